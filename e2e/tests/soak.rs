//! The soak of the full chain in real Envoy (`sluice_e2e::soak`): mixed traffic with failures at a
//! bounded rate on loopback, Envoy's memory, series and connections sampled and held flat after the
//! warm-up, every request's accounting checked at the end.
//!
//! - `soak_short`: ≈ 40 s of traffic, in the test command (about a minute in all).
//! - `soak_long` (ignored): `SLUICE_SOAK_MINUTES` minutes (default 20), writing the sample table and
//!   the SVG into `SLUICE_SOAK_OUT` (default `target/soak`); run by `cargo xtask soak [--minutes N]`.
//!
//! Skipped when Envoy is not installed (unless `SLUICE_ENVOY`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use sluice_e2e::soak::{run, SoakConfig};
use sluice_e2e::tools::workspace_root;
use sluice_e2e::Tools;
use std::time::Instant;

#[test]
fn soak_short() {
    let Some(_tools) = Tools::locate_or_skip().unwrap() else { return };
    let started = Instant::now();
    let report = run(&SoakConfig::short()).unwrap();
    report.verdict().unwrap();
    println!("soak_short took {:.1} s", started.elapsed().as_secs_f64());
}

#[test]
#[ignore = "minutes long: cargo xtask soak"]
fn soak_long() {
    Tools::locate().unwrap();
    let minutes = std::env::var("SLUICE_SOAK_MINUTES").ok().map_or(20, |m| m.parse::<u64>().expect("SLUICE_SOAK_MINUTES is a number of minutes"));
    let mut cfg = SoakConfig::minutes(minutes);
    cfg.out_dir = Some(std::env::var_os("SLUICE_SOAK_OUT").map_or_else(|| workspace_root().join("target/soak"), Into::into));
    let report = run(&cfg).unwrap();
    report.verdict().unwrap();
}
