//! Where the binaries the end-to-end tests run come from.

use anyhow::{bail, Result};
use std::path::{Path, PathBuf};

/// The workspace root: the parent of this crate's directory.
pub fn workspace_root() -> PathBuf {
    let manifest_dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest_dir.parent().map(Path::to_path_buf).unwrap_or(manifest_dir)
}

/// The plugin `.wasm` files the tests load (the default `{{WASM_DIR}}`): `$SLUICE_WASM_DIR`, e.g. to
/// run the tests against another build, else where `cargo xtask build` puts them.
pub fn wasm_dir() -> PathBuf {
    match std::env::var_os("SLUICE_WASM_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => workspace_root().join("target").join("wasm32-wasip1").join("release"),
    }
}

/// External tools the tests need.
#[derive(Debug, Clone)]
pub struct Tools {
    pub envoy: PathBuf,
}

impl Tools {
    /// Finds Envoy: `$SLUICE_ENVOY`, else `<workspace>/.tools/venv/bin/envoy`.
    pub fn locate() -> Result<Tools> {
        let envoy = match std::env::var_os("SLUICE_ENVOY") {
            Some(p) => PathBuf::from(p),
            None => workspace_root().join(".tools/venv/bin/envoy"),
        };
        if !envoy.is_file() {
            bail!("Envoy not found at {}: run `cargo xtask setup` (or set SLUICE_ENVOY)", envoy.display());
        }
        Ok(Tools { envoy })
    }

    /// For tests that need Envoy: `None` (with a note on stderr) when Envoy is simply not
    /// installed, so `cargo test` works on a fresh clone. When `SLUICE_ENVOY` is set the caller
    /// asked for Envoy explicitly (as `cargo xtask test` does), so a missing binary is an error.
    pub fn locate_or_skip() -> Result<Option<Tools>> {
        match Tools::locate() {
            Ok(t) => Ok(Some(t)),
            Err(e) if std::env::var_os("SLUICE_ENVOY").is_none() => {
                eprintln!("skipping Envoy test: {e}");
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }
}

/// Finds the mock server binary: `$SLUICE_MOCK_BIN`, else the newest of
/// `<target>/release/sluice-mock-server` and `<target>/debug/sluice-mock-server`, where `<target>`
/// is the target directory this test binary was built in (so a custom `CARGO_TARGET_DIR` works)
/// and then `<workspace>/target`. Newest, so a stale release build never shadows a fresh debug one.
pub fn mock_bin() -> Result<PathBuf> {
    built_binary("sluice-mock-server", "SLUICE_MOCK_BIN", "cargo build -p sluice-mock-server")
}

/// Finds the `sluice-ledger` binary: `$SLUICE_LEDGER_BIN` (set by `cargo xtask test`), else the
/// newest of `<target>/release/sluice-ledger` and `<target>/debug/sluice-ledger`, as
/// [`mock_bin`] looks. `cargo xtask build` builds it.
pub fn ledger_bin() -> Result<PathBuf> {
    built_binary("sluice-ledger", "SLUICE_LEDGER_BIN", "cargo build --release -p sluice-ledger")
}

/// A workspace binary: `$<env>` if set, else the newest `name` in the release and debug
/// directories of this test binary's target directory and of `<workspace>/target`.
fn built_binary(name: &str, env: &str, build: &str) -> Result<PathBuf> {
    if let Some(p) = std::env::var_os(env) {
        let p = PathBuf::from(p);
        if !p.is_file() {
            bail!("{env}={} does not exist: run `cargo xtask build`", p.display());
        }
        return Ok(p);
    }
    let mut target_dirs = Vec::new();
    // Test binaries live in <target>/<profile>/deps/.
    if let Some(dir) = std::env::current_exe().ok().and_then(|exe| Some(exe.parent()?.parent()?.parent()?.to_path_buf())) {
        target_dirs.push(dir);
    }
    target_dirs.push(workspace_root().join("target"));
    let newest = target_dirs
        .iter()
        .flat_map(|t| ["release", "debug"].map(|profile| t.join(profile).join(name)))
        .filter_map(|p| Some((std::fs::metadata(&p).ok()?.modified().ok()?, p)))
        .max();
    match newest {
        Some((_, p)) => Ok(p),
        None => bail!(
            "{name} binary not found (looked in {target_dirs:?}): build it with `{build}` or \
             `cargo xtask build`, or set {env}"
        ),
    }
}

/// A program from one of Debian's packages, which `cargo xtask setup` installs: `$<env>` when set
/// (it must exist), else the first `name` on the `PATH`, `/usr/bin` or `/usr/sbin`.
pub fn debian_binary(name: &str, env: &str, package: &str) -> Result<PathBuf> {
    if let Some(p) = std::env::var_os(env) {
        let p = PathBuf::from(p);
        if !p.is_file() {
            bail!("{env}={} does not exist", p.display());
        }
        return Ok(p);
    }
    let mut dirs: Vec<PathBuf> = std::env::var_os("PATH").map(|p| std::env::split_paths(&p).collect()).unwrap_or_default();
    dirs.extend([PathBuf::from("/usr/bin"), PathBuf::from("/usr/sbin")]);
    match dirs.into_iter().map(|d| d.join(name)).find(|p| p.is_file()) {
        Some(p) => Ok(p),
        None => bail!("{name} not found: run `cargo xtask setup` (installs Debian's {package}) or set {env}"),
    }
}
