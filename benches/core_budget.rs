//! Criterion benchmarks of `sluice-core` budgets: the cost of admitting and settling one request
//! of key `search-prod` of `policies/tenant-budget.example.json` (3 levels, 5 counters: org month $,
//! team month $ and minute tokens, key minute tokens and day $) against the in-memory CAS store, and
//! of computing a month window's id (done once per counter per admission and settlement).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use sluice_core::budget::{Demand, Policy, Window};
use sluice_core::store::MemoryStore;
use sluice_core::usage::Usage;
use std::hint::black_box;
use std::time::{Duration, Instant};

/// 2025-06-15T12:00:00Z.
const NOW_NS: u64 = 1_749_988_800 * 1_000_000_000;
/// Requests per fresh store: 1,400 tokens settled each, well under the key's 1.5M tokens/minute,
/// so every admission in a run succeeds and the store never grows past the key's 5 counters.
const REQUESTS_PER_STORE: u64 = 500;

fn policy() -> Policy {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../policies/tenant-budget.example.json");
    let bytes = std::fs::read(path).expect("example policy");
    Policy::from_json(&bytes).expect("example policy compiles")
}

/// Runs `iters` admit + settle pairs, in fresh stores of [`REQUESTS_PER_STORE`] requests (creating
/// a store is not timed; the first request of each store creates the counters, as the plugin's
/// `on_configure` would).
fn admit_settle(policy: &Policy, key: usize, demand: &Demand, actual: &Usage, iters: u64) -> Duration {
    let mut total = Duration::ZERO;
    let mut done = 0;
    while done < iters {
        let mut store = MemoryStore::default();
        let n = (iters - done).min(REQUESTS_PER_STORE);
        let start = Instant::now();
        for i in 0..n {
            let now = NOW_NS + i * 1_000;
            let admission = policy.admit(&mut store, key, black_box(demand), now).expect("admitted");
            black_box(policy.settle(&mut store, &admission, black_box(actual), now + 500));
        }
        total += start.elapsed();
        done += n;
    }
    total
}

fn budget(c: &mut Criterion) {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../policies/tenant-budget.example.json");
    let bytes = std::fs::read(path).expect("example policy");
    let mut g = c.benchmark_group("budget_policy");
    g.bench_function("from_json_example", |b| b.iter(|| Policy::from_json(black_box(&bytes)).expect("compiles")));
    g.finish();

    let policy = policy();
    let key = policy.key_by_id("search-prod").expect("search-prod");
    assert_eq!(policy.keys[key].counters.len(), 5, "search-prod has 5 counters over 3 levels");

    let demand = Demand { input_tokens: 1_200, output_tokens: 512, choices: 1, model: Some("gpt-4o-mini".into()), identity: None };
    let actual = Usage { input_tokens: 1_100, output_tokens: 300, ..Usage::default() };
    let mut g = c.benchmark_group("budget_request");
    g.throughput(Throughput::Elements(1));
    g.bench_function("admit_settle_search_prod", |b| b.iter_custom(|iters| admit_settle(&policy, key, &demand, &actual, iters)));
    // Worst case the key's 1.5M tokens/minute cannot hold: the first try reserves 3 counters, is
    // refused on the 4th and rolls back; the clamp reads all 5, then admits with a lower output limit.
    let too_big = Demand { output_tokens: 1_600_000, ..demand.clone() };
    let clamped = policy.admit(&mut MemoryStore::default(), key, &too_big, NOW_NS).expect("clamped");
    assert!(clamped.clamped && clamped.output_tokens < too_big.output_tokens);
    g.bench_function("admit_clamped_settle_search_prod", |b| b.iter_custom(|iters| admit_settle(&policy, key, &too_big, &actual, iters)));
    g.finish();

    let mut g = c.benchmark_group("window_id");
    for (name, window) in [("month_reset_1", Window::Month { reset_day: 1 }), ("month_reset_15", Window::Month { reset_day: 15 })] {
        g.bench_function(name, |b| {
            let mut now = NOW_NS;
            b.iter(|| {
                // A different day each call (≈ 1 day + 1 s steps), so nothing is constant-folded.
                now = now.wrapping_add(86_401 * 1_000_000_000);
                window.id(black_box(now))
            })
        });
    }
    g.bench_function("minute", |b| b.iter(|| Window::Minute.id(black_box(NOW_NS))));
    g.finish();
}

criterion_group!(benches, budget);
criterion_main!(benches);
