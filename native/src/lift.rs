//! Filter `sluice-body-metadata`: the request body's `model` (and `user`) into the stream's dynamic
//! metadata, for model-router, which picks a version at the request headers — the job Envoy's
//! `json_to_metadata` filter does in the wasm gateways, natively and about as cheaply as the
//! module's own reading of the body.
//!
//! Measured in Envoy 1.40 (docs/native.md): `json_to_metadata` in front of the native chain cost
//! ≈ 95 µs of Envoy CPU per request — it parses the whole body into a JSON tree and converts it.
//! This filter holds the request headers until the body has arrived, reads it with core's request
//! inspection (the one tenant-budget and latency-guard read it with: on the same worker their
//! reading of the same bytes is then remembered, not parsed again), writes
//! `metadata.filter_metadata.sluice.model` and `…sluice.user` where the body has them as strings,
//! and lets headers and body go on together.
//!
//! What it lifts and when, as the `json_to_metadata` rules of envoy/templates/full-gateway.yaml do:
//! top-level `model` and `user` when they are strings (`user` not for Anthropic's Messages API,
//! whose end user is `metadata.user_id`, which those rules do not lift either). It lifts nothing,
//! and lets the request go unchanged, for a request that is not to an LLM path core knows
//! (`sluice_core::api::ApiKind::from_path`), has no body, has a `content-encoding`, is not a JSON
//! object, or is larger than [`MAX_BODY_BYTES`] (then it stops reading and lets what it held go
//! on; debug log lines say which). Unlike `json_to_metadata`, which reads only `application/json`
//! bodies by default, it does not look at `content-type`: core's policies read a JSON body whatever
//! type it is sent as, and the lift reads what they read.

use sluice_core::api::ApiKind;
use sluice_core::contract::USER_METADATA;
use sluice_core::request::inspect_request_with_kind;

use crate::filter::{log, log_enabled, BodyKind, BodyStatus, Envoy, Filter, FilterConfig, HeadersStatus, LogLevel};

/// The filter name this module answers to for the lift.
pub const FILTER_NAME: &str = "sluice-body-metadata";

/// The metadata namespace and keys written (what model-router reads).
const NAMESPACE: &str = "sluice";
const MODEL_KEY: &str = "model";

/// The most body bytes held: tenant-budget's own bound on a request body it reads.
pub const MAX_BODY_BYTES: usize = sluice_core::flow::budget::MAX_REQUEST_BODY_BYTES;

/// The filter's configuration: none.
pub struct LiftConfig;

/// Accepts an empty configuration (no bytes, or `{}`); anything else is refused with the reason.
pub fn new_config(config: &[u8]) -> Result<LiftConfig, String> {
    crate::filter::no_configuration(FILTER_NAME, config, " (it lifts the body's model and user into metadata namespace sluice)")?;
    Ok(LiftConfig)
}

impl FilterConfig for LiftConfig {
    fn new_filter(&self) -> Box<dyn Filter> {
        Box::new(Lift { kind: None, body: Vec::new() })
    }
}

/// One stream: the API kind of its path while it holds the request, and the body read so far.
struct Lift {
    kind: Option<ApiKind>,
    body: Vec<u8>,
}

fn debug(message: &str) {
    if log_enabled(LogLevel::Debug) {
        log(LogLevel::Debug, message);
    }
}

impl Lift {
    /// Lets the request go without lifting (what was held goes on with it).
    fn give_up(&mut self, why: &str) -> BodyStatus {
        debug(&format!("{FILTER_NAME}: nothing lifted: {why}"));
        self.kind = None;
        self.body = Vec::new();
        BodyStatus::Continue
    }
}

impl Filter for Lift {
    fn on_request_headers(&mut self, envoy: &mut Envoy<'_>, end_of_stream: bool) -> HeadersStatus {
        if end_of_stream {
            return HeadersStatus::Continue;
        }
        let headers = envoy.request_headers();
        let kind = headers.get(":path").and_then(|p| std::str::from_utf8(p).ok()).and_then(ApiKind::from_path);
        let Some(kind) = kind else { return HeadersStatus::Continue };
        if headers.get("content-encoding").is_some_and(sluice_core::headers::is_encoded) {
            debug(&format!("{FILTER_NAME}: nothing lifted: the request body has a content-encoding"));
            return HeadersStatus::Continue;
        }
        self.kind = Some(kind);
        envoy.raise_buffer_limit(crate::filter::HELD_BODY_BUFFER_LIMIT);
        HeadersStatus::StopIteration
    }

    fn on_request_body(&mut self, envoy: &mut Envoy<'_>, end_of_stream: bool) -> BodyStatus {
        let Some(kind) = self.kind else { return BodyStatus::Continue };
        let chunk = envoy.body(BodyKind::ReceivedRequest);
        if self.body.len().saturating_add(chunk.len()) > MAX_BODY_BYTES {
            return self.give_up(&format!("the request body is over {MAX_BODY_BYTES} bytes"));
        }
        chunk.copy_into(&mut self.body);
        if !end_of_stream {
            return BodyStatus::StopIterationAndBuffer;
        }
        match inspect_request_with_kind(kind, &self.body) {
            Ok((kind, info)) => {
                if let Some(model) = &info.model {
                    envoy.set_dynamic_metadata_string(NAMESPACE, MODEL_KEY, model);
                }
                // `user` as json_to_metadata's rule lifts it: top-level, so not Anthropic's.
                if let (Some(user), false) = (&info.user, kind == ApiKind::AnthropicMessages) {
                    envoy.set_dynamic_metadata_string(NAMESPACE, USER_METADATA[3], user);
                }
                self.kind = None;
                self.body = Vec::new();
                BodyStatus::Continue
            }
            Err(e) => self.give_up(&e.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_configuration_is_accepted_and_anything_else_refused() {
        assert!(new_config(b"").is_ok());
        assert!(new_config(b" {} \n").is_ok());
        assert_eq!(
            new_config(br#"{"model":"x"}"#).err(),
            Some(r#"filter "sluice-body-metadata" takes no configuration (it lifts the body's model and user into metadata namespace sluice); got 13 bytes: "{\"model\":\"x\"}""#.to_string())
        );
    }

    #[test]
    fn it_writes_where_model_router_reads() {
        assert_eq!(["metadata", "filter_metadata", NAMESPACE, MODEL_KEY], sluice_core::contract::MODEL_METADATA);
        assert_eq!(["metadata", "filter_metadata", NAMESPACE], [USER_METADATA[0], USER_METADATA[1], USER_METADATA[2]]);
    }
}
