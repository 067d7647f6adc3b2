//! Criterion benchmarks of `sluice-core` model routing: one `decide` (sticky key → version, with
//! ramps evaluated at the request's time) for a 2-version model with a ramp (the brief's canary) and
//! a 5-version model, the model lookup, shadow sampling, and the shadow similarity score on two
//! 4 KiB texts.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use sluice_core::routing::similarity::jaccard_per_mille;
use sluice_core::routing::RoutingPolicy;
use std::hint::black_box;

/// 2026-12-10T00:00:00Z: inside the ramp (second step applies).
const NOW_NS: u64 = 1_796_860_800 * 1_000_000_000;

const POLICY: &str = r#"{
  "sticky_key": [ {"header": "x-sluice-tenant"}, {"api_key": true} ],
  "override": { "property": ["metadata", "filter_metadata", "envoy.filters.http.jwt_authn", "force_version"] },
  "models": [
    { "model": "llama-3-70b*",
      "versions": [
        { "name": "v1", "weight": 99, "upstream_model": "llama-3-70b", "route": "llama-v1" },
        { "name": "v2", "weight": 1, "upstream_model": "llama-3-70b-v2", "route": "llama-v2",
          "ramp": [ {"at": "2026-12-01T00:00:00Z", "weight": 5}, {"at": "2026-12-08T00:00:00Z", "weight": 25}, {"at": "2026-12-15T00:00:00Z", "weight": 100} ] }
      ],
      "shadow": { "version": { "name": "qwen-v1", "upstream_model": "qwen-72b", "cluster": "qwen_v1" },
                  "fraction": 0.05, "max_concurrent": 8, "exclude_tenants": ["bank-*"], "tenant_header": "x-sluice-tenant" } },
    { "model": "mixtral*",
      "versions": [
        { "name": "a", "weight": 40, "upstream_model": "mixtral-a", "route": "a" },
        { "name": "b", "weight": 25, "upstream_model": "mixtral-b", "route": "b" },
        { "name": "c", "weight": 20, "upstream_model": "mixtral-c", "route": "c" },
        { "name": "d", "weight": 10, "upstream_model": "mixtral-d", "route": "d" },
        { "name": "e", "weight": 5, "upstream_model": "mixtral-e", "route": "e" }
      ] }
  ]
}"#;

/// A 4 KiB English-like text from a word list, varied by `seed`.
fn text(seed: u64, bytes: usize) -> String {
    const WORDS: [&str; 32] = [
        "the",
        "model",
        "answer",
        "request",
        "token",
        "latency",
        "stream",
        "version",
        "shadow",
        "canary",
        "gateway",
        "envoy",
        "budget",
        "tenant",
        "metric",
        "histogram",
        "weight",
        "split",
        "sticky",
        "key",
        "user",
        "session",
        "response",
        "output",
        "input",
        "compare",
        "similar",
        "score",
        "prefix",
        "cap",
        "Paris",
        "capital",
    ];
    let mut s = String::with_capacity(bytes + 16);
    let mut x = seed;
    while s.len() < bytes {
        x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        s.push_str(WORDS[(x >> 59) as usize]);
        if x & 0x30 == 0 {
            // A quarter of the words carry a number: ~800 distinct words, realistic overlap.
            s.push_str(&((x >> 40) % 100).to_string());
        }
        s.push(if x & 0xf == 0 { '.' } else { ' ' });
    }
    s.truncate(bytes);
    s
}

fn routing(c: &mut Criterion) {
    let policy = RoutingPolicy::from_json(POLICY.as_bytes()).expect("compiles");
    let two = policy.model_for("llama-3-70b").expect("llama");
    let five = policy.model_for("mixtral-8x7b").expect("mixtral");
    assert_eq!(policy.model(five).unwrap().versions.len(), 5);
    // Keys look like API-key hashes (64 hex digits), the longest usual sticky key.
    let keys: Vec<Vec<u8>> = (0..1024u32).map(|i| sluice_core::identity::sha256_hex(&i.to_le_bytes()).into_bytes()).collect();

    let mut g = c.benchmark_group("routing_decide");
    g.throughput(Throughput::Elements(1));
    for (name, model) in [("2_versions_ramped", two), ("5_versions", five)] {
        g.bench_function(name, |b| {
            let mut i = 0usize;
            b.iter(|| {
                i = (i + 1) & 1023;
                policy.decide(black_box(model), Some(&keys[i]), b"req", None, black_box(NOW_NS), &[])
            })
        });
    }
    // The choice alone, without building the Decision's three strings.
    g.bench_function("weighted_choice_5_versions", |b| {
        let mut i = 0usize;
        b.iter(|| {
            i = (i + 1) & 1023;
            policy.weighted_choice(black_box(five), &keys[i], black_box(NOW_NS))
        })
    });
    g.bench_function("model_for_glob", |b| b.iter(|| policy.model_for(black_box("mixtral-8x7b-instruct"))));
    g.bench_function("shadow_sampled", |b| {
        let mut i = 0usize;
        b.iter(|| {
            i = (i + 1) & 1023;
            policy.shadow_sampled(two, &keys[i], Some(black_box("acme")))
        })
    });
    g.bench_function("from_json", |b| b.iter(|| RoutingPolicy::from_json(black_box(POLICY.as_bytes())).expect("compiles")));
    g.finish();

    let (a, b2) = (text(1, 4096), text(2, 4096));
    let score = jaccard_per_mille(&a, &b2);
    assert!(score > 0 && score < 1000, "{score}");
    let mut g = c.benchmark_group("similarity");
    g.throughput(Throughput::Bytes(8192));
    g.bench_function("jaccard_2x4KiB", |b| b.iter(|| jaccard_per_mille(black_box(&a), black_box(&b2))));
    g.finish();
}

criterion_group!(benches, routing);
criterion_main!(benches);
