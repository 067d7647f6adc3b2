//! The plugins as Istio gets them, end to end, without a cluster:
//!
//! 1. each plugin's compat image is built from the `.wasm` `cargo xtask build` made (the digest
//!    must be the `sha256` pinned in `examples/istio/`), pushed with skopeo to a real registry on
//!    loopback (Debian's `docker-registry`), and pulled back by digest — with skopeo into an OCI
//!    layout and with plain registry API calls — then checked the way Istio's image fetcher checks
//!    it: pinned digest = manifest digest, one layer of the compat media type, `plugin.wasm`
//!    inside, byte for byte the built module;
//! 2. the four extracted modules run in real Envoy under the configuration Istio generates from the
//!    `WasmPlugin`s, the `EnvoyFilter` and the bootstrap override (`sluice_e2e::istio`): filter
//!    order, no `vm_id`, failure policies, `pluginConfig` through a protobuf `Struct`; one streamed
//!    request goes through all four plugins, every stamp is written, and the metrics carry the
//!    labels and buckets of the override's stats tags; one gzip-encoded stream is decoded by the
//!    `EnvoyFilter`'s decompressors and measured exactly (tokens equal to the mock's).
//!
//! Skipped when Envoy is not installed (unless `SLUICE_ENVOY` is set, as `cargo xtask test` does).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use serde_json::{json, Value};
use sluice_e2e::access_log::stamp;
use sluice_e2e::istio::{bootstrap, http_filters, read_manifest, Ports};
use sluice_e2e::registry::{layout_blob, skopeo, Registry};
use sluice_e2e::tools::{wasm_dir, workspace_root};
use sluice_e2e::{free_port, post_stream, wait_until, Envoy, MockServer, Tools};
use sluice_oci::compat::{self, CompatError, Shape};
use sluice_oci::image::MANIFEST_MEDIA_TYPE;
use sluice_oci::istio::{plugin_image, BOOTSTRAP_KEY, PLUGINS, VERSION};
use std::path::PathBuf;
use std::time::Duration;

struct Pulled {
    module: PathBuf,
    digest: String,
}

/// Step 1 for every plugin: build, push, pull by digest, check; the module written to `dir`.
fn push_and_pull(registry: &Registry, dir: &std::path::Path) -> Vec<Pulled> {
    let mut out = Vec::new();
    println!("| image | digest | .wasm bytes | layer bytes |\n|---|---|---|---|");
    for plugin in &PLUGINS {
        let wasm = std::fs::read(wasm_dir().join(format!("{}.wasm", plugin.wasm_stem))).unwrap();
        let image = plugin_image(plugin, &wasm).unwrap();
        let manifest = read_manifest(&workspace_root().join(format!("examples/istio/sluice-{}.wasmplugin.yaml", plugin.name))).unwrap();
        let pinned = manifest["spec"]["sha256"].as_str().unwrap().to_string();
        assert_eq!(format!("sha256:{pinned}"), image.digest(), "{}: examples/istio/ pins another image (run `cargo xtask images`)", plugin.name);

        let layout = dir.join("layout").join(plugin.name);
        image.write_layout(&layout, VERSION).unwrap();
        let repo = format!("{}/sluice/{}", registry.host(), plugin.name);
        skopeo(&[
            "copy",
            "--quiet",
            "--preserve-digests",
            "--dest-tls-verify=false",
            &format!("oci:{}:{VERSION}", layout.display()),
            &format!("docker://{repo}:{VERSION}"),
        ])
        .unwrap();

        // The registry names the tag by the digest that was built.
        let by_tag = registry.get(&format!("/v2/sluice/{}/manifests/{VERSION}", plugin.name), MANIFEST_MEDIA_TYPE).unwrap();
        assert_eq!(by_tag.status, 200, "{}", by_tag.text());
        assert_eq!(by_tag.header("docker-content-digest"), Some(image.digest().as_str()));
        assert_eq!(by_tag.body, image.manifest, "{}: the registry serves other manifest bytes than were built", plugin.name);

        // Pulled back by digest with skopeo, then checked as Istio's fetcher checks.
        let pulled = dir.join("pulled").join(plugin.name);
        std::fs::create_dir_all(pulled.parent().unwrap()).unwrap();
        skopeo(&["copy", "--quiet", "--src-tls-verify=false", &format!("docker://{repo}@{}", image.digest()), &format!("oci:{}:pulled", pulled.display())])
            .unwrap();
        let index: Value = serde_json::from_slice(&std::fs::read(pulled.join("index.json")).unwrap()).unwrap();
        let manifest_digest = index["manifests"][0]["digest"].as_str().unwrap().to_string();
        let manifest_bytes = layout_blob(&pulled, &manifest_digest).unwrap();
        let (shape, module) = compat::check(&manifest_bytes, &pinned, |d| layout_blob(&pulled, d)).unwrap();
        assert_eq!(shape, Shape::OciCompat);
        assert!(module == wasm, "{}: the pulled plugin.wasm differs from the built module", plugin.name);

        // And with the registry API alone, by digest, as a fetcher without skopeo would.
        let by_digest = registry.get(&format!("/v2/sluice/{}/manifests/{}", plugin.name, image.digest()), MANIFEST_MEDIA_TYPE).unwrap();
        assert_eq!(by_digest.status, 200);
        let blob = |d: &str| -> anyhow::Result<Vec<u8>> {
            let r = registry.get(&format!("/v2/sluice/{}/blobs/{d}", plugin.name), "*/*")?;
            anyhow::ensure!(r.status == 200, "blob {d}: HTTP {}", r.status);
            Ok(r.body)
        };
        let (_, module_again) = compat::check(&by_digest.body, &pinned, blob).unwrap();
        assert!(module_again == wasm);
        // A pin that names another image is refused before any layer is read.
        let other_pin = "0".repeat(64);
        assert!(matches!(compat::check(&by_digest.body, &other_pin, |_| panic!("no blob may be fetched")), Err(CompatError::DigestMismatch { .. })));

        println!("| sluice/{}:{VERSION} | {} | {} | {} |", plugin.name, image.digest(), wasm.len(), image.layer.len());
        let module_path = dir.join("modules").join(plugin.name).join("plugin.wasm");
        std::fs::create_dir_all(module_path.parent().unwrap()).unwrap();
        std::fs::write(&module_path, &module).unwrap();
        out.push(Pulled { module: module_path, digest: image.digest() });
    }
    out
}

#[test]
fn the_images_go_through_a_real_registry_and_run_in_envoy_as_istio_configures_them() {
    if Tools::locate_or_skip().unwrap().is_none() {
        return;
    }
    let root = workspace_root();
    let dir = std::env::temp_dir().join(format!("sluice-istio-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let registry = Registry::start().unwrap();
    let pulled = push_and_pull(&registry, &dir);
    let digests: std::collections::HashSet<&str> = pulled.iter().map(|p| p.digest.as_str()).collect();
    assert_eq!(digests.len(), 4, "four distinct images");

    // Step 2: Envoy as Istio configures it.
    let plugins: Vec<(Value, &std::path::Path)> = PLUGINS
        .iter()
        .zip(&pulled)
        .map(|(p, m)| (read_manifest(&root.join(format!("examples/istio/sluice-{}.wasmplugin.yaml", p.name))).unwrap(), m.module.as_path()))
        .collect();
    let envoy_filter = read_manifest(&root.join("examples/istio/sluice-filters.envoyfilter.yaml")).unwrap();
    let filters = http_filters(&plugins, &[envoy_filter]).unwrap();
    let names: Vec<&str> = filters.iter().map(|f| f["name"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        [
            "sluice.request_body_limit",
            "envoy.filters.http.json_to_metadata",
            "istio-system.sluice-latency-guard",
            "istio-system.sluice-model-router",
            "istio-system.sluice-tenant-budget",
            "istio-system.sluice-llm-metrics",
            "envoy.filters.http.buffer",
            "envoy.filters.http.decompressor.gzip",
            "envoy.filters.http.decompressor.br",
            "envoy.filters.http.decompressor.zstd",
            "envoy.filters.http.router"
        ]
    );
    assert!(filters.iter().all(|f| f["typed_config"]["config"]["vm_config"].get("vm_id").is_none()), "Istio sets no vm_id");
    let configmap = read_manifest(&root.join("examples/istio/sluice-stats.configmap.yaml")).unwrap();
    let stats_override: Value = serde_json::from_str(configmap["data"][BOOTSTRAP_KEY].as_str().unwrap()).unwrap();

    let mock = |served_by: &str| MockServer::start(&["--served-by", served_by, "--tokens", "6", "--ttft-ms", "40"]).unwrap();
    let (v1, v2, shadow) = (mock("llama-v1"), mock("llama-v2"), mock("qwen-v1"));
    let (admin, listen) = (free_port().unwrap(), free_port().unwrap());
    let access_log = dir.join("access.log").display().to_string();
    let clusters = [("model_v1", v1.port()), ("model_v2", v2.port()), ("qwen_v1", shadow.port())];
    let config = bootstrap(&root, filters, &stats_override, &Ports { admin, listen, access_log: &access_log, clusters: &clusters }).unwrap();
    let (admin_text, listen_text) = (admin.to_string(), listen.to_string());
    let envoy = Envoy::start(
        &format!("{}\n", serde_json::to_string_pretty(&config).unwrap()),
        &[("ADMIN_PORT", admin_text.as_str()), ("LISTEN_PORT", listen_text.as_str()), ("ACCESS_LOG", access_log.as_str())],
    )
    .unwrap();

    let id = "istio-stream-1";
    let body = json!({
        "model": "llama-3-70b",
        "stream": true,
        "stream_options": {"include_usage": true},
        "messages": [{"role": "user", "content": "Hello through the Istio chain"}],
    })
    .to_string();
    let resp =
        post_stream(envoy.listen_addr(), "/v1/chat/completions", &[("x-sluice-tenant", "acme"), ("x-request-id", id)], &body).unwrap().collect().unwrap();
    assert_eq!(resp.status, 200, "{}", resp.text());
    assert!(resp.complete && resp.text().contains("data: [DONE]"), "{}", resp.text());
    let line = envoy.access_log().wait_for_request(id, Duration::from_secs(10)).unwrap();
    let get = |field: &str| stamp(&line, field).unwrap().unwrap_or(Value::Null);
    let (route, latency, budget, llm) = (get("route"), get("latency"), get("budget"), get("sluice"));
    let version = route["version"].as_str().unwrap_or_default().to_string();
    assert!(version == "v1" || version == "v2", "route stamp: {route}");
    assert_eq!(resp.header("x-mock-served-by"), Some(format!("llama-{version}").as_str()));
    assert_eq!(latency["version"], json!(version), "latency stamp: {latency}");
    assert_eq!(latency["outcome"], json!("ok"), "latency stamp: {latency}");
    assert_eq!(budget["key"], json!("acme"), "budget stamp: {budget}");
    assert_eq!(budget["decision"], json!("admitted"), "budget stamp: {budget}");
    assert_eq!(llm["output_tokens"], json!(6), "llm stamp: {llm}");
    assert_eq!(budget["charged_tokens"], json!(llm["input_tokens"].as_u64().unwrap() + 6), "budget {budget} against llm {llm}");

    // The override's stats tags made labels, and its buckets are the histogram's.
    let labels = [("model_version", version.as_str()), ("tenant", "acme"), ("api", "chat_completions")];
    let ttft = wait_until(Duration::from_secs(10), "a labelled TTFT histogram", || {
        let m = envoy.metrics()?;
        Ok(m.value("sluice_ttft_ms_count", &labels).filter(|&n| n >= 1.0).map(|_| m))
    })
    .unwrap();
    let bounds: Vec<f64> = ttft.histogram("sluice_ttft_ms", &labels).unwrap().buckets.iter().map(|(le, _)| *le).collect();
    let shipped =
        [1.0, 5.0, 10.0, 20.0, 40.0, 60.0, 80.0, 100.0, 250.0, 500.0, 750.0, 1000.0, 2500.0, 5000.0, 7500.0, 10000.0, 30000.0, 60000.0, f64::INFINITY];
    assert_eq!(bounds, shipped, "the TTFT buckets are the override's");
    assert_eq!(
        ttft.value("sluice_budget_charged_tokens_total", &[("key", "acme"), ("model_version", version.as_str())]),
        Some(budget["charged_tokens"].as_f64().unwrap())
    );
    assert!(ttft.value("sluice_latency_requests_total", &[("version", version.as_str()), ("outcome", "ok")]).unwrap_or(0.0) >= 1.0);

    // A gzip-encoded stream: the EnvoyFilter's decompressors decode it before the plugins see it,
    // so it is measured exactly (without them: 0 output tokens, usage `estimated`).
    let id = "istio-gzip-stream-1";
    let resp =
        post_stream(envoy.listen_addr(), "/v1/chat/completions", &[("x-sluice-tenant", "acme"), ("x-request-id", id), ("x-mock-encoding", "gzip")], &body)
            .unwrap()
            .collect()
            .unwrap();
    assert_eq!(resp.status, 200, "{}", resp.text());
    assert_eq!(resp.header("content-encoding"), None, "the client gets the answer decoded");
    assert!(resp.complete && resp.text().contains("tok5 ") && resp.text().contains("data: [DONE]"), "{}", resp.text());
    let line = envoy.access_log().wait_for_request(id, Duration::from_secs(10)).unwrap();
    let get = |field: &str| stamp(&line, field).unwrap().unwrap_or(Value::Null);
    let (route, latency, budget, llm) = (get("route"), get("latency"), get("budget"), get("sluice"));
    let version = route["version"].as_str().unwrap_or_default().to_string();
    let upstream = if version == "v2" { &v2 } else { &v1 };
    let record = upstream.requests().unwrap().into_iter().find(|r| r.request_id == id).unwrap_or_else(|| panic!("llama-{version} has no record of {id}"));
    assert_eq!(
        upstream.heads().unwrap().iter().find(|h| h.request_id.as_deref() == Some(id)).map(|h| h.values("accept-encoding").is_empty()),
        Some(true),
        "the client's accept-encoding is not extended"
    );
    assert!(record.usage_reported && record.completed, "{record:?}");
    assert_eq!(llm["usage"], json!("reported"), "llm stamp: {llm}");
    assert_eq!(llm["outcome"], json!("completed"), "llm stamp: {llm}");
    assert_eq!(llm["input_tokens"], json!(record.prompt_tokens), "llm stamp: {llm}");
    assert_eq!(llm["output_tokens"], json!(record.completion_tokens), "llm stamp: {llm}");
    assert_eq!(record.completion_tokens, 6);
    assert_eq!(budget["input_tokens"], llm["input_tokens"], "budget {budget} against llm {llm}");
    assert_eq!(budget["output_tokens"], llm["output_tokens"], "budget {budget} against llm {llm}");
    assert_eq!(budget["charged_tokens"], json!(record.prompt_tokens + record.completion_tokens), "budget stamp: {budget}");
    assert_eq!(budget["outcome"], json!("completed"), "budget stamp: {budget}");
    assert_eq!(latency["outcome"], json!("ok"), "latency stamp: {latency}");
    drop(envoy);
    let _ = std::fs::remove_dir_all(&dir);
}
