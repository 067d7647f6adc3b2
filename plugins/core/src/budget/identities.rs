//! Per-identity counters of the local ledger, bounded.
//!
//! An `identity_budgets` entry applies to every identity on its own, and identities are not listed
//! in the policy, so their counters cannot be created at configure time — and a counter created on
//! the fly in Envoy's shared data races (Envoy accepts any CAS token for a missing key, so two
//! workers creating one key could each overwrite the other's first reservation). Instead each
//! template owns [`BUCKETS`] keys created at configure time; an identity's counter is an entry of
//! the bucket its hash selects, and every update is a real CAS on that bucket.
//!
//! Bounded: a bucket keeps at most `capacity` entries. Inserting into a full bucket evicts the
//! entry of the oldest window (a finished window first; its counter no longer matters). When every
//! entry is of the current window, the evicted identity starts over: per-identity budgets of the
//! local ledger are exact only while the identities active in one window fit the capacity
//! (`max_local_identities` per template). The Redis ledger has no such bound.
//!
//! [`IdentityBuckets`] is a [`SharedStore`] adapter: the ledger's reserve/settle run unchanged on an
//! identity counter key `<template store key>#<identity hash>`.

use crate::store::{SharedStore, StoreError};

/// Buckets per identity template.
pub const BUCKETS: u64 = 64;

const FORMAT_VERSION: u8 = 1;

/// The separator between a template's store key and an identity hash.
pub const IDENTITY_SEPARATOR: char = '#';

/// The identity part of counter keys: the first 16 hex digits (64 bits) of the identity's SHA-256.
pub fn identity_hash(identity: &str) -> String {
    let mut hex = crate::identity::sha256_hex(identity.as_bytes());
    hex.truncate(16);
    hex
}

/// The store key of bucket `n` of a template.
pub fn bucket_key(template_key: &str, n: u64) -> String {
    format!("{template_key}/b{n}")
}

/// An empty bucket, as written at configure time.
pub fn empty_bucket() -> Vec<u8> {
    encode(&[])
}

type Entry = (u64, Vec<u8>);

fn encode(entries: &[Entry]) -> Vec<u8> {
    let mut out = Vec::with_capacity(3 + entries.iter().map(|(_, v)| 10 + v.len()).sum::<usize>());
    out.push(FORMAT_VERSION);
    out.extend_from_slice(&u16::try_from(entries.len()).unwrap_or(u16::MAX).to_le_bytes());
    for (id, value) in entries.iter().take(usize::from(u16::MAX)) {
        out.extend_from_slice(&id.to_le_bytes());
        out.extend_from_slice(&u16::try_from(value.len()).unwrap_or(u16::MAX).to_le_bytes());
        out.extend_from_slice(value.get(..usize::from(u16::MAX)).unwrap_or(value));
    }
    out
}

/// `None` for bytes this version did not write (then the bucket is treated as empty).
fn decode(bytes: &[u8]) -> Option<Vec<Entry>> {
    let (&version, rest) = bytes.split_first()?;
    if version != FORMAT_VERSION {
        return None;
    }
    let n = u16::from_le_bytes(rest.get(..2)?.try_into().ok()?);
    let mut at = 2usize;
    let mut entries = Vec::with_capacity(usize::from(n));
    for _ in 0..n {
        let id = u64::from_le_bytes(rest.get(at..at + 8)?.try_into().ok()?);
        let len = usize::from(u16::from_le_bytes(rest.get(at + 8..at + 10)?.try_into().ok()?));
        let value = rest.get(at + 10..at + 10 + len)?.to_vec();
        entries.push((id, value));
        at += 10 + len;
    }
    Some(entries)
}

/// The window id of an encoded ledger counter (0 when unreadable: evicted first).
fn window_of(counter: &[u8]) -> u64 {
    counter.get(1..9).and_then(|b| b.try_into().ok()).map(u64::from_le_bytes).unwrap_or(0)
}

/// Routes identity counter keys onto bucket entries; every other key goes to `inner` unchanged.
pub struct IdentityBuckets<'a> {
    inner: &'a mut dyn SharedStore,
    capacity: usize,
    /// The bucket last read: `set` writes it back with one entry changed, under the CAS token of
    /// that read (the ledger always reads a key right before it writes it).
    last: Option<(String, Vec<Entry>)>,
}

impl<'a> IdentityBuckets<'a> {
    /// `max_identities` per template, spread over [`BUCKETS`] buckets.
    pub fn new(inner: &'a mut dyn SharedStore, max_identities: u32) -> Self {
        let capacity = usize::try_from(u64::from(max_identities).div_ceil(BUCKETS)).unwrap_or(usize::MAX).max(1);
        IdentityBuckets { inner, capacity, last: None }
    }

    fn route(key: &str) -> Option<(String, u64)> {
        let (template, hash) = key.split_once(IDENTITY_SEPARATOR)?;
        let id = u64::from_str_radix(hash, 16).ok()?;
        Some((bucket_key(template, id % BUCKETS), id))
    }
}

impl SharedStore for IdentityBuckets<'_> {
    fn get(&mut self, key: &str) -> Result<(Option<Vec<u8>>, u32), StoreError> {
        let Some((bucket, id)) = Self::route(key) else { return self.inner.get(key) };
        let (bytes, cas) = self.inner.get(&bucket)?;
        let entries = bytes.as_deref().and_then(decode).unwrap_or_default();
        let value = entries.iter().find(|(e, _)| *e == id).map(|(_, v)| v.clone());
        self.last = Some((bucket, entries));
        Ok((value, cas))
    }

    fn set(&mut self, key: &str, value: &[u8], cas: u32) -> Result<(), StoreError> {
        let Some((bucket, id)) = Self::route(key) else { return self.inner.set(key, value, cas) };
        let mut entries = match self.last.take() {
            Some((last, entries)) if last == bucket => entries,
            // Not read first: read now; the CAS token given still guards the write.
            _ => {
                let (bytes, _) = self.inner.get(&bucket)?;
                bytes.as_deref().and_then(decode).unwrap_or_default()
            }
        };
        if let Some(entry) = entries.iter_mut().find(|(e, _)| *e == id) {
            entry.1 = value.to_vec();
        } else {
            while entries.len() >= self.capacity {
                let oldest = entries.iter().enumerate().min_by_key(|(_, (_, v))| window_of(v)).map(|(i, _)| i);
                match oldest {
                    Some(i) => {
                        entries.swap_remove(i);
                    }
                    None => break,
                }
            }
            entries.push((id, value.to_vec()));
        }
        self.inner.set(&bucket, &encode(&entries), cas)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::budget::ledger;
    use crate::store::MemoryStore;

    #[test]
    fn buckets_round_trip_and_reject_garbage() {
        let entries = vec![(1u64, vec![1, 2, 3]), (u64::MAX, vec![])];
        assert_eq!(decode(&encode(&entries)), Some(entries));
        assert_eq!(decode(&[2, 0, 0]), None);
        assert_eq!(decode(&[1, 1, 0, 9]), None);
        assert_eq!(decode(&empty_bucket()), Some(vec![]));
    }

    #[test]
    fn identities_get_their_own_counter_inside_a_bucket() {
        let mut mem = MemoryStore::default();
        for n in 0..BUCKETS {
            mem.set(&bucket_key("t", n), &empty_bucket(), 0).unwrap();
        }
        let mut store = IdentityBuckets::new(&mut mem, 4096);
        let (a, b) = (format!("t#{}", identity_hash("alice")), format!("t#{}", identity_hash("bob")));
        ledger::reserve(&mut store, &a, 7, 0, 10, 60, 100).unwrap();
        ledger::reserve(&mut store, &a, 7, 0, 10, 40, 100).unwrap();
        assert!(ledger::reserve(&mut store, &a, 7, 0, 10, 1, 100).is_err(), "alice is full");
        ledger::reserve(&mut store, &b, 7, 0, 10, 100, 100).unwrap();
        assert_eq!(ledger::read(&mut store, &b, 7, 0, 10).unwrap().reserved(), 100);
    }

    #[test]
    fn a_full_bucket_evicts_the_oldest_window_first() {
        let mut mem = MemoryStore::default();
        let mut store = IdentityBuckets::new(&mut mem, 64); // one entry per bucket
                                                            // Two identities that land in the same bucket.
        let same: Vec<String> =
            (0..1000).map(|i| identity_hash(&format!("user-{i}"))).filter(|h| u64::from_str_radix(h, 16).unwrap() % BUCKETS == 0).take(2).collect();
        let (old, new) = (format!("t#{}", same[0]), format!("t#{}", same[1]));
        ledger::reserve(&mut store, &old, 1, 0, 10, 50, 100).unwrap();
        ledger::reserve(&mut store, &new, 2, 0, 10, 30, 100).unwrap();
        assert_eq!(ledger::read(&mut store, &new, 2, 0, 10).unwrap().reserved(), 30);
        // The old identity was evicted: it starts over.
        assert_eq!(ledger::read(&mut store, &old, 1, 0, 10).unwrap().reserved(), 0);
    }
}
