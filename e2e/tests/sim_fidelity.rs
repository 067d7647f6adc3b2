//! Fidelity of the simulator, measured: trace slices through real Envoy and through `sluice-sim`.
//!
//! Two real traces of different shape, each under its own scenario:
//!
//! - the first 2,000 requests of the bundled Azure conversation trace, time-compressed ten-fold
//!   (424 s → 42 s), under `examples/sim/fidelity.scenario.json`: all four plugins (a breaker on
//!   v1, a 70/30 split sticky per user with 5 % shadowed, day budgets two tenants exhaust, the
//!   metrics policy) and a modelled upstream with an incident (v1's TTFT × 10 from 12 s to 20 s);
//! - the bundled Mooncake slice (200 requests in bursts of up to 16 at one millisecond every 3 s,
//!   prompts of 14,000 tokens on average and up to 120,000), five times compressed (72 s → 14.4 s),
//!   under `examples/sim/fidelity-mooncake.scenario.json` (see that case's comment).
//!
//! The simulator runs first, in process. Then the same requests — byte for byte the bodies and
//! headers the simulator built — go to the full gateway (`envoy/templates/full-gateway.yaml`, the
//! scenario's policies) at their arrival times, each with `x-mock-*` headers that make the mock
//! server answer as the simulator's upstream model did for that request (TTFT to the millisecond,
//! the gap between tokens, the tokens, a failure). Envoy's access log is read back into verdicts.
//!
//! Checked: every request's verdict — decision (admitted / clamped / refused), refusal code, model
//! version, shadow version — is the same; each budget key's charged tokens are equal; the breaker
//! goes through the same transitions, each within one window slot (5 s) of the other. The figures
//! are printed as the table docs/simulator.md shows.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::Value;
use sluice_e2e::gateway::{shipped, start_full_gateway};
use sluice_e2e::{wait_until, Connection, Tools};
use sluice_sim::engine::{client_request, Engine, Plugins, RunOptions};
use sluice_sim::observed::read_access_log;
use sluice_sim::scenario::{PluginKind, Scenario};
use sluice_sim::trace::{ReaderOptions, TraceReader, TraceRequest};
use sluice_sim::verdict::{Transition, Verdict};

/// How close to a breaker transition a request may arrive and still go either way.
const RACE_MS: f64 = 5.0;

/// One trace slice, the scenario it runs under, and what the run must show.
struct Case {
    trace: &'static str,
    scenario: &'static str,
    /// Requests in the slice.
    requests: usize,
    /// The replay starts a whole number of these after the simulation's clock did: a multiple of
    /// the breaker's window slot, so that slots (`now / slot`) fall on the same requests.
    period_s: u64,
    /// The simulation's clock starts on a whole period, so the breaker's slots fall on the same
    /// requests in every run (the decisions, and the figures docs/simulator.md shows, are then the
    /// same each time); otherwise it starts now.
    start_on_period: bool,
    /// Requests the trace gives one arrival are sent this far apart (replay time, ns), in trace
    /// order, by both runs: simultaneous requests have no order at a real gateway. 0: none.
    spread_ties_ns: u64,
    /// Verdict classes the simulation must contain, so that the scenario keeps exercising them.
    must_see: &'static [&'static str],
}

/// One request of the replay: when after the start, and what is sent.
struct Send {
    offset_ns: u64,
    path: String,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

fn trace(case: &Case, time_scale: f64) -> Vec<TraceRequest> {
    let file = std::fs::File::open(shipped(case.trace)).unwrap();
    let mut requests: Vec<TraceRequest> = TraceReader::new(std::io::BufReader::new(file), ReaderOptions::default()).map(|r| r.unwrap()).collect();
    if case.spread_ties_ns > 0 {
        // In trace time, so that after `time_scale` the gap is `spread_ties_ns`.
        let gap = (case.spread_ties_ns as f64 / time_scale).round() as u64;
        for i in 1..requests.len() {
            let previous = requests[i - 1].arrival_ns;
            if requests[i].arrival_ns <= previous {
                requests[i].arrival_ns = previous + gap;
            }
        }
    }
    requests
}

/// The breaker's window slot of the scenario's first version with a breaker, ms.
fn slot_ms(scenario: &Scenario) -> f64 {
    let policy: Value = serde_json::from_str(scenario.policy(PluginKind::LatencyGuard).unwrap()).unwrap();
    let versions = policy["versions"].as_array().unwrap();
    let breaker = versions.iter().find_map(|v| v.get("breaker")).unwrap();
    breaker["window_s"].as_f64().unwrap() * 1000.0 / breaker.get("slots").and_then(Value::as_f64).unwrap_or(6.0)
}

fn wasm_dir() -> PathBuf {
    sluice_host::workspace_target_dir().join("wasm32-wasip1").join("release")
}

fn now_ns() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos() as u64
}

/// What the two sides must agree on.
fn key(v: &Verdict) -> (String, Option<String>, Option<String>, Option<String>) {
    (v.decision.as_str().to_string(), v.code.clone(), v.version.clone(), v.shadow_version.clone())
}

fn charged(verdicts: &[Verdict]) -> BTreeMap<String, u64> {
    let mut totals = BTreeMap::new();
    for v in verdicts {
        if let Some(b) = &v.stamps.budget {
            if let (Some(k), Some(c)) = (b.str("key"), b.u64("charged_tokens")) {
                *totals.entry(k).or_insert(0) += c;
            }
        }
    }
    totals
}

/// latency-guard's breaker transitions in Envoy's log, ms after `t0_ns`.
fn envoy_transitions(stderr: &Path, t0_ns: u64) -> Vec<Transition> {
    let text = std::fs::read_to_string(stderr).unwrap_or_default();
    let mut out = Vec::new();
    for line in text.lines() {
        let Some(at) = line.find("sluice latency-guard: breaker of ") else { continue };
        // `[2026-12-01 07:30:00.123][…` — Envoy logs local time; the test machines run in UTC.
        let Some(stamp) = line.get(1..24) else { continue };
        let Some(t_ns) = parse_utc(stamp) else { continue };
        let message = &line[at..];
        let rest = &message["sluice latency-guard: breaker of ".len()..];
        let Some((head, _)) = rest.split_once(": ") else { continue };
        let Some((left, to)) = head.split_once(" → ") else { continue };
        let Some((version, from)) = left.rsplit_once(' ') else { continue };
        out.push(Transition { t_ms: (t_ns as f64 - t0_ns as f64) / 1e6, version: version.into(), from: from.into(), to: to.into() });
    }
    out
}

/// `YYYY-MM-DD HH:MM:SS.mmm` as UTC, ns since the epoch.
fn parse_utc(s: &str) -> Option<u64> {
    let num = |a: usize, b: usize| s.get(a..b)?.parse::<i64>().ok();
    let (y, mo, d, h, mi, se, ms) = (num(0, 4)?, num(5, 7)?, num(8, 10)?, num(11, 13)?, num(14, 16)?, num(17, 19)?, num(20, 23)?);
    // Days from the civil date (Howard Hinnant's algorithm).
    let y = if mo <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (mo + if mo > 2 { -3 } else { 9 }) + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    let secs = days * 86_400 + h * 3600 + mi * 60 + se;
    u64::try_from(secs * 1_000_000_000 + ms * 1_000_000).ok()
}

#[test]
fn the_simulator_and_real_envoy_agree_on_every_verdict_of_2000_requests() {
    check(&Case {
        trace: "sim/traces/azure-2023-conv/azure-2023-conv.first-2000.csv",
        scenario: "examples/sim/fidelity.scenario.json",
        requests: 2000,
        period_s: 10,
        start_on_period: false,
        spread_ties_ns: 0,
        must_see: &[],
    });
}

/// The Mooncake slice: long prompts in bursts, where Azure's are short and spread out. Each burst
/// reaches both sides 1 ms a request apart in trace order (`spread_ties_ns`): the order within a
/// burst decides who gets the last of a budget (reversed, 9 of the simulator's 200 verdicts
/// change). The scenario makes every
/// kind of decision hang on exact accounting and timing: three day budgets run out (globex's on
/// total tokens and bank-emea's on input tokens, where after the first refusal smaller prompts
/// still fit; batch-nightly's on output tokens), the last request that fits is clamped, and v1's
/// breaker (median TTFT, 4 s window in 1 s slots) opens in an incident, fails its first probes and
/// closes after the second.
#[test]
fn the_simulator_and_real_envoy_agree_on_every_verdict_of_the_mooncake_slice() {
    check(&Case {
        trace: "sim/traces/mooncake/conversation_trace.first-200.jsonl",
        scenario: "examples/sim/fidelity-mooncake.scenario.json",
        requests: 200,
        period_s: 2,
        start_on_period: true,
        spread_ties_ns: 1_000_000,
        must_see: &[
            "clamped",
            "refused key:bank-emea:day:input_tokens",
            "refused key:batch-nightly:day:output_tokens",
            "refused key:globex:day:total_tokens",
            "refused shed_breaker_open",
        ],
    });
}

/// The cases take turns: each replays in real time, and timing is what they measure.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn check(case: &Case) {
    let Some(_tools) = Tools::locate_or_skip().unwrap() else { return };
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    // Day budgets: both runs must fall in one UTC day.
    let into_day = (now_ns() / 1_000_000_000) % 86_400;
    if into_day > 86_400 - 300 {
        std::thread::sleep(Duration::from_secs(86_400 - into_day + 5));
    }
    let scenario = Scenario::load(&PathBuf::from(shipped(case.scenario))).unwrap();
    let slot = slot_ms(&scenario);
    assert_eq!((case.period_s as f64 * 1000.0) % slot, 0.0, "the replay's period is a whole number of breaker slots");
    let requests = trace(case, scenario.time_scale);
    assert_eq!(requests.len(), case.requests);

    // 1. The simulator.
    let plugins = Plugins::load(&wasm_dir()).unwrap();
    let period_ns = case.period_s * 1_000_000_000;
    let sim_start = if case.start_on_period { now_ns().div_ceil(period_ns) * period_ns } else { now_ns() };
    let engine = Engine::new(&scenario, &plugins, &RunOptions { start_ns: sim_start }).unwrap();
    let mut simulated: Vec<Verdict> = Vec::new();
    let started = Instant::now();
    let result = engine
        .run(
            requests.clone().into_iter(),
            |v| {
                simulated.push(v);
                Ok(())
            },
            |_| {},
        )
        .unwrap();
    let sim_seconds = started.elapsed().as_secs_f64();
    let by_line: HashMap<u64, &Verdict> = simulated.iter().map(|v| (v.line, v)).collect();

    // 2. Real Envoy with the same policies, the mock driven by the simulator's upstream plan.
    let policy = |kind| scenario.policy(kind).unwrap().to_string();
    let gw = start_full_gateway(
        &[],
        &[
            ("LATENCY_CONFIG", &policy(PluginKind::LatencyGuard)),
            ("ROUTER_CONFIG", &policy(PluginKind::ModelRouter)),
            ("BUDGET_CONFIG", &policy(PluginKind::TenantBudget)),
            ("PLUGIN_CONFIG", &policy(PluginKind::LlmMetrics)),
        ],
    )
    .unwrap();
    let addr = gw.envoy.listen_addr();
    // Every request is built before the replay starts, so that the timed loop only waits and
    // sends: in this debug build, the body of Mooncake's longest prompt (120,000 tokens) takes
    // 0.2 s to build, which would make the rest of its burst late.
    let mut filler = String::new();
    let sends: Vec<Send> = requests
        .iter()
        .map(|request| {
            let client = client_request(&scenario, request, &mut filler);
            let mut headers: Vec<(String, String)> = client.headers.iter().filter(|(k, _)| !k.starts_with(':') && k != "content-length").cloned().collect();
            match by_line.get(&request.line).and_then(|v| v.upstream.as_ref()) {
                Some(plan) => {
                    headers.push(("x-mock-ttft-ms".into(), format!("{}", plan.ttft_ms.round() as u64)));
                    headers.push(("x-mock-itl-ms".into(), format!("{}", plan.itl_ms.round() as u64)));
                    headers.push(("x-mock-tokens".into(), plan.tokens.to_string()));
                    if let Some(status) = plan.fail_status {
                        headers.push(("x-mock-fail".into(), format!("status:{status}")));
                    }
                }
                None => headers.push(("x-mock-tokens".into(), client.output_tokens.to_string())),
            }
            Send { offset_ns: (request.arrival_ns as f64 * scenario.time_scale).round() as u64, path: client.path, headers, body: client.body }
        })
        .collect();
    // The replay starts a whole number of periods after the simulation's clock did: the
    // breaker's window slots (`now / slot`) then fall on the same requests (the day budgets' window
    // is the same day).
    let (now_wall, now_mono) = (now_ns(), Instant::now());
    let t0_ns = sim_start + (now_wall + 500_000_000).saturating_sub(sim_start).div_ceil(period_ns) * period_ns;
    let t0 = now_mono + Duration::from_nanos(t0_ns - now_wall);
    let failures = Arc::new(Mutex::new(Vec::new()));
    let mut threads = Vec::new();
    for Send { offset_ns, path, headers, body } in sends {
        let at = t0 + Duration::from_nanos(offset_ns);
        if let Some(wait) = at.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
        let failures = failures.clone();
        threads.push(std::thread::spawn(move || {
            let h: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
            let outcome = Connection::connect(addr).and_then(|c| c.send("POST", &path, &h, &body)).and_then(|s| s.collect());
            if let Err(e) = outcome {
                failures.lock().unwrap().push(format!("{path}: {e:#}"));
            }
        }));
    }
    for t in threads {
        t.join().unwrap();
    }
    let replay_seconds = t0.elapsed().as_secs_f64();
    assert!(failures.lock().unwrap().is_empty(), "client errors: {:?}", failures.lock().unwrap());
    let log = gw.envoy.access_log();
    let entries = wait_until(Duration::from_secs(30), &format!("{} access-log lines", case.requests), || {
        let e = log.entries()?;
        Ok((e.len() >= case.requests).then_some(e))
    })
    .unwrap();
    let text = std::fs::read_to_string(log.path()).unwrap();
    let observed: Vec<Verdict> = read_access_log(text.as_bytes()).map(|v| v.unwrap()).collect();
    assert_eq!(observed.len(), entries.len());
    let mut envoy_by_line: HashMap<u64, Verdict> = HashMap::new();
    for (entry, verdict) in entries.iter().zip(observed) {
        let id = entry["request_id"].as_str().unwrap_or_default();
        let line: u64 = id.strip_prefix("sim-").and_then(|n| n.parse().ok()).unwrap_or_else(|| panic!("unexpected request id {id:?}"));
        envoy_by_line.insert(line, verdict);
    }

    // 3. Compare. A request that arrives within a few milliseconds of a breaker transition may
    // land on either side of it: the transition happens at a sample (a first token, an end) whose
    // time in Envoy is the simulator's plus Envoy's own latency (docs/simulator.md, "Where the two
    // can differ"). Such requests are counted, not failed.
    let envoy_trans = envoy_transitions(&gw.envoy.dir().join("envoy.stderr"), t0_ns);
    let near_transition = |arrival_ms: f64| result.transitions.iter().chain(&envoy_trans).any(|t| (t.t_ms - arrival_ms).abs() <= RACE_MS);
    let mut disagreements = Vec::new();
    let mut at_transitions = Vec::new();
    let mut classes: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    for v in &simulated {
        let e = envoy_by_line.get(&v.line).unwrap_or_else(|| panic!("line {} missing from Envoy's log", v.line));
        let class = |v: &Verdict| format!("{} {}", v.decision.as_str(), v.code.clone().unwrap_or_default()).trim().to_string();
        classes.entry(class(v)).or_default().0 += 1;
        classes.entry(class(e)).or_default().1 += 1;
        if key(v) != key(e) {
            let what = format!("line {} at {:.0} ms ({:?}): sim {:?}, envoy {:?}", v.line, v.arrival_ms, v.tenant, key(v), key(e));
            if near_transition(v.arrival_ms) {
                at_transitions.push(what);
            } else {
                disagreements.push(what);
            }
        }
    }
    let envoy_verdicts: Vec<Verdict> = envoy_by_line.values().cloned().collect();
    let (sim_charged, envoy_charged) = (charged(&simulated), charged(&envoy_verdicts));
    let shadows = |vs: &[Verdict]| vs.iter().filter(|v| v.shadow_version.is_some()).count();
    let versions =
        |vs: &[Verdict], name: &str| vs.iter().filter(|v| v.decision != sluice_sim::verdict::Decision::Refused && v.version.as_deref() == Some(name)).count();

    println!("fidelity, {}: {} requests, simulated in {sim_seconds:.1} s, replayed through Envoy in {replay_seconds:.1} s", case.trace, simulated.len());
    println!("| verdict | simulator | Envoy |\n|---|---|---|");
    for (class, (s, e)) in &classes {
        println!("| {class} | {s} | {e} |");
    }
    println!("| admitted to v1 | {} | {} |", versions(&simulated, "v1"), versions(&envoy_verdicts, "v1"));
    println!("| admitted to v2 | {} | {} |", versions(&simulated, "v2"), versions(&envoy_verdicts, "v2"));
    println!("| shadowed | {} | {} |", shadows(&simulated), shadows(&envoy_verdicts));
    for (k, s) in &sim_charged {
        println!("| tokens charged to {k} | {s} | {} |", envoy_charged.get(k).copied().unwrap_or(0));
    }
    for (i, t) in result.transitions.iter().enumerate() {
        let e = envoy_trans.get(i).map_or("-".to_string(), |e| format!("{} → {} at {:.1} s", e.from, e.to, e.t_ms / 1000.0));
        println!("| breaker {} {} → {} | {:.1} s | {e} |", t.version, t.from, t.to, t.t_ms / 1000.0);
    }
    let differing = disagreements.len() + at_transitions.len();
    println!("| agreement | {} of {} | |", simulated.len() - differing, simulated.len());
    println!("| differing within {RACE_MS} ms of a breaker transition | {} | |", at_transitions.len());
    for what in &at_transitions {
        println!("at a transition: {what}");
    }

    assert!(disagreements.is_empty(), "{} verdicts differ:\n{}", disagreements.len(), disagreements.join("\n"));
    if at_transitions.is_empty() {
        assert_eq!(sim_charged, envoy_charged, "tokens charged per key");
    }
    assert!(!result.transitions.is_empty(), "the incident opens the breaker");
    assert_eq!(
        result.transitions.iter().map(|t| (&t.version, &t.from, &t.to)).collect::<Vec<_>>(),
        envoy_trans.iter().map(|t| (&t.version, &t.from, &t.to)).collect::<Vec<_>>(),
        "the same breaker transitions"
    );
    for (s, e) in result.transitions.iter().zip(&envoy_trans) {
        assert!(
            (s.t_ms - e.t_ms).abs() <= slot,
            "transition {} → {} at {:.0} ms (sim) vs {:.0} ms (Envoy): more than a window slot apart",
            s.from,
            s.to,
            s.t_ms,
            e.t_ms
        );
    }
    for class in case.must_see {
        assert!(classes.get(*class).is_some_and(|(s, _)| *s > 0), "the scenario no longer yields `{class}`: {classes:?}");
    }
}
