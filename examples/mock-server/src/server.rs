//! The server: accepts connections (a bounded number, one thread each), reads requests in a
//! keep-alive loop, routes them, and plays out an answer [`Plan`] in time — role chunk with the
//! response head, keep-alive comments and the time to first token, then one token per inter-token
//! interval, then the end of the stream — or fails as the request's controls ask.

use crate::api::{self, keepalive_comment, Api, Event, Plan};
use crate::controls::{Controls, Defaults, Failure};
use crate::http::{self, BodyFraming, ReadError, Request};
use crate::ledger::{FailureKind, Ledger, Record};
use crate::stats::Stats;
use crate::traffic::{BodyState, Traffic};
use crate::wire::{Encoder, Wire, BOM};
use serde_json::{json, Value};
use std::io::{self, BufRead, BufReader, Read};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::Duration;

/// How the server runs.
#[derive(Debug, Clone)]
pub struct Config {
    pub defaults: Defaults,
    /// Connections served at once; more are answered 503 and closed.
    pub max_connections: usize,
    /// How long an idle kept-alive connection is held open. Long, because Envoy pools upstream
    /// connections and a server closing one just as Envoy reuses it shows up as a spurious 503.
    pub idle_timeout: Duration,
}

impl Default for Config {
    fn default() -> Self {
        Config { defaults: Defaults::default(), max_connections: 1024, idle_timeout: Duration::from_secs(300) }
    }
}

struct Shared {
    config: Config,
    stats: Stats,
    ledger: Ledger,
    /// Every connection accepted and every request head read (`/mock/connections`, `/mock/heads`).
    traffic: Traffic,
    active: AtomicUsize,
    /// Default TTFT set at run time by `POST /mock/ttft` with `{"ms": N}` (`u64::MAX`: the configured one), so
    /// a test can make the upstream slow and fast again without the clients' help.
    ttft_override_ms: std::sync::atomic::AtomicU64,
}

/// A bound, not yet running server.
pub struct Server {
    listener: TcpListener,
    shared: Arc<Shared>,
}

/// Decrements the open-connection count however the connection thread ends.
struct ActiveGuard(Arc<Shared>);
impl Drop for ActiveGuard {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, Ordering::Relaxed);
    }
}

/// What to do with the connection after a response.
enum After {
    KeepAlive,
    Close,
}

impl Server {
    pub fn bind(addr: &str, config: Config) -> io::Result<Server> {
        let listener = TcpListener::bind(addr)?;
        Ok(Server {
            listener,
            shared: Arc::new(Shared {
                config,
                stats: Stats::default(),
                ledger: Ledger::default(),
                traffic: Traffic::default(),
                active: AtomicUsize::new(0),
                ttft_override_ms: std::sync::atomic::AtomicU64::new(u64::MAX),
            }),
        })
    }

    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Accepts connections forever.
    pub fn run(self) -> io::Result<()> {
        for conn in self.listener.incoming() {
            let stream = match conn {
                Ok(s) => s,
                Err(_) => {
                    // Typically EMFILE or a connection reset before accept: back off briefly, go on.
                    thread::sleep(Duration::from_millis(10));
                    continue;
                }
            };
            let shared = Arc::clone(&self.shared);
            let peer = stream.peer_addr().map(|a| a.to_string()).unwrap_or_default();
            if shared.active.fetch_add(1, Ordering::Relaxed) >= shared.config.max_connections {
                shared.active.fetch_sub(1, Ordering::Relaxed);
                shared.traffic.connection_opened(&peer, true);
                reject_busy(stream);
                continue;
            }
            let conn_id = shared.traffic.connection_opened(&peer, false);
            let guard = ActiveGuard(Arc::clone(&shared));
            // Small stacks: a thousand mostly idle connection threads should cost little memory.
            let spawned = thread::Builder::new().stack_size(512 * 1024).spawn(move || {
                let _guard = guard;
                serve_connection(stream, &shared, conn_id);
                shared.traffic.connection_closed(conn_id);
            });
            if spawned.is_err() {
                // The guard was dropped with the closure, and the connection with it.
                self.shared.traffic.connection_closed(conn_id);
                thread::sleep(Duration::from_millis(10));
            }
        }
        Ok(())
    }

    /// Runs the accept loop on a background thread (for in-process tests) and returns the address.
    pub fn spawn(self) -> io::Result<SocketAddr> {
        let addr = self.local_addr()?;
        thread::Builder::new().name("mock-accept".into()).spawn(move || self.run())?;
        Ok(addr)
    }
}

fn reject_busy(mut stream: TcpStream) {
    let body = api::error_body("", 503, "mock: too many connections").to_string();
    let _ = http::write_full(&mut stream, 503, &[("content-type", "application/json".into())], body.as_bytes(), false);
}

fn serve_connection(stream: TcpStream, shared: &Shared, conn_id: u64) {
    // Every SSE event must leave when written: without NODELAY, Nagle would hold small token
    // chunks back and blur the timing the tests measure.
    let _ = stream.set_nodelay(true);
    let _ = stream.set_read_timeout(Some(shared.config.idle_timeout));
    let _ = stream.set_write_timeout(Some(Duration::from_secs(60)));
    let Ok(read_half) = stream.try_clone() else { return };
    // The reader persists across requests so bytes of a pipelined next request are not lost.
    let mut reader = BufReader::new(read_half);
    let mut writer = stream;
    loop {
        // The head is recorded as soon as it is read, before its body: a request whose body never
        // comes (a gateway that sent headers and then reset) is still seen to have reached us.
        let read = http::read_head(&mut reader).and_then(|head| {
            let empty = matches!(head.body, BodyFraming::None | BodyFraming::Length(0));
            let announced = if empty { BodyState::None } else { BodyState::Receiving };
            let seq = shared.traffic.head(conn_id, &head.method, &head.path, &head.headers, announced);
            if let Some(cut) = transport_reset(&head) {
                return Err(reset_request(&mut reader, shared, &head, seq, announced, cut));
            }
            let req = http::read_body(&mut reader, &mut writer, head);
            let body = match &req {
                Ok(_) if announced == BodyState::None => BodyState::None,
                Ok(_) => BodyState::Complete,
                // A body cut short by the peer reads as truncated framing or as an I/O error.
                Err(ReadError::Closed | ReadError::Io(_)) => BodyState::Incomplete,
                Err(ReadError::Bad(_, msg)) if msg.contains("truncated") || msg.contains("shorter") => BodyState::Incomplete,
                Err(ReadError::Bad(..)) => BodyState::Bad,
            };
            shared.traffic.body(seq, body);
            req
        });
        let req = match read {
            Ok(req) => req,
            Err(ReadError::Closed | ReadError::Io(_)) => return,
            Err(ReadError::Bad(status, msg)) => {
                let body = api::error_body("", status, &msg).to_string();
                let headers = [("content-type", "application/json".to_string()), served_by(&shared.config.defaults.served_by)];
                let _ = http::write_full(&mut writer, status, &headers, body.as_bytes(), false);
                return;
            }
        };
        match handle(&req, &mut writer, shared) {
            Ok(After::KeepAlive) if req.keep_alive => continue,
            Ok(_) | Err(_) => {
                let _ = writer.shutdown(Shutdown::Both);
                return;
            }
        }
    }
}

/// Where `x-mock-fail` asks to cut the request itself: after its head, or halfway through its body.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Cut {
    AfterHead,
    MidBody,
}

fn transport_reset(head: &http::Head) -> Option<Cut> {
    Api::from_path(&head.path)?;
    match head.header("x-mock-fail").map(str::trim) {
        Some("reset-on-head") => Some(Cut::AfterHead),
        Some("reset-in-body") => Some(Cut::MidBody),
        _ => None,
    }
}

/// Drops the connection of a request `x-mock-fail` cuts, after reading half of its body for
/// `reset-in-body`, and records it (ledger failure `reset`, nothing sent). The connection closes
/// with request bytes still unread, so the peer sees a reset.
fn reset_request(reader: &mut BufReader<TcpStream>, shared: &Shared, head: &http::Head, seq: u64, announced: BodyState, cut: Cut) -> ReadError {
    if cut == Cut::MidBody {
        let half = match head.body {
            BodyFraming::Length(n) => n / 2,
            // A chunked body: what its first read brings, halved.
            BodyFraming::Chunked => reader.fill_buf().map(|b| b.len() / 2).unwrap_or(0),
            BodyFraming::None => 0,
        };
        let mut buf = vec![0; half];
        let _ = reader.read_exact(&mut buf);
    }
    shared.traffic.body(seq, if announced == BodyState::None { BodyState::None } else { BodyState::Incomplete });
    shared.stats.count_request(&head.path);
    let request_id = head.header("x-request-id").map(str::to_string).unwrap_or_else(|| api::new_id("mockreq-"));
    let mut record = Record::new(request_id, &head.path);
    record.failure = Some(FailureKind::Reset);
    shared.ledger.push(record);
    ReadError::Io(io::Error::new(io::ErrorKind::ConnectionAborted, "x-mock-fail cut the request"))
}

/// The `x-mock-served-by` header. The name may come from a request header and is echoed back,
/// so control characters are dropped: a CR/LF must never split the response head.
fn served_by(name: &str) -> (&'static str, String) {
    ("x-mock-served-by", name.chars().filter(|c| !c.is_control()).collect())
}

fn json_headers(served: &str, prompt_tokens: u64) -> Vec<(&'static str, String)> {
    vec![("content-type", "application/json".into()), served_by(served), ("x-mock-prompt-tokens", prompt_tokens.to_string())]
}

/// Writes a JSON response. The connection stays open unless the request asked to close it,
/// which the connection loop checks.
fn write_json(w: &mut TcpStream, status: u16, headers: &[(&str, String)], body: &Value, keep_alive: bool) -> io::Result<After> {
    http::write_full(w, status, headers, body.to_string().as_bytes(), keep_alive)?;
    Ok(After::KeepAlive)
}

fn handle(req: &Request, w: &mut TcpStream, shared: &Shared) -> io::Result<After> {
    let served = req.header("x-mock-version").unwrap_or(&shared.config.defaults.served_by);
    let ka = req.keep_alive;
    match (req.method.as_str(), req.path.as_str()) {
        ("GET", "/health") => {
            let headers = [("content-type", "text/plain".to_string()), served_by(served)];
            http::write_full(w, 200, &headers, b"ok", ka)?;
            Ok(After::KeepAlive)
        }
        ("GET", "/v1/models") => {
            let model = shared.config.defaults.model_name.as_deref().unwrap_or("mock-model");
            let body = json!({"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "sluice-mock"}]});
            write_json(w, 200, &json_headers(served, 0), &body, ka)
        }
        ("GET", "/mock/stats") => {
            let body = shared.stats.to_json(shared.active.load(Ordering::Relaxed), shared.traffic.accepted());
            write_json(w, 200, &json_headers(served, 0), &body, ka)
        }
        ("GET", "/mock/requests") => {
            let body = shared.ledger.to_json();
            write_json(w, 200, &json_headers(served, 0), &body, ka)
        }
        ("GET", "/mock/connections") => {
            let body = shared.traffic.connections_json();
            write_json(w, 200, &json_headers(served, 0), &body, ka)
        }
        ("GET", "/mock/heads") => {
            let body = shared.traffic.heads_json();
            write_json(w, 200, &json_headers(served, 0), &body, ka)
        }
        ("POST", "/mock/ttft") => {
            let ms = serde_json::from_slice::<Value>(&req.body).ok().and_then(|v| v.get("ms").and_then(Value::as_u64));
            match ms {
                Some(ms) => {
                    shared.ttft_override_ms.store(ms, Ordering::Relaxed);
                    write_json(w, 200, &json_headers(served, 0), &json!({"ttft_ms": ms}), ka)
                }
                None => write_json(w, 400, &json_headers(served, 0), &json!({"error": "send {\"ms\": N}"}), ka),
            }
        }
        ("POST", "/mock/reset") => {
            shared.stats.reset();
            shared.ledger.clear();
            shared.traffic.clear();
            write_json(w, 200, &json_headers(served, 0), &json!({}), ka)
        }
        ("POST", path) if Api::from_path(path).is_some() => inference(req, w, shared),
        (_, path) => {
            let known = Api::from_path(path).is_some()
                || matches!(
                    path,
                    "/health" | "/v1/models" | "/mock/stats" | "/mock/requests" | "/mock/connections" | "/mock/heads" | "/mock/reset" | "/mock/ttft"
                );
            let (status, msg) = if known { (405, "method not allowed") } else { (404, "no such endpoint") };
            let body = api::error_body(path, status, &format!("mock: {msg}: {} {path}", req.method));
            write_json(w, status, &json_headers(served, 0), &body, ka)
        }
    }
}

/// Answers one inference request and records in the ledger what happened to it.
fn inference(req: &Request, w: &mut TcpStream, shared: &Shared) -> io::Result<After> {
    let path = req.path.as_str();
    let Some(api) = Api::from_path(path) else {
        return Ok(After::Close);
    };
    shared.stats.count_request(path);
    let request_id = req.header("x-request-id").map(str::to_string).unwrap_or_else(|| api::new_id("mockreq-"));
    let mut record = Record::new(request_id, path);
    let result = answer(api, req, w, shared, &mut record);
    if result.is_err() && record.failure.is_none() {
        // Every write error means the peer went away (or stopped reading for a minute).
        record.failure = Some(FailureKind::ClientGone);
    }
    shared.ledger.push(record);
    result
}

/// Validates, then fails, answers whole, or streams, as the request's controls say; keeps `record`
/// up to date as it goes, so an early return by `?` leaves an accurate record behind.
fn answer(api: Api, req: &Request, w: &mut TcpStream, shared: &Shared, record: &mut Record) -> io::Result<After> {
    let path = req.path.as_str();
    let mut defaults = shared.config.defaults.clone();
    let override_ms = shared.ttft_override_ms.load(Ordering::Relaxed);
    if override_ms != u64::MAX {
        defaults.ttft = Duration::from_millis(override_ms);
    }
    let defaults = &defaults;
    let served = req.header("x-mock-version").unwrap_or(&defaults.served_by);
    let bad_request = |w: &mut TcpStream, record: &mut Record, msg: &str| {
        record.failure = Some(FailureKind::BadRequest);
        write_json(w, 400, &json_headers(served, 0), &api::error_body(path, 400, msg), req.keep_alive)
    };
    let controls = match Controls::from_headers(defaults, |n| req.header(n)) {
        Ok(c) => c,
        Err(msg) => return bad_request(w, record, &msg),
    };
    let wire = match Wire::from_headers(|n| req.header(n)) {
        Ok(w) => w,
        Err(msg) => return bad_request(w, record, &msg),
    };
    let body: Value = match serde_json::from_slice(&req.body) {
        Ok(v) => v,
        Err(e) => return bad_request(w, record, &format!("invalid JSON body: {e}")),
    };
    let plan = match Plan::new(api, &body, &controls, defaults.model_name.as_deref()) {
        Ok(p) => p,
        Err(msg) => return bad_request(w, record, &msg),
    };
    let headers = json_headers(&controls.served_by, plan.prompt_tokens);
    record.stream = plan.stream;
    record.max_tokens = plan.max_tokens;
    record.model = body.get("model").and_then(Value::as_str).map(str::to_string);
    record.prompt_tokens = plan.prompt_tokens;
    record.completion_tokens = plan.completion_tokens();

    if let Some(Failure::Status(status)) = controls.fail {
        record.failure = Some(FailureKind::Status(status));
        let mut headers = headers;
        if status == 429 {
            headers.push(("retry-after", "1".into()));
        }
        let body = api::error_body(path, status, &format!("mock: injected failure with status {status}"));
        return write_json(w, status, &headers, &body, req.keep_alive);
    }
    if plan.stream {
        stream(&plan, &controls, &wire, req.keep_alive, w, shared, record)
    } else {
        // A whole answer takes as long as generating it would.
        let n = plan.tokens;
        thread::sleep(controls.ttft + controls.itl * u32::try_from(n.saturating_sub(1)).unwrap_or(u32::MAX));
        match controls.fail {
            // Without a stream there is no "after N tokens": the connection closes with no answer.
            Some(Failure::ResetAfter(_) | Failure::ResetInside(_) | Failure::ResetBeforeTerminal) => {
                record.failure = Some(FailureKind::Reset);
                Ok(After::Close)
            }
            Some(Failure::ErrorEventAfter(_)) => {
                record.failure = Some(FailureKind::ErrorEvent);
                let body = api::error_body(path, 500, "mock: injected error");
                write_json(w, 500, &headers, &body, req.keep_alive)
            }
            _ => {
                let mut headers = headers;
                if wire.no_content_type {
                    headers.retain(|(name, _)| *name != "content-type");
                }
                let mut body = plan.full_body().to_string().into_bytes();
                if wire.bom {
                    body.splice(0..0, BOM.iter().copied());
                }
                if let Some(encoding) = wire.encoding {
                    body = Encoder::encode_all(encoding, &body);
                    headers.push(("content-encoding", encoding.name().to_string()));
                }
                if wire.continue_first {
                    http::write_continue(w)?;
                }
                http::write_full(w, 200, &headers, &body, req.keep_alive)?;
                shared.stats.count_tokens(n);
                record.tokens_flushed = n;
                record.usage_reported = plan.usage;
                record.completed = true;
                Ok(After::KeepAlive)
            }
        }
    }
}

/// Writes `bytes` as one HTTP chunk, or as chunks of `split` bytes to exercise reassembly.
fn send(w: &mut TcpStream, bytes: &[u8], split: Option<usize>) -> io::Result<()> {
    match split {
        None => http::write_chunk(w, bytes),
        Some(n) => bytes.chunks(n.max(1)).try_for_each(|piece| http::write_chunk(w, piece)),
    }
}

/// Where a stream's bytes go: the byte-order mark before the first of them, each piece through
/// the content-encoding (as complete blocks), then HTTP chunks of at most `split` bytes.
struct Sink<'a> {
    w: &'a mut TcpStream,
    split: Option<usize>,
    crlf: bool,
    encoder: Option<Encoder>,
    bom: bool,
}

impl Sink<'_> {
    fn bytes(&mut self, bytes: &[u8]) -> io::Result<()> {
        let mut piece = Vec::new();
        if std::mem::take(&mut self.bom) {
            piece.extend_from_slice(BOM);
        }
        piece.extend_from_slice(bytes);
        if let Some(encoder) = self.encoder.as_mut() {
            piece = encoder.push(&piece);
        }
        send(self.w, &piece, self.split)
    }

    fn event(&mut self, event: &Event) -> io::Result<()> {
        let raw = event.render(self.crlf);
        self.bytes(&raw)
    }

    /// The end of the encoded stream (nothing without an encoding).
    fn finish(&mut self) -> io::Result<()> {
        match self.encoder.as_mut() {
            Some(encoder) => {
                let tail = encoder.finish();
                send(self.w, &tail, self.split)
            }
            None => Ok(()),
        }
    }
}

/// Plays a streamed answer out in time.
fn stream(plan: &Plan, c: &Controls, wire: &Wire, keep_alive: bool, w: &mut TcpStream, shared: &Shared, record: &mut Record) -> io::Result<After> {
    let mut headers = vec![
        ("content-type", "text/event-stream".to_string()),
        ("cache-control", "no-cache".to_string()),
        served_by(&c.served_by),
        ("x-mock-prompt-tokens", plan.prompt_tokens.to_string()),
    ];
    if wire.no_content_type {
        headers.remove(0);
    }
    if let Some(encoding) = wire.encoding {
        headers.push(("content-encoding", encoding.name().to_string()));
    }
    if wire.trailers {
        headers.push(("trailer", "x-mock-tokens-sent".to_string()));
    }
    if wire.continue_first {
        http::write_continue(w)?;
    }
    http::start_chunked(w, 200, &headers, keep_alive)?;
    let mut out = Sink { w, split: c.split, crlf: c.crlf, encoder: wire.encoding.map(Encoder::new), bom: wire.bom };

    // Token i is due at head + TTFT + i × ITL on one schedule: sleeping a gap per token would let
    // each sleep's overshoot add up (tens of ms over a long stream under load).
    let head_sent = std::time::Instant::now();
    // Sent with the head, before the TTFT delay, so first byte and first token differ in time.
    let mut seq = 0;
    for event in plan.preamble(&mut seq) {
        out.event(&event)?;
    }
    // Keep-alive comments spread evenly over the wait for the first token.
    let gap = c.ttft / u32::try_from(c.keepalives.saturating_add(1)).unwrap_or(u32::MAX);
    for _ in 0..c.keepalives {
        thread::sleep(gap);
        out.bytes(&keepalive_comment(c.crlf))?;
    }

    // A failure "after N tokens" with N past the end happens after the last token instead.
    let fail_at = match c.fail {
        Some(Failure::ResetAfter(n) | Failure::ErrorEventAfter(n) | Failure::ResetInside(n)) => Some(n.min(plan.tokens)),
        _ => None,
    };
    let token = |i: u64, seq: &mut u64| if wire.token_bytes > 0 { plan.token_padded(i, wire.token_bytes, seq) } else { plan.token(i, seq) };
    for i in 0..=plan.tokens {
        if fail_at == Some(i) {
            return match c.fail {
                Some(Failure::ErrorEventAfter(_)) => {
                    out.event(&plan.error_event(&mut seq))?;
                    out.finish()?;
                    http::finish_chunked(out.w)?;
                    record.failure = Some(FailureKind::ErrorEvent);
                    Ok(After::KeepAlive)
                }
                Some(Failure::ResetInside(_)) => {
                    // Half of the next event (a token's, or the first of the end events), then the
                    // connection closes: the peer holds an event without its end.
                    let next =
                        if i < plan.tokens { token(i, &mut seq) } else { plan.epilogue(&mut seq).into_iter().next().unwrap_or_else(|| token(i, &mut seq)) };
                    let raw = next.render(c.crlf);
                    out.bytes(raw.get(..raw.len() / 2).unwrap_or_default())?;
                    record.failure = Some(FailureKind::Reset);
                    Ok(After::Close)
                }
                // The body is left unterminated: the peer sees the connection close mid-stream.
                _ => {
                    record.failure = Some(FailureKind::Reset);
                    Ok(After::Close)
                }
            };
        }
        if i == plan.tokens {
            break;
        }
        let due = head_sent + c.ttft + c.itl * u32::try_from(i).unwrap_or(u32::MAX);
        thread::sleep(due.saturating_duration_since(std::time::Instant::now()));
        out.event(&token(i, &mut seq))?;
        shared.stats.count_tokens(1);
        record.tokens_flushed += 1;
    }
    let mut epilogue = plan.epilogue(&mut seq);
    let cut_terminal = matches!(c.fail, Some(Failure::NoTerminal | Failure::ResetBeforeTerminal));
    if cut_terminal {
        epilogue.pop();
    }
    for event in epilogue {
        out.event(&event)?;
        if plan.is_final_usage(&event) {
            record.usage_reported = true;
        }
    }
    if c.fail == Some(Failure::ResetBeforeTerminal) {
        record.failure = Some(FailureKind::Reset);
        return Ok(After::Close);
    }
    out.finish()?;
    if wire.trailers {
        http::finish_chunked_with_trailers(out.w, &[("x-mock-tokens-sent", record.tokens_flushed.to_string())])?;
    } else {
        http::finish_chunked(out.w)?;
    }
    if cut_terminal {
        record.failure = Some(FailureKind::NoTerminal);
    } else {
        record.completed = true;
    }
    Ok(After::KeepAlive)
}
