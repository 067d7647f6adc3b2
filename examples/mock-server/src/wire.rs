//! How an answer looks on the wire, beyond its content: a content-encoding (gzip, br, zstd), a
//! UTF-8 byte-order mark before the first event, chunked trailers, no `content-type`, an
//! unsolicited `100 Continue` before the head, padded token events. Set per request with
//! `x-mock-*` headers like [`crate::controls`], so a test drives these faults from the client side.
//!
//! The encoders write valid streams of each format with *stored* (uncompressed) blocks — a gzip
//! stream of stored deflate blocks with its CRC-32, a brotli stream of uncompressed meta-blocks, a
//! zstd frame of raw blocks. No compression library is needed, and every event leaves as one
//! complete block, flushed: what a server that sync-flushes its compressor after each event sends,
//! so a decoder in front of the plugins can hand each event on as it arrives.

/// A response content-encoding the mock can write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encoding {
    Gzip,
    Brotli,
    Zstd,
}

impl Encoding {
    /// The `content-encoding` token.
    pub fn name(self) -> &'static str {
        match self {
            Encoding::Gzip => "gzip",
            Encoding::Brotli => "br",
            Encoding::Zstd => "zstd",
        }
    }
}

/// The wire-level shape of one answer.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Wire {
    /// `x-mock-encoding: gzip | br | zstd | identity`.
    pub encoding: Option<Encoding>,
    /// `x-mock-bom: 1`: a UTF-8 BOM (EF BB BF) before the first byte of the body.
    pub bom: bool,
    /// `x-mock-trailers: 1`: the chunked body ends with trailers (`x-mock-tokens-sent: N`).
    pub trailers: bool,
    /// `x-mock-content-type: none`: no `content-type` header on the answer.
    pub no_content_type: bool,
    /// `x-mock-100-continue: 1`: an interim `100 Continue` head before the response head, asked
    /// for or not.
    pub continue_first: bool,
    /// `x-mock-token-bytes: N`: each content token's text padded with `x` to at least N bytes.
    pub token_bytes: usize,
}

/// Largest padded token accepted: room for a 10 MiB single event and then some.
pub const MAX_TOKEN_BYTES: u64 = 16 * 1024 * 1024;

impl Wire {
    /// Reads the `x-mock-*` wire headers found by `header`; a value the mock does not understand is
    /// an error (answered 400), as for [`crate::controls::Controls::from_headers`].
    pub fn from_headers<'a>(header: impl Fn(&str) -> Option<&'a str>) -> Result<Wire, String> {
        let flag = |name: &str| -> Result<bool, String> {
            match header(name).map(str::trim) {
                None | Some("0") | Some("false") => Ok(false),
                Some("1") | Some("true") => Ok(true),
                Some(v) => Err(format!("{name}: expected 0 or 1, got {v:?}")),
            }
        };
        let encoding = match header("x-mock-encoding").map(|v| v.trim().to_ascii_lowercase()) {
            None => None,
            Some(v) => match v.as_str() {
                "identity" => None,
                "gzip" => Some(Encoding::Gzip),
                "br" => Some(Encoding::Brotli),
                "zstd" => Some(Encoding::Zstd),
                _ => return Err(format!("x-mock-encoding: expected gzip, br, zstd or identity, got {v:?}")),
            },
        };
        let no_content_type = match header("x-mock-content-type").map(str::trim) {
            None => false,
            Some("none") => true,
            Some(v) => return Err(format!("x-mock-content-type: expected none, got {v:?}")),
        };
        let token_bytes = match header("x-mock-token-bytes") {
            None => 0,
            Some(v) => match v.trim().parse::<u64>() {
                Ok(n) if n <= MAX_TOKEN_BYTES => usize::try_from(n).unwrap_or(usize::MAX),
                _ => return Err(format!("x-mock-token-bytes: expected an integer from 0 to {MAX_TOKEN_BYTES}, got {v:?}")),
            },
        };
        Ok(Wire {
            encoding,
            bom: flag("x-mock-bom")?,
            trailers: flag("x-mock-trailers")?,
            no_content_type,
            continue_first: flag("x-mock-100-continue")?,
            token_bytes,
        })
    }
}

/// The UTF-8 byte-order mark.
pub const BOM: &[u8] = b"\xEF\xBB\xBF";

/// An encoder of one response body, fed piece by piece; each piece leaves as complete blocks.
#[derive(Debug)]
pub struct Encoder {
    encoding: Encoding,
    started: bool,
    /// gzip: CRC-32 and length (mod 2^32) of the data so far.
    crc: u32,
    size: u32,
}

/// Stored deflate blocks and brotli uncompressed meta-blocks carry at most this many bytes here
/// (deflate's limit is 65,535; four brotli nibbles give 65,536).
const STORED_BLOCK: usize = 65_535;
/// zstd raw blocks: at most 128 KiB (the window declared below is as large).
const ZSTD_BLOCK: usize = 128 * 1024;

impl Encoder {
    pub fn new(encoding: Encoding) -> Encoder {
        Encoder { encoding, started: false, crc: 0, size: 0 }
    }

    /// The stream's header, once, before its first block.
    fn header(&mut self, out: &mut Vec<u8>) {
        if std::mem::replace(&mut self.started, true) {
            return;
        }
        match self.encoding {
            // Magic, deflate, no flags, no mtime, no extra flags, OS unknown.
            Encoding::Gzip => out.extend_from_slice(&[0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 0xff]),
            // Brotli's window bits share the first byte with the first meta-block: see `block`.
            Encoding::Brotli => {}
            // Magic; frame header: no content size, not single-segment, no checksum, no
            // dictionary; window descriptor 2^17 (exponent 7, mantissa 0), the raw block limit.
            Encoding::Zstd => out.extend_from_slice(&[0x28, 0xb5, 0x2f, 0xfd, 0x00, 0x38]),
        }
    }

    /// `data` as complete blocks (empty input: nothing, once the header has gone).
    pub fn push(&mut self, data: &[u8]) -> Vec<u8> {
        let first = !self.started;
        let mut out = Vec::with_capacity(data.len() + 16);
        self.header(&mut out);
        match self.encoding {
            Encoding::Gzip => {
                self.crc = crc32_update(self.crc, data);
                self.size = self.size.wrapping_add(u32::try_from(data.len() % (1 << 32)).unwrap_or(0));
                for piece in data.chunks(STORED_BLOCK) {
                    stored_deflate_block(&mut out, piece, false);
                }
            }
            Encoding::Brotli => {
                for (i, piece) in data.chunks(STORED_BLOCK).enumerate() {
                    brotli_uncompressed_meta_block(&mut out, piece, first && i == 0);
                }
                if first && data.is_empty() {
                    // Nothing to carry yet; the window bits go out with the first real block.
                    self.started = false;
                }
            }
            Encoding::Zstd => {
                for piece in data.chunks(ZSTD_BLOCK) {
                    zstd_raw_block(&mut out, piece, false);
                }
            }
        }
        out
    }

    /// The end of the stream: a final empty block and the format's trailer.
    pub fn finish(&mut self) -> Vec<u8> {
        let first = !self.started;
        let mut out = Vec::new();
        self.header(&mut out);
        match self.encoding {
            Encoding::Gzip => {
                stored_deflate_block(&mut out, &[], true);
                out.extend_from_slice(&self.crc.to_le_bytes());
                out.extend_from_slice(&self.size.to_le_bytes());
            }
            // WBITS = 16 (one 0 bit) if nothing went before, then ISLAST = 1, ISLASTEMPTY = 1.
            Encoding::Brotli => out.push(if first { 0b110 } else { 0b11 }),
            Encoding::Zstd => zstd_raw_block(&mut out, &[], true),
        }
        out
    }

    /// A whole body encoded at once.
    pub fn encode_all(encoding: Encoding, data: &[u8]) -> Vec<u8> {
        let mut e = Encoder::new(encoding);
        let mut out = e.push(data);
        out.extend_from_slice(&e.finish());
        out
    }
}

/// One stored deflate block (RFC 1951 §3.2.4), byte-aligned: BFINAL, BTYPE = 00, LEN, NLEN, data.
fn stored_deflate_block(out: &mut Vec<u8>, data: &[u8], last: bool) {
    let len = u16::try_from(data.len()).unwrap_or(u16::MAX);
    out.push(u8::from(last));
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(&(!len).to_le_bytes());
    out.extend_from_slice(data.get(..usize::from(len)).unwrap_or(data));
}

/// One uncompressed brotli meta-block (RFC 7932 §9.2): ISLAST = 0, MNIBBLES = 4, MLEN − 1,
/// ISUNCOMPRESSED = 1, zero bits to the byte boundary, then the bytes. The very first one is
/// preceded by WBITS = 16, a single 0 bit. Bits are packed from the least significant.
fn brotli_uncompressed_meta_block(out: &mut Vec<u8>, data: &[u8], first: bool) {
    if data.is_empty() {
        return; // an uncompressed meta-block cannot be empty
    }
    let mlen_minus_1 = u32::try_from(data.len() - 1).unwrap_or(0) & 0xffff;
    let (mut bits, mut n) = (0u32, 0u32);
    let mut put = |value: u32, width: u32| {
        bits |= value << n;
        n += width;
    };
    if first {
        put(0, 1); // WBITS = 16
    }
    put(0, 1); // ISLAST
    put(0, 2); // MNIBBLES = 4
    put(mlen_minus_1, 16);
    put(1, 1); // ISUNCOMPRESSED
    for i in 0..n.div_ceil(8) {
        out.push(u8::try_from((bits >> (8 * i)) & 0xff).unwrap_or(0));
    }
    out.extend_from_slice(data);
}

/// One raw zstd block (RFC 8878 §3.1.1.2): a 3-byte little-endian header (Last_Block, Block_Type
/// = 0, Block_Size) and the bytes.
fn zstd_raw_block(out: &mut Vec<u8>, data: &[u8], last: bool) {
    let header = (u32::try_from(data.len()).unwrap_or(0) << 3) | u32::from(last);
    out.extend_from_slice(header.to_le_bytes().get(..3).unwrap_or_default());
    out.extend_from_slice(data);
}

/// CRC-32 (IEEE, reflected, as gzip uses), continued from `crc` over `data`.
pub fn crc32_update(crc: u32, data: &[u8]) -> u32 {
    let mut c = !crc;
    for &b in data {
        c ^= u32::from(b);
        for _ in 0..8 {
            c = if c & 1 == 1 { (c >> 1) ^ 0xedb8_8320 } else { c >> 1 };
        }
    }
    !c
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]
    use super::*;

    fn with(headers: &[(&'static str, &'static str)]) -> Result<Wire, String> {
        let h = headers.to_vec();
        Wire::from_headers(move |n| h.iter().find(|(k, _)| *k == n).map(|(_, v)| *v))
    }

    #[test]
    fn headers_set_the_wire_shape_and_bad_values_are_refused() {
        assert_eq!(with(&[]).unwrap(), Wire::default());
        let w = with(&[
            ("x-mock-encoding", "BR"),
            ("x-mock-bom", "1"),
            ("x-mock-trailers", "true"),
            ("x-mock-content-type", "none"),
            ("x-mock-100-continue", "1"),
            ("x-mock-token-bytes", "1024"),
        ])
        .unwrap();
        assert_eq!(w, Wire { encoding: Some(Encoding::Brotli), bom: true, trailers: true, no_content_type: true, continue_first: true, token_bytes: 1024 });
        assert_eq!(with(&[("x-mock-encoding", "identity")]).unwrap().encoding, None);
        for bad in [("x-mock-encoding", "deflate"), ("x-mock-bom", "yes"), ("x-mock-content-type", "text/plain"), ("x-mock-token-bytes", "99999999999")] {
            assert!(with(&[bad]).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn crc32_matches_the_standard_check_value() {
        assert_eq!(crc32_update(0, b"123456789"), 0xcbf4_3926);
        // Continued over pieces, the same value.
        assert_eq!(crc32_update(crc32_update(0, b"12345"), b"6789"), 0xcbf4_3926);
    }

    #[test]
    fn gzip_of_stored_blocks_has_the_exact_layout() {
        let out = Encoder::encode_all(Encoding::Gzip, b"abc");
        let mut want = vec![0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 0xff, 0, 3, 0, 0xfc, 0xff, b'a', b'b', b'c', 1, 0, 0, 0xff, 0xff];
        want.extend_from_slice(&crc32_update(0, b"abc").to_le_bytes());
        want.extend_from_slice(&3u32.to_le_bytes());
        assert_eq!(out, want);
    }

    #[test]
    fn brotli_and_zstd_blocks_have_the_exact_layout() {
        // Brotli: WBITS 0, ISLAST 0, MNIBBLES 00, MLEN-1 = 2 (16 bits), ISUNCOMPRESSED 1 → 21 bits.
        let out = Encoder::encode_all(Encoding::Brotli, b"abc");
        assert_eq!(out, vec![0b0010_0000, 0x00, 0b0001_0000, b'a', b'b', b'c', 0b11]);
        assert_eq!(Encoder::encode_all(Encoding::Brotli, b""), vec![0b110]);
        let out = Encoder::encode_all(Encoding::Zstd, b"abc");
        assert_eq!(out, vec![0x28, 0xb5, 0x2f, 0xfd, 0x00, 0x38, 3 << 3, 0, 0, b'a', b'b', b'c', 1, 0, 0]);
    }

    #[test]
    fn large_pieces_split_into_blocks_within_each_formats_limit() {
        let data = vec![b'x'; 300_000];
        let gz = Encoder::encode_all(Encoding::Gzip, &data);
        assert_eq!(gz.len(), 10 + 300_000 + 5 * 300_000usize.div_ceil(STORED_BLOCK) + 5 + 8);
        let zs = Encoder::encode_all(Encoding::Zstd, &data);
        assert_eq!(zs.len(), 6 + 300_000 + 3 * 300_000usize.div_ceil(ZSTD_BLOCK) + 3);
        let br = Encoder::encode_all(Encoding::Brotli, &data);
        assert_eq!(br.len(), 300_000 + 3 * 300_000usize.div_ceil(STORED_BLOCK) + 1);
    }
}
