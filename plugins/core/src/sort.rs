//! [`stable_by_key`]: a stable sort by a `u64` key through the one instance of the standard
//! library's sort that the crates the playground's page compiles in share, `[u64]::sort_unstable`.
//!
//! Each `sort_by_key` or `sort_unstable_by_key` of another element type or closure carries its own
//! copy of the standard library's sort, ≈ 4 KB of the page each (docs/playground.md).

/// `items` stably sorted by `key` (equal keys keep their order), as `sort_by_key` would sort them.
///
/// The distinct keys are sorted (`[u64]::sort_unstable`, the shared instance), then each item goes
/// to its key's place by a counting sort over the keys' ranks, which keeps equal keys in order.
pub fn stable_by_key<T>(items: Vec<T>, key: impl Fn(&T) -> u64) -> Vec<T> {
    // Most callers' lists are short and already in order: nothing to allocate.
    if items.is_sorted_by_key(&key) {
        return items;
    }
    let keys: Vec<u64> = items.iter().map(key).collect();
    let mut slots: Vec<Option<T>> = std::iter::repeat_with(|| None).take(keys.len()).collect();
    for (item, place) in items.into_iter().zip(places(&keys)) {
        if let Some(slot) = slots.get_mut(place) {
            *slot = Some(item);
        }
    }
    slots.into_iter().flatten().collect()
}

/// Where each of `keys` goes in a stable sort of them (not generic: one copy for every caller).
fn places(keys: &[u64]) -> Vec<usize> {
    let mut distinct = keys.to_vec();
    distinct.sort_unstable();
    distinct.dedup();
    let ranks: Vec<usize> = keys.iter().map(|k| distinct.binary_search(k).unwrap_or_default()).collect();
    // The first place of each rank: the count of smaller keys.
    let mut next = vec![0usize; distinct.len()];
    for &r in &ranks {
        if let Some(n) = next.get_mut(r) {
            *n += 1;
        }
    }
    let mut at = 0usize;
    for n in next.iter_mut() {
        let count = *n;
        *n = at;
        at += count;
    }
    ranks
        .into_iter()
        .map(|r| {
            let n = next.get_mut(r).map(|n| std::mem::replace(n, *n + 1));
            n.unwrap_or_default()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// The same order as the standard library's stable sort, equal keys included.
        #[test]
        fn sorts_as_sort_by_key(keys in proptest::collection::vec(0u64..8, 0..64), wide in proptest::collection::vec(any::<u64>(), 0..64)) {
            for keys in [keys, wide] {
                let items: Vec<(u64, usize)> = keys.iter().copied().zip(0..).collect();
                let mut expected = items.clone();
                expected.sort_by_key(|&(k, _)| k);
                prop_assert_eq!(stable_by_key(items, |&(k, _)| k), expected);
            }
        }
    }
}
