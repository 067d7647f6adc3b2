//! Reads the Prometheus text exposition format (what Envoy's `/stats/prometheus` serves) into
//! samples, and answers the two questions tests ask: "what is this counter/gauge" and "what does
//! this histogram hold", for the series whose labels include a given subset.
//!
//! Note on Envoy histograms: `/stats/prometheus` shows them as of the last stats flush (every
//! `stats_flush_interval`, 5 s by default), so configs for tests set a short interval and tests
//! poll with [`crate::wait_until`].

use anyhow::{anyhow, bail, Result};
use std::collections::BTreeMap;

/// One line of exposition: `name{labels} value`.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

impl Sample {
    /// True when every `(key, value)` of `subset` is among this sample's labels.
    pub fn has_labels(&self, subset: &[(&str, &str)]) -> bool {
        subset.iter().all(|(k, v)| self.labels.get(*k).is_some_and(|have| have == v))
    }
}

/// A histogram merged over the matching series: bucket bounds with cumulative counts.
#[derive(Debug, Clone, PartialEq)]
pub struct Histogram {
    pub count: u64,
    pub sum: f64,
    /// `(le, cumulative count)`, ascending; the last bound is `f64::INFINITY`.
    pub buckets: Vec<(f64, u64)>,
}

impl Histogram {
    /// Cumulative count of observations `<= le` (for a bound that is one of the buckets).
    pub fn cumulative(&self, le: f64) -> Option<u64> {
        self.buckets.iter().find(|(b, _)| *b == le).map(|(_, c)| *c)
    }

    /// Observations that fell in `(lo, hi]`, both being bucket bounds.
    pub fn count_between(&self, lo: f64, hi: f64) -> Option<u64> {
        Some(self.cumulative(hi)?.saturating_sub(self.cumulative(lo)?))
    }
}

/// All samples of one scrape.
#[derive(Debug, Clone, Default)]
pub struct Metrics {
    pub samples: Vec<Sample>,
}

impl Metrics {
    /// Parses exposition text. `# HELP` / `# TYPE` and other comments are skipped.
    pub fn parse(text: &str) -> Result<Metrics> {
        let mut samples = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            samples.push(parse_sample(line).map_err(|e| anyhow!("line {}: {e}: {line:?}", i + 1))?);
        }
        Ok(Metrics { samples })
    }

    /// Samples named exactly `name`.
    pub fn series<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a Sample> + 'a {
        self.samples.iter().filter(move |s| s.name == name)
    }

    /// The value of `name` summed over every series whose labels include `labels` (sum, because
    /// "requests for tenant acme" may span several other label values). `None` if no series
    /// matches.
    pub fn value(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let mut matched = self.series(name).filter(|s| s.has_labels(labels)).peekable();
        matched.peek()?;
        Some(matched.map(|s| s.value).sum())
    }

    /// The histogram `name` (from `name_bucket`, `name_sum`, `name_count`), merged over every
    /// series whose labels include `labels`. `None` if no series matches.
    pub fn histogram(&self, name: &str, labels: &[(&str, &str)]) -> Option<Histogram> {
        let bucket_name = format!("{name}_bucket");
        let mut buckets: Vec<(f64, u64)> = Vec::new();
        for s in self.series(&bucket_name).filter(|s| s.has_labels(labels)) {
            let Some(le) = s.labels.get("le").and_then(|v| parse_value(v).ok()) else {
                continue;
            };
            let n = to_count(s.value);
            match buckets.iter_mut().find(|(b, _)| *b == le) {
                Some((_, c)) => *c += n,
                None => buckets.push((le, n)),
            }
        }
        let count_name = format!("{name}_count");
        let count = self.value(&count_name, labels);
        if buckets.is_empty() && count.is_none() {
            return None;
        }
        buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        Some(Histogram { count: count.map_or(0, to_count), sum: self.value(&format!("{name}_sum"), labels).unwrap_or(0.0), buckets })
    }

    /// Distinct sample names, sorted (handy in failure messages: "what is there instead?").
    pub fn names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self.samples.iter().map(|s| s.name.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        names
    }
}

/// Counts are exposed as floats; they are whole numbers, so rounding is exact.
fn to_count(v: f64) -> u64 {
    if v.is_finite() && v > 0.0 {
        v.round() as u64
    } else {
        0
    }
}

fn parse_value(v: &str) -> Result<f64> {
    match v {
        "+Inf" | "Inf" => Ok(f64::INFINITY),
        "-Inf" => Ok(f64::NEG_INFINITY),
        "NaN" => Ok(f64::NAN),
        _ => v.parse().map_err(|_| anyhow!("bad value {v:?}")),
    }
}

fn parse_sample(line: &str) -> Result<Sample> {
    let name_end = line.find(|c: char| c == '{' || c.is_whitespace()).ok_or_else(|| anyhow!("no value"))?;
    let (name, mut rest) = line.split_at(name_end);
    if name.is_empty() {
        bail!("empty metric name");
    }
    let mut labels = BTreeMap::new();
    if let Some(after_brace) = rest.strip_prefix('{') {
        let (parsed, after) = parse_labels(after_brace)?;
        labels = parsed;
        rest = after;
    }
    // Value, then an optional timestamp.
    let value = rest.split_whitespace().next().ok_or_else(|| anyhow!("no value"))?;
    Ok(Sample { name: name.to_string(), labels, value: parse_value(value)? })
}

/// Parses `k="v",k2="v2"}` (after the opening brace); returns the labels and the text after `}`.
fn parse_labels(s: &str) -> Result<(BTreeMap<String, String>, &str)> {
    let mut labels = BTreeMap::new();
    let mut rest = s;
    loop {
        rest = rest.trim_start();
        if let Some(after) = rest.strip_prefix('}') {
            return Ok((labels, after));
        }
        let eq = rest.find('=').ok_or_else(|| anyhow!("label without '='"))?;
        let key = rest.get(..eq).unwrap_or("").trim().to_string();
        rest = rest.get(eq + 1..).unwrap_or("").trim_start();
        rest = rest.strip_prefix('"').ok_or_else(|| anyhow!("label value not quoted"))?;
        let mut value = String::new();
        let mut chars = rest.char_indices();
        let end = loop {
            match chars.next() {
                Some((i, '"')) => break i,
                Some((_, '\\')) => match chars.next() {
                    Some((_, 'n')) => value.push('\n'),
                    Some((_, c)) => value.push(c),
                    None => bail!("unterminated label value"),
                },
                Some((_, c)) => value.push(c),
                None => bail!("unterminated label value"),
            }
        };
        labels.insert(key, value);
        rest = rest.get(end + 1..).unwrap_or("").trim_start();
        rest = rest.strip_prefix(',').unwrap_or(rest);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn escapes_in_label_values() {
        let m = Metrics::parse(r#"x{a="q\"uo\\te\n",b="}"} 3 1700000000"#).unwrap();
        let s = &m.samples[..];
        assert_eq!(s.len(), 1);
        assert_eq!(s.first().unwrap().labels.get("a").unwrap(), "q\"uo\\te\n");
        assert_eq!(s.first().unwrap().labels.get("b").unwrap(), "}");
        assert_eq!(s.first().unwrap().value, 3.0);
    }

    #[test]
    fn malformed_lines_are_errors() {
        for bad in ["x{a=\"1\"", "x{a=1} 2", "x", "x notanumber", "{a=\"1\"} 2"] {
            assert!(Metrics::parse(bad).is_err(), "{bad}");
        }
    }
}
