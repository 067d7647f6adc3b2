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
//! deleted scheduler, nor a filter Envoy has destroyed (the filter's `on_http_filter_destroy`
//! removes it, and Envoy keeps the filter alive until that hook returns, so the commit's own hold
//! on the filter is never the last one).
//!
//! The thread runs while a configuration with latency-guard lives ([`Users`], one per such
//! configuration): the last one's destruction stops it and joins it, so no thread of the module
//! outlives the configurations that need it (abi.h: a thread that commits must be joined before
//! the workers it posts to go away). Envoy destroys a configuration only after its streams, so the
//! registry is empty by then.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
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
    state: Mutex<State>,
    changed: Condvar,
}

struct State {
    streams: BTreeMap<u32, Scheduler>,
    /// Configurations with latency-guard alive.
    users: usize,
    /// The run the thread now running belongs to; `None` once it is told to stop. A thread whose
    /// run is not this one ends (so a quick stop and start never leaves two threads ticking).
    run: Option<u64>,
    runs: u64,
    thread: Option<JoinHandle<()>>,
}

static TICKER: Ticker = Ticker {
    period_ms: AtomicU64::new(deadline::IDLE_TICK_NS / 1_000_000),
    ticks: AtomicU64::new(0),
    state: Mutex::new(State { streams: BTreeMap::new(), users: 0, run: None, runs: 0, thread: None }),
    changed: Condvar::new(),
};

fn state() -> MutexGuard<'static, State> {
    TICKER.state.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A configuration's use of the tick thread: the thread runs while one exists, and dropping the
/// last stops and joins it.
pub struct Users(());

/// Starts the tick thread if it is not running; it runs until every [`Users`] is dropped.
pub fn start() -> Users {
    let mut state = state();
    state.users += 1;
    if state.run.is_none() {
        state.runs += 1;
        let run = state.runs;
        match std::thread::Builder::new().name("sluice-guard-tick".into()).spawn(move || tick_thread(run)) {
            Ok(thread) => {
                state.run = Some(run);
                // A thread of a run stopped before and not joined yet ends on its own (its run is
                // not the current one); it is detached here.
                state.thread = Some(thread);
            }
            Err(e) => log(LogLevel::Error, &format!("sluice latency-guard: cannot start the tick thread ({e}); deadlines will not fire")),
        }
    }
    Users(())
}

impl Drop for Users {
    fn drop(&mut self) {
        let thread = {
            let mut state = state();
            state.users = state.users.saturating_sub(1);
            if state.users > 0 {
                return;
            }
            // Under the lock the thread commits under: no commit starts after this.
            state.run = None;
            state.thread.take()
        };
        TICKER.changed.notify_all();
        if let Some(thread) = thread {
            // Never the tick thread itself (it destroys no configuration), but a self-join would
            // fail, so it is checked.
            if thread.thread().id() != std::thread::current().id() && thread.join().is_err() {
                log(LogLevel::Error, "sluice latency-guard: the tick thread panicked");
            }
        }
    }
}

fn tick_thread(run: u64) {
    let mut state = state();
    let mut last = Instant::now();
    loop {
        if state.run != Some(run) {
            return;
        }
        let period = Duration::from_millis(TICKER.period_ms.load(Ordering::Relaxed).max(1));
        let due = last + period;
        let now = Instant::now();
        if now < due {
            // Woken early when the period changes or the thread is told to stop: the tick is then
            // due a new period after the last.
            state = TICKER.changed.wait_timeout(state, due - now).unwrap_or_else(PoisonError::into_inner).0;
            continue;
        }
        last = now;
        let tick = TICKER.ticks.fetch_add(1, Ordering::Relaxed).saturating_add(1);
        for scheduler in state.streams.values() {
            scheduler.commit(tick);
        }
    }
}

/// Ticks stream `id` through `scheduler` from now on (until [`forget`]).
pub fn watch(id: u32, scheduler: Scheduler) {
    state().streams.insert(id, scheduler);
}

/// Stops ticking stream `id` and deletes its scheduler.
pub fn forget(id: u32) {
    let removed = state().streams.remove(&id);
    drop(removed);
}

/// Sets the tick period (ms), waking the thread to wait the new one.
pub fn set_period(ms: u64) {
    if TICKER.period_ms.swap(ms, Ordering::Relaxed) != ms {
        TICKER.changed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn running() -> bool {
        let state = state();
        state.run.is_some() && state.thread.as_ref().is_some_and(|t| !t.is_finished())
    }

    #[test]
    fn the_thread_runs_while_a_configuration_uses_it_and_is_joined_after_the_last() {
        let first = start();
        let second = start();
        assert!(running());
        drop(first);
        assert!(running(), "one configuration still uses the tick");
        let thread = state().thread.as_ref().map(|t| t.thread().id());
        drop(second);
        let state = state();
        assert!(state.run.is_none() && state.thread.is_none(), "the last use stops and joins the thread");
        assert!(thread.is_some());
        drop(state);
        // And it starts again for a configuration that comes after (a reload).
        let again = start();
        assert!(running());
        drop(again);
        assert!(!running());
    }
}
