//! `cargo xtask fuzz [--target NAME] [--time SECS | --runs N] [--jobs N] | --smoke`: the cargo-fuzz targets of
//! `fuzz/` (docs/fuzzing.md), each with its budget, and a table of the executions each reached.
//!
//! Setup is part of the command: the nightly toolchain (cargo-fuzz's sanitizer-coverage flags need
//! it) and cargo-fuzz are installed only when missing. The targets are built once with cargo-fuzz
//! (release, debug assertions on so an arithmetic overflow is a finding, no sanitizer: the code
//! under test has no `unsafe`), then each binary runs with its corpus in `fuzz/corpus/<target>`
//! and the committed seeds of `fuzz/seeds/<target>` (`fuzz/json.dict` as its dictionary). A
//! finding is written to `fuzz/artifacts/<target>/` and fails the command.
//!
//! [`smoke`] is the short run of every target in `cargo xtask test`.

use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Every target in fuzz/Cargo.toml.
pub const TARGETS: &[&str] = &[
    "sse_stream",
    "stream_event",
    "request",
    "rewrite",
    "usage_stripper",
    "json",
    "identity",
    "budget_policy",
    "latency_policy",
    "routing_policy",
    "metrics_config",
    "sim_trace",
    "sim_access_log",
];

/// The full run's default: the aim of docs/fuzzing.md, per target.
const DEFAULT_RUNS: u64 = 10_000_000;

/// The smoke run: executions per target (seeds first), on a fresh corpus so it costs the same each
/// time.
const SMOKE_RUNS: u64 = 30_000;

#[derive(Debug, Clone, Copy)]
enum Budget {
    Time(u64),
    Runs(u64),
}

/// What one target's run reached.
#[derive(Debug)]
struct Outcome {
    target: &'static str,
    executions: Option<u64>,
    elapsed: Duration,
    /// The crash file libFuzzer wrote, or why the run failed otherwise.
    finding: Option<String>,
}

fn usage() -> String {
    format!("usage: cargo xtask fuzz [--target NAME] [--time SECS | --runs N] [--jobs N] | --smoke\ntargets: {}", TARGETS.join(", "))
}

/// `cargo xtask fuzz …`.
pub fn command(root: &Path, args: &[String]) -> Result<()> {
    if args.iter().any(|a| a == "--smoke") {
        return smoke(root);
    }
    let mut targets: Vec<&'static str> = Vec::new();
    let mut budget = Budget::Runs(DEFAULT_RUNS);
    let mut jobs = 1usize;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = || it.next().with_context(usage);
        match a.as_str() {
            "--target" => {
                let name = value()?;
                let t = TARGETS.iter().find(|t| *t == name).with_context(|| format!("unknown target {name}\n{}", usage()))?;
                targets.push(t);
            }
            "--time" => budget = Budget::Time(value()?.parse().with_context(usage)?),
            "--runs" => budget = Budget::Runs(value()?.parse().with_context(usage)?),
            "--jobs" => jobs = value()?.parse::<usize>().with_context(usage)?.max(1),
            other => bail!("unknown option {other}\n{}", usage()),
        }
    }
    if targets.is_empty() {
        targets = TARGETS.to_vec();
    }
    let started = Instant::now();
    let binaries = prepare(root, false)?;
    let outcomes = run_all(root, &binaries, &targets, budget, jobs, false)?;
    report(&outcomes, started.elapsed())
}

/// A short run of every target, for `cargo xtask test`: builds them (a no-op when up to date) and
/// runs each for [`SMOKE_RUNS`] executions from the seeds; fails on any finding.
pub fn smoke(root: &Path) -> Result<()> {
    let binaries = prepare(root, false)?;
    smoke_built(root, &binaries)
}

/// The smoke run of targets already built in `binaries` ([`build_in_background`]).
pub fn smoke_built(root: &Path, binaries: &Path) -> Result<()> {
    let started = Instant::now();
    // A fixed number of executions each, so running one per core changes no target's run, only the
    // wall time.
    let jobs = std::thread::available_parallelism().map_or(1, |n| n.get());
    let outcomes = run_all(root, binaries, TARGETS, Budget::Runs(SMOKE_RUNS), jobs, true)?;
    report(&outcomes, started.elapsed())
}

/// [`prepare`] on a thread of its own, the build at the lowest CPU priority (`nice -n 19`): it
/// takes the CPU the tests leave idle while they wait on Envoy and Redis, and yields it to them
/// when they want it. Its output goes to `target/xtask/fuzz-build.log`, shown if it fails.
pub fn build_in_background(root: &Path) -> std::thread::JoinHandle<Result<PathBuf>> {
    let root = root.to_path_buf();
    std::thread::spawn(move || prepare(&root, true))
}

/// Tools when missing, then the build; returns the directory of the target binaries. `quiet`: the
/// build at the lowest CPU priority, its output to a log file.
fn prepare(root: &Path, quiet: bool) -> Result<PathBuf> {
    let toolchains = super::output(Command::new("rustup").args(["toolchain", "list"]))?;
    if !toolchains.lines().any(|l| l.starts_with("nightly")) {
        super::run(Command::new("rustup").args(["toolchain", "install", "nightly", "--profile", "minimal"]))?;
    }
    let has_cargo_fuzz = Command::new("cargo").args(["fuzz", "--version"]).stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok_and(|s| s.success());
    if !has_cargo_fuzz {
        super::run(Command::new("cargo").args(["install", "cargo-fuzz", "--locked"]))?;
    }
    let mut build = if quiet {
        let mut nice = Command::new("nice");
        nice.args(["-n", "19", "cargo"]);
        nice
    } else {
        Command::new("cargo")
    };
    build
        .current_dir(root)
        // The nightly toolchain is chosen by name; the environment cargo gives xtask would pin
        // the stable one.
        .env_remove("RUSTUP_TOOLCHAIN")
        .env_remove("CARGO")
        .env_remove("RUSTC")
        .args(["+nightly", "fuzz", "build", "--fuzz-dir", "fuzz", "-O", "--debug-assertions", "--sanitizer", "none"]);
    if quiet {
        let log = root.join("target/xtask/fuzz-build.log");
        if let Some(dir) = log.parent() {
            std::fs::create_dir_all(dir)?;
        }
        eprintln!("xtask: (in the background, nice 19, output in {}) {}", log.display(), super::describe(&build));
        let out = build.output().with_context(|| format!("could not start {}", super::describe(&build)))?;
        std::fs::write(&log, [out.stdout.as_slice(), out.stderr.as_slice()].concat())?;
        if !out.status.success() {
            bail!("the fuzz targets' build failed with {}:\n{}", out.status, String::from_utf8_lossy(&out.stderr));
        }
    } else {
        super::run(&mut build)?;
    }
    let host = super::output(Command::new("rustc").env_remove("RUSTUP_TOOLCHAIN").args(["+nightly", "-vV"]))?;
    let triple = host.lines().find_map(|l| l.strip_prefix("host: ")).context("rustc -vV names no host")?.trim().to_owned();
    Ok(root.join("fuzz/target").join(triple).join("release"))
}

fn run_all(root: &Path, binaries: &Path, targets: &[&'static str], budget: Budget, jobs: usize, smoke: bool) -> Result<Vec<Outcome>> {
    let next = AtomicUsize::new(0);
    let results = Mutex::new(Vec::new());
    let errors = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..jobs.min(targets.len()) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                let Some(&target) = targets.get(i) else { break };
                match run_target(root, binaries, target, budget, smoke) {
                    Ok(o) => {
                        eprintln!(
                            "xtask: fuzz {target}: {} executions in {:.1} s{}",
                            o.executions.map_or("?".into(), |n| n.to_string()),
                            o.elapsed.as_secs_f64(),
                            o.finding.as_deref().map(|f| format!(", FINDING {f}")).unwrap_or_default()
                        );
                        results.lock().unwrap_or_else(|e| e.into_inner()).push((i, o));
                    }
                    Err(e) => errors.lock().unwrap_or_else(|e| e.into_inner()).push(format!("{target}: {e:#}")),
                }
            });
        }
    });
    let errors = errors.into_inner().unwrap_or_else(|e| e.into_inner());
    if !errors.is_empty() {
        bail!("fuzz targets could not run:\n{}", errors.join("\n"));
    }
    let mut results = results.into_inner().unwrap_or_else(|e| e.into_inner());
    results.sort_by_key(|(i, _)| *i);
    Ok(results.into_iter().map(|(_, o)| o).collect())
}

fn run_target(root: &Path, binaries: &Path, target: &'static str, budget: Budget, smoke: bool) -> Result<Outcome> {
    let fuzz = root.join("fuzz");
    // The smoke run starts from the seeds alone each time, so its cost does not grow with the
    // corpus the long runs collect.
    let corpus = if smoke { fuzz.join("target/smoke-corpus").join(target) } else { fuzz.join("corpus").join(target) };
    if smoke && corpus.exists() {
        std::fs::remove_dir_all(&corpus).with_context(|| format!("clearing {}", corpus.display()))?;
    }
    let artifacts = fuzz.join("artifacts").join(target);
    let logs = fuzz.join("target/logs");
    for dir in [&corpus, &artifacts, &logs] {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let log_path = logs.join(format!("{target}.log"));
    let log = std::fs::File::create(&log_path).with_context(|| format!("creating {}", log_path.display()))?;
    let mut cmd = Command::new(binaries.join(target));
    cmd.arg(format!("-artifact_prefix={}/", artifacts.display()))
        .arg(format!("-dict={}", fuzz.join("json.dict").display()))
        .arg("-print_final_stats=1")
        // One input taking this long is a finding (a hang), not a slow machine.
        .arg("-timeout=30");
    match budget {
        Budget::Time(s) => cmd.arg(format!("-max_total_time={s}")),
        Budget::Runs(n) => cmd.arg(format!("-runs={n}")),
    };
    cmd.arg(&corpus);
    let seeds = fuzz.join("seeds").join(target);
    if seeds.is_dir() {
        cmd.arg(&seeds);
    }
    let started = Instant::now();
    let status = cmd.stdout(Stdio::null()).stderr(log).status().with_context(|| format!("could not start {}", binaries.join(target).display()))?;
    let elapsed = started.elapsed();
    let text = std::fs::read_to_string(&log_path).unwrap_or_default();
    let executions = executions(&text);
    let finding = if status.success() {
        None
    } else {
        let file = text.lines().find_map(|l| l.split_once("Test unit written to ").map(|(_, f)| f.trim().to_owned()));
        Some(file.unwrap_or_else(|| format!("exit {status}, see {}", log_path.display())))
    };
    Ok(Outcome { target, executions, elapsed, finding })
}

/// Executions from libFuzzer's final statistics (`stat::number_of_executed_units: N`), else its
/// last `#N DONE` / `Done N runs` line.
fn executions(log: &str) -> Option<u64> {
    let stat = log.lines().rev().find_map(|l| l.strip_prefix("stat::number_of_executed_units:")).and_then(|n| n.trim().parse().ok());
    stat.or_else(|| {
        log.lines().rev().find_map(|l| {
            let l = l.trim();
            if let Some(rest) = l.strip_prefix("Done ") {
                return rest.split_whitespace().next()?.parse().ok();
            }
            let (count, rest) = l.strip_prefix('#')?.split_once(char::is_whitespace)?;
            rest.trim_start().starts_with("DONE").then(|| count.parse().ok()).flatten()
        })
    })
}

fn report(outcomes: &[Outcome], total: Duration) -> Result<()> {
    println!("{:<16} {:>14} {:>10}  finding", "target", "executions", "seconds");
    for o in outcomes {
        println!(
            "{:<16} {:>14} {:>10.1}  {}",
            o.target,
            o.executions.map_or("?".into(), |n| n.to_string()),
            o.elapsed.as_secs_f64(),
            o.finding.as_deref().unwrap_or("-")
        );
    }
    println!("total wall time {:.1} s", total.as_secs_f64());
    let found: Vec<String> = outcomes.iter().filter_map(|o| o.finding.as_ref().map(|f| format!("{}: {f}", o.target))).collect();
    if !found.is_empty() {
        bail!("fuzzing found {} failing input(s) (each becomes a regression test, docs/fuzzing.md):\n{}", found.len(), found.join("\n"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::executions;

    #[test]
    fn executions_from_final_stats_or_done_line() {
        assert_eq!(
            executions("#1024\tpulse\n#20000\tDONE   cov: 1 ft: 2\nDone 20000 runs in 3 second(s)\nstat::number_of_executed_units: 20001\n"),
            Some(20001)
        );
        assert_eq!(executions("#1024\tpulse\n#20000\tDONE   cov: 1 ft: 2\n"), Some(20000));
        assert_eq!(executions("Done 77 runs in 0 second(s)\n"), Some(77));
        assert_eq!(executions("#1024\tpulse  cov: 3\n"), None);
    }
}
