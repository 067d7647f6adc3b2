//! Stream control from inside the plugin: answering locally (`proxy_send_local_response`),
//! resuming a paused direction (`proxy_continue_stream`) and resetting the stream
//! (`proxy_close_stream`). After a local reply or a reset the stream is stopped: the host delivers
//! no further request or response events for it, only the end of its life (log, done, delete).

use wasmtime::{Caller, Linker, Result};

use super::MODULE;
use crate::abi::{decode_map, reply, HostcallResult, Status, StreamType};
use crate::guest;
use crate::headers::Headers;
use crate::state::{HostState, LocalReply, Phase};

pub(super) fn add_to_linker(linker: &mut Linker<HostState>) -> Result<()> {
    linker.func_wrap(MODULE, "proxy_send_local_response", proxy_send_local_response)?;
    linker.func_wrap(MODULE, "proxy_continue_stream", proxy_continue_stream)?;
    linker.func_wrap(MODULE, "proxy_close_stream", proxy_close_stream)?;
    Ok(())
}

#[allow(clippy::too_many_arguments)] // the ABI's shape
fn proxy_send_local_response(
    mut caller: Caller<'_, HostState>,
    status: u32,
    details_ptr: u32,
    details_len: u32,
    body_ptr: u32,
    body_len: u32,
    headers_ptr: u32,
    headers_len: u32,
    grpc_status: i32,
) -> HostcallResult {
    let details = guest::read_string(&mut caller, details_ptr, details_len)?;
    let body = guest::read(&mut caller, body_ptr, body_len)?;
    let Ok(headers) = decode_map(&guest::read(&mut caller, headers_ptr, headers_len)?) else {
        return reply(Status::BadArgument);
    };
    let state = caller.data_mut();
    let id = state.effective_context;
    state.touched.push(id);
    let Some(stream) = state.current_stream_mut() else {
        return reply(Status::NotFound);
    };
    if stream.phase != Phase::Open {
        // Envoy ignores a second reply: the first one is already on its way.
        return reply(Status::Ok);
    }
    stream.local_reply = Some(LocalReply { status, details, body, headers: Headers::from_vec(headers), grpc_status });
    stream.phase = Phase::Stopped;
    reply(Status::Ok)
}

fn proxy_continue_stream(mut caller: Caller<'_, HostState>, stream_type: u32) -> HostcallResult {
    let Some(stream_type) = StreamType::from_code(stream_type) else {
        return reply(Status::BadArgument);
    };
    let state = caller.data_mut();
    let id = state.effective_context;
    state.touched.push(id);
    let Some(stream) = state.current_stream_mut() else {
        return reply(Status::NotFound);
    };
    if stream.phase != Phase::Open {
        return reply(Status::Ok);
    }
    let direction = match stream_type {
        StreamType::HttpRequest => &mut stream.request,
        StreamType::HttpResponse => &mut stream.response,
        // This host runs HTTP streams only.
        StreamType::Downstream | StreamType::Upstream => return reply(Status::BadArgument),
    };
    if direction.paused {
        direction.release();
    }
    reply(Status::Ok)
}

fn proxy_close_stream(mut caller: Caller<'_, HostState>, stream_type: u32) -> HostcallResult {
    let Some(stream_type) = StreamType::from_code(stream_type) else {
        return reply(Status::BadArgument);
    };
    if matches!(stream_type, StreamType::Downstream | StreamType::Upstream) {
        return reply(Status::BadArgument);
    }
    let state = caller.data_mut();
    let id = state.effective_context;
    state.touched.push(id);
    let Some(stream) = state.current_stream_mut() else {
        return reply(Status::NotFound);
    };
    if stream.phase == Phase::Open {
        stream.phase = Phase::Stopped;
        stream.closed_by_plugin = true;
    }
    reply(Status::Ok)
}
