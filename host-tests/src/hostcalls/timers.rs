//! `proxy_set_tick_period_milliseconds`: the root context's timer. Ticks are due at
//! `set time + period`, then every period; [`Gateway::advance`](crate::Gateway::advance) fires each
//! one at its exact virtual time.

use wasmtime::{Caller, Linker, Result};

use super::MODULE;
use crate::abi::{reply, HostcallResult, Status};
use crate::state::HostState;

/// The tick timer of the root context.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Timer {
    pub period_ns: Option<u64>,
    /// Virtual time of the next tick.
    pub next_due_ns: u64,
    /// Ticks delivered so far.
    pub fired: u64,
}

impl Timer {
    /// Starts (or, with 0, stops) ticking every `period_ms` from `now_ns`.
    pub fn set_period(&mut self, period_ms: u32, now_ns: u64) {
        if period_ms == 0 {
            self.period_ns = None;
            return;
        }
        let period = u64::from(period_ms) * 1_000_000;
        self.period_ns = Some(period);
        self.next_due_ns = now_ns + period;
    }

    /// When the next tick is due, if the timer runs.
    pub fn due_ns(&self) -> Option<u64> {
        self.period_ns.map(|_| self.next_due_ns)
    }

    /// Books the tick due at `at_ns` as fired and schedules the next one.
    pub fn fire(&mut self, at_ns: u64) {
        self.fired += 1;
        if let Some(period) = self.period_ns {
            self.next_due_ns = at_ns + period;
        }
    }
}

pub(super) fn add_to_linker(linker: &mut Linker<HostState>) -> Result<()> {
    linker.func_wrap(MODULE, "proxy_set_tick_period_milliseconds", proxy_set_tick_period_milliseconds)?;
    Ok(())
}

fn proxy_set_tick_period_milliseconds(mut caller: Caller<'_, HostState>, period_ms: u32) -> HostcallResult {
    let state = caller.data_mut();
    let now = state.clock.now_ns();
    state.timer.set_period(period_ms, now);
    reply(Status::Ok)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_are_due_one_period_apart() {
        let mut timer = Timer::default();
        assert_eq!(timer.due_ns(), None);
        timer.set_period(100, 1_000);
        assert_eq!(timer.due_ns(), Some(100_001_000));
        timer.fire(100_001_000);
        assert_eq!(timer.due_ns(), Some(200_001_000));
        timer.set_period(0, 0);
        assert_eq!(timer.due_ns(), None);
    }
}
