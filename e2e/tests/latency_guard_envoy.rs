//! latency-guard in real Envoy (`envoy/templates/latency-gateway.yaml`): json_to_metadata → latency-guard →
//! model-router → llm-metrics → router, two mock clusters (v1, its fallback v2).
//!
//! - a stalled upstream (headers and role chunk sent, no token) is answered 504 at the TTFT
//!   deadline, because the guard held the response headers;
//! - a healthy stream is released at its first token, its TTFT at the client barely moved;
//! - a stream past its total deadline ends with an error event;
//! - the SLO scenario: v1's TTFT goes from fast to slow mid-test, the breaker opens within its
//!   window, critical and standard tenants move to v2, sheddable ones get 503 with `retry-after`;
//!   v1 recovers, probes pass, the breaker closes and traffic returns. The timeline is printed.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use serde_json::{json, Value};
use sluice_e2e::gateway::{demo_plugin_config, shipped, yaml_string_body};
use sluice_e2e::{post_json, post_stream, Envoy, MockServer};
use std::time::{Duration, Instant};

const CHAT: &str = "/v1/chat/completions";

struct Gateway {
    _v1: MockServer,
    _v2: MockServer,
    envoy: Envoy,
}

fn start() -> Gateway {
    let v1 = MockServer::start(&["--served-by", "llama-v1", "--tokens", "6", "--ttft-ms", "40"]).unwrap();
    let v2 = MockServer::start(&["--served-by", "llama-v2", "--tokens", "6", "--ttft-ms", "40"]).unwrap();
    let mut metrics: Value = serde_json::from_str(&demo_plugin_config().unwrap()).unwrap();
    metrics["stream_summary_comment"] = json!(false);
    let read = |p: &str| std::fs::read_to_string(shipped(p)).unwrap();
    let (p1, p2) = (v1.port().to_string(), v2.port().to_string());
    let guard = yaml_string_body(&read("policies/latency-guard.e2e.json"));
    let router = yaml_string_body(&read("policies/model-router.latency-e2e.json"));
    let metrics = yaml_string_body(&metrics.to_string());
    let envoy = Envoy::start(
        &shipped("envoy/templates/latency-gateway.yaml"),
        &[
            ("UPSTREAM_PORT", p1.as_str()),
            ("UPSTREAM_PORT_V2", p2.as_str()),
            // No shadow in this policy; the cluster needs a port all the same.
            ("SHADOW_PORT", p2.as_str()),
            ("LATENCY_CONFIG", guard.as_str()),
            ("ROUTER_CONFIG", router.as_str()),
            ("PLUGIN_CONFIG", metrics.as_str()),
        ],
    )
    .unwrap();
    Gateway { _v1: v1, _v2: v2, envoy }
}

fn body(stream: bool) -> String {
    json!({"model": "llama-3-70b", "stream": stream, "messages": [{"role": "user", "content": "How fast are you today?"}]}).to_string()
}

fn headers<'a>(tenant: &'a str, extra: &[(&'a str, &'a str)]) -> Vec<(&'a str, &'a str)> {
    let mut h = vec![("content-type", "application/json"), ("x-sluice-tenant", tenant)];
    h.extend_from_slice(extra);
    h
}

#[test]
fn stalled_upstream_is_answered_504_at_the_ttft_deadline_and_healthy_streams_pass() {
    let gw = start();
    // Healthy: released at the first token.
    let t = Instant::now();
    let ok = post_stream(gw.envoy.listen_addr(), CHAT, &headers("std-a", &[("x-mock-ttft-ms", "150")]), &body(true)).unwrap().collect().unwrap();
    assert_eq!(ok.status, 200, "{}", ok.text());
    assert!(ok.complete);
    let head = ok.head_at.duration_since(ok.sent_at);
    println!("healthy stream: head after {head:?}, complete after {:?}", t.elapsed());
    assert!(head >= Duration::from_millis(150), "headers must wait for the first token (held), got {head:?}");
    assert!(ok.text().contains("[DONE]"));

    // Stalled: headers and the role chunk sent at once, the first token only after 5 s.
    let t = Instant::now();
    let stalled = post_json(gw.envoy.listen_addr(), CHAT, &headers("std-a", &[("x-mock-ttft-ms", "5000")]), &body(true)).unwrap();
    let took = t.elapsed();
    println!("stalled stream: {} after {took:?}: {}", stalled.status, stalled.text());
    assert_eq!(stalled.status, 504, "{}", stalled.text());
    assert!(took >= Duration::from_millis(1000) && took < Duration::from_millis(2500), "{took:?}");
    let err: Value = stalled.json().unwrap();
    assert_eq!(err["error"]["code"], "ttft_deadline_exceeded");
    assert!(err["error"]["message"].as_str().unwrap().contains("1000 ms"), "{err}");
    let m = gw.envoy.metrics().unwrap();
    let fired = m.value("sluice_latency_deadline_total", &[("version", "v1"), ("kind", "ttft"), ("action", "reply_504")]);
    assert_eq!(fired, Some(1.0));

    // A whole (non-streamed) answer has no first token before its end: only the total deadline
    // applies, so 1.5 s is fine against a 1 s TTFT deadline.
    let t = Instant::now();
    let whole = post_json(gw.envoy.listen_addr(), CHAT, &headers("std-a", &[("x-mock-ttft-ms", "1500")]), &body(false)).unwrap();
    assert_eq!(whole.status, 200, "{}", whole.text());
    assert!(t.elapsed() >= Duration::from_millis(1500));

    // An upstream error event before any token is the upstream's answer: it is released at the end
    // of the stream, not held until the deadline.
    let t = Instant::now();
    let failed = post_json(gw.envoy.listen_addr(), CHAT, &headers("std-a", &[("x-mock-fail", "error-event-after:0")]), &body(true)).unwrap();
    println!("upstream error event: {} after {:?}", failed.status, t.elapsed());
    assert_eq!(failed.status, 200);
    assert!(t.elapsed() < Duration::from_millis(500), "{:?}", t.elapsed());
    assert!(failed.text().contains("error"), "{}", failed.text());
    drop(gw);
}

#[test]
fn total_deadline_ends_a_slow_stream_with_an_error_event() {
    let gw = start();
    // 40 tokens 250 ms apart: 10 s of stream against a 4 s total deadline.
    let extra = [("x-mock-itl-ms", "250"), ("x-mock-tokens", "40")];
    let s = post_stream(gw.envoy.listen_addr(), CHAT, &headers("std-a", &extra), &body(true)).unwrap().collect().unwrap();
    // `collect` returns when the connection ends (the reset): the stream's end as the client sees it.
    let ended = s.sent_at.elapsed();
    assert_eq!(s.status, 200);
    let text = s.text();
    let cut = s.time_to("total_deadline_exceeded").unwrap_or_else(|| panic!("no deadline event in {text}"));
    let last = s.chunks.last().map(|c| c.at.duration_since(s.sent_at)).unwrap_or_default();
    println!(
        "total deadline event after {cut:?}, last byte after {last:?}, connection ended after {ended:?} ({:?} after the event), complete={}",
        ended.saturating_sub(cut),
        s.complete
    );
    assert!(cut >= Duration::from_millis(4000) && cut < Duration::from_millis(4600), "{cut:?}");
    // Nothing after the error event (the [DONE] that follows it), and the stream ends soon after.
    let after = text.split("total_deadline_exceeded").nth(1).unwrap_or_default();
    assert!(!after.contains("\"content\""), "tokens after the deadline event: {after}");
    assert!(last < Duration::from_millis(5000), "{last:?}");
    // The guard resets the stream 20 ms after the event; Envoy then closes the HTTP/1.1 connection
    // after the connection manager's delayed_close_timeout (default 1 s): ≈ 1.02 s measured. Without
    // the reset the stream would run to its 10 s end.
    assert!(ended.saturating_sub(cut) < Duration::from_millis(1500), "connection ended {ended:?}, event at {cut:?}");
    // Tokens before the cut reached the client.
    let before = text.split("total_deadline_exceeded").next().unwrap_or_default();
    assert!(before.matches("\"content\"").count() >= 10, "{before}");
}

/// One request of the scenario, as the client saw it.
#[derive(Debug, Clone)]
struct Seen {
    at: Duration,
    class: &'static str,
    status: u16,
    served_by: String,
    retry_after: Option<String>,
}

fn breaker_transitions(envoy: &Envoy, to: &str) -> f64 {
    let m = envoy.metrics().unwrap();
    m.value("sluice_latency_breaker_transitions_total", &[("version", "v1"), ("to", to)]).unwrap_or(0.0)
}

#[test]
fn slow_version_trips_the_breaker_critical_fails_over_sheddable_is_refused_and_it_closes_on_recovery() {
    let gw = start();
    let addr = gw.envoy.listen_addr();
    let v1_control = gw._v1.addr();
    let t0 = Instant::now();
    let (slow_at, recover_at, end_at) = (Duration::from_secs(3), Duration::from_secs(11), Duration::from_secs(22));
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::<Seen>::new()));
    let mut clients = Vec::new();
    for (i, (class, tenant)) in
        [("critical", "crit-1"), ("critical", "crit-2"), ("standard", "std-1"), ("standard", "std-2"), ("sheddable", "batch-1"), ("sheddable", "batch-2")]
            .into_iter()
            .enumerate()
    {
        let seen = seen.clone();
        clients.push(std::thread::spawn(move || {
            let mut n = 0u64;
            while t0.elapsed() < end_at {
                n += 1;
                let id = format!("{tenant}-{n}-{i}");
                let h = [("content-type", "application/json"), ("x-sluice-tenant", tenant), ("x-request-id", id.as_str())];
                let at = t0.elapsed();
                match post_json(addr, CHAT, &h, &body(true)) {
                    Ok(r) => {
                        let served_by = r.header("x-mock-served-by").unwrap_or("-").to_string();
                        let retry_after = r.header("retry-after").map(str::to_string);
                        seen.lock().unwrap().push(Seen { at, class, status: r.status, served_by, retry_after });
                        if r.status == 503 {
                            // A refused client backs off briefly, as retry-after asks (shortened).
                            std::thread::sleep(Duration::from_millis(100));
                        }
                    }
                    Err(e) => panic!("{class} request failed at {at:?}: {e:#}"),
                }
            }
        }));
    }
    let set_ttft = |ms: u64| {
        let r = post_json(v1_control, "/mock/ttft", &[("content-type", "application/json")], &json!({ "ms": ms }).to_string()).unwrap();
        assert_eq!(r.status, 200);
    };
    let mut opened_at = None;
    let mut closed_at = None;
    std::thread::sleep(slow_at);
    set_ttft(600);
    while t0.elapsed() < recover_at {
        if opened_at.is_none() && breaker_transitions(&gw.envoy, "open") > 0.0 {
            opened_at = Some(t0.elapsed());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    set_ttft(40);
    while t0.elapsed() < end_at {
        if closed_at.is_none() && breaker_transitions(&gw.envoy, "closed") > 0.0 {
            closed_at = Some(t0.elapsed());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    for c in clients {
        c.join().unwrap();
    }
    let seen = seen.lock().unwrap().clone();
    let metrics = gw.envoy.metrics().unwrap();

    // The timeline, one line per second: what each class got.
    println!("t(s)  critical(v1/v2/503)  standard(v1/v2/503)  sheddable(v1/v2/503)   [slow at {slow_at:?}, recovered at {recover_at:?}]");
    for s in 0..end_at.as_secs() {
        let mut line = format!("{s:>4}");
        for class in ["critical", "standard", "sheddable"] {
            let in_second = |what: &dyn Fn(&Seen) -> bool| seen.iter().filter(|x| x.class == class && x.at.as_secs() == s && what(x)).count();
            let v1 = in_second(&|x| x.status == 200 && x.served_by == "llama-v1");
            let v2 = in_second(&|x| x.status == 200 && x.served_by == "llama-v2");
            let refused = in_second(&|x| x.status == 503);
            line.push_str(&format!("  {:>19}", format!("{v1}/{v2}/{refused}")));
        }
        println!("{line}");
    }
    println!("breaker opened (seen in stats) at {opened_at:?}, closed at {closed_at:?}");
    for to in ["open", "half_open", "closed"] {
        println!("transitions to {to}: {}", breaker_transitions(&gw.envoy, to));
    }
    println!("envoy log:\n{}", gw.envoy.stderr_tail(40));

    // Before the switch: everyone on v1.
    let before: Vec<&Seen> = seen.iter().filter(|x| x.at < slow_at).collect();
    assert!(before.len() > 30, "{}", before.len());
    assert!(before.iter().all(|x| x.status == 200 && x.served_by == "llama-v1"), "{before:?}");
    // The breaker opens within its 4 s window of the switch (plus the stats flush).
    let opened_at = opened_at.expect("the breaker never opened");
    assert!(opened_at > slow_at && opened_at < slow_at + Duration::from_secs(5), "{opened_at:?}");
    // Critical tenants are never refused and are answered by v2 while v1 is open.
    assert!(seen.iter().filter(|x| x.class == "critical").all(|x| x.status == 200), "a critical request was refused");
    let open_phase = |x: &&Seen| x.at > opened_at + Duration::from_millis(500) && x.at < recover_at;
    let critical_open: Vec<&Seen> = seen.iter().filter(|x| x.class == "critical").filter(open_phase).collect();
    let on_v2 = critical_open.iter().filter(|x| x.served_by == "llama-v2").count();
    assert!(critical_open.len() >= 10 && on_v2 * 10 >= critical_open.len() * 7, "critical while open: {on_v2} of {} on v2", critical_open.len());
    let standard_open: Vec<&Seen> = seen.iter().filter(|x| x.class == "standard").filter(open_phase).collect();
    assert!(standard_open.iter().all(|x| x.status == 200), "a standard request was refused while failing over");
    // Sheddable tenants are refused with 503 and retry-after while open.
    let shed: Vec<&Seen> = seen.iter().filter(|x| x.class == "sheddable" && x.status == 503).collect();
    assert!(shed.len() >= 5, "sheddable refusals: {}", shed.len());
    assert!(shed.iter().all(|x| x.retry_after.as_deref().and_then(|v| v.parse::<u64>().ok()).is_some_and(|s| s >= 1)));
    assert!(shed.iter().all(|x| x.at > slow_at), "refused before the slowdown");
    let shed_metric = metrics.value("sluice_latency_shed_total", &[("version", "v1"), ("priority", "sheddable"), ("reason", "breaker_open")]).unwrap_or(0.0);
    assert_eq!(shed_metric as usize, shed.len());
    // Recovery: the breaker closes and traffic comes back to v1 for every class.
    let closed_at = closed_at.expect("the breaker never closed after recovery");
    assert!(closed_at > recover_at, "{closed_at:?}");
    let after: Vec<&Seen> = seen.iter().filter(|x| x.at > closed_at + Duration::from_millis(1500)).collect();
    assert!(after.len() >= 10, "{}", after.len());
    assert!(after.iter().all(|x| x.status == 200 && x.served_by == "llama-v1"), "after closing: {after:?}");
    assert_eq!(metrics.value("sluice_latency_breaker_state", &[("version", "v1")]), Some(0.0));
}
