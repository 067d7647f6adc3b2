//! A real Envoy as a child process: renders a bootstrap template (`{{NAME}}` placeholders), runs
//! Envoy on it with its own scratch directory, waits until the admin endpoint reports `LIVE`,
//! and kills it on drop. Envoy's stderr goes to a file whose tail is attached to every error, so a
//! rejected config explains itself in the test output.

use crate::access_log::AccessLog;
use crate::http;
use crate::prometheus::Metrics;
use crate::tools::{wasm_dir, Tools};
use anyhow::{anyhow, bail, Context, Result};
use std::collections::HashSet;
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long Envoy may take to become ready (wasm compilation included).
const READY_TIMEOUT: Duration = Duration::from_secs(20);

/// A loopback port that was free a moment ago. Ports handed out are remembered so parallel tests
/// in one process never get the same one; another process can still race for it, which
/// [`Envoy::start`] handles by retrying with new ports.
pub fn free_port() -> Result<u16> {
    static GIVEN: Mutex<Option<HashSet<u16>>> = Mutex::new(None);
    for _ in 0..100 {
        let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
        if given.get_or_insert_with(HashSet::new).insert(port) {
            return Ok(port);
        }
    }
    bail!("could not find a free port")
}

/// Replaces every `{{NAME}}` in `template` with its value from `vars` (names given with or
/// without the braces), in one pass: a value is never scanned for placeholders. A placeholder left
/// over is an error that names it. The same rules as `cargo xtask render` (`sluice_envoy_render`).
pub fn render_config(template: &str, vars: &[(&str, &str)]) -> Result<String> {
    let vars: Vec<(&str, &str)> = vars.iter().map(|(n, v)| (placeholder_name(n), *v)).collect();
    sluice_envoy_render::render_template(template, &vars, &[]).map_err(|e| anyhow!("{e}"))
}

/// `NAME` from `NAME` or `{{NAME}}`.
fn placeholder_name(name: &str) -> &str {
    name.trim_start_matches("{{").trim_end_matches("}}")
}

/// A running Envoy. Dropping it kills Envoy and deletes its scratch directory — unless the test
/// is panicking or `SLUICE_E2E_KEEP` is set, in which case the directory (config, stderr, access
/// log) is kept and its path printed.
pub struct Envoy {
    child: Child,
    dir: PathBuf,
    admin_port: u16,
    listen_port: u16,
    config_path: PathBuf,
    stderr_path: PathBuf,
    access_log: PathBuf,
}

impl Envoy {
    /// Starts Envoy on `config` — a path to a YAML template, or the YAML itself (anything with a
    /// newline is taken as YAML). Placeholders: `{{ADMIN_PORT}}` and `{{LISTEN_PORT}}` (free ports
    /// unless given), `{{WASM_DIR}}` (the workspace's wasm build dir unless given), `{{ACCESS_LOG}}`
    /// (a file in Envoy's scratch dir unless given), plus whatever `substitutions` provide, e.g.
    /// `("UPSTREAM_PORT", "18000")`.
    ///
    /// Runs `envoy -c <rendered> --concurrency 2 --log-level warn --disable-hot-restart
    /// --base-id <unique> --file-flush-interval-msec 100` and waits (up to 20 s) for admin
    /// `/ready` to say `LIVE`.
    pub fn start(config: &str, substitutions: &[(&str, &str)]) -> Result<Envoy> {
        Envoy::start_with_args(config, substitutions, &[])
    }

    /// [`Envoy::start`] with extra Envoy command-line arguments.
    pub fn start_with_args(config: &str, substitutions: &[(&str, &str)], extra_args: &[&str]) -> Result<Envoy> {
        let template = if config.contains('\n') {
            config.to_string()
        } else {
            std::fs::read_to_string(config).with_context(|| format!("reading Envoy config {config}"))?
        };
        let given = |name: &str| substitutions.iter().any(|(n, _)| placeholder_name(n) == name);
        let mut attempt = 0;
        loop {
            attempt += 1;
            match Envoy::try_start(&template, substitutions, extra_args) {
                // Another process took one of our free ports between probe and bind: new ports.
                Err(e) if attempt < 3 && !(given("ADMIN_PORT") && given("LISTEN_PORT")) && format!("{e:#}").contains("in use") => continue,
                other => return other,
            }
        }
    }

    fn try_start(template: &str, substitutions: &[(&str, &str)], extra_args: &[&str]) -> Result<Envoy> {
        let tools = Tools::locate()?;
        let dir = scratch_dir()?;
        let mut vars: Vec<(String, String)> = vec![
            ("ADMIN_PORT".into(), free_port()?.to_string()),
            ("LISTEN_PORT".into(), free_port()?.to_string()),
            ("ACCESS_LOG".into(), dir.join("access.log").display().to_string()),
            ("WASM_DIR".into(), wasm_dir().display().to_string()),
        ];
        for (name, value) in substitutions {
            let name = placeholder_name(name);
            vars.retain(|(n, _)| n != name);
            vars.push((name.to_string(), value.to_string()));
        }
        let var = |name: &str| vars.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone()).unwrap_or_default();
        let port = |name: &str| -> Result<u16> { var(name).parse().map_err(|_| anyhow!("{name} is not a port number")) };
        let refs: Vec<(&str, &str)> = vars.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect();
        let config_path = dir.join("envoy.yaml");
        let written = render_config(template, &refs).and_then(|c| Ok(std::fs::write(&config_path, c)?));
        if let Err(e) = written {
            // No Envoy owns the directory yet, so nothing else would remove it.
            let _ = std::fs::remove_dir_all(&dir);
            return Err(e);
        }
        let stderr_path = dir.join("envoy.stderr");
        let stderr = std::fs::File::create(&stderr_path)?;
        let child = Command::new(&tools.envoy)
            .arg("-c")
            .arg(&config_path)
            .args(["--concurrency", "2", "--log-level", "warn", "--disable-hot-restart"])
            .args(["--base-id", &unique_base_id().to_string()])
            // Access-log files are flushed every 10 s by default; tests read them right away.
            .args(["--file-flush-interval-msec", "100"])
            .args(extra_args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .with_context(|| format!("starting {}", tools.envoy.display()))?;
        // From here on, Drop cleans up the process and the directory.
        let mut envoy = Envoy {
            child,
            dir,
            admin_port: port("ADMIN_PORT")?,
            listen_port: port("LISTEN_PORT")?,
            config_path,
            stderr_path,
            access_log: PathBuf::from(var("ACCESS_LOG")),
        };
        envoy.wait_ready()?;
        Ok(envoy)
    }

    fn wait_ready(&mut self) -> Result<()> {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Ok(r) = http::get(self.admin_addr(), "/ready") {
                if r.status == 200 && r.text().trim() == "LIVE" {
                    return Ok(());
                }
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(self.with_stderr(anyhow!("Envoy exited during startup ({status})")));
            }
            if Instant::now() >= deadline {
                return Err(self.with_stderr(anyhow!("Envoy not LIVE after {READY_TIMEOUT:?}")));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The error plus the last lines of Envoy's stderr.
    fn with_stderr(&self, e: anyhow::Error) -> anyhow::Error {
        e.context(format!("Envoy stderr ({}), last lines:\n{}", self.stderr_path.display(), self.stderr_tail(40)))
    }

    /// The last `n` lines Envoy wrote to stderr.
    pub fn stderr_tail(&self, n: usize) -> String {
        tail(&self.stderr_path, n)
    }

    pub fn admin_port(&self) -> u16 {
        self.admin_port
    }
    pub fn listen_port(&self) -> u16 {
        self.listen_port
    }
    pub fn admin_addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.admin_port))
    }
    /// The address of `{{LISTEN_PORT}}` on loopback: where tests send requests.
    pub fn listen_addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.listen_port))
    }
    pub fn config_path(&self) -> &Path {
        &self.config_path
    }
    pub fn dir(&self) -> &Path {
        &self.dir
    }
    /// The access log at `{{ACCESS_LOG}}`.
    pub fn access_log(&self) -> AccessLog {
        AccessLog::new(&self.access_log)
    }

    /// `GET` on the admin endpoint; non-200 is an error.
    pub fn admin_get(&self, path: &str) -> Result<String> {
        let r = http::get(self.admin_addr(), path).map_err(|e| self.with_stderr(e))?;
        if r.status != 200 {
            bail!("admin {path}: status {}: {}", r.status, r.text());
        }
        Ok(r.text())
    }

    /// The raw `/stats/prometheus` text.
    pub fn stats_prometheus(&self) -> Result<String> {
        self.admin_get("/stats/prometheus")
    }

    /// `/stats/prometheus`, parsed.
    pub fn metrics(&self) -> Result<Metrics> {
        Metrics::parse(&self.stats_prometheus()?)
    }

    /// Runs `envoy --mode validate -c path`: checks a config without starting listeners. Envoy
    /// 1.40 loads the `.wasm` files and runs each plugin's `on_configure` in this mode, so a policy
    /// its plugin refuses fails validation.
    pub fn validate(path: &Path) -> Result<()> {
        Envoy::validate_in(path, None)
    }

    /// [`Envoy::validate`] with Envoy's working directory set to `dir` (relative paths in the
    /// config, such as the rendered files' `.wasm` paths, resolve against it).
    /// The release of the Envoy the tests run, from `envoy --version`
    /// (`… version: <commit>/1.40.0/Clean/RELEASE/BoringSSL`): `"1.40.0"`.
    pub fn release() -> Result<String> {
        let tools = Tools::locate()?;
        let out = Command::new(&tools.envoy).arg("--version").output().with_context(|| format!("starting {}", tools.envoy.display()))?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        text.split('/')
            .find(|part| part.split('.').count() == 3 && part.split('.').all(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit())))
            .map(str::to_string)
            .ok_or_else(|| anyhow!("no release in `envoy --version`: {text:?}"))
    }

    pub fn validate_in(path: &Path, dir: Option<&Path>) -> Result<()> {
        let tools = Tools::locate()?;
        let mut cmd = Command::new(&tools.envoy);
        if let Some(dir) = dir {
            cmd.current_dir(dir);
            // Where a native gateway's libsluice.so is (`cargo xtask build`): Envoy loads the
            // module to validate its filter configuration.
            cmd.env("ENVOY_DYNAMIC_MODULES_SEARCH_PATH", dir.join("target/native"));
        }
        let out = cmd
            .args(["--mode", "validate", "--log-level", "warn", "--disable-hot-restart", "-c"])
            .arg(path)
            .output()
            .with_context(|| format!("starting {}", tools.envoy.display()))?;
        if !out.status.success() {
            bail!(
                "envoy --mode validate -c {} failed ({}):\n{}{}",
                path.display(),
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(())
    }
}

impl Drop for Envoy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() || std::env::var_os("SLUICE_E2E_KEEP").is_some() {
            eprintln!("Envoy files kept in {}", self.dir.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// Envoy's shared-memory base id; unique per process and instance so parallel Envoys never
/// collide even if hot restart were enabled.
fn unique_base_id() -> u32 {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    (std::process::id() % 1_000_000) * 100 + NEXT.fetch_add(1, Ordering::Relaxed) % 100
}

fn scratch_dir() -> Result<PathBuf> {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let dir = std::env::temp_dir().join(format!("sluice-e2e-{}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed)));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(dir)
}

/// The last `n` lines of the file at `path` (a child's stderr or log); empty if there is none.
pub(crate) fn tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines.get(lines.len().saturating_sub(n)..).unwrap_or(&[]).join("\n")
}
