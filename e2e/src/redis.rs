//! A real Redis as a child process: Debian's `redis-server` on a free loopback port, with its own
//! temporary directory, killed on drop; restartable (same port, same directory) with persistence on,
//! so a test can show what survives a Redis restart. Talks RESP itself (a few lines), so the tests
//! need no `redis-cli` and no Redis crate.

use crate::envoy::{free_port, tail};
use crate::process::Process;
use anyhow::{anyhow, bail, Context, Result};
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// How Redis keeps its data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Persistence {
    /// Nothing on disk (`save ""`, `appendonly no`): a restart starts empty.
    None,
    /// `appendonly yes` with `appendfsync everysec` (Redis's default fsync policy): every write is in
    /// the append-only file before its reply leaves, so a killed Redis comes back with it.
    AppendOnly,
}

/// Finds `redis-server`: `$SLUICE_REDIS_SERVER`, else the `PATH` (and `/usr/bin`, `/usr/sbin`,
/// where Debian's package puts it) — `cargo xtask setup` installs Debian's `redis-server`.
pub fn redis_server_bin() -> Result<PathBuf> {
    crate::tools::debian_binary("redis-server", "SLUICE_REDIS_SERVER", "redis-server")
}

/// A running `redis-server`, killed (and its directory removed) on drop.
pub struct Redis {
    process: Process,
    bin: PathBuf,
    dir: PathBuf,
    port: u16,
    persistence: Persistence,
}

impl Redis {
    /// Starts Redis on a free loopback port in a new temporary directory and waits for `PING`.
    pub fn start(persistence: Persistence) -> Result<Redis> {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let bin = redis_server_bin()?;
        let dir = std::env::temp_dir().join(format!("sluice-redis-{}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed)));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let mut redis = Redis { process: Process::new("redis-server"), bin, dir, port: free_port()?, persistence };
        redis.spawn()?;
        Ok(redis)
    }

    fn spawn(&mut self) -> Result<()> {
        let mut cmd = Command::new(&self.bin);
        cmd.args(["--port", &self.port.to_string(), "--bind", "127.0.0.1", "--daemonize", "no", "--protected-mode", "yes"])
            .arg("--dir")
            .arg(&self.dir)
            .arg("--logfile")
            .arg(self.dir.join("redis.log"))
            .args(["--save", ""]);
        match self.persistence {
            Persistence::None => cmd.args(["--appendonly", "no"]),
            Persistence::AppendOnly => cmd.args(["--appendonly", "yes", "--appendfsync", "everysec"]),
        };
        let child = cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null()).spawn().with_context(|| format!("starting {}", self.bin.display()))?;
        self.process.run(child);
        let (addr, log) = (self.addr(), self.dir.join("redis.log"));
        let pong = || matches!(command_at(addr, &["PING"]), Ok(Resp::Simple(p)) if p == "PONG");
        self.process.wait_ready(Duration::from_secs(10), "answering PING", pong, || format!("log:\n{}", tail(&log, 20)))
    }

    /// Kills Redis with SIGKILL (no shutdown save: what a crash leaves) and starts it again on the
    /// same port and directory, waiting for `PING`. Returns how long it was down.
    pub fn kill_and_restart(&mut self) -> Result<Duration> {
        let down = Instant::now();
        self.kill();
        self.spawn()?;
        Ok(down.elapsed())
    }

    /// SIGKILL, and wait for the process to be gone.
    pub fn kill(&mut self) {
        self.process.kill();
    }

    /// SIGSTOP: Redis stays, its connections stay open, nothing is answered — a stalled Redis (a
    /// long fork, a slow script) until [`Redis::resume`].
    pub fn pause(&self) -> Result<()> {
        self.process.signal("-STOP")
    }

    /// SIGCONT after [`Redis::pause`].
    pub fn resume(&self) -> Result<()> {
        self.process.signal("-CONT")
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// `redis://127.0.0.1:PORT/`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Sends one command on a new connection and reads its reply. A Redis error reply is `Ok`
    /// ([`Resp::Error`]); a connection failure is `Err`.
    pub fn command(&self, args: &[&str]) -> Result<Resp> {
        command_at(self.addr(), args)
    }

    /// Every key matching `pattern` (`KEYS`: fine for a test's few thousand keys).
    pub fn keys(&self, pattern: &str) -> Result<Vec<String>> {
        match self.command(&["KEYS", pattern])? {
            Resp::Array(Some(items)) => Ok(items.into_iter().filter_map(|i| i.text()).collect()),
            other => bail!("KEYS {pattern}: {other:?}"),
        }
    }

    /// A hash's fields (`HGETALL`).
    pub fn hgetall(&self, key: &str) -> Result<BTreeMap<String, String>> {
        match self.command(&["HGETALL", key])? {
            Resp::Array(Some(items)) => {
                let texts: Vec<String> = items.into_iter().filter_map(|i| i.text()).collect();
                Ok(texts.chunks(2).filter_map(|p| Some((p.first()?.clone(), p.get(1)?.clone()))).collect())
            }
            other => bail!("HGETALL {key}: {other:?}"),
        }
    }

    /// `used` and `reserved` of every counter hash under `<prefix>:{…}:c:`, by the counter key the
    /// plugin named (`key:search-prod:minute:total_tokens:w29583344`), with the org tag:
    /// `(org, counter) → (used, reserved)`.
    pub fn ledger_counters(&self, prefix: &str) -> Result<BTreeMap<(String, String), (u64, u64)>> {
        let mut out = BTreeMap::new();
        for key in self.keys(&format!("{prefix}:{{*}}:c:*"))? {
            let Some(rest) = key.strip_prefix(&format!("{prefix}:{{")) else { continue };
            let Some((org, counter)) = rest.split_once("}:c:") else { continue };
            let h = self.hgetall(&key)?;
            let num = |f: &str| h.get(f).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
            out.insert((org.to_string(), counter.to_string()), (num("used"), num("reserved")));
        }
        Ok(out)
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        self.kill();
        if std::thread::panicking() || std::env::var_os("SLUICE_E2E_KEEP").is_some() {
            eprintln!("Redis files kept in {}", self.dir.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// [`Redis::command`] to the Redis at `addr`.
fn command_at(addr: SocketAddr, args: &[&str]) -> Result<Resp> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut out = format!("*{}\r\n", args.len()).into_bytes();
    for a in args {
        out.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
        out.extend_from_slice(a.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    stream.write_all(&out)?;
    read_resp(&mut BufReader::new(stream))
}

/// A RESP reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resp {
    Simple(String),
    Error(String),
    Int(i64),
    Bulk(Option<Vec<u8>>),
    Array(Option<Vec<Resp>>),
}

impl Resp {
    /// The reply as text: a simple string, a bulk string, or an integer.
    pub fn text(&self) -> Option<String> {
        match self {
            Resp::Simple(s) => Some(s.clone()),
            Resp::Bulk(Some(b)) => Some(String::from_utf8_lossy(b).into_owned()),
            Resp::Int(i) => Some(i.to_string()),
            _ => None,
        }
    }
}

fn read_resp<R: BufRead>(r: &mut R) -> Result<Resp> {
    let mut line = String::new();
    if r.read_line(&mut line)? == 0 {
        bail!("Redis closed the connection");
    }
    let line = line.trim_end_matches(['\r', '\n']);
    let (kind, rest) = line.split_at(line.len().min(1));
    let num = || rest.parse::<i64>().map_err(|_| anyhow!("bad RESP line {line:?}"));
    Ok(match kind {
        "+" => Resp::Simple(rest.to_string()),
        "-" => Resp::Error(rest.to_string()),
        ":" => Resp::Int(num()?),
        "$" => match usize::try_from(num()?) {
            Err(_) => Resp::Bulk(None),
            Ok(n) => {
                let mut buf = vec![0; n + 2];
                r.read_exact(&mut buf)?;
                buf.truncate(n);
                Resp::Bulk(Some(buf))
            }
        },
        "*" => match usize::try_from(num()?) {
            Err(_) => Resp::Array(None),
            Ok(n) => Resp::Array(Some((0..n).map(|_| read_resp(r)).collect::<Result<_>>()?)),
        },
        _ => bail!("unexpected RESP line {line:?}"),
    })
}
