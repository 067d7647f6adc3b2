//! gRPC callouts: unary calls and streams the plugin opens, sends on, cancels and closes, and
//! `proxy_get_status`, which tells the plugin the status of the call being reported.

use wasmtime::{Caller, Linker, Result};

use super::callouts::{deadline, GrpcCall, GrpcKind};
use super::MODULE;
use crate::abi::{decode_map, reply, HostcallResult, Status};
use crate::guest;
use crate::headers::Headers;
use crate::state::HostState;

pub(super) fn add_to_linker(linker: &mut Linker<HostState>) -> Result<()> {
    linker.func_wrap(MODULE, "proxy_grpc_call", proxy_grpc_call)?;
    linker.func_wrap(MODULE, "proxy_grpc_stream", proxy_grpc_stream)?;
    linker.func_wrap(MODULE, "proxy_grpc_send", proxy_grpc_send)?;
    linker.func_wrap(MODULE, "proxy_grpc_cancel", proxy_grpc_cancel)?;
    linker.func_wrap(MODULE, "proxy_grpc_close", proxy_grpc_close)?;
    linker.func_wrap(MODULE, "proxy_get_status", proxy_get_status)?;
    Ok(())
}

/// Where to find the upstream, service, method and metadata of a call or stream.
struct Target {
    upstream: (u32, u32),
    service: (u32, u32),
    method: (u32, u32),
    metadata: (u32, u32),
}

fn open(caller: &mut Caller<'_, HostState>, kind: GrpcKind, target: Target, message: Option<Vec<u8>>, timeout_ms: u32, token_out: u32) -> HostcallResult {
    let upstream = guest::read_string(caller, target.upstream.0, target.upstream.1)?;
    let service = guest::read_string(caller, target.service.0, target.service.1)?;
    let method = guest::read_string(caller, target.method.0, target.method.1)?;
    let Ok(metadata) = decode_map(&guest::read(caller, target.metadata.0, target.metadata.1)?) else {
        return reply(Status::ParseFailure);
    };
    let state = caller.data_mut();
    let token = state.callouts.next_token();
    let (timeout, deadline_ns) = deadline(state.clock.now_ns(), timeout_ms);
    let call = GrpcCall {
        token,
        context_id: state.effective_context,
        kind,
        upstream,
        service,
        method,
        initial_metadata: Headers::from_vec(metadata),
        messages: message.into_iter().collect(),
        timeout,
        closed_by_plugin: false,
        deadline_ns,
    };
    state.callouts.grpc.insert(token, call);
    guest::write_u32(caller, token_out, token)?;
    reply(Status::Ok)
}

#[allow(clippy::too_many_arguments)] // the ABI's shape
fn proxy_grpc_call(
    mut caller: Caller<'_, HostState>,
    upstream_ptr: u32,
    upstream_len: u32,
    service_ptr: u32,
    service_len: u32,
    method_ptr: u32,
    method_len: u32,
    metadata_ptr: u32,
    metadata_len: u32,
    message_ptr: u32,
    message_len: u32,
    timeout_ms: u32,
    token_out: u32,
) -> HostcallResult {
    let message = guest::read(&mut caller, message_ptr, message_len)?;
    let target = Target {
        upstream: (upstream_ptr, upstream_len),
        service: (service_ptr, service_len),
        method: (method_ptr, method_len),
        metadata: (metadata_ptr, metadata_len),
    };
    open(&mut caller, GrpcKind::Call, target, Some(message), timeout_ms, token_out)
}

#[allow(clippy::too_many_arguments)] // the ABI's shape
fn proxy_grpc_stream(
    mut caller: Caller<'_, HostState>,
    upstream_ptr: u32,
    upstream_len: u32,
    service_ptr: u32,
    service_len: u32,
    method_ptr: u32,
    method_len: u32,
    metadata_ptr: u32,
    metadata_len: u32,
    token_out: u32,
) -> HostcallResult {
    let target = Target {
        upstream: (upstream_ptr, upstream_len),
        service: (service_ptr, service_len),
        method: (method_ptr, method_len),
        metadata: (metadata_ptr, metadata_len),
    };
    open(&mut caller, GrpcKind::Stream, target, None, 0, token_out)
}

fn proxy_grpc_send(mut caller: Caller<'_, HostState>, token: u32, ptr: u32, len: u32, end_stream: u32) -> HostcallResult {
    let message = guest::read(&mut caller, ptr, len)?;
    let Some(call) = caller.data_mut().callouts.grpc.get_mut(&token) else {
        return reply(Status::NotFound);
    };
    if call.kind != GrpcKind::Stream || call.closed_by_plugin {
        return reply(Status::BadArgument);
    }
    call.messages.push(message);
    call.closed_by_plugin = end_stream != 0;
    reply(Status::Ok)
}

fn proxy_grpc_cancel(mut caller: Caller<'_, HostState>, token: u32) -> HostcallResult {
    // A cancelled call is forgotten: no callback will report it.
    match caller.data_mut().callouts.grpc.remove(&token) {
        Some(_) => reply(Status::Ok),
        None => reply(Status::NotFound),
    }
}

fn proxy_grpc_close(mut caller: Caller<'_, HostState>, token: u32) -> HostcallResult {
    match caller.data_mut().callouts.grpc.get_mut(&token) {
        Some(call) => {
            call.closed_by_plugin = true;
            reply(Status::Ok)
        }
        None => reply(Status::NotFound),
    }
}

fn proxy_get_status(mut caller: Caller<'_, HostState>, code_out: u32, message_out: u32, size_out: u32) -> HostcallResult {
    let (code, message) = caller.data().callback.grpc_status.clone().unwrap_or((0, String::new()));
    guest::write_u32(&mut caller, code_out, code)?;
    guest::return_bytes(&mut caller, message.as_bytes(), message_out, size_out)?;
    reply(Status::Ok)
}
