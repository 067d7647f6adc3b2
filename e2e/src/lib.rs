//! sluice-e2e: the support library for sluice's end-to-end tests against a real Envoy.
//!
//! A test starts the mock model server ([`MockServer`]) and Envoy ([`Envoy`]) as child processes
//! on loopback ports, sends requests with the blocking HTTP/1.1 client in [`http`] (which records
//! when each body chunk arrived), and reads the results back from Envoy's `/stats/prometheus`
//! ([`prometheus`]) and its JSON access log ([`access_log`]). Every process is killed on drop, and
//! every wait is bounded, so a broken build fails a test instead of hanging it.
//!
//! Where binaries come from is in [`tools`]: `SLUICE_ENVOY` / `SLUICE_MOCK_BIN` / `SLUICE_LEDGER_BIN`
//! / `SLUICE_WASM_DIR` (the plugin `.wasm` files), else the workspace's `.tools/venv` and `target/`
//! (what `cargo xtask setup` and `cargo xtask build` make); `redis-server` from `SLUICE_REDIS_SERVER`
//! or the `PATH`. The fleet tests also run Redis ([`redis`]) and the ledger service ([`ledger`]);
//! they and the single-Envoy budget test send and check the same planned traffic
//! ([`budget_traffic`]).

pub mod access_log;
pub mod budget_traffic;
pub mod checks;
pub mod envoy;
pub mod faults;
pub mod gateway;
pub mod http;
pub mod istio;
pub mod ledger;
pub mod lifecycle;
pub mod mock;
pub mod otlp;
mod process;
pub mod prometheus;
pub mod prometheus_server;
pub mod redis;
pub mod registry;
pub mod soak;
pub mod sse;
pub mod tools;

pub use access_log::AccessLog;
pub use checks::Checks;
pub use envoy::{free_port, render_config, Envoy};
pub use http::{get, post_json, post_stream, ClientStream, Connection, Response, StreamedResponse};
pub use mock::{MockHead, MockRequest, MockServer};
pub use tools::Tools;

use anyhow::{bail, Result};
use std::time::{Duration, Instant};

/// Calls `check` every 50 ms until it returns `Some`, an error, or `timeout` passes.
/// Envoy publishes some results asynchronously (access-log flushes, histogram merges), so tests
/// poll for them rather than sleep a fixed time.
pub fn wait_until<T>(timeout: Duration, what: &str, mut check: impl FnMut() -> Result<Option<T>>) -> Result<T> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = check()? {
            return Ok(v);
        }
        if Instant::now() >= deadline {
            bail!("timed out after {timeout:?} waiting for {what}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// base64url without padding, as jwt_authn's `forward_payload_header` writes a verified token's
/// payload: what the tests send as `x-jwt-payload`.
pub fn base64url(bytes: &[u8]) -> String {
    const ABC: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let at = |i: usize| u32::from(chunk.get(i).copied().unwrap_or(0));
        let n = (at(0) << 16) | (at(1) << 8) | at(2);
        for i in 0..=chunk.len() {
            if let Some(&c) = ABC.get(((n >> (18 - 6 * i)) & 63) as usize) {
                out.push(char::from(c));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::base64url;

    #[test]
    fn base64url_matches_the_rfc_4648_vectors() {
        for (plain, encoded) in [("", ""), ("f", "Zg"), ("fo", "Zm8"), ("foo", "Zm9v"), ("foob", "Zm9vYg"), ("fooba", "Zm9vYmE"), ("foobar", "Zm9vYmFy")] {
            assert_eq!(base64url(plain.as_bytes()), encoded);
        }
        assert_eq!(base64url(&[0xfb, 0xff]), "-_8");
    }
}
