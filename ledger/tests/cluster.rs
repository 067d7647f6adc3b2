//! sluice-ledger in front of a real Redis Cluster (3 primaries + 3 replicas of Debian's
//! redis-server on loopback): the same answers as one Redis, redirections followed while a slot
//! moves, and a primary killed under load (docs/ledger.md, "Redis Cluster").

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

mod common;

use common::cluster::Cluster;
use common::{cluster_ledger, ledger, metric, Http, Redis};
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

const FAR: u64 = 4_000_000_000; // expire_at_s far ahead (2096)

fn reserve(id: &str, tag: &str, counters: &[(&str, u64, u64)]) -> Value {
    let counters: Vec<Value> = counters.iter().map(|(key, limit, amount)| json!({"key": key, "limit": limit, "amount": amount, "expire_at_s": FAR})).collect();
    json!({"id": id, "tag": tag, "hold_ttl_s": 600, "counters": counters})
}

fn settle(id: &str, tag: &str, charges: &[u64]) -> Value {
    json!({"id": id, "tag": tag, "charges": charges})
}

/// The SHA-1 of each script, as the service sends it with `EVALSHA`.
fn script_hashes() -> [String; 2] {
    let common = include_str!("../src/lua/common.lua");
    [
        redis::Script::new(&format!("{common}\n{}", include_str!("../src/lua/reserve.lua"))).get_hash().to_string(),
        redis::Script::new(&format!("{common}\n{}", include_str!("../src/lua/settle.lua"))).get_hash().to_string(),
    ]
}

fn scripts_loaded(node: &common::cluster::Node) -> Vec<bool> {
    let [r, s] = script_hashes();
    node.query(&["SCRIPT", "EXISTS", &r, &s])
}

/// Next of a small linear congruential sequence.
fn next(seed: &mut u64) -> u64 {
    *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    *seed >> 33
}

#[test]
fn orgs_on_every_primary_get_the_answers_of_one_redis() {
    let cluster = Cluster::start(1000);
    let single = Redis::start();
    for node in &cluster.nodes {
        assert_eq!(scripts_loaded(node), [false, false], "node {} already has the scripts", node.port);
    }
    let on_cluster = cluster_ledger(&cluster, "t", Duration::from_millis(500));
    let on_single = ledger(&single, "t");
    let (mut c, mut s) = (Http::new(on_cluster.addr), Http::new(on_single.addr));
    assert_eq!(c.get("/healthz").status, 200);

    let orgs: Vec<String> = (0..30).map(|i| format!("org{i}")).collect();
    let mut by_primary: BTreeMap<u16, Vec<&str>> = BTreeMap::new();
    for org in &orgs {
        by_primary.entry(cluster.primary_of(&format!("t:{{{org}}}:holds"))).or_default().push(org);
    }
    assert_eq!(by_primary.len(), 3, "the 30 orgs' tags should land on all three primaries: {by_primary:?}");

    let mut same = |path: &str, body: Value| -> Value {
        let (a, b) = (c.post(path, &body.to_string()), s.post(path, &body.to_string()));
        assert_eq!((a.status, &a.body), (b.status, &b.body), "{path} {body}: cluster vs single Redis");
        a.json()
    };
    let mut seed = 7u64;
    let mut calls = 0;
    for round in 0..6 {
        for org in &orgs {
            let id = format!("r{round}");
            let amount = 20 + next(&mut seed) % 60;
            let key = format!("key:{}", next(&mut seed) % 3);
            let answer = same("/v1/reserve", reserve(&id, org, &[("org", 300, amount), (&key, 150, amount)]));
            calls += 1;
            if answer["admitted"] == json!(true) {
                if next(&mut seed) % 3 == 0 {
                    assert_eq!(same("/v1/reserve", reserve(&id, org, &[("org", 300, amount), (&key, 150, amount)]))["replayed"], json!(true));
                }
                let charge = amount - next(&mut seed) % 10;
                if next(&mut seed) % 5 == 0 {
                    same("/v1/settle", settle(&id, org, &[charge])); // 400 charges_mismatch
                }
                assert_eq!(same("/v1/settle", settle(&id, org, &[charge, charge]))["settled"], json!(true));
                if next(&mut seed) % 4 == 0 {
                    assert_eq!(same("/v1/settle", settle(&id, org, &[charge, charge]))["reason"], json!("already_settled"));
                }
                calls += 2;
            }
            if round == 5 {
                // Left open: a hold on each org's counters.
                same("/v1/reserve", reserve("open", org, &[("org", 300, 1), ("key:0", 150, 1)]));
                same("/v1/settle", settle("never", org, &[1]));
            }
        }
    }
    // Each counter read from the primary that owns its slot equals the single Redis's.
    let mut keys_checked = 0;
    for (primary, orgs) in &by_primary {
        for org in orgs {
            for counter in ["org", "key:0", "key:1", "key:2"] {
                let key = format!("t:{{{org}}}:c:{counter}");
                assert_eq!(cluster.primary_of(&key), *primary);
                assert_eq!(cluster.counter(&key), single.counter(&key), "{key} on primary {primary}");
                keys_checked += 1;
            }
            let holds = format!("t:{{{org}}}:holds");
            assert_eq!(cluster.query_key::<Vec<String>>(&holds, &["ZRANGE", &holds, "0", "-1"]), single.query::<Vec<String>>(&["ZRANGE", &holds, "0", "-1"]));
        }
    }
    let used: u64 = orgs.iter().map(|o| cluster.counter(&format!("t:{{{o}}}:c:org")).map(|c| c.0).unwrap_or(0)).sum();
    assert!(used > 0);
    // Every primary was sent the scripts it did not have (NOSCRIPT, then SCRIPT LOAD).
    for primary in by_primary.keys() {
        assert_eq!(scripts_loaded(cluster.node(*primary)), [true, true], "primary {primary}");
    }
    let (mc, ms) = (c.get("/metrics").body, s.get("/metrics").body);
    for line in ms.lines().filter(|l| l.starts_with("sluice_ledger_requests_total{endpoint=\"reserve\"") || l.starts_with("sluice_ledger_requests_total{endpoint=\"settle\"")) {
        let series = line.rsplit_once(' ').unwrap().0;
        assert_eq!(metric(&mc, series), metric(&ms, series), "{series}");
    }
    assert_eq!(metric(&mc, "sluice_ledger_redis_up"), Some(1.0));
    println!(
        "{calls} calls for {} orgs over primaries {:?}: {keys_checked} counters equal to one Redis's, {used} used in all",
        orgs.len(),
        by_primary.iter().map(|(p, o)| (*p, o.len())).collect::<Vec<_>>()
    );
}
