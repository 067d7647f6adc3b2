//! Reading Envoy's JSON access log (one JSON object per line, as configured with
//! `json_format`). Envoy flushes the file on a timer, so [`AccessLog::wait_for`] polls.

use anyhow::{Context, Result};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::time::Duration;

#[derive(Debug, Clone)]
pub struct AccessLog {
    path: PathBuf,
}

impl AccessLog {
    pub fn new(path: impl Into<PathBuf>) -> AccessLog {
        AccessLog { path: path.into() }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Every complete line parsed as JSON; an empty list if the file does not exist yet. A last
    /// line without its newline is still being written and is left for the next read.
    pub fn entries(&self) -> Result<Vec<Value>> {
        let text = match std::fs::read_to_string(&self.path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(e).with_context(|| format!("reading {}", self.path.display())),
        };
        let complete = match text.rfind('\n') {
            Some(end) => text.get(..end).unwrap_or(""),
            None => "",
        };
        complete
            .lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
            .map(|(i, l)| {
                serde_json::from_str(l)
                    .with_context(|| format!("{} line {}: not JSON: {l}", self.path.display(), i + 1))
            })
            .collect()
    }

    /// Waits until at least `n` entries are there, and returns all of them.
    pub fn wait_for(&self, n: usize, timeout: Duration) -> Result<Vec<Value>> {
        crate::wait_until(
            timeout,
            &format!("{n} access log entries in {}", self.path.display()),
            || {
                let entries = self.entries()?;
                Ok((entries.len() >= n).then_some(entries))
            },
        )
    }
}
