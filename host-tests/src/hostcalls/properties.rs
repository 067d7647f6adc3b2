//! Properties (Envoy attributes and filter state): `proxy_get_property` and `proxy_set_property`.
//!
//! A read looks, in order, at what was set on the current stream (by the plugin or by the test),
//! what was set on the root context or for the whole gateway, and then at the attributes the host
//! derives itself:
//!
//! | path                                          | value                                            |
//! |-----------------------------------------------|--------------------------------------------------|
//! | `plugin_name`, `plugin_root_id`, `plugin_vm_id` | from the [`PluginSpec`](crate::PluginSpec)     |
//! | `request.path` `.url_path` `.host` `.method` `.scheme` `.id` `.protocol` `.useragent` | from the request headers |
//! | `request.headers.<name>`, `response.headers.<name>` | a header value                             |
//! | `request.time`                                | first event of the stream, ns since epoch, i64 LE |
//! | `response.code`                               | `:status` as i64 LE                              |
//! | `source.address`, `destination.address`       | `10.0.0.1:50000`, `10.0.0.2:8080`                |
//! | `source.port`, `destination.port`             | i64 LE                                           |
//!
//! Integers and timestamps are 8-byte little-endian, as Envoy serializes them.

use std::borrow::Cow;
use std::collections::BTreeMap;

use wasmtime::{Caller, Linker, Result};

use super::MODULE;
use crate::abi::{reply, split_property_path, HostcallResult, Status};
use crate::guest;
use crate::state::{lock, HostState, HttpStream};

/// Values stored under property paths (in wire form: segments joined by NUL).
#[derive(Clone, Debug, Default)]
pub(crate) struct Properties(BTreeMap<Vec<u8>, Vec<u8>>);

impl Properties {
    pub fn get(&self, path: &[u8]) -> Option<&[u8]> {
        self.0.get(path).map(Vec::as_slice)
    }

    pub fn set(&mut self, path: Vec<u8>, value: Vec<u8>) {
        self.0.insert(path, value);
    }

    /// Values under one-segment paths (filter state, `%FILTER_STATE(wasm.<name>)%`), by name.
    pub fn filter_state(&self) -> Vec<(String, Vec<u8>)> {
        self.0.iter().filter(|(k, _)| !k.contains(&0)).map(|(k, v)| (String::from_utf8_lossy(k).into_owned(), v.clone())).collect()
    }
}

pub(super) fn add_to_linker(linker: &mut Linker<HostState>) -> Result<()> {
    linker.func_wrap(MODULE, "proxy_get_property", proxy_get_property)?;
    linker.func_wrap(MODULE, "proxy_set_property", proxy_set_property)?;
    Ok(())
}

/// Canonical key of a path the plugin sent (a trailing NUL is dropped).
fn key(raw: &[u8]) -> &[u8] {
    raw.strip_suffix(&[0]).unwrap_or(raw)
}

/// Resolves `path` as the plugin would see it from `stream` (or from the root, with `None`).
pub(crate) fn lookup(state: &HostState, stream: Option<&HttpStream>, path: &[u8]) -> Option<Vec<u8>> {
    let mut value = Vec::new();
    lookup_into(state, stream, path, &mut value).then_some(value)
}

/// [`lookup`], appending the value to `out` (a hostcall's reused buffer); false when there is none.
fn lookup_into(state: &HostState, stream: Option<&HttpStream>, path: &[u8], out: &mut Vec<u8>) -> bool {
    let path = key(path);
    if let Some(stream) = stream {
        if let Some(value) = lock(&stream.properties).get(path) {
            out.extend_from_slice(value);
            return true;
        }
    }
    if let Some(value) = state.properties.get(path) {
        out.extend_from_slice(value);
        return true;
    }
    match builtin(state, stream, &split_property_path(path)) {
        Some(value) => {
            out.extend_from_slice(&value);
            true
        }
        None => false,
    }
}

fn int(value: i64) -> Cow<'static, [u8]> {
    Cow::Owned(value.to_le_bytes().to_vec())
}

fn builtin<'a>(state: &'a HostState, stream: Option<&'a HttpStream>, path: &[&[u8]]) -> Option<Cow<'a, [u8]>> {
    let plugin = &state.plugin;
    let request_header = |name: &[u8]| stream.and_then(|s| s.request.headers.first(name)).map(Cow::Borrowed);
    match path {
        [b"plugin_name"] => Some(Cow::Borrowed(plugin.name.as_bytes())),
        [b"plugin_root_id"] => Some(Cow::Borrowed(plugin.root_id.as_bytes())),
        [b"plugin_vm_id"] => Some(Cow::Borrowed(plugin.vm_id.as_bytes())),
        [b"source", b"address"] => Some(Cow::Borrowed(b"10.0.0.1:50000")),
        [b"source", b"port"] => Some(int(50000)),
        [b"destination", b"address"] => Some(Cow::Borrowed(b"10.0.0.2:8080")),
        [b"destination", b"port"] => Some(int(8080)),
        [b"request", b"path"] => request_header(b":path"),
        [b"request", b"url_path"] => {
            stream.and_then(|s| s.request.headers.first(b":path")).map(|p| Cow::Borrowed(p.split(|b| *b == b'?').next().unwrap_or_default()))
        }
        [b"request", b"host"] => request_header(b":authority"),
        [b"request", b"method"] => request_header(b":method"),
        [b"request", b"scheme"] => request_header(b":scheme"),
        [b"request", b"id"] => request_header(b"x-request-id"),
        [b"request", b"useragent"] => request_header(b"user-agent"),
        [b"request", b"protocol"] => stream.map(|_| Cow::Borrowed(&b"HTTP/1.1"[..])),
        [b"request", b"time"] => stream.map(|s| int(i64::try_from(s.started_ns).unwrap_or(i64::MAX))),
        [b"request", b"headers", name] => request_header(name),
        [b"response", b"headers", name] => stream.and_then(|s| s.response.headers.first(name)).map(Cow::Borrowed),
        [b"response", b"code"] => {
            stream.and_then(|s| s.response.headers.first(b":status")).and_then(|v| std::str::from_utf8(v).ok()?.parse::<i64>().ok()).map(int)
        }
        _ => None,
    }
}

fn proxy_get_property(mut caller: Caller<'_, HostState>, path_ptr: u32, path_len: u32, value_out: u32, size_out: u32) -> HostcallResult {
    let found = guest::return_filled(&mut caller, value_out, size_out, |guest, state, out| {
        let path = guest.bytes(path_ptr, path_len)?;
        Ok(lookup_into(state, state.current_stream(), path, out))
    })?;
    reply(if found { Status::Ok } else { Status::NotFound })
}

fn proxy_set_property(mut caller: Caller<'_, HostState>, path_ptr: u32, path_len: u32, value_ptr: u32, value_len: u32) -> HostcallResult {
    let (guest, state) = guest::view(&mut caller);
    let path = key(guest.bytes(path_ptr, path_len)?).to_vec();
    let value = guest.bytes(value_ptr, value_len)?.to_vec();
    match state.current_stream_mut() {
        Some(stream) => lock(&stream.properties).set(path, value),
        None => state.properties.set(path, value),
    }
    reply(Status::Ok)
}
