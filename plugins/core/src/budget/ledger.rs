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
//! The store is a trait: proxy-wasm shared data in one Envoy process today; a remote store (Redis
//! through an Envoy cluster) can implement the same `get`/`set` with CAS later without touching this
//! logic.

/// A key-value store with compare-and-swap, as proxy-wasm shared data offers.
pub trait SharedStore {
    /// The value and its CAS token; `(None, 0)` when the key does not exist.
    fn get(&mut self, key: &str) -> Result<(Option<Vec<u8>>, u32), StoreError>;
    /// Writes `value` if the key's CAS token is still `cas` (0: unconditionally).
    fn set(&mut self, key: &str, value: &[u8], cas: u32) -> Result<(), StoreError>;
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    #[error("compare-and-swap mismatch")]
    CasMismatch,
    #[error("shared store unavailable: {0}")]
    Unavailable(String),
}

/// CAS attempts per counter update before giving up (each mismatch means another request updated
/// the same counter in between; 32 is far beyond what 64 concurrent requests cause in practice).
pub const MAX_CAS_ATTEMPTS: u32 = 32;

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

fn load(store: &mut dyn SharedStore, key: &str) -> Result<(Counter, u32), StoreError> {
    let (bytes, cas) = store.get(key)?;
    let counter = bytes.as_deref().and_then(Counter::decode).unwrap_or_default();
    Ok((counter, cas))
}

/// Reads a counter as it stands now (rolled to the current window, expired leases dropped).
pub fn read(store: &mut dyn SharedStore, key: &str, window_id: u64, now_minute: u32, ttl_minutes: u32) -> Result<Counter, StoreError> {
    let (mut counter, _) = load(store, key)?;
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
    for _ in 0..MAX_CAS_ATTEMPTS {
        let (mut counter, cas) = load(store, key).map_err(ReserveError::Store)?;
        counter.roll(window_id, now_minute, ttl_minutes);
        if counter.committed().saturating_add(amount) > limit {
            return Err(ReserveError::Exceeded { used: counter.used, reserved: counter.reserved(), limit });
        }
        counter.add_lease(now_minute, amount);
        match store.set(key, &counter.encode(), cas) {
            Ok(()) => return Ok((Lease { key: key.to_string(), window_id, minute: now_minute, amount }, counter)),
            Err(StoreError::CasMismatch) => continue,
            Err(e) => return Err(ReserveError::Store(e)),
        }
    }
    Err(ReserveError::Contended)
}

/// Replaces a lease by the actual amount: the lease is released and `actual` added to `used`, if
/// the lease's window is still current. Returns the counter after the update.
pub fn settle(store: &mut dyn SharedStore, lease: &Lease, actual: u64, now_window_id: u64, now_minute: u32, ttl_minutes: u32) -> Result<Counter, ReserveError> {
    for _ in 0..MAX_CAS_ATTEMPTS {
        let (mut counter, cas) = load(store, &lease.key).map_err(ReserveError::Store)?;
        counter.roll(now_window_id, now_minute, ttl_minutes);
        if counter.window_id != lease.window_id {
            // The admission window is over: nothing of it remains to settle against.
            return Ok(counter);
        }
        counter.release_lease(lease.minute, lease.amount, now_minute, ttl_minutes);
        counter.used = counter.used.saturating_add(actual);
        match store.set(&lease.key, &counter.encode(), cas) {
            Ok(()) => return Ok(counter),
            Err(StoreError::CasMismatch) => continue,
            Err(e) => return Err(ReserveError::Store(e)),
        }
    }
    Err(ReserveError::Contended)
}

/// An in-memory [`SharedStore`] with the same CAS semantics as Envoy's shared data (each write bumps
/// the key's CAS token). For tests, benches and the simulator.
#[derive(Debug, Default, Clone)]
pub struct MemoryStore {
    entries: std::collections::BTreeMap<String, (Vec<u8>, u32)>,
    next_cas: u32,
}

impl SharedStore for MemoryStore {
    fn get(&mut self, key: &str) -> Result<(Option<Vec<u8>>, u32), StoreError> {
        Ok(match self.entries.get(key) {
            Some((value, cas)) => (Some(value.clone()), *cas),
            None => (None, 0),
        })
    }

    fn set(&mut self, key: &str, value: &[u8], cas: u32) -> Result<(), StoreError> {
        let current = self.entries.get(key).map(|(_, c)| *c).unwrap_or(0);
        if cas != 0 && cas != current {
            return Err(StoreError::CasMismatch);
        }
        self.next_cas = self.next_cas.wrapping_add(1).max(1);
        self.entries.insert(key.to_string(), (value.to_vec(), self.next_cas));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    /// A store whose CAS fails a few times, as under contention from other workers.
    struct Contended {
        inner: MemoryStore,
        failures_left: u32,
    }
    impl SharedStore for Contended {
        fn get(&mut self, key: &str) -> Result<(Option<Vec<u8>>, u32), StoreError> {
            self.inner.get(key)
        }
        fn set(&mut self, key: &str, value: &[u8], cas: u32) -> Result<(), StoreError> {
            if self.failures_left > 0 {
                self.failures_left -= 1;
                // Someone else wrote in between: bump the token.
                let (v, c) = self.inner.get(key)?;
                self.inner.set(key, &v.unwrap_or_default(), c)?;
                return Err(StoreError::CasMismatch);
            }
            self.inner.set(key, value, cas)
        }
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
