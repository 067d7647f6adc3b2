//! The compat image: one `application/vnd.oci.image.layer.v1.tar+gzip` layer whose tar holds one
//! file, `plugin.wasm`, under an OCI image manifest — the variant Istio's image fetcher accepts
//! with a single layer (facts: docs/istio.md). Built from the `.wasm` bytes alone, with every
//! timestamp, owner and compression setting fixed, so the same `.wasm` always gives the same
//! manifest digest — the `sha256` a `WasmPlugin` pins.

use crate::tarball;
use anyhow::{Context, Result};
use serde_json::json;
use sha2::{Digest, Sha256};
use std::io::Write;
use std::path::Path;

pub const MANIFEST_MEDIA_TYPE: &str = "application/vnd.oci.image.manifest.v1+json";
pub const CONFIG_MEDIA_TYPE: &str = "application/vnd.oci.image.config.v1+json";
pub const LAYER_MEDIA_TYPE: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
/// The file the layer's tar must hold.
pub const PLUGIN_FILE: &str = "plugin.wasm";

/// A built image: its three blobs and the digests that name them.
#[derive(Debug, Clone)]
pub struct Image {
    pub manifest: Vec<u8>,
    pub config: Vec<u8>,
    pub layer: Vec<u8>,
}

/// `sha256:<hex>` of `bytes`.
pub fn digest(bytes: &[u8]) -> String {
    format!("sha256:{}", hex(&Sha256::digest(bytes)))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// What the manifest says about the image beyond its content (OCI's pre-defined annotation keys).
#[derive(Debug, Clone)]
pub struct Labels<'a> {
    /// e.g. `sluice-llm-metrics`.
    pub title: &'a str,
    /// e.g. `0.1.0`.
    pub version: &'a str,
    pub description: &'a str,
    pub licenses: &'a str,
}

impl Image {
    /// The image of `wasm`. Fails only if `wasm` is not a WebAssembly module (no `\0asm` magic):
    /// an image Envoy could never load is better refused at build time.
    pub fn build(wasm: &[u8], labels: &Labels) -> Result<Image> {
        if !wasm.starts_with(b"\0asm") {
            anyhow::bail!("not a WebAssembly module (no \\0asm magic at the start)");
        }
        let tar = tarball::single_file(PLUGIN_FILE, wasm)?;
        let layer = gzip(&tar)?;
        // `diff_ids` name the uncompressed layer, as the OCI image spec asks; no `created` date, so
        // the config (and with it the manifest) depends on the content only.
        let config = serde_json::to_vec(&json!({
            "architecture": "wasm",
            "os": "wasip1",
            "rootfs": { "type": "layers", "diff_ids": [digest(&tar)] },
            "config": {},
        }))?;
        let manifest = serde_json::to_vec(&json!({
            "schemaVersion": 2,
            "mediaType": MANIFEST_MEDIA_TYPE,
            "config": { "mediaType": CONFIG_MEDIA_TYPE, "digest": digest(&config), "size": config.len() },
            "layers": [{
                "mediaType": LAYER_MEDIA_TYPE,
                "digest": digest(&layer),
                "size": layer.len(),
                "annotations": { "org.opencontainers.image.title": PLUGIN_FILE },
            }],
            "annotations": {
                "org.opencontainers.image.title": labels.title,
                "org.opencontainers.image.version": labels.version,
                "org.opencontainers.image.description": labels.description,
                "org.opencontainers.image.licenses": labels.licenses,
            },
        }))?;
        Ok(Image { manifest, config, layer })
    }

    /// The manifest digest: what a registry names the image by, and what Istio compares `sha256` with.
    pub fn digest(&self) -> String {
        digest(&self.manifest)
    }

    /// Writes the image as an OCI image layout (`oci-layout`, `index.json`, `blobs/sha256/…`) in
    /// `dir`, tagged `tag` — what `skopeo copy oci:<dir>:<tag> docker://…` pushes. Whatever `dir`
    /// held before is replaced.
    pub fn write_layout(&self, dir: &Path, tag: &str) -> Result<()> {
        if dir.exists() {
            std::fs::remove_dir_all(dir).with_context(|| format!("clearing {}", dir.display()))?;
        }
        let blobs = dir.join("blobs/sha256");
        std::fs::create_dir_all(&blobs).with_context(|| format!("creating {}", blobs.display()))?;
        for blob in [&self.manifest, &self.config, &self.layer] {
            let name = digest(blob);
            let hex = name.trim_start_matches("sha256:");
            std::fs::write(blobs.join(hex), blob)?;
        }
        std::fs::write(dir.join("oci-layout"), br#"{"imageLayoutVersion":"1.0.0"}"#)?;
        let index = json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.index.v1+json",
            "manifests": [{
                "mediaType": MANIFEST_MEDIA_TYPE,
                "digest": self.digest(),
                "size": self.manifest.len(),
                "annotations": { "org.opencontainers.image.ref.name": tag },
            }],
        });
        std::fs::write(dir.join("index.json"), serde_json::to_vec(&index)?)?;
        Ok(())
    }
}

/// Gzip with a fixed header (no file name, mtime 0, OS "unknown") at the best compression: the
/// same tar always compresses to the same bytes.
fn gzip(data: &[u8]) -> Result<Vec<u8>> {
    let mut encoder = flate2::GzBuilder::new().mtime(0).operating_system(255).write(Vec::new(), flate2::Compression::best());
    encoder.write_all(data)?;
    Ok(encoder.finish()?)
}

/// Decompresses a gzip member (the layer, when checking it).
pub fn gunzip(data: &[u8], limit: u64) -> Result<Vec<u8>> {
    use std::io::Read;
    let mut out = Vec::new();
    flate2::read::GzDecoder::new(data).take(limit + 1).read_to_end(&mut out).context("the layer is not valid gzip")?;
    if out.len() as u64 > limit {
        anyhow::bail!("the layer decompresses to more than {limit} bytes");
    }
    Ok(out)
}
