//! Redis: one connection per instance, re-made after a failure, and the three scripts (reserve,
//! settle, charge).
//!
//! The connection is either one multiplexed connection to a primary ([`RedisTarget::Single`]) or
//! the redis crate's cluster connection ([`RedisTarget::Cluster`]: one multiplexed connection per
//! node, the slot map, `MOVED` / `ASK` followed and the map refreshed by the crate). Both run the
//! same scripts through the same [`Store::call`]; every key of one call carries the request's hash
//! tag, so a call is routed to the one primary that owns its slot.
//!
//! Every call is bounded by the Redis timeout (connecting included). A connection that fails is
//! dropped and the next call connects again (at most one attempt per [`RECONNECT_INTERVAL`],
//! shared by all concurrent calls), so a restarted or failed-over Redis is picked up without
//! restarting the service. A call that failed on a connection made before it is tried once more on
//! a fresh one within the same deadline: every script is idempotent per id, so a retry of a script
//! that did run answers `replayed` / `already_settled` / `already_charged` and changes nothing. A
//! single connection that timed out is dropped too (a hung server); a cluster connection is kept
//! (one slow node does not make the other shards' connections bad; the crate's own per-request
//! timeout and retries handle that node).

use crate::api::{ChargeOutcome, ChargeRequest, CounterState, ReserveOutcome, ReserveRequest, SettleOutcome, SettleRequest};
use crate::metrics::Metrics;
use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::cluster::{ClusterClient, ClusterClientBuilder};
use redis::cluster_async::ClusterConnection;
use redis::{AsyncConnectionConfig, Client, Cmd, IntoConnectionInfo, Pipeline, RedisError, RedisFuture, Script, ScriptInvocation, Value};
use std::future::Future;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Expired holds one script call sweeps at most.
pub const SWEEP_BOUND: u32 = 64;
/// Least time between two connection attempts after a failed one.
pub const RECONNECT_INTERVAL: Duration = Duration::from_millis(100);

const COMMON_LUA: &str = include_str!("lua/common.lua");
const RESERVE_LUA: &str = include_str!("lua/reserve.lua");
const SETTLE_LUA: &str = include_str!("lua/settle.lua");
const CHARGE_LUA: &str = include_str!("lua/charge.lua");

/// Where the counters are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RedisTarget {
    /// One primary: `redis://[user:password@]host:port/db`.
    Single(String),
    /// A Redis Cluster, reached through these seed nodes (any reachable one gives the slot map).
    Cluster(Vec<String>),
}

impl RedisTarget {
    /// The target without passwords, for messages and logs.
    pub fn redacted(&self) -> String {
        match self {
            RedisTarget::Single(url) => redact(url),
            RedisTarget::Cluster(seeds) => format!("cluster {}", seeds.iter().map(|s| redact(s)).collect::<Vec<_>>().join(",")),
        }
    }
}

/// How the store makes a connection.
enum Connector {
    Single { client: Client, config: AsyncConnectionConfig },
    Cluster(ClusterClient),
}

impl Connector {
    async fn connect(&self) -> Result<Connection, RedisError> {
        match self {
            Connector::Single { client, config } => client.get_multiplexed_async_connection_with_config(config).await.map(Connection::Single),
            Connector::Cluster(client) => client.get_async_connection().await.map(Connection::Cluster),
        }
    }
}

/// One connection to a primary, or the cluster connection (which routes each command by its keys'
/// slot); both are cheap clones of one shared connection.
#[derive(Clone)]
pub enum Connection {
    Single(MultiplexedConnection),
    Cluster(ClusterConnection),
}

impl ConnectionLike for Connection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Connection::Single(c) => c.req_packed_command(cmd),
            Connection::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(&'a mut self, pipeline: &'a Pipeline, offset: usize, count: usize) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Connection::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Connection::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Connection::Single(c) => c.get_db(),
            Connection::Cluster(c) => c.get_db(),
        }
    }
}

/// Why a call did not give an answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreError {
    /// Redis unreachable, timed out, or not accepting writes now (503).
    Unavailable(String),
    /// Redis answered with an error or a reply the scripts never make (500).
    Script(String),
}

struct Connecting {
    generation: u64,
    last_failure: Option<(Instant, RedisError)>,
}

const UNKNOWN: u8 = 0;
const UP: u8 = 1;
const DOWN: u8 = 2;

pub struct Store {
    connector: Connector,
    /// Where Redis is, for the logs (no credentials).
    address: String,
    prefix: String,
    timeout: Duration,
    current: Mutex<Option<(u64, Connection)>>,
    connecting: tokio::sync::Mutex<Connecting>,
    state: AtomicU8,
    reserve: Script,
    settle: Script,
    charge: Script,
    metrics: Arc<Metrics>,
}

enum Failure {
    Timeout,
    /// No connection could be made (refused, unresolvable, authentication failed, …).
    Connect(RedisError),
    Redis(RedisError),
}

impl Store {
    pub fn new(target: &RedisTarget, prefix: &str, timeout: Duration, metrics: Arc<Metrics>) -> Result<Store, String> {
        let (connector, address) = match target {
            RedisTarget::Single(url) => {
                let client = Client::open(url.as_str()).map_err(|e| format!("--redis {:?}: {e}", redact(url)))?;
                let address = client.get_connection_info().addr().to_string();
                // The deadline of every call (below) covers the response; the connection's own
                // response timeout would only duplicate it.
                let config = AsyncConnectionConfig::new().set_connection_timeout(Some(timeout)).set_response_timeout(None);
                (Connector::Single { client, config }, address)
            }
            RedisTarget::Cluster(seeds) => (Connector::Cluster(cluster_client(seeds, timeout)?), target.redacted()),
        };
        Ok(Store {
            connector,
            address,
            prefix: prefix.to_string(),
            timeout,
            current: Mutex::new(None),
            connecting: tokio::sync::Mutex::new(Connecting { generation: 0, last_failure: None }),
            state: AtomicU8::new(UNKNOWN),
            reserve: Script::new(&format!("{COMMON_LUA}\n{RESERVE_LUA}")),
            settle: Script::new(&format!("{COMMON_LUA}\n{SETTLE_LUA}")),
            charge: Script::new(&format!("{COMMON_LUA}\n{CHARGE_LUA}")),
            metrics,
        })
    }

    /// `<prefix>:{<tag>}:`, the start of every key of one tag.
    pub fn base(&self, tag: &str) -> String {
        format!("{}:{{{tag}}}:", self.prefix)
    }

    fn cluster(&self) -> bool {
        matches!(self.connector, Connector::Cluster(_))
    }

    fn cached(&self) -> Option<(u64, Connection)> {
        self.current.lock().ok().and_then(|slot| slot.clone())
    }

    /// The current connection, or a new one. `fresh` is true when this call made it.
    async fn connection(&self) -> Result<(u64, Connection, bool), RedisError> {
        if let Some((generation, conn)) = self.cached() {
            return Ok((generation, conn, false));
        }
        let mut connecting = self.connecting.lock().await;
        if let Some((generation, conn)) = self.cached() {
            return Ok((generation, conn, false));
        }
        if let Some((at, error)) = &connecting.last_failure {
            if at.elapsed() < RECONNECT_INTERVAL {
                return Err(error.clone());
            }
        }
        match self.connector.connect().await {
            Ok(conn) => {
                connecting.generation += 1;
                connecting.last_failure = None;
                let generation = connecting.generation;
                if let Ok(mut slot) = self.current.lock() {
                    *slot = Some((generation, conn.clone()));
                }
                Ok((generation, conn, true))
            }
            Err(e) => {
                connecting.last_failure = Some((Instant::now(), e.clone()));
                Err(e)
            }
        }
    }

    /// Forgets connection `generation` (not a newer one another call already made).
    fn discard(&self, generation: u64) {
        if let Ok(mut slot) = self.current.lock() {
            if slot.as_ref().is_some_and(|(g, _)| *g == generation) {
                *slot = None;
            }
        }
    }

    fn mark(&self, up: bool, why: &str) {
        let new = if up { UP } else { DOWN };
        if self.state.swap(new, Ordering::Relaxed) != new {
            self.metrics.set_redis_up(up);
            if up {
                eprintln!("sluice-ledger: redis {} reachable", self.address);
            } else {
                eprintln!("sluice-ledger: redis {} unreachable: {why}", self.address);
            }
        }
    }

    /// Runs `op` on a connection within the timeout, classifying what went wrong.
    async fn call<T, F, Fut>(&self, op: F) -> Result<T, StoreError>
    where
        F: Fn(Connection) -> Fut,
        Fut: Future<Output = Result<T, RedisError>>,
    {
        let mut used: Option<u64> = None;
        let attempt = async {
            let mut last = None;
            for _ in 0..2 {
                let (generation, conn, fresh) = self.connection().await.map_err(Failure::Connect)?;
                used = Some(generation);
                match op(conn).await {
                    Ok(v) => return Ok(v),
                    Err(e) if is_connection_error(&e) => {
                        self.discard(generation);
                        let retry = !fresh;
                        last = Some(e);
                        if !retry {
                            break;
                        }
                    }
                    Err(e) => return Err(Failure::Redis(e)),
                }
            }
            Err(Failure::Redis(last.unwrap_or_else(|| RedisError::from(std::io::Error::other("no connection")))))
        };
        let result = match tokio::time::timeout(self.timeout, attempt).await {
            Ok(r) => r,
            Err(_) => Err(Failure::Timeout),
        };
        match result {
            Ok(v) => {
                self.mark(true, "");
                Ok(v)
            }
            Err(Failure::Timeout) => {
                // A hung connection (a paused server, a silent network) is replaced, not waited on;
                // the cluster connection times out and reconnects each node itself.
                if let Some(generation) = used.filter(|_| !self.cluster()) {
                    self.discard(generation);
                }
                self.metrics.redis_error("timeout");
                let message = format!("no answer from redis {} within {} ms", self.address, self.timeout.as_millis());
                self.mark(false, &message);
                Err(StoreError::Unavailable(message))
            }
            Err(Failure::Connect(e)) => {
                self.metrics.redis_error("connection");
                self.mark(false, &e.to_string());
                Err(StoreError::Unavailable(format!("redis {}: {e}", self.address)))
            }
            Err(Failure::Redis(e)) if is_connection_error(&e) => {
                self.metrics.redis_error("connection");
                self.mark(false, &e.to_string());
                Err(StoreError::Unavailable(format!("redis {}: {e}", self.address)))
            }
            Err(Failure::Redis(e)) if is_unavailable(&e) => {
                // Reachable, but not taking this call now. A replica (READONLY after a failover) is
                // dropped so the next call connects again, perhaps to the new primary.
                if e.code() == Some("READONLY") {
                    if let Some(generation) = used {
                        self.discard(generation);
                    }
                }
                self.mark(true, "");
                self.metrics.redis_error("unavailable");
                Err(StoreError::Unavailable(format!("redis {}: {e}", self.address)))
            }
            Err(Failure::Redis(e)) => {
                self.mark(true, "");
                self.metrics.redis_error("script");
                Err(StoreError::Script(format!("redis {}: {e}", self.address)))
            }
        }
    }

    /// One primary: `PING`. A cluster: `CLUSTER INFO` of one node, which must say
    /// `cluster_state:ok` (every slot served by a reachable primary, as the cluster sees it).
    pub async fn ping(&self) -> Result<(), StoreError> {
        if !self.cluster() {
            return self.call(|mut conn| async move { redis::cmd("PING").query_async::<String>(&mut conn).await.map(|_| ()) }).await;
        }
        let info = self.call(|mut conn| async move { redis::cmd("CLUSTER").arg("INFO").query_async::<String>(&mut conn).await }).await?;
        let state = info.lines().find_map(|l| l.strip_prefix("cluster_state:")).map(str::trim).unwrap_or("missing");
        if state == "ok" {
            Ok(())
        } else {
            Err(StoreError::Unavailable(format!("redis {}: cluster_state:{state}", self.address)))
        }
    }

    /// A call of `script` for `id` with the keys every script starts with (the tag's holds, the
    /// id's hold and marker) and the arguments `base`, `id`, sweep bound; and the tag's base.
    fn prepare<'a>(&self, script: &'a Script, tag: &str, id: &str) -> (String, ScriptInvocation<'a>) {
        let base = self.base(tag);
        let mut invocation = script.prepare_invoke();
        invocation.key(format!("{base}holds")).key(format!("{base}h:{id}")).key(format!("{base}s:{id}"));
        invocation.arg(&base).arg(id).arg(SWEEP_BOUND);
        (base, invocation)
    }

    /// Runs a prepared call, timed as `script`; its reply, whose swept holds are counted.
    async fn run(&self, script: &str, invocation: &ScriptInvocation<'_>) -> Result<Reply, StoreError> {
        let started = Instant::now();
        let reply = self.call(|mut conn| async move { invocation.invoke_async::<Value>(&mut conn).await }).await;
        self.metrics.script_latency(script, started.elapsed());
        let reply = Reply::new(reply?)?;
        self.metrics.holds_expired(reply.int(1)?);
        Ok(reply)
    }

    pub async fn reserve(&self, request: &ReserveRequest) -> Result<ReserveOutcome, StoreError> {
        let (base, mut invocation) = self.prepare(&self.reserve, &request.tag, &request.id);
        for c in &request.counters {
            invocation.key(format!("{base}c:{}", c.key));
        }
        invocation.arg(request.hold_ttl_s).arg(request.counters.len());
        for c in &request.counters {
            invocation.arg(&c.key).arg(c.limit).arg(c.amount).arg(c.expire_at_s);
        }
        let reply = self.run("reserve", &invocation).await?;
        match reply.tag()? {
            "admitted" | "replayed" => Ok(ReserveOutcome::Admitted { replayed: reply.tag()? == "replayed", counters: reply.states(2)? }),
            "refused" => Ok(ReserveOutcome::Refused {
                index: usize::try_from(reply.int(2)?).map_err(|_| unexpected("index"))?,
                used: reply.int(3)?,
                reserved: reply.int(4)?,
                limit: reply.int(5)?,
            }),
            "already_settled" => Ok(ReserveOutcome::AlreadySettled),
            other => Err(unexpected(other)),
        }
    }

    pub async fn settle(&self, request: &SettleRequest) -> Result<SettleOutcome, StoreError> {
        let (_, mut invocation) = self.prepare(&self.settle, &request.tag, &request.id);
        invocation.arg(request.charges.len());
        for charge in &request.charges {
            invocation.arg(*charge);
        }
        let reply = self.run("settle", &invocation).await?;
        match reply.tag()? {
            "settled" => Ok(SettleOutcome::Settled { counters: reply.states(2)? }),
            "already_settled" => Ok(SettleOutcome::AlreadySettled),
            "expired" => Ok(SettleOutcome::Expired),
            "unknown" => Ok(SettleOutcome::Unknown),
            "mismatch" => Ok(SettleOutcome::Mismatch { held: usize::try_from(reply.int(2)?).map_err(|_| unexpected("held"))? }),
            other => Err(unexpected(other)),
        }
    }

    pub async fn charge(&self, request: &ChargeRequest) -> Result<ChargeOutcome, StoreError> {
        let (base, mut invocation) = self.prepare(&self.charge, &request.tag, &request.id);
        for c in &request.counters {
            invocation.key(format!("{base}c:{}", c.key));
        }
        invocation.arg(request.counters.len());
        for c in &request.counters {
            invocation.arg(&c.key).arg(c.amount).arg(c.expire_at_s);
        }
        let reply = self.run("charge", &invocation).await?;
        match reply.tag()? {
            "charged" => Ok(ChargeOutcome::Charged { counters: reply.states(2)? }),
            "already_charged" => Ok(ChargeOutcome::AlreadyCharged),
            other => Err(unexpected(other)),
        }
    }
}

fn unexpected(what: &str) -> StoreError {
    StoreError::Script(format!("unexpected script reply ({what})"))
}

/// A script's reply: an array whose first element names the outcome.
struct Reply(Vec<Value>);

impl Reply {
    fn new(value: Value) -> Result<Reply, StoreError> {
        match value {
            Value::Array(items) => Ok(Reply(items)),
            _ => Err(unexpected("not an array")),
        }
    }

    fn text(&self, i: usize) -> Result<&str, StoreError> {
        match self.0.get(i) {
            Some(Value::BulkString(bytes)) => std::str::from_utf8(bytes).map_err(|_| unexpected("not UTF-8")),
            Some(Value::SimpleString(s)) => Ok(s),
            _ => Err(unexpected("missing text")),
        }
    }

    fn tag(&self) -> Result<&str, StoreError> {
        self.text(0)
    }

    fn int(&self, i: usize) -> Result<u64, StoreError> {
        match self.0.get(i) {
            Some(Value::Int(n)) => u64::try_from(*n).map_err(|_| unexpected("negative number")),
            Some(_) => self.text(i)?.parse().map_err(|_| unexpected("not a number")),
            None => Err(unexpected("missing number")),
        }
    }

    /// `(used, reserved)` pairs from element `from` on.
    fn states(&self, from: usize) -> Result<Vec<CounterState>, StoreError> {
        let mut out = Vec::new();
        let mut i = from;
        while i < self.0.len() {
            out.push(CounterState { used: self.int(i)?, reserved: self.int(i + 1)? });
            i += 2;
        }
        Ok(out)
    }
}

/// The crate's cluster client, bounded like the single connection: connecting to a node and each
/// request within `timeout`, retries (after a `MOVED`, a node's connection lost, `TRYAGAIN`, …) a
/// few milliseconds apart so that they fit in it, and the whole call — redirections and slot-map
/// refreshes included — within `timeout` too.
fn cluster_client(seeds: &[String], timeout: Duration) -> Result<ClusterClient, String> {
    let nodes = seeds.iter().map(|s| seed_node(s)).collect::<Result<Vec<_>, String>>()?;
    ClusterClientBuilder::new(nodes)
        .connection_timeout(timeout)
        .response_timeout(timeout)
        .overall_response_timeout(Some(timeout))
        .retries(CLUSTER_RETRIES)
        .min_retry_wait(2)
        .max_retry_wait(50)
        .retry_wait_formula(5, 2)
        .build()
        .map_err(|e| format!("--redis-cluster: {e}"))
}

/// One seed node of `--redis-cluster`: a `redis://` URL whose database, if any, is 0 (the only one
/// a Redis Cluster has).
pub fn seed_node(seed: &str) -> Result<redis::ConnectionInfo, String> {
    let info = seed.into_connection_info().map_err(|e| format!("--redis-cluster {:?}: {e}", redact(seed)))?;
    if info.redis_settings().db() != 0 {
        return Err(format!("--redis-cluster {:?}: a Redis Cluster has only database 0", redact(seed)));
    }
    Ok(info)
}

/// Retries of one call by the cluster client (each a few ms apart, all within the call's timeout).
const CLUSTER_RETRIES: u32 = 16;

/// The connection is unusable: refused, reset, closed, timed out, or the client says so.
fn is_connection_error(e: &RedisError) -> bool {
    e.is_io_error() || e.is_connection_dropped() || e.is_connection_refusal() || e.is_timeout() || e.is_unrecoverable_error()
}

/// Redis answered but cannot take the call now; the same call may pass later. `MOVED` / `ASK`
/// reach here only when the cluster client could not complete a redirection within the call's
/// retries (during a fail-over a replica redirects to its primary until it is promoted itself).
fn is_unavailable(e: &RedisError) -> bool {
    matches!(
        e.code(),
        Some("LOADING" | "BUSY" | "OOM" | "READONLY" | "MASTERDOWN" | "TRYAGAIN" | "CLUSTERDOWN" | "MISCONF" | "NOREPLICAS" | "NOSCRIPT" | "MOVED" | "ASK")
    )
}

/// A Redis URL without its password, for messages.
pub fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => format!("{}://…@{}", url.get(..scheme).unwrap_or(""), url.get(at + 1..).unwrap_or("")),
        _ => url.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_redacted() {
        assert_eq!(redact("redis://user:secret@host:6379/0"), "redis://…@host:6379/0");
        assert_eq!(redact("redis://127.0.0.1:6379/"), "redis://127.0.0.1:6379/");
    }
}
