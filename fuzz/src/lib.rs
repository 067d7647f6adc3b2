//! Shared pieces of the fuzz targets: chunk splitting, and the simulator's trace and access-log
//! readers compiled from their own source files.
//!
//! The simulator crate links the wasmtime host (it runs the plugins' .wasm files); instrumenting
//! and linking wasmtime into every fuzz binary would make the fuzz build many times slower, for
//! code no target calls. The readers depend only on sluice-core, serde and thiserror, so their
//! files are compiled here as they are, under the module names they have in `sluice_sim`.

#[path = "../../sim/src/trace/mod.rs"]
pub mod trace;

#[path = "../../sim/src/verdict.rs"]
pub mod verdict;

#[path = "../../sim/src/observed.rs"]
pub mod observed;

/// What `observed` needs of the simulator's report module.
pub mod report {
    /// The same value as `sluice_sim::report::ANONYMOUS` (llm-metrics' label of requests without
    /// a tenant); the simulator's unit tests pin it there.
    pub const ANONYMOUS: &str = "anonymous";
}

/// Splits `body` into chunks whose sizes alternate between `a` and `b` (each at least 1), so that
/// line ends, CR/LF pairs and UTF-8 sequences land on chunk boundaries.
pub fn chunks(body: &[u8], a: u8, b: u8) -> Vec<&[u8]> {
    let (a, b) = (usize::from(a.max(1)), usize::from(b.max(1)));
    let mut out = Vec::new();
    let mut i = 0;
    let mut turn = false;
    while i < body.len() {
        let len = if turn { b } else { a };
        turn = !turn;
        let end = body.len().min(i + len);
        out.push(&body[i..end]);
        i = end;
    }
    out
}
