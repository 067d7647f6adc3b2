//! `cargo xtask images [--registry HOST/PATH] [--push HOST/PATH [--tls-verify=false]] [--check]`:
//! the plugins as OCI images Istio loads (docs/istio.md), and the `examples/istio/` manifests that
//! pin their digests.
//!
//! - builds each plugin's compat image from `target/wasm32-wasip1/release/<plugin>.wasm` into
//!   `target/oci/<plugin>/` (an OCI image layout, tag = the workspace version) and prints the
//!   digest and sizes;
//! - writes `examples/istio/` for images under `--registry` (default `registry.example.com/sluice`);
//!   with `--check`, writes nothing and fails if a committed file differs from what it would write;
//! - with `--push`, copies every image to that registry with `skopeo` (Debian's, installed by
//!   setup), digests preserved.

use anyhow::{bail, Context, Result};
use sluice_oci::istio::{self, plugin_image, PLUGINS, VERSION};
use std::path::Path;
use std::process::Command;

const DEFAULT_REGISTRY: &str = "registry.example.com/sluice";

pub fn images_command(root: &Path, args: &[String]) -> Result<()> {
    let mut registry = DEFAULT_REGISTRY.to_string();
    let (mut push, mut tls_verify, mut check) = (None, true, false);
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--registry" => registry = it.next().context("--registry needs HOST/PATH")?.clone(),
            "--push" => push = Some(it.next().context("--push needs HOST/PATH")?.clone()),
            "--tls-verify=false" => tls_verify = false,
            "--check" => check = true,
            other => bail!("unknown option {other}: cargo xtask images [--registry HOST/PATH] [--push HOST/PATH [--tls-verify=false]] [--check]"),
        }
    }
    let mut digests = Vec::new();
    println!("| image | digest | .wasm bytes | layer bytes (gzip) |\n|---|---|---|---|");
    for plugin in &PLUGINS {
        let wasm_path = root.join(sluice_envoy_render::WASM_DIR).join(format!("{}.wasm", plugin.wasm_stem));
        let wasm = std::fs::read(&wasm_path).with_context(|| format!("reading {} (cargo xtask build makes it)", wasm_path.display()))?;
        let image = plugin_image(plugin, &wasm)?;
        let layout = root.join("target/oci").join(plugin.name);
        image.write_layout(&layout, VERSION)?;
        println!("| sluice/{}:{VERSION} | {} | {} | {} |", plugin.name, image.digest(), wasm.len(), image.layer.len());
        if let Some(to) = &push {
            let dest = format!("docker://{}", istio::image_reference(to, plugin, VERSION));
            let mut skopeo = Command::new("skopeo");
            skopeo.args(["copy", "--quiet", "--preserve-digests"]);
            if !tls_verify {
                skopeo.arg("--dest-tls-verify=false");
            }
            let status =
                skopeo.arg(format!("oci:{}:{VERSION}", layout.display())).arg(&dest).status().context("running skopeo (cargo xtask setup installs it)")?;
            if !status.success() {
                bail!("skopeo copy to {dest} failed with {status}");
            }
            eprintln!("xtask: pushed {dest}");
        }
        digests.push((plugin, image.digest()));
    }
    let dir = root.join("examples/istio");
    let files = istio::manifests(root, &registry, VERSION, &digests)?;
    let mut stale = Vec::new();
    for (name, text) in &files {
        let path = dir.join(name);
        if check {
            if std::fs::read_to_string(&path).ok().as_deref() != Some(text.as_str()) {
                stale.push(path.display().to_string());
            }
        } else {
            std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
            eprintln!("xtask: wrote {}", path.display());
        }
    }
    if !stale.is_empty() {
        bail!("out of date (run `cargo xtask images`): {}", stale.join(", "));
    }
    Ok(())
}
