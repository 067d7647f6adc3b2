//! Support for the fault matrix (`e2e/tests/faults_envoy.rs`): the shipped budget gateway
//! (`envoy/templates/budget-gateway.yaml`: tenant-budget, llm-metrics, Envoy's decompressors, the
//! buffer filter, the router) in front of the mock, with one budget key per cell so that each
//! cell's counters are its own series (`key` and `tenant` label the same name), shared by the cells
//! that can run side by side; a request's accounting read back from the access-log stamps, the
//! mock's ledger and `/stats/prometheus`; raw clients that cut a request where a cell says; curl
//! for HTTP/2 clients; a bridge Envoy for an HTTP/2 upstream.

use crate::access_log::stamp;
use crate::gateway::{shipped, yaml_string_body};
use crate::{http, Envoy, MockRequest, MockServer};
use anyhow::{anyhow, Context, Result};
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

/// Budget keys, one per cell (also the llm-metrics tenant of its requests).
pub const KEYS: usize = 48;

/// The key of cell `n`: `f01` … `f48`.
pub fn key(n: usize) -> String {
    format!("f{n:02}")
}

/// A tenant-budget policy with keys `f01` … `f48`, each with a budget far above anything a cell
/// sends (a day of 10^9 tokens), strict mode, usage injection on; price 1 $/MTok in, 4 $/MTok out,
/// so a charge in micro-USD is `input + 4 × output`.
pub fn budget_policy() -> String {
    let keys: Vec<Value> = (1..=KEYS).map(|n| json!({"id": key(n), "budgets": [{"window": "day", "tokens": 1_000_000_000u64, "count": "total"}]})).collect();
    json!({
        "mode": "strict",
        "identity": {"header": "x-sluice-key"},
        "unknown": {"action": "reject"},
        "include_usage": true,
        "default_max_output_tokens": 1_000_000,
        "orgs": [{"id": "faults", "teams": [{"id": "matrix", "keys": keys}]}],
        "prices": [{"model": "*", "input_usd_per_mtok": 1.0, "output_usd_per_mtok": 4.0}],
    })
    .to_string()
}

/// llm-metrics with the key as tenant label and the budget's price.
pub fn metrics_policy() -> String {
    let tenants: Vec<String> = (1..=KEYS).map(key).collect();
    json!({
        "path_prefixes": ["/v1/"],
        "tenant": {"header": "x-sluice-key"},
        "tenants": tenants,
        "prices": [{"model": "*", "input_usd_per_mtok": 1, "output_usd_per_mtok": 4}],
    })
    .to_string()
}

/// The budget gateway and its mock (Envoy dropped first).
pub struct FaultGateway {
    pub envoy: Envoy,
    pub mock: MockServer,
}

impl FaultGateway {
    /// A gateway of its own, with `patch` applied to the rendered template text (e.g. the cluster
    /// made HTTP/2) and `upstream_port` in place of the mock's port when given.
    pub fn start_with(patch: impl Fn(String) -> String, upstream_port: Option<u16>, mock: MockServer) -> Result<FaultGateway> {
        let template = std::fs::read_to_string(shipped("envoy/templates/budget-gateway.yaml"))?;
        let upstream = upstream_port.unwrap_or(mock.port()).to_string();
        let (budget, metrics) = (yaml_string_body(&budget_policy()), yaml_string_body(&metrics_policy()));
        let envoy =
            Envoy::start(&patch(template), &[("UPSTREAM_PORT", upstream.as_str()), ("BUDGET_CONFIG", budget.as_str()), ("PLUGIN_CONFIG", metrics.as_str())])?;
        Ok(FaultGateway { envoy, mock })
    }

    pub fn start() -> Result<FaultGateway> {
        FaultGateway::start_with(|t| t, None, MockServer::start(&[])?)
    }

    /// The gateway the independent cells share: started by the first cell that asks, stopped when
    /// the last one holding it ends (so no Envoy outlives the test process).
    pub fn shared() -> Result<Arc<FaultGateway>> {
        static SHARED: Mutex<Weak<FaultGateway>> = Mutex::new(Weak::new());
        let mut slot = SHARED.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(gw) = slot.upgrade() {
            return Ok(gw);
        }
        let gw = Arc::new(FaultGateway::start()?);
        *slot = Arc::downgrade(&gw);
        Ok(gw)
    }

    /// The access-log line of request `id` with its two stamps and the mock's record of it, once
    /// both are written (the mock's only if `upstream` says one is due).
    pub fn observe(&self, id: &str, upstream: bool) -> Result<Observed> {
        let line = self.envoy.access_log().wait_for_request(id, Duration::from_secs(20))?;
        let get = |field: &str| -> Result<Value> { Ok(stamp(&line, field)?.unwrap_or(Value::Null)) };
        let (llm, budget) = (get("sluice")?, get("budget")?);
        let mock = if upstream {
            Some(crate::wait_until(Duration::from_secs(20), &format!("the mock's record of {id}"), || {
                Ok(self.mock.requests()?.into_iter().find(|r| r.request_id == id))
            })?)
        } else {
            None
        };
        Ok(Observed { line, llm, budget, mock })
    }

    /// A counter or gauge summed over the series with these labels (0 when there is none).
    pub fn counter(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.envoy.metrics().ok().and_then(|m| m.value(name, labels)).unwrap_or(0.0)
    }

    /// A plain Envoy stat from `/stats` (e.g. `server.memory_allocated`), 0 when absent.
    pub fn stat(&self, name: &str) -> Result<u64> {
        let text = self.envoy.admin_get(&format!("/stats?filter=^{}$", regex_escape(name)))?;
        Ok(text.lines().find_map(|l| l.strip_prefix(&format!("{name}: ")).and_then(|v| v.trim().parse().ok())).unwrap_or(0))
    }
}

fn regex_escape(s: &str) -> String {
    s.replace('.', "\\.")
}

/// What the gateway and the upstream recorded of one request.
#[derive(Debug, Clone)]
pub struct Observed {
    pub line: Value,
    /// llm-metrics' stamp (`Null` when none).
    pub llm: Value,
    /// tenant-budget's stamp (`Null` when none).
    pub budget: Value,
    pub mock: Option<MockRequest>,
}

impl Observed {
    pub fn u(&self, stamp: &Value, field: &str) -> u64 {
        stamp.get(field).and_then(Value::as_u64).unwrap_or(u64::MAX)
    }
}

/// A chat request body: streamed with `include_usage` as given, `max_tokens` set (so the budget
/// writes nothing into it and the mock sends `tokens`).
pub fn chat(stream: bool, tokens: u64) -> String {
    json!({
        "model": "llama-3-70b",
        "stream": stream,
        "max_tokens": tokens,
        "messages": [{"role": "user", "content": "Tell me about faults."}],
    })
    .to_string()
}

/// An Anthropic Messages body.
pub fn messages(stream: bool, tokens: u64) -> String {
    json!({
        "model": "claude-x",
        "stream": stream,
        "max_tokens": tokens,
        "messages": [{"role": "user", "content": "Tell me about faults."}],
    })
    .to_string()
}

/// Writes `raw` to `addr` and closes the connection at once (a client gone mid-request).
pub fn send_and_close(addr: SocketAddr, raw: &[u8]) -> Result<()> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    s.write_all(raw)?;
    // Let Envoy read what was sent before the close.
    std::thread::sleep(Duration::from_millis(200));
    drop(s);
    Ok(())
}

/// A request head (with `content-length: len`) for `path` with `headers`.
pub fn head(addr: SocketAddr, path: &str, headers: &[(&str, &str)], len: usize) -> String {
    // connection: close, so that a raw reader sees the end of the response as the end of the socket.
    let mut h = format!("POST {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\ncontent-type: application/json\r\ncontent-length: {len}\r\n");
    for (n, v) in headers {
        h.push_str(&format!("{n}: {v}\r\n"));
    }
    h.push_str("\r\n");
    h
}

/// A raw streaming read of one response: the request written, the body read as raw bytes with a
/// `pace` between reads of at most `piece` bytes, until `stop` says so of the bytes last read (and
/// the 256 before them) or the connection ends.
/// Returns the bytes read (head included).
pub fn read_paced(addr: SocketAddr, raw: &[u8], piece: usize, pace: Duration, mut stop: impl FnMut(&[u8]) -> bool) -> Result<Vec<u8>> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    s.set_read_timeout(Some(Duration::from_secs(60)))?;
    // A small receive buffer, so that a slow reader holds the gateway back sooner.
    s.write_all(raw)?;
    let mut seen = Vec::new();
    let mut buf = vec![0; piece];
    loop {
        let n = match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if matches!(e.kind(), std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::UnexpectedEof) => break,
            Err(e) => return Err(e.into()),
        };
        seen.extend_from_slice(buf.get(..n).unwrap_or_default());
        // The tail only: scanning the whole body at every read would be quadratic.
        if stop(seen.get(seen.len().saturating_sub(n + 256)..).unwrap_or_default()) {
            break;
        }
        if !pace.is_zero() {
            std::thread::sleep(pace);
        }
    }
    Ok(seen)
}

/// True when `needle` occurs in `hay`.
pub fn contains(hay: &[u8], needle: &str) -> bool {
    hay.windows(needle.len()).any(|w| w == needle.as_bytes())
}

/// curl, when installed (`SLUICE_CURL` or the `PATH`).
pub fn curl() -> Option<String> {
    if let Some(c) = std::env::var_os("SLUICE_CURL") {
        return Some(c.to_string_lossy().into_owned());
    }
    std::process::Command::new("curl").arg("--version").output().ok().filter(|o| o.status.success()).map(|_| "curl".to_string())
}

/// One request of an HTTP/2 curl run; `max_time` makes curl give up on it (an RST_STREAM for
/// this stream alone, the connection and the other streams going on).
pub struct H2Request<'a> {
    pub id: &'a str,
    pub body: &'a str,
    pub max_time: Option<&'a str>,
}

/// Sends `requests` to `url` in one curl run over HTTP/2 without TLS (prior knowledge), all in
/// parallel on one connection; returns each response body as curl wrote it (what arrived, for a
/// request given up) and the HTTP version curl reports for it. curl's exit status is not checked:
/// a request given up makes it non-zero.
pub fn curl_h2_parallel(curl: &str, url: &str, headers: &[(&str, &str)], requests: &[H2Request], dir: &std::path::Path) -> Result<Vec<(String, String)>> {
    let mut cmd = std::process::Command::new(curl);
    cmd.args(["-s", "--parallel", "--parallel-immediate"]);
    for (i, r) in requests.iter().enumerate() {
        if i > 0 {
            cmd.arg("--next");
        }
        cmd.args([
            "--http2-prior-knowledge",
            "--max-time",
            r.max_time.unwrap_or("30"),
            "-H",
            "content-type: application/json",
            "-H",
            &format!("x-request-id: {}", r.id),
        ]);
        for (n, v) in headers {
            cmd.args(["-H", &format!("{n}: {v}")]);
        }
        let out = dir.join(format!("{}.out", r.id));
        cmd.args(["-d", r.body, "-o"]).arg(&out).args(["-w", "%{http_version}\n", url]);
    }
    let out = cmd.output().context("running curl")?;
    let versions: Vec<String> = String::from_utf8_lossy(&out.stdout).lines().map(str::to_string).collect();
    requests
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let body = std::fs::read_to_string(dir.join(format!("{}.out", r.id))).unwrap_or_default();
            Ok((body, versions.get(i).cloned().unwrap_or_default()))
        })
        .collect()
}

/// A plain Envoy (no plugins) that takes HTTP/2 without TLS on its listener and forwards to the
/// mock over HTTP/1.1: the gateway's cluster speaks HTTP/2 to it, so the plugins run with an
/// HTTP/2 upstream (the mock itself speaks only HTTP/1.1).
pub fn start_h2_bridge(mock_port: u16) -> Result<Envoy> {
    let config = r#"admin:
  address: { socket_address: { address: 127.0.0.1, port_value: {{ADMIN_PORT}} } }
static_resources:
  listeners:
  - name: bridge
    address: { socket_address: { address: 127.0.0.1, port_value: {{LISTEN_PORT}} } }
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: bridge
          codec_type: HTTP2
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: { prefix: "/" }
                route: { cluster: mock, timeout: 300s }
          http_filters:
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
  - name: mock
    type: STATIC
    connect_timeout: 1s
    # The mock's chunked trailers are passed on (HTTP/1.1 codecs drop them unless told).
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config:
          http_protocol_options: { enable_trailers: true }
    load_assignment:
      cluster_name: mock
      endpoints:
      - lb_endpoints:
        - endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: {{MOCK_PORT}} } } }
"#;
    let port = mock_port.to_string();
    Envoy::start(config, &[("MOCK_PORT", port.as_str())])
}

/// The gateway template with its `model_server` cluster speaking HTTP/2 (prior knowledge).
pub fn with_h2_cluster(template: String) -> String {
    let anchor = "  - name: model_server\n    type: STATIC\n";
    template.replacen(
        anchor,
        &format!(
            "{anchor}    typed_extension_protocol_options:\n      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:\n        \"@type\": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions\n        explicit_http_config:\n          http2_protocol_options: {{}}\n"
        ),
        1,
    )
}

/// The gateway template without its decompressors: what the plugins alone do with an encoded
/// answer (the control of the encoding cells).
pub fn without_decompressors(template: String) -> String {
    let (Some(start), Some(end)) = (template.find("          # Envoy's decompressors between"), template.find("          - name: envoy.filters.http.router\n"))
    else {
        return template;
    };
    format!("{}{}", template.get(..start).unwrap_or_default(), template.get(end..).unwrap_or_default())
}

/// Polls `stat` on `gw` until `ok` holds or `timeout` passes; the last value either way.
pub fn poll_stat(gw: &FaultGateway, stat: &str, timeout: Duration, ok: impl Fn(u64) -> bool) -> Result<u64> {
    let deadline = Instant::now() + timeout;
    loop {
        let v = gw.stat(stat)?;
        if ok(v) || Instant::now() >= deadline {
            return Ok(v);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `GET` on the mock or the gateway's admin, as JSON.
pub fn get_json(addr: SocketAddr, path: &str) -> Result<Value> {
    http::get(addr, path)?.json().map_err(|e| anyhow!("{path}: {e:#}"))
}
