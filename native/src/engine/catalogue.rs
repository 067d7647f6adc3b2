//! sluice's metric families as Envoy's labelled metrics.
//!
//! The flows name a sample the way proxy-wasm needs it, flat: `sluice.ttft_ms.model_version.v2.
//! tenant.acme…` (`sluice_core::metrics`), and `sluice.wasm`'s gateways turn the `.<key>.<value>`
//! pairs into labels with `stats_tags` regexes. The dynamic-module ABI has labelled metrics
//! instead, defined when the filter configuration is made (names and label *names*), recorded with
//! label *values*. So this module defines every family of the configured policies once per
//! configuration, from core's catalogue ([`FAMILIES`]), and maps each flat sample back to its
//! family and label values. Envoy stores them under the dynamic modules' custom stat namespace
//! (`dynamicmodulescustom.sluice.ttft_ms` with tags), which `/stats/prometheus` prints without
//! the namespace and without `envoy_`, as it prints `wasmcustom.`: `sluice_ttft_ms_bucket{
//! model_version="v2",tenant="acme",…}` — the series `sluice.wasm` gives, so dashboards and alerts
//! read both hosts alike (tests/envoy.rs compares the two on the same requests).

use std::collections::HashMap;

use sluice_core::metrics::{Family, MetricKind, Plugin, FAMILIES};

use crate::filter::{ConfigContext, CounterId, GaugeId, HistogramId, Metrics, MetricsError};

/// The most labels a family has (`sluice.requests_total`: nine).
const MAX_LABELS: usize = 12;

/// tenant-budget's Redis-ledger families, defined only when a budget has a Redis ledger: a family
/// without labels exists from its definition on — `ledger_up` would read 0 (down) on a gateway that
/// has no ledger.
const LEDGER_FAMILIES: &str = "sluice.budget.ledger_";

/// One defined metric.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricId {
    Counter(CounterId),
    Gauge(GaugeId),
    Histogram(HistogramId),
}

/// One label-name list of a family, as defined in Envoy.
#[derive(Debug)]
struct Variant {
    keys: Vec<&'static str>,
    id: MetricId,
}

/// The families of one filter configuration, by flat base name (`sluice.ttft_ms`).
#[derive(Debug, Default)]
pub struct Catalogue {
    families: HashMap<&'static str, Vec<Variant>>,
}

/// The label-name lists a family's series carry: `a|b|c` is one label whose key is one of them (a
/// budget's level), `k?` a label only some series have.
fn variants(family: &Family) -> Vec<Vec<&'static str>> {
    let mut lists: Vec<Vec<&'static str>> = vec![Vec::new()];
    for label in family.labels {
        if let Some(optional) = label.strip_suffix('?') {
            let with: Vec<Vec<&'static str>> = lists
                .iter()
                .map(|l| {
                    let mut l = l.clone();
                    l.push(optional);
                    l
                })
                .collect();
            lists.extend(with);
        } else {
            let choices: Vec<&'static str> = label.split('|').collect();
            lists = lists
                .iter()
                .flat_map(|l| {
                    choices.iter().map(move |choice| {
                        let mut l = l.clone();
                        l.push(choice);
                        l
                    })
                })
                .collect();
        }
    }
    lists
}

impl Catalogue {
    /// Defines every family of `plugins` in the configuration being made (the Redis ledger's with
    /// `ledger`).
    pub fn define(context: &mut ConfigContext<'_>, plugins: &[Plugin], ledger: bool) -> Result<Catalogue, String> {
        let mut families: HashMap<&'static str, Vec<Variant>> = HashMap::new();
        for family in FAMILIES.iter().filter(|f| plugins.contains(&f.plugin) && (ledger || !f.name.starts_with(LEDGER_FAMILIES))) {
            for keys in variants(family) {
                let defined: Result<MetricId, MetricsError> = match family.kind {
                    MetricKind::Counter => context.define_counter(family.name, &keys).map(MetricId::Counter),
                    MetricKind::Gauge => context.define_gauge(family.name, &keys).map(MetricId::Gauge),
                    MetricKind::Histogram => context.define_histogram(family.name, &keys).map(MetricId::Histogram),
                };
                let id = defined.map_err(|e| format!("defining metric {} {{{}}}: {e}", family.name, keys.join(",")))?;
                families.entry(family.name).or_default().push(Variant { keys, id });
            }
        }
        Ok(Catalogue { families })
    }

    /// The metric and label values of flat sample name `name`; `None` for a name of no defined
    /// family (a family of a policy not configured, or a name core's catalogue does not list).
    pub fn resolve<'n>(&self, name: &'n str, values: &mut [&'n str; MAX_LABELS]) -> Option<(MetricId, usize)> {
        // The base name ends at one of the dots (or the end); the rest is `.key.value` pairs.
        let ends = name.match_indices('.').map(|(i, _)| i).chain(std::iter::once(name.len()));
        for end in ends {
            let Some(variants) = name.get(..end).and_then(|base| self.families.get(base)) else { continue };
            let rest = name.get(end..).unwrap_or_default();
            let mut keys: [&str; MAX_LABELS] = [""; MAX_LABELS];
            let mut count = 0;
            let mut parts = rest.split('.').skip(1);
            let mut well_formed = true;
            while let Some(key) = parts.next() {
                let (Some(value), Some(key_slot), Some(value_slot)) = (parts.next(), keys.get_mut(count), values.get_mut(count)) else {
                    well_formed = false;
                    break;
                };
                *key_slot = key;
                *value_slot = value;
                count += 1;
            }
            if !well_formed {
                continue;
            }
            let keys = keys.get(..count).unwrap_or_default();
            if let Some(variant) = variants.iter().find(|v| v.keys.as_slice() == keys) {
                return Some((variant.id, count));
            }
        }
        None
    }

    /// Records one flow sample: `delta` for a counter or gauge, `value` for a histogram.
    pub fn record(&self, envoy: &mut dyn Metrics, name: &str, sample: Sample) -> Result<(), String> {
        let mut values = [""; MAX_LABELS];
        let Some((id, count)) = self.resolve(name, &mut values) else {
            return Err(format!("metric {name} is not one of the configured families"));
        };
        let labels = values.get(..count).unwrap_or_default();
        let result = match (id, sample) {
            // A zero defines the series (it then exists from the first request on, as with wasm).
            (MetricId::Counter(id), Sample::Add(delta)) => match u64::try_from(delta) {
                Ok(by) => envoy.increment_counter(id, labels, by),
                Err(_) => return Err(format!("counter {name} cannot go down by {delta}")),
            },
            (MetricId::Gauge(id), Sample::Add(delta)) => envoy.add_gauge(id, labels, delta),
            (MetricId::Gauge(id), Sample::Set(value)) => envoy.set_gauge(id, labels, value),
            (MetricId::Histogram(id), Sample::Set(value)) => envoy.record_histogram(id, labels, value),
            _ => return Err(format!("metric {name} is not of the kind the sample is ({sample:?})")),
        };
        result.map_err(|e| format!("metric {name}: {e}"))
    }
}

/// What a flow sample does to its metric.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sample {
    /// Add to a counter or gauge.
    Add(i64),
    /// Set a gauge, or record a histogram value.
    Set(u64),
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A catalogue with made-up ids, as `define` would build it (no Envoy in a unit test).
    fn catalogue(plugins: &[Plugin]) -> Catalogue {
        let mut families: HashMap<&'static str, Vec<Variant>> = HashMap::new();
        let mut next = 0usize;
        for family in FAMILIES.iter().filter(|f| plugins.contains(&f.plugin)) {
            for keys in variants(family) {
                next += 1;
                families.entry(family.name).or_default().push(Variant { keys, id: MetricId::Counter(CounterId::for_tests(next)) });
            }
        }
        Catalogue { families }
    }

    fn resolved(c: &Catalogue, name: &str) -> Option<Vec<String>> {
        let mut values = [""; MAX_LABELS];
        c.resolve(name, &mut values).map(|(_, n)| values.iter().take(n).map(|v| v.to_string()).collect())
    }

    #[test]
    fn variants_expand_alternatives_and_optional_labels() {
        let remaining = FAMILIES.iter().find(|f| f.name == "sluice.budget.remaining").map(variants);
        assert_eq!(remaining, Some(vec![vec!["org", "window", "unit"], vec!["team", "window", "unit"], vec!["key", "window", "unit"]]));
        let unrouted = FAMILIES.iter().find(|f| f.name == "sluice.router.unrouted_total").map(variants);
        assert_eq!(unrouted, Some(vec![vec!["reason"], vec!["reason", "model"]]));
        assert!(FAMILIES.iter().all(|f| variants(f).iter().all(|v| v.len() <= MAX_LABELS)));
    }

    #[test]
    fn flat_names_map_back_to_their_family_and_values() {
        let c = catalogue(&[Plugin::LlmMetrics, Plugin::TenantBudget]);
        let six = ".model_version.v2.tenant.acme.api.chat_completions.ctx.1k.turn.first.stream.true";
        assert_eq!(resolved(&c, &format!("sluice.ttft_ms{six}")), Some(["v2", "acme", "chat_completions", "1k", "first", "true"].map(String::from).to_vec()));
        // A family whose name is another's prefix, and one whose name has two dots.
        assert_eq!(resolved(&c, &format!("sluice.output_tokens_total{six}")).map(|v| v.len()), Some(6));
        assert_eq!(resolved(&c, "sluice.quality.output_tokens.model_version.v2.finish.stop"), Some(vec!["v2".to_string(), "stop".to_string()]));
        assert_eq!(resolved(&c, "sluice.budget.remaining.team.ml.window.day.unit.tokens"), Some(["ml", "day", "tokens"].map(String::from).to_vec()));
        assert_eq!(resolved(&c, "sluice.budget.ledger_up"), Some(Vec::new()));
        assert_eq!(resolved(&c, "sluice.request_body_uninspected_total.reason.encoded"), Some(vec!["encoded".to_string()]));
    }

    #[test]
    fn names_of_no_defined_family_are_not_resolved() {
        let c = catalogue(&[Plugin::LlmMetrics]);
        assert_eq!(resolved(&c, "sluice.router.requests_total.model.m.version.v.reason.r"), None, "model-router is not configured");
        assert_eq!(resolved(&c, "sluice.ttft_ms.model_version.v2"), None, "labels missing");
        assert_eq!(resolved(&c, "sluice.in_flight.model_version"), None, "a key without its value");
        assert_eq!(resolved(&c, "sluice.nothing"), None);
    }

    #[test]
    fn every_constructor_name_of_core_resolves() {
        // The names core's constructors build for the per-request families, through a record.
        let c = catalogue(&[Plugin::LlmMetrics, Plugin::TenantBudget, Plugin::ModelRouter, Plugin::LatencyGuard]);
        let labels = sluice_core::report::Labels {
            model_version: "v2".into(),
            tenant: "acme".into(),
            api: "chat_completions".into(),
            ctx: "1k".into(),
            turn: "first".into(),
            stream: "true".into(),
        };
        let series = sluice_core::metrics::RequestSeries::new(&labels);
        for name in [
            sluice_core::metrics::requests_total(&series, 200, Some("stop"), true),
            sluice_core::metrics::ttft_ms(&series),
            sluice_core::metrics::gateway_replies_total(&series, sluice_core::contract::GatewayEnd::Refused),
            sluice_core::metrics::in_flight("v2"),
        ] {
            assert!(resolved(&c, &name).is_some(), "{name}");
        }
    }
}
