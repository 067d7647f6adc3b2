//! Fuzz request inspection for every API kind: any bytes must give `Ok` or an error, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sluice_core::api::ApiKind;
use sluice_core::request::{inspect_request, ContextBucket};

fuzz_target!(|data: &[u8]| {
    for kind in ApiKind::ALL {
        if let Ok(info) = inspect_request(kind, data) {
            let _ = ContextBucket::from_tokens(info.prompt_tokens_estimate).as_str();
        }
    }
    if let Ok(path) = std::str::from_utf8(data) {
        let _ = ApiKind::from_path(path);
    }
});
