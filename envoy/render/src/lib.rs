//! Renders sluice's Envoy templates into files Envoy runs as they are.
//!
//! Every `envoy/templates/*gateway.yaml` is a template with `{{NAME}}` placeholders: ports, the `.wasm`
//! directory, the access-log path and each plugin's policy JSON. [`Gateway::render`] fills them with
//! the values `cargo xtask up` uses and the example policies from `policies/`; `cargo xtask render`
//! writes the result to `envoy/rendered/<gateway>.yaml`, and the end-to-end tests render the same way
//! and fail when a committed file differs. Dependency-free, so `cargo xtask` stays quick to build.
//!
//! How a policy gets into the YAML (docs/configuration.md, "Embedding a policy in Envoy YAML"):
//! - a template line that is exactly `value: "{{NAME}}"` becomes a literal block scalar
//!   (`value: |` and the JSON, verbatim, indented two more spaces): readable and editable in place;
//! - anywhere else the JSON goes into the double-quoted YAML string around the placeholder, escaped
//!   by [`yaml_string_body`].

use std::fmt;
use std::path::Path;

/// Where `cargo xtask build` puts the plugins, relative to the repository root: the rendered files
/// are run from there (Envoy resolves a relative filename against its working directory).
pub const WASM_DIR: &str = "target/wasm32-wasip1/release";
/// Envoy's standard output: exists wherever Envoy runs, so the rendered files need no directory.
pub const ACCESS_LOG: &str = "/dev/stdout";
/// The gateway's listener and admin ports (loopback only), as `cargo xtask up` serves them.
pub const LISTEN_PORT: u16 = 10000;
pub const ADMIN_PORT: u16 = 9901;
/// The fleet ledger service (`sluice-ledger`, `{{LEDGER_PORT}}`) and the Redis behind it, as
/// `cargo xtask up --fleet` serves them (loopback only; not Redis's usual 6379, which a system Redis
/// may hold).
pub const LEDGER_PORT: u16 = 18090;
pub const REDIS_PORT: u16 = 16379;
/// Timing of the demo mocks: one content token every 25 ms, 24 tokens an answer.
pub const MOCK_ITL_MS: u32 = 25;
pub const MOCK_TOKENS: u32 = 24;

/// A mock model server a gateway routes to, as `cargo xtask up` starts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mock {
    /// The template placeholder that holds its port.
    pub placeholder: &'static str,
    pub port: u16,
    /// The mock's `x-mock-served-by` header: which model version answered.
    pub served_by: &'static str,
    pub ttft_ms: u32,
}

impl Mock {
    /// The `sluice-mock-server` arguments that start it.
    pub fn args(&self) -> Vec<String> {
        vec![
            "--listen".into(),
            format!("127.0.0.1:{}", self.port),
            "--served-by".into(),
            self.served_by.into(),
            "--ttft-ms".into(),
            self.ttft_ms.to_string(),
            "--itl-ms".into(),
            MOCK_ITL_MS.to_string(),
            "--tokens".into(),
            MOCK_TOKENS.to_string(),
        ]
    }
}

/// The current version, the canary and the shadow model (the router templates' three clusters);
/// single-upstream templates use the first.
pub const MOCKS: [Mock; 3] = [
    Mock { placeholder: "UPSTREAM_PORT", port: 18000, served_by: "llama-3-70b-v1", ttft_ms: 180 },
    Mock { placeholder: "UPSTREAM_PORT_V2", port: 18001, served_by: "llama-3-70b-v2", ttft_ms: 140 },
    Mock { placeholder: "SHADOW_PORT", port: 18002, served_by: "qwen-72b-v1", ttft_ms: 220 },
];

/// A shipped gateway template and the example policies it is rendered with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gateway {
    /// File stem: the template is `envoy/templates/<name>.yaml`, the rendered file `envoy/rendered/<name>.yaml`.
    pub name: &'static str,
    /// Policy placeholders and the file in `policies/` each is filled with.
    pub policies: &'static [(&'static str, &'static str)],
    /// How many of [`MOCKS`] it routes to (the first `mocks`).
    pub mocks: usize,
    /// The request headers of the example `curl` in the rendered file's header.
    pub example_headers: &'static [&'static str],
    /// Whether it calls the fleet ledger service (`{{LEDGER_PORT}}`), which the rendered file's
    /// header then says how to start, with its Redis.
    pub ledger: bool,
    /// Whether it runs sluice natively (`libsluice.so`, found through
    /// `ENVOY_DYNAMIC_MODULES_SEARCH_PATH`) instead of as `sluice.wasm`.
    pub native: bool,
}

/// Every gateway template in `envoy/`, in the order of the README.
pub const GATEWAYS: &[Gateway] = &[
    Gateway {
        name: "gateway",
        policies: &[("PLUGIN_CONFIG", "llm-metrics.demo.json")],
        mocks: 1,
        example_headers: &["x-sluice-tenant: acme"],
        ledger: false,
        native: false,
    },
    Gateway {
        name: "budget-gateway",
        policies: &[("BUDGET_CONFIG", "tenant-budget.example.json"), ("PLUGIN_CONFIG", "llm-metrics.demo.json")],
        mocks: 1,
        // The worked example identifies keys by the SHA-256 of their API key: "test" is search-staging.
        example_headers: &["authorization: Bearer test"],
        ledger: false,
        native: false,
    },
    Gateway {
        name: "router-gateway",
        policies: &[("ROUTER_CONFIG", "model-router.demo.json"), ("PLUGIN_CONFIG", "llm-metrics.demo.json")],
        mocks: 3,
        example_headers: &["x-sluice-tenant: acme"],
        ledger: false,
        native: false,
    },
    Gateway {
        name: "latency-gateway",
        policies: &[("LATENCY_CONFIG", "latency-guard.demo.json"), ("ROUTER_CONFIG", "model-router.demo.json"), ("PLUGIN_CONFIG", "llm-metrics.demo.json")],
        mocks: 3,
        example_headers: &["x-sluice-tenant: acme"],
        ledger: false,
        native: false,
    },
    Gateway {
        name: "full-gateway",
        policies: &[
            ("LATENCY_CONFIG", "latency-guard.demo.json"),
            ("ROUTER_CONFIG", "model-router.demo.json"),
            ("BUDGET_CONFIG", "tenant-budget.full.json"),
            ("PLUGIN_CONFIG", "llm-metrics.demo.json"),
        ],
        mocks: 3,
        // One header names the tenant for every plugin: the guard's class, the budget's key, the
        // router's sticky key and the metrics' tenant label.
        example_headers: &["x-sluice-tenant: acme"],
        ledger: false,
        native: false,
    },
    Gateway {
        name: "fleet-gateway",
        policies: &[("BUDGET_CONFIG", "tenant-budget.fleet.json"), ("PLUGIN_CONFIG", "llm-metrics.demo.json")],
        mocks: 1,
        example_headers: &["x-sluice-tenant: acme"],
        ledger: true,
        native: false,
    },
    Gateway {
        name: "native-gateway",
        policies: &[("PLUGIN_CONFIG", "llm-metrics.demo.json")],
        mocks: 1,
        example_headers: &["x-sluice-tenant: acme"],
        ledger: false,
        native: true,
    },
    Gateway {
        name: "native-full-gateway",
        // full-gateway's policies, the router's shadow included.
        policies: &[
            ("LATENCY_CONFIG", "latency-guard.demo.json"),
            ("ROUTER_CONFIG", "model-router.demo.json"),
            ("BUDGET_CONFIG", "tenant-budget.full.json"),
            ("PLUGIN_CONFIG", "llm-metrics.demo.json"),
        ],
        // v1, v2 and the shadow model.
        mocks: 3,
        example_headers: &["x-sluice-tenant: acme"],
        ledger: false,
        native: true,
    },
];

/// The gateway named `name`: its file stem (`full-gateway`), the stem without `-gateway` (`full`),
/// or the template's path (`envoy/templates/full-gateway.yaml`).
pub fn gateway(name: &str) -> Option<&'static Gateway> {
    let stem = name.rsplit('/').next().unwrap_or(name).trim_end_matches(".yaml");
    GATEWAYS.iter().find(|g| g.name == stem || g.name.strip_suffix("-gateway") == Some(stem))
}

/// The span attributes sluice's sections write as filter state `sluice_span.<name>`, with the section
/// that writes each: `sluice_core::span::ATTRIBUTES` (this crate stays dependency-free; the
/// end-to-end tracing test checks the two lists are equal).
pub const SPAN_ATTRIBUTES: &[(&str, &str)] = &[
    ("gen_ai.operation.name", "llm_metrics"),
    ("gen_ai.provider.name", "llm_metrics"),
    ("gen_ai.request.model", "llm_metrics"),
    ("gen_ai.request.max_tokens", "llm_metrics"),
    ("sluice.api", "llm_metrics"),
    ("sluice.model_version", "llm_metrics"),
    ("sluice.tenant", "llm_metrics"),
    ("gen_ai.response.model", "llm_metrics"),
    ("gen_ai.usage.input_tokens", "llm_metrics"),
    ("gen_ai.usage.output_tokens", "llm_metrics"),
    ("gen_ai.response.finish_reasons", "llm_metrics"),
    ("gen_ai.response.time_to_first_chunk", "llm_metrics"),
    ("sluice.tpot_us", "llm_metrics"),
    ("sluice.cost_micro_usd", "llm_metrics"),
    ("sluice.outcome", "llm_metrics"),
    ("sluice.route.reason", "model_router"),
    ("sluice.shadow", "model_router"),
    ("sluice.budget.decision", "tenant_budget"),
    ("sluice.budget.code", "tenant_budget"),
    ("sluice.guard.class", "latency_guard"),
    ("sluice.guard.outcome", "latency_guard"),
];

/// The collector cluster the tracing block exports to.
pub const OTLP_CLUSTER: &str = "sluice_otlp_collector";

/// Where a gateway's spans go: an OpenTelemetry collector's OTLP/HTTP receiver.
#[derive(Debug, Clone, PartialEq)]
pub struct Tracing {
    /// Host name or address of the collector (`127.0.0.1`, `otel-collector.observability`).
    pub host: String,
    /// Its OTLP/HTTP port (the collector's default is 4318).
    pub port: u16,
    /// Share of requests traced, in percent (Envoy's `random_sampling`); a client's
    /// `x-client-trace-id` or a sampled `traceparent` is traced as Envoy decides for those.
    pub sampling_percent: f64,
}

impl Tracing {
    /// `HOST:PORT` with sampling at 100 %.
    pub fn parse(collector: &str) -> Result<Tracing, Error> {
        let (host, port) = collector.rsplit_once(':').ok_or_else(|| Error(format!("collector {collector:?} is not HOST:PORT")))?;
        let port = port.parse().map_err(|_| Error(format!("collector {collector:?}: {port:?} is not a port")))?;
        if host.is_empty() {
            return Err(Error(format!("collector {collector:?} has no host")));
        }
        Ok(Tracing { host: host.to_string(), port, sampling_percent: 100.0 })
    }

    /// The values of a template's `{{TRACING}}` (the connection manager's `tracing`, with a custom
    /// tag per span attribute the gateway's `sections` write) and `{{TRACING_CLUSTER}}` (the
    /// collector's cluster) placeholders.
    pub fn vars(&self, sections: &[&str]) -> [(&'static str, String); 2] {
        let mut t = String::new();
        t.push_str("# OpenTelemetry: a span per request, exported over OTLP/HTTP (docs/tracing.md).\n");
        t.push_str("tracing:\n");
        t.push_str(&format!("  random_sampling: {{ value: {} }}\n", self.sampling_percent));
        t.push_str("  provider:\n    name: envoy.tracers.opentelemetry\n    typed_config:\n");
        t.push_str("      \"@type\": type.googleapis.com/envoy.config.trace.v3.OpenTelemetryConfig\n");
        t.push_str("      service_name: sluice-gateway\n");
        t.push_str("      http_service:\n        http_uri:\n");
        t.push_str(&format!("          uri: \"http://{}:{}/v1/traces\"\n", self.host, self.port));
        t.push_str(&format!("          cluster: {OTLP_CLUSTER}\n          timeout: 2s\n"));
        t.push_str("  # Each is a value a sluice section writes while the request runs (docs/tracing.md).\n");
        t.push_str("  custom_tags:\n");
        for (name, _) in SPAN_ATTRIBUTES.iter().filter(|(_, section)| sections.contains(section)) {
            t.push_str(&format!("  - tag: {name}\n    value: \"%FILTER_STATE(wasm.sluice_span.{name}:PLAIN)%\"\n"));
        }
        let cluster = format!(
            "- name: {OTLP_CLUSTER}\n  type: STRICT_DNS\n  connect_timeout: 1s\n  load_assignment:\n    cluster_name: {OTLP_CLUSTER}\n    \
             endpoints: [{{ lb_endpoints: [{{ endpoint: {{ address: {{ socket_address: {{ address: {}, port_value: {} }} }} }} }}] }}]\n",
            self.host, self.port
        );
        [("TRACING", t), ("TRACING_CLUSTER", cluster)]
    }
}

/// The sluice section a policy placeholder of the templates fills.
pub fn section_of(placeholder: &str) -> Option<&'static str> {
    match placeholder {
        "LATENCY_CONFIG" => Some("latency_guard"),
        "ROUTER_CONFIG" => Some("model_router"),
        "BUDGET_CONFIG" => Some("tenant_budget"),
        "PLUGIN_CONFIG" => Some("llm_metrics"),
        _ => None,
    }
}

/// A template, policy or path that could not be rendered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error(pub String);

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Error {}

fn read(root: &Path, relative: &str) -> Result<String, Error> {
    let path = root.join(relative);
    std::fs::read_to_string(&path).map_err(|e| Error(format!("reading {}: {e}", path.display())))
}

impl Gateway {
    /// The sluice sections the gateway runs (`llm_metrics`, …), in its filters' order.
    pub fn sections(&self) -> Vec<&'static str> {
        self.policies.iter().filter_map(|(placeholder, _)| section_of(placeholder)).collect()
    }

    /// `envoy/templates/<name>.yaml`, relative to the repository root.
    pub fn template_path(&self) -> String {
        format!("envoy/templates/{}.yaml", self.name)
    }

    /// `envoy/rendered/<name>.yaml`, relative to the repository root.
    pub fn rendered_path(&self) -> String {
        format!("envoy/rendered/{}.yaml", self.name)
    }

    /// The placeholder values a rendered file gets besides its policies: the demo ports, the wasm
    /// directory relative to the repository root, the access log on standard output.
    pub fn default_vars() -> Vec<(&'static str, String)> {
        let mut vars = vec![
            ("LISTEN_PORT", LISTEN_PORT.to_string()),
            ("ADMIN_PORT", ADMIN_PORT.to_string()),
            ("WASM_DIR", WASM_DIR.to_string()),
            ("ACCESS_LOG", ACCESS_LOG.to_string()),
            ("LEDGER_PORT", LEDGER_PORT.to_string()),
        ];
        vars.extend(MOCKS.iter().map(|m| (m.placeholder, m.port.to_string())));
        vars
    }

    /// The committed file `envoy/rendered/<name>.yaml`: a header saying how it was made and how to
    /// run it, then the template with every placeholder filled. `root` is the repository root.
    pub fn render(&self, root: &Path) -> Result<String, Error> {
        let body = self.render_with(root, &[], &[])?;
        Ok(format!("{}{body}", self.header()))
    }

    /// [`Gateway::render`] with tracing on: Envoy's OpenTelemetry tracer exporting to `tracing`'s
    /// collector, a custom tag for each span attribute of the gateway's sections.
    pub fn render_traced(&self, root: &Path, tracing: &Tracing) -> Result<String, Error> {
        let vars = tracing.vars(&self.sections());
        let refs: Vec<(&str, &str)> = vars.iter().map(|(n, v)| (*n, v.as_str())).collect();
        let body = self.render_with(root, &refs, &[])?;
        Ok(format!("{}{body}", self.header()))
    }

    /// The template rendered without the header. `vars` replace [`Gateway::default_vars`] (raw
    /// text, e.g. `("ACCESS_LOG", "/var/log/envoy.log")`); `policies` replace example policies
    /// (placeholder and the JSON text, inlined as any policy is).
    pub fn render_with(&self, root: &Path, vars: &[(&str, &str)], policies: &[(&str, &str)]) -> Result<String, Error> {
        let template = read(root, &self.template_path())?;
        let mut all_vars: Vec<(&str, String)> = Gateway::default_vars();
        for (name, value) in vars {
            all_vars.retain(|(n, _)| n != name);
            all_vars.push((name, (*value).to_string()));
        }
        let mut all_policies: Vec<(&str, String)> = Vec::new();
        for (placeholder, file) in self.policies {
            let json = match policies.iter().find(|(n, _)| n == placeholder) {
                Some((_, json)) => (*json).to_string(),
                None => read(root, &format!("policies/{file}"))?,
            };
            all_policies.push((placeholder, json));
        }
        for (name, json) in policies {
            if !all_policies.iter().any(|(n, _)| n == name) {
                all_policies.push((name, (*json).to_string()));
            }
        }
        let vars: Vec<(&str, &str)> = all_vars.iter().map(|(n, v)| (*n, v.as_str())).collect();
        let policies: Vec<(&str, &str)> = all_policies.iter().map(|(n, v)| (*n, v.as_str())).collect();
        render_template(&template, &vars, &policies).map_err(|e| Error(format!("{}: {e}", self.template_path())))
    }

    /// The comment at the top of a rendered file.
    pub fn header(&self) -> String {
        let mut h = String::new();
        h.push_str(&format!("# GENERATED by `cargo xtask render {}` from {}, with the example policies inlined:\n", self.name, self.template_path()));
        for (placeholder, file) in self.policies {
            h.push_str(&format!("#   {placeholder} <- policies/{file}\n"));
        }
        h.push_str(
            "# Do not edit by hand: change the template or a policy, then run `cargo xtask render --all`\n\
             # (e2e/tests/shipped_configs.rs fails while a rendered file differs from its sources).\n\
             #\n\
             # Run it from the repository root: the .wasm paths are relative to Envoy's working directory.\n\
             #   cargo xtask build      # the plugins (target/wasm32-wasip1/release) and the mock server\n",
        );
        for m in MOCKS.iter().take(self.mocks) {
            h.push_str(&format!("#   target/release/sluice-mock-server {} &\n", m.args().join(" ")));
        }
        if self.ledger {
            h.push_str(&format!(
                "#   redis-server --port {REDIS_PORT} --bind 127.0.0.1 --save '' --appendonly yes &   # Debian's redis-server\n\
                 #   target/release/sluice-ledger --listen 127.0.0.1:{LEDGER_PORT} --redis redis://127.0.0.1:{REDIS_PORT}/ &\n\
                 # (`cargo xtask up --fleet` starts all of it, with two Envoys sharing the ledger.)\n"
            ));
        }
        // Envoy looks the module up by name in this directory (`cargo xtask build` puts it there).
        let modules = if self.native { "ENVOY_DYNAMIC_MODULES_SEARCH_PATH=target/native " } else { "" };
        h.push_str(&format!("#   {modules}.tools/venv/bin/envoy -c {}\n", self.rendered_path()));
        h.push_str(&format!(
            "# Envoy listens on 127.0.0.1:{LISTEN_PORT} (admin and /stats/prometheus on 127.0.0.1:{ADMIN_PORT}) and\n\
             # writes its JSON access log, one line per request with the sluice stamps, to standard output.\n\
             # Try it:\n\
             #   curl -N 127.0.0.1:{LISTEN_PORT}/v1/chat/completions -H 'content-type: application/json'"
        ));
        for header in self.example_headers {
            h.push_str(&format!(" -H '{header}'"));
        }
        h.push_str(
            " \\\n#     -d '{\"model\":\"llama-3-70b\",\"stream\":true,\"messages\":[{\"role\":\"user\",\"content\":\"Hello\"}]}'\n#\n\
             # The template's own description follows.\n",
        );
        h
    }
}

/// Fills a template: a line `<indent>value: "{{NAME}}"` with `NAME` a policy becomes a literal
/// block scalar holding the policy verbatim; a line that is only `<indent>{{NAME}}` takes its var's
/// lines, each indented as the placeholder was, or nothing for an empty var (and for the optional
/// blocks, [`OPTIONAL_BLOCKS`], nothing when no var is given); every other `{{NAME}}` (upper-case
/// letters, digits, `_`) is replaced by its var, or by its policy escaped for a double-quoted YAML
/// string. One pass: a value is never scanned for placeholders itself. A placeholder without a
/// value is an error naming every such placeholder.
pub fn render_template(template: &str, vars: &[(&str, &str)], policies: &[(&str, &str)]) -> Result<String, Error> {
    let mut out = String::with_capacity(template.len() + policies.iter().map(|(_, p)| p.len() * 2).sum::<usize>());
    let mut missing: Vec<String> = Vec::new();
    for line in template.split_inclusive('\n') {
        if let Some((indent, name)) = block_line(line) {
            let value = vars.iter().find(|(n, _)| *n == name).map(|(_, v)| *v);
            if value.is_some() || OPTIONAL_BLOCKS.contains(&name) {
                for block_line in value.unwrap_or_default().lines().filter(|l| !l.trim().is_empty()) {
                    out.push_str(indent);
                    out.push_str(block_line);
                    out.push('\n');
                }
                continue;
            }
        }
        if let Some((indent, text)) = block_value_line(line, policies) {
            out.push_str(&indent);
            out.push_str("value: |\n");
            push_block(&mut out, &format!("{indent}  "), &text);
            continue;
        }
        let mut rest = line;
        while let Some((before, name, after)) = next_placeholder(rest) {
            out.push_str(before);
            if let Some((_, v)) = vars.iter().find(|(n, _)| *n == name) {
                out.push_str(v);
            } else if let Some((_, json)) = policies.iter().find(|(n, _)| *n == name) {
                out.push_str(&yaml_string_body(json));
            } else {
                if !missing.iter().any(|m| m == name) {
                    missing.push(name.to_string());
                }
                out.push_str("{{");
                out.push_str(name);
                out.push_str("}}");
            }
            rest = after;
        }
        out.push_str(rest);
    }
    if !missing.is_empty() {
        return Err(Error(format!("config placeholders without a value: {}", missing.join(", "))));
    }
    Ok(out)
}

/// Block placeholders a template may leave without a value: they render to nothing then. Tracing is
/// off unless a collector is given ([`tracing_vars`]).
pub const OPTIONAL_BLOCKS: &[&str] = &["TRACING", "TRACING_CLUSTER"];

/// `(indent, NAME)` when `line` is only a placeholder, indented by spaces.
fn block_line(line: &str) -> Option<(&str, &str)> {
    let line = line.trim_end();
    let body = line.trim_start_matches(' ');
    let (before, name, after) = next_placeholder(body)?;
    (before.is_empty() && after.is_empty()).then(|| (line.get(..line.len() - body.len()).unwrap_or_default(), name))
}

/// The next `{{NAME}}` in `text`: what comes before it, the name, what comes after.
fn next_placeholder(text: &str) -> Option<(&str, &str, &str)> {
    let mut from = 0;
    loop {
        let start = from + text.get(from..)?.find("{{")?;
        let after_open = text.get(start + 2..)?;
        let name_len = after_open.bytes().take_while(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || *b == b'_').count();
        if name_len > 0 && after_open.get(name_len..)?.starts_with("}}") {
            return Some((text.get(..start)?, after_open.get(..name_len)?, after_open.get(name_len + 2..)?));
        }
        // Braces that are not a placeholder stay as they are.
        from = start + 2;
    }
}

/// `(indent, text)` when `line` is exactly `<indent>value: "X"` (trailing spaces allowed) and every
/// placeholder in `X` — at least one — is a policy: `text` is `X` read as YAML reads the string
/// (`\"` and `\\` are the only escapes allowed here), each placeholder replaced by its policy
/// verbatim. `value: "{{NAME}}"` is the policy alone; `value: "{\"llm_metrics\": {{NAME}}}"` wraps it
/// in a section of the one filter's configuration.
fn block_value_line(line: &str, policies: &[(&str, &str)]) -> Option<(String, String)> {
    let line = line.trim_end();
    let body = line.trim_start_matches(' ');
    let indent = line.get(..line.len() - body.len())?;
    let quoted = body.strip_prefix("value: \"")?.strip_suffix('"')?;
    let mut unescaped = String::with_capacity(quoted.len());
    let mut chars = quoted.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => match chars.next()? {
                e @ ('"' | '\\') => unescaped.push(e),
                _ => return None,
            },
            '"' => return None,
            c => unescaped.push(c),
        }
    }
    let mut text = String::with_capacity(unescaped.len() + policies.iter().map(|(_, p)| p.len()).sum::<usize>());
    let mut rest = unescaped.as_str();
    let mut any = false;
    while let Some((before, name, after)) = next_placeholder(rest) {
        let (_, json) = policies.iter().find(|(n, _)| *n == name)?;
        text.push_str(before);
        text.push_str(json.trim());
        rest = after;
        any = true;
    }
    text.push_str(rest);
    any.then(|| (indent.to_string(), text))
}

/// `text` as the lines of a literal block scalar indented by `indent`. YAML takes the block's
/// indentation from its first line, so leading blank space is dropped; empty lines stay empty.
fn push_block(out: &mut String, indent: &str, text: &str) {
    for line in text.trim_start().trim_end().lines() {
        let line = line.trim_end_matches('\r');
        if !line.trim().is_empty() {
            out.push_str(indent);
            out.push_str(line);
        }
        out.push('\n');
    }
}

/// Text for the inside of a double-quoted YAML string (`value: "…"`), such that YAML reads back
/// exactly `text`: `\` and `"` are escaped, line breaks become `\n`, tabs `\t`, and any other
/// control character `\uXXXX`. JSON's own escapes survive: `\"` in the JSON is written `\\\"`.
pub fn yaml_string_body(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + text.len() / 8);
    for c in text.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c.is_control() => out.push_str(&format!("\\u{:04X}", u32::from(c))),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn placeholders_are_filled_in_one_pass_and_missing_ones_named() {
        let t = "a: {{A}}\nb: \"{{P}}\"\nc: {{A}}{{B}} {{not one}} {{C}}\n";
        let err = render_template(t, &[("A", "{{C}}")], &[("P", "{\"x\": \"{{A}}\"}")]).unwrap_err();
        assert_eq!(err.0, "config placeholders without a value: B, C");
        let out = render_template(t, &[("A", "{{C}}"), ("B", "2"), ("C", "3")], &[("P", "{\"x\": \"{{A}}\"}")]).unwrap();
        // Values are not scanned again: the {{C}} inside A's value and the {{A}} inside P stay.
        assert_eq!(out, "a: {{C}}\nb: \"{\\\"x\\\": \\\"{{A}}\\\"}\"\nc: {{C}}2 {{not one}} 3\n");
    }

    #[test]
    fn a_whole_value_line_becomes_a_block_scalar() {
        let t = "    configuration:\n      value: \"{{P}}\"\n    next: 1\n";
        let json = "\n{\n  \"a\": \"q\\\"uote\",\n\n  \"b\": [1]\n}\n";
        let out = render_template(t, &[], &[("P", json)]).unwrap();
        assert_eq!(out, "    configuration:\n      value: |\n        {\n          \"a\": \"q\\\"uote\",\n\n          \"b\": [1]\n        }\n    next: 1\n");
    }

    #[test]
    fn a_value_line_of_sections_becomes_one_block_with_each_policy_in_place() {
        let t = "      value: \"{\\\"llm_metrics\\\": {{P}}, \\\"model_router\\\": {{R}}}\"\n";
        let out = render_template(t, &[], &[("P", "{\n  \"a\": 1\n}\n"), ("R", "{}")]).unwrap();
        assert_eq!(out, "      value: |\n        {\"llm_metrics\": {\n          \"a\": 1\n        }, \"model_router\": {}}\n");
        // A var among the placeholders (the tests' raw text) keeps the line a quoted string.
        let out = render_template(t, &[("P", "{}")], &[("R", "{}")]).unwrap();
        assert_eq!(out, "      value: \"{\\\"llm_metrics\\\": {}, \\\"model_router\\\": {}}\"\n");
    }

    #[test]
    fn yaml_string_body_escapes_what_yaml_would_read() {
        assert_eq!(yaml_string_body("{\"a\": \"b\\\"c\\u00e9\"}\n\t\u{1}"), "{\\\"a\\\": \\\"b\\\\\\\"c\\\\u00e9\\\"}\\n\\t\\u0001");
    }

    #[test]
    fn gateways_are_found_by_name_stem_or_path() {
        assert_eq!(gateway("full").map(|g| g.name), Some("full-gateway"));
        assert_eq!(gateway("envoy/templates/full-gateway.yaml").map(|g| g.name), Some("full-gateway"));
        assert_eq!(gateway("gateway").map(|g| g.name), Some("gateway"));
        assert_eq!(gateway("fleet").map(|g| g.name), Some("fleet-gateway"));
        assert_eq!(gateway("nope"), None);
    }
}
