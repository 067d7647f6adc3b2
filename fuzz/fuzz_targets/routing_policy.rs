//! model-router's policy decoding (`routing::RoutingPolicy::from_json`) on any bytes, and a
//! compiled policy used: model lookup, and for every model the weights, a sticky and an unkeyed
//! decision (also with every version unhealthy and with a forced version) and shadow sampling, at
//! the epoch, now and the far end of u64 time. A decision names one of the model's versions.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sluice_core::routing::RoutingPolicy;

fuzz_target!(|data: &[u8]| {
    let Ok(policy) = RoutingPolicy::from_json(data) else { return };
    let _ = policy.model_for("gpt-4o");
    let mut header = |_: &str| Some(b"tenant-a".to_vec());
    let mut property = |_: &[String]| None;
    let _ = policy.sticky_key(&mut header, &mut property);
    for (m, route) in policy.models().iter().enumerate().take(8) {
        let _ = policy.model_for(&route.pattern);
        let names: Vec<&str> = route.versions.iter().map(|v| v.name.as_str()).collect();
        for now in [0u64, 1_700_000_000_000_000_000, u64::MAX] {
            let _ = policy.weights_at(m, now);
            let _ = policy.weighted_choice(m, b"key", now);
            for (key, forced, unhealthy) in [
                (Some(&b"key"[..]), None, &[][..]),
                (None, None, &[][..]),
                (Some(&b"key"[..]), names.first().copied(), &[][..]),
                (Some(&b"key"[..]), None, &names[..]),
            ] {
                if let Some(d) = policy.decide(m, key, b"request-1", forced, now, unhealthy) {
                    let chosen = format!("{d:?}");
                    assert!(names.iter().any(|n| chosen.contains(n)), "decision names no version of the model: {chosen}");
                }
            }
        }
        let _ = policy.shadow_sampled(m, b"request-1", Some("t"));
    }
});
