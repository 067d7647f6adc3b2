//! Defaults of requests that do not say: what the simulator's `traffic` section and the
//! playground's take when a field is left out. One place, so a workload without them means the
//! same thing to both.

/// The header every plugin reads the tenant from (as in the shipped gateways).
pub fn default_tenant_header() -> String {
    "x-sluice-tenant".into()
}

/// Users per tenant for requests without a user (each request draws one, uniformly).
pub fn default_users_per_tenant() -> u64 {
    100
}

/// The model asked for when the request names none.
pub fn default_model() -> String {
    "llama-3-70b".into()
}

/// Streamed when the request does not say.
pub fn default_stream() -> bool {
    true
}

/// Output tokens when the request gives none.
pub fn default_output_tokens() -> u64 {
    128
}

/// How often state is sampled for the charts and reports, ms of virtual time.
pub fn default_sample_every_ms() -> u64 {
    1000
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_the_documented_ones() {
        // docs/simulator.md, "The scenario file".
        assert_eq!(default_tenant_header(), "x-sluice-tenant");
        assert_eq!(default_users_per_tenant(), 100);
        assert_eq!(default_model(), "llama-3-70b");
        assert!(default_stream());
        assert_eq!(default_output_tokens(), 128);
        assert_eq!(default_sample_every_ms(), 1000);
    }
}
