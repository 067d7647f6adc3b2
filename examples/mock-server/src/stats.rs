//! Counters of what the mock served, read back with `GET /mock/stats` so a test can check what
//! actually reached the upstream (e.g. that a budget filter stopped a request before it got here).

use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

#[derive(Debug, Default)]
pub struct Stats {
    /// Inference requests received (the four API paths), including ones answered with an error.
    requests: AtomicU64,
    /// Content tokens written to a socket successfully.
    tokens_sent: AtomicU64,
    by_path: Mutex<BTreeMap<String, u64>>,
}

impl Stats {
    pub fn count_request(&self, path: &str) {
        self.requests.fetch_add(1, Ordering::Relaxed);
        // A poisoned lock only means another thread panicked mid-increment; the map is still usable.
        let mut by_path = self.by_path.lock().unwrap_or_else(|e| e.into_inner());
        *by_path.entry(path.to_string()).or_insert(0) += 1;
    }

    pub fn count_tokens(&self, n: u64) {
        self.tokens_sent.fetch_add(n, Ordering::Relaxed);
    }

    pub fn reset(&self) {
        self.requests.store(0, Ordering::Relaxed);
        self.tokens_sent.store(0, Ordering::Relaxed);
        self.by_path.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }

    /// `{"requests": n, "tokens_sent": n, "by_path": {path: n}, "connections": open now,
    /// "connections_accepted": n}`
    pub fn to_json(&self, connections: usize, accepted: u64) -> Value {
        let by_path = self.by_path.lock().unwrap_or_else(|e| e.into_inner()).clone();
        json!({
            "requests": self.requests.load(Ordering::Relaxed),
            "tokens_sent": self.tokens_sent.load(Ordering::Relaxed),
            "by_path": by_path,
            "connections": connections,
            "connections_accepted": accepted,
        })
    }
}
