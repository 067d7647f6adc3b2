//! sluice's native module in the real Envoy 1.40 (`SLUICE_ENVOY`, else `.tools/venv/bin/envoy`),
//! configured by tests/envoy-native.yaml, in front of a small upstream this test runs (HTTP/1.1,
//! answering a chunked SSE stream and recording what it was sent):
//!
//! - the proof filter: the upstream gets `x-sluice-native: 1`, the client `x-sluice-native-seen:
//!   <path>`, the access log the response body's exact byte count from filter state
//!   `sluice_native_bytes`, Prometheus the labelled counter and histogram; a local 429 never
//!   reaches the upstream; Envoy logs that the module's ABI version matched;
//! - `proof-hold`: the request headers wait while the filter reads the whole body, then carry its
//!   size to the upstream;
//! - a configuration the module does not recognise, and an unknown `filter_name`: Envoy refuses to
//!   start, with the module's reason in its log;
//! - a module returning a wrong ABI version string: Envoy 1.40 warns and loads it (it does not refuse);
//! - a panic in a hook (the `panic-probe` build): caught, logged, the stream continues, Envoy lives;
//! - a module missing a callback it needs (the `refuse-load` build): refused at load, with a line
//!   naming the callback.
//!
//! Builds nothing: the modules come from `cargo xtask build` (`target/native`, and the probe builds
//! in `target/sluice-native-probes/native` and `target/sluice-native-refuse/native`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const TEMPLATE: &str = include_str!("envoy-native.yaml");
/// The upstream's SSE body, one chunk per write (so Envoy delivers several response body events).
const SSE_CHUNKS: [&str; 3] = [
    "data: {\"choices\":[{\"delta\":{\"content\":\"Hel\"}}]}\n\n",
    "data: {\"choices\":[{\"delta\":{\"content\":\"lo\"}}],\"usage\":{\"completion_tokens\":2}}\n\n",
    "data: [DONE]\n\n",
];

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

fn envoy_bin() -> PathBuf {
    std::env::var_os("SLUICE_ENVOY").map(PathBuf::from).unwrap_or_else(|| root().join(".tools/venv/bin/envoy"))
}

/// The directory holding `libsluice.so`: the release build, or a probe build's.
fn module_dir(variant: Option<&str>) -> PathBuf {
    let dir = match variant {
        None => root().join("target/native"),
        Some(variant) => root().join(format!("target/sluice-native-{variant}/native")),
    };
    assert!(dir.join("libsluice.so").is_file(), "{} is missing: run `cargo xtask build` first", dir.join("libsluice.so").display());
    dir
}

fn sse_body() -> String {
    SSE_CHUNKS.concat()
}

// ------------------------------------------------------------------------------------------------
// The upstream.

struct Recorded {
    head: String,
    body: Vec<u8>,
}

struct Upstream {
    port: u16,
    requests: Arc<Mutex<Vec<Recorded>>>,
}

impl Upstream {
    fn start() -> Upstream {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let requests = Arc::new(Mutex::new(Vec::new()));
        let seen = Arc::clone(&requests);
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let seen = Arc::clone(&seen);
                std::thread::spawn(move || serve(stream, &seen));
            }
        });
        Upstream { port, requests }
    }

    /// The heads of the requests received for `path`.
    fn heads_for(&self, path: &str) -> Vec<String> {
        let prefix = format!(" {path} HTTP/1.1");
        self.requests.lock().unwrap().iter().filter(|r| r.head.lines().next().is_some_and(|l| l.contains(&prefix))).map(|r| r.head.clone()).collect()
    }

    fn body_for(&self, path: &str) -> Option<Vec<u8>> {
        let prefix = format!(" {path} HTTP/1.1");
        self.requests.lock().unwrap().iter().find(|r| r.head.lines().next().is_some_and(|l| l.contains(&prefix))).map(|r| r.body.clone())
    }
}

/// Answers every request of one keep-alive connection with the SSE stream.
fn serve(stream: TcpStream, seen: &Mutex<Vec<Recorded>>) {
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut writer = stream;
    loop {
        let Some((head, body)) = read_message(&mut reader) else { return };
        seen.lock().unwrap().push(Recorded { head, body });
        if writer.write_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n").is_err() {
            return;
        }
        for chunk in SSE_CHUNKS {
            let _ = write!(writer, "{:x}\r\n{chunk}\r\n", chunk.len());
            let _ = writer.flush();
            std::thread::sleep(Duration::from_millis(20));
        }
        if writer.write_all(b"0\r\n\r\n").is_err() {
            return;
        }
    }
}

/// One HTTP/1.1 message: its head (lower-cased header names as sent) and its de-chunked body.
fn read_message(reader: &mut impl BufRead) -> Option<(String, Vec<u8>)> {
    let mut head = String::new();
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).ok()? == 0 {
            return None;
        }
        if line == "\r\n" {
            break;
        }
        head.push_str(&line);
    }
    let header =
        |name: &str| head.lines().skip(1).find_map(|l| l.split_once(':').filter(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.trim().to_string()));
    let mut body = Vec::new();
    if let Some(length) = header("content-length") {
        body.resize(length.parse().ok()?, 0);
        reader.read_exact(&mut body).ok()?;
    } else if header("transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked")) {
        loop {
            let mut size = String::new();
            reader.read_line(&mut size).ok()?;
            let size = usize::from_str_radix(size.trim(), 16).ok()?;
            let mut chunk = vec![0; size + 2];
            reader.read_exact(&mut chunk).ok()?;
            if size == 0 {
                break;
            }
            body.extend_from_slice(&chunk[..size]);
        }
    }
    Some((head, body))
}

// ------------------------------------------------------------------------------------------------
// Envoy.

struct Envoy {
    child: Child,
    dir: PathBuf,
    listen_port: u16,
    admin_port: u16,
}

impl Drop for Envoy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("Envoy's files are kept in {}", self.dir.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

fn scratch_dir() -> PathBuf {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let dir = std::env::temp_dir().join(format!("sluice-native-{}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed)));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// How a start ended: Envoy serving, or Envoy exited (with its log).
enum Started {
    Up(Envoy),
    Exited { code: Option<i32>, log: String },
}

impl Started {
    fn up(self) -> Envoy {
        match self {
            Started::Up(envoy) => envoy,
            Started::Exited { code, log } => panic!("Envoy exited ({code:?}):\n{log}"),
        }
    }
}

/// Starts Envoy with the module from `module_dir`, filter `filter_name` with `filter_config` (a
/// `google.protobuf.StringValue`), in front of `upstream_port`; waits until it serves or exits.
fn start_envoy(module_dir: &Path, filter_name: &str, filter_config: &str, upstream_port: u16) -> Started {
    let dir = scratch_dir();
    let config = TEMPLATE
        .replace("{{UPSTREAM_PORT}}", &upstream_port.to_string())
        .replace("{{ACCESS_LOG}}", &dir.join("access.log").display().to_string())
        .replace("{{FILTER_NAME}}", filter_name)
        .replace("{{FILTER_CONFIG}}", filter_config);
    std::fs::write(dir.join("envoy.yaml"), config).unwrap();
    let log = std::fs::File::create(dir.join("envoy.log")).unwrap();
    let admin_file = dir.join("admin.address");
    let child = Command::new(envoy_bin())
        .arg("-c")
        .arg(dir.join("envoy.yaml"))
        .args(["--concurrency", "1", "--disable-hot-restart", "--log-level", "info", "--file-flush-interval-msec", "100"])
        .arg("--admin-address-path")
        .arg(&admin_file)
        .env("ENVOY_DYNAMIC_MODULES_SEARCH_PATH", module_dir)
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap_or_else(|e| panic!("starting {}: {e}", envoy_bin().display()));
    let mut envoy = Envoy { child, dir, listen_port: 0, admin_port: 0 };
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(status) = envoy.child.try_wait().unwrap() {
            let log = envoy.log();
            return Started::Exited { code: status.code(), log };
        }
        assert!(Instant::now() < deadline, "Envoy did not start in 30 s:\n{}", envoy.log());
        if envoy.admin_port == 0 {
            if let Some(port) = std::fs::read_to_string(&admin_file).ok().and_then(|a| a.trim().rsplit(':').next()?.parse().ok()) {
                envoy.admin_port = port;
            }
        }
        if envoy.admin_port != 0 {
            let listeners = get(envoy.admin_port, "/listeners").map(|r| String::from_utf8_lossy(&r.body).into_owned()).unwrap_or_default();
            let port = listeners.lines().find_map(|l| l.strip_prefix("ingress::")?.rsplit(':').next()?.parse().ok());
            let ready = get(envoy.admin_port, "/ready").is_some_and(|r| r.status == 200);
            if let (Some(port), true) = (port, ready) {
                envoy.listen_port = port;
                return Started::Up(envoy);
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

impl Envoy {
    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("envoy.log")).unwrap_or_default()
    }

    fn request(&self, raw: &str) -> Response {
        send(self.listen_port, raw.as_bytes()).unwrap_or_else(|| panic!("no answer from Envoy to {raw:?}:\n{}", self.log()))
    }

    /// The access log line of `path`, waiting for Envoy to flush it.
    fn access_log_line(&self, path: &str) -> String {
        let marker = format!("path={path} ");
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let text = std::fs::read_to_string(self.dir.join("access.log")).unwrap_or_default();
            if let Some(line) = text.lines().find(|l| l.starts_with(&marker)) {
                return line.to_string();
            }
            assert!(Instant::now() < deadline, "no access log line for {path}; access log:\n{text}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits until `/stats/prometheus` has a line `line`; the whole output otherwise.
    fn wait_for_metric(&self, line: &str) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let text = get(self.admin_port, "/stats/prometheus").map(|r| String::from_utf8_lossy(&r.body).into_owned()).unwrap_or_default();
            if text.lines().any(|l| l == line) {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(text.lines().filter(|l| l.contains("sluice")).collect::<Vec<_>>().join("\n"));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

// ------------------------------------------------------------------------------------------------
// A plain HTTP/1.1 client.

struct Response {
    status: u16,
    head: String,
    body: Vec<u8>,
}

impl Response {
    fn header(&self, name: &str) -> Option<&str> {
        self.head.lines().skip(1).find_map(|l| l.split_once(':').filter(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.trim()))
    }
}

fn send(port: u16, raw: &[u8]) -> Option<Response> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(15))).ok()?;
    stream.write_all(raw).ok()?;
    let mut reader = BufReader::new(stream);
    let (head, body) = read_message(&mut reader)?;
    let status = head.split_whitespace().nth(1)?.parse().ok()?;
    Some(Response { status, head, body })
}

fn get(port: u16, path: &str) -> Option<Response> {
    send(port, format!("GET {path} HTTP/1.1\r\nhost: admin\r\nconnection: close\r\n\r\n").as_bytes())
}

fn get_request(path: &str, extra: &str) -> String {
    format!("GET {path} HTTP/1.1\r\nhost: gateway\r\n{extra}connection: close\r\n\r\n")
}

// ------------------------------------------------------------------------------------------------
// The tests.

#[test]
fn proof_filter_in_real_envoy() {
    let upstream = Upstream::start();
    let envoy = start_envoy(&module_dir(None), "proof", "", upstream.port).up();
    let log = envoy.log();
    assert!(log.contains("Dynamic module ABI version v0.2.0 matched."), "Envoy did not match the ABI version:\n{log}");
    assert!(log.contains("built for Envoy 1.40.0 (dynamic-module ABI v0.2.0), 17 host callbacks resolved"), "{log}");

    let path = "/v1/chat/completions?stream=true";
    let response = envoy.request(&get_request(path, ""));
    assert_eq!(response.status, 200, "{}", response.head);
    assert_eq!(response.header("x-sluice-native-seen"), Some(path), "{}", response.head);
    assert_eq!(String::from_utf8_lossy(&response.body), sse_body());

    let heads = upstream.heads_for(path);
    assert_eq!(heads.len(), 1);
    assert!(heads[0].lines().any(|l| l == "x-sluice-native: 1"), "the upstream did not get x-sluice-native: 1:\n{}", heads[0]);

    let bytes = sse_body().len();
    assert_eq!(envoy.access_log_line(path), format!("path={path} status=200 bytes_sent={bytes} sluice_native_bytes={bytes}"));

    // A refusal is answered by the module and never reaches the upstream.
    let refused = envoy.request(&get_request("/sluice-native/refuse", ""));
    assert_eq!(refused.status, 429, "{}", refused.head);
    assert_eq!(refused.header("x-sluice-native-refused"), Some("1"));
    assert_eq!(refused.body, b"refused by sluice-native\n");
    assert!(upstream.heads_for("/sluice-native/refuse").is_empty());
    assert_eq!(envoy.access_log_line("/sluice-native/refuse"), "path=/sluice-native/refuse status=429 bytes_sent=25 sluice_native_bytes=0");

    // Metrics defined at configuration time with a label, recorded per stream: native labels in
    // Prometheus, under `envoy_` + `metrics_namespace`.
    envoy.wait_for_metric(r#"envoy_sluice_native_streams{filter="proof"} 2"#).unwrap_or_else(|m| panic!("counter missing:\n{m}"));
    envoy.wait_for_metric(r#"envoy_sluice_native_response_body_bytes_count{filter="proof"} 2"#).unwrap_or_else(|m| panic!("histogram missing:\n{m}"));
}

#[test]
fn proof_hold_reads_the_request_body_while_the_headers_wait() {
    let upstream = Upstream::start();
    let envoy = start_envoy(&module_dir(None), "proof-hold", "{}", upstream.port).up();
    let body = "x".repeat(3000);
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    // The body in two writes, so the filter sees more than one piece of it.
    let mut stream = TcpStream::connect(("127.0.0.1", envoy.listen_port)).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
    stream.write_all(head.as_bytes()).unwrap();
    stream.write_all(&body.as_bytes()[..1000]).unwrap();
    stream.flush().unwrap();
    std::thread::sleep(Duration::from_millis(100));
    stream.write_all(&body.as_bytes()[1000..]).unwrap();
    let (response_head, _) = read_message(&mut BufReader::new(stream)).unwrap();
    assert!(response_head.starts_with("HTTP/1.1 200"), "{response_head}\n{}", envoy.log());

    let heads = upstream.heads_for("/v1/completions");
    assert_eq!(heads.len(), 1);
    assert!(heads[0].lines().any(|l| l == "x-sluice-native-request-body-bytes: 3000"), "headers changed after the body was read did not arrive:\n{}", heads[0]);
    assert!(heads[0].lines().any(|l| l == "x-sluice-native: 1"), "{}", heads[0]);
    assert_eq!(upstream.body_for("/v1/completions").unwrap().len(), 3000);
}

#[test]
fn an_unrecognised_configuration_is_refused() {
    for (name, config, reason) in [
        ("proof", "model: llama", r#"sluice-native: filter configuration refused: filter "proof" takes no configuration yet; got 12 bytes: "model: llama""#),
        ("router", "", r#"sluice-native: filter configuration refused: unknown filter_name "router" (this module has: proof, proof-hold)"#),
    ] {
        let Started::Exited { code, log } = start_envoy(&module_dir(None), name, config, 9) else {
            panic!("Envoy started with filter {name:?} and configuration {config:?}");
        };
        assert_ne!(code, Some(0));
        assert!(log.contains(reason), "the module's reason is missing:\n{log}");
        assert!(log.contains("Failed to initialize dynamic module"), "Envoy's refusal is missing:\n{log}");
    }
}

#[test]
fn envoy_1_40_loads_a_module_with_a_wrong_abi_version_and_only_warns() {
    let upstream = Upstream::start();
    let envoy = start_envoy(&module_dir(Some("probes")), "proof", "", upstream.port).up();
    let log = envoy.log();
    assert!(
        log.contains("Dynamic module ABI version v0.0.0-sluice-wrong-abi is deprecated. Please recompile the module against the SDK with the exact Envoy version used by the main program."),
        "{log}"
    );
    let response = envoy.request(&get_request("/after-warning", ""));
    assert_eq!(response.status, 200);
    assert_eq!(response.header("x-sluice-native-seen"), Some("/after-warning"));
}

#[test]
fn a_panic_in_a_hook_is_caught_and_the_stream_continues() {
    let upstream = Upstream::start();
    let envoy = start_envoy(&module_dir(Some("probes")), "proof", "", upstream.port).up();
    assert!(envoy.log().contains("panic=unwind"), "the probe module was not built with panic=unwind:\n{}", envoy.log());

    let response = envoy.request(&get_request("/panics", "x-sluice-native-panic: 1\r\n"));
    assert_eq!(response.status, 200, "{}\n{}", response.head, envoy.log());
    assert_eq!(String::from_utf8_lossy(&response.body), sse_body());
    // Bypassed for the rest of the stream: no header set, none added.
    assert_eq!(response.header("x-sluice-native-seen"), None);
    let heads = upstream.heads_for("/panics");
    assert_eq!(heads.len(), 1);
    assert!(!heads[0].contains("x-sluice-native: 1"), "{}", heads[0]);
    let log = envoy.log();
    assert!(
        log.contains("sluice-native: panic in on_request_headers: sluice-native panic probe: the request carries x-sluice-native-panic; the stream continues and this filter is bypassed for the rest of it"),
        "{log}"
    );
    // The stream's end still writes nothing (bypassed), and the next stream is filtered again.
    assert_eq!(envoy.access_log_line("/panics"), format!("path=/panics status=200 bytes_sent={} sluice_native_bytes=-", sse_body().len()));
    let next = envoy.request(&get_request("/after-panic", ""));
    assert_eq!(next.header("x-sluice-native-seen"), Some("/after-panic"));
}

#[test]
fn a_module_missing_a_callback_is_refused_at_load() {
    let Started::Exited { code, log } = start_envoy(&module_dir(Some("refuse")), "proof", "", 9) else {
        panic!("Envoy loaded a module that needs a callback it does not export");
    };
    assert_ne!(code, Some(0));
    assert!(
        log.contains("sluice-native: refusing to load: this Envoy does not export envoy_dynamic_module_callback_sluice_refuse_load_probe (libsluice.so is built for Envoy 1.40.0, dynamic-module ABI v0.2.0)"),
        "the module's reason is missing:\n{log}"
    );
    assert!(log.contains("Failed to initialize dynamic module"), "Envoy's refusal is missing:\n{log}");
}
