//! Header maps: request/response headers and trailers of the current stream, the headers and
//! trailers of a callout reply, and gRPC metadata. Pairs travel in the format of
//! [`encode_map`](crate::abi::encode_map).

use wasmtime::{Caller, Linker, Result};

use super::MODULE;
use crate::abi::{decode_map, encode_map, reply, HostcallResult, MapType, Status};
use crate::guest;
use crate::headers::Headers;
use crate::state::HostState;

pub(super) fn add_to_linker(linker: &mut Linker<HostState>) -> Result<()> {
    linker.func_wrap(MODULE, "proxy_get_header_map_pairs", proxy_get_header_map_pairs)?;
    linker.func_wrap(MODULE, "proxy_set_header_map_pairs", proxy_set_header_map_pairs)?;
    linker.func_wrap(MODULE, "proxy_get_header_map_value", proxy_get_header_map_value)?;
    linker.func_wrap(MODULE, "proxy_add_header_map_value", proxy_add_header_map_value)?;
    linker.func_wrap(MODULE, "proxy_replace_header_map_value", proxy_replace_header_map_value)?;
    linker.func_wrap(MODULE, "proxy_remove_header_map_value", proxy_remove_header_map_value)?;
    Ok(())
}

/// The map `map_type` names in the current context, if it exists there.
fn map(state: &HostState, map_type: MapType) -> Option<&Headers> {
    match map_type {
        MapType::RequestHeaders => state.current_stream().map(|s| &s.request.headers),
        MapType::RequestTrailers => state.current_stream().map(|s| &s.request.trailers),
        MapType::ResponseHeaders => state.current_stream().map(|s| &s.response.headers),
        MapType::ResponseTrailers => state.current_stream().map(|s| &s.response.trailers),
        MapType::HttpCallResponseHeaders => state.callback.http_reply.as_ref().map(|r| &r.headers),
        MapType::HttpCallResponseTrailers => state.callback.http_reply.as_ref().map(|r| &r.trailers),
        MapType::GrpcInitialMetadata | MapType::GrpcTrailingMetadata => state.callback.grpc_metadata.as_ref(),
    }
}

/// The map `map_type` names, if the plugin may change it: its own stream's headers and trailers.
fn map_mut(state: &mut HostState, map_type: MapType) -> Option<&mut Headers> {
    let stream = state.current_stream_mut()?;
    match map_type {
        MapType::RequestHeaders => Some(&mut stream.request.headers),
        MapType::RequestTrailers => Some(&mut stream.request.trailers),
        MapType::ResponseHeaders => Some(&mut stream.response.headers),
        MapType::ResponseTrailers => Some(&mut stream.response.trailers),
        _ => None,
    }
}

fn proxy_get_header_map_pairs(mut caller: Caller<'_, HostState>, map_type: u32, data_out: u32, size_out: u32) -> HostcallResult {
    let Some(map_type) = MapType::from_code(map_type) else {
        return reply(Status::BadArgument);
    };
    guest::return_filled(&mut caller, data_out, size_out, |_, state, out| {
        // A map that does not exist here reads as empty, as in Envoy.
        match map(state, map_type) {
            Some(headers) => encode_map(headers.iter(), out),
            None => encode_map(std::iter::empty(), out),
        }
        Ok(true)
    })?;
    reply(Status::Ok)
}

fn proxy_set_header_map_pairs(mut caller: Caller<'_, HostState>, map_type: u32, ptr: u32, len: u32) -> HostcallResult {
    let Some(map_type) = MapType::from_code(map_type) else {
        return reply(Status::BadArgument);
    };
    let (guest, state) = guest::view(&mut caller);
    let pairs = match decode_map(guest.bytes(ptr, len)?) {
        Ok(pairs) => pairs,
        Err(status) => return reply(status),
    };
    let Some(headers) = map_mut(state, map_type) else {
        return reply(Status::NotFound);
    };
    *headers = Headers::from_vec(pairs);
    reply(Status::Ok)
}

fn proxy_get_header_map_value(mut caller: Caller<'_, HostState>, map_type: u32, key_ptr: u32, key_len: u32, value_out: u32, size_out: u32) -> HostcallResult {
    let Some(map_type) = MapType::from_code(map_type) else {
        return reply(Status::BadArgument);
    };
    let found = guest::return_filled(&mut caller, value_out, size_out, |guest, state, out| {
        let key = guest.bytes(key_ptr, key_len)?;
        let Some(value) = map(state, map_type).and_then(|h| h.first(key)) else {
            return Ok(false);
        };
        out.extend_from_slice(value);
        Ok(true)
    })?;
    reply(if found { Status::Ok } else { Status::NotFound })
}

/// Shared body of the three single-value edits.
fn edit(caller: &mut Caller<'_, HostState>, map_type: u32, key: (u32, u32), value: (u32, u32), apply: fn(&mut Headers, &[u8], &[u8])) -> HostcallResult {
    let Some(map_type) = MapType::from_code(map_type) else {
        return reply(Status::BadArgument);
    };
    let (guest, state) = guest::view(caller);
    let key = guest.bytes(key.0, key.1)?;
    let value = guest.bytes(value.0, value.1)?;
    let Some(headers) = map_mut(state, map_type) else {
        return reply(Status::NotFound);
    };
    apply(headers, key, value);
    reply(Status::Ok)
}

fn proxy_add_header_map_value(mut caller: Caller<'_, HostState>, map_type: u32, key_ptr: u32, key_len: u32, value_ptr: u32, value_len: u32) -> HostcallResult {
    edit(&mut caller, map_type, (key_ptr, key_len), (value_ptr, value_len), Headers::add)
}

fn proxy_replace_header_map_value(
    mut caller: Caller<'_, HostState>,
    map_type: u32,
    key_ptr: u32,
    key_len: u32,
    value_ptr: u32,
    value_len: u32,
) -> HostcallResult {
    edit(&mut caller, map_type, (key_ptr, key_len), (value_ptr, value_len), Headers::replace)
}

fn proxy_remove_header_map_value(mut caller: Caller<'_, HostState>, map_type: u32, key_ptr: u32, key_len: u32) -> HostcallResult {
    edit(&mut caller, map_type, (key_ptr, key_len), (0, 0), |headers, key, _| headers.remove(key))
}
