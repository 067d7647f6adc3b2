//! sluice-ledger over HTTP against a real redis-server (docs/ledger.md is the contract).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

mod common;

use common::{ledger, ledger_with_timeout, metric, Http, Redis};
use serde_json::{json, Value};
use std::time::{Duration, Instant};

const FAR: u64 = 4_000_000_000; // expire_at_s far ahead (2096)

fn reserve(id: &str, tag: &str, ttl: u64, counters: &[(&str, u64, u64, u64)]) -> Value {
    let counters: Vec<Value> =
        counters.iter().map(|(key, limit, amount, expire_at_s)| json!({"key": key, "limit": limit, "amount": amount, "expire_at_s": expire_at_s})).collect();
    json!({"id": id, "tag": tag, "hold_ttl_s": ttl, "counters": counters})
}

fn settle(id: &str, tag: &str, charges: &[u64]) -> Value {
    json!({"id": id, "tag": tag, "charges": charges})
}

fn charge(id: &str, tag: &str, counters: &[(&str, u64, u64)]) -> Value {
    let counters: Vec<Value> = counters.iter().map(|(key, amount, expire_at_s)| json!({"key": key, "amount": amount, "expire_at_s": expire_at_s})).collect();
    json!({"id": id, "tag": tag, "counters": counters})
}

fn states(pairs: &[(u64, u64)]) -> Value {
    Value::Array(pairs.iter().map(|(u, r)| json!({"used": u, "reserved": r})).collect())
}

#[test]
fn admission_is_all_or_nothing() {
    let redis = Redis::start();
    let service = ledger(&redis, "t");
    let mut http = Http::new(service.addr);

    // Counter 2 cannot take 60 of 50: nothing is held anywhere, no key is created.
    let refused = http.ok("/v1/reserve", &reserve("r1", "acme", 600, &[("k0", 100, 30, FAR), ("k1", 100, 30, FAR), ("k2", 50, 60, FAR)]));
    assert_eq!(refused, json!({"admitted": false, "refused": 2, "used": 0, "reserved": 0, "limit": 50}));
    for key in ["t:{acme}:c:k0", "t:{acme}:c:k1", "t:{acme}:c:k2", "t:{acme}:h:r1", "t:{acme}:holds"] {
        assert!(!redis.query::<bool>(&["EXISTS", key]), "{key} exists after a refusal");
    }

    let admitted = http.ok("/v1/reserve", &reserve("r2", "acme", 600, &[("k0", 100, 30, FAR), ("k1", 100, 30, FAR)]));
    assert_eq!(admitted, json!({"admitted": true, "replayed": false, "counters": states(&[(0, 30), (0, 30)])}));

    // Exactly at the limit fits; one more does not. The refusal on counter 1 leaves counter 0 as it was.
    let refused = http.ok("/v1/reserve", &reserve("r3", "acme", 600, &[("k0", 100, 70, FAR), ("k1", 100, 71, FAR)]));
    assert_eq!(refused, json!({"admitted": false, "refused": 1, "used": 0, "reserved": 30, "limit": 100}));
    assert_eq!(redis.counter("t:{acme}:c:k0"), Some((0, 30)));
    assert_eq!(redis.counter("t:{acme}:c:k1"), Some((0, 30)));
    let fits = http.ok("/v1/reserve", &reserve("r4", "acme", 600, &[("k0", 100, 70, FAR), ("k1", 100, 70, FAR)]));
    assert_eq!(fits["counters"], states(&[(0, 100), (0, 100)]));

    // used counts too: settle r2 for 10 each, then 20 more fit, 21 do not.
    assert_eq!(http.ok("/v1/settle", &settle("r2", "acme", &[10, 10])), json!({"settled": true, "counters": states(&[(10, 70), (10, 70)])}));
    let refused = http.ok("/v1/reserve", &reserve("r5", "acme", 600, &[("k0", 100, 21, FAR)]));
    assert_eq!(refused, json!({"admitted": false, "refused": 0, "used": 10, "reserved": 70, "limit": 100}));
    assert_eq!(http.ok("/v1/reserve", &reserve("r6", "acme", 600, &[("k0", 100, 20, FAR)]))["counters"], states(&[(10, 90)]));

    // Another tag is another set of counters.
    assert_eq!(http.ok("/v1/reserve", &reserve("r1", "other", 600, &[("k0", 100, 100, FAR)]))["counters"], states(&[(0, 100)]));
    assert_eq!(redis.counter("t:{acme}:c:k0"), Some((10, 90)));

    // The largest amount a Lua number holds exactly is accepted and exact.
    let big = 1u64 << 53;
    assert_eq!(http.ok("/v1/reserve", &reserve("big", "acme", 600, &[("huge", big, big, FAR)]))["counters"], states(&[(0, big)]));
    assert_eq!(http.ok("/v1/reserve", &reserve("big2", "acme", 600, &[("huge", big, 1, FAR)]))["refused"], json!(0));
    assert_eq!(http.ok("/v1/settle", &settle("big", "acme", &[big - 1])), json!({"settled": true, "counters": states(&[(big - 1, 0)])}));
    assert_eq!(redis.counter("t:{acme}:c:huge"), Some((big - 1, 0)));
}

#[test]
fn reserve_and_settle_are_idempotent_per_id() {
    let redis = Redis::start();
    let service = ledger(&redis, "t");
    let mut http = Http::new(service.addr);
    let body = reserve("req-1", "acme", 600, &[("key:a", 5000, 1234, FAR), ("org", 9000, 1234, FAR)]);
    assert_eq!(http.ok("/v1/reserve", &body), json!({"admitted": true, "replayed": false, "counters": states(&[(0, 1234), (0, 1234)])}));
    // A retry holds nothing more.
    assert_eq!(http.ok("/v1/reserve", &body), json!({"admitted": true, "replayed": true, "counters": states(&[(0, 1234), (0, 1234)])}));
    assert_eq!(redis.counter("t:{acme}:c:key:a"), Some((0, 1234)));
    assert_eq!(redis.query::<u64>(&["ZCARD", "t:{acme}:holds"]), 1);

    // Charges must match the hold's counters: refused before anything changes.
    let mismatch = http.post("/v1/settle", &settle("req-1", "acme", &[812]).to_string());
    assert_eq!(mismatch.status, 400, "{}", mismatch.body);
    assert_eq!(mismatch.json()["error"], "charges_mismatch");
    assert_eq!(redis.counter("t:{acme}:c:key:a"), Some((0, 1234)));

    assert_eq!(http.ok("/v1/settle", &settle("req-1", "acme", &[812, 900])), json!({"settled": true, "counters": states(&[(812, 0), (900, 0)])}));
    // A retried settle changes nothing.
    assert_eq!(http.ok("/v1/settle", &settle("req-1", "acme", &[812, 900])), json!({"settled": false, "reason": "already_settled"}));
    assert_eq!(redis.counter("t:{acme}:c:key:a"), Some((812, 0)));
    assert_eq!(redis.counter("t:{acme}:c:org"), Some((900, 0)));
    // A reserve retried after the settle is not admitted again.
    assert_eq!(http.ok("/v1/reserve", &body), json!({"admitted": false, "reason": "already_settled"}));
    assert_eq!(redis.counter("t:{acme}:c:key:a"), Some((812, 0)));
    // The marker lives 2 × the hold TTL; the hold and its index entry are gone.
    let marker_ttl: i64 = redis.query(&["TTL", "t:{acme}:s:req-1"]);
    assert!((1199..=1200).contains(&marker_ttl), "{marker_ttl}");
    assert_eq!(redis.query::<String>(&["GET", "t:{acme}:s:req-1"]), "settled");
    assert!(!redis.query::<bool>(&["EXISTS", "t:{acme}:h:req-1"]));
    assert_eq!(redis.query::<u64>(&["ZCARD", "t:{acme}:holds"]), 0);
    // Never reserved: answered `unknown`, and a tombstone keeps a reservation with that id that
    // arrives later (its caller gave up and released it) from holding anything.
    assert_eq!(http.ok("/v1/settle", &settle("nobody", "acme", &[1])), json!({"settled": false, "reason": "unknown"}));
    assert_eq!(http.ok("/v1/reserve", &reserve("nobody", "acme", 600, &[("key:a", 5000, 100, FAR)])), json!({"admitted": false, "reason": "already_settled"}));
    assert_eq!(redis.counter("t:{acme}:c:key:a"), Some((812, 0)));
    // A charge above the hold (estimate mode) is charged in full.
    http.ok("/v1/reserve", &reserve("req-2", "acme", 600, &[("key:a", 5000, 100, FAR)]));
    assert_eq!(http.ok("/v1/settle", &settle("req-2", "acme", &[150])), json!({"settled": true, "counters": states(&[(962, 0)])}));
}

/// A batch settles each item as `/v1/settle` would, answering each item's status and body in
/// order; a bad item is that item's 400, the others still settle; a malformed or oversized batch is
/// refused whole, before anything changes.
#[test]
fn a_settlement_batch_answers_each_item_as_settle_would() {
    let redis = Redis::start();
    let service = ledger(&redis, "t");
    let mut http = Http::new(service.addr);
    http.ok("/v1/reserve", &reserve("b-1", "acme", 600, &[("key:a", 5000, 100, FAR)]));
    http.ok("/v1/reserve", &reserve("b-2", "globex", 600, &[("key:g", 5000, 200, FAR), ("org", 9000, 200, FAR)]));
    http.ok("/v1/reserve", &reserve("b-3", "acme", 600, &[("key:a", 5000, 300, FAR)]));
    let batch = json!({"settlements": [
        settle("b-1", "acme", &[40]),
        settle("b-2", "globex", &[150, 150]),
        settle("b-3", "acme", &[1, 2]),
        {"id": "b-4", "tag": "acme"},
        settle("never", "acme", &[5]),
        settle("b-1", "acme", &[40]),
    ]});
    let answer = http.ok("/v1/settle_batch", &batch);
    let results = answer["results"].as_array().unwrap();
    assert_eq!(results.len(), 6, "{answer}");
    assert_eq!(results[1], json!({"status": 200, "answer": {"settled": true, "counters": states(&[(150, 0), (150, 0)])}}));
    assert_eq!(results[2]["status"], 400, "{answer}");
    assert_eq!(results[2]["answer"]["error"], "charges_mismatch");
    assert_eq!(results[3]["status"], 400, "{answer}");
    assert_eq!(results[3]["answer"]["error"], "malformed_json");
    assert_eq!(results[4], json!({"status": 200, "answer": {"settled": false, "reason": "unknown"}}));
    // The same hold twice in one batch: one settles it, the other finds it settled (items run at
    // once, so which is which is Redis's order).
    let mut twice = [results[0]["answer"]["settled"].clone(), results[5]["answer"]["settled"].clone()];
    twice.sort_by_key(|v| v.as_bool());
    assert_eq!(twice, [json!(false), json!(true)], "{answer}");
    let settled = if results[0]["answer"]["settled"] == json!(true) { &results[0] } else { &results[5] };
    assert_eq!(*settled, json!({"status": 200, "answer": {"settled": true, "counters": states(&[(40, 300)])}}));
    assert_eq!(redis.counter("t:{acme}:c:key:a"), Some((40, 300)));
    assert_eq!(redis.counter("t:{globex}:c:org"), Some((150, 0)));
    // Each item counts as a settle request; the batch once.
    let text = http.get("/metrics").body;
    assert_eq!(metric(&text, "sluice_ledger_requests_total{endpoint=\"settle\",result=\"settled\"}"), Some(2.0), "{text}");
    assert_eq!(metric(&text, "sluice_ledger_requests_total{endpoint=\"settle\",result=\"bad_request\"}"), Some(2.0), "{text}");
    assert_eq!(metric(&text, "sluice_ledger_requests_total{endpoint=\"settle_batch\",result=\"ok\"}"), Some(1.0), "{text}");

    // Refused whole: not JSON, no items, too many, an unknown field.
    let too_many = json!({"settlements": vec![settle("x", "acme", &[1]); 257]});
    for bad in [String::from("{"), json!({"settlements": []}).to_string(), too_many.to_string(), json!({"settlements": [], "x": 1}).to_string()] {
        let r = http.post("/v1/settle_batch", &bad);
        assert_eq!(r.status, 400, "{bad:.80}: {}", r.body);
    }
    assert_eq!(redis.counter("t:{acme}:c:key:a"), Some((40, 300)));
}

#[test]
fn expired_holds_are_charged_at_their_reserved_amount() {
    let redis = Redis::start();
    let service = ledger(&redis, "t");
    let mut http = Http::new(service.addr);
    // Tag a: swept by the next reserve. Tag b: a settle after expiry. Tag c: more expired holds
    // than one sweep takes (64), the last one found by its settle.
    http.ok("/v1/reserve", &reserve("lost", "a", 1, &[("k", 100, 70, FAR), ("org", 1000, 70, FAR)]));
    http.ok("/v1/reserve", &reserve("late", "b", 1, &[("k", 100, 40, FAR)]));
    for i in 0..65 {
        http.ok("/v1/reserve", &reserve(&format!("h{i:02}"), "c", 1, &[("k", 10_000, 3, FAR)]));
    }
    http.ok("/v1/reserve", &reserve("kept", "a", 600, &[("k", 100, 0, FAR)]));
    std::thread::sleep(Duration::from_millis(1200));

    // The expired hold still counts (70 reserved) until a call sweeps it: this one, which sees it
    // charged at 70 and then holds 30 of what is left.
    assert_eq!(
        http.ok("/v1/reserve", &reserve("next", "a", 600, &[("k", 100, 30, FAR)])),
        json!({"admitted": true, "replayed": false, "counters": states(&[(70, 30)])})
    );
    assert_eq!(redis.counter("t:{a}:c:org"), Some((70, 0)));
    assert_eq!(redis.query::<String>(&["GET", "t:{a}:s:lost"]), "expired");
    assert_eq!(http.ok("/v1/settle", &settle("lost", "a", &[5, 5])), json!({"settled": false, "reason": "expired"}));
    assert_eq!(http.ok("/v1/reserve", &reserve("lost", "a", 600, &[("k", 100, 1, FAR)])), json!({"admitted": false, "reason": "already_settled"}));
    // The live hold was not touched.
    assert_eq!(http.ok("/v1/settle", &settle("kept", "a", &[0])), json!({"settled": true, "counters": states(&[(70, 30)])}));

    assert_eq!(http.ok("/v1/settle", &settle("late", "b", &[10])), json!({"settled": false, "reason": "expired"}));
    assert_eq!(redis.counter("t:{b}:c:k"), Some((40, 0)));

    // h64 expires last; the settle's sweep takes h00..h63, then finds h64 expired itself.
    assert_eq!(http.ok("/v1/settle", &settle("h64", "c", &[1])), json!({"settled": false, "reason": "expired"}));
    assert_eq!(redis.counter("t:{c}:c:k"), Some((65 * 3, 0)));
    assert_eq!(redis.query::<u64>(&["ZCARD", "t:{c}:holds"]), 0);
    assert_eq!(http.ok("/v1/settle", &settle("h00", "c", &[1])), json!({"settled": false, "reason": "expired"}));

    let metrics = http.get("/metrics").body;
    assert_eq!(metric(&metrics, "sluice_ledger_holds_expired_total"), Some(67.0), "{metrics}");
    assert_eq!(metric(&metrics, "sluice_ledger_requests_total{endpoint=\"settle\",result=\"expired\"}"), Some(4.0));
}

/// `/v1/charge` writes back what the plugin's local fallback charged: added to `used` with no
/// limit check, once per id, to the counters whose window is not over.
#[test]
fn a_charge_is_added_without_a_limit_once_per_id() {
    let redis = Redis::start();
    let service = ledger(&redis, "t");
    let mut http = Http::new(service.addr);
    let now = redis.now_s();
    // k held to its limit; the charge still goes in, and creates a counter that did not exist.
    http.ok("/v1/reserve", &reserve("r1", "acme", 600, &[("k", 100, 100, now + 3600)]));
    let charged = http.ok("/v1/charge", &charge("c1", "acme", &[("k", 30, now + 1800), ("new", 7, now + 900)]));
    assert_eq!(charged, json!({"charged": true, "counters": states(&[(30, 100), (7, 0)])}));
    assert_eq!(redis.query::<Vec<Option<String>>>(&["HMGET", "t:{acme}:c:new", "used", "reserved"]), [Some("7".into()), Some("0".into())]);
    // Expiry: max(expire_at_s, what the key had), never shortened.
    assert_eq!(redis.query::<i64>(&["EXPIRETIME", "t:{acme}:c:k"]), (now + 3600) as i64);
    assert_eq!(redis.query::<i64>(&["EXPIRETIME", "t:{acme}:c:new"]), (now + 900) as i64);
    assert!(redis.query::<i64>(&["PTTL", "t:{acme}:c:new"]) <= 900_000);
    // The marker: `charged`, for 2 hours when every window ends sooner, else until the last ends.
    assert_eq!(redis.query::<String>(&["GET", "t:{acme}:s:c1"]), "charged");
    let marker = redis.query::<i64>(&["EXPIRETIME", "t:{acme}:s:c1"]);
    assert!((now as i64 + 7199..=now as i64 + 7201).contains(&marker), "{marker} vs now {now}");
    http.ok("/v1/charge", &charge("c2", "acme", &[("k", 0, now + 10_000)]));
    assert_eq!(redis.query::<i64>(&["EXPIRETIME", "t:{acme}:c:k"]), (now + 10_000) as i64);
    assert_eq!(redis.query::<i64>(&["EXPIRETIME", "t:{acme}:s:c2"]), (now + 10_000) as i64);
    // A settlement under a charge's id finds no hold: `unknown`, and the charge's marker is kept as
    // it was (a tombstone in its place would end its idempotency after two hours).
    assert_eq!(http.ok("/v1/settle", &settle("c2", "acme", &[0]))["reason"], "unknown");
    assert_eq!(redis.query::<String>(&["GET", "t:{acme}:s:c2"]), "charged");
    assert_eq!(redis.query::<i64>(&["EXPIRETIME", "t:{acme}:s:c2"]), (now + 10_000) as i64);
    // Past the limit now: the hold settles on top, and the next reserve is refused.
    assert_eq!(http.ok("/v1/settle", &settle("r1", "acme", &[100])), json!({"settled": true, "counters": states(&[(130, 0)])}));
    let refused = http.ok("/v1/reserve", &reserve("r2", "acme", 600, &[("k", 100, 1, now + 3600)]));
    assert_eq!(refused, json!({"admitted": false, "refused": 0, "used": 130, "reserved": 0, "limit": 100}));

    // The same id again (a retry), an id with a live hold, a settled one, a tombstoned one:
    // `already_charged`, nothing changed.
    http.ok("/v1/reserve", &reserve("held", "acme", 600, &[("other", 100, 10, now + 3600)]));
    assert_eq!(http.ok("/v1/settle", &settle("nobody", "acme", &[0]))["reason"], "unknown");
    for id in ["c1", "held", "r1", "nobody"] {
        let again = http.ok("/v1/charge", &charge(id, "acme", &[("k", 30, now + 1800), ("new", 7, now + 900)]));
        assert_eq!(again, json!({"charged": false, "reason": "already_charged"}), "{id}");
    }
    assert_eq!(redis.counter("t:{acme}:c:k"), Some((130, 0)));
    assert_eq!(redis.counter("t:{acme}:c:new"), Some((7, 0)));
    assert_eq!(redis.query::<String>(&["GET", "t:{acme}:s:nobody"]), "released");

    // A counter whose window is over is skipped: left as it is, or not created.
    let late = http.ok("/v1/charge", &charge("c3", "acme", &[("k", 5, now - 1), ("gone", 9, 1), ("fresh", 4, now + 60)]));
    assert_eq!(late, json!({"charged": true, "counters": states(&[(130, 0), (0, 0), (4, 0)])}));
    assert_eq!(redis.counter("t:{acme}:c:gone"), None);
    assert_eq!(redis.query::<String>(&["GET", "t:{acme}:s:c3"]), "charged");
    // Every key carries the tag.
    let keys = redis.query::<Vec<String>>(&["KEYS", "*"]);
    assert!(keys.iter().all(|k| k.starts_with("t:{acme}:")), "{keys:?}");

    // A charge sweeps the tag's expired holds first, like the other scripts.
    http.ok("/v1/reserve", &reserve("lost", "b", 1, &[("k", 100, 70, FAR)]));
    std::thread::sleep(Duration::from_millis(1200));
    assert_eq!(http.ok("/v1/charge", &charge("c1", "b", &[("k", 5, FAR)]))["counters"], states(&[(75, 0)]));
    assert_eq!(redis.query::<String>(&["GET", "t:{b}:s:lost"]), "expired");

    // Bad bodies are 400s, a wrong method a 405.
    let bad = http.post("/v1/charge", &charge("c4", "acme", &[("k", 1 << 54, FAR)]).to_string());
    assert_eq!((bad.status, bad.json()["error"].clone()), (400, json!("invalid_field")), "{}", bad.body);
    let bad = http.post("/v1/charge", &json!({"id": "c4", "tag": "acme", "counters": [{"key": "k", "amount": 1, "limit": 5, "expire_at_s": FAR}]}).to_string());
    assert_eq!((bad.status, bad.json()["error"].clone()), (400, json!("malformed_json")), "{}", bad.body);
    assert!(!redis.query::<bool>(&["EXISTS", "t:{acme}:s:c4"]));
    assert_eq!(http.get("/v1/charge").status, 405);

    let text = http.get("/metrics").body;
    for (result, n) in [("charged", 4.0), ("already_charged", 4.0), ("bad_request", 2.0), ("unavailable", 0.0), ("error", 0.0)] {
        assert_eq!(metric(&text, &format!("sluice_ledger_requests_total{{endpoint=\"charge\",result=\"{result}\"}}")), Some(n), "{result}: {text}");
    }
    assert_eq!(metric(&text, "sluice_ledger_requests_total{endpoint=\"other\",result=\"method_not_allowed\"}"), Some(1.0));
    assert_eq!(metric(&text, "sluice_ledger_script_seconds_count{script=\"charge\"}"), Some(8.0));
    assert_eq!(metric(&text, "sluice_ledger_holds_expired_total"), Some(1.0));
}

/// A charge while Redis is down is a 503, counted as `unavailable`; its retry charges once.
#[test]
fn a_charge_with_redis_down_is_a_503_and_its_retry_charges_once() {
    let mut redis = Redis::start();
    let service = ledger(&redis, "t");
    let mut http = Http::new(service.addr);
    let body = charge("c1", "acme", &[("k", 12, FAR)]);
    redis.kill();
    let r = http.post("/v1/charge", &body.to_string());
    assert_eq!((r.status, r.json()["error"].clone()), (503, json!("redis_unavailable")), "{}", r.body);
    redis.restart();
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let r = http.post("/v1/charge", &body.to_string());
        if r.status == 200 {
            assert_eq!(r.json(), json!({"charged": true, "counters": states(&[(12, 0)])}));
            break;
        }
        assert_eq!(r.status, 503, "{}", r.body);
        assert!(Instant::now() < deadline, "no recovery after the restart");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(http.ok("/v1/charge", &body), json!({"charged": false, "reason": "already_charged"}));
    assert_eq!(redis.counter("t:{acme}:c:k"), Some((12, 0)));
    let text = http.get("/metrics").body;
    assert!(metric(&text, "sluice_ledger_requests_total{endpoint=\"charge\",result=\"unavailable\"}").unwrap() >= 1.0, "{text}");
}

#[test]
fn counter_keys_expire_at_their_window_end_and_never_earlier() {
    let redis = Redis::start();
    let service = ledger(&redis, "t");
    let mut http = Http::new(service.addr);
    let now = redis.now_s();
    let key = "t:{acme}:c:key:a:0:w1";
    http.ok("/v1/reserve", &reserve("r1", "acme", 600, &[("key:a:0:w1", 100, 10, now + 3600)]));
    assert_eq!(redis.query::<i64>(&["EXPIRETIME", key]), (now + 3600) as i64);
    // A shorter expiry does not shorten it; a longer one extends it.
    http.ok("/v1/reserve", &reserve("r2", "acme", 600, &[("key:a:0:w1", 100, 10, now + 1800)]));
    assert_eq!(redis.query::<i64>(&["EXPIRETIME", key]), (now + 3600) as i64);
    http.ok("/v1/reserve", &reserve("r3", "acme", 600, &[("key:a:0:w1", 100, 10, now + 7200)]));
    assert_eq!(redis.query::<i64>(&["EXPIRETIME", key]), (now + 7200) as i64);
    // A counter never expires before a hold on it: expire_at_s in the past keeps it the hold TTL.
    http.ok("/v1/reserve", &reserve("r4", "acme", 600, &[("old", 100, 10, 1)]));
    let t = redis.query::<i64>(&["EXPIRETIME", "t:{acme}:c:old"]);
    assert!((now as i64 + 600..=now as i64 + 602).contains(&t), "{t} vs now {now}");
    // Holds and the tag's index go when their last counter does.
    assert_eq!(redis.query::<i64>(&["EXPIRETIME", "t:{acme}:h:r3"]), (now + 7200) as i64);
    assert_eq!(redis.query::<i64>(&["EXPIRETIME", "t:{acme}:holds"]), (now + 7200) as i64);
    let hold_ttl = redis.query::<i64>(&["PEXPIRETIME", "t:{acme}:h:r4"]) / 1000;
    assert!((now as i64 + 600..=now as i64 + 602).contains(&hold_ttl), "{hold_ttl}");

    // A window that ends soon really goes: expire_at_s now+1, hold TTL 1, settled at once.
    http.ok("/v1/reserve", &reserve("w", "acme", 1, &[("short", 100, 10, now + 1)]));
    http.ok("/v1/settle", &settle("w", "acme", &[4]));
    assert_eq!(redis.counter("t:{acme}:c:short"), Some((4, 0)));
    let deadline = Instant::now() + Duration::from_secs(4);
    while redis.counter("t:{acme}:c:short").is_some() {
        assert!(Instant::now() < deadline, "counter still there");
        std::thread::sleep(Duration::from_millis(100));
    }
    // A settle arriving after its counter is gone changes nothing (the window is over).
    assert_eq!(redis.counter("t:{acme}:c:short"), None);
}

#[test]
fn concurrent_clients_never_pass_the_limit() {
    const THREADS: usize = 32;
    const PAIRS: usize = 50;
    const LIMIT: u64 = 5_000;
    let redis = Redis::start();
    let service = ledger(&redis, "t");
    let addr = service.addr;
    let redis = &redis;
    let results: Vec<(u64, u64, u64)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..THREADS)
            .map(|t| {
                s.spawn(move || {
                    let mut http = Http::new(addr);
                    let (mut admitted, mut refused, mut charged) = (0u64, 0u64, 0u64);
                    let mut seed = t as u64 * 7919 + 1;
                    for i in 0..PAIRS {
                        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                        let amount = 20 + (seed >> 33) % 41; // 20..=60
                        let id = format!("t{t}-{i}");
                        let key = format!("key:{t}");
                        let answer = http.ok("/v1/reserve", &reserve(&id, "org", 600, &[("org", LIMIT, amount, FAR), (&key, 1_000_000, amount, FAR)]));
                        if answer["admitted"] == json!(true) {
                            let org = &answer["counters"][0];
                            let (used, reserved) = (org["used"].as_u64().unwrap(), org["reserved"].as_u64().unwrap());
                            assert!(used + reserved <= LIMIT, "{answer}");
                            let charge = amount - (i as u64 % 7); // never above the hold (strict mode)
                            let settled = http.ok("/v1/settle", &settle(&id, "org", &[charge, charge]));
                            assert_eq!(settled["settled"], json!(true), "{settled}");
                            assert!(settled["counters"][0]["used"].as_u64().unwrap() <= LIMIT, "{settled}");
                            admitted += 1;
                            charged += charge;
                        } else {
                            assert_eq!(answer["refused"], json!(0), "{answer}");
                            assert!(answer["used"].as_u64().unwrap() + answer["reserved"].as_u64().unwrap() + amount > LIMIT, "{answer}");
                            refused += 1;
                        }
                    }
                    let (key_used, key_reserved) = {
                        let c = redis.counter(&format!("t:{{org}}:c:key:{t}")).unwrap_or((0, 0));
                        (c.0, c.1)
                    };
                    assert_eq!((key_used, key_reserved), (charged, 0), "thread {t}'s own counter");
                    (admitted, refused, charged)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let admitted: u64 = results.iter().map(|r| r.0).sum();
    let refused: u64 = results.iter().map(|r| r.1).sum();
    let charged: u64 = results.iter().map(|r| r.2).sum();
    assert_eq!(admitted + refused, (THREADS * PAIRS) as u64);
    assert!(admitted > 50 && refused > 0, "admitted {admitted}, refused {refused}: the limit was not reached");
    let (used, reserved) = redis.counter("t:{org}:c:org").unwrap();
    assert_eq!((used, reserved), (charged, 0));
    assert!(used <= LIMIT, "{used}");
    // Every hold is settled: nothing left in the index.
    assert_eq!(redis.query::<u64>(&["ZCARD", "t:{org}:holds"]), 0);
    let metrics = Http::new(addr).get("/metrics").body;
    assert_eq!(metric(&metrics, "sluice_ledger_requests_total{endpoint=\"reserve\",result=\"admitted\"}"), Some(admitted as f64));
    assert_eq!(metric(&metrics, "sluice_ledger_requests_total{endpoint=\"settle\",result=\"settled\"}"), Some(admitted as f64));
    assert_eq!(metric(&metrics, "sluice_ledger_script_seconds_count{script=\"reserve\"}"), Some((THREADS * PAIRS) as f64));
}

#[test]
fn counters_and_holds_survive_a_redis_restart_with_persistence() {
    let mut redis = Redis::start_persistent();
    let service = ledger(&redis, "t");
    let mut http = Http::new(service.addr);
    http.ok("/v1/reserve", &reserve("done", "acme", 600, &[("k", 1000, 300, FAR)]));
    http.ok("/v1/settle", &settle("done", "acme", &[120]));
    http.ok("/v1/reserve", &reserve("open", "acme", 600, &[("k", 1000, 500, FAR)]));

    // SIGKILL: only what the append-only file holds comes back.
    redis.restart();
    assert_eq!(redis.counter("t:{acme}:c:k"), Some((120, 500)));
    // The same service instance carries on (new connection, scripts loaded again after NOSCRIPT).
    let deadline = Instant::now() + Duration::from_secs(3);
    let replay = loop {
        let r = http.post("/v1/reserve", &reserve("open", "acme", 600, &[("k", 1000, 500, FAR)]).to_string());
        if r.status == 200 {
            break r.json();
        }
        assert_eq!(r.status, 503, "{}", r.body);
        assert!(Instant::now() < deadline, "no recovery after the restart");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(replay, json!({"admitted": true, "replayed": true, "counters": states(&[(120, 500)])}));
    assert_eq!(http.ok("/v1/settle", &settle("done", "acme", &[120])), json!({"settled": false, "reason": "already_settled"}));
    assert_eq!(http.ok("/v1/reserve", &reserve("more", "acme", 600, &[("k", 1000, 381, FAR)]))["refused"], json!(0));
    assert_eq!(http.ok("/v1/settle", &settle("open", "acme", &[499])), json!({"settled": true, "counters": states(&[(619, 0)])}));
    assert_eq!(http.ok("/v1/reserve", &reserve("more", "acme", 600, &[("k", 1000, 381, FAR)]))["counters"], states(&[(619, 381)]));
}

#[test]
fn redis_down_answers_503_within_the_timeout_and_recovers() {
    let mut redis = Redis::start();
    let service = ledger_with_timeout(&redis, "t", Duration::from_millis(200));
    let mut http = Http::new(service.addr);
    http.ok("/v1/reserve", &reserve("a", "acme", 600, &[("k", 1000, 1, FAR)]));

    // A paused Redis (accepts, never answers): the timeout answers.
    redis.signal("-STOP");
    let started = Instant::now();
    let r = http.post("/v1/reserve", &reserve("b", "acme", 600, &[("k", 1000, 1, FAR)]).to_string());
    let took = started.elapsed();
    assert_eq!(r.status, 503, "{}", r.body);
    assert_eq!(r.json()["error"], "redis_unavailable");
    assert!(took >= Duration::from_millis(190) && took < Duration::from_millis(600), "{took:?}");
    let started = Instant::now();
    assert_eq!(http.get("/healthz").status, 503);
    assert!(started.elapsed() < Duration::from_millis(600));
    redis.signal("-CONT");
    let deadline = Instant::now() + Duration::from_secs(3);
    while http.get("/healthz").status != 200 {
        assert!(Instant::now() < deadline, "no recovery after SIGCONT");
        std::thread::sleep(Duration::from_millis(20));
    }
    // The reserve that timed out may or may not have run; either way its retry is safe.
    let b = http.ok("/v1/reserve", &reserve("b", "acme", 600, &[("k", 1000, 1, FAR)]));
    assert_eq!(b["admitted"], json!(true));
    assert_eq!(redis.counter("t:{acme}:c:k"), Some((0, 2)));

    // Gone (connection refused): 503 at once.
    redis.kill();
    for _ in 0..3 {
        let started = Instant::now();
        let r = http.post("/v1/settle", &settle("a", "acme", &[1]).to_string());
        assert_eq!(r.status, 503, "{}", r.body);
        assert!(started.elapsed() < Duration::from_millis(300), "{:?}", started.elapsed());
    }
    let metrics = http.get("/metrics").body;
    assert_eq!(metric(&metrics, "sluice_ledger_redis_up"), Some(0.0));
    assert_eq!(metric(&metrics, "sluice_ledger_requests_total{endpoint=\"settle\",result=\"unavailable\"}"), Some(3.0));
    assert!(metric(&metrics, "sluice_ledger_redis_errors_total{kind=\"timeout\"}").unwrap() >= 1.0);
    assert!(metric(&metrics, "sluice_ledger_redis_errors_total{kind=\"connection\"}").unwrap() >= 3.0);

    // Back (empty: no persistence here), and the same service instance uses it.
    redis.restart();
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let r = http.post("/v1/reserve", &reserve("c", "acme", 600, &[("k", 1000, 5, FAR)]).to_string());
        if r.status == 200 {
            assert_eq!(r.json(), json!({"admitted": true, "replayed": false, "counters": states(&[(0, 5)])}));
            break;
        }
        assert_eq!(r.status, 503, "{}", r.body);
        assert!(Instant::now() < deadline, "no recovery after the restart");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(http.get("/healthz").status, 200);
    assert_eq!(metric(&http.get("/metrics").body, "sluice_ledger_redis_up"), Some(1.0));
}

#[test]
fn bad_requests_get_400_with_a_json_error() {
    let redis = Redis::start();
    let service = ledger(&redis, "t");
    let mut http = Http::new(service.addr);
    let good = reserve("r1", "acme", 600, &[("k", 100, 10, FAR)]).to_string();
    let counter = json!({"key": "k", "limit": 100, "amount": 1, "expire_at_s": FAR});
    let many: Vec<Value> = (0..65).map(|i| json!({"key": format!("k{i}"), "limit": 100, "amount": 1, "expire_at_s": FAR})).collect();
    let cases: Vec<(&str, String, &str)> = vec![
        ("/v1/reserve", "{\"id\":".into(), "malformed_json"),
        ("/v1/reserve", "".into(), "malformed_json"),
        ("/v1/reserve", good.replace("\"acme\"", "42"), "malformed_json"),
        ("/v1/reserve", good.replace("10", "\"10\""), "malformed_json"),
        ("/v1/reserve", good.replace("10", "-10"), "malformed_json"),
        ("/v1/reserve", good.replace("10", "10.5"), "malformed_json"),
        ("/v1/reserve", good.replace("\"id\"", "\"ID\""), "malformed_json"),
        ("/v1/reserve", good.replace("100", "9007199254740993"), "invalid_field"),
        ("/v1/reserve", good.replace("\"acme\"", "\"ac{me\""), "invalid_field"),
        ("/v1/reserve", good.replace("\"r1\"", "\"r\\n1\""), "invalid_field"),
        ("/v1/reserve", good.replace("\"r1\"", &format!("\"{}\"", "r".repeat(200))), "invalid_field"),
        ("/v1/reserve", json!({"id": "r", "tag": "t", "hold_ttl_s": 600, "counters": many}).to_string(), "invalid_field"),
        ("/v1/reserve", json!({"id": "r", "tag": "t", "hold_ttl_s": 600, "counters": [counter, counter]}).to_string(), "invalid_field"),
        ("/v1/reserve", format!("{{\"pad\":\"{}\"}}", "x".repeat(70 * 1024)), "body_too_large"),
        ("/v1/settle", "[]".into(), "malformed_json"),
        ("/v1/settle", json!({"id": "r", "tag": "t", "charges": [1.5]}).to_string(), "malformed_json"),
        ("/v1/settle", json!({"id": "r", "tag": "t", "charges": []}).to_string(), "invalid_field"),
        ("/v1/settle", json!({"id": "r", "tag": "t", "charges": [1u64 << 54]}).to_string(), "invalid_field"),
    ];
    for (path, body, code) in &cases {
        let r = http.post(path, body);
        assert_eq!(r.status, 400, "{path} {body:.200}: {}", r.body);
        assert_eq!(r.json()["error"], *code, "{path} {body:.200}: {}", r.body);
        assert!(r.json()["message"].as_str().is_some_and(|m| !m.is_empty()));
    }
    let form = http.request("POST", "/v1/reserve", &[("content-type", "application/x-www-form-urlencoded")], good.as_bytes());
    assert_eq!((form.status, form.json()["error"].clone()), (400, json!("unsupported_media_type")));
    // Without a content type the body is still read as JSON.
    assert_eq!(http.request("POST", "/v1/reserve", &[], good.as_bytes()).status, 200);
    assert_eq!(http.get("/v1/reserve").status, 405);
    assert_eq!(http.get("/nope").status, 404);
    // Nothing of the bad requests reached Redis.
    assert_eq!(redis.query::<Vec<String>>(&["KEYS", "*"]).len(), 3, "{:?}", redis.query::<Vec<String>>(&["KEYS", "*"]));
    let metrics = http.get("/metrics").body;
    assert_eq!(metric(&metrics, "sluice_ledger_requests_total{endpoint=\"reserve\",result=\"bad_request\"}"), Some(15.0));
    assert_eq!(metric(&metrics, "sluice_ledger_requests_total{endpoint=\"settle\",result=\"bad_request\"}"), Some(4.0));
}

/// The built binary: its flags, and one log line per Redis state change.
#[test]
fn the_binary_serves_with_its_flags_and_logs_state_changes_once() {
    let mut redis = Redis::start();
    let port = common::free_port();
    let log = redis.dir.join("ledger.log");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_sluice-ledger"))
        .args(["--listen", &format!("127.0.0.1:{port}"), "--redis", &redis.url(), "--prefix", "p2", "--redis-timeout-ms", "300", "--threads", "2"])
        .stderr(std::fs::File::create(&log).unwrap())
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
        if let Ok(Some(status)) = child.try_wait() {
            panic!("sluice-ledger exited with {status}: {}", std::fs::read_to_string(&log).unwrap_or_default());
        }
        assert!(Instant::now() < deadline, "sluice-ledger did not listen");
        std::thread::sleep(Duration::from_millis(20));
    }
    let _guard = Kill(child);
    let mut http = Http::new(format!("127.0.0.1:{port}").parse().unwrap());
    for i in 0..5 {
        http.ok("/v1/reserve", &reserve(&format!("r{i}"), "acme", 600, &[("k", 100, 1, FAR)]));
    }
    assert_eq!(redis.counter("p2:{acme}:c:k"), Some((0, 5)));
    redis.kill();
    for _ in 0..3 {
        assert_eq!(http.get("/healthz").status, 503);
    }
    redis.restart();
    let deadline = Instant::now() + Duration::from_secs(3);
    while http.get("/healthz").status != 200 {
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(20));
    }
    for i in 0..3 {
        http.ok("/v1/reserve", &reserve(&format!("s{i}"), "acme", 600, &[("k", 100, 1, FAR)]));
    }
    let text = std::fs::read_to_string(&log).unwrap();
    let states: Vec<&str> = text.lines().filter(|l| l.contains("reachable")).map(|l| if l.contains("unreachable") { "down" } else { "up" }).collect();
    assert_eq!(states, ["up", "down", "up"], "{text}");
    assert!(text.contains("listening on http://127.0.0.1:"), "{text}");

    let bad = std::process::Command::new(env!("CARGO_BIN_EXE_sluice-ledger")).args(["--threads", "0"]).output().unwrap();
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--threads"));
}
