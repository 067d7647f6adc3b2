//! A header map as the proxy-wasm ABI serialises it (`proxy_get_header_map_pairs`), read once per
//! callback instead of one hostcall per header.
//!
//! Each hostcall costs Envoy about as much as a page of the plugin's own code
//! (`benches/envoy_hostcalls.py`: ≈ 1–2 µs for one header read), and a callback that reads four or
//! more headers — or removes headers a client may have sent, most of which are absent — pays less
//! for one read of the whole map. Layout: a little-endian `u32` count, then a `u32` name size and a
//! `u32` value size per entry, then each name and each value followed by a NUL byte.

use std::ops::Range;

/// Whether a `content-encoding` value says the body is encoded (anything but `identity`, in any
/// case): its bytes are then not the JSON the policies read.
pub fn is_encoded(content_encoding: &[u8]) -> bool {
    !content_encoding.eq_ignore_ascii_case(b"identity")
}

/// The entries of one header map, in the host's order. Names compare ASCII case-insensitively
/// (Envoy keeps them lower case; a configured name may not be).
#[derive(Debug, Clone, Default)]
pub struct HeaderPairs {
    bytes: Vec<u8>,
    entries: Vec<(Range<usize>, Range<usize>)>,
}

impl HeaderPairs {
    /// `pairs` in the ABI's layout, as `proxy_get_header_map_pairs` returns them: what [`parse`]
    /// reads, for hosts that hold a request in memory (the harness, the native drivers of the
    /// flows) and for tests.
    ///
    /// [`parse`]: HeaderPairs::parse
    pub fn serialize<N: AsRef<[u8]>, V: AsRef<[u8]>>(pairs: &[(N, V)]) -> Vec<u8> {
        let size = |n: usize| u32::try_from(n).unwrap_or(u32::MAX).to_le_bytes();
        let mut out = size(pairs.len()).to_vec();
        for (name, value) in pairs {
            out.extend_from_slice(&size(name.as_ref().len()));
            out.extend_from_slice(&size(value.as_ref().len()));
        }
        for (name, value) in pairs {
            out.extend_from_slice(name.as_ref());
            out.push(0);
            out.extend_from_slice(value.as_ref());
            out.push(0);
        }
        out
    }

    /// The map of `pairs`, for hosts that hold a request in memory or read it as name–value
    /// pairs (the playground, the native module): one copy into the layout [`parse`] reads.
    ///
    /// [`parse`]: HeaderPairs::parse
    pub fn from_pairs<N: AsRef<[u8]>, V: AsRef<[u8]>>(pairs: &[(N, V)]) -> HeaderPairs {
        // What `serialize` writes always follows the layout.
        HeaderPairs::parse(HeaderPairs::serialize(pairs)).unwrap_or_default()
    }

    /// Reads `serialized`; `None` when the bytes do not follow the layout (nothing is guessed).
    pub fn parse(serialized: Vec<u8>) -> Option<HeaderPairs> {
        if serialized.is_empty() {
            return Some(HeaderPairs::default());
        }
        let word = |at: usize| -> Option<usize> {
            let bytes: [u8; 4] = serialized.get(at..at.checked_add(4)?)?.try_into().ok()?;
            usize::try_from(u32::from_le_bytes(bytes)).ok()
        };
        let count = word(0)?;
        let mut data_at = count.checked_mul(8)?.checked_add(4)?;
        if data_at > serialized.len() {
            return None;
        }
        let mut entries = Vec::with_capacity(count);
        for index in 0..count {
            let sizes_at = index.checked_mul(8)?.checked_add(4)?;
            let (name_len, value_len) = (word(sizes_at)?, word(sizes_at.checked_add(4)?)?);
            let name = data_at..data_at.checked_add(name_len)?;
            let value_at = name.end.checked_add(1)?;
            let value = value_at..value_at.checked_add(value_len)?;
            data_at = value.end.checked_add(1)?;
            if data_at > serialized.len() {
                return None;
            }
            entries.push((name, value));
        }
        Some(HeaderPairs { bytes: serialized, entries })
    }

    fn named<'a, 'n>(&'a self, name: &'n str) -> impl Iterator<Item = &'a [u8]> + use<'a, 'n> {
        self.entries.iter().filter_map(move |(n, v)| {
            let entry_name = self.bytes.get(n.clone())?;
            entry_name.eq_ignore_ascii_case(name.as_bytes()).then(|| self.bytes.get(v.clone())).flatten()
        })
    }

    /// The first value of `name` — what Envoy's single-value read (`proxy_get_header_map_value`)
    /// returns for a repeated header.
    pub fn first(&self, name: &str) -> Option<&[u8]> {
        self.named(name).next()
    }

    /// The first value of `name` as text (bytes that are not UTF-8 replaced, as the single-value
    /// reads of the plugins do).
    pub fn text(&self, name: &str) -> Option<String> {
        self.first(name).map(|v| String::from_utf8_lossy(v).into_owned())
    }

    /// How many entries are named `name`.
    pub fn count(&self, name: &str) -> usize {
        self.named(name).count()
    }

    /// Whether any entry is named `name`.
    pub fn contains(&self, name: &str) -> bool {
        self.first(name).is_some()
    }

    /// The value of `name` when it is present exactly once; a repeated header is no value (a
    /// client's copy ahead of the one an auth filter appended must not be read as it).
    pub fn single(&self, name: &str) -> Option<&[u8]> {
        let mut values = self.named(name);
        let first = values.next()?;
        values.next().is_none().then_some(first)
    }
}

#[cfg(test)]
mod tests {
    use super::HeaderPairs;

    fn serialise(pairs: &[(&str, &[u8])]) -> Vec<u8> {
        HeaderPairs::serialize(pairs)
    }

    #[test]
    fn reads_first_values_counts_and_singles_in_any_case() {
        let map = serialise(&[(":path", b"/v1/chat/completions"), ("x-tenant", b"a"), ("X-Tenant", b"b"), ("x-bin", b"\xff\xfe"), ("empty", b"")]);
        let pairs = HeaderPairs::parse(map).expect("well-formed");
        assert_eq!(pairs.first(":path"), Some(&b"/v1/chat/completions"[..]));
        assert_eq!(pairs.text("x-TENANT").as_deref(), Some("a"));
        assert_eq!(pairs.count("x-tenant"), 2);
        assert_eq!(pairs.single("x-tenant"), None);
        assert_eq!(pairs.single(":path"), Some(&b"/v1/chat/completions"[..]));
        assert_eq!(pairs.text("x-bin").as_deref(), Some("\u{fffd}\u{fffd}"));
        assert_eq!(pairs.first("empty"), Some(&b""[..]));
        assert!(pairs.contains("empty"));
        assert!(!pairs.contains("absent"));
        assert_eq!(pairs.count("absent"), 0);
    }

    #[test]
    fn an_empty_map_is_empty_and_a_broken_one_is_refused() {
        assert_eq!(HeaderPairs::parse(Vec::new()).map(|p| p.count("a")), Some(0));
        let good = serialise(&[("a", b"1"), ("b", b"2")]);
        for cut in 1..good.len() {
            assert!(HeaderPairs::parse(good[..cut].to_vec()).is_none(), "cut at {cut}");
        }
        let mut huge = good.clone();
        huge[0..4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(HeaderPairs::parse(huge).is_none());
        let mut long_name = good;
        long_name[4..8].copy_from_slice(&1000u32.to_le_bytes());
        assert!(HeaderPairs::parse(long_name).is_none());
    }
}
