//! An OTLP/HTTP trace receiver on loopback, for the tracing tests: what Envoy's OpenTelemetry
//! tracer exports (`POST /v1/traces`, a protobuf `ExportTraceServiceRequest`) is decoded with the
//! official OTLP definitions (`opentelemetry-proto`) and kept as [`ReceivedSpan`]s. A body that
//! does not decode, or a request that is not an OTLP export, is kept as an error the test reports:
//! the receiver never makes Envoy's output look better than it was.

use anyhow::{bail, Context, Result};
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use prost::Message;
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// One span as exported, its ids in lower-case hex and its attributes as text (an integer as its
/// decimal digits, a double as Rust prints it, a boolean as `true`/`false`).
#[derive(Debug, Clone, PartialEq)]
pub struct ReceivedSpan {
    pub trace_id: String,
    pub span_id: String,
    pub parent_span_id: String,
    pub name: String,
    /// OTLP's span kind number (2 server, 3 client).
    pub kind: i32,
    pub attributes: BTreeMap<String, String>,
    /// The resource's `service.name`.
    pub service: String,
}

impl ReceivedSpan {
    pub fn attr(&self, name: &str) -> Option<&str> {
        self.attributes.get(name).map(String::as_str)
    }
}

#[derive(Default)]
struct Received {
    spans: Vec<ReceivedSpan>,
    exports: u64,
    errors: Vec<String>,
}

/// The receiver: a listener thread and a thread per connection, stopped on drop.
pub struct OtlpReceiver {
    port: u16,
    received: Arc<Mutex<Received>>,
    stop: Arc<AtomicBool>,
    accept: Option<JoinHandle<()>>,
}

impl OtlpReceiver {
    pub fn start() -> Result<OtlpReceiver> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        listener.set_nonblocking(true)?;
        let port = listener.local_addr()?.port();
        let received = Arc::new(Mutex::new(Received::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let (r, s) = (Arc::clone(&received), Arc::clone(&stop));
        let accept = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((conn, _)) => {
                        let r = Arc::clone(&r);
                        std::thread::spawn(move || {
                            if let Err(e) = serve(conn, &r) {
                                lock(&r).errors.push(format!("{e:#}"));
                            }
                        });
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::sleep(Duration::from_millis(10)),
                    Err(e) => {
                        lock(&r).errors.push(format!("accept: {e}"));
                        return;
                    }
                }
            }
        });
        Ok(OtlpReceiver { port, received, stop, accept: Some(accept) })
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<ReceivedSpan> {
        lock(&self.received).spans.clone()
    }

    /// Export requests decoded so far.
    pub fn exports(&self) -> u64 {
        lock(&self.received).exports
    }

    /// What could not be received: undecodable bodies, wrong paths or content types.
    pub fn errors(&self) -> Vec<String> {
        lock(&self.received).errors.clone()
    }
}

impl Drop for OtlpReceiver {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
    }
}

fn lock(r: &Mutex<Received>) -> std::sync::MutexGuard<'_, Received> {
    r.lock().unwrap_or_else(|e| e.into_inner())
}

/// HTTP/1.1 requests on one connection, until the peer closes it.
fn serve(conn: TcpStream, received: &Mutex<Received>) -> Result<()> {
    conn.set_nonblocking(false)?;
    conn.set_read_timeout(Some(Duration::from_secs(30)))?;
    let mut writer = conn.try_clone()?;
    let mut reader = BufReader::new(conn);
    loop {
        let mut request_line = String::new();
        if reader.read_line(&mut request_line)? == 0 {
            return Ok(());
        }
        let mut length: Option<usize> = None;
        let mut chunked = false;
        let mut content_type = String::new();
        loop {
            let mut line = String::new();
            if reader.read_line(&mut line)? == 0 {
                bail!("connection closed inside the headers of {request_line:?}");
            }
            let line = line.trim_end();
            if line.is_empty() {
                break;
            }
            let (name, value) = line.split_once(':').with_context(|| format!("header line {line:?}"))?;
            match name.trim().to_ascii_lowercase().as_str() {
                "content-length" => length = Some(value.trim().parse().with_context(|| format!("content-length {value:?}"))?),
                "content-type" => content_type = value.trim().to_string(),
                "transfer-encoding" if value.trim().eq_ignore_ascii_case("chunked") => chunked = true,
                "transfer-encoding" => bail!("{request_line:?}: transfer-encoding {value:?}"),
                _ => {}
            }
        }
        let body = if chunked {
            read_chunked(&mut reader)?
        } else {
            let mut body = vec![0; length.with_context(|| format!("{request_line:?} without content-length"))?];
            reader.read_exact(&mut body)?;
            body
        };
        let target = request_line.split_whitespace().nth(1).unwrap_or_default().to_string();
        if !request_line.starts_with("POST ") || target != "/v1/traces" || content_type != "application/x-protobuf" {
            lock(received).errors.push(format!("not an OTLP/HTTP trace export: {} with content-type {content_type:?}", request_line.trim_end()));
        } else {
            match ExportTraceServiceRequest::decode(body.as_slice()) {
                Ok(export) => {
                    let mut r = lock(received);
                    r.exports += 1;
                    r.spans.extend(spans_of(export));
                }
                Err(e) => lock(received).errors.push(format!("an export of {} bytes does not decode: {e}", body.len())),
            }
        }
        // An empty ExportTraceServiceResponse: everything accepted.
        writer.write_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/x-protobuf\r\ncontent-length: 0\r\n\r\n")?;
    }
}

/// A chunked body (Envoy's OTLP/HTTP exporter sends one): hex size lines, each chunk and its CRLF,
/// up to the empty last chunk and the (ignored) trailers.
fn read_chunked(reader: &mut impl BufRead) -> Result<Vec<u8>> {
    let mut body = Vec::new();
    loop {
        let mut size_line = String::new();
        reader.read_line(&mut size_line)?;
        let hex_size = size_line.trim().split(';').next().unwrap_or_default();
        let size = usize::from_str_radix(hex_size, 16).with_context(|| format!("chunk size line {size_line:?}"))?;
        if size == 0 {
            loop {
                let mut trailer = String::new();
                if reader.read_line(&mut trailer)? == 0 || trailer.trim().is_empty() {
                    return Ok(body);
                }
            }
        }
        let mut chunk = vec![0; size];
        reader.read_exact(&mut chunk)?;
        body.extend_from_slice(&chunk);
        let mut crlf = [0u8; 2];
        reader.read_exact(&mut crlf)?;
    }
}

fn text(value: Option<AnyValue>) -> String {
    match value {
        Some(AnyValue::StringValue(s)) => s,
        Some(AnyValue::IntValue(i)) => i.to_string(),
        Some(AnyValue::DoubleValue(d)) => d.to_string(),
        Some(AnyValue::BoolValue(b)) => b.to_string(),
        Some(other) => format!("{other:?}"),
        None => String::new(),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn spans_of(export: ExportTraceServiceRequest) -> Vec<ReceivedSpan> {
    let mut out = Vec::new();
    for resource_spans in export.resource_spans {
        let service = resource_spans
            .resource
            .map(|r| r.attributes)
            .unwrap_or_default()
            .into_iter()
            .find(|kv| kv.key == "service.name")
            .map(|kv| text(kv.value.and_then(|v| v.value)))
            .unwrap_or_default();
        for scope in resource_spans.scope_spans {
            for span in scope.spans {
                out.push(ReceivedSpan {
                    trace_id: hex(&span.trace_id),
                    span_id: hex(&span.span_id),
                    parent_span_id: hex(&span.parent_span_id),
                    name: span.name,
                    kind: span.kind,
                    attributes: span.attributes.into_iter().map(|kv| (kv.key, text(kv.value.and_then(|v| v.value)))).collect(),
                    service: service.clone(),
                });
            }
        }
    }
    out
}
