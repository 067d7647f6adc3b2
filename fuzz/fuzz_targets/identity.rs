//! What a client controls in headers and what plugins read back from filter state: API-key
//! extraction, the repeated-header count over the proxy-wasm serialised header map, JWT payload
//! claims, and the contract's decoders (contract.rs).
//!
//! - a key is visible ASCII, at most `MAX_API_KEY_BYTES`, and appears in the header it came from;
//! - `header_occurrences` on a well-formed map counts the entries with the name, ASCII
//!   case-insensitively; any other bytes give `None` or a count, never a panic;
//! - a JWT claim is never empty;
//! - every decoder reads back what its encoder writes from what it decoded.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sluice_core::contract::{decode_avoid_list, encode_avoid_list, route_version, FirstTokenMark, GatewayReply, ReleaseAddress};
use sluice_core::identity::{api_key_from_headers, header_occurrences, jwt_payload_claim, MAX_API_KEY_BYTES};

/// The proxy-wasm serialisation of a header map.
fn serialise(pairs: &[(&[u8], &[u8])]) -> Vec<u8> {
    let mut out = (pairs.len() as u32).to_le_bytes().to_vec();
    for (n, v) in pairs {
        out.extend_from_slice(&(n.len() as u32).to_le_bytes());
        out.extend_from_slice(&(v.len() as u32).to_le_bytes());
    }
    for (n, v) in pairs {
        out.extend_from_slice(n);
        out.push(0);
        out.extend_from_slice(v);
        out.push(0);
    }
    out
}

fuzz_target!(|data: &[u8]| {
    // Fields separated by 0xFF (never in a UTF-8 text): authorization, x-api-key, claim, rest.
    let mut fields = data.split(|&b| b == 0xFF);
    let auth = fields.next().unwrap_or_default();
    let x_key = fields.next().unwrap_or_default();
    let claim = fields.next().unwrap_or_default();
    let rest = fields.next().unwrap_or_default();

    for (a, x) in [(Some(auth), Some(x_key)), (Some(auth), None), (None, Some(x_key))] {
        if let Some(key) = api_key_from_headers(a, x) {
            assert!(!key.is_empty() && key.len() <= MAX_API_KEY_BYTES, "key of {} bytes", key.len());
            assert!(key.iter().all(|b| (0x21..=0x7e).contains(b)), "key outside visible ASCII: {key:?}");
            let inside = |h: Option<&[u8]>| h.is_some_and(|h| h.windows(key.len()).any(|w| w == key.as_slice()));
            assert!(inside(a) || inside(x), "the key is in neither header");
        }
    }

    // Header maps: the raw bytes, and a well-formed map of the fields as names and values.
    let _ = header_occurrences(data, "x-tenant");
    let names: Vec<&[u8]> = data.split(|&b| b == 0xFF || b == 0).collect();
    let pairs: Vec<(&[u8], &[u8])> = names.chunks(2).map(|p| (p[0], p.get(1).copied().unwrap_or_default())).collect();
    if let Ok(name) = std::str::from_utf8(auth) {
        if !name.is_empty() {
            let want = pairs.iter().filter(|(n, _)| n.eq_ignore_ascii_case(name.as_bytes())).count();
            assert_eq!(header_occurrences(&serialise(&pairs), name), Some(want), "occurrences of {name:?}");
        }
    }

    if let Ok(claim) = std::str::from_utf8(claim) {
        for header in [x_key, rest] {
            if let Some(v) = jwt_payload_claim(header, claim) {
                assert!(!v.is_empty(), "an empty claim value");
            }
        }
    }

    let Ok(text) = std::str::from_utf8(rest) else { return };
    if let Some(r) = GatewayReply::decode(text) {
        assert_eq!(GatewayReply::decode(&r.encode()), Some(r));
    }
    if let Some(a) = ReleaseAddress::decode(text) {
        let encoded = a.encode();
        assert_eq!(ReleaseAddress::decode(&encoded), Some(a));
    }
    let list = decode_avoid_list(text);
    assert!(list.len() <= sluice_core::contract::MAX_AVOIDED_VERSIONS);
    let encoded = encode_avoid_list(list.iter().map(|(v, f)| (v.as_str(), f.as_str())));
    assert_eq!(decode_avoid_list(&encoded), list, "avoid list round trip");
    if let FirstTokenMark::At(t) = FirstTokenMark::parse(Some(text)) {
        assert!(t > 0);
        assert_eq!(FirstTokenMark::parse(Some(&FirstTokenMark::at(t))), FirstTokenMark::At(t));
    }
    let _ = route_version(text);
});
