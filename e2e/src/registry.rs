//! A real OCI registry as a child process: Debian's `docker-registry` (the CNCF distribution
//! registry) on a free loopback port, storing in its own temporary directory, killed (and the
//! directory removed) on drop; and `skopeo`, Debian's, to push and pull images through it.

use crate::envoy::{free_port, tail};
use crate::http;
use crate::process::Process;
use crate::tools::debian_binary;
use anyhow::{anyhow, bail, Context, Result};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

/// A running registry.
pub struct Registry {
    process: Process,
    dir: PathBuf,
    port: u16,
}

impl Registry {
    /// Starts `docker-registry serve` on a free port and waits until `GET /v2/` answers 200.
    pub fn start() -> Result<Registry> {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let bin = debian_binary("docker-registry", "SLUICE_REGISTRY", "docker-registry")?;
        let dir = std::env::temp_dir().join(format!("sluice-registry-{}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed)));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("storage"))?;
        let port = free_port()?;
        let config = format!(
            "version: 0.1\nlog:\n  level: warn\n  accesslog:\n    disabled: true\nstorage:\n  filesystem:\n    rootdirectory: {}\nhttp:\n  addr: 127.0.0.1:{port}\n",
            dir.join("storage").display()
        );
        std::fs::write(dir.join("config.yml"), config)?;
        let log = std::fs::File::create(dir.join("registry.log"))?;
        let child = Command::new(&bin)
            .arg("serve")
            .arg(dir.join("config.yml"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let mut registry = Registry { process: Process::new("docker-registry"), dir, port };
        registry.process.run(child);
        let addr = registry.addr();
        let log_path = registry.dir.join("registry.log");
        registry.process.wait_ready(
            Duration::from_secs(10),
            "answering /v2/",
            || http::get(addr, "/v2/").map(|r| r.status == 200).unwrap_or(false),
            || tail(&log_path, 20),
        )?;
        Ok(registry)
    }

    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// `127.0.0.1:<port>`, as an image reference starts.
    pub fn host(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// `GET path` with `accept`: the response (status, headers, body).
    pub fn get(&self, path: &str, accept: &str) -> Result<http::Response> {
        Ok(http::Connection::connect(self.addr())?.send("GET", path, &[("accept", accept)], b"")?.collect()?.into_response())
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        self.process.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Runs `skopeo` with `args` (plain-HTTP registries on loopback need `--tls-verify=false` or
/// `--dest-tls-verify=false`); its standard output, or an error with its standard error.
pub fn skopeo(args: &[&str]) -> Result<Vec<u8>> {
    let bin = debian_binary("skopeo", "SLUICE_SKOPEO", "skopeo")?;
    let out = Command::new(&bin).args(args).stdin(Stdio::null()).output().with_context(|| format!("running {}", bin.display()))?;
    if !out.status.success() {
        bail!("skopeo {} failed ({}): {}", args.join(" "), out.status, String::from_utf8_lossy(&out.stderr));
    }
    Ok(out.stdout)
}

/// A blob of an OCI image layout directory, by digest (`sha256:<hex>`).
pub fn layout_blob(layout: &Path, digest: &str) -> Result<Vec<u8>> {
    let hex = digest.strip_prefix("sha256:").ok_or_else(|| anyhow!("digest {digest} is not sha256"))?;
    let path = layout.join("blobs/sha256").join(hex);
    std::fs::read(&path).with_context(|| format!("reading {}", path.display()))
}
