//! `proxy_log` and `proxy_get_log_level`: the plugin's log lines are kept in order, tagged with the
//! active context, and echoed to the test's (captured) stderr.

use wasmtime::{Caller, Linker, Result};

use super::MODULE;
use crate::abi::{reply, HostcallResult, LogLevel, Status};
use crate::guest;
use crate::state::{HostState, LogLine};

pub(super) fn add_to_linker(linker: &mut Linker<HostState>) -> Result<()> {
    linker.func_wrap(MODULE, "proxy_log", proxy_log)?;
    linker.func_wrap(MODULE, "proxy_get_log_level", proxy_get_log_level)?;
    Ok(())
}

fn proxy_log(mut caller: Caller<'_, HostState>, level: u32, ptr: u32, len: u32) -> HostcallResult {
    let Some(level) = LogLevel::from_code(level) else {
        return reply(Status::BadArgument);
    };
    let (guest, state) = guest::view(&mut caller);
    // Checked against linear memory even when dropped; decoded and copied only when kept.
    let message = guest.bytes(ptr, len)?;
    let context_id = state.effective_context;
    if level < state.keep_logs_from {
        return reply(Status::Ok);
    }
    let message = String::from_utf8_lossy(message).into_owned();
    if state.echo_logs {
        eprintln!("[plugin {}] {level} ctx={context_id}: {message}", state.plugin.name);
    }
    let at_ns = state.clock.now_ns();
    state.logs.push(LogLine { level, context_id, message, at_ns });
    reply(Status::Ok)
}

fn proxy_get_log_level(mut caller: Caller<'_, HostState>, level_out: u32) -> HostcallResult {
    let level = caller.data().plugin.log_level as u32;
    guest::write_u32(&mut caller, level_out, level)?;
    reply(Status::Ok)
}
