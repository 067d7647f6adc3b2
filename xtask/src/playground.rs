//! `cargo xtask playground`: the policy playground's page (examples/playground/, docs/playground.md).
//!
//! The page must open from `file://`, where Chromium blocks ES modules and `fetch()`: so the glue is
//! wasm-bindgen's `no-modules` output, the `.wasm` is embedded as base64 in a script, and the
//! example policies and workload are written into a script too (read from `policies/` here, so the
//! page never drifts from the shipped files). Everything lands in `examples/playground/pkg/`
//! (generated, not committed).

use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The browser target, and the wasm-bindgen-cli that must match the crate's `wasm-bindgen` pin.
const TARGET: &str = "wasm32-unknown-unknown";
const WASM_BINDGEN_VERSION: &str = "0.2.130";
/// The page's policy pickers: every shipped example of each plugin the playground runs.
const PLUGINS: [&str; 3] = ["latency-guard", "model-router", "tenant-budget"];

/// npm's binaryen, whose `wasm-opt` (a newer one than Debian's 108) runs after wasm-bindgen too.
const BINARYEN_NPM_VERSION: &str = "132.0.0";

/// Where [`setup`] installs npm's binaryen: `~/.cache/sluice/binaryen-<version>`.
fn binaryen_npm_dir() -> Option<PathBuf> {
    let home = std::env::var_os("HOME")?;
    Some(PathBuf::from(home).join(".cache/sluice").join(format!("binaryen-{BINARYEN_NPM_VERSION}")))
}

/// npm's `wasm-opt` (a node script), when [`setup`] could install it.
fn newer_wasm_opt() -> Option<PathBuf> {
    let path = binaryen_npm_dir()?.join("node_modules/.bin/wasm-opt");
    path.exists().then_some(path)
}

/// What the playground's build needs: the target, the matching wasm-bindgen-cli, binaryen's
/// `wasm-opt` (Debian's package) to shrink the page's `.wasm`, and npm's newer binaryen when npm
/// is there (without it, the page is built with Debian's alone, a few KiB larger).
pub fn setup() -> Result<()> {
    let installed = crate::output(Command::new("rustup").args(["target", "list", "--installed"]))?;
    if !installed.lines().any(|l| l.trim() == TARGET) {
        crate::run(Command::new("rustup").args(["target", "add", TARGET]))?;
    }
    let have = Command::new("wasm-bindgen").arg("--version").output().map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string()).unwrap_or_default();
    if have != format!("wasm-bindgen {WASM_BINDGEN_VERSION}") {
        let locked = crate::run(Command::new("cargo").args(["install", "wasm-bindgen-cli", "--version", WASM_BINDGEN_VERSION, "--locked"]));
        if let Err(e) = locked {
            // A registry mirror may lack a version the CLI's own lockfile names (seen here:
            // webpki-roots 1.0.11); the CLI's own requirements still bound what cargo picks.
            eprintln!("xtask: wasm-bindgen-cli with its lockfile failed ({e:#}); installing with fresh resolution");
            crate::run(Command::new("cargo").args(["install", "wasm-bindgen-cli", "--version", WASM_BINDGEN_VERSION]))?;
        }
    }
    crate::ensure_debian_packages(&[("wasm-opt", "binaryen")])?;
    if newer_wasm_opt().is_none() {
        let installed = binaryen_npm_dir().context("no HOME for npm's binaryen").and_then(|dir| {
            std::fs::create_dir_all(&dir)?;
            crate::run(
                Command::new("npm").arg("install").arg("--prefix").arg(&dir).args(["--no-audit", "--no-fund"]).arg(format!("binaryen@{BINARYEN_NPM_VERSION}")),
            )
        });
        if let Err(e) = installed {
            eprintln!("xtask: npm's binaryen {BINARYEN_NPM_VERSION} not installed ({e:#}); the page is built with Debian's wasm-opt alone");
        }
    }
    Ok(())
}

/// Builds the page's `pkg/`: the `.wasm` (profile `playground`: size over speed), its glue, the
/// embedded module and the example policies. Returns the size of the `.wasm` the page embeds.
pub fn build(root: &Path) -> Result<u64> {
    crate::run(
        crate::cargo()
            .current_dir(root)
            .args(["build", "--profile", "playground", "--target", TARGET, "--package", "sluice-playground"])
            .env("CARGO_TARGET_WASM32_UNKNOWN_UNKNOWN_RUSTFLAGS", remap_path_prefixes(root)),
    )?;
    let built = root.join("target").join(TARGET).join("playground").join("sluice_playground.wasm");
    let staging = root.join("target").join("playground-bindgen");
    std::fs::create_dir_all(&staging)?;
    let out = staging.join("out");
    let wasm = out.join("sluice_playground_bg.wasm");
    // With npm's wasm-opt (132 keeps the externref table wasm-bindgen writes), one pass after
    // wasm-bindgen on rustc's output: what wasm-bindgen left out becomes dead code, and 132 shrinks
    // further than Debian's 108 (a little smaller than 108 before wasm-bindgen and 132 after).
    // `--low-memory-unused`: the page's memory below 1 KiB is never addressed through a pointer
    // that wraps around (Rust's pointers never do), so 132 folds constant offsets into the
    // loads and stores, 4.5 KiB; `--converge` repeats -Oz while it still shrinks. Merging similar
    // functions (the monomorphized copies that differ only in constants) before -Oz, while they are
    // not yet inlined into their callers, 4.7 KB more (after -Oz alone it finds nothing). Then
    // flattening the code and rebuilding its control flow with the relooper (`--flatten
    // --rereloop`) before -Oz: -Oz then finds smaller structures than rustc's, 8.1 KB.
    let newer = newer_wasm_opt();
    if let Some(newer) = &newer {
        bindgen(&built, &out)?;
        let again = staging.join("sluice_playground_bg.opt.wasm");
        let passes = [
            "--low-memory-unused",
            "--merge-similar-functions",
            "--duplicate-function-elimination",
            "--merge-similar-functions",
            "--flatten",
            "--rereloop",
            "-Oz",
            "--converge",
            "--strip-producers",
            "--strip-target-features",
        ];
        match crate::run(Command::new(newer).args(passes).args(FEATURES).arg(&wasm).arg("-o").arg(&again)) {
            Ok(()) => std::fs::rename(&again, &wasm)?,
            Err(e) => {
                eprintln!("xtask: npm's wasm-opt failed ({e:#}); Debian's runs before wasm-bindgen instead");
                debian_then_bindgen(&built, &staging, &out)?;
            }
        }
    } else {
        debian_then_bindgen(&built, &staging, &out)?;
    }
    let bytes = std::fs::read(&wasm).with_context(|| format!("reading {}", wasm.display()))?;
    let pkg = root.join("examples/playground/pkg");
    std::fs::create_dir_all(&pkg)?;
    std::fs::copy(out.join("sluice_playground.js"), pkg.join("sluice_playground.js"))?;
    let embedded = format!(
        "// Generated by `cargo xtask playground`: the playground's .wasm ({} bytes), embedded so that the page needs no fetch (blocked on file://).\nself.SLUICE_PLAYGROUND_WASM = \"{}\";\n",
        bytes.len(),
        base64(&bytes)
    );
    std::fs::write(pkg.join("wasm.js"), embedded)?;
    std::fs::write(pkg.join("examples.js"), examples_js(root)?)?;
    let size = bytes.len() as u64;
    eprintln!("xtask: playground built: {} ({} KiB of wasm); open examples/playground/index.html", pkg.display(), size / 1024);
    Ok(size)
}

/// The plugins' path prefixes (crate::remap_path_prefixes: page bytes that do not depend on where
/// the checkout sits), and each registry's source directory as `/crates`: the panic locations the
/// page carries (a file name per bounds check that may fail) are that much shorter, 0.7 KiB.
fn remap_path_prefixes(root: &Path) -> String {
    let mut remap = crate::remap_path_prefixes(root);
    let cargo_home = std::env::var_os("CARGO_HOME").map(PathBuf::from).or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")));
    let registries = cargo_home.and_then(|home| std::fs::read_dir(home.join("registry/src")).ok());
    // rustc applies the last prefix that matches: these come after the cargo home's.
    for dir in registries.into_iter().flatten().filter_map(|e| e.ok()) {
        remap = format!("{remap} --remap-path-prefix={}=/crates", dir.path().display());
    }
    remap
}

/// Features rustc enables for this target by default; wasm-opt must accept them to keep them.
const FEATURES: [&str; 6] = [
    "--enable-bulk-memory",
    "--enable-sign-ext",
    "--enable-mutable-globals",
    "--enable-nontrapping-float-to-int",
    "--enable-reference-types",
    "--enable-multivalue",
];

/// wasm-bindgen's glue and module for `wasm`, into `out`.
fn bindgen(wasm: &Path, out: &Path) -> Result<()> {
    crate::run(Command::new("wasm-bindgen").arg("--target").arg("no-modules").arg("--no-typescript").arg("--out-dir").arg(out).arg(wasm))
}

/// Without npm's binaryen: Debian's wasm-opt, before wasm-bindgen (108 breaks the externref table
/// that wasm-bindgen 0.2.130 writes when it runs after it: the page then fails to instantiate).
fn debian_then_bindgen(built: &Path, staging: &Path, out: &Path) -> Result<()> {
    let optimized = staging.join("sluice_playground.wasm");
    let input = match crate::run(Command::new("wasm-opt").arg("-Oz").args(FEATURES).arg(built).arg("-o").arg(&optimized)) {
        Ok(()) => optimized,
        Err(e) => {
            eprintln!("xtask: wasm-opt failed ({e:#}); the page embeds rustc's output as it is");
            built.to_path_buf()
        }
    };
    bindgen(&input, out)
}

/// `self.SLUICE_EXAMPLES = {policies: {plugin: {file: text}}, workload: text}` from `policies/` and
/// `examples/playground/example.workload.json`.
fn examples_js(root: &Path) -> Result<String> {
    let mut policies = serde_json::Map::new();
    let mut entries: Vec<PathBuf> = std::fs::read_dir(root.join("policies"))?.filter_map(|e| e.ok().map(|e| e.path())).collect();
    entries.sort();
    for plugin in PLUGINS {
        let mut files = serde_json::Map::new();
        for path in &entries {
            let Some(name) = path.file_name().and_then(|n| n.to_str()) else { continue };
            if name.starts_with(&format!("{plugin}.")) && name.ends_with(".json") && !name.ends_with(".schema.json") {
                files.insert(name.to_string(), std::fs::read_to_string(path)?.into());
            }
        }
        if files.is_empty() {
            bail!("no example policy of {plugin} in policies/");
        }
        policies.insert(plugin.to_string(), files.into());
    }
    let workload = std::fs::read_to_string(root.join("examples/playground/example.workload.json"))?;
    let examples = serde_json::json!({ "policies": policies, "workload": workload });
    Ok(format!("// Generated by `cargo xtask playground` from policies/ and examples/playground/example.workload.json.\nself.SLUICE_EXAMPLES = {examples};\n"))
}

/// Standard base64 with padding (RFC 4648), for the embedded module.
fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [chunk.first().copied().unwrap_or(0), chunk.get(1).copied().unwrap_or(0), chunk.get(2).copied().unwrap_or(0)];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for (i, shift) in [18u32, 12, 6, 0].into_iter().enumerate() {
            if i <= chunk.len() {
                out.push(char::from(ALPHABET[((n >> shift) & 63) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn base64_matches_rfc_4648_vectors() {
        for (input, expected) in [("", ""), ("f", "Zg=="), ("fo", "Zm8="), ("foo", "Zm9v"), ("foob", "Zm9vYg=="), ("fooba", "Zm9vYmE="), ("foobar", "Zm9vYmFy")]
        {
            assert_eq!(super::base64(input.as_bytes()), expected);
        }
    }
}
