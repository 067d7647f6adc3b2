//! latency-guard's tick, natively. Envoy 1.40's dynamic-module ABI gives an HTTP filter no timer,
//! only a scheduler that posts an event to the stream's worker at once (`scheduler_commit`, callable
//! from any thread). So the module keeps one thread of its own that commits a tick to a guarded
//! stream's scheduler when that stream has something due — the time its guard's root gives for it
//! (`GuardRoot::stream_due_ns`: a deadline, a reset after an error event, the fallback look at a
//! held stream), which the stream sends after each of its hooks ([`set_due`]) — and each stream, on
//! its worker, runs the guard's tick for itself (`GuardRoot::on_tick_stream`), so a deadline's 504,
//! a release or a reset happens in the stream's own callback, with no release queue. At least every
//! [`SWEEP_NS`] one watched stream is ticked even with nothing due, so the root's `after_tick`
//! sweeps the breakers.
//!
//! Only what is due is committed, and the thread is woken only when a stream's due time comes
//! before the one it sleeps until: ticking every guarded stream at the root's period (1 ms while
//! any stream was held) cost Envoy a cross-thread post per stream per tick and a wake-up of this
//! thread at each period change (docs/native.md).
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
use std::time::Duration;

use sluice_core::latency::deadline;

use super::view::now_ns;
use crate::filter::{log, LogLevel, Scheduler};

/// The event id of a tick: the tick's number (so a root can tell a new tick from one it has seen).
pub type Tick = u64;

/// The longest the thread waits while streams are watched: the breakers' sweep (core's
/// `BREAKER_SWEEP_NS`, the idle tick).
pub const SWEEP_NS: u64 = deadline::IDLE_TICK_NS;

/// A due time meaning "nothing due".
const NEVER: u64 = u64::MAX;

struct Ticker {
    /// Ticks so far.
    ticks: AtomicU64,
    /// When the thread next wakes (ns, [`now_ns`]'s clock): a stream whose due time is earlier
    /// wakes it ([`set_due`]).
    wakes_at: AtomicU64,
    state: Mutex<State>,
    changed: Condvar,
}

/// A watched stream: its scheduler and when its tick is due.
struct Entry<S = Scheduler> {
    scheduler: S,
    due_ns: u64,
}

struct State {
    streams: BTreeMap<u32, Entry>,
    /// When a stream was last ticked for the breakers' sweep.
    swept_at: u64,
    /// Configurations with latency-guard alive.
    users: usize,
    /// The run the thread now running belongs to; `None` once it is told to stop. A thread whose
    /// run is not this one ends (so a quick stop and start never leaves two threads ticking).
    run: Option<u64>,
    runs: u64,
    thread: Option<JoinHandle<()>>,
}

static TICKER: Ticker = Ticker {
    ticks: AtomicU64::new(0),
    wakes_at: AtomicU64::new(NEVER),
    state: Mutex::new(State { streams: BTreeMap::new(), swept_at: 0, users: 0, run: None, runs: 0, thread: None }),
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

/// What one wake of the thread does at `now`: the streams to tick (their due times reset to
/// [`NEVER`]: each sends its next one after its tick), whether the sweep's stream is among them,
/// and when to wake next.
fn plan<S>(streams: &mut BTreeMap<u32, Entry<S>>, swept_at: &mut u64, now: u64, out: &mut Vec<u32>) -> u64 {
    out.clear();
    for (id, entry) in streams.iter_mut() {
        if entry.due_ns <= now {
            entry.due_ns = NEVER;
            out.push(*id);
        }
    }
    if now.saturating_sub(*swept_at) >= SWEEP_NS {
        *swept_at = now;
        // One watched stream runs the root's sweep (its `after_tick` runs once per tick number).
        if out.is_empty() {
            out.extend(streams.keys().next().copied());
        }
    }
    let next_due = streams.values().map(|e| e.due_ns).min().unwrap_or(NEVER);
    next_due.min(swept_at.saturating_add(SWEEP_NS))
}

fn tick_thread(run: u64) {
    let mut state = state();
    let mut due = Vec::new();
    loop {
        if state.run != Some(run) {
            return;
        }
        let now = now_ns();
        let st = &mut *state;
        let wake_at = plan(&mut st.streams, &mut st.swept_at, now, &mut due);
        if !due.is_empty() {
            let tick = TICKER.ticks.fetch_add(1, Ordering::Relaxed).saturating_add(1);
            for id in &due {
                if let Some(entry) = state.streams.get(id) {
                    entry.scheduler.commit(tick);
                }
            }
        }
        TICKER.wakes_at.store(wake_at, Ordering::Relaxed);
        let wait = Duration::from_nanos(wake_at.saturating_sub(now_ns()).min(SWEEP_NS));
        if !wait.is_zero() {
            state = TICKER.changed.wait_timeout(state, wait).unwrap_or_else(PoisonError::into_inner).0;
        }
    }
}

/// Ticks stream `id` through `scheduler` from now on (until [`forget`]), when it is due ([`set_due`]).
pub fn watch(id: u32, scheduler: Scheduler) {
    state().streams.insert(id, Entry { scheduler, due_ns: NEVER });
}

/// Stream `id`'s tick is next due at `due_ns` (`None`: nothing due but its end). Wakes the thread
/// only when that is before the time it sleeps until.
pub fn set_due(id: u32, due_ns: Option<u64>) {
    let due_ns = due_ns.unwrap_or(NEVER);
    {
        let mut state = state();
        let Some(entry) = state.streams.get_mut(&id) else { return };
        entry.due_ns = due_ns;
    }
    if due_ns < TICKER.wakes_at.load(Ordering::Relaxed) {
        TICKER.wakes_at.store(due_ns, Ordering::Relaxed);
        TICKER.changed.notify_all();
    }
}

/// Stops ticking stream `id` and deletes its scheduler.
pub fn forget(id: u32) {
    let removed = state().streams.remove(&id);
    drop(removed);
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

    fn streams(dues: &[(u32, u64)]) -> BTreeMap<u32, Entry<()>> {
        dues.iter().map(|&(id, due_ns)| (id, Entry { scheduler: (), due_ns })).collect()
    }

    #[test]
    fn only_the_streams_due_are_ticked_and_the_thread_wakes_at_the_next_due_time() {
        let now = 10 * SWEEP_NS;
        let mut watched = streams(&[(1, now - 5), (2, now + 7_000_000), (3, NEVER), (4, now)]);
        let (mut swept_at, mut out) = (now - 1, Vec::new());
        let wake = plan(&mut watched, &mut swept_at, now, &mut out);
        assert_eq!(out, vec![1, 4]);
        assert_eq!(wake, now + 7_000_000, "stream 2 is next");
        assert!(watched.get(&1).is_some_and(|e| e.due_ns == NEVER), "a ticked stream waits for its next due time");
        assert!(watched.get(&2).is_some_and(|e| e.due_ns == now + 7_000_000));
        // Nothing due: nothing ticked, and the thread sleeps until the next sweep at the latest.
        let mut idle = streams(&[(5, NEVER)]);
        assert_eq!(plan(&mut idle, &mut swept_at, now + 1, &mut out), swept_at + SWEEP_NS);
        assert!(out.is_empty());
    }

    #[test]
    fn a_sweep_ticks_one_stream_when_none_is_due() {
        let now = 10 * SWEEP_NS;
        let mut watched = streams(&[(8, NEVER), (9, NEVER)]);
        let (mut swept_at, mut out) = (now - SWEEP_NS, Vec::new());
        let wake = plan(&mut watched, &mut swept_at, now, &mut out);
        assert_eq!(out, vec![8], "the root's breakers are swept through one watched stream");
        assert_eq!((swept_at, wake), (now, now + SWEEP_NS));
        // A stream due at the sweep is the sweep's stream too: no second one.
        let mut due = streams(&[(8, NEVER), (9, now)]);
        swept_at = now - SWEEP_NS;
        plan(&mut due, &mut swept_at, now, &mut out);
        assert_eq!(out, vec![9]);
    }
}
