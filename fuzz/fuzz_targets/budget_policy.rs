//! tenant-budget's policy decoding (`budget::Policy::from_json`) on any bytes, and a compiled
//! policy used: every key admits a demand (of input-chosen size) and settles it on an in-memory
//! store, at a time after the Unix epoch and at the far end of u64. A policy the decoder accepts
//! must never make admission or settlement panic (an overflow is a panic here).
#![no_main]

use libfuzzer_sys::fuzz_target;
use sluice_core::budget::admission::Demand;
use sluice_core::budget::Policy;
use sluice_core::store::MemoryStore;
use sluice_core::usage::Usage;

fuzz_target!(|data: &[u8]| {
    let Ok(policy) = Policy::from_json(data) else { return };
    // Sizes from the input's last bytes, so the fuzzer can steer them too.
    let size = |i: usize| data.iter().rev().nth(i).map_or(1, |&b| u64::from(b) << (b % 40));
    let model = policy.prices.is_empty().then(|| "m".to_owned());
    for key in 0..policy.keys.len().min(8) {
        let id = policy.keys[key].id.clone();
        assert_eq!(policy.key_by_id(&id).map(|k| policy.keys[k].id.as_str()), Some(id.as_str()));
        for now_ns in [1_700_000_000_000_000_000u64, u64::MAX - 1] {
            let mut store = MemoryStore::default();
            let demand = Demand { input_tokens: size(0), output_tokens: size(1), choices: size(2).max(1), model: model.clone(), identity: None };
            for admit in [Policy::admit, Policy::admit_fallback] {
                if let Ok(admission) = admit(&policy, &mut store, key, &demand, now_ns) {
                    let used = Usage { input_tokens: size(3), output_tokens: size(4), ..Usage::default() };
                    let _ = policy.settle(&mut store, &admission, &used, now_ns);
                }
            }
        }
    }
    let _ = policy.key_by_api_key_hash("00");
});
