//! tenant-budget under concurrency in real Envoy: 2 worker threads, 64 kept-alive client
//! connections, 3,000 requests across seven keys in two orgs, several of them driven past their
//! limits, with client disconnects and upstream resets mixed in. Afterwards three records of every
//! request are joined by `x-request-id` — what the client received, what the plugin stamped in the
//! access log (`budget` field), and what the mock upstream produced (`GET /mock/requests`) — and
//! checked:
//!
//! (a) completed requests are charged exactly the usage the mock reported;
//! (b) interrupted ones (client disconnect, upstream reset) between the content tokens the client
//!     received and the tokens the mock flushed;
//! (c) a 429 never reaches the upstream, and everything that did was admitted;
//! (d) per key, the stamps add up to the plugin's own counters;
//! (e) strict mode: no org, team or key exceeds any hard limit in any window (zero overshoot);
//! (f) the run was meaningful: limits were reached, and most traffic was admitted.
//!
//! The traffic is reproducible (a fixed-seed xorshift decides every request); which requests get
//! rejected depends on timing, so the assertions are about invariants, not about exact figures.
//! The figures are printed at the end (`cargo test -p sluice-e2e --test budget_concurrency --
//! --nocapture`), also when the test fails.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use serde_json::{json, Value};
use sluice_e2e::gateway::{budget_e2e_policy, demo_plugin_config, start_budget_gateway};
use sluice_e2e::tools::wasm_dir;
use sluice_e2e::{wait_until, Connection, Envoy, MockRequest, MockServer, StreamedResponse, Tools};
use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

const SEED: u64 = 0x5eed_0b0d_9e7c_0ffe;
const REQUESTS: usize = 3000;
const CONNECTIONS: usize = 64;
/// No new request is started after this; the test fails if fewer than 2,000 were sent.
const TRAFFIC_DEADLINE: Duration = Duration::from_secs(60);
/// A request may be settled into the window of any instant from its start to its end plus this
/// (admission happens after the start; settlement at the end; the access log's duration is rounded).
const WINDOW_SLACK_MS: i64 = 500;

const CHAT: &str = "/v1/chat/completions";
const MESSAGES: &str = "/v1/messages";

/// Keys and their share of the traffic. Metered keys get more traffic than their budgets pay
/// for; `ads-rt` and `labs-open` have budgets far above what the run spends, so most requests are
/// admitted; `search-batch` has no budget of its own and is stopped by its team's.
const KEYS: [(&str, u64); 7] = [
    ("search-prod", 10),
    ("search-dev", 7),
    ("search-batch", 10),
    ("ads-batch", 8),
    ("ads-rt", 22),
    ("labs-metered", 8),
    ("labs-open", 35),
];

// ---------------------------------------------------------------------------------------------
// The traffic plan

/// xorshift64*: small, deterministic, good enough to pick test traffic.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    /// Uniform in `lo..=hi`.
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }
    /// True with probability `percent`/100.
    fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Api {
    /// OpenAI chat, streamed, with `stream_options.include_usage`.
    ChatStreamUsage,
    /// OpenAI chat, streamed, without: the plugin must inject it upstream and hide the usage chunk.
    ChatStream,
    ChatWhole,
    MessagesStream,
    MessagesWhole,
}

impl Api {
    fn path(self) -> &'static str {
        match self {
            Api::ChatStreamUsage | Api::ChatStream | Api::ChatWhole => CHAT,
            Api::MessagesStream | Api::MessagesWhole => MESSAGES,
        }
    }
    fn stream(self) -> bool {
        matches!(self, Api::ChatStreamUsage | Api::ChatStream | Api::MessagesStream)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    None,
    /// Read at least this many body bytes, then drop the connection.
    Disconnect(usize),
    /// `x-mock-fail: reset-after:N`.
    Reset(u64),
}

#[derive(Debug, Clone)]
struct Planned {
    id: String,
    key: &'static str,
    api: Api,
    /// `x-mock-tokens`: content tokens the mock would send without an output limit.
    tokens: u64,
    ttft_ms: u64,
    itl_ms: u64,
    max_tokens: Option<u64>,
    user_text: String,
    fault: Fault,
}

impl Planned {
    fn body(&self) -> String {
        let mut body = match self.api {
            Api::ChatStreamUsage | Api::ChatStream | Api::ChatWhole => json!({
                "model": "llama-3-70b",
                "stream": self.api.stream(),
                "messages": [{"role": "system", "content": "You are terse."},
                             {"role": "user", "content": self.user_text}],
            }),
            Api::MessagesStream | Api::MessagesWhole => json!({
                "model": "claude-3-5-haiku",
                "stream": self.api.stream(),
                "system": "You are terse.",
                "messages": [{"role": "user", "content": self.user_text}],
            }),
        };
        if self.api == Api::ChatStreamUsage {
            body["stream_options"] = json!({"include_usage": true});
        }
        if let Some(m) = self.max_tokens {
            body["max_tokens"] = json!(m);
        }
        body.to_string()
    }

    fn headers(&self) -> Vec<(&'static str, String)> {
        let mut h = vec![
            ("x-request-id", self.id.clone()),
            ("x-sluice-key", self.key.to_string()),
            ("x-mock-ttft-ms", self.ttft_ms.to_string()),
            ("x-mock-itl-ms", self.itl_ms.to_string()),
            ("x-mock-tokens", self.tokens.to_string()),
        ];
        if let Fault::Reset(n) = self.fault {
            h.push(("x-mock-fail", format!("reset-after:{n}")));
        }
        h
    }
}

fn plan_traffic(n: usize, seed: u64) -> Vec<Planned> {
    let mut rng = Rng(seed);
    let total_weight: u64 = KEYS.iter().map(|(_, w)| w).sum();
    let words = ["budget", "tenant", "stream", "token", "window", "ledger", "model", "quota"];
    (0..n)
        .map(|i| {
            let mut pick = rng.range(0, total_weight - 1);
            let key = KEYS
                .iter()
                .find(|(_, w)| {
                    let hit = pick < *w;
                    pick = pick.saturating_sub(*w);
                    hit
                })
                .map_or("labs-open", |(k, _)| k);
            let api = match rng.range(0, 99) {
                0..=29 => Api::ChatStreamUsage,
                30..=54 => Api::ChatStream,
                55..=74 => Api::ChatWhole,
                75..=89 => Api::MessagesStream,
                _ => Api::MessagesWhole,
            };
            let tokens = rng.range(5, 60);
            let max_tokens = match api {
                // Anthropic requires max_tokens; sometimes below the answer's length (truncation).
                Api::MessagesStream | Api::MessagesWhole => Some(if rng.chance(70) { 64 } else { rng.range(20, 80) }),
                _ if rng.chance(40) => Some(rng.range(tokens.saturating_sub(10).max(1), 80)),
                _ => None,
            };
            let user_text = (0..rng.range(1, 20))
                .map(|_| words[rng.range(0, words.len() as u64 - 1) as usize])
                .collect::<Vec<_>>()
                .join(" ");
            // ≈5 % disconnects (streams only) and ≈5 % resets overall.
            let roll = rng.range(0, 99);
            let fault = if api.stream() && roll < 7 {
                Fault::Disconnect(rng.range(64, 64 + tokens * 80) as usize)
            } else if (10..15).contains(&roll) {
                Fault::Reset(rng.range(0, tokens))
            } else {
                Fault::None
            };
            Planned {
                id: format!("budget-e2e-{i:05}"),
                key,
                api,
                tokens,
                ttft_ms: rng.range(0, 5),
                itl_ms: rng.range(0, 2),
                max_tokens,
                user_text,
                fault,
            }
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Running it

/// What the client saw of one request.
#[derive(Debug, Clone, Default)]
struct Seen {
    status: Option<u16>,
    /// The body ended as framed (false when cut by a reset, or dropped by us).
    complete: bool,
    /// We dropped the connection mid-body.
    aborted: bool,
    /// Content tokens in complete events (streams) or in the whole body (JSON).
    received_tokens: u64,
    /// A usage object reached the client.
    usage_seen: bool,
    retry_after: Option<String>,
    body: Vec<u8>,
    error: Option<String>,
}

/// Content tokens (`tok<digits>`) in `bytes`: `tok` followed by a digit never occurs elsewhere in
/// the mock's answers (ids are hex, usage fields are `…_tokens`).
fn count_tokens(bytes: &[u8]) -> u64 {
    bytes
        .windows(4)
        .filter(|w| &w[..3] == b"tok" && w[3].is_ascii_digit())
        .count() as u64
}

/// The prefix of an SSE body made of complete events (up to the last blank line).
fn complete_events(bytes: &[u8]) -> &[u8] {
    let normalized_end = bytes
        .windows(2)
        .rposition(|w| w == b"\n\n")
        .map(|p| p + 2)
        .or_else(|| bytes.windows(4).rposition(|w| w == b"\r\n\r\n").map(|p| p + 4))
        .unwrap_or(0);
    &bytes[..normalized_end]
}

fn seen_from(resp: &StreamedResponse, stream: bool) -> Seen {
    let body = resp.body();
    // A cut JSON body proves nothing; a cut stream proves its complete events.
    let counted = match (resp.complete, stream) {
        (true, _) => &body[..],
        (false, true) => complete_events(&body),
        (false, false) => &[][..],
    };
    Seen {
        status: Some(resp.status),
        complete: resp.complete,
        aborted: false,
        received_tokens: if resp.status == 200 { count_tokens(counted) } else { 0 },
        usage_seen: String::from_utf8_lossy(&body).contains("\"usage\":{"),
        retry_after: resp.header("retry-after").map(str::to_string),
        body,
        error: None,
    }
}

/// Sends one request on `conn`; returns what was seen and the connection if it can be reused.
fn run_one(conn: Connection, p: &Planned) -> (Seen, Option<Connection>) {
    let headers = p.headers();
    let headers: Vec<(&str, &str)> = headers.iter().map(|(n, v)| (*n, v.as_str())).collect();
    let body = p.body();
    let failed = |e: anyhow::Error| Seen {
        error: Some(format!("{e:#}")),
        ..Seen::default()
    };
    if let Fault::Disconnect(after) = p.fault {
        let stream = match conn.send("POST", p.api.path(), &headers, body.as_bytes()) {
            Ok(s) => s,
            Err(e) => return (failed(e), None),
        };
        if stream.status != 200 {
            return match stream.collect() {
                Ok(resp) => (seen_from(&resp, p.api.stream()), None),
                Err(e) => (failed(e), None),
            };
        }
        let status = stream.status;
        return match stream.abort_after(after) {
            Ok(bytes) => (
                Seen {
                    status: Some(status),
                    aborted: true,
                    received_tokens: count_tokens(complete_events(&bytes)),
                    usage_seen: String::from_utf8_lossy(&bytes).contains("\"usage\":{"),
                    body: bytes,
                    ..Seen::default()
                },
                None,
            ),
            Err(e) => (failed(e), None),
        };
    }
    match conn.request("POST", p.api.path(), &headers, body.as_bytes()) {
        Ok((resp, conn)) => {
            let seen = seen_from(&resp, p.api.stream());
            let reusable = resp.complete
                && !resp
                    .header("connection")
                    .is_some_and(|c| c.eq_ignore_ascii_case("close"));
            (seen, reusable.then_some(conn))
        }
        Err(e) => (failed(e), None),
    }
}

/// 64 threads, each on one kept-alive connection (a new one after a cut or a close), pulling the
/// next planned request until the plan or the time is used up.
fn run_traffic(addr: SocketAddr, plans: &[Planned]) -> Vec<(usize, Seen)> {
    let next = AtomicUsize::new(0);
    let deadline = Instant::now() + TRAFFIC_DEADLINE;
    std::thread::scope(|scope| {
        let workers: Vec<_> = (0..CONNECTIONS)
            .map(|_| {
                scope.spawn(|| {
                    let mut done = Vec::new();
                    let mut conn: Option<Connection> = None;
                    loop {
                        if Instant::now() >= deadline {
                            break;
                        }
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(p) = plans.get(i) else { break };
                        let c = match conn.take() {
                            Some(c) => c,
                            None => match Connection::connect(addr) {
                                Ok(c) => c,
                                Err(e) => {
                                    let seen = Seen {
                                        error: Some(format!("connect: {e:#}")),
                                        ..Seen::default()
                                    };
                                    done.push((i, seen));
                                    continue;
                                }
                            },
                        };
                        let (seen, keep) = run_one(c, p);
                        conn = keep;
                        done.push((i, seen));
                    }
                    done
                })
            })
            .collect();
        workers.into_iter().flat_map(|w| w.join().unwrap()).collect()
    })
}

// ---------------------------------------------------------------------------------------------
// The policy, read back for limits and the key → team → org map

#[derive(Debug, Clone)]
struct Budget {
    level: &'static str,
    id: String,
    window: String,
    /// `tokens_total`, `tokens_input`, `tokens_output`, `requests`, `micro_usd`.
    kind: String,
    limit: u64,
}

impl Budget {
    fn describe(&self) -> String {
        format!("{}:{} {} {}/{}", self.level, self.id, self.limit, self.kind, self.window)
    }
}

struct Policy {
    /// key → (team, org)
    parents: HashMap<String, (String, String)>,
    budgets: Vec<Budget>,
}

impl Policy {
    fn parse(text: &str) -> Policy {
        let v: Value = serde_json::from_str(text).expect("policy is JSON");
        let mut parents = HashMap::new();
        let mut budgets = Vec::new();
        let mut read = |level: &'static str, node: &Value| {
            let id = node["id"].as_str().unwrap().to_string();
            for b in node["budgets"].as_array().into_iter().flatten() {
                let window = b["window"].as_str().unwrap().to_string();
                let (kind, limit) = if let Some(t) = b["tokens"].as_u64() {
                    (format!("tokens_{}", b["count"].as_str().unwrap_or("total")), t)
                } else if let Some(r) = b["requests"].as_u64() {
                    ("requests".to_string(), r)
                } else if let Some(usd) = b["usd"].as_f64() {
                    ("micro_usd".to_string(), (usd * 1e6).round() as u64)
                } else {
                    panic!("budget kind not understood by this test: {b}");
                };
                budgets.push(Budget {
                    level,
                    id: id.clone(),
                    window,
                    kind,
                    limit,
                });
            }
            id
        };
        for org in v["orgs"].as_array().unwrap() {
            let org_id = read("org", org);
            for team in org["teams"].as_array().into_iter().flatten() {
                let team_id = read("team", team);
                for key in team["keys"].as_array().into_iter().flatten() {
                    let key_id = read("key", key);
                    parents.insert(key_id, (team_id.clone(), org_id.clone()));
                }
            }
        }
        Policy { parents, budgets }
    }

    /// Whether a request by `key` counts against `b`.
    fn applies(&self, b: &Budget, key: &str) -> bool {
        let Some((team, org)) = self.parents.get(key) else { return false };
        match b.level {
            "key" => b.id == key,
            "team" => &b.id == team,
            _ => &b.id == org,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Windows

/// Days since 1970-01-01 → (year, month), proleptic Gregorian (Howard Hinnant's algorithm).
fn year_month(days: i64) -> (i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month)
}

/// The UTC calendar window holding `ms` (epoch milliseconds), as an ordered number.
fn window_of(window: &str, ms: i64) -> i64 {
    match window {
        "minute" => ms.div_euclid(60_000),
        "hour" => ms.div_euclid(3_600_000),
        "day" => ms.div_euclid(86_400_000),
        "month" => {
            let (y, m) = year_month(ms.div_euclid(86_400_000));
            y * 12 + m - 1
        }
        other => panic!("unknown window {other}"),
    }
}

/// One admitted request's charge against one budget, with the windows it may have been settled in.
struct Charge {
    id: String,
    amount: u64,
    first: i64,
    last: i64,
}

/// Checks that the charges of every window stay within `limit`. A charge whose start and end
/// (plus slack) lie in different windows may belong to either; it is kept in the earlier one
/// unless that one overflows, in which case the largest such charges move to the later one.
/// Returns (violations, charges moved, peak window total).
fn check_windows(b: &Budget, charges: &[Charge]) -> (Vec<String>, usize, u64) {
    let mut windows: Vec<i64> = charges.iter().flat_map(|c| [c.first, c.last]).collect();
    windows.sort_unstable();
    windows.dedup();
    let mut carried: BTreeMap<i64, u64> = BTreeMap::new();
    let (mut violations, mut moved, mut peak) = (Vec::new(), 0, 0);
    for w in windows {
        let fixed: u64 = charges.iter().filter(|c| c.first == w && c.last == w).map(|c| c.amount).sum();
        let mut movable: Vec<&Charge> = charges.iter().filter(|c| c.first == w && c.last != w).collect();
        movable.sort_by_key(|c| std::cmp::Reverse(c.amount));
        let mut total = fixed + carried.get(&w).copied().unwrap_or(0) + movable.iter().map(|c| c.amount).sum::<u64>();
        for c in movable {
            if total <= b.limit {
                break;
            }
            total -= c.amount;
            *carried.entry(c.last).or_insert(0) += c.amount;
            moved += 1;
        }
        peak = peak.max(total);
        if total > b.limit {
            let ids: Vec<&str> = charges.iter().filter(|c| c.first == w || c.last == w).map(|c| c.id.as_str()).take(5).collect();
            violations.push(format!(
                "(e) overshoot: {} — window {w} charged {total} > limit {} (by {}; e.g. {ids:?})",
                b.describe(),
                b.limit,
                total - b.limit
            ));
        }
    }
    (violations, moved, peak)
}

// ---------------------------------------------------------------------------------------------
// Reading the results

fn as_i64_ms(v: &Value) -> Option<i64> {
    match v {
        Value::Number(n) => n.as_f64().map(|f| (f * 1000.0).round() as i64),
        Value::String(s) => s.trim().parse::<f64>().ok().map(|f| (f * 1000.0).round() as i64),
        _ => None,
    }
}

fn as_u64(v: &Value) -> Option<u64> {
    match v {
        Value::Number(n) => n.as_u64(),
        Value::String(s) => s.trim().parse().ok(),
        _ => None,
    }
}

/// The access-log line of one request, with its parsed `budget` stamp.
struct Logged {
    start_ms: Option<i64>,
    duration_ms: u64,
    status: Option<u64>,
    stamp: Option<Value>,
    raw_stamp: String,
}

fn read_access_log(envoy: &Envoy, expected: usize) -> HashMap<String, Logged> {
    // Every sent request has a line once Envoy is done with it; give the flush time to happen.
    let log = envoy.access_log();
    let _ = log.wait_for(expected, Duration::from_secs(20));
    let mut out = HashMap::new();
    for line in log.entries().unwrap() {
        let Some(id) = line["request_id"].as_str() else { continue };
        let raw_stamp = line["budget"].as_str().unwrap_or("").to_string();
        let logged = Logged {
            start_ms: as_i64_ms(&line["start_epoch"]),
            duration_ms: as_u64(&line["duration_ms"]).unwrap_or(0),
            status: as_u64(&line["status"]),
            stamp: serde_json::from_str(&raw_stamp).ok().filter(Value::is_object),
            raw_stamp,
        };
        out.insert(id.to_string(), logged);
    }
    out
}

/// The mock's ledger once it has stopped growing (records are written when each answer ends).
fn read_ledger(mock: &MockServer) -> HashMap<String, MockRequest> {
    let mut last = usize::MAX;
    let stable = wait_until(Duration::from_secs(10), "the mock's ledger to settle", || {
        let records = mock.requests()?;
        let n = records.len();
        let settled = n == last;
        last = n;
        std::thread::sleep(Duration::from_millis(250));
        Ok(settled.then_some(records))
    })
    .unwrap_or_else(|_| mock.requests().unwrap());
    stable.into_iter().map(|r| (r.request_id.clone(), r)).collect()
}

fn stamp_u64(stamp: &Value, field: &str) -> Option<u64> {
    stamp.get(field).and_then(Value::as_u64)
}

fn stamp_str<'a>(stamp: &'a Value, field: &str) -> &'a str {
    stamp.get(field).and_then(Value::as_str).unwrap_or("")
}

const CHARGED_TOKENS: &str = "sluice_budget_charged_tokens_total";
const CHARGED_MICRO_USD: &str = "sluice_budget_charged_micro_usd_total";
const REJECTIONS: &str = "sluice_budget_rejections_total";

#[derive(Debug, Default, Clone)]
struct Figures {
    sent: u64,
    admitted: u64,
    clamped: u64,
    rejected: u64,
    disconnects: u64,
    resets: u64,
    client_errors: u64,
    charged_tokens: u64,
    charged_micro_usd: u64,
    metric_tokens: Option<f64>,
    metric_micro_usd: Option<f64>,
    metric_rejections: Option<f64>,
}

/// Collects failures instead of panicking at the first, so the figures are printed either way.
#[derive(Default)]
struct Failures {
    by_check: BTreeMap<String, Vec<String>>,
}

impl Failures {
    fn add(&mut self, check: &str, msg: String) {
        self.by_check.entry(check.to_string()).or_default().push(msg);
    }
    fn report(&self) -> String {
        let mut out = String::new();
        for (check, msgs) in &self.by_check {
            let _ = writeln!(out, "{check}: {} failure(s)", msgs.len());
            for m in msgs.iter().take(12) {
                let _ = writeln!(out, "  {m}");
            }
            if msgs.len() > 12 {
                let _ = writeln!(out, "  … and {} more", msgs.len() - 12);
            }
        }
        out
    }
}

/// Whether the plugin's 429 body names a budget of this key's hierarchy: `<level>:<id>:<window>`.
/// A refusal code is `level:id:window:measure`, measure one of `total_tokens`, `input_tokens`,
/// `output_tokens`, `requests`, `micro_usd` (this test's policy has no weighted budgets).
fn code_names_a_budget(code: &str, key: &str, policy: &Policy) -> bool {
    let parts: Vec<&str> = code.split(':').collect();
    let [level, id, window, measure] = parts[..] else { return false };
    policy.budgets.iter().any(|b| {
        let expected = match b.kind.strip_prefix("tokens_") {
            Some(count) => format!("{count}_tokens"),
            None => b.kind.clone(),
        };
        b.level == level && b.id == id && b.window == window && expected == measure && policy.applies(b, key)
    })
}

#[test]
fn budgets_hold_under_concurrency_with_disconnects_and_resets() {
    let Some(_tools) = Tools::locate_or_skip().unwrap() else {
        return;
    };
    let wasm = wasm_dir().join("sluice_tenant_budget.wasm");
    assert!(wasm.is_file(), "{} is missing: build the plugins with `cargo xtask build`", wasm.display());
    let started = Instant::now();
    let policy_text = budget_e2e_policy().unwrap();
    let policy = Policy::parse(&policy_text);
    // llm-metrics rides along as in production; its summary comment would change what the
    // client receives, so it is off here.
    let mut metrics_config: Value = serde_json::from_str(&demo_plugin_config().unwrap()).unwrap();
    metrics_config["stream_summary_comment"] = json!(false);

    let mock = MockServer::start(&[]).unwrap();
    let envoy = start_budget_gateway(&mock, &policy_text, &metrics_config.to_string()).unwrap();

    let plans = plan_traffic(REQUESTS, SEED);
    let traffic_started = Instant::now();
    let mut results = run_traffic(envoy.listen_addr(), &plans);
    let traffic_time = traffic_started.elapsed();
    results.sort_by_key(|(i, _)| *i);

    let logged = read_access_log(&envoy, results.len());
    let ledger = read_ledger(&mock);
    let mut failures = Failures::default();
    let mut figures: BTreeMap<&str, Figures> = KEYS.iter().map(|(k, _)| (*k, Figures::default())).collect();
    // Per budget, the charges of admitted requests.
    let mut charges: Vec<Vec<Charge>> = policy.budgets.iter().map(|_| Vec::new()).collect();
    let mut statuses: BTreeMap<String, u64> = BTreeMap::new();

    for (i, seen) in &results {
        let p = &plans[*i];
        let fig = figures.get_mut(p.key).unwrap();
        fig.sent += 1;
        *statuses
            .entry(seen.status.map_or_else(|| "no response".to_string(), |s| s.to_string()))
            .or_insert(0) += 1;
        if seen.error.is_some() {
            fig.client_errors += 1;
        }
        let upstream = ledger.get(&p.id);
        let Some(log) = logged.get(&p.id) else {
            if seen.status.is_some() {
                failures.add("join", format!("{}: no access-log line with this request_id", p.id));
            }
            continue;
        };
        let Some(stamp) = &log.stamp else {
            failures.add("join", format!("{}: no budget stamp in the access log: {:?}", p.id, log.raw_stamp));
            continue;
        };
        let (team, org) = policy.parents[p.key].clone();
        if (stamp_str(stamp, "key"), stamp_str(stamp, "team"), stamp_str(stamp, "org")) != (p.key, &team, &org) {
            failures.add("stamp", format!("{}: sent as {}/{team}/{org}, stamped {stamp}", p.id, p.key));
        }
        let decision = stamp_str(stamp, "decision");
        let input = stamp_u64(stamp, "input_tokens").unwrap_or(0);
        let output = stamp_u64(stamp, "output_tokens").unwrap_or(0);
        let charged = stamp_u64(stamp, "charged_tokens").unwrap_or(0);
        let micro_usd = stamp_u64(stamp, "charged_micro_usd").unwrap_or(0);
        fig.charged_tokens += charged;
        fig.charged_micro_usd += micro_usd;
        match decision {
            "admitted" => fig.admitted += 1,
            "clamped" => fig.clamped += 1,
            "rejected" => fig.rejected += 1,
            other => failures.add("stamp", format!("{}: decision {other:?}: {stamp}", p.id)),
        }

        // (c) a 429 never reaches the upstream; everything that did was admitted.
        if seen.status == Some(429) || log.status == Some(429) || decision == "rejected" {
            if upstream.is_some() {
                failures.add("(c)", format!("{}: rejected ({decision}, status {:?}) but reached the mock", p.id, seen.status));
            }
            if decision != "rejected" || log.status != Some(429) {
                failures.add("(c)", format!("{}: status {:?} with decision {decision:?}", p.id, log.status));
            }
            if charged != 0 || micro_usd != 0 {
                failures.add("(c)", format!("{}: rejected but charged: {stamp}", p.id));
            }
            if seen.status == Some(429) {
                let body: Value = serde_json::from_slice(&seen.body).unwrap_or(Value::Null);
                let code = body.pointer("/error/code").and_then(Value::as_str).unwrap_or("");
                let kind = body.pointer("/error/type").and_then(Value::as_str).unwrap_or("");
                // /v1/messages may answer in Anthropic's error shape; elsewhere OpenAI's, exactly.
                let shaped = p.api.path() == MESSAGES && body.pointer("/error/message").is_some()
                    || (kind == "budget_exceeded" && code_names_a_budget(code, p.key, &policy));
                if !shaped {
                    failures.add("(c)", format!("{}: 429 body does not name a budget of {}: {body}", p.id, p.key));
                }
                if !code.is_empty() && stamp.get("reject_code").and_then(Value::as_str) != Some(code) {
                    failures.add("(c)", format!("{}: body code {code:?} ≠ stamp reject_code: {stamp}", p.id));
                }
                if seen.retry_after.as_deref().and_then(|r| r.trim().parse::<u64>().ok()).is_none() {
                    failures.add("(c)", format!("{}: 429 without a numeric retry-after ({:?})", p.id, seen.retry_after));
                }
            }
            continue;
        }
        if !matches!(decision, "admitted" | "clamped") {
            continue;
        }
        for field in ["input_tokens", "output_tokens", "charged_tokens", "charged_micro_usd", "reserved_tokens"] {
            if stamp_u64(stamp, field).is_none() {
                failures.add("stamp", format!("{}: {field} missing or not a number: {stamp}", p.id));
            }
        }

        // Money and token totals are exact functions of the charged counts ($1 and $4 per Mtok).
        if charged != input + output {
            failures.add("stamp", format!("{}: charged_tokens {charged} ≠ input {input} + output {output}", p.id));
        }
        if micro_usd != input + 4 * output {
            failures.add("stamp", format!("{}: charged_micro_usd {micro_usd} ≠ {input}×1 + {output}×4", p.id));
        }
        // Strict mode: the reservation is an upper bound of the charge.
        if let Some(reserved) = stamp_u64(stamp, "reserved_tokens") {
            if charged > reserved {
                failures.add("strict", format!("{}: charged {charged} > reserved {reserved}: {stamp}", p.id));
            }
        }

        let disconnected = seen.aborted;
        let reset = matches!(p.fault, Fault::Reset(_));
        if disconnected {
            fig.disconnects += 1;
        }
        if reset {
            fig.resets += 1;
        }
        let interrupted = disconnected
            || reset
            || seen.error.is_some()
            || !seen.complete
            || upstream.is_none_or(|u| !u.completed || u.failure.is_some());
        if !interrupted {
            // (a) completed: charged exactly what the mock's usage reported.
            let u = upstream.unwrap();
            if seen.status != Some(200) {
                failures.add("(a)", format!("{}: completed upstream but client status {:?}", p.id, seen.status));
            }
            if !u.usage_reported {
                failures.add("(a)", format!("{}: the mock reported no usage (include_usage not injected?): {u:?}", p.id));
            }
            if input != u.prompt_tokens || output != u.completion_tokens || stamp_str(stamp, "usage") != "reported" {
                failures.add(
                    "(a)",
                    format!(
                        "{}: stamped input {input} output {output} usage {:?}; the mock reported {} / {}",
                        p.id,
                        stamp_str(stamp, "usage"),
                        u.prompt_tokens,
                        u.completion_tokens
                    ),
                );
            }
            if stamp_str(stamp, "outcome") != "completed" {
                failures.add("(a)", format!("{}: outcome {:?}", p.id, stamp_str(stamp, "outcome")));
            }
            if seen.received_tokens != u.tokens_flushed {
                failures.add("(a)", format!("{}: client got {} tokens, mock sent {}", p.id, seen.received_tokens, u.tokens_flushed));
            }
            // The client sees the stream it asked for: no usage chunk it did not request.
            if p.api == Api::ChatStream && seen.usage_seen {
                failures.add("(a)", format!("{}: usage chunk reached a client that did not ask for it", p.id));
            }
        } else {
            // (b) interrupted: between what the client got and what the mock flushed.
            let flushed = upstream.map_or(0, |u| u.tokens_flushed);
            if !(seen.received_tokens <= output && output <= flushed) {
                failures.add(
                    "(b)",
                    format!(
                        "{}: client received {} ≤ charged output {output} ≤ mock flushed {flushed} does not hold ({:?}, {stamp})",
                        p.id, seen.received_tokens, p.fault
                    ),
                );
            }
        }

        // (e) collect the charge against every budget of the key's hierarchy.
        let Some(start) = log.start_ms else {
            failures.add("join", format!("{}: no start_epoch in the access log", p.id));
            continue;
        };
        let end = start + log.duration_ms as i64 + WINDOW_SLACK_MS;
        for (b, list) in policy.budgets.iter().zip(charges.iter_mut()) {
            if !policy.applies(b, p.key) {
                continue;
            }
            let amount = match b.kind.as_str() {
                "tokens_total" => input + output,
                "tokens_input" => input,
                "tokens_output" => output,
                "requests" => 1,
                _ => micro_usd,
            };
            list.push(Charge {
                id: p.id.clone(),
                amount,
                first: window_of(&b.window, start),
                last: window_of(&b.window, end),
            });
        }
    }

    // Requests that reached the mock without being in the plan (or twice) would escape the join.
    let planned: HashMap<&str, usize> = plans.iter().enumerate().map(|(i, p)| (p.id.as_str(), i)).collect();
    for id in ledger.keys() {
        if !planned.contains_key(id.as_str()) {
            failures.add("join", format!("the mock served request_id {id:?}, which the client never sent"));
        }
    }

    // (d) per key, the stamps add up to the plugin's counters.
    let metrics_match = |m: &sluice_e2e::prometheus::Metrics, figures: &BTreeMap<&str, Figures>| {
        figures.iter().all(|(k, f)| {
            m.value(CHARGED_TOKENS, &[("key", k)]).unwrap_or(0.0) == f.charged_tokens as f64
                && m.value(CHARGED_MICRO_USD, &[("key", k)]).unwrap_or(0.0) == f.charged_micro_usd as f64
                && m.value(REJECTIONS, &[("key", k)]).unwrap_or(0.0) == f.rejected as f64
        })
    };
    let metrics = wait_until(Duration::from_secs(10), "budget counters to match the stamps", || {
        let m = envoy.metrics()?;
        Ok(metrics_match(&m, &figures).then_some(m))
    })
    .unwrap_or_else(|_| envoy.metrics().unwrap());
    for (k, f) in figures.iter_mut() {
        f.metric_tokens = metrics.value(CHARGED_TOKENS, &[("key", k)]);
        f.metric_micro_usd = metrics.value(CHARGED_MICRO_USD, &[("key", k)]);
        f.metric_rejections = metrics.value(REJECTIONS, &[("key", k)]);
        let checks = [
            (CHARGED_TOKENS, f.metric_tokens, f.charged_tokens),
            (CHARGED_MICRO_USD, f.metric_micro_usd, f.charged_micro_usd),
            (REJECTIONS, f.metric_rejections, f.rejected),
        ];
        for (name, have, want) in checks {
            if have.unwrap_or(0.0) != want as f64 {
                failures.add("(d)", format!("{k}: {name} = {have:?}, the stamps add up to {want}"));
            }
        }
    }

    // (e) zero overshoot in every window of every budget.
    let mut budget_lines = Vec::new();
    for (b, list) in policy.budgets.iter().zip(&charges) {
        let (violations, moved, peak) = check_windows(b, list);
        for v in violations {
            failures.add("(e)", v);
        }
        budget_lines.push(format!(
            "  {:<40} peak window {:>9} of {:>9} ({:>5.1} %){}",
            b.describe(),
            peak,
            b.limit,
            peak as f64 * 100.0 / b.limit.max(1) as f64,
            if moved > 0 { format!(", {moved} charge(s) at a window edge assigned to the next window") } else { String::new() }
        ));
    }

    // (f) the run was meaningful.
    let sent: u64 = figures.values().map(|f| f.sent).sum();
    let admitted: u64 = figures.values().map(|f| f.admitted + f.clamped).sum();
    let keys_limited: Vec<&str> = figures.iter().filter(|(_, f)| f.rejected > 0).map(|(k, _)| *k).collect();
    if sent < 2000 {
        failures.add("(f)", format!("only {sent} requests sent within {TRAFFIC_DEADLINE:?}"));
    }
    if admitted < 1500 {
        failures.add("(f)", format!("only {admitted} requests admitted"));
    }
    if keys_limited.is_empty() {
        failures.add("(f)", "no key reached a limit: the budgets were never tested".to_string());
    }

    // The figures.
    let mut table = String::new();
    let _ = writeln!(
        table,
        "\ntenant-budget under concurrency: {sent} requests over {CONNECTIONS} connections in {:.1} s (total test {:.1} s)",
        traffic_time.as_secs_f64(),
        started.elapsed().as_secs_f64()
    );
    let _ = writeln!(table, "statuses: {statuses:?}; keys that hit a limit: {keys_limited:?}");
    let _ = writeln!(
        table,
        "{:<13} {:>5} {:>8} {:>7} {:>8} {:>6} {:>6} {:>6} {:>9} {:>9} {:>9}  key limits",
        "key", "sent", "admitted", "clamped", "rejected", "discon", "resets", "errors", "tokens", "µUSD", "metric"
    );
    for (k, f) in &figures {
        let limits: Vec<String> = policy
            .budgets
            .iter()
            .filter(|b| b.level == "key" && b.id == *k)
            .map(|b| format!("{} {}/{}", b.limit, b.kind, b.window))
            .collect();
        let _ = writeln!(
            table,
            "{:<13} {:>5} {:>8} {:>7} {:>8} {:>6} {:>6} {:>6} {:>9} {:>9} {:>9}  {}",
            k,
            f.sent,
            f.admitted,
            f.clamped,
            f.rejected,
            f.disconnects,
            f.resets,
            f.client_errors,
            f.charged_tokens,
            f.charged_micro_usd,
            f.metric_tokens.map_or("-".to_string(), |v| format!("{v}")),
            if limits.is_empty() { "(team/org only)".to_string() } else { limits.join(", ") }
        );
    }
    let _ = writeln!(table, "budgets (peak charged window vs hard limit):");
    for line in &budget_lines {
        let _ = writeln!(table, "{line}");
    }
    println!("{table}");

    if !failures.by_check.is_empty() {
        panic!("{}\nEnvoy stderr (tail):\n{}", failures.report(), envoy.stderr_tail(20));
    }
    assert!(started.elapsed() < Duration::from_secs(90), "the test took {:?}", started.elapsed());
}

#[cfg(test)]
mod unit {
    use super::*;

    #[test]
    fn month_windows_follow_the_calendar() {
        // 2024-02-29T23:59:59.999Z and 2024-03-01T00:00:00Z
        let leap_end = 1_709_251_199_999;
        assert_eq!(year_month(leap_end / 86_400_000), (2024, 2));
        assert_eq!(window_of("month", leap_end) + 1, window_of("month", leap_end + 1));
        assert_eq!(year_month(0), (1970, 1));
        assert_eq!(window_of("minute", 119_999), 1);
    }

    #[test]
    fn window_check_catches_overshoot_and_tolerates_edges() {
        let b = Budget {
            level: "key",
            id: "k".into(),
            window: "minute".into(),
            kind: "tokens_total".into(),
            limit: 100,
        };
        let c = |amount, first, last| Charge {
            id: "x".into(),
            amount,
            first,
            last,
        };
        // 60 + 50 in one window: over.
        assert_eq!(check_windows(&b, &[c(60, 1, 1), c(50, 1, 1)]).0.len(), 1);
        // The 50 straddles the edge and fits in the next window.
        assert!(check_windows(&b, &[c(60, 1, 1), c(50, 1, 2), c(40, 2, 2)]).0.is_empty());
        // …but not if the next window is full too.
        assert_eq!(check_windows(&b, &[c(60, 1, 1), c(50, 1, 2), c(60, 2, 2)]).0.len(), 1);
    }

    #[test]
    fn token_counting_ignores_usage_fields_and_partial_events() {
        let sse = b"data: {\"content\":\"tok0 \"}\n\ndata: {\"usage\":{\"prompt_tokens\":3}}\n\ndata: {\"content\":\"tok1";
        assert_eq!(count_tokens(complete_events(sse)), 1);
        assert_eq!(count_tokens(sse), 2);
    }

    #[test]
    fn the_plan_is_reproducible_and_mixed() {
        let a = plan_traffic(REQUESTS, SEED);
        let b = plan_traffic(REQUESTS, SEED);
        assert_eq!(format!("{a:?}"), format!("{b:?}"));
        let share = |f: &dyn Fn(&Planned) -> bool| a.iter().filter(|p| f(p)).count() as f64 / a.len() as f64;
        let disconnects = share(&|p| matches!(p.fault, Fault::Disconnect(_)));
        let resets = share(&|p| matches!(p.fault, Fault::Reset(_)));
        assert!((0.03..0.08).contains(&disconnects), "{disconnects}");
        assert!((0.03..0.08).contains(&resets), "{resets}");
        for api in [Api::ChatStreamUsage, Api::ChatStream, Api::ChatWhole, Api::MessagesStream, Api::MessagesWhole] {
            assert!(share(&|p| p.api == api) > 0.05, "{api:?}");
        }
        for (key, _) in KEYS {
            assert!(share(&|p| p.key == key) > 0.04, "{key}");
        }
    }
}
