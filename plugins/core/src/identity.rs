//! Who is calling, from authenticated sources only.
//!
//! Nothing here trusts a header a client can set to *name* a tenant. An API key is a credential: it
//! identifies its holder only after being looked up by hash in a policy ([`sha256_hex`]). A JWT claim
//! is read from the payload Envoy's `jwt_authn` filter forwards after verifying the signature
//! (`forward_payload_header`); the plugin must make sure a client cannot send that header itself
//! (jwt_authn overwrites it only when a token was verified, so strip it in front, or require a
//! verified token on the route).

use base64::engine::general_purpose::{GeneralPurpose, GeneralPurposeConfig};
use base64::engine::DecodePaddingMode;
use base64::{alphabet, Engine};
use serde_json::Value;
use sha2::{Digest, Sha256};

/// Largest JWT payload header accepted by [`jwt_payload_claim`] (bytes, before decoding).
pub const MAX_JWT_PAYLOAD_HEADER_BYTES: usize = 16 * 1024;

/// Longest API key accepted by [`api_key_from_headers`] (bytes). Real keys are well under 256 bytes.
pub const MAX_API_KEY_BYTES: usize = 1024;

/// Lowercase hex SHA-256 of `data` (policies store API keys only by this hash).
pub fn sha256_hex(data: &[u8]) -> String {
    // Every budgeted request hashes its key: digits from a table, not `write!` (32 formatter calls).
    let digest = Sha256::digest(data);
    let mut out = String::with_capacity(64);
    for b in digest {
        crate::text::push_hex_byte(&mut out, b);
    }
    out
}

/// The API key of a request: `authorization: Bearer <key>` (scheme case-insensitive, any number of
/// spaces or tabs around the key), else an `x-api-key` value (Anthropic). Pass the raw header values.
///
/// `None` when neither yields a key: absent or empty headers, another scheme (`Basic …`), a key with
/// bytes outside visible ASCII (`0x21..=0x7e`: control characters, spaces inside the key, non-UTF-8)
/// or longer than [`MAX_API_KEY_BYTES`]. An unusable `authorization` falls back to `x-api-key`.
pub fn api_key_from_headers(authorization: Option<&[u8]>, x_api_key: Option<&[u8]>) -> Option<Vec<u8>> {
    authorization.and_then(bearer_token).or_else(|| x_api_key.map(trim_ows).filter(|k| valid_key(k))).map(<[u8]>::to_vec)
}

/// `<key>` of `Bearer <key>`.
fn bearer_token(value: &[u8]) -> Option<&[u8]> {
    let value = trim_ows(value);
    let scheme = value.get(..6)?;
    if !scheme.eq_ignore_ascii_case(b"bearer") {
        return None;
    }
    let rest = value.get(6..)?;
    // The scheme must be followed by whitespace ("Bearerabc" is not a bearer token).
    if !matches!(rest.first(), Some(b' ' | b'\t')) {
        return None;
    }
    Some(trim_ows(rest)).filter(|k| valid_key(k))
}

fn valid_key(key: &[u8]) -> bool {
    !key.is_empty() && key.len() <= MAX_API_KEY_BYTES && key.iter().all(|b| (0x21..=0x7e).contains(b))
}

/// `value` without leading and trailing spaces and tabs (HTTP optional whitespace).
fn trim_ows(value: &[u8]) -> &[u8] {
    let is_ows = |b: &u8| *b == b' ' || *b == b'\t';
    let start = value.iter().position(|b| !is_ows(b)).unwrap_or(value.len());
    let end = value.iter().rposition(|b| !is_ows(b)).map_or(start, |p| p.saturating_add(1));
    value.get(start..end).unwrap_or_default()
}

/// How many entries named `name` (ASCII case-insensitive) a header map holds, from the map as the
/// proxy-wasm ABI serialises it (`proxy_get_header_map_pairs`): a little-endian `u32` count, then a
/// `u32` name size and a `u32` value size per entry, then each name and each value followed by a
/// NUL byte. `None` when the bytes do not follow that layout.
///
/// Envoy's single-value read (`proxy_get_header_map_value`) returns only the first of a repeated
/// header, so an identity read that way would let a second copy — or a client's copy ahead of the
/// one an auth filter appended — go unseen; callers use this to refuse a repeated identity source.
pub fn header_occurrences(serialized: &[u8], name: &str) -> Option<usize> {
    crate::headers::HeaderPairs::parse(serialized.to_vec()).map(|pairs| pairs.count(name))
}

const PADDING_INDIFFERENT: GeneralPurposeConfig = GeneralPurposeConfig::new().with_decode_padding_mode(DecodePaddingMode::Indifferent);
const URL_SAFE_ANY_PADDING: GeneralPurpose = GeneralPurpose::new(&alphabet::URL_SAFE, PADDING_INDIFFERENT);
const STANDARD_ANY_PADDING: GeneralPurpose = GeneralPurpose::new(&alphabet::STANDARD, PADDING_INDIFFERENT);

/// A claim from the JSON payload Envoy's `jwt_authn` filter forwards in `forward_payload_header`:
/// base64url without padding (padding and the standard `+/` alphabet are accepted too).
///
/// `claim` is a dot path (`"tenant"`, `"org.team"`). A key that itself contains dots (namespaced
/// claims such as `"https://example.com/tenant"`) is matched whole first; otherwise the path is split
/// at its dots, shortest first segment first. String claims are returned as they are, numbers as
/// their decimal text (`42`, `1.5`). `None` when the header is longer than
/// [`MAX_JWT_PAYLOAD_HEADER_BYTES`], is not base64 of a JSON object, or the claim is absent, empty,
/// or of another type (boolean, null, array, object).
pub fn jwt_payload_claim(header_value: &[u8], claim: &str) -> Option<String> {
    if header_value.len() > MAX_JWT_PAYLOAD_HEADER_BYTES || claim.is_empty() {
        return None;
    }
    let encoded = trim_ows(header_value);
    let payload = URL_SAFE_ANY_PADDING.decode(encoded).or_else(|_| STANDARD_ANY_PADDING.decode(encoded)).ok()?;
    let v: Value = serde_json::from_slice(&payload).ok()?;
    if !v.is_object() {
        return None;
    }
    match lookup(&v, claim, 0)? {
        Value::String(s) if !s.is_empty() => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

/// Dot paths deeper than this are not resolved (config paths are short; this bounds the search).
const MAX_CLAIM_DEPTH: usize = 16;

/// `v` at dot path `path`: the whole path as one key first, then every split at a dot.
fn lookup<'a>(v: &'a Value, path: &str, depth: usize) -> Option<&'a Value> {
    let obj = v.as_object()?;
    if let Some(found) = obj.get(path) {
        return Some(found);
    }
    if depth >= MAX_CLAIM_DEPTH {
        return None;
    }
    path.match_indices('.').find_map(|(i, _)| {
        let head = path.get(..i)?;
        let tail = path.get(i.saturating_add(1)..)?;
        lookup(obj.get(head)?, tail, depth.saturating_add(1))
    })
}
