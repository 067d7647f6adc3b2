//! Criterion benchmarks of `sluice-core`'s latency guard: the quantile sketch (add, quantile,
//! merge, encode/decode), the rolling window, and the per-request cost of the guard against the
//! in-memory CAS store with a realistic window (20 requests/s for a minute, lognormal TTFTs around
//! 250 ms, TPOTs around 30 ms): the admission path (evaluate the shared breaker on time alone,
//! admit, shed check) and the completion path (CAS-record into the window, snapshot, evaluate
//! the breaker).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use sluice_core::latency::breaker::{self, BreakerConfig};
use sluice_core::latency::window::{self, RollingWindow, Sample, WindowCache, WindowConfig, WindowStats};
use sluice_core::latency::{should_shed, InFlightLimit, LatencyPolicy, Priority, QuantileSketch, SketchParams};
use sluice_core::store::MemoryStore;
use std::hint::black_box;

const S: u64 = 1_000_000_000;
const T0: u64 = 1_749_988_800 * S;

/// Deterministic lognormal-ish samples (xorshift + Box-Muller).
fn samples(n: usize, median: f64, sigma: f64, seed: u64) -> Vec<u64> {
    let mut x = seed;
    let mut next = move || {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        ((x.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    };
    (0..n)
        .map(|_| {
            let z = (-2.0 * next().ln()).sqrt() * (2.0 * std::f64::consts::PI * next()).cos();
            (median * (sigma * z).exp()) as u64
        })
        .collect()
}

fn config() -> WindowConfig {
    WindowConfig::new(6, 10 * S, SketchParams::DEFAULT).unwrap()
}

fn breaker_config() -> BreakerConfig {
    BreakerConfig {
        percentile: 95.0,
        ttft_us: Some(2_000_000),
        tpot_us: Some(200_000),
        error_per_mille: Some(20),
        min_samples: 50,
        open_for_ns: 30 * S,
        hysteresis_percent: 10,
        probe_percent: 10,
        probes: 20,
    }
}

/// A minute of traffic at 20 requests/s, ending at `T0`.
fn full_window() -> RollingWindow {
    let ttft = samples(1200, 250_000.0, 0.5, 1);
    let tpot = samples(1200, 30_000.0, 0.3, 2);
    let mut w = RollingWindow::new(config());
    for i in 0..1200u64 {
        w.record(T0 - 60 * S + i * S / 20, Some(ttft[i as usize]), Some(tpot[i as usize]), i % 100 == 0);
    }
    w
}

fn sketch(c: &mut Criterion) {
    let values = samples(60_000, 250_000.0, 0.6, 3);
    let mut g = c.benchmark_group("latency_sketch");
    g.throughput(Throughput::Elements(1));
    g.bench_function("add", |b| {
        let mut s = QuantileSketch::default();
        let mut i = 0usize;
        b.iter(|| {
            i = (i + 1) % values.len();
            s.add(black_box(values[i]));
        })
    });
    let mut full = QuantileSketch::default();
    values.iter().for_each(|v| full.add(*v));
    g.bench_function("quantile_p95_60k", |b| b.iter(|| black_box(&full).quantile(black_box(0.95))));
    let bytes = full.encode();
    g.bench_function("encode_60k", |b| b.iter(|| black_box(&full).encode()));
    g.bench_function("decode_60k", |b| b.iter(|| QuantileSketch::decode(black_box(&bytes))));
    let parts: Vec<QuantileSketch> = values
        .chunks(10_000)
        .map(|c| {
            let mut s = QuantileSketch::default();
            c.iter().for_each(|v| s.add(*v));
            s
        })
        .collect();
    g.bench_function("merge_6x10k", |b| {
        b.iter(|| {
            let mut m = QuantileSketch::default();
            for p in &parts {
                m.merge(black_box(p)).unwrap();
            }
            m
        })
    });
    g.finish();
}

fn window_and_request(c: &mut Criterion) {
    let w = full_window();
    let bytes = w.encode();
    eprintln!("full window (1,200 requests): {} bytes encoded", bytes.len());
    let mut g = c.benchmark_group("latency_window");
    g.throughput(Throughput::Elements(1));
    g.bench_function("snapshot_full", |b| b.iter(|| black_box(&w).snapshot(black_box(T0))));
    g.bench_function("decode_full", |b| b.iter(|| RollingWindow::decode(black_box(&bytes))));
    g.bench_function("encode_full", |b| b.iter(|| black_box(&w).encode()));
    g.finish();

    let cfg = config();
    let bcfg = breaker_config();
    let limit = InFlightLimit { limit: 64, standard_extra_percent: 25 };
    let mut store = MemoryStore::default();
    store_set(&mut store, "w", &bytes);
    breaker::ensure(&mut store, "b").unwrap();
    let mut g = c.benchmark_group("latency_request");
    g.throughput(Throughput::Elements(1));
    // Admission: only time can move the breaker (open → half-open), so the window is not read.
    let no_stats = WindowStats::default();
    g.bench_function("admission_path", |b| {
        let mut draw = 0u64;
        b.iter(|| {
            draw = draw.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let (br, t) = breaker::update(&mut store, "b", &bcfg, T0, black_box(&no_stats)).unwrap();
            assert!(t.is_none());
            (br.admit(draw), should_shed(Priority::Standard, black_box(40), &limit))
        })
    });
    g.bench_function("completion_path", |b| {
        let mut now = T0;
        b.iter(|| {
            // 50 µs apart: stays in the same minute for the whole run, the window keeps ~its size.
            now += 50_000;
            let w = window::update(&mut store, "w", &cfg, now, Some(black_box(240_000)), Some(black_box(31_000)), false).unwrap();
            let stats = w.snapshot(now);
            breaker::update(&mut store, "b", &bcfg, now, &stats).unwrap()
        })
    });
    // The completion path as latency-guard runs it, through the worker's window cache (it finds
    // its own bytes in the store: no other worker wrote), on a busy window: 20 requests a second
    // of spread latencies, so the window holds a minute of them (the benches above add one value
    // 20,000 times a second, and their window soon holds a few buckets).
    g.bench_function("completion_path_cached_busy", |b| {
        let (ttft, tpot) = (samples(1200, 250_000.0, 0.5, 1), samples(1200, 30_000.0, 0.3, 2));
        let mut busy = MemoryStore::default();
        store_set(&mut busy, "w", &bytes);
        breaker::ensure(&mut busy, "b").unwrap();
        let mut cache = WindowCache::default();
        let (mut now, mut i) = (T0, 0usize);
        b.iter(|| {
            now += S / 20;
            i += 1;
            let k = i % 1200;
            let stats =
                cache.update(&mut busy, "w", &cfg, now, Sample::Finished { ttft_us: Some(ttft[k]), tpot_us: Some(tpot[k]), error: k % 100 == 0 }).unwrap();
            breaker::update(&mut busy, "b", &bcfg, now, stats).unwrap()
        })
    });
    // A stream's first token: its TTFT into the window, the breaker judged (the end of the same
    // request then takes the completion path without the TTFT).
    g.bench_function("first_token_path", |b| {
        let mut now = T0;
        b.iter(|| {
            now += 50_000;
            let w = window::update_ttft(&mut store, "w", &cfg, now, black_box(240_000)).unwrap();
            let stats = w.snapshot(now);
            breaker::update(&mut store, "b", &bcfg, now, &stats).unwrap()
        })
    });
    // The completion path of a window that is read but not evaluated (snapshot cost excluded).
    g.bench_function("record_only", |b| {
        let mut now = T0;
        b.iter(|| {
            now += 50_000;
            window::update(&mut store, "w", &cfg, now, Some(black_box(240_000)), Some(black_box(31_000)), false).unwrap()
        })
    });
    g.finish();

    let policy = br#"{
      "tenant": {"header": "x-sluice-tenant"},
      "classes": [{"name": "gold", "priority": "critical", "tenants": ["bank-*"]},
                  {"name": "batch", "priority": "sheddable", "tenants": ["*-batch"]}],
      "versions": [
        {"name": "v2", "ttft_deadline_ms": 2000, "total_deadline_ms": 120000, "in_flight": {"limit": 64},
         "breaker": {"objective": {"ttft_ms": 500, "error_per_mille": 20}, "window_s": 60,
                     "min_samples": 50, "open_for_ms": 30000, "fallback": "v1"}},
        {"name": "v1"}]}"#;
    let p = LatencyPolicy::from_json(policy).unwrap();
    let mut g = c.benchmark_group("latency_policy");
    g.bench_function("from_json", |b| b.iter(|| LatencyPolicy::from_json(black_box(policy)).unwrap()));
    g.bench_function("classify", |b| b.iter(|| p.classify(black_box(Some("acme-batch")))));
    g.finish();
}

fn store_set(store: &mut MemoryStore, key: &str, bytes: &[u8]) {
    use sluice_core::store::SharedStore;
    store.set(key, bytes, 0).unwrap();
}

criterion_group!(benches, sketch, window_and_request);
criterion_main!(benches);
