//! What Istio makes of sluice's manifests (`examples/istio/`), as an Envoy bootstrap a test can run
//! without a cluster. The translation follows the facts of Istio's source (istio/istio
//! `pilot/pkg/model/extensions.go` and the listener builder; docs/istio.md):
//!
//! - a `WasmPlugin` becomes an HTTP wasm filter named `<namespace>.<name>`, `root_id` = its
//!   `pluginName`, `configuration` = its `pluginConfig` as JSON in a `StringValue` (through a
//!   protobuf `Struct`, so every number is a double), the V8 runtime, **no `vm_id`**, its
//!   `failStrategy` as `failure_policy` (`FAIL_CLOSE` → `FAIL_CLOSED`), and for `oci://` URLs the
//!   module the agent fetched and checked, as a local file;
//! - filters are ordered by phase (`AUTHN`, `AUTHZ`, `STATS`, then unspecified, before the
//!   router), and within a phase by `priority`, highest first (Istio's own authn, authz and stats
//!   filters sit between the phases; a gateway without policies has none);
//! - `EnvoyFilter` `HTTP_FILTER` patches are applied to that list in order (`INSERT_FIRST`,
//!   `INSERT_BEFORE`/`INSERT_AFTER` a named sub-filter);
//! - the bootstrap override's document is merged into the bootstrap (here: it supplies all of
//!   `stats_config`).
//!
//! The rest of the bootstrap — listener, routes (what a `VirtualService` would give), clusters,
//! access-log format — is `envoy/rendered/full-gateway.yaml`'s.

use anyhow::{anyhow, bail, Context, Result};
use serde_json::{json, Value};
use std::path::Path;

/// The member at JSON pointer `path`, `Null` when absent (manifests are read, never trusted).
fn at<'a>(v: &'a Value, path: &str) -> &'a Value {
    v.pointer(path).unwrap_or(&Value::Null)
}

/// Sets the member at JSON pointer `path`, which must exist.
fn set(v: &mut Value, path: &str, to: Value) -> Result<()> {
    *v.pointer_mut(path).with_context(|| format!("the full gateway has no {path}"))? = to;
    Ok(())
}

/// A parsed manifest file (one YAML document).
pub fn read_manifest(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let yaml: serde_yaml::Value = serde_yaml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    Ok(serde_json::to_value(yaml)?)
}

/// `pluginConfig` as Istio hands it to Envoy: through `google.protobuf.Struct`, whose numbers are
/// doubles, printed back as JSON (integral values without a fraction, as Go's protojson does).
pub fn struct_json(config: &Value) -> Value {
    match config {
        Value::Number(n) => {
            let f = n.as_f64().unwrap_or(0.0);
            // Exact for |f| ≤ 2^53; above, the double's own integer value, as Istio would send it.
            if f.fract() == 0.0 && f.abs() < 9.0e18 {
                json!(f as i64)
            } else {
                json!(f)
            }
        }
        Value::Array(a) => Value::Array(a.iter().map(struct_json).collect()),
        Value::Object(m) => Value::Object(m.iter().map(|(k, v)| (k.clone(), struct_json(v))).collect()),
        other => other.clone(),
    }
}

/// The HTTP wasm filter Istio generates for `plugin` (a `WasmPlugin` document), loading `module`.
pub fn wasm_filter(plugin: &Value, module: &Path) -> Result<Value> {
    let meta = &at(plugin, "/metadata");
    let spec = &at(plugin, "/spec");
    let name = format!("{}.{}", at(meta, "/namespace").as_str().context("metadata.namespace")?, at(meta, "/name").as_str().context("metadata.name")?);
    let failure_policy = match at(spec, "/failStrategy").as_str().unwrap_or("FAIL_CLOSE") {
        "FAIL_OPEN" => "FAIL_OPEN",
        "FAIL_CLOSE" => "FAIL_CLOSED",
        "FAIL_RELOAD" => "FAIL_RELOAD",
        other => bail!("{name}: unknown failStrategy {other}"),
    };
    let mut env = serde_json::Map::new();
    env.insert("ISTIO_META_WASM_PLUGIN_RESOURCE_VERSION".into(), json!("1"));
    if let Some(policy) = at(spec, "/imagePullPolicy").as_str() {
        env.insert("ISTIO_META_WASM_IMAGE_PULL_POLICY".into(), json!(policy));
    }
    let mut config = json!({
        "name": name,
        "root_id": at(spec, "/pluginName").as_str().unwrap_or_default(),
        "failure_policy": failure_policy,
        "vm_config": {
            "runtime": "envoy.wasm.runtime.v8",
            "code": { "local": { "filename": module.display().to_string() } },
            "environment_variables": { "key_values": env },
        },
    });
    let plugin_config = at(spec, "/pluginConfig");
    if plugin_config.as_object().is_some_and(|m| !m.is_empty()) {
        let value = serde_json::to_string(&struct_json(plugin_config))?;
        let configuration = json!({ "@type": "type.googleapis.com/google.protobuf.StringValue", "value": value });
        if let Some(m) = config.as_object_mut() {
            m.insert("configuration".into(), configuration);
        }
    }
    Ok(json!({
        "name": name,
        "typed_config": { "@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm", "config": config },
    }))
}

/// The gateway's HTTP filter list Istio builds from `plugins` (with the module each loads) and
/// `envoy_filters`.
pub fn http_filters(plugins: &[(Value, &Path)], envoy_filters: &[Value]) -> Result<Vec<Value>> {
    let phase_rank = |p: &Value| match at(p, "/spec/phase").as_str().unwrap_or("UNSPECIFIED_PHASE") {
        "AUTHN" => 0,
        "AUTHZ" => 1,
        "STATS" => 2,
        _ => 3,
    };
    let mut ordered: Vec<&(Value, &Path)> = plugins.iter().collect();
    // Stable: plugins of one phase and priority keep their given order.
    ordered.sort_by_key(|(p, _)| (phase_rank(p), std::cmp::Reverse(at(p, "/spec/priority").as_i64().unwrap_or(0))));
    let mut filters = ordered.into_iter().map(|(p, module)| wasm_filter(p, module)).collect::<Result<Vec<_>>>()?;
    filters.push(
        json!({ "name": "envoy.filters.http.router", "typed_config": { "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router" } }),
    );
    for ef in envoy_filters {
        for patch in at(ef, "/spec/configPatches").as_array().into_iter().flatten() {
            if at(patch, "/applyTo") != "HTTP_FILTER" {
                bail!("only HTTP_FILTER patches are translated, not {}", at(patch, "/applyTo"));
            }
            let value = at(patch, "/patch/value").clone();
            let sub = at(patch, "/match/listener/filterChain/filter/subFilter/name").as_str();
            let position = |name: &str| filters.iter().position(|f| at(f, "/name") == name).ok_or_else(|| anyhow!("no filter {name} to patch around"));
            match (at(patch, "/patch/operation").as_str().unwrap_or_default(), sub) {
                ("INSERT_FIRST", _) => filters.insert(0, value),
                ("INSERT_BEFORE", Some(name)) => {
                    let at = position(name)?;
                    filters.insert(at, value)
                }
                ("INSERT_AFTER", Some(name)) => {
                    let at = position(name)?;
                    filters.insert(at + 1, value)
                }
                (op, _) => bail!("patch operation {op} without what the translation needs"),
            }
        }
    }
    Ok(filters)
}

/// Ports and paths of one run.
pub struct Ports<'a> {
    pub admin: u16,
    pub listen: u16,
    pub access_log: &'a str,
    /// `(cluster name, port)` for the full gateway's clusters.
    pub clusters: &'a [(&'a str, u16)],
}

/// The bootstrap: the full gateway's listener, routes, clusters and access log, with `filters` as
/// its HTTP filters and `stats_override` (the bootstrap override document) merged in.
pub fn bootstrap(root: &Path, filters: Vec<Value>, stats_override: &Value, ports: &Ports) -> Result<Value> {
    let path = root.join("envoy/rendered/full-gateway.yaml");
    let text = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let mut doc: Value = serde_json::to_value(serde_yaml::from_str::<serde_yaml::Value>(&text)?)?;
    set(&mut doc, "/admin/address/socket_address/port_value", json!(ports.admin))?;
    let listener = "/static_resources/listeners/0";
    set(&mut doc, &format!("{listener}/address/socket_address/port_value"), json!(ports.listen))?;
    let hcm = format!("{listener}/filter_chains/0/filters/0/typed_config");
    set(&mut doc, &format!("{hcm}/http_filters"), Value::Array(filters))?;
    set(&mut doc, &format!("{hcm}/access_log/0/typed_config/path"), json!(ports.access_log))?;
    for cluster in doc.pointer_mut("/static_resources/clusters").and_then(Value::as_array_mut).into_iter().flatten() {
        let name = at(cluster, "/name").as_str().unwrap_or_default().to_string();
        let port = ports.clusters.iter().find(|(n, _)| *n == name).map(|(_, p)| *p).with_context(|| format!("no port for cluster {name}"))?;
        set(cluster, "/load_assignment/endpoints/0/lb_endpoints/0/endpoint/address/socket_address/port_value", json!(port))?;
    }
    let Some(overrides) = stats_override.as_object() else { bail!("the bootstrap override is not an object") };
    let Some(top) = doc.as_object_mut() else { bail!("the full gateway is not a mapping") };
    for (k, v) in overrides {
        top.insert(k.clone(), v.clone());
    }
    Ok(doc)
}
