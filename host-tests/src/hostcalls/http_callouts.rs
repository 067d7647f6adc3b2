//! `proxy_http_call`: the plugin asks an Envoy cluster for something; the host books the call and
//! returns a token. The reply comes when the test gives one (or the timeout passes on the virtual
//! clock), through `proxy_on_http_call_response`.

use wasmtime::{Caller, Linker, Result};

use super::callouts::{deadline, HttpCall};
use super::MODULE;
use crate::abi::{decode_map, reply, HostcallResult, Status};
use crate::guest;
use crate::headers::Headers;
use crate::state::HostState;

pub(super) fn add_to_linker(linker: &mut Linker<HostState>) -> Result<()> {
    linker.func_wrap(MODULE, "proxy_http_call", proxy_http_call)?;
    Ok(())
}

#[allow(clippy::too_many_arguments)] // the ABI's shape
fn proxy_http_call(
    mut caller: Caller<'_, HostState>,
    upstream_ptr: u32,
    upstream_len: u32,
    headers_ptr: u32,
    headers_len: u32,
    body_ptr: u32,
    body_len: u32,
    trailers_ptr: u32,
    trailers_len: u32,
    timeout_ms: u32,
    token_out: u32,
) -> HostcallResult {
    let upstream = guest::read_string(&mut caller, upstream_ptr, upstream_len)?;
    let headers = guest::read(&mut caller, headers_ptr, headers_len)?;
    let body = guest::read(&mut caller, body_ptr, body_len)?;
    let trailers = guest::read(&mut caller, trailers_ptr, trailers_len)?;
    let (Ok(headers), Ok(trailers)) = (decode_map(&headers), decode_map(&trailers)) else {
        return reply(Status::BadArgument);
    };
    let headers = Headers::from_vec(headers);
    // Envoy refuses a call without these.
    if [":method", ":path", ":authority"].iter().any(|h| !headers.contains(h)) {
        return reply(Status::BadArgument);
    }
    let state = caller.data_mut();
    let token = state.callouts.next_token();
    let (timeout, deadline_ns) = deadline(state.clock.now_ns(), timeout_ms);
    let call = HttpCall { token, context_id: state.effective_context, upstream, headers, body, trailers: Headers::from_vec(trailers), timeout, deadline_ns };
    state.callouts.http.insert(token, call);
    guest::write_u32(&mut caller, token_out, token)?;
    reply(Status::Ok)
}
