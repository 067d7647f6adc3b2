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
        let mut server = MockServer {
            child,
            addr: SocketAddr::from(([127, 0, 0, 1], 0)),
        };
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
}

impl Drop for MockServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
