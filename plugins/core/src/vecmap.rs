//! [`VecMap`]: a map kept as a `Vec` of entries sorted by key.
//!
//! For maps of a few entries (or of many written once and then read), in the crates the
//! playground's page compiles in: every `BTreeMap<K, V>` of another `(K, V)` brings its own copy of
//! the B-tree's node code (insertion, splits, merges on removal), ≈ 7 KB of `.wasm` each, where this
//! is a binary search and a `Vec` insert or remove. Iteration is in key order, as a `BTreeMap`'s.
//! Inserting or removing moves the entries after it: not for large maps written often.

use std::borrow::Borrow;

/// A map over a `Vec` of `(key, value)` sorted by key, with the `BTreeMap` methods its users need.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VecMap<K, V> {
    entries: Vec<(K, V)>,
}

impl<K, V> Default for VecMap<K, V> {
    fn default() -> Self {
        VecMap { entries: Vec::new() }
    }
}

impl<K: Ord, V> VecMap<K, V> {
    pub const fn new() -> Self {
        VecMap { entries: Vec::new() }
    }

    /// Where `key` is (`Ok`) or would go (`Err`).
    fn find<Q: Ord + ?Sized>(&self, key: &Q) -> Result<usize, usize>
    where
        K: Borrow<Q>,
    {
        self.entries.binary_search_by(|(k, _)| k.borrow().cmp(key))
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn get<Q: Ord + ?Sized>(&self, key: &Q) -> Option<&V>
    where
        K: Borrow<Q>,
    {
        self.find(key).ok().and_then(|i| self.entries.get(i)).map(|(_, v)| v)
    }

    pub fn get_mut<Q: Ord + ?Sized>(&mut self, key: &Q) -> Option<&mut V>
    where
        K: Borrow<Q>,
    {
        self.find(key).ok().and_then(|i| self.entries.get_mut(i)).map(|(_, v)| v)
    }

    pub fn contains_key<Q: Ord + ?Sized>(&self, key: &Q) -> bool
    where
        K: Borrow<Q>,
    {
        self.find(key).is_ok()
    }

    /// Sets `key`'s value; the one it replaces, if any (the key itself is kept, as `BTreeMap` does).
    pub fn insert(&mut self, key: K, value: V) -> Option<V> {
        match self.find(&key) {
            Ok(i) => self.entries.get_mut(i).map(|(_, v)| std::mem::replace(v, value)),
            Err(i) => {
                self.entries.insert(i, (key, value));
                None
            }
        }
    }

    pub fn remove<Q: Ord + ?Sized>(&mut self, key: &Q) -> Option<V>
    where
        K: Borrow<Q>,
    {
        self.find(key).ok().map(|i| self.entries.remove(i).1)
    }

    /// `key`'s value, inserted with `make` when absent (`BTreeMap`'s `entry(key).or_insert_with`).
    pub fn get_or_insert_with(&mut self, key: K, make: impl FnOnce() -> V) -> &mut V {
        let i = match self.find(&key) {
            Ok(i) => i,
            Err(i) => {
                self.entries.insert(i, (key, make()));
                i
            }
        };
        // In bounds: found or just inserted there.
        #[allow(clippy::indexing_slicing)]
        &mut self.entries[i].1
    }

    /// [`get_or_insert_with`](VecMap::get_or_insert_with) by a borrowed key, made owned only when
    /// it is inserted.
    pub fn get_or_insert_with_borrowed<Q>(&mut self, key: &Q, make: impl FnOnce() -> V) -> &mut V
    where
        K: Borrow<Q>,
        Q: Ord + ToOwned<Owned = K> + ?Sized,
    {
        let i = match self.find(key) {
            Ok(i) => i,
            Err(i) => {
                self.entries.insert(i, (key.to_owned(), make()));
                i
            }
        };
        // In bounds: found or just inserted there.
        #[allow(clippy::indexing_slicing)]
        &mut self.entries[i].1
    }

    /// Keeps the entries `keep` returns `true` for, in order.
    pub fn retain(&mut self, mut keep: impl FnMut(&K, &mut V) -> bool) {
        self.entries.retain_mut(|(k, v)| keep(k, v));
    }

    pub fn clear(&mut self) {
        self.entries.clear();
    }

    /// The entries in key order.
    pub fn iter(&self) -> impl Iterator<Item = (&K, &V)> {
        self.entries.iter().map(|(k, v)| (k, v))
    }

    pub fn iter_mut(&mut self) -> impl Iterator<Item = (&K, &mut V)> {
        self.entries.iter_mut().map(|(k, v)| (&*k, v))
    }

    pub fn keys(&self) -> impl Iterator<Item = &K> {
        self.entries.iter().map(|(k, _)| k)
    }

    pub fn values(&self) -> impl Iterator<Item = &V> {
        self.entries.iter().map(|(_, v)| v)
    }

    pub fn values_mut(&mut self) -> impl Iterator<Item = &mut V> {
        self.entries.iter_mut().map(|(_, v)| v)
    }
}

impl<K, V> IntoIterator for VecMap<K, V> {
    type Item = (K, V);
    type IntoIter = std::vec::IntoIter<(K, V)>;

    /// The entries in key order.
    fn into_iter(self) -> Self::IntoIter {
        self.entries.into_iter()
    }
}

/// A JSON object in key order, as a `BTreeMap` is serialized.
impl<K: serde::Serialize, V: serde::Serialize> serde::Serialize for VecMap<K, V> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_map(self.entries.iter().map(|(k, v)| (k, v)))
    }
}

/// From a map as a `BTreeMap` is deserialized: a repeated key keeps its last value, and the
/// errors are worded alike (`expected a map`).
impl<'de, K: serde::Deserialize<'de> + Ord, V: serde::Deserialize<'de>> serde::Deserialize<'de> for VecMap<K, V> {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor<K, V>(std::marker::PhantomData<(K, V)>);
        impl<'de, K: serde::Deserialize<'de> + Ord, V: serde::Deserialize<'de>> serde::de::Visitor<'de> for Visitor<K, V> {
            type Value = VecMap<K, V>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a map")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut access: A) -> Result<Self::Value, A::Error> {
                let mut map = VecMap::new();
                while let Some((k, v)) = access.next_entry()? {
                    map.insert(k, v);
                }
                Ok(map)
            }
        }
        deserializer.deserialize_map(Visitor(std::marker::PhantomData))
    }
}

#[cfg(test)]
mod tests {
    use super::VecMap;
    use std::collections::BTreeMap;

    /// The same operations on a `VecMap` and a `BTreeMap` leave the same entries in the same order.
    #[test]
    fn behaves_as_a_btreemap() {
        let mut v: VecMap<String, u32> = VecMap::new();
        let mut b: BTreeMap<String, u32> = BTreeMap::new();
        let mut x = 7u32;
        for step in 0..2000u32 {
            x = x.wrapping_mul(1_103_515_245).wrapping_add(12_345);
            let key = format!("k{}", (x >> 16) % 97);
            match step % 5 {
                0 | 1 => assert_eq!(v.insert(key.clone(), step), b.insert(key, step)),
                2 => assert_eq!(v.remove(&key), b.remove(&key)),
                3 => {
                    *v.get_or_insert_with(key.clone(), || step) += 1;
                    *b.entry(key).or_insert_with(|| step) += 1;
                }
                _ => {
                    v.retain(|_, n| *n % 3 != 0);
                    b.retain(|_, n| *n % 3 != 0);
                }
            }
            assert_eq!(v.get("k5"), b.get("k5"));
            assert_eq!(v.contains_key("k6"), b.contains_key("k6"));
            assert_eq!(v.len(), b.len());
        }
        assert!(v.iter().eq(b.iter()));
        assert!(v.keys().eq(b.keys()) && v.values().eq(b.values()));
        v.clear();
        assert!(v.is_empty());
    }

    /// Serialized and deserialized as a `BTreeMap`: the same JSON, the same last-wins on a repeated
    /// key, the same errors.
    #[test]
    fn serde_as_a_btreemap() {
        for text in [r#"{"b": 2, "a": 1, "b": 3}"#, "{}", "[1]", r#"{"a": "x"}"#, "7"] {
            let v = serde_json::from_str::<VecMap<String, u64>>(text).map_err(|e| e.to_string());
            let b = serde_json::from_str::<BTreeMap<String, u64>>(text).map_err(|e| e.to_string());
            assert_eq!(v.as_ref().map(|v| serde_json::to_string(v).unwrap()), b.as_ref().map(|b| serde_json::to_string(b).unwrap()), "{text}");
            assert_eq!(v.map(|v| v.into_iter().collect::<Vec<_>>()), b.map(|b| b.into_iter().collect::<Vec<_>>()), "{text}");
        }
    }
}
