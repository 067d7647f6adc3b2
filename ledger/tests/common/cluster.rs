//! A real Redis Cluster from Debian's redis-server: 3 primaries and 3 replicas on free loopback
//! ports (client and cluster-bus ports both picked free), each in its own temporary directory,
//! created with `redis-cli --cluster create … --cluster-replicas 1`; every process killed on drop.
//! A test fails, not skips, without redis-server or redis-cli.

use super::free_port;
use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct Node {
    pub port: u16,
    bus: u16,
    dir: PathBuf,
    child: Option<Child>,
}

impl Node {
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    pub fn alive(&self) -> bool {
        self.child.is_some()
    }

    /// A synchronous connection to this node alone (no redirections followed).
    pub fn conn(&self) -> redis::Connection {
        let client = redis::Client::open(self.url()).unwrap();
        let conn = client.get_connection_with_timeout(Duration::from_secs(2)).unwrap();
        conn.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        conn
    }

    pub fn query<T: redis::FromRedisValue>(&self, args: &[&str]) -> T {
        let mut cmd = redis::cmd(args[0]);
        for a in &args[1..] {
            cmd.arg(*a);
        }
        cmd.query(&mut self.conn()).unwrap_or_else(|e| panic!("{args:?} on {}: {e}", self.port))
    }

    /// `CLUSTER INFO` as lines `name:value`.
    pub fn info_field(&self, section: &str, field: &str) -> Option<String> {
        let client = redis::Client::open(self.url()).ok()?;
        let mut conn = client.get_connection_with_timeout(Duration::from_millis(500)).ok()?;
        conn.set_read_timeout(Some(Duration::from_millis(500))).ok()?;
        let text: String = if section == "cluster" {
            redis::cmd("CLUSTER").arg("INFO").query(&mut conn).ok()?
        } else {
            redis::cmd("INFO").arg(section).query(&mut conn).ok()?
        };
        text.lines().find_map(|l| l.strip_prefix(&format!("{field}:")).map(|v| v.trim().to_string()))
    }

    pub fn id(&self) -> String {
        self.query(&["CLUSTER", "MYID"])
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

pub struct Cluster {
    pub nodes: Vec<Node>,
    dir: PathBuf,
}

/// Who serves a slot range now.
#[derive(Debug, Clone)]
pub struct Shard {
    pub start: u16,
    pub end: u16,
    /// Ports: the primary first, then its replicas.
    pub primary: u16,
    pub replicas: Vec<u16>,
}

impl Cluster {
    /// Six nodes, `cluster-node-timeout` of `node_timeout_ms`, created and waited on until every node
    /// reports `cluster_state:ok`, knows three shards and every replica is in sync.
    pub fn start(node_timeout_ms: u64) -> Cluster {
        let dir = super::temp_dir("sluice-ledger-cluster");
        let mut ports = BTreeSet::new();
        while ports.len() < 12 {
            ports.insert(free_port());
        }
        let ports: Vec<u16> = ports.into_iter().collect();
        let mut cluster = Cluster { nodes: Vec::new(), dir };
        for i in 0..6 {
            let node_dir = cluster.dir.join(format!("node{i}"));
            std::fs::create_dir_all(&node_dir).unwrap();
            let (port, bus) = (ports[2 * i], ports[2 * i + 1]);
            let child = Command::new("redis-server")
                .args(["--port", &port.to_string(), "--cluster-port", &bus.to_string(), "--bind", "127.0.0.1", "--protected-mode", "no"])
                .args(["--daemonize", "no", "--save", "", "--appendonly", "no", "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"])
                .args(["--cluster-node-timeout", &node_timeout_ms.to_string()])
                .arg("--dir")
                .arg(&node_dir)
                .arg("--logfile")
                .arg(node_dir.join("redis.log"))
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("redis-server must be installed (cargo xtask setup installs Debian's redis-server)");
            cluster.nodes.push(Node { port, bus, dir: node_dir, child: Some(child) });
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        for node in &mut cluster.nodes {
            loop {
                let exited = node.child.as_mut().map(|c| c.try_wait().ok().flatten().is_some()).unwrap_or(true);
                assert!(!exited, "redis-server on port {} (bus {}) exited; see {}", node.port, node.bus, node.dir.join("redis.log").display());
                if node.info_field("server", "redis_version").is_some() {
                    break;
                }
                assert!(Instant::now() < deadline, "redis-server on port {} did not answer", node.port);
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        let addresses: Vec<String> = cluster.nodes.iter().map(|n| format!("127.0.0.1:{}", n.port)).collect();
        let out = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(&addresses)
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .expect("redis-cli must be installed (Debian's redis-tools, with redis-server)");
        assert!(out.status.success(), "redis-cli --cluster create: {}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        cluster.wait_healthy(Duration::from_secs(30));
        cluster
    }

    /// Until every live node says `cluster_state:ok` and the slot map shows three shards, each with
    /// a primary and a replica in sync.
    pub fn wait_healthy(&self, within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            let ok = self.nodes.iter().filter(|n| n.alive()).all(|n| n.info_field("cluster", "cluster_state").as_deref() == Some("ok"));
            let shards = if ok { self.try_shards() } else { None };
            if let Some(shards) = shards {
                let synced = shards.len() == 3
                    && shards.iter().all(|s| {
                        !s.replicas.is_empty()
                            && s.replicas.iter().all(|r| self.node(*r).info_field("replication", "master_link_status").as_deref() == Some("up"))
                    });
                if synced {
                    return;
                }
            }
            assert!(Instant::now() < deadline, "the cluster did not become healthy: {:?}", self.try_shards());
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn seeds(&self) -> Vec<String> {
        self.nodes.iter().map(|n| n.url()).collect()
    }

    pub fn node(&self, port: u16) -> &Node {
        self.nodes.iter().find(|n| n.port == port).unwrap_or_else(|| panic!("no node on port {port}"))
    }

    /// SIGKILL one node (by port), and wait for the process to be gone.
    pub fn kill(&mut self, port: u16) {
        if let Some(n) = self.nodes.iter_mut().find(|n| n.port == port) {
            n.kill();
        }
    }

    /// The slot map as one live node sees it (`CLUSTER SLOTS`), merged by primary.
    pub fn try_shards(&self) -> Option<Vec<Shard>> {
        for node in self.nodes.iter().filter(|n| n.alive()) {
            let Ok(client) = redis::Client::open(node.url()) else { continue };
            let Ok(mut conn) = client.get_connection_with_timeout(Duration::from_millis(500)) else { continue };
            let _ = conn.set_read_timeout(Some(Duration::from_millis(500)));
            let Ok(slots) = redis::cmd("CLUSTER").arg("SLOTS").query::<Vec<redis::Value>>(&mut conn) else { continue };
            let mut shards = Vec::new();
            for range in slots {
                let redis::Value::Array(items) = range else { return None };
                let int = |v: &redis::Value| match v {
                    redis::Value::Int(i) => Some(*i),
                    _ => None,
                };
                let port_of = |v: &redis::Value| match v {
                    redis::Value::Array(a) => a.get(1).and_then(int).map(|p| p as u16),
                    _ => None,
                };
                let (start, end) = (int(items.first()?)? as u16, int(items.get(1)?)? as u16);
                let primary = port_of(items.get(2)?)?;
                let replicas = items.iter().skip(3).filter_map(port_of).collect();
                shards.push(Shard { start, end, primary, replicas });
            }
            return Some(shards);
        }
        None
    }

    pub fn shards(&self) -> Vec<Shard> {
        self.try_shards().expect("no live node answered CLUSTER SLOTS")
    }

    /// The hash slot of a key (`CLUSTER KEYSLOT`, asked of a live node).
    pub fn keyslot(&self, key: &str) -> u16 {
        self.nodes.iter().find(|n| n.alive()).unwrap().query(&["CLUSTER", "KEYSLOT", key])
    }

    /// The port of the primary serving `slot`.
    pub fn primary_of_slot(&self, slot: u16) -> u16 {
        self.shards().iter().find(|s| s.start <= slot && slot <= s.end).unwrap_or_else(|| panic!("slot {slot} unserved")).primary
    }

    pub fn primary_of(&self, key: &str) -> u16 {
        self.primary_of_slot(self.keyslot(key))
    }

    /// `(used, reserved)` of a counter, read from the primary that owns it (not redirected: a key
    /// that is not on its slot's primary reads as missing).
    pub fn counter(&self, key: &str) -> Option<(u64, u64)> {
        let node = self.node(self.primary_of(key));
        let exists: bool = node.query(&["EXISTS", key]);
        if !exists {
            return None;
        }
        let (used, reserved): (Option<u64>, Option<u64>) = redis::cmd("HMGET").arg(key).arg("used").arg("reserved").query(&mut node.conn()).unwrap();
        Some((used.unwrap_or(0), reserved.unwrap_or(0)))
    }

    /// A command run on the primary that owns `key`.
    pub fn query_key<T: redis::FromRedisValue>(&self, key: &str, args: &[&str]) -> T {
        self.node(self.primary_of(key)).query(args)
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for n in &mut self.nodes {
            n.kill();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
