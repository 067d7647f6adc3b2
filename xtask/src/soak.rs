//! `cargo xtask soak [--minutes N] [--out DIR]`: the long soak of the full chain in real Envoy
//! (`e2e/src/soak.rs`, run as the ignored test `soak_long` of `e2e/tests/soak.rs`), N minutes
//! (default 20) of mixed traffic with failures at 10 requests a second on loopback. Writes
//! `soak-<N>min.md` (samples every minute, figures) and `soak-<N>min.svg` (memory and series over
//! time) into DIR (default `target/soak`); fails when memory, series or connections grow after the
//! warm-up or when any request's accounting does not check out (docs/soak.md).

use anyhow::{bail, Result};
use std::path::Path;

pub fn soak_command(root: &Path, args: &[String]) -> Result<()> {
    let mut minutes: u64 = 20;
    let mut out = root.join("target/soak");
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        match (arg.as_str(), it.next()) {
            ("--minutes", Some(n)) => match n.parse() {
                Ok(n) if n > 0 => minutes = n,
                _ => bail!("cargo xtask soak --minutes N: N must be a positive number of minutes"),
            },
            ("--out", Some(dir)) => out = root.join(dir),
            _ => bail!("usage: cargo xtask soak [--minutes N] [--out DIR]"),
        }
    }
    crate::run(
        crate::cargo()
            .current_dir(root)
            .args(["test", "--package", "sluice-e2e", "--test", "soak", "--", "--ignored", "--exact", "soak_long", "--nocapture"])
            .env("SLUICE_ENVOY", crate::envoy_bin(root))
            .env("SLUICE_MOCK_BIN", root.join("target/release/sluice-mock-server"))
            .env("SLUICE_SOAK_MINUTES", minutes.to_string())
            .env("SLUICE_SOAK_OUT", &out),
    )
}
