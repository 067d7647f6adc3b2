//! The host, end to end, through a plugin written for it (`host-tests/test-plugin`): each test
//! states one behaviour of the host as a plugin experiences it.

mod common;

use common::{gateway, ms, test_plugin, CONFIG};
use sluice_host::{Action, Gateway, Headers, HttpReply, LogLevel, PluginSpec, DEFAULT_EPOCH_NS};

const CHAT: [(&str, &str); 3] = [(":method", "POST"), (":path", "/v1/chat/completions"), (":authority", "api")];

fn header(headers: &Option<Headers>, name: &str) -> Option<String> {
    headers.as_ref()?.get(name).map(str::to_owned)
}

#[test]
fn request_headers_reach_upstream_as_the_plugin_changed_them() {
    let gw = gateway();
    let mut s = gw.stream();
    s.set_property(&["tenant"], "acme");
    let action =
        s.request_headers(&[(&b":path"[..], &b"/v1/chat/completions"[..]), (b":authority", b"\xff\xfe"), (b"x-internal-secret", b"let me in")], true).unwrap();
    assert_eq!(action, Action::Continue);
    let upstream = s.upstream_request_headers();
    assert_eq!(header(&upstream, "x-seen-path").as_deref(), Some("/v1/chat/completions"));
    assert_eq!(header(&upstream, "x-tenant").as_deref(), Some("acme"));
    assert_eq!(header(&upstream, "x-authority-len").as_deref(), Some("2"));
    assert_eq!(upstream.as_ref().and_then(|h| h.get_bytes(":authority")), Some(&b"\xff\xfe"[..]));
    assert!(!upstream.unwrap().contains("x-internal-secret"));
    assert_eq!(s.filter_state("sluice_test").as_deref(), Some(&b"seen"[..]));
    assert_eq!(s.property(&["request", "method"]), None, "no :method header was sent");
    assert_eq!(s.property(&["request", "path"]).as_deref(), Some(&b"/v1/chat/completions"[..]));
}

#[test]
fn the_client_receives_the_body_with_the_appended_line_and_exact_timing_headers() {
    let gw = gateway();
    let mut s = gw.stream();
    s.request_headers(&CHAT, true).unwrap();
    gw.advance(ms(180)).unwrap();
    s.response_headers(&[(":status", "200"), ("content-type", "text/event-stream"), ("content-length", "99")], false).unwrap();
    let downstream = s.downstream_response_headers();
    assert_eq!(header(&downstream, "x-elapsed-ms").as_deref(), Some("180"));
    assert!(!downstream.unwrap().contains("content-length"));

    s.response_body(b"data: {\"a\":1}\n\n", false).unwrap();
    assert_eq!(s.downstream_body(), b"data: {\"a\":1}\n\n");
    gw.advance(ms(20)).unwrap();
    s.response_body(b"data: [DONE]\n\n", true).unwrap();
    assert_eq!(s.downstream_body(), b"data: {\"a\":1}\n\ndata: [DONE]\n\n: sluice-test done\n\n");
    s.end().unwrap();
    assert_eq!(gw.histogram("test.ttfb_ms"), Some(vec![180]));
    assert_eq!(gw.histogram("test.duration_ms"), Some(vec![200]));
}

#[test]
fn metrics_count_requests_and_track_active_streams() {
    let gw = gateway();
    assert_eq!(gw.counter("test.requests"), Some(0));
    let mut a = gw.stream();
    let mut b = gw.stream();
    a.request_headers(&CHAT, true).unwrap();
    b.request_headers(&CHAT, true).unwrap();
    assert_eq!(gw.counter("test.requests"), Some(2));
    assert_eq!(gw.gauge("test.active"), Some(2));
    a.end().unwrap();
    assert_eq!(gw.gauge("test.active"), Some(1));
    b.client_reset().unwrap();
    assert_eq!(gw.gauge("test.active"), Some(0));
    assert_eq!(gw.counter("no.such.metric"), None);
    assert!(gw.metric_names().contains(&"test.ttfb_ms".to_owned()));
}

#[test]
fn a_write_with_a_stale_cas_is_refused() {
    let gw = gateway();
    for expected in 1..=3u64 {
        let mut s = gw.stream();
        s.request_headers(&[(":path", "/"), ("x-cas-conflict", "1")], true).unwrap();
        s.end().unwrap();
        assert_eq!(gw.shared_data("sluice/test/count"), Some(expected.to_string().into_bytes()));
        assert_eq!(gw.counter("test.cas_mismatch"), Some(expected));
    }
}

#[test]
fn ticks_fire_exactly_when_the_clock_passes_them() {
    let gw = gateway();
    assert_eq!(gw.tick_period(), Some(ms(100)));
    gw.advance(ms(99)).unwrap();
    assert_eq!(gw.counter("test.ticks"), Some(0));
    gw.advance(ms(1)).unwrap();
    assert_eq!(gw.counter("test.ticks"), Some(1));
    gw.advance(ms(250)).unwrap();
    assert_eq!(gw.counter("test.ticks"), Some(3));
    assert_eq!(gw.ticks(), 3);
    // The third tick ran at exactly start + 300 ms, although the clock went on to 350 ms.
    let expected = (DEFAULT_EPOCH_NS + 300_000_000).to_string();
    assert_eq!(gw.shared_data("sluice/test/last_tick_ns"), Some(expected.into_bytes()));
    assert_eq!(gw.now_ns(), DEFAULT_EPOCH_NS + 350_000_000);
}

#[test]
fn a_callout_reply_resumes_the_paused_request() {
    let gw = gateway();
    let mut s = gw.stream();
    let action = s.request_headers(&[(":path", "/"), ("x-callout", "1")], false).unwrap();
    assert_eq!(action, Action::Pause);
    assert!(s.request_paused());
    assert_eq!(s.upstream_request_headers(), None, "held while the callout is out");
    // Body arriving meanwhile is seen by the plugin but not let through.
    let calls = gw.http_calls();
    assert_eq!(calls.len(), 1);
    let call = &calls[0];
    assert_eq!(call.upstream, "auth");
    assert_eq!(call.body, b"who?");
    assert_eq!(call.headers.get(":path"), Some("/check"));
    assert_eq!(call.timeout, Some(ms(500)));
    assert_eq!(call.context_id, s.id());

    gw.respond_http_call(call.token, HttpReply::status(200).body("tenant=acme")).unwrap();
    assert!(!s.request_paused());
    let upstream = s.upstream_request_headers();
    assert_eq!(header(&upstream, "x-auth-result").as_deref(), Some("tenant=acme"));
    assert!(gw.http_calls().is_empty());
}

#[test]
fn a_callout_that_times_out_fails_at_its_deadline() {
    let gw = gateway();
    let mut s = gw.stream();
    s.request_headers(&[(":path", "/"), ("x-callout", "1")], true).unwrap();
    gw.advance(ms(499)).unwrap();
    assert_eq!(gw.http_calls().len(), 1);
    assert!(s.local_reply().is_none());
    gw.advance(ms(1)).unwrap();
    assert!(gw.http_calls().is_empty());
    let reply = s.local_reply().expect("the plugin denies when auth does not answer");
    assert_eq!(reply.status, 403);
    assert_eq!(reply.headers.get("x-denied-by"), Some("test-plugin"));
}

#[test]
fn a_local_reply_ends_the_stream_for_the_plugin() {
    let gw = gateway();
    let mut s = gw.stream();
    let action = s.request_headers(&[(":path", "/"), ("x-local-reply", "1")], false).unwrap();
    assert_eq!(action, Action::Pause);
    let reply = s.local_reply().expect("a local reply");
    assert_eq!(reply.status, 429);
    assert_eq!(reply.headers.get("retry-after"), Some("1"));
    assert!(String::from_utf8_lossy(&reply.body).contains("rate_limit"));
    assert_eq!(s.upstream_request_headers(), None, "nothing went upstream");

    // Whatever else happens on the wire, the plugin is not called for this stream any more…
    s.request_body(b"ignored", true).unwrap();
    s.response_headers(&[(":status", "200")], false).unwrap();
    s.response_body(b"ignored", true).unwrap();
    let downstream = s.downstream_response_headers();
    assert_eq!(header(&downstream, ":status").as_deref(), Some("429"));
    assert_eq!(header(&downstream, "x-elapsed-ms"), None);
    assert_eq!(s.downstream_body(), reply.body);
    assert_eq!(gw.histogram("test.ttfb_ms"), Some(vec![]));
    // …but its end of life is.
    s.end().unwrap();
    assert_eq!(gw.histogram("test.duration_ms"), Some(vec![0]));
    assert_eq!(gw.gauge("test.active"), Some(0));
}

#[test]
fn a_paused_body_is_buffered_and_rewritten_whole() {
    let gw = gateway();
    let mut s = gw.stream();
    s.request_headers(&[(":path", "/"), ("x-buffer-request", "1")], false).unwrap();
    assert_eq!(s.request_body(b"ab", false).unwrap(), Action::Pause);
    assert_eq!(s.upstream_request_body(), b"");
    assert_eq!(s.request_body(b"cd", true).unwrap(), Action::Continue);
    assert_eq!(s.upstream_request_body(), b"wrapped:abcd");
    assert_eq!(gw.histogram("test.request_body_bytes"), Some(vec![4]));
}

#[test]
fn two_streams_in_flight_keep_their_own_state() {
    let gw = gateway();
    let mut a = gw.stream();
    let mut b = gw.stream();
    a.request_headers(&CHAT, true).unwrap();
    gw.advance(ms(50)).unwrap();
    b.request_headers(&CHAT, true).unwrap();
    gw.advance(ms(30)).unwrap();
    b.response_headers(&[(":status", "200")], false).unwrap();
    gw.advance(ms(40)).unwrap();
    a.response_headers(&[(":status", "200")], false).unwrap();
    a.response_body(b"a1", false).unwrap();
    b.response_body(b"b1", true).unwrap();
    a.response_body(b"a2", true).unwrap();
    assert_eq!(header(&a.downstream_response_headers(), "x-elapsed-ms").as_deref(), Some("120"));
    assert_eq!(header(&b.downstream_response_headers(), "x-elapsed-ms").as_deref(), Some("30"));
    assert_eq!(a.downstream_body(), b"a1a2: sluice-test done\n\n");
    assert_eq!(b.downstream_body(), b"b1: sluice-test done\n\n");
    assert_eq!(gw.histogram("test.ttfb_ms"), Some(vec![120, 70]));
}

#[test]
fn gateways_on_different_threads_share_nothing() {
    let plugin = test_plugin();
    let handles: Vec<_> = (1..=4u64)
        .map(|n| {
            let plugin = plugin.clone();
            std::thread::spawn(move || {
                let gw = Gateway::start(&plugin, PluginSpec::new(CONFIG)).unwrap();
                for _ in 0..n {
                    let mut s = gw.stream();
                    s.request_headers(&[(":path", "/"), ("x-cas-conflict", "1")], true).unwrap();
                    gw.advance(ms(10 * n)).unwrap();
                    s.response_headers(&[(":status", "200")], false).unwrap();
                    s.response_body(b"x", true).unwrap();
                    s.end().unwrap();
                }
                (n, gw.counter("test.requests"), gw.shared_data("sluice/test/count"), gw.histogram("test.ttfb_ms"))
            })
        })
        .collect();
    for handle in handles {
        let (n, requests, count, ttfb) = handle.join().unwrap();
        assert_eq!(requests, Some(n));
        assert_eq!(count, Some(n.to_string().into_bytes()));
        assert_eq!(ttfb, Some(vec![10 * n; n as usize]));
    }
}

#[test]
fn a_trap_kills_the_vm_and_says_why() {
    let gw = gateway();
    let mut s = gw.stream();
    let error = s.request_headers(&[(":path", "/"), ("x-panic", "1")], true).unwrap_err();
    let text = format!("{error:#}");
    assert!(text.contains("proxy_on_request_headers"), "{text}");
    assert!(text.contains("asked to panic"), "the panic message is in the report: {text}");
    assert!(gw.crashed().is_some());
    let mut next = gw.stream();
    assert!(next.request_headers(&CHAT, true).is_err(), "a crashed VM takes no more calls");
}

#[test]
fn a_rejected_configuration_fails_the_load_with_the_plugin_logs() {
    let error = Gateway::start(&test_plugin(), PluginSpec::new(r#"{"fail": true}"#)).err().expect("refused");
    let text = format!("{error:#}");
    assert!(text.contains("proxy_on_configure returned false"), "{text}");
    assert!(text.contains("configuration asks me to fail"), "{text}");
}

#[test]
fn queue_items_wake_the_registering_context() {
    let gw = gateway();
    let mut s = gw.stream();
    s.request_headers(&[(":path", "/queued")], true).unwrap();
    assert_eq!(gw.counter("test.queue_items"), Some(1));
    gw.enqueue("test.queue", "from another worker").unwrap();
    assert_eq!(gw.counter("test.queue_items"), Some(2));
    assert_eq!(gw.queue_items("test.queue"), Some(vec![]));
    let logged: Vec<_> = gw.logs().into_iter().filter(|l| l.message.starts_with("dequeued")).collect();
    assert_eq!(logged[0].message, "dequeued /queued");
    assert_eq!(logged[0].context_id, 1, "delivered to the root context");
}

#[test]
fn grpc_replies_and_failures_reach_the_plugin() {
    let gw = gateway();
    let mut ok = gw.stream();
    assert_eq!(ok.request_headers(&[(":path", "/"), ("x-grpc", "1")], true).unwrap(), Action::Pause);
    let mut denied = gw.stream();
    denied.request_headers(&[(":path", "/"), ("x-grpc", "1")], true).unwrap();
    let calls = gw.grpc_calls();
    assert_eq!(calls.len(), 2);
    assert_eq!((calls[0].service.as_str(), calls[0].method.as_str()), ("svc.Auth", "Check"));
    assert_eq!(calls[0].messages, vec![b"req".to_vec()]);
    assert_eq!(calls[0].initial_metadata.get("x-md"), Some("1"));

    gw.grpc_reply(calls[0].token, "granted").unwrap();
    assert_eq!(header(&ok.upstream_request_headers(), "x-grpc-result").as_deref(), Some("granted"));
    gw.grpc_close(calls[1].token, 7, "no entry").unwrap();
    let reply = denied.local_reply().expect("503");
    assert_eq!((reply.status, reply.body.as_slice()), (503, &b"no entry"[..]));
    assert!(gw.grpc_calls().is_empty());
}

#[test]
fn the_plugin_sees_its_name_and_logs_are_kept_in_order() {
    let gw = Gateway::start(&test_plugin(), PluginSpec::new(CONFIG).name("tester").vm_configuration("vm-1")).unwrap();
    let info = gw.logs_at_least(LogLevel::Info);
    assert_eq!(info, ["vm config: vm-1", "configured plugin tester"]);
}

#[test]
fn an_upstream_reset_before_headers_reaches_the_plugin_as_a_503() {
    let gw = gateway();
    let mut s = gw.stream();
    s.request_headers(&CHAT, true).unwrap();
    gw.advance(ms(30)).unwrap();
    s.upstream_reset().unwrap();
    let downstream = s.downstream_response_headers();
    assert_eq!(header(&downstream, ":status").as_deref(), Some("503"));
    assert_eq!(header(&downstream, "x-elapsed-ms").as_deref(), Some("30"));
    assert_eq!(gw.histogram("test.duration_ms"), Some(vec![30]));
}

#[test]
fn events_after_the_end_are_errors() {
    let gw = gateway();
    let mut s = gw.stream();
    s.request_headers(&CHAT, true).unwrap();
    s.end().unwrap();
    s.end().unwrap(); // idempotent
    assert!(s.response_headers(&[(":status", "200")], true).is_err());
}

#[test]
fn a_gateway_can_move_to_another_thread_and_a_plugin_can_be_shared() {
    fn send<T: Send>() {}
    fn send_sync<T: Send + Sync>() {}
    send::<Gateway>();
    send_sync::<sluice_host::Plugin>();
}
