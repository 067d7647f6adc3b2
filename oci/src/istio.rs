//! The Istio manifests of the sluice chain (`examples/istio/`), generated from what the project
//! already ships so they cannot drift from it: each plugin's `WasmPlugin` carries the example
//! policy of `envoy/templates/full-gateway.yaml` as its `pluginConfig` and the digest of the image
//! built from the `.wasm` as its `sha256`; the `EnvoyFilter` carries the full gateway's
//! `json_to_metadata`, `buffer` and decompressor filters; the bootstrap override carries its
//! `stats_config` (stats tags and histogram buckets). `cargo xtask images` writes them; a test compares the
//! committed files with a fresh generation.

use anyhow::{anyhow, bail, Context, Result};
use serde_yaml::{Mapping, Value};
use std::path::Path;

/// The namespace and gateway the examples target (Istio's default ingress gateway).
pub const NAMESPACE: &str = "istio-system";
pub const GATEWAY_LABEL: (&str, &str) = ("istio", "ingressgateway");
/// The ConfigMap holding the bootstrap override with sluice's stats tags and buckets.
pub const STATS_CONFIGMAP: &str = "sluice-stats-bootstrap";
/// The key Istio reads a bootstrap override from in that ConfigMap.
pub const BOOTSTRAP_KEY: &str = "custom_bootstrap.json";

/// One plugin of the chain, in chain order, and how Istio is to run it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Plugin {
    /// `llm-metrics`: the image's repository name and the `WasmPlugin`'s name after `sluice-`.
    pub name: &'static str,
    /// The `.wasm` file stem `cargo xtask build` writes.
    pub wasm_stem: &'static str,
    /// `pluginName` (Envoy's root id), as in the shipped Envoy gateways.
    pub root_id: &'static str,
    pub phase: &'static str,
    pub priority: i64,
    pub fail_strategy: &'static str,
    /// The full gateway's placeholder for its policy (`sluice_envoy_render::GATEWAYS`).
    pub policy_placeholder: &'static str,
    /// Why this failure strategy, for the manifest's comment (the plugin's docs say the same).
    pub fail_reason: &'static str,
}

/// Every plugin runs in the `STATS` phase — after Istio's authentication and authorization
/// filters, so the identity they read has been verified and a request RBAC denies never reserves
/// budget — ordered within it by priority, highest first: guard → router → budget → metrics.
pub const PLUGINS: [Plugin; 4] = [
    Plugin {
        name: "latency-guard",
        wasm_stem: "sluice_latency_guard",
        root_id: "sluice_latency_guard",
        phase: "STATS",
        priority: 40,
        fail_strategy: "FAIL_OPEN",
        policy_placeholder: "LATENCY_CONFIG",
        fail_reason: "deadlines and shedding protect the fleet, but a broken guard must not take traffic down: requests pass unguarded",
    },
    Plugin {
        name: "model-router",
        wasm_stem: "sluice_model_router",
        root_id: "sluice_model_router",
        phase: "STATS",
        priority: 30,
        fail_strategy: "FAIL_CLOSE",
        policy_placeholder: "ROUTER_CONFIG",
        fail_reason: "routing must not silently stop: without the router every request would go to the default route",
    },
    Plugin {
        name: "tenant-budget",
        wasm_stem: "sluice_tenant_budget",
        root_id: "sluice_tenant_budget",
        phase: "STATS",
        priority: 20,
        fail_strategy: "FAIL_CLOSE",
        policy_placeholder: "BUDGET_CONFIG",
        fail_reason: "budgets must not silently stop being enforced: if the VM fails, requests fail",
    },
    Plugin {
        name: "llm-metrics",
        wasm_stem: "sluice_llm_metrics",
        root_id: "sluice_llm_metrics",
        phase: "STATS",
        priority: 10,
        fail_strategy: "FAIL_OPEN",
        policy_placeholder: "PLUGIN_CONFIG",
        fail_reason: "metrics must never take traffic down: if the VM fails, requests pass unmeasured",
    },
];

/// The version images are tagged with: the workspace's.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The image of one plugin's `.wasm`, labelled with its name and [`VERSION`]: what
/// `cargo xtask images` builds and the tests rebuild to compare digests.
pub fn plugin_image(plugin: &Plugin, wasm: &[u8]) -> Result<crate::Image> {
    let title = format!("sluice-{}", plugin.name);
    let description = format!("sluice {} proxy-wasm filter for Envoy and Istio", plugin.name);
    crate::Image::build(wasm, &crate::Labels { title: &title, version: VERSION, description: &description, licenses: "Apache-2.0" })
}

/// A plugin's image reference: `<registry>/<name>:<version>`.
pub fn image_reference(registry: &str, plugin: &Plugin, version: &str) -> String {
    format!("{}/{}:{version}", registry.trim_end_matches('/'), plugin.name)
}

/// The generated files: (file name in `examples/istio/`, content).
pub fn manifests(root: &Path, registry: &str, version: &str, digests: &[(&Plugin, String)]) -> Result<Vec<(String, String)>> {
    let gateway = full_gateway(root)?;
    let mut files = Vec::new();
    for plugin in &PLUGINS {
        let digest = digests.iter().find(|(p, _)| p.name == plugin.name).map(|(_, d)| d).with_context(|| format!("no image digest for {}", plugin.name))?;
        files.push((format!("sluice-{}.wasmplugin.yaml", plugin.name), wasm_plugin(root, plugin, registry, version, digest)?));
    }
    files.push(("sluice-filters.envoyfilter.yaml".into(), envoy_filter(&gateway)?));
    files.push(("sluice-stats.configmap.yaml".into(), stats_configmap(&gateway)?));
    files.push(("ingressgateway-patch.yaml".into(), gateway_patch()));
    Ok(files)
}

/// `envoy/rendered/full-gateway.yaml` (valid YAML, unlike its template), parsed.
fn full_gateway(root: &Path) -> Result<Value> {
    let path = root.join("envoy/rendered/full-gateway.yaml");
    let text = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    serde_yaml::from_str(&text).with_context(|| format!("parsing {}", path.display()))
}

fn wasm_plugin(root: &Path, plugin: &Plugin, registry: &str, version: &str, digest: &str) -> Result<String> {
    let file = sluice_policy_file(plugin)?;
    let path = root.join("policies").join(file);
    let json = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    // JSON is YAML: read this way the policy keeps its member order.
    let config: Value = serde_yaml::from_str(&json).with_context(|| format!("parsing {}", path.display()))?;
    let sha256 = digest.strip_prefix("sha256:").ok_or_else(|| anyhow!("digest {digest} is not sha256:<hex>"))?;
    let doc = map([
        ("apiVersion", "extensions.istio.io/v1alpha1".into()),
        ("kind", "WasmPlugin".into()),
        ("metadata", map([("name", format!("sluice-{}", plugin.name).into()), ("namespace", NAMESPACE.into())])),
        (
            "spec",
            map([
                ("selector", map([("matchLabels", map([(GATEWAY_LABEL.0, GATEWAY_LABEL.1.into())]))])),
                ("url", format!("oci://{}", image_reference(registry, plugin, version)).into()),
                ("sha256", sha256.into()),
                ("imagePullPolicy", "IfNotPresent".into()),
                ("pluginName", plugin.root_id.into()),
                ("phase", plugin.phase.into()),
                ("priority", plugin.priority.into()),
                ("failStrategy", plugin.fail_strategy.into()),
                ("type", "HTTP".into()),
                ("pluginConfig", config),
            ]),
        ),
    ]);
    let order = PLUGINS.iter().map(|p| p.name).collect::<Vec<_>>().join(" → ");
    let header = format!(
        "# sluice {name} on Istio's ingress gateway. Generated by `cargo xtask images` (docs/istio.md):\n\
         # `sha256` is the digest of the image built from target/wasm32-wasip1/release/{stem}.wasm, and\n\
         # `pluginConfig` is policies/{file}, the policy envoy/templates/full-gateway.yaml runs.\n\
         # Phase STATS, priority {priority}: the chain runs {order}, after Istio's authn and authz filters.\n\
         # failStrategy {fail}: {reason}.\n",
        name = plugin.name,
        stem = plugin.wasm_stem,
        priority = plugin.priority,
        fail = plugin.fail_strategy,
        reason = plugin.fail_reason,
    );
    Ok(format!("{header}{}", serde_yaml::to_string(&doc)?))
}

fn sluice_policy_file(plugin: &Plugin) -> Result<&'static str> {
    sluice_envoy_render::gateway("full-gateway")
        .and_then(|g| g.policies.iter().find(|(p, _)| *p == plugin.policy_placeholder))
        .map(|(_, f)| *f)
        .with_context(|| format!("the full gateway has no policy {}", plugin.policy_placeholder))
}

/// The full gateway's HTTP filters, in its order.
fn gateway_http_filters(gateway: &Value) -> Result<&[Value]> {
    gateway
        .get("static_resources")
        .and_then(|s| s.get("listeners"))
        .and_then(|l| l.get(0))
        .and_then(|l| l.get("filter_chains"))
        .and_then(|c| c.get(0))
        .and_then(|c| c.get("filters"))
        .and_then(|f| f.get(0))
        .and_then(|f| f.get("typed_config"))
        .and_then(|t| t.get("http_filters"))
        .and_then(Value::as_sequence)
        .map(Vec::as_slice)
        .context("envoy/rendered/full-gateway.yaml has no http_filters")
}

/// The full gateway's HTTP filter named `name`.
fn gateway_filter(gateway: &Value, name: &str) -> Result<Value> {
    gateway_http_filters(gateway)?
        .iter()
        .find(|f| f.get("name").and_then(Value::as_str) == Some(name))
        .cloned()
        .with_context(|| format!("the full gateway has no {name} filter"))
}

fn hcm_match(sub_filter: Option<&str>) -> Value {
    let mut filter = map([("name", "envoy.filters.network.http_connection_manager".into())]);
    if let (Some(sub), Value::Mapping(m)) = (sub_filter, &mut filter) {
        m.insert("subFilter".into(), map([("name", sub.into())]));
    }
    map([("context", "GATEWAY".into()), ("listener", map([("filterChain", map([("filter", filter)]))]))])
}

/// The `@type` of Envoy's decompressor filter.
pub const DECOMPRESSOR_TYPE: &str = "type.googleapis.com/envoy.extensions.filters.http.decompressor.v3.Decompressor";

/// The full gateway's decompressor filters (gzip, br, zstd), in its order.
fn gateway_decompressors(gateway: &Value) -> Result<Vec<Value>> {
    let buffer = gateway_filter(gateway, "envoy.filters.http.buffer")?;
    let filters = gateway_http_filters(gateway)?
        .iter()
        .skip_while(|f| **f != buffer)
        .filter(|f| f.get("typed_config").and_then(|t| t.get("@type")).and_then(Value::as_str) == Some(DECOMPRESSOR_TYPE))
        .cloned()
        .collect::<Vec<_>>();
    if filters.is_empty() {
        bail!("the full gateway has no decompressor after its buffer filter");
    }
    Ok(filters)
}

fn envoy_filter(gateway: &Value) -> Result<String> {
    let patch = |operation: &str, sub: Option<&str>, value: Value| {
        map([("applyTo", "HTTP_FILTER".into()), ("match", hcm_match(sub)), ("patch", map([("operation", operation.into()), ("value", value)]))])
    };
    // Each INSERT_FIRST goes in front of what is first then: json_to_metadata, then the request
    // body limit in front of it.
    let mut patches = vec![
        patch("INSERT_FIRST", None, gateway_filter(gateway, "envoy.filters.http.json_to_metadata")?),
        patch("INSERT_FIRST", None, gateway_filter(gateway, "sluice.request_body_limit")?),
        patch("INSERT_BEFORE", Some("envoy.filters.http.router"), gateway_filter(gateway, "envoy.filters.http.buffer")?),
    ];
    // Istio applies the patches in order, each just before the router: buffer, then the
    // decompressors in the gateway's order, then the router.
    for decompressor in gateway_decompressors(gateway)? {
        patches.push(patch("INSERT_BEFORE", Some("envoy.filters.http.router"), decompressor));
    }
    let doc = map([
        ("apiVersion", "networking.istio.io/v1alpha3".into()),
        ("kind", "EnvoyFilter".into()),
        ("metadata", map([("name", "sluice-filters".into()), ("namespace", NAMESPACE.into())])),
        ("spec", map([("workloadSelector", map([("labels", map([(GATEWAY_LABEL.0, GATEWAY_LABEL.1.into())]))])), ("configPatches", Value::Sequence(patches))])),
    ]);
    let header = "# The plain Envoy filters the sluice chain needs around its WasmPlugins, as in\n\
                  # envoy/templates/full-gateway.yaml. Generated by `cargo xtask images` (docs/istio.md).\n\
                  # json_to_metadata goes first: it lifts the body's `model` and `user` into metadata\n\
                  # before latency-guard and model-router read them. In front of it a buffer filter\n\
                  # (sluice.request_body_limit) raises the request's buffer limit to 9 MiB: held by\n\
                  # json_to_metadata under the default 1 MiB, a longer body would get Envoy's own 413.\n\
                  # The other buffer filter goes before the\n\
                  # router: tenant-budget lets the headers continue while it holds the body, and without\n\
                  # the buffer the router would open an upstream connection for a request that is then\n\
                  # refused. The gzip, br and zstd decompressors go between the buffer and the router, so\n\
                  # an encoded upstream answer is decoded before tenant-budget and llm-metrics see it\n\
                  # (otherwise it counts as 0 output tokens); responses only, and the client's\n\
                  # accept-encoding is not extended (docs/faults.md).\n";
    Ok(format!("{header}{}", serde_yaml::to_string(&doc)?))
}

/// The full gateway's `stats_config` as the bootstrap override document.
pub fn stats_bootstrap(gateway: &Value) -> Result<serde_json::Value> {
    let stats = gateway.get("stats_config").context("envoy/rendered/full-gateway.yaml has no stats_config")?;
    let mut override_doc = Mapping::new();
    override_doc.insert("stats_config".into(), stats.clone());
    Ok(serde_json::to_value(Value::Mapping(override_doc))?)
}

fn stats_configmap(gateway: &Value) -> Result<String> {
    let json = one_entry_a_line(&stats_bootstrap(gateway)?)?;
    let doc = map([
        ("apiVersion", "v1".into()),
        ("kind", "ConfigMap".into()),
        ("metadata", map([("name", STATS_CONFIGMAP.into()), ("namespace", NAMESPACE.into())])),
        ("data", map([(BOOTSTRAP_KEY, format!("{json}\n").into())])),
    ]);
    let header = "# sluice's stats tags and histogram buckets for the gateway's Envoy: a bootstrap override\n\
                  # (the gateway Deployment's `sidecar.istio.io/bootstrapOverride` annotation names this\n\
                  # ConfigMap; see ingressgateway-patch.yaml), merged into Istio's own bootstrap. It is the\n\
                  # `stats_config` of envoy/templates/full-gateway.yaml; without it the metrics still exist,\n\
                  # as long flat names without labels and with Envoy's default buckets.\n\
                  # Generated by `cargo xtask images` (docs/istio.md).\n";
    Ok(format!("{header}{}", serde_yaml::to_string(&doc)?))
}

/// `{"stats_config": {"<list>": [ … ]}}` with one compact list entry a line: readable in the
/// ConfigMap, and still the JSON Istio reads.
fn one_entry_a_line(doc: &serde_json::Value) -> Result<String> {
    let stats = doc.get("stats_config").and_then(serde_json::Value::as_object).context("no stats_config")?;
    let mut out = String::from("{\n  \"stats_config\": {\n");
    for (i, (key, value)) in stats.iter().enumerate() {
        out.push_str(&format!("    {}: ", serde_json::to_string(key)?));
        match value.as_array() {
            Some(items) => {
                out.push_str("[\n");
                for (j, item) in items.iter().enumerate() {
                    out.push_str(&format!("      {}{}\n", serde_json::to_string(item)?, if j + 1 < items.len() { "," } else { "" }));
                }
                out.push_str("    ]");
            }
            None => out.push_str(&serde_json::to_string(value)?),
        }
        out.push_str(if i + 1 < stats.len() { ",\n" } else { "\n" });
    }
    out.push_str("  }\n}");
    Ok(out)
}

fn gateway_patch() -> String {
    format!(
        "# Pod annotations for Istio's ingress gateway Deployment, to apply with\n\
         #   kubectl -n {NAMESPACE} patch deployment istio-ingressgateway --patch-file ingressgateway-patch.yaml\n\
         # (the pods restart: the bootstrap is read at start). The bootstrap override gives sluice's\n\
         # metrics their labels and buckets; the stats matcher keeps them (Istio versions whose\n\
         # default inclusion list lacks `wasm`). Generated by `cargo xtask images` (docs/istio.md).\n\
         spec:\n\
         \x20 template:\n\
         \x20   metadata:\n\
         \x20     annotations:\n\
         \x20       sidecar.istio.io/bootstrapOverride: {STATS_CONFIGMAP}\n\
         \x20       proxy.istio.io/config: |\n\
         \x20         proxyStatsMatcher:\n\
         \x20           inclusionPrefixes: [\"wasmcustom.sluice\"]\n"
    )
}

fn map<const N: usize>(entries: [(&str, Value); N]) -> Value {
    let mut m = Mapping::new();
    for (k, v) in entries {
        m.insert(Value::String(k.to_string()), v);
    }
    Value::Mapping(m)
}

/// The `sha256` (hex) a `WasmPlugin` manifest pins.
pub fn pinned_sha256(manifest: &str) -> Result<String> {
    let doc: Value = serde_yaml::from_str(manifest)?;
    match doc.get("spec").and_then(|s| s.get("sha256")).and_then(Value::as_str) {
        Some(s) => Ok(s.to_string()),
        None => bail!("the manifest pins no spec.sha256"),
    }
}
