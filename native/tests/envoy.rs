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
//! - the shipped envoy/rendered/native-full-gateway.yaml (its ports and access log pointed at this
//!   test's): one streamed request through all four sections, whose stamps agree on the version and
//!   the tokens.
//!
//! Builds nothing: the modules come from `cargo xtask build` (`target/native`, and the probe builds
//! in `target/sluice-native-probes` and `target/sluice-native-refuse`).
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

/// [`SSE_CHUNKS`], 20 ms apart.
const PROOF_SCRIPT: [(u64, &str); 3] = [(0, SSE_CHUNKS[0]), (20, SSE_CHUNKS[1]), (20, SSE_CHUNKS[2])];

/// How long the LLM script waits before its first content token.
const FIRST_CONTENT_MS: u64 = 200;

/// An OpenAI chat completion stream with usage (what a request with `x-test-script: llm` gets), each
/// chunk written after its pause in ms: a role-only chunk and an SSE comment at once (neither is a
/// token), the first content [`FIRST_CONTENT_MS`] after the request, a second one, the finish, usage.
const LLM_SCRIPT: [(u64, &str); 7] = [
    (0, "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"model\":\"m-1\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\"}}],\"usage\":null}\n\n"),
    (0, ": keep-alive\n\n"),
    (FIRST_CONTENT_MS, "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"model\":\"m-1\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hello\"}}],\"usage\":null}\n\n"),
    (30, "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"model\":\"m-1\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\" world\"}}],\"usage\":null}\n\n"),
    (0, "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"model\":\"m-1\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}],\"usage\":null}\n\n"),
    (0, "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"model\":\"m-1\",\"choices\":[],\"usage\":{\"prompt_tokens\":12,\"completion_tokens\":2,\"total_tokens\":14,\"prompt_tokens_details\":{\"cached_tokens\":4}}}\n\n"),
    (0, "data: [DONE]\n\n"),
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
        Some(variant) => root().join(format!("target/sluice-native-{variant}")),
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
        let script_of = |name: &str| head.lines().any(|l| l.eq_ignore_ascii_case(&format!("x-test-script: {name}")));
        // `cut`: the LLM stream's first two chunks, then the connection closes mid-stream.
        let (script, cut): (&[(u64, &str)], bool) = if script_of("llm") {
            (&LLM_SCRIPT, false)
        } else if script_of("cut") {
            (&LLM_SCRIPT[..3], true)
        } else {
            (&PROOF_SCRIPT, false)
        };
        seen.lock().unwrap().push(Recorded { head, body });
        if writer.write_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n").is_err() {
            return;
        }
        for (pause_ms, chunk) in script {
            std::thread::sleep(Duration::from_millis(*pause_ms));
            let _ = write!(writer, "{:x}\r\n{chunk}\r\n", chunk.len());
            let _ = writer.flush();
        }
        if cut {
            let _ = writer.shutdown(std::net::Shutdown::Both);
            return;
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
    let config =
        TEMPLATE.replace("{{UPSTREAM_PORT}}", &upstream_port.to_string()).replace("{{FILTER_NAME}}", filter_name).replace("{{FILTER_CONFIG}}", filter_config);
    start_with(module_dir, &config)
}

/// Starts Envoy on `config` (its `{{ACCESS_LOG}}` filled in) with `module_dir` as the modules'
/// search path; waits until it serves or exits.
fn start_with(module_dir: &Path, config: &str) -> Started {
    let dir = scratch_dir();
    let config = config.replace("{{ACCESS_LOG}}", &dir.join("access.log").display().to_string());
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
            // `<listener name>::127.0.0.1:<port>` (the tests' `ingress`, a shipped gateway's `gateway`).
            let port = listeners.lines().find_map(|l| l.split_once("::")?.1.rsplit(':').next()?.parse().ok());
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
    let resolved = format!("built for Envoy 1.40.0 (dynamic-module ABI v0.2.0), {} host callbacks resolved", sluice::CALLBACKS_USED.len());
    assert!(log.contains(&resolved), "{log}");

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
        (
            "router",
            "",
            r#"sluice-native: filter configuration refused: unknown filter_name "router" (this module has: sluice, sluice-body-metadata, proof, proof-hold, floor)"#,
        ),
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

// ------------------------------------------------------------------------------------------------
// The engine (filter `sluice`), natively and as sluice.wasm, on the same requests.

const ENGINE_TEMPLATE: &str = include_str!("envoy-engine.yaml");

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Host {
    Native,
    Wasm,
}

/// `sluice.wasm`, from `cargo xtask build`.
fn sluice_wasm() -> PathBuf {
    let wasm = root().join("target/wasm32-wasip1/release/sluice.wasm");
    assert!(wasm.is_file(), "{} is missing: run `cargo xtask build` first", wasm.display());
    wasm
}

/// `text` inside a YAML double-quoted scalar.
fn yaml_quoted(text: &str) -> String {
    text.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', " ")
}

/// The top-level blocks of a shipped gateway template from `first` (`stats_config`, or the native
/// gateway's `layered_runtime` and `stats_config`: labels, histogram buckets) to its listeners.
fn stats_config_of(template: &str, first: &str) -> String {
    let text = std::fs::read_to_string(root().join("envoy/templates").join(template)).unwrap();
    let start = text.find(&format!("\n{first}:")).unwrap() + 1;
    let end = start + text[start..].find("\nstatic_resources:").unwrap();
    text[start..end].to_string()
}

/// Separates the filter instances in [`start_engine`]'s `sections`.
const NEXT_INSTANCE: &str = "\n---\n";

/// Starts Envoy with the engine configured with `sections` (sluice.wasm's configuration JSON) on
/// `host`, with the shipped gateway's `stats_config` for that host.
fn start_engine(host: Host, sections: &str, upstream_port: u16) -> Started {
    start_engine_with_ledger(host, sections, upstream_port, 9)
}

/// [`start_engine`] with cluster `sluice_ledger` on `ledger_port` (a [`LedgerService`]).
fn start_engine_with_ledger(host: Host, sections: &str, upstream_port: u16, ledger_port: u16) -> Started {
    // Several filter instances, in order, when `sections` holds several documents separated by
    // [`NEXT_INSTANCE`] (latency-guard runs in an instance of its own, in front of the others).
    let instance = |name: &str, sections: &str| -> String {
        let value = yaml_quoted(sections);
        match host {
            Host::Native => format!(
                r#"          - name: envoy.filters.http.dynamic_modules
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter
              dynamic_module_config: {{ name: sluice, do_not_close: true }}
              filter_name: sluice
              filter_config:
                "@type": type.googleapis.com/google.protobuf.StringValue
                value: "{value}"
"#
            ),
            Host::Wasm => format!(
                r#"          - name: envoy.filters.http.wasm
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm
              config:
                name: {name}
                root_id: {name}
                failure_policy: FAIL_OPEN
                configuration:
                  "@type": type.googleapis.com/google.protobuf.StringValue
                  value: "{value}"
                vm_config:
                  vm_id: sluice
                  runtime: envoy.wasm.runtime.v8
                  code: {{ local: {{ filename: "{}" }} }}
"#,
                sluice_wasm().display(),
            ),
        }
    };
    let instances: Vec<&str> = sections.split(NEXT_INSTANCE).collect();
    let filters: String = instances.iter().map(|s| instance(if s.contains("latency_guard") { "sluice_latency_guard" } else { "sluice" }, s)).collect();
    // model-router reads the body's `model` from dynamic metadata (Envoy routes on headers, before a
    // filter sees the body): with sluice.wasm Envoy's json_to_metadata in front, as
    // router-gateway.yaml; natively the module's own sluice-body-metadata, as
    // native-full-gateway.yaml — so every routing case here also compares the two lifts.
    let lifts = sections.contains("model_router") || sections.contains("latency_guard");
    let json_to_metadata = if lifts && host == Host::Native {
        r#"          - name: envoy.filters.http.dynamic_modules
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter
              dynamic_module_config: { name: sluice, do_not_close: true }
              filter_name: sluice-body-metadata
"#
    } else if lifts {
        r#"          - name: envoy.filters.http.json_to_metadata
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.json_to_metadata.v3.JsonToMetadata
              request_rules:
                rules:
                - selectors: [{ key: model }]
                  on_present: { metadata_namespace: sluice, key: model, type: STRING }
"#
    } else {
        ""
    };
    let stats = match host {
        Host::Native => stats_config_of("native-gateway.yaml", "layered_runtime"),
        Host::Wasm => stats_config_of(
            // The guard beside another policy: the full gateway's tags (the router's alone lacks
            // the guard's `to`, the guard's alone the budget's).
            if sections.contains("latency_guard") && (sections.contains("tenant_budget") || sections.contains("model_router")) {
                "full-gateway.yaml"
            } else if sections.contains("tenant_budget") {
                "budget-gateway.yaml"
            } else if sections.contains("model_router") {
                "router-gateway.yaml"
            } else if sections.contains("latency_guard") {
                "latency-gateway.yaml"
            } else {
                "gateway.yaml"
            },
            "stats_config",
        ),
    };
    // sluice.wasm's budget needs Envoy's buffer filter behind it to keep a refused request's
    // headers from the upstream (docs/tenant-budget.md); the native host holds them itself.
    let buffer = if host == Host::Wasm && sections.contains("tenant_budget") {
        "          - name: envoy.filters.http.buffer\n            typed_config:\n              \"@type\": type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer\n              max_request_bytes: 9437184\n"
    } else {
        ""
    };
    let filter = format!("{json_to_metadata}{filters}{buffer}");
    let filter = filter.trim_end_matches('\n');
    let config =
        ENGINE_TEMPLATE.replace("{{HTTP_FILTER}}", filter).replace("{{STATS_CONFIG}}", &stats).replace("{{UPSTREAM_PORT}}", &upstream_port.to_string());
    let config = config.replace("{{LEDGER_PORT}}", &ledger_port.to_string());
    start_with(&module_dir(None), &config)
}

/// A streamed chat completion request the upstream answers with [`LLM_SCRIPT`].
fn llm_request(path: &str) -> String {
    scripted_request(path, "llm")
}

/// A streamed chat completion request the upstream answers with script `script`.
fn scripted_request(path: &str, script: &str) -> String {
    scripted_request_with(path, script, "")
}

/// [`scripted_request`] with `extra` header lines (each ending in CRLF).
fn scripted_request_with(path: &str, script: &str, extra: &str) -> String {
    let body =
        r#"{"model":"m-1","stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"Say hello to the world, please."}]}"#;
    format!(
        "POST {path} HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n{extra}x-test-script: {script}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
}

/// tenant-budget's stamp in the access log line of `path`.
fn budget_stamp(envoy: &Envoy, path: &str) -> String {
    let line = envoy.access_log_line(path);
    let after = line.split_once(" budget=").map(|(_, rest)| rest).unwrap_or_else(|| panic!("no budget stamp in {line}"));
    after.split_once(" sluice=").map(|(stamp, _)| stamp.to_string()).unwrap_or_default()
}

/// llm-metrics' stamp in the access log line of `path`.
fn stamp(envoy: &Envoy, path: &str) -> String {
    let line = envoy.access_log_line(path);
    line.split_once(" sluice=").map(|(_, stamp)| stamp.to_string()).unwrap_or_else(|| panic!("no stamp in {line}"))
}

/// The stamp's number for `key` (`"ttft_us":123`).
fn stamp_number(stamp: &str, key: &str) -> Option<u64> {
    let at = stamp.find(&format!("\"{key}\":"))? + key.len() + 3;
    stamp[at..].split(|c: char| !c.is_ascii_digit()).next()?.parse().ok()
}

/// `text` with the number after `marker` replaced by `#`.
/// What a client sees of an answer: its status, rate-limit and sluice headers, and a refusal's body,
/// with the times to a window's end masked (they count down between two runs).
fn seen_by_client(r: &Response) -> (u16, Vec<String>, String) {
    let headers: Vec<String> = r
        .head
        .lines()
        .skip(1)
        .map(str::to_ascii_lowercase)
        .filter(|l| (l.starts_with("x-ratelimit") || l.starts_with("retry-after") || l.starts_with("x-sluice")) && !l.starts_with("x-ratelimit-reset"))
        .map(|h| countdown_masked(&h, "retry-after: "))
        .collect();
    let body = if r.status == 200 { String::new() } else { countdown_masked(&String::from_utf8_lossy(&r.body), "resets in ") };
    (r.status, headers, body)
}

fn countdown_masked(text: &str, marker: &str) -> String {
    let Some(at) = text.find(marker).map(|at| at + marker.len()) else { return text.to_string() };
    let len = text[at..].find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len() - at);
    format!("{}#{}", &text[..at], &text[at + len..])
}

/// Five requests for `model`, one after the other, through each host; each one's `row` (which reads
/// its access log line: the guard's sample of a request has reached its breaker before the next
/// request is sent). The two hosts' rows must be equal; returns the native host's.
fn five_in_turn_alike<R: PartialEq + std::fmt::Debug>(native: &Envoy, wasm: &Envoy, model: &str, row: impl Fn(&Envoy, &str, &Response) -> R) -> Vec<R> {
    let mut seen = Vec::new();
    for (host, envoy) in [("native", native), ("wasm", wasm)] {
        let rows: Vec<R> = (0..5)
            .map(|n| {
                let path = format!("/v1/chat/completions?host={host}&n={n}");
                let response = envoy.request(&model_request(&path, model, ""));
                row(envoy, &path, &response)
            })
            .collect();
        seen.push(rows);
    }
    let wasm_rows = seen.pop().unwrap_or_default();
    let native_rows = seen.pop().unwrap_or_default();
    for (n, (native, wasm)) in native_rows.iter().zip(&wasm_rows).enumerate() {
        assert_eq!(native, wasm, "request {n}: native (left) and sluice.wasm (right) differ");
    }
    native_rows
}

/// latency-guard's stamp with its timings (and a refusal's retry hint) masked.
fn latency_timeless(stamp: &str) -> String {
    let mut out = stamp.to_string();
    for key in ["\"ttft_ms\":", "\"tpot_ms\":", "\"duration_ms\":", "\"retry_after_s\":"] {
        out = countdown_masked(&out, key);
    }
    out
}

/// The stamp with the figures that depend on timing replaced by `#`.
fn timeless(stamp: &str) -> String {
    let mut out = stamp.to_string();
    for key in ["ttft_us", "tpot_us", "decode_tokens_per_s", "duration_us"] {
        let marker = format!("\"{key}\":");
        if let Some(at) = out.find(&marker) {
            let from = at + marker.len();
            let len = out[from..].find(|c: char| !c.is_ascii_digit()).unwrap_or(out.len() - from);
            out.replace_range(from..from + len, "#");
        }
    }
    out
}

impl Envoy {
    /// The `le` bounds of histogram series `bucket` (`sluice_ttft_ms_bucket`) in `/stats/prometheus`.
    fn bucket_bounds(&self, bucket: &str) -> Vec<String> {
        let text = get(self.admin_port, "/stats/prometheus").map(|r| String::from_utf8_lossy(&r.body).into_owned()).unwrap_or_default();
        let mut bounds: Vec<String> = text
            .lines()
            .filter(|l| l.starts_with(&format!("{bucket}{{")))
            .filter_map(|l| Some(l.split("le=\"").nth(1)?.split('"').next()?.to_string()))
            .collect();
        bounds.dedup();
        bounds
    }

    /// sluice's series in `/stats/prometheus` once each of `families` has a series at its count and
    /// two reads 250 ms apart agree (the module sends counter and gauge changes every 100 ms), as
    /// `name{labels sorted}` → value; histograms by their `_count` only (their buckets and sums are
    /// timings).
    fn sluice_series(&self, families: &[(&str, u64)]) -> std::collections::BTreeMap<String, String> {
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut previous = None;
        loop {
            let text = get(self.admin_port, "/stats/prometheus").map(|r| String::from_utf8_lossy(&r.body).into_owned()).unwrap_or_default();
            let lines: Vec<&str> = text.lines().filter(|l| l.starts_with("sluice_")).collect();
            // Every family at its count (a histogram's count lags until the stats flush after its sample).
            if families.iter().all(|(f, count)| lines.iter().any(|l| l.starts_with(&format!("{f}{{")) && l.ends_with(&format!(" {count}")))) {
                let series: std::collections::BTreeMap<String, String> = lines
                    .iter()
                    .filter(|l| !l.contains("_bucket{") && !l.contains("_sum{"))
                    .map(|l| {
                        let (series, value) = l.rsplit_once(' ').unwrap();
                        let (name, labels) = series.split_once('{').unwrap_or((series, "}"));
                        let mut labels: Vec<&str> = labels.trim_end_matches('}').split(',').filter(|l| !l.is_empty()).collect();
                        labels.sort_unstable();
                        (format!("{name}{{{}}}", labels.join(",")), value.to_string())
                    })
                    .collect();
                if previous.as_ref() == Some(&series) {
                    return series;
                }
                previous = Some(series);
                std::thread::sleep(Duration::from_millis(250));
                continue;
            }
            assert!(Instant::now() < deadline, "{families:?} did not all show:\n{}", lines.join("\n"));
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

#[test]
fn engine_llm_metrics_natively_stamps_and_counts_as_sluice_wasm() {
    let upstream = Upstream::start();
    let sections = format!(r#"{{"llm_metrics": {}}}"#, include_str!("../../policies/llm-metrics.demo.json"));
    let native = start_engine(Host::Native, &sections, upstream.port).up();
    let wasm = start_engine(Host::Wasm, &sections, upstream.port).up();
    assert!(native.log().contains("sluice llm-metrics: configured (4 price entries)"), "{}", native.log());

    let mut stamps = Vec::new();
    for (host, envoy) in [(Host::Native, &native), (Host::Wasm, &wasm)] {
        let path = "/v1/chat/completions";
        let response = envoy.request(&llm_request(path));
        assert_eq!(response.status, 200, "{host:?}: {}", response.head);
        // The stream passes unchanged, with the demo policy's summary comment after it.
        let body = String::from_utf8_lossy(&response.body);
        let tail = body.strip_prefix(&LLM_SCRIPT.map(|(_, c)| c).concat()).unwrap_or_else(|| panic!("{host:?}: {body}"));
        assert!(tail.starts_with(": sluice ttft_us=") && tail.ends_with(" output_tokens=2 input_tokens=12 usage=reported\n\n"), "{host:?}: {tail:?}");
        let stamp = stamp(envoy, path);
        // TTFT is taken at the first content token, not at the role-only chunk or the comment
        // that came FIRST_CONTENT_MS earlier.
        let ttft = stamp_number(&stamp, "ttft_us").unwrap_or_else(|| panic!("{host:?}: no ttft_us in {stamp}"));
        assert!((FIRST_CONTENT_MS * 1000..FIRST_CONTENT_MS * 1000 + 100_000).contains(&ttft), "{host:?}: ttft_us {ttft} in {stamp}");
        // The stream ends after its last content token, sent 30 ms after the first: at least that
        // long from the request (a loaded Envoy may take the first token late, never the end early).
        let duration = stamp_number(&stamp, "duration_us").unwrap();
        assert!(duration > ttft && duration >= (FIRST_CONTENT_MS + 30) * 1000, "{host:?}: {stamp}");
        stamps.push(stamp);
    }
    assert_eq!(timeless(&stamps[0]), timeless(&stamps[1]), "the native stamp (first) differs from sluice.wasm's");

    // A stream the upstream cuts: reported at the stream's end from Envoy's response code details
    // and flags (natively the ABI's attributes), as the same outcome on both hosts.
    let mut cut = Vec::new();
    for envoy in [&native, &wasm] {
        let path = "/v1/chat/completions?cut";
        let _ = send(envoy.listen_port, scripted_request(path, "cut").as_bytes());
        cut.push(stamp(envoy, path));
    }
    assert_eq!(timeless(&cut[0]), timeless(&cut[1]), "the native stamp (first) of a cut stream differs from sluice.wasm's");
    assert!(cut[0].contains(r#""outcome":"upstream_error""#), "{}", cut[0]);
    assert!(stamps[0].contains(r#""usage":"reported""#) && stamps[0].contains(r#""output_tokens":2"#), "{}", stamps[0]);

    // The same Prometheus series, labels and counts on both hosts.
    let families = [("sluice_ttft_ms_count", 2), ("sluice_request_duration_ms_count", 2), ("sluice_output_tokens_count", 2)];
    let native_series = native.sluice_series(&families);
    let wasm_series = wasm.sluice_series(&families);
    assert_eq!(native_series, wasm_series, "native (left) and sluice.wasm (right) Prometheus series differ");
    // The same histogram buckets, from each gateway template's settings.
    let native_buckets = native.bucket_bounds("sluice_ttft_ms_bucket");
    assert_eq!(native_buckets, wasm.bucket_bounds("sluice_ttft_ms_bucket"));
    assert!(native_buckets.contains(&"250".to_string()) && native_buckets.contains(&"60000".to_string()), "{native_buckets:?}");
    let completed = native_series.iter().find(|(k, _)| k.starts_with("sluice_requests_total{") && k.contains(r#"finish="stop""#));
    assert!(completed.is_some_and(|(k, v)| k.contains(r#"model_version="m-1""#) && v == "1"), "{native_series:#?}");
}

#[test]
fn engine_configuration_is_refused_in_sluice_wasm_words() {
    for (sections, reason) in [
        (
            r#"{"llm_metrics":{"path_prefixes":["v1"]}}"#,
            r#"sluice-native: filter configuration refused: sluice llm-metrics: configuration refused: path_prefixes[0]: must start with '/', got "v1" (section `llm_metrics`)"#,
        ),
        (r#"{"llm_metric":{}}"#, "sluice-native: filter configuration refused: sluice: configuration refused: unknown section `llm_metric`: expected one of latency_guard, model_router, tenant_budget, llm_metrics"),
    ] {
        let Started::Exited { code, log } = start_engine(Host::Native, sections, 9) else {
            panic!("Envoy started with {sections}");
        };
        assert_ne!(code, Some(0));
        assert!(log.contains(reason), "the reason is missing:\n{log}");
    }
}

#[test]
fn engine_tenant_budget_natively_refuses_before_the_upstream_as_sluice_wasm() {
    let upstream = Upstream::start();
    // Key k1 may send 2 requests a day: the third is refused.
    let budget = r#"{"identity":{"header":"x-sluice-key"},"orgs":[{"id":"acme","teams":[{"id":"search","keys":[{"id":"k1","budgets":[{"window":"day","requests":2}]}]}]}]}"#;
    let sections = format!(r#"{{"tenant_budget": {budget}, "llm_metrics": {{}}}}"#);
    let native = start_engine(Host::Native, &sections, upstream.port).up();
    let wasm = start_engine(Host::Wasm, &sections, upstream.port).up();
    assert!(native.log().contains("tenant-budget configured: 1 keys"), "{}", native.log());

    let mut answers = Vec::new();
    for (host, envoy) in [("native", &native), ("wasm", &wasm)] {
        let mut of_host = Vec::new();
        for n in 1..=3 {
            let path = format!("/v1/chat/completions?host={host}&n={n}");
            let response = envoy.request(&scripted_request_with(&path, "llm", "x-sluice-key: k1\r\n"));
            let expected = if n <= 2 { 200 } else { 429 };
            assert_eq!(response.status, expected, "{host} request {n}: {}\n{}", response.head, String::from_utf8_lossy(&response.body));
            // A refusal reaches the upstream in no form; an admitted request arrives whole.
            assert_eq!(upstream.heads_for(&path).len(), usize::from(n <= 2), "{host} request {n}");
            of_host.push((seen_by_client(&response), timeless(&budget_stamp(envoy, &path)), timeless(&stamp(envoy, &path))));
        }
        answers.push(of_host);
    }
    for (n, (native, wasm)) in answers[0].iter().zip(&answers[1]).enumerate() {
        assert_eq!(native, wasm, "request {}: native (left) and sluice.wasm (right) differ", n + 1);
    }
    // The refusal's own body is sluice's message, not the upstream's, on both hosts.
    assert!(answers[0][2].2.contains(r#""upstream_error":null"#), "{}", answers[0][2].2);
    let refused = &answers[0][2];
    assert!(refused.0 .1.iter().any(|h| h.starts_with("retry-after")), "{refused:?}");
    assert!(refused.1.contains("429") && refused.2.contains(r#""status":429"#) && refused.2.contains(r#""outcome":"refused""#), "{refused:?}");

    // The budget's metrics, as sluice.wasm's.
    let families = [("sluice_budget_rejections_total", 1), ("sluice_budget_overestimate_tokens_count", 2), ("sluice_ttft_ms_count", 2)];
    assert_eq!(native.sluice_series(&families), wasm.sluice_series(&families), "native (left) and sluice.wasm (right) Prometheus series differ");
}

// ------------------------------------------------------------------------------------------------
// tenant-budget's Redis ledger: a real `redis-server` and `sluice-ledger` in front of it.

/// A free loopback port (bound, then released).
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// `redis-server` on a free port and `sluice-ledger` in front of it (docs/ledger.md), each killed on
/// drop: one per host, so the two hosts' budgets do not share counters.
struct LedgerService {
    redis: Child,
    ledger: Child,
    dir: PathBuf,
    port: u16,
}

impl Drop for LedgerService {
    fn drop(&mut self) {
        for child in [&mut self.ledger, &mut self.redis] {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl LedgerService {
    fn start() -> LedgerService {
        let dir = scratch_dir();
        let redis_port = free_port();
        let redis_bin = std::env::var_os("SLUICE_REDIS_SERVER").map_or_else(|| PathBuf::from("redis-server"), PathBuf::from);
        let redis = Command::new(&redis_bin)
            .args(["--port", &redis_port.to_string(), "--bind", "127.0.0.1", "--daemonize", "no", "--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(&dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("starting {} (cargo xtask setup installs it): {e}", redis_bin.display()));
        let ledger_bin = std::env::var_os("SLUICE_LEDGER_BIN").map_or_else(|| root().join("target/release/sluice-ledger"), PathBuf::from);
        let port = free_port();
        let wait = |what: &str, ready: &dyn Fn() -> bool| {
            let deadline = Instant::now() + Duration::from_secs(10);
            while !ready() {
                assert!(Instant::now() < deadline, "{what} did not come up in 10 s");
                std::thread::sleep(Duration::from_millis(50));
            }
        };
        wait("redis-server", &|| TcpStream::connect(("127.0.0.1", redis_port)).is_ok());
        let ledger = Command::new(&ledger_bin)
            .args(["--listen", &format!("127.0.0.1:{port}"), "--redis", &format!("redis://127.0.0.1:{redis_port}/"), "--threads", "1"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("starting {} (cargo xtask build makes it): {e}", ledger_bin.display()));
        let service = LedgerService { redis, ledger, dir, port };
        wait("sluice-ledger", &|| get(port, "/healthz").is_some_and(|r| r.status == 200));
        service
    }
}

/// A budget stamp with the Redis hold id (unique to the proxy, the stream and the time) masked.
fn hold_masked(stamp: &str) -> String {
    let Some(at) = stamp.find(r#""ledger_hold":""#).map(|at| at + r#""ledger_hold":""#.len()) else { return stamp.to_string() };
    let len = stamp[at..].find('"').unwrap_or(0);
    format!("{}#{}", &stamp[..at], &stamp[at + len..])
}

/// The value of family `family`'s series with (at least) the labels `labels` (`call="reserve"`) in
/// `/stats/prometheus`, once it shows at least `at_least`; what it shows after 10 s otherwise.
fn series_value(envoy: &Envoy, family: &str, labels: &[&str], at_least: u64) -> Option<u64> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let text = get(envoy.admin_port, "/stats/prometheus").map(|r| String::from_utf8_lossy(&r.body).into_owned()).unwrap_or_default();
        let value = text.lines().find_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let (name, rest) = series.split_once('{').unwrap_or((series, "}"));
            let have: Vec<&str> = rest.trim_end_matches('}').split(',').collect();
            (name == family && labels.iter().all(|want| have.contains(want))).then(|| value.parse::<u64>().ok()).flatten()
        });
        if value.is_some_and(|v| v >= at_least) || Instant::now() >= deadline {
            return value;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn engine_tenant_budget_with_a_redis_ledger_natively_refuses_as_sluice_wasm() {
    let upstream = Upstream::start();
    // Key k1 may send 2 requests a day, counted in Redis through sluice-ledger: the third is
    // refused by the ledger's answer, before the upstream sees anything.
    let budget = |on_failure: &str| {
        format!(
            r#"{{"identity":{{"header":"x-sluice-key"}},"ledger":{{"mode":"redis","cluster":"sluice_ledger","timeout_ms":2000,"on_failure":"{on_failure}"}},"orgs":[{{"id":"acme","teams":[{{"id":"search","keys":[{{"id":"k1","budgets":[{{"window":"day","requests":2}}]}}]}}]}}]}}"#
        )
    };
    let sections = format!(r#"{{"tenant_budget": {}, "llm_metrics": {{}}}}"#, budget("deny"));
    let (native_ledger, wasm_ledger) = (LedgerService::start(), LedgerService::start());
    let native = start_engine_with_ledger(Host::Native, &sections, upstream.port, native_ledger.port).up();
    let wasm = start_engine_with_ledger(Host::Wasm, &sections, upstream.port, wasm_ledger.port).up();
    assert!(native.log().contains("tenant-budget: Redis hold ids of this proxy start with"), "{}", native.log());

    // What a client sees ([`seen_by_client`]) and the budget's stamp (its hold id masked).
    let mut answers = Vec::new();
    for (host, envoy) in [("native", &native), ("wasm", &wasm)] {
        let mut of_host = Vec::new();
        for n in 1..=3u64 {
            let path = format!("/v1/chat/completions?host={host}&redis={n}");
            // The refusal's message splits the count into used and reserved: the requests before
            // have settled in the ledger first (both hosts settle after the stream, on the main
            // thread; under load a request could otherwise find the one before still reserved).
            if n > 1 {
                let settled = series_value(envoy, "sluice_budget_ledger_calls_total", &["call=\"settle\"", "result=\"ok\""], n - 1);
                assert_eq!(settled, Some(n - 1), "{host}: the settlements before request {n}");
            }
            let response = envoy.request(&scripted_request_with(&path, "llm", "x-sluice-key: k1\r\n"));
            let expected = if n <= 2 { 200 } else { 429 };
            assert_eq!(response.status, expected, "{host} request {n}: {}\n{}\n{}", response.head, String::from_utf8_lossy(&response.body), envoy.log());
            assert_eq!(upstream.heads_for(&path).len(), usize::from(n <= 2), "{host} request {n}");
            let stamp = hold_masked(&budget_stamp(envoy, &path));
            assert!(stamp.contains(r##""ledger_hold":"#""##), "{host} request {n}: the Redis ledger's hold is not named: {stamp}");
            of_host.push((seen_by_client(&response), timeless(&stamp)));
        }
        answers.push(of_host);
    }
    for (n, (native, wasm)) in answers[0].iter().zip(&answers[1]).enumerate() {
        assert_eq!(native, wasm, "request {}: native (left) and sluice.wasm (right) differ", n + 1);
    }
    assert!(answers[0][2].1.contains(r#""outcome":"refused""#), "{:?}", answers[0][2]);

    // Three reservations answered by the ledger, and the two admitted requests settled there (by
    // the configuration's callouts, on the main thread), as sluice.wasm's root settles them.
    for (host, envoy) in [("native", &native), ("wasm", &wasm)] {
        let calls = |call: &str, at_least| series_value(envoy, "sluice_budget_ledger_calls_total", &[&format!("call=\"{call}\""), "result=\"ok\""], at_least);
        assert_eq!(calls("reserve", 3), Some(3), "{host}");
        assert_eq!(calls("settle", 2), Some(2), "{host}: the settlements did not reach the ledger");
        assert_eq!(series_value(envoy, "sluice_budget_ledger_up", &[], 1), Some(1), "{host}");
    }
    let rejections = |envoy: &Envoy| -> Vec<(String, String)> {
        envoy.sluice_series(&[("sluice_budget_rejections_total", 1)]).into_iter().filter(|(k, _)| k.starts_with("sluice_budget_rejections_total{")).collect()
    };
    assert_eq!(rejections(&native), rejections(&wasm), "native (left) and sluice.wasm (right) Prometheus series differ");

    // The ledger unreachable, `on_failure: deny`: both hosts answer 503 `budget_ledger_unavailable`,
    // and the request never reaches the upstream. Twice: nothing listens on the ledger's port (the
    // callout fails later), and the ledger's cluster has no endpoint (Envoy fails the callout inline,
    // inside the call that starts it).
    drop((native, wasm));
    let closed = free_port();
    for (case, sections) in [
        ("closed", format!(r#"{{"tenant_budget": {}}}"#, budget("deny"))),
        ("no-endpoint", format!(r#"{{"tenant_budget": {}}}"#, budget("deny").replace(r#""cluster":"sluice_ledger""#, r#""cluster":"qwen_dead""#))),
    ] {
        let mut down = Vec::new();
        for (host, kind) in [("native", Host::Native), ("wasm", Host::Wasm)] {
            let envoy = start_engine_with_ledger(kind, &sections, upstream.port, closed).up();
            let path = format!("/v1/chat/completions?host={host}&ledger={case}");
            let response = envoy.request(&scripted_request_with(&path, "llm", "x-sluice-key: k1\r\n"));
            assert!(upstream.heads_for(&path).is_empty(), "{host}, {case}: the request reached the upstream with the ledger down");
            down.push((seen_by_client(&response), timeless(&hold_masked(&budget_stamp(&envoy, &path)))));
        }
        assert_eq!(down[0], down[1], "ledger down ({case}): native (left) and sluice.wasm (right) differ");
        assert_eq!(down[0].0 .0, 503, "{case}: {:?}", down[0]);
        assert!(down[0].0 .2.contains("budget_ledger_unavailable"), "{case}: {:?}", down[0]);
    }
}

/// The access log's field `key` of `path`'s line (its values have no spaces, but the last one).
fn log_field(envoy: &Envoy, path: &str, key: &str) -> String {
    let line = envoy.access_log_line(path);
    let after = line.split_once(&format!(" {key}=")).map(|(_, rest)| rest).unwrap_or_else(|| panic!("no {key} in {line}"));
    after.split(' ').next().unwrap_or_default().to_string()
}

/// A streamed chat completion request for `model` (the upstream answers with the LLM script).
fn model_request(path: &str, model: &str, extra: &str) -> String {
    let body = format!(r#"{{"model":"{model}","stream":true,"messages":[{{"role":"user","content":"Say hello."}}]}}"#);
    format!(
        "POST {path} HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n{extra}x-test-script: llm\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
}

/// The value of header `name` in a recorded request head.
fn head_value(head: &str, name: &str) -> Option<String> {
    head.lines().find_map(|l| l.split_once(':').filter(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.trim().to_string()))
}

/// A router policy of two models: `llama-3-70b` split 50/50 between v1 (the default route) and v2
/// (route `llama-v2`, another upstream model name), sticky on `x-sluice-tenant`; `qwen` on q1,
/// whose cluster has no endpoints, falling back to q2 (weight 0, route `qwen-v2`).
const ROUTER_POLICY: &str = r#"{"sticky_key":[{"header":"x-sluice-tenant"}],"route_header":"x-sluice-route","version_header":"x-model-version","models":[
  {"model":"llama-3-70b","versions":[{"name":"v1","weight":50,"upstream_model":"llama-3-70b","route":"llama-v1"},{"name":"v2","weight":50,"upstream_model":"llama-3-70b-v2","route":"llama-v2"}]},
  {"model":"qwen","versions":[{"name":"q1","weight":100,"upstream_model":"qwen","route":"qwen-dead"},{"name":"q2","weight":0,"upstream_model":"qwen-72b-v2","route":"qwen-v2"}],"fallback":["q1","q2"]}]}"#;

#[test]
fn engine_model_router_natively_routes_to_the_cluster_sluice_wasm_does() {
    let upstream = Upstream::start();
    let sections = format!(r#"{{"model_router": {ROUTER_POLICY}, "llm_metrics": {{}}}}"#);
    let native = start_engine(Host::Native, &sections, upstream.port).up();
    let wasm = start_engine(Host::Wasm, &sections, upstream.port).up();
    assert!(native.log().contains("model-router configured: 2 models"), "{}", native.log());

    // What each request became: status, the cluster Envoy chose, the route stamp, llm-metrics'
    // stamp (timings aside), and what the upstream got (route and version headers, the body's model).
    let mut seen = Vec::new();
    for (host, envoy) in [("native", &native), ("wasm", &wasm)] {
        let mut of_host = Vec::new();
        // Six tenants, each twice (sticky: the same version both times); a client's own route header
        // is removed. Then qwen: its version's cluster has no healthy upstream, and the next request
        // falls back.
        let mut requests: Vec<(String, &str, String)> = Vec::new();
        for tenant in 0..6 {
            for n in 0..2 {
                requests.push((
                    format!("/v1/chat/completions?host={host}&t={tenant}&n={n}"),
                    "llama-3-70b",
                    format!("x-sluice-tenant: tenant-{tenant}\r\nx-sluice-route: qwen-dead\r\n"),
                ));
            }
        }
        for n in 0..2 {
            requests.push((format!("/v1/chat/completions?host={host}&qwen={n}"), "qwen", String::new()));
        }
        for (path, model, extra) in &requests {
            let response = envoy.request(&model_request(path, model, extra));
            let cluster = log_field(envoy, path, "cluster");
            let route = log_field(envoy, path, "route");
            let head = upstream.heads_for(path).first().cloned().unwrap_or_default();
            let body_model = upstream.body_for(path).and_then(|b| {
                let text = String::from_utf8_lossy(&b).into_owned();
                text.split_once(r#""model":""#).and_then(|(_, rest)| rest.split_once('"')).map(|(m, _)| m.to_string())
            });
            of_host.push((
                response.status,
                cluster,
                route,
                timeless(&stamp(envoy, path)),
                head_value(&head, "x-sluice-route"),
                head_value(&head, "x-model-version"),
                body_model,
            ));
        }
        seen.push(of_host);
    }
    for (n, (native, wasm)) in seen[0].iter().zip(&seen[1]).enumerate() {
        assert_eq!(native, wasm, "request {n}: native (left) and sluice.wasm (right) differ");
    }
    let rows = &seen[0];
    // The split reaches both clusters, each tenant sticks to its version, and the route took effect:
    // v2 went to cluster llama_v2 with its upstream model, v1 to the default cluster unchanged.
    let clusters: std::collections::BTreeSet<&str> = rows[..12].iter().map(|r| r.1.as_str()).collect();
    assert_eq!(clusters, ["llama_v2", "upstream"].into_iter().collect(), "{rows:#?}");
    for pair in rows[..12].chunks(2) {
        assert_eq!((&pair[0].1, &pair[0].2), (&pair[1].1, &pair[1].2), "not sticky: {pair:#?}");
        let r = &pair[0];
        assert_eq!(r.0, 200, "{r:?}");
        if r.1 == "llama_v2" {
            assert!(r.2.contains(r#""route":"llama-v2""#) && r.2.contains(r#""version":"v2""#), "{r:?}");
            assert_eq!((r.4.as_deref(), r.5.as_deref(), r.6.as_deref()), (Some("llama-v2"), Some("v2"), Some("llama-3-70b-v2")), "{r:?}");
        } else {
            assert!(r.2.contains(r#""route":"llama-v1""#) && r.2.contains(r#""version":"v1""#), "{r:?}");
            assert_eq!((r.4.as_deref(), r.6.as_deref()), (Some("llama-v1"), Some("llama-3-70b")), "{r:?}");
        }
    }
    // qwen: the first request meets a cluster without endpoints; the next falls back to q2.
    let (dead, fallback) = (&rows[12], &rows[13]);
    assert_eq!((dead.0, dead.1.as_str()), (503, "qwen_dead"), "{dead:?}");
    assert!(dead.2.contains(r#""reason":"weighted""#) || dead.2.contains(r#""version":"q1""#), "{dead:?}");
    assert_eq!((fallback.0, fallback.1.as_str()), (200, "qwen_v2"), "{fallback:?}");
    assert!(fallback.2.contains(r#""reason":"fallback""#) && fallback.2.contains(r#""version":"q2""#), "{fallback:?}");
    assert_eq!(fallback.6.as_deref(), Some("qwen-72b-v2"), "{fallback:?}");

    // The router's metrics, as sluice.wasm's.
    let families = [("sluice_router_requests_total", 1), ("sluice_ttft_ms_count", 1)];
    assert_eq!(native.sluice_series(&families), wasm.sluice_series(&families), "native (left) and sluice.wasm (right) Prometheus series differ");
}

/// A router policy of one model on v1, every request shadowed to version `s1` (another upstream
/// model, sent to cluster `llama_v2`: the same upstream).
const SHADOW_POLICY: &str = r#"{"route_header":"x-sluice-route","version_header":"x-model-version","models":[
  {"model":"llama-3-70b","versions":[{"name":"v1","weight":100,"upstream_model":"llama-3-70b","route":"llama-v1"}],
   "shadow":{"version":{"name":"s1","upstream_model":"llama-shadow","route":"llama-shadow","cluster":"llama_v2","authority":"shadow.internal"},"fraction":1.0,"max_concurrent":8}}]}"#;

/// The `shadow comparison {…}` lines of an Envoy log, with timings and the request id masked.
fn shadow_comparisons(log: &str) -> Vec<String> {
    log.lines()
        .filter_map(|l| l.find("shadow comparison {").map(|at| &l[at..]))
        .map(|line| {
            let mut out = line.to_string();
            for key in ["\"duration_ms\":[", "\"ttft_ms\":["] {
                if let Some(from) = out.find(key).map(|at| at + key.len()) {
                    let len = out[from..].find(']').unwrap_or(0);
                    out.replace_range(from..from + len, "#");
                }
            }
            if let Some(from) = out.find("\"request_id\":\"").map(|at| at + "\"request_id\":\"".len()) {
                let len = out[from..].find('"').unwrap_or(0);
                out.replace_range(from..from + len, "#");
            }
            out
        })
        .collect()
}

#[test]
fn engine_model_router_natively_sends_shadows_and_compares_as_sluice_wasm() {
    let upstream = Upstream::start();
    let sections = format!(r#"{{"model_router": {SHADOW_POLICY}, "llm_metrics": {{}}}}"#);
    let native = start_engine(Host::Native, &sections, upstream.port).up();
    let wasm = start_engine(Host::Wasm, &sections, upstream.port).up();
    let mut seen = Vec::new();
    for (host, envoy) in [("native", &native), ("wasm", &wasm)] {
        let mut of_host = Vec::new();
        for n in 0..2 {
            let path = format!("/v1/chat/completions?host={host}&shadow={n}");
            let response = envoy.request(&model_request(&path, "llama-3-70b", ""));
            assert_eq!(response.status, 200, "{host} request {n}: {}", response.head);
            // The shadow copy leaves from the main thread (natively) or the root (wasm), after the
            // primary's request: wait for it at the upstream.
            let deadline = Instant::now() + Duration::from_secs(10);
            while upstream.heads_for(&path).len() < 2 {
                assert!(Instant::now() < deadline, "{host} request {n}: no shadow copy reached the upstream:\n{}", envoy.log());
                std::thread::sleep(Duration::from_millis(50));
            }
            let shadow = upstream.heads_for(&path).into_iter().find(|h| head_value(h, "x-sluice-shadow").is_some()).unwrap_or_default();
            of_host.push((timeless(&log_field(envoy, &path, "route")), head_value(&shadow, "host"), head_value(&shadow, "x-sluice-shadow")));
        }
        // Both sides of each comparison are in: the log line, then the metrics.
        let deadline = Instant::now() + Duration::from_secs(10);
        while shadow_comparisons(&envoy.log()).len() < 2 {
            assert!(Instant::now() < deadline, "{host}: no shadow comparisons in the log:\n{}", envoy.log());
            std::thread::sleep(Duration::from_millis(100));
        }
        of_host.push((shadow_comparisons(&envoy.log()).join("\n"), None, None));
        seen.push(of_host);
    }
    assert_eq!(seen[0], seen[1], "native (left) and sluice.wasm (right) differ");
    let rows = &seen[0];
    assert!(rows[0].0.contains(r#""shadow":"s1""#), "{rows:?}");
    assert_eq!((rows[0].1.as_deref(), rows[0].2.as_deref()), (Some("shadow.internal"), Some("1")), "{rows:?}");
    assert!(rows[2].0.contains(r#""primary":"v1""#) && rows[2].0.contains(r#""shadow":"s1""#) && rows[2].0.contains(r#""status":[200,200]"#), "{rows:?}");

    // The shadows' and the comparisons' metrics, as sluice.wasm's.
    for (host, envoy) in [("native", &native), ("wasm", &wasm)] {
        assert_eq!(series_value(envoy, "sluice_router_shadow_total", &["result=\"sent\""], 2), Some(2), "{host}");
        let compared = series_value(envoy, "sluice_router_compare_total", &["primary=\"v1\"", "shadow=\"s1\""], 2);
        assert_eq!(compared, Some(2), "{host}");
    }
    let families = [("sluice_router_shadow_total", 2), ("sluice_router_compare_total", 2), ("sluice_router_compare_similarity_per_mille_count", 2)];
    let router_series = |envoy: &Envoy| -> Vec<(String, String)> {
        envoy
            .sluice_series(&families)
            .into_iter()
            .filter(|(k, _)| k.starts_with("sluice_router_shadow_total") || k.starts_with("sluice_router_compare_"))
            .collect()
    };
    assert_eq!(router_series(&native), router_series(&wasm), "native (left) and sluice.wasm (right) Prometheus series differ");
}

#[test]
fn engine_latency_guard_natively_holds_releases_and_fires_deadlines_as_sluice_wasm() {
    let upstream = Upstream::start();
    // The upstream's first content token comes FIRST_CONTENT_MS (200 ms) after the request: within
    // `fast`'s TTFT deadline, past `slow`'s.
    let policy = r#"{"classes":[{"name":"default","priority":"standard"}],"default_class":"default","versions":[{"name":"fast","ttft_deadline_ms":2000},{"name":"slow","ttft_deadline_ms":100}]}"#;
    let sections = format!(r#"{{"latency_guard": {policy}}}{NEXT_INSTANCE}{{"llm_metrics": {{}}}}"#);
    let native = start_engine(Host::Native, &sections, upstream.port).up();
    let wasm = start_engine(Host::Wasm, &sections, upstream.port).up();
    assert!(native.log().contains("sluice latency-guard: configured (1 classes, 2 versions, 0 with a breaker)"), "{}", native.log());
    assert!(native.log().contains("sluice llm-metrics: configured"), "{}", native.log());

    let mut seen = Vec::new();
    for (host, envoy) in [("native", &native), ("wasm", &wasm)] {
        let mut of_host = Vec::new();
        for model in ["fast", "slow"] {
            let path = format!("/v1/chat/completions?host={host}&model={model}");
            let started = Instant::now();
            let response = envoy.request(&model_request(&path, model, ""));
            let took = started.elapsed();
            let body = String::from_utf8_lossy(&response.body).into_owned();
            if model == "fast" {
                // Held until the first token, then the whole stream.
                assert_eq!(response.status, 200, "{host}: {}\n{body}", response.head);
                assert!(body.contains("Hello") && body.contains("[DONE]"), "{host}: {body}");
            } else {
                // The TTFT deadline fired before the first token: the module answers 504 itself.
                assert_eq!(response.status, 504, "{host}: {}\n{body}", response.head);
                assert!(took < Duration::from_millis(FIRST_CONTENT_MS), "{host}: the 504 came after {took:?}");
            }
            let deadline = response.header("x-sluice-deadline").map(str::to_string);
            let refused_by = response.header("x-sluice-refused-by").map(str::to_string);
            let reply = if response.status == 200 { String::new() } else { body };
            of_host.push((response.status, deadline, refused_by, reply, latency_timeless(&log_field(envoy, &path, "latency")), timeless(&stamp(envoy, &path))));
        }
        seen.push(of_host);
    }
    for (n, (native, wasm)) in seen[0].iter().zip(&seen[1]).enumerate() {
        assert_eq!(native, wasm, "request {n}: native (left) and sluice.wasm (right) differ");
    }
    // The guard's stamps above came from the observer the instance behind it read the response
    // with (one scan of each event for both), as in sluice.wasm.
    assert!(native.log().contains(SHARED_OBSERVER_LINE), "{}", native.log());
    let slow = &seen[0][1];
    assert_eq!((slow.1.as_deref(), slow.2.as_deref()), (Some("ttft"), Some("latency-guard")), "{slow:?}");
    assert!(slow.4.contains(r#""version":"slow""#), "{slow:?}");

    // Histogram counts reach Prometheus at a stats flush: wait for each family's.
    let families = [
        ("sluice_latency_deadline_total", 1),
        ("sluice_ttft_ms_count", 1),
        ("sluice_request_duration_ms_count", 1),
        ("sluice_output_tokens_count", 1),
        ("sluice_input_tokens_count", 1),
        ("sluice_tpot_us_count", 1),
        ("sluice_decode_tokens_per_s_count", 1),
        ("sluice_quality_output_tokens_count", 1),
    ];
    assert_eq!(native.sluice_series(&families), wasm.sluice_series(&families), "native (left) and sluice.wasm (right) Prometheus series differ");
}

/// The JSON access log field `key` of the line whose `path` is `path` (a stamp is a string in it:
/// returned unescaped, as the section wrote it); `None` when it is `null` (no stamp).
fn json_log_field(envoy: &Envoy, path: &str, key: &str) -> Option<String> {
    let marker = format!(r#""path":"{path}""#);
    let deadline = Instant::now() + Duration::from_secs(10);
    let line = loop {
        let text = std::fs::read_to_string(envoy.dir.join("access.log")).unwrap_or_default();
        if let Some(line) = text.lines().find(|l| l.contains(&marker)) {
            break line.to_string();
        }
        assert!(Instant::now() < deadline, "no access log line for {path}; access log:\n{text}");
        std::thread::sleep(Duration::from_millis(50));
    };
    if line.contains(&format!(r#""{key}":null"#)) {
        return None;
    }
    let start = line.find(&format!(r#""{key}":""#)).unwrap_or_else(|| panic!("no {key} in {line}")) + key.len() + 4;
    let mut out = String::new();
    let mut chars = line[start..].chars();
    while let Some(c) = chars.next() {
        match c {
            '"' => return Some(out),
            '\\' => out.push(chars.next().unwrap()),
            c => out.push(c),
        }
    }
    panic!("{key} is not closed in {line}")
}

/// The stamp's string for `key` (`"version":"v1"`).
fn stamp_string(stamp: &str, key: &str) -> Option<String> {
    let at = stamp.find(&format!(r#""{key}":""#))? + key.len() + 4;
    Some(stamp[at..].split('"').next()?.to_string())
}

#[test]
fn native_full_gateway_stamps_one_streamed_request_alike_in_its_four_sections() {
    let upstream = Upstream::start();
    // The shipped file as `cargo xtask render` wrote it: the demo ports (admin 9901, listener 10000,
    // v1 18000, v2 18001, the shadow 18002) become free ones and this test's upstream, the access
    // log a file.
    let rendered = std::fs::read_to_string(root().join("envoy/rendered/native-full-gateway.yaml")).unwrap();
    let upstream_port = format!("port_value: {} ", upstream.port);
    let mut config = rendered;
    for (from, to) in [
        ("port_value: 9901 ", "port_value: 0 "),
        ("port_value: 10000 ", "port_value: 0 "),
        ("port_value: 18000 ", upstream_port.as_str()),
        ("port_value: 18001 ", upstream_port.as_str()),
        ("port_value: 18002 ", upstream_port.as_str()),
        (r#"path: "/dev/stdout""#, r#"path: "{{ACCESS_LOG}}""#),
    ] {
        assert_eq!(config.matches(from).count(), 1, "{from:?} is not in native-full-gateway.yaml once");
        config = config.replace(from, to);
    }
    let envoy = start_with(&module_dir(None), &config).up();
    for section in ["latency-guard: configured", "llm-metrics: configured"] {
        assert!(envoy.log().contains(section), "{section}:\n{}", envoy.log());
    }

    let path = "/v1/chat/completions?native-full";
    let response = envoy.request(&model_request(path, "llama-3-70b", "x-sluice-tenant: acme\r\n"));
    let body = String::from_utf8_lossy(&response.body).into_owned();
    assert_eq!(response.status, 200, "{}\n{body}", response.head);
    assert!(body.contains("Hello") && body.contains("[DONE]"), "{body}");

    let [route, latency, budget, llm] = ["route", "latency", "budget", "sluice"].map(|key| json_log_field(&envoy, path, key).unwrap_or_default());
    let stamps = format!("route {route}\nlatency {latency}\nbudget {budget}\nllm-metrics {llm}");
    // One version in the router's, the guard's and llm-metrics' stamps, and the one the upstream was sent.
    let version = stamp_string(&route, "version").unwrap_or_else(|| panic!("{stamps}"));
    assert!(version == "v1" || version == "v2", "{stamps}");
    assert_eq!(stamp_string(&latency, "version").as_deref(), Some(version.as_str()), "{stamps}");
    assert_eq!(stamp_string(&llm, "model_version").as_deref(), Some(version.as_str()), "{stamps}");
    // The primary's head: the gateway's 5 % shadow may send a copy (`x-sluice-shadow`) that arrives first.
    let heads = upstream.heads_for(path);
    let head = heads.iter().find(|h| head_value(h, "x-sluice-shadow").is_none()).cloned().unwrap_or_default();
    assert_eq!(head_value(&head, "x-model-version").as_deref(), Some(version.as_str()), "{heads:?}");
    // The tokens of the upstream's usage (12 in, 2 out) in the budget's charge and llm-metrics' record.
    for stamp in [&budget, &llm] {
        assert_eq!((stamp_number(stamp, "input_tokens"), stamp_number(stamp, "output_tokens")), (Some(12), Some(2)), "{stamps}");
    }
    assert_eq!(stamp_string(&budget, "decision").as_deref(), Some("admitted"), "{stamps}");
    assert_eq!(stamp_string(&budget, "key").as_deref(), Some("acme"), "{stamps}");
    assert_eq!(stamp_string(&latency, "outcome").as_deref(), Some("ok"), "{stamps}");
    assert_eq!(stamp_string(&llm, "outcome").as_deref(), Some("completed"), "{stamps}");
    assert!(envoy.log().contains(SHARED_OBSERVER_LINE), "{}", envoy.log());
}

/// The module's line at the first stream whose response the sluice instance reads through the
/// observer latency-guard's instance in front announced.
const SHARED_OBSERVER_LINE: &str = "the response is read once for latency-guard's instance and this one";

#[test]
fn engine_latency_guard_natively_refuses_before_the_upstream_with_the_router_behind_it() {
    let upstream = Upstream::start();
    // The guard decides at the body on the version the router (in the instance behind) picked at
    // the headers; that instance holds the headers meanwhile, so a refusal reaches the upstream in
    // no form (no budget behind to hold them otherwise, and no buffer filter).
    let guard = r#"{"classes":[{"name":"batch","priority":"sheddable"}],"default_class":"batch","versions":[{"name":"v1","in_flight":{"limit":1}}]}"#;
    let router = r#"{"route_header":"x-sluice-route","version_header":"x-model-version","models":[{"model":"llama-3-70b","versions":[{"name":"v1","weight":100,"upstream_model":"llama-3-70b","route":"llama-v1"}]}]}"#;
    let sections = format!(r#"{{"latency_guard": {guard}}}{NEXT_INSTANCE}{{"model_router": {router}, "llm_metrics": {{}}}}"#);
    let envoy = start_engine(Host::Native, &sections, upstream.port).up();

    // The first request is in flight (its first token comes after FIRST_CONTENT_MS) when the
    // second comes: past v1's limit of 1, the second is shed.
    let port = envoy.listen_port;
    let first = std::thread::spawn(move || send(port, model_request("/v1/chat/completions?first", "llama-3-70b", "").as_bytes()).map(|r| r.status));
    let deadline = Instant::now() + Duration::from_secs(5);
    while upstream.heads_for("/v1/chat/completions?first").is_empty() {
        assert!(Instant::now() < deadline, "the first request did not reach the upstream:\n{}", envoy.log());
        std::thread::sleep(Duration::from_millis(10));
    }
    let second = envoy.request(&model_request("/v1/chat/completions?second", "llama-3-70b", ""));
    assert_eq!(second.status, 503, "{}\n{}", second.head, String::from_utf8_lossy(&second.body));
    assert_eq!(second.header("x-sluice-refused-by"), Some("latency-guard"), "{}", second.head);
    assert_eq!(first.join().unwrap(), Some(200));
    assert!(upstream.heads_for("/v1/chat/completions?second").is_empty(), "the refused request reached the upstream");
    let latency = log_field(&envoy, "/v1/chat/completions?second", "latency");
    assert!(latency.contains(r#""version":"v1""#) && latency.contains(r#""outcome":"shed_in_flight""#), "{latency}");
    let admitted = log_field(&envoy, "/v1/chat/completions?first", "latency");
    assert!(admitted.contains(r#""version":"v1""#) && admitted.contains(r#""outcome":"ok""#), "{admitted}");
}

#[test]
fn engine_latency_guard_natively_opens_a_breaker_and_sheds_as_sluice_wasm() {
    let upstream = Upstream::start();
    // Every answer's first content token comes after FIRST_CONTENT_MS (200 ms), past the 50 ms
    // objective: after three samples v1's breaker opens, and a sheddable request is refused before
    // the upstream (no fallback named).
    let policy = r#"{"classes":[{"name":"batch","priority":"sheddable"}],"default_class":"batch","versions":[{"name":"v1","breaker":{"objective":{"percentile":95,"ttft_ms":50},"window_s":30,"min_samples":3,"open_for_ms":60000}}]}"#;
    let sections = format!(r#"{{"latency_guard": {policy}}}{NEXT_INSTANCE}{{"llm_metrics": {{}}}}"#);
    let native = start_engine(Host::Native, &sections, upstream.port).up();
    let wasm = start_engine(Host::Wasm, &sections, upstream.port).up();

    let rows = five_in_turn_alike(&native, &wasm, "v1", |envoy, path, response| {
        let refused_by = response.header("x-sluice-refused-by").map(str::to_string);
        let reached = !upstream.heads_for(path).is_empty();
        (response.status, refused_by, reached, latency_timeless(&log_field(envoy, path, "latency")))
    });
    let statuses: Vec<u16> = rows.iter().map(|r| r.0).collect();
    assert_eq!(statuses, [200, 200, 200, 503, 503], "{rows:?}");
    for refused in &rows[3..] {
        assert_eq!(refused.1.as_deref(), Some("latency-guard"), "{refused:?}");
        assert!(!refused.2, "a request refused with the breaker open reached the upstream: {refused:?}");
        assert!(refused.3.contains(r#""outcome":"shed_breaker_open""#), "{refused:?}");
    }
    // The two refusals' histogram samples (under version "unknown") too: a count shows at a stats flush.
    let families = [
        ("sluice_latency_breaker_transitions_total", 1),
        ("sluice_latency_shed_total", 2),
        ("sluice_ttft_ms_count", 3),
        ("sluice_request_duration_ms_count", 2),
        ("sluice_input_tokens_count", 2),
        ("sluice_output_tokens_count", 2),
    ];
    let series = native.sluice_series(&families);
    assert_eq!(series, wasm.sluice_series(&families), "native (left) and sluice.wasm (right) Prometheus series differ");
    let state = series.iter().find(|(k, _)| k.starts_with("sluice_latency_breaker_state{")).map(|(k, v)| format!("{k} {v}"));
    assert_eq!(state.as_deref(), Some("sluice_latency_breaker_state{version=\"v1\"} 1"), "{series:?}");
}

#[test]
fn engine_latency_guard_natively_fails_over_to_the_fallback_version_as_sluice_wasm() {
    let upstream = Upstream::start();
    // v1's breaker opens after three answers past its 50 ms objective; standard requests then go to
    // its fallback v2: the guard names v1 in its avoid list and model-router (behind it) takes the
    // next version of the model's fallback order.
    let guard = r#"{"classes":[{"name":"default","priority":"standard"}],"default_class":"default","versions":[{"name":"v1","breaker":{"objective":{"percentile":95,"ttft_ms":50},"window_s":30,"min_samples":3,"open_for_ms":60000,"fallback":"v2"}},{"name":"v2"}]}"#;
    let router = r#"{"route_header":"x-sluice-route","version_header":"x-model-version","models":[{"model":"llama-3-70b","versions":[{"name":"v1","weight":100,"upstream_model":"llama-3-70b","route":"llama-v1"},{"name":"v2","weight":0,"upstream_model":"llama-3-70b-v2","route":"llama-v2"}],"fallback":["v1","v2"]}]}"#;
    let sections = format!(r#"{{"latency_guard": {guard}}}{NEXT_INSTANCE}{{"model_router": {router}, "llm_metrics": {{}}}}"#);
    let native = start_engine(Host::Native, &sections, upstream.port).up();
    let wasm = start_engine(Host::Wasm, &sections, upstream.port).up();

    let rows = five_in_turn_alike(&native, &wasm, "llama-3-70b", |envoy, path, response| {
        let sent_version = upstream.heads_for(path).first().and_then(|h| head_value(h, "x-model-version"));
        (response.status, sent_version, log_field(envoy, path, "route"), latency_timeless(&log_field(envoy, path, "latency")))
    });
    for (n, row) in rows.iter().enumerate() {
        let want = if n < 3 { "v1" } else { "v2" };
        assert_eq!((row.0, row.1.as_deref()), (200, Some(want)), "request {n}: {row:?}");
        assert!(row.3.contains(&format!(r#""version":"{want}""#)), "request {n}: {row:?}");
    }
    for row in &rows[3..] {
        assert!(row.2.contains(r#""reason":"fallback""#), "{row:?}");
    }
    let families = [("sluice_latency_breaker_transitions_total", 1), ("sluice_ttft_ms_count", 3), ("sluice_request_duration_ms_count", 2)];
    assert_eq!(native.sluice_series(&families), wasm.sluice_series(&families), "native (left) and sluice.wasm (right) Prometheus series differ");
}

#[test]
fn engine_llm_metrics_natively_bounds_every_label_as_sluice_wasm() {
    let upstream = Upstream::start();
    // One configured version and two more learned from traffic; one named tenant. Clients send six
    // versions and five tenants: the rest must fold into the bounded values, alike on both hosts.
    let policy = r#"{"model_version_header":"x-model-version","model_versions":["v1"],"max_dynamic_model_versions":2,"tenant":{"header":"x-sluice-tenant"},"tenants":["acme"]}"#;
    let sections = format!(r#"{{"llm_metrics": {policy}}}"#);
    let native = start_engine(Host::Native, &sections, upstream.port).up();
    let wasm = start_engine(Host::Wasm, &sections, upstream.port).up();
    let versions = ["v1", "dyn-a", "dyn-b", "dyn-c", "dyn-d", "v1"];
    let tenants = ["acme", "mallory-1", "mallory-2", "acme", "mallory-3", "mallory-4"];
    for (host, envoy) in [("native", &native), ("wasm", &wasm)] {
        for (n, (version, tenant)) in versions.iter().zip(tenants).enumerate() {
            let path = format!("/v1/chat/completions?host={host}&n={n}");
            let response = envoy.request(&model_request(&path, "llama-3-70b", &format!("x-model-version: {version}\r\nx-sluice-tenant: {tenant}\r\n")));
            assert_eq!(response.status, 200, "{host} {n}: {}", response.head);
        }
    }
    let families = [("sluice_ttft_ms_count", 1), ("sluice_request_duration_ms_count", 1)];
    // Every request's duration sample has flushed on both hosts before comparing.
    let total = |s: &std::collections::BTreeMap<String, String>| -> u64 {
        s.iter().filter(|(k, _)| k.starts_with("sluice_request_duration_ms_count{")).map(|(_, v)| v.parse::<u64>().unwrap_or(0)).sum()
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    let (mut native_series, mut wasm_series) = (native.sluice_series(&families), wasm.sluice_series(&families));
    while total(&native_series) < 6 || total(&wasm_series) < 6 {
        assert!(Instant::now() < deadline, "not every request's sample showed: native {native_series:?}\nwasm {wasm_series:?}");
        std::thread::sleep(Duration::from_millis(200));
        native_series = native.sluice_series(&families);
        wasm_series = wasm.sluice_series(&families);
    }
    assert_eq!(native_series, wasm_series, "native (left) and sluice.wasm (right) Prometheus series differ");
    let values_of = |label: &str| -> std::collections::BTreeSet<String> {
        let marker = format!("{label}=\"");
        native_series.keys().filter_map(|k| k.split_once(&marker).and_then(|(_, rest)| rest.split('"').next()).map(str::to_string)).collect()
    };
    let versions_seen = values_of("model_version");
    let tenants_seen = values_of("tenant");
    // v1, the two learned, and what the rest fold into; acme and what the rest fold into.
    assert!(
        versions_seen.len() <= 4 && versions_seen.contains("v1") && !versions_seen.contains("dyn-c") && !versions_seen.contains("dyn-d"),
        "{versions_seen:?}"
    );
    assert!(tenants_seen.len() <= 2 && tenants_seen.contains("acme") && !tenants_seen.iter().any(|t| t.starts_with("mallory")), "{tenants_seen:?}");
}

/// Envoy's CPU time so far (user + system), µs, from `/proc/<pid>/stat` (10 ms ticks).
fn envoy_cpu_us(envoy: &Envoy) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{}/stat", envoy.child.id())).unwrap();
    let fields: Vec<&str> = stat.rsplit_once(')').unwrap().1.split_whitespace().collect();
    // utime and stime: fields 14 and 15 of stat(5), 12 and 13 after the command's `)`.
    (fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap()) * 10_000
}

/// A measurement, not a check (docs/native.md, "Callouts"): Envoy's CPU per request and the
/// client's median latency, native against sluice.wasm, with a Redis-ledger budget (a reservation
/// callout per request, a settlement per request from the tick) and with a router shadowing every
/// request. Run with `cargo test -p sluice-native --test envoy -- --ignored --nocapture measure_callouts`.
#[test]
#[ignore = "a measurement: run by hand"]
fn measure_callouts() {
    const REQUESTS: usize = 2000;
    const CLIENTS: usize = 16;
    let upstream = Upstream::start();
    let budget = r#"{"identity":{"header":"x-sluice-key"},"ledger":{"mode":"redis","cluster":"sluice_ledger","timeout_ms":2000},"orgs":[{"id":"acme","teams":[{"id":"search","keys":[{"id":"k1","budgets":[{"window":"day","requests":100000000}]}]}]}]}"#;
    let local = budget.replace(r#""ledger":{"mode":"redis","cluster":"sluice_ledger","timeout_ms":2000},"#, "");
    let unshadowed = SHADOW_POLICY.replace(r#""fraction":1.0"#, r#""fraction":0.0"#);
    let configurations = [
        ("llm-metrics alone", r#"{"llm_metrics": {}}"#.to_string(), ""),
        ("budget, local ledger", format!(r#"{{"tenant_budget": {local}}}"#), "x-sluice-key: k1\r\n"),
        ("budget, Redis ledger", format!(r#"{{"tenant_budget": {budget}}}"#), "x-sluice-key: k1\r\n"),
        ("router, shadow at fraction 0", format!(r#"{{"model_router": {unshadowed}}}"#), ""),
        ("router, every request shadowed", format!(r#"{{"model_router": {SHADOW_POLICY}}}"#), ""),
    ];
    for (name, sections, extra) in configurations {
        for (host, kind) in [("native", Host::Native), ("wasm", Host::Wasm)] {
            let ledger = LedgerService::start();
            let envoy = start_engine_with_ledger(kind, &sections, upstream.port, ledger.port).up();
            let round = |count: usize| -> Vec<Duration> {
                let next = std::sync::atomic::AtomicUsize::new(0);
                let latencies = Mutex::new(Vec::with_capacity(count));
                std::thread::scope(|scope| {
                    for _ in 0..CLIENTS {
                        scope.spawn(|| loop {
                            let n = next.fetch_add(1, Ordering::Relaxed);
                            if n >= count {
                                return;
                            }
                            let raw = model_request(&format!("/v1/chat/completions?m={n}"), "llama-3-70b", extra).replace("x-test-script: llm\r\n", "");
                            let start = Instant::now();
                            let response = envoy.request(&raw);
                            assert_eq!(response.status, 200, "{}", response.head);
                            latencies.lock().unwrap().push(start.elapsed());
                        });
                    }
                });
                latencies.into_inner().unwrap()
            };
            round(200);
            std::thread::sleep(Duration::from_secs(1));
            let before = envoy_cpu_us(&envoy);
            let mut latencies = round(REQUESTS);
            // The settlements and shadow answers after the last request, too.
            std::thread::sleep(Duration::from_secs(1));
            let cpu = envoy_cpu_us(&envoy) - before;
            latencies.sort_unstable();
            let median = latencies[latencies.len() / 2];
            eprintln!(
                "{name}, {host}: Envoy CPU {:.1} µs per request, client median {:.1} ms ({REQUESTS} requests, {CLIENTS} clients)",
                cpu as f64 / REQUESTS as f64,
                median.as_secs_f64() * 1000.0
            );
        }
    }
}

/// Sends SIGTERM to Envoy and waits (30 s at most) for it to exit; its exit status.
fn terminate(envoy: &mut Envoy) -> std::process::ExitStatus {
    let pid = envoy.child.id().to_string();
    let sent = Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    assert!(sent.success(), "kill -TERM {pid} failed");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(status) = envoy.child.try_wait().unwrap() {
            return status;
        }
        assert!(Instant::now() < deadline, "Envoy did not exit in 30 s after SIGTERM:\n{}", envoy.log());
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// What Envoy's log shows after a crash (its signal handler's lines), an abort or a panic.
const CRASH_MARKERS: [&str; 6] = ["Caught ", "Backtrace", "panicked at", "sluice-native: panic", "terminate called", "assert failure"];

#[test]
fn envoy_exits_cleanly_on_sigterm_while_the_module_threads_commit() {
    let upstream = Upstream::start();
    let rounds: usize = std::env::var("SLUICE_EXIT_ROUNDS").ok().and_then(|r| r.parse().ok()).unwrap_or(20);
    // latency-guard's tick thread (a held stream is in flight at SIGTERM), and a Redis ledger that
    // never answers with `on_failure: local`, so write-backs always wait and the settlement thread
    // commits the configuration's scheduler every SETTLE_TICK_MS until Envoy destroys it.
    let guard = r#"{"classes":[{"name":"default","priority":"standard"}],"default_class":"default","versions":[{"name":"fast","ttft_deadline_ms":2000}]}"#;
    let budget = r#"{"identity":{"header":"x-sluice-key"},"ledger":{"mode":"redis","cluster":"sluice_ledger","timeout_ms":200,"on_failure":"local"},"orgs":[{"id":"acme","teams":[{"id":"search","keys":[{"id":"k1","budgets":[{"window":"day","requests":100000}]}]}]}]}"#;
    let sections = format!(r#"{{"latency_guard": {guard}}}{NEXT_INSTANCE}{{"tenant_budget": {budget}, "llm_metrics": {{}}}}"#);
    let closed = free_port();
    for round in 0..rounds {
        let mut envoy = start_engine_with_ledger(Host::Native, &sections, upstream.port, closed).up();
        for n in 0..3 {
            let path = format!("/v1/chat/completions?exit={round}&n={n}");
            let response = envoy.request(&model_request(&path, "fast", "x-sluice-key: k1\r\n"));
            assert_eq!(response.status, 200, "round {round}: {}\n{}", response.head, envoy.log());
        }
        // One more, held by the guard until its first token when SIGTERM comes.
        let held = format!("/v1/chat/completions?exit={round}&held");
        let port = envoy.listen_port;
        let request = model_request(&held, "fast", "x-sluice-key: k1\r\n");
        let in_flight = std::thread::spawn(move || send(port, request.as_bytes()).map(|r| r.status));
        let deadline = Instant::now() + Duration::from_secs(5);
        while upstream.heads_for(&held).is_empty() {
            assert!(Instant::now() < deadline, "round {round}: the held request did not reach the upstream:\n{}", envoy.log());
            std::thread::sleep(Duration::from_millis(5));
        }
        let status = terminate(&mut envoy);
        let log = envoy.log();
        let _ = in_flight.join();
        assert!(status.success(), "round {round}: Envoy exited with {status} after SIGTERM:\n{log}");
        for marker in CRASH_MARKERS {
            assert!(!log.contains(marker), "round {round}: {marker:?} in Envoy's log after SIGTERM:\n{log}");
        }
    }
}

#[test]
fn a_held_request_continued_into_a_router_reply_reaches_the_filter_after_its_hook() {
    // The ledger never answers (`on_failure: local`): the callout's failure comes to the done hook,
    // the budget admits locally and the request goes on, to a cluster without endpoints, whose
    // router answers 503 at once. Envoy runs that reply through the filter's response hooks inside
    // `continue_decoding`; the module makes that call after the done hook has returned, so they
    // reach the filter (llm-metrics stamps the 503) rather than find it borrowed.
    let upstream = Upstream::start();
    let budget = r#"{"identity":{"header":"x-sluice-key"},"ledger":{"mode":"redis","cluster":"sluice_ledger","timeout_ms":500,"on_failure":"local"},"orgs":[{"id":"acme","teams":[{"id":"search","keys":[{"id":"k1","budgets":[{"window":"day","requests":100}]}]}]}]}"#;
    let sections = format!(r#"{{"tenant_budget": {budget}, "llm_metrics": {{}}}}"#);
    let envoy = start_engine_with_ledger(Host::Native, &sections, upstream.port, free_port()).up();
    let path = "/v1/chat/completions?reentry";
    let response = envoy.request(&scripted_request_with(path, "llm", "x-sluice-key: k1\r\nx-sluice-route: qwen-dead\r\n"));
    assert_eq!(response.status, 503, "{}\n{}", response.head, envoy.log());
    assert_eq!(log_field(&envoy, path, "details"), "no_healthy_upstream");
    let llm = stamp(&envoy, path);
    assert!(llm.contains(r#""status":503"#), "llm-metrics did not see the router's reply: {llm}");
    let log = envoy.log();
    assert!(log.contains("the Redis ledger is failing"), "the request did not wait for the ledger:\n{log}");
    assert!(!log.contains("while another hook of the stream ran"), "{log}");
    for marker in CRASH_MARKERS {
        assert!(!log.contains(marker), "{marker:?} in Envoy's log:\n{log}");
    }
}

/// `sluice-body-metadata` (in front of the native router here, as in native-full-gateway.yaml) lifts
/// the body's model when it can read it, and otherwise lets the request go on unchanged and
/// unrouted: a `content-encoding`, a body that is not JSON, a `model` that is not a string.
#[test]
fn engine_body_metadata_lift_passes_what_it_cannot_read_unchanged() {
    let upstream = Upstream::start();
    let sections = format!(r#"{{"model_router": {ROUTER_POLICY}, "llm_metrics": {{}}}}"#);
    let native = start_engine(Host::Native, &sections, upstream.port).up();
    let raw = |path: &str, extra: &str, body: &str| {
        format!(
            "POST {path} HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n{extra}x-test-script: llm\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        )
    };
    let readable = r#"{"model":"llama-3-70b","stream":true,"messages":[{"role":"user","content":"Say hello."}]}"#;
    // Read: routed by the body's model (the route stamp names it).
    let routed = "/v1/chat/completions?lift=read";
    native.request(&raw(routed, "x-sluice-tenant: tenant-1\r\n", readable));
    assert!(log_field(&native, routed, "route").contains(r#""model":"llama-3-70b""#), "{}", native.access_log_line(routed));
    assert_ne!(log_field(&native, routed, "cluster"), "upstream");
    assert_eq!(log_field(&native, routed, "lifted"), "llama-3-70b", "the dynamic metadata the lift wrote");
    for (case, extra, body) in [
        ("encoded", "content-encoding: gzip\r\n", readable),
        ("not-json", "", r#"{"model":"llama-3-70b","stream":tr"#),
        ("number-model", "", r#"{"model":70,"stream":true,"messages":[]}"#),
    ] {
        let path = format!("/v1/chat/completions?lift={case}");
        native.request(&raw(&path, &format!("{extra}x-sluice-tenant: tenant-1\r\n"), body));
        assert_eq!(log_field(&native, &path, "route"), "-", "{case}: {}", native.access_log_line(&path));
        assert_eq!(log_field(&native, &path, "lifted"), "-", "{case}: nothing lifted");
        assert_eq!(log_field(&native, &path, "cluster"), "upstream", "{case}: the route table's default");
        assert_eq!(upstream.body_for(&path).as_deref(), Some(body.as_bytes()), "{case}: the body reaches the upstream as sent");
    }
    // A path that is no LLM API: the readable body is not looked at, nothing lifted, the body
    // reaches the upstream as sent.
    let other = "/v1/embeddings?lift=not-an-llm-path";
    native.request(&raw(other, "x-sluice-tenant: tenant-1\r\n", readable));
    assert_eq!(log_field(&native, other, "lifted"), "-", "{}", native.access_log_line(other));
    assert_eq!(log_field(&native, other, "cluster"), "upstream");
    assert_eq!(upstream.body_for(other).as_deref(), Some(readable.as_bytes()));
}

/// A request body over Envoy's default 1 MiB buffer limit: natively every filter of the module
/// that holds the body raises the stream's limit to 9 MiB (what the wasm gateways' `buffer` filter
/// allows), so tenant-budget reads a 2 MB and a 5 MB body as sluice.wasm does behind that filter,
/// and the lift reads one where `json_to_metadata` in front of sluice.wasm leaves Envoy to answer
/// 413 (its decodeHeaders holds the request before the `buffer` filter could raise the limit).
#[test]
fn engine_holds_bodies_over_a_mebibyte_as_the_wasm_gateways_buffer_filter_allows() {
    let upstream = Upstream::start();
    let budget = r#"{"identity":{"header":"x-sluice-key"},"orgs":[{"id":"acme","teams":[{"id":"search","keys":[{"id":"k1","budgets":[{"window":"day","tokens":100000000}]}]}]}]}"#;
    let request = |path: &str, size: usize| {
        let body = format!(r#"{{"model":"llama-3-70b","stream":true,"messages":[{{"role":"user","content":"{}"}}]}}"#, "a ".repeat(size / 2));
        format!(
            "POST {path} HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\nx-sluice-tenant: tenant-1\r\nx-sluice-key: k1\r\nx-test-script: llm\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        )
    };
    let budget_sections = format!(r#"{{"tenant_budget": {budget}, "llm_metrics": {{}}}}"#);
    for host in [Host::Native, Host::Wasm] {
        let envoy = start_engine(host, &budget_sections, upstream.port).up();
        for size in [2_000_000usize, 5_000_000] {
            let path = format!("/v1/chat/completions?budget-body={size}&host={host:?}");
            let response = envoy.request(&request(&path, size));
            assert_eq!(response.status, 200, "{host:?}, {size} bytes: {}", envoy.access_log_line(&path));
            assert!(log_field(&envoy, &path, "budget").contains(r#""decision":"admitted""#), "{host:?}: {}", envoy.access_log_line(&path));
            // The whole body reached the upstream (the budget adds its usage request to it).
            assert!(upstream.body_for(&path).is_some_and(|b| b.len() > size), "{host:?}, {size} bytes");
        }
    }
    let router_sections = format!(r#"{{"model_router": {ROUTER_POLICY}, "llm_metrics": {{}}}}"#);
    let native = start_engine(Host::Native, &router_sections, upstream.port).up();
    let path = "/v1/chat/completions?lift-body=2000000";
    assert_eq!(native.request(&request(path, 2_000_000)).status, 200, "{}", native.access_log_line(path));
    assert_eq!(log_field(&native, path, "lifted"), "llama-3-70b");
    assert_ne!(log_field(&native, path, "cluster"), "upstream", "routed by the body's model");
}
