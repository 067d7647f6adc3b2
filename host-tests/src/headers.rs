//! An ordered header map with byte values, compared the way HTTP compares names (ASCII
//! case-insensitively). Used for request/response headers and trailers, callout replies and gRPC
//! metadata.

use std::fmt;

/// Ordered `(name, value)` pairs; names may repeat; values may be any bytes.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Headers {
    pairs: Vec<(Vec<u8>, Vec<u8>)>,
}

impl Headers {
    /// An empty map.
    pub fn new() -> Self {
        Self::default()
    }

    /// Builds a map from pairs of anything byte-like: `&[(":path", "/"), ("x", "y")]`, or byte
    /// strings for non-UTF-8 values.
    pub fn from_pairs<K: AsRef<[u8]>, V: AsRef<[u8]>>(pairs: &[(K, V)]) -> Self {
        Self { pairs: pairs.iter().map(|(k, v)| (k.as_ref().to_vec(), v.as_ref().to_vec())).collect() }
    }

    pub(crate) fn from_vec(pairs: Vec<(Vec<u8>, Vec<u8>)>) -> Self {
        Self { pairs }
    }

    /// The first value of `name` as text, if present and valid UTF-8.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.get_bytes(name).and_then(|v| std::str::from_utf8(v).ok())
    }

    /// The first value of `name`, if present.
    pub fn get_bytes(&self, name: &str) -> Option<&[u8]> {
        self.first(name.as_bytes())
    }

    /// Every value of `name`, in order.
    pub fn get_all<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a [u8]> + 'a {
        self.pairs.iter().filter(move |(k, _)| k.eq_ignore_ascii_case(name.as_bytes())).map(|(_, v)| v.as_slice())
    }

    /// Whether `name` is present.
    pub fn contains(&self, name: &str) -> bool {
        self.get_bytes(name).is_some()
    }

    /// Number of pairs (a repeated name counts once per value).
    pub fn len(&self) -> usize {
        self.pairs.len()
    }

    /// Whether there are no pairs.
    pub fn is_empty(&self) -> bool {
        self.pairs.is_empty()
    }

    /// The pairs in order.
    pub fn iter(&self) -> impl Iterator<Item = (&[u8], &[u8])> + Clone {
        self.pairs.iter().map(|(k, v)| (k.as_slice(), v.as_slice()))
    }

    /// The names in order, lossily decoded.
    pub fn names(&self) -> Vec<String> {
        self.pairs.iter().map(|(k, _)| String::from_utf8_lossy(k).into_owned()).collect()
    }

    /// Appends a value, keeping existing ones (`proxy_add_header_map_value`).
    pub fn add(&mut self, name: &[u8], value: &[u8]) {
        self.pairs.push((name.to_vec(), value.to_vec()));
    }

    /// Sets `name` to exactly one value: the first occurrence is replaced in place, later ones
    /// removed, and a missing name appended (`proxy_replace_header_map_value`).
    pub fn replace(&mut self, name: &[u8], value: &[u8]) {
        let mut seen = false;
        self.pairs.retain_mut(|(k, v)| {
            if !k.eq_ignore_ascii_case(name) {
                return true;
            }
            if seen {
                return false;
            }
            seen = true;
            *v = value.to_vec();
            true
        });
        if !seen {
            self.add(name, value);
        }
    }

    /// Removes every value of `name`.
    pub fn remove(&mut self, name: &[u8]) {
        self.pairs.retain(|(k, _)| !k.eq_ignore_ascii_case(name));
    }

    pub(crate) fn first(&self, name: &[u8]) -> Option<&[u8]> {
        self.pairs.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_slice())
    }
}

impl fmt::Debug for Headers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.pairs.iter().map(|(k, v)| (String::from_utf8_lossy(k), String::from_utf8_lossy(v)))).finish()
    }
}

impl<K: AsRef<[u8]>, V: AsRef<[u8]>> From<&[(K, V)]> for Headers {
    fn from(pairs: &[(K, V)]) -> Self {
        Self::from_pairs(pairs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_case_insensitive() {
        let h = Headers::from_pairs(&[("Content-Type", "text/plain")]);
        assert_eq!(h.get("content-type"), Some("text/plain"));
    }

    #[test]
    fn replace_keeps_position_and_collapses_duplicates() {
        let mut h = Headers::from_pairs(&[("a", "1"), ("b", "2"), ("a", "3")]);
        h.replace(b"a", b"9");
        assert_eq!(h, Headers::from_pairs(&[("a", "9"), ("b", "2")]));
        h.replace(b"c", b"4");
        assert_eq!(h.get("c"), Some("4"));
    }

    #[test]
    fn non_utf8_values_are_bytes_not_text() {
        let h = Headers::from_pairs(&[(&b"x"[..], &b"\xff"[..])]);
        assert_eq!(h.get("x"), None);
        assert_eq!(h.get_bytes("x"), Some(&b"\xff"[..]));
    }
}
