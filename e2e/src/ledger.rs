//! The fleet ledger service (`sluice-ledger`, docs/ledger.md) as a child process on a free loopback
//! port, in front of a [`crate::redis::Redis`]: started, killed with SIGKILL (what a crash does) and
//! restarted on the same port, so Envoy's `sluice_ledger` cluster finds it again. Killed on drop.

use crate::envoy::{free_port, tail};
use crate::http;
use crate::process::Process;
use crate::tools::ledger_bin;
use anyhow::{anyhow, bail, Context, Result};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

/// The Redis key prefix the tests run the service with (its default).
pub const PREFIX: &str = "sluice";

/// A running `sluice-ledger`.
pub struct LedgerService {
    process: Process,
    bin: PathBuf,
    port: u16,
    redis_url: String,
    threads: usize,
    stderr_path: PathBuf,
}

impl LedgerService {
    /// Starts the service on a free port against `redis_url` with `threads` worker threads, and
    /// waits until `GET /healthz` answers 200 (Redis reachable).
    pub fn start(redis_url: &str, threads: usize) -> Result<LedgerService> {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let stderr_path = std::env::temp_dir().join(format!("sluice-ledger-{}-{}.stderr", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed)));
        let mut ledger = LedgerService {
            process: Process::new("sluice-ledger"),
            bin: ledger_bin()?,
            port: free_port()?,
            redis_url: redis_url.to_string(),
            threads,
            stderr_path,
        };
        ledger.spawn()?;
        ledger.wait_healthy(Duration::from_secs(10))?;
        Ok(ledger)
    }

    fn spawn(&mut self) -> Result<()> {
        let stderr = std::fs::OpenOptions::new().create(true).append(true).open(&self.stderr_path)?;
        let child = Command::new(&self.bin)
            .args(["--listen", &format!("127.0.0.1:{}", self.port)])
            .args(["--redis", &self.redis_url, "--prefix", PREFIX, "--redis-timeout-ms", "200"])
            .args(["--threads", &self.threads.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .with_context(|| format!("starting {}", self.bin.display()))?;
        self.process.run(child);
        Ok(())
    }

    /// Waits until `GET /healthz` answers 200.
    pub fn wait_healthy(&mut self, timeout: Duration) -> Result<()> {
        let (addr, stderr) = (self.addr(), self.stderr_path.clone());
        let healthy = || http::get(addr, "/healthz").is_ok_and(|r| r.status == 200);
        self.process.wait_ready(timeout, "healthy", healthy, || format!("stderr:\n{}", tail(&stderr, 20)))
    }

    /// SIGKILL: the process dies at once, in-flight calls and all.
    pub fn kill(&mut self) {
        self.process.kill();
    }

    /// Starts the service again on the same port (after [`LedgerService::kill`]) and waits until
    /// it is healthy.
    pub fn restart(&mut self) -> Result<()> {
        self.kill();
        self.spawn()?;
        self.wait_healthy(Duration::from_secs(10))
    }

    /// SIGSTOP: the process stays, its sockets stay open, nothing is answered — a stalled service
    /// (until [`LedgerService::resume`]).
    pub fn pause(&self) -> Result<()> {
        self.process.signal("-STOP")
    }

    /// SIGCONT after [`LedgerService::pause`].
    pub fn resume(&self) -> Result<()> {
        self.process.signal("-CONT")
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// The status of `GET /healthz`.
    pub fn healthz(&self) -> Result<u16> {
        Ok(http::get(self.addr(), "/healthz")?.status)
    }

    /// `GET /metrics` (Prometheus text).
    pub fn metrics(&self) -> Result<String> {
        let r = http::get(self.addr(), "/metrics")?;
        if r.status != 200 {
            bail!("/metrics: status {}", r.status);
        }
        Ok(r.text())
    }

    /// `POST path` with a JSON body straight to the service (not through Envoy); the answer's
    /// status and JSON.
    pub fn post(&self, path: &str, body: &serde_json::Value) -> Result<(u16, serde_json::Value)> {
        let r = http::post_json(self.addr(), path, &[], &body.to_string())?;
        let v = r.json().map_err(|e| anyhow!("{path}: {e:#}"))?;
        Ok((r.status, v))
    }

    /// The last `n` lines the service wrote to stderr.
    pub fn stderr_tail(&self, n: usize) -> String {
        tail(&self.stderr_path, n)
    }
}

impl Drop for LedgerService {
    fn drop(&mut self) {
        self.kill();
        if !std::thread::panicking() && std::env::var_os("SLUICE_E2E_KEEP").is_none() {
            let _ = std::fs::remove_file(&self.stderr_path);
        }
    }
}
