//! Priority shedding against a per-version in-flight limit.
//!
//! The rule, with `in_flight` the requests already in flight to the version (not counting the one
//! being decided) and `limit` its in-flight limit:
//!
//! - **sheddable** requests are refused once `in_flight ≥ limit` (admitting one more would pass the
//!   limit);
//! - **standard** requests are refused once `in_flight ≥ limit + ⌊limit × standard_extra_percent / 100⌋`
//!   — they may use the headroom above the limit that sheddable traffic is kept out of;
//! - **critical** requests are **never** refused by this rule, whatever the load.
//!
//! So under rising load sheddable traffic goes first, then standard; critical traffic still gets
//! through (and is still counted in `in_flight`, pushing the others out sooner).

/// Tenant priority, in the Gateway API Inference Extension's vocabulary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[cfg_attr(feature = "schema", serde(rename_all = "snake_case"))]
pub enum Priority {
    Critical,
    Standard,
    Sheddable,
}

crate::json::unit_enum_deserialize!(Priority {
    Critical = "critical",
    Standard = "standard",
    Sheddable = "sheddable",
});

impl Priority {
    pub const ALL: [Priority; 3] = [Priority::Critical, Priority::Standard, Priority::Sheddable];

    /// Label for metrics and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Priority::Critical => "critical",
            Priority::Standard => "standard",
            Priority::Sheddable => "sheddable",
        }
    }
}

/// A version's in-flight limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InFlightLimit {
    /// Sheddable requests are refused at this many in flight.
    pub limit: u64,
    /// Standard requests may go this many percent above `limit`.
    pub standard_extra_percent: u32,
}

impl InFlightLimit {
    /// In-flight count at which standard requests are refused.
    pub fn standard_limit(&self) -> u64 {
        let extra = u128::from(self.limit) * u128::from(self.standard_extra_percent) / 100;
        self.limit.saturating_add(u64::try_from(extra).unwrap_or(u64::MAX))
    }
}

/// Whether a request of `priority` is refused with `in_flight` requests already in flight. See the
/// module documentation for the rule; critical requests are never shed.
pub fn should_shed(priority: Priority, in_flight: u64, limit: &InFlightLimit) -> bool {
    match priority {
        Priority::Critical => false,
        Priority::Standard => in_flight >= limit.standard_limit(),
        Priority::Sheddable => in_flight >= limit.limit,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sheddable_goes_first_then_standard_never_critical() {
        let l = InFlightLimit { limit: 10, standard_extra_percent: 25 };
        assert_eq!(l.standard_limit(), 12);
        assert!(!should_shed(Priority::Sheddable, 9, &l));
        assert!(should_shed(Priority::Sheddable, 10, &l));
        assert!(!should_shed(Priority::Standard, 11, &l));
        assert!(should_shed(Priority::Standard, 12, &l));
        assert!(!should_shed(Priority::Critical, u64::MAX, &l));
        let huge = InFlightLimit { limit: u64::MAX, standard_extra_percent: 1000 };
        assert_eq!(huge.standard_limit(), u64::MAX);
    }
}
