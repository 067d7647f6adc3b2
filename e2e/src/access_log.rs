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
            .map(|(i, l)| serde_json::from_str(l).with_context(|| format!("{} line {}: not JSON: {l}", self.path.display(), i + 1)))
            .collect()
    }

    /// Waits for the entry whose `request_id` field is `id` (configs log `%REQ(X-REQUEST-ID)%`
    /// there) and returns it.
    pub fn wait_for_request(&self, id: &str, timeout: Duration) -> Result<Value> {
        crate::wait_until(timeout, &format!("the access log entry of request {id} in {}", self.path.display()), || {
            Ok(self.entries()?.into_iter().find(|e| e.get("request_id").and_then(Value::as_str) == Some(id)))
        })
    }

    /// Waits until at least `n` entries are there, and returns all of them.
    pub fn wait_for(&self, n: usize, timeout: Duration) -> Result<Vec<Value>> {
        crate::wait_until(timeout, &format!("{n} access log entries in {}", self.path.display()), || {
            let entries = self.entries()?;
            Ok((entries.len() >= n).then_some(entries))
        })
    }
}

/// The stamp a plugin wrote into filter state, which the access log holds as a JSON string in
/// `field` (`sluice`, `budget`, `route`, `latency` in the shipped configs), parsed. `None` when the
/// plugin wrote nothing (Envoy logs `null` or `-`).
pub fn stamp(entry: &Value, field: &str) -> Result<Option<Value>> {
    match entry.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if s.is_empty() || s == "-" => Ok(None),
        Some(Value::String(s)) => serde_json::from_str(s).map(Some).with_context(|| format!("stamp {field} is not JSON: {s}")),
        Some(other) => anyhow::bail!("stamp {field} is not a string: {other}"),
    }
}
