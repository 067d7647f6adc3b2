//! A real Prometheus server as a child process (Debian's `prometheus`, which `cargo xtask setup`
//! installs): scrapes one target on loopback, loads rule files, keeps its TSDB in a temporary
//! directory, and is killed on drop. Its HTTP API is read with the crate's own client.
//! (Not to be confused with [`crate::prometheus`], the parser of Envoy's `/stats/prometheus` text.)

use crate::envoy::{free_port, tail};
use crate::http;
use crate::process::Process;
use anyhow::{anyhow, bail, Context, Result};
use serde_json::Value;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

/// How long Prometheus may take to answer `/-/ready`.
const READY_TIMEOUT: Duration = Duration::from_secs(20);

/// Finds `prometheus`: `$SLUICE_PROMETHEUS`, else the `PATH`, else `/usr/bin` (Debian's package).
pub fn prometheus_bin() -> Result<PathBuf> {
    find_tool("prometheus", "SLUICE_PROMETHEUS")
}

/// Finds `promtool` (shipped with Prometheus): `$SLUICE_PROMTOOL`, else next to the `prometheus`
/// that [`prometheus_bin`] finds, else the `PATH`, else `/usr/bin`.
pub fn promtool_bin() -> Result<PathBuf> {
    if std::env::var_os("SLUICE_PROMTOOL").is_none() {
        if let Some(beside) = prometheus_bin().ok().and_then(|p| Some(p.parent()?.join("promtool"))).filter(|p| p.is_file()) {
            return Ok(beside);
        }
    }
    find_tool("promtool", "SLUICE_PROMTOOL")
}

fn find_tool(name: &str, env: &str) -> Result<PathBuf> {
    crate::tools::debian_binary(name, env, "prometheus")
}

/// What to scrape and which rules to load.
#[derive(Debug, Clone)]
pub struct ScrapeConfig {
    /// `host:port` of the target.
    pub target: SocketAddr,
    pub metrics_path: String,
    /// Scrape and rule-evaluation interval, whole seconds.
    pub interval_s: u32,
    pub rule_files: Vec<PathBuf>,
}

/// A running Prometheus, killed (and its directory removed) on drop; the directory is kept when the
/// test panics or `SLUICE_E2E_KEEP` is set.
pub struct PrometheusServer {
    process: Process,
    dir: PathBuf,
    port: u16,
}

impl PrometheusServer {
    /// Writes `prometheus.yml` for `config` into a new temporary directory, starts Prometheus on a
    /// free loopback port with its TSDB there, and waits for `/-/ready`.
    pub fn start(config: &ScrapeConfig) -> Result<PrometheusServer> {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let bin = prometheus_bin()?;
        let dir = std::env::temp_dir().join(format!("sluice-prometheus-{}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed)));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("data")).with_context(|| format!("creating {}", dir.display()))?;
        let mut server = PrometheusServer { process: Process::new("prometheus"), dir, port: free_port()? };
        let config_path = server.dir.join("prometheus.yml");
        std::fs::write(&config_path, config_yaml(config)).with_context(|| format!("writing {}", config_path.display()))?;
        let log = std::fs::File::create(server.log_path())?;
        let child = Command::new(&bin)
            .arg(format!("--config.file={}", config_path.display()))
            .arg(format!("--storage.tsdb.path={}", server.dir.join("data").display()))
            .arg(format!("--web.listen-address=127.0.0.1:{}", server.port))
            .arg("--log.level=warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        server.process.run(child);
        let addr = server.addr();
        let log_path = server.log_path();
        server.process.wait_ready(
            READY_TIMEOUT,
            "ready",
            || http::get(addr, "/-/ready").is_ok_and(|r| r.status == 200),
            || format!("log ({}):\n{}", log_path.display(), tail(&log_path, 30)),
        )?;
        Ok(server)
    }

    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    fn log_path(&self) -> PathBuf {
        self.dir.join("prometheus.log")
    }

    /// The last lines Prometheus logged.
    pub fn log_tail(&self, n: usize) -> String {
        tail(&self.log_path(), n)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// `GET path` on the HTTP API: the `data` member of a `"status": "success"` answer.
    pub fn api(&self, path: &str) -> Result<Value> {
        let r = http::get(self.addr(), path)?;
        let body: Value = serde_json::from_slice(&r.body).with_context(|| format!("{path}: status {}: {}", r.status, r.text()))?;
        if r.status != 200 || at(&body, "/status") != "success" {
            bail!("{path}: status {}: {body}", r.status);
        }
        Ok(at(&body, "/data").clone())
    }

    /// An instant query: the `result` vector as `(labels, value)` pairs (a scalar result is one
    /// pair without labels).
    pub fn query(&self, expr: &str) -> Result<Vec<(serde_json::Map<String, Value>, f64)>> {
        let data = self.api(&format!("/api/v1/query?query={}", url_encode(expr)))?;
        if at(&data, "/resultType") == "scalar" {
            let value = at(&data, "/result/1").as_str().and_then(|v| v.parse::<f64>().ok()).ok_or_else(|| anyhow!("{expr}: bad scalar {data}"))?;
            return Ok(vec![(serde_json::Map::new(), value)]);
        }
        let result = at(&data, "/result").as_array().ok_or_else(|| anyhow!("{expr}: no result vector: {data}"))?;
        result
            .iter()
            .map(|s| {
                let labels = at(s, "/metric").as_object().cloned().unwrap_or_default();
                let value = at(s, "/value/1").as_str().and_then(|v| v.parse::<f64>().ok()).ok_or_else(|| anyhow!("{expr}: bad sample {s}"))?;
                Ok((labels, value))
            })
            .collect()
    }

    /// `/api/v1/series` for one selector: the label sets of the matching series.
    pub fn series(&self, selector: &str) -> Result<Vec<serde_json::Map<String, Value>>> {
        let data = self.api(&format!("/api/v1/series?match[]={}", url_encode(selector)))?;
        Ok(data.as_array().map(|a| a.iter().filter_map(|s| s.as_object().cloned()).collect()).unwrap_or_default())
    }
}

impl Drop for PrometheusServer {
    fn drop(&mut self) {
        self.process.kill();
        if std::thread::panicking() || std::env::var_os("SLUICE_E2E_KEEP").is_some() {
            eprintln!("Prometheus files kept in {}", self.dir.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// Prometheus' configuration: one job, one static target; the scrape timeout equals the interval
/// (it may not exceed it, and the default of 10 s would).
fn config_yaml(c: &ScrapeConfig) -> String {
    let rules: String = c.rule_files.iter().map(|f| format!("  - '{}'\n", f.display())).collect();
    format!(
        "global:\n  scrape_interval: {i}s\n  scrape_timeout: {i}s\n  evaluation_interval: {i}s\nrule_files:\n{rules}scrape_configs:\n  - job_name: sluice-envoy\n    metrics_path: '{path}'\n    static_configs:\n      - targets: ['{target}']\n",
        i = c.interval_s,
        path = c.metrics_path,
        target = c.target,
    )
}

/// The member at JSON pointer `path`, `null` when absent.
fn at<'a>(v: &'a Value, path: &str) -> &'a Value {
    v.pointer(path).unwrap_or(&Value::Null)
}

/// Percent-encodes everything but RFC 3986's unreserved characters, for a query-string value.
pub fn url_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}
