//! `cargo test --workspace`'s test binaries, run two at a time.
//!
//! Most of the suite's wall time is binaries that wait: Envoy, Redis, Prometheus and the mock
//! streaming in real time (the fleet, soak, rules and cluster suites alone are ≈ 3 minutes of
//! waiting). cargo runs test binaries one after another; here the binaries cargo built are run in
//! two lanes instead, longest first (durations of the last run, kept in
//! `target/xtask/test-times.json`; a first run orders by a list of the known long ones), each with
//! the working directory and `CARGO_MANIFEST_DIR` cargo gives it. The binaries that judge timing
//! against real Envoy under a CPU budget (`SOLO`) run afterwards, alone. Doc tests run last, through
//! cargo. Each binary's output is kept and printed whole when it fails; one line per binary
//! otherwise. A binary that fails in a lane runs again alone after the lanes, as cargo would have
//! run it: it fails the phase only if it fails there too.
//!
//! Runs of some binaries again under other settings (the harness suites against `sluice.wasm`, the
//! Envoy matrix's older versions) are jobs of the same lanes ([`Rerun`]).

use anyhow::{bail, Context, Result};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Test binaries that run alone, after the lanes: their verdicts depend on Envoy keeping real time
/// on a loaded machine (the simulator's fidelity replays fail at a load average of ≈ 3).
const SOLO: &[&str] = &["sim_fidelity"];

/// Known long binaries, longest first: the order of a run without recorded durations.
const KNOWN_LONG: &[&str] = &[
    "budget_fleet",
    "soak",
    "observability_rules",
    "cluster",
    "latency_guard_envoy",
    "lifecycle_envoy",
    "faults_envoy",
    "envoy",
    "sse_props",
    "security_envoy",
];

/// Lanes: the machine's two cores (more would only queue on them).
const LANES: usize = 2;

/// One test binary cargo built, and the variables of this run of it.
#[derive(Debug, Clone)]
struct Binary {
    /// `package/kind/name` (and the rerun's label), the key of its recorded duration.
    id: String,
    name: String,
    executable: PathBuf,
    package_dir: PathBuf,
    env: Vec<(String, String)>,
}

/// The binaries named `names` run again with `env` set, labelled `label`.
pub struct Rerun {
    pub label: String,
    pub names: Vec<&'static str>,
    pub env: Vec<(String, String)>,
}

/// What one binary's run gave.
struct Ran {
    binary: Binary,
    seconds: f64,
    ok: bool,
    output: String,
    /// From its `test result:` line: passed, failed, ignored.
    counts: (u64, u64, u64),
}

/// Runs the test binaries of `cargo` (a `cargo test --workspace` command, environment set) in
/// lanes, then the solo ones, then the doc tests. Fails when any binary failed, naming them.
/// `before_solo` runs when the lanes are done, before the solo binaries (it waits for work started
/// beside the lanes).
pub fn run(root: &Path, cargo: impl Fn() -> Command, reruns: &[Rerun], before_solo: impl FnOnce()) -> Result<()> {
    let mut binaries = list(root, &cargo)?;
    for rerun in reruns {
        let again: Vec<Binary> = binaries
            .iter()
            .filter(|b| rerun.names.contains(&b.name.as_str()) && b.env.is_empty())
            .map(|b| Binary { id: format!("{} ({})", b.id, rerun.label), env: rerun.env.clone(), ..b.clone() })
            .collect();
        if again.len() != rerun.names.len() {
            bail!("{}: found {} of the test binaries {:?}", rerun.label, again.len(), rerun.names);
        }
        binaries.extend(again);
    }
    let times_path = root.join("target/xtask/test-times.json");
    let mut times: BTreeMap<String, f64> =
        std::fs::read_to_string(&times_path).ok().and_then(|s| serde_json::from_str::<BTreeMap<String, f64>>(&s).ok()).unwrap_or_default();
    let expected =
        |b: &Binary| -> f64 { times.get(&b.id).copied().unwrap_or_else(|| KNOWN_LONG.iter().position(|n| *n == b.name).map_or(1.0, |p| 1000.0 - p as f64)) };
    let (solo, mut queue): (Vec<Binary>, Vec<Binary>) = binaries.into_iter().partition(|b| SOLO.contains(&b.name.as_str()));
    // Popped from the end, longest first: the lanes end close together.
    queue.sort_by(|a, b| expected(a).total_cmp(&expected(b)));
    eprintln!("xtask: {} test binaries in {LANES} lanes, then {} alone, then the doc tests", queue.len(), solo.len());

    let env = environment(&cargo());
    let started = Instant::now();
    let queue = Arc::new(Mutex::new(queue));
    let done: Arc<Mutex<Vec<Ran>>> = Arc::new(Mutex::new(Vec::new()));
    let lanes: Vec<_> = (0..LANES)
        .map(|_| {
            let (queue, done, env) = (queue.clone(), done.clone(), env.clone());
            std::thread::spawn(move || loop {
                let Some(binary) = queue.lock().unwrap_or_else(|e| e.into_inner()).pop() else { break };
                let ran = run_binary(binary, &env);
                report(&ran);
                done.lock().unwrap_or_else(|e| e.into_inner()).push(ran);
            })
        })
        .collect();
    for lane in lanes {
        if lane.join().is_err() {
            bail!("a test lane panicked");
        }
    }
    eprintln!("xtask: lanes done in {:.1} s", started.elapsed().as_secs_f64());
    before_solo();
    let mut ran = std::mem::take(&mut *done.lock().unwrap_or_else(|e| e.into_inner()));
    // A binary that failed beside another runs again alone, as cargo would have run it: the lanes
    // must not make a test fail that passes on its own (timing tests on a loaded 2-core machine).
    // One that fails alone too is a failure; one that passes alone is said so, loudly, with the
    // first failure's output above.
    for r in ran.iter_mut().filter(|r| !r.ok) {
        let again = run_binary(r.binary.clone(), &env);
        if again.ok {
            eprintln!("xtask: RETRIED {} alone: passed ({:.1} s); it failed beside another binary (its output above)", again.binary.id, again.seconds);
        }
        report(&again);
        *r = again;
    }
    for binary in solo {
        let one = run_binary(binary, &env);
        report(&one);
        ran.push(one);
    }

    for r in &ran {
        times.insert(r.binary.id.clone(), (r.seconds * 10.0).round() / 10.0);
    }
    if let Some(dir) = times_path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&times_path, serde_json::to_string_pretty(&times)?)?;

    let doc = crate::run(cargo().args(["--doc"]));
    let (passed, failed, ignored) = ran.iter().fold((0, 0, 0), |(p, f, i), r| (p + r.counts.0, f + r.counts.1, i + r.counts.2));
    eprintln!("xtask: test binaries: {passed} passed, {failed} failed, {ignored} ignored ({} binaries)", ran.len());
    let failures: Vec<&str> = ran.iter().filter(|r| !r.ok).map(|r| r.binary.id.as_str()).collect();
    if !failures.is_empty() {
        bail!("test binaries failed: {}", failures.join(", "));
    }
    doc
}

/// The test binaries `cargo test --workspace` runs (lib, bin and test targets), as cargo built them
/// (`--no-run`: the build is the phase before).
fn list(root: &Path, cargo: &impl Fn() -> Command) -> Result<Vec<Binary>> {
    let out = crate::output(cargo().args(["--no-run", "--message-format=json"]))?;
    let mut binaries = Vec::new();
    for line in out.lines() {
        let Ok(message) = serde_json::from_str::<Value>(line) else { continue };
        if message["reason"] != "compiler-artifact" || message["profile"]["test"] != true {
            continue;
        }
        let Some(executable) = message["executable"].as_str() else { continue };
        let name = message["target"]["name"].as_str().unwrap_or_default().to_string();
        let kind = message["target"]["kind"][0].as_str().unwrap_or_default();
        let manifest = PathBuf::from(message["manifest_path"].as_str().context("cargo's artifact message has no manifest_path")?);
        let package_dir = manifest.parent().unwrap_or(root).to_path_buf();
        let package = package_dir.strip_prefix(root).unwrap_or(&package_dir).display().to_string();
        binaries.push(Binary { id: format!("{package}/{kind}/{name}"), name, executable: executable.into(), package_dir, env: Vec::new() });
    }
    if binaries.is_empty() {
        bail!("cargo listed no test binaries");
    }
    Ok(binaries)
}

/// The variables `cargo` was given (SLUICE_ENVOY and the others the tests read).
fn environment(cargo: &Command) -> Vec<(String, String)> {
    cargo
        .get_envs()
        .filter_map(|(k, v)| Some((k.to_str()?.to_string(), v?.to_str()?.to_string())))
        .filter(|(k, _)| !matches!(k.as_str(), "RUSTC_WORKSPACE_WRAPPER" | "CLIPPY_ARGS"))
        .collect()
}

fn run_binary(binary: Binary, env: &[(String, String)]) -> Ran {
    let started = Instant::now();
    let result = Command::new(&binary.executable)
        .current_dir(&binary.package_dir)
        .env("CARGO_MANIFEST_DIR", &binary.package_dir)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .envs(binary.env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .output();
    let seconds = started.elapsed().as_secs_f64();
    let (ok, output) = match result {
        Ok(out) => (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))),
        Err(e) => (false, format!("could not start {}: {e}", binary.executable.display())),
    };
    let counts = counts(&output);
    Ran { binary, seconds, ok, output, counts }
}

/// Passed, failed and ignored from a test binary's `test result:` line.
fn counts(output: &str) -> (u64, u64, u64) {
    let Some(line) = output.lines().rev().find(|l| l.starts_with("test result:")) else { return (0, 0, 0) };
    let number = |label: &str| -> u64 {
        line.split(';')
            .find_map(|part| {
                part.trim().trim_start_matches("test result: ok.").trim_start_matches("test result: FAILED.").trim().strip_suffix(label)?.trim().parse().ok()
            })
            .unwrap_or(0)
    };
    (number("passed"), number("failed"), number("ignored"))
}

fn report(ran: &Ran) {
    let (passed, failed, ignored) = ran.counts;
    if ran.ok {
        eprintln!("xtask: ok     {:<60} {passed:>4} passed {ignored:>2} ignored {:>7.1} s", ran.binary.id, ran.seconds);
    } else {
        eprintln!("xtask: FAILED {:<60} {passed:>4} passed {failed:>2} failed {:>7.1} s — its output:", ran.binary.id, ran.seconds);
        eprintln!("{}", ran.output);
    }
}

#[cfg(test)]
mod tests {
    use super::counts;

    #[test]
    fn counts_are_read_from_the_result_line() {
        let ok = "running 3 tests\ntest result: ok. 2 passed; 0 failed; 1 ignored; 0 measured; 0 filtered out; finished in 0.01s\n";
        assert_eq!(counts(ok), (2, 0, 1));
        let failed = "test result: FAILED. 5 passed; 2 failed; 0 ignored; 0 measured; 0 filtered out; finished in 3.20s";
        assert_eq!(counts(failed), (5, 2, 0));
        assert_eq!(counts("thread 'main' panicked"), (0, 0, 0));
    }
}
