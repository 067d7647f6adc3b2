//! The budget ledger: one counter per (level, budget), kept in a shared key-value store with
//! compare-and-swap, updated by reserve-then-settle.
//!
//! Invariants (per counter, within its current window):
//! 1. Admission only adds a reservation when `used + reserved + amount ≤ limit`, checked and written
//!    in one CAS step, so concurrent admissions can never together pass the limit.
//! 2. Settlement removes the request's reservation and adds its actual amount to `used`, in one CAS
//!    step. When actual ≤ reserved (strict mode), `used + reserved` never grows, so invariant 1 gives
//!    zero overshoot.
//! 3. Reservations are leases tagged with the minute they were taken; a lease older than the TTL
//!    is dropped when the counter is next touched. A request that never settles (a VM that died, a
//!    stream that never ended) therefore holds budget for at most the TTL — no sweeper needed, and
//!    nothing depends on the process that made the reservation still existing.
//! 4. A request is charged to the window it was admitted in. If that window has ended when it
//!    settles, the counter has moved on and the charge is not added to the new window (its
//!    reservation was never part of it either).
//!
//! The store is [`crate::store::SharedStore`], and every update one [`crate::store::cas_update`].

use crate::store::{cas_update, CasError, SharedStore, Step, StoreError, Updated};

/// Most lease slots a counter keeps; bounds the stored value (8 + 8 + 8 + 12 × slots bytes).
pub const MAX_LEASE_SLOTS: usize = 64;

const FORMAT_VERSION: u8 = 1;

/// One counter's stored state.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Counter {
    pub window_id: u64,
    pub used: u64,
    /// `(minute taken, amount)` leases, at most one per minute.
    pub leases: Vec<(u32, u64)>,
}

impl Counter {
    pub fn reserved(&self) -> u64 {
        self.leases.iter().fold(0u64, |acc, (_, a)| acc.saturating_add(*a))
    }

    /// `used + reserved`.
    pub fn committed(&self) -> u64 {
        self.used.saturating_add(self.reserved())
    }

    /// Moves the counter to `window_id` (resetting it if that is a new window) and drops leases older
    /// than `ttl_minutes`.
    pub fn roll(&mut self, window_id: u64, now_minute: u32, ttl_minutes: u32) {
        if window_id > self.window_id {
            *self = Counter { window_id, used: 0, leases: Vec::new() };
        }
        self.leases.retain(|(minute, amount)| *amount > 0 && minute.saturating_add(ttl_minutes) > now_minute);
    }

    fn add_lease(&mut self, minute: u32, amount: u64) {
        if let Some(slot) = self.leases.iter_mut().find(|(m, _)| *m == minute) {
            slot.1 = slot.1.saturating_add(amount);
        } else if self.leases.len() < MAX_LEASE_SLOTS {
            self.leases.push((minute, amount));
        } else if let Some(newest) = self.leases.iter_mut().max_by_key(|(m, _)| *m) {
            // Full (TTL longer than the slots): fold into the newest lease, which expires last.
            newest.1 = newest.1.saturating_add(amount);
        }
    }

    /// Releases a lease taken at `minute`, unless it already expired (then it is gone already).
    fn release_lease(&mut self, minute: u32, amount: u64, now_minute: u32, ttl_minutes: u32) {
        if minute.saturating_add(ttl_minutes) <= now_minute {
            return;
        }
        if let Some(slot) = self.leases.iter_mut().find(|(m, _)| *m == minute) {
            slot.1 = slot.1.saturating_sub(amount);
        } else if let Some(newest) = self.leases.iter_mut().max_by_key(|(m, _)| *m) {
            // The lease may have been folded into a newer slot when the slots were full.
            newest.1 = newest.1.saturating_sub(amount);
        }
        self.leases.retain(|(_, a)| *a > 0);
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(17 + 12 * self.leases.len());
        out.push(FORMAT_VERSION);
        out.extend_from_slice(&self.window_id.to_le_bytes());
        out.extend_from_slice(&self.used.to_le_bytes());
        for (minute, amount) in self.leases.iter().take(MAX_LEASE_SLOTS) {
            out.extend_from_slice(&minute.to_le_bytes());
            out.extend_from_slice(&amount.to_le_bytes());
        }
        out
    }

    /// `None` for bytes this version did not write (treated as a fresh counter, and logged by the caller).
    pub fn decode(bytes: &[u8]) -> Option<Counter> {
        let (&version, rest) = bytes.split_first()?;
        if version != FORMAT_VERSION || rest.len() < 16 || (rest.len() - 16) % 12 != 0 {
            return None;
        }
        let u64_at = |b: &[u8], at: usize| -> Option<u64> { Some(u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?)) };
        let window_id = u64_at(rest, 0)?;
        let used = u64_at(rest, 8)?;
        let mut leases = Vec::new();
        for slot in rest.get(16..)?.chunks_exact(12) {
            let minute = u32::from_le_bytes(slot.get(..4)?.try_into().ok()?);
            leases.push((minute, u64_at(slot, 4)?));
        }
        Some(Counter { window_id, used, leases })
    }
}

/// A reservation held on one counter, to be settled later.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    pub key: String,
    pub window_id: u64,
    pub minute: u32,
    pub amount: u64,
}

/// Why a reservation was not taken.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReserveError {
    /// `used + reserved + amount > limit`; the counter's figures at the time.
    Exceeded {
        used: u64,
        reserved: u64,
        limit: u64,
    },
    /// Too many concurrent updates to the same counter.
    Contended,
    Store(StoreError),
}

/// A missing or unreadable counter starts fresh.
fn decode_or_fresh(bytes: Option<&[u8]>) -> Counter {
    bytes.and_then(Counter::decode).unwrap_or_default()
}

impl From<CasError> for ReserveError {
    fn from(e: CasError) -> Self {
        match e {
            CasError::Contended => ReserveError::Contended,
            CasError::Store(e) => ReserveError::Store(e),
        }
    }
}

/// Reads a counter as it stands now (rolled to the current window, expired leases dropped).
pub fn read(store: &mut dyn SharedStore, key: &str, window_id: u64, now_minute: u32, ttl_minutes: u32) -> Result<Counter, StoreError> {
    let mut counter = decode_or_fresh(store.get(key)?.0.as_deref());
    counter.roll(window_id, now_minute, ttl_minutes);
    Ok(counter)
}

/// Reserves `amount` on one counter if it fits under `limit`.
pub fn reserve(
    store: &mut dyn SharedStore,
    key: &str,
    window_id: u64,
    now_minute: u32,
    ttl_minutes: u32,
    amount: u64,
    limit: u64,
) -> Result<(Lease, Counter), ReserveError> {
    let written = cas_update(store, key, |bytes| {
        let mut counter = decode_or_fresh(bytes);
        counter.roll(window_id, now_minute, ttl_minutes);
        if counter.committed().saturating_add(amount) > limit {
            return Step::Stop(ReserveError::Exceeded { used: counter.used, reserved: counter.reserved(), limit });
        }
        counter.add_lease(now_minute, amount);
        Step::Write(counter.encode(), counter)
    });
    match written.map_err(ReserveError::from)? {
        Updated::Written(counter) => Ok((Lease { key: key.to_string(), window_id, minute: now_minute, amount }, counter)),
        Updated::Stopped(e) => Err(e),
    }
}

/// Replaces a lease by the actual amount: the lease is released and `actual` added to `used`, if
/// the lease's window is still current. Returns the counter after the update.
pub fn settle(store: &mut dyn SharedStore, lease: &Lease, actual: u64, now_window_id: u64, now_minute: u32, ttl_minutes: u32) -> Result<Counter, ReserveError> {
    let written = cas_update(store, &lease.key, |bytes| {
        let mut counter = decode_or_fresh(bytes);
        counter.roll(now_window_id, now_minute, ttl_minutes);
        if counter.window_id != lease.window_id {
            // The admission window is over: nothing of it remains to settle against.
            return Step::Stop(counter);
        }
        counter.release_lease(lease.minute, lease.amount, now_minute, ttl_minutes);
        counter.used = counter.used.saturating_add(actual);
        Step::Write(counter.encode(), counter)
    });
    match written.map_err(ReserveError::from)? {
        Updated::Written(counter) | Updated::Stopped(counter) => Ok(counter),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::tests::Contended;
    use crate::store::{MemoryStore, MAX_CAS_ATTEMPTS};

    #[test]
    fn counter_encoding_round_trips_and_rejects_garbage() {
        let c = Counter { window_id: 7, used: 100, leases: vec![(5, 10), (6, 20)] };
        assert_eq!(Counter::decode(&c.encode()), Some(c));
        assert_eq!(Counter::decode(b""), None);
        assert_eq!(Counter::decode(&[2; 17]), None);
        assert_eq!(Counter::decode(&[1; 20]), None);
    }

    #[test]
    fn reservations_never_pass_the_limit_and_settle_exactly() {
        let mut store = MemoryStore::default();
        let (a, _) = reserve(&mut store, "k", 1, 0, 10, 60, 100).unwrap();
        let (b, _) = reserve(&mut store, "k", 1, 0, 10, 40, 100).unwrap();
        assert_eq!(reserve(&mut store, "k", 1, 0, 10, 1, 100), Err(ReserveError::Exceeded { used: 0, reserved: 100, limit: 100 }));
        let after = settle(&mut store, &a, 25, 1, 0, 10).unwrap();
        assert_eq!((after.used, after.reserved()), (25, 40));
        let after = settle(&mut store, &b, 40, 1, 1, 10).unwrap();
        assert_eq!((after.used, after.reserved()), (65, 0));
        assert!(reserve(&mut store, "k", 1, 1, 10, 35, 100).is_ok());
        assert!(reserve(&mut store, "k", 1, 1, 10, 1, 100).is_err());
    }

    #[test]
    fn leases_expire_after_the_ttl_and_windows_reset() {
        let mut store = MemoryStore::default();
        let (lost, _) = reserve(&mut store, "k", 1, 100, 10, 90, 100).unwrap();
        assert!(reserve(&mut store, "k", 1, 109, 10, 20, 100).is_err(), "lease still held at +9 min");
        assert!(reserve(&mut store, "k", 1, 110, 10, 20, 100).is_ok(), "lease dropped at +10 min");
        // The late settlement still charges what was used, without releasing someone else's lease.
        let c = settle(&mut store, &lost, 5, 1, 111, 10).unwrap();
        assert_eq!((c.used, c.reserved()), (5, 20));
        // A new window starts from zero; a settlement from the old window does not leak into it.
        let (old, _) = reserve(&mut store, "w", 1, 0, 10, 50, 100).unwrap();
        let c = settle(&mut store, &old, 50, 2, 1, 10).unwrap();
        assert_eq!((c.window_id, c.used, c.reserved()), (2, 0, 0));
    }

    #[test]
    fn cas_mismatches_are_retried_a_bounded_number_of_times() {
        let mut store = Contended { inner: MemoryStore::default(), failures_left: 3 };
        store.inner.set("k", &Counter::default().encode(), 0).unwrap();
        assert!(reserve(&mut store, "k", 1, 0, 10, 1, 10).is_ok());
        store.failures_left = MAX_CAS_ATTEMPTS;
        assert_eq!(reserve(&mut store, "k", 1, 0, 10, 1, 10), Err(ReserveError::Contended));
    }
}
