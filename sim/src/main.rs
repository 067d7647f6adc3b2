//! `sluice-sim`: replay a trace through the production plugins and report what they would do.

use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, IsTerminal, Read, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context as _, Result};
use clap::{Parser, Subcommand, ValueEnum};
use sluice_sim::engine::{Engine, Plugins, RunOptions};
use sluice_sim::gateway::Host;
use sluice_sim::observed::read_access_log;
use sluice_sim::report::{compare, render_compare_html, render_html, summarize, ReportInput, Source, Summary};
use sluice_sim::scenario::Scenario;
use sluice_sim::trace::{Clock, OnMalformed, OutOfOrder, ReaderOptions, TraceFormat, TraceReader, TraceRequest};
use sluice_sim::verdict::{Stamps, Verdict};

// The replay allocates per event and per request (the flows' effects, the rendered upstream, the
// verdicts); glibc's malloc and free were a fifth of its time.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The verdicts file's write buffer.
const VERDICT_WRITE_BUFFER: usize = 1 << 20;

/// Exit codes scripts can rely on.
mod exit {
    /// A run went through (compare: and found no difference, unless asked otherwise).
    pub const OK: u8 = 0;
    /// The run failed: a plugin trapped, an output could not be written.
    pub const FAILED: u8 = 1;
    /// Bad flags, scenario or policy (a plugin refused its configuration).
    pub const USAGE: u8 = 2;
    /// The trace: unreadable, or a malformed line under `--on-malformed fail`.
    pub const TRACE: u8 = 3;
    /// `compare --fail-on-difference`: the two scenarios disagree on some request.
    pub const DIFFERENT: u8 = 4;
}

#[derive(Parser)]
#[command(
    name = "sluice-sim",
    version,
    about = "Replay a request trace through the production sluice plugins (.wasm, on a virtual clock) against a modelled upstream, and report what the policies would do.",
    after_help = "Exit codes: 0 done; 1 the run failed (a plugin trapped, output not writable); 2 bad flags, scenario or policy; \
3 the trace is unreadable or has a malformed line under --on-malformed fail; 4 compare --fail-on-difference found differences.\n\n\
Example (the bundled Azure conversation trace, first 2,000 requests):\n  \
sluice-sim run --scenario examples/sim/demo.scenario.json --trace sim/traces/azure-2023-conv/azure-2023-conv.first-2000.csv --out target/sim-demo"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Simulate one scenario over a trace: verdicts.jsonl, summary.json and report.html in --out.
    Run {
        #[command(flatten)]
        trace: TraceArgs,
        /// The scenario file (JSON): policies, traffic defaults, upstream models, incidents.
        #[arg(long)]
        scenario: PathBuf,
        /// Directory for the outputs (created if missing).
        #[arg(long)]
        out: PathBuf,
        #[command(flatten)]
        run: RunArgs,
    },
    /// Simulate two scenarios over the same trace and list the requests whose verdict differs:
    /// <out>/a and <out>/b as for `run`, plus compare.json and compare.html.
    Compare {
        #[command(flatten)]
        trace: TraceArgs,
        /// Today's scenario.
        #[arg(long)]
        a: PathBuf,
        /// The proposed scenario.
        #[arg(long)]
        b: PathBuf,
        #[arg(long)]
        out: PathBuf,
        #[command(flatten)]
        run: RunArgs,
        /// Exit with 4 when any request's verdict differs (for CI gates on policy changes).
        #[arg(long)]
        fail_on_difference: bool,
    },
    /// Report what happened, from a real gateway's JSON access log (no simulation):
    /// verdicts.jsonl, summary.json and report.html in --out.
    Observe {
        /// The access log (the shipped gateways' json_format).
        #[arg(long)]
        access_log: PathBuf,
        #[arg(long)]
        out: PathBuf,
        /// Skip malformed lines (counted and reported) instead of stopping at the first.
        #[arg(long)]
        skip_malformed: bool,
    },
}

#[derive(clap::Args)]
struct TraceArgs {
    /// The trace file: Azure CSV, RAGPulse JSONL, sluice's generic JSONL or its access log.
    #[arg(long)]
    trace: PathBuf,
    /// The trace's format; detected from its first line when not given.
    #[arg(long, value_enum)]
    format: Option<FormatArg>,
    /// A malformed line: `fail` stops with its line number (exit 3), `skip` reports and counts it.
    #[arg(long, value_enum, default_value = "fail")]
    on_malformed: MalformedArg,
    /// An arrival earlier than the previous one: `reject` it as malformed, or `clamp` it to the previous.
    #[arg(long, value_enum, default_value = "reject")]
    out_of_order: OrderArg,
    /// Replay only the first N requests.
    #[arg(long)]
    limit: Option<u64>,
}

#[derive(clap::Args)]
struct RunArgs {
    /// What runs the flows: `wasm` runs `sluice.wasm` itself under wasmtime (the file Envoy loads);
    /// `native` runs the same sluice-core flows compiled into the simulator, many times faster, with
    /// verdicts held equal to the wasm host's by the simulator's tests (docs/simulator.md).
    #[arg(long, value_enum, default_value_t = Host::Wasm)]
    host: Host,
    /// Where `sluice.wasm` is (default: the workspace's target/wasm32-wasip1/release).
    #[arg(long)]
    wasm_dir: Option<PathBuf>,
    /// Wall-clock time of the first request, as Unix milliseconds: budgets' minute/day/month
    /// windows are counted from it. Default: the trace's own first timestamp when it has calendar
    /// times, else 2026-01-01T00:00:00Z.
    #[arg(long)]
    start_unix_ms: Option<u64>,
    /// Multiply arrival offsets by this (overrides the scenario's time_scale): 0.1 replays ten times faster.
    #[arg(long)]
    time_scale: Option<f64>,
    /// No progress bar.
    #[arg(long, short)]
    quiet: bool,
    /// Write verdicts.jsonl only (no summary or HTML: they keep every verdict, without stamps, in memory).
    #[arg(long)]
    no_report: bool,
}

#[derive(Clone, Copy, ValueEnum)]
enum FormatArg {
    Azure,
    Ragpulse,
    Mooncake,
    Generic,
    AccessLog,
}

#[derive(Clone, Copy, ValueEnum)]
enum MalformedArg {
    Fail,
    Skip,
}

#[derive(Clone, Copy, ValueEnum)]
enum OrderArg {
    Reject,
    Clamp,
}

/// An error with the exit code it deserves.
struct Failure {
    code: u8,
    error: anyhow::Error,
}

impl<E: Into<anyhow::Error>> From<E> for Failure {
    fn from(e: E) -> Self {
        Failure { code: exit::FAILED, error: e.into() }
    }
}

fn fail(code: u8, error: impl Into<anyhow::Error>) -> Failure {
    Failure { code, error: error.into() }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run { trace, scenario, out, run } => run_one(&trace, &scenario, &out, &run).map(|_| exit::OK),
        Command::Compare { trace, a, b, out, run, fail_on_difference } => run_compare(&trace, &a, &b, &out, &run, fail_on_difference),
        Command::Observe { access_log, out, skip_malformed } => observe(&access_log, &out, skip_malformed).map(|_| exit::OK),
    };
    match result {
        Ok(code) => ExitCode::from(code),
        Err(Failure { code, error }) => {
            eprintln!("sluice-sim: {error:#}");
            ExitCode::from(code)
        }
    }
}

/// Counts the bytes read, for the progress bar.
struct Counting<R> {
    inner: R,
    read: Arc<AtomicU64>,
}

impl<R: Read> Read for Counting<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.read.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }
}

struct Progress {
    enabled: bool,
    total_bytes: u64,
    read: Arc<AtomicU64>,
    started: Instant,
    label: String,
}

impl Progress {
    fn show(&self, requests: u64) {
        if !self.enabled {
            return;
        }
        let fraction = if self.total_bytes == 0 { 1.0 } else { (self.read.load(Ordering::Relaxed) as f64 / self.total_bytes as f64).min(1.0) };
        let width = 30;
        let filled = (fraction * width as f64).round() as usize;
        let elapsed = self.started.elapsed().as_secs_f64().max(1e-9);
        eprint!(
            "\r{} [{}{}] {:>3.0}%  {requests} requests  {:.0} req/s ",
            self.label,
            "#".repeat(filled),
            "-".repeat(width - filled.min(width)),
            fraction * 100.0,
            requests as f64 / elapsed
        );
        let _ = std::io::stderr().flush();
    }

    fn done(&self) {
        if self.enabled {
            eprintln!();
        }
    }
}

fn reader_options(args: &TraceArgs) -> ReaderOptions {
    ReaderOptions {
        format: args.format.map(|f| match f {
            FormatArg::Azure => TraceFormat::Azure,
            FormatArg::Ragpulse => TraceFormat::RagPulse,
            FormatArg::Mooncake => TraceFormat::Mooncake,
            FormatArg::Generic => TraceFormat::Generic,
            FormatArg::AccessLog => TraceFormat::AccessLog,
        }),
        on_malformed: match args.on_malformed {
            MalformedArg::Fail => OnMalformed::Fail,
            MalformedArg::Skip => OnMalformed::Skip,
        },
        out_of_order: match args.out_of_order {
            OrderArg::Reject => OutOfOrder::Reject,
            OrderArg::Clamp => OutOfOrder::Clamp,
        },
        ..ReaderOptions::default()
    }
}

fn default_wasm_dir() -> PathBuf {
    sluice_host::workspace_target_dir().join("wasm32-wasip1").join("release")
}

/// What one simulated run leaves in `out`.
struct RunOutput {
    /// The scenario's `name` (its file's stem when it has none): the report's title.
    name: String,
    verdicts: Vec<Verdict>,
    summary: Option<Summary>,
}

fn run_one(args: &TraceArgs, scenario_path: &Path, out: &Path, run: &RunArgs) -> Result<RunOutput, Failure> {
    let mut scenario = Scenario::load(scenario_path).map_err(|e| fail(exit::USAGE, e))?;
    // Said even with -q: the run is not of the policy as written.
    for note in &scenario.notes {
        eprintln!("sluice-sim: {}: {note}", scenario_path.display());
    }
    if let Some(scale) = run.time_scale {
        if !(scale.is_finite() && scale > 0.0) {
            return Err(fail(exit::USAGE, anyhow::anyhow!("--time-scale must be a positive number, got {scale}")));
        }
        scenario.time_scale = scale;
    }
    let wasm_dir = run.wasm_dir.clone().unwrap_or_else(default_wasm_dir);
    let plugins = Plugins::for_host(run.host, &wasm_dir).map_err(|e| fail(exit::USAGE, e))?;
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;

    let file = File::open(&args.trace).with_context(|| format!("cannot open trace {}", args.trace.display())).map_err(|e| fail(exit::TRACE, e))?;
    let total_bytes = file.metadata().map(|m| m.len()).unwrap_or(0);
    let read = Arc::new(AtomicU64::new(0));
    let source = BufReader::with_capacity(256 << 10, Counting { inner: file, read: read.clone() });
    let mut reader = TraceReader::new(source, reader_options(args));
    let fail_on_malformed = matches!(args.on_malformed, MalformedArg::Fail);
    let first = if args.limit == Some(0) { None } else { next_request(&mut reader, &args.trace, fail_on_malformed)? };
    let start_ns = match (run.start_unix_ms, reader.origin()) {
        (Some(ms), _) => ms.saturating_mul(1_000_000),
        (None, Some((Clock::Unix, ns))) => u64::try_from(ns).unwrap_or(sluice_host::DEFAULT_EPOCH_NS),
        _ => sluice_host::DEFAULT_EPOCH_NS,
    };
    let progress =
        Progress { enabled: !run.quiet && std::io::stderr().is_terminal(), total_bytes, read, started: Instant::now(), label: scenario.name.clone() };
    let engine = Engine::new(&scenario, &plugins, &RunOptions { start_ns }).map_err(|e| fail(exit::USAGE, e))?;
    let engine = if run.no_report { engine.without_samples() } else { engine };

    let verdicts_path = out.join("verdicts.jsonl");
    // Verdict lines are ≈ 1.8 KB each: written a megabyte at a time, not 8 KB (a write call every
    // four or five verdicts).
    let mut writer =
        BufWriter::with_capacity(VERDICT_WRITE_BUFFER, File::create(&verdicts_path).with_context(|| format!("cannot create {}", verdicts_path.display()))?);
    let mut kept: Vec<Verdict> = Vec::new();
    // One verdict line at a time, its buffer reused.
    let mut line = Vec::new();
    let keep = !run.no_report;
    let mut trace_error: Option<anyhow::Error> = None;
    let limit = args.limit.unwrap_or(u64::MAX);
    let mut taken = 0u64;
    let trace_path = args.trace.clone();
    let requests = first.into_iter().chain(std::iter::from_fn(|| loop {
        if taken >= limit.saturating_sub(1) {
            return None;
        }
        match reader.next() {
            None => return None,
            Some(Ok(r)) => {
                taken += 1;
                return Some(r);
            }
            Some(Err(e)) => {
                if e.is_fatal() || fail_on_malformed {
                    trace_error = Some(anyhow::anyhow!("{}: {e}", trace_path.display()));
                    return None;
                }
                eprintln!("sluice-sim: {}: skipped: {e}", trace_path.display());
            }
        }
    }));
    let result = engine.run(
        requests,
        |mut verdict| {
            line.clear();
            verdict.write_line(&mut line)?;
            writer.write_all(&line)?;
            if keep {
                kept.push(Verdict { stamps: Stamps::default(), ..verdict });
            }
            Ok(())
        },
        |n| progress.show(n),
    )?;
    progress.done();
    writer.flush()?;
    if let Some(e) = trace_error {
        return Err(fail(exit::TRACE, e));
    }
    let skipped = reader.stats().malformed;
    if skipped > 0 {
        eprintln!("sluice-sim: {skipped} malformed trace lines skipped");
    }
    if !result.warnings.is_empty() {
        let path = out.join("plugin-warnings.log");
        write_text(&path, &(result.warnings.join("\n") + "\n"))?;
        if !run.quiet {
            eprintln!("sluice-sim: the plugins logged {} warnings (breaker transitions among them): {}", result.warnings.len(), path.display());
        }
    }
    kept.sort_by_key(|v| v.line);
    let summary = if keep {
        let input =
            ReportInput { title: &scenario.name, source: Source::Simulated, verdicts: &kept, samples: &result.samples, transitions: &result.transitions };
        let summary = summarize(&input);
        write_json(&out.join("summary.json"), &summary)?;
        write_text(&out.join("report.html"), &render_html(&input, &summary))?;
        Some(summary)
    } else {
        None
    };
    let elapsed = progress.started.elapsed().as_secs_f64();
    if !run.quiet {
        eprintln!(
            "sluice-sim: {}: {} requests over {:.1} s of virtual time in {:.2} s ({:.0} requests/s); outputs in {}",
            scenario.name,
            result.requests,
            result.span_ms / 1000.0,
            elapsed,
            result.requests as f64 / elapsed.max(1e-9),
            out.display()
        );
    }
    Ok(RunOutput { name: scenario.name.clone(), verdicts: kept, summary })
}

/// The first request (so the trace's origin is known before the clock starts).
fn next_request<R: BufRead>(reader: &mut TraceReader<R>, path: &Path, fail_on_malformed: bool) -> Result<Option<TraceRequest>, Failure> {
    loop {
        match reader.next() {
            None => return Ok(None),
            Some(Ok(r)) => return Ok(Some(r)),
            Some(Err(e)) if e.is_fatal() || fail_on_malformed => return Err(fail(exit::TRACE, anyhow::anyhow!("{}: {e}", path.display()))),
            Some(Err(e)) => eprintln!("sluice-sim: {}: skipped: {e}", path.display()),
        }
    }
}

fn run_compare(args: &TraceArgs, a: &Path, b: &Path, out: &Path, run: &RunArgs, fail_on_difference: bool) -> Result<u8, Failure> {
    // The two scenarios replay on a thread each: neither shares anything with the other.
    let (ra, rb) = std::thread::scope(|scope| {
        let side_a = scope.spawn(|| run_one(args, a, &out.join("a"), &RunArgs { no_report: false, ..clone_run(run) }));
        let rb = run_one(args, b, &out.join("b"), &RunArgs { no_report: false, ..clone_run(run) });
        let ra = side_a.join().unwrap_or_else(|_| Err(fail(exit::USAGE, anyhow::anyhow!("the replay of {} stopped with a panic", a.display()))));
        (ra, rb)
    });
    let (ra, rb) = (ra?, rb?);
    let comparison = compare(&ra.verdicts, &rb.verdicts);
    write_json(&out.join("compare.json"), &comparison)?;
    let (title_a, title_b) = side_titles(&ra.name, a, &rb.name, b);
    if let (Some(sa), Some(sb)) = (&ra.summary, &rb.summary) {
        write_text(&out.join("compare.html"), &render_compare_html("sluice-sim compare", &title_a, &title_b, sa, sb, &comparison))?;
    }
    let differing = comparison.differences.len();
    eprintln!("sluice-sim: {} of {} requests get a different verdict; compare.html in {}", differing, ra.verdicts.len(), out.display());
    Ok(if fail_on_difference && differing > 0 { exit::DIFFERENT } else { exit::OK })
}

/// Each side is titled by its scenario's `name`; two scenarios of one name also show their files.
fn side_titles(name_a: &str, a: &Path, name_b: &str, b: &Path) -> (String, String) {
    if name_a != name_b {
        return (name_a.to_string(), name_b.to_string());
    }
    let file = |p: &Path| p.file_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    (format!("{name_a} ({})", file(a)), format!("{name_b} ({})", file(b)))
}

fn clone_run(run: &RunArgs) -> RunArgs {
    RunArgs {
        host: run.host,
        wasm_dir: run.wasm_dir.clone(),
        start_unix_ms: run.start_unix_ms,
        time_scale: run.time_scale,
        quiet: run.quiet,
        no_report: run.no_report,
    }
}

fn observe(path: &Path, out: &Path, skip_malformed: bool) -> Result<(), Failure> {
    let file = File::open(path).with_context(|| format!("cannot open access log {}", path.display())).map_err(|e| fail(exit::TRACE, e))?;
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    let mut writer = BufWriter::with_capacity(VERDICT_WRITE_BUFFER, File::create(out.join("verdicts.jsonl"))?);
    let mut verdicts = Vec::new();
    let mut line = Vec::new();
    let mut malformed = 0u64;
    for item in read_access_log(BufReader::new(file)) {
        match item {
            Ok(mut v) => {
                line.clear();
                v.write_line(&mut line)?;
                writer.write_all(&line)?;
                verdicts.push(Verdict { stamps: Stamps::default(), ..v });
            }
            Err(e) if skip_malformed => {
                malformed += 1;
                eprintln!("sluice-sim: {}: {e}", path.display());
            }
            Err(e) => return Err(fail(exit::TRACE, anyhow::anyhow!("{}: {e}", path.display()))),
        }
    }
    writer.flush()?;
    let title = path.file_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    let input = ReportInput { title: &title, source: Source::Observed, verdicts: &verdicts, samples: &[], transitions: &[] };
    let summary = summarize(&input);
    write_json(&out.join("summary.json"), &summary)?;
    write_text(&out.join("report.html"), &render_html(&input, &summary))?;
    eprintln!("sluice-sim: {} requests read ({malformed} malformed lines skipped); outputs in {}", verdicts.len(), out.display());
    Ok(())
}

fn write_json(path: &Path, value: &impl serde::Serialize) -> Result<()> {
    let text = serde_json::to_string_pretty(value)?;
    write_text(path, &text)
}

fn write_text(path: &Path, text: &str) -> Result<()> {
    std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))
}
