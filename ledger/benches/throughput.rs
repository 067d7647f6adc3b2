//! Reserve+settle pairs per second through one sluice-ledger (served on one tokio thread) and a
//! local redis-server, with N concurrent keep-alive HTTP clients (blocking threads), and the
//! latency of each pair and of each call. Not a timed test: run it by hand.
//!
//! ```sh
//! cargo bench -p sluice-ledger --bench throughput                      # 1, 8 and 32 clients, 3 s each
//! cargo bench -p sluice-ledger --bench throughput -- --clients 16 --seconds 5
//! cargo bench -p sluice-ledger --bench throughput -- --cluster         # a local 3+3 Redis Cluster
//! ```
//!
//! With `--cluster` the service runs with `--redis-cluster` in front of a local Redis Cluster (three
//! primaries, three replicas); every pair is for the same org, so one primary serves it all.
//!
//! Everything (clients, service, Redis) shares the machine's cores, so the figures are a floor for
//! the service itself; the summary says how many cores there were.
//!
//! Beside each row, the physical limit at the same concurrency: the same two scripts sent straight to
//! the same Redis by the service's own store (`sluice_ledger::store::Store`, the redis crate's
//! multiplexed connection) from one tokio thread, with no HTTP — what the service would do if HTTP
//! cost nothing (single Redis only).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

#[path = "../tests/common/mod.rs"]
mod common;

use serde_json::json;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn ms(d: Duration) -> String {
    format!("{:.3} ms", d.as_secs_f64() * 1e3)
}

/// Pairs per second through the service (printed with their latencies); returns the rate.
fn run(addr: std::net::SocketAddr, clients: usize, seconds: f64) -> f64 {
    let stop = AtomicBool::new(false);
    let warmup = Duration::from_millis(300);
    let started = Instant::now();
    let measure_from = started + warmup;
    let per_client: Vec<(Vec<Duration>, Vec<Duration>)> = std::thread::scope(|s| {
        let stop = &stop;
        let handles: Vec<_> = (0..clients)
            .map(|c| {
                s.spawn(move || {
                    let mut http = common::Http::new(addr);
                    let (mut pairs, mut calls) = (Vec::new(), Vec::new());
                    let mut i = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        i += 1;
                        let id = format!("bench-{clients}-{c}-{i}");
                        let t0 = Instant::now();
                        let reserve = json!({"id": id, "tag": "bench", "hold_ttl_s": 600, "counters": [
                            {"key": "org:bench:day", "limit": 1u64 << 53, "amount": 1500, "expire_at_s": 4_000_000_000u64},
                            {"key": format!("key:{c}:day"), "limit": 1u64 << 53, "amount": 1500, "expire_at_s": 4_000_000_000u64}]});
                        let r = http.post("/v1/reserve", &reserve.to_string());
                        let t1 = Instant::now();
                        assert_eq!(r.status, 200, "{}", r.body);
                        let s = http.post("/v1/settle", &json!({"id": id, "tag": "bench", "charges": [812, 812]}).to_string());
                        let t2 = Instant::now();
                        assert_eq!(s.status, 200, "{}", s.body);
                        if t0 >= measure_from {
                            pairs.push(t2 - t0);
                            calls.push(t1 - t0);
                            calls.push(t2 - t1);
                        }
                    }
                    (pairs, calls)
                })
            })
            .collect();
        std::thread::sleep(warmup + Duration::from_secs_f64(seconds));
        stop.store(true, Ordering::Relaxed);
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut pairs: Vec<Duration> = per_client.iter().flat_map(|(p, _)| p.iter().copied()).collect();
    let mut calls: Vec<Duration> = per_client.iter().flat_map(|(_, c)| c.iter().copied()).collect();
    pairs.sort();
    calls.sort();
    println!(
        "{clients:>3} clients: {:>7.0} pairs/s ({} pairs in {seconds} s) | pair p50 {} p99 {} | call p50 {} p99 {}",
        pairs.len() as f64 / seconds,
        pairs.len(),
        ms(percentile(&pairs, 0.5)),
        ms(percentile(&pairs, 0.99)),
        ms(percentile(&calls, 0.5)),
        ms(percentile(&calls, 0.99)),
    );
    pairs.len() as f64 / seconds
}

/// Reserve+settle pairs per second with the scripts called directly (see the module's doc): `clients`
/// tasks on one thread, each a pair after the other. Returns (pairs/s, pair p50, pair p99).
fn run_raw(redis_url: &str, clients: usize, seconds: f64) -> (f64, Duration, Duration) {
    use sluice_ledger::api::{CounterRequest, ReserveRequest, SettleRequest};
    use sluice_ledger::store::{RedisTarget, Store};
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        let metrics = std::sync::Arc::new(sluice_ledger::metrics::Metrics::default());
        let store = std::rc::Rc::new(Store::new(&RedisTarget::Single(redis_url.to_string()), "raw", Duration::from_secs(1), metrics).unwrap());
        let warmup = Duration::from_millis(300);
        let measure_from = Instant::now() + warmup;
        let until = measure_from + Duration::from_secs_f64(seconds);
        let local = tokio::task::LocalSet::new();
        let tasks: Vec<_> = (0..clients)
            .map(|c| {
                let store = std::rc::Rc::clone(&store);
                local.spawn_local(async move {
                    let mut pairs = Vec::new();
                    let mut i = 0u64;
                    while Instant::now() < until {
                        i += 1;
                        let id = format!("raw-{clients}-{c}-{i}");
                        let counter = |key: String| CounterRequest { key, limit: 1u64 << 53, amount: 1500, expire_at_s: 4_000_000_000 };
                        let reserve = ReserveRequest {
                            id: id.clone(),
                            tag: "bench".into(),
                            hold_ttl_s: 600,
                            counters: vec![counter("org:bench:day".into()), counter(format!("key:{c}:day"))],
                        };
                        let t0 = Instant::now();
                        store.reserve(&reserve).await.unwrap();
                        store.settle(&SettleRequest { id, tag: "bench".into(), charges: vec![812, 812] }).await.unwrap();
                        if t0 >= measure_from {
                            pairs.push(t0.elapsed());
                        }
                    }
                    pairs
                })
            })
            .collect();
        let mut pairs: Vec<Duration> = Vec::new();
        local
            .run_until(async {
                for t in tasks {
                    pairs.extend(t.await.unwrap());
                }
            })
            .await;
        pairs.sort();
        (pairs.len() as f64 / seconds, percentile(&pairs, 0.5), percentile(&pairs, 0.99))
    })
}

fn main() {
    // `cargo bench` passes `--bench`; anything else unknown is ignored too.
    let args: Vec<String> = std::env::args().collect();
    let value = |flag: &str| args.iter().position(|a| a == flag).and_then(|i| args.get(i + 1)).cloned();
    let clients: Vec<usize> = match value("--clients") {
        Some(list) => list.split(',').filter_map(|n| n.trim().parse().ok()).collect(),
        None => vec![1, 8, 32],
    };
    let seconds: f64 = value("--seconds").and_then(|s| s.parse().ok()).unwrap_or(3.0);

    let cluster_mode = args.iter().any(|a| a == "--cluster");
    let (_redis, _cluster, service) = if cluster_mode {
        let cluster = common::cluster::Cluster::start(1000);
        let service = common::cluster_ledger(&cluster, "sluice", Duration::from_millis(1000));
        (None, Some(cluster), service)
    } else {
        let redis = common::Redis::start();
        let service = common::ledger_with_timeout(&redis, "sluice", Duration::from_millis(1000));
        (Some(redis), None, service)
    };
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0);
    let store = if cluster_mode { "a local Redis Cluster (3 primaries + 3 replicas)" } else { "local redis-server" };
    println!("sluice-ledger bench: one service thread, {store}, {cores} cores shared by clients, service and Redis");
    for n in clients {
        let through_service = run(service.addr, n.max(1), seconds);
        if let Some(redis) = &_redis {
            let (raw, p50, p99) = run_raw(&redis.url(), n.max(1), seconds);
            println!(
                "{:>3} clients, the scripts straight to Redis (no HTTP, one thread): {raw:>7.0} pairs/s | pair p50 {} p99 {} | the service reaches {:.0} % of it",
                n.max(1),
                ms(p50),
                ms(p99),
                through_service / raw * 100.0
            );
        }
    }
    let mut http = common::Http::new(service.addr);
    let metrics = http.get("/metrics").body;
    let count = common::metric(&metrics, "sluice_ledger_script_seconds_count{script=\"reserve\"}").unwrap_or(0.0);
    let sum = common::metric(&metrics, "sluice_ledger_script_seconds_sum{script=\"reserve\"}").unwrap_or(0.0);
    if count > 0.0 {
        println!("reserve script, as the service saw it: mean {:.3} ms over {count} calls", sum / count * 1e3);
    }
}
