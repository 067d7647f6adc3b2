//! The SLO circuit breaker of one model version: closed → open → half-open → closed.
//!
//! - **Closed → Open** when an objective (TTFT at a percentile ≤ X ms, time per output token at the
//!   percentile ≤ Y ms, errors ≤ Z ‰) is breached over the window, each objective judged only with at
//!   least `min_samples` samples of its own kind (requests for the error rate, TTFTs for TTFT…).
//!   A breaker that has just closed stays closed for `open_for` at least (its minimum dwell).
//! - **Open → HalfOpen** once it has been open `open_for`. The transition asks the caller to reset
//!   the version's window ([`Transition::reset_window`]), so that the probes are judged on their own
//!   rather than on the samples that opened it.
//! - **HalfOpen** admits `probe_percent` % of the traffic ([`Breaker::admit`]). Once `probes`
//!   samples are in, it reopens at once if any objective is breached, closes when every objective
//!   holds with hysteresis (`value ≤ objective × (1 − hysteresis)`), and otherwise keeps probing.
//!
//! Why it does not flap: to close, probes must be better than the objective by the hysteresis
//! margin; open lasts `open_for`, and closed lasts at least `open_for` too. A latency oscillating
//! around the objective therefore changes the breaker's routing at most once per `open_for`, and an
//! oscillation narrower than the hysteresis band, once at all.
//!
//! Every transition carries a human-readable reason with the numbers that caused it, for the log.
//! The state is 18 bytes ([`Breaker::encode`]), shared by every worker through a CAS-updated store
//! value ([`update`]), so exactly one worker makes (and logs) each transition.

use super::window::WindowStats;
use super::UpdateError;
use crate::store::{cas_update, SharedStore, Step, StoreError, Updated};
use std::fmt::Write as _;

const FORMAT_VERSION: u8 = 1;
const NS_PER_MS: u64 = 1_000_000;

/// Breaker state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum State {
    #[default]
    Closed,
    Open,
    HalfOpen,
}

impl State {
    /// Label for metrics and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            State::Closed => "closed",
            State::Open => "open",
            State::HalfOpen => "half_open",
        }
    }

    /// Gauge value: 0 closed, 1 open, 2 half-open.
    pub fn code(self) -> u8 {
        match self {
            State::Closed => 0,
            State::Open => 1,
            State::HalfOpen => 2,
        }
    }

    /// The state a gauge value stands for ([`State::code`]).
    pub fn from_code(code: u8) -> Option<State> {
        match code {
            0 => Some(State::Closed),
            1 => Some(State::Open),
            2 => Some(State::HalfOpen),
            _ => None,
        }
    }
}

/// The breaker's objectives and timing (compiled from the policy, which validates them; the
/// breaker itself never panics on any values).
#[derive(Debug, Clone, PartialEq)]
pub struct BreakerConfig {
    /// The percentile the latency objectives are read at, e.g. 95.
    pub percentile: f64,
    /// TTFT objective, µs.
    pub ttft_us: Option<u64>,
    /// Time-per-output-token objective, µs.
    pub tpot_us: Option<u64>,
    /// Error-rate objective, errors per thousand requests.
    pub error_per_mille: Option<u32>,
    /// Samples an objective needs before it can open the breaker.
    pub min_samples: u64,
    /// How long the breaker stays open before probing; also the least time it stays closed.
    pub open_for_ns: u64,
    /// Closing needs every objective met with this margin (percent).
    pub hysteresis_percent: u32,
    /// Share of traffic admitted as probes while half-open (percent).
    pub probe_percent: u32,
    /// Samples the probes need before half-open decides.
    pub probes: u64,
}

impl BreakerConfig {
    fn quantile(&self) -> f64 {
        (self.percentile / 100.0).clamp(0.0, 1.0)
    }

    fn close_limit(&self, limit: u64) -> u64 {
        let keep = 100u64.saturating_sub(u64::from(self.hysteresis_percent));
        u64::try_from(u128::from(limit) * u128::from(keep) / 100).unwrap_or(u64::MAX)
    }
}

/// What a breaker remembers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BreakerState {
    pub state: State,
    /// When the current state was entered.
    pub since_ns: u64,
    /// A closed breaker does not open before this (its minimum dwell after closing).
    pub hold_closed_until_ns: u64,
}

/// One change of state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transition {
    pub from: State,
    pub to: State,
    pub at_ns: u64,
    /// For the log: what was measured and against which threshold.
    pub reason: String,
    /// The caller must empty the version's window as of `at_ns` ([`super::window::reset_since`]):
    /// set when probing starts.
    pub reset_window: bool,
}

/// Whether a request may go to the version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Closed: normal traffic.
    Pass,
    /// Half-open: this request is a probe.
    Probe,
    /// Open (or half-open and not picked as a probe): apply the priority's action while open.
    Blocked,
}

/// A breaker: its configuration and state.
#[derive(Debug, Clone, PartialEq)]
pub struct Breaker {
    config: BreakerConfig,
    state: BreakerState,
}

/// One objective as measured (formatted only when a transition needs its reason).
enum Measured {
    Latency { name: &'static str, value: u64, limit: u64, close: u64 },
    Errors { errors: u64, samples: u64, per_mille: u32 },
    Short { name: &'static str, have: u64, needed: u64 },
}

struct Check {
    /// Enough samples to judge.
    judged: bool,
    breached: bool,
    /// Meets the objective with the hysteresis margin.
    healthy: bool,
    measured: Measured,
}

/// What a judgement was made on: finished requests (errors, time per output token) and TTFTs, which
/// may include streams still running (recorded at their first token).
fn counts(stats: &WindowStats) -> String {
    format!("{} finished requests, {} TTFTs", stats.samples, stats.ttft.count())
}

fn ms(us: u64) -> String {
    format!("{}.{} ms", us / 1000, (us % 1000) / 100)
}

fn limit_ms(us: u64) -> String {
    if us.checked_rem(1000) == Some(0) {
        format!("{} ms", us / 1000)
    } else {
        ms(us)
    }
}

/// `n` in decimal, as `u128`'s `Display` writes it, through `u64`'s: the only `u128` the filters
/// printed, which carried `u128`'s formatter (1.5 KB of the playground's page) for values that
/// pass `u64` only when errors outnumber samples.
fn decimal(n: u128) -> String {
    const E19: u128 = 10_000_000_000_000_000_000;
    match u64::try_from(n) {
        Ok(n) => n.to_string(),
        Err(_) => format!("{}{:019}", decimal(n / E19), u64::try_from(n % E19).unwrap_or(0)),
    }
}

impl Breaker {
    pub fn new(config: BreakerConfig) -> Breaker {
        Breaker { config, state: BreakerState::default() }
    }

    pub fn with_state(config: BreakerConfig, state: BreakerState) -> Breaker {
        Breaker { config, state }
    }

    pub fn config(&self) -> &BreakerConfig {
        &self.config
    }

    pub fn state(&self) -> BreakerState {
        self.state
    }

    fn measure(&self, stats: &WindowStats, needed: u64) -> ([Option<Check>; 3], usize) {
        let c = &self.config;
        let q = c.quantile();
        let latency = |name: &'static str, limit: Option<u64>, sketch: &super::sketch::QuantileSketch| -> Option<Check> {
            let limit = limit?;
            let have = sketch.count();
            Some(match sketch.quantile(q) {
                Some(value) if have >= needed => {
                    let close = c.close_limit(limit);
                    Check { judged: true, breached: value > limit, healthy: value <= close, measured: Measured::Latency { name, value, limit, close } }
                }
                _ => Check { judged: false, breached: false, healthy: false, measured: Measured::Short { name, have, needed } },
            })
        };
        let errors = c.error_per_mille.map(|z| {
            let (e, n) = (u128::from(stats.errors), u128::from(stats.samples));
            let keep = u128::from(100u32.saturating_sub(c.hysteresis_percent));
            if stats.samples >= needed && stats.samples > 0 {
                Check {
                    judged: true,
                    breached: e * 1000 > u128::from(z) * n,
                    healthy: e * 1000 * 100 <= u128::from(z) * keep * n,
                    measured: Measured::Errors { errors: stats.errors, samples: stats.samples, per_mille: z },
                }
            } else {
                Check { judged: false, breached: false, healthy: false, measured: Measured::Short { name: "errors", have: stats.samples, needed } }
            }
        });
        let checks = [latency("ttft", c.ttft_us, &stats.ttft), latency("tpot", c.tpot_us, &stats.tpot), errors];
        let n = checks.iter().flatten().count();
        (checks, n)
    }

    /// The measurements as text; `closing`: show the close thresholds of what is not breached.
    fn describe(&self, checks: &[Option<Check>; 3], closing: bool) -> String {
        let c = &self.config;
        let mut parts = Vec::with_capacity(3);
        for check in checks.iter().flatten() {
            let op = |bad: bool| if bad { ">" } else { "≤" };
            parts.push(match check.measured {
                Measured::Short { name, have, needed } => format!("{name}: {have} of {needed} samples needed"),
                Measured::Latency { name, value, limit, close } if closing && !check.breached => format!(
                    "{name} p{} {} {} {} (objective {} − {} %)",
                    c.percentile,
                    ms(value),
                    op(!check.healthy),
                    limit_ms(close),
                    limit_ms(limit),
                    c.hysteresis_percent
                ),
                Measured::Latency { name, value, limit, .. } => {
                    format!("{name} p{} {} {} {}", c.percentile, ms(value), op(check.breached), limit_ms(limit))
                }
                Measured::Errors { errors, samples, per_mille } => {
                    // Tenths of a per-mille, for display.
                    let tenths = (u128::from(errors) * 10_000).checked_div(u128::from(samples)).unwrap_or(0);
                    let shown = format!("errors {errors}/{samples} = {}.{}‰", decimal(tenths / 10), u8::try_from(tenths % 10).unwrap_or(0));
                    if closing && !check.breached {
                        let close_tenths = u64::from(per_mille) * 100u64.saturating_sub(u64::from(c.hysteresis_percent)) / 10;
                        format!(
                            "{shown} {} {}.{}‰ (objective {per_mille}‰ − {} %)",
                            op(!check.healthy),
                            close_tenths / 10,
                            close_tenths % 10,
                            c.hysteresis_percent
                        )
                    } else {
                        format!("{shown} {} {per_mille}‰", op(check.breached))
                    }
                }
            });
        }
        parts.join(", ")
    }

    fn go(&mut self, to: State, now_ns: u64, reason: String) -> Transition {
        let from = self.state.state;
        self.state.state = to;
        self.state.since_ns = now_ns;
        if to == State::Closed {
            self.state.hold_closed_until_ns = now_ns.saturating_add(self.config.open_for_ns);
        }
        Transition { from, to, at_ns: now_ns, reason, reset_window: to == State::HalfOpen }
    }

    /// Advances the state machine with the version's current window. Call it at every completion
    /// (after recording it) and at every admission: there only time can change the state (open →
    /// half-open), so `WindowStats::default()` will do and the window need not be read.
    pub fn evaluate(&mut self, now_ns: u64, stats: &WindowStats) -> Option<Transition> {
        let window_s = stats.window_ns / 1_000_000_000;
        match self.state.state {
            State::Closed => {
                if now_ns < self.state.hold_closed_until_ns {
                    return None;
                }
                let (checks, _) = self.measure(stats, self.config.min_samples.max(1));
                if !checks.iter().flatten().any(|c| c.breached) {
                    return None;
                }
                let reason = format!("objective breached in the last {window_s} s ({}): {}", counts(stats), self.describe(&checks, false));
                Some(self.go(State::Open, now_ns, reason))
            }
            State::Open => {
                let open = now_ns.saturating_sub(self.state.since_ns);
                if open < self.config.open_for_ns {
                    return None;
                }
                let mut reason = format!(
                    "open for {} ms; probing {} % of traffic, deciding after {} samples",
                    open / NS_PER_MS,
                    self.config.probe_percent,
                    self.config.probes
                );
                let c = &self.config;
                let mut goals = Vec::new();
                if let Some(t) = c.ttft_us {
                    goals.push(format!("ttft p{} ≤ {}", c.percentile, limit_ms(c.close_limit(t))));
                }
                if let Some(t) = c.tpot_us {
                    goals.push(format!("tpot p{} ≤ {}", c.percentile, limit_ms(c.close_limit(t))));
                }
                if let Some(z) = c.error_per_mille {
                    let tenths = u64::from(z) * 100u64.saturating_sub(u64::from(c.hysteresis_percent)) / 10;
                    goals.push(format!("errors ≤ {}.{}‰", tenths / 10, tenths % 10));
                }
                if !goals.is_empty() {
                    let _ = write!(reason, "; closing needs {}", goals.join(", "));
                }
                Some(self.go(State::HalfOpen, now_ns, reason))
            }
            State::HalfOpen => {
                if self.probes_on_a_stale_window(stats) {
                    return None;
                }
                let (checks, n) = self.measure(stats, self.config.probes.max(1));
                if checks.iter().flatten().any(|c| c.breached) {
                    let reason = format!("probes breached the objective ({}): {}", counts(stats), self.describe(&checks, true));
                    return Some(self.go(State::Open, now_ns, reason));
                }
                if n > 0 && checks.iter().flatten().all(|c| c.judged && c.healthy) {
                    let reason = format!("probes healthy ({}): {}", counts(stats), self.describe(&checks, true));
                    return Some(self.go(State::Closed, now_ns, reason));
                }
                None
            }
        }
    }

    /// Half-open, and `stats` are of a window not emptied since probing began: it still holds the
    /// samples that opened the breaker (a worker read it just before another's transition emptied
    /// it), so there is nothing to judge yet, and the window is to be emptied as of `since_ns`.
    pub fn probes_on_a_stale_window(&self, stats: &WindowStats) -> bool {
        self.state.state == State::HalfOpen && stats.started_ns < self.state.since_ns
    }

    /// Whether a request may go to the version. `draw` is any per-request number spread evenly (a
    /// hash of the request id); a half-open breaker admits it as a probe when `draw % 100` is below
    /// `probe_percent`. Call [`Breaker::evaluate`] first, so an expired open state is half-open.
    pub fn admit(&self, draw: u64) -> Admission {
        match self.state.state {
            State::Closed => Admission::Pass,
            State::Open => Admission::Blocked,
            State::HalfOpen if draw % 100 < u64::from(self.config.probe_percent) => Admission::Probe,
            State::HalfOpen => Admission::Blocked,
        }
    }

    /// `retry-after` for a refused request, whole seconds: the rest of the open time (at least 1),
    /// 1 while half-open, 0 when closed.
    pub fn retry_after_s(&self, now_ns: u64) -> u64 {
        match self.state.state {
            State::Closed => 0,
            State::HalfOpen => 1,
            State::Open => {
                let end = self.state.since_ns.saturating_add(self.config.open_for_ns);
                end.saturating_sub(now_ns).div_ceil(1_000_000_000).max(1)
            }
        }
    }

    /// The state as 18 bytes: version, state, since, hold-closed-until.
    pub fn encode(&self) -> Vec<u8> {
        encode_state(&self.state)
    }

    /// A breaker of `config` in the state `bytes` hold; `None` for bytes this version did not write.
    pub fn decode(config: BreakerConfig, bytes: &[u8]) -> Option<Breaker> {
        decode_state(bytes).map(|state| Breaker { config, state })
    }
}

pub fn encode_state(state: &BreakerState) -> Vec<u8> {
    let mut out = Vec::with_capacity(18);
    out.push(FORMAT_VERSION);
    out.push(state.state.code());
    out.extend_from_slice(&state.since_ns.to_le_bytes());
    out.extend_from_slice(&state.hold_closed_until_ns.to_le_bytes());
    out
}

pub fn decode_state(bytes: &[u8]) -> Option<BreakerState> {
    let mut r = super::codec::Reader::new(bytes);
    if r.u8()? != FORMAT_VERSION {
        return None;
    }
    let state = State::from_code(r.u8()?)?;
    let since_ns = r.u64_le()?;
    let hold_closed_until_ns = r.u64_le()?;
    r.is_empty().then_some(BreakerState { state, since_ns, hold_closed_until_ns })
}

/// A request's probe draw for [`Breaker::admit`]: FNV-1a of its request id (or, without one, of
/// the stream's context id), high bits mixed down so that `draw % 100` does not depend on the last
/// byte alone. Deterministic per request: latency-guard and the playground pick the same probes.
pub fn probe_draw(request_id: &str, context_id: u32) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let id_bytes = context_id.to_le_bytes();
    let bytes: &[u8] = if request_id.is_empty() { &id_bytes } else { request_id.as_bytes() };
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h ^ (h >> 29)
}

/// Reads the shared breaker (closed when absent or unreadable).
pub fn read(store: &mut dyn SharedStore, key: &str, config: &BreakerConfig) -> Result<Breaker, StoreError> {
    let (bytes, _) = store.get(key)?;
    let state = bytes.as_deref().and_then(decode_state).unwrap_or_default();
    Ok(Breaker::with_state(config.clone(), state))
}

/// Creates the shared breaker state (closed) if it does not exist; `true` when it did. Call at
/// configure time, before traffic, for the reason given at [`super::window::ensure`].
pub fn ensure(store: &mut dyn SharedStore, key: &str) -> Result<bool, StoreError> {
    if let (None, _) = store.get(key)? {
        store.set(key, &encode_state(&BreakerState::default()), 0)?;
        return Ok(true);
    }
    Ok(false)
}

/// Evaluates the shared breaker and writes a transition with compare-and-swap (retrying at most
/// [`crate::store::MAX_CAS_ATTEMPTS`] times, re-evaluating on the state another worker wrote). The worker whose
/// write lands gets the [`Transition`]; the others see the new state without one.
pub fn update(
    store: &mut dyn SharedStore,
    key: &str,
    config: &BreakerConfig,
    now_ns: u64,
    stats: &WindowStats,
) -> Result<(Breaker, Option<Transition>), UpdateError> {
    let written = cas_update(store, key, |bytes| {
        let Some(bytes) = bytes else { return Step::Create(encode_state(&BreakerState::default())) };
        let state = decode_state(bytes).unwrap_or_default();
        let mut breaker = Breaker::with_state(config.clone(), state);
        match breaker.evaluate(now_ns, stats) {
            Some(transition) => Step::Write(breaker.encode(), (breaker, Some(transition))),
            None => Step::Stop((breaker, None)),
        }
    })?;
    match written {
        Updated::Written(done) | Updated::Stopped(done) => Ok(done),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::latency::sketch::{QuantileSketch, SketchParams};

    const MS: u64 = 1_000_000;

    #[test]
    fn decimal_writes_what_u128_display_writes() {
        for n in [
            0,
            9,
            10,
            999,
            u128::from(u64::MAX),
            u128::from(u64::MAX) + 1,
            10_000_000_000_000_000_000,
            10_000_000_000_000_000_007 * 3,
            u128::MAX / 7,
            u128::MAX,
        ] {
            assert_eq!(decimal(n), n.to_string());
        }
    }

    fn config() -> BreakerConfig {
        BreakerConfig {
            percentile: 95.0,
            ttft_us: Some(500_000),
            tpot_us: None,
            error_per_mille: Some(20),
            min_samples: 50,
            open_for_ns: 30_000 * MS,
            hysteresis_percent: 10,
            probe_percent: 10,
            probes: 20,
        }
    }

    fn stats(n: u64, ttft_us: u64, errors: u64) -> WindowStats {
        let mut ttft = QuantileSketch::new(SketchParams::DEFAULT);
        ttft.add_n(ttft_us, n);
        WindowStats {
            samples: n,
            errors,
            error_rate_per_mille: errors * 1000 / n.max(1),
            ttft,
            tpot: QuantileSketch::new(SketchParams::DEFAULT),
            window_ns: 60_000 * MS,
            started_ns: 0,
        }
    }

    #[test]
    fn opens_only_with_enough_samples_and_says_why() {
        let mut b = Breaker::new(config());
        assert_eq!(b.evaluate(1, &stats(49, 900_000, 0)), None);
        let t = b.evaluate(2, &stats(50, 612_300, 1)).unwrap();
        assert_eq!((t.from, t.to), (State::Closed, State::Open));
        assert_eq!(t.reason, "objective breached in the last 60 s (50 finished requests, 50 TTFTs): ttft p95 612.3 ms > 500 ms, errors 1/50 = 20.0‰ ≤ 20‰");
        assert_eq!(b.retry_after_s(2 + 10_000 * MS), 20);
    }

    #[test]
    fn error_rate_is_compared_exactly() {
        let mut b = Breaker::new(config());
        assert_eq!(b.evaluate(1, &stats(1000, 1000, 20)), None, "20‰ is within ≤ 20‰");
        assert!(b.evaluate(1, &stats(1000, 1000, 21)).is_some());
    }

    #[test]
    fn half_open_judges_only_a_window_emptied_since_probing_began() {
        let mut b = Breaker::new(config());
        assert!(b.evaluate(1_000 * MS, &stats(60, 900_000, 0)).is_some_and(|t| t.to == State::Open));
        let probing = b.evaluate(40_000 * MS, &WindowStats::default()).unwrap();
        assert_eq!((probing.to, probing.reset_window), (State::HalfOpen, true));
        // The samples that opened it, read by a worker just before the window was emptied.
        let stale = stats(60, 900_000, 0);
        assert_eq!(b.evaluate(40_001 * MS, &stale), None);
        assert_eq!(b.state().state, State::HalfOpen);
        // The emptied window's probes decide.
        let probes = WindowStats { started_ns: probing.at_ns, ..stats(20, 900_000, 0) };
        assert!(b.evaluate(41_000 * MS, &probes).is_some_and(|t| t.to == State::Open));
    }

    #[test]
    fn state_round_trips() {
        let s = BreakerState { state: State::HalfOpen, since_ns: 5, hold_closed_until_ns: 9 };
        assert_eq!(decode_state(&encode_state(&s)), Some(s));
        assert_eq!(decode_state(&[1, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]), None);
        assert_eq!(decode_state(&encode_state(&s)[..17]), None);
    }
}
