//! The shared key-value store every piece of cross-request state goes through (budget counters,
//! latency windows and breakers, latency-guard's in-flight and VM-sequence counters), and the one
//! compare-and-swap loop that updates it.
//!
//! The store is a trait: proxy-wasm shared data in one Envoy process (`sluice_proxy_host::SharedData`),
//! [`MemoryStore`] natively. A remote store (Redis through an Envoy cluster) can implement the same
//! `get`/`set` with CAS without touching the logic built on it.
//!
//! Every read-modify-write is [`cas_update`] (or [`counter_update`] / [`counter_add`] on top of it):
//! read, let the caller compute the new value or decide to stop, write with the CAS token read, and
//! retry on a mismatch — at most [`MAX_CAS_ATTEMPTS`] times.

use std::sync::{Arc, Mutex, PoisonError};

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

/// Attempts per read-modify-write before giving up, for every shared value. Each mismatch means
/// another worker wrote the same key between this one's read and write; 32 is far beyond what 64
/// concurrent requests on one key cause in practice (measured by the threaded tests), and bounds
/// the work of one request when a key is hot. (latency-guard's counters used 16 for no recorded
/// reason; one limit now.)
pub const MAX_CAS_ATTEMPTS: u32 = 32;

/// What the closure of [`cas_update`] decides about the value it was shown.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step<W, S> {
    /// Write these bytes (with the CAS token read); `W` is returned once the write lands.
    Write(Vec<u8>, W),
    /// The key is missing: create it with these bytes, then run the update again on them. A create
    /// cannot be conditional (Envoy accepts any CAS token for a missing key), so a value that must
    /// not lose a racing update is created first and updated with a real CAS after. Counts as an
    /// attempt.
    Create(Vec<u8>),
    /// Write nothing; [`cas_update`] returns [`Updated::Stopped`] with this.
    Stop(S),
}

/// How a [`cas_update`] that did not fail ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Updated<W, S> {
    Written(W),
    Stopped(S),
}

/// Why a [`cas_update`] failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CasError {
    /// Every one of the [`MAX_CAS_ATTEMPTS`] attempts lost to another worker's write.
    #[error("too many concurrent updates of the same shared value")]
    Contended,
    #[error(transparent)]
    Store(StoreError),
}

/// Read-modify-write of `key` with compare-and-swap: `step` sees the current value (`None` when the
/// key is missing) and says what to write or that nothing is to be written; a lost CAS runs it
/// again on the value the other writer left, at most [`MAX_CAS_ATTEMPTS`] times in all.
pub fn cas_update<W, S>(store: &mut dyn SharedStore, key: &str, mut step: impl FnMut(Option<&[u8]>) -> Step<W, S>) -> Result<Updated<W, S>, CasError> {
    for _ in 0..MAX_CAS_ATTEMPTS {
        let (bytes, cas) = store.get(key).map_err(CasError::Store)?;
        let (value, done) = match step(bytes.as_deref()) {
            Step::Stop(s) => return Ok(Updated::Stopped(s)),
            Step::Create(value) => (value, None),
            Step::Write(value, w) => (value, Some(w)),
        };
        match store.set(key, &value, cas) {
            Ok(()) => {
                if let Some(w) = done {
                    return Ok(Updated::Written(w));
                }
            }
            Err(StoreError::CasMismatch) => {}
            Err(e) => return Err(CasError::Store(e)),
        }
    }
    Err(CasError::Contended)
}

/// A counter as stored: its first 8 bytes, little-endian; 0 when the key is missing or shorter.
pub fn decode_counter(bytes: Option<&[u8]>) -> u64 {
    bytes.and_then(|b| b.get(..8)).and_then(|b| b.try_into().ok()).map(u64::from_le_bytes).unwrap_or(0)
}

/// A counter's stored bytes.
pub fn encode_counter(n: u64) -> [u8; 8] {
    n.to_le_bytes()
}

/// Updates the little-endian `u64` counter at `key` (0 when missing) to `next(current)`, or writes
/// nothing when `next` declines with `Err(reason)`; returns the value written.
///
/// A missing key's first write is blind (the store cannot make a create conditional): create a
/// counter that concurrent workers update before traffic, as latency-guard does at configure time.
pub fn counter_update<S>(store: &mut dyn SharedStore, key: &str, mut next: impl FnMut(u64) -> Result<u64, S>) -> Result<Updated<u64, S>, CasError> {
    cas_update(store, key, |bytes| match next(decode_counter(bytes)) {
        Ok(n) => Step::Write(encode_counter(n).to_vec(), n),
        Err(reason) => Step::Stop(reason),
    })
}

/// Adds `delta` to the counter at `key`, saturating at 0 and `u64::MAX`; returns the new value.
pub fn counter_add(store: &mut dyn SharedStore, key: &str, delta: i64) -> Result<u64, CasError> {
    let add = |n: u64| Ok::<_, std::convert::Infallible>(n.saturating_add_signed(delta));
    match counter_update(store, key, add)? {
        Updated::Written(n) => Ok(n),
        Updated::Stopped(never) => match never {},
    }
}

/// An in-memory [`SharedStore`] with the same CAS semantics as Envoy's shared data (each write bumps
/// the key's CAS token). For tests, benches, the simulator and the playground.
#[derive(Debug, Default, Clone)]
pub struct MemoryStore {
    /// A [`VecMap`](crate::vecmap::VecMap): keys are added far less often than read, and the
    /// playground's page carries one B-tree instantiation less.
    entries: crate::vecmap::VecMap<String, (Vec<u8>, u32)>,
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
        let next_cas = self.next_cas.wrapping_add(1).max(1);
        match self.entries.get_mut(key) {
            Some((_, current)) if cas != 0 && cas != *current => return Err(StoreError::CasMismatch),
            // A key written again keeps its allocations (most writes are of keys that exist).
            Some((stored, current)) => {
                stored.clear();
                stored.extend_from_slice(value);
                *current = next_cas;
            }
            None if cas != 0 => return Err(StoreError::CasMismatch),
            None => {
                self.entries.insert(key.to_string(), (value.to_vec(), next_cas));
            }
        }
        self.next_cas = next_cas;
        Ok(())
    }
}

/// A [`MemoryStore`] shared by threads: every get and set is atomic, a thread's get → set is not —
/// exactly as Envoy shared data across worker threads. Clones share the store. For concurrency tests.
#[derive(Debug, Default, Clone)]
pub struct ThreadedStore(Arc<Mutex<MemoryStore>>);

impl SharedStore for ThreadedStore {
    fn get(&mut self, key: &str) -> Result<(Option<Vec<u8>>, u32), StoreError> {
        // A poisoned lock means a test thread panicked; the map itself is still whole.
        let r = self.0.lock().unwrap_or_else(PoisonError::into_inner).get(key);
        // Give other threads the chance to write between this read and the write that follows.
        std::thread::yield_now();
        r
    }

    fn set(&mut self, key: &str, value: &[u8], cas: u32) -> Result<(), StoreError> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).set(key, value, cas)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A store whose CAS fails a few times, as under contention from other workers.
    pub(crate) struct Contended {
        pub(crate) inner: MemoryStore,
        pub(crate) failures_left: u32,
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
    fn memory_store_cas_semantics() {
        let mut s = MemoryStore::default();
        assert_eq!(s.get("k").unwrap(), (None, 0));
        s.set("k", b"a", 0).unwrap();
        let (v, cas) = s.get("k").unwrap();
        assert_eq!(v.as_deref(), Some(&b"a"[..]));
        s.set("k", b"b", cas).unwrap();
        assert_eq!(s.set("k", b"c", cas), Err(StoreError::CasMismatch));
        s.set("k", b"d", 0).unwrap();
        assert_eq!(s.get("k").unwrap().0.as_deref(), Some(&b"d"[..]));
    }

    #[test]
    fn cas_update_retries_a_bounded_number_of_times() {
        let mut store = Contended { inner: MemoryStore::default(), failures_left: MAX_CAS_ATTEMPTS - 1 };
        let mut calls = 0;
        let r = cas_update(&mut store, "k", |_| {
            calls += 1;
            Step::<_, ()>::Write(b"x".to_vec(), calls)
        });
        assert_eq!(r, Ok(Updated::Written(MAX_CAS_ATTEMPTS)));
        store.failures_left = MAX_CAS_ATTEMPTS;
        let r = cas_update(&mut store, "k", |_| Step::<(), ()>::Write(b"y".to_vec(), ()));
        assert_eq!(r, Err(CasError::Contended));
        assert_eq!(store.inner.get("k").unwrap().0.as_deref(), Some(&b"x"[..]), "no losing write landed");
    }

    #[test]
    fn cas_update_stops_creates_and_reports_store_errors() {
        let mut store = MemoryStore::default();
        assert_eq!(cas_update(&mut store, "k", |_| Step::<(), _>::Stop(7)), Ok(Updated::Stopped(7)));
        assert_eq!(store.get("k").unwrap(), (None, 0), "a stop writes nothing");
        // A missing key is created first, then updated on what was created.
        let mut seen = Vec::new();
        let r = cas_update(&mut store, "k", |bytes| match bytes {
            None => Step::<_, ()>::Create(b"empty".to_vec()),
            Some(b) => {
                seen.push(b.to_vec());
                Step::Write(b"full".to_vec(), ())
            }
        });
        assert_eq!(r, Ok(Updated::Written(())));
        assert_eq!(seen, vec![b"empty".to_vec()]);
        assert_eq!(store.get("k").unwrap().0.as_deref(), Some(&b"full"[..]));

        struct Down;
        impl SharedStore for Down {
            fn get(&mut self, _: &str) -> Result<(Option<Vec<u8>>, u32), StoreError> {
                Err(StoreError::Unavailable("down".into()))
            }
            fn set(&mut self, _: &str, _: &[u8], _: u32) -> Result<(), StoreError> {
                Err(StoreError::Unavailable("down".into()))
            }
        }
        assert_eq!(counter_add(&mut Down, "k", 1), Err(CasError::Store(StoreError::Unavailable("down".into()))));
    }

    #[test]
    fn counters_add_saturate_and_decline() {
        let mut store = MemoryStore::default();
        assert_eq!(counter_add(&mut store, "n", 1), Ok(1));
        assert_eq!(counter_add(&mut store, "n", 2), Ok(3));
        assert_eq!(counter_add(&mut store, "n", -5), Ok(0), "saturates at zero");
        assert_eq!(store.get("n").unwrap().0, Some(0u64.to_le_bytes().to_vec()));
        assert_eq!(counter_update(&mut store, "n", |n| if n < 1 { Ok(n + 1) } else { Err(n) }), Ok(Updated::Written(1)));
        assert_eq!(counter_update(&mut store, "n", |n| if n < 1 { Ok(n + 1) } else { Err(n) }), Ok(Updated::Stopped(1)));
        store.set("m", &[u64::MAX.to_le_bytes().as_slice(), b"tail"].concat(), 0).unwrap();
        assert_eq!(counter_add(&mut store, "m", 1), Ok(u64::MAX), "saturates at the top; trailing bytes ignored");
        assert_eq!(decode_counter(Some(b"short")), 0);
        assert_eq!(decode_counter(None), 0);
    }

    #[test]
    fn threaded_counters_lose_no_increment() {
        let mut store = ThreadedStore::default();
        // Created up front: two racing first writes to a missing key could lose one (see `Step::Create`).
        store.set("n", &encode_counter(0), 0).unwrap();
        let handles: Vec<_> = (0..8)
            .map(|_| {
                let mut store = store.clone();
                std::thread::spawn(move || {
                    let mut contended = 0u32;
                    for _ in 0..200 {
                        while counter_add(&mut store, "n", 1).is_err() {
                            contended += 1;
                        }
                    }
                    contended
                })
            })
            .collect();
        let contended: u32 = handles.into_iter().map(|h| h.join().unwrap()).sum();
        assert_eq!(decode_counter(store.get("n").unwrap().0.as_deref()), 1600, "contended {contended} times");
    }
}
