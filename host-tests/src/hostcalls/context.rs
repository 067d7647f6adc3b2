//! Context bookkeeping: `proxy_set_effective_context`, `proxy_done`, and
//! `proxy_call_foreign_function`, for which this host registers no functions.

use wasmtime::{Caller, Linker, Result};

use super::MODULE;
use crate::abi::{reply, HostcallResult, Status};
use crate::state::HostState;

pub(super) fn add_to_linker(linker: &mut Linker<HostState>) -> Result<()> {
    linker.func_wrap(MODULE, "proxy_set_effective_context", proxy_set_effective_context)?;
    linker.func_wrap(MODULE, "proxy_done", proxy_done)?;
    linker.func_wrap(MODULE, "proxy_call_foreign_function", proxy_call_foreign_function)?;
    Ok(())
}

fn proxy_set_effective_context(mut caller: Caller<'_, HostState>, context_id: u32) -> HostcallResult {
    let state = caller.data_mut();
    if !state.context_exists(context_id) {
        return reply(Status::BadArgument);
    }
    state.effective_context = context_id;
    reply(Status::Ok)
}

fn proxy_done(mut caller: Caller<'_, HostState>) -> HostcallResult {
    caller.data_mut().done_calls += 1;
    reply(Status::Ok)
}

fn proxy_call_foreign_function(
    _caller: Caller<'_, HostState>,
    _name_ptr: u32,
    _name_len: u32,
    _args_ptr: u32,
    _args_len: u32,
    _results_out: u32,
    _size_out: u32,
) -> HostcallResult {
    reply(Status::NotFound)
}
