//! The fault matrix (issue 14, item 2) in real Envoy: the shipped budget gateway
//! (`envoy/templates/budget-gateway.yaml` — tenant-budget, llm-metrics, Envoy's gzip / br / zstd
//! decompressors, the buffer filter, the router) with the built `.wasm`, the mock over real sockets.
//! Every cell sends its requests under a budget key of its own (`f01` …; also the llm-metrics
//! tenant), so its counters are its own series, and checks the accounting three ways: the two
//! access-log stamps (llm-metrics' `sluice`, tenant-budget's `budget`), the mock's ledger of what it
//! sent, and the counters in `/stats/prometheus`. The table of cells, what each expects and why is
//! docs/faults.md. Cells that can run side by side share one gateway; the ones that measure Envoy
//! itself (memory, flow control) get their own. Skipped when Envoy is not installed (unless
//! `SLUICE_ENVOY`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use serde_json::{json, Value};
use sluice_e2e::faults::{self, chat, contains, head, key, messages, FaultGateway, Observed};
use sluice_e2e::{post_stream, Checks, MockServer, Tools};
use std::time::{Duration, Instant};

const CHAT: &str = "/v1/chat/completions";
const MESSAGES: &str = "/v1/messages";

fn envoy_available() -> bool {
    Tools::locate_or_skip().unwrap().is_some()
}

/// The request headers of cell key `k` and request `id`, plus `extra`.
fn hdrs<'a>(k: &'a str, id: &'a str, extra: &[(&'a str, &'a str)]) -> Vec<(&'a str, &'a str)> {
    let mut h = vec![("x-sluice-key", k), ("x-request-id", id)];
    h.extend_from_slice(extra);
    h
}

/// Exact accounting: usage reported and equal to what the mock reported, llm-metrics and
/// tenant-budget agreeing, the money `input + 4 × output` micro-USD in both.
fn exact(c: &mut Checks, o: &Observed, what: &str) {
    let Some(m) = &o.mock else {
        c.that(false, format!("{what}: no mock record"));
        return;
    };
    c.eq(&format!("{what}: llm.usage"), &o.llm["usage"], json!("reported"));
    c.eq(&format!("{what}: budget.usage"), &o.budget["usage"], json!("reported"));
    c.eq(&format!("{what}: llm.input_tokens = mock prompt"), &o.llm["input_tokens"], json!(m.prompt_tokens));
    c.eq(&format!("{what}: llm.output_tokens = mock completion"), &o.llm["output_tokens"], json!(m.completion_tokens));
    agree(c, o, what);
}

/// tenant-budget charged what llm-metrics counted; money at the test price.
fn agree(c: &mut Checks, o: &Observed, what: &str) {
    let (input, output) = (o.u(&o.llm, "input_tokens"), o.u(&o.llm, "output_tokens"));
    c.eq(&format!("{what}: budget.input_tokens = llm"), &o.budget["input_tokens"], json!(input));
    c.eq(&format!("{what}: budget.output_tokens = llm"), &o.budget["output_tokens"], json!(output));
    c.eq(&format!("{what}: budget.charged_tokens"), &o.budget["charged_tokens"], json!(input.saturating_add(output)));
    let money = input.saturating_add(output.saturating_mul(4));
    c.eq(&format!("{what}: budget.charged_micro_usd"), &o.budget["charged_micro_usd"], json!(money));
    c.eq(&format!("{what}: llm.cost_micro_usd"), &o.llm["cost_micro_usd"], json!(money));
}

/// The cell's counters: requests, output tokens counted, tokens charged — summed over its key.
fn counters(c: &mut Checks, gw: &FaultGateway, k: &str, requests: u64, output: u64, charged: u64) {
    let t = [("tenant", k)];
    c.eq(&format!("{k}: sluice_requests_total"), &json!(gw.counter("sluice_requests_total", &t) as u64), json!(requests));
    c.eq(&format!("{k}: sluice_output_tokens_total"), &json!(gw.counter("sluice_output_tokens_total", &t) as u64), json!(output));
    c.eq(&format!("{k}: sluice_budget_charged_tokens_total"), &json!(gw.counter("sluice_budget_charged_tokens_total", &[("key", k)]) as u64), json!(charged));
}

fn outcome(c: &mut Checks, o: &Observed, what: &str, status: u64, outcome: &str) {
    c.eq(&format!("{what}: llm.status"), &o.llm["status"], json!(status));
    c.eq(&format!("{what}: llm.outcome"), &o.llm["outcome"], json!(outcome));
    c.eq(&format!("{what}: budget.status"), &o.budget["status"], json!(status));
    c.eq(&format!("{what}: budget.outcome"), &o.budget["outcome"], json!(outcome));
}

/// Reports every failed check, after one more: Envoy logged no plugin panic, no critical line and
/// no plugin error (the plugins log at warn and above to Envoy's stderr).
fn finish(mut c: Checks, gw: &FaultGateway, o: &[&Observed]) {
    let log = gw.envoy.stderr_tail(10_000);
    let bad: Vec<&str> = log.lines().filter(|l| l.contains("panic") || l.contains("[critical]") || (l.contains("[error]") && l.contains("wasm"))).collect();
    c.that(bad.is_empty(), format!("Envoy logged {} panic/critical/error line(s): {bad:?}", bad.len()));
    c.done(&context(gw, o));
}

fn context(gw: &FaultGateway, o: &[&Observed]) -> String {
    let lines: Vec<String> = o.iter().map(|o| format!("{} | mock {:?}", o.line, o.mock)).collect();
    format!("observed:\n{}\nEnvoy stderr:\n{}", lines.join("\n"), gw.envoy.stderr_tail(20))
}

// --- encodings ------------------------------------------------------------------------------------

#[test]
fn gzip_br_and_zstd_answers_are_decoded_in_front_of_the_plugins_and_measured_exactly() {
    if !envoy_available() {
        return;
    }
    let gw = FaultGateway::shared().unwrap();
    let mut c = Checks::default();
    let mut seen = Vec::new();
    for (n, encoding) in [(1, "gzip"), (2, "br"), (3, "zstd")] {
        let k = key(n);
        for stream in [true, false] {
            let id = format!("enc-{encoding}-{stream}");
            let h = hdrs(&k, &id, &[("x-mock-encoding", encoding), ("x-mock-tokens", "7")]);
            let resp = post_stream(gw.envoy.listen_addr(), CHAT, &h, &chat(stream, 7)).unwrap().collect().unwrap();
            c.eq(&format!("{id}: status"), &json!(resp.status), json!(200));
            // The client gets the answer decoded: no content-encoding, the text readable.
            c.eq(&format!("{id}: content-encoding to the client"), &json!(resp.header("content-encoding")), Value::Null);
            c.that(resp.text().contains("tok6 "), format!("{id}: the client's body is decoded: {:?}", resp.text()));
            let o = gw.observe(&id, true).unwrap();
            exact(&mut c, &o, &id);
            outcome(&mut c, &o, &id, 200, "completed");
            c.eq(&format!("{id}: llm.stream"), &o.llm["stream"], json!(stream));
            seen.push(o);
        }
        counters(&mut c, &gw, &k, 2, 14, 2 * 7 + 2 * seen.last().map_or(0, |o| o.u(&o.llm, "input_tokens")));
    }
    finish(c, &gw, &seen.iter().collect::<Vec<_>>());
}

/// The control: the same gateway without its decompressors. The plugins alone cannot read an
/// encoded body — llm-metrics counts no output and marks usage `estimated`, tenant-budget charges
/// the prompt estimate only: what docs/configuration.md states, and why the shipped gateways decode
/// in front of them.
#[test]
fn without_the_decompressors_an_encoded_answer_is_counted_as_no_output() {
    if !envoy_available() {
        return;
    }
    let gw = FaultGateway::start_with(faults::without_decompressors, None, MockServer::start(&[]).unwrap()).unwrap();
    assert!(!std::fs::read_to_string(gw.envoy.config_path()).unwrap().contains("decompressor"), "the control still decodes");
    let k = key(20);
    let mut c = Checks::default();
    let mut seen = Vec::new();
    for stream in [true, false] {
        let id = format!("raw-gzip-{stream}");
        let resp = post_stream(gw.envoy.listen_addr(), CHAT, &hdrs(&k, &id, &[("x-mock-encoding", "gzip"), ("x-mock-tokens", "7")]), &chat(stream, 7))
            .unwrap()
            .collect()
            .unwrap();
        c.eq(&format!("{id}: content-encoding to the client"), &json!(resp.header("content-encoding")), json!("gzip"));
        let o = gw.observe(&id, true).unwrap();
        c.eq(&format!("{id}: llm.usage"), &o.llm["usage"], json!("estimated"));
        c.eq(&format!("{id}: llm.output_tokens"), &o.llm["output_tokens"], json!(0));
        c.eq(&format!("{id}: budget.output_tokens"), &o.budget["output_tokens"], json!(0));
        c.eq(&format!("{id}: budget.input_tokens = llm"), &o.budget["input_tokens"], o.llm["input_tokens"].clone());
        c.eq(&format!("{id}: mock completion"), &json!(o.mock.as_ref().map(|m| m.completion_tokens)), json!(7));
        seen.push(o);
    }
    finish(c, &gw, &seen.iter().collect::<Vec<_>>());
}

// --- HTTP/2 ---------------------------------------------------------------------------------------

#[test]
fn http2_clients_multiplexed_on_one_connection_are_measured_exactly() {
    if !envoy_available() {
        return;
    }
    let Some(curl) = faults::curl() else {
        eprintln!("skipped: curl is not installed");
        return;
    };
    let gw = FaultGateway::shared().unwrap();
    let k = key(4);
    let ids: Vec<String> = (0..4).map(|i| format!("h2-client-{i}")).collect();
    let (stream_body, whole_body) = (chat(true, 9), chat(false, 9));
    // Two streams and two whole answers on one connection, all completing; then a stream curl
    // gives up after 1 s of its 4 s (an RST_STREAM) between two that complete.
    let slow_body = chat(true, 20);
    let requests: Vec<faults::H2Request> = ids
        .iter()
        .take(4)
        .enumerate()
        .map(|(i, id)| faults::H2Request { id, body: if i % 2 == 0 { &stream_body } else { &whole_body }, max_time: None })
        .collect();
    let url = format!("http://{}{CHAT}", gw.envoy.listen_addr());
    let dir = tempdir("h2-client");
    let out = faults::curl_h2_parallel(&curl, &url, &[("x-sluice-key", &k), ("x-mock-tokens", "9"), ("x-mock-itl-ms", "20")], &requests, &dir).unwrap();
    let mut c = Checks::default();
    let mut seen = Vec::new();
    for (r, (body, version)) in requests.iter().zip(&out) {
        let id = r.id;
        c.eq(&format!("{id}: curl's HTTP version"), &json!(version), json!("2"));
        c.that(body.contains("tok8 "), format!("{id}: body {body:?}"));
        let o = gw.observe(id, true).unwrap();
        exact(&mut c, &o, id);
        outcome(&mut c, &o, id, 200, "completed");
        seen.push(o);
    }
    // The reset, with two complete streams beside it on the same connection.
    let with_reset = [
        faults::H2Request { id: "h2-client-beside-0", body: &stream_body, max_time: None },
        faults::H2Request { id: "h2-client-reset", body: &slow_body, max_time: Some("1") },
        faults::H2Request { id: "h2-client-beside-1", body: &stream_body, max_time: None },
    ];
    let out = faults::curl_h2_parallel(&curl, &url, &[("x-sluice-key", &k), ("x-mock-tokens", "20"), ("x-mock-itl-ms", "200")], &with_reset, &dir).unwrap();
    for (r, (body, _)) in with_reset.iter().zip(&out) {
        let o = gw.observe(r.id, true).unwrap();
        if r.max_time.is_some() {
            outcome(&mut c, &o, r.id, 200, "client_disconnect");
            agree(&mut c, &o, r.id);
            let (counted, flushed) = (o.u(&o.llm, "output_tokens"), o.mock.as_ref().map_or(0, |m| m.tokens_flushed));
            let client = body.matches("\"content\":\"tok").count() as u64;
            c.that(
                client <= counted && counted <= flushed && flushed < 20,
                format!("{}: client got {client}, counted {counted}, mock flushed {flushed} of 20", r.id),
            );
        } else {
            exact(&mut c, &o, r.id);
            outcome(&mut c, &o, r.id, 200, "completed");
        }
        seen.push(o);
    }
    let (output, charged) = seen.iter().fold((0, 0), |(o, ch), s| (o + s.u(&s.llm, "output_tokens"), ch + s.u(&s.budget, "charged_tokens")));
    counters(&mut c, &gw, &k, 7, output, charged);
    c.eq("client disconnects", &json!(gw.counter("sluice_client_disconnects_total", &[("tenant", k.as_str())])), json!(1.0));
    // One connection carried the four streams.
    let h2 = gw.counter("envoy_http_downstream_cx_http2_total", &[("envoy_http_conn_manager_prefix", "gateway")]);
    c.that(h2 >= 1.0, format!("downstream HTTP/2 connections: {h2}"));
    let _ = std::fs::remove_dir_all(&dir);
    finish(c, &gw, &seen.iter().collect::<Vec<_>>());
}

fn tempdir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("sluice-faults-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn an_http2_upstream_is_measured_exactly() {
    if !envoy_available() {
        return;
    }
    // The mock speaks HTTP/1.1 only: a plugin-less Envoy in between takes the gateway's HTTP/2.
    let mock = MockServer::start(&[]).unwrap();
    let bridge = faults::start_h2_bridge(mock.port()).unwrap();
    let gw = FaultGateway::start_with(faults::with_h2_cluster, Some(bridge.listen_port()), mock).unwrap();
    let k = key(5);
    let mut c = Checks::default();
    let mut seen = Vec::new();
    // The bridge passes the mock's trailers on: over HTTP/2 they reach the plugins and end the
    // response there (the body sees no end_of_stream).
    for (id, path, body, trailers) in [
        ("h2-up-chat", CHAT, chat(true, 11), "0"),
        ("h2-up-whole", CHAT, chat(false, 11), "0"),
        ("h2-up-messages", MESSAGES, messages(true, 11), "0"),
        ("h2-up-trailers", CHAT, chat(true, 11), "1"),
        ("h2-up-trailers-messages", MESSAGES, messages(true, 11), "1"),
    ] {
        let resp = post_stream(gw.envoy.listen_addr(), path, &hdrs(&k, id, &[("x-mock-tokens", "11"), ("x-mock-trailers", trailers)]), &body)
            .unwrap()
            .collect()
            .unwrap();
        c.eq(&format!("{id}: status"), &json!(resp.status), json!(200));
        let o = gw.observe(id, true).unwrap();
        exact(&mut c, &o, id);
        outcome(&mut c, &o, id, 200, "completed");
        seen.push(o);
    }
    // The gateway's upstream connection was HTTP/2 (the bridge counts what it accepted).
    let h2 = bridge.metrics().unwrap().value("envoy_http_downstream_cx_http2_total", &[]).unwrap_or(0.0);
    c.that(h2 >= 1.0, format!("the bridge accepted no HTTP/2 connection ({h2})"));
    let up_h2 = gw.counter("envoy_cluster_upstream_cx_http2_total", &[("envoy_cluster_name", "model_server")]);
    c.that(up_h2 >= 1.0, format!("the gateway opened no HTTP/2 upstream connection ({up_h2})"));
    finish(c, &gw, &seen.iter().collect::<Vec<_>>());
}

/// A request of a cell: id, path, body, extra headers.
type Case<'a> = (&'a str, &'a str, String, Vec<(&'a str, &'a str)>);

// --- the upstream's framing -----------------------------------------------------------------------

#[test]
fn an_upstream_100_continue_trailers_and_a_bom_change_no_count() {
    if !envoy_available() {
        return;
    }
    let gw = FaultGateway::shared().unwrap();
    let k = key(6);
    let mut c = Checks::default();
    let mut seen = Vec::new();
    let cases: [Case; 5] = [
        ("continue-1", CHAT, chat(true, 5), vec![("x-mock-100-continue", "1"), ("expect", "100-continue")]),
        ("trailers-1", CHAT, chat(true, 5), vec![("x-mock-trailers", "1")]),
        ("trailers-messages", MESSAGES, messages(true, 5), vec![("x-mock-trailers", "1")]),
        // A BOM before message_start, which carries Anthropic's input tokens.
        ("bom-messages", MESSAGES, messages(true, 5), vec![("x-mock-bom", "1")]),
        ("bom-chat", CHAT, chat(true, 5), vec![("x-mock-bom", "1")]),
    ];
    for (id, path, body, extra) in &cases {
        let mut extra = extra.clone();
        extra.push(("x-mock-tokens", "5"));
        let resp = post_stream(gw.envoy.listen_addr(), path, &hdrs(&k, id, &extra), body).unwrap().collect().unwrap();
        c.eq(&format!("{id}: status"), &json!(resp.status), json!(200));
        c.that(resp.complete, format!("{id}: the client's body did not end"));
        let o = gw.observe(id, true).unwrap();
        exact(&mut c, &o, id);
        outcome(&mut c, &o, id, 200, "completed");
        c.eq(&format!("{id}: content events"), &o.llm["content_chunks"], json!(5));
        seen.push(o);
    }
    let charged: u64 = seen.iter().map(|o| o.u(&o.llm, "input_tokens") + 5).sum();
    counters(&mut c, &gw, &k, 5, 25, charged);
    finish(c, &gw, &seen.iter().collect::<Vec<_>>());
}

#[test]
fn a_stream_without_content_type() {
    if !envoy_available() {
        return;
    }
    let gw = FaultGateway::shared().unwrap();
    let k = key(7);
    let mut c = Checks::default();
    let id = "no-content-type";
    let resp = post_stream(gw.envoy.listen_addr(), CHAT, &hdrs(&k, id, &[("x-mock-content-type", "none"), ("x-mock-tokens", "6")]), &chat(true, 6))
        .unwrap()
        .collect()
        .unwrap();
    c.eq("status", &json!(resp.status), json!(200));
    c.that(resp.text().contains("data: [DONE]"), format!("body: {}", resp.text()));
    let o = gw.observe(id, true).unwrap();
    exact(&mut c, &o, id);
    outcome(&mut c, &o, id, 200, "completed");
    // Without content-type it is no stream to the plugins: a whole answer, no TTFT — its body is
    // still read as the SSE it is, so the usage counts.
    c.eq("llm.stream", &o.llm["stream"], json!(false));
    c.eq("llm.ttft_us", &o.llm["ttft_us"], Value::Null);
    finish(c, &gw, &[&o]);
}

#[test]
fn a_10_mib_single_event_passes_whole_and_usage_still_counts() {
    if !envoy_available() {
        return;
    }
    let gw = FaultGateway::shared().unwrap();
    let k = key(8);
    let mut c = Checks::default();
    let id = "event-10mib";
    let size = 10 * 1024 * 1024;
    let resp = post_stream(gw.envoy.listen_addr(), CHAT, &hdrs(&k, id, &[("x-mock-token-bytes", &size.to_string()), ("x-mock-tokens", "1")]), &chat(true, 1))
        .unwrap()
        .collect()
        .unwrap();
    c.eq("status", &json!(resp.status), json!(200));
    // The client gets the event byte for byte.
    let events = resp.events();
    let big = events
        .iter()
        .filter_map(|e| e.json())
        .find_map(|v| v.pointer("/choices/0/delta/content").and_then(Value::as_str).filter(|t| t.starts_with("tok0")).map(str::len));
    c.eq("the client's event content bytes", &json!(big), json!(size));
    let o = gw.observe(id, true).unwrap();
    exact(&mut c, &o, id);
    outcome(&mut c, &o, id, 200, "completed");
    // Past the framer's 256 KiB cap the event is not inspected: no content event, no first token.
    c.eq("content events", &o.llm["content_chunks"], json!(0));
    c.eq("ttft_us", &o.llm["ttft_us"], Value::Null);
    finish(c, &gw, &[&o]);
}

#[test]
fn a_200000_token_stream_keeps_envoy_memory_flat() {
    if !envoy_available() {
        return;
    }
    let gw = FaultGateway::start().unwrap();
    let k = key(9);
    let mut c = Checks::default();
    // One short stream first, so that every per-series allocation exists before the baseline.
    let warm = post_stream(gw.envoy.listen_addr(), CHAT, &hdrs(&k, "long-warm", &[("x-mock-tokens", "50")]), &chat(true, 50)).unwrap().collect().unwrap();
    assert_eq!(warm.status, 200);
    gw.observe("long-warm", true).unwrap();
    let before = gw.stat("server.memory_allocated").unwrap();
    let id = "long-200k";
    let tokens = 200_000u64;
    let mut s = post_stream(gw.envoy.listen_addr(), CHAT, &hdrs(&k, id, &[("x-mock-tokens", "200000")]), &chat(true, tokens)).unwrap();
    let (mut bytes, mut peak, mut polled) = (0usize, before, Instant::now());
    while let Some(chunk) = s.next_chunk().unwrap() {
        bytes += chunk.data.len();
        if polled.elapsed() > Duration::from_millis(250) {
            peak = peak.max(gw.stat("server.memory_allocated").unwrap());
            polled = Instant::now();
        }
    }
    c.that(s.is_complete(), "the 200,000-token stream did not end".into());
    let o = gw.observe(id, true).unwrap();
    exact(&mut c, &o, id);
    outcome(&mut c, &o, id, 200, "completed");
    c.eq("content events", &o.llm["content_chunks"], json!(tokens));
    let after = gw.stat("server.memory_allocated").unwrap();
    // Flat: the stream is ≈ 50 MB; Envoy holds at most a few buffers of it at a time.
    let bound = 16 * 1024 * 1024;
    c.that(
        peak.saturating_sub(before) < bound,
        format!("memory grew by {} bytes during the stream (before {before}, peak {peak})", peak.saturating_sub(before)),
    );
    c.that(
        after.saturating_sub(before) < bound,
        format!("memory grew by {} bytes after the stream (before {before}, after {after})", after.saturating_sub(before)),
    );
    eprintln!("200,000 tokens, {bytes} bytes: server.memory_allocated before {before}, peak {peak}, after {after}");
    finish(c, &gw, &[&o]);
}

// --- slow and stalled clients ---------------------------------------------------------------------

#[test]
fn a_slow_reader_is_held_back_by_flow_control_and_measured_exactly() {
    if !envoy_available() {
        return;
    }
    let gw = FaultGateway::start().unwrap();
    let k = key(10);
    let id = "slow-reader";
    let (tokens, bytes) = (400u64, 16 * 1024);
    let body = chat(true, tokens);
    let h = hdrs(&k, id, &[("x-mock-tokens", "400"), ("x-mock-token-bytes", "16384")]);
    let raw = format!("{}{body}", head(gw.envoy.listen_addr(), CHAT, &h, body.len()));
    let seen = faults::read_paced(gw.envoy.listen_addr(), raw.as_bytes(), 16 * 1024, Duration::from_millis(2), |_| false).unwrap();
    let mut c = Checks::default();
    c.that(seen.len() > tokens as usize * bytes, format!("read {} bytes", seen.len()));
    c.that(contains(&seen, "data: [DONE]"), "the slow reader got no [DONE]".into());
    let o = gw.observe(id, true).unwrap();
    exact(&mut c, &o, id);
    outcome(&mut c, &o, id, 200, "completed");
    // Backpressure reached the upstream: Envoy stopped reading from the mock at least once.
    let paused = gw.stat("cluster.model_server.upstream_flow_control_paused_reading_total").unwrap();
    c.that(paused >= 1, format!("upstream_flow_control_paused_reading_total = {paused}"));
    finish(c, &gw, &[&o]);
}

#[test]
fn a_stalled_reader_holds_the_upstream_back_and_is_charged_what_passed() {
    if !envoy_available() {
        return;
    }
    let gw = FaultGateway::start().unwrap();
    let k = key(11);
    let id = "stalled-reader";
    let tokens = 2000u64;
    let body = chat(true, tokens);
    let h = hdrs(&k, id, &[("x-mock-tokens", "2000"), ("x-mock-token-bytes", "16384")]);
    let before = gw.stat("server.memory_allocated").unwrap();
    let mut s = std::net::TcpStream::connect(gw.envoy.listen_addr()).unwrap();
    use std::io::{Read, Write};
    s.write_all(format!("{}{body}", head(gw.envoy.listen_addr(), CHAT, &h, body.len())).as_bytes()).unwrap();
    let mut first = vec![0; 64 * 1024];
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let got = s.read(&mut first).unwrap();
    let mut c = Checks::default();
    c.that(got > 0, "nothing arrived before the stall".into());
    // The stall: the client reads nothing more. Envoy must stop reading from the mock, and hold
    // only its buffers, not the 32 MB stream.
    let paused = faults::poll_stat(&gw, "cluster.model_server.upstream_flow_control_paused_reading_total", Duration::from_secs(10), |v| v >= 1).unwrap();
    c.that(paused >= 1, format!("upstream_flow_control_paused_reading_total = {paused}"));
    std::thread::sleep(Duration::from_secs(1));
    let during = gw.stat("server.memory_allocated").unwrap();
    let unfinished = !gw.mock.requests().unwrap().iter().any(|r| r.request_id == id);
    c.that(unfinished, "the mock finished the stream while the client stalled".into());
    c.that(during.saturating_sub(before) < 16 * 1024 * 1024, format!("memory grew by {} bytes during the stall", during.saturating_sub(before)));
    drop(s);
    let o = gw.observe(id, true).unwrap();
    outcome(&mut c, &o, id, 200, "client_disconnect");
    agree(&mut c, &o, id);
    // Without usage, each content event counts max(1, ⌊chars / 4⌋) tokens: 4,096 for the mock's
    // 16 KiB token texts. The events counted are between none and what the mock flushed.
    let out = o.u(&o.llm, "output_tokens");
    let flushed = o.mock.as_ref().map_or(0, |m| m.tokens_flushed);
    c.that(
        out.is_multiple_of(4096) && out > 0 && out / 4096 <= flushed && flushed < tokens,
        format!("counted {out} (= {} events) of {flushed} flushed (of {tokens})", out / 4096),
    );
    c.eq("llm.usage", &o.llm["usage"], json!("estimated"));
    c.eq("mock failure", &json!(o.mock.as_ref().and_then(|m| m.failure.clone())), json!("client_gone"));
    c.eq("client disconnects", &json!(gw.counter("sluice_client_disconnects_total", &[("tenant", k.as_str())])), json!(1.0));
    eprintln!("stalled reader: {out} tokens counted, {flushed} flushed by the mock; memory before {before}, during {during}");
    finish(c, &gw, &[&o]);
}

// --- client resets --------------------------------------------------------------------------------

#[test]
fn a_client_gone_during_its_request_headers_leaves_no_trace() {
    if !envoy_available() {
        return;
    }
    let gw = FaultGateway::shared().unwrap();
    let k = key(12);
    let id = "client-cut-head";
    let full = head(gw.envoy.listen_addr(), CHAT, &hdrs(&k, id, &[]), 100);
    faults::send_and_close(gw.envoy.listen_addr(), &full.as_bytes()[..full.len() - 10]).unwrap();
    // A later request on the same key is there: the log is written in order, and this one is not.
    let probe = "client-cut-head-probe";
    let resp = post_stream(gw.envoy.listen_addr(), CHAT, &hdrs(&k, probe, &[("x-mock-tokens", "2")]), &chat(true, 2)).unwrap().collect().unwrap();
    assert_eq!(resp.status, 200);
    let probe_seen = gw.observe(probe, true).unwrap();
    let mut c = Checks::default();
    let logged = gw.envoy.access_log().entries().unwrap().iter().any(|e| e["request_id"] == id);
    c.that(!logged, "an access-log line for a request whose headers never completed".into());
    c.that(!gw.mock.heads().unwrap().iter().any(|h| h.request_id.as_deref() == Some(id)), "its head reached the upstream".into());
    counters(&mut c, &gw, &k, 1, 2, probe_seen.u(&probe_seen.budget, "charged_tokens"));
    finish(c, &gw, &[&probe_seen]);
}

#[test]
fn a_client_gone_mid_request_body_reaches_no_upstream_and_is_charged_nothing() {
    if !envoy_available() {
        return;
    }
    let gw = FaultGateway::shared().unwrap();
    let k = key(13);
    let id = "client-cut-body";
    let body = chat(true, 5);
    let raw = format!("{}{}", head(gw.envoy.listen_addr(), CHAT, &hdrs(&k, id, &[]), body.len()), &body[..body.len() / 2]);
    faults::send_and_close(gw.envoy.listen_addr(), raw.as_bytes()).unwrap();
    let o = gw.observe(id, false).unwrap();
    let mut c = Checks::default();
    c.eq("llm.outcome", &o.llm["outcome"], json!("client_disconnect"));
    c.eq("llm.status", &o.llm["status"], json!(0));
    c.eq("llm.output_tokens", &o.llm["output_tokens"], json!(0));
    c.eq("llm.input_tokens", &o.llm["input_tokens"], json!(0));
    // Nothing admitted, nothing reserved: tenant-budget has no charge to stamp.
    c.eq("budget stamp", &o.budget, Value::Null);
    c.that(!gw.mock.heads().unwrap().iter().any(|h| h.request_id.as_deref() == Some(id)), "its head reached the upstream".into());
    counters(&mut c, &gw, &k, 1, 0, 0);
    c.eq("client disconnects", &json!(gw.counter("sluice_client_disconnects_total", &[("tenant", k.as_str())])), json!(1.0));
    finish(c, &gw, &[&o]);
}

/// A client that reads its stream until `stop` holds, then closes; the cell's expectations for an
/// interrupted stream: outcome client_disconnect, the budget charging what llm-metrics counted,
/// which is between what the client saw and what the mock flushed.
/// `per_event` is what one content event counts without usage (max(1, ⌊chars / 4⌋)); `min_events`
/// the events the client had whole when it left.
#[allow(clippy::too_many_arguments)]
fn client_cut(
    gw: &FaultGateway,
    c: &mut Checks,
    k: &str,
    id: &str,
    extra: &[(&str, &str)],
    tokens: u64,
    per_event: u64,
    min_events: u64,
    stop: impl FnMut(&[u8]) -> bool,
) -> Observed {
    let body = chat(true, tokens);
    let raw = format!("{}{body}", head(gw.envoy.listen_addr(), CHAT, &hdrs(k, id, extra), body.len()));
    faults::read_paced(gw.envoy.listen_addr(), raw.as_bytes(), 4096, Duration::ZERO, stop).unwrap();
    let o = gw.observe(id, true).unwrap();
    outcome(c, &o, id, 200, "client_disconnect");
    agree(c, &o, id);
    let out = o.u(&o.llm, "output_tokens");
    let flushed = o.mock.as_ref().map_or(0, |m| m.tokens_flushed);
    let events = out / per_event;
    c.that(
        out.is_multiple_of(per_event) && min_events <= events && events <= flushed && flushed < tokens,
        format!("{id}: counted {out} ({events} events), client saw ≥ {min_events}, mock flushed {flushed} of {tokens}"),
    );
    c.eq(&format!("{id}: llm.usage"), &o.llm["usage"], json!("estimated"));
    c.eq(&format!("{id}: mock failure"), &json!(o.mock.as_ref().and_then(|m| m.failure.clone())), json!("client_gone"));
    o
}

#[test]
fn a_client_gone_after_the_response_head_between_events_or_inside_one_is_charged_what_passed() {
    if !envoy_available() {
        return;
    }
    let gw = FaultGateway::shared().unwrap();
    let mut c = Checks::default();
    // After the head: the first token is 400 ms away when the client leaves.
    let (k1, k2, k3) = (key(14), key(15), key(16));
    let a = client_cut(&gw, &mut c, &k1, "client-cut-after-head", &[("x-mock-ttft-ms", "400"), ("x-mock-tokens", "20")], 20, 1, 0, |b| contains(b, "\r\n\r\n"));
    // Between events: after tok4, with 50 ms between tokens.
    // (At the first read that ends on an event's end once tok4 has come: a read may end mid-event.)
    let mut tok4 = false;
    let b = client_cut(&gw, &mut c, &k2, "client-cut-between", &[("x-mock-itl-ms", "50"), ("x-mock-tokens", "20")], 20, 1, 5, |b| {
        tok4 |= contains(b, "tok4 ");
        tok4 && b.ends_with(b"\n\n\r\n")
    });
    // Inside an event: tok2's 64 KiB event has begun to arrive (below the framer's 256 KiB cap,
    // so each event is inspected: 16,384 estimated tokens each).
    let ci = client_cut(
        &gw,
        &mut c,
        &k3,
        "client-cut-inside",
        &[("x-mock-itl-ms", "200"), ("x-mock-tokens", "10"), ("x-mock-token-bytes", "65536")],
        10,
        16_384,
        2,
        |b| contains(b, "\"content\":\"tok2 "),
    );
    for (k, o) in [(&k1, &a), (&k2, &b), (&k3, &ci)] {
        counters(&mut c, &gw, k, 1, o.u(&o.llm, "output_tokens"), o.u(&o.budget, "charged_tokens"));
        c.eq(&format!("{k}: client disconnects"), &json!(gw.counter("sluice_client_disconnects_total", &[("tenant", k.as_str())])), json!(1.0));
    }
    finish(c, &gw, &[&a, &b, &ci]);
}

// --- upstream resets ------------------------------------------------------------------------------

#[test]
fn an_upstream_gone_before_answering_is_a_503_charged_nothing() {
    if !envoy_available() {
        return;
    }
    let gw = FaultGateway::shared().unwrap();
    let k = key(17);
    let mut c = Checks::default();
    let mut seen = Vec::new();
    for (id, fail) in [("up-cut-head", "reset-on-head"), ("up-cut-body", "reset-in-body")] {
        let resp = post_stream(gw.envoy.listen_addr(), CHAT, &hdrs(&k, id, &[("x-mock-fail", fail)]), &chat(true, 5)).unwrap().collect().unwrap();
        c.eq(&format!("{id}: status"), &json!(resp.status), json!(503));
        let o = gw.observe(id, true).unwrap();
        outcome(&mut c, &o, id, 503, "upstream_error");
        c.eq(&format!("{id}: llm tokens"), &json!([o.llm["input_tokens"].clone(), o.llm["output_tokens"].clone()]), json!([0, 0]));
        c.eq(&format!("{id}: budget charged"), &json!([o.budget["charged_tokens"].clone(), o.budget["charged_micro_usd"].clone()]), json!([0, 0]));
        c.eq(&format!("{id}: mock failure"), &json!(o.mock.as_ref().and_then(|m| m.failure.clone())), json!("reset"));
        seen.push(o);
    }
    counters(&mut c, &gw, &k, 2, 0, 0);
    c.eq("upstream errors", &json!(gw.counter("sluice_upstream_errors_total", &[("tenant", k.as_str())])), json!(2.0));
    finish(c, &gw, &seen.iter().collect::<Vec<_>>());
}

#[test]
fn an_upstream_reset_after_the_head_between_events_or_inside_one_is_charged_what_passed() {
    if !envoy_available() {
        return;
    }
    let gw = FaultGateway::shared().unwrap();
    let k = key(18);
    let mut c = Checks::default();
    let mut seen = Vec::new();
    for (id, fail, counted) in
        [("up-reset-after-head", "reset-after:0", 0u64), ("up-reset-between", "reset-after:3", 3), ("up-reset-inside", "reset-inside:3", 3)]
    {
        let resp = post_stream(gw.envoy.listen_addr(), CHAT, &hdrs(&k, id, &[("x-mock-fail", fail), ("x-mock-tokens", "8")]), &chat(true, 8))
            .unwrap()
            .collect()
            .unwrap();
        c.eq(&format!("{id}: status"), &json!(resp.status), json!(200));
        c.that(!resp.complete, format!("{id}: the client's stream ended cleanly after an upstream reset"));
        let o = gw.observe(id, true).unwrap();
        outcome(&mut c, &o, id, 200, "upstream_error");
        agree(&mut c, &o, id);
        c.eq(&format!("{id}: llm.output_tokens"), &o.llm["output_tokens"], json!(counted));
        c.eq(&format!("{id}: llm.usage"), &o.llm["usage"], json!("estimated"));
        c.eq(&format!("{id}: mock flushed"), &json!(o.mock.as_ref().map(|m| m.tokens_flushed)), json!(counted));
        seen.push(o);
    }
    let charged: u64 = seen.iter().map(|o| o.u(&o.budget, "charged_tokens")).sum();
    counters(&mut c, &gw, &k, 3, 6, charged);
    c.eq("upstream errors", &json!(gw.counter("sluice_upstream_errors_total", &[("tenant", k.as_str())])), json!(3.0));
    finish(c, &gw, &seen.iter().collect::<Vec<_>>());
}

#[test]
fn an_upstream_ending_without_done_or_message_stop_is_measured_from_its_usage() {
    if !envoy_available() {
        return;
    }
    let gw = FaultGateway::shared().unwrap();
    let k = key(19);
    let mut c = Checks::default();
    let mut seen = Vec::new();
    for (id, path, body, fail, end) in [
        ("no-done", CHAT, chat(true, 6), "no-terminal", "completed"),
        ("no-done-reset", CHAT, chat(true, 6), "reset-before-terminal", "upstream_error"),
        ("no-message-stop", MESSAGES, messages(true, 6), "no-terminal", "completed"),
        ("no-message-stop-reset", MESSAGES, messages(true, 6), "reset-before-terminal", "upstream_error"),
    ] {
        let resp =
            post_stream(gw.envoy.listen_addr(), path, &hdrs(&k, id, &[("x-mock-fail", fail), ("x-mock-tokens", "6")]), &body).unwrap().collect().unwrap();
        c.eq(&format!("{id}: status"), &json!(resp.status), json!(200));
        c.that(!resp.text().contains("[DONE]") && !resp.text().contains("message_stop"), format!("{id}: a terminal event reached the client"));
        let o = gw.observe(id, true).unwrap();
        // The usage arrived before the end: the counts are exact whatever the ending.
        exact(&mut c, &o, id);
        outcome(&mut c, &o, id, 200, end);
        seen.push(o);
    }
    let charged: u64 = seen.iter().map(|o| o.u(&o.llm, "input_tokens") + 6).sum();
    counters(&mut c, &gw, &k, 4, 24, charged);
    finish(c, &gw, &seen.iter().collect::<Vec<_>>());
}

#[test]
fn a_gzip_answer_through_the_full_chain_is_stamped_alike_by_all_four_plugins() {
    if !envoy_available() {
        return;
    }
    let gw = sluice_e2e::gateway::start_full_gateway(&["--tokens", "6", "--ttft-ms", "40"], &[]).unwrap();
    let mut c = Checks::default();
    let mut lines = Vec::new();
    // Several gzip streams: the guard holds each response until its first token, and whether the
    // whole answer is in by then is a race (before the proxy-host fix, 7 of 8 were stamped
    // client_disconnect).
    let cases = [
        ("full-gzip-stream-0", true, "gzip"),
        ("full-gzip-stream-1", true, "gzip"),
        ("full-br-stream", true, "br"),
        ("full-zstd-whole", false, "zstd"),
        ("full-identity-stream", true, "identity"),
    ];
    for (id, stream, encoding) in cases {
        let body = json!({"model": "llama-3-70b", "stream": stream, "messages": [{"role": "user", "content": "Hello, compressed."}]}).to_string();
        let resp = post_stream(gw.envoy.listen_addr(), CHAT, &[("x-sluice-tenant", "acme"), ("x-request-id", id), ("x-mock-encoding", encoding)], &body)
            .unwrap()
            .collect()
            .unwrap();
        c.eq(&format!("{id}: status"), &json!(resp.status), json!(200));
        let line = gw.envoy.access_log().wait_for_request(id, Duration::from_secs(10)).unwrap();
        let get = |field: &str| sluice_e2e::access_log::stamp(&line, field).unwrap().unwrap_or(Value::Null);
        let (llm, budget, latency, route) = (get("sluice"), get("budget"), get("latency"), get("route"));
        let version = route["version"].as_str().unwrap_or_default().to_string();
        let mock = if version == "v2" { &gw.v2 } else { &gw.v1 };
        let record = mock.requests().unwrap().into_iter().find(|r| r.request_id == id);
        c.eq(&format!("{id}: llm.outcome"), &llm["outcome"], json!("completed"));
        c.eq(&format!("{id}: budget.outcome"), &budget["outcome"], json!("completed"));
        c.eq(&format!("{id}: latency.outcome"), &latency["outcome"], json!("ok"));
        c.eq(&format!("{id}: llm.usage"), &llm["usage"], json!("reported"));
        c.eq(&format!("{id}: llm.output_tokens = mock"), &llm["output_tokens"], json!(record.as_ref().map(|r| r.completion_tokens)));
        c.eq(&format!("{id}: budget.output_tokens = llm"), &budget["output_tokens"], llm["output_tokens"].clone());
        c.eq(&format!("{id}: budget.input_tokens = llm"), &budget["input_tokens"], llm["input_tokens"].clone());
        lines.push(line.to_string());
    }
    c.eq("client disconnects", &json!(gw.envoy.metrics().unwrap().value("sluice_client_disconnects_total", &[]).unwrap_or(0.0)), json!(0.0));
    c.eq(
        "guard: client_disconnect outcomes",
        &json!(gw.envoy.metrics().unwrap().value("sluice_latency_requests_total", &[("outcome", "client_disconnect")]).unwrap_or(0.0)),
        json!(0.0),
    );
    let log = gw.envoy.stderr_tail(10_000);
    c.that(!log.contains("panic") && !log.contains("[critical]"), format!("Envoy logged a panic or a critical line:\n{log}"));
    c.done(&lines.join("\n"));
}
