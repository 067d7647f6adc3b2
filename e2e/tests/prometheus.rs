//! The Prometheus reader on text shaped like Envoy 1.40's `/stats/prometheus` (counters, gauges
//! with empty label sets, Envoy histograms, and sluice wasm histograms labelled by stats tags).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use sluice_e2e::prometheus::Metrics;

const SAMPLE: &str = r#"# TYPE envoy_cluster_upstream_rq counter
envoy_cluster_upstream_rq{envoy_response_code="200",envoy_cluster_name="mock"} 2
envoy_cluster_upstream_rq{envoy_response_code="404",envoy_cluster_name="mock"} 1
envoy_cluster_upstream_rq{envoy_response_code="200",envoy_cluster_name="other"} 7
# TYPE envoy_cluster_upstream_rq_timeout counter
envoy_cluster_upstream_rq_timeout{envoy_cluster_name="mock"} 0
# TYPE envoy_http_downstream_rq_active gauge
envoy_http_downstream_rq_active{envoy_http_conn_manager_prefix="admin"} 1
envoy_http_downstream_rq_active{envoy_http_conn_manager_prefix="ingress"} 0
# TYPE envoy_server_live gauge
envoy_server_live{} 1
# TYPE envoy_cluster_upstream_rq_time histogram
envoy_cluster_upstream_rq_time_bucket{envoy_cluster_name="mock",le="0.5"} 2
envoy_cluster_upstream_rq_time_bucket{envoy_cluster_name="mock",le="1"} 2
envoy_cluster_upstream_rq_time_bucket{envoy_cluster_name="mock",le="5"} 2
envoy_cluster_upstream_rq_time_bucket{envoy_cluster_name="mock",le="10"} 2
envoy_cluster_upstream_rq_time_bucket{envoy_cluster_name="mock",le="25"} 2
envoy_cluster_upstream_rq_time_bucket{envoy_cluster_name="mock",le="50"} 3
envoy_cluster_upstream_rq_time_bucket{envoy_cluster_name="mock",le="100"} 3
envoy_cluster_upstream_rq_time_bucket{envoy_cluster_name="mock",le="3600000"} 3
envoy_cluster_upstream_rq_time_bucket{envoy_cluster_name="mock",le="+Inf"} 3
envoy_cluster_upstream_rq_time_sum{envoy_cluster_name="mock"} 30.491803278688525580264467862435
envoy_cluster_upstream_rq_time_count{envoy_cluster_name="mock"} 3
# TYPE sluice_ttft_ms histogram
sluice_ttft_ms_bucket{model_version="v2",tenant="acme",le="10"} 0
sluice_ttft_ms_bucket{model_version="v2",tenant="acme",le="100"} 1
sluice_ttft_ms_bucket{model_version="v2",tenant="acme",le="250"} 4
sluice_ttft_ms_bucket{model_version="v2",tenant="acme",le="+Inf"} 5
sluice_ttft_ms_sum{model_version="v2",tenant="acme"} 1105
sluice_ttft_ms_count{model_version="v2",tenant="acme"} 5
sluice_ttft_ms_bucket{model_version="v2",tenant="other",le="10"} 1
sluice_ttft_ms_bucket{model_version="v2",tenant="other",le="100"} 1
sluice_ttft_ms_bucket{model_version="v2",tenant="other",le="250"} 2
sluice_ttft_ms_bucket{model_version="v2",tenant="other",le="+Inf"} 2
sluice_ttft_ms_sum{model_version="v2",tenant="other"} 205
sluice_ttft_ms_count{model_version="v2",tenant="other"} 2
sluice_ttft_ms_bucket{model_version="v1",tenant="acme",le="10"} 0
sluice_ttft_ms_bucket{model_version="v1",tenant="acme",le="100"} 0
sluice_ttft_ms_bucket{model_version="v1",tenant="acme",le="250"} 0
sluice_ttft_ms_bucket{model_version="v1",tenant="acme",le="+Inf"} 1
sluice_ttft_ms_sum{model_version="v1",tenant="acme"} 900
sluice_ttft_ms_count{model_version="v1",tenant="acme"} 1
"#;

#[test]
fn counters_and_gauges_by_label_subset() {
    let m = Metrics::parse(SAMPLE).unwrap();
    let ok_mock = [("envoy_cluster_name", "mock"), ("envoy_response_code", "200")];
    assert_eq!(m.value("envoy_cluster_upstream_rq", &ok_mock), Some(2.0));
    // A subset matches several series: their values add up.
    assert_eq!(m.value("envoy_cluster_upstream_rq", &[("envoy_cluster_name", "mock")]), Some(3.0));
    assert_eq!(m.value("envoy_cluster_upstream_rq", &[]), Some(10.0));
    assert_eq!(m.value("envoy_cluster_upstream_rq_timeout", &[]), Some(0.0));
    assert_eq!(m.value("envoy_server_live", &[]), Some(1.0));
    assert_eq!(m.value("envoy_http_downstream_rq_active", &[("envoy_http_conn_manager_prefix", "admin")]), Some(1.0));
    // Absent names and labels are None, not zero: "never recorded" differs from "recorded 0".
    assert_eq!(m.value("envoy_cluster_upstream_rq", &[("envoy_cluster_name", "nope")]), None);
    assert_eq!(m.value("no_such_metric", &[]), None);
    assert!(m.names().contains(&"sluice_ttft_ms_bucket"));
}

#[test]
fn envoy_histogram() {
    let m = Metrics::parse(SAMPLE).unwrap();
    let h = m.histogram("envoy_cluster_upstream_rq_time", &[("envoy_cluster_name", "mock")]).unwrap();
    assert_eq!(h.count, 3);
    assert!((h.sum - 30.4918).abs() < 1e-3);
    assert_eq!(h.buckets.len(), 9);
    assert_eq!(h.buckets[0], (0.5, 2));
    assert_eq!(h.buckets.last().unwrap(), &(f64::INFINITY, 3));
    assert_eq!(h.cumulative(25.0), Some(2));
    assert_eq!(h.count_between(25.0, 50.0), Some(1));
    assert_eq!(h.count_between(25.0, 7.0), None); // 7 is not a bucket bound
}

#[test]
fn sluice_histogram_merged_over_tags() {
    let m = Metrics::parse(SAMPLE).unwrap();
    let acme_v2 = m.histogram("sluice_ttft_ms", &[("tenant", "acme"), ("model_version", "v2")]).unwrap();
    assert_eq!((acme_v2.count, acme_v2.sum), (5, 1105.0));
    assert_eq!(acme_v2.buckets, vec![(10.0, 0), (100.0, 1), (250.0, 4), (f64::INFINITY, 5)]);

    let v2 = m.histogram("sluice_ttft_ms", &[("model_version", "v2")]).unwrap();
    assert_eq!((v2.count, v2.sum), (7, 1310.0));
    assert_eq!(v2.buckets, vec![(10.0, 1), (100.0, 2), (250.0, 6), (f64::INFINITY, 7)]);

    let all = m.histogram("sluice_ttft_ms", &[]).unwrap();
    assert_eq!(all.count, 8);
    assert_eq!(all.cumulative(f64::INFINITY), Some(8));

    assert!(m.histogram("sluice_ttft_ms", &[("tenant", "nobody")]).is_none());
    assert!(m.histogram("sluice_tpot_ms", &[]).is_none());
}

#[test]
fn real_envoy_scrape_parses_completely() {
    // Everything Envoy prints must parse, including NaN quantile-less summaries and odd names.
    let text = "# HELP x help text\nx_total{a=\"1\"} NaN\ny +Inf\nz -Inf 1700000000000\n";
    let m = Metrics::parse(text).unwrap();
    assert!(m.value("x_total", &[]).unwrap().is_nan());
    assert_eq!(m.value("y", &[]), Some(f64::INFINITY));
    assert_eq!(m.value("z", &[]), Some(f64::NEG_INFINITY));
}
