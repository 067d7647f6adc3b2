//! The servers `cargo xtask up` runs in the foreground, and how they end.
//!
//! Each child runs in its own process group, so a Ctrl-C at the terminal reaches xtask alone (not
//! Envoy and the mocks behind its back): xtask then ends every child itself — SIGTERM, and SIGKILL
//! for one still running after a few seconds — the same way for SIGINT, SIGTERM and SIGHUP, and for
//! an error or a child that exited on its own. `cargo xtask` runs xtask through `cargo run`, which
//! replaces the `cargo` process with xtask on Unix: a signal sent to that `cargo` process is a
//! signal to xtask.

use anyhow::{bail, Context, Result};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Set by the handler of SIGINT, SIGTERM and SIGHUP (installed by [`catch_stop_signals`]).
static STOP: AtomicBool = AtomicBool::new(false);

/// How long a child has to exit after SIGTERM before it gets SIGKILL.
const GRACE: Duration = Duration::from_secs(5);

/// The error a wait returns when a stop signal arrived: a clean stop, not a failure.
#[derive(Debug)]
pub struct Stopped;

impl std::fmt::Display for Stopped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("stopped by a signal")
    }
}

impl std::error::Error for Stopped {}

/// From here on SIGINT, SIGTERM and SIGHUP ask the waits below to stop instead of killing xtask.
pub fn catch_stop_signals() -> Result<()> {
    ctrlc::set_handler(|| STOP.store(true, Ordering::SeqCst)).context("installing the SIGINT/SIGTERM handler")
}

fn stop_requested() -> bool {
    STOP.load(Ordering::SeqCst)
}

/// Running children, ended (SIGTERM, then SIGKILL) when dropped.
#[derive(Default)]
pub struct Children {
    running: Vec<(String, Child)>,
}

impl Children {
    /// Starts `cmd` in a process group of its own; `name` is how errors call it.
    pub fn spawn(&mut self, name: &str, cmd: &mut Command) -> Result<u32> {
        let child = cmd.stdin(Stdio::null()).process_group(0).spawn().with_context(|| format!("starting {name}"))?;
        let pid = child.id();
        self.running.push((name.to_string(), child));
        Ok(pid)
    }

    /// Waits until something accepts connections on 127.0.0.1:`port`; fails when a child exits
    /// first or after `timeout`, and returns [`Stopped`] on a stop signal.
    pub fn wait_for_port(&mut self, port: u16, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                return Ok(());
            }
            self.check()?;
            std::thread::sleep(Duration::from_millis(50));
        }
        bail!("nothing listening on 127.0.0.1:{port} after {timeout:?}")
    }

    /// Runs until a stop signal ([`Stopped`]) or until a child exits (an error naming it).
    pub fn wait(&mut self) -> Result<()> {
        loop {
            self.check()?;
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn check(&mut self) -> Result<()> {
        if stop_requested() {
            return Err(Stopped.into());
        }
        for (name, child) in &mut self.running {
            if let Some(status) = child.try_wait().with_context(|| format!("waiting for {name}"))? {
                // A signal to the process group of a child (e.g. `kill -- -PID`) may end it just
                // before the signal reaches xtask: a stop, not a failure.
                std::thread::sleep(Duration::from_millis(200));
                if stop_requested() {
                    return Err(Stopped.into());
                }
                bail!("{name} exited on its own ({}); the others were stopped", describe(status));
            }
        }
        Ok(())
    }

    /// SIGTERM to every child still running, then SIGKILL to those still running after [`GRACE`];
    /// every child is reaped.
    pub fn stop_all(&mut self) {
        for (_, child) in &mut self.running {
            if matches!(child.try_wait(), Ok(None)) {
                if let Ok(pid) = i32::try_from(child.id()) {
                    let _ = kill(Pid::from_raw(pid), Signal::SIGTERM);
                }
            }
        }
        let deadline = Instant::now() + GRACE;
        for (name, child) in &mut self.running {
            loop {
                match child.try_wait() {
                    Ok(Some(_)) | Err(_) => break,
                    Ok(None) if Instant::now() >= deadline => {
                        eprintln!("xtask: {name} still running {GRACE:?} after SIGTERM; killing it");
                        let _ = child.kill();
                        let _ = child.wait();
                        break;
                    }
                    Ok(None) => std::thread::sleep(Duration::from_millis(20)),
                }
            }
        }
        self.running.clear();
    }
}

impl Drop for Children {
    fn drop(&mut self) {
        self.stop_all();
    }
}

fn describe(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exit status {code}"),
        (None, Some(signal)) => format!("killed by signal {signal}"),
        _ => status.to_string(),
    }
}
