//! Model routing: sticky A/B splits, canary ramps, fallback and shadow sampling by model version.
//!
//! A [`RoutingPolicy`] lists, per logical model (a glob over the `model` the client asks for), the
//! versions that serve it with integer weights. [`RoutingPolicy::decide`] assigns a request to a
//! version from a *sticky key* (tenant, API-key hash, session, user…): the same key always gets the
//! same version — across requests, processes, restarts and replicas — because the assignment is a
//! pure function of the key bytes, the version names and the weights (see [`hash`]).
//!
//! The assignment is weighted rendezvous hashing: each version scores `w / −ln(u)` with `u` from a
//! hash of the key and the version name, and the highest score wins. This splits keys in proportion
//! to the weights and moves the fewest keys when weights change: raising a version's weight only
//! moves keys *to* it, lowering it only moves keys *away from* it, adding a version only moves keys
//! to the new one (a user on v2 at 10% stays on v2 at 20%).
//!
//! Order of precedence of a decision (its [`Reason`]): a trusted override naming a known version
//! (`override`); then the weighted choice, reported as `unkeyed` when no sticky key was found (the
//! request id is hashed instead, so such requests are split but not sticky), else `ramp` when the
//! chosen version's weight currently comes from a ramp step, else `weight`. If the chosen version
//! is unhealthy the first healthy version of the model's `fallback` order replaces it (`fallback`).
//!
//! Version names are hashed without the model: a key that gets `v2` of one model tends to get `v2`
//! of another model with the same version names and weights (one cohort sees all canaries). Name
//! versions distinctly (`llama-v2`, `qwen-v2`) to make the experiments independent.

pub mod hash;
pub mod policy;
pub mod similarity;

pub use policy::{ModelRoute, RampStep, RoutingPolicy, RoutingPolicyError, Shadow, ShadowVersion, StickySource, Version, MAX_WEIGHT};

use crate::price::glob_match;
use hash::Fnv1a;

/// Why a request went to its version.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    /// The weighted split, on the sticky key.
    Weight,
    /// The weighted split, on the sticky key, while the chosen version's weight comes from a ramp step.
    Ramp,
    /// Forced by the trusted override.
    Override,
    /// The chosen version was unhealthy; this is the next healthy one in fallback order.
    Fallback,
    /// No sticky key: split on the request id (not sticky).
    Unkeyed,
}

impl Reason {
    pub const ALL: [Reason; 5] = [Reason::Weight, Reason::Ramp, Reason::Override, Reason::Fallback, Reason::Unkeyed];

    /// Stable label value: `"weight"`, `"ramp"`, `"override"`, `"fallback"`, `"unkeyed"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Weight => "weight",
            Reason::Ramp => "ramp",
            Reason::Override => "override",
            Reason::Fallback => "fallback",
            Reason::Unkeyed => "unkeyed",
        }
    }
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where a request goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    /// Version name (the `model_version` label).
    pub version: String,
    /// Model name to write into the request body.
    pub upstream_model: String,
    /// Value of the route header.
    pub route: String,
    pub reason: Reason,
    /// Index of the version in [`ModelRoute::versions`].
    pub index: usize,
    /// With [`Reason::Fallback`]: the version that was chosen first and is unhealthy.
    pub fallback_from: Option<String>,
    /// A forced version was given but is not a version of this model; it was ignored.
    pub override_ignored: bool,
}

/// Whether a request is shadowed (before the plugin's concurrency cap).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ShadowVerdict {
    /// The model has no shadow.
    NotConfigured,
    Sampled,
    NotSampled,
    /// The tenant matches `exclude_tenants`, or exclusions exist and the tenant is unknown.
    ExcludedTenant,
}

impl ShadowVerdict {
    /// `"not_configured"`, `"sampled"`, `"not_sampled"`, `"excluded_tenant"`.
    pub fn as_str(self) -> &'static str {
        match self {
            ShadowVerdict::NotConfigured => "not_configured",
            ShadowVerdict::Sampled => "sampled",
            ShadowVerdict::NotSampled => "not_sampled",
            ShadowVerdict::ExcludedTenant => "excluded_tenant",
        }
    }
}

/// A resolved sticky key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StickyKey {
    /// Index into [`RoutingPolicy::sticky_sources`] of the source that gave it.
    pub source: usize,
    /// The key bytes ([`StickySource::ApiKey`]: the lowercase hex SHA-256 of the key, never the key).
    pub bytes: Vec<u8>,
}

impl RoutingPolicy {
    pub fn sticky_sources(&self) -> &[StickySource] {
        &self.sticky
    }

    /// Lowercase name of the header the plugin sets to the chosen route.
    pub fn route_header(&self) -> &str {
        &self.route_header
    }

    /// Lowercase name of the header the plugin sets to the chosen version.
    pub fn version_header(&self) -> &str {
        &self.version_header
    }

    /// The trusted property path that may force a version.
    pub fn override_property(&self) -> Option<&[String]> {
        self.override_property.as_deref()
    }

    /// The (lowercase) header clients might use to force a version: strip it, never honour it.
    pub fn override_client_header(&self) -> Option<&str> {
        self.override_client_header.as_deref()
    }

    /// All model entries, in policy order.
    pub fn models(&self) -> &[ModelRoute] {
        &self.models
    }

    /// Which model entry applies to the requested model: the first whose glob matches.
    pub fn model_for(&self, requested_model: &str) -> Option<usize> {
        self.models.iter().position(|m| glob_match(&m.pattern, requested_model))
    }

    pub fn model(&self, index: usize) -> Option<&ModelRoute> {
        self.models.get(index)
    }

    /// The sticky key of a request: the first source, in policy order, that yields a non-empty
    /// value. `header(name)` returns a request header's value (name lowercase), `property(path)` a
    /// host property's value. For [`StickySource::ApiKey`] `header` is asked for `authorization` and
    /// `x-api-key` and the key found ([`crate::identity::api_key_from_headers`]) is replaced by its
    /// SHA-256 hex.
    pub fn sticky_key(&self, header: &mut dyn FnMut(&str) -> Option<Vec<u8>>, property: &mut dyn FnMut(&[String]) -> Option<Vec<u8>>) -> Option<StickyKey> {
        self.sticky.iter().enumerate().find_map(|(source, s)| {
            let bytes = match s {
                StickySource::Header(name) => header(name),
                StickySource::ApiKey => {
                    let auth = header("authorization");
                    let xkey = header("x-api-key");
                    crate::identity::api_key_from_headers(auth.as_deref(), xkey.as_deref()).map(|k| crate::identity::sha256_hex(&k).into_bytes())
                }
                StickySource::Property(path) => property(path),
            }?;
            (!bytes.is_empty()).then_some(StickyKey { source, bytes })
        })
    }

    /// Effective weights of a model's versions at `now_ns` (after ramps), in version order. Empty
    /// for an unknown model index.
    pub fn weights_at(&self, model: usize, now_ns: u64) -> Vec<(String, u64)> {
        self.models.get(model).map_or_else(Vec::new, |m| m.versions.iter().map(|v| (v.name.clone(), v.weight_at(now_ns).0)).collect())
    }

    /// Index of the version the weighted split gives `key` at `now_ns`, and whether its weight
    /// comes from a ramp step. `None` only if every weight is 0 (validation rules that out).
    pub fn weighted_choice(&self, model: usize, key: &[u8], now_ns: u64) -> Option<(usize, bool)> {
        let m = self.models.get(model)?;
        let state = Fnv1a::new().write(key);
        let mut best: Option<(usize, bool, f64)> = None;
        for (i, v) in m.versions.iter().enumerate() {
            let (w, ramped) = v.weight_at(now_ns);
            if w == 0 {
                continue;
            }
            let s = hash::score(w, hash::version_hash(state, &v.name));
            // Strictly greater: on an (astronomically unlikely) tie the earlier version wins.
            if best.is_none_or(|(_, _, b)| s.total_cmp(&b).is_gt()) {
                best = Some((i, ramped, s));
            }
        }
        best.map(|(i, ramped, _)| (i, ramped))
    }

    /// The routing decision for one request of model entry `model`.
    ///
    /// - `key`: the sticky key bytes; `None` → the split uses `request_id` and the reason is
    ///   [`Reason::Unkeyed`].
    /// - `forced`: a version name from the trusted override. A version of this model → that version,
    ///   [`Reason::Override`]; any other name is ignored (the split decides) and
    ///   [`Decision::override_ignored`] is set.
    /// - `now_ns`: host time, for ramps.
    /// - `unhealthy`: version names whose cluster has no healthy upstream. If the chosen (or forced)
    ///   version is one, the first version of the model's fallback order that is healthy and not the
    ///   chosen one is used instead ([`Reason::Fallback`]); with the default fallback order, versions
    ///   of weight 0 at `now_ns` are skipped. `None` when no healthy version remains (or for an
    ///   unknown model index).
    pub fn decide(&self, model: usize, key: Option<&[u8]>, request_id: &[u8], forced: Option<&str>, now_ns: u64, unhealthy: &[&str]) -> Option<Decision> {
        let m = self.models.get(model)?;
        let forced_index = forced.and_then(|name| m.versions.iter().position(|v| v.name == name));
        let override_ignored = forced.is_some() && forced_index.is_none();
        let (mut index, mut reason) = match forced_index {
            Some(i) => (i, Reason::Override),
            None => {
                let (i, ramped) = self.weighted_choice(model, key.unwrap_or(request_id), now_ns)?;
                let reason = match (key, ramped) {
                    (None, _) => Reason::Unkeyed,
                    (Some(_), true) => Reason::Ramp,
                    (Some(_), false) => Reason::Weight,
                };
                (i, reason)
            }
        };
        let is_unhealthy = |i: usize| m.versions.get(i).is_some_and(|v| unhealthy.contains(&v.name.as_str()));
        let mut fallback_from = None;
        if is_unhealthy(index) {
            let next = m
                .fallback
                .iter()
                .copied()
                .find(|&i| i != index && !is_unhealthy(i) && (m.fallback_explicit || m.versions.get(i).is_some_and(|v| v.weight_at(now_ns).0 > 0)))?;
            fallback_from = m.versions.get(index).map(|v| v.name.clone());
            index = next;
            reason = Reason::Fallback;
        }
        let v = m.versions.get(index)?;
        Some(Decision {
            version: v.name.clone(),
            upstream_model: v.upstream_model.clone(),
            route: v.route.clone(),
            reason,
            index,
            fallback_from,
            override_ignored,
        })
    }

    /// Whether to shadow this request. Tenant exclusion is checked first: a tenant matching one of
    /// `exclude_tenants` — or no tenant at all while exclusions are configured (fail closed: data
    /// that must not be copied is not copied by accident) — is [`ShadowVerdict::ExcludedTenant`].
    /// Otherwise the request is sampled when the hash of its id ([`hash::shadow_hash`]), as a
    /// fraction of 2⁶⁴, is below `fraction`: deterministic in the request id. The concurrency cap is
    /// the plugin's (it counts shadows in flight).
    pub fn shadow_sampled(&self, model: usize, request_id: &[u8], tenant: Option<&str>) -> ShadowVerdict {
        let Some(shadow) = self.models.get(model).and_then(|m| m.shadow.as_ref()) else {
            return ShadowVerdict::NotConfigured;
        };
        if !shadow.exclude_tenants.is_empty() {
            match tenant {
                None => return ShadowVerdict::ExcludedTenant,
                Some(t) if shadow.exclude_tenants.iter().any(|g| glob_match(g, t)) => return ShadowVerdict::ExcludedTenant,
                Some(_) => {}
            }
        }
        if hash::unit_closed_open(hash::shadow_hash(request_id)) < shadow.fraction {
            ShadowVerdict::Sampled
        } else {
            ShadowVerdict::NotSampled
        }
    }
}
