//! Where the chain's per-request work goes, without timing noise: the full gateway's four plugins
//! (the example policies) under the harness, `REQUESTS` streamed OpenAI requests of `TOKENS` content
//! events each (one body callback per event, as model servers write them), and per plugin and
//! callback the wasm fuel (≈ instructions executed) and the hostcalls made, per request.
//!
//! `cargo run --release -p sluice-host --example profile [TOKENS] [REQUESTS]` (after `cargo xtask build`);
//! with `PROFILE_COMMENTS=1` the events are keep-alive comments instead: the cost of framing alone;
//! with `PROFILE_USAGE_NULL=1` every content event ends in `"usage":null`, as OpenAI sends them
//! when `include_usage` is on (the member tenant-budget cuts, when it turned the option on).
//! The shipped shape is profiled (`Chain::sluice_gateway`: the guard's `sluice.wasm` filter, then one
//! with the three other sections); `PROFILE_SHAPE=four` profiles one filter per policy instead.

use sluice_host::{Chain, Headers, SLUICE_GATEWAY};

use sluice_core::contract::MODEL_METADATA;

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let tokens: u64 = args.next().map(|a| a.parse()).transpose()?.unwrap_or(1);
    let requests: u64 = args.next().map(|a| a.parse()).transpose()?.unwrap_or(200);
    let four = std::env::var("PROFILE_SHAPE").is_ok_and(|v| v == "four");
    let chain = if four { Chain::full_gateway()? } else { Chain::sluice_gateway()? };
    let names: Vec<&str> = if four { sluice_host::FULL_GATEWAY.iter().map(|(n, _)| *n).collect() } else { SLUICE_GATEWAY.iter().map(|(n, _)| *n).collect() };
    // Warm-up: label sets seen, metric ids defined, as in a gateway that has been running.
    run(&chain, tokens, 50, 0)?;
    for gw in chain.gateways() {
        gw.reset_profile();
    }
    run(&chain, tokens, requests, 50)?;
    println!("per request, {tokens} content event(s) each, mean of {requests} requests");
    println!("{:<22} {:<34} {:>8} {:>12} {:>10}", "plugin", "callback", "calls", "fuel", "hostcalls");
    let (mut all_fuel, mut all_hostcalls) = (0u64, 0u64);
    for (gw, name) in chain.gateways().iter().zip(names) {
        let (mut fuel, mut hostcalls) = (0u64, 0u64);
        for (export, p) in gw.profile() {
            println!(
                "{:<22} {:<34} {:>8.2} {:>12} {:>10.1}",
                name,
                export,
                p.calls as f64 / requests as f64,
                p.fuel / requests,
                p.hostcalls as f64 / requests as f64
            );
            fuel += p.fuel;
            hostcalls += p.hostcalls;
        }
        println!("{:<22} {:<34} {:>8} {:>12} {:>10.1}", name, "= total", "", fuel / requests, hostcalls as f64 / requests as f64);
        all_fuel += fuel;
        all_hostcalls += hostcalls;
    }
    println!("{:<22} {:<34} {:>8} {:>12} {:>10.1}", "chain", "= total", "", all_fuel / requests, all_hostcalls as f64 / requests as f64);
    Ok(())
}

fn run(chain: &Chain, tokens: u64, requests: u64, first_id: u64) -> anyhow::Result<()> {
    let tenants = ["acme", "globex"];
    for i in 0..requests {
        let body = r#"{"model":"llama-3-70b","stream":true,"max_tokens":50,"messages":[{"role":"user","content":"hello there"}]}"#;
        let stream = chain.stream(&[(&MODEL_METADATA, b"llama-3-70b")]);
        let id = format!("req-{}", first_id + i);
        let len = body.len().to_string();
        let headers = Headers::from_pairs(&[
            (":method", "POST"),
            (":path", "/v1/chat/completions"),
            (":authority", "gateway"),
            (":scheme", "http"),
            ("content-type", "application/json"),
            ("x-sluice-tenant", tenants[(i % 2) as usize]),
            ("x-request-id", &id),
            ("content-length", &len),
        ]);
        chain.request_headers(stream, headers, false)?;
        chain.request_body(stream, body.as_bytes().to_vec(), true)?;
        let t = chain.now_ns();
        chain.advance_to(t + 1_000_000)?;
        chain.response_headers(stream, Headers::from_pairs(&[(":status", "200"), ("content-type", "text/event-stream")]), false)?;
        for n in 0..tokens {
            let t = chain.now_ns();
            chain.advance_to(t + 100_000)?;
            let chunk = if std::env::var_os("PROFILE_COMMENTS").is_some_and(|v| !v.is_empty()) {
                format!(": keep-alive {n}\n\n")
            } else {
                let usage = if std::env::var_os("PROFILE_USAGE_NULL").is_some_and(|v| !v.is_empty()) { ",\"usage\":null" } else { "" };
                format!("data: {{\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"model\":\"llama-3-70b\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"t{n}\"}},\"finish_reason\":null}}]{usage}}}\n\n")
            };
            chain.response_body(stream, chunk.into_bytes(), false)?;
        }
        let end = format!(
            "data: {{\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"model\":\"llama-3-70b\",\"choices\":[{{\"index\":0,\"delta\":{{}},\"finish_reason\":\"stop\"}}]}}\n\n\
             data: {{\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"model\":\"llama-3-70b\",\"choices\":[],\"usage\":{{\"prompt_tokens\":11,\"completion_tokens\":{tokens},\"total_tokens\":{}}}}}\n\ndata: [DONE]\n\n",
            11 + tokens
        );
        chain.response_body(stream, end.into_bytes(), true)?;
        chain.take_events();
    }
    Ok(())
}
