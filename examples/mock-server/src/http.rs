//! Just enough HTTP/1.1 for a model server behind Envoy: read one request at a time from a
//! kept-alive connection (body by `Content-Length` or chunked transfer-encoding), and write
//! responses either with `Content-Length` or as a chunked stream flushed chunk by chunk.
//!
//! Every limit here exists so that a malformed or hostile request costs a bounded amount of memory
//! and ends in a 4xx, never a panic.

use std::fmt;
use std::io::{self, BufRead, Read, Write};

/// Longest request line or header line accepted.
const MAX_LINE: u64 = 16 * 1024;
/// Most header lines accepted in one request (also bounds chunked trailers).
const MAX_HEADERS: usize = 128;
/// Largest request body accepted; prompts for a mock never need more.
pub const MAX_BODY: usize = 16 * 1024 * 1024;

/// One parsed request. Header names are lower-cased so lookups are case-insensitive.
#[derive(Debug)]
pub struct Request {
    pub method: String,
    pub path: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    /// Whether the connection may carry another request after this one.
    pub keep_alive: bool,
}

impl Request {
    /// First value of header `name` (lower-case), trimmed.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
    }
}

/// Why a request could not be read. `Bad` requests get a 4xx and the connection is closed, since
/// after a framing error we can no longer tell where the next request starts.
#[derive(Debug)]
pub enum ReadError {
    /// The peer closed the connection cleanly between requests.
    Closed,
    /// Socket error or timeout: nothing useful can be written back.
    Io(io::Error),
    /// Malformed or oversized request: answer with this status and message, then close.
    Bad(u16, String),
}

impl From<io::Error> for ReadError {
    fn from(e: io::Error) -> Self {
        ReadError::Io(e)
    }
}

impl fmt::Display for ReadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReadError::Closed => write!(f, "connection closed"),
            ReadError::Io(e) => write!(f, "i/o error: {e}"),
            ReadError::Bad(status, msg) => write!(f, "{status}: {msg}"),
        }
    }
}

fn bad(status: u16, msg: impl Into<String>) -> ReadError {
    ReadError::Bad(status, msg.into())
}

/// Reads one line ending in LF (a preceding CR is stripped), at most `MAX_LINE` bytes.
/// Returns `None` on EOF before any byte.
fn read_line<R: BufRead>(r: &mut R) -> Result<Option<String>, ReadError> {
    let mut buf = Vec::new();
    let n = r.by_ref().take(MAX_LINE).read_until(b'\n', &mut buf)?;
    if n == 0 {
        return Ok(None);
    }
    if buf.last() != Some(&b'\n') {
        // Either the line was too long or the peer closed mid-line.
        return Err(if n as u64 >= MAX_LINE { bad(431, "header line too long") } else { bad(400, "truncated request") });
    }
    buf.pop();
    if buf.last() == Some(&b'\r') {
        buf.pop();
    }
    String::from_utf8(buf).map(Some).map_err(|_| bad(400, "request head is not UTF-8"))
}

/// Reads header lines up to the blank line that ends them.
fn read_headers<R: BufRead>(r: &mut R) -> Result<Vec<(String, String)>, ReadError> {
    let mut headers = Vec::new();
    loop {
        let line = read_line(r)?.ok_or_else(|| bad(400, "truncated request head"))?;
        if line.is_empty() {
            return Ok(headers);
        }
        if headers.len() >= MAX_HEADERS {
            return Err(bad(431, "too many headers"));
        }
        let (name, value) = line.split_once(':').ok_or_else(|| bad(400, format!("malformed header line {line:?}")))?;
        if name.is_empty() || name.contains(char::is_whitespace) {
            return Err(bad(400, format!("malformed header name {name:?}")));
        }
        headers.push((name.to_ascii_lowercase(), value.trim().to_string()));
    }
}

/// A request head: the request line and headers, before any body is read.
#[derive(Debug, Clone)]
pub struct Head {
    pub method: String,
    /// The path, query string dropped (routing is by path only).
    pub path: String,
    pub headers: Vec<(String, String)>,
    /// Whether the connection may carry another request after this one.
    pub keep_alive: bool,
    /// How the body is framed.
    pub body: BodyFraming,
}

/// How a request's body is framed, as its head says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyFraming {
    /// No `Content-Length` and no chunked transfer-encoding: no body.
    None,
    Length(usize),
    Chunked,
}

impl Head {
    /// First value of header `name` (lower-case), trimmed.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
    }
}

/// Reads the next request from `r`. Blocks until a full request (head and body) has arrived.
pub fn read_request<R: BufRead, W: Write>(r: &mut R, w: &mut W) -> Result<Request, ReadError> {
    let head = read_head(r)?;
    read_body(r, w, head)
}

/// Reads the next request head (request line and headers) from `r`, and checks its framing
/// headers; the body, if any, is left for [`read_body`].
pub fn read_head<R: BufRead>(r: &mut R) -> Result<Head, ReadError> {
    let line = match read_line(r) {
        Ok(Some(l)) => l,
        Ok(None) => return Err(ReadError::Closed),
        Err(e) => return Err(e),
    };
    let mut parts = line.split(' ');
    let (method, target, version) = match (parts.next(), parts.next(), parts.next(), parts.next()) {
        (Some(m), Some(t), Some(v), None) if !m.is_empty() && t.starts_with('/') => (m, t, v),
        _ => return Err(bad(400, format!("malformed request line {line:?}"))),
    };
    let http10 = match version {
        "HTTP/1.1" => false,
        "HTTP/1.0" => true,
        _ => return Err(bad(505, format!("unsupported version {version:?}"))),
    };
    let headers = read_headers(r)?;
    let find = |name: &str| headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str());

    let connection = find("connection").unwrap_or("").to_ascii_lowercase();
    let keep_alive = if http10 { connection.contains("keep-alive") } else { !connection.contains("close") };

    let body = match find("transfer-encoding") {
        Some(te) if te.to_ascii_lowercase().trim_end().ends_with("chunked") => BodyFraming::Chunked,
        Some(te) => return Err(bad(501, format!("unsupported transfer-encoding {te:?}"))),
        None => match find("content-length") {
            Some(cl) => {
                let len: usize = cl.parse().map_err(|_| bad(400, format!("bad content-length {cl:?}")))?;
                if headers.iter().any(|(n, v)| n == "content-length" && v != cl) {
                    return Err(bad(400, "conflicting content-length headers"));
                }
                if len > MAX_BODY {
                    return Err(bad(413, "request body too large"));
                }
                BodyFraming::Length(len)
            }
            None => BodyFraming::None,
        },
    };
    // Drop any query string: routing is by path only.
    let path = target.split('?').next().unwrap_or(target).to_string();
    Ok(Head { method: method.to_string(), path, headers, keep_alive, body })
}

/// Reads the body `head` announces (answering `Expect: 100-continue` first) and returns the whole
/// request.
pub fn read_body<R: BufRead, W: Write>(r: &mut R, w: &mut W, head: Head) -> Result<Request, ReadError> {
    // curl and some SDKs wait for this before sending a large body.
    if head.header("expect").is_some_and(|e| e.eq_ignore_ascii_case("100-continue")) {
        w.write_all(b"HTTP/1.1 100 Continue\r\n\r\n")?;
        w.flush()?;
    }
    let body = match head.body {
        BodyFraming::Chunked => read_chunked_body(r)?,
        BodyFraming::Length(len) => {
            let mut body = vec![0; len];
            r.read_exact(&mut body).map_err(|_| bad(400, "request body shorter than content-length"))?;
            body
        }
        BodyFraming::None => Vec::new(),
    };
    Ok(Request { method: head.method, path: head.path, headers: head.headers, body, keep_alive: head.keep_alive })
}

/// Decodes a chunked request body (chunk extensions ignored, trailers read and dropped).
fn read_chunked_body<R: BufRead>(r: &mut R) -> Result<Vec<u8>, ReadError> {
    let mut body = Vec::new();
    loop {
        let line = read_line(r)?.ok_or_else(|| bad(400, "truncated chunked body"))?;
        let size_hex = line.split(';').next().unwrap_or("").trim();
        let size = usize::from_str_radix(size_hex, 16).map_err(|_| bad(400, format!("bad chunk size {size_hex:?}")))?;
        if size == 0 {
            read_headers(r)?; // trailers
            return Ok(body);
        }
        if body.len().saturating_add(size) > MAX_BODY {
            return Err(bad(413, "request body too large"));
        }
        let start = body.len();
        body.resize(start + size, 0);
        r.read_exact(body.get_mut(start..).unwrap_or_default()).map_err(|_| bad(400, "truncated chunk"))?;
        let mut crlf = [0u8; 2];
        r.read_exact(&mut crlf).map_err(|_| bad(400, "truncated chunk"))?;
        if &crlf != b"\r\n" {
            return Err(bad(400, "chunk not followed by CRLF"));
        }
    }
}

/// Standard reason phrase for the statuses the mock sends.
pub fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        413 => "Payload Too Large",
        429 => "Too Many Requests",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        501 => "Not Implemented",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        505 => "HTTP Version Not Supported",
        529 => "Overloaded",
        _ => "Status",
    }
}

fn head(status: u16, headers: &[(&str, String)], keep_alive: bool) -> Vec<u8> {
    let mut out = format!("HTTP/1.1 {status} {}\r\n", reason(status));
    for (name, value) in headers {
        out.push_str(name);
        out.push_str(": ");
        out.push_str(value);
        out.push_str("\r\n");
    }
    if !keep_alive {
        out.push_str("connection: close\r\n");
    }
    out.into_bytes()
}

/// Writes a complete response with `Content-Length`.
pub fn write_full<W: Write>(w: &mut W, status: u16, headers: &[(&str, String)], body: &[u8], keep_alive: bool) -> io::Result<()> {
    let mut out = head(status, headers, keep_alive);
    out.extend_from_slice(format!("content-length: {}\r\n\r\n", body.len()).as_bytes());
    out.extend_from_slice(body);
    // One write: head and body leave in as few segments as possible.
    w.write_all(&out)?;
    w.flush()
}

/// Writes the head of a chunked response; follow with [`write_chunk`]s and [`finish_chunked`].
pub fn start_chunked<W: Write>(w: &mut W, status: u16, headers: &[(&str, String)], keep_alive: bool) -> io::Result<()> {
    let mut out = head(status, headers, keep_alive);
    out.extend_from_slice(b"transfer-encoding: chunked\r\n\r\n");
    w.write_all(&out)?;
    w.flush()
}

/// Writes one HTTP chunk and flushes it, so it leaves now rather than when a buffer fills.
pub fn write_chunk<W: Write>(w: &mut W, data: &[u8]) -> io::Result<()> {
    if data.is_empty() {
        return Ok(()); // an empty chunk would end the body
    }
    let mut out = format!("{:x}\r\n", data.len()).into_bytes();
    out.extend_from_slice(data);
    out.extend_from_slice(b"\r\n");
    w.write_all(&out)?;
    w.flush()
}

/// Ends a chunked body.
pub fn finish_chunked<W: Write>(w: &mut W) -> io::Result<()> {
    finish_chunked_with_trailers(w, &[])
}

/// Ends a chunked body with trailer fields after the last chunk.
pub fn finish_chunked_with_trailers<W: Write>(w: &mut W, trailers: &[(&str, String)]) -> io::Result<()> {
    let mut out = b"0\r\n".to_vec();
    for (name, value) in trailers {
        out.extend_from_slice(format!("{name}: {value}\r\n").as_bytes());
    }
    out.extend_from_slice(b"\r\n");
    w.write_all(&out)?;
    w.flush()
}

/// An interim `100 Continue` head.
pub fn write_continue<W: Write>(w: &mut W) -> io::Result<()> {
    w.write_all(b"HTTP/1.1 100 Continue\r\n\r\n")?;
    w.flush()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]
    use super::*;

    fn parse(raw: &[u8]) -> Result<Request, ReadError> {
        let mut r = io::BufReader::new(raw);
        read_request(&mut r, &mut Vec::new())
    }

    #[test]
    fn content_length_body() {
        let req = parse(b"POST /v1/x?a=1 HTTP/1.1\r\nHost: h\r\nContent-Length: 3\r\n\r\nabc").unwrap();
        assert_eq!(req.method, "POST");
        assert_eq!(req.path, "/v1/x");
        assert_eq!(req.body, b"abc");
        assert_eq!(req.header("host"), Some("h"));
        assert!(req.keep_alive);
    }

    #[test]
    fn chunked_body_with_extension_and_trailer() {
        let req = parse(b"POST / HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\n3;x=y\r\nabc\r\n2\r\nde\r\n0\r\nt: v\r\n\r\n").unwrap();
        assert_eq!(req.body, b"abcde");
    }

    #[test]
    fn two_requests_back_to_back_on_one_reader() {
        let raw = b"GET /a HTTP/1.1\r\n\r\nGET /b HTTP/1.1\r\nconnection: close\r\n\r\n";
        let mut r = io::BufReader::new(&raw[..]);
        let a = read_request(&mut r, &mut Vec::new()).unwrap();
        let b = read_request(&mut r, &mut Vec::new()).unwrap();
        assert_eq!((a.path.as_str(), a.keep_alive), ("/a", true));
        assert_eq!((b.path.as_str(), b.keep_alive), ("/b", false));
        assert!(matches!(read_request(&mut r, &mut Vec::new()), Err(ReadError::Closed)));
    }

    #[test]
    fn malformed_requests_are_4xx_not_panics() {
        for raw in [
            &b"garbage\r\n\r\n"[..],
            b"GET / HTTP/1.1\r\nno-colon\r\n\r\n",
            b"POST / HTTP/1.1\r\ncontent-length: x\r\n\r\n",
            b"POST / HTTP/1.1\r\ncontent-length: 10\r\n\r\nabc",
            b"POST / HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
            b"POST / HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabcXX",
            b"GET / HTTP/1.1\r\nhost: h",
        ] {
            assert!(matches!(parse(raw), Err(ReadError::Bad(400..=505, _))), "{:?}", String::from_utf8_lossy(raw));
        }
    }

    #[test]
    fn expect_continue_is_answered() {
        let mut out = Vec::new();
        let mut r = io::BufReader::new(&b"POST / HTTP/1.1\r\nexpect: 100-continue\r\ncontent-length: 1\r\n\r\nx"[..]);
        read_request(&mut r, &mut out).unwrap();
        assert_eq!(out, b"HTTP/1.1 100 Continue\r\n\r\n");
    }
}
