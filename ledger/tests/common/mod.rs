//! Test support: a real redis-server on a free loopback port in a temporary directory (killed on
//! drop), a real Redis Cluster ([`cluster::Cluster`]), a small blocking HTTP/1.1 client, and a
//! sluice-ledger served in-process.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use serde_json::Value;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

pub mod cluster;

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

static DIRS: AtomicU32 = AtomicU32::new(0);

/// A new empty directory under the system's temporary directory, unique to this process and call.
pub fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("{name}-{}-{}", std::process::id(), DIRS.fetch_add(1, Ordering::Relaxed)));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A redis-server of Debian's package (`cargo xtask setup` installs it); a test fails, not skips,
/// without it.
pub struct Redis {
    pub port: u16,
    pub dir: PathBuf,
    persistent: bool,
    child: Option<Child>,
}

impl Redis {
    /// No persistence (`--save "" --appendonly no`).
    pub fn start() -> Redis {
        Redis::start_with(false)
    }

    /// With an append-only file fsynced on every write (`--appendonly yes --appendfsync always`),
    /// so that a SIGKILL loses nothing acknowledged.
    pub fn start_persistent() -> Redis {
        Redis::start_with(true)
    }

    fn start_with(persistent: bool) -> Redis {
        let dir = temp_dir("sluice-ledger-test");
        let mut redis = Redis { port: free_port(), dir, persistent, child: None };
        redis.launch();
        redis
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    fn launch(&mut self) {
        let port = self.port.to_string();
        let mut cmd = Command::new("redis-server");
        cmd.args(["--port", &port, "--bind", "127.0.0.1", "--protected-mode", "no", "--daemonize", "no", "--save", ""])
            .arg("--dir")
            .arg(&self.dir)
            .arg("--logfile")
            .arg(self.dir.join("redis.log"));
        if self.persistent {
            cmd.args(["--appendonly", "yes", "--appendfsync", "always"]);
        } else {
            cmd.args(["--appendonly", "no"]);
        }
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server must be installed (cargo xtask setup installs Debian's redis-server)");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            // Ours, not another process that took the port first (then ours has exited).
            let exited = self.child.as_mut().map(|c| c.try_wait().ok().flatten().is_some()).unwrap_or(true);
            assert!(!exited, "redis-server on port {} exited; see {}", self.port, self.dir.join("redis.log").display());
            if self.raw("PING").map(|r| r.starts_with("+PONG")).unwrap_or(false) {
                return;
            }
            assert!(Instant::now() < deadline, "redis-server on port {} did not answer PING; see {}", self.port, self.dir.join("redis.log").display());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// One inline command over a fresh connection; the first reply line.
    fn raw(&self, command: &str) -> std::io::Result<String> {
        let mut s = TcpStream::connect(("127.0.0.1", self.port))?;
        s.set_read_timeout(Some(Duration::from_secs(2)))?;
        s.write_all(format!("{command}\r\n").as_bytes())?;
        let mut line = String::new();
        BufReader::new(s).read_line(&mut line)?;
        Ok(line)
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().unwrap().id()
    }

    /// SIGKILL, and wait for the process to be gone.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts again on the same port and directory (what was persisted comes back).
    pub fn restart(&mut self) {
        self.kill();
        self.launch();
    }

    pub fn signal(&self, signal: &str) {
        let status = Command::new("kill").args([signal, &self.pid().to_string()]).status().unwrap();
        assert!(status.success());
    }

    /// A synchronous client for looking at keys.
    pub fn conn(&self) -> redis::Connection {
        redis::Client::open(self.url()).unwrap().get_connection().unwrap()
    }

    /// Redis's clock, seconds.
    pub fn now_s(&self) -> u64 {
        let (s, _us): (u64, u64) = redis::cmd("TIME").query(&mut self.conn()).unwrap();
        s
    }

    /// `(used, reserved)` of a counter; `None` when the key does not exist.
    pub fn counter(&self, key: &str) -> Option<(u64, u64)> {
        let mut c = self.conn();
        let exists: bool = redis::cmd("EXISTS").arg(key).query(&mut c).unwrap();
        if !exists {
            return None;
        }
        let (used, reserved): (Option<u64>, Option<u64>) = redis::cmd("HMGET").arg(key).arg("used").arg("reserved").query(&mut c).unwrap();
        Some((used.unwrap_or(0), reserved.unwrap_or(0)))
    }

    pub fn query<T: redis::FromRedisValue>(&self, args: &[&str]) -> T {
        let mut cmd = redis::cmd(args[0]);
        for a in &args[1..] {
            cmd.arg(*a);
        }
        cmd.query(&mut self.conn()).unwrap()
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A sluice-ledger on a free port, served in this process on a thread of its own.
pub fn ledger(redis: &Redis, prefix: &str) -> sluice_ledger::Running {
    ledger_with_timeout(redis, prefix, Duration::from_millis(200))
}

pub fn ledger_with_timeout(redis: &Redis, prefix: &str, timeout: Duration) -> sluice_ledger::Running {
    ledger_on(sluice_ledger::store::RedisTarget::Single(redis.url()), prefix, timeout)
}

/// A sluice-ledger on a free port in front of a Redis Cluster, through all of its nodes as seeds.
pub fn cluster_ledger(cluster: &cluster::Cluster, prefix: &str, timeout: Duration) -> sluice_ledger::Running {
    ledger_on(sluice_ledger::store::RedisTarget::Cluster(cluster.seeds()), prefix, timeout)
}

pub fn ledger_on(redis: sluice_ledger::store::RedisTarget, prefix: &str, timeout: Duration) -> sluice_ledger::Running {
    sluice_ledger::spawn(sluice_ledger::Config { listen: "127.0.0.1:0".parse().unwrap(), redis, prefix: prefix.into(), redis_timeout: timeout, threads: 1 })
        .unwrap()
}

/// A blocking HTTP/1.1 client keeping one connection alive.
pub struct Http {
    addr: SocketAddr,
    conn: Option<BufReader<TcpStream>>,
}

pub struct Reply {
    pub status: u16,
    pub body: String,
}

impl Reply {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }
}

impl Http {
    pub fn new(addr: SocketAddr) -> Http {
        Http { addr, conn: None }
    }

    pub fn post(&mut self, path: &str, body: &str) -> Reply {
        self.request("POST", path, &[("content-type", "application/json")], body.as_bytes())
    }

    /// POSTs JSON, expects 200, returns the answer.
    pub fn ok(&mut self, path: &str, body: &Value) -> Value {
        let reply = self.post(path, &body.to_string());
        assert_eq!(reply.status, 200, "{path} {body}: {}", reply.body);
        reply.json()
    }

    pub fn get(&mut self, path: &str) -> Reply {
        self.request("GET", path, &[], b"")
    }

    pub fn request(&mut self, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Reply {
        // A kept-alive connection the server closed in between is retried once on a new one.
        match self.try_request(method, path, headers, body) {
            Ok(r) => r,
            Err(_) => {
                self.conn = None;
                self.try_request(method, path, headers, body).unwrap_or_else(|e| panic!("{method} {path}: {e}"))
            }
        }
    }

    fn try_request(&mut self, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> std::io::Result<Reply> {
        if self.conn.is_none() {
            let s = TcpStream::connect(self.addr)?;
            s.set_read_timeout(Some(Duration::from_secs(10)))?;
            s.set_nodelay(true)?;
            self.conn = Some(BufReader::new(s));
        }
        let conn = self.conn.as_mut().unwrap();
        let mut head = format!("{method} {path} HTTP/1.1\r\nhost: ledger\r\ncontent-length: {}\r\n", body.len());
        for (k, v) in headers {
            head.push_str(&format!("{k}: {v}\r\n"));
        }
        head.push_str("\r\n");
        let stream = conn.get_mut();
        stream.write_all(head.as_bytes())?;
        stream.write_all(body)?;
        let mut line = String::new();
        if conn.read_line(&mut line)? == 0 {
            return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "closed"));
        }
        let status: u16 =
            line.split_whitespace().nth(1).and_then(|s| s.parse().ok()).ok_or_else(|| std::io::Error::other(format!("bad status line {line:?}")))?;
        let mut length = 0usize;
        let mut close = false;
        loop {
            let mut h = String::new();
            conn.read_line(&mut h)?;
            let h = h.trim_end();
            if h.is_empty() {
                break;
            }
            let (name, value) = h.split_once(':').unwrap_or((h, ""));
            match name.to_ascii_lowercase().as_str() {
                "content-length" => length = value.trim().parse().unwrap_or(0),
                "connection" => close = value.trim().eq_ignore_ascii_case("close"),
                _ => {}
            }
        }
        let mut buf = vec![0; length];
        conn.read_exact(&mut buf)?;
        if close {
            self.conn = None;
        }
        Ok(Reply { status, body: String::from_utf8_lossy(&buf).into_owned() })
    }
}

/// The value of one sample in Prometheus text.
pub fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(series).and_then(|rest| rest.strip_prefix(' ')).and_then(|v| v.trim().parse().ok()))
}
