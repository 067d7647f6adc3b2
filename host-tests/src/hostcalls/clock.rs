//! The virtual clock and `proxy_get_current_time_nanoseconds`.
//!
//! Time only moves when the test says so ([`Gateway::advance`](crate::Gateway::advance)). The same
//! clock backs the WASI wall and monotonic clocks, so a plugin that reads `std::time` by mistake
//! still sees virtual time.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use wasmtime::{Caller, Linker, Result};
use wasmtime_wasi::{HostMonotonicClock, HostWallClock};

use super::MODULE;
use crate::abi::{reply, HostcallResult, Status};
use crate::guest;
use crate::state::HostState;

/// 2026-01-01T00:00:00Z, where every gateway's clock starts unless told otherwise.
pub const DEFAULT_EPOCH_NS: u64 = 1_767_225_600 * 1_000_000_000;

/// Nanoseconds since the Unix epoch, shared by the host state and the WASI clocks of one gateway.
#[derive(Clone, Debug)]
pub(crate) struct VirtualClock(Arc<AtomicU64>);

impl VirtualClock {
    pub fn starting_at(ns: u64) -> Self {
        Self(Arc::new(AtomicU64::new(ns)))
    }

    pub fn now_ns(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }

    pub fn set_ns(&self, ns: u64) {
        self.0.store(ns, Ordering::SeqCst);
    }
}

impl HostWallClock for VirtualClock {
    fn resolution(&self) -> Duration {
        Duration::from_nanos(1)
    }

    fn now(&self) -> Duration {
        Duration::from_nanos(self.now_ns())
    }
}

impl HostMonotonicClock for VirtualClock {
    fn resolution(&self) -> u64 {
        1
    }

    fn now(&self) -> u64 {
        self.now_ns()
    }
}

pub(super) fn add_to_linker(linker: &mut Linker<HostState>) -> Result<()> {
    linker.func_wrap(MODULE, "proxy_get_current_time_nanoseconds", proxy_get_current_time_nanoseconds)?;
    Ok(())
}

fn proxy_get_current_time_nanoseconds(mut caller: Caller<'_, HostState>, time_out: u32) -> HostcallResult {
    let now = caller.data().clock.now_ns();
    guest::write_u64(&mut caller, time_out, now)?;
    reply(Status::Ok)
}
