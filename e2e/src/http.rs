//! A small blocking HTTP/1.1 client on `std::net`, made for measuring streams: it decodes
//! chunked bodies itself and stamps every piece of body with the instant it arrived, so tests can
//! compute client-side time to first token and check what Envoy forwarded, byte for byte.
//!
//! Body framing handled: chunked, `Content-Length`, and read-until-close. A connection that closes
//! or resets mid-body is not an error: the response comes back with `complete == false`, because
//! "the stream was cut" is often exactly what a test wants to observe.

use crate::sse;
use anyhow::{anyhow, bail, Context, Result};
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

/// No single read may block longer than this; keeps a wedged test bounded.
const READ_TIMEOUT: Duration = Duration::from_secs(20);

/// A complete, buffered response.
#[derive(Debug, Clone)]
pub struct Response {
    pub status: u16,
    /// Header names lower-cased, in arrival order.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Response {
    /// First value of header `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        find_header(&self.headers, name)
    }
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
    pub fn json(&self) -> Result<serde_json::Value> {
        serde_json::from_slice(&self.body).with_context(|| format!("response body is not JSON: {:?}", self.text()))
    }
}

fn find_header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
}

/// A piece of response body as it arrived: one decoded HTTP chunk (or one read, for bodies that
/// are not chunked).
#[derive(Debug, Clone)]
pub struct Chunk {
    pub data: Vec<u8>,
    pub at: Instant,
}

/// A response read to its end (or to where the connection was cut), with timings.
#[derive(Debug, Clone)]
pub struct StreamedResponse {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    /// When the request was written.
    pub sent_at: Instant,
    /// When the response head was read.
    pub head_at: Instant,
    pub chunks: Vec<Chunk>,
    /// False when the connection closed or reset before the body's end.
    pub complete: bool,
}

impl StreamedResponse {
    pub fn header(&self, name: &str) -> Option<&str> {
        find_header(&self.headers, name)
    }
    pub fn body(&self) -> Vec<u8> {
        self.chunks.iter().flat_map(|c| c.data.iter().copied()).collect()
    }
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body()).into_owned()
    }
    /// The body parsed as server-sent events.
    pub fn events(&self) -> Vec<sse::Event> {
        sse::parse(&self.text())
    }
    /// Time from sending the request to the arrival of the first chunk whose accumulated body
    /// contains `needle` (e.g. the first token text). Searching the accumulated body makes the
    /// answer independent of how Envoy re-chunked the stream.
    pub fn time_to(&self, needle: &str) -> Option<Duration> {
        let mut seen = Vec::new();
        for c in &self.chunks {
            seen.extend_from_slice(&c.data);
            if String::from_utf8_lossy(&seen).contains(needle) {
                return Some(c.at.duration_since(self.sent_at));
            }
        }
        None
    }
    pub fn into_response(self) -> Response {
        let body = self.body();
        Response { status: self.status, headers: self.headers, body }
    }
}

/// One client connection; several requests may be sent on it in turn (keep-alive).
pub struct Connection {
    reader: BufReader<TcpStream>,
    stream: TcpStream,
    addr: SocketAddr,
}

impl Connection {
    pub fn connect(addr: SocketAddr) -> Result<Connection> {
        let stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).with_context(|| format!("connecting to {addr}"))?;
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(READ_TIMEOUT))?;
        stream.set_write_timeout(Some(READ_TIMEOUT))?;
        let reader = BufReader::new(stream.try_clone()?);
        Ok(Connection { reader, stream, addr })
    }

    /// Sends a request and returns once the response head has arrived; the body is read from the
    /// returned stream. A non-empty body gets `content-type: application/json` unless `headers`
    /// set one.
    pub fn send(self, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Result<ClientStream> {
        self.send_with_pause(method, path, headers, body, Duration::ZERO)
    }

    /// [`Connection::send`], but the body is written `pause` after the head (when `pause` is not
    /// zero): the gateway has the headers alone for that long, as with a slow client or a large
    /// upload.
    pub fn send_with_pause(mut self, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8], pause: Duration) -> Result<ClientStream> {
        let mut head = format!("{method} {path} HTTP/1.1\r\nhost: {}\r\n", self.addr);
        if !body.is_empty() && !headers.iter().any(|(n, _)| n.eq_ignore_ascii_case("content-type")) {
            head.push_str("content-type: application/json\r\n");
        }
        if !body.is_empty() || method == "POST" || method == "PUT" {
            head.push_str(&format!("content-length: {}\r\n", body.len()));
        }
        for (n, v) in headers {
            head.push_str(&format!("{n}: {v}\r\n"));
        }
        head.push_str("\r\n");
        let mut out = head.into_bytes();
        let sent_at = Instant::now();
        if !pause.is_zero() {
            self.stream.write_all(&out).context("sending request head")?;
            std::thread::sleep(pause);
            out.clear();
        }
        out.extend_from_slice(body);
        self.stream.write_all(&out).context("sending request")?;
        let (status, headers) = read_head(&mut self.reader).context("reading response head")?;
        let head_at = Instant::now();
        let framing = if find_header(&headers, "transfer-encoding").is_some_and(|te| te.to_ascii_lowercase().contains("chunked")) {
            Framing::Chunked
        } else if let Some(cl) = find_header(&headers, "content-length") {
            Framing::Length(cl.trim().parse().map_err(|_| anyhow!("bad content-length {cl:?}"))?)
        } else if status == 204 || status == 304 || method == "HEAD" {
            Framing::Length(0)
        } else {
            Framing::UntilClose
        };
        Ok(ClientStream { conn: self, status, headers, sent_at, head_at, framing, done: false, complete: false })
    }

    /// Sends a request and reads the whole response, keeping the connection for the next one.
    pub fn request(self, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Result<(StreamedResponse, Connection)> {
        let mut s = self.send(method, path, headers, body)?;
        let mut chunks = Vec::new();
        while let Some(c) = s.next_chunk()? {
            chunks.push(c);
        }
        let resp = StreamedResponse {
            status: s.status,
            headers: std::mem::take(&mut s.headers),
            sent_at: s.sent_at,
            head_at: s.head_at,
            chunks,
            complete: s.complete,
        };
        Ok((resp, s.conn))
    }
}

enum Framing {
    Chunked,
    Length(usize),
    UntilClose,
}

/// A response whose body is still arriving.
pub struct ClientStream {
    conn: Connection,
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub sent_at: Instant,
    pub head_at: Instant,
    framing: Framing,
    done: bool,
    complete: bool,
}

/// Whether an I/O error means "the peer went away" (a cut stream) rather than a test failure.
fn is_disconnect(e: &io::Error) -> bool {
    matches!(e.kind(), io::ErrorKind::UnexpectedEof | io::ErrorKind::ConnectionReset | io::ErrorKind::ConnectionAborted | io::ErrorKind::BrokenPipe)
}

impl ClientStream {
    pub fn header(&self, name: &str) -> Option<&str> {
        find_header(&self.headers, name)
    }

    /// The next piece of body, `None` at the end (or where the connection was cut; see
    /// [`ClientStream::is_complete`]). A read timeout is an error.
    pub fn next_chunk(&mut self) -> Result<Option<Chunk>> {
        if self.done {
            return Ok(None);
        }
        match self.read_piece() {
            Ok(Some(data)) => Ok(Some(Chunk { data, at: Instant::now() })),
            Ok(None) => {
                self.done = true;
                self.complete = true;
                Ok(None)
            }
            Err(e) if is_disconnect(&e) => {
                self.done = true;
                Ok(None)
            }
            Err(e) => Err(anyhow!(e).context("reading response body")),
        }
    }

    /// True once the body ended as its framing says (false if cut, or not yet read to the end).
    pub fn is_complete(&self) -> bool {
        self.complete
    }

    fn read_piece(&mut self) -> io::Result<Option<Vec<u8>>> {
        let r = &mut self.conn.reader;
        match &mut self.framing {
            Framing::Chunked => {
                let line = read_line(r)?;
                let size_hex = line.split(';').next().unwrap_or("").trim();
                let size = usize::from_str_radix(size_hex, 16).map_err(|_| io::Error::new(io::ErrorKind::InvalidData, format!("bad chunk size {line:?}")))?;
                if size == 0 {
                    while !read_line(r)?.is_empty() {} // trailers
                    return Ok(None);
                }
                let mut data = vec![0; size];
                r.read_exact(&mut data)?;
                if !read_line(r)?.is_empty() {
                    return Err(io::Error::new(io::ErrorKind::InvalidData, "chunk not followed by CRLF"));
                }
                Ok(Some(data))
            }
            Framing::Length(left) => {
                if *left == 0 {
                    return Ok(None);
                }
                let buf = r.fill_buf()?;
                if buf.is_empty() {
                    return Err(io::ErrorKind::UnexpectedEof.into());
                }
                let n = buf.len().min(*left);
                let data = buf.get(..n).unwrap_or_default().to_vec();
                r.consume(n);
                *left -= n;
                Ok(Some(data))
            }
            Framing::UntilClose => {
                let buf = r.fill_buf()?;
                if buf.is_empty() {
                    return Ok(None);
                }
                let data = buf.to_vec();
                r.consume(data.len());
                Ok(Some(data))
            }
        }
    }

    /// Reads the rest of the body.
    pub fn collect(mut self) -> Result<StreamedResponse> {
        let mut chunks = Vec::new();
        while let Some(c) = self.next_chunk()? {
            chunks.push(c);
        }
        Ok(StreamedResponse { status: self.status, headers: self.headers, sent_at: self.sent_at, head_at: self.head_at, chunks, complete: self.complete })
    }

    /// Client disconnect: reads body until at least `n_bytes` have arrived (or the body ends),
    /// then closes the socket in both directions. Returns the body bytes read.
    pub fn abort_after(mut self, n_bytes: usize) -> Result<Vec<u8>> {
        let mut body = Vec::new();
        while body.len() < n_bytes {
            match self.next_chunk()? {
                Some(c) => body.extend_from_slice(&c.data),
                None => break,
            }
        }
        let _ = self.conn.stream.shutdown(Shutdown::Both);
        Ok(body)
    }
}

fn read_line<R: BufRead>(r: &mut R) -> io::Result<String> {
    let mut line = Vec::new();
    let n = r.by_ref().take(64 * 1024).read_until(b'\n', &mut line)?;
    if n == 0 || line.last() != Some(&b'\n') {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    while matches!(line.last(), Some(b'\n' | b'\r')) {
        line.pop();
    }
    Ok(String::from_utf8_lossy(&line).into_owned())
}

fn read_head<R: BufRead>(r: &mut R) -> Result<(u16, Vec<(String, String)>)> {
    loop {
        let status_line = read_line(r)?;
        let status: u16 = status_line.split(' ').nth(1).and_then(|s| s.parse().ok()).ok_or_else(|| anyhow!("malformed status line {status_line:?}"))?;
        let mut headers = Vec::new();
        loop {
            let line = read_line(r)?;
            if line.is_empty() {
                break;
            }
            let (n, v) = line.split_once(':').ok_or_else(|| anyhow!("malformed header line {line:?}"))?;
            headers.push((n.trim().to_ascii_lowercase(), v.trim().to_string()));
        }
        // 1xx heads (100 Continue) precede the real one.
        if !(100..200).contains(&status) {
            return Ok((status, headers));
        }
    }
}

/// `GET path` on a new connection.
pub fn get(addr: SocketAddr, path: &str) -> Result<Response> {
    Ok(Connection::connect(addr)?.send("GET", path, &[], b"")?.collect()?.into_response())
}

/// `POST path` with a JSON body on a new connection; reads the whole response (streamed or not).
pub fn post_json(addr: SocketAddr, path: &str, headers: &[(&str, &str)], body: &str) -> Result<Response> {
    let resp = post_stream(addr, path, headers, body)?.collect()?;
    if !resp.complete {
        bail!("connection closed before the end of the response body ({} bytes read)", resp.body().len());
    }
    Ok(resp.into_response())
}

/// `POST path` with a JSON body on a new connection; returns once the response head arrives, with
/// the body to be read chunk by chunk.
pub fn post_stream(addr: SocketAddr, path: &str, headers: &[(&str, &str)], body: &str) -> Result<ClientStream> {
    Connection::connect(addr)?.send("POST", path, headers, body.as_bytes())
}
