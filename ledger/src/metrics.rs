//! Prometheus counters and a latency histogram, as plain atomics rendered in the text format.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// `(endpoint, result)` pairs of `sluice_ledger_requests_total`.
const REQUESTS: &[(&str, &str)] = &[
    ("reserve", "admitted"),
    ("reserve", "replayed"),
    ("reserve", "refused"),
    ("reserve", "already_settled"),
    ("reserve", "bad_request"),
    ("reserve", "unavailable"),
    ("reserve", "error"),
    ("settle", "settled"),
    ("settle", "already_settled"),
    ("settle", "expired"),
    ("settle", "unknown"),
    ("settle", "bad_request"),
    ("settle", "unavailable"),
    ("settle", "error"),
    ("charge", "charged"),
    ("charge", "already_charged"),
    ("charge", "bad_request"),
    ("charge", "unavailable"),
    ("charge", "error"),
    // A batch counts once here; each of its settlements counts under `settle`.
    ("settle_batch", "ok"),
    ("settle_batch", "bad_request"),
    ("healthz", "ok"),
    ("healthz", "unavailable"),
    ("metrics", "ok"),
    ("other", "not_found"),
    ("other", "method_not_allowed"),
];

/// `kind` values of `sluice_ledger_redis_errors_total`.
pub const ERROR_KINDS: &[&str] = &["timeout", "connection", "unavailable", "script"];

/// Scripts whose latency is measured.
pub const SCRIPTS: &[&str] = &["reserve", "settle", "charge"];

/// Upper bounds of the latency histogram, in microseconds.
const BUCKETS_US: &[u64] = &[100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 500_000, 1_000_000];

struct Histogram {
    buckets: Vec<AtomicU64>,
    sum_us: AtomicU64,
    count: AtomicU64,
}

impl Histogram {
    fn new() -> Self {
        Histogram { buckets: BUCKETS_US.iter().map(|_| AtomicU64::new(0)).collect(), sum_us: AtomicU64::new(0), count: AtomicU64::new(0) }
    }

    fn observe(&self, elapsed: Duration) {
        let us = u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX);
        for (bound, bucket) in BUCKETS_US.iter().zip(&self.buckets) {
            if us <= *bound {
                bucket.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.sum_us.fetch_add(us, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }
}

pub struct Metrics {
    requests: Vec<AtomicU64>,
    redis_errors: Vec<AtomicU64>,
    scripts: Vec<Histogram>,
    holds_expired: AtomicU64,
    redis_up: AtomicU64,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            requests: REQUESTS.iter().map(|_| AtomicU64::new(0)).collect(),
            redis_errors: ERROR_KINDS.iter().map(|_| AtomicU64::new(0)).collect(),
            scripts: SCRIPTS.iter().map(|_| Histogram::new()).collect(),
            holds_expired: AtomicU64::new(0),
            redis_up: AtomicU64::new(0),
        }
    }
}

fn bump(list: &[AtomicU64], index: Option<usize>) {
    if let Some(counter) = index.and_then(|i| list.get(i)) {
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

impl Metrics {
    pub fn request(&self, endpoint: &str, result: &str) {
        bump(&self.requests, REQUESTS.iter().position(|(e, r)| *e == endpoint && *r == result));
    }

    pub fn redis_error(&self, kind: &str) {
        bump(&self.redis_errors, ERROR_KINDS.iter().position(|k| *k == kind));
    }

    pub fn script_latency(&self, script: &str, elapsed: Duration) {
        if let Some(h) = SCRIPTS.iter().position(|s| *s == script).and_then(|i| self.scripts.get(i)) {
            h.observe(elapsed);
        }
    }

    pub fn holds_expired(&self, n: u64) {
        self.holds_expired.fetch_add(n, Ordering::Relaxed);
    }

    pub fn set_redis_up(&self, up: bool) {
        self.redis_up.store(u64::from(up), Ordering::Relaxed);
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::with_capacity(4096);
        let _ = writeln!(out, "# HELP sluice_ledger_requests_total Requests answered, by endpoint and result.");
        let _ = writeln!(out, "# TYPE sluice_ledger_requests_total counter");
        for ((endpoint, result), n) in REQUESTS.iter().zip(&self.requests) {
            let _ = writeln!(out, "sluice_ledger_requests_total{{endpoint=\"{endpoint}\",result=\"{result}\"}} {}", n.load(Ordering::Relaxed));
        }
        let _ = writeln!(out, "# HELP sluice_ledger_redis_errors_total Redis calls that failed: timeout, connection (refused, reset, dropped), unavailable (LOADING, BUSY, OOM, READONLY and the like), script (any other error).");
        let _ = writeln!(out, "# TYPE sluice_ledger_redis_errors_total counter");
        for (kind, n) in ERROR_KINDS.iter().zip(&self.redis_errors) {
            let _ = writeln!(out, "sluice_ledger_redis_errors_total{{kind=\"{kind}\"}} {}", n.load(Ordering::Relaxed));
        }
        let _ = writeln!(out, "# HELP sluice_ledger_holds_expired_total Holds that reached their TTL unsettled and were charged at their reserved amount.");
        let _ = writeln!(out, "# TYPE sluice_ledger_holds_expired_total counter");
        let _ = writeln!(out, "sluice_ledger_holds_expired_total {}", self.holds_expired.load(Ordering::Relaxed));
        let _ = writeln!(out, "# HELP sluice_ledger_redis_up 1 when the last Redis call of this instance succeeded.");
        let _ = writeln!(out, "# TYPE sluice_ledger_redis_up gauge");
        let _ = writeln!(out, "sluice_ledger_redis_up {}", self.redis_up.load(Ordering::Relaxed));
        let _ = writeln!(
            out,
            "# HELP sluice_ledger_script_seconds Time of one script call as this instance sees it (connection, round trip, script), successful or not."
        );
        let _ = writeln!(out, "# TYPE sluice_ledger_script_seconds histogram");
        for (script, h) in SCRIPTS.iter().zip(&self.scripts) {
            for (bound, bucket) in BUCKETS_US.iter().zip(&h.buckets) {
                let le = *bound as f64 / 1e6;
                let _ = writeln!(out, "sluice_ledger_script_seconds_bucket{{script=\"{script}\",le=\"{le}\"}} {}", bucket.load(Ordering::Relaxed));
            }
            let count = h.count.load(Ordering::Relaxed);
            let _ = writeln!(out, "sluice_ledger_script_seconds_bucket{{script=\"{script}\",le=\"+Inf\"}} {count}");
            let _ = writeln!(out, "sluice_ledger_script_seconds_sum{{script=\"{script}\"}} {}", h.sum_us.load(Ordering::Relaxed) as f64 / 1e6);
            let _ = writeln!(out, "sluice_ledger_script_seconds_count{{script=\"{script}\"}} {count}");
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counts_and_cumulative_buckets() {
        let m = Metrics::default();
        m.request("reserve", "admitted");
        m.request("reserve", "admitted");
        m.request("nope", "nope");
        m.redis_error("timeout");
        m.script_latency("reserve", Duration::from_micros(300));
        let text = m.render();
        assert!(text.contains("sluice_ledger_requests_total{endpoint=\"reserve\",result=\"admitted\"} 2\n"), "{text}");
        assert!(text.contains("sluice_ledger_redis_errors_total{kind=\"timeout\"} 1\n"));
        assert!(text.contains("sluice_ledger_script_seconds_bucket{script=\"reserve\",le=\"0.00025\"} 0\n"));
        assert!(text.contains("sluice_ledger_script_seconds_bucket{script=\"reserve\",le=\"0.0005\"} 1\n"));
        assert!(text.contains("sluice_ledger_script_seconds_bucket{script=\"reserve\",le=\"+Inf\"} 1\n"));
        assert!(text.contains("sluice_ledger_script_seconds_count{script=\"settle\"} 0\n"));
        m.request("charge", "already_charged");
        assert!(m.render().contains("sluice_ledger_requests_total{endpoint=\"charge\",result=\"already_charged\"} 1\n"));
        assert!(m.render().contains("sluice_ledger_script_seconds_count{script=\"charge\"} 0\n"));
    }
}
