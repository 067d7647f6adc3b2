//! Budgets across Envoy replicas (issue 10), in real processes: Debian's `redis-server`, the
//! `sluice-ledger` service, several Envoys running `envoy/templates/fleet-gateway.yaml` (tenant-budget in Redis
//! mode, the buffer filter, llm-metrics) and the recording mock upstream, over loopback sockets.
//!
//! (a) three Envoys × two workers, ≥ 3,000 requests over 96 kept-alive connections spread over the
//!     three, budgets sized so that a good share is refused, ≈ 5 % client disconnects and ≈ 5 %
//!     upstream resets: every completed request is charged exactly the upstream's usage (the three
//!     access logs joined with the mock's ledger by `x-request-id`), interrupted ones between what
//!     the client got and what the mock flushed, Σ charged over the fleet never above a limit in any
//!     window, and Redis's counters equal to the charges; then the same traffic with
//!     `"ledger": {"mode": "local"}` on three fresh Envoys: each Envoy exact on its own, the fleet
//!     above the limits — both printed side by side;
//! (b) the ledger service SIGKILLed mid-run and restarted: with `on_failure: deny` 503
//!     `budget_ledger_unavailable` (OpenAI shape) during the outage, with `on_failure: local` traffic
//!     continues under the limits divided by `replicas`; settlements of requests in flight across the
//!     outage are not lost (Redis equals the charges settled before and after); the local fallback
//!     starts from zero (printed: a key's day over its limit across the outage); a request refused 503
//!     while Redis was stalled has its hold id released by the plugin a second later, so the script
//!     that runs when Redis wakes leaves no hold (or the release finds it and frees it); the hold left
//!     behind by a killed Envoy expires (`reservation_ttl_minutes: 1`) and is charged at its
//!     reservation, a late settle answered `expired`;
//! (c) Redis SIGKILLed and restarted with `appendonly yes`: every counter intact, limits still
//!     enforced from where they were, traffic continues;
//! (d) 1,000 JWT subjects (`x-jwt-payload`, as jwt_authn's `forward_payload_header` writes it) under
//!     one `identity_budgets` template of 2 requests a day, their requests spread over two Envoys: the
//!     third request of each subject is refused, no other; no stat series per identity;
//! (e) refusals (429 budget, 503 ledger down) reach the upstream not at all — no connection, no
//!     request head — through the fleet, budget and full gateways; the same fleet gateway without the
//!     buffer filter sends the refused request's headers upstream (the control that shows the check
//!     can fail).
//!
//! The tests take turns (a lock): each runs several Envoys, and the project's machine has 2 cores.
//! Test (b) gives its turn away while it waits a minute for its holds to expire. Figures are printed
//! (`cargo test -p sluice-e2e --test budget_fleet -- --nocapture`), also when a test fails.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use serde_json::{json, Value};
use sluice_e2e::budget_traffic::{
    check_windows, error_fields, plan_traffic, read_logs, run_traffic, stamp_str, stamp_u64, Budget, Charge, Check, Failures, Fault, Figures, Logged, Measure,
    Planned, Policy, Records, Seen, Tally, Window, CHAT, KEYS, LEDGER_UNAVAILABLE,
};
use sluice_e2e::gateway::{demo_plugin_config, shipped, start_budget_gateway, start_full_gateway, yaml_string_body};
use sluice_e2e::ledger::{LedgerService, PREFIX};
use sluice_e2e::redis::{redis_server_bin, Persistence, Redis, Resp};
use sluice_e2e::tools::{ledger_bin, mock_bin, wasm_dir};
use sluice_e2e::{base64url, wait_until, Connection, Envoy, MockServer, StreamedResponse, Tools};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

// =============================================================================================
// Shared set-up

/// One test at a time: each runs several Envoys.
static TURN: Mutex<()> = Mutex::new(());

/// Waits for this test's turn. Test (b) asks `first`: started alongside the others (libtest starts
/// two at once on 2 cores), it takes the first turn, and gives it away during its one-minute wait,
/// which the others then use; the others give it 300 ms to do so.
fn my_turn(first: bool) -> MutexGuard<'static, ()> {
    if !first {
        std::thread::sleep(Duration::from_millis(300));
    }
    TURN.lock().unwrap_or_else(|e| e.into_inner())
}

/// Whether everything the fleet tests run is here. Skipped (with a note) on a fresh clone without
/// Envoy; when `SLUICE_ENVOY` is set (`cargo xtask test`), anything missing is a failure.
fn prerequisites() -> bool {
    if Tools::locate_or_skip().unwrap().is_none() {
        return false;
    }
    let mut missing: Vec<String> = [redis_server_bin().err(), ledger_bin().err(), mock_bin().err()].into_iter().flatten().map(|e| format!("{e:#}")).collect();
    let wasm = wasm_dir().join("sluice_tenant_budget.wasm");
    if !wasm.is_file() {
        missing.push(format!("{} is missing: build the plugins with `cargo xtask build`", wasm.display()));
    }
    if missing.is_empty() {
        return true;
    }
    assert!(std::env::var_os("SLUICE_ENVOY").is_none(), "the fleet tests cannot run:\n{}", missing.join("\n"));
    eprintln!("skipping fleet test: {}", missing.join("; "));
    false
}

/// llm-metrics rides along as in production; its summary comment would change what clients
/// receive, so it is off.
fn metrics_config() -> String {
    let mut v: Value = serde_json::from_str(&demo_plugin_config().unwrap()).unwrap();
    v["stream_summary_comment"] = json!(false);
    v.to_string()
}

fn fleet_template() -> String {
    std::fs::read_to_string(shipped("envoy/templates/fleet-gateway.yaml")).unwrap()
}

/// The fleet gateway without its buffer filter: the control of test (e).
fn fleet_template_without_buffer() -> String {
    let t = fleet_template();
    let start = t.find("          # Holds the request (headers and body)").expect("the buffer filter's comment");
    let marker = "max_request_bytes: 9437184\n";
    let end = start + t[start..].find(marker).expect("the buffer filter") + marker.len();
    let out = format!("{}{}", &t[..start], &t[end..]);
    assert!(!out.contains("envoy.filters.http.buffer"));
    out
}

/// Starts an Envoy on `template` (the fleet gateway's placeholders) in front of `mock`, calling the
/// ledger service on `ledger_port`, with tenant-budget's `policy`.
/// The node id fleet Envoy `n` runs with (`--service-node`).
fn node_id(n: usize) -> String {
    format!("fleet-{n}")
}

/// What every hold id of the Envoy named `node` starts with (docs/ledger.md, "the hold's name").
fn hold_prefix(node: &str) -> String {
    sluice_core::identity::sha256_hex(node.as_bytes()).get(..8).unwrap_or_default().to_string()
}

fn fleet_envoy_from(template: &str, mock: &MockServer, ledger_port: u16, policy: &str, node: &str) -> Envoy {
    let upstream = mock.port().to_string();
    let ledger = ledger_port.to_string();
    let budget = yaml_string_body(policy);
    let metrics = yaml_string_body(&metrics_config());
    Envoy::start_with_args(
        template,
        &[("UPSTREAM_PORT", upstream.as_str()), ("LEDGER_PORT", ledger.as_str()), ("BUDGET_CONFIG", budget.as_str()), ("PLUGIN_CONFIG", metrics.as_str())],
        &["--service-node", node],
    )
    .unwrap()
}

/// `policies.len()` fleet-gateway Envoys, started two at a time (V8 compiles the plugins); Envoy
/// `n` has node id [`node_id`]`(n)`.
fn fleet_envoys(mock: &MockServer, ledger_port: u16, policies: &[&str]) -> Vec<Envoy> {
    let template = fleet_template();
    let mut out = Vec::new();
    for (pair_index, pair) in policies.chunks(2).enumerate() {
        let started: Vec<Envoy> = std::thread::scope(|s| {
            let template = &template;
            let handles: Vec<_> =
                pair.iter().enumerate().map(|(i, p)| s.spawn(move || fleet_envoy_from(template, mock, ledger_port, p, &node_id(2 * pair_index + i)))).collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        out.extend(started);
    }
    out
}

fn redis_ledger(ledger: &str, on_failure: &str, extra: Value) -> Value {
    let mut v = json!({"mode": ledger, "cluster": "sluice_ledger", "authority": "sluice-ledger", "timeout_ms": 250, "on_failure": on_failure});
    if let Value::Object(m) = extra {
        for (k, x) in m {
            v[k] = x;
        }
    }
    v
}

/// Request id → the body states of every head the mock read with that id.
fn read_heads(mock: &MockServer) -> HashMap<String, Vec<String>> {
    let mut out: HashMap<String, Vec<String>> = HashMap::new();
    for h in mock.heads().unwrap() {
        if let Some(id) = h.request_id {
            out.entry(id).or_default().push(h.body);
        }
    }
    out
}

/// The sum of a Prometheus counter (all label sets matching `labels`) over several Envoys.
fn metric_sum(envoys: &[&Envoy], name: &str, labels: &[(&str, &str)]) -> f64 {
    envoys.iter().map(|e| e.metrics().ok().and_then(|m| m.value(name, labels)).unwrap_or(0.0)).sum()
}

/// Sends one chat request (body written `pause` after the head) on a new connection and reads the
/// whole answer.
fn send(addr: SocketAddr, headers: &[(&str, &str)], body: &str, pause: Duration) -> StreamedResponse {
    Connection::connect(addr).unwrap().send_with_pause("POST", CHAT, headers, body.as_bytes(), pause).unwrap().collect().unwrap()
}

fn chat(stream: bool, max_tokens: Option<u64>, text: &str) -> String {
    let mut v = json!({"model": "llama-3-70b", "stream": stream, "messages": [{"role": "user", "content": text}]});
    if stream {
        v["stream_options"] = json!({"include_usage": true});
    }
    if let Some(m) = max_tokens {
        v["max_tokens"] = json!(m);
    }
    v.to_string()
}

/// The refusal body of `resp`: `(type, code)` of OpenAI's error shape.
fn error_of(resp: &StreamedResponse) -> (String, String) {
    error_fields(&resp.body())
}

// =============================================================================================
// (a) The fleet, exact; the local ledgers, not

const A_REQUESTS: usize = 3000;
const A_CONNECTIONS: usize = 96;
const A_ENVOYS: usize = 3;
/// No new request after this; the test fails if fewer than 3,000 were sent.
const A_TRAFFIC_DEADLINE: Duration = Duration::from_secs(70);
const A_SEED: u64 = 0xf1ee_7b0d_9e7c_0ffe;
/// The plugin's output limit when a request sets none (the policy's `default_max_output_tokens`).
const A_DEFAULT_MAX_OUTPUT: u64 = 64;

/// What a request costs if admitted and answered whole, by the mock's token rule
/// (`ceil(chars / 4) + 4` per text unit; the system prompt is 8): (input, output).
fn full_usage(p: &Planned) -> (u64, u64) {
    let input = 8 + (p.user_text.chars().count() as u64).div_ceil(4) + 4;
    (input, p.tokens.min(p.max_tokens.unwrap_or(A_DEFAULT_MAX_OUTPUT)))
}

/// Test (a)'s budgets, sized from the plan: each metered budget is 30–35 % of what its traffic
/// would cost if all of it were admitted, so the fleet must refuse most of it, while each of three
/// local ledgers sees a third of the traffic and lets nearly all of that through. Five keys are
/// metered below what their traffic asks for; `ads-rt` and `labs-open` have room for everything.
fn a_budgets(plans: &[Planned]) -> Vec<Budget> {
    let demand = |keys: &[&str], f: &dyn Fn(u64, u64) -> u64| -> u64 {
        plans
            .iter()
            .filter(|p| keys.contains(&p.key))
            .map(|p| {
                let (i, o) = full_usage(p);
                f(i, o)
            })
            .sum()
    };
    let total = |i: u64, o: u64| i + o;
    let pct = |x: u64, p: u64| (x * p / 100).max(1);
    let search = ["search-prod", "search-dev", "search-batch"];
    let b = |level, id: &str, n, window, measure, limit| Budget { level, id: id.to_string(), n, window, measure, limit };
    use Measure::*;
    use Window::*;
    vec![
        b("org", "acme", 0, Month, MicroUsd, 5_000_000),
        b("team", "search", 0, Day, TotalTokens, pct(demand(&search, &total), 35)),
        b("key", "search-prod", 0, Day, TotalTokens, pct(demand(&["search-prod"], &total), 30)),
        b("key", "search-dev", 0, Day, Requests, pct(demand(&["search-dev"], &|_, _| 1), 30)),
        b("key", "ads-batch", 0, Day, OutputTokens, pct(demand(&["ads-batch"], &|_, o| o), 30)),
        b("key", "ads-rt", 0, Day, TotalTokens, 10 * demand(&["ads-rt"], &total)),
        b("org", "globex", 0, Month, MicroUsd, 5_000_000),
        b("team", "labs", 0, Day, TotalTokens, 10_000_000),
        // Whole thousandths of a dollar, so the policy's decimal USD reads back exactly.
        b("key", "labs-metered", 0, Month, MicroUsd, pct(demand(&["labs-metered"], &|i, o| i + 4 * o), 30) / 1000 * 1000),
        b("key", "labs-open", 0, Day, InputTokens, 3_000_000),
    ]
}

fn a_policy(budgets: &[Budget], ledger: Value) -> String {
    let of = |level: &str, id: &str| -> Value { Value::Array(budgets.iter().filter(|b| b.level == level && b.id == id).map(Budget::json).collect()) };
    let mut orgs = Vec::new();
    for org in ["acme", "globex"] {
        let mut teams = Vec::new();
        let mut team_ids: Vec<&str> = KEYS.iter().filter(|k| k.org == org).map(|k| k.team).collect();
        team_ids.dedup();
        for team in team_ids {
            let keys: Vec<Value> = KEYS.iter().filter(|k| k.team == team).map(|k| json!({"id": k.key, "budgets": of("key", k.key)})).collect();
            teams.push(json!({"id": team, "budgets": of("team", team), "keys": keys}));
        }
        orgs.push(json!({"id": org, "budgets": of("org", org), "teams": teams}));
    }
    json!({
        "mode": "strict",
        "identity": {"header": "x-sluice-key"},
        "unknown": {"action": "reject"},
        "include_usage": true,
        "default_max_output_tokens": A_DEFAULT_MAX_OUTPUT,
        "ledger": ledger,
        "orgs": orgs,
        "prices": [{"model": "*", "input_usd_per_mtok": 1.0, "output_usd_per_mtok": 4.0}],
    })
    .to_string()
}

/// One run of test (a)'s traffic, checked.
struct RunReport {
    figures: BTreeMap<&'static str, Figures>,
    /// Per budget: every Envoy's charges together, and each Envoy's own.
    fleet: Vec<Vec<Charge>>,
    per_envoy: Vec<Vec<Vec<Charge>>>,
    statuses: BTreeMap<String, u64>,
    traffic_time: Duration,
    sent: usize,
    refused_without_head: usize,
}

/// Joins what the clients saw, the three access logs, the mock's ledger and the heads it read, and
/// checks every request (see the file's doc, (a) and (e)).
fn check_run(
    plans: &[Planned],
    results: &[(usize, Seen)],
    envoys: &[&Envoy],
    mock: &MockServer,
    policy: &Policy,
    redis_mode: bool,
    failures: &mut Failures,
) -> RunReport {
    let records = Records::read(envoys, mock, results.len()).unwrap();
    let heads = read_heads(mock);
    let mut per_envoy: Vec<Vec<Vec<Charge>>> = envoys.iter().map(|_| policy.budgets.iter().map(|_| Vec::new()).collect()).collect();
    let mut refused_without_head = 0;
    let mode = if redis_mode { "redis" } else { "local" };
    let check = |c: &str| format!("{mode} {c}");
    let name = |c: Check| {
        check(match c {
            Check::Join => "join",
            Check::Stamp => "stamp",
            Check::Strict => "strict",
            Check::Completed => "exact",
            Check::Interrupted => "interrupted",
            Check::Refused => "refused",
            Check::TooMany => "429",
        })
    };
    let mut tally = Tally::new(policy, &name);

    for (i, seen) in results {
        let Some(r) = tally.join(&plans[*i], seen, &records, failures) else { continue };
        let p = r.plan;
        // (e) a refusal reaches the upstream not at all: no ledger record, no request head.
        if r.decision == "rejected" {
            let code = stamp_str(r.stamp, "reject_code");
            if r.upstream.is_some() || heads.contains_key(&p.id) {
                failures.add(&check("(e)"), format!("{}: refused ({code}) but the mock saw it: heads {:?}", p.id, heads.get(&p.id)));
            } else {
                refused_without_head += 1;
            }
            if seen.status.is_some() && r.log.status != seen.status.map(u64::from) {
                failures.add(&check("refused"), format!("{}: the client got {:?}, the access log says {:?}", p.id, seen.status, r.log.status));
            }
            tally.check_refusal(&r, failures);
            if seen.status.is_some() && seen.status != Some(429) && code != LEDGER_UNAVAILABLE {
                failures.add(&check("refused"), format!("{}: refused ({code}) with status {:?}", p.id, seen.status));
            }
            continue;
        }
        if !r.admitted() {
            continue;
        }
        let ledger_field = stamp_str(r.stamp, "ledger");
        if redis_mode && ledger_field != "redis" {
            failures.add(&check("ledger"), format!("{}: admitted by ledger {ledger_field:?}, not redis: {}", p.id, r.stamp));
        }
        // A hold in Redis names the Envoy that made it.
        let hold = stamp_str(r.stamp, "ledger_hold");
        let want = hold_prefix(&node_id(r.log.envoy));
        if redis_mode && !hold.starts_with(&want) {
            failures
                .add(&check("hold id"), format!("{}: hold {hold:?} on Envoy {} (node {}) does not start with {want}", p.id, r.log.envoy, node_id(r.log.envoy)));
        }
        for (bi, c) in tally.check_admitted(&r, failures).charges {
            per_envoy[r.log.envoy][bi].push(c);
        }
    }
    tally.check_unplanned(plans, &records, failures);
    // Per key, the stamps add up to the plugin's counters, summed over the Envoys.
    for (k, f) in &tally.figures {
        let have = metric_sum(envoys, "sluice_budget_charged_tokens_total", &[("key", k)]);
        if have != f.charged_tokens as f64 {
            failures.add(&check("metrics"), format!("{k}: Σ sluice_budget_charged_tokens_total = {have}, the stamps add up to {}", f.charged_tokens));
        }
    }
    RunReport {
        figures: tally.figures,
        fleet: tally.charges,
        per_envoy,
        statuses: tally.statuses,
        traffic_time: Duration::ZERO,
        sent: results.len(),
        refused_without_head,
    }
}

/// Runs test (a)'s traffic on `envoys`, then checks it.
fn a_run(envoys: &[&Envoy], mock: &MockServer, plans: &[Planned], policy: &Policy, redis_mode: bool, failures: &mut Failures) -> RunReport {
    mock.reset().unwrap();
    let addrs: Vec<SocketAddr> = envoys.iter().map(|e| e.listen_addr()).collect();
    let started = Instant::now();
    // `A_CONNECTIONS` threads, thread `t` on Envoy `t % n`.
    let results = run_traffic(&addrs, plans, A_CONNECTIONS, A_TRAFFIC_DEADLINE).unwrap();
    let traffic_time = started.elapsed();
    let mut report = check_run(plans, &results, envoys, mock, policy, redis_mode, failures);
    report.traffic_time = traffic_time;
    report
}

#[test]
fn a_fleet_budgets_are_exact_across_three_envoys_and_local_ledgers_overshoot() {
    if !prerequisites() {
        return;
    }
    let _turn = my_turn(false);
    let started = Instant::now();
    let redis = Redis::start(Persistence::None).unwrap();
    let ledger = LedgerService::start(&redis.url(), 2).unwrap();
    let mock = MockServer::start(&[]).unwrap();
    let strict_plan = plan_traffic(A_REQUESTS, A_SEED, "fleet");
    let local_plan: Vec<Planned> = strict_plan.iter().map(|p| Planned { id: p.id.replacen("fleet", "local", 1), ..p.clone() }).collect();
    let policy = Policy::of_traffic_keys(a_budgets(&strict_plan));
    let budgets = &policy.budgets;
    let mut failures = Failures::default();

    // The fleet: one Redis ledger. A generous admission timeout: on 2 cores, 96 connections keep
    // every process busy, and a timed-out reservation would be refused (503), not miscounted.
    let fleet_policy = a_policy(budgets, redis_ledger("redis", "deny", json!({"timeout_ms": 2000})));
    let envoys = fleet_envoys(&mock, ledger.port(), &[&fleet_policy, &fleet_policy, &fleet_policy]);
    let refs: Vec<&Envoy> = envoys.iter().collect();
    let strict = a_run(&refs, &mock, &strict_plan, &policy, true, &mut failures);

    // Redis agrees with the stamps once every settlement has landed (they are sent from the root
    // context's tick): per budget, Σ used over windows = Σ charged, nothing left reserved.
    let stamped: Vec<u64> = strict.fleet.iter().map(|c| c.iter().map(|c| c.amount).sum()).collect();
    let redis_view = |redis: &Redis| -> (Vec<u64>, Vec<u64>, Vec<u64>) {
        let counters = redis.ledger_counters(PREFIX).unwrap();
        let mut used = vec![0; budgets.len()];
        let mut reserved = vec![0; budgets.len()];
        let mut peak = vec![0; budgets.len()];
        for ((_, key), (u, r)) in &counters {
            for (bi, b) in budgets.iter().enumerate() {
                if key.starts_with(&b.redis_prefix()) {
                    used[bi] += u;
                    reserved[bi] += r;
                    peak[bi] = peak[bi].max(*u);
                }
            }
        }
        (used, reserved, peak)
    };
    let drained = wait_until(Duration::from_secs(15), "Redis to hold every settlement", || {
        let (used, reserved, _) = redis_view(&redis);
        Ok((used == stamped && reserved.iter().all(|r| *r == 0)).then_some(()))
    });
    let (redis_used, redis_reserved, redis_peak) = redis_view(&redis);
    if drained.is_err() {
        for (bi, b) in budgets.iter().enumerate() {
            if redis_used[bi] != stamped[bi] || redis_reserved[bi] != 0 {
                failures.add(
                    "redis counters",
                    format!("{}: Redis used {} reserved {}, the stamps charge {}", b.describe(), redis_used[bi], redis_reserved[bi], stamped[bi]),
                );
            }
        }
    }
    let dropped = metric_sum(&refs, "sluice_budget_ledger_settlements_dropped_total", &[]);
    failures.that("redis counters", dropped == 0.0, || format!("{dropped} settlements dropped"));
    // Three counts of the same calls: the stamps, the Envoys' ledger-call counters, the service's.
    let admitted: u64 = strict.figures.values().map(Figures::let_through).sum();
    let refused: u64 = strict.figures.values().map(|f| f.rejected).sum();
    let service = sluice_e2e::prometheus::Metrics::parse(&ledger.metrics().unwrap()).unwrap();
    let served =
        |endpoint: &str, result: &str| service.value("sluice_ledger_requests_total", &[("endpoint", endpoint), ("result", result)]).unwrap_or(0.0) as u64;
    let reserve_calls = metric_sum(&refs, "sluice_budget_ledger_calls_total", &[("call", "reserve"), ("result", "ok")]) as u64;
    let settle_calls = metric_sum(&refs, "sluice_budget_ledger_calls_total", &[("call", "settle"), ("result", "ok")]) as u64;
    let call_counts = format!(
        "stamps: {admitted} admitted, {refused} refused; Envoys' ledger calls: {reserve_calls} reserve ok, {settle_calls} settle ok; the service: reserve admitted {} refused {}, settle settled {} already_settled {}, {} settlement batches",
        served("reserve", "admitted"),
        served("reserve", "refused"),
        served("settle", "settled"),
        served("settle", "already_settled"),
        served("settle_batch", "ok")
    );
    println!("{call_counts}");
    failures.that(
        "ledger calls",
        served("reserve", "admitted") == admitted
            && served("reserve", "refused") == refused
            && served("settle", "settled") == admitted
            && reserve_calls == admitted + refused
            && settle_calls >= admitted,
        || call_counts.clone(),
    );
    drop(envoys);

    // The same traffic, each Envoy with its own ledger.
    let local_policy = a_policy(budgets, json!({"mode": "local"}));
    let envoys = fleet_envoys(&mock, ledger.port(), &[&local_policy, &local_policy, &local_policy]);
    let refs: Vec<&Envoy> = envoys.iter().collect();
    let local = a_run(&refs, &mock, &local_plan, &policy, false, &mut failures);
    drop(envoys);

    // Limits: the fleet never above one in any window; each local Envoy not above one on its own;
    // the local fleet together above at least one.
    let mut lines = Vec::new();
    let mut overshoots = 0;
    for (bi, b) in budgets.iter().enumerate() {
        let fleet = check_windows(b, &strict.fleet[bi]);
        let strict_peak = fleet.peak;
        for v in fleet.violations {
            failures.add("(a) fleet overshoot", v);
        }
        if redis_peak[bi] > b.limit {
            failures.add("(a) fleet overshoot", format!("{}: a Redis counter holds {} used", b.describe(), redis_peak[bi]));
        }
        let mut envoy_peaks = Vec::new();
        for (e, charges) in local.per_envoy.iter().enumerate() {
            let own = check_windows(b, &charges[bi]);
            for v in own.violations {
                failures.add("(a) local Envoy overshoot", format!("Envoy {e}: {v}"));
            }
            envoy_peaks.push(own.peak);
        }
        let together = check_windows(b, &local.fleet[bi]);
        let local_peak = together.peak;
        if !together.violations.is_empty() {
            overshoots += 1;
        }
        lines.push(format!(
            "  {:<36} {:>9} │ {:>9} {:>9} {:>6.1} % │ {:>9} {:>6.1} %  ({})",
            b.describe(),
            b.limit,
            strict_peak,
            redis_used[bi],
            strict_peak as f64 * 100.0 / b.limit as f64,
            local_peak,
            local_peak as f64 * 100.0 / b.limit as f64,
            envoy_peaks.iter().map(u64::to_string).collect::<Vec<_>>().join(" + ")
        ));
    }
    failures.that("(a) local overshoot", overshoots > 0, || "no budget was overshot by three local ledgers: the contrast is missing".into());

    // The run was meaningful: enough traffic, a good share refused, most of the rest admitted.
    for (label, run) in [("redis", &strict), ("local", &local)] {
        failures.that(&format!("{label} volume"), run.sent >= A_REQUESTS, || format!("only {} requests sent within {A_TRAFFIC_DEADLINE:?}", run.sent));
        let unavailable: u64 = run.figures.values().map(|f| f.unavailable).sum();
        failures.that(&format!("{label} volume"), unavailable == 0, || format!("{unavailable} requests refused for an unavailable ledger"));
    }
    let rejected: u64 = strict.figures.values().map(|f| f.rejected).sum();
    failures
        .that("(a) volume", rejected * 100 >= strict.sent as u64 * 15, || format!("only {rejected} of {} refused: the limits were barely tested", strict.sent));

    let mut table = String::new();
    let _ = writeln!(
        table,
        "\n(a) {A_REQUESTS} requests over {A_CONNECTIONS} connections spread over {A_ENVOYS} Envoys × 2 workers; Redis ledger {:.1} s, local ledgers {:.1} s (test {:.1} s)",
        strict.traffic_time.as_secs_f64(),
        local.traffic_time.as_secs_f64(),
        started.elapsed().as_secs_f64()
    );
    let _ = writeln!(table, "statuses — redis: {:?}; local: {:?}", strict.statuses, local.statuses);
    let _ = writeln!(table, "{call_counts}");
    let _ = writeln!(
        table,
        "refused requests the mock saw no head of: redis {} of {}, local {} of {}",
        strict.refused_without_head,
        strict.figures.values().map(|f| f.rejected + f.unavailable).sum::<u64>(),
        local.refused_without_head,
        local.figures.values().map(|f| f.rejected + f.unavailable).sum::<u64>()
    );
    let _ = writeln!(table, "{:<19} │ {:^46} │ {:^28}", "", "one Redis ledger", "a local ledger per Envoy");
    let _ = writeln!(
        table,
        "{:<13} {:>5} │ {:>8} {:>8} {:>6} {:>6} {:>9} │ {:>8} {:>8} {:>9}",
        "key", "sent", "admitted", "refused", "discon", "resets", "tokens", "admitted", "refused", "tokens"
    );
    for (k, f) in &strict.figures {
        let l = &local.figures[k];
        let _ = writeln!(
            table,
            "{:<13} {:>5} │ {:>8} {:>8} {:>6} {:>6} {:>9} │ {:>8} {:>8} {:>9}",
            k,
            f.sent,
            f.let_through(),
            f.rejected,
            f.disconnects,
            f.resets,
            f.charged_tokens,
            l.let_through(),
            l.rejected,
            l.charged_tokens
        );
    }
    let _ = writeln!(
        table,
        "budgets, peak window charged over the fleet (stamps of the three Envoys), and Redis's counter:\n  {:<36} {:>9} │ {:>9} {:>9} {:>8} │ {:>9} {:>8}  (per Envoy)",
        "budget", "limit", "fleet Σ", "Redis", "of limit", "fleet Σ", "of limit"
    );
    for l in &lines {
        let _ = writeln!(table, "{l}");
    }
    println!("{table}");
    failures.verdict(&format!("ledger stderr:\n{}", ledger.stderr_tail(10))).unwrap();
}

// =============================================================================================
// (b) The ledger service killed and restarted

/// Test (b)'s policy: key `k` with room for everything, key `lim` with 12 requests a day (6 per
/// Envoy when the local fallback divides it by `replicas: 2`), holds kept one minute.
fn b_policy(on_failure: &str) -> String {
    json!({
        "mode": "strict",
        "identity": {"header": "x-sluice-key"},
        "include_usage": true,
        "default_max_output_tokens": 64,
        "reservation_ttl_minutes": 1,
        "ledger": redis_ledger("redis", on_failure, json!({"replicas": 2})),
        "orgs": [{"id": "acme", "teams": [{"id": "t", "keys": [
            {"id": "k", "budgets": [{"window": "day", "tokens": 10_000_000}]},
            {"id": "lim", "budgets": [{"window": "day", "requests": 12}]}]}]}],
        "prices": [{"model": "*", "input_usd_per_mtok": 1.0, "output_usd_per_mtok": 4.0}],
    })
    .to_string()
}

/// One request of test (b)'s traffic.
#[derive(Debug, Clone)]
struct Sent {
    envoy: usize,
    id: String,
    /// Phase (0 before the kill, 1 outage, 2 after the restart) when sent and when answered.
    phase_sent: u8,
    phase_done: u8,
    status: u16,
    error: (String, String),
    retry_after: Option<String>,
}

/// A hold the Redis ledger still keeps: its id, expiry (Redis ms) and counters with amounts.
#[derive(Debug, Clone)]
struct Hold {
    id: String,
    expires_ms: u64,
    counters: Vec<(String, u64)>,
}

fn holds(redis: &Redis, org: &str) -> Vec<Hold> {
    let ids = match redis.command(&["ZRANGE", &format!("{PREFIX}:{{{org}}}:holds"), "0", "-1"]).unwrap() {
        Resp::Array(Some(items)) => items.into_iter().filter_map(|i| i.text()).collect::<Vec<_>>(),
        _ => Vec::new(),
    };
    ids.into_iter()
        .filter_map(|id| {
            let raw = redis.command(&["GET", &format!("{PREFIX}:{{{org}}}:h:{id}")]).unwrap().text()?;
            let v: Value = serde_json::from_str(&raw).ok()?;
            let counters = v["c"].as_array()?.iter().filter_map(|c| Some((c[0].as_str()?.to_string(), c[1].as_str()?.parse().ok()?))).collect();
            Some(Hold { id, expires_ms: v["e"].as_f64()? as u64, counters })
        })
        .collect()
}

fn redis_time_ms(redis: &Redis) -> u64 {
    match redis.command(&["TIME"]).unwrap() {
        Resp::Array(Some(t)) => {
            let s: u64 = t[0].text().unwrap().parse().unwrap();
            let us: u64 = t[1].text().unwrap().parse().unwrap();
            s * 1000 + us / 1000
        }
        other => panic!("TIME: {other:?}"),
    }
}

/// `(used, reserved)` of the Redis counters whose key starts with `prefix` (org `org`), summed.
fn counter_state(redis: &Redis, org: &str, prefix: &str) -> (u64, u64) {
    redis
        .ledger_counters(PREFIX)
        .unwrap()
        .into_iter()
        .filter(|((o, k), _)| o == org && k.starts_with(prefix))
        .fold((0, 0), |(u, r), (_, (cu, cr))| (u + cu, r + cr))
}

#[test]
fn b_the_ledger_killed_mid_run_loses_no_settled_usage_and_its_outage_follows_on_failure() {
    if !prerequisites() {
        return;
    }
    let turn = my_turn(true);
    let started = Instant::now();
    let redis = Redis::start(Persistence::None).unwrap();
    let mut ledger = LedgerService::start(&redis.url(), 2).unwrap();
    let mock = MockServer::start(&[]).unwrap();
    let (deny, local) = (b_policy("deny"), b_policy("local"));
    let mut envoys = fleet_envoys(&mock, ledger.port(), &[&deny, &local, &deny]);
    let victim = envoys.pop().unwrap();
    let (e_deny, e_local) = (&envoys[0], &envoys[1]);
    let addrs = [e_deny.listen_addr(), e_local.listen_addr()];
    let mut failures = Failures::default();
    let k_prefix = "key:k:day:total_tokens:w";

    // A request in flight on an Envoy that dies: its hold is left in Redis, never settled.
    let victim_addr = victim.listen_addr();
    let victim_body = chat(true, None, "orphan");
    let victim_thread = std::thread::spawn(move || {
        let h = [("x-request-id", "b-victim"), ("x-sluice-key", "k"), ("x-mock-tokens", "400"), ("x-mock-itl-ms", "100")];
        let mut s = Connection::connect(victim_addr).unwrap().send("POST", CHAT, &h, victim_body.as_bytes()).unwrap();
        let status = s.status;
        // Keep reading until Envoy goes away.
        while let Ok(Some(_)) = s.next_chunk() {}
        status
    });
    wait_until(Duration::from_secs(10), "the victim's stream to reach the mock", || {
        Ok(mock.heads()?.iter().any(|h| h.request_id.as_deref() == Some("b-victim")).then_some(()))
    })
    .unwrap();
    std::thread::sleep(Duration::from_millis(200));
    drop(victim); // SIGKILL
    let victim_status = victim_thread.join().unwrap();

    // Traffic on both Envoys, and two long streams each that outlive the outage.
    let phase = AtomicU8::new(0);
    let stop = AtomicBool::new(false);
    let counter = AtomicUsize::new(0);
    let mut kill_at = Duration::ZERO;
    let mut outage = Duration::ZERO;
    let mut lim_answers: Vec<(u16, String, Option<Value>)> = Vec::new();
    let mut lim_before: Vec<(u16, String)> = Vec::new();
    let mut deny_during_outage: Option<(StreamedResponse, HashMap<String, Vec<String>>)> = None;
    let (steady, long): (Vec<Sent>, Vec<Sent>) = std::thread::scope(|s| {
        let phase = &phase;
        let stop = &stop;
        let counter = &counter;
        let longs: Vec<_> = (0..4)
            .map(|n| {
                let envoy = n % 2;
                let addr = addrs[envoy];
                s.spawn(move || {
                    let id = format!("b-long-{n}");
                    let h = [("x-request-id", id.as_str()), ("x-sluice-key", "k"), ("x-mock-tokens", "40"), ("x-mock-itl-ms", "100")];
                    let phase_sent = phase.load(Ordering::SeqCst);
                    let r = send(addr, &h, &chat(true, None, "a long answer"), Duration::ZERO);
                    Sent { envoy, id, phase_sent, phase_done: phase.load(Ordering::SeqCst), status: r.status, error: error_of(&r), retry_after: None }
                })
            })
            .collect();
        let workers: Vec<_> = (0..6)
            .map(|t| {
                let envoy = t % 2;
                let addr = addrs[envoy];
                s.spawn(move || {
                    let mut out = Vec::new();
                    while !stop.load(Ordering::SeqCst) {
                        let id = format!("b-{}", counter.fetch_add(1, Ordering::SeqCst));
                        let h = [("x-request-id", id.as_str()), ("x-sluice-key", "k"), ("x-mock-tokens", "5"), ("x-mock-itl-ms", "10")];
                        let phase_sent = phase.load(Ordering::SeqCst);
                        let r = send(addr, &h, &chat(true, None, "steady"), Duration::ZERO);
                        out.push(Sent {
                            envoy,
                            id,
                            phase_sent,
                            phase_done: phase.load(Ordering::SeqCst),
                            status: r.status,
                            error: error_of(&r),
                            retry_after: r.header("retry-after").map(str::to_string),
                        });
                        // Paced a little: a refusal comes back in well under a millisecond.
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    out
                })
            })
            .collect();
        // Key lim through Redis: its 12 requests of the day, over both Envoys; a 13th is refused.
        for n in 0..13 {
            let id = format!("b-lim-redis-{n}");
            let r = send(
                addrs[n % 2],
                &[("x-request-id", id.as_str()), ("x-sluice-key", "lim"), ("x-mock-tokens", "2")],
                &chat(false, None, "lim"),
                Duration::ZERO,
            );
            lim_before.push((r.status, error_of(&r).1));
        }
        // Let the long streams get admitted, then kill the ledger mid-run.
        std::thread::sleep(Duration::from_millis(500));
        phase.store(1, Ordering::SeqCst);
        let killed = Instant::now();
        kill_at = started.elapsed();
        ledger.kill();
        std::thread::sleep(Duration::from_millis(300));
        // Key lim during the outage: through the local fallback, 12 / 2 replicas = 6 admitted — by
        // a fallback ledger that starts from zero, not from what Redis counted.
        for n in 0..10 {
            let id = format!("b-lim-{n}");
            let r =
                send(addrs[1], &[("x-request-id", id.as_str()), ("x-sluice-key", "lim"), ("x-mock-tokens", "2")], &chat(false, None, "lim"), Duration::ZERO);
            let stamp = e_local
                .access_log()
                .wait_for_request(&id, Duration::from_secs(5))
                .ok()
                .and_then(|l| sluice_e2e::access_log::stamp(&l, "budget").ok().flatten());
            lim_answers.push((r.status, error_of(&r).1, stamp));
        }
        // One refused by the deny Envoy, written slowly (headers first): nothing may reach the mock.
        let r = send(addrs[0], &[("x-request-id", "b-deny-split"), ("x-sluice-key", "k")], &chat(false, None, "split"), Duration::from_millis(200));
        std::thread::sleep(Duration::from_millis(200));
        deny_during_outage = Some((r, read_heads(&mock)));
        std::thread::sleep(Duration::from_millis(500));
        ledger.restart().unwrap();
        outage = killed.elapsed();
        phase.store(2, Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(1500));
        stop.store(true, Ordering::SeqCst);
        let steady: Vec<Sent> = workers.into_iter().flat_map(|w| w.join().unwrap()).collect();
        let long: Vec<Sent> = longs.into_iter().map(|l| l.join().unwrap()).collect();
        (steady, long)
    });

    // Redis stalled (SIGSTOP) past the service's 200 ms Redis timeout: the service answers 503 and
    // the deny Envoy refuses; the script the service had sent runs when Redis wakes. The plugin
    // releases that hold id a second after the failure: the hold is freed, or never made (the
    // ledger's tombstone), and nothing is charged for the refused request.
    let stall_redis_ms = redis_time_ms(&redis);
    redis.pause().unwrap();
    let stall_started = Instant::now();
    let stalled = send(addrs[0], &[("x-request-id", "b-stalled"), ("x-sluice-key", "k")], &chat(false, None, "stalled"), Duration::ZERO);
    let stall_answered = stall_started.elapsed();
    std::thread::sleep(Duration::from_millis(300));
    redis.resume().unwrap();
    failures.that("(b) stall", stalled.status == 503 && error_of(&stalled).1 == "budget_ledger_unavailable", || {
        format!("a stalled Redis: {} {}", stalled.status, stalled.text())
    });
    failures.that("(b) stall", stall_answered < Duration::from_millis(1000), || format!("a stalled Redis answered after {stall_answered:?}"));

    // What each side of the outage answered.
    let mut table: BTreeMap<(usize, &str), BTreeMap<u16, u64>> = BTreeMap::new();
    for r in &steady {
        let when = match (r.phase_sent, r.phase_done) {
            (0, 0) => "before",
            (1, 1) => "outage",
            (2, 2) => "after",
            _ => "across",
        };
        *table.entry((r.envoy, when)).or_default().entry(r.status).or_insert(0) += 1;
        match (r.envoy, when) {
            (0, "outage") => {
                failures.that("(b) deny", r.status == 503 && r.error == ("overloaded".into(), "budget_ledger_unavailable".into()), || {
                    format!("{}: during the outage the deny Envoy answered {} {:?}", r.id, r.status, r.error)
                });
                failures.that("(b) deny", r.retry_after.as_deref() == Some("1"), || format!("{}: retry-after {:?}", r.id, r.retry_after));
            }
            (1, "outage") => failures.that("(b) local", r.status == 200, || format!("{}: the local-fallback Envoy answered {} {:?}", r.id, r.status, r.error)),
            (_, "before" | "after") => {
                failures.that("(b) ledger up", r.status == 200, || format!("{}: answered {} {:?} with the ledger up", r.id, r.status, r.error))
            }
            _ => {}
        }
    }
    for (envoy, when) in [(0, "outage"), (1, "outage"), (0, "after"), (1, "after")] {
        failures.that("(b) volume", table.get(&(envoy, when)).is_some_and(|m| m.values().sum::<u64>() >= 3), || {
            format!("Envoy {envoy}: fewer than 3 requests {when}")
        });
    }
    for l in &long {
        failures.that("(b) long streams", l.status == 200 && l.phase_sent == 0 && l.phase_done == 2, || {
            format!("{l:?}: not admitted before the kill and finished after the restart")
        });
    }
    // No 503 reached the upstream, not even as a head.
    let heads_now = read_heads(&mock);
    let leaked: Vec<&str> = steady.iter().filter(|r| r.status == 503 && heads_now.contains_key(&r.id)).map(|r| r.id.as_str()).collect();
    failures.that("(e) 503", leaked.is_empty(), || format!("requests refused 503 whose head reached the mock: {leaked:?}"));
    let (split, heads_then) = deny_during_outage.unwrap();
    failures.that("(b) deny", split.status == 503 && error_of(&split).1 == "budget_ledger_unavailable", || {
        format!("slowly written request: {} {}", split.status, split.text())
    });
    failures.that("(e) 503", !heads_then.contains_key("b-deny-split"), || "the mock saw the head of a request refused 503".into());
    failures.that(
        "(b) lim",
        lim_before.iter().take(12).all(|(s, _)| *s == 200) && lim_before.get(12).is_some_and(|(s, c)| *s == 429 && c == "key:lim:day:requests"),
        || format!("key lim through Redis before the outage: {lim_before:?}"),
    );
    let lim_admitted = lim_answers.iter().filter(|(s, _, _)| *s == 200).count();
    let lim_fallback = lim_answers.iter().filter(|(_, _, st)| st.as_ref().is_some_and(|s| s["ledger"] == "local_fallback")).count();
    failures.that("(b) local", lim_admitted == 6 && lim_fallback == 6, || format!("key lim (12 a day, replicas 2) during the outage: {lim_answers:?}"));
    failures.that(
        "(b) local",
        lim_answers.iter().filter(|(s, _, _)| *s == 429).all(|(_, code, _)| code == "key:lim:day:requests")
            && lim_answers.iter().all(|(s, _, _)| *s == 200 || *s == 429),
        || format!("key lim refusals: {lim_answers:?}"),
    );

    // Every request admitted through Redis, settled before or after the outage, is in Redis; nothing
    // but the orphaned holds stays reserved.
    let refs: Vec<&Envoy> = envoys.iter().collect();
    let ids: Vec<&str> = steady.iter().chain(&long).map(|r| r.id.as_str()).collect();
    let logged = read_logs(&refs, ids.len() + lim_answers.len() + lim_before.len() + 2).unwrap();
    let mut holds_named: HashMap<String, Vec<&str>> = HashMap::new();
    let mut via_redis = 0u64;
    let mut via_redis_n = 0;
    let mut via_fallback = 0u64;
    let mut fallback_n = 0;
    for id in &ids {
        let Some(stamp) = logged.get(*id).and_then(|l| l.stamp.clone()) else {
            failures.add("(b) join", format!("{id}: no stamp"));
            continue;
        };
        match stamp_str(&stamp, "ledger") {
            "redis" => {
                via_redis += stamp_u64(&stamp, "charged_tokens").unwrap_or(0);
                via_redis_n += 1;
                holds_named.entry(stamp_str(&stamp, "ledger_hold").to_string()).or_default().push(id);
            }
            "local_fallback" => {
                via_fallback += stamp_u64(&stamp, "charged_tokens").unwrap_or(0);
                fallback_n += 1;
            }
            _ => {}
        }
    }
    // Every request reserved under a hold id of its own: two workers' VMs configured at the same
    // instant once named their holds alike, and one request's reservation replayed the other's.
    let shared: Vec<_> = holds_named.iter().filter(|(_, ids)| ids.len() > 1).collect();
    failures.that("(b) hold ids", shared.is_empty(), || format!("requests that share a hold id: {shared:?}"));
    // What the local fallback charged during the outage is written back once the ledger answers:
    // Redis holds the fleet's whole usage.
    let orphans = wait_until(Duration::from_secs(20), "every settlement and write-back to reach Redis", || {
        let (used, reserved) = counter_state(&redis, "acme", k_prefix);
        let orphans = holds(&redis, "acme");
        let held: u64 = orphans.iter().flat_map(|h| &h.counters).filter(|(c, _)| c.starts_with(k_prefix)).map(|(_, a)| a).sum();
        let stalled_hold_left = orphans.iter().any(|h| h.expires_ms >= stall_redis_ms + 60_000);
        Ok((used == via_redis + via_fallback && reserved == held && !stalled_hold_left).then_some(orphans))
    });
    let (used_before_expiry, reserved_before_expiry) = counter_state(&redis, "acme", k_prefix);
    let orphans = orphans.unwrap_or_else(|_| {
        failures.add(
            "(b) no usage lost",
            format!(
                "Redis key k: used {used_before_expiry} reserved {reserved_before_expiry}; stamps settled through Redis: {via_redis}, by the local fallback: {via_fallback}; holds {:?}",
                holds(&redis, "acme")
            ),
        );
        holds(&redis, "acme")
    });
    // A request refused while the ledger was down never reached it (Envoy could not connect):
    // it queues no release, so the outage leaves no `released` marker per refused request. Only
    // calls in flight at the kill (one per client thread at most) and the stalled one may.
    let outage_requests = steady.iter().filter(|r| r.phase_sent == 1 && r.phase_done == 1).count();
    let released = redis
        .keys(&format!("{PREFIX}:{{acme}}:s:*"))
        .unwrap()
        .iter()
        .filter(|k| redis.command(&["GET", k]).ok().and_then(|v| v.text()).as_deref() == Some("released"))
        .count();
    let may_have_run = 6 + 4 + 1 + 1;
    failures.that("(b) outage releases", released <= may_have_run, || {
        format!(
            "{released} released markers after an outage that refused {outage_requests} requests (at most {may_have_run} calls may have reached the ledger)"
        )
    });
    let dropped = metric_sum(&refs, "sluice_budget_ledger_settlements_dropped_total", &[]);
    failures.that("(b) no usage lost", dropped == 0.0, || format!("{dropped} settlements dropped"));
    failures.that("(b) expiry", !orphans.is_empty(), || "the killed Envoy's hold is not in Redis".into());
    let lim_redis = counter_state(&redis, "acme", "key:lim:day:requests:w");
    failures.that("(b) write-back", lim_redis == (12 + lim_admitted as u64, 0), || {
        format!("key lim in Redis after the outage: {lim_redis:?}; want the 12 admitted through Redis + the {lim_admitted} the fallback admitted")
    });
    let write_backs = metric_sum(&refs, "sluice_budget_ledger_calls_total", &[("call", "write_back"), ("result", "ok")]);
    failures.that("(b) write-back", write_backs >= 1.0, || "no write-back call answered".into());
    // Holds are named by the plugin, not by x-request-id: the stalled request's is the one made
    // after the stall began (its expiry is a minute after that).
    let stall_holds: Vec<&Hold> = orphans.iter().filter(|h| h.expires_ms >= stall_redis_ms + 60_000).collect();
    failures.that("(b) stall", stall_holds.is_empty(), || format!("the refused request's hold is still in Redis: {stall_holds:?}"));
    // The refused request's stamp names its hold id; the ledger has it released (freed, or tombstoned
    // before the late script ran).
    let stalled_line = e_deny.access_log().wait_for_request("b-stalled", Duration::from_secs(10)).unwrap();
    let stalled_stamp = Logged::from_line(0, &stalled_line).stamp.unwrap_or(Value::Null);
    let stalled_hold = stalled_stamp.get("ledger_hold").and_then(Value::as_str).unwrap_or("").to_string();
    let stalled_marker = redis.command(&["GET", &format!("{PREFIX}:{{acme}}:s:{stalled_hold}")]).unwrap().text();
    failures.that("(b) stall", matches!(stalled_marker.as_deref(), Some("settled" | "released")), || {
        format!("the refused request's hold {stalled_hold:?}: marker {stalled_marker:?}")
    });

    // The holds expire a minute after they were made; the next reservation of org acme sweeps them
    // and charges each its reserved amount. Other tests run meanwhile.
    let expiry = orphans.iter().map(|h| h.expires_ms).max().unwrap_or(0);
    let wait = Duration::from_millis(expiry.saturating_sub(redis_time_ms(&redis)) + 300);
    drop(turn);
    std::thread::sleep(wait);
    let _turn = my_turn(true);
    let swept_at = started.elapsed();
    let r = send(addrs[0], &[("x-request-id", "b-sweeper"), ("x-sluice-key", "k"), ("x-mock-tokens", "3")], &chat(false, None, "sweep"), Duration::ZERO);
    failures.that("(b) expiry", r.status == 200, || format!("the sweeping request: {} {}", r.status, r.text()));
    let sweeper_line = e_deny.access_log().wait_for_request("b-sweeper", Duration::from_secs(10)).unwrap();
    let sweeper = Logged::from_line(0, &sweeper_line).stamp.unwrap_or(Value::Null);
    let sweeper_charge = stamp_u64(&sweeper, "charged_tokens").unwrap_or(0);
    let orphaned_k: u64 = orphans.iter().flat_map(|h| &h.counters).filter(|(c, _)| c.starts_with(k_prefix)).map(|(_, a)| a).sum();
    let want = used_before_expiry + orphaned_k + sweeper_charge;
    let after = wait_until(Duration::from_secs(10), "the sweep and the sweeper's settlement", || {
        let s = counter_state(&redis, "acme", k_prefix);
        Ok((s == (want, 0)).then_some(s))
    });
    let (used_after, reserved_after) = counter_state(&redis, "acme", k_prefix);
    failures.that("(b) expiry", after.is_ok(), || {
        format!("after expiry: used {used_after} reserved {reserved_after}; want used {used_before_expiry} + holds {orphaned_k} + sweeper {sweeper_charge} = {want}, reserved 0")
    });
    let mut late_settles = Vec::new();
    for h in &orphans {
        let marker = redis.command(&["GET", &format!("{PREFIX}:{{acme}}:s:{}", h.id)]).unwrap().text();
        failures.that("(b) expiry", marker.as_deref() == Some("expired"), || format!("hold {}: marker {marker:?}", h.id));
        let (status, answer) = ledger.post("/v1/settle", &json!({"id": h.id, "tag": "acme", "charges": vec![0; h.counters.len()]})).unwrap();
        failures.that("(b) expiry", status == 200 && answer == json!({"settled": false, "reason": "expired"}), || {
            format!("a late settle of {}: {status} {answer}", h.id)
        });
        late_settles.push(answer);
    }
    failures.that("(b) expiry", holds(&redis, "acme").is_empty(), || format!("holds left: {:?}", holds(&redis, "acme")));

    let mut out = String::new();
    let _ = writeln!(
        out,
        "\n(b) the ledger SIGKILLed at {:.1} s, back after {:.2} s; holds swept at {:.1} s (test {:.1} s)",
        kill_at.as_secs_f64(),
        outage.as_secs_f64(),
        swept_at.as_secs_f64(),
        started.elapsed().as_secs_f64()
    );
    for ((envoy, when), statuses) in &table {
        let _ = writeln!(out, "  {:<26} {when:<7} {statuses:?}", if *envoy == 0 { "Envoy on_failure=deny" } else { "Envoy on_failure=local" });
    }
    let _ = writeln!(out, "  long streams across the outage: {:?}", long.iter().map(|l| (l.id.as_str(), l.status)).collect::<Vec<_>>());
    let _ = writeln!(
        out,
        "  key lim (12/day): {} admitted through Redis before the outage, the 13th refused; during it the local fallback (12 / replicas 2) admitted {lim_admitted} more, refused {}; Redis lim after: {lim_redis:?} — the day's total {} of 12, all of it in Redis (the fallback starts from zero; its charges are written back)",
        lim_before.iter().filter(|(s, _)| *s == 200).count(),
        lim_answers.len() - lim_admitted,
        lim_before.iter().filter(|(s, _)| *s == 200).count() + lim_admitted
    );
    let _ = writeln!(
        out,
        "  Redis stalled (SIGSTOP) 0.3 s: answered {} {} after {:.0} ms; the refused request's hold {} released by the plugin (marker {:?}); holds left from it: {}",
        stalled.status,
        error_of(&stalled).1,
        stall_answered.as_secs_f64() * 1e3,
        stalled_hold,
        stalled_marker,
        stall_holds.len()
    );
    let _ = writeln!(
        out,
        "  requests settled through Redis: {via_redis_n} ({via_redis} tokens) + admitted by the local fallback: {fallback_n} ({via_fallback} tokens, written back in {write_backs} calls) = Redis used {used_before_expiry}"
    );
    let _ = writeln!(
        out,
        "  killed Envoy's stream: status {victim_status}; holds left in Redis after the drain: {} ({orphaned_k} tokens reserved on key k)",
        orphans.len()
    );
    let _ = writeln!(out, "  after expiry: used {used_after} = {used_before_expiry} + {orphaned_k} (holds, charged at their reservation) + {sweeper_charge} (the sweeping request); reserved {reserved_after}; late settles answered {}", Value::Array(late_settles));
    let _ = writeln!(out, "  requests refused or served locally during the outage: {outage_requests}; released markers left in Redis: {released}");
    println!("{out}");
    failures.verdict(&format!("ledger stderr:\n{}", ledger.stderr_tail(10))).unwrap();
}

// =============================================================================================
// (c) Redis restarted with persistence

#[test]
fn c_redis_restarted_with_appendonly_keeps_every_counter_and_traffic_continues() {
    if !prerequisites() {
        return;
    }
    let _turn = my_turn(false);
    let started = Instant::now();
    let mut redis = Redis::start(Persistence::AppendOnly).unwrap();
    let mut ledger = LedgerService::start(&redis.url(), 1).unwrap();
    let mock = MockServer::start(&["--tokens", "3"]).unwrap();
    let policy = json!({
        "mode": "strict",
        "identity": {"header": "x-sluice-key"},
        "include_usage": true,
        "default_max_output_tokens": 16,
        "ledger": redis_ledger("redis", "deny", json!({})),
        "orgs": [{"id": "acme", "budgets": [{"window": "month", "usd": 100}], "teams": [{"id": "t", "keys": [
            {"id": "k", "budgets": [{"window": "day", "tokens": 10_000_000}]},
            {"id": "lim", "budgets": [{"window": "day", "requests": 80}]}]}]}],
        "prices": [{"model": "*", "input_usd_per_mtok": 1.0, "output_usd_per_mtok": 4.0}],
    })
    .to_string();
    let envoys = fleet_envoys(&mock, ledger.port(), &[&policy, &policy]);
    let mut failures = Failures::default();
    let mut n = 0;
    let mut burst = |key: &str, count: usize, envoys: &[Envoy]| -> Vec<(String, u16, String)> {
        (0..count)
            .map(|_| {
                n += 1;
                let id = format!("c-{n}");
                let r =
                    send(envoys[n % 2].listen_addr(), &[("x-request-id", id.as_str()), ("x-sluice-key", key)], &chat(false, None, "persist"), Duration::ZERO);
                (id, r.status, error_of(&r).1)
            })
            .collect()
    };
    let first_lim = burst("lim", 50, &envoys);
    let first_k = burst("k", 20, &envoys);
    failures.that("(c) before", first_lim.iter().chain(&first_k).all(|(_, s, _)| *s == 200), || format!("before the restart: {first_lim:?} {first_k:?}"));
    let settled = wait_until(Duration::from_secs(10), "the settlements", || {
        let c = redis.ledger_counters(PREFIX)?;
        Ok((c.values().all(|(_, r)| *r == 0) && counter_state(&redis, "acme", "key:lim:day:requests:w") == (50, 0)).then_some(c))
    });
    let before = settled.unwrap_or_else(|_| redis.ledger_counters(PREFIX).unwrap());

    // SIGKILL Redis; what the fleet answers while it is down; Redis back on the same port.
    let killed = Instant::now();
    redis.kill();
    let down = burst("k", 2, &envoys);
    redis.kill_and_restart().unwrap();
    let down_for = killed.elapsed();
    let back = Instant::now();
    ledger.wait_healthy(Duration::from_secs(10)).unwrap();
    let healthy_after = back.elapsed();
    let intact = redis.ledger_counters(PREFIX).unwrap();
    failures.that("(c) intact", intact == before, || format!("counters before the restart {before:?}\nafter {intact:?}"));
    failures.that("(c) outage", down.iter().all(|(_, s, c)| *s == 503 && c == "budget_ledger_unavailable"), || format!("while Redis was down: {down:?}"));

    // Traffic continues, and the limits go on from where they were: 30 more of lim's 80.
    let second_lim = burst("lim", 40, &envoys);
    let second_k = burst("k", 20, &envoys);
    let admitted = second_lim.iter().filter(|(_, s, _)| *s == 200).count();
    failures.that("(c) continues", admitted == 30, || format!("key lim after the restart: {admitted} admitted of 40 (30 left of 80): {second_lim:?}"));
    failures.that("(c) continues", second_k.iter().all(|(_, s, _)| *s == 200), || format!("key k after the restart: {second_k:?}"));
    let refs: Vec<&Envoy> = envoys.iter().collect();
    let all: Vec<&(String, u16, String)> = first_k.iter().chain(&second_k).collect();
    let logged = read_logs(&refs, n).unwrap();
    let k_charged: u64 = all.iter().filter_map(|(id, _, _)| logged.get(id).and_then(|l| l.stamp.as_ref()).and_then(|s| stamp_u64(s, "charged_tokens"))).sum();
    let end = wait_until(Duration::from_secs(10), "the settlements after the restart", || {
        let k = counter_state(&redis, "acme", "key:k:day:total_tokens:w");
        let lim = counter_state(&redis, "acme", "key:lim:day:requests:w");
        Ok((k == (k_charged, 0) && lim == (80, 0)).then_some((k, lim)))
    });
    let (k_end, lim_end) = (counter_state(&redis, "acme", "key:k:day:total_tokens:w"), counter_state(&redis, "acme", "key:lim:day:requests:w"));
    failures.that("(c) continues", end.is_ok(), || format!("Redis after: k {k_end:?} (stamps {k_charged}), lim {lim_end:?} (want 80)"));

    let mut out = String::new();
    let _ = writeln!(
        out,
        "\n(c) Redis (appendonly yes, appendfsync everysec) SIGKILLed and restarted: down {:.0} ms, ledger healthy {:.0} ms after (test {:.1} s)",
        down_for.as_secs_f64() * 1e3,
        healthy_after.as_secs_f64() * 1e3,
        started.elapsed().as_secs_f64()
    );
    let _ = writeln!(out, "  counters before the kill = after the restart: {} ({} keys)", intact == before, intact.len());
    for ((org, key), (u, r)) in &intact {
        let _ = writeln!(out, "    {org} {key:<28} used {u:>8} reserved {r}");
    }
    let _ = writeln!(out, "  while down: {:?}", down.iter().map(|(_, s, c)| format!("{s} {c}")).collect::<Vec<_>>());
    let _ = writeln!(
        out,
        "  after: key lim {admitted} of 40 admitted (limit 80, 50 used before), Redis lim {lim_end:?}; key k Redis {k_end:?} = stamps {k_charged}"
    );
    println!("{out}");
    failures.verdict("").unwrap();
}

// =============================================================================================
// (d) A thousand JWT subjects

const D_SUBJECTS: usize = 1000;

/// Whether the series name and labels of a Prometheus line (before its value) hold `n` hex digits
/// in a row.
fn has_hex_run(line: &str, n: usize) -> bool {
    let series = line.rsplit_once(' ').map_or(line, |(s, _)| s);
    let mut run = 0;
    for c in series.chars() {
        run = if c.is_ascii_hexdigit() { run + 1 } else { 0 };
        if run >= n {
            return true;
        }
    }
    false
}

#[test]
fn d_a_thousand_jwt_subjects_are_each_limited_on_their_own_with_no_series_per_identity() {
    if !prerequisites() {
        return;
    }
    let _turn = my_turn(false);
    let started = Instant::now();
    let redis = Redis::start(Persistence::None).unwrap();
    let ledger = LedgerService::start(&redis.url(), 2).unwrap();
    let mock = MockServer::start(&["--tokens", "1"]).unwrap();
    let policy = json!({
        "mode": "strict",
        "identity": {"header": "x-sluice-key", "per_identity": {"jwt": {"header": "x-jwt-payload", "claim": "sub"}}},
        "include_usage": true,
        "default_max_output_tokens": 8,
        "ledger": redis_ledger("redis", "deny", json!({"timeout_ms": 2000})),
        "orgs": [{"id": "acme", "teams": [{"id": "t", "keys": [
            {"id": "app", "budgets": [{"window": "day", "tokens": 10_000_000}],
             "identity_budgets": [{"window": "day", "requests": 2}]}]}]}],
        "prices": [{"model": "*", "input_usd_per_mtok": 1.0, "output_usd_per_mtok": 4.0}],
    })
    .to_string();
    let envoys = fleet_envoys(&mock, ledger.port(), &[&policy, &policy]);
    let addrs = [envoys[0].listen_addr(), envoys[1].listen_addr()];
    let stat_names = |e: &Envoy| -> usize { e.admin_get("/stats").unwrap().lines().count() };
    let stats_before: Vec<usize> = envoys.iter().map(stat_names).collect();
    let body = chat(false, Some(1), "hi");

    // Each subject's three requests in turn, on Envoy 0, 1, then the other one again; subjects in
    // parallel. The third must be refused by the subject's own counter, shared by the fleet.
    let next = AtomicUsize::new(0);
    let traffic = Instant::now();
    let answers: Vec<(usize, [(u16, String); 3])> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..48)
            .map(|_| {
                let (next, body) = (&next, &body);
                s.spawn(move || {
                    let mut out = Vec::new();
                    loop {
                        let subject = next.fetch_add(1, Ordering::Relaxed);
                        if subject >= D_SUBJECTS {
                            break out;
                        }
                        let jwt = base64url(json!({"sub": format!("user-{subject}"), "iss": "https://idp.example"}).to_string().as_bytes());
                        let mut three: [(u16, String); 3] = Default::default();
                        for (n, slot) in three.iter_mut().enumerate() {
                            let id = format!("d-{subject}-{n}");
                            let h = [("x-request-id", id.as_str()), ("x-sluice-key", "app"), ("x-jwt-payload", jwt.as_str())];
                            let r = send(addrs[(subject + n) % 2], &h, body, Duration::ZERO);
                            *slot = (r.status, error_of(&r).1);
                        }
                        out.push((subject, three));
                    }
                })
            })
            .collect();
        workers.into_iter().flat_map(|w| w.join().unwrap()).collect()
    });
    let traffic_time = traffic.elapsed();
    let mut failures = Failures::default();
    let mut pattern: BTreeMap<String, u64> = BTreeMap::new();
    for (subject, three) in &answers {
        let p = format!("{} {} {} {}", three[0].0, three[1].0, three[2].0, three[2].1);
        *pattern.entry(p.clone()).or_insert(0) += 1;
        if p != "200 200 429 key:app:day:requests:per_identity" {
            failures.add("(d) per subject", format!("user-{subject}: {three:?}"));
        }
    }
    failures.that("(d) volume", answers.len() == D_SUBJECTS, || format!("{} subjects answered", answers.len()));

    // Redis: one counter per subject, each at 2, once every settlement has landed (they are sent
    // from the root context's tick, after the client has its answer).
    let all_settled = wait_until(Duration::from_secs(10), "the settlements", || {
        let c = redis.ledger_counters(PREFIX)?;
        let per_identity_used: u64 = c.iter().filter(|((_, k), _)| k.starts_with("key:app:day:requests:per_identity:")).map(|(_, (u, _))| *u).sum();
        Ok((c.values().all(|(_, reserved)| *reserved == 0) && per_identity_used >= 2 * D_SUBJECTS as u64).then_some(c))
    });
    let counters = all_settled.unwrap_or_else(|_| redis.ledger_counters(PREFIX).unwrap());
    let per_identity: Vec<u64> = counters.iter().filter(|((_, k), _)| k.starts_with("key:app:day:requests:per_identity:")).map(|(_, (u, _))| *u).collect();
    failures.that("(d) redis", per_identity.len() == D_SUBJECTS && per_identity.iter().all(|u| *u == 2), || {
        format!("{} per-identity counters, used values {:?}", per_identity.len(), per_identity.iter().collect::<HashSet<_>>())
    });
    // No stat per identity: the stats grow by a bounded number, and none names a subject.
    let stats_after: Vec<usize> = envoys.iter().map(stat_names).collect();
    for (e, envoy) in envoys.iter().enumerate() {
        let grown = stats_after[e] - stats_before[e];
        failures.that("(d) no series per identity", grown < 200, || format!("Envoy {e}: /stats grew by {grown} lines over {D_SUBJECTS} identities"));
        // An identity would show as its claim or as its hash (16 hex digits) in a name or label.
        let prom = envoy.stats_prometheus().unwrap();
        let named: Vec<&str> = prom.lines().filter(|l| !l.starts_with('#') && (l.contains("user-") || has_hex_run(l, 16))).take(3).collect();
        failures.that("(d) no series per identity", named.is_empty(), || format!("Envoy {e}: series naming an identity: {named:?}"));
    }
    let budget_series: usize = envoys[0].stats_prometheus().unwrap().lines().filter(|l| l.starts_with("sluice_budget")).count();

    let mut out = String::new();
    let _ = writeln!(
        out,
        "\n(d) {D_SUBJECTS} JWT subjects × 3 requests over 2 Envoys in {:.1} s (test {:.1} s); answers (1st 2nd 3rd, 3rd's code): {pattern:?}",
        traffic_time.as_secs_f64(),
        started.elapsed().as_secs_f64()
    );
    let _ = writeln!(out, "  Redis per-identity counters: {} (each used 2: {}); Envoy /stats lines before → after: {stats_before:?} → {stats_after:?}; sluice_budget* series on Envoy 0: {budget_series}", per_identity.len(), per_identity.iter().all(|u| *u == 2));
    println!("{out}");
    failures.verdict("").unwrap();
}

// =============================================================================================
// (e) Refusals reach no upstream

/// What a mock saw of a refused request: new connections, and the heads with its id.
fn seen_upstream(mocks: &[&MockServer], before: &[u64], id: &str) -> (u64, Vec<String>) {
    // The upstream side of a refusal would be in flight for a moment at most.
    std::thread::sleep(Duration::from_millis(300));
    let mut conns = 0;
    let mut heads = Vec::new();
    for (m, b) in mocks.iter().zip(before) {
        // Reading the count back is one connection itself.
        conns += m.connections_accepted().unwrap() - b - 1;
        heads.extend(m.heads().unwrap().into_iter().filter(|h| h.request_id.as_deref() == Some(id)).map(|h| h.body));
    }
    (conns, heads)
}

#[test]
fn e_refused_requests_reach_no_upstream_not_even_their_headers() {
    if !prerequisites() {
        return;
    }
    let _turn = my_turn(false);
    let started = Instant::now();
    let redis = Redis::start(Persistence::None).unwrap();
    let mut ledger = LedgerService::start(&redis.url(), 1).unwrap();
    let policy = |ledger: Value| {
        json!({
            "mode": "strict",
            "identity": {"header": "x-sluice-key"},
            "include_usage": true,
            "default_max_output_tokens": 64,
            "ledger": ledger,
            "orgs": [{"id": "o", "teams": [{"id": "t", "keys": [
                {"id": "open", "budgets": [{"window": "day", "tokens": 1_000_000}]},
                // A request's worst case (its body's bytes + 64) never fits 100 tokens.
                {"id": "tight", "budgets": [{"window": "day", "tokens": 100}]}]}]}],
        })
        .to_string()
    };
    let redis_policy = policy(redis_ledger("redis", "deny", json!({})));
    let local_policy = policy(json!({"mode": "local"}));
    let over = chat(true, None, "Hello");
    let fine = chat(true, Some(8), "Hello");
    // A fresh Envoy; after an admitted request (an upstream connection pooled); the body written
    // 200 ms after the headers.
    let cases: [(&str, bool, Duration); 3] = [("cold", false, Duration::ZERO), ("warm", true, Duration::ZERO), ("slow body", true, Duration::from_millis(200))];
    let mut rows: Vec<(String, String, u16, String, u64, Vec<String>)> = Vec::new();
    let mut failures = Failures::default();

    // For each gateway: the refused request on a cold Envoy, after an admitted one (`ok`'s headers;
    // its upstream connection pooled), and with its body written 200 ms after its headers.
    let mut run_cases = |name: &str, envoy: &Envoy, mocks: &[&MockServer], ok: Option<&[(&str, &str)]>, bad: &[(&str, &str)], bad_body: &str| {
        for (n, (case, warm, pause)) in cases.into_iter().enumerate() {
            // Without a warm-up (the ledger down: nothing is admitted), the cases are just in turn.
            let case = if ok.is_some() { case } else { ["1st", "2nd", "slow body"][n] };
            if let (true, Some(ok)) = (warm, ok) {
                let mut h = vec![("x-request-id", "e-ok")];
                h.extend_from_slice(ok);
                let r = send(envoy.listen_addr(), &h, &fine, Duration::ZERO);
                assert_eq!(r.status, 200, "{name}: {}", r.text());
            }
            let before: Vec<u64> = mocks.iter().map(|m| m.connections_accepted().unwrap()).collect();
            let id = format!("e-{name}-{case}");
            let mut h = vec![("x-request-id", id.as_str())];
            h.extend_from_slice(bad);
            let r = send(envoy.listen_addr(), &h, bad_body, pause);
            let (conns, heads) = seen_upstream(mocks, &before, &id);
            rows.push((name.to_string(), case.to_string(), r.status, error_of(&r).1, conns, heads));
        }
    };
    let tight = [("x-sluice-key", "tight")];
    let open = [("x-sluice-key", "open")];
    {
        let mock = MockServer::start(&["--tokens", "4"]).unwrap();
        let envoy = fleet_envoy_from(&fleet_template(), &mock, ledger.port(), &redis_policy, &node_id(0));
        run_cases("fleet", &envoy, &[&mock], Some(&open), &tight, &over);
        // The ledger down (on_failure deny): 503, and nothing upstream either.
        ledger.kill();
        run_cases("fleet, ledger down", &envoy, &[&mock], None, &open, &fine);
        ledger.restart().unwrap();
    }
    {
        let mock = MockServer::start(&["--tokens", "4"]).unwrap();
        let envoy = fleet_envoy_from(&fleet_template_without_buffer(), &mock, ledger.port(), &redis_policy, &node_id(0));
        run_cases("fleet without buffer", &envoy, &[&mock], Some(&open), &tight, &over);
    }
    {
        let mock = MockServer::start(&["--tokens", "4"]).unwrap();
        let envoy = start_budget_gateway(&mock, &local_policy, &metrics_config()).unwrap();
        run_cases("budget-gateway", &envoy, &[&mock], Some(&open), &tight, &over);
    }
    {
        let gw = start_full_gateway(&["--tokens", "4"], &[]).unwrap();
        // Key globex has 100,000 tokens a minute; a 120 kB body's worst case never fits.
        let big = chat(true, None, &"budget ".repeat(120_000 / 7));
        run_cases("full-gateway", &gw.envoy, &[&gw.v1, &gw.v2, &gw.shadow], Some(&[("x-sluice-tenant", "acme")]), &[("x-sluice-tenant", "globex")], &big);
    }

    let mut out = String::new();
    let _ = writeln!(out, "\n(e) refused requests and the upstream (test {:.1} s):", started.elapsed().as_secs_f64());
    let _ = writeln!(out, "  {:<22} {:<10} {:>6} {:<30} {:>16}  heads with its id", "gateway", "case", "status", "code", "new connections");
    for (name, case, status, code, conns, heads) in &rows {
        let _ = writeln!(out, "  {name:<22} {case:<10} {status:>6} {code:<30} {conns:>16}  {heads:?}");
        let expected = if name.starts_with("fleet, ledger down") { 503 } else { 429 };
        failures.that("(e) status", *status == expected, || format!("{name} {case}: status {status} {code}, want {expected}"));
        if name != "fleet without buffer" {
            failures.that("(e) nothing upstream", *conns == 0 && heads.is_empty(), || format!("{name} {case}: {conns} new connection(s), heads {heads:?}"));
        }
    }
    // The control: the same gateway without the buffer filter sends the refused request's headers.
    let leaked = rows.iter().filter(|r| r.0 == "fleet without buffer" && !r.5.is_empty()).count();
    failures.that("(e) control", leaked > 0, || "without the buffer filter no refused request's head reached the mock: the check proves nothing".into());
    println!("{out}");
    failures.verdict("").unwrap();
}

#[cfg(test)]
mod unit {
    use super::*;

    #[test]
    fn the_plan_is_mixed_and_the_budgets_bind() {
        let plan = plan_traffic(A_REQUESTS, A_SEED, "fleet");
        let share = |f: &dyn Fn(&Planned) -> bool| plan.iter().filter(|p| f(p)).count() as f64 / plan.len() as f64;
        assert!((0.03..0.08).contains(&share(&|p| matches!(p.fault, Fault::Disconnect(_)))));
        assert!((0.03..0.08).contains(&share(&|p| matches!(p.fault, Fault::Reset(_)))));
        let budgets = a_budgets(&plan);
        let policy: Value = serde_json::from_str(&a_policy(&budgets, json!({"mode": "local"}))).unwrap();
        assert_eq!(policy["orgs"][0]["teams"][0]["keys"][0]["budgets"][0]["tokens"], json!(budgets[2].limit));
        // Whole thousandths of a dollar survive the decimal round trip.
        let metered = budgets.iter().find(|b| b.id == "labs-metered").unwrap();
        assert_eq!(metered.limit % 1000, 0);
        assert!(metered.limit > 0);
    }
}
