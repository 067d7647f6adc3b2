//! Shared by the model-router tests: the compiled `sluice_model_router.wasm`, the demo policy and
//! policies derived from it, requests as Envoy hands them to the router (the body's `model` already
//! lifted into dynamic metadata by `json_to_metadata`), the decision the router leaves behind, and
//! the names of its metrics. Request and response payloads come from [`super::llm`].

use std::sync::OnceLock;
use std::time::SystemTime;

use serde_json::{json, Value};
use sluice_host::{workspace_wasm, Gateway, Headers, Plugin, PluginSpec, Stream};

use super::llm::{self, chat, Call};

/// Where `json_to_metadata` puts the body's `model` (envoy/templates/router-gateway.yaml).
pub use sluice_core::contract::MODEL_METADATA;
/// The demo policy's trusted override property (jwt_authn metadata in the demo gateway).
pub const FORCE_PROPERTY: [&str; 4] = ["metadata", "filter_metadata", "sluice_trusted", "force_version"];
/// `policies/model-router.demo.json`, as shipped.
pub const DEMO: &str = include_str!("../../../policies/model-router.demo.json");

/// The demo's logical model, its versions, routes and upstream names.
pub const MODEL: &str = "llama-3-70b";
pub const V1_UPSTREAM: &str = "llama-3-70b";
pub const V2_UPSTREAM: &str = "llama-3-70b-v2";
pub const ROUTE_V1: &str = "llama-v1";
pub const ROUTE_V2: &str = "llama-v2";
/// The demo's shadow version, its upstream model, cluster and authority.
pub const SHADOW: &str = "qwen-72b-v1";
pub const SHADOW_UPSTREAM: &str = "qwen-72b";
pub const SHADOW_CLUSTER: &str = "qwen_v1";
pub const SHADOW_AUTHORITY: &str = "qwen.internal";

pub const ROUTE_HEADER: &str = "x-sluice-route";
pub const VERSION_HEADER: &str = "x-model-version";
pub const TENANT_HEADER: &str = "x-sluice-tenant";
pub const CLIENT_OVERRIDE_HEADER: &str = "x-sluice-force-version";

/// The compiled model-router plugin (compiled once per test binary; build it first with
/// `cargo build --release --target wasm32-wasip1 -p sluice-model-router`).
pub fn plugin() -> Plugin {
    static PLUGIN: OnceLock<Plugin> = OnceLock::new();
    PLUGIN.get_or_init(|| Plugin::load(workspace_wasm(super::build_stem("sluice_model_router"))).expect("the build compiles")).clone()
}

/// The demo policy, parsed (tests change fields of it).
pub fn demo() -> Value {
    serde_json::from_str(DEMO).expect("the demo policy is JSON")
}

/// The demo policy with every request of non-excluded tenants shadowed (`fraction` 1) and at most
/// `max_concurrent` shadows in flight.
pub fn demo_shadow_all(max_concurrent: u32) -> Value {
    let mut p = demo();
    p["models"][0]["shadow"]["fraction"] = json!(1.0);
    p["models"][0]["shadow"]["max_concurrent"] = json!(max_concurrent);
    p
}

/// The demo policy without its shadow.
pub fn demo_no_shadow() -> Value {
    let mut p = demo();
    p["models"][0].as_object_mut().expect("model entry").remove("shadow");
    p
}

/// The demo policy at a `w1`/`w2` split of v1/v2, without shadow.
pub fn split(w1: u64, w2: u64) -> Value {
    let mut p = demo_no_shadow();
    p["models"][0]["versions"][0]["weight"] = json!(w1);
    p["models"][0]["versions"][1]["weight"] = json!(w2);
    p
}

/// A gateway running model-router with `policy` (its clock at 2026-01-01T00:00:00Z).
pub fn gateway(policy: &Value) -> Gateway {
    Gateway::start(&plugin(), spec(&policy.to_string())).unwrap_or_else(|e| panic!("model-router refused the policy: {e:#}\npolicy: {policy}"))
}

/// A gateway running model-router with `policy`, its clock at `t`.
pub fn gateway_at(policy: &Value, t: SystemTime) -> Gateway {
    Gateway::start(&plugin(), spec(&policy.to_string()).start_time(t)).unwrap_or_else(|e| panic!("model-router refused the policy: {e:#}\npolicy: {policy}"))
}

/// The error a policy is refused with (panics if it is accepted).
pub fn refusal(policy: &str) -> String {
    match Gateway::start(&plugin(), spec(policy)) {
        Ok(_) => panic!("model-router accepted {policy}"),
        Err(e) => format!("{e:#}"),
    }
}

/// [`chat::request`] (streamed, with usage) asking for `model`, byte for byte otherwise the same.
pub fn chat_body(model: &str) -> String {
    let body = chat::request(true, true);
    let from = r#""model":"gpt-4o""#;
    assert!(body.contains(from), "chat::request names gpt-4o: {body}");
    body.replacen(from, &format!(r#""model":{}"#, json!(model)), 1)
}

/// One request as the router receives it.
#[derive(Clone, Debug)]
pub struct Req {
    /// The body's `model` as `json_to_metadata` lifted it (`None`: no metadata).
    pub model: Option<String>,
    pub tenant: Option<String>,
    pub request_id: String,
    /// The trusted override property's value.
    pub force: Option<String>,
    /// Further request headers (after the standard ones of [`llm::headers`]).
    pub extra: Vec<(String, String)>,
    /// The body (`None`: the headers end the request).
    pub body: Option<Vec<u8>>,
    /// Size of the pieces the body arrives in (`None`: one piece).
    pub chunk: Option<usize>,
    /// The request path (an API's endpoint).
    pub path: String,
}

impl Req {
    /// A chat request for [`MODEL`] from `tenant`, headers only.
    pub fn new(tenant: &str, request_id: &str) -> Self {
        Self {
            model: Some(MODEL.into()),
            tenant: Some(tenant.into()),
            request_id: request_id.into(),
            force: None,
            extra: Vec::new(),
            body: None,
            chunk: None,
            path: chat::PATH.into(),
        }
    }
    pub fn model(mut self, m: Option<&str>) -> Self {
        self.model = m.map(str::to_string);
        self
    }
    pub fn tenant(mut self, t: Option<&str>) -> Self {
        self.tenant = t.map(str::to_string);
        self
    }
    pub fn force(mut self, v: &str) -> Self {
        self.force = Some(v.into());
        self
    }
    pub fn header(mut self, k: &str, v: &str) -> Self {
        self.extra.push((k.into(), v.into()));
        self
    }
    /// With a body (and its `content-length`, as clients send it).
    pub fn body(mut self, b: impl Into<Vec<u8>>) -> Self {
        self.body = Some(b.into());
        self
    }
    /// The streamed chat body of [`chat_body`] for [`MODEL`].
    pub fn chat(self) -> Self {
        self.body(chat_body(MODEL))
    }
    /// Another API: its `path` and `body`, whose `model` becomes [`MODEL`] (as the client asks for
    /// the logical model).
    pub fn api(mut self, path: &str, body: &str) -> Self {
        let mut v: Value = serde_json::from_str(body).expect("a JSON body");
        v["model"] = json!(MODEL);
        path.clone_into(&mut self.path);
        self.body(v.to_string())
    }
    pub fn chunked(mut self, size: usize) -> Self {
        self.chunk = Some(size);
        self
    }

    /// The request headers as the client sent them.
    pub fn headers(&self) -> Vec<(String, String)> {
        let mut h: Vec<(String, String)> = llm::headers(&self.path, &[]).into_iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        h.push(("x-request-id".into(), self.request_id.clone()));
        if let Some(t) = &self.tenant {
            h.push((TENANT_HEADER.into(), t.clone()));
        }
        if let Some(b) = &self.body {
            h.push(("content-length".into(), b.len().to_string()));
        }
        h.extend(self.extra.iter().cloned());
        h
    }

    /// Sends the request on a new stream of `gw` at the current time: metadata first (as
    /// json_to_metadata writes it before the router runs), then headers, then the body.
    pub fn send<'g>(&self, gw: &'g Gateway) -> Stream<'g> {
        let mut s = gw.stream();
        if let Some(m) = &self.model {
            s.set_property(&MODEL_METADATA, m.as_bytes());
        }
        if let Some(f) = &self.force {
            s.set_property(&FORCE_PROPERTY, f.as_bytes());
        }
        s.request_headers(&self.headers(), self.body.is_none()).expect("request headers");
        if let Some(body) = &self.body {
            let size = self.chunk.unwrap_or(body.len()).max(1);
            let pieces: Vec<&[u8]> = body.chunks(size).collect();
            let last = pieces.len().saturating_sub(1);
            for (i, piece) in pieces.iter().enumerate() {
                s.request_body(piece, i == last).expect("request body");
            }
        }
        s
    }

    /// [`Req::send`], as an [`llm::Call`] whose offsets count from now, to play the response with.
    pub fn call<'g>(&self, gw: &'g Gateway) -> Call<'g> {
        let start_ns = gw.now_ns();
        let stream = self.send(gw);
        Call { gw, stream, start_ns, upstream_body: Vec::new() }
    }
}

/// What the router decided for one stream, read from what it sent upstream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Routed {
    /// Every value of the route header sent upstream.
    pub routes: Vec<String>,
    /// Every value of the version header sent upstream.
    pub versions: Vec<String>,
    /// The `sluice_route` filter state.
    pub stamp: Option<Value>,
}

impl Routed {
    /// The one route sent upstream (panics unless exactly one).
    pub fn route(&self) -> &str {
        assert_eq!(self.routes.len(), 1, "exactly one route header upstream: {self:?}");
        &self.routes[0]
    }
    pub fn version(&self) -> &str {
        assert_eq!(self.versions.len(), 1, "exactly one version header upstream: {self:?}");
        &self.versions[0]
    }
    pub fn reason(&self) -> &str {
        self.stamp.as_ref().and_then(|s| s["reason"].as_str()).unwrap_or_else(|| panic!("no decision stamp: {self:?}"))
    }
}

fn all(headers: &Headers, name: &str) -> Vec<String> {
    headers.get_all(name).map(|v| String::from_utf8_lossy(v).into_owned()).collect()
}

pub fn routed(s: &Stream) -> Routed {
    let up = s.upstream_request_headers().expect("the router let the request headers go");
    Routed {
        routes: all(&up, ROUTE_HEADER),
        versions: all(&up, VERSION_HEADER),
        stamp: s.filter_state("sluice_route").map(|raw| serde_json::from_slice(&raw).expect("the route stamp is JSON")),
    }
}

/// Routes `req` (headers only), ends the stream and returns the decision.
pub fn decide(gw: &Gateway, req: &Req) -> Routed {
    let mut s = req.send(gw);
    let r = routed(&s);
    s.end().expect("end of stream");
    r
}

/// The decision for `tenant` (a fresh request id each time).
pub fn decide_tenant(gw: &Gateway, tenant: &str, request_id: &str) -> Routed {
    decide(gw, &Req::new(tenant, request_id))
}

// ---- metric names ----

/// `sluice.router.requests_total.model.<m>.version.<v>.reason.<r>`
pub fn requests_total(model: &str, version: &str, reason: &str) -> String {
    format!("sluice.router.requests_total.model.{model}.version.{version}.reason.{reason}")
}

/// `sluice.router.shadow_total.primary.<p>.shadow.<s>.result.<r>`
pub fn shadow_total(primary: &str, shadow: &str, result: &str) -> String {
    format!("sluice.router.shadow_total.primary.{primary}.shadow.{shadow}.result.{result}")
}

/// `sluice.router.<metric>.primary.<p>.shadow.<s>` (add `.side.<side>` where the metric has one).
pub fn compare(metric: &str, primary: &str, shadow: &str) -> String {
    format!("sluice.router.{metric}.primary.{primary}.shadow.{shadow}")
}

/// `sluice.router.<metric>.primary.<p>.shadow.<s>.side.<side>`
pub fn compare_side(metric: &str, primary: &str, shadow: &str, side: &str) -> String {
    format!("{}.side.{side}", compare(metric, primary, shadow))
}

/// Every metric the plugin defined whose name starts with `prefix`.
pub fn metrics_with_prefix(gw: &Gateway, prefix: &str) -> Vec<String> {
    gw.metric_names().into_iter().filter(|n| n.starts_with(prefix)).collect()
}

/// A policy as the build under test reads it ([`super::section_spec`]).
pub fn spec(policy: &str) -> PluginSpec {
    super::section_spec("model_router", policy)
}
