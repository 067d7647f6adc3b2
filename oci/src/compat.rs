//! The checks Istio's image fetcher makes before it hands a `plugin.wasm` to Envoy (facts from
//! istio/istio `pkg/wasm/imagefetcher.go`, summarised in docs/istio.md): the manifest's digest is
//! the pinned `sha256`; the manifest is an OCI or Docker v2 image manifest; the image is one of
//! the three shapes Istio knows — a Docker image with exactly one
//! `application/vnd.docker.image.rootfs.diff.tar.gzip` layer, an OCI image with exactly one
//! `application/vnd.oci.image.layer.v1.tar+gzip` layer (the "compat" image, what sluice builds),
//! or an OCI artifact with exactly two layers, one of them
//! `application/vnd.module.wasm.content.layer.v1+wasm`; and the layer holds the module. On top, as
//! any careful client does: each blob matches its descriptor's digest and size.

use crate::image::{digest, gunzip, LAYER_MEDIA_TYPE, MANIFEST_MEDIA_TYPE, PLUGIN_FILE};
use crate::tarball;
use serde_json::Value;

const DOCKER_MANIFEST_MEDIA_TYPE: &str = "application/vnd.docker.distribution.manifest.v2+json";
const DOCKER_LAYER_MEDIA_TYPE: &str = "application/vnd.docker.image.rootfs.diff.tar.gzip";
const WASM_ARTIFACT_LAYER_MEDIA_TYPE: &str = "application/vnd.module.wasm.content.layer.v1+wasm";
/// No plugin comes near this; a layer that inflates past it is refused rather than read.
const MAX_MODULE_BYTES: u64 = 256 << 20;

/// Which of Istio's accepted shapes an image has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// OCI manifest, one `tar+gzip` layer holding `plugin.wasm`: what `cargo xtask images` builds.
    OciCompat,
    /// Docker v2 manifest, one `rootfs.diff.tar.gzip` layer holding `plugin.wasm`.
    Docker,
    /// OCI artifact: two layers, the module one raw `application/vnd.module.wasm.content.layer.v1+wasm`.
    OciArtifact,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CompatError {
    #[error("manifest digest {actual} is not the pinned sha256 {expected}")]
    DigestMismatch { expected: String, actual: String },
    #[error("the manifest is not JSON: {0}")]
    NotJson(String),
    #[error("manifest media type {0:?} is neither an OCI nor a Docker v2 image manifest")]
    ManifestMediaType(String),
    #[error("{layers} layers: Istio accepts one (compat or Docker image) or two (OCI artifact)")]
    LayerCount { layers: usize },
    #[error("layer media type {0:?} is not one Istio accepts for this manifest")]
    LayerMediaType(String),
    #[error("layer descriptor without a {0}")]
    Descriptor(&'static str),
    #[error("blob {digest}: {reason}")]
    Blob { digest: String, reason: String },
    #[error("the layer holds no {PLUGIN_FILE} (files: {0})")]
    NoModule(String),
    #[error("{PLUGIN_FILE} is not a WebAssembly module")]
    NotWasm,
}

/// Checks an image as Istio's fetcher would, given its manifest bytes, the `sha256` pinned for it
/// (hex, as in a `WasmPlugin`, or `sha256:`-prefixed) and a way to fetch a blob by digest;
/// returns its shape and the module.
pub fn check(manifest: &[u8], pinned_sha256: &str, mut blob: impl FnMut(&str) -> anyhow::Result<Vec<u8>>) -> Result<(Shape, Vec<u8>), CompatError> {
    let expected = if pinned_sha256.starts_with("sha256:") { pinned_sha256.to_string() } else { format!("sha256:{pinned_sha256}") };
    let actual = digest(manifest);
    if actual != expected {
        return Err(CompatError::DigestMismatch { expected, actual });
    }
    let doc: Value = serde_json::from_slice(manifest).map_err(|e| CompatError::NotJson(e.to_string()))?;
    let media_type = doc.get("mediaType").and_then(Value::as_str).unwrap_or_default().to_string();
    let layers = doc.get("layers").and_then(Value::as_array).cloned().unwrap_or_default();
    let layer_type = |l: &Value| l.get("mediaType").and_then(Value::as_str).unwrap_or_default().to_string();
    let (shape, layer) = match (media_type.as_str(), layers.as_slice()) {
        (MANIFEST_MEDIA_TYPE, [one]) if layer_type(one) == LAYER_MEDIA_TYPE => (Shape::OciCompat, one),
        (DOCKER_MANIFEST_MEDIA_TYPE, [one]) if layer_type(one) == DOCKER_LAYER_MEDIA_TYPE => (Shape::Docker, one),
        (MANIFEST_MEDIA_TYPE | DOCKER_MANIFEST_MEDIA_TYPE, [one]) => return Err(CompatError::LayerMediaType(layer_type(one))),
        (MANIFEST_MEDIA_TYPE, [a, b]) => match [a, b].into_iter().find(|l| layer_type(l) == WASM_ARTIFACT_LAYER_MEDIA_TYPE) {
            Some(module) => (Shape::OciArtifact, module),
            None => return Err(CompatError::LayerMediaType(format!("{} and {}", layer_type(a), layer_type(b)))),
        },
        (MANIFEST_MEDIA_TYPE | DOCKER_MANIFEST_MEDIA_TYPE, other) => return Err(CompatError::LayerCount { layers: other.len() }),
        (other, _) => return Err(CompatError::ManifestMediaType(other.to_string())),
    };
    let layer_digest = layer.get("digest").and_then(Value::as_str).ok_or(CompatError::Descriptor("digest"))?;
    let layer_size = layer.get("size").and_then(Value::as_u64).ok_or(CompatError::Descriptor("size"))?;
    let blob_error = |reason: String| CompatError::Blob { digest: layer_digest.to_string(), reason };
    let bytes = blob(layer_digest).map_err(|e| blob_error(format!("{e:#}")))?;
    if digest(&bytes) != layer_digest {
        return Err(blob_error(format!("content digest is {}", digest(&bytes))));
    }
    if bytes.len() as u64 != layer_size {
        return Err(blob_error(format!("{} bytes, the descriptor says {layer_size}", bytes.len())));
    }
    let module = match shape {
        Shape::OciArtifact => bytes,
        Shape::OciCompat | Shape::Docker => {
            let tar = gunzip(&bytes, MAX_MODULE_BYTES + (1 << 20)).map_err(|e| blob_error(format!("{e:#}")))?;
            let files = tarball::regular_files(&tar).map_err(|e| blob_error(format!("{e:#}")))?;
            let names: Vec<String> = files.iter().map(|f| f.name.clone()).collect();
            files.into_iter().find(|f| f.name == PLUGIN_FILE).map(|f| f.data).ok_or_else(|| CompatError::NoModule(names.join(", ")))?
        }
    };
    if !module.starts_with(b"\0asm") {
        return Err(CompatError::NotWasm);
    }
    Ok((shape, module))
}
