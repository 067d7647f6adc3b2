//! Model routing: split accuracy, stickiness, minimal movement when weights change, ramps, override,
//! fallback, unkeyed requests, shadow sampling, policy validation, and the shadow similarity score.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use proptest::prelude::*;
use sluice_core::api::ApiKind;
use sluice_core::routing::similarity::{jaccard_per_mille, response_text, ResponseText, TextPrefix};
use sluice_core::routing::{Reason, RoutingPolicy, ShadowVerdict, StickySource};

const NS: u64 = 1_000_000_000;
/// 2026-11-01T00:00:00Z: before the example ramp.
const NOV1: u64 = 1_793_491_200 * NS;
/// 2026-12-01T00:00:00Z, 12-08, 12-15: the example ramp steps.
const DEC1: u64 = 1_796_083_200 * NS;
const DEC8: u64 = DEC1 + 7 * 86_400 * NS;
const DEC15: u64 = DEC1 + 14 * 86_400 * NS;

/// The policy of the brief (docs/model-router.md's example rollout).
const EXAMPLE: &str = r#"{
  "sticky_key": [ {"header": "x-sluice-tenant"}, {"api_key": true}, {"header": "X-Session-Id"}, {"body_user": true} ],
  "route_header": "x-sluice-route",
  "version_header": "x-model-version",
  "override": { "property": ["metadata", "filter_metadata", "envoy.filters.http.jwt_authn", "force_version"], "client_header": "x-sluice-force-version" },
  "models": [
    { "model": "llama-3-70b*",
      "versions": [
        { "name": "v1", "weight": 99, "upstream_model": "llama-3-70b", "route": "llama-v1" },
        { "name": "v2", "weight": 1, "upstream_model": "llama-3-70b-v2", "route": "llama-v2",
          "ramp": [ {"at": "2026-12-01T00:00:00Z", "weight": 5}, {"at": "2026-12-08T00:00:00Z", "weight": 25}, {"at": "2026-12-15T00:00:00Z", "weight": 100} ] }
      ],
      "fallback": ["v1", "v2"],
      "shadow": { "version": { "name": "qwen-v1", "upstream_model": "qwen-72b", "route": "qwen-v1", "cluster": "qwen_v1", "authority": "qwen.internal" },
                  "fraction": 0.05, "max_concurrent": 8, "exclude_tenants": ["bank-*"], "tenant_header": "x-sluice-tenant" } },
    { "model": "gpt-*", "versions": [ { "name": "only", "weight": 1, "upstream_model": "gpt-4o", "route": "openai" } ] }
  ]
}"#;

fn policy(json: &str) -> RoutingPolicy {
    RoutingPolicy::from_json(json.as_bytes()).unwrap_or_else(|e| panic!("{e}"))
}

/// A one-model policy with versions `(name, weight)` (route = name, upstream = `up-<name>`).
fn split(versions: &[(&str, u64)]) -> RoutingPolicy {
    let vs: Vec<String> = versions.iter().map(|(n, w)| format!(r#"{{"name":"{n}","weight":{w},"upstream_model":"up-{n}","route":"{n}"}}"#)).collect();
    policy(&format!(r#"{{"sticky_key":[{{"header":"x-user"}}],"models":[{{"model":"m","versions":[{}]}}]}}"#, vs.join(",")))
}

fn key(i: usize) -> Vec<u8> {
    format!("user-{i}").into_bytes()
}

const N: usize = 10_000;

/// The version of each of the N keys.
fn assign(p: &RoutingPolicy, now: u64) -> Vec<String> {
    (0..N).map(|i| p.decide(0, Some(&key(i)), b"rid", None, now, &[]).unwrap().version).collect()
}

fn count(assignment: &[String], version: &str) -> usize {
    assignment.iter().filter(|v| *v == version).count()
}

#[test]
fn example_policy_compiles_with_its_accessors() {
    let p = policy(EXAMPLE);
    assert_eq!(
        p.sticky_sources(),
        &[
            StickySource::Header("x-sluice-tenant".into()),
            StickySource::ApiKey,
            StickySource::Header("x-session-id".into()),
            StickySource::Property(vec!["metadata".into(), "filter_metadata".into(), "sluice".into(), "user".into()]),
        ]
    );
    assert_eq!(p.route_header(), "x-sluice-route");
    assert_eq!(p.version_header(), "x-model-version");
    assert_eq!(p.override_property().unwrap()[3], "force_version");
    assert_eq!(p.override_client_header(), Some("x-sluice-force-version"));
    assert_eq!(p.model_for("llama-3-70b"), Some(0));
    assert_eq!(p.model_for("llama-3-70b-instruct"), Some(0));
    assert_eq!(p.model_for("gpt-4o"), Some(1));
    assert_eq!(p.model_for("claude"), None);
    let m = p.model(0).unwrap();
    assert_eq!(m.versions.len(), 2);
    assert_eq!(m.fallback, vec![0, 1]);
    let s = m.shadow.as_ref().unwrap();
    assert_eq!((s.version.cluster.as_str(), s.version.authority.as_str()), ("qwen_v1", "qwen.internal"));
    assert_eq!((s.fraction, s.max_concurrent), (0.05, 8));
    assert_eq!(s.tenant_header.as_deref(), Some("x-sluice-tenant"));
    assert!(p.model(2).is_none());
    assert!(p.decide(2, Some(b"k"), b"r", None, 0, &[]).is_none());
    assert!(p.weights_at(2, 0).is_empty());
    assert_eq!(p.shadow_sampled(1, b"r", None), ShadowVerdict::NotConfigured);
    assert_eq!(p.shadow_sampled(7, b"r", None), ShadowVerdict::NotConfigured);
}

#[test]
fn split_90_10_is_accurate_to_one_percent() {
    let a = assign(&split(&[("v1", 90), ("v2", 10)]), 0);
    let v2 = count(&a, "v2");
    assert!((900..=1100).contains(&v2), "v2 got {v2} of {N}");
    assert_eq!(count(&a, "v1") + v2, N);
}

#[test]
fn split_50_30_20_is_accurate_to_one_and_a_half_percent() {
    let a = assign(&split(&[("a", 50), ("b", 30), ("c", 20)]), 0);
    for (v, share) in [("a", 5000), ("b", 3000), ("c", 2000)] {
        let n = count(&a, v);
        assert!(n.abs_diff(share) <= 150, "{v}: {n} of {N}, expected {share} ± 150");
    }
}

#[test]
fn split_one_percent_canary() {
    let a = assign(&split(&[("v1", 99), ("v2", 1)]), 0);
    let v2 = count(&a, "v2");
    assert!((70..=130).contains(&v2), "v2 got {v2} of {N}");
}

#[test]
fn same_key_same_version_every_time_and_across_compilations() {
    let p1 = split(&[("v1", 50), ("v2", 50)]);
    let p2 = split(&[("v1", 50), ("v2", 50)]);
    for i in 0..50 {
        let first = p1.decide(0, Some(&key(i)), b"r0", None, 0, &[]).unwrap();
        for n in 0..1_000 {
            // Different request ids and times do not matter to a keyed decision.
            let rid = format!("req-{n}");
            let again = p1.decide(0, Some(&key(i)), rid.as_bytes(), None, n * NS, &[]).unwrap();
            assert_eq!(again, first);
        }
        assert_eq!(p2.decide(0, Some(&key(i)), b"other", None, 0, &[]).unwrap(), first);
    }
    // Both versions are used by those keys (the test is not trivially passing).
    let a = assign(&p1, 0);
    assert!(count(&a, "v1") > 4_000 && count(&a, "v2") > 4_000);
}

#[test]
fn assignment_is_pinned() {
    // A change of the hash (or of how it is fed) would reshuffle every user of every deployment;
    // this pins the assignment of the first 32 keys at 50/50.
    let p = split(&[("v1", 50), ("v2", 50)]);
    let got: String = (0..32).map(|i| if p.decide(0, Some(&key(i)), b"", None, 0, &[]).unwrap().version == "v1" { '1' } else { '2' }).collect();
    assert_eq!(got, PINNED);
}
const PINNED: &str = "11212212212112222222111221112121";

#[test]
fn raising_v2_from_10_to_20_percent_only_moves_keys_to_v2() {
    let before = assign(&split(&[("v1", 90), ("v2", 10)]), 0);
    let after = assign(&split(&[("v1", 80), ("v2", 20)]), 0);
    let mut moved = 0;
    for (b, a) in before.iter().zip(&after) {
        if b != a {
            moved += 1;
            assert_eq!((b.as_str(), a.as_str()), ("v1", "v2"), "a key left v2");
        }
    }
    let share = moved as f64 / N as f64;
    eprintln!("10% → 20%: {moved} of {N} keys moved ({:.2}%)", share * 100.0);
    assert!((0.09..=0.105).contains(&share), "moved {share}");
}

#[test]
fn lowering_a_weight_only_moves_keys_away_from_it() {
    let before = assign(&split(&[("a", 50), ("b", 30), ("c", 20)]), 0);
    let after = assign(&split(&[("a", 50), ("b", 10), ("c", 20)]), 0);
    let mut moved = 0;
    for (b, a) in before.iter().zip(&after) {
        if b != a {
            moved += 1;
            assert_eq!(b, "b", "only keys of b may move");
        }
    }
    // b: 30% → 10/80 = 12.5%: ≈ 17.5% of keys move.
    assert!((1_600..=1_900).contains(&moved), "moved {moved}");
}

#[test]
fn adding_a_version_at_10_percent_only_moves_keys_to_it() {
    let before = assign(&split(&[("v1", 900), ("v2", 100)]), 0);
    // Same 9:1 ratio between v1 and v2, plus v3 at 10% of the total.
    let after = assign(&split(&[("v1", 810), ("v2", 90), ("v3", 100)]), 0);
    let mut moved = 0;
    for (b, a) in before.iter().zip(&after) {
        if b != a {
            moved += 1;
            assert_eq!(a, "v3", "a key moved between old versions");
        }
    }
    let share = moved as f64 / N as f64;
    eprintln!("add v3 at 10%: {moved} of {N} keys moved ({:.2}%)", share * 100.0);
    assert!((0.09..=0.11).contains(&share), "moved {share}");
    assert_eq!(moved, count(&after, "v3"));
}

#[test]
fn weight_zero_is_never_chosen() {
    let p = split(&[("a", 1), ("zero", 0), ("b", 1)]);
    let a = assign(&p, 0);
    assert_eq!(count(&a, "zero"), 0);
    assert!(count(&a, "a") > 4_000 && count(&a, "b") > 4_000);
    // Unkeyed too.
    for i in 0..N {
        assert_ne!(p.decide(0, None, &key(i), None, 0, &[]).unwrap().version, "zero");
    }
    // A tiny weight next to a huge one is still chosen sometimes.
    let p = split(&[("big", 1_000_000), ("tiny", 1_000)]);
    let a = assign(&p, 0);
    assert!((1..=30).contains(&count(&a, "tiny")), "{}", count(&a, "tiny"));
}

#[test]
fn ramp_schedule_changes_weights_at_each_step() {
    let p = policy(EXAMPLE);
    let w = |t| p.weights_at(0, t);
    let pair = |v1: u64, v2: u64| vec![("v1".to_string(), v1), ("v2".to_string(), v2)];
    assert_eq!(w(0), pair(99, 1));
    assert_eq!(w(NOV1), pair(99, 1));
    assert_eq!(w(DEC1 - 1), pair(99, 1));
    assert_eq!(w(DEC1), pair(99, 5));
    assert_eq!(w(DEC8 - 1), pair(99, 5));
    assert_eq!(w(DEC8), pair(99, 25));
    assert_eq!(w(DEC15 - 1), pair(99, 25));
    assert_eq!(w(DEC15), pair(99, 100));
    assert_eq!(w(u64::MAX), pair(99, 100));

    // Shares follow, keys only ever move to v2, and v2's reason is "ramp" once a step applies.
    let mut previous: Option<Vec<String>> = None;
    for (t, expected_pct) in [(NOV1, 1.0), (DEC1, 100.0 * 5.0 / 104.0), (DEC8, 100.0 * 25.0 / 124.0), (DEC15, 100.0 * 100.0 / 199.0)] {
        let decisions: Vec<_> = (0..N).map(|i| p.decide(0, Some(&key(i)), b"r", None, t, &[]).unwrap()).collect();
        let v2 = decisions.iter().filter(|d| d.version == "v2").count();
        let pct = v2 as f64 * 100.0 / N as f64;
        assert!((pct - expected_pct).abs() <= 1.5, "at {t}: {pct}% on v2, expected {expected_pct}%");
        for d in &decisions {
            let expected = match (d.version.as_str(), t >= DEC1) {
                ("v2", true) => Reason::Ramp,
                _ => Reason::Weight,
            };
            assert_eq!(d.reason, expected, "{d:?} at {t}");
        }
        let now: Vec<String> = decisions.into_iter().map(|d| d.version).collect();
        if let Some(prev) = &previous {
            for (b, a) in prev.iter().zip(&now) {
                assert!(!(b == "v2" && a == "v1"), "a key left v2 while v2 ramped up");
            }
        }
        previous = Some(now);
    }
}

#[test]
fn a_full_rollout_ramps_the_old_version_down_to_zero() {
    let p = policy(
        r#"{"sticky_key":[{"header":"x-user"}],"models":[{"model":"m","versions":[
          {"name":"old","weight":99,"upstream_model":"o","route":"o","ramp":[{"at":"2026-12-15T00:00:00Z","weight":0}]},
          {"name":"new","weight":1,"upstream_model":"n","route":"n","ramp":[{"at":"2026-12-01T00:00:00Z","weight":50}]}]}]}"#,
    );
    assert_eq!(p.weights_at(0, DEC15), vec![("old".into(), 0), ("new".into(), 50)]);
    for i in 0..1_000 {
        let d = p.decide(0, Some(&key(i)), b"r", None, DEC15, &[]).unwrap();
        assert_eq!((d.version.as_str(), d.reason), ("new", Reason::Ramp));
    }
}

#[test]
fn override_from_the_trusted_source_forces_a_known_version_only() {
    let p = split(&[("v1", 100), ("v2", 0), ("v3", 1)]);
    for i in 0..200 {
        let d = p.decide(0, Some(&key(i)), b"r", Some("v2"), 0, &[]).unwrap();
        assert_eq!((d.version.as_str(), d.upstream_model.as_str(), d.route.as_str()), ("v2", "up-v2", "v2"));
        assert_eq!(d.reason, Reason::Override);
        assert!(!d.override_ignored);
        // Unknown names are ignored: same as no override, flagged.
        let plain = p.decide(0, Some(&key(i)), b"r", None, 0, &[]).unwrap();
        let unknown = p.decide(0, Some(&key(i)), b"r", Some("v9"), 0, &[]).unwrap();
        assert_eq!(unknown.version, plain.version);
        assert_eq!(unknown.reason, Reason::Weight);
        assert!(unknown.override_ignored && !plain.override_ignored);
        // Case matters: "V2" is not "v2".
        assert!(p.decide(0, Some(&key(i)), b"r", Some("V2"), 0, &[]).unwrap().override_ignored);
    }
    // Forced to an unhealthy version: falls back.
    let d = p.decide(0, Some(b"k"), b"r", Some("v2"), 0, &["v2"]).unwrap();
    assert_eq!((d.version.as_str(), d.reason, d.fallback_from.as_deref()), ("v1", Reason::Fallback, Some("v2")));
}

#[test]
fn fallback_skips_unhealthy_versions_in_fallback_order() {
    let p = policy(
        r#"{"sticky_key":[{"header":"x-user"}],"models":[{"model":"m","versions":[
          {"name":"a","weight":1,"upstream_model":"ua","route":"ra"},
          {"name":"b","weight":0,"upstream_model":"ub","route":"rb"},
          {"name":"c","weight":0,"upstream_model":"uc","route":"rc"}],
          "fallback":["c","b","a"]}]}"#,
    );
    let d = p.decide(0, Some(b"k"), b"r", None, 0, &[]).unwrap();
    assert_eq!((d.version.as_str(), d.reason), ("a", Reason::Weight));
    let d = p.decide(0, Some(b"k"), b"r", None, 0, &["a"]).unwrap();
    assert_eq!((d.version.as_str(), d.route.as_str(), d.reason), ("c", "rc", Reason::Fallback));
    assert_eq!(d.fallback_from.as_deref(), Some("a"));
    let d = p.decide(0, Some(b"k"), b"r", None, 0, &["a", "c"]).unwrap();
    assert_eq!((d.version.as_str(), d.reason), ("b", Reason::Fallback));
    // Unhealthy versions that were not chosen change nothing.
    let d = p.decide(0, Some(b"k"), b"r", None, 0, &["b", "c"]).unwrap();
    assert_eq!((d.version.as_str(), d.reason, d.fallback_from), ("a", Reason::Weight, None));
    assert!(p.decide(0, Some(b"k"), b"r", None, 0, &["a", "b", "c"]).is_none());

    // Default order: every version in listed order, weight-0 versions skipped.
    let p = split(&[("x", 1), ("y", 0), ("z", 1)]);
    let on_x = (0..).map(key).find(|k| p.decide(0, Some(k), b"r", None, 0, &[]).unwrap().version == "x").unwrap();
    let d = p.decide(0, Some(&on_x), b"r", None, 0, &["x"]).unwrap();
    assert_eq!((d.version.as_str(), d.reason), ("z", Reason::Fallback));
    assert!(p.decide(0, Some(&on_x), b"r", None, 0, &["x", "z"]).is_none());
}

#[test]
fn unkeyed_requests_split_on_the_request_id() {
    let p = split(&[("v1", 90), ("v2", 10)]);
    let mut v2 = 0;
    for i in 0..N {
        let rid = format!("req-{i}");
        let d = p.decide(0, None, rid.as_bytes(), None, 0, &[]).unwrap();
        assert_eq!(d.reason, Reason::Unkeyed);
        // Same hash as a key with those bytes: deterministic in the request id.
        assert_eq!(d.version, p.decide(0, Some(rid.as_bytes()), b"x", None, 0, &[]).unwrap().version);
        v2 += usize::from(d.version == "v2");
    }
    assert!((900..=1100).contains(&v2), "{v2}");
    // Override and fallback take precedence over "unkeyed".
    assert_eq!(p.decide(0, None, b"r", Some("v2"), 0, &[]).unwrap().reason, Reason::Override);
    let on_v1 = (0..N).map(|i| format!("q{i}")).find(|r| p.decide(0, None, r.as_bytes(), None, 0, &[]).unwrap().version == "v1").unwrap();
    assert_eq!(p.decide(0, None, on_v1.as_bytes(), None, 0, &["v1"]).unwrap().reason, Reason::Fallback);
}

#[test]
fn sticky_key_comes_from_the_first_source_present() {
    let p = policy(EXAMPLE);
    let headers = |pairs: &'static [(&'static str, &'static str)]| move |name: &str| pairs.iter().find(|(n, _)| *n == name).map(|(_, v)| v.as_bytes().to_vec());
    let mut no_props = |_: &[String]| None;
    let mut h = headers(&[("x-sluice-tenant", "acme"), ("authorization", "Bearer sk-1"), ("x-session-id", "s")]);
    let k = p.sticky_key(&mut h, &mut no_props).unwrap();
    assert_eq!((k.source, k.bytes.as_slice()), (0, &b"acme"[..]));
    // Empty tenant header: skipped; the API key is used by its hash, never raw.
    let mut h = headers(&[("x-sluice-tenant", ""), ("authorization", "Bearer sk-1"), ("x-session-id", "s")]);
    let k = p.sticky_key(&mut h, &mut no_props).unwrap();
    assert_eq!(k.source, 1);
    assert_eq!(k.bytes, sluice_core::identity::sha256_hex(b"sk-1").into_bytes());
    let mut h = headers(&[("x-api-key", "sk-ant-2")]);
    assert_eq!(p.sticky_key(&mut h, &mut no_props).unwrap().bytes, sluice_core::identity::sha256_hex(b"sk-ant-2").into_bytes());
    let mut h = headers(&[("authorization", "Basic abc"), ("x-session-id", "sess-9")]);
    let k = p.sticky_key(&mut h, &mut no_props).unwrap();
    assert_eq!((k.source, k.bytes.as_slice()), (2, &b"sess-9"[..]));
    // body_user: the json_to_metadata property.
    let mut h = headers(&[]);
    let mut props = |path: &[String]| (path.join(".") == "metadata.filter_metadata.sluice.user").then(|| b"u-1".to_vec());
    let k = p.sticky_key(&mut h, &mut props).unwrap();
    assert_eq!((k.source, k.bytes.as_slice()), (3, &b"u-1"[..]));
    assert!(p.sticky_key(&mut h, &mut no_props).is_none());
}

#[test]
fn shadow_sampling_follows_the_fraction_deterministically() {
    let p = policy(EXAMPLE);
    let mut sampled = 0;
    for i in 0..N {
        let rid = format!("8d0f3c7e-{i:04}-4b1a-9c2e-request");
        let v = p.shadow_sampled(0, rid.as_bytes(), Some("acme"));
        assert_eq!(v, p.shadow_sampled(0, rid.as_bytes(), Some("acme")));
        assert!(matches!(v, ShadowVerdict::Sampled | ShadowVerdict::NotSampled));
        sampled += usize::from(v == ShadowVerdict::Sampled);
    }
    assert!((425..=575).contains(&sampled), "sampled {sampled} of {N} at 5%");

    // Excluded tenants by glob, whatever the sample; no tenant at all is excluded too (fail closed).
    for i in 0..1_000 {
        let rid = format!("r{i}");
        assert_eq!(p.shadow_sampled(0, rid.as_bytes(), Some("bank-of-x")), ShadowVerdict::ExcludedTenant);
        assert_eq!(p.shadow_sampled(0, rid.as_bytes(), None), ShadowVerdict::ExcludedTenant);
        assert_ne!(p.shadow_sampled(0, rid.as_bytes(), Some("banker")), ShadowVerdict::ExcludedTenant);
    }
    assert_eq!(ShadowVerdict::ExcludedTenant.as_str(), "excluded_tenant");

    let with_fraction = |f: &str| {
        policy(&format!(
            r#"{{"models":[{{"model":"m","versions":[{{"name":"a","weight":1,"upstream_model":"a","route":"a"}}],
               "shadow":{{"version":{{"name":"s","upstream_model":"s","cluster":"c"}},"fraction":{f},"max_concurrent":1}}}}]}}"#
        ))
    };
    let (never, always) = (with_fraction("0"), with_fraction("1.0"));
    for i in 0..N {
        let rid = key(i);
        assert_eq!(never.shadow_sampled(0, &rid, None), ShadowVerdict::NotSampled);
        assert_eq!(always.shadow_sampled(0, &rid, None), ShadowVerdict::Sampled);
    }
    let s = always.model(0).unwrap().shadow.as_ref().unwrap();
    assert_eq!((s.version.route.as_str(), s.version.authority.as_str()), ("s", "c"));
}

fn refused(json: &str) -> String {
    match RoutingPolicy::from_json(json.as_bytes()) {
        Ok(_) => panic!("accepted: {json}"),
        Err(e) => e.to_string(),
    }
}

/// The example with `from` replaced by `to` (which must occur).
fn example_with(from: &str, to: &str) -> String {
    assert!(EXAMPLE.contains(from), "{from}");
    EXAMPLE.replacen(from, to, 1)
}

#[test]
fn policy_errors_name_the_field_and_the_problem() {
    let cases: Vec<(String, &str)> = vec![
        (example_with(r#""weight": 1, "#, r#""weight": 1.5, "#), "models[0].versions[1].weight: must be a whole number 0–1000000, got 1.5"),
        (example_with(r#""weight": 1, "#, r#""weight": -1, "#), "models[0].versions[1].weight: must be a whole number 0–1000000, got -1"),
        (example_with(r#""weight": 99,"#, r#""weight": 1000001,"#), "models[0].versions[0].weight: must be a whole number 0–1000000, got 1000001"),
        (example_with(r#""name": "v2""#, r#""name": "v 2""#), r#"models[0].versions[1].name: must be 1–64 of A–Z a–z 0–9 '_' '.' '-', got "v 2""#),
        (example_with(r#""name": "v2""#, r#""name": "v1""#), r#"models[0].versions[1].name: version "v1" is listed twice"#),
        (
            example_with(r#""route": "llama-v2""#, r#""route": "llama/v2""#),
            r#"models[0].versions[1].route: must be 1–64 of A–Z a–z 0–9 '_' '.' '-', got "llama/v2""#,
        ),
        (
            example_with("2026-12-08T00:00:00Z", "2026-11-30T00:00:00Z"),
            "models[0].versions[1].ramp[1].at: 2026-11-30T00:00:00Z is not after the previous step (2026-12-01T00:00:00Z); steps must be in increasing time",
        ),
        (
            example_with("2026-12-08T00:00:00Z", "2026-12-01T00:00:00Z"),
            "models[0].versions[1].ramp[1].at: 2026-12-01T00:00:00Z is not after the previous step (2026-12-01T00:00:00Z); steps must be in increasing time",
        ),
        (
            example_with("2026-12-08T00:00:00Z", "2026-02-30T00:00:00Z"),
            r#"models[0].versions[1].ramp[1].at: must be a UTC time YYYY-MM-DDTHH:MM:SSZ between 1970 and 2500, got "2026-02-30T00:00:00Z""#,
        ),
        (
            example_with("2026-12-08T00:00:00Z", "2026-12-08T00:00:00+01:00"),
            r#"models[0].versions[1].ramp[1].at: must be a UTC time YYYY-MM-DDTHH:MM:SSZ between 1970 and 2500, got "2026-12-08T00:00:00+01:00""#,
        ),
        (example_with(r#""fallback": ["v1", "v2"]"#, r#""fallback": ["v1", "v3"]"#), r#"models[0].fallback[1]: "v3" is not a version of this model"#),
        (example_with(r#""fallback": ["v1", "v2"]"#, r#""fallback": ["v1", "v1"]"#), r#"models[0].fallback[1]: "v1" is listed twice"#),
        (
            example_with(r#""fallback": ["v1", "v2"]"#, r#""fallback": []"#),
            "models[0].fallback: must list at least one version (omit it for every version in order)",
        ),
        (example_with(r#""fraction": 0.05"#, r#""fraction": 1.5"#), "models[0].shadow.fraction: must be 0–1, got 1.5"),
        (example_with(r#""fraction": 0.05"#, r#""fraction": -0.1"#), "models[0].shadow.fraction: must be 0–1, got -0.1"),
        (example_with(r#""max_concurrent": 8"#, r#""max_concurrent": 0"#), "models[0].shadow.max_concurrent: must be 1–100000, got 0"),
        (
            example_with(r#", "tenant_header": "x-sluice-tenant""#, ""),
            "models[0].shadow.tenant_header: required with exclude_tenants: the header (set by auth in front) that names the tenant",
        ),
        (example_with(r#"["bank-*"]"#, r#"["bank-*", ""]"#), "models[0].shadow.exclude_tenants[1]: must be a glob of 1–256 bytes"),
        (example_with(r#""cluster": "qwen_v1""#, r#""cluster": "qwen v1""#), "models[0].shadow.version.cluster: must not contain whitespace"),
        (
            example_with(r#""upstream_model": "llama-3-70b","#, r#""upstream_model": "","#),
            r#"models[0].versions[0].upstream_model: must be 1–256 bytes without control characters, got """#,
        ),
        (example_with(r#"{"api_key": true}"#, r#"{"api_key": true, "header": "x"}"#), "sticky_key[1]: set exactly one of header, api_key, property, body_user"),
        (example_with(r#"{"api_key": true}"#, r#"{}"#), "sticky_key[1]: set exactly one of header, api_key, property, body_user"),
        (example_with(r#"{"api_key": true}"#, r#"{"api_key": false}"#), "sticky_key[1].api_key: only `true` is meaningful; remove the entry instead"),
        (example_with(r#"{"api_key": true}"#, r#"{"header": "x-sluice-tenant"}"#), "sticky_key[1]: the same source is listed twice"),
        (
            example_with(r#"{"api_key": true}"#, r#"{"header": "x session"}"#),
            r#"sticky_key[1].header: must be an HTTP header name (1–128 token characters), got "x session""#,
        ),
        (example_with(r#"{"api_key": true}"#, r#"{"property": ["metadata", ""]}"#), "sticky_key[1].property[1]: must not be empty"),
        (
            example_with(
                r#""sticky_key": [ {"header": "x-sluice-tenant"}, {"api_key": true}, {"header": "X-Session-Id"}, {"body_user": true} ]"#,
                r#""sticky_key": []"#,
            ),
            r#"sticky_key: list at least one source (omit the field for [{"api_key": true}]); with none every request would be unkeyed"#,
        ),
        (example_with(r#""version_header": "x-model-version""#, r#""version_header": "X-Sluice-Route""#), "version_header: must differ from route_header"),
        (
            example_with(r#""client_header": "x-sluice-force-version""#, r#""client_header": "x-session-id""#),
            r#"override.client_header: "x-session-id" is also a header the policy reads or writes; it would be stripped"#,
        ),
        (
            example_with(r#""model": "gpt-*""#, r#""model": "llama-3-70b*""#),
            r#"models[1].model: "llama-3-70b*" is already matched by models[0] (the first match wins)"#,
        ),
        (
            example_with(r#""weight": 99,"#, r#""weight": 0,"#).replacen(r#""weight": 5}"#, r#""weight": 0}"#, 1),
            "models[0].versions: every version has weight 0 from 2026-12-01T00:00:00Z; at least one must have weight > 0 at all times",
        ),
        (
            example_with(r#""weight": 99,"#, r#""weight": 0,"#).replacen(r#""weight": 1, "#, r#""weight": 0, "#, 1),
            "models[0].versions: every version has weight 0 before any ramp step; at least one must have weight > 0 at all times",
        ),
        (r#"{"models": []}"#.to_string(), "models: list at least one model"),
        (r#"{"models": [{"model": "m", "versions": []}]}"#.to_string(), "models[0].versions: list 1–64 versions, got 0"),
    ];
    assert!(cases.len() >= 8);
    for (json, expected) in cases {
        assert_eq!(refused(&json), expected, "{json}");
    }
    // Unknown fields and wrong types are JSON errors naming the field.
    let e = refused(&example_with(r#""max_concurrent": 8"#, r#""max_concurent": 8"#));
    assert!(e.starts_with("model-router policy is not valid JSON: models[0].shadow.max_concurent: unknown field `max_concurent`"), "{e}");
    let e = refused(&example_with(r#""route_header""#, r#""routeheader""#));
    assert!(e.contains("unknown field `routeheader`"), "{e}");
    assert!(refused("not json").starts_with("model-router policy is not valid JSON"));
}

#[test]
fn reasons_have_stable_labels() {
    let labels: Vec<&str> = Reason::ALL.iter().map(|r| r.as_str()).collect();
    assert_eq!(labels, ["weight", "ramp", "override", "fallback", "unkeyed"]);
    assert_eq!(Reason::Fallback.to_string(), "fallback");
}

proptest! {
    #[test]
    fn decide_never_panics_and_never_picks_weight_zero(
        key in proptest::option::of(proptest::collection::vec(any::<u8>(), 0..64)),
        rid in proptest::collection::vec(any::<u8>(), 0..64),
        forced in proptest::option::of("[a-z0-9]{0,4}"),
        now in any::<u64>(),
        unhealthy_mask in 0u8..16,
    ) {
        let p = split(&[("a", 7), ("b", 0), ("c", 1_000_000), ("d", 1)]);
        let names = ["a", "b", "c", "d"];
        let unhealthy: Vec<&str> = names.iter().enumerate().filter(|(i, _)| unhealthy_mask & (1 << i) != 0).map(|(_, n)| *n).collect();
        let d = p.decide(0, key.as_deref(), &rid, forced.as_deref(), now, &unhealthy);
        if let Some(d) = d {
            prop_assert!(!unhealthy.contains(&d.version.as_str()));
            if d.reason != Reason::Override {
                prop_assert_ne!(d.version.as_str(), "b");
            }
        } else {
            // Only when every eligible version is down.
            prop_assert!(["a", "c", "d"].iter().all(|n| unhealthy.contains(n)) || forced.as_deref() == Some("b"));
        }
        let _ = p.shadow_sampled(0, &rid, forced.as_deref());
    }
}

// ------------------------------------------------------------------------------------------------
// Similarity.

#[test]
fn jaccard_on_known_pairs() {
    assert_eq!(jaccard_per_mille("", ""), 1000);
    assert_eq!(jaccard_per_mille("  ...  ", "!"), 1000);
    assert_eq!(jaccard_per_mille("hello", ""), 0);
    assert_eq!(jaccard_per_mille("", "hello"), 0);
    assert_eq!(jaccard_per_mille("the cat sat", "the cat sat"), 1000);
    assert_eq!(jaccard_per_mille("The cat, sat!", "sat the CAT"), 1000);
    assert_eq!(jaccard_per_mille("the cat sat", "the cat ran"), 500);
    assert_eq!(jaccard_per_mille("a b c", "a b c d"), 750);
    assert_eq!(jaccard_per_mille("a b", "b c"), 333);
    assert_eq!(jaccard_per_mille("a b c", "a d e"), 200);
    assert_eq!(jaccard_per_mille("alpha beta", "gamma delta"), 0);
    // Repetition does not count (sets), Unicode words lowercase.
    assert_eq!(jaccard_per_mille("yes yes yes no", "no yes"), 1000);
    assert_eq!(jaccard_per_mille("Größe ÜBER", "größe über"), 1000);
    assert_eq!(jaccard_per_mille("x1 y2", "x1 y3"), 333);
}

#[test]
fn text_prefix_stops_at_the_cap_on_a_character_boundary() {
    let mut t = TextPrefix::new(5);
    t.push("hé");
    assert!(!t.truncated());
    t.push("llo");
    // "héllo" is 6 bytes: "héll" (5) fits.
    assert_eq!(t.as_str(), "héll");
    assert!(t.truncated());
    t.push("more");
    assert_eq!(t.as_str(), "héll");

    let mut t = TextPrefix::new(2);
    t.push("hé");
    assert_eq!((t.as_str(), t.truncated()), ("h", true));

    let mut t = TextPrefix::new(4);
    t.push("😊😊");
    assert_eq!((t.as_str(), t.truncated()), ("😊", true));

    let mut t = TextPrefix::new(3);
    t.push("abc");
    t.push("");
    assert_eq!((t.as_str(), t.truncated(), t.len()), ("abc", false, 3));
    t.push("d");
    assert!(t.truncated());

    let mut t = TextPrefix::new(0);
    t.push("x");
    assert_eq!((t.as_str(), t.truncated()), ("", true));
}

const CHAT_SSE: &str = "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"finish_reason\":null}],\"usage\":null}\n\n\
data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hello\"},\"finish_reason\":null}],\"usage\":null}\n\n\
: keep-alive\n\n\
data: {\"id\":\"c\",\"choices\":[{\"index\":1,\"delta\":{\"content\":\"OTHER CHOICE\"},\"finish_reason\":null}],\"usage\":null}\n\n\
data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\", wörld \\\"quoted\\\"\"},\"finish_reason\":null}],\"usage\":null}\n\n\
data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"arguments\":\"{}\"}}]},\"finish_reason\":\"stop\"}],\"usage\":null}\n\n\
data: {\"id\":\"c\",\"choices\":[],\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":2,\"total_tokens\":3}}\n\n\
data: [DONE]\n\n";

const CHAT_JSON: &str = r#"{"id":"c","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"Hello, wörld \"quoted\"","refusal":null},"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":2,"total_tokens":3}}"#;

const COMPLETIONS_SSE: &str = "data: {\"id\":\"cmpl\",\"object\":\"text_completion\",\"choices\":[{\"text\":\"Once\",\"index\":0,\"finish_reason\":null}]}\n\n\
data: {\"id\":\"cmpl\",\"object\":\"text_completion\",\"choices\":[{\"text\":\" upon a time\",\"index\":0,\"finish_reason\":\"length\"}]}\n\n\
data: [DONE]\n\n";

const COMPLETIONS_JSON: &str =
    r#"{"id":"cmpl","object":"text_completion","choices":[{"text":"Once upon a time","index":0,"logprobs":null,"finish_reason":"length"}]}"#;

const RESPONSES_SSE: &str = "event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"id\":\"resp\",\"status\":\"in_progress\"}}\n\n\
event: response.reasoning_summary_text.delta\ndata: {\"type\":\"response.reasoning_summary_text.delta\",\"delta\":\"thinking\"}\n\n\
event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"item_id\":\"msg\",\"output_index\":1,\"content_index\":0,\"delta\":\"Paris is\"}\n\n\
event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"item_id\":\"msg\",\"output_index\":1,\"content_index\":0,\"delta\":\" the capital.\"}\n\n\
event: response.output_text.done\ndata: {\"type\":\"response.output_text.done\",\"text\":\"Paris is the capital.\"}\n\n\
event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"id\":\"resp\",\"status\":\"completed\",\"output\":[{\"type\":\"message\",\"content\":[{\"type\":\"output_text\",\"text\":\"Paris is the capital.\"}]}]}}\n\n";

const RESPONSES_JSON: &str = r#"{"id":"resp","object":"response","status":"completed","output":[{"type":"reasoning","id":"rs","summary":[{"type":"summary_text","text":"thinking"}]},{"type":"message","id":"msg","role":"assistant","content":[{"type":"output_text","text":"Paris is the capital.","annotations":[]}]}],"usage":{"input_tokens":5,"output_tokens":6,"total_tokens":11}}"#;

const ANTHROPIC_SSE: &str = "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg\",\"type\":\"message\",\"role\":\"assistant\",\"content\":[],\"usage\":{\"input_tokens\":10,\"output_tokens\":1}}}\n\n\
event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"thinking\",\"thinking\":\"\"}}\n\n\
event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"thinking_delta\",\"thinking\":\"hmm\"}}\n\n\
event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":1,\"delta\":{\"type\":\"text_delta\",\"text\":\"Bonjour\"}}\n\n\
event: ping\ndata: {\"type\": \"ping\"}\n\n\
event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":1,\"delta\":{\"type\":\"text_delta\",\"text\":\" le monde\"}}\n\n\
event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":2,\"delta\":{\"type\":\"input_json_delta\",\"partial_json\":\"{\\\"a\\\"\"}}\n\n\
event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":3,\"delta\":{\"type\":\"text_delta\",\"text\":\"Fin\"}}\n\n\
event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"output_tokens\":5}}\n\n\
event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n";

const ANTHROPIC_JSON: &str = r#"{"id":"msg","type":"message","role":"assistant","model":"claude","content":[{"type":"thinking","thinking":"hmm","signature":"x"},{"type":"text","text":"Bonjour le monde"},{"type":"tool_use","id":"t","name":"f","input":{"a":1}},{"type":"text","text":"Fin"}],"stop_reason":"end_turn","usage":{"input_tokens":10,"output_tokens":5}}"#;

#[test]
fn response_text_for_each_api_kind_streamed_and_not() {
    let cases = [
        (ApiKind::ChatCompletions, CHAT_SSE, "Hello, wörld \"quoted\""),
        (ApiKind::ChatCompletions, CHAT_JSON, "Hello, wörld \"quoted\""),
        (ApiKind::Completions, COMPLETIONS_SSE, "Once upon a time"),
        (ApiKind::Completions, COMPLETIONS_JSON, "Once upon a time"),
        (ApiKind::Responses, RESPONSES_SSE, "Paris is the capital."),
        (ApiKind::Responses, RESPONSES_JSON, "Paris is the capital."),
        (ApiKind::AnthropicMessages, ANTHROPIC_SSE, "Bonjour le monde\nFin"),
        (ApiKind::AnthropicMessages, ANTHROPIC_JSON, "Bonjour le monde\nFin"),
    ];
    for (kind, body, expected) in cases {
        assert_eq!(response_text(kind, body.as_bytes(), 4096), expected, "{kind} {body}");
        // Capped, on a character boundary.
        let capped = response_text(kind, body.as_bytes(), 9);
        assert!(expected.starts_with(&capped) && capped.len() <= 9 && capped.len() >= 8, "{kind}: {capped:?}");
        // Fed in pieces of every size, CRLF line ends: the same text.
        for step in [1, 2, 7, 64] {
            let crlf = body.replace('\n', "\r\n");
            let mut r = ResponseText::new(kind, 4096);
            for chunk in crlf.as_bytes().chunks(step) {
                r.push(chunk);
            }
            r.finish();
            assert_eq!(r.text().as_str(), expected, "{kind} step {step}");
            assert!(!r.text().truncated());
        }
    }
    // Streamed chat content given as parts.
    let parts = "data: {\"choices\":[{\"delta\":{\"content\":[{\"type\":\"text\",\"text\":\"a\"},{\"type\":\"text\",\"text\":\"b\"}]}}]}\n\n";
    assert_eq!(response_text(ApiKind::ChatCompletions, parts.as_bytes(), 100), "ab");
    // Garbage, errors and empty bodies give no text, and never panic.
    for body in ["", "   ", "{", "{\"error\":{\"message\":\"overloaded\"}}", "data: {not json}\n\n", "\u{0}\u{1}", "data: [DONE]\n\n"] {
        for kind in ApiKind::ALL {
            assert_eq!(response_text(kind, body.as_bytes(), 100), "", "{kind} {body:?}");
        }
    }
}

#[test]
fn streaming_json_bodies_over_the_body_cap_give_no_text() {
    let mut r = ResponseText::with_body_cap(ApiKind::ChatCompletions, 100, 64);
    r.push(CHAT_JSON.as_bytes());
    r.finish();
    assert!(r.overflowed());
    assert_eq!(r.text().as_str(), "");
    // A long stream stops being parsed once the text is full.
    let mut r = ResponseText::new(ApiKind::AnthropicMessages, 10);
    for _ in 0..10_000 {
        r.push(b"event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"abc \"}}\n\n");
    }
    r.finish();
    assert_eq!((r.text().as_str(), r.text().truncated()), ("abc abc ab", true));
}

#[test]
fn primary_and_shadow_answers_compare() {
    let primary = response_text(ApiKind::ChatCompletions, CHAT_SSE.as_bytes(), 4096);
    let shadow = response_text(ApiKind::ChatCompletions, CHAT_JSON.as_bytes(), 4096);
    assert_eq!(jaccard_per_mille(&primary, &shadow), 1000);
    let other = response_text(ApiKind::AnthropicMessages, ANTHROPIC_SSE.as_bytes(), 4096);
    assert_eq!(jaccard_per_mille(&primary, &other), 0);
}
