//! The mock model server as a child process on a free loopback port.

use crate::http;
use crate::tools::mock_bin;
use anyhow::{anyhow, bail, Context, Result};
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// A running `sluice-mock-server`, killed on drop.
pub struct MockServer {
    child: Child,
    addr: SocketAddr,
}

impl MockServer {
    /// Starts the mock on `127.0.0.1:0` with extra CLI `args` (e.g. `["--ttft-ms", "100"]`) and
    /// waits for its `listening on ADDR` line.
    pub fn start(args: &[&str]) -> Result<MockServer> {
        let bin = mock_bin()?;
        let mut child = Command::new(&bin)
            .args(["--listen", "127.0.0.1:0"])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let stdout = child.stdout.take().ok_or_else(|| anyhow!("no stdout pipe"))?;
        // Read on a thread so a mock that never prints cannot hang the test; the thread then
        // keeps draining stdout so the mock never blocks on a full pipe.
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            let _ = tx.send(lines.next());
            for _ in lines {}
        });
        let mut server = MockServer { child, addr: SocketAddr::from(([127, 0, 0, 1], 0)) };
        let line = match rx.recv_timeout(Duration::from_secs(10)) {
            Ok(Some(Ok(line))) => line,
            Ok(_) => bail!("mock server exited before listening: {:?}", server.child.try_wait()),
            Err(_) => bail!("mock server did not report its address within 10 s"),
        };
        server.addr = line
            .trim()
            .strip_prefix("listening on ")
            .and_then(|a| a.parse().ok())
            .ok_or_else(|| anyhow!("unexpected first line from mock server: {line:?}"))?;
        Ok(server)
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// The mock's own counters: `{requests, tokens_sent, by_path, connections}`.
    pub fn stats(&self) -> Result<serde_json::Value> {
        http::get(self.addr, "/mock/stats")?.json()
    }

    /// The mock's per-request ledger (`GET /mock/requests`), oldest first: the last 100,000
    /// inference requests, each written when its answer ended.
    pub fn requests(&self) -> Result<Vec<MockRequest>> {
        let v = http::get(self.addr, "/mock/requests")?.json()?;
        let items = v.as_array().ok_or_else(|| anyhow!("/mock/requests is not an array: {v}"))?;
        items.iter().map(MockRequest::from_json).collect()
    }

    /// Every request head the mock read (`GET /mock/heads`), oldest first, whether or not a body
    /// followed: what proves that a request reached the upstream not even as headers.
    pub fn heads(&self) -> Result<Vec<MockHead>> {
        let v = http::get(self.addr, "/mock/heads")?.json()?;
        let items = v.as_array().ok_or_else(|| anyhow!("/mock/heads is not an array: {v}"))?;
        items.iter().map(MockHead::from_json).collect()
    }

    /// Connections the mock accepted since start or reset (`GET /mock/connections`), the
    /// connections made to read it included.
    pub fn connections_accepted(&self) -> Result<u64> {
        let v = http::get(self.addr, "/mock/connections")?.json()?;
        v.get("accepted").and_then(serde_json::Value::as_u64).ok_or_else(|| anyhow!("no accepted in {v}"))
    }

    /// `GET /mock/connections`: `{"accepted", "open", "connections": [{"id", "peer", "opened_ms",
    /// "heads", "closed", "refused"}]}`.
    pub fn connections(&self) -> Result<serde_json::Value> {
        http::get(self.addr, "/mock/connections")?.json()
    }

    /// `POST /mock/reset`: zeroes the counters and clears the ledger and the traffic logs.
    pub fn reset(&self) -> Result<()> {
        let r = http::post_json(self.addr, "/mock/reset", &[], "")?;
        if r.status != 200 {
            bail!("/mock/reset: status {}", r.status);
        }
        Ok(())
    }
}

/// One record of the mock's ledger (see examples/mock-server/README.md): what the upstream was
/// asked and what it actually produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MockRequest {
    /// The `x-request-id` header as the mock received it.
    pub request_id: String,
    pub path: String,
    pub stream: bool,
    /// The request's output limit as the mock received it (after any rewrite by a filter).
    pub max_tokens: Option<u64>,
    /// The body's `model` as the mock received it.
    pub model: Option<String>,
    pub prompt_tokens: u64,
    /// What the usage reported, or would have reported for the whole answer.
    pub completion_tokens: u64,
    /// Content tokens whose write to the socket succeeded.
    pub tokens_flushed: u64,
    pub usage_reported: bool,
    pub completed: bool,
    /// `bad_request`, `status:N`, `reset`, `error_event` or `client_gone`.
    pub failure: Option<String>,
}

impl MockRequest {
    pub fn from_json(v: &serde_json::Value) -> Result<MockRequest> {
        let num = |k: &str| v.get(k).and_then(serde_json::Value::as_u64).ok_or_else(|| anyhow!("no {k} in {v}"));
        let flag = |k: &str| v.get(k).and_then(serde_json::Value::as_bool).ok_or_else(|| anyhow!("no {k} in {v}"));
        let text = |k: &str| v.get(k).and_then(serde_json::Value::as_str).map(str::to_string);
        Ok(MockRequest {
            request_id: text("request_id").ok_or_else(|| anyhow!("no request_id in {v}"))?,
            path: text("path").unwrap_or_default(),
            stream: flag("stream")?,
            max_tokens: v.get("max_tokens").and_then(serde_json::Value::as_u64),
            model: v.get("model").and_then(serde_json::Value::as_str).map(str::to_string),
            prompt_tokens: num("prompt_tokens")?,
            completion_tokens: num("completion_tokens")?,
            tokens_flushed: num("tokens_flushed")?,
            usage_reported: flag("usage_reported")?,
            completed: flag("completed")?,
            failure: text("failure"),
        })
    }
}

/// One request head the mock read (`GET /mock/heads`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MockHead {
    pub seq: u64,
    /// The mock's id of the connection it came on.
    pub connection: u64,
    pub method: String,
    pub path: String,
    /// The `x-request-id` header.
    pub request_id: Option<String>,
    pub at_ms: u64,
    /// `none`, `receiving`, `complete`, `incomplete`, `bad`.
    pub body: String,
    /// Every header line the mock read, names lower-cased, values trimmed, in order, duplicates kept.
    pub headers: Vec<(String, String)>,
}

impl MockHead {
    pub fn from_json(v: &serde_json::Value) -> Result<MockHead> {
        let num = |k: &str| v.get(k).and_then(serde_json::Value::as_u64).ok_or_else(|| anyhow!("no {k} in {v}"));
        let text = |k: &str| v.get(k).and_then(serde_json::Value::as_str).map(str::to_string);
        Ok(MockHead {
            seq: num("seq")?,
            connection: num("connection")?,
            method: text("method").unwrap_or_default(),
            path: text("path").unwrap_or_default(),
            request_id: text("request_id"),
            at_ms: num("at_ms")?,
            body: text("body").unwrap_or_default(),
            headers: v
                .get("headers")
                .and_then(serde_json::Value::as_array)
                .map(|pairs| pairs.iter().filter_map(|p| Some((p.get(0)?.as_str()?.to_string(), p.get(1)?.as_str()?.to_string()))).collect())
                .unwrap_or_default(),
        })
    }

    /// Every value of header `name` (lower-case) in this head, in order.
    pub fn values(&self, name: &str) -> Vec<&str> {
        self.headers.iter().filter(|(n, _)| n == name).map(|(_, v)| v.as_str()).collect()
    }
}

impl Drop for MockServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
