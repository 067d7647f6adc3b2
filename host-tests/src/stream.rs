//! One HTTP stream through the gateway, as a test drives it: the request and response arrive in
//! pieces, the plugin sees each piece, and the stream records what got past the plugin in each
//! direction.
//!
//! Flow control follows Envoy: `Pause` on headers holds them (body callbacks still run); `Pause`
//! on a body chunk buffers it, and the next body callback sees everything buffered; `Continue`
//! (or `proxy_continue_stream`) lets everything held pass. After a local reply or a reset by the
//! plugin, later events are dropped without calling the plugin, and only the end of the stream
//! (done, log, delete) is still delivered.

use anyhow::{bail, Context as _, Result};

use crate::abi::{property_path, Action};
use crate::gateway::{Gateway, Runtime};
use crate::headers::Headers;
use crate::hostcalls::properties;
use crate::state::{lock, Direction, HttpStream, LocalReply, Phase, ROOT_CONTEXT};

/// Which way data flows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Side {
    Request,
    Response,
}

impl Side {
    fn of(self, stream: &mut HttpStream) -> &mut Direction {
        match self {
            Side::Request => &mut stream.request,
            Side::Response => &mut stream.response,
        }
    }

    fn export(self, part: Part) -> &'static str {
        match (self, part) {
            (Side::Request, Part::Headers) => "proxy_on_request_headers",
            (Side::Request, Part::Body) => "proxy_on_request_body",
            (Side::Request, Part::Trailers) => "proxy_on_request_trailers",
            (Side::Response, Part::Headers) => "proxy_on_response_headers",
            (Side::Response, Part::Body) => "proxy_on_response_body",
            (Side::Response, Part::Trailers) => "proxy_on_response_trailers",
        }
    }
}

/// What of one side a callback delivers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Part {
    Headers,
    Body,
    Trailers,
}

/// An HTTP stream (one request and its response) on a [`Gateway`].
pub struct Stream<'g> {
    gateway: &'g Gateway,
    id: u32,
}

impl<'g> Stream<'g> {
    pub(crate) fn new(gateway: &'g Gateway, id: u32) -> Self {
        Self { gateway, id }
    }

    /// The stream's context id.
    pub fn id(&self) -> u32 {
        self.id
    }

    // ---- events ----

    /// Request headers arrive from the client. Values may be any bytes.
    pub fn request_headers<K: AsRef<[u8]>, V: AsRef<[u8]>>(&mut self, headers: &[(K, V)], end_of_stream: bool) -> Result<Action> {
        self.headers(Side::Request, Headers::from_pairs(headers), end_of_stream)
    }

    /// Request headers given as [`Headers`] (a chain hands them on without copying pairs).
    pub(crate) fn request_headers_owned(&mut self, headers: Headers, end_of_stream: bool) -> Result<Action> {
        self.headers(Side::Request, headers, end_of_stream)
    }

    /// Response headers given as [`Headers`].
    pub(crate) fn response_headers_owned(&mut self, headers: Headers, end_of_stream: bool) -> Result<Action> {
        self.headers(Side::Response, headers, end_of_stream)
    }

    /// A chunk of request body arrives from the client.
    pub fn request_body(&mut self, chunk: &[u8], end_of_stream: bool) -> Result<Action> {
        self.body(Side::Request, chunk, end_of_stream)
    }

    /// Request trailers arrive (they end the request).
    pub fn request_trailers<K: AsRef<[u8]>, V: AsRef<[u8]>>(&mut self, trailers: &[(K, V)]) -> Result<Action> {
        self.trailers(Side::Request, Headers::from_pairs(trailers))
    }

    /// Response headers arrive from upstream.
    pub fn response_headers<K: AsRef<[u8]>, V: AsRef<[u8]>>(&mut self, headers: &[(K, V)], end_of_stream: bool) -> Result<Action> {
        self.headers(Side::Response, Headers::from_pairs(headers), end_of_stream)
    }

    /// A chunk of response body arrives from upstream.
    pub fn response_body(&mut self, chunk: &[u8], end_of_stream: bool) -> Result<Action> {
        self.body(Side::Response, chunk, end_of_stream)
    }

    /// Response trailers arrive (they end the response).
    pub fn response_trailers<K: AsRef<[u8]>, V: AsRef<[u8]>>(&mut self, trailers: &[(K, V)]) -> Result<Action> {
        self.trailers(Side::Response, Headers::from_pairs(trailers))
    }

    /// The stream completes normally: `proxy_on_done`, `proxy_on_log`, `proxy_on_delete`.
    pub fn end(&mut self) -> Result<()> {
        self.finish()
    }

    /// The client goes away mid-stream. The plugin sees the same end of life as for [`Stream::end`]
    /// — done, log, delete — without ever having seen an end of stream.
    /// Like Envoy, the reason is readable as the `response.code_details` attribute.
    pub fn client_reset(&mut self) -> Result<()> {
        self.set_property(&["response", "code_details"], "downstream_remote_disconnect");
        self.finish()
    }

    /// The upstream connection resets. Before response headers, Envoy answers the client itself
    /// with a 503, which passes through the plugin like any response; after them, the stream just
    /// ends.
    pub fn upstream_reset(&mut self) -> Result<()> {
        let headers_seen = self.with(|s| s.response.headers_seen)?;
        if !headers_seen {
            self.response_headers(&[(":status", "503"), ("content-type", "text/plain")], false)?;
            self.response_body(b"upstream connect error or disconnect/reset before headers. reset reason: remote reset", true)?;
        } else {
            self.set_property(&["response", "code_details"], "upstream_reset_after_response_started{remote_reset}");
        }
        self.finish()
    }

    // ---- what happened ----

    /// The plugin's local reply, if it sent one.
    pub fn local_reply(&self) -> Option<LocalReply> {
        self.read(|s| s.local_reply.clone()).flatten()
    }

    /// Whether the plugin reset the stream (`proxy_close_stream`).
    pub fn closed_by_plugin(&self) -> bool {
        self.read(|s| s.closed_by_plugin).unwrap_or(false)
    }

    /// Whether the plugin is holding the request (it paused and has not resumed).
    pub fn request_paused(&self) -> bool {
        self.read(|s| s.phase == Phase::Open && s.request.paused).unwrap_or(false)
    }

    /// Whether the plugin is holding the response.
    pub fn response_paused(&self) -> bool {
        self.read(|s| s.phase == Phase::Open && s.response.paused).unwrap_or(false)
    }

    /// The request headers as sent upstream (after the plugin's changes), once they were let go.
    pub fn upstream_request_headers(&self) -> Option<Headers> {
        self.read(|s| s.request.sent_headers.clone()).flatten()
    }

    /// The request body bytes sent upstream so far.
    pub fn upstream_request_body(&self) -> Vec<u8> {
        self.read(|s| s.request.sent_body.clone()).unwrap_or_default()
    }

    /// The request trailers as sent upstream.
    pub fn upstream_request_trailers(&self) -> Option<Headers> {
        self.read(|s| s.request.sent_trailers.clone()).flatten()
    }

    /// The response headers the client received: the plugin's local reply (with `:status`), or
    /// the upstream's as changed by the plugin once they were let go.
    pub fn downstream_response_headers(&self) -> Option<Headers> {
        self.read(|s| match &s.local_reply {
            Some(reply) => {
                let mut headers = Headers::from_pairs(&[(":status", reply.status.to_string())]);
                for (k, v) in reply.headers.iter() {
                    headers.add(k, v);
                }
                Some(headers)
            }
            None => s.response.sent_headers.clone(),
        })
        .flatten()
    }

    /// The response body bytes the client received so far.
    pub fn downstream_body(&self) -> Vec<u8> {
        self.read(|s| match &s.local_reply {
            Some(reply) => reply.body.clone(),
            None => s.response.sent_body.clone(),
        })
        .unwrap_or_default()
    }

    /// The response trailers the client received.
    pub fn downstream_response_trailers(&self) -> Option<Headers> {
        self.read(|s| s.response.sent_trailers.clone()).flatten()
    }

    /// The property at `path` as the plugin would read it from this stream: what the plugin or
    /// the test set, else a gateway-wide value, else a built-in attribute.
    pub fn property(&self, path: &[&str]) -> Option<Vec<u8>> {
        let runtime = self.gateway.runtime();
        let state = runtime.state();
        let stream = state.streams.get(&self.id);
        properties::lookup(state, stream, &property_path(path))
    }

    /// Filter state the plugin set with `set_property([name], …)`: what Envoy's access log prints
    /// as `%FILTER_STATE(wasm.name:PLAIN)%`.
    pub fn filter_state(&self, name: &str) -> Option<Vec<u8>> {
        self.read(|s| lock(&s.properties).get(name.as_bytes()).map(<[u8]>::to_vec)).flatten()
    }

    /// Sets a property for this stream only (an attribute or filter state from an earlier filter).
    pub fn set_property(&self, path: &[&str], value: impl Into<Vec<u8>>) {
        let mut runtime = self.gateway.runtime();
        if let Some(stream) = runtime.state_mut().streams.get_mut(&self.id) {
            lock(&stream.properties).set(property_path(path), value.into());
        }
    }

    // ---- plumbing ----

    fn read<T>(&self, f: impl FnOnce(&HttpStream) -> T) -> Option<T> {
        self.gateway.runtime().state().streams.get(&self.id).map(f)
    }

    fn with<T>(&self, f: impl FnOnce(&mut HttpStream) -> T) -> Result<T> {
        let mut runtime = self.gateway.runtime();
        let stream = runtime.state_mut().streams.get_mut(&self.id).with_context(|| format!("unknown stream {}", self.id))?;
        Ok(f(stream))
    }

    /// Checks the stream can take an event, and creates its context on the first one.
    /// Returns false when the event is to be dropped (the plugin stopped the stream).
    fn open(&self, runtime: &mut Runtime) -> Result<bool> {
        let now = runtime.state().clock.now_ns();
        let stream = runtime.state_mut().streams.get_mut(&self.id).with_context(|| format!("unknown stream {}", self.id))?;
        match stream.phase {
            Phase::Finished => bail!("stream {} has already ended", self.id),
            Phase::Stopped => return Ok(false),
            Phase::Open => {}
        }
        if !stream.created {
            stream.created = true;
            stream.started_ns = now;
            runtime.call::<(u32, u32), ()>(self.id, "proxy_on_context_create", (self.id, ROOT_CONTEXT))?;
        }
        Ok(true)
    }

    /// Applies the plugin's answer to `side`.
    fn settle(&self, runtime: &mut Runtime, side: Side, code: u32) -> Action {
        let action = Action::from_code(code);
        if let Some(stream) = runtime.state_mut().streams.get_mut(&self.id) {
            if stream.phase == Phase::Open {
                let direction = side.of(stream);
                match action {
                    Action::Continue => direction.release(),
                    Action::Pause => direction.paused = true,
                }
            }
        }
        action
    }

    fn headers(&mut self, side: Side, headers: Headers, end_of_stream: bool) -> Result<Action> {
        let mut runtime = self.gateway.runtime();
        if !self.open(&mut runtime)? {
            return Ok(Action::Continue);
        }
        let count = len_u32(headers.len());
        if let Some(stream) = runtime.state_mut().streams.get_mut(&self.id) {
            let direction = side.of(stream);
            direction.headers = headers;
            direction.headers_seen = true;
        }
        let code: u32 = runtime.call(self.id, side.export(Part::Headers), (self.id, count, u32::from(end_of_stream)))?;
        Ok(self.settle(&mut runtime, side, code))
    }

    fn body(&mut self, side: Side, chunk: &[u8], end_of_stream: bool) -> Result<Action> {
        let mut runtime = self.gateway.runtime();
        if !self.open(&mut runtime)? {
            return Ok(Action::Continue);
        }
        let mut size = 0;
        if let Some(stream) = runtime.state_mut().streams.get_mut(&self.id) {
            let direction = side.of(stream);
            direction.body.extend_from_slice(chunk);
            size = len_u32(direction.body.len());
        }
        let code: u32 = runtime.call(self.id, side.export(Part::Body), (self.id, size, u32::from(end_of_stream)))?;
        Ok(self.settle(&mut runtime, side, code))
    }

    fn trailers(&mut self, side: Side, trailers: Headers) -> Result<Action> {
        let mut runtime = self.gateway.runtime();
        if !self.open(&mut runtime)? {
            return Ok(Action::Continue);
        }
        let count = len_u32(trailers.len());
        if let Some(stream) = runtime.state_mut().streams.get_mut(&self.id) {
            let direction = side.of(stream);
            direction.trailers = trailers;
            direction.trailers_seen = true;
        }
        let code: u32 = runtime.call(self.id, side.export(Part::Trailers), (self.id, count))?;
        Ok(self.settle(&mut runtime, side, code))
    }

    /// Ends the context's life: done, log, delete (the order proxy-wasm hosts use), once.
    fn finish(&mut self) -> Result<()> {
        let mut runtime = self.gateway.runtime();
        let stream = runtime.state_mut().streams.get_mut(&self.id).with_context(|| format!("unknown stream {}", self.id))?;
        if stream.phase == Phase::Finished {
            return Ok(());
        }
        if stream.created {
            let _done: u32 = runtime.call(self.id, "proxy_on_done", self.id)?;
            runtime.call::<u32, ()>(self.id, "proxy_on_log", self.id)?;
            runtime.call::<u32, ()>(self.id, "proxy_on_delete", self.id)?;
        }
        if let Some(stream) = runtime.state_mut().streams.get_mut(&self.id) {
            stream.phase = Phase::Finished;
        }
        Ok(())
    }
}

fn len_u32(len: usize) -> u32 {
    u32::try_from(len).unwrap_or(u32::MAX)
}
