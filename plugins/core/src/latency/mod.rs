//! The latency guard: per-version rolling latency windows, an SLO circuit breaker with probes and
//! hysteresis, and priority shedding against in-flight limits.
//!
//! - [`sketch`]: bounded-memory quantile sketch with a stated relative error (1 % by default).
//! - [`window`]: rolling window of TTFT / time-per-output-token sketches and error counts, shared
//!   by every worker through a CAS-updated store value.
//! - [`breaker`]: closed → open → half-open state machine per model version, with the numbers that
//!   caused every transition.
//! - [`deadline`]: one stream's TTFT and total deadlines: the phase it is in (awaiting headers,
//!   held, streaming, answered 504, reset, cut by an error event) and the effects each event has.
//! - [`shed`]: priorities (critical, standard, sheddable) and the shedding rule.
//! - [`policy`]: the `latency-guard` policy (JSON), validated with errors that name the field.
//!
//! Host-agnostic like the rest of the crate: time is a nanosecond timestamp the caller passes in,
//! shared state goes through [`crate::store::SharedStore`] and its one CAS loop, [`crate::store::cas_update`].

pub mod breaker;
mod codec;
pub mod deadline;
pub mod policy;
pub mod shed;
pub mod sketch;
pub mod window;

pub use breaker::{Admission, Breaker, BreakerConfig, BreakerState, State, Transition};
pub use deadline::StreamWatch;
pub use policy::{BreakerPolicy, LatencyPolicy, OpenAction, PolicyError, TenantClass, TenantSource, VersionPolicy};
pub use shed::{should_shed, InFlightLimit, Priority};
pub use sketch::{QuantileSketch, SketchParams};
pub use window::{RollingWindow, WindowConfig, WindowStats};

use crate::store::{CasError, StoreError};

/// Why a shared value could not be updated.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UpdateError {
    /// Every compare-and-swap attempt lost to another worker's write.
    #[error("too many concurrent updates of the same shared value")]
    Contended,
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl From<CasError> for UpdateError {
    fn from(e: CasError) -> Self {
        match e {
            CasError::Contended => UpdateError::Contended,
            CasError::Store(e) => UpdateError::Store(e),
        }
    }
}
