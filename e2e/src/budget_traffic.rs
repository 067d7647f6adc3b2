//! The traffic of the tenant-budget load tests (`tests/budget_concurrency.rs` on one Envoy,
//! `tests/budget_fleet.rs` on several sharing a Redis ledger), and how it is checked afterwards.
//!
//! A fixed seed plans every request (key, API, length, output limit, client disconnect or upstream
//! reset); [`run_traffic`] sends the plan over kept-alive connections. Afterwards what the client
//! saw, the plugin's `budget` stamp in the access log and the mock's record are joined by
//! `x-request-id` ([`Records`], [`Tally`]) and each request is checked for an exact charge; the
//! charges per budget and window are then checked against the limits ([`check_windows`]) of the
//! policy as read back ([`Policy`]).

use crate::{wait_until, Connection, Envoy, MockRequest, MockServer, StreamedResponse};
use anyhow::{anyhow, bail, Context, Result};
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

pub const CHAT: &str = "/v1/chat/completions";
pub const MESSAGES: &str = "/v1/messages";

/// The refusal code when the ledger cannot be reached (`on_failure: deny`); not a budget's.
pub const LEDGER_UNAVAILABLE: &str = "budget_ledger_unavailable";

/// A request may be settled into the window of any instant from its start to its end plus this
/// (admission happens after the start; settlement at the end; the access log's duration is rounded).
pub const WINDOW_SLACK_MS: i64 = 500;

// ---------------------------------------------------------------------------------------------
// The traffic plan

/// A key of the traffic, where it sits in the hierarchy, and its share of the requests.
#[derive(Debug, Clone, Copy)]
pub struct TrafficKey {
    pub key: &'static str,
    pub team: &'static str,
    pub org: &'static str,
    pub weight: u64,
}

const fn key(key: &'static str, team: &'static str, org: &'static str, weight: u64) -> TrafficKey {
    TrafficKey { key, team, org, weight }
}

/// The seven keys in two orgs, as `policies/tenant-budget.e2e.json` places them (the fleet test's
/// generated policies keep the same hierarchy).
pub const KEYS: [TrafficKey; 7] = [
    key("search-prod", "search", "acme", 10),
    key("search-dev", "search", "acme", 7),
    key("search-batch", "search", "acme", 10),
    key("ads-batch", "ads", "acme", 8),
    key("ads-rt", "ads", "acme", 22),
    key("labs-metered", "labs", "globex", 8),
    key("labs-open", "labs", "globex", 35),
];

/// xorshift64*: small, deterministic, good enough to pick test traffic (the soak's too).
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    /// Uniform in `lo..=hi`.
    pub(crate) fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }
    /// True with probability `percent`/100.
    fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// OpenAI chat, streamed, with `stream_options.include_usage`.
    ChatStreamUsage,
    /// OpenAI chat, streamed, without: the plugin must inject it upstream and hide the usage chunk.
    ChatStream,
    ChatWhole,
    MessagesStream,
    MessagesWhole,
}

impl Api {
    pub fn path(self) -> &'static str {
        match self {
            Api::ChatStreamUsage | Api::ChatStream | Api::ChatWhole => CHAT,
            Api::MessagesStream | Api::MessagesWhole => MESSAGES,
        }
    }
    pub fn stream(self) -> bool {
        matches!(self, Api::ChatStreamUsage | Api::ChatStream | Api::MessagesStream)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    None,
    /// Read at least this many body bytes, then drop the connection.
    Disconnect(usize),
    /// `x-mock-fail: reset-after:N`.
    Reset(u64),
}

#[derive(Debug, Clone)]
pub struct Planned {
    pub id: String,
    pub key: &'static str,
    pub api: Api,
    /// `x-mock-tokens`: content tokens the mock would send without an output limit.
    pub tokens: u64,
    pub ttft_ms: u64,
    pub itl_ms: u64,
    pub max_tokens: Option<u64>,
    pub user_text: String,
    pub fault: Fault,
}

impl Planned {
    pub fn body(&self) -> String {
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
        if let Some(fields) = body.as_object_mut() {
            if self.api == Api::ChatStreamUsage {
                fields.insert("stream_options".into(), json!({"include_usage": true}));
            }
            if let Some(m) = self.max_tokens {
                fields.insert("max_tokens".into(), json!(m));
            }
        }
        body.to_string()
    }

    pub fn headers(&self) -> Vec<(&'static str, String)> {
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

/// `n` requests over [`KEYS`] by their weights, named `<prefix>-<00000>`; the same `seed` plans the
/// same traffic.
pub fn plan_traffic(n: usize, seed: u64, prefix: &str) -> Vec<Planned> {
    let mut rng = Rng(seed);
    let total_weight: u64 = KEYS.iter().map(|k| k.weight).sum();
    let words = ["budget", "tenant", "stream", "token", "window", "ledger", "model", "quota"];
    (0..n)
        .map(|i| {
            let mut pick = rng.range(0, total_weight - 1);
            let key = KEYS
                .iter()
                .find(|k| {
                    let hit = pick < k.weight;
                    pick = pick.saturating_sub(k.weight);
                    hit
                })
                .map_or("labs-open", |k| k.key);
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
                .map(|_| words.get(rng.range(0, words.len() as u64 - 1) as usize).copied().unwrap_or_default())
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
            Planned { id: format!("{prefix}-{i:05}"), key, api, tokens, ttft_ms: rng.range(0, 5), itl_ms: rng.range(0, 2), max_tokens, user_text, fault }
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Sending it

/// What the client saw of one request.
#[derive(Debug, Clone, Default)]
pub struct Seen {
    pub status: Option<u16>,
    /// The body ended as framed (false when cut by a reset, or dropped by us).
    pub complete: bool,
    /// We dropped the connection mid-body.
    pub aborted: bool,
    /// Content tokens in complete events (streams) or in the whole body (JSON).
    pub received_tokens: u64,
    /// A usage object reached the client.
    pub usage_seen: bool,
    pub retry_after: Option<String>,
    pub body: Vec<u8>,
    pub error: Option<String>,
}

/// Content tokens (`tok<digits>`) in `bytes`: `tok` followed by a digit never occurs elsewhere in
/// the mock's answers (ids are hex, usage fields are `…_tokens`).
pub fn count_tokens(bytes: &[u8]) -> u64 {
    bytes.windows(4).filter(|w| w.starts_with(b"tok") && w.get(3).is_some_and(u8::is_ascii_digit)).count() as u64
}

/// The prefix of an SSE body made of complete events (up to the last blank line).
pub fn complete_events(bytes: &[u8]) -> &[u8] {
    let end =
        bytes.windows(2).rposition(|w| w == b"\n\n").map(|p| p + 2).or_else(|| bytes.windows(4).rposition(|w| w == b"\r\n\r\n").map(|p| p + 4)).unwrap_or(0);
    bytes.get(..end).unwrap_or_default()
}

/// What the client saw of a stream it left after `bytes` (the soak's disconnects too): the
/// complete events of what it read.
pub(crate) fn seen_aborted(status: u16, bytes: Vec<u8>) -> Seen {
    Seen {
        status: Some(status),
        aborted: true,
        received_tokens: count_tokens(complete_events(&bytes)),
        usage_seen: String::from_utf8_lossy(&bytes).contains("\"usage\":{"),
        body: bytes,
        ..Seen::default()
    }
}

/// What the client saw of one answer (the soak reads its responses the same way).
pub fn seen_from(resp: &StreamedResponse, stream: bool) -> Seen {
    let body = resp.body();
    // A cut JSON body proves nothing; a cut stream proves its complete events.
    let counted: &[u8] = match (resp.complete, stream) {
        (true, _) => &body,
        (false, true) => complete_events(&body),
        (false, false) => &[],
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
    let failed = |e: anyhow::Error| Seen { error: Some(format!("{e:#}")), ..Seen::default() };
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
            Ok(bytes) => (seen_aborted(status, bytes), None),
            Err(e) => (failed(e), None),
        };
    }
    match conn.request("POST", p.api.path(), &headers, body.as_bytes()) {
        Ok((resp, conn)) => {
            let seen = seen_from(&resp, p.api.stream());
            let reusable = resp.complete && !resp.header("connection").is_some_and(|c| c.eq_ignore_ascii_case("close"));
            (seen, reusable.then_some(conn))
        }
        Err(e) => (failed(e), None),
    }
}

/// `connections` threads, thread `t` on `addrs[t % addrs.len()]`, each on one kept-alive
/// connection (a new one after a cut or a close), pulling the next planned request until the plan
/// is used up or `time` has passed. Returns what was seen of each request sent, by plan index, in
/// plan order.
pub fn run_traffic(addrs: &[SocketAddr], plans: &[Planned], connections: usize, time: Duration) -> Result<Vec<(usize, Seen)>> {
    if addrs.is_empty() {
        bail!("no address to send the traffic to");
    }
    let next = AtomicUsize::new(0);
    let deadline = Instant::now() + time;
    let mut results = std::thread::scope(|scope| {
        let workers: Vec<_> = addrs
            .iter()
            .cycle()
            .take(connections)
            .map(|&addr| {
                let next = &next;
                scope.spawn(move || {
                    let mut done = Vec::new();
                    let mut conn: Option<Connection> = None;
                    while Instant::now() < deadline {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(p) = plans.get(i) else { break };
                        let c = match conn.take() {
                            Some(c) => c,
                            None => match Connection::connect(addr) {
                                Ok(c) => c,
                                Err(e) => {
                                    done.push((i, Seen { error: Some(format!("connect: {e:#}")), ..Seen::default() }));
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
        let mut results = Vec::new();
        for w in workers {
            results.extend(w.join().map_err(|_| anyhow!("a traffic thread panicked"))?);
        }
        Ok::<_, anyhow::Error>(results)
    })?;
    results.sort_by_key(|(i, _)| *i);
    Ok(results)
}

// ---------------------------------------------------------------------------------------------
// The policy, read back for limits and the key → team → org map

/// A budget's calendar window (UTC, as the plugin's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Window {
    Minute,
    Hour,
    Day,
    Month,
}

impl Window {
    pub fn parse(name: &str) -> Result<Window> {
        Ok(match name {
            "minute" => Window::Minute,
            "hour" => Window::Hour,
            "day" => Window::Day,
            "month" => Window::Month,
            other => bail!("unknown window {other:?}"),
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Window::Minute => "minute",
            Window::Hour => "hour",
            Window::Day => "day",
            Window::Month => "month",
        }
    }

    /// The window holding `ms` (epoch milliseconds), numbered as the plugin numbers it (`w<id>`).
    pub fn of(self, ms: i64) -> i64 {
        match self {
            Window::Minute => ms.div_euclid(60_000),
            Window::Hour => ms.div_euclid(3_600_000),
            Window::Day => ms.div_euclid(86_400_000),
            Window::Month => {
                let (y, m) = year_month(ms.div_euclid(86_400_000));
                y * 12 + m - 1
            }
        }
    }
}

/// Days since 1970-01-01 → (year, month), proleptic Gregorian (Howard Hinnant's algorithm).
pub fn year_month(days: i64) -> (i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    (yoe + era * 400 + i64::from(month <= 2), month)
}

/// What a budget counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Measure {
    TotalTokens,
    InputTokens,
    OutputTokens,
    Requests,
    MicroUsd,
}

impl Measure {
    /// `tokens_total`, `tokens_input`, `tokens_output`, `requests`, `micro_usd`.
    pub fn name(self) -> &'static str {
        match self {
            Measure::TotalTokens => "tokens_total",
            Measure::InputTokens => "tokens_input",
            Measure::OutputTokens => "tokens_output",
            Measure::Requests => "requests",
            Measure::MicroUsd => "micro_usd",
        }
    }

    /// The last part of a refusal code naming a budget of this measure.
    fn code(self) -> &'static str {
        match self {
            Measure::TotalTokens => "total_tokens",
            Measure::InputTokens => "input_tokens",
            Measure::OutputTokens => "output_tokens",
            Measure::Requests => "requests",
            Measure::MicroUsd => "micro_usd",
        }
    }

    fn unit(self) -> &'static str {
        match self {
            Measure::TotalTokens => "tok",
            Measure::InputTokens => "in tok",
            Measure::OutputTokens => "out tok",
            Measure::Requests => "req",
            Measure::MicroUsd => "µUSD",
        }
    }

    /// This measure of one request's charge.
    pub fn amount(self, input: u64, output: u64, micro_usd: u64) -> u64 {
        match self {
            Measure::TotalTokens => input + output,
            Measure::InputTokens => input,
            Measure::OutputTokens => output,
            Measure::Requests => 1,
            Measure::MicroUsd => micro_usd,
        }
    }
}

/// One budget of a policy.
#[derive(Debug, Clone)]
pub struct Budget {
    /// `org`, `team` or `key`.
    pub level: &'static str,
    pub id: String,
    /// Its position among its owner's budgets in the policy (the Redis counter is named by what it
    /// counts, not by this: see [`Budget::redis_prefix`]).
    pub n: usize,
    pub window: Window,
    pub measure: Measure,
    pub limit: u64,
}

impl Budget {
    pub fn describe(&self) -> String {
        format!("{}:{} {} {}/{}", self.level, self.id, self.limit, self.measure.unit(), self.window.name())
    }

    /// As a policy writes it.
    pub fn json(&self) -> Value {
        let (window, limit) = (self.window.name(), self.limit);
        match self.measure {
            Measure::TotalTokens => json!({"window": window, "tokens": limit}),
            Measure::InputTokens => json!({"window": window, "tokens": limit, "count": "input"}),
            Measure::OutputTokens => json!({"window": window, "tokens": limit, "count": "output"}),
            Measure::Requests => json!({"window": window, "requests": limit}),
            Measure::MicroUsd => json!({"window": window, "usd": limit as f64 / 1e6}),
        }
    }

    /// The code of a 429 this budget refuses: `level:id:window:measure`.
    pub fn refusal_code(&self) -> String {
        format!("{}:{}:{}:{}", self.level, self.id, self.window.name(), self.measure.code())
    }

    /// The Redis counter key's prefix, before the window id: `<level>:<id>:<window>:<measure>:w`
    /// (a month resets on day 1: these policies set no `reset_day`).
    pub fn redis_prefix(&self) -> String {
        let window = if self.window == Window::Month { "month_day1" } else { self.window.name() };
        format!("{}:{}:{window}:{}:w", self.level, self.id, self.measure.code())
    }
}

/// A policy's budgets and its keys' places in the hierarchy.
pub struct Policy {
    /// key → (team, org)
    pub parents: HashMap<String, (String, String)>,
    pub budgets: Vec<Budget>,
}

impl Policy {
    /// Reads tenant-budget's policy JSON (budgets by tokens, requests or USD).
    pub fn parse(text: &str) -> Result<Policy> {
        let v: Value = serde_json::from_str(text).context("the policy is not JSON")?;
        let mut parents = HashMap::new();
        let mut budgets = Vec::new();
        let mut read = |level: &'static str, node: &Value| -> Result<String> {
            let id = node.get("id").and_then(Value::as_str).ok_or_else(|| anyhow!("a {level} without an id: {node}"))?.to_string();
            for (n, b) in list(node, "budgets").iter().enumerate() {
                let window = Window::parse(b.get("window").and_then(Value::as_str).unwrap_or(""))?;
                let (measure, limit) = if let Some(t) = b.get("tokens").and_then(Value::as_u64) {
                    let measure = match b.get("count").and_then(Value::as_str).unwrap_or("total") {
                        "total" => Measure::TotalTokens,
                        "input" => Measure::InputTokens,
                        "output" => Measure::OutputTokens,
                        other => bail!("token count {other:?} not understood by this test: {b}"),
                    };
                    (measure, t)
                } else if let Some(r) = b.get("requests").and_then(Value::as_u64) {
                    (Measure::Requests, r)
                } else if let Some(usd) = b.get("usd").and_then(Value::as_f64) {
                    (Measure::MicroUsd, (usd * 1e6).round() as u64)
                } else {
                    bail!("budget kind not understood by this test: {b}");
                };
                budgets.push(Budget { level, id: id.clone(), n, window, measure, limit });
            }
            Ok(id)
        };
        let orgs = v.get("orgs").and_then(Value::as_array).ok_or_else(|| anyhow!("the policy has no orgs"))?;
        for org in orgs {
            let org_id = read("org", org)?;
            for team in list(org, "teams") {
                let team_id = read("team", team)?;
                for key in list(team, "keys") {
                    let key_id = read("key", key)?;
                    parents.insert(key_id, (team_id.clone(), org_id.clone()));
                }
            }
        }
        Ok(Policy { parents, budgets })
    }

    /// `budgets` over the hierarchy of [`KEYS`] (a policy this test writes itself).
    pub fn of_traffic_keys(budgets: Vec<Budget>) -> Policy {
        let parents = KEYS.iter().map(|k| (k.key.to_string(), (k.team.to_string(), k.org.to_string()))).collect();
        Policy { parents, budgets }
    }

    /// Whether a request by `key` counts against `b`.
    pub fn applies(&self, b: &Budget, key: &str) -> bool {
        let Some((team, org)) = self.parents.get(key) else { return false };
        match b.level {
            "key" => b.id == key,
            "team" => &b.id == team,
            _ => &b.id == org,
        }
    }

    /// Whether `code` (of a 429) names a budget of `key`'s hierarchy.
    pub fn names_a_budget(&self, code: &str, key: &str) -> bool {
        self.budgets.iter().any(|b| b.refusal_code() == code && self.applies(b, key))
    }
}

/// The array `field` of a policy node; empty where there is none.
fn list<'v>(node: &'v Value, field: &str) -> &'v [Value] {
    node.get(field).and_then(Value::as_array).map_or(&[], Vec::as_slice)
}

// ---------------------------------------------------------------------------------------------
// Charges per window

/// One admitted request's charge against one budget, with the windows it may have been settled in.
#[derive(Debug, Clone)]
pub struct Charge {
    pub id: String,
    pub amount: u64,
    pub first: i64,
    pub last: i64,
}

/// What [`check_windows`] found.
#[derive(Debug, Default)]
pub struct WindowCheck {
    /// One line per window charged above the limit.
    pub violations: Vec<String>,
    /// Charges at a window edge that went to the later window.
    pub moved: usize,
    /// The most any window was charged.
    pub peak: u64,
}

/// Checks that the charges of every window stay within `b`'s limit. A charge whose start and end
/// (plus slack) lie in different windows may belong to either; it is kept in the earlier one
/// unless that one overflows, in which case the largest such charges move to the later one.
pub fn check_windows(b: &Budget, charges: &[Charge]) -> WindowCheck {
    let mut windows: Vec<i64> = charges.iter().flat_map(|c| [c.first, c.last]).collect();
    windows.sort_unstable();
    windows.dedup();
    let mut carried: BTreeMap<i64, u64> = BTreeMap::new();
    let mut out = WindowCheck::default();
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
            out.moved += 1;
        }
        out.peak = out.peak.max(total);
        if total > b.limit {
            let ids: Vec<&str> = charges.iter().filter(|c| c.first == w || c.last == w).map(|c| c.id.as_str()).take(5).collect();
            out.violations.push(format!("{} — window {w} charged {total} > limit {} (by {}; e.g. {ids:?})", b.describe(), b.limit, total - b.limit));
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Reading the results

/// The access-log line of one request, with its parsed `budget` stamp and the Envoy it came from.
#[derive(Debug, Clone)]
pub struct Logged {
    /// The index of its Envoy in the list read.
    pub envoy: usize,
    pub start_ms: Option<i64>,
    pub duration_ms: u64,
    pub status: Option<u64>,
    pub stamp: Option<Value>,
    pub raw_stamp: String,
}

impl Logged {
    /// Reads access-log `line` of Envoy number `envoy`.
    pub fn from_line(envoy: usize, line: &Value) -> Logged {
        let raw_stamp = line.get("budget").and_then(Value::as_str).unwrap_or("").to_string();
        Logged {
            envoy,
            start_ms: as_ms(line.get("start_epoch")),
            duration_ms: as_u64(line.get("duration_ms")).unwrap_or(0),
            status: as_u64(line.get("status")),
            stamp: serde_json::from_str(&raw_stamp).ok().filter(Value::is_object),
            raw_stamp,
        }
    }
}

/// A number Envoy may log as a number or as a string.
fn as_u64(v: Option<&Value>) -> Option<u64> {
    match v? {
        Value::Number(n) => n.as_u64(),
        Value::String(s) => s.trim().parse().ok(),
        _ => None,
    }
}

/// Seconds (with a fraction) as milliseconds.
fn as_ms(v: Option<&Value>) -> Option<i64> {
    match v? {
        Value::Number(n) => n.as_f64().map(|f| (f * 1000.0).round() as i64),
        Value::String(s) => s.trim().parse::<f64>().ok().map(|f| (f * 1000.0).round() as i64),
        _ => None,
    }
}

/// Every access-log line of `envoys`, by request id, once at least `expected` lines are there (or
/// 20 s passed: every sent request has a line once Envoy is done with it, flushed on a timer).
pub fn read_logs(envoys: &[&Envoy], expected: usize) -> Result<HashMap<String, Logged>> {
    let _ = wait_until(Duration::from_secs(20), "the access logs", || {
        let n: usize = envoys.iter().map(|e| e.access_log().entries().map_or(0, |l| l.len())).sum();
        Ok((n >= expected).then_some(()))
    });
    let mut out = HashMap::new();
    for (i, envoy) in envoys.iter().enumerate() {
        for line in envoy.access_log().entries()? {
            let Some(id) = line.get("request_id").and_then(Value::as_str) else { continue };
            out.insert(id.to_string(), Logged::from_line(i, &line));
        }
    }
    Ok(out)
}

/// The mock's ledger once it has stopped growing (records are written when each answer ends).
pub fn read_mock_ledger(mock: &MockServer) -> Result<HashMap<String, MockRequest>> {
    let mut last = usize::MAX;
    let stable = wait_until(Duration::from_secs(10), "the mock's ledger to settle", || {
        let records = mock.requests()?;
        let n = records.len();
        let settled = n == last;
        last = n;
        std::thread::sleep(Duration::from_millis(250));
        Ok(settled.then_some(records))
    });
    let stable = match stable {
        Ok(records) => records,
        Err(_) => mock.requests()?,
    };
    Ok(stable.into_iter().map(|r| (r.request_id.clone(), r)).collect())
}

pub fn stamp_u64(stamp: &Value, field: &str) -> Option<u64> {
    stamp.get(field).and_then(Value::as_u64)
}

pub fn stamp_str<'a>(stamp: &'a Value, field: &str) -> &'a str {
    stamp.get(field).and_then(Value::as_str).unwrap_or("")
}

/// `(type, code)` of an error body in OpenAI's shape; empty strings where absent.
pub fn error_fields(body: &[u8]) -> (String, String) {
    let v: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    let s = |p: &str| v.pointer(p).and_then(Value::as_str).unwrap_or("").to_string();
    (s("/error/type"), s("/error/code"))
}

/// The two records of a run besides the client's: the access logs and the mock's ledger.
pub struct Records {
    pub logged: HashMap<String, Logged>,
    pub upstream: HashMap<String, MockRequest>,
}

impl Records {
    /// Reads both once the `expected` access-log lines are in (see [`read_logs`]).
    pub fn read(envoys: &[&Envoy], mock: &MockServer, expected: usize) -> Result<Records> {
        Ok(Records { logged: read_logs(envoys, expected)?, upstream: read_mock_ledger(mock)? })
    }
}

// ---------------------------------------------------------------------------------------------
// Checking every request

/// Per key, what happened to its requests.
#[derive(Debug, Default, Clone)]
pub struct Figures {
    pub sent: u64,
    pub admitted: u64,
    pub clamped: u64,
    /// Refused by a budget.
    pub rejected: u64,
    /// Refused because the ledger could not be reached.
    pub unavailable: u64,
    pub disconnects: u64,
    pub resets: u64,
    pub client_errors: u64,
    pub charged_tokens: u64,
    pub charged_micro_usd: u64,
}

impl Figures {
    /// Admitted, with or without a clamped output limit.
    pub fn let_through(&self) -> u64 {
        self.admitted + self.clamped
    }
}

/// Collects failures instead of panicking at the first, so the figures are printed either way.
#[derive(Default)]
pub struct Failures {
    by_check: BTreeMap<String, Vec<String>>,
}

impl Failures {
    pub fn add(&mut self, check: &str, msg: String) {
        self.by_check.entry(check.to_string()).or_default().push(msg);
    }

    pub fn that(&mut self, check: &str, ok: bool, msg: impl FnOnce() -> String) {
        if !ok {
            self.add(check, msg());
        }
    }

    pub fn is_empty(&self) -> bool {
        self.by_check.is_empty()
    }

    /// Up to 12 failures of each check.
    pub fn report(&self) -> String {
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

    /// An error with the report and `context` if anything failed.
    pub fn verdict(&self, context: &str) -> Result<()> {
        if self.is_empty() {
            return Ok(());
        }
        bail!("{}\n{context}", self.report())
    }
}

/// The kinds of failure the shared checks find; each test names them in its own terms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Check {
    /// A request missing from a record, or a record of no planned request.
    Join,
    /// A stamp at odds with the request or with itself.
    Stamp,
    /// A charge above the reservation (strict mode).
    Strict,
    /// A completed request not charged exactly the upstream's usage.
    Completed,
    /// An interrupted request charged outside what the client got and what the mock flushed.
    Interrupted,
    /// A refused request charged.
    Refused,
    /// A 429 that names no budget of the key, or says not when to retry.
    TooMany,
}

/// One request's three records, joined by its id, with its stamp's figures.
pub struct Joined<'r> {
    pub plan: &'r Planned,
    pub seen: &'r Seen,
    pub log: &'r Logged,
    pub stamp: &'r Value,
    pub upstream: Option<&'r MockRequest>,
    /// `admitted`, `clamped` or `rejected`.
    pub decision: &'r str,
    pub input: u64,
    pub output: u64,
    pub charged: u64,
    pub micro_usd: u64,
}

impl Joined<'_> {
    pub fn admitted(&self) -> bool {
        matches!(self.decision, "admitted" | "clamped")
    }
}

/// What [`Tally::check_admitted`] found of one request.
pub struct Admitted<'r> {
    /// The mock's record, when the request completed (neither side cut it).
    pub completed: Option<&'r MockRequest>,
    /// Its charges, by the index of the budget in the policy.
    pub charges: Vec<(usize, Charge)>,
}

/// The checks of one run's requests, and what they add up to.
pub struct Tally<'a> {
    policy: &'a Policy,
    name: &'a dyn Fn(Check) -> String,
    pub figures: BTreeMap<&'static str, Figures>,
    /// Client status (or `no response`) → requests.
    pub statuses: BTreeMap<String, u64>,
    /// Per budget of the policy, the charges of admitted requests.
    pub charges: Vec<Vec<Charge>>,
}

impl<'a> Tally<'a> {
    /// `name` gives each [`Check`] the label its failures are reported under.
    pub fn new(policy: &'a Policy, name: &'a dyn Fn(Check) -> String) -> Tally<'a> {
        Tally {
            policy,
            name,
            figures: KEYS.iter().map(|k| (k.key, Figures::default())).collect(),
            statuses: BTreeMap::new(),
            charges: policy.budgets.iter().map(|_| Vec::new()).collect(),
        }
    }

    fn fail(&self, failures: &mut Failures, check: Check, msg: String) {
        failures.add(&(self.name)(check), msg);
    }

    /// Counts the request and joins its records; `None` (a join failure if the client got an
    /// answer) when the access log has no stamped line of it. Checks the stamp names the key's
    /// team and org, and a known decision.
    pub fn join<'r>(&mut self, plan: &'r Planned, seen: &'r Seen, records: &'r Records, failures: &mut Failures) -> Option<Joined<'r>> {
        let fig = self.figures.entry(plan.key).or_default();
        fig.sent += 1;
        *self.statuses.entry(seen.status.map_or_else(|| "no response".to_string(), |s| s.to_string())).or_insert(0) += 1;
        if seen.error.is_some() {
            fig.client_errors += 1;
        }
        let Some(log) = records.logged.get(&plan.id) else {
            if seen.status.is_some() {
                self.fail(failures, Check::Join, format!("{}: no access-log line with this request_id", plan.id));
            }
            return None;
        };
        let Some(stamp) = &log.stamp else {
            self.fail(failures, Check::Join, format!("{}: no budget stamp in the access log: {:?}", plan.id, log.raw_stamp));
            return None;
        };
        let r = Joined {
            plan,
            seen,
            log,
            stamp,
            upstream: records.upstream.get(&plan.id),
            decision: stamp_str(stamp, "decision"),
            input: stamp_u64(stamp, "input_tokens").unwrap_or(0),
            output: stamp_u64(stamp, "output_tokens").unwrap_or(0),
            charged: stamp_u64(stamp, "charged_tokens").unwrap_or(0),
            micro_usd: stamp_u64(stamp, "charged_micro_usd").unwrap_or(0),
        };
        let fig = self.figures.entry(plan.key).or_default();
        fig.charged_tokens += r.charged;
        fig.charged_micro_usd += r.micro_usd;
        match r.decision {
            "admitted" => fig.admitted += 1,
            "clamped" => fig.clamped += 1,
            "rejected" if stamp_str(stamp, "reject_code") == LEDGER_UNAVAILABLE => fig.unavailable += 1,
            "rejected" => fig.rejected += 1,
            other => self.fail(failures, Check::Stamp, format!("{}: decision {other:?}: {stamp}", plan.id)),
        }
        let stamped = (stamp_str(stamp, "key"), stamp_str(stamp, "team"), stamp_str(stamp, "org"));
        let placed = self.policy.parents.get(plan.key);
        if placed.is_none_or(|(team, org)| stamped != (plan.key, team.as_str(), org.as_str())) {
            let (team, org) = placed.map_or(("?", "?"), |(t, o)| (t.as_str(), o.as_str()));
            self.fail(failures, Check::Stamp, format!("{}: sent as {}/{team}/{org}, stamped {stamp}", plan.id, plan.key));
        }
        Some(r)
    }

    /// What every refusal must be: not charged; a 429 in OpenAI's shape naming a budget of the key
    /// (or Anthropic's shape on `/v1/messages`), with a numeric `retry-after`.
    pub fn check_refusal(&self, r: &Joined, failures: &mut Failures) {
        let (p, seen) = (r.plan, r.seen);
        if r.charged != 0 || r.micro_usd != 0 {
            self.fail(failures, Check::Refused, format!("{}: refused but charged: {}", p.id, r.stamp));
        }
        if seen.status != Some(429) {
            return;
        }
        let body: Value = serde_json::from_slice(&seen.body).unwrap_or(Value::Null);
        let text = |pointer: &str| body.pointer(pointer).and_then(Value::as_str).unwrap_or("");
        let shaped = p.api.path() == MESSAGES && body.pointer("/error/message").is_some()
            || (text("/error/type") == "budget_exceeded" && self.policy.names_a_budget(text("/error/code"), p.key));
        if !shaped {
            self.fail(failures, Check::TooMany, format!("{}: 429 body does not name a budget of {}: {body}", p.id, p.key));
        }
        if seen.retry_after.as_deref().and_then(|r| r.trim().parse::<u64>().ok()).is_none() {
            self.fail(failures, Check::TooMany, format!("{}: 429 without a numeric retry-after ({:?})", p.id, seen.retry_after));
        }
    }

    /// Checks an admitted request's charge: tokens and money consistent and within the
    /// reservation; a completed request charged exactly the usage the mock reported (and the
    /// client's stream what it asked for), an interrupted one between the content tokens the client
    /// received and those the mock flushed. Counts its disconnect or reset, and records its charge
    /// against every budget of its key.
    pub fn check_admitted<'r>(&mut self, r: &Joined<'r>, failures: &mut Failures) -> Admitted<'r> {
        let (p, seen, stamp) = (r.plan, r.seen, r.stamp);
        let (input, output, charged, micro_usd) = (r.input, r.output, r.charged, r.micro_usd);
        // Money and token totals are exact functions of the charged counts ($1 and $4 per Mtok).
        if charged != input + output {
            self.fail(failures, Check::Stamp, format!("{}: charged_tokens {charged} ≠ input {input} + output {output}", p.id));
        }
        if micro_usd != input + 4 * output {
            self.fail(failures, Check::Stamp, format!("{}: charged_micro_usd {micro_usd} ≠ {input}×1 + {output}×4", p.id));
        }
        // Strict mode: the reservation is an upper bound of the charge.
        if let Some(reserved) = stamp_u64(stamp, "reserved_tokens").filter(|r| charged > *r) {
            self.fail(failures, Check::Strict, format!("{}: charged {charged} > reserved {reserved}: {stamp}", p.id));
        }

        let reset = matches!(p.fault, Fault::Reset(_));
        let fig = self.figures.entry(p.key).or_default();
        if seen.aborted {
            fig.disconnects += 1;
        }
        if reset {
            fig.resets += 1;
        }
        let cut = seen.aborted || reset || seen.error.is_some() || !seen.complete;
        let completed = r.upstream.filter(|u| !cut && u.completed && u.failure.is_none());
        if let Some(u) = completed {
            let usage = stamp_str(stamp, "usage");
            if input != u.prompt_tokens || output != u.completion_tokens || usage != "reported" {
                self.fail(
                    failures,
                    Check::Completed,
                    format!("{}: stamped input {input} output {output} usage {usage:?}; the mock reported {} / {}", p.id, u.prompt_tokens, u.completion_tokens),
                );
            }
            if seen.received_tokens != u.tokens_flushed {
                self.fail(failures, Check::Completed, format!("{}: client got {} tokens, mock sent {}", p.id, seen.received_tokens, u.tokens_flushed));
            }
            // The client sees the stream it asked for: no usage chunk it did not request.
            if p.api == Api::ChatStream && seen.usage_seen {
                self.fail(failures, Check::Completed, format!("{}: usage chunk reached a client that did not ask for it", p.id));
            }
        } else {
            let flushed = r.upstream.map_or(0, |u| u.tokens_flushed);
            if !(seen.received_tokens <= output && output <= flushed) {
                self.fail(
                    failures,
                    Check::Interrupted,
                    format!(
                        "{}: client received {} ≤ charged output {output} ≤ mock flushed {flushed} does not hold ({:?}, {stamp})",
                        p.id, seen.received_tokens, p.fault
                    ),
                );
            }
        }

        let mut charges = Vec::new();
        let Some(start) = r.log.start_ms else {
            self.fail(failures, Check::Join, format!("{}: no start_epoch in the access log", p.id));
            return Admitted { completed, charges };
        };
        let end = start + r.log.duration_ms as i64 + WINDOW_SLACK_MS;
        for (bi, (b, list)) in self.policy.budgets.iter().zip(self.charges.iter_mut()).enumerate() {
            if !self.policy.applies(b, p.key) {
                continue;
            }
            let c = Charge { id: p.id.clone(), amount: b.measure.amount(input, output, micro_usd), first: b.window.of(start), last: b.window.of(end) };
            list.push(c.clone());
            charges.push((bi, c));
        }
        Admitted { completed, charges }
    }

    /// Requests that reached the mock without being in the plan (or twice) would escape the join.
    pub fn check_unplanned(&self, plans: &[Planned], records: &Records, failures: &mut Failures) {
        let planned: HashSet<&str> = plans.iter().map(|p| p.id.as_str()).collect();
        for id in records.upstream.keys() {
            if !planned.contains(id.as_str()) {
                self.fail(failures, Check::Join, format!("the mock served request_id {id:?}, which this run never sent"));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn month_windows_follow_the_calendar() {
        // 2024-02-29T23:59:59.999Z and 2024-03-01T00:00:00Z
        let leap_end = 1_709_251_199_999;
        assert_eq!(year_month(leap_end / 86_400_000), (2024, 2));
        assert_eq!(Window::Month.of(leap_end) + 1, Window::Month.of(leap_end + 1));
        assert_eq!(year_month(0), (1970, 1));
        assert_eq!(Window::Minute.of(119_999), 1);
    }

    #[test]
    fn window_check_catches_overshoot_and_tolerates_edges() {
        let b = Budget { level: "key", id: "k".into(), n: 0, window: Window::Minute, measure: Measure::TotalTokens, limit: 100 };
        let c = |amount, first, last| Charge { id: "x".into(), amount, first, last };
        // 60 + 50 in one window: over.
        assert_eq!(check_windows(&b, &[c(60, 1, 1), c(50, 1, 1)]).violations.len(), 1);
        // The 50 straddles the edge and fits in the next window.
        let edge = check_windows(&b, &[c(60, 1, 1), c(50, 1, 2), c(40, 2, 2)]);
        assert!(edge.violations.is_empty());
        assert_eq!((edge.moved, edge.peak), (1, 90));
        // …but not if the next window is full too.
        assert_eq!(check_windows(&b, &[c(60, 1, 1), c(50, 1, 2), c(60, 2, 2)]).violations.len(), 1);
    }

    #[test]
    fn token_counting_ignores_usage_fields_and_partial_events() {
        let sse = b"data: {\"content\":\"tok0 \"}\n\ndata: {\"usage\":{\"prompt_tokens\":3}}\n\ndata: {\"content\":\"tok1";
        assert_eq!(count_tokens(complete_events(sse)), 1);
        assert_eq!(count_tokens(sse), 2);
    }

    #[test]
    fn a_policy_reads_back_what_it_was_written_from() {
        let budgets = [
            Budget { level: "org", id: "acme".into(), n: 0, window: Window::Month, measure: Measure::MicroUsd, limit: 12_000 },
            Budget { level: "key", id: "search-prod".into(), n: 0, window: Window::Day, measure: Measure::OutputTokens, limit: 300 },
            Budget { level: "key", id: "search-prod".into(), n: 1, window: Window::Minute, measure: Measure::Requests, limit: 4 },
        ];
        let of = |id: &str| Value::Array(budgets.iter().filter(|b| b.id == id).map(Budget::json).collect());
        let text = json!({"orgs": [{"id": "acme", "budgets": of("acme"), "teams": [{"id": "search", "keys": [{"id": "search-prod", "budgets": of("search-prod")}]}]}]});
        let policy = Policy::parse(&text.to_string()).unwrap();
        let read: Vec<String> = policy.budgets.iter().map(|b| format!("{} n{} {}", b.describe(), b.n, b.refusal_code())).collect();
        let written: Vec<String> = budgets.iter().map(|b| format!("{} n{} {}", b.describe(), b.n, b.refusal_code())).collect();
        assert_eq!(read, written);
        assert!(policy.names_a_budget("key:search-prod:day:output_tokens", "search-prod"));
        assert!(policy.names_a_budget("org:acme:month:micro_usd", "search-prod"));
        assert!(!policy.names_a_budget("key:search-prod:day:output_tokens", "ads-rt"));
    }
}
