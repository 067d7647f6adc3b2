//! The proxy-wasm ABI 0.2.1 vocabulary: the enums that cross the boundary and the wire format of
//! header maps and property paths. Nothing here touches wasm memory.

use std::fmt;

/// What a hostcall returns to the plugin (`WasmResult` in the spec).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum Status {
    Ok = 0,
    NotFound = 1,
    BadArgument = 2,
    SerializationFailure = 3,
    ParseFailure = 4,
    InvalidMemoryAccess = 6,
    Empty = 7,
    CasMismatch = 8,
    InternalFailure = 10,
    Unimplemented = 12,
}

impl Status {
    /// The code as the plugin receives it.
    pub fn code(self) -> u32 {
        self as u32
    }
}

/// Result type of a hostcall body: `Err` is a trap (a host bug or a plugin that broke the ABI in a
/// way no status can describe); a `Status` is the ordinary answer.
pub(crate) type HostcallResult = wasmtime::Result<u32>;

/// Returns `status` to the plugin.
pub(crate) fn reply(status: Status) -> HostcallResult {
    Ok(status.code())
}

/// A log level, as the plugin passes it to `proxy_log`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(u32)]
pub enum LogLevel {
    Trace = 0,
    Debug = 1,
    Info = 2,
    Warn = 3,
    Error = 4,
    Critical = 5,
}

impl LogLevel {
    pub(crate) fn from_code(code: u32) -> Option<Self> {
        Some(match code {
            0 => Self::Trace,
            1 => Self::Debug,
            2 => Self::Info,
            3 => Self::Warn,
            4 => Self::Error,
            5 => Self::Critical,
            _ => return None,
        })
    }
}

impl fmt::Display for LogLevel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self {
            Self::Trace => "trace",
            Self::Debug => "debug",
            Self::Info => "info",
            Self::Warn => "warn",
            Self::Error => "error",
            Self::Critical => "critical",
        };
        f.write_str(name)
    }
}

/// What a plugin answers to a headers, body or trailers callback.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Pass the data on (Envoy: `Continue`).
    Continue,
    /// Hold it (Envoy: `StopIteration` for headers and trailers, `StopIterationAndBuffer` for
    /// body data) until the plugin calls `proxy_continue_stream`.
    Pause,
}

impl Action {
    pub(crate) fn from_code(code: u32) -> Self {
        // Anything that is not Continue stops iteration in Envoy as well.
        if code == 0 {
            Self::Continue
        } else {
            Self::Pause
        }
    }
}

/// The header-like maps a plugin can address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum MapType {
    RequestHeaders,
    RequestTrailers,
    ResponseHeaders,
    ResponseTrailers,
    GrpcInitialMetadata,
    GrpcTrailingMetadata,
    HttpCallResponseHeaders,
    HttpCallResponseTrailers,
}

impl MapType {
    pub(crate) fn from_code(code: u32) -> Option<Self> {
        Some(match code {
            0 => Self::RequestHeaders,
            1 => Self::RequestTrailers,
            2 => Self::ResponseHeaders,
            3 => Self::ResponseTrailers,
            4 => Self::GrpcInitialMetadata,
            5 => Self::GrpcTrailingMetadata,
            6 => Self::HttpCallResponseHeaders,
            7 => Self::HttpCallResponseTrailers,
            _ => return None,
        })
    }
}

/// The byte buffers a plugin can address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BufferType {
    RequestBody,
    ResponseBody,
    DownstreamData,
    UpstreamData,
    HttpCallResponseBody,
    GrpcReceiveBuffer,
    VmConfiguration,
    PluginConfiguration,
    CallData,
}

impl BufferType {
    pub(crate) fn from_code(code: u32) -> Option<Self> {
        Some(match code {
            0 => Self::RequestBody,
            1 => Self::ResponseBody,
            2 => Self::DownstreamData,
            3 => Self::UpstreamData,
            4 => Self::HttpCallResponseBody,
            5 => Self::GrpcReceiveBuffer,
            6 => Self::VmConfiguration,
            7 => Self::PluginConfiguration,
            8 => Self::CallData,
            _ => return None,
        })
    }
}

/// Kinds of metric.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MetricType {
    Counter,
    Gauge,
    Histogram,
}

impl MetricType {
    pub(crate) fn from_code(code: u32) -> Option<Self> {
        Some(match code {
            0 => Self::Counter,
            1 => Self::Gauge,
            2 => Self::Histogram,
            _ => return None,
        })
    }
}

/// The stream a plugin resumes or closes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum StreamType {
    HttpRequest,
    HttpResponse,
    Downstream,
    Upstream,
}

impl StreamType {
    pub(crate) fn from_code(code: u32) -> Option<Self> {
        Some(match code {
            0 => Self::HttpRequest,
            1 => Self::HttpResponse,
            2 => Self::Downstream,
            3 => Self::Upstream,
            _ => return None,
        })
    }
}

/// Serializes header pairs onto `out`: `count: u32`, then `(key_len: u32, value_len: u32)` per
/// pair, then each key and value followed by a NUL byte. All integers little-endian. The pairs are
/// walked more than once rather than collected (a hostcall encodes into a reused buffer).
pub(crate) fn encode_map<'a>(pairs: impl IntoIterator<Item = (&'a [u8], &'a [u8])> + Clone, out: &mut Vec<u8>) {
    let count = pairs.clone().into_iter().count();
    out.extend_from_slice(&len_u32(count).to_le_bytes());
    for (key, value) in pairs.clone() {
        out.extend_from_slice(&len_u32(key.len()).to_le_bytes());
        out.extend_from_slice(&len_u32(value.len()).to_le_bytes());
    }
    for (key, value) in pairs {
        out.extend_from_slice(key);
        out.push(0);
        out.extend_from_slice(value);
        out.push(0);
    }
}

fn len_u32(len: usize) -> u32 {
    u32::try_from(len).unwrap_or(u32::MAX)
}

/// Header pairs as raw bytes.
pub(crate) type Pairs = Vec<(Vec<u8>, Vec<u8>)>;

/// Parses the format [`encode_map`] writes. An empty input is an empty map.
pub(crate) fn decode_map(bytes: &[u8]) -> Result<Pairs, Status> {
    if bytes.is_empty() {
        return Ok(Vec::new());
    }
    let mut reader = Reader { bytes, at: 0 };
    let count = reader.u32()? as usize;
    let mut sizes = Vec::with_capacity(count.min(1024));
    for _ in 0..count {
        sizes.push((reader.u32()? as usize, reader.u32()? as usize));
    }
    let mut pairs = Vec::with_capacity(sizes.len());
    for (key_len, value_len) in sizes {
        let key = reader.terminated(key_len)?;
        let value = reader.terminated(value_len)?;
        pairs.push((key.to_vec(), value.to_vec()));
    }
    Ok(pairs)
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], Status> {
        let end = self.at.checked_add(n).ok_or(Status::SerializationFailure)?;
        let slice = self.bytes.get(self.at..end).ok_or(Status::SerializationFailure)?;
        self.at = end;
        Ok(slice)
    }

    fn u32(&mut self) -> Result<u32, Status> {
        let raw: [u8; 4] = self.take(4)?.try_into().map_err(|_| Status::SerializationFailure)?;
        Ok(u32::from_le_bytes(raw))
    }

    /// `n` bytes followed by a NUL.
    fn terminated(&mut self, n: usize) -> Result<&'a [u8], Status> {
        let data = self.take(n)?;
        match self.take(1)? {
            [0] => Ok(data),
            _ => Err(Status::SerializationFailure),
        }
    }
}

/// A property path in its wire form: segments separated by NUL, without a trailing NUL.
pub(crate) fn property_path<S: AsRef<str>>(segments: &[S]) -> Vec<u8> {
    let mut out = Vec::new();
    for (i, segment) in segments.iter().enumerate() {
        if i > 0 {
            out.push(0);
        }
        out.extend_from_slice(segment.as_ref().as_bytes());
    }
    out
}

/// Normalizes a path received from a plugin (a trailing NUL is tolerated) into its segments.
pub(crate) fn split_property_path(raw: &[u8]) -> Vec<&[u8]> {
    let raw = raw.strip_suffix(&[0]).unwrap_or(raw);
    if raw.is_empty() {
        return Vec::new();
    }
    raw.split(|b| *b == 0).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encoded<'a>(pairs: impl IntoIterator<Item = (&'a [u8], &'a [u8])> + Clone) -> Vec<u8> {
        let mut out = Vec::new();
        encode_map(pairs, &mut out);
        out
    }

    #[test]
    fn map_round_trip_keeps_order_duplicates_and_non_utf8() {
        let pairs: Vec<(&[u8], &[u8])> = vec![(b":method", b"GET"), (b"x-a", b"\xff\xfe"), (b"x-a", b"")];
        let encoded = encoded(pairs.clone());
        let decoded = decode_map(&encoded).unwrap();
        let expected: Vec<(Vec<u8>, Vec<u8>)> = pairs.iter().map(|(k, v)| (k.to_vec(), v.to_vec())).collect();
        assert_eq!(decoded, expected);
    }

    #[test]
    fn map_layout_matches_the_spec() {
        let encoded = encoded(vec![(&b"ab"[..], &b"c"[..])]);
        assert_eq!(encoded, [1, 0, 0, 0, 2, 0, 0, 0, 1, 0, 0, 0, b'a', b'b', 0, b'c', 0]);
    }

    #[test]
    fn truncated_map_is_a_serialization_failure() {
        let encoded = encoded(vec![(&b"ab"[..], &b"c"[..])]);
        assert_eq!(decode_map(&encoded[..encoded.len() - 1]), Err(Status::SerializationFailure));
        assert_eq!(decode_map(&[5, 0, 0, 0]), Err(Status::SerializationFailure));
    }

    #[test]
    fn property_paths() {
        assert_eq!(property_path(&["request", "path"]), b"request\0path");
        assert_eq!(split_property_path(b"request\0path\0"), vec![&b"request"[..], b"path"]);
        assert!(split_property_path(b"").is_empty());
    }
}
