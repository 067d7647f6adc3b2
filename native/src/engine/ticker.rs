//! latency-guard's tick, natively. Envoy 1.40's dynamic-module ABI gives an HTTP filter no timer,
//! only a scheduler that posts an event to the stream's worker at once (`scheduler_commit`, callable
//! from any thread). So the module keeps one thread of its own: every tick period (the period the
//! guard's root asks for with `SetTickPeriod`, the time until the next deadline or held stream is
//! due) it commits a tick to every guarded stream's scheduler, and each stream, on its worker, runs
//! the guard's tick for itself (`GuardRoot::on_tick_stream`) — so a deadline's 504, a release or a
//! reset happens in the stream's own callback, with no release queue.
//!
//! The schedulers live in one registry behind a mutex: the thread commits while holding it, and a
//! stream removes (and so deletes) its scheduler under the same lock, so no commit reaches a
//! deleted scheduler.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use sluice_core::latency::deadline;

use crate::filter::{log, LogLevel, Scheduler};

/// The event id of a tick: the tick's number (so a root can tell a new tick from one it has seen).
pub type Tick = u64;

struct Ticker {
    /// The period, ms (the guard root's `SetTickPeriod`).
    period_ms: AtomicU64,
    /// Ticks so far.
    ticks: AtomicU64,
    streams: Mutex<BTreeMap<u32, Scheduler>>,
    changed: Condvar,
}

fn ticker() -> &'static Ticker {
    static TICKER: OnceLock<Ticker> = OnceLock::new();
    static STARTED: OnceLock<()> = OnceLock::new();
    let ticker = TICKER.get_or_init(|| Ticker {
        period_ms: AtomicU64::new(deadline::IDLE_TICK_NS / 1_000_000),
        ticks: AtomicU64::new(0),
        streams: Mutex::new(BTreeMap::new()),
        changed: Condvar::new(),
    });
    STARTED.get_or_init(|| {
        let spawned = std::thread::Builder::new().name("sluice-guard-tick".into()).spawn(move || run(ticker));
        if let Err(e) = spawned {
            log(LogLevel::Error, &format!("sluice latency-guard: cannot start the tick thread ({e}); deadlines will not fire"));
        }
    });
    ticker
}

fn run(ticker: &'static Ticker) {
    let mut streams = ticker.streams.lock().unwrap_or_else(PoisonError::into_inner);
    let mut last = Instant::now();
    loop {
        let period = Duration::from_millis(ticker.period_ms.load(Ordering::Relaxed).max(1));
        let due = last + period;
        let now = Instant::now();
        if now < due {
            // Woken early when the period changes: the tick is then due a new period after the last.
            streams = ticker.changed.wait_timeout(streams, due - now).unwrap_or_else(PoisonError::into_inner).0;
            continue;
        }
        last = now;
        let tick = ticker.ticks.fetch_add(1, Ordering::Relaxed).saturating_add(1);
        for scheduler in streams.values() {
            scheduler.commit(tick);
        }
    }
}

/// Ticks stream `id` through `scheduler` from now on (until [`forget`]).
pub fn watch(id: u32, scheduler: Scheduler) {
    let ticker = ticker();
    ticker.streams.lock().unwrap_or_else(PoisonError::into_inner).insert(id, scheduler);
}

/// Stops ticking stream `id` and deletes its scheduler.
pub fn forget(id: u32) {
    let ticker = ticker();
    let removed = ticker.streams.lock().unwrap_or_else(PoisonError::into_inner).remove(&id);
    drop(removed);
}

/// Sets the tick period (ms), waking the thread to wait the new one.
pub fn set_period(ms: u64) {
    let ticker = ticker();
    if ticker.period_ms.swap(ms, Ordering::Relaxed) != ms {
        ticker.changed.notify_all();
    }
}
