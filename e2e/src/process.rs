//! A child process the fleet tests kill, stall and resume on purpose (Redis, the ledger service):
//! what a crash or a stall does to the rest of the fleet is what they test.

use anyhow::{anyhow, bail, Context, Result};
use std::process::{Child, Command, ExitStatus};
use std::time::{Duration, Instant};

/// A child process that may be stopped and started again; killed on drop.
pub(crate) struct Process {
    /// For errors.
    name: &'static str,
    child: Option<Child>,
}

impl Process {
    /// Nothing running yet.
    pub(crate) fn new(name: &'static str) -> Process {
        Process { name, child: None }
    }

    /// Takes charge of `child`, killing whatever ran before.
    pub(crate) fn run(&mut self, child: Child) {
        self.kill();
        self.child = Some(child);
    }

    /// Its exit status, once it has exited on its own.
    fn exited(&mut self) -> Option<ExitStatus> {
        self.child.as_mut().and_then(|c| c.try_wait().ok().flatten())
    }

    /// Polls `ready` every 20 ms until it holds (the process is `what`, e.g. `healthy`); an error
    /// with `last_words` (the tail of its stderr or log) if the process exits first or `timeout`
    /// passes, so a broken start fails the test with its reason instead of hanging it.
    pub(crate) fn wait_ready(&mut self, timeout: Duration, what: &str, mut ready: impl FnMut() -> bool, last_words: impl Fn() -> String) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            if ready() {
                return Ok(());
            }
            if let Some(status) = self.exited() {
                bail!("{} exited ({status}) before it was {what}; {}", self.name, last_words());
            }
            if Instant::now() >= deadline {
                bail!("{} not {what} after {timeout:?}; {}", self.name, last_words());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGKILL, and wait for the process to be gone: it dies at once, in-flight work and all.
    pub(crate) fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Sends `sig` (`-STOP`, `-CONT`) with kill(1).
    pub(crate) fn signal(&self, sig: &str) -> Result<()> {
        let pid = self.child.as_ref().map(Child::id).ok_or_else(|| anyhow!("{} is not running", self.name))?;
        let status = Command::new("kill").args([sig, &pid.to_string()]).status().context("running kill")?;
        if !status.success() {
            bail!("kill {sig} {pid}: {status}");
        }
        Ok(())
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.kill();
    }
}
