//! `cargo xtask bench --sim [REQUESTS]`: the simulator's speed on the Azure conversation trace
//! (the demo scenario) and on a synthetic day of REQUESTS requests (default 1,000,000) shaped like
//! a platform's day: a diurnal arrival rate, 24 tenants by Zipf weight, two model versions split
//! 70/30 and sticky per tenant, a one-hour TTFT incident on v1 that opens its breaker, minute and
//! day budgets that bind for the busiest tenants. Each at 1 and 16 tokens per SSE event, with
//! `--no-report`, on each host of the flows (`--host wasm`: sluice.wasm under wasmtime; `--host
//! native`: the flows compiled in; `cargo xtask bench --sim [REQUESTS] --host H` runs one); prints
//! requests/s, wall time and the simulator's peak resident memory — for the Azure trace the median
//! of five runs and their spread, for the day one run.
//!
//! `cargo xtask bench --sim --instructions` instead counts what the native host executes for the
//! whole Azure hour at 1 and 16 tokens per event (valgrind's count): the figure that does not move
//! with the machine's pace from one hour to the next, as its wall time does.

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use std::io::{BufRead as _, Write as _};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const DAY_MS: f64 = 86_400_000.0;
/// The day's rate swings ±60 % around its mean: lowest at 03:00, highest at 15:00.
const DIURNAL_AMPLITUDE: f64 = 0.6;
const TENANTS: usize = 24;
/// Runs of each Azure row (about a second each natively): single runs on a shared machine move by
/// ±15 %, so the row gives their median and spread. The day (minutes) runs once.
const AZURE_RUNS: usize = 5;

const AZURE_ROW: &str = "Azure conversation trace (1 h), demo scenario";

/// What both benches start from: the simulator built, its bench directory, the demo scenario (its
/// policies' paths made absolute), the Azure trace.
struct Setup {
    dir: PathBuf,
    demo: Value,
    azure: PathBuf,
}

fn setup(root: &Path) -> Result<Setup> {
    crate::run(crate::cargo().current_dir(root).args(["build", "--release", "--package", "sluice-sim"]))?;
    let dir = root.join("target/sim-bench");
    std::fs::create_dir_all(&dir)?;
    let demo: Value = serde_json::from_str(&std::fs::read_to_string(root.join("examples/sim/demo.scenario.json"))?)?;
    Ok(Setup { dir, demo: absolute_policy_paths(root, demo), azure: root.join("sim/traces/azure-2023-conv/azure-2023-conv.csv") })
}

/// `scenario` at `per_event` tokens per SSE event, written as `scenario-<stem>-<per_event>.json`.
fn write_scenario(dir: &Path, stem: &str, scenario: &Value, per_event: u64) -> Result<PathBuf> {
    let mut scenario = scenario.clone();
    scenario["tokens_per_event"] = per_event.into();
    let path = dir.join(format!("scenario-{stem}-{per_event}.json"));
    std::fs::write(&path, serde_json::to_string_pretty(&scenario)?)?;
    Ok(path)
}

pub fn bench_sim(root: &Path, requests: u64, hosts: &[&str]) -> Result<()> {
    let Setup { dir, demo, azure } = setup(root)?;
    let day = dir.join("synthetic-day.jsonl");
    write_synthetic_day(&day, requests)?;
    let day_scenario = day_scenario(root, &dir, demo.clone())?;
    let runs = [("azure", AZURE_ROW, &azure, &demo, AZURE_RUNS), ("day", "synthetic day (24 h, 24 tenants, diurnal, incident)", &day, &day_scenario, 1)];
    println!("| trace | tokens per event | host | requests | runs | wall s (median) | requests/s (median) | requests/s (min – max) | peak RSS MiB |\n|---|---|---|---|---|---|---|---|---|");
    for (stem, name, trace, scenario, runs) in runs {
        for (per_event, host) in [1u64, 16].into_iter().flat_map(|n| hosts.iter().map(move |h| (n, *h))) {
            let path = write_scenario(&dir, stem, scenario, per_event)?;
            let out = dir.join("out");
            let (mut seconds, mut peak_kib) = (Vec::new(), 0u64);
            for _ in 0..runs {
                // The last run's verdicts (1.7 GB for the day at 16 tokens an event) go before the
                // clock starts: truncating them was timed as the next run's.
                remove_if_present(&out.join("verdicts.jsonl"))?;
                let mut cmd = Command::new(root.join("target/release/sluice-sim"));
                cmd.args(["run", "-q", "--no-report", "--host", host, "--scenario"]).arg(&path).arg("--trace").arg(trace).arg("--out").arg(&out);
                let (s, kib) = timed_with_peak_rss(&mut cmd).with_context(|| format!("sluice-sim on {name}"))?;
                seconds.push(s);
                peak_kib = peak_kib.max(kib);
            }
            // Every run gives the same verdicts: the last run's are counted.
            let n = count_lines(&out.join("verdicts.jsonl"))?;
            let Spread { median, min, max } = spread(&seconds).context("no run")?;
            let rate = |s: f64| n as f64 / s;
            println!(
                "| {name} | {per_event} | {host} | {n} | {runs} | {median:.2} | {:.0} | {:.0} – {:.0} | {:.0} |",
                rate(median),
                rate(max),
                rate(min),
                peak_kib as f64 / 1024.0
            );
        }
    }
    Ok(())
}

/// `--instructions`: the instructions the native host executes for the whole Azure hour under the
/// demo scenario at 1 and 16 tokens per event (`valgrind --tool=cachegrind --cache-sim=no`, which
/// counts without simulating caches; a few minutes), and per request. The same on every run of one
/// build on one machine, so two builds compare without pairing runs.
pub fn instructions(root: &Path) -> Result<()> {
    let Setup { dir, demo, azure } = setup(root)?;
    println!("| trace | tokens per event | host | requests | instructions | per request |\n|---|---|---|---|---|---|");
    for per_event in [1u64, 16] {
        let path = write_scenario(&dir, "azure", &demo, per_event)?;
        let out = dir.join("out-instructions");
        remove_if_present(&out.join("verdicts.jsonl"))?;
        let run = Command::new("valgrind")
            .args(["--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null"])
            .arg(root.join("target/release/sluice-sim"))
            .args(["run", "-q", "--no-report", "--host", "native", "--scenario"])
            .arg(&path)
            .arg("--trace")
            .arg(&azure)
            .arg("--out")
            .arg(&out)
            .output()
            .context("running valgrind")?;
        let stderr = String::from_utf8_lossy(&run.stderr);
        if !run.status.success() {
            bail!("sluice-sim under valgrind exited with {}: {stderr}", run.status);
        }
        let count = instruction_count(&stderr).with_context(|| format!("no instruction count in valgrind's output: {stderr}"))?;
        let n = count_lines(&out.join("verdicts.jsonl"))?;
        println!("| {AZURE_ROW} | {per_event} | native | {n} | {count} | {:.0} |", count as f64 / n.max(1) as f64);
    }
    Ok(())
}

/// The count in cachegrind's summary line (`==PID== I   refs:      9,183,276,656`).
fn instruction_count(valgrind_stderr: &str) -> Option<u64> {
    valgrind_stderr.lines().find_map(|line| {
        let (label, count) = line.split_once("refs:")?;
        label.trim_end().ends_with(" I").then(|| count.trim().replace(',', "").parse().ok()).flatten()
    })
}

/// Runs `cmd` to its end; its wall time (from spawning it to reaping it) and peak resident set
/// (`VmHWM`, a high-water mark the kernel keeps, read every 20 ms by another thread while it runs:
/// only growth in its last 20 ms could be missed).
fn timed_with_peak_rss(cmd: &mut Command) -> Result<(f64, u64)> {
    let started = Instant::now();
    let mut child = cmd.spawn()?;
    let status_file = PathBuf::from(format!("/proc/{}/status", child.id()));
    let done = Arc::new(AtomicBool::new(false));
    let sampler = {
        let done = Arc::clone(&done);
        std::thread::spawn(move || {
            let mut peak_kib = 0u64;
            while !done.load(Ordering::Relaxed) {
                if let Some(kib) = std::fs::read_to_string(&status_file).ok().and_then(|s| vm_hwm_kib(&s)) {
                    peak_kib = peak_kib.max(kib);
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            peak_kib
        })
    };
    let status = child.wait();
    let seconds = started.elapsed().as_secs_f64();
    done.store(true, Ordering::Relaxed);
    let peak_kib = sampler.join().unwrap_or(0);
    let status = status?;
    if !status.success() {
        bail!("exited with {status}");
    }
    Ok((seconds, peak_kib))
}

/// The median, least and greatest of some run times.
#[derive(Debug, PartialEq)]
struct Spread {
    median: f64,
    min: f64,
    max: f64,
}

/// `None` for no runs; the median of an even count is the mean of the middle two.
fn spread(seconds: &[f64]) -> Option<Spread> {
    let mut sorted = seconds.to_vec();
    sorted.sort_by(f64::total_cmp);
    let (min, max) = (*sorted.first()?, *sorted.last()?);
    let mid = sorted.len() / 2;
    let median = if sorted.len() % 2 == 1 { sorted[mid] } else { (sorted[mid - 1] + sorted[mid]) / 2.0 };
    Some(Spread { median, min, max })
}

fn remove_if_present(path: &Path) -> Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e).with_context(|| format!("removing {}", path.display())),
        _ => Ok(()),
    }
}

/// Lines of a file read in pieces (the day's verdicts do not fit a string comfortably).
fn count_lines(path: &Path) -> Result<usize> {
    let mut file = std::io::BufReader::with_capacity(1 << 20, std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?);
    let mut lines = 0usize;
    loop {
        let buffer = file.fill_buf()?;
        if buffer.is_empty() {
            return Ok(lines);
        }
        lines += buffer.iter().filter(|&&b| b == b'\n').count();
        let read = buffer.len();
        file.consume(read);
    }
}

fn vm_hwm_kib(status: &str) -> Option<u64> {
    status.lines().find_map(|l| l.strip_prefix("VmHWM:")).and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

/// The demo scenario's policy paths (relative to examples/sim/) made absolute.
fn absolute_policy_paths(root: &Path, mut scenario: Value) -> Value {
    for (_, policy) in scenario["plugins"].as_object_mut().into_iter().flatten() {
        if let Some(rel) = policy.as_str() {
            *policy = root.join("examples/sim").join(rel).display().to_string().into();
        }
    }
    scenario
}

/// The day's scenario: the demo's upstreams and guard, 24 tenants, a 70/30 split, a budget
/// policy with a key per tenant, and an hour of four times the TTFT on v1 at 10:00.
fn day_scenario(root: &Path, dir: &Path, mut scenario: Value) -> Result<Value> {
    let tenants: Vec<String> = (1..=TENANTS).map(|i| format!("t{i:02}")).collect();
    scenario["name"] = "synthetic day".into();
    scenario["traffic"]["tenants"] = tenants.iter().map(|t| json!({ "name": t })).collect();
    scenario["incidents"] = json!([{ "upstream": "llama-v1", "from_s": 36_000, "to_s": 39_600, "ttft_factor": 4 }]);

    let mut router: Value = serde_json::from_str(&std::fs::read_to_string(root.join("policies/model-router.demo.json"))?)?;
    let versions = router["models"][0]["versions"].as_array_mut().context("model-router.demo.json: models[0].versions")?;
    for (version, weight) in versions.iter_mut().zip([70, 30]) {
        version["weight"] = weight.into();
    }
    let router_path = dir.join("day.model-router.json");
    std::fs::write(&router_path, serde_json::to_string_pretty(&router)?)?;
    scenario["plugins"]["model_router"] = router_path.display().to_string().into();

    // Mean ≈ 1,900 tokens a request: at 1M requests a day the busiest tenant (Zipf share ≈ 27 %)
    // sends ≈ 570,000 tokens a minute at the afternoon peak, the fifth ≈ 110,000.
    let orgs: Vec<Value> = tenants
        .iter()
        .map(|t| {
            json!({ "id": t, "teams": [{ "id": format!("{t}-api"), "keys": [{ "id": t, "budgets": [
                { "window": "minute", "tokens": 200_000 },
                { "window": "day", "usd": 100 }
            ] }] }] })
        })
        .collect();
    let budget = json!({
        "mode": "strict",
        "identity": { "header": "x-sluice-tenant" },
        "unknown": { "action": "reject" },
        "include_usage": true,
        "default_max_output_tokens": 4096,
        "prices": [{ "model": "llama-3-70b*", "input_usd_per_mtok": 0.59, "output_usd_per_mtok": 0.79 }],
        "orgs": orgs,
    });
    let budget_path = dir.join("day.tenant-budget.json");
    std::fs::write(&budget_path, serde_json::to_string_pretty(&budget)?)?;
    scenario["plugins"]["tenant_budget"] = budget_path.display().to_string().into();
    Ok(scenario)
}

/// `requests` requests over 24 hours in sluice-sim's generic format: arrivals at the quantiles of
/// a diurnal rate `1 + A·sin(2π(t − 9 h)/24 h)` (so the gaps follow the rate, deterministically),
/// sizes drawn deterministically (log-uniform prompts of 64–8,192 tokens, outputs of 8–1,024;
/// 80 % streamed). No tenant: the scenario's Zipf weights pick it.
fn write_synthetic_day(path: &Path, requests: u64) -> Result<()> {
    let mut out = std::io::BufWriter::new(std::fs::File::create(path)?);
    let mut state = 0x5eed_u64;
    let mut draw = || {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (state >> 11) as f64 / (1u64 << 53) as f64
    };
    let n = requests.max(1) as f64;
    let mut t_ms = 0.0;
    for i in 0..requests {
        t_ms = arrival_at_quantile((i as f64 + 0.5) / n, t_ms);
        let prompt = (64.0 * 128f64.powf(draw())).round() as u64;
        let output = (8.0 * 128f64.powf(draw())).round() as u64;
        let stream = draw() < 0.8;
        writeln!(out, r#"{{"t_ms": {t_ms:.3}, "prompt_tokens": {prompt}, "output_tokens": {output}, "max_tokens": {output}, "stream": {stream}}}"#)?;
    }
    out.flush()?;
    Ok(())
}

/// The share of a day's requests that arrived by `t_ms` under the diurnal rate.
fn arrivals_by(t_ms: f64) -> f64 {
    let phase = 9.0 * 3_600_000.0;
    let w = std::f64::consts::TAU / DAY_MS;
    (t_ms - DIURNAL_AMPLITUDE / w * ((w * (t_ms - phase)).cos() - (w * -phase).cos())) / DAY_MS
}

/// The time by which a share `q` of the day's requests arrived (bisection; `from` is a lower bound,
/// the previous arrival, as `q` only grows).
fn arrival_at_quantile(q: f64, from: f64) -> f64 {
    let (mut lo, mut hi) = (from, DAY_MS);
    for _ in 0..60 {
        let mid = (lo + hi) / 2.0;
        if arrivals_by(mid) < q {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    (lo + hi) / 2.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_instruction_count_is_read_from_cachegrinds_summary() {
        let stderr = "==23656== Cachegrind, a high-precision tracing profiler\n==23656== \n==23656== I   refs:      9,183,276,656\n";
        assert_eq!(instruction_count(stderr), Some(9_183_276_656));
        assert_eq!(instruction_count("==1== D   refs:      12\n"), None);
        assert_eq!(instruction_count("==1== I   refs:      many\n"), None);
        assert_eq!(instruction_count(""), None);
    }

    #[test]
    fn the_day_is_diurnal_and_whole() {
        assert!(arrivals_by(0.0).abs() < 1e-12);
        assert!((arrivals_by(DAY_MS) - 1.0).abs() < 1e-12);
        // Rate at 15:00 is (1 + A) / (1 − A) = 4 times the rate at 03:00: compare an hour's share.
        let hour = 3_600_000.0;
        let afternoon = arrivals_by(15.5 * hour) - arrivals_by(14.5 * hour);
        let night = arrivals_by(3.5 * hour) - arrivals_by(2.5 * hour);
        assert!((afternoon / night - 4.0).abs() < 0.05, "{afternoon} / {night}");
        let median = arrival_at_quantile(0.5, 0.0);
        assert!((arrivals_by(median) - 0.5).abs() < 1e-9);
    }

    #[test]
    fn lines_are_counted_across_reads() {
        let dir = std::env::temp_dir().join(format!("sluice-simbench-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("lines");
        let line = "x".repeat(1000) + "\n";
        std::fs::write(&path, line.repeat(3000)).unwrap();
        assert_eq!(count_lines(&path).unwrap(), 3000);
        remove_if_present(&path).unwrap();
        remove_if_present(&path).unwrap();
        assert!(count_lines(&path).is_err());
        std::fs::remove_dir(&dir).unwrap();
    }

    #[test]
    fn a_rows_figure_is_the_median_of_its_runs() {
        assert_eq!(spread(&[1.2, 0.9, 1.0]), Some(Spread { median: 1.0, min: 0.9, max: 1.2 }));
        assert_eq!(spread(&[1.0, 0.8, 1.4, 0.9]), Some(Spread { median: 0.95, min: 0.8, max: 1.4 }));
        assert_eq!(spread(&[0.7]), Some(Spread { median: 0.7, min: 0.7, max: 0.7 }));
        assert_eq!(spread(&[]), None);
    }

    #[test]
    fn peak_rss_is_read_from_the_status_file() {
        assert_eq!(vm_hwm_kib("Name:\tsim\nVmPeak:\t  9 kB\nVmHWM:\t   51234 kB\nVmRSS:\t 1 kB\n"), Some(51234));
        assert_eq!(vm_hwm_kib("Name:\tsim\n"), None);
    }
}
