//! The rules latency-guard's adapter used to hold, as exact effect lists: admission, shedding,
//! the open breaker, holds and deadlines, and what a stream's end writes.

use super::*;
use crate::flow::FixedView;
use crate::latency::BreakerState;
use crate::store::MemoryStore;
use serde_json::json;

/// Host time of the first request (any time well past the epoch).
const T0: u64 = 1_767_225_600_000_000_000;
const MS: u64 = 1_000_000;
/// The stream's context id.
const ID: u32 = 7;
const QUEUE: &str = "sluice_latency_release_1";

/// The classes of the harness' policy, `v1` as given (without its name) and `v2` as given.
fn policy(v1: serde_json::Value, v2: serde_json::Value) -> LatencyPolicy {
    let (mut v1, mut v2) = (v1, v2);
    v1["name"] = json!("v1");
    v2["name"] = json!("v2");
    let p = json!({
        "tenant": {"header": "x-sluice-tenant"},
        "classes": [
            {"name": "interactive", "priority": "critical", "tenants": ["crit-*"]},
            {"name": "standard", "priority": "standard", "tenants": ["std-*"]},
            {"name": "batch", "priority": "sheddable", "tenants": ["batch-*"]}
        ],
        "versions": [v1, v2]
    });
    LatencyPolicy::from_json(p.to_string().as_bytes()).unwrap()
}

/// A TTFT breaker (p95 ≤ 500 ms, 5 samples, open 10 s) failing over to `v2`.
fn breaker_v1() -> serde_json::Value {
    json!({"objective": {"percentile": 95, "ttft_ms": 500}, "window_s": 60, "min_samples": 5, "open_for_ms": 10_000, "fallback": "v2"})
}

fn root(v1: serde_json::Value, v2: serde_json::Value) -> (GuardRoot, MemoryStore) {
    let p = policy(v1, v2);
    let mut store = MemoryStore::default();
    ensure_shared_state(&p, &mut store).unwrap();
    (GuardRoot::new(p, Some(QUEUE.to_string()), "vm-1".to_string()), store)
}

/// A streamed chat request of `tenant`, routed by model-router to `version`.
fn request(tenant: &str, version: &str) -> FixedView {
    let pair = |k: &str, v: &str| (k.to_string(), v.to_string());
    FixedView {
        request_headers: vec![pair(":path", "/v1/chat/completions"), pair("x-sluice-tenant", tenant), pair("x-request-id", "req-1")],
        request_body: br#"{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}"#.to_vec(),
        properties: vec![(vec![ROUTE_PROPERTY.to_string()], json!({"version": version}).to_string())],
        ..FixedView::default()
    }
}

fn open_breaker(store: &mut MemoryStore, root: &GuardRoot, version: &str, since_ns: u64) {
    let vp = root.policy().version(version).unwrap();
    let state = BreakerState { state: State::Open, since_ns, hold_closed_until_ns: 0 };
    store.set(&vp.breaker_key(), &breaker::encode_state(&state), 0).unwrap();
}

fn set_in_flight(store: &mut MemoryStore, root: &GuardRoot, version: &str, n: u64) {
    let key = root.policy().version(version).unwrap().in_flight_key();
    store.set(&key, &store::encode_counter(n), 0).unwrap();
}

fn in_flight(store: &mut MemoryStore, root: &GuardRoot, version: &str) -> u64 {
    let key = root.policy().version(version).unwrap().in_flight_key();
    store::decode_counter(store.get(&key).unwrap().0.as_deref())
}

fn headers(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

/// Request headers then the whole request body, at `T0`: what each pushed, and the body's verdict.
fn admit(flow: &mut GuardFlow, root: &mut GuardRoot, view: &mut FixedView, store: &mut MemoryStore) -> (Vec<Effect>, Vec<Effect>, Verdict) {
    let mut fx = Effects::default();
    assert_eq!(flow.on_request_headers(root, view, store, false, T0, &mut fx), Verdict::Continue);
    let at_headers = std::mem::take(&mut fx.0);
    let size = view.request_body.len();
    let verdict = flow.on_request_body(root, view, store, size, true, T0, &mut fx);
    (at_headers, fx.0, verdict)
}

#[test]
fn an_admitted_request_writes_the_avoid_list_and_enters_in_flight() {
    let (mut root, mut store) = root(json!({"breaker": breaker_v1()}), json!({"ttft_deadline_ms": 300, "in_flight": {"limit": 10}}));
    open_breaker(&mut store, &root, "v1", T0 - 1000 * MS);
    // A critical tenant fails over while v1 is open: model-router is told, and routes to v2.
    let (mut flow, mut view) = (GuardFlow::new(ID), request("crit-a", "v2"));
    let (at_headers, at_body, verdict) = admit(&mut flow, &mut root, &mut view, &mut store);
    assert_eq!(at_headers, vec![Effect::SetState { key: "sluice_latency_avoid".into(), value: b"v1>v2".to_vec() }]);
    assert_eq!(
        at_body,
        vec![
            Effect::GaugeSet { name: "sluice.latency.in_flight.version.v2".into(), value: 1 },
            // The TTFT deadline is the next thing due on this worker.
            Effect::SetTickPeriod { ms: 300 },
        ]
    );
    assert_eq!(verdict, Verdict::Continue);
    assert_eq!(in_flight(&mut store, &root, "v2"), 1);
    assert_eq!(root.watched_ids(), vec![ID]);
}

#[test]
fn an_unguarded_path_is_not_followed() {
    let (mut root, mut store) = root(json!({}), json!({}));
    let mut view = request("crit-a", "v1");
    view.request_headers[0].1 = "/healthz".into();
    let mut flow = GuardFlow::new(ID);
    let mut fx = Effects::default();
    assert_eq!(flow.on_request_headers(&mut root, &mut view, &mut store, true, T0, &mut fx), Verdict::Continue);
    assert!(!flow.is_guarded());
    assert!(fx.is_empty());
}

#[test]
fn past_the_in_flight_limit_a_sheddable_request_is_refused() {
    let (mut root, mut store) = root(json!({"in_flight": {"limit": 2}}), json!({}));
    set_in_flight(&mut store, &root, "v1", 2);
    let (mut flow, mut view) = (GuardFlow::new(ID), request("batch-a", "v1"));
    let (at_headers, at_body, verdict) = admit(&mut flow, &mut root, &mut view, &mut store);
    assert!(at_headers.is_empty(), "{at_headers:?}");
    let body = r#"{"error":{"code":"in_flight_limit","message":"model version v1 has 2 requests in flight (limit 2 for sheddable requests); try again shortly","type":"overloaded"}}"#;
    assert_eq!(
        at_body,
        vec![
            Effect::Count { name: "sluice.latency.shed_total.version.v1.priority.sheddable.reason.in_flight".into(), delta: 1 },
            Effect::MarkReply(GatewayReply { status: 503, end: GatewayEnd::Refused }),
            Effect::LocalReply {
                status: 503,
                headers: headers(&[("content-type", "application/json"), ("retry-after", "1"), ("x-sluice-refused-by", "latency-guard")]),
                body: body.as_bytes().to_vec(),
            },
            Effect::SetState {
                key: "sluice_latency".into(),
                value: br#"{"class":"batch","outcome":"shed_in_flight","priority":"sheddable","probe":false,"status":503,"ttft_ms":null,"version":"v1"}"#
                    .to_vec(),
            },
        ]
    );
    assert_eq!(verdict, Verdict::Pause);
    // Not counted in, and nothing to count out or report at its end.
    assert_eq!(in_flight(&mut store, &root, "v1"), 2);
    let mut fx = Effects::default();
    flow.on_log(&mut root, &mut view, &mut store, T0 + MS, &mut fx);
    assert!(fx.is_empty(), "{fx:?}");
    assert!(root.watched_ids().is_empty());
}

#[test]
fn a_critical_request_is_never_shed() {
    let (mut root, mut store) = root(json!({"in_flight": {"limit": 2}}), json!({}));
    set_in_flight(&mut store, &root, "v1", 5);
    let (mut flow, mut view) = (GuardFlow::new(ID), request("crit-a", "v1"));
    let (_, at_body, verdict) = admit(&mut flow, &mut root, &mut view, &mut store);
    assert_eq!(at_body, vec![Effect::GaugeSet { name: "sluice.latency.in_flight.version.v1".into(), value: 6 }]);
    assert_eq!(verdict, Verdict::Continue);
    // Out again at its end.
    let mut fx = Effects::default();
    flow.on_log(&mut root, &mut view, &mut store, T0 + MS, &mut fx);
    assert_eq!(fx.0.first(), Some(&Effect::GaugeSet { name: "sluice.latency.in_flight.version.v1".into(), value: 5 }));
}

#[test]
fn an_open_breaker_refuses_the_class_that_rejects_and_avoids_for_the_one_that_fails_over() {
    let (mut root, mut store) = root(json!({"breaker": breaker_v1()}), json!({}));
    open_breaker(&mut store, &root, "v1", T0 - 1500 * MS);
    // Sheddable: refused (no fallback for it by default), retry-after the rest of the open time.
    let (mut flow, mut view) = (GuardFlow::new(ID), request("batch-a", "v1"));
    let (at_headers, at_body, verdict) = admit(&mut flow, &mut root, &mut view, &mut store);
    assert!(at_headers.is_empty(), "{at_headers:?}");
    let body = r#"{"error":{"code":"breaker_open","message":"model version v1 is failing its latency objective (circuit open); sheddable requests are refused until it recovers","type":"overloaded"}}"#;
    assert_eq!(
        at_body,
        vec![
            Effect::Count { name: "sluice.latency.shed_total.version.v1.priority.sheddable.reason.breaker_open".into(), delta: 1 },
            Effect::MarkReply(GatewayReply { status: 503, end: GatewayEnd::Refused }),
            Effect::LocalReply {
                status: 503,
                headers: headers(&[("content-type", "application/json"), ("retry-after", "9"), ("x-sluice-refused-by", "latency-guard")]),
                body: body.as_bytes().to_vec(),
            },
            Effect::SetState {
                key: "sluice_latency".into(),
                value: br#"{"class":"batch","outcome":"shed_breaker_open","priority":"sheddable","probe":false,"status":503,"ttft_ms":null,"version":"v1"}"#
                    .to_vec(),
            },
        ]
    );
    assert_eq!(verdict, Verdict::Pause);

    // Standard fails over: the avoid list names the fallback; if it reaches v1 anyway (no router
    // honoured the list), it is served and counted.
    let (mut flow, mut view) = (GuardFlow::new(ID), request("std-a", "v1"));
    let (at_headers, at_body, verdict) = admit(&mut flow, &mut root, &mut view, &mut store);
    assert_eq!(at_headers, vec![Effect::SetState { key: "sluice_latency_avoid".into(), value: b"v1>v2".to_vec() }]);
    assert_eq!(at_body, vec![Effect::Count { name: "sluice.latency.fallback_unavailable_total.version.v1.priority.standard".into(), delta: 1 }]);
    assert_eq!(verdict, Verdict::Continue);
}

#[test]
fn an_open_breaker_past_its_open_time_goes_half_open_at_the_request_that_finds_it() {
    let (mut root, mut store) = root(json!({"breaker": breaker_v1()}), json!({}));
    open_breaker(&mut store, &root, "v1", T0 - 10_000 * MS);
    let (mut flow, mut view) = (GuardFlow::new(ID), request("crit-a", "v1"));
    let mut fx = Effects::default();
    flow.on_request_headers(&mut root, &mut view, &mut store, false, T0, &mut fx);
    let [gauge, Effect::Log { level: LogLevel::Warn, message }, count, ..] = fx.0.as_slice() else { panic!("{fx:?}") };
    assert_eq!(gauge, &Effect::GaugeSet { name: "sluice.latency.breaker_state.version.v1".into(), value: 2 });
    assert!(message.starts_with("sluice latency-guard: breaker of v1 open → half_open: open for 10000 ms"), "{message}");
    assert_eq!(count, &Effect::Count { name: "sluice.latency.breaker_transitions_total.version.v1.to.half_open".into(), delta: 1 });
    let vp = root.policy().version("v1").unwrap();
    assert_eq!(breaker::read(&mut store, &vp.breaker_key(), &vp.breaker.as_ref().unwrap().config).unwrap().state().state, State::HalfOpen);
}

/// Two workers: one turns the breaker half-open and is about to empty the window; the other
/// records a first token on the window as it still is (the samples that opened the breaker). The
/// second must not judge the probes on those samples, and empties the window itself.
#[test]
fn a_half_open_breaker_is_not_judged_on_a_window_another_worker_has_not_emptied_yet() {
    let mut breaker_config = breaker_v1();
    breaker_config["probes"] = json!(5);
    let (mut root, mut store) = root(json!({"breaker": breaker_config}), json!({}));
    let (mut flow, mut view) = (GuardFlow::new(ID), request("crit-a", "v1"));
    admit(&mut flow, &mut root, &mut view, &mut store);
    let vp = root.policy().version("v1").unwrap().clone();
    let b = vp.breaker.clone().unwrap();
    for i in 0..10 {
        window::update(&mut store, &vp.window_key(), &b.window, T0 + i * MS, Some(900_000), None, false).unwrap();
    }
    let probing_since = T0 + 50 * MS;
    let half_open = BreakerState { state: State::HalfOpen, since_ns: probing_since, hold_closed_until_ns: 0 };
    store.set(&vp.breaker_key(), &breaker::encode_state(&half_open), 0).unwrap();

    event_stream(&mut view);
    let mut fx = Effects::default();
    flow.on_response_headers(&mut root, &mut view, &mut store, false, T0 + 100 * MS, &mut fx);
    let size = view.response_body.len();
    flow.on_response_body(&mut root, &mut view, &mut store, size, true, T0 + 250 * MS, &mut fx);
    assert!(!fx.0.iter().any(|e| matches!(e, Effect::Log { .. })), "no transition: {fx:?}");
    assert_eq!(breaker::read(&mut store, &vp.breaker_key(), &b.config).unwrap().state(), half_open);
    let stats = window::read(&mut store, &vp.window_key(), &b.window).unwrap().snapshot(T0 + 250 * MS);
    assert_eq!((stats.samples, stats.ttft.count(), stats.started_ns), (0, 0, probing_since), "emptied as of the probing's start");
}

/// The stream of one content event then `[DONE]`, with its usage.
const SSE: &[u8] = b"data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\n\
data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":1}}\n\ndata: [DONE]\n\n";

fn event_stream(view: &mut FixedView) {
    view.response_headers = headers(&[(":status", "200"), ("content-type", "text/event-stream")]);
    view.response_body = SSE.to_vec();
}

#[test]
fn a_stream_end_records_the_window_and_writes_the_stamp() {
    let (mut root, mut store) = root(json!({"breaker": breaker_v1()}), json!({}));
    let (mut flow, mut view) = (GuardFlow::new(ID), request("crit-a", "v1"));
    let (_, at_body, _) = admit(&mut flow, &mut root, &mut view, &mut store);
    assert!(at_body.is_empty(), "{at_body:?}");
    event_stream(&mut view);
    let mut fx = Effects::default();
    // Without a TTFT deadline nothing is held.
    assert_eq!(flow.on_response_headers(&mut root, &mut view, &mut store, false, T0 + 100 * MS, &mut fx), Verdict::Continue);
    assert!(fx.is_empty(), "{fx:?}");
    let size = view.response_body.len();
    assert_eq!(flow.on_response_body(&mut root, &mut view, &mut store, size, true, T0 + 250 * MS, &mut fx), Verdict::Continue);
    // The guard's own first token went into the window at once (no breaker move on one sample).
    assert_eq!(fx.0, vec![Effect::GaugeSet { name: "sluice.latency.breaker_state.version.v1".into(), value: 0 }]);
    fx.clear();
    flow.on_log(&mut root, &mut view, &mut store, T0 + 400 * MS, &mut fx);
    assert_eq!(
        fx.0,
        vec![
            Effect::Count { name: "sluice.latency.requests_total.version.v1.class.interactive.outcome.ok".into(), delta: 1 },
            Effect::SetState {
                key: "sluice_latency".into(),
                value: br#"{"class":"interactive","outcome":"ok","priority":"critical","probe":false,"status":200,"ttft_ms":250,"version":"v1"}"#.to_vec(),
            },
            Effect::GaugeSet { name: "sluice.latency.breaker_state.version.v1".into(), value: 0 },
        ]
    );
    // One finished request (its TTFT in once, at the first token).
    let vp = root.policy().version("v1").unwrap();
    let stats = window::read(&mut store, &vp.window_key(), &vp.breaker.as_ref().unwrap().window).unwrap().snapshot(T0 + 400 * MS);
    assert_eq!((stats.samples, stats.errors), (1, 0));
    assert_eq!(stats.ttft.count(), 1);
    assert!(root.watched_ids().is_empty());
    // A second teardown reports nothing.
    fx.clear();
    flow.on_log(&mut root, &mut view, &mut store, T0 + 500 * MS, &mut fx);
    assert!(fx.is_empty(), "{fx:?}");
}

#[test]
fn a_client_that_went_away_writes_the_stamp_but_no_sample() {
    let (mut root, mut store) = root(json!({"breaker": breaker_v1()}), json!({}));
    let (mut flow, mut view) = (GuardFlow::new(ID), request("crit-a", "v1"));
    admit(&mut flow, &mut root, &mut view, &mut store);
    event_stream(&mut view);
    let mut fx = Effects::default();
    flow.on_response_headers(&mut root, &mut view, &mut store, false, T0 + 100 * MS, &mut fx);
    view.unended = Outcome::ClientDisconnect;
    flow.on_log(&mut root, &mut view, &mut store, T0 + 400 * MS, &mut fx);
    assert_eq!(
        fx.0,
        vec![
            Effect::Count { name: "sluice.latency.requests_total.version.v1.class.interactive.outcome.client_disconnect".into(), delta: 1 },
            Effect::SetState {
                key: "sluice_latency".into(),
                value:
                    br#"{"class":"interactive","outcome":"client_disconnect","priority":"critical","probe":false,"status":200,"ttft_ms":null,"version":"v1"}"#
                        .to_vec(),
            },
        ]
    );
    let vp = root.policy().version("v1").unwrap();
    let stats = window::read(&mut store, &vp.window_key(), &vp.breaker.as_ref().unwrap().window).unwrap().snapshot(T0 + 400 * MS);
    assert_eq!(stats.samples, 0);
}

#[test]
fn a_held_stream_is_released_through_its_queue_at_the_first_token() {
    let (mut root, mut store) = root(json!({"ttft_deadline_ms": 1000, "breaker": breaker_v1()}), json!({}));
    let (mut flow, mut view) = (GuardFlow::new(ID), request("crit-a", "v1"));
    let (_, at_body, _) = admit(&mut flow, &mut root, &mut view, &mut store);
    assert!(at_body.is_empty(), "the deadline is the idle tick away: {at_body:?}");
    event_stream(&mut view);
    view.properties.push((vec![FIRST_TOKEN_PROPERTY.to_string()], "0".to_string()));
    let mut fx = Effects::default();
    assert_eq!(flow.on_response_headers(&mut root, &mut view, &mut store, false, T0 + 100 * MS, &mut fx), Verdict::Pause);
    assert_eq!(
        fx.0,
        vec![Effect::SetState { key: "sluice_latency_release".into(), value: format!("{ID} {QUEUE} vm-1").into_bytes() }, Effect::SetTickPeriod { ms: 10 }]
    );
    assert!(root.is_held(ID));
    fx.clear();
    // llm-metrics marked the first token at +150 ms and enqueued the stream.
    view.properties.last_mut().unwrap().1 = (T0 + 150 * MS).to_string();
    let mut entered = Vec::new();
    root.on_release(
        b"7",
        T0 + 151 * MS,
        &mut |id| {
            entered.push(id);
            true
        },
        &mut view,
        &mut store,
        &mut fx,
    );
    assert_eq!(entered, vec![ID]);
    assert_eq!(fx.0, vec![Effect::ResumeResponse, Effect::GaugeSet { name: "sluice.latency.breaker_state.version.v1".into(), value: 0 }]);
    assert!(!root.is_held(ID));
}

#[test]
fn a_ttft_deadline_on_the_tick_answers_504_and_a_gone_stream_is_forgotten() {
    let (mut root, mut store) = root(json!({"ttft_deadline_ms": 300}), json!({}));
    let (mut flow, mut view) = (GuardFlow::new(ID), request("crit-a", "v1"));
    admit(&mut flow, &mut root, &mut view, &mut store);
    let mut fx = Effects::default();
    let mut enter = |_| true;
    root.on_tick_stream(ID, T0 + 299 * MS, &mut enter, &mut view, &mut store, &mut fx);
    assert!(fx.is_empty(), "{fx:?}");
    root.on_tick_stream(ID, T0 + 300 * MS, &mut enter, &mut view, &mut store, &mut fx);
    let body = r#"{"error":{"code":"ttft_deadline_exceeded","message":"sluice latency-guard: the first token of model version v1 did not arrive within the ttft deadline of 300 ms","type":"timeout"}}"#;
    assert_eq!(
        fx.0,
        vec![
            Effect::MarkReply(GatewayReply { status: 504, end: GatewayEnd::Deadline }),
            Effect::LocalReply {
                status: 504,
                headers: headers(&[("content-type", "application/json"), ("x-sluice-deadline", "ttft"), ("x-sluice-refused-by", "latency-guard")]),
                body: body.as_bytes().to_vec(),
            },
            Effect::Log {
                level: LogLevel::Info,
                message: "sluice latency-guard: ttft deadline of 300 ms fired for a request to v1 after 300 ms: reply_504".into()
            },
            Effect::Count { name: "sluice.latency.deadline_total.version.v1.kind.ttft.action.reply_504".into(), delta: 1 },
        ]
    );
    fx.clear();
    root.after_tick(T0 + 300 * MS, &mut store, &mut fx);
    assert_eq!(fx.0, vec![Effect::SetTickPeriod { ms: 1000 }], "nothing is due any more");

    // A second stream whose context is gone by its deadline: nothing is done, it is no longer watched.
    let (mut other, mut view) = (GuardFlow::new(ID + 1), request("crit-a", "v1"));
    let mut fx = Effects::default();
    other.on_request_headers(&mut root, &mut view, &mut store, true, T0, &mut fx);
    fx.clear();
    root.on_tick_stream(ID + 1, T0 + 300 * MS, &mut |_| false, &mut view, &mut store, &mut fx);
    assert!(fx.is_empty(), "{fx:?}");
    assert_eq!(root.watched_ids(), vec![ID]);
}

#[test]
fn the_output_ceiling_is_written_into_the_whole_body() {
    let (mut root, mut store) = root(json!({"max_output_tokens": 16}), json!({}));
    let (mut flow, mut view) = (GuardFlow::new(ID), request("crit-a", "v1"));
    let mut fx = Effects::default();
    flow.on_request_headers(&mut root, &mut view, &mut store, false, T0, &mut fx);
    // Its length may change: no content-length upstream.
    assert_eq!(fx.0, vec![Effect::SetHeader { dir: Dir::Request, name: "content-length".into(), value: None }]);
    fx.clear();
    // A first chunk of several: decided, then the guard waits for the whole body.
    assert_eq!(flow.on_request_body(&mut root, &mut view, &mut store, 10, false, T0, &mut fx), Verdict::Pause);
    assert!(fx.is_empty(), "{fx:?}");
    let size = view.request_body.len();
    assert_eq!(flow.on_request_body(&mut root, &mut view, &mut store, size, true, T0, &mut fx), Verdict::Continue);
    let [Effect::ReplaceBody { dir: Dir::Request, bytes }, count] = fx.0.as_slice() else { panic!("{fx:?}") };
    let body: serde_json::Value = serde_json::from_slice(bytes).unwrap();
    assert_eq!(body["max_tokens"], json!(16), "{body}");
    assert_eq!(count, &Effect::Count { name: "sluice.latency.output_capped_total.version.v1".into(), delta: 1 });
}

/// A host that copies the body out on every read (as proxy-wasm's hostcall does), counting reads.
struct CopyingView {
    inner: FixedView,
    body_reads: usize,
}

impl View for CopyingView {
    fn now(&mut self) -> u64 {
        self.inner.now()
    }
    fn request_header(&mut self, name: &str) -> Option<String> {
        self.inner.request_header(name)
    }
    fn response_header(&mut self, name: &str) -> Option<String> {
        self.inner.response_header(name)
    }
    fn body(&mut self, dir: Dir, size: usize) -> std::borrow::Cow<'_, [u8]> {
        self.body_reads += 1;
        std::borrow::Cow::Owned(self.inner.body(dir, size).into_owned())
    }
    fn property(&mut self, path: &[&str]) -> Option<String> {
        self.inner.property(path)
    }
    fn gateway_reply(&mut self) -> Option<GatewayReply> {
        self.inner.gateway_reply()
    }
    fn unended_outcome(&mut self) -> Outcome {
        self.inner.unended_outcome()
    }
}

/// The whole body in one event: the guard decides on it and writes the ceiling into it, and a
/// host that copies the body out is asked for it once.
#[test]
fn a_whole_body_is_read_once_for_the_decision_and_the_ceiling() {
    let (mut root, mut store) = root(json!({"max_output_tokens": 16}), json!({}));
    let mut flow = GuardFlow::new(ID);
    let mut view = CopyingView { inner: request("crit-a", "v1"), body_reads: 0 };
    let mut fx = Effects::default();
    flow.on_request_headers(&mut root, &mut view, &mut store, false, T0, &mut fx);
    fx.clear();
    let size = view.inner.request_body.len();
    assert_eq!(flow.on_request_body(&mut root, &mut view, &mut store, size, true, T0, &mut fx), Verdict::Continue);
    let Some(Effect::ReplaceBody { dir: Dir::Request, bytes }) = fx.0.first() else { panic!("{fx:?}") };
    let body: serde_json::Value = serde_json::from_slice(bytes).unwrap();
    assert_eq!(body["max_tokens"], json!(16), "{body}");
    assert_eq!(view.body_reads, 1, "the body read once in the event");
}

#[test]
fn a_root_woken_in_the_marking_hook_looks_at_a_held_stream_as_rarely_as_with_a_queue() {
    let (queued, store) = root(json!({"ttft_deadline_ms": 1000}), json!({}));
    let no_queue = || GuardRoot::new(queued.policy().clone(), None, String::new());
    for (mut root, poll_ms) in [(no_queue(), 1), (no_queue().woken_at_first_token(), 10)] {
        let mut store = store.clone();
        let (mut flow, mut view) = (GuardFlow::new(ID), request("crit-a", "v1"));
        admit(&mut flow, &mut root, &mut view, &mut store);
        assert_eq!(root.stream_due_ns(ID, T0 + 50 * MS), Some(T0 + 1000 * MS), "the TTFT deadline, before the response");
        event_stream(&mut view);
        view.properties.push((vec![FIRST_TOKEN_PROPERTY.to_string()], "0".to_string()));
        let mut fx = Effects::default();
        assert_eq!(flow.on_response_headers(&mut root, &mut view, &mut store, false, T0 + 100 * MS, &mut fx), Verdict::Pause);
        assert_eq!(fx.0.last(), Some(&Effect::SetTickPeriod { ms: poll_ms }));
        assert_eq!(root.stream_due_ns(ID, T0 + 100 * MS), Some(T0 + (100 + poll_ms) * MS), "held: the tick's fallback look");
        assert_eq!(root.stream_due_ns(ID + 1, T0 + 100 * MS), None, "not watched");
    }
}

/// Hundreds of streams at once, their events in a pseudo-random order (admissions, held and
/// unheld responses, releases, first tokens, deadlines firing on ticks, ends): at every tick and
/// every admission the watch list's due streams and next due time must be what a walk of every
/// stream says (in tests the watch list checks itself against that walk), and it files no more
/// times than it watches streams.
#[test]
fn the_watch_list_agrees_with_a_walk_of_every_stream_under_random_traffic() {
    for seed in 1..=12u64 {
        let (mut root, mut store) = root(json!({"ttft_deadline_ms": 300, "total_deadline_ms": 2000}), json!({"total_deadline_ms": 900}));
        let mut state = seed;
        let mut draw = move |n: u64| {
            state = state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            (state >> 33) % n
        };
        // Each live stream: its flow, its view, and how far its response got (0: none, 1: headers).
        let mut live: Vec<(u32, GuardFlow, FixedView, u8)> = Vec::new();
        let (mut now, mut next_id, mut ticks, mut most_watched) = (T0, 1u32, 0u32, 0usize);
        let mut fx = Effects::default();
        for _ in 0..3000 {
            now += draw(4) * MS;
            let pick = |live: &Vec<(u32, GuardFlow, FixedView, u8)>, n: u64| (n as usize) % live.len().max(1);
            match draw(7) {
                0 | 1 if live.len() < 400 => {
                    let version = if draw(3) == 0 { "v2" } else { "v1" };
                    let (mut flow, mut view) = (GuardFlow::new(next_id), request("crit-a", version));
                    flow.on_request_headers(&mut root, &mut view, &mut store, false, now, &mut fx);
                    let size = view.request_body.len();
                    flow.on_request_body(&mut root, &mut view, &mut store, size, true, now, &mut fx);
                    live.push((next_id, flow, view, 0));
                    next_id += 1;
                }
                2 if !live.is_empty() => {
                    let i = pick(&live, draw(1 << 20));
                    let held = draw(2) == 0;
                    let (_, flow, view, stage) = &mut live[i];
                    if *stage == 0 {
                        event_stream(view);
                        if held {
                            view.properties.push((vec![FIRST_TOKEN_PROPERTY.to_string()], "0".to_string()));
                        }
                        flow.on_response_headers(&mut root, view, &mut store, false, now, &mut fx);
                        *stage = 1;
                    }
                }
                3 if !live.is_empty() => {
                    let i = pick(&live, draw(1 << 20));
                    let (id, flow, view, stage) = &mut live[i];
                    if *stage == 1 && root.is_held(*id) {
                        // llm-metrics marked the first token.
                        if let Some(p) = view.properties.iter_mut().find(|(k, _)| k[0] == FIRST_TOKEN_PROPERTY) {
                            p.1 = now.to_string();
                        }
                        root.on_release(id.to_string().as_bytes(), now, &mut |_| true, view, &mut store, &mut fx);
                    } else if *stage == 1 {
                        let size = view.response_body.len();
                        flow.on_response_body(&mut root, view, &mut store, size, false, now, &mut fx);
                    }
                }
                4 if !live.is_empty() => {
                    let i = pick(&live, draw(1 << 20));
                    let (_, mut flow, mut view, _) = live.swap_remove(i);
                    flow.on_log(&mut root, &mut view, &mut store, now, &mut fx);
                }
                _ => {
                    for id in root.due_ids(now) {
                        let Some((_, _, view, _)) = live.iter_mut().find(|s| s.0 == id) else { continue };
                        root.on_tick_stream(id, now, &mut |_| true, view, &mut store, &mut fx);
                    }
                    root.after_tick(now, &mut store, &mut fx);
                    ticks += 1;
                }
            }
            fx.clear();
            let watched = root.watched_ids().len();
            most_watched = most_watched.max(watched);
            assert!(root.watched.filed_len() <= watched, "seed {seed}: {} times filed for {watched} streams", root.watched.filed_len());
        }
        assert!(ticks > 300 && most_watched > 50, "seed {seed}: {ticks} ticks, at most {most_watched} streams watched");
    }
}

/// Streams that come and go while an earlier deadline stays the first thing due take their filed
/// times with them: the watch list holds one a stream, however many came and went.
#[test]
fn streams_that_end_leave_nothing_filed_behind() {
    let (mut root, mut store) = root(json!({"ttft_deadline_ms": 300}), json!({}));
    let mut fx = Effects::default();
    let (mut first, mut view) = (GuardFlow::new(1), request("crit-a", "v1"));
    first.on_request_headers(&mut root, &mut view, &mut store, false, T0, &mut fx);
    let size = view.request_body.len();
    first.on_request_body(&mut root, &mut view, &mut store, size, true, T0, &mut fx);
    let mut most = 0;
    for id in 2..2_000u32 {
        let now = T0 + u64::from(id) * 100_000;
        let (mut flow, mut view) = (GuardFlow::new(id), request("crit-a", "v1"));
        flow.on_request_headers(&mut root, &mut view, &mut store, false, now, &mut fx);
        let size = view.request_body.len();
        flow.on_request_body(&mut root, &mut view, &mut store, size, true, now, &mut fx);
        most = most.max(root.watched.filed_len());
        flow.on_log(&mut root, &mut view, &mut store, now, &mut fx);
        fx.clear();
    }
    assert_eq!(root.watched_ids(), vec![1]);
    assert_eq!((most, root.watched.filed_len()), (2, 1));
}
