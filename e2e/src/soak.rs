//! The soak: mixed traffic through the full chain (`envoy/templates/full-gateway.yaml`:
//! json_to_metadata → latency-guard → model-router → tenant-budget → llm-metrics → buffer → router)
//! in real Envoy for a bounded time at a bounded rate, on loopback, with failures mixed in; Envoy's
//! memory, its metric series and its connections sampled throughout; and at the end every request
//! accounted for.
//!
//! Traffic: a fixed cycle of request shapes (five tenants, OpenAI chat and Anthropic messages,
//! streamed and whole, four users whose sticky hash spreads them over both model versions, client
//! disconnects mid-stream, upstream resets, 500s and error events, streams stalled past the guard's
//! TTFT deadline), repeated in a new order every cycle, so every label combination the traffic can
//! produce shows up in every cycle; one tenant sends more than its requests-per-minute budget
//! (429s). Every 30 s the two mocks' default TTFT changes (`POST /mock/ttft`).
//!
//! Samples (every `sample_every`): `server.memory_allocated` and `server.memory_heap_size` from
//! `/stats`, Envoy's resident set and open file descriptors from `/proc`, the wasm VM count, the
//! number of series in `/stats/prometheus` (all, and `sluice_*`), open downstream and upstream
//! connections. Envoy has no statistic of the size of proxy-wasm shared data (the `wasm.*` stats are
//! VM counts and reload counters); shared data lives in Envoy's heap, so it is inside
//! `server.memory_allocated`.
//!
//! At the end ([`run`] collects every failure, then fails with all of them): each request's client
//! outcome against the four access-log stamps and the mock's ledger (the checks of
//! [`crate::budget_traffic`] plus status, version, outcome and token agreement between the plugins),
//! the budget counters against the sum of the charges, `sluice_requests_total` and the other request
//! counters against the requests by outcome, in-flight gauges back at 0, and memory, series and
//! connections flat after the warm-up.

use crate::access_log::stamp;
use crate::budget_traffic::{
    error_fields, read_logs, read_mock_ledger, stamp_str, stamp_u64, Api, Check, Failures, Fault, Planned, Policy, Records, Rng, Seen, Tally, Window,
};
use crate::gateway::{start_full_gateway, FullGateway};
use crate::prometheus::Metrics;
use crate::{http, Connection, MockServer};
use anyhow::{anyhow, Context, Result};
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// How long and how hard to soak.
#[derive(Debug, Clone)]
pub struct SoakConfig {
    /// Traffic time (no request starts after it).
    pub duration: Duration,
    /// Samples before this are not held to the flatness bounds (VMs, stats and buffers warming up).
    pub warmup: Duration,
    pub sample_every: Duration,
    /// Requests started per second, at most.
    pub rate_per_s: f64,
    /// Client connections (threads), each kept alive until a fault cuts it.
    pub connections: usize,
    /// Where the sample table and the SVG go (`soak-<name>.md`, `soak-<name>.svg`), if anywhere.
    pub out_dir: Option<PathBuf>,
    /// Names the output files: `20min`, `short`.
    pub name: String,
}

impl SoakConfig {
    /// The run inside the test command: 45 s of traffic.
    pub fn short() -> SoakConfig {
        SoakConfig {
            duration: Duration::from_secs(45),
            warmup: Duration::from_secs(16),
            sample_every: Duration::from_secs(2),
            rate_per_s: 10.0,
            connections: 12,
            out_dir: None,
            name: "short".into(),
        }
    }

    /// `minutes` of traffic, sampled every 5 s, the first 2 minutes (a tenth of a short run) warm-up.
    pub fn minutes(minutes: u64) -> SoakConfig {
        let duration = Duration::from_secs(minutes * 60);
        SoakConfig {
            duration,
            warmup: Duration::from_secs(120).min(duration / 10),
            sample_every: Duration::from_secs(5),
            rate_per_s: 10.0,
            connections: 12,
            out_dir: None,
            name: format!("{minutes}min"),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Bounds

/// Memory (allocated, heap, resident): the last quarter's maximum may exceed the first quarter's
/// (after warm-up) by this fraction plus [`MEMORY_SLACK_BYTES`]. A leak of 1 KiB a request at 10
/// requests a second adds 9 MiB over the last 15 minutes of a 20-minute run, well past it.
pub const MEMORY_SLACK_FRACTION: f64 = 0.05;
pub const MEMORY_SLACK_BYTES: u64 = 4 << 20;
/// Distinct values one sluice label may take over the run: far above what the traffic's tenants,
/// versions, keys and APIs make, far below one per request.
pub const MAX_LABEL_VALUES: usize = 24;
/// Open file descriptors and connections: the last quarter's maximum over the first quarter's.
pub const FD_SLACK: u64 = 16;

// ---------------------------------------------------------------------------------------------
// The policies

pub const TENANTS: [&str; 5] = ["acme", "bank-emea", "globex", "batch-nightly", "initech"];
/// The tenant sent past its requests-per-minute budget.
pub const OVER_BUDGET_TENANT: &str = "globex";
/// A tenth of what globex sends a minute: refusals from its first seconds in every minute.
pub const GLOBEX_REQUESTS_PER_MINUTE: u64 = 15;
/// A stalled stream's TTFT, past the guard's deadline.
const STALL_TTFT_MS: u64 = 3500;
const TTFT_DEADLINE_MS: u64 = 2000;
/// The two default TTFTs the mocks alternate between, every [`TTFT_SHIFT_EVERY`].
const TTFT_FAST_MS: u64 = 15;
const TTFT_SLOW_MS: u64 = 180;
const TTFT_SHIFT_EVERY: Duration = Duration::from_secs(30);

/// latency-guard: the demo's classes and deadlines; v1's breaker objective is above the soak's
/// failure mix (≈ 15 % of v1's answers are errors, resets or stalls by design), so it stays closed
/// and no request is shed — its transitions are latency_guard_envoy.rs's subject.
pub fn latency_policy() -> Value {
    json!({
        "tenant": { "header": "x-sluice-tenant" },
        "classes": [
            { "name": "interactive", "priority": "critical", "tenants": ["acme", "bank-*"] },
            { "name": "batch", "priority": "sheddable", "tenants": ["batch-*"] },
            { "name": "standard", "priority": "standard" }
        ],
        "default_class": "standard",
        "versions": [
            { "name": "v1", "ttft_deadline_ms": TTFT_DEADLINE_MS, "total_deadline_ms": 60000, "in_flight": { "limit": 64 },
              "breaker": { "objective": { "percentile": 95, "ttft_ms": 3000, "error_per_mille": 800 }, "window_s": 30, "min_samples": 20,
                           "open_for_ms": 10000, "fallback": "v2" } },
            { "name": "v2", "ttft_deadline_ms": TTFT_DEADLINE_MS, "total_deadline_ms": 60000 }
        ]
    })
}

/// model-router: both models split 50/50 between v1 and v2, sticky by the body's `user` (four users
/// in the traffic) before the tenant; 30 % of llama's requests shadowed to the qwen cluster (often
/// enough that every comparison series appears within the warm-up).
pub fn router_policy() -> Value {
    let versions = |model: &str| {
        json!([
            { "name": "v1", "weight": 50, "upstream_model": model, "route": "llama-v1" },
            { "name": "v2", "weight": 50, "upstream_model": model, "route": "llama-v2" }
        ])
    };
    json!({
        "sticky_key": [ { "body_user": true }, { "header": "x-sluice-tenant" } ],
        "route_header": "x-sluice-route",
        "version_header": "x-model-version",
        "models": [
            { "model": "llama-3-70b", "versions": versions("llama-3-70b"), "fallback": ["v1", "v2"],
              "shadow": { "version": { "name": "qwen-72b-v1", "upstream_model": "qwen-72b", "route": "qwen-v1", "cluster": "qwen_v1", "authority": "qwen.internal" },
                          "fraction": 0.3, "max_concurrent": 8, "exclude_tenants": ["bank-*"], "tenant_header": "x-sluice-tenant" } },
            { "model": "claude-3-5-haiku", "versions": versions("claude-3-5-haiku"), "fallback": ["v1", "v2"] }
        ]
    })
}

/// The prices both tenant-budget and llm-metrics use: $1 and $4 per million input and output
/// tokens for both models, the prices [`crate::budget_traffic`]'s charge checks assume.
fn prices() -> Value {
    json!([
        { "model": "llama-3-70b*", "input_usd_per_mtok": 1, "output_usd_per_mtok": 4 },
        { "model": "claude-*", "input_usd_per_mtok": 1, "output_usd_per_mtok": 4 }
    ])
}

/// tenant-budget, strict: budgets every tenant stays within except globex's requests per minute.
pub fn budget_policy() -> Value {
    json!({
        "mode": "strict",
        "identity": { "header": "x-sluice-tenant" },
        "unknown": { "action": "reject" },
        "include_usage": true,
        "default_max_output_tokens": 1024,
        "prices": prices(),
        "orgs": [
            { "id": "acme", "budgets": [ { "window": "month", "usd": 20000 } ],
              "teams": [
                { "id": "assistants", "budgets": [ { "window": "minute", "tokens": 20000000 } ],
                  "keys": [ { "id": "acme", "budgets": [ { "window": "minute", "tokens": 5000000 }, { "window": "day", "usd": 500 } ] } ] },
                { "id": "batch", "keys": [ { "id": "batch-nightly", "budgets": [ { "window": "day", "tokens": 500000000, "count": "output" } ] } ] } ] },
            { "id": "globex", "budgets": [ { "window": "month", "usd": 2000 } ],
              "teams": [ { "id": "labs", "keys": [ { "id": "globex", "budgets": [ { "window": "minute", "requests": GLOBEX_REQUESTS_PER_MINUTE }, { "window": "day", "usd": 200 } ] } ] } ] },
            { "id": "bank", "budgets": [ { "window": "month", "usd": 50000 } ],
              "teams": [ { "id": "retail", "keys": [ { "id": "bank-emea", "max_output_tokens": 2048, "budgets": [ { "window": "minute", "tokens": 10000000 } ] } ] } ] },
            { "id": "initech", "budgets": [ { "window": "day", "usd": 1000 } ],
              "teams": [ { "id": "core", "keys": [ { "id": "initech", "budgets": [ { "window": "minute", "tokens": 5000000 } ] } ] } ] }
        ]
    })
}

/// llm-metrics: the demo's configuration with the soak's tenants and the shared prices.
pub fn metrics_policy() -> Value {
    json!({
        "path_prefixes": ["/v1/"],
        "model_version_header": "x-model-version",
        "model_versions": ["v1", "v2"],
        "max_dynamic_model_versions": 16,
        "tenant": { "header": "x-sluice-tenant" },
        "tenants": TENANTS,
        "prices": prices(),
        "stream_summary_comment": true
    })
}

// ---------------------------------------------------------------------------------------------
// The traffic

/// What a request is made to go through.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    Ok,
    /// The client reads a few events, then closes the connection.
    Disconnect,
    /// `x-mock-fail: reset-after:N`.
    Reset,
    /// `x-mock-fail: status:500`.
    Error500,
    /// `x-mock-fail: error-event-after:N` (streams).
    ErrorEvent,
    /// `x-mock-ttft-ms` past the guard's TTFT deadline: a 504.
    Stall,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::Ok => "ok",
            Kind::Disconnect => "disconnect",
            Kind::Reset => "reset",
            Kind::Error500 => "500",
            Kind::ErrorEvent => "error_event",
            Kind::Stall => "stall",
        }
    }
}

/// One request of the cycle.
#[derive(Debug, Clone)]
pub struct Shape {
    pub tenant: &'static str,
    pub api: Api,
    pub user: u64,
    pub tokens: u64,
    pub itl_ms: u64,
    pub max_tokens: Option<u64>,
    pub words: u64,
    pub kind: Kind,
    /// Reset / error event after this many tokens; disconnect after this many body bytes.
    pub after: u64,
}

pub const CYCLE: usize = 60;
const SEED: u64 = 0x0050_a65e_ed0f_c4a1;

/// The cycle: 60 shapes. Each tenant gets every API; 11 faults (≈ 18 %) spread over tenants and APIs.
pub fn cycle() -> Vec<Shape> {
    let mut rng = Rng(SEED);
    let apis = [Api::ChatStreamUsage, Api::ChatStream, Api::ChatWhole, Api::MessagesStream, Api::MessagesWhole];
    // globex gets a quarter of the traffic: 15 a cycle of ≈ 6 s, ≈ 150 a minute against its 15.
    let tenants: [(&'static str, usize); 5] = [("acme", 15), ("bank-emea", 8), ("globex", 15), ("batch-nightly", 10), ("initech", 12)];
    let mut pending = vec![
        Kind::Disconnect,
        Kind::Reset,
        Kind::Error500,
        Kind::ErrorEvent,
        Kind::Stall,
        Kind::Disconnect,
        Kind::Reset,
        Kind::Error500,
        Kind::ErrorEvent,
        Kind::Stall,
        Kind::Reset,
    ];
    let mut out = Vec::new();
    for (tenant, n) in tenants {
        for j in 0..n {
            let api = apis.get(j % apis.len()).copied().unwrap_or(Api::ChatWhole);
            // Every fourth shape takes the first pending fault it can have (disconnects, error
            // events and stalls are stream faults; globex, mostly refused, gets no stall).
            let fits = |k: &Kind| match k {
                Kind::Disconnect | Kind::ErrorEvent => api.stream(),
                Kind::Stall => api.stream() && tenant != OVER_BUDGET_TENANT,
                _ => true,
            };
            let kind = match pending.iter().position(fits) {
                Some(at) if out.len() % 4 == 1 => pending.remove(at),
                _ => Kind::Ok,
            };
            let tokens = if kind == Kind::Disconnect { 60 } else { rng.range(6, 40) };
            let max_tokens = match api {
                Api::MessagesStream | Api::MessagesWhole => Some(if j % 3 == 0 { tokens.saturating_sub(2).max(1) } else { 64 }),
                _ if j % 4 == 1 => Some(tokens + 8),
                _ => None,
            };
            let after = match kind {
                Kind::Disconnect => 420,
                Kind::Reset | Kind::ErrorEvent => rng.range(0, tokens.saturating_sub(1)),
                _ => 0,
            };
            let itl_ms = if kind == Kind::Disconnect { 12 } else { rng.range(1, 6) };
            out.push(Shape { tenant, api, user: rng.range(0, 3), tokens, itl_ms, max_tokens, words: rng.range(1, 30), kind, after });
        }
    }
    out
}

/// Request `i` of the run: cycle `i / CYCLE` in its own order.
pub fn request(i: usize, cycle: &[Shape]) -> (Planned, Shape) {
    let round = (i / CYCLE.max(1)) as u64;
    let mut order: Vec<usize> = (0..cycle.len()).collect();
    let mut rng = Rng(SEED ^ round.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 1);
    for k in (1..order.len()).rev() {
        let j = (rng.next() % (k as u64 + 1)) as usize;
        order.swap(k, j);
    }
    let pick = order.get(i % CYCLE.max(1)).copied().unwrap_or(0);
    let shape = cycle.get(pick).cloned().unwrap_or(Shape {
        tenant: "acme",
        api: Api::ChatWhole,
        user: 0,
        tokens: 8,
        itl_ms: 1,
        max_tokens: None,
        words: 3,
        kind: Kind::Ok,
        after: 0,
    });
    (planned(format!("soak-{i:06}"), &shape), shape)
}

fn planned(id: String, s: &Shape) -> Planned {
    let words = ["soak", "tenant", "stream", "token", "window", "ledger", "model", "quota", "budget", "series"];
    let user_text =
        (0..s.words).map(|w| words.get((w as usize * 7 + s.tokens as usize) % words.len()).copied().unwrap_or("soak")).collect::<Vec<_>>().join(" ");
    let fault = match s.kind {
        Kind::Disconnect => Fault::Disconnect(s.after as usize),
        Kind::Reset => Fault::Reset(s.after),
        _ => Fault::None,
    };
    Planned { id, key: s.tenant, api: s.api, tokens: s.tokens, ttft_ms: 0, itl_ms: s.itl_ms, max_tokens: s.max_tokens, user_text, fault }
}

fn headers(p: &Planned, s: &Shape) -> Vec<(&'static str, String)> {
    let mut h = vec![
        ("x-request-id", p.id.clone()),
        ("x-sluice-tenant", s.tenant.to_string()),
        ("x-mock-tokens", s.tokens.to_string()),
        ("x-mock-itl-ms", s.itl_ms.to_string()),
    ];
    match s.kind {
        Kind::Reset => h.push(("x-mock-fail", format!("reset-after:{}", s.after))),
        Kind::Error500 => h.push(("x-mock-fail", "status:500".into())),
        Kind::ErrorEvent => h.push(("x-mock-fail", format!("error-event-after:{}", s.after))),
        Kind::Stall => h.push(("x-mock-ttft-ms", STALL_TTFT_MS.to_string())),
        Kind::Ok | Kind::Disconnect => {}
    }
    h
}

fn body(p: &Planned, s: &Shape) -> String {
    let mut v: Value = serde_json::from_str(&p.body()).unwrap_or(Value::Null);
    if let Some(o) = v.as_object_mut() {
        o.insert("user".into(), json!(format!("user-{}", s.user)));
    }
    v.to_string()
}

/// What the client saw of one request, and which upstream said it served it.
#[derive(Debug, Clone, Default)]
pub struct Outcome {
    pub seen: Seen,
    pub served_by: Option<String>,
}

/// Sends one request on `conn`; returns what was seen and the connection if it can be reused.
fn send_one(conn: Connection, p: &Planned, s: &Shape) -> (Outcome, Option<Connection>) {
    let h = headers(p, s);
    let h: Vec<(&str, &str)> = h.iter().map(|(n, v)| (*n, v.as_str())).collect();
    let body = body(p, s);
    let failed = |e: anyhow::Error| Outcome { seen: Seen { error: Some(format!("{e:#}")), ..Seen::default() }, served_by: None };
    if let Fault::Disconnect(after) = p.fault {
        let stream = match conn.send("POST", p.api.path(), &h, body.as_bytes()) {
            Ok(s) => s,
            Err(e) => return (failed(e), None),
        };
        let served_by = stream.header("x-mock-served-by").map(str::to_string);
        if stream.status != 200 {
            return match stream.collect() {
                Ok(resp) => (Outcome { seen: crate::budget_traffic::seen_from(&resp, p.api.stream()), served_by }, None),
                Err(e) => (failed(e), None),
            };
        }
        let status = stream.status;
        return match stream.abort_after(after) {
            Ok(bytes) => (Outcome { seen: crate::budget_traffic::seen_aborted(status, bytes), served_by }, None),
            Err(e) => (failed(e), None),
        };
    }
    match conn.request("POST", p.api.path(), &h, body.as_bytes()) {
        Ok((resp, conn)) => {
            let seen = crate::budget_traffic::seen_from(&resp, p.api.stream());
            let reusable = resp.complete && !resp.header("connection").is_some_and(|c| c.eq_ignore_ascii_case("close"));
            (Outcome { seen, served_by: resp.header("x-mock-served-by").map(str::to_string) }, reusable.then_some(conn))
        }
        Err(e) => (failed(e), None),
    }
}

// ---------------------------------------------------------------------------------------------
// Samples

/// One sample of Envoy's state.
#[derive(Debug, Clone, Default)]
pub struct Sample {
    /// Seconds since the traffic started.
    pub t_s: f64,
    /// Requests started so far.
    pub requests: u64,
    pub memory_allocated: u64,
    pub memory_heap_size: u64,
    /// Envoy's resident set (`/proc/<pid>/status` VmRSS), bytes.
    pub rss: u64,
    pub fds: u64,
    pub wasm_vms: u64,
    /// Sample lines of `/stats/prometheus`, and those named `sluice_*`.
    pub series: usize,
    pub sluice_series: usize,
    pub downstream_cx: u64,
    pub upstream_cx: u64,
}

/// `name: value` lines of `/stats`.
fn stats_values(text: &str) -> HashMap<&str, u64> {
    text.lines().filter_map(|l| l.split_once(": ")).filter_map(|(n, v)| Some((n.trim(), v.trim().parse().ok()?))).collect()
}

/// The pid of the Envoy running `config`: the process whose command line names it.
fn envoy_pid(config: &Path) -> Option<u32> {
    let want = config.as_os_str().as_encoded_bytes();
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: u32 = e.file_name().to_str()?.parse().ok()?;
        let cmdline = std::fs::read(e.path().join("cmdline")).ok()?;
        cmdline.split(|b| *b == 0).any(|arg| arg == want).then_some(pid)
    })
}

fn rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status.lines().find_map(|l| l.strip_prefix("VmRSS:")).and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok()).map_or(0, |kib| kib * 1024)
}

fn fd_count(pid: u32) -> u64 {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count() as u64)
}

/// Series identities (`name{labels}`) of one exposition.
fn series_set(text: &str) -> BTreeSet<String> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .filter_map(|l| l.rsplit_once(' ').map(|(series, _)| series.to_string()))
        .collect()
}

struct Sampler<'a> {
    gw: &'a FullGateway,
    pid: Option<u32>,
    started: Instant,
}

impl Sampler<'_> {
    fn take(&self, requests: u64) -> Result<(Sample, BTreeSet<String>)> {
        let stats = self.gw.envoy.admin_get("/stats")?;
        let v = stats_values(&stats);
        let get = |n: &str| v.get(n).copied().unwrap_or(0);
        let upstream_cx = ["model_v1", "model_v2", "qwen_v1"].iter().map(|c| get(&format!("cluster.{c}.upstream_cx_active"))).sum();
        let prom = self.gw.envoy.stats_prometheus()?;
        let series = series_set(&prom);
        let sample = Sample {
            t_s: self.started.elapsed().as_secs_f64(),
            requests,
            memory_allocated: get("server.memory_allocated"),
            memory_heap_size: get("server.memory_heap_size"),
            rss: self.pid.map_or(0, rss_bytes),
            fds: self.pid.map_or(0, fd_count),
            wasm_vms: get("wasm.envoy.wasm.runtime.v8.active"),
            series: series.len(),
            sluice_series: series.iter().filter(|s| s.starts_with("sluice_")).count(),
            downstream_cx: get("http.gateway.downstream_cx_active"),
            upstream_cx,
        };
        Ok((sample, series))
    }
}

// ---------------------------------------------------------------------------------------------
// The run

/// What a soak measured and found.
pub struct SoakReport {
    pub samples: Vec<Sample>,
    /// Series first seen after the warm-up, with the second they appeared.
    pub late_series: Vec<(f64, String)>,
    /// Requests sent (the final probes included), by kind and client status.
    pub by_kind: BTreeMap<(String, String), u64>,
    pub requests: usize,
    pub traffic_s: f64,
    pub summary: String,
    pub failures: Failures,
}

impl SoakReport {
    /// Fails with every recorded failure and the summary.
    pub fn verdict(&self) -> Result<()> {
        self.failures.verdict(&self.summary)
    }
}

/// Runs the soak and checks it; the report holds the failures (see [`SoakReport::verdict`]).
pub fn run(cfg: &SoakConfig) -> Result<SoakReport> {
    let latency = latency_policy().to_string();
    let router = router_policy().to_string();
    let budget = budget_policy().to_string();
    let metrics = metrics_policy().to_string();
    let policies =
        [("LATENCY_CONFIG", latency.as_str()), ("ROUTER_CONFIG", router.as_str()), ("BUDGET_CONFIG", budget.as_str()), ("PLUGIN_CONFIG", metrics.as_str())];
    // The shadow mock streams slowly enough that its answers overlap the primaries'.
    let gw = start_full_gateway(&["--ttft-ms", &TTFT_FAST_MS.to_string(), "--tokens", "12", "--itl-ms", "2"], &policies)?;
    let cycle = cycle();
    let pid = envoy_pid(gw.envoy.config_path());
    let addr = gw.envoy.listen_addr();

    let next = AtomicU64::new(0);
    let stop = AtomicBool::new(false);
    let outcomes: Mutex<Vec<(usize, Outcome)>> = Mutex::new(Vec::new());
    let started = Instant::now();
    let sampler = Sampler { gw: &gw, pid, started };
    let mut samples = Vec::new();
    let mut first_seen: BTreeMap<String, f64> = BTreeMap::new();
    let mut sample_errors = Vec::new();

    std::thread::scope(|scope| {
        for _ in 0..cfg.connections {
            let (next, stop, outcomes, cycle) = (&next, &stop, &outcomes, &cycle);
            scope.spawn(move || {
                let mut conn: Option<Connection> = None;
                let mut mine = Vec::new();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed) as usize;
                    // Request i starts no earlier than i / rate: the rate is bounded whatever the latency.
                    let due = Duration::from_secs_f64(i as f64 / cfg.rate_per_s);
                    if due >= cfg.duration || stop.load(Ordering::Relaxed) {
                        break;
                    }
                    if let Some(wait) = due.checked_sub(started.elapsed()) {
                        std::thread::sleep(wait);
                    }
                    let (p, s) = request(i, cycle);
                    let c = match conn.take() {
                        Some(c) => c,
                        None => match Connection::connect(addr) {
                            Ok(c) => c,
                            Err(e) => {
                                mine.push((i, Outcome { seen: Seen { error: Some(format!("connect: {e:#}")), ..Seen::default() }, served_by: None }));
                                continue;
                            }
                        },
                    };
                    let (outcome, keep) = send_one(c, &p, &s);
                    conn = keep;
                    mine.push((i, outcome));
                }
                if let Ok(mut all) = outcomes.lock() {
                    all.extend(mine);
                }
            });
        }
        // The upstreams' default TTFT alternates, v1 and v2 out of phase.
        let (stop_ref, gw_ref) = (&stop, &gw);
        scope.spawn(move || {
            let mut slow_v1 = true;
            while !stop_ref.load(Ordering::Relaxed) {
                let (a, b) = if slow_v1 { (TTFT_SLOW_MS, TTFT_FAST_MS) } else { (TTFT_FAST_MS, TTFT_SLOW_MS) };
                let _ = set_ttft(&gw_ref.v1, a);
                let _ = set_ttft(&gw_ref.v2, b);
                slow_v1 = !slow_v1;
                let until = Instant::now() + TTFT_SHIFT_EVERY;
                while Instant::now() < until && !stop_ref.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(200));
                }
            }
        });
        // Sampling on this thread until the traffic's time is up.
        let mut at = Duration::ZERO;
        while at <= cfg.duration {
            if let Some(wait) = at.checked_sub(started.elapsed()) {
                std::thread::sleep(wait);
            }
            match sampler.take(next.load(Ordering::Relaxed).min((cfg.duration.as_secs_f64() * cfg.rate_per_s) as u64)) {
                Ok((sample, series)) => {
                    for s in series {
                        first_seen.entry(s).or_insert(sample.t_s);
                    }
                    samples.push(sample);
                }
                Err(e) => sample_errors.push(format!("sample at {:.0} s: {e:#}", at.as_secs_f64())),
            }
            at += cfg.sample_every;
        }
        stop.store(true, Ordering::Relaxed);
    });
    let traffic_s = started.elapsed().as_secs_f64();
    let _ = set_ttft(&gw.v1, TTFT_FAST_MS);
    let _ = set_ttft(&gw.v2, TTFT_FAST_MS);

    // One request per tenant after the traffic, one at a time: the budget gauges are then last set
    // by a settlement with nothing else in flight.
    let mut outcomes = outcomes.into_inner().map_err(|_| anyhow!("a traffic thread panicked"))?;
    let sent = outcomes.iter().map(|(i, _)| *i + 1).max().unwrap_or(0);
    let mut probes: Vec<(Planned, Shape)> = Vec::new();
    for (n, tenant) in TENANTS.iter().enumerate() {
        let shape = Shape { tenant, api: Api::ChatWhole, user: n as u64 % 4, tokens: 8, itl_ms: 1, max_tokens: Some(16), words: 3, kind: Kind::Ok, after: 0 };
        let p = planned(format!("soak-final-{tenant}"), &shape);
        let outcome = match Connection::connect(addr) {
            Ok(c) => send_one(c, &p, &shape).0,
            Err(e) => Outcome { seen: Seen { error: Some(format!("{e:#}")), ..Seen::default() }, served_by: None },
        };
        outcomes.push((sent + n, outcome));
        probes.push((p, shape));
    }
    outcomes.sort_by_key(|(i, _)| *i);
    // Streams stalled past the deadline end at the mock a little later: its ledger settles then.
    std::thread::sleep(Duration::from_millis(STALL_TTFT_MS));
    let final_sample = sampler.take(sent as u64).ok().map(|(s, _)| s);

    let plan_of = |i: usize| -> (Planned, Shape) {
        match i.checked_sub(sent).and_then(|k| probes.get(k)) {
            Some(p) => p.clone(),
            None => request(i, &cycle),
        }
    };
    let mut report = check(cfg, &gw, &outcomes, &plan_of, samples, first_seen, final_sample)?;
    for e in sample_errors {
        report.failures.add("sampling", e);
    }
    report.traffic_s = traffic_s;
    if let Some(dir) = &cfg.out_dir {
        write_outputs(dir, cfg, &report)?;
    }
    println!("{}", report.summary);
    Ok(report)
}

fn set_ttft(mock: &MockServer, ms: u64) -> Result<()> {
    let r = http::post_json(mock.addr(), "/mock/ttft", &[], &json!({ "ms": ms }).to_string())?;
    anyhow::ensure!(r.status == 200, "/mock/ttft: {}", r.status);
    Ok(())
}

fn label(check: Check) -> String {
    match check {
        Check::Join => "join",
        Check::Stamp => "budget stamp",
        Check::Strict => "strict",
        Check::Completed => "completed charge",
        Check::Interrupted => "interrupted charge",
        Check::Refused => "refused",
        Check::TooMany => "429",
    }
    .to_string()
}

/// The status class llm-metrics labels a status with.
fn class(status: u64) -> String {
    if status == 0 {
        "none".into()
    } else {
        format!("{}xx", status / 100)
    }
}

#[allow(clippy::too_many_lines)]
fn check(
    cfg: &SoakConfig,
    gw: &FullGateway,
    outcomes: &[(usize, Outcome)],
    plan_of: &dyn Fn(usize) -> (Planned, Shape),
    samples: Vec<Sample>,
    first_seen: BTreeMap<String, f64>,
    final_sample: Option<Sample>,
) -> Result<SoakReport> {
    let mut failures = Failures::default();
    let policy = Policy::parse(&budget_policy().to_string())?;
    let envoy = &gw.envoy;
    let logged = read_logs(&[envoy], outcomes.len())?;
    let lines: HashMap<String, Value> =
        envoy.access_log().entries()?.into_iter().filter_map(|l| Some((l.get("request_id")?.as_str()?.to_string(), l))).collect();
    let v1 = read_mock_ledger(&gw.v1)?;
    let v2 = read_mock_ledger(&gw.v2)?;
    let shadow = read_mock_ledger(&gw.shadow)?;
    let mut heads: HashMap<String, usize> = HashMap::new();
    for mock in [&gw.v1, &gw.v2] {
        for h in mock.heads()? {
            if let Some(id) = h.request_id {
                *heads.entry(id).or_insert(0) += 1;
            }
        }
    }
    for id in v1.keys() {
        if v2.contains_key(id) {
            failures.add("join", format!("{id}: served by both v1 and v2"));
        }
    }
    let mut upstream = v1.clone();
    upstream.extend(v2.iter().map(|(k, r)| (k.clone(), r.clone())));
    let records = Records { logged, upstream };
    let name: &dyn Fn(Check) -> String = &label;
    let mut tally = Tally::new(&policy, name);

    // Counts the metrics must equal.
    let mut requests_by: BTreeMap<(String, String, String), u64> = BTreeMap::new();
    let mut client_by: BTreeMap<(String, String), u64> = BTreeMap::new();
    let mut llm_outcomes: BTreeMap<String, u64> = BTreeMap::new();
    let mut latency_by: BTreeMap<(String, String, String), u64> = BTreeMap::new();
    let mut by_kind: BTreeMap<(String, String), u64> = BTreeMap::new();
    let mut charges_by_key: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    let mut rejections_by_key: BTreeMap<String, u64> = BTreeMap::new();
    // (key, start ms, duration ms, input, output, µUSD) of every admitted request.
    let mut charge_at: Vec<(String, i64, u64, u64, u64, u64)> = Vec::new();
    let mut plans = Vec::new();

    for (i, o) in outcomes {
        let (p, s) = plan_of(*i);
        plans.push(p.clone());
        let seen = &o.seen;
        let status_name = seen.status.map_or_else(|| "no response".to_string(), |s| s.to_string());
        *by_kind.entry((s.kind.name().to_string(), status_name)).or_insert(0) += 1;
        if let Some(e) = &seen.error {
            failures.add("client", format!("{}: {e}", p.id));
        }
        let Some(r) = tally.join(&p, seen, &records, &mut failures) else { continue };
        let Some(line) = lines.get(&p.id) else { continue };
        let get = |field: &str| stamp(line, field).ok().flatten().unwrap_or(Value::Null);
        let (route, lat, llm, bud) = (get("route"), get("latency"), get("sluice"), r.stamp.clone());
        let log_status = r.log.status.unwrap_or(0);
        let llm_status = llm.get("status").and_then(Value::as_u64).unwrap_or(0);
        let id = &p.id;

        // One status: the client's, the access log's and every plugin's.
        if let Some(client) = seen.status {
            failures.that("status", u64::from(client) == log_status, || format!("{id}: client got {client}, access log says {log_status}"));
        }
        for (who, st) in [("llm", &llm), ("latency", &lat), ("budget", &bud)] {
            let got = st.get("status").and_then(Value::as_u64);
            failures.that("status", got == Some(log_status), || format!("{id}: {who} stamp status {got:?}, access log {log_status}: {st}"));
        }

        // One version, named alike by every plugin, served by its own cluster.
        let version = stamp_str(&route, "version").to_string();
        failures.that("version", version == "v1" || version == "v2", || format!("{id}: route stamp names no version: {route}"));
        failures.that("version", stamp_str(&lat, "version") == version, || format!("{id}: latency version {lat} ≠ route {version}"));
        failures.that("version", stamp_str(&llm, "model_version") == version, || format!("{id}: llm model_version {llm} ≠ route {version}"));
        let ledger = if version == "v2" { &v2 } else { &v1 };
        let other = if version == "v2" { &v1 } else { &v2 };
        failures.that("version", !other.contains_key(id), || format!("{id}: routed to {version}, served by the other version"));
        if let Some(by) = &o.served_by {
            failures.that("version", *by == format!("llama-{version}"), || format!("{id}: x-mock-served-by {by}, routed to {version}"));
        }

        // What each kind of request must come to, in every stamp.
        let refused = r.decision == "rejected";
        let llm_outcome = stamp_str(&llm, "outcome").to_string();
        let lat_outcome = stamp_str(&lat, "outcome").to_string();
        let bud_outcome = stamp_str(&bud, "outcome").to_string();
        let outcomes3 = (llm_outcome.as_str(), lat_outcome.as_str(), bud_outcome.as_str());
        let whole_cut = !p.api.stream() && s.kind == Kind::Reset;
        let expected: &[(&str, &str, &str)] = if refused {
            &[("refused", "refused", "refused")]
        } else {
            match s.kind {
                Kind::Ok => &[("completed", "ok", "completed")],
                // Envoy may have sent the whole (short) rest before the close reached it.
                Kind::Disconnect => &[("client_disconnect", "client_disconnect", "client_disconnect"), ("completed", "ok", "completed")],
                Kind::Reset | Kind::Error500 | Kind::ErrorEvent => &[("upstream_error", "error", "upstream_error")],
                Kind::Stall => &[("deadline", "ttft", "deadline")],
            }
        };
        failures.that("outcome", expected.contains(&outcomes3), || {
            format!("{id}: {} {:?}: outcomes (llm, latency, budget) {outcomes3:?}, want one of {expected:?}", s.kind.name(), p.api)
        });
        let want_status: Option<u16> = match s.kind {
            _ if refused => Some(429),
            Kind::Error500 => Some(500),
            Kind::Stall => Some(504),
            // A whole answer cut before its head is Envoy's 503.
            Kind::Reset if whole_cut => Some(503),
            _ => Some(200),
        };
        failures.that("status", seen.status == want_status || seen.error.is_some(), || {
            format!("{id}: {}: client status {:?}, want {want_status:?}", s.kind.name(), seen.status)
        });
        if refused {
            failures.that("refused", p.key == OVER_BUDGET_TENANT, || format!("{id}: {} refused: {bud}", p.key));
            failures.that("refused", !heads.contains_key(id), || format!("{id}: refused, but its head reached an upstream"));
            tally.check_refusal(&r, &mut failures);
            let code = error_fields(&seen.body).1;
            failures.that("refused", code.is_empty() || stamp_str(&bud, "reject_code") == code, || format!("{id}: body code {code:?}, stamp {bud}"));
            *rejections_by_key.entry(p.key.to_string()).or_insert(0) += 1;
        } else if r.admitted() {
            let admitted = tally.check_admitted(&r, &mut failures);
            if admitted.completed.is_some() {
                failures.that("completed charge", seen.status == Some(200), || format!("{id}: completed upstream, client status {:?}", seen.status));
            }
            // The budget charged what llm-metrics measured (for an answer that counts), at the same price.
            if log_status < 400 {
                for (b, l) in [("input_tokens", "input_tokens"), ("output_tokens", "output_tokens"), ("charged_micro_usd", "cost_micro_usd")] {
                    let (bv, lv) = (stamp_u64(&bud, b), stamp_u64(&llm, l));
                    failures.that("plugins agree", bv == lv, || {
                        format!("{id}: {} {:?}: budget {b} {bv:?} ≠ llm {l} {lv:?}; the mock: {:?}", s.kind.name(), p.api, ledger.get(id))
                    });
                }
            } else {
                failures.that("refused", r.charged == 0 && r.micro_usd == 0, || format!("{id}: status {log_status} charged: {bud}"));
            }
            // The mock's record is in the ledger of the version that served it.
            if s.kind != Kind::Stall || ledger.contains_key(id) {
                failures.that("join", ledger.contains_key(id), || format!("{id}: admitted to {version}, no record in its mock's ledger"));
            }
            let e = charges_by_key.entry(p.key.to_string()).or_insert((0, 0));
            e.0 += r.charged;
            e.1 += r.micro_usd;
            if let Some(start) = r.log.start_ms {
                charge_at.push((p.key.to_string(), start, r.log.duration_ms, r.input, r.output, r.micro_usd));
            }
        } else {
            failures.add("budget stamp", format!("{id}: decision {:?}: {bud}", r.decision));
        }

        let tenant = stamp_str(&llm, "tenant").to_string();
        failures.that("labels", tenant == p.key, || format!("{id}: llm tenant {tenant:?}, sent as {}", p.key));
        *requests_by.entry((tenant.clone(), version.clone(), class(llm_status))).or_insert(0) += 1;
        *client_by.entry((p.key.to_string(), class(seen.status.map_or(0, u64::from)))).or_insert(0) += 1;
        *llm_outcomes.entry(llm_outcome).or_insert(0) += 1;
        *latency_by.entry((version, stamp_str(&lat, "class").to_string(), lat_outcome)).or_insert(0) += 1;
    }
    tally.check_unplanned(&plans, &records, &mut failures);
    // Every shadow answered for a request of the run.
    let planned: std::collections::HashSet<&str> = plans.iter().map(|p| p.id.as_str()).collect();
    for id in shadow.keys() {
        failures.that("shadow", planned.contains(id.as_str()), || format!("the shadow served {id:?}, no request of the run"));
    }

    // The counters: after the last flush they equal what the requests add up to.
    let metric_checks = |m: &Metrics| -> Vec<String> {
        let mut bad = Vec::new();
        let mut want = |what: String, got: Option<f64>, n: u64| {
            if got.unwrap_or(0.0) != n as f64 {
                bad.push(format!("{what} = {got:?}, the requests add up to {n}"));
            }
        };
        for ((tenant, version, status), n) in &requests_by {
            let l = [("tenant", tenant.as_str()), ("model_version", version.as_str()), ("status", status.as_str())];
            want(format!("sluice_requests_total{{tenant={tenant},model_version={version},status={status}}}"), m.value("sluice_requests_total", &l), *n);
        }
        let total: u64 = requests_by.values().sum();
        want("sluice_requests_total".into(), m.value("sluice_requests_total", &[]), total);
        for ((tenant, status), n) in &client_by {
            let l = [("tenant", tenant.as_str()), ("status", status.as_str())];
            want(format!("sluice_requests_total{{tenant={tenant},status={status}}} (client statuses)"), m.value("sluice_requests_total", &l), *n);
        }
        let count = |o: &str| llm_outcomes.get(o).copied().unwrap_or(0);
        want("sluice_client_disconnects_total".into(), m.value("sluice_client_disconnects_total", &[]), count("client_disconnect"));
        want("sluice_upstream_errors_total".into(), m.value("sluice_upstream_errors_total", &[]), count("upstream_error"));
        want("sluice_gateway_replies_total{reason=refused}".into(), m.value("sluice_gateway_replies_total", &[("reason", "refused")]), count("refused"));
        want("sluice_gateway_replies_total{reason=deadline}".into(), m.value("sluice_gateway_replies_total", &[("reason", "deadline")]), count("deadline"));
        for ((version, class, outcome), n) in &latency_by {
            let l = [("version", version.as_str()), ("class", class.as_str()), ("outcome", outcome.as_str())];
            want(
                format!("sluice_latency_requests_total{{version={version},class={class},outcome={outcome}}}"),
                m.value("sluice_latency_requests_total", &l),
                *n,
            );
        }
        for tenant in TENANTS {
            let (tokens, micro_usd) = charges_by_key.get(tenant).copied().unwrap_or((0, 0));
            want(format!("sluice_budget_charged_tokens_total{{key={tenant}}}"), m.value("sluice_budget_charged_tokens_total", &[("key", tenant)]), tokens);
            want(
                format!("sluice_budget_charged_micro_usd_total{{key={tenant}}}"),
                m.value("sluice_budget_charged_micro_usd_total", &[("key", tenant)]),
                micro_usd,
            );
            let rejected = rejections_by_key.get(tenant).copied().unwrap_or(0);
            want(format!("sluice_budget_rejections_total{{key={tenant}}}"), m.value("sluice_budget_rejections_total", &[("key", tenant)]), rejected);
        }
        // Nothing is left in flight.
        for s in m.series("sluice_in_flight").chain(m.series("sluice_latency_in_flight")) {
            if s.value != 0.0 {
                bad.push(format!("{} {:?} = {} after the traffic ended", s.name, s.labels, s.value));
            }
        }
        bad
    };
    let metrics = crate::wait_until(Duration::from_secs(15), "the counters to match the requests", || {
        let m = envoy.metrics()?;
        Ok(metric_checks(&m).is_empty().then_some(m))
    })
    .or_else(|_| envoy.metrics())?;
    for bad in metric_checks(&metrics) {
        failures.add("counters", bad);
    }

    // The budget gauges of day and month windows: limit − the charges of the run (nothing is
    // reserved once the final probes settled). Only where every charge lies in the probe's window.
    let now_ms = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64);
    let mut gauges_checked = 0;
    for b in policy.budgets.iter().filter(|b| matches!(b.window, Window::Day | Window::Month)) {
        let keys: Vec<&str> = TENANTS.iter().copied().filter(|k| policy.applies(b, k)).collect();
        let mine: Vec<&(String, i64, u64, u64, u64, u64)> = charge_at.iter().filter(|c| keys.contains(&c.0.as_str())).collect();
        if mine.iter().any(|c| b.window.of(c.1) != b.window.of(now_ms) || b.window.of(c.1 + c.2 as i64 + 500) != b.window.of(now_ms)) {
            continue;
        }
        let used: u64 = mine.iter().map(|c| b.measure.amount(c.3, c.4, c.5)).sum();
        let unit = match b.measure {
            crate::budget_traffic::Measure::MicroUsd => "micro_usd",
            crate::budget_traffic::Measure::OutputTokens => "output_tokens",
            crate::budget_traffic::Measure::InputTokens => "input_tokens",
            crate::budget_traffic::Measure::TotalTokens => "total_tokens",
            crate::budget_traffic::Measure::Requests => "requests",
        };
        let labels = [(b.level, b.id.as_str()), ("window", b.window.name()), ("unit", unit)];
        let got = metrics.value("sluice_budget_remaining", &labels);
        let want = b.limit.saturating_sub(used);
        failures.that("budget gauges", got == Some(want as f64), || {
            format!("sluice_budget_remaining{{{} {}}} = {got:?}, limit − charges = {want}", b.describe(), unit)
        });
        gauges_checked += 1;
    }

    // Flat after the warm-up.
    let warm: Vec<&Sample> = samples.iter().filter(|s| s.t_s >= cfg.warmup.as_secs_f64()).collect();
    let quarter = (warm.len() / 4).max(1);
    let (first, last) = (warm.get(..quarter).unwrap_or(&[]), warm.get(warm.len().saturating_sub(quarter)..).unwrap_or(&[]));
    let max_of = |set: &[&Sample], f: &dyn Fn(&Sample) -> u64| set.iter().map(|s| f(s)).max().unwrap_or(0);
    let mut flat_lines = Vec::new();
    if warm.len() < 8 {
        failures.add("flat", format!("only {} samples after the warm-up", warm.len()));
    }
    type Measured = (&'static str, fn(&Sample) -> u64, bool);
    let measured: [Measured; 6] = [
        ("server.memory_allocated", |s| s.memory_allocated, true),
        ("server.memory_heap_size", |s| s.memory_heap_size, true),
        ("resident set", |s| s.rss, true),
        ("open fds", |s| s.fds, false),
        ("downstream connections", |s| s.downstream_cx, false),
        ("upstream connections", |s| s.upstream_cx, false),
    ];
    for (what, f, memory) in measured {
        let (a, b) = (max_of(first, &f), max_of(last, &f));
        let bound = if memory { (a as f64 * (1.0 + MEMORY_SLACK_FRACTION)) as u64 + MEMORY_SLACK_BYTES } else { a + FD_SLACK };
        flat_lines.push(format!("  {what:<24} first quarter max {a:>11}, last quarter max {b:>11}, bound {bound:>11}"));
        failures.that("flat", b <= bound, || format!("{what}: last quarter's max {b} > {bound} (first quarter's max {a})"));
    }
    let downstream_max = samples.iter().map(|s| s.downstream_cx).max().unwrap_or(0);
    failures
        .that("flat", downstream_max <= cfg.connections as u64 + 2, || format!("{downstream_max} downstream connections open, {} clients", cfg.connections));
    let warm_end = warm.first().map_or(f64::MAX, |s| s.t_s);
    let late_series: Vec<(f64, String)> = first_seen.iter().filter(|(_, t)| **t > warm_end).map(|(s, t)| (*t, s.clone())).collect();
    failures.that("series", late_series.is_empty(), || {
        format!("{} series first seen after the warm-up: {:?}", late_series.len(), late_series.iter().take(20).collect::<Vec<_>>())
    });
    // No label takes per-request values.
    let mut values: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for s in metrics.samples.iter().filter(|s| s.name.starts_with("sluice_")) {
        for (k, v) in &s.labels {
            if k != "le" {
                values.entry(k.clone()).or_default().insert(v.clone());
            }
        }
    }
    for (k, vs) in &values {
        failures.that("series", vs.len() <= MAX_LABEL_VALUES, || format!("label {k} took {} values: {:?}", vs.len(), vs.iter().take(30).collect::<Vec<_>>()));
    }

    // The summary.
    let mut summary = String::new();
    let n = outcomes.len();
    let _ = writeln!(
        summary,
        "\nsoak {}: {n} requests ({} final probes), {} samples, Envoy pid {:?}",
        cfg.name,
        TENANTS.len(),
        samples.len(),
        envoy_pid(envoy.config_path())
    );
    let _ = writeln!(summary, "by kind and client status: {by_kind:?}");
    let _ = writeln!(summary, "llm-metrics outcomes: {llm_outcomes:?}");
    let _ =
        writeln!(summary, "budget: charged (tokens, µUSD) by key {charges_by_key:?}; refused {rejections_by_key:?}; {gauges_checked} day/month gauges checked");
    let _ = writeln!(summary, "mock ledgers: v1 {}, v2 {}, shadow {}", v1.len(), v2.len(), shadow.len());
    let _ = writeln!(summary, "flatness after {} s of warm-up ({} samples, quarters of {quarter}):", cfg.warmup.as_secs(), warm.len());
    for l in &flat_lines {
        let _ = writeln!(summary, "{l}");
    }
    let series_at = |set: &[&Sample]| (set.first().map_or(0, |s| s.series), set.last().map_or(0, |s| s.series));
    let _ = writeln!(
        summary,
        "  series {:?} (first quarter) → {:?} (last quarter); sluice_* at the end {}; {} first seen after the warm-up",
        series_at(first),
        series_at(last),
        samples.last().map_or(0, |s| s.sluice_series),
        late_series.len()
    );
    for (t, s) in late_series.iter().take(40) {
        let _ = writeln!(summary, "  late series at {t:.0} s: {s}");
    }
    if let Some(f) = &final_sample {
        let _ = writeln!(
            summary,
            "  after the traffic: memory_allocated {}, rss {}, fds {}, connections {}↓ {}↑",
            f.memory_allocated, f.rss, f.fds, f.downstream_cx, f.upstream_cx
        );
    }
    let _ = writeln!(summary, "{}", sample_table(&samples, Duration::from_secs(if cfg.duration >= Duration::from_secs(300) { 60 } else { 10 })));
    let _ = writeln!(summary, "Envoy stderr (tail):\n{}", envoy.stderr_tail(15));
    Ok(SoakReport { samples, late_series, by_kind, requests: n, traffic_s: 0.0, summary, failures })
}

// ---------------------------------------------------------------------------------------------
// Output: the table and the SVG

fn mib(b: u64) -> f64 {
    b as f64 / (1024.0 * 1024.0)
}

/// The samples nearest each multiple of `every`, as a Markdown table.
pub fn sample_table(samples: &[Sample], every: Duration) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "| t (s) | requests | memory_allocated (MiB) | heap_size (MiB) | RSS (MiB) | fds | wasm VMs | series | sluice_* series | conns ↓ | conns ↑ |"
    );
    let _ = writeln!(out, "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let step = every.as_secs_f64().max(1.0);
    let mut next = 0.0;
    for (k, s) in samples.iter().enumerate() {
        let last = k + 1 == samples.len();
        if s.t_s + 0.5 < next && !last {
            continue;
        }
        next = (s.t_s / step).floor() * step + step;
        let _ = writeln!(
            out,
            "| {:.0} | {} | {:.1} | {:.1} | {:.1} | {} | {} | {} | {} | {} | {} |",
            s.t_s,
            s.requests,
            mib(s.memory_allocated),
            mib(s.memory_heap_size),
            mib(s.rss),
            s.fds,
            s.wasm_vms,
            s.series,
            s.sluice_series,
            s.downstream_cx,
            s.upstream_cx
        );
    }
    out
}

/// Two panels over time: memory (allocated, heap, resident; MiB) and series (all, sluice_*).
pub fn svg(samples: &[Sample], title: &str) -> String {
    let (w, h, pad_l, pad_r, pad_t, panel_h, gap) = (720.0, 440.0, 64.0, 150.0, 34.0, 160.0, 50.0);
    let t_max = samples.iter().map(|s| s.t_s).fold(1.0_f64, f64::max);
    let plot_w = w - pad_l - pad_r;
    let mut out = String::new();
    let _ = writeln!(out, r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="11">"#);
    let _ = writeln!(out, r#"<rect width="{w}" height="{h}" fill="white"/>"#);
    let _ = writeln!(out, r#"<text x="{pad_l}" y="18" font-size="13">{}</text>"#, escape(title));
    type Line = (&'static str, &'static str, fn(&Sample) -> f64);
    let panels: [(&str, Vec<Line>); 2] = [
        (
            "MiB",
            vec![
                ("memory_allocated", "#1f77b4", |s: &Sample| mib(s.memory_allocated)),
                ("memory_heap_size", "#ff7f0e", |s: &Sample| mib(s.memory_heap_size)),
                ("resident set", "#2ca02c", |s: &Sample| mib(s.rss)),
            ],
        ),
        ("series", vec![("/stats/prometheus", "#9467bd", |s: &Sample| s.series as f64), ("sluice_*", "#d62728", |s: &Sample| s.sluice_series as f64)]),
    ];
    for (p, (unit, lines)) in panels.iter().enumerate() {
        let top = pad_t + p as f64 * (panel_h + gap);
        let y_max = lines.iter().flat_map(|(_, _, f)| samples.iter().map(f)).fold(1.0_f64, f64::max) * 1.1;
        let x = |t: f64| pad_l + t / t_max * plot_w;
        let y = |v: f64| top + panel_h - v / y_max * panel_h;
        let _ = writeln!(out, r##"<rect x="{pad_l}" y="{top}" width="{plot_w}" height="{panel_h}" fill="none" stroke="#999"/>"##);
        for k in 0..=4 {
            let v = y_max * f64::from(k) / 4.0;
            let _ = writeln!(out, r##"<line x1="{pad_l}" x2="{}" y1="{:.1}" y2="{:.1}" stroke="#eee"/>"##, pad_l + plot_w, y(v), y(v));
            let _ = writeln!(
                out,
                r#"<text x="{}" y="{:.1}" text-anchor="end">{}</text>"#,
                pad_l - 4.0,
                y(v) + 4.0,
                if y_max > 100.0 { format!("{v:.0}") } else { format!("{v:.1}") }
            );
        }
        for k in 0..=5 {
            let t = t_max * f64::from(k) / 5.0;
            let label = if t_max >= 300.0 { format!("{:.0} min", t / 60.0) } else { format!("{t:.0} s") };
            let _ = writeln!(out, r#"<text x="{:.1}" y="{}" text-anchor="middle">{label}</text>"#, x(t), top + panel_h + 14.0);
        }
        let _ =
            writeln!(out, r#"<text x="14" y="{}" transform="rotate(-90 14 {})" text-anchor="middle">{unit}</text>"#, top + panel_h / 2.0, top + panel_h / 2.0);
        for (n, (name, color, f)) in lines.iter().enumerate() {
            let points: Vec<String> = samples.iter().map(|s| format!("{:.1},{:.1}", x(s.t_s), y(f(s)))).collect();
            let _ = writeln!(out, r#"<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{}"/>"#, points.join(" "));
            let ly = top + 14.0 + n as f64 * 16.0;
            let _ =
                writeln!(out, r#"<line x1="{}" x2="{}" y1="{ly}" y2="{ly}" stroke="{color}" stroke-width="2"/>"#, pad_l + plot_w + 10.0, pad_l + plot_w + 28.0);
            let _ = writeln!(out, r#"<text x="{}" y="{}">{}</text>"#, pad_l + plot_w + 32.0, ly + 4.0, escape(name));
        }
    }
    out.push_str("</svg>\n");
    out
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

fn write_outputs(dir: &Path, cfg: &SoakConfig, report: &SoakReport) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let title = format!(
        "sluice soak, {}: {} requests in {:.0} s through the full chain (samples every {} s)",
        cfg.name,
        report.requests,
        report.traffic_s,
        cfg.sample_every.as_secs()
    );
    let svg_path = dir.join(format!("soak-{}.svg", cfg.name));
    std::fs::write(&svg_path, svg(&report.samples, &title)).with_context(|| format!("writing {}", svg_path.display()))?;
    let md_path = dir.join(format!("soak-{}.md", cfg.name));
    let mut md = format!("{title}\n\n");
    md.push_str(&sample_table(&report.samples, Duration::from_secs(60)));
    md.push_str("\n```\n");
    md.push_str(&report.summary);
    md.push_str("\n```\n");
    std::fs::write(&md_path, md).with_context(|| format!("writing {}", md_path.display()))?;
    println!("soak: wrote {} and {}", svg_path.display(), md_path.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn the_cycle_mixes_every_tenant_api_and_fault() {
        let c = cycle();
        assert_eq!(c.len(), CYCLE);
        for t in TENANTS {
            assert!(c.iter().filter(|s| s.tenant == t).count() >= 5, "{t}");
        }
        for k in [Kind::Ok, Kind::Disconnect, Kind::Reset, Kind::Error500, Kind::ErrorEvent, Kind::Stall] {
            assert!(c.iter().any(|s| s.kind == k), "{k:?}");
        }
        assert!(c.iter().all(|s| s.kind != Kind::Disconnect || s.api.stream()));
        // Each round is a permutation of the cycle.
        let round: BTreeSet<String> = (CYCLE..2 * CYCLE).map(|i| format!("{:?}", request(i, &c).1)).collect();
        let all: BTreeSet<String> = c.iter().map(|s| format!("{s:?}")).collect();
        assert_eq!(round, all);
        assert_ne!(format!("{:?}", request(0, &c).1), format!("{:?}", request(CYCLE, &c).1));
    }

    #[test]
    fn series_identities_leave_out_values_and_comments() {
        let set = series_set("# TYPE x counter\nx{a=\"1\"} 3\nx{a=\"2\"} 4 1700000000\ny 1\n");
        assert_eq!(set.len(), 3);
        assert!(set.contains("y") && set.contains("x{a=\"1\"}"));
    }

    #[test]
    fn the_svg_has_a_line_per_measure() {
        let s = |t: f64, m: u64| Sample { t_s: t, memory_allocated: m, series: 10, ..Sample::default() };
        let text = svg(&[s(0.0, 1 << 20), s(5.0, 2 << 20)], "t <1>");
        assert_eq!(text.matches("<polyline").count(), 5);
        assert!(text.contains("t &lt;1&gt;"));
    }
}
