//! The HTML pages: one file each, inline CSS and SVG, no script, well-formed XHTML (every tag
//! closed, attributes quoted, data escaped), so it opens offline and parses as XML.

use super::compare::{Comparison, Side};
use super::stats::{cost, decode_tokens_per_s, tenant_name, usd_per_mtok, Latency, Summary};
use super::svg::{self, esc, w, Band, Line, Series, OTHER_COLOR};
use super::{ReportInput, Source};
use crate::verdict::{Decision, Sample, Verdict};
use std::collections::{BTreeSet, HashMap};
use std::fmt::Write as _;

/// Differing requests listed on the comparison page; the rest are counted.
pub const MAX_LISTED_DIFFERENCES: usize = 1000;

/// Series drawn per chart; the rest are summed as "other".
const TOP_SERIES: usize = 12;
/// Time buckets of the charts over time.
const TIME_BUCKETS: usize = 60;
/// Points drawn in the scatter and per line; more are thinned evenly.
const MAX_POINTS: usize = 5000;
const MAX_LINE_POINTS: usize = 600;
/// Rows of the long tables (transitions, refusal codes).
const MAX_ROWS: usize = 500;

const STYLE: &str = "body{font:14px/1.45 system-ui,-apple-system,'Segoe UI',Roboto,sans-serif;margin:24px auto;max-width:1100px;color:#222;padding:0 16px}\
h1{font-size:22px;margin-bottom:4px}h2{font-size:18px;border-bottom:1px solid #ddd;padding-bottom:4px;margin-top:36px}h3{font-size:15px;margin:18px 0 6px}\
table{border-collapse:collapse;margin:8px 0 16px}th,td{border:1px solid #ddd;padding:3px 8px;vertical-align:top}th{background:#f5f5f5;text-align:left}\
td.n{text-align:right;font-variant-numeric:tabular-nums}.meta{color:#555;margin-top:0}.empty{color:#666;font-style:italic}\
ul.legend{list-style:none;padding:0;margin:4px 0 14px;display:flex;flex-wrap:wrap;gap:4px 16px}\
.swatch{display:inline-block;width:12px;height:12px;margin-right:6px;vertical-align:middle;border-radius:2px}\
svg{max-width:100%;height:auto;display:block}svg text{font:11px sans-serif;fill:#333}";

/// A table cell: text (left) or a number (right-aligned).
enum Cell {
    T(String),
    N(String),
}

fn t(s: impl Into<String>) -> Cell {
    Cell::T(s.into())
}

fn n(s: impl Into<String>) -> Cell {
    Cell::N(s.into())
}

fn table(out: &mut String, headers: &[&str], rows: impl IntoIterator<Item = Vec<Cell>>) {
    out.push_str("<table><thead><tr>");
    for h in headers {
        w!(out, "<th>{}</th>", esc(h));
    }
    out.push_str("</tr></thead><tbody>");
    for row in rows {
        out.push_str("<tr>");
        for cell in row {
            match cell {
                Cell::T(s) => w!(out, "<td>{}</td>", esc(&s)),
                Cell::N(s) => w!(out, r#"<td class="n">{}</td>"#, esc(&s)),
            }
        }
        out.push_str("</tr>");
    }
    out.push_str("</tbody></table>");
}

fn empty(out: &mut String, sentence: &str) {
    w!(out, r#"<p class="empty">{}</p>"#, esc(sentence));
}

fn note(out: &mut String, sentence: &str) {
    w!(out, "<p>{}</p>", esc(sentence));
}

fn heading(out: &mut String, id: &str, text: &str) {
    w!(out, r#"<h2 id="{id}">{}</h2>"#, esc(text));
}

/// 12345 → "12,345".
fn int(v: u64) -> String {
    let digits = v.to_string();
    let groups: Vec<&str> = digits.as_bytes().rchunks(3).rev().map(|g| std::str::from_utf8(g).unwrap_or_default()).collect();
    groups.join(",")
}

fn ms(v: Option<f64>) -> String {
    v.filter(|x| x.is_finite()).map_or_else(|| "-".into(), |x| format!("{x:.1}"))
}

fn pct(v: Option<f64>) -> String {
    v.filter(|x| x.is_finite()).map_or_else(|| "-".into(), |x| format!("{:.2}%", x * 100.0))
}

fn usd(v: f64) -> String {
    if v.abs() >= 100.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.6}")
    }
}

fn opt_usd(v: Option<f64>) -> String {
    v.filter(|x| x.is_finite()).map_or_else(|| "-".into(), usd)
}

fn opt_num(v: Option<f64>) -> String {
    v.filter(|x| x.is_finite()).map_or_else(|| "-".into(), |x| format!("{x:.1}"))
}

fn share(part: u64, whole: u64) -> String {
    if whole == 0 {
        "-".into()
    } else {
        format!("{:.2}%", part as f64 * 100.0 / whole as f64)
    }
}

fn opt(s: &Option<String>) -> String {
    s.clone().unwrap_or_else(|| "-".into())
}

/// Names ranked by volume: the first [`TOP_SERIES`] get their own series, the rest are "other".
struct Ranked {
    names: Vec<String>,
    slots: HashMap<String, usize>,
    other: bool,
}

impl Ranked {
    fn new<'a>(volumes: impl IntoIterator<Item = (&'a str, f64)>) -> Ranked {
        let mut total: HashMap<&str, f64> = HashMap::new();
        for (name, v) in volumes {
            *total.entry(name).or_insert(0.0) += v;
        }
        let mut ranked: Vec<(&str, f64)> = total.into_iter().collect();
        ranked.sort_by(|a, b| b.1.total_cmp(&a.1).then_with(|| a.0.cmp(b.0)));
        let mut names = Vec::new();
        let mut other = false;
        for (name, _) in ranked {
            // A name "other" already (llm-metrics' overflow label) joins the summed rest.
            if names.len() < TOP_SERIES && name != "other" {
                names.push(name.to_string());
            } else {
                other = true;
            }
        }
        let slots = names.iter().enumerate().map(|(i, name)| (name.clone(), i)).collect();
        Ranked { names, slots, other }
    }
    fn slot(&self, name: &str) -> usize {
        self.slots.get(name).copied().unwrap_or(self.names.len())
    }
    fn len(&self) -> usize {
        self.names.len() + usize::from(self.other)
    }
    fn name(&self, i: usize) -> &str {
        self.names.get(i).map_or("other", String::as_str)
    }
    fn color(&self, i: usize) -> &'static str {
        if i < self.names.len() {
            svg::color(i)
        } else {
            OTHER_COLOR
        }
    }
    /// Empty series, one per slot, of `len` values.
    fn series(&self, len: usize) -> Vec<Series> {
        (0..self.len()).map(|i| Series { name: self.name(i).to_string(), color: self.color(i), values: vec![None; len] }).collect()
    }
}

/// Adds `v` to slot `s`, bucket `b`.
fn add(series: &mut [Series], s: usize, b: usize, v: f64) {
    if let Some(cell) = series.get_mut(s).and_then(|s| s.values.get_mut(b)) {
        *cell = Some(cell.unwrap_or(0.0) + v);
    }
}

/// Equal time buckets over the arrivals.
struct Grid {
    t0: f64,
    t1: f64,
    n: usize,
}

impl Grid {
    fn over(times: impl IntoIterator<Item = f64>) -> Option<Grid> {
        let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
        for t in times.into_iter().filter(|t| t.is_finite()) {
            lo = lo.min(t);
            hi = hi.max(t);
        }
        (lo <= hi).then_some(Grid { t0: lo, t1: hi, n: if hi > lo { TIME_BUCKETS } else { 1 } })
    }
    fn index(&self, t: f64) -> usize {
        if self.t1 <= self.t0 || !t.is_finite() {
            return 0;
        }
        let f = ((t - self.t0) / (self.t1 - self.t0)).clamp(0.0, 1.0);
        ((f * self.n as f64).floor() as usize).min(self.n - 1)
    }
    fn end(&self, i: usize) -> f64 {
        self.t0 + (self.t1 - self.t0) * (i + 1) as f64 / self.n as f64
    }
    /// The range a chart shows (never zero wide).
    fn range(&self) -> (f64, f64) {
        if self.t1 > self.t0 {
            (self.t0, self.t1)
        } else {
            (self.t0, self.t0 + 1000.0)
        }
    }
    fn bucket_text(&self) -> String {
        let (unit, name) = svg::time_unit(self.t1 - self.t0);
        format!("{} buckets of {} {name}", self.n, svg::fmt_num((self.t1 - self.t0) / self.n as f64 / unit))
    }
}

/// Every `k`-th item so that at most `max` remain.
fn thin<T>(items: Vec<T>, max: usize) -> Vec<T> {
    let stride = items.len().div_ceil(max.max(1)).max(1);
    items.into_iter().step_by(stride).collect()
}

fn page_head(out: &mut String, title: &str, subtitle: &str) {
    out.push_str("<!DOCTYPE html>\n");
    w!(
        out,
        r#"<html xmlns="http://www.w3.org/1999/xhtml" lang="en"><head><meta charset="utf-8"/><meta name="viewport" content="width=device-width, initial-scale=1"/>"#
    );
    w!(out, "<title>{}</title><style>{STYLE}</style></head><body>", esc(title));
    w!(out, r#"<h1>{}</h1><p class="meta">{}</p>"#, esc(title), esc(subtitle));
}

fn page_foot(out: &mut String) {
    out.push_str("</body></html>\n");
}

/// The report of one verdict set: sections (a)–(j) of docs/simulator.md ("Reports").
pub fn render_html(input: &ReportInput, summary: &Summary) -> String {
    let mut out = String::with_capacity(1 << 16);
    let subtitle = match input.source {
        Source::Simulated => "Simulated: what the policies would have done to this trace (sluice-sim).",
        Source::Observed => "Observed: what a gateway did, read from its access log (sluice-sim).",
    };
    page_head(&mut out, input.title, subtitle);
    let grid = Grid::over(input.verdicts.iter().map(|v| v.arrival_ms));
    // One colour per version in every chart: the versions with most requests first.
    let versions = Ranked::new(summary.versions.iter().map(|v| (v.version.as_str(), v.requests as f64)));
    headline(&mut out, summary);
    ttft(&mut out, summary, &versions);
    decode(&mut out, input.verdicts, &versions);
    spend(&mut out, input, summary, grid.as_ref());
    refusals(&mut out, input.verdicts, summary, grid.as_ref());
    breakers(&mut out, input);
    split(&mut out, input.verdicts, grid.as_ref(), &versions);
    turns(&mut out, summary);
    shadows(&mut out, summary);
    quality(&mut out, summary, input.source);
    page_foot(&mut out);
    out
}

fn headline(out: &mut String, s: &Summary) {
    heading(out, "headline", "Headline");
    let d = &s.decisions;
    let span = match (s.first_arrival_ms, s.last_arrival_ms) {
        (Some(a), Some(b)) => format!("{:.3} s", (b - a) / 1000.0),
        _ => "-".into(),
    };
    let source = match s.source {
        Source::Simulated => "simulated",
        Source::Observed => "observed (access log)",
    };
    table(
        out,
        &["Measure", "Value"],
        [
            vec![t("Source"), t(source)],
            vec![t("Requests"), n(int(s.requests))],
            vec![t("Admitted"), n(format!("{} ({})", int(d.admitted), share(d.admitted, s.requests)))],
            vec![t("Clamped"), n(format!("{} ({})", int(d.clamped), share(d.clamped, s.requests)))],
            vec![t("Refused"), n(format!("{} ({})", int(d.refused), share(d.refused, s.requests)))],
            vec![t("Availability (admitted and completed)"), n(pct(s.availability))],
            vec![t("Spend (USD)"), n(usd(s.spend_usd))],
            vec![t("Tokens in / out"), n(format!("{} / {}", int(s.input_tokens), int(s.output_tokens)))],
            vec![t("USD per million tokens"), n(opt_usd(s.usd_per_mtok))],
            vec![t("Arrivals span"), n(span)],
            vec![t("Requests without a model version"), n(int(s.unrouted))],
        ],
    );
    w!(out, "<h3>Per model version</h3>");
    if s.versions.is_empty() {
        empty(out, "No request has a model version.");
        return;
    }
    table(
        out,
        &[
            "Version",
            "Requests",
            "Admitted",
            "Availability",
            "TTFT p50 (ms)",
            "TTFT p99 (ms)",
            "TPOT p50 (ms)",
            "TPOT p99 (ms)",
            "Decode tok/s p50",
            "Tokens in",
            "Tokens out",
            "Cost (USD)",
            "USD/MTok",
        ],
        s.versions.iter().map(|v| {
            vec![
                t(v.version.as_str()),
                n(int(v.requests)),
                n(int(v.admitted)),
                n(pct(v.availability)),
                n(ms(v.ttft.p50_ms)),
                n(ms(v.ttft.p99_ms)),
                n(ms(v.tpot.p50_ms)),
                n(ms(v.tpot.p99_ms)),
                n(opt_num(v.decode_tokens_per_s_p50)),
                n(int(v.input_tokens)),
                n(int(v.output_tokens)),
                n(usd(v.cost_usd)),
                n(opt_usd(v.usd_per_mtok)),
            ]
        }),
    );
}

fn ttft(out: &mut String, s: &Summary, ranked: &Ranked) {
    heading(out, "ttft", "Time to first token");
    if s.versions.iter().all(|v| v.ttft.samples == 0) {
        empty(out, "No request has a time to first token (none was streamed to its first token), so there is nothing to chart.");
        return;
    }
    let shown: Vec<&super::stats::VersionSummary> = s.versions.iter().filter(|v| ranked.slots.contains_key(&v.version)).collect();
    w!(out, "<h3>Per model version</h3>");
    let categories: Vec<String> = shown.iter().map(|v| v.version.clone()).collect();
    let series = vec![
        Series { name: "p50".into(), color: svg::P50_COLOR, values: shown.iter().map(|v| v.ttft.p50_ms).collect() },
        Series { name: "p99".into(), color: svg::P99_COLOR, values: shown.iter().map(|v| v.ttft.p99_ms).collect() },
    ];
    out.push_str(&svg::grouped_bars("TTFT p50 and p99 per model version", &categories, &series, "TTFT (ms)"));
    out.push_str(&svg::series_legend(&series));
    if ranked.other {
        note(out, &format!("The {TOP_SERIES} versions with most requests are drawn; the table above lists all."));
    }

    w!(out, "<h3>Per context bucket (prompt tokens)</h3>");
    let buckets: Vec<String> = s.context.iter().map(|c| c.bucket.clone()).collect();
    for (label, pick) in [("p50", (|l: &Latency| l.p50_ms) as fn(&Latency) -> Option<f64>), ("p99", |l: &Latency| l.p99_ms)] {
        let series: Vec<Series> = shown
            .iter()
            .map(|v| Series {
                name: v.version.clone(),
                color: ranked.color(ranked.slot(&v.version)),
                values: s.context.iter().map(|c| c.versions.iter().find(|b| b.version == v.version).and_then(|b| pick(&b.ttft))).collect(),
            })
            .collect();
        out.push_str(&svg::grouped_bars(&format!("TTFT {label} per context bucket and version"), &buckets, &series, &format!("TTFT {label} (ms)")));
        out.push_str(&svg::series_legend(&series));
    }
    table(
        out,
        &["Context", "Version", "Requests", "TTFT samples", "TTFT p50 (ms)", "TTFT p99 (ms)"],
        s.context.iter().flat_map(|c| {
            c.versions.iter().map(|b| {
                vec![t(c.bucket.as_str()), t(b.version.as_str()), n(int(b.requests)), n(int(b.ttft.samples)), n(ms(b.ttft.p50_ms)), n(ms(b.ttft.p99_ms))]
            })
        }),
    );
}

fn decode(out: &mut String, verdicts: &[Verdict], ranked: &Ranked) {
    heading(out, "decode", "Decode speed against upstream concurrency");
    let speeds: Vec<(&Verdict, f64)> = verdicts.iter().filter_map(|v| decode_tokens_per_s(v).map(|s| (v, s))).collect();
    if speeds.is_empty() {
        empty(out, "No decode speed recorded: no streamed response had more than one output token.");
        return;
    }
    let points: Vec<(&Verdict, f64, f64)> = speeds.iter().filter_map(|(v, s)| v.upstream_concurrency.map(|c| (*v, f64::from(c), *s))).collect();
    if points.is_empty() {
        empty(out, "No concurrency recorded: upstream concurrency is known only in a simulation, so decode speed cannot be set against it.");
        return;
    }
    let total = points.len();
    // Requests without a version are drawn grey, after the slots of the ranked versions.
    let slot = |v: &Verdict| v.version.as_deref().map_or(ranked.len(), |name| ranked.slot(name));
    let drawn_versions: BTreeSet<usize> = points.iter().map(|(v, _, _)| slot(v)).collect();
    let drawn: Vec<(f64, f64, &str)> = thin(points, MAX_POINTS).into_iter().map(|(v, c, s)| (c, s, ranked.color(slot(v)))).collect();
    out.push_str(&svg::scatter(
        "Decode tokens/s per request against requests in flight upstream",
        &drawn,
        "requests in flight at the version when sent",
        "decode tokens/s",
    ));
    let mut drawn_slots: Vec<usize> = drawn_versions.into_iter().collect();
    drawn_slots.sort_unstable();
    out.push_str(&svg::legend(drawn_slots.into_iter().map(|i| if i < ranked.len() { (ranked.name(i), ranked.color(i)) } else { ("no version", OTHER_COLOR) })));
    if drawn.len() < total {
        note(out, &format!("{} of {} requests drawn, evenly spaced in arrival order.", drawn.len(), total));
    }
}

fn spend(out: &mut String, input: &ReportInput, s: &Summary, grid: Option<&Grid>) {
    heading(out, "spend", "Spend per tenant");
    if s.tenants.is_empty() {
        empty(out, "No requests.");
        return;
    }
    // Table: the tenants with most requests, the rest summed.
    let mut rows: Vec<Vec<Cell>> = Vec::new();
    let (mut rest, mut rest_req, mut rest_ref, mut rest_tok, mut rest_usd) = (0usize, 0u64, 0u64, 0u64, 0.0f64);
    for (i, tn) in s.tenants.iter().enumerate() {
        if i < TOP_SERIES {
            rows.push(vec![
                t(tn.tenant.as_str()),
                n(int(tn.requests)),
                n(int(tn.refused)),
                n(int(tn.tokens)),
                n(usd(tn.spend_usd)),
                n(opt_usd(tn.usd_per_mtok)),
            ]);
        } else {
            rest += 1;
            rest_req += tn.requests;
            rest_ref += tn.refused;
            rest_tok += tn.tokens;
            rest_usd += tn.spend_usd;
        }
    }
    if rest > 0 {
        rows.push(vec![
            t(format!("other ({rest} tenants)")),
            n(int(rest_req)),
            n(int(rest_ref)),
            n(int(rest_tok)),
            n(usd(rest_usd)),
            n(opt_usd(usd_per_mtok(rest_usd, rest_tok))),
        ]);
    }
    table(out, &["Tenant", "Requests", "Refused", "Tokens", "Spend (USD)", "USD/MTok"], rows);

    w!(out, "<h3>Cumulative spend over time</h3>");
    match grid {
        Some(grid) if s.spend_usd > 0.0 => {
            let ranked = Ranked::new(input.verdicts.iter().map(|v| (tenant_name(v), cost(v))));
            let mut series = ranked.series(grid.n);
            for v in input.verdicts {
                add(&mut series, ranked.slot(tenant_name(v)), grid.index(v.arrival_ms), cost(v));
            }
            let lines: Vec<Line> = series
                .into_iter()
                .map(|s| {
                    let mut sum = 0.0;
                    let mut points = vec![(grid.t0, 0.0)];
                    for (i, v) in s.values.iter().enumerate() {
                        sum += v.unwrap_or(0.0);
                        points.push((grid.end(i), sum));
                    }
                    Line { name: s.name, color: s.color, points }
                })
                .collect();
            let (t0, t1) = grid.range();
            out.push_str(&svg::lines("Cumulative spend per tenant", t0, t1, &lines, "spend (USD)", true));
            out.push_str(&svg::legend(lines.iter().map(|l| (l.name.as_str(), l.color))));
        }
        _ => empty(out, "No spend recorded: no request matched a price."),
    }

    w!(out, "<h3>Budgets remaining over time</h3>");
    budgets(out, input.samples);
}

fn budgets(out: &mut String, samples: &[Sample]) {
    if samples.is_empty() {
        empty(out, "No samples: budgets remaining are sampled only in a simulation.");
        return;
    }
    // The codes that came closest to running out get a line of their own.
    let mut lowest: HashMap<&str, i64> = HashMap::new();
    for s in samples {
        for (code, left) in &s.budgets_remaining {
            let e = lowest.entry(code.as_str()).or_insert(*left);
            *e = (*e).min(*left);
        }
    }
    if lowest.is_empty() {
        empty(out, "No budget was sampled.");
        return;
    }
    let mut codes: Vec<(&str, i64)> = lowest.into_iter().collect();
    codes.sort_by(|a, b| a.1.cmp(&b.1).then_with(|| a.0.cmp(b.0)));
    let hidden = codes.len().saturating_sub(TOP_SERIES);
    codes.truncate(TOP_SERIES);
    let mut order: Vec<&Sample> = samples.iter().collect();
    order.sort_by(|a, b| a.t_ms.total_cmp(&b.t_ms));
    let order = thin(order, MAX_LINE_POINTS);
    let lines: Vec<Line> = codes
        .iter()
        .enumerate()
        .map(|(i, (code, _))| Line {
            name: (*code).to_string(),
            color: svg::color(i),
            points: order.iter().filter_map(|s| s.budgets_remaining.iter().find(|(c, _)| c == code).map(|(_, left)| (s.t_ms, *left as f64))).collect(),
        })
        .collect();
    let Some(grid) = Grid::over(order.iter().map(|s| s.t_ms)) else {
        empty(out, "No budget was sampled.");
        return;
    };
    let (t0, t1) = grid.range();
    out.push_str(&svg::lines("Budgets remaining per budget code", t0, t1, &lines, "remaining (budget's own unit)", true));
    out.push_str(&svg::legend(lines.iter().map(|l| (l.name.as_str(), l.color))));
    if hidden > 0 {
        note(out, &format!("The {TOP_SERIES} budgets that came closest to running out are drawn; {hidden} more are not."));
    }
}

fn refusals(out: &mut String, verdicts: &[Verdict], s: &Summary, grid: Option<&Grid>) {
    heading(out, "refusals", "Refusals over time");
    let Some(grid) = grid.filter(|_| s.decisions.refused > 0) else {
        empty(out, "No request was refused.");
        return;
    };
    let code = |v: &Verdict| v.code.as_deref().unwrap_or("-").to_string();
    let refused = || verdicts.iter().filter(|v| v.decision == Decision::Refused);
    let codes: Vec<String> = refused().map(code).collect();
    let ranked = Ranked::new(codes.iter().map(|c| (c.as_str(), 1.0)));
    let mut series = ranked.series(grid.n);
    for (v, c) in refused().zip(&codes) {
        add(&mut series, ranked.slot(c), grid.index(v.arrival_ms), 1.0);
    }
    let (t0, t1) = grid.range();
    out.push_str(&svg::stacked_bars(
        &format!("Refused requests per time bucket by reason ({})", grid.bucket_text()),
        t0,
        t1,
        &series,
        "refused requests",
        false,
    ));
    out.push_str(&svg::series_legend(&series));
    let mut by_code: Vec<(&String, &u64)> = s.refusals_by_code.iter().collect();
    by_code.sort_by(|a, b| b.1.cmp(a.1).then_with(|| a.0.cmp(b.0)));
    let listed = by_code.len().min(MAX_ROWS);
    table(out, &["Code", "Refused"], by_code.iter().take(MAX_ROWS).map(|(c, k)| vec![t(c.as_str()), n(int(**k))]));
    if listed < by_code.len() {
        note(out, &format!("{listed} of {} codes listed.", by_code.len()));
    }
    table(out, &["Refused by", "Refused"], s.refusals_by_plugin.iter().map(|(p, k)| vec![t(p.as_str()), n(int(*k))]));
}

fn state_color(state: &str) -> (&'static str, &'static str) {
    match state {
        "closed" => ("#43a047", "closed"),
        "half_open" => ("#ffb300", "half_open"),
        "open" => ("#e53935", "open"),
        _ => (OTHER_COLOR, "unknown"),
    }
}

fn breakers(out: &mut String, input: &ReportInput) {
    heading(out, "breakers", "Breaker state per version");
    let mut order: Vec<&Sample> = input.samples.iter().filter(|s| s.t_ms.is_finite()).collect();
    order.sort_by(|a, b| a.t_ms.total_cmp(&b.t_ms));
    let versions: BTreeSet<&str> = order.iter().flat_map(|s| s.breakers.iter().map(|(v, _)| v.as_str())).collect();
    if order.is_empty() {
        empty(out, "No samples: breaker state is sampled only in a simulation.");
    } else if versions.is_empty() {
        empty(out, "No breaker was sampled (no latency-guard policy in this scenario).");
    } else if let Some(grid) = Grid::over(order.iter().map(|s| s.t_ms)) {
        let (t0, t1) = grid.range();
        let rows: Vec<Band> = versions
            .iter()
            .take(TOP_SERIES)
            .map(|version| {
                let mut spans: Vec<(f64, f64, &'static str, &'static str)> = Vec::new();
                let mut prev_t: Option<f64> = None;
                for (i, s) in order.iter().enumerate() {
                    // A sampled state holds until the next sample; the last one for one more step.
                    let next = order.get(i + 1).map(|n| n.t_ms).unwrap_or_else(|| s.t_ms + prev_t.map_or(0.0, |p| s.t_ms - p)).min(t1);
                    prev_t = Some(s.t_ms);
                    let Some((_, state)) = s.breakers.iter().find(|(v, _)| v == version) else { continue };
                    let (colour, what) = state_color(state);
                    match spans.last_mut() {
                        Some(last) if last.2 == colour && last.1 >= s.t_ms => last.1 = next,
                        _ => spans.push((s.t_ms, next, colour, what)),
                    }
                }
                Band { name: (*version).to_string(), spans }
            })
            .collect();
        out.push_str(&svg::bands("Breaker state per version over time", t0, t1, &rows));
        out.push_str(&svg::legend(["closed", "half_open", "open"].iter().map(|s| (*s, state_color(s).0))));
        if versions.len() > TOP_SERIES {
            note(out, &format!("The first {TOP_SERIES} of {} versions by name are drawn.", versions.len()));
        }
    }
    w!(out, "<h3>Transitions</h3>");
    if input.transitions.is_empty() {
        empty(out, "No breaker transitions.");
        return;
    }
    table(
        out,
        &["Time (s)", "Version", "From", "To"],
        input
            .transitions
            .iter()
            .take(MAX_ROWS)
            .map(|tr| vec![n(format!("{:.3}", tr.t_ms / 1000.0)), t(tr.version.as_str()), t(tr.from.as_str()), t(tr.to.as_str())]),
    );
    if input.transitions.len() > MAX_ROWS {
        note(out, &format!("The first {MAX_ROWS} of {} transitions are listed.", input.transitions.len()));
    }
}

fn split(out: &mut String, verdicts: &[Verdict], grid: Option<&Grid>, ranked: &Ranked) {
    heading(out, "split", "Traffic split");
    let routed = || verdicts.iter().filter_map(|v| v.version.as_deref().map(|name| (v, name)));
    let Some(grid) = grid.filter(|_| routed().next().is_some()) else {
        empty(out, "No request has a model version, so there is no traffic split.");
        return;
    };
    let mut series = ranked.series(grid.n);
    for (v, name) in routed() {
        add(&mut series, ranked.slot(name), grid.index(v.arrival_ms), 1.0);
    }
    let (t0, t1) = grid.range();
    out.push_str(&svg::stacked_bars(&format!("Share of requests per model version ({})", grid.bucket_text()), t0, t1, &series, "share of requests", true));
    out.push_str(&svg::series_legend(&series));
    note(out, "Requests without a model version are not counted here.");
}

fn turns(out: &mut String, s: &Summary) {
    heading(out, "turns", "First turn and follow-up");
    let tu = &s.turns;
    if tu.first_requests + tu.follow_up_requests == 0 {
        empty(out, "No request has a turn label.");
        return;
    }
    table(
        out,
        &["Turn", "Requests", "TTFT samples", "TTFT p50 (ms)", "TTFT p99 (ms)"],
        [
            vec![t("first"), n(int(tu.first_requests)), n(int(tu.first_ttft.samples)), n(ms(tu.first_ttft.p50_ms)), n(ms(tu.first_ttft.p99_ms))],
            vec![
                t("follow-up"),
                n(int(tu.follow_up_requests)),
                n(int(tu.follow_up_ttft.samples)),
                n(ms(tu.follow_up_ttft.p50_ms)),
                n(ms(tu.follow_up_ttft.p99_ms)),
            ],
        ],
    );
    if tu.first_ttft.samples + tu.follow_up_ttft.samples == 0 {
        empty(out, "No turn has a time to first token to chart.");
        return;
    }
    let categories = vec!["first".to_string(), "follow-up".to_string()];
    let series = vec![
        Series { name: "p50".into(), color: svg::P50_COLOR, values: vec![tu.first_ttft.p50_ms, tu.follow_up_ttft.p50_ms] },
        Series { name: "p99".into(), color: svg::P99_COLOR, values: vec![tu.first_ttft.p99_ms, tu.follow_up_ttft.p99_ms] },
    ];
    out.push_str(&svg::grouped_bars("TTFT of first turns and follow-ups", &categories, &series, "TTFT (ms)"));
    out.push_str(&svg::series_legend(&series));
}

fn shadows(out: &mut String, s: &Summary) {
    heading(out, "shadow", "Shadow traffic");
    if s.shadows.is_empty() {
        empty(out, "No request was shadowed.");
        return;
    }
    table(
        out,
        &["Shadow version", "Shadowed", "Share of requests", "By primary version"],
        s.shadows.iter().map(|sh| {
            let by: Vec<String> = sh.by_primary.iter().map(|(p, k)| format!("{p}: {}", int(*k))).collect();
            vec![t(sh.version.as_str()), n(int(sh.shadowed)), n(share(sh.shadowed, s.requests)), t(by.join(", "))]
        }),
    );
}

fn quality(out: &mut String, s: &Summary, source: Source) {
    heading(out, "quality", "Output quality");
    if s.quality.is_empty() {
        empty(out, "No whole answer was judged: llm-metrics judges answers with a 2xx status and outcome completed, and only its stamp carries the figures.");
        return;
    }
    table(
        out,
        &[
            "Version (llm-metrics)",
            "Answers judged",
            "Output tokens mean",
            "Output tokens p50",
            "Output tokens p95",
            "Answers with a repetition figure",
            "Repetition mean (‰)",
            "Empty",
            "Truncated",
        ],
        s.quality.iter().map(|q| {
            vec![
                t(q.version.as_str()),
                n(int(q.answers)),
                n(opt_num(q.output_tokens_mean)),
                n(opt_num(q.output_tokens_p50)),
                n(opt_num(q.output_tokens_p95)),
                n(int(q.repetition_answers)),
                n(opt_num(q.repetition_mean_per_mille)),
                n(format!("{} ({})", int(q.empty), pct(q.empty_share))),
                n(format!("{} ({})", int(q.truncated), pct(q.truncated_share))),
            ]
        }),
    );
    note(
        out,
        "Whole answers only (status 2xx, outcome completed), grouped by llm-metrics' model_version label: the requests sluice_quality_* counts. \
         Repetition is the share of an answer's word trigrams that repeat an earlier one, for answers of at least 10 trigrams; \
         empty answers had no content event; truncated ones finished at the token limit.",
    );
    if source == Source::Simulated {
        note(
            out,
            "Simulated answers are the mock's text, distinct words (tok0 tok1 …): repetition near 0 ‰ and no empty answer show the mock, not a model. \
             Output length is the trace's, cut by the output limit the request carried (a cut answer is truncated).",
        );
    }
    let categories: Vec<String> = s.quality.iter().take(TOP_SERIES).map(|q| q.version.clone()).collect();
    let series = vec![
        Series { name: "p50".into(), color: svg::P50_COLOR, values: s.quality.iter().take(TOP_SERIES).map(|q| q.output_tokens_p50).collect() },
        Series { name: "p95".into(), color: svg::P99_COLOR, values: s.quality.iter().take(TOP_SERIES).map(|q| q.output_tokens_p95).collect() },
    ];
    out.push_str(&svg::grouped_bars("Output tokens of whole answers, p50 and p95 per model version", &categories, &series, "output tokens"));
    out.push_str(&svg::series_legend(&series));
    if s.quality.len() > TOP_SERIES {
        note(out, &format!("The first {TOP_SERIES} versions by name are drawn; the table lists all."));
    }
}

/// Side-by-side pages of two scenarios over the same trace.
pub fn render_compare_html(title: &str, a_name: &str, b_name: &str, sa: &Summary, sb: &Summary, cmp: &Comparison) -> String {
    let mut out = String::with_capacity(1 << 16);
    page_head(&mut out, title, &format!("Comparison of two scenarios over the same trace: a = {a_name}, b = {b_name}."));
    let (ha, hb) = (format!("a: {a_name}"), format!("b: {b_name}"));

    heading(&mut out, "headline", "Headline");
    let delta = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) if a.is_finite() && b.is_finite() => format!("{:+.6}", b - a),
        _ => "-".into(),
    };
    let count = |label: &str, a: u64, b: u64| vec![t(label), n(int(a)), n(int(b)), n(format!("{:+}", i128::from(b) - i128::from(a)))];
    let avail = |x: Option<f64>| x.map(|v| v * 100.0);
    table(
        &mut out,
        &["Measure", &ha, &hb, "b − a"],
        [
            count("Requests", sa.requests, sb.requests),
            count("Admitted", sa.decisions.admitted, sb.decisions.admitted),
            count("Clamped", sa.decisions.clamped, sb.decisions.clamped),
            count("Refused", sa.decisions.refused, sb.decisions.refused),
            vec![
                t("Availability (%)"),
                n(pct(sa.availability)),
                n(pct(sb.availability)),
                n(match (avail(sa.availability), avail(sb.availability)) {
                    (Some(a), Some(b)) => format!("{:+.2}", b - a),
                    _ => "-".into(),
                }),
            ],
            vec![t("Spend (USD)"), n(usd(sa.spend_usd)), n(usd(sb.spend_usd)), n(delta(Some(sa.spend_usd), Some(sb.spend_usd)))],
            vec![t("USD per million tokens"), n(opt_usd(sa.usd_per_mtok)), n(opt_usd(sb.usd_per_mtok)), n(delta(sa.usd_per_mtok, sb.usd_per_mtok))],
            count("Tokens in", sa.input_tokens, sb.input_tokens),
            count("Tokens out", sa.output_tokens, sb.output_tokens),
        ],
    );

    heading(&mut out, "versions", "Per model version");
    let names: BTreeSet<&str> = sa.versions.iter().chain(&sb.versions).map(|v| v.version.as_str()).collect();
    if names.is_empty() {
        empty(&mut out, "No request has a model version in either scenario.");
    } else {
        let heads: Vec<String> =
            ["Requests", "Availability", "TTFT p50 (ms)", "TTFT p99 (ms)", "Cost (USD)"].iter().flat_map(|h| [format!("{h} a"), format!("{h} b")]).collect();
        let mut headers = vec!["Version"];
        headers.extend(heads.iter().map(String::as_str));
        table(
            &mut out,
            &headers,
            names.iter().map(|name| {
                let va = sa.versions.iter().find(|v| v.version == *name);
                let vb = sb.versions.iter().find(|v| v.version == *name);
                let mut row = vec![t(*name)];
                row.extend([va, vb].map(|v| n(v.map_or("-".into(), |v| int(v.requests)))));
                row.extend([va, vb].map(|v| n(pct(v.and_then(|v| v.availability)))));
                row.extend([va, vb].map(|v| n(ms(v.and_then(|v| v.ttft.p50_ms)))));
                row.extend([va, vb].map(|v| n(ms(v.and_then(|v| v.ttft.p99_ms)))));
                row.extend([va, vb].map(|v| n(v.map_or("-".into(), |v| usd(v.cost_usd)))));
                row
            }),
        );
    }

    heading(&mut out, "agreement", "Agreement");
    table(
        &mut out,
        &["Measure", "Requests"],
        [
            vec![t("Paired by trace line"), n(int(cmp.paired))],
            vec![t("Same decision, code, version and shadow"), n(format!("{} ({})", int(cmp.agree), share(cmp.agree, cmp.paired)))],
            vec![t("Different"), n(int(cmp.differences.len() as u64))],
            vec![t(format!("Only in a ({a_name})")), n(int(cmp.only_in_a.len() as u64))],
            vec![t(format!("Only in b ({b_name})")), n(int(cmp.only_in_b.len() as u64))],
        ],
    );
    if !cmp.decision_changes.is_empty() {
        table(
            &mut out,
            &["Decision a", "Decision b", "Requests"],
            cmp.decision_changes.iter().map(|c| vec![t(c.a.as_str()), t(c.b.as_str()), n(int(c.requests))]),
        );
    }

    heading(&mut out, "differences", "Requests that differ");
    let total = cmp.differences.len();
    if total == 0 {
        empty(&mut out, "No paired request differs.");
    } else {
        note(
            &mut out,
            &if total > MAX_LISTED_DIFFERENCES {
                format!("{} requests differ; the first {} by trace line are listed.", int(total as u64), int(MAX_LISTED_DIFFERENCES as u64))
            } else {
                format!("{} requests differ.", int(total as u64))
            },
        );
        let side = |s: &Side| [s.decision.as_str().to_string(), opt(&s.code), opt(&s.version), opt(&s.shadow_version)];
        table(
            &mut out,
            &["Line", "Arrival (s)", "Tenant", "Decision a", "Decision b", "Code a", "Code b", "Version a", "Version b", "Shadow a", "Shadow b"],
            cmp.differences.iter().take(MAX_LISTED_DIFFERENCES).map(|d| {
                let (a, b) = (side(&d.a), side(&d.b));
                let mut row = vec![n(d.line.to_string()), n(format!("{:.3}", d.arrival_ms / 1000.0)), t(opt(&d.tenant))];
                for (x, y) in a.into_iter().zip(b) {
                    row.push(t(x));
                    row.push(t(y));
                }
                row
            }),
        );
    }
    page_foot(&mut out);
    out
}
