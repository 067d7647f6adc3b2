//! `examples/istio/` against Istio's own CRD schemas (vendored in `examples/istio/crds/`), the way
//! the Kubernetes API server takes a manifest under strict field validation: unknown fields,
//! wrong enum values and malformed patterns refused, and the schemas' CEL rules that matter here
//! checked by hand. Also: the committed files are what `cargo xtask images` makes of the built
//! plugins (digests pinned to the current `.wasm`), and they say what the Envoy gateway says.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use serde_json::{json, Value};
use sluice_oci::istio::{self, plugin_image, PLUGINS};
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

fn yaml_to_json(text: &str) -> Value {
    let yaml: serde_yaml::Value = serde_yaml::from_str(text).unwrap();
    serde_json::to_value(yaml).unwrap()
}

fn shipped(name: &str) -> Value {
    yaml_to_json(&std::fs::read_to_string(root().join("examples/istio").join(name)).unwrap())
}

/// Kubernetes prunes or (strict validation) refuses fields a structural schema does not list;
/// JSON Schema allows them unless told: every object schema that lists its properties and does
/// not preserve unknown fields gets `additionalProperties: false`.
fn strict(schema: &mut Value) {
    match schema {
        Value::Object(m) => {
            let preserves = m.get("x-kubernetes-preserve-unknown-fields") == Some(&Value::Bool(true));
            if m.contains_key("properties") && !preserves && !m.contains_key("additionalProperties") {
                m.insert("additionalProperties".into(), Value::Bool(false));
            }
            for v in m.values_mut() {
                strict(v);
            }
        }
        Value::Array(a) => a.iter_mut().for_each(strict),
        _ => {}
    }
}

struct Crd {
    group: String,
    kind: String,
    versions: Vec<(String, jsonschema::Validator)>,
}

fn crds() -> Vec<Crd> {
    ["wasmplugin-crd.yaml", "envoyfilter-crd.yaml"]
        .iter()
        .map(|file| {
            let crd = yaml_to_json(&std::fs::read_to_string(root().join("examples/istio/crds").join(file)).unwrap());
            let versions = crd["spec"]["versions"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| {
                    let mut schema = v["schema"]["openAPIV3Schema"].clone();
                    // Every object has these; the API server adds them to each CRD's schema.
                    for (field, kind) in [("apiVersion", "string"), ("kind", "string"), ("metadata", "object")] {
                        schema["properties"].as_object_mut().unwrap().entry(field).or_insert(json!({ "type": kind }));
                    }
                    strict(&mut schema);
                    let validator = jsonschema::options().with_draft(jsonschema::Draft::Draft4).build(&schema).unwrap();
                    (v["name"].as_str().unwrap().to_string(), validator)
                })
                .collect();
            Crd { group: crd["spec"]["group"].as_str().unwrap().into(), kind: crd["spec"]["names"]["kind"].as_str().unwrap().into(), versions }
        })
        .collect()
}

/// Every reason the API server would refuse `doc` (empty: accepted).
fn refusals(crds: &[Crd], doc: &Value) -> Vec<String> {
    let api_version = doc["apiVersion"].as_str().unwrap_or_default();
    let (group, version) = api_version.split_once('/').unwrap_or(("", api_version));
    let kind = doc["kind"].as_str().unwrap_or_default();
    let Some(crd) = crds.iter().find(|c| c.group == group && c.kind == kind) else {
        return vec![format!("no CRD for {api_version} {kind}")];
    };
    let Some((_, validator)) = crd.versions.iter().find(|(v, _)| v == version) else {
        return vec![format!("{kind} has no version {version}")];
    };
    let mut out: Vec<String> = validator.iter_errors(doc).map(|e| format!("{}: {e}", e.instance_path())).collect();
    let name = doc["metadata"]["name"].as_str().unwrap_or_default();
    let dns_label = !name.is_empty() && name.len() <= 63 && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    if !dns_label || name.starts_with('-') || name.ends_with('-') {
        out.push(format!("metadata.name {name:?} is not a DNS-1123 label"));
    }
    out.extend(cel_refusals(kind, &doc["spec"]));
    out
}

/// The schemas' CEL rules (x-kubernetes-validations) for the fields these manifests use, by hand.
fn cel_refusals(kind: &str, spec: &Value) -> Vec<String> {
    let mut out = Vec::new();
    let set = |k: &str| spec.get(k).is_some();
    let selector_key = if kind == "WasmPlugin" { "selector" } else { "workloadSelector" };
    let selectors = [set(selector_key), set("targetRef"), set("targetRefs")].iter().filter(|&&b| b).count();
    if selectors > 1 {
        out.push(format!("only one of targetRefs or {selector_key} can be set"));
    }
    let labels_key = if kind == "WasmPlugin" { "matchLabels" } else { "labels" };
    for (k, v) in spec[selector_key][labels_key].as_object().into_iter().flatten() {
        if k.is_empty() || k.contains('*') || v.as_str().unwrap_or_default().contains('*') {
            out.push(format!("{selector_key}.{labels_key}: wildcard or empty key {k:?}"));
        }
    }
    if kind == "WasmPlugin" {
        let url = spec["url"].as_str().unwrap_or_default();
        let scheme = url.split_once("://").map(|(s, _)| s).unwrap_or("");
        if !["", "http", "https", "oci", "file"].contains(&scheme) {
            out.push("url must have schema one of [http, https, file, oci]".into());
        }
        for env in spec["vmConfig"]["env"].as_array().into_iter().flatten() {
            if env["valueFrom"] == "HOST" && env.get("value").is_some() {
                out.push("value may only be set when valueFrom is INLINE".into());
            }
        }
    }
    out
}

fn crd_manifests() -> Vec<(String, Value)> {
    let mut out: Vec<(String, Value)> = std::fs::read_dir(root().join("examples/istio"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            let n = p.file_name().unwrap().to_string_lossy().into_owned();
            n.ends_with(".wasmplugin.yaml") || n.ends_with(".envoyfilter.yaml")
        })
        .map(|p| (p.file_name().unwrap().to_string_lossy().into_owned(), yaml_to_json(&std::fs::read_to_string(&p).unwrap())))
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

#[test]
fn every_shipped_manifest_is_accepted_by_its_crd() {
    let crds = crds();
    let manifests = crd_manifests();
    assert_eq!(manifests.len(), 5, "four WasmPlugins and one EnvoyFilter: {:?}", manifests.iter().map(|m| &m.0).collect::<Vec<_>>());
    for (name, doc) in &manifests {
        assert_eq!(refusals(&crds, doc), Vec::<String>::new(), "{name}");
    }
}

#[test]
fn misspelled_fields_bad_enums_and_malformed_digests_are_refused() {
    let crds = crds();
    let plugin = shipped("sluice-tenant-budget.wasmplugin.yaml");
    let filter = shipped("sluice-filters.envoyfilter.yaml");
    let with = |base: &Value, edit: &dyn Fn(&mut Value)| {
        let mut doc = base.clone();
        edit(&mut doc);
        refusals(&crds, &doc)
    };
    let cases: Vec<(&str, Vec<String>, &str)> = vec![
        ("misspelled field", with(&plugin, &|d| d["spec"]["failStrategyy"] = json!("FAIL_OPEN")), "failStrategyy"),
        ("misspelled nested field", with(&plugin, &|d| d["spec"]["selector"]["matchLabel"] = json!({"app": "x"})), "matchLabel"),
        ("bad phase", with(&plugin, &|d| d["spec"]["phase"] = json!("STAT")), "STAT"),
        ("bad failStrategy", with(&plugin, &|d| d["spec"]["failStrategy"] = json!("FAIL_CLOSED")), "FAIL_CLOSED"),
        ("sha256 one digit short", with(&plugin, &|d| d["spec"]["sha256"] = json!("a".repeat(63))), "sha256"),
        ("sha256 in upper case", with(&plugin, &|d| d["spec"]["sha256"] = json!("A".repeat(64))), "sha256"),
        ("sha256 with its algorithm prefix", with(&plugin, &|d| d["spec"]["sha256"] = json!(format!("sha256:{}", "a".repeat(64)))), "sha256"),
        ("priority as text", with(&plugin, &|d| d["spec"]["priority"] = json!("high")), "priority"),
        ("url scheme", with(&plugin, &|d| d["spec"]["url"] = json!("ftp://registry/sluice")), "url must have schema"),
        ("selector and targetRefs", with(&plugin, &|d| d["spec"]["targetRefs"] = json!([{"kind": "Gateway", "name": "gw"}])), "only one of"),
        ("bad metadata name", with(&plugin, &|d| d["metadata"]["name"] = json!("Sluice_Budget")), "DNS-1123"),
        ("EnvoyFilter applyTo", with(&filter, &|d| d["spec"]["configPatches"][0]["applyTo"] = json!("HTTP_FILTERS")), "HTTP_FILTERS"),
        (
            "EnvoyFilter operation",
            with(&filter, &|d| d["spec"]["configPatches"][1]["patch"]["operation"] = json!("INSERT_AFTER_ROUTER")),
            "INSERT_AFTER_ROUTER",
        ),
        ("EnvoyFilter misspelled spec field", with(&filter, &|d| d["spec"]["configPatch"] = json!([])), "configPatch"),
        ("unknown API version", with(&plugin, &|d| d["apiVersion"] = json!("extensions.istio.io/v1")), "no version v1"),
    ];
    for (case, found, needle) in cases {
        assert!(found.iter().any(|r| r.contains(needle)), "{case}: expected a refusal mentioning {needle:?}, got {found:?}");
    }
}

/// The failure policy of the shipped full gateway's filter that runs plugin `root_id`, and the
/// plugins that filter runs: one under Istio (a WasmPlugin each), several where sluice.wasm runs
/// sections together.
fn gateway_failure_policy(root_id: &str) -> (String, Vec<String>) {
    let filter = gateway_http_filters()
        .into_iter()
        .find(|f| wasm_policies(f).iter().any(|p| p == root_id))
        .unwrap_or_else(|| panic!("no filter of the full gateway runs {root_id}"));
    (filter["typed_config"]["config"]["failure_policy"].as_str().unwrap().to_string(), wasm_policies(&filter))
}

/// The plugins a gateway wasm filter runs, as Istio names them (`sluice_<policy>`): its root id, or
/// for sluice.wasm with several sections, each section in pipeline order.
fn wasm_policies(filter: &Value) -> Vec<String> {
    let config = &filter["typed_config"]["config"];
    let Some(root_id) = config["root_id"].as_str() else { return Vec::new() };
    if root_id != "sluice" {
        return vec![root_id.to_string()];
    }
    let sections: Value = serde_json::from_str(config["configuration"]["value"].as_str().unwrap()).unwrap();
    ["latency_guard", "model_router", "tenant_budget", "llm_metrics"].iter().filter(|s| sections.get(**s).is_some()).map(|s| format!("sluice_{s}")).collect()
}

#[test]
fn the_chain_order_failure_strategies_and_policies_are_those_of_the_envoy_gateway() {
    let phase_rank = |p: &str| ["AUTHN", "AUTHZ", "STATS", "UNSPECIFIED_PHASE"].iter().position(|x| *x == p).unwrap();
    let mut plugins: Vec<Value> = PLUGINS.iter().map(|p| shipped(&format!("sluice-{}.wasmplugin.yaml", p.name))).collect();
    // Istio orders WasmPlugins by phase, then by priority, highest first.
    plugins.sort_by_key(|d| (phase_rank(d["spec"]["phase"].as_str().unwrap()), -d["spec"]["priority"].as_i64().unwrap()));
    let order: Vec<&str> = plugins.iter().map(|d| d["spec"]["pluginName"].as_str().unwrap()).collect();
    assert_eq!(order, ["sluice_latency_guard", "sluice_model_router", "sluice_tenant_budget", "sluice_llm_metrics"]);
    let gateway = sluice_envoy_render::gateway("full-gateway").unwrap();
    let istio_strategy = |name: &str| {
        let doc = plugins.iter().find(|d| d["spec"]["pluginName"] == name).unwrap();
        match doc["spec"]["failStrategy"].as_str().unwrap() {
            "FAIL_CLOSE" => "FAIL_CLOSED".to_string(),
            other => other.to_string(),
        }
    };
    for doc in &plugins {
        let root_id = doc["spec"]["pluginName"].as_str().unwrap();
        let (envoy, together) = gateway_failure_policy(root_id);
        // A filter running several sections fails closed when one of its plugins does alone.
        let strictest = if together.iter().any(|p| istio_strategy(p) == "FAIL_CLOSED") { "FAIL_CLOSED".to_string() } else { istio_strategy(root_id) };
        assert_eq!(strictest, envoy, "{root_id} (in a filter with {together:?}): failStrategy against the Envoy gateway's failure_policy");
        let plugin = PLUGINS.iter().find(|p| p.root_id == root_id).unwrap();
        let file = gateway.policies.iter().find(|(p, _)| *p == plugin.policy_placeholder).unwrap().1;
        let policy: Value = serde_json::from_str(&std::fs::read_to_string(root().join("policies").join(file)).unwrap()).unwrap();
        assert_eq!(doc["spec"]["pluginConfig"], policy, "{root_id}: pluginConfig is policies/{file}");
    }
}

#[test]
fn the_stats_bootstrap_override_is_the_envoy_gateways_stats_config() {
    let configmap = shipped("sluice-stats.configmap.yaml");
    let data: Value = serde_json::from_str(configmap["data"][istio::BOOTSTRAP_KEY].as_str().unwrap()).unwrap();
    let gateway = yaml_to_json(&std::fs::read_to_string(root().join("envoy/rendered/full-gateway.yaml")).unwrap());
    assert_eq!(data, json!({ "stats_config": gateway["stats_config"] }));
    assert!(data["stats_config"]["stats_tags"].as_array().unwrap().len() > 20);
    let patch = shipped("ingressgateway-patch.yaml");
    assert_eq!(patch["spec"]["template"]["metadata"]["annotations"]["sidecar.istio.io/bootstrapOverride"], json!(configmap["metadata"]["name"]));
}

#[test]
fn the_committed_manifests_pin_the_images_of_the_built_plugins() {
    let wasm_dir = root().join(sluice_envoy_render::WASM_DIR);
    let mut digests = Vec::new();
    for plugin in &PLUGINS {
        let path = wasm_dir.join(format!("{}.wasm", plugin.wasm_stem));
        let wasm = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e} (cargo xtask build makes it)", path.display()));
        let image = plugin_image(plugin, &wasm).unwrap();
        // Reproducible: built again from the same bytes, the same digest.
        assert_eq!(plugin_image(plugin, &wasm).unwrap().digest(), image.digest());
        digests.push((plugin, image.digest()));
    }
    let files = istio::manifests(&root(), "registry.example.com/sluice", istio::VERSION, &digests).unwrap();
    let mut stale = Vec::new();
    for (name, text) in &files {
        let committed = std::fs::read_to_string(root().join("examples/istio").join(name)).unwrap_or_default();
        if &committed != text {
            stale.push(name.clone());
        }
    }
    assert!(stale.is_empty(), "examples/istio/ is out of date with the built plugins or the shipped policies (run `cargo xtask images`): {stale:?}");
}

const ROUTER: &str = "envoy.filters.http.router";

/// A filter list reduced to what the two deployments must share: a wasm filter by its root id
/// (Istio names and loads them its own way), the router by its name (Istio writes its own), every
/// other filter whole — name and settings.
fn comparable(filters: &[Value]) -> Vec<Value> {
    filters
        .iter()
        .flat_map(|f| match f["name"].as_str() {
            Some(ROUTER) => vec![json!({ "router": ROUTER })],
            _ if f.get("wasm").is_some() => vec![json!({ "wasm": f["wasm"] })],
            // One gateway filter of several sections is, in Istio, a WasmPlugin per section.
            Some("envoy.filters.http.wasm") => wasm_policies(f).into_iter().map(|p| json!({ "wasm": p })).collect(),
            _ => vec![f.clone()],
        })
        .collect()
}

/// The full Envoy gateway's HTTP filters.
fn gateway_http_filters() -> Vec<Value> {
    let gateway = yaml_to_json(&std::fs::read_to_string(root().join("envoy/rendered/full-gateway.yaml")).unwrap());
    gateway["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"].as_array().unwrap().clone()
}

/// The gateway's HTTP filters as Istio builds them (its listener builder and EnvoyFilter patching;
/// docs/istio.md): the WasmPlugins by phase, then priority, highest first, then the router; then
/// the EnvoyFilter's `HTTP_FILTER` patches applied one after the other. A gateway without
/// policies has no Istio authn/authz filters; Istio's own stats filters (between the STATS plugins
/// and the router) are left out.
fn istio_http_filters(envoy_filter: &Value) -> Vec<Value> {
    let phase_rank = |p: &str| ["AUTHN", "AUTHZ", "STATS", "UNSPECIFIED_PHASE"].iter().position(|x| *x == p).unwrap();
    let mut plugins: Vec<Value> = PLUGINS.iter().map(|p| shipped(&format!("sluice-{}.wasmplugin.yaml", p.name))).collect();
    plugins.sort_by_key(|d| (phase_rank(d["spec"]["phase"].as_str().unwrap()), -d["spec"]["priority"].as_i64().unwrap()));
    let mut filters: Vec<Value> = plugins
        .iter()
        .map(|d| json!({ "name": format!("istio-system.{}", d["metadata"]["name"].as_str().unwrap()), "wasm": d["spec"]["pluginName"] }))
        .collect();
    filters.push(json!({ "name": ROUTER }));
    for patch in envoy_filter["spec"]["configPatches"].as_array().unwrap() {
        assert_eq!(patch["applyTo"], "HTTP_FILTER");
        assert_eq!(patch["match"]["context"], "GATEWAY");
        assert_eq!(patch["match"]["listener"]["filterChain"]["filter"]["name"], "envoy.filters.network.http_connection_manager");
        let value = patch["patch"]["value"].clone();
        let sub = patch["match"]["listener"]["filterChain"]["filter"]["subFilter"]["name"].as_str();
        let position = |name: &str| filters.iter().position(|f| f["name"] == name).unwrap_or_else(|| panic!("no filter {name} to patch around"));
        match (patch["patch"]["operation"].as_str().unwrap(), sub) {
            ("INSERT_FIRST", _) => filters.insert(0, value),
            ("INSERT_BEFORE", Some(name)) => {
                let at = position(name);
                filters.insert(at, value);
            }
            ("INSERT_AFTER", Some(name)) => {
                let at = position(name);
                filters.insert(at + 1, value);
            }
            (op, sub) => panic!("patch {op} around {sub:?} not modelled"),
        }
    }
    filters
}

#[test]
fn the_envoy_filter_gives_istio_the_plain_filters_of_the_envoy_gateway_in_its_order() {
    let gateway = gateway_http_filters();
    let envoy_filter = shipped("sluice-filters.envoyfilter.yaml");
    let istio = istio_http_filters(&envoy_filter);
    // Presence, order and settings: the request body limit, json_to_metadata, the four plugins,
    // buffer, the gzip, br and
    // zstd decompressors, the router — each plain filter equal to the gateway's, member for member.
    assert_eq!(comparable(&istio), comparable(&gateway), "the Istio filter chain against envoy/rendered/full-gateway.yaml's");

    // What the decompressors must be (the gateway's and so Istio's): between the buffer and the
    // router, i.e. in the response direction before every plugin; one per encoding; responses only.
    let names: Vec<&str> = istio.iter().map(|f| f["name"].as_str().unwrap()).collect();
    let buffer = names.iter().position(|n| *n == "envoy.filters.http.buffer").unwrap();
    let last_wasm = istio.iter().rposition(|f| f.get("wasm").is_some()).unwrap();
    assert!(last_wasm < buffer);
    let libraries = [
        ("gzip", "type.googleapis.com/envoy.extensions.compression.gzip.decompressor.v3.Gzip"),
        ("br", "type.googleapis.com/envoy.extensions.compression.brotli.decompressor.v3.Brotli"),
        ("zstd", "type.googleapis.com/envoy.extensions.compression.zstd.decompressor.v3.Zstd"),
    ];
    assert_eq!(
        names[buffer + 1..],
        ["envoy.filters.http.decompressor.gzip", "envoy.filters.http.decompressor.br", "envoy.filters.http.decompressor.zstd", ROUTER]
    );
    for (filter, (library, library_type)) in istio[buffer + 1..].iter().zip(libraries) {
        let config = &filter["typed_config"];
        assert_eq!(config["@type"], istio::DECOMPRESSOR_TYPE, "{library}");
        assert_eq!(config["decompressor_library"]["name"], library);
        assert_eq!(config["decompressor_library"]["typed_config"]["@type"], library_type);
        assert_eq!(config["request_direction_config"]["common_config"]["enabled"]["default_value"], false, "{library}: requests are not decoded");
        assert_eq!(config["request_direction_config"]["advertise_accept_encoding"], false, "{library}: the client's accept-encoding is not extended");
        assert!(config.get("response_direction_config").is_none(), "{library}: responses decoded (the default)");
    }

    // The comparison sees a misplaced, a missing and a changed decompressor.
    let mut misplaced = envoy_filter.clone();
    misplaced["spec"]["configPatches"][3]["patch"]["operation"] = json!("INSERT_FIRST");
    let mut missing = envoy_filter.clone();
    missing["spec"]["configPatches"].as_array_mut().unwrap().remove(5);
    let mut changed = envoy_filter.clone();
    changed["spec"]["configPatches"][4]["patch"]["value"]["typed_config"]["request_direction_config"]["advertise_accept_encoding"] = json!(true);
    for (case, doc) in [("misplaced", misplaced), ("missing", missing), ("changed", changed)] {
        assert_ne!(comparable(&istio_http_filters(&doc)), comparable(&gateway), "{case} decompressor not seen");
    }
}
