//! Smoke test of the whole harness against a real Envoy with no sluice filter: a listener routing
//! to the mock. What arrives through Envoy must be byte-identical to what the mock sends directly
//! (ids and timestamps aside), and Envoy's own stats and access log must show the request.
//! Skipped when Envoy is not installed (unless `SLUICE_ENVOY` is set).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use sluice_e2e::{post_json, post_stream, wait_until, Envoy, MockServer, Tools};
use std::time::Duration;

const BOOTSTRAP: &str = r#"
admin:
  address: {socket_address: {address: 127.0.0.1, port_value: {{ADMIN_PORT}}}}
# Histograms reach /stats/prometheus at each flush; flush often so tests wait little.
stats_flush_interval: 0.2s
static_resources:
  listeners:
  - name: main
    address: {socket_address: {address: 127.0.0.1, port_value: {{LISTEN_PORT}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: ingress
          access_log:
          - name: envoy.access_loggers.file
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog
              path: "{{ACCESS_LOG}}"
              log_format:
                json_format:
                  status: "%RESPONSE_CODE%"
                  path: "%REQ(:PATH)%"
                  served_by: "%RESP(X-MOCK-SERVED-BY)%"
                  bytes_sent: "%BYTES_SENT%"
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {prefix: "/"}
                route: {cluster: mock, timeout: 0s}
          http_filters:
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
  - name: mock
    type: STATIC
    connect_timeout: 1s
    load_assignment:
      cluster_name: mock
      endpoints:
      - lb_endpoints:
        - endpoint: {address: {socket_address: {address: 127.0.0.1, port_value: {{UPSTREAM_PORT}}}}}
"#;

/// Blanks what differs between two runs of the same request: ids and creation times.
fn normalize(sse: &str) -> String {
    let mut out = String::new();
    for event in sse_lines(sse) {
        out.push_str(&event);
        out.push('\n');
    }
    out
}

fn sse_lines(sse: &str) -> Vec<String> {
    sse.lines()
        .map(|line| match line.strip_prefix("data: ").and_then(|d| serde_json::from_str::<serde_json::Value>(d).ok()) {
            Some(mut v) => {
                for key in ["id", "created"] {
                    if v.get(key).is_some() {
                        v[key] = "X".into();
                    }
                }
                format!("data: {v}")
            }
            None => line.to_string(),
        })
        .collect()
}

#[test]
fn envoy_passes_streams_through_unchanged() {
    let Some(_tools) = Tools::locate_or_skip().unwrap() else {
        return;
    };
    let mock = MockServer::start(&["--tokens", "5", "--served-by", "mock-a"]).unwrap();
    let port = mock.port().to_string();
    let envoy = Envoy::start(BOOTSTRAP, &[("UPSTREAM_PORT", &port)]).unwrap();

    let body = r#"{"model":"m","stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"Hello"}]}"#;
    let headers = [("x-mock-ttft-ms", "100"), ("x-mock-itl-ms", "10")];
    let direct = post_stream(mock.addr(), "/v1/chat/completions", &headers, body).unwrap().collect().unwrap();
    let proxied = post_stream(envoy.listen_addr(), "/v1/chat/completions", &headers, body).unwrap().collect().unwrap();
    assert_eq!(proxied.status, 200);
    assert!(proxied.complete && direct.complete);
    assert_eq!(proxied.header("x-mock-served-by"), Some("mock-a"));
    assert_eq!(normalize(&proxied.text()), normalize(&direct.text()));
    assert!(proxied.text().ends_with("data: [DONE]\n\n"));
    // The first token cannot arrive before the mock's TTFT, whatever Envoy does.
    assert!(proxied.time_to("tok0").unwrap() >= Duration::from_millis(100));

    // A non-streamed answer on the same route.
    let whole = post_json(envoy.listen_addr(), "/v1/messages", &[], r#"{"messages":[]}"#).unwrap();
    assert_eq!(whole.json().unwrap()["content"][0]["text"], "tok0 tok1 tok2 tok3 tok4 ");

    let metrics = envoy.metrics().unwrap();
    let ok = metrics.value("envoy_cluster_upstream_rq", &[("envoy_cluster_name", "mock"), ("envoy_response_code", "200")]);
    assert_eq!(ok, Some(2.0), "names present: {:?}", metrics.names());
    let rq_time = wait_until(Duration::from_secs(5), "upstream_rq_time histogram", || {
        let h = envoy.metrics()?.histogram("envoy_cluster_upstream_rq_time", &[("envoy_cluster_name", "mock")]);
        Ok(h.filter(|h| h.count == 2))
    })
    .unwrap();
    assert_eq!(rq_time.buckets.last().map(|b| b.1), Some(2));

    let log = envoy.access_log().wait_for(2, Duration::from_secs(5)).unwrap();
    assert_eq!(log[0]["status"], 200);
    assert_eq!(log[0]["path"], "/v1/chat/completions");
    assert_eq!(log[0]["served_by"], "mock-a");
    assert_eq!(log[0]["bytes_sent"].as_u64(), Some(proxied.body().len() as u64));
    assert_eq!(mock.stats().unwrap()["requests"], 3);
}

#[test]
fn validate_accepts_the_rendered_bootstrap_and_rejects_garbage() {
    let Some(_tools) = Tools::locate_or_skip().unwrap() else {
        return;
    };
    let dir = std::env::temp_dir().join(format!("sluice-e2e-validate-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let good = dir.join("good.yaml");
    let rendered =
        sluice_e2e::render_config(BOOTSTRAP, &[("ADMIN_PORT", "9901"), ("LISTEN_PORT", "10000"), ("UPSTREAM_PORT", "18000"), ("ACCESS_LOG", "/dev/null")])
            .unwrap();
    std::fs::write(&good, rendered).unwrap();
    Envoy::validate(&good).unwrap();
    let bad = dir.join("bad.yaml");
    std::fs::write(&bad, "static_resources: {listeners: [{name: x, nonsense: 1}]}\n").unwrap();
    assert!(Envoy::validate(&bad).is_err());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn startup_failure_reports_envoy_stderr() {
    let Some(_tools) = Tools::locate_or_skip().unwrap() else {
        return;
    };
    let broken = BOOTSTRAP.replace("type: STATIC", "type: NOT_A_TYPE");
    let err = match Envoy::start(&broken, &[("UPSTREAM_PORT", "1")]) {
        Ok(_) => panic!("Envoy accepted a broken config"),
        Err(e) => format!("{e:#}"),
    };
    assert!(err.contains("NOT_A_TYPE"), "{err}");
    // A placeholder without a value is caught before Envoy runs.
    let err = Envoy::start(BOOTSTRAP, &[]).err().unwrap();
    assert!(format!("{err:#}").contains("UPSTREAM_PORT"));
}
