//! API-key hashing and extraction, JWT payload claims.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use proptest::prelude::*;
use sluice_core::identity::{api_key_from_headers, header_occurrences, jwt_payload_claim, sha256_hex, MAX_JWT_PAYLOAD_HEADER_BYTES};

#[test]
fn sha256_known_vectors() {
    assert_eq!(sha256_hex(b""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
    assert_eq!(sha256_hex(b"abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    assert_eq!(sha256_hex(b"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"), "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
}

fn key(auth: Option<&[u8]>, x: Option<&[u8]>) -> Option<String> {
    api_key_from_headers(auth, x).map(|k| String::from_utf8(k).unwrap())
}

#[test]
fn bearer_parsing() {
    assert_eq!(key(Some(b"Bearer sk-abc"), None).as_deref(), Some("sk-abc"));
    assert_eq!(key(Some(b"bearer    k"), None).as_deref(), Some("k"));
    assert_eq!(key(Some(b"BEARER\tk \t"), None).as_deref(), Some("k"));
    assert_eq!(key(Some(b"  Bearer k"), None).as_deref(), Some("k"));
    assert_eq!(key(Some(b"Basic dXNlcjpwYXNz"), None), None);
    assert_eq!(key(Some(b"Bearer"), None), None);
    assert_eq!(key(Some(b"Bearer "), None), None);
    assert_eq!(key(Some(b"Bearer    "), None), None);
    assert_eq!(key(Some(b"Bearerk"), None), None, "scheme must be followed by space");
    assert_eq!(key(Some(b"Bearer a b"), None), None, "inner space");
    assert_eq!(key(Some(b"Bearer k\x00"), None), None, "control byte");
    assert_eq!(key(Some(b"Bearer k\xff\xfe"), None), None, "non-UTF-8");
    assert_eq!(key(Some(b"B\xc3\xa9arer k"), None), None, "non-ASCII scheme");
    assert_eq!(key(Some(b""), None), None);
    assert_eq!(key(None, None), None);
}

#[test]
fn x_api_key_and_precedence() {
    assert_eq!(key(None, Some(b"sk-ant-api03-xyz")).as_deref(), Some("sk-ant-api03-xyz"));
    assert_eq!(key(None, Some(b"  k  ")).as_deref(), Some("k"));
    assert_eq!(key(None, Some(b"")), None);
    assert_eq!(key(None, Some(b"   ")), None);
    assert_eq!(key(None, Some(b"\xff")), None);
    // Bearer wins when both are usable; an unusable authorization falls back to x-api-key.
    assert_eq!(key(Some(b"Bearer a"), Some(b"b")).as_deref(), Some("a"));
    assert_eq!(key(Some(b"Basic a"), Some(b"b")).as_deref(), Some("b"));
    assert_eq!(key(Some(b""), Some(b"b")).as_deref(), Some("b"));
    // Oversized keys are refused.
    let long = vec![b'k'; 2000];
    assert_eq!(api_key_from_headers(None, Some(&long)), None);
}

/// base64url without padding, as Envoy's jwt_authn forwards the payload.
fn b64url(data: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::new();
    for chunk in data.chunks(3) {
        let b = [chunk[0], *chunk.get(1).unwrap_or(&0), *chunk.get(2).unwrap_or(&0)];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        let chars = chunk.len() + 1;
        for i in 0..chars {
            out.push(A[((n >> (18 - 6 * i)) & 63) as usize] as char);
        }
    }
    out
}

fn padded(s: &str) -> String {
    let mut s = s.to_owned();
    while !s.len().is_multiple_of(4) {
        s.push('=');
    }
    s
}

const PAYLOAD: &str = r#"{"iss":"https://issuer.example","sub":"user-1","tenant":"acme","org":{"team":"ml","id":42,"deep":{"x":"y"}},"https://example.com/tenant":"namespaced","n":1.5,"neg":-3,"flag":true,"empty":"","groups":["a","b"],"nul":null,"u":"h\u00e9\"llo"}"#;

#[test]
fn jwt_claims() {
    let h = b64url(PAYLOAD.as_bytes());
    assert!(!h.ends_with('='));
    let get = |c: &str| jwt_payload_claim(h.as_bytes(), c);
    assert_eq!(get("tenant").as_deref(), Some("acme"));
    assert_eq!(get("sub").as_deref(), Some("user-1"));
    assert_eq!(get("org.team").as_deref(), Some("ml"));
    assert_eq!(get("org.id").as_deref(), Some("42"));
    assert_eq!(get("org.deep.x").as_deref(), Some("y"));
    assert_eq!(get("https://example.com/tenant").as_deref(), Some("namespaced"));
    assert_eq!(get("n").as_deref(), Some("1.5"));
    assert_eq!(get("neg").as_deref(), Some("-3"));
    assert_eq!(get("u").as_deref(), Some("hé\"llo"));
    for absent in ["flag", "empty", "groups", "nul", "org", "missing", "org.missing", "tenant.x", "", ".", "org."] {
        assert_eq!(get(absent), None, "{absent}");
    }
}

#[test]
fn jwt_padding_alphabet_and_whitespace() {
    // Lengths that need 0, 1 and 2 padding characters.
    for payload in [r#"{"tenant":"acme"}"#, r#"{"tenant":"acme2"}"#, r#"{"tenant":"acme22"}"#] {
        let h = b64url(payload.as_bytes());
        assert!(jwt_payload_claim(h.as_bytes(), "tenant").is_some(), "{h}");
        let p = padded(&h);
        assert!(jwt_payload_claim(p.as_bytes(), "tenant").is_some(), "{p}");
        let spaced = format!("  {h} ");
        assert!(jwt_payload_claim(spaced.as_bytes(), "tenant").is_some());
    }
    // A payload whose encoding uses '-' / '_' also decodes from the standard alphabet's '+' / '/'.
    let payload = r#"{"tenant":"??>>"}"#;
    let url = b64url(payload.as_bytes());
    assert!(url.contains('-') || url.contains('_'), "{url}");
    let std = url.replace('-', "+").replace('_', "/");
    assert_eq!(jwt_payload_claim(url.as_bytes(), "tenant").as_deref(), Some("??>>"));
    assert_eq!(jwt_payload_claim(std.as_bytes(), "tenant").as_deref(), Some("??>>"));
}

#[test]
fn jwt_garbage_and_oversize() {
    let not_object = b64url(b"[1,2]");
    let not_json = b64url(b"hello");
    let whole_jwt = format!("{}.{}.sig", b64url(br#"{"alg":"RS256"}"#), b64url(PAYLOAD.as_bytes()));
    for h in ["", "!!!", "a", not_object.as_str(), not_json.as_str(), whole_jwt.as_str()] {
        assert_eq!(jwt_payload_claim(h.as_bytes(), "tenant"), None, "{h}");
    }
    assert_eq!(jwt_payload_claim(b"\xff\xfe", "tenant"), None);

    // Just under the limit works, over it does not.
    let filler = |n: usize| format!(r#"{{"tenant":"acme","pad":"{}"}}"#, "x".repeat(n));
    // 16 KiB of base64 is 12 KiB of JSON: start the search just below that.
    let mut n = 12_000;
    let fits = loop {
        let h = b64url(filler(n + 1).as_bytes());
        if h.len() > MAX_JWT_PAYLOAD_HEADER_BYTES {
            break b64url(filler(n).as_bytes());
        }
        n += 1;
    };
    assert!(fits.len() <= MAX_JWT_PAYLOAD_HEADER_BYTES);
    assert_eq!(jwt_payload_claim(fits.as_bytes(), "tenant").as_deref(), Some("acme"));
    let over = b64url(filler(n + 1).as_bytes());
    assert!(over.len() > MAX_JWT_PAYLOAD_HEADER_BYTES);
    assert_eq!(jwt_payload_claim(over.as_bytes(), "tenant"), None);
}

proptest! {
    #[test]
    fn arbitrary_headers_never_panic(
        auth in proptest::collection::vec(any::<u8>(), 0..64),
        x in proptest::collection::vec(any::<u8>(), 0..64),
        claim in "[a-z.]{0,12}",
    ) {
        if let Some(k) = api_key_from_headers(Some(&auth), Some(&x)) {
            prop_assert!(!k.is_empty());
            prop_assert!(k.iter().all(|b| (0x21..=0x7e).contains(b)));
        }
        let _ = jwt_payload_claim(&auth, &claim);
        let _ = sha256_hex(&x);
    }

    #[test]
    fn bearer_round_trip(k in "[!-~]{1,64}", spaces in 1usize..5, scheme in "[bB][eE][aA][rR][eE][rR]") {
        let h = format!("{scheme}{}{k}", " ".repeat(spaces));
        prop_assert_eq!(api_key_from_headers(Some(h.as_bytes()), None), Some(k.into_bytes()));
    }
}

/// A header map serialised as `proxy_get_header_map_pairs` returns it.
fn serialise(pairs: &[(&str, &str)]) -> Vec<u8> {
    sluice_core::headers::HeaderPairs::serialize(pairs)
}

#[test]
fn header_occurrences_counts_repeats_in_any_case() {
    let map = serialise(&[(":path", "/v1/chat/completions"), ("x-sluice-tenant", "globex"), ("x-other", ""), ("X-Sluice-Tenant", "acme")]);
    assert_eq!(header_occurrences(&map, "x-sluice-tenant"), Some(2));
    assert_eq!(header_occurrences(&map, "x-other"), Some(1));
    assert_eq!(header_occurrences(&map, ":path"), Some(1));
    assert_eq!(header_occurrences(&map, "x-absent"), Some(0));
    assert_eq!(header_occurrences(&[], "x-sluice-tenant"), Some(0));
    assert_eq!(header_occurrences(&serialise(&[]), "x-sluice-tenant"), Some(0));
    // Truncated anywhere, or a count larger than the entries: not the layout.
    for cut in 1..map.len() {
        assert_eq!(header_occurrences(&map[..cut], "x-sluice-tenant"), None, "cut at {cut}");
    }
    let mut lying = map.clone();
    lying[0] = 9;
    assert_eq!(header_occurrences(&lying, "x-sluice-tenant"), None);
}

proptest! {
    #[test]
    fn header_occurrences_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        let _ = header_occurrences(&bytes, "x-sluice-tenant");
    }
}
