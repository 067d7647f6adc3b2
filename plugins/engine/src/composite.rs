//! One filter instance running several sections (`{"model_router": …, "tenant_budget": …,
//! "llm_metrics": …}`): each event goes to the sections' streams in pipeline order on the request,
//! reversed on the response, as Envoy would take it through one filter per section — but in one
//! callback crossing, in one VM.
//!
//! What Envoy does between filters, this does between sections:
//! - a section that pauses a request event stops it there; the sections after it see the event
//!   when it continues — in the same callback (a whole body it buffered), or when a callout's
//!   answer lets it continue (its resume is deferred until the later sections have seen the
//!   event, then made once);
//! - a section that replaces or grows a body chunk hands the next section the new length;
//! - every section's tick keeps the period the others need ([`sluice_proxy_host::set_tick_period`]);
//! - the stream's [`host::stream::Slot`] is lent for every callback: a body chunk is fetched once
//!   for all sections, and the sections (and the other sluice filters of this VM on the stream)
//!   read the response through one shared observer.
//!
//! It relies on what the sections do with request bodies: one that reads a chunk and continues
//! (llm-metrics) must come after every section that pauses to buffer (model-router when it
//! rewrites or shadows, tenant-budget): a paused instance is handed the whole buffered body on the
//! next chunk, which such a section would read twice. The pipeline order gives exactly that.
//! latency-guard is never a section here: it pauses response headers, which would keep the body
//! from the sections that must see its first token.

use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::Action;
use sluice_proxy_host as host;
use std::time::Duration;

/// A request event a section paused, kept until that section continues.
#[derive(Debug, Clone, Copy)]
enum RequestEvent {
    Headers { num_headers: usize, end_of_stream: bool },
    Body { body_size: usize, end_of_stream: bool },
}

pub struct Composite {
    /// The sections' streams, in pipeline (request) order.
    children: Vec<Box<dyn HttpContext>>,
    /// The paused section's position and the event it paused.
    paused: Option<(usize, RequestEvent)>,
    tick_floor: Option<Duration>,
    slot: host::stream::Slot,
}

impl Composite {
    pub fn new(children: Vec<Box<dyn HttpContext>>, tick_floor: Option<Duration>, context_id: u32) -> Composite {
        let slot = host::stream::Slot::new(context_id, children.len());
        Composite { children, paused: None, tick_floor, slot }
    }

    /// Runs `callback` with the stream's slot lent and the instance's tick floor set.
    fn lent<R>(&mut self, callback: impl FnOnce(&mut Self) -> R) -> R {
        let outer = host::stream::enter(&mut self.slot);
        host::composite::set_tick_floor(self.tick_floor);
        let result = callback(self);
        host::composite::set_tick_floor(None);
        host::stream::leave(&mut self.slot, outer);
        result
    }

    /// Runs `event` through the sections from position `from` until one pauses it.
    fn run_request(&mut self, from: usize, mut event: RequestEvent) -> Action {
        let mut action = Action::Continue;
        self.paused = None;
        for (i, child) in self.children.iter_mut().enumerate().skip(from) {
            action = match event {
                RequestEvent::Headers { num_headers, end_of_stream } => child.on_http_request_headers(num_headers, end_of_stream),
                RequestEvent::Body { body_size, end_of_stream } => child.on_http_request_body(body_size, end_of_stream),
            };
            if let (RequestEvent::Body { body_size, .. }, Some(len)) = (&mut event, host::composite::take_body_len()) {
                *body_size = len;
            }
            if action != Action::Continue {
                self.paused = Some((i, event));
                break;
            }
        }
        action
    }

    /// Runs a response event through the sections in reverse order until one pauses it.
    fn run_response(&mut self, mut body_size: usize, mut event: impl FnMut(&mut dyn HttpContext, usize) -> Action) -> Action {
        self.lent(|this| {
            let mut action = Action::Continue;
            for child in this.children.iter_mut().rev() {
                action = event(child.as_mut(), body_size);
                if let Some(len) = host::composite::take_body_len() {
                    body_size = len;
                }
                if action != Action::Continue {
                    break;
                }
            }
            action
        })
    }
}

impl Context for Composite {
    fn on_http_call_response(&mut self, token: u32, num_headers: usize, body_size: usize, num_trailers: usize) {
        // A section answered by its callout may continue the request: not before the sections
        // after it have seen the event it paused.
        let continued = self.lent(|this| {
            host::composite::set_deferring(true);
            for child in &mut this.children {
                child.on_http_call_response(token, num_headers, body_size, num_trailers);
            }
            host::composite::set_deferring(false);
            if !host::composite::take_resume_wanted() {
                return false;
            }
            let action = match this.paused.take() {
                Some((i, RequestEvent::Body { body_size, end_of_stream })) => {
                    // The section may have replaced the buffered body while answering.
                    let body_size = host::composite::take_body_len().unwrap_or(body_size);
                    this.run_request(i + 1, RequestEvent::Body { body_size, end_of_stream })
                }
                Some((i, event)) => this.run_request(i + 1, event),
                None => Action::Continue,
            };
            action == Action::Continue
        });
        if continued {
            host::resume_request();
        }
    }
}

impl HttpContext for Composite {
    fn on_http_request_headers(&mut self, num_headers: usize, end_of_stream: bool) -> Action {
        self.lent(|this| this.run_request(0, RequestEvent::Headers { num_headers, end_of_stream }))
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let _ = host::composite::take_body_len();
        self.lent(|this| this.run_request(0, RequestEvent::Body { body_size, end_of_stream }))
    }

    fn on_http_response_headers(&mut self, num_headers: usize, end_of_stream: bool) -> Action {
        self.run_response(0, |child, _| child.on_http_response_headers(num_headers, end_of_stream))
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let _ = host::composite::take_body_len();
        self.run_response(body_size, |child, size| child.on_http_response_body(size, end_of_stream))
    }

    fn on_http_response_trailers(&mut self, num_trailers: usize) -> Action {
        self.run_response(0, |child, _| child.on_http_response_trailers(num_trailers))
    }

    fn on_log(&mut self) {
        self.lent(|this| {
            for child in this.children.iter_mut().rev() {
                child.on_log();
            }
        });
        self.slot.end();
    }
}
