//! sluice-sim: the offline policy simulator, which will replay real traffic through the
//! production plugins (issue 11). This first part is the trace readers ([`trace`]); the engine,
//! the scenario file and the reports are not built yet (docs/simulator.md).

pub mod trace;
