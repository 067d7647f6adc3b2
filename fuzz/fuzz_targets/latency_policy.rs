//! latency-guard's policy decoding (`latency::LatencyPolicy::from_json`) on any bytes, and a
//! compiled policy used: tenants classified, every version's store keys and in-flight limit, and
//! every breaker and window built from the policy fed a few samples and evaluated, also at the far
//! end of u64 time. A policy the decoder accepts must never make them panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sluice_core::latency::{should_shed, Breaker, LatencyPolicy, Priority, RollingWindow};

fuzz_target!(|data: &[u8]| {
    let Ok(policy) = LatencyPolicy::from_json(data) else { return };
    for tenant in [None, Some(""), Some("t"), Some("critical")] {
        let _ = policy.classify(tenant);
    }
    for class in &policy.classes {
        for tenant in &class.tenants {
            let _ = policy.classify(Some(tenant));
        }
    }
    for v in policy.versions.iter().take(8) {
        assert_eq!(policy.version(&v.name).map(|p| p.name.as_str()), Some(v.name.as_str()));
        let _ = (v.window_key(), v.breaker_key(), v.in_flight_key());
        if let Some(limit) = &v.in_flight {
            for p in [Priority::Critical, Priority::Standard, Priority::Sheddable] {
                let _ = should_shed(p, limit.limit, limit);
                let _ = should_shed(p, u64::MAX, limit);
            }
        }
        if let Some(b) = &v.breaker {
            for p in [Priority::Critical, Priority::Standard, Priority::Sheddable] {
                let _ = b.action(p);
            }
            let mut window = RollingWindow::new(b.window.clone());
            let mut breaker = Breaker::new(b.config.clone());
            for (i, now) in [1u64, 1_000_000_000, 1 << 62, u64::MAX - 1].into_iter().enumerate() {
                window.record(now, Some(i as u64 * 1000), Some(u64::MAX), i % 2 == 0);
                let _ = breaker.evaluate(now, &window.snapshot(now));
                let _ = breaker.admit(now);
                let _ = breaker.retry_after_s(now);
            }
            let _ = Breaker::decode(b.config.clone(), data);
        }
    }
});
