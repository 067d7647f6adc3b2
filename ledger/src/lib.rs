//! `sluice-ledger`: the fleet ledger of tenant-budget (docs/ledger.md).
//!
//! A stateless HTTP service: `POST /v1/reserve`, `POST /v1/settle` (and its batch form,
//! `POST /v1/settle_batch`) and `POST /v1/charge` (write-back of what the plugin's local fallback
//! charged) each run one atomic Lua script per request in Redis, which holds every bit of state;
//! `GET /healthz` pings Redis; `GET /metrics` is Prometheus text. Any number of instances can serve
//! the same Redis.

pub mod api;
pub mod http;
pub mod metrics;
pub mod store;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

/// Command-line settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    pub listen: SocketAddr,
    pub redis: store::RedisTarget,
    pub prefix: String,
    pub redis_timeout: Duration,
    pub threads: usize,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            listen: SocketAddr::from(([127, 0, 0, 1], 18090)),
            redis: store::RedisTarget::Single("redis://127.0.0.1:6379/".into()),
            prefix: "sluice".into(),
            redis_timeout: Duration::from_millis(200),
            threads: 1,
        }
    }
}

pub const USAGE: &str = "usage: sluice-ledger [--listen 127.0.0.1:18090] [--redis redis://127.0.0.1:6379/ | --redis-cluster URL,URL,...] [--prefix sluice]
                    [--redis-timeout-ms 200] [--threads 1]

  --listen ADDR           address:port to serve HTTP/1.1 on
  --redis URL             redis://[user:password@]host:port/db (one primary)
  --redis-cluster URLS    a Redis Cluster: comma-separated seed nodes, redis://[user:password@]host:port
                          (any of them gives the slot map; list several); not with --redis
  --prefix P              first part of every Redis key (no braces, spaces or control characters)
  --redis-timeout-ms MS   bound of one Redis call, connecting included; past it the request gets 503
  --threads N             tokio worker threads";

impl Config {
    /// Parses the arguments after the program name; `Err` holds the message to print.
    pub fn from_args<I: IntoIterator<Item = String>>(args: I) -> Result<Config, String> {
        let mut config = Config::default();
        let (mut single, mut cluster) = (false, false);
        let mut args = args.into_iter();
        while let Some(flag) = args.next() {
            if flag == "--help" || flag == "-h" {
                return Err(USAGE.to_string());
            }
            let (name, inline) = match flag.split_once('=') {
                Some((n, v)) => (n.to_string(), Some(v.to_string())),
                None => (flag.clone(), None),
            };
            let value = match inline.or_else(|| args.next()) {
                Some(v) => v,
                None => return Err(format!("{name} needs a value\n{USAGE}")),
            };
            match name.as_str() {
                "--listen" => config.listen = value.parse().map_err(|e| format!("--listen {value:?}: {e}"))?,
                "--redis" => {
                    single = true;
                    config.redis = store::RedisTarget::Single(value);
                }
                "--redis-cluster" => {
                    cluster = true;
                    let seeds: Vec<String> = value.split(',').map(|s| s.trim().to_string()).collect();
                    if seeds.iter().any(|s| s.is_empty()) {
                        return Err(format!("--redis-cluster {:?}: comma-separated redis:// URLs of seed nodes, none empty", store::redact(&value)));
                    }
                    for seed in &seeds {
                        store::seed_node(seed)?;
                    }
                    config.redis = store::RedisTarget::Cluster(seeds);
                }
                "--prefix" => {
                    if value.is_empty() || value.len() > 64 || value.chars().any(|c| c.is_control() || c.is_whitespace() || c == '{' || c == '}') {
                        return Err(format!("--prefix {value:?}: 1 to 64 characters, no braces, spaces or control characters"));
                    }
                    config.prefix = value;
                }
                "--redis-timeout-ms" => {
                    let ms: u64 = value.parse().map_err(|e| format!("--redis-timeout-ms {value:?}: {e}"))?;
                    if ms == 0 || ms > 60_000 {
                        return Err(format!("--redis-timeout-ms {ms}: must be 1..=60000"));
                    }
                    config.redis_timeout = Duration::from_millis(ms);
                }
                "--threads" => {
                    let n: usize = value.parse().map_err(|e| format!("--threads {value:?}: {e}"))?;
                    if n == 0 || n > 1024 {
                        return Err(format!("--threads {n}: must be 1..=1024"));
                    }
                    config.threads = n;
                }
                _ => return Err(format!("unknown argument {flag:?}\n{USAGE}")),
            }
        }
        if single && cluster {
            return Err("--redis and --redis-cluster exclude each other: --redis URL for one primary, --redis-cluster URL,URL,... for a Redis Cluster".into());
        }
        Ok(config)
    }
}

/// What the request handlers share.
pub struct Ledger {
    pub store: store::Store,
    pub metrics: Arc<metrics::Metrics>,
}

impl Ledger {
    pub fn new(config: &Config) -> Result<Ledger, String> {
        let metrics = Arc::new(metrics::Metrics::default());
        let store = store::Store::new(&config.redis, &config.prefix, config.redis_timeout, metrics.clone())?;
        Ok(Ledger { store, metrics })
    }
}

/// Binds `config.listen`, checks Redis once (logging whether it answers; the service starts either
/// way and answers 503 until Redis does), then serves until `shutdown` completes.
pub async fn run(config: Config, shutdown: impl std::future::Future<Output = ()>) -> Result<(), String> {
    let ledger = Arc::new(Ledger::new(&config)?);
    let listener = tokio::net::TcpListener::bind(config.listen).await.map_err(|e| format!("--listen {}: {e}", config.listen))?;
    let local = listener.local_addr().map_err(|e| e.to_string())?;
    eprintln!("sluice-ledger: listening on http://{local}, redis {}, prefix {:?}", config.redis.redacted(), config.prefix);
    let _ = ledger.store.ping().await;
    http::serve(listener, ledger, shutdown).await;
    Ok(())
}

/// A ledger served on a thread of its own (one-thread runtime), for tests and benches: stops when
/// dropped.
pub struct Running {
    pub addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// Starts a ledger on `config.listen` (port 0 picks a free one; see [`Running::addr`]).
pub fn spawn(config: Config) -> Result<Running, String> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| e.to_string())?;
    let ledger = Arc::new(Ledger::new(&config)?);
    let std_listener = std::net::TcpListener::bind(config.listen).map_err(|e| format!("{}: {e}", config.listen))?;
    std_listener.set_nonblocking(true).map_err(|e| e.to_string())?;
    let addr = std_listener.local_addr().map_err(|e| e.to_string())?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let thread = std::thread::Builder::new()
        .name("sluice-ledger".into())
        .spawn(move || {
            runtime.block_on(async move {
                let Ok(listener) = tokio::net::TcpListener::from_std(std_listener) else { return };
                http::serve(listener, ledger, async {
                    let _ = stopped.await;
                })
                .await;
            });
        })
        .map_err(|e| e.to_string())?;
    Ok(Running { addr, stop: Some(stop), thread: Some(thread) })
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Config, String> {
        Config::from_args(args.iter().map(|s| s.to_string()))
    }

    #[test]
    fn flags_parse_and_bad_ones_are_refused() {
        assert_eq!(parse(&[]), Ok(Config::default()));
        let c = parse(&["--listen", "0.0.0.0:9", "--redis=redis://r:1/", "--prefix", "p", "--redis-timeout-ms", "50", "--threads", "4"]);
        assert_eq!(
            c,
            Ok(Config {
                listen: "0.0.0.0:9".parse().unwrap_or(Config::default().listen),
                redis: store::RedisTarget::Single("redis://r:1/".into()),
                prefix: "p".into(),
                redis_timeout: Duration::from_millis(50),
                threads: 4
            })
        );
        for bad in [&["--threads", "0"][..], &["--prefix", "a{b}"], &["--prefix", ""], &["--redis-timeout-ms", "x"], &["--listen"], &["--what", "1"]] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
        let c = parse(&["--redis-cluster", "redis://a:1,redis://b:2/"]).map(|c| c.redis);
        assert_eq!(c, Ok(store::RedisTarget::Cluster(vec!["redis://a:1".into(), "redis://b:2/".into()])));
        for bad in [&["--redis", "redis://a:1/", "--redis-cluster", "redis://b:2"][..], &["--redis-cluster", "redis://b:2", "--redis", "redis://a:1/"]] {
            let e = parse(bad).err().unwrap_or_default();
            assert!(e.starts_with("--redis and --redis-cluster exclude each other"), "{bad:?}: {e}");
        }
        assert!(parse(&["--redis-cluster", "redis://a:1,,redis://b:2"]).is_err_and(|e| e.contains("none empty")));
        assert!(
            parse(&["--redis-cluster", "redis://a:1/2"]).is_err_and(|e| e.contains("only database 0")),
            "{:?}",
            parse(&["--redis-cluster", "redis://a:1/2"])
        );
        assert!(parse(&["--redis-cluster", "http://a:1"]).is_err_and(|e| e.starts_with("--redis-cluster \"http://a:1\"")));
    }
}
