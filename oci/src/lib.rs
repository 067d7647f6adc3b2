//! sluice's plugins for Istio: OCI images and manifests.
//!
//! - [`image`]: the single-layer "compat" OCI image of a `.wasm` (one `tar+gzip` layer holding
//!   `plugin.wasm`), reproducible — the same `.wasm` always gives the same manifest digest — and
//!   written as an OCI image layout that `skopeo` pushes to any registry. No docker involved.
//! - [`compat`]: the checks Istio's image fetcher makes on an image before Envoy gets the module.
//! - [`istio`]: the `WasmPlugin`, `EnvoyFilter` and bootstrap-override manifests of the chain,
//!   generated from the shipped policies and Envoy gateway, with the image digests pinned.
//! - [`tarball`]: the little of tar the image needs.
//!
//! `cargo xtask images` drives it (docs/istio.md); the tests push and pull through a real registry.
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing))]

pub mod compat;
pub mod image;
pub mod istio;
pub mod tarball;

pub use image::{Image, Labels};
