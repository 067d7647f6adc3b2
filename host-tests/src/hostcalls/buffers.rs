//! Byte buffers: request and response bodies of the current stream (read and rewrite), the body
//! of a callout reply, a received gRPC message, and the VM and plugin configuration.
//!
//! `proxy_set_buffer_bytes(start, size, data)` replaces bytes `start..start+size` (clamped to the
//! buffer) with `data`: `(0, 0)` prepends, `(len, 0)` appends, `(0, len)` replaces everything —
//! the cases Envoy supports, and the obvious meaning in between.

use wasmtime::{Caller, Linker, Result};

use super::MODULE;
use crate::abi::{reply, BufferType, HostcallResult, Status};
use crate::guest;
use crate::state::HostState;

pub(super) fn add_to_linker(linker: &mut Linker<HostState>) -> Result<()> {
    linker.func_wrap(MODULE, "proxy_get_buffer_bytes", proxy_get_buffer_bytes)?;
    linker.func_wrap(MODULE, "proxy_set_buffer_bytes", proxy_set_buffer_bytes)?;
    Ok(())
}

fn buffer(state: &HostState, buffer_type: BufferType) -> Option<&[u8]> {
    match buffer_type {
        BufferType::RequestBody => state.current_stream().map(|s| s.request.body.as_slice()),
        BufferType::ResponseBody => state.current_stream().map(|s| s.response.body.as_slice()),
        BufferType::HttpCallResponseBody => state.callback.http_reply.as_ref().map(|r| r.body.as_slice()),
        BufferType::GrpcReceiveBuffer => state.callback.grpc_message.as_deref(),
        BufferType::VmConfiguration => Some(&state.plugin.vm_configuration),
        BufferType::PluginConfiguration => Some(&state.plugin.configuration),
        // No TCP streams and no foreign-function call data in this host.
        BufferType::DownstreamData | BufferType::UpstreamData | BufferType::CallData => None,
    }
}

fn buffer_mut(state: &mut HostState, buffer_type: BufferType) -> Option<&mut Vec<u8>> {
    match buffer_type {
        BufferType::RequestBody => state.current_stream_mut().map(|s| &mut s.request.body),
        BufferType::ResponseBody => state.current_stream_mut().map(|s| &mut s.response.body),
        _ => None,
    }
}

fn proxy_get_buffer_bytes(mut caller: Caller<'_, HostState>, buffer_type: u32, start: u32, max_size: u32, data_out: u32, size_out: u32) -> HostcallResult {
    let Some(buffer_type) = BufferType::from_code(buffer_type) else {
        return reply(Status::BadArgument);
    };
    let found = guest::return_filled(&mut caller, data_out, size_out, |_, state, out| {
        let Some(bytes) = buffer(state, buffer_type) else {
            return Ok(false);
        };
        let start = (start as usize).min(bytes.len());
        let end = start.saturating_add(max_size as usize).min(bytes.len());
        out.extend_from_slice(bytes.get(start..end).unwrap_or_default());
        Ok(true)
    })?;
    reply(if found { Status::Ok } else { Status::NotFound })
}

fn proxy_set_buffer_bytes(mut caller: Caller<'_, HostState>, buffer_type: u32, start: u32, size: u32, data_ptr: u32, data_len: u32) -> HostcallResult {
    let Some(buffer_type) = BufferType::from_code(buffer_type) else {
        return reply(Status::BadArgument);
    };
    let (guest, state) = guest::view(&mut caller);
    let data = guest.bytes(data_ptr, data_len)?;
    let Some(bytes) = buffer_mut(state, buffer_type) else {
        return reply(Status::NotFound);
    };
    splice(bytes, start as usize, size as usize, data);
    reply(Status::Ok)
}

/// Replaces `start..start+size` of `bytes` (clamped) with `data`.
pub(crate) fn splice(bytes: &mut Vec<u8>, start: usize, size: usize, data: &[u8]) {
    let start = start.min(bytes.len());
    let end = start.saturating_add(size).min(bytes.len());
    bytes.splice(start..end, data.iter().copied());
}

#[cfg(test)]
mod tests {
    use super::splice;

    #[test]
    fn splice_covers_prepend_append_replace() {
        let mut b = b"body".to_vec();
        splice(&mut b, 0, 0, b">");
        assert_eq!(b, b">body");
        splice(&mut b, 5, 0, b"<");
        assert_eq!(b, b">body<");
        splice(&mut b, 99, 0, b"!");
        assert_eq!(b, b">body<!");
        splice(&mut b, 0, 99, b"new");
        assert_eq!(b, b"new");
        splice(&mut b, 1, 1, b"EE");
        assert_eq!(b, b"nEEw");
    }
}
