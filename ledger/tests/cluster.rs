//! sluice-ledger in front of a real Redis Cluster (3 primaries + 3 replicas of Debian's
//! redis-server on loopback): the same answers as one Redis, redirections followed while a slot
//! moves, and a primary killed under load (docs/ledger.md, "Redis Cluster").

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

mod common;

use common::cluster::Cluster;
use common::{cluster_ledger, ledger, metric, Http, Redis};
use serde_json::{json, Value};
use std::collections::BTreeMap;
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
                if next(&mut seed).is_multiple_of(3) {
                    assert_eq!(same("/v1/reserve", reserve(&id, org, &[("org", 300, amount), (&key, 150, amount)]))["replayed"], json!(true));
                }
                let charge = amount - next(&mut seed) % 10;
                if next(&mut seed).is_multiple_of(5) {
                    same("/v1/settle", settle(&id, org, &[charge])); // 400 charges_mismatch
                }
                assert_eq!(same("/v1/settle", settle(&id, org, &[charge, charge]))["settled"], json!(true));
                if next(&mut seed).is_multiple_of(4) {
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
    for line in ms
        .lines()
        .filter(|l| l.starts_with("sluice_ledger_requests_total{endpoint=\"reserve\"") || l.starts_with("sluice_ledger_requests_total{endpoint=\"settle\""))
    {
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

/// Runs one reserve (and its settle when admitted) for `org`; `(status of the reserve, charged)`.
fn pair(http: &mut Http, id: &str, org: &str, limit: u64, amount: u64) -> (u16, Option<u64>) {
    let r = http.post("/v1/reserve", &reserve(id, org, &[("org", limit, amount)]).to_string());
    if r.status != 200 || r.json()["admitted"] != json!(true) {
        return (r.status, None);
    }
    let charge = amount - amount / 4;
    loop {
        let s = http.post("/v1/settle", &settle(id, org, &[charge]).to_string());
        if s.status == 200 {
            let reason = &s.json()["reason"];
            assert!(s.json()["settled"] == json!(true) || *reason == json!("already_settled"), "{id}: {}", s.body);
            return (200, Some(charge));
        }
        assert_eq!(s.status, 503, "{}", s.body);
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_slot_moved_between_primaries_is_followed() {
    let cluster = Cluster::start(1000);
    let service = cluster_ledger(&cluster, "t", Duration::from_millis(300));
    let org = "moving";
    let slot = cluster.keyslot(&format!("t:{{{org}}}:holds"));
    let src = cluster.primary_of_slot(slot);
    let dst = cluster.shards().iter().map(|s| s.primary).find(|p| *p != src).unwrap();
    let (src_id, dst_id) = (cluster.node(src).id(), cluster.node(dst).id());
    let mut http = Http::new(service.addr);
    let mut charged = 0u64;
    for i in 0..5 {
        charged += pair(&mut http, &format!("before{i}"), org, 1_000_000, 40).1.unwrap();
    }
    assert_eq!(http.ok("/v1/reserve", &reserve("open", org, &[("org", 1_000_000, 100)]))["admitted"], json!(true));

    // Meanwhile, another client keeps reserving and settling for the same org.
    let stop = std::sync::atomic::AtomicBool::new(false);
    let (background, moved) = std::thread::scope(|s| {
        let load = s.spawn(|| {
            let mut http = Http::new(service.addr);
            let (mut ok, mut unavailable, mut charged) = (0u64, 0u64, 0u64);
            let mut i = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                i += 1;
                match pair(&mut http, &format!("bg{i}"), org, 1_000_000, 8) {
                    (200, c) => {
                        ok += 1;
                        charged += c.unwrap_or(0);
                    }
                    (503, _) => unavailable += 1,
                    (status, _) => panic!("reserve answered {status}"),
                }
            }
            (ok, unavailable, charged)
        });
        // A panic below must not leave the other client running (the scope would wait forever).
        struct Stop<'a>(&'a std::sync::atomic::AtomicBool);
        impl Drop for Stop<'_> {
            fn drop(&mut self) {
                self.0.store(true, std::sync::atomic::Ordering::Relaxed);
            }
        }
        let _stop = Stop(&stop);
        std::thread::sleep(Duration::from_millis(200));
        let started = Instant::now();
        // The slot's keys go one by one from src to dst (MIGRATING / IMPORTING), then dst owns it.
        let setslot = |port: u16, state: &str, id: &str| {
            let _: () = cluster.node(port).query(&["CLUSTER", "SETSLOT", &slot.to_string(), state, id]);
        };
        setslot(dst, "IMPORTING", &src_id);
        setslot(src, "MIGRATING", &dst_id);
        let mut keys_moved = 0;
        loop {
            let keys: Vec<String> = cluster.node(src).query(&["CLUSTER", "GETKEYSINSLOT", &slot.to_string(), "10"]);
            if keys.is_empty() {
                break;
            }
            for key in keys {
                let dst_port = dst.to_string();
                let _: redis::Value = cluster.node(src).query(&["MIGRATE", "127.0.0.1", &dst_port, &key, "0", "5000"]);
                keys_moved += 1;
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        // Every key is on dst, the slot still MIGRATING on src: src answers ASK, and dst answers the
        // script after ASKING with TRYAGAIN (a multi-key call whose keys do not all exist yet — the
        // settle's marker — in an importing slot), retried until the timeout: 503. Not required
        // to pass before the slot is dst's.
        let asked = http.post("/v1/settle", &settle("open", org, &[90]).to_string());
        let ask_status = asked.status;
        if ask_status == 200 {
            assert_eq!(asked.json()["settled"], json!(true), "{}", asked.body);
        } else {
            // What dst itself answers to that script after ASKING.
            let [_, settle_sha] = script_hashes();
            let base = format!("t:{{{org}}}:");
            let mut p = redis::pipe();
            p.cmd("ASKING").ignore();
            p.cmd("EVALSHA").arg(&settle_sha).arg(3).arg(format!("{base}holds")).arg(format!("{base}h:open")).arg(format!("{base}s:open"));
            p.arg(&base).arg("open").arg(64).arg(1).arg(90);
            let direct: redis::RedisResult<Vec<redis::Value>> = p.query(&mut cluster.node(dst).conn());
            println!("during ASK the ledger answered {}: {}; dst after ASKING answers {direct:?}", asked.status, asked.body);
        }
        for port in [dst, src] {
            setslot(port, "NODE", &dst_id);
        }
        for port in cluster.shards().iter().map(|s| s.primary).filter(|p| *p != src && *p != dst) {
            setslot(port, "NODE", &dst_id);
        }
        let took = started.elapsed();
        // Now src answers MOVED for the slot, followed to dst; the other client kept going.
        if ask_status != 200 {
            let moved = http.ok("/v1/settle", &settle("open", org, &[90]));
            assert!(moved["settled"] == json!(true) || moved["reason"] == json!("already_settled"), "{moved}");
        }
        std::thread::sleep(Duration::from_millis(300));
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        (load.join().unwrap(), (keys_moved, took, ask_status))
    });
    assert_eq!(cluster.primary_of_slot(slot), dst);
    for i in 0..5 {
        charged += pair(&mut http, &format!("after{i}"), org, 1_000_000, 40).1.unwrap();
    }
    let (ok, unavailable, bg_charged) = background;
    let key = format!("t:{{{org}}}:c:org");
    // Read from dst itself: the counter and its hold index moved there whole.
    assert_eq!(cluster.counter(&key), Some((charged + 90 + bg_charged, 0)));
    assert_eq!(cluster.node(src).query::<u64>(&["CLUSTER", "COUNTKEYSINSLOT", &slot.to_string()]), 0);
    assert!(ok > 0, "the other client got nothing through");
    println!(
        "slot {slot} moved {src} → {dst}: {} keys in {:?}; a settle during ASK answered {}; the other client {ok} pairs answered, {unavailable} reserves 503 (while the keys were split)",
        moved.0, moved.1, moved.2
    );
}

/// What one client saw.
#[derive(Default)]
struct Seen {
    /// `(sent, answered, status)` of every reserve and settle, relative to the test's start.
    calls: Vec<(Duration, Duration, u16)>,
    /// Charges of settles answered `settled` or `already_settled`, by hold id.
    charged: BTreeMap<String, u64>,
    /// Admitted reserves whose settle answered `unknown`: the reserve was lost.
    lost_reserves: Vec<(String, u64)>,
    refused: u64,
}

fn post(http: &mut Http, seen: &mut Seen, t0: Instant, path: &str, body: &Value) -> common::Reply {
    let sent = t0.elapsed();
    let r = http.post(path, &body.to_string());
    seen.calls.push((sent, t0.elapsed(), r.status));
    assert!(r.status == 200 || r.status == 503, "{path}: {} {}", r.status, r.body);
    r
}

/// Sends a settle until it is answered (as tenant-budget's queue does); its answer.
fn settle_until_answered(http: &mut Http, seen: &mut Seen, t0: Instant, id: &str, org: &str, charges: &[u64]) -> Value {
    loop {
        let r = post(http, seen, t0, "/v1/settle", &settle(id, org, charges));
        if r.status == 200 {
            return r.json();
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// What the clients saw, when the primary was killed, and when `/healthz` went 503 and 200 again.
type Run = (Vec<Seen>, Option<Duration>, (Option<Duration>, Option<Duration>));

#[test]
fn a_primary_killed_under_load_fails_over_to_its_replica() {
    const CLIENTS: usize = 8;
    let mut cluster = Cluster::start(1000);
    let service = cluster_ledger(&cluster, "t", Duration::from_millis(200));
    let org = "budget";
    let holds = format!("t:{{{org}}}:holds");
    let victim = cluster.primary_of(&holds);
    let shard = cluster.shards().into_iter().find(|s| s.primary == victim).unwrap();
    let replica = shard.replicas[0];

    // The cost of waiting for the replica after each write, measured on the victim: a counter
    // increment alone, then with `WAIT 1 100` after it (one round trip each, sequential).
    let mut conn = cluster.node(victim).conn();
    let key = format!("t:{{{org}}}:waitprobe");
    let timed = |conn: &mut redis::Connection, wait: bool| {
        let started = Instant::now();
        for _ in 0..500 {
            let mut p = redis::pipe();
            p.cmd("HINCRBY").arg(&key).arg("n").arg(1);
            if wait {
                p.cmd("WAIT").arg(1).arg(100);
            }
            let _: redis::Value = p.query(conn).unwrap();
        }
        started.elapsed() / 500
    };
    let (plain, waited) = (timed(&mut conn, false), timed(&mut conn, true));
    let _: () = redis::cmd("DEL").arg(&key).query(&mut conn).unwrap();

    // Warm-up: how much the clients charge per second, to size the budget so that it runs out
    // after the fail-over.
    let t0 = Instant::now();
    let run = |seconds: f64, counter: &str, limit: u64, kill_at: Option<Duration>, cluster: &mut Cluster| -> Run {
        let stop = std::sync::atomic::AtomicBool::new(false);
        let killed = std::sync::Mutex::new(None);
        let health = std::sync::Mutex::new((None, None));
        let seen = std::thread::scope(|s| {
            let handles: Vec<_> = (0..CLIENTS)
                .map(|c| {
                    let (stop, service) = (&stop, &service);
                    s.spawn(move || {
                        let mut http = Http::new(service.addr);
                        let mut seen = Seen::default();
                        let mut seed = c as u64 + 11;
                        let mut i = 0;
                        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                            i += 1;
                            let id = format!("{counter}-{c}-{i}");
                            let amount = 20 + next(&mut seed) % 41;
                            let own = format!("key:{c}");
                            let r = post(&mut http, &mut seen, t0, "/v1/reserve", &reserve(&id, org, &[(counter, limit, amount), (&own, 1 << 50, amount)]));
                            if r.status == 503 {
                                // Perhaps held, perhaps not: released (a settle of nothing).
                                settle_until_answered(&mut http, &mut seen, t0, &id, org, &[0, 0]);
                                std::thread::sleep(Duration::from_millis(5));
                                continue;
                            }
                            let answer = r.json();
                            if answer["admitted"] != json!(true) {
                                assert_eq!(answer["refused"], json!(0), "{answer}");
                                seen.refused += 1;
                                std::thread::sleep(Duration::from_millis(2));
                                continue;
                            }
                            let charge = amount - amount / 4;
                            let done = settle_until_answered(&mut http, &mut seen, t0, &id, org, &[charge, charge]);
                            if done["settled"] == json!(true) || done["reason"] == json!("already_settled") {
                                seen.charged.insert(id, charge);
                            } else {
                                assert_eq!(done["reason"], json!("unknown"), "{id}: {done}");
                                seen.lost_reserves.push((id, charge));
                            }
                        }
                        seen
                    })
                })
                .collect();
            struct Stop<'a>(&'a std::sync::atomic::AtomicBool);
            impl Drop for Stop<'_> {
                fn drop(&mut self) {
                    self.0.store(true, std::sync::atomic::Ordering::Relaxed);
                }
            }
            let _stop = Stop(&stop);
            let started = Instant::now();
            if let Some(at) = kill_at {
                std::thread::sleep(at);
                // The replica has never loaded the scripts: the first call after the promotion
                // gets NOSCRIPT there.
                let _: () = cluster.node(replica).query(&["SCRIPT", "FLUSH"]);
                assert_eq!(scripts_loaded(cluster.node(replica)), [false, false]);
                cluster.kill(victim);
                *killed.lock().unwrap() = Some(t0.elapsed());
                // /healthz pings every primary: 503 while the shard has none, 200 again after.
                let mut probe = Http::new(service.addr);
                let deadline = Instant::now() + Duration::from_secs(8);
                let (mut down, mut up) = (None, None);
                while up.is_none() && Instant::now() < deadline {
                    match (probe.get("/healthz").status, down) {
                        (503, None) => down = Some(t0.elapsed()),
                        (200, Some(_)) => up = Some(t0.elapsed()),
                        _ => {}
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                *health.lock().unwrap() = (down, up);
            }
            std::thread::sleep(Duration::from_secs_f64(seconds).saturating_sub(started.elapsed()));
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            handles.into_iter().map(|h| h.join().unwrap()).collect::<Vec<Seen>>()
        });
        (seen, killed.into_inner().unwrap(), health.into_inner().unwrap())
    };
    let (warm, _, _) = run(1.0, "warm", 1 << 50, None, &mut cluster);
    let warm_charged: u64 = warm.iter().flat_map(|s| s.charged.values()).sum();
    let rate = warm_charged as f64 / 1.0;
    let limit = (rate * 2.0) as u64;

    let (seen, killed, (health_down, health_up)) = run(9.0, "budget", limit, Some(Duration::from_millis(1000)), &mut cluster);
    let killed = killed.unwrap();
    let (health_down, health_up) = (health_down.expect("/healthz never answered 503"), health_up.expect("/healthz never answered 200 again"));

    // The replica took over its slots, and has the scripts now (loaded after NOSCRIPT).
    let slot = cluster.keyslot(&holds);
    assert_eq!(cluster.primary_of_slot(slot), replica, "{:?}", cluster.shards());
    assert_eq!(scripts_loaded(cluster.node(replica)), [true, true]);

    let calls: Vec<(Duration, Duration, u16)> = {
        let mut all: Vec<_> = seen.iter().flat_map(|s| s.calls.iter().copied()).collect();
        all.sort();
        all
    };
    let unavailable: Vec<&(Duration, Duration, u16)> = calls.iter().filter(|c| c.2 == 503).collect();
    let first_ok_after = calls.iter().find(|c| c.0 > killed && c.2 == 200).map(|c| c.1).expect("no call succeeded after the kill");
    let last_503 = unavailable.last().map(|c| c.1).unwrap_or(killed);
    let window = first_ok_after.saturating_sub(killed);
    assert!(calls.iter().filter(|c| c.0 > last_503 && c.2 == 200).count() > 10, "calls did not succeed again after the fail-over");

    // Budget exactness: what the clients were told was charged, against the counter on the new
    // primary. A settle the old primary acknowledged but never replicated comes back as an open
    // hold; a reserve it acknowledged but never replicated answers `unknown` at its settle.
    let charged: BTreeMap<&String, u64> = seen.iter().flat_map(|s| s.charged.iter().map(|(k, v)| (k, *v))).collect();
    let client_total: u64 = charged.values().sum();
    let lost_reserves: Vec<&(String, u64)> = seen.iter().flat_map(|s| s.lost_reserves.iter()).collect();
    let open: Vec<String> = cluster.query_key(&holds, &["ZRANGE", &holds, "0", "-1"]);
    let lost_settles: u64 = open.iter().filter_map(|id| charged.get(id)).sum();
    let (used, reserved) = cluster.counter(&format!("t:{{{org}}}:c:budget")).unwrap();
    let refused: u64 = seen.iter().map(|s| s.refused).sum();
    println!(
        "fail-over: primary {victim} killed at {killed:?}; replica {replica} answering {window:?} later (503s from {:?} to {:?}, {} calls answered 503; /healthz 503 from {:?} to {:?}); \
         {} settled pairs, {refused} refused; budget limit {limit}: used {used}, reserved {reserved}, Σ charged by clients {client_total}; \
         lost: {} reserves ({} charged units), {} settles ({lost_settles} units); WAIT 1 per write: {plain:?} → {waited:?} per call",
        unavailable.first().map(|c| c.1.saturating_sub(killed)),
        last_503.saturating_sub(killed),
        unavailable.len(),
        health_down.saturating_sub(killed),
        health_up.saturating_sub(killed),
        charged.len(),
        lost_reserves.len(),
        lost_reserves.iter().map(|r| r.1).sum::<u64>(),
        open.len(),
    );
    assert!(used + reserved <= limit, "used {used} + reserved {reserved} above the limit {limit}");
    assert!(refused > 0, "the budget was never exhausted: the limit {limit} was not reached");
    assert_eq!(used + lost_settles, client_total, "the counter against what the clients were told");
    assert!(window < Duration::from_secs(10), "{window:?}");
}

/// The built binary with `--redis-cluster`, and the flags it refuses.
#[test]
fn the_binary_serves_a_cluster_and_refuses_both_targets() {
    let cluster = Cluster::start(1000);
    let port = common::free_port();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_sluice-ledger"))
        .args(["--listen", &format!("127.0.0.1:{port}"), "--redis-cluster", &cluster.seeds()[..2].join(","), "--prefix", "p"])
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    struct Kill(std::process::Child);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(child.try_wait().unwrap().is_none(), "sluice-ledger exited");
        assert!(Instant::now() < deadline, "sluice-ledger did not listen");
        std::thread::sleep(Duration::from_millis(20));
    }
    let _guard = Kill(child);
    let mut http = Http::new(format!("127.0.0.1:{port}").parse().unwrap());
    assert_eq!(http.get("/healthz").status, 200);
    // Two seeds are enough to reach every primary: one org per shard.
    let orgs: Vec<String> = (0..30).map(|i| format!("o{i}")).collect();
    let mut primaries = BTreeMap::new();
    for org in &orgs {
        primaries.entry(cluster.primary_of(&format!("p:{{{org}}}:holds"))).or_insert(org);
    }
    assert_eq!(primaries.len(), 3);
    for org in primaries.values() {
        assert_eq!(http.ok("/v1/reserve", &reserve("r", org, &[("k", 10, 4)]))["admitted"], json!(true));
        assert_eq!(cluster.counter(&format!("p:{{{org}}}:c:k")), Some((0, 4)));
    }
    for (args, message) in [
        (&["--redis", "redis://127.0.0.1:1/", "--redis-cluster", "redis://127.0.0.1:2"][..], "--redis and --redis-cluster exclude each other"),
        (&["--redis-cluster", "redis://127.0.0.1:2/3"], "only database 0"),
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_sluice-ledger")).args(args).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert!(String::from_utf8_lossy(&out.stderr).contains(message), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    }
}
