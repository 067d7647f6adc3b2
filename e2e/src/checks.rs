//! Failed checks of one end-to-end test, reported together at its end: one run shows everything
//! that differs, not just the first difference.

use serde_json::Value;

#[derive(Debug, Default)]
pub struct Checks(Vec<String>);

impl Checks {
    /// Records a failure when `got` is not `want`.
    pub fn eq(&mut self, what: &str, got: &Value, want: Value) {
        if *got != want {
            self.0.push(format!("{what}: got {got}, want {want}"));
        }
    }

    /// Records `what` when `ok` is false.
    pub fn that(&mut self, ok: bool, what: String) {
        if !ok {
            self.0.push(what);
        }
    }

    /// Fails the test with every recorded failure (and `context`, e.g. what the gateway logged).
    pub fn done(self, context: &str) {
        assert!(self.0.is_empty(), "{} failed check(s):\n  {}\n{context}", self.0.len(), self.0.join("\n  "));
    }
}
