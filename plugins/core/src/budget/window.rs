//! Budget windows on the UTC calendar: which window an instant falls in, and when it ends.
//!
//! Windows are fixed (not sliding): a minute window is `[hh:mm:00, hh:mm+1:00)`, a month window runs
//! from the configured reset day 00:00 UTC to the same day of the next month. Each window has a
//! numeric id that only grows, so a stored counter knows whether it belongs to the current window.

use serde::Deserialize;

const NS_PER_S: u64 = 1_000_000_000;
const S_PER_DAY: u64 = 86_400;

/// A budget window.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Window {
    Minute,
    Hour,
    Day,
    /// A calendar month starting on `reset_day` (1–28, so every month has it) at 00:00 UTC.
    Month {
        reset_day: u8,
    },
}

impl Window {
    pub fn as_str(&self) -> &'static str {
        match self {
            Window::Minute => "minute",
            Window::Hour => "hour",
            Window::Day => "day",
            Window::Month { .. } => "month",
        }
    }

    /// The window as part of a counter's name: the period and, for months, the reset day
    /// (`month_day15`), so two windows that reset at different instants never share a counter
    /// (their ids would mean different periods). No timezone: every window is on UTC.
    pub fn key_part(&self) -> String {
        match self {
            Window::Month { reset_day } => format!("month_day{reset_day}"),
            other => other.as_str().to_string(),
        }
    }

    /// Id of the window containing `now_ns` (nanoseconds since the Unix epoch).
    pub fn id(&self, now_ns: u64) -> u64 {
        let s = now_ns / NS_PER_S;
        match self {
            Window::Minute => s / 60,
            Window::Hour => s / 3600,
            Window::Day => s / S_PER_DAY,
            Window::Month { reset_day } => {
                let (y, m, d) = civil_from_days(s / S_PER_DAY);
                let months = month_index(y, m);
                if d < u64::from(*reset_day) {
                    months.saturating_sub(1)
                } else {
                    months
                }
            }
        }
    }

    /// Start of window `id`, in nanoseconds since the epoch.
    pub fn start_ns(&self, id: u64) -> u64 {
        let s = match self {
            Window::Minute => id.saturating_mul(60),
            Window::Hour => id.saturating_mul(3600),
            Window::Day => id.saturating_mul(S_PER_DAY),
            Window::Month { reset_day } => {
                let (y, m) = (id / 12, id % 12 + 1);
                let day = days_from_civil(y, m, u64::from(*reset_day));
                day.saturating_mul(S_PER_DAY)
            }
        };
        s.saturating_mul(NS_PER_S)
    }

    /// End (exclusive) of the window containing `now_ns`: when its budget resets.
    pub fn end_ns(&self, now_ns: u64) -> u64 {
        self.start_ns(self.id(now_ns).saturating_add(1))
    }
}

/// Months since year 0 (`year * 12 + month - 1`).
fn month_index(year: u64, month: u64) -> u64 {
    year.saturating_mul(12).saturating_add(month.saturating_sub(1))
}

// Calendar arithmetic on the proleptic Gregorian calendar, days counted from 1970-01-01. The
// algorithm works in 400-year eras starting on March 1st, so leap days fall at the end of a year.
const DAYS_PER_ERA: u64 = 146_097;
/// Days from 0000-03-01 to 1970-01-01.
const EPOCH_SHIFT: u64 = 719_468;

/// (year, month 1–12, day 1–31) of a day number (days since 1970-01-01).
pub fn civil_from_days(days: u64) -> (u64, u64, u64) {
    let z = days + EPOCH_SHIFT;
    let era = z / DAYS_PER_ERA;
    let doe = z - era * DAYS_PER_ERA; // [0, 146096]
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365; // [0, 399]
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100); // [0, 365]
    let mp = (5 * doy + 2) / 153; // [0, 11], March = 0
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    (year, month, day)
}

/// Day number (days since 1970-01-01) of a date; dates before the epoch clamp to 0.
pub fn days_from_civil(year: u64, month: u64, day: u64) -> u64 {
    let y = if month <= 2 { year.saturating_sub(1) } else { year };
    let era = y / 400;
    let yoe = y - era * 400;
    let mp = if month > 2 { month - 3 } else { month + 9 };
    let doy = (153 * mp + 2) / 5 + day.saturating_sub(1);
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    (era * DAYS_PER_ERA + doe).saturating_sub(EPOCH_SHIFT)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 2026-01-31T23:59:30Z
    const JAN31: u64 = 1_769_903_970 * NS_PER_S;

    #[test]
    fn calendar_round_trips_across_leap_years() {
        for days in (0..200_000).step_by(7) {
            let (y, m, d) = civil_from_days(days);
            assert_eq!(days_from_civil(y, m, d), days, "{y}-{m}-{d}");
        }
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(days_from_civil(2024, 2, 29)), (2024, 2, 29));
        assert_eq!(days_from_civil(2024, 3, 1) - days_from_civil(2024, 2, 28), 2);
        assert_eq!(days_from_civil(2100, 3, 1) - days_from_civil(2100, 2, 28), 1);
    }

    #[test]
    fn fixed_windows_end_on_their_boundary() {
        assert_eq!(civil_from_days(JAN31 / NS_PER_S / S_PER_DAY), (2026, 1, 31));
        assert_eq!(Window::Minute.end_ns(JAN31), JAN31 + 30 * NS_PER_S);
        assert_eq!(Window::Hour.end_ns(JAN31), JAN31 + 30 * NS_PER_S);
        assert_eq!(Window::Day.end_ns(JAN31), JAN31 + 30 * NS_PER_S);
        assert_ne!(Window::Minute.id(JAN31), Window::Minute.id(JAN31 + 30 * NS_PER_S));
        assert_eq!(Window::Minute.id(JAN31), Window::Minute.id(JAN31 + 29 * NS_PER_S));
    }

    #[test]
    fn months_reset_on_their_day() {
        let calendar = Window::Month { reset_day: 1 };
        let feb1 = JAN31 + 30 * NS_PER_S;
        assert_eq!(calendar.end_ns(JAN31), feb1);
        assert_eq!(calendar.id(feb1), calendar.id(JAN31) + 1);
        // A month starting on the 15th: Jan 31 belongs to the window Jan 15 – Feb 15.
        let mid = Window::Month { reset_day: 15 };
        let feb15 = days_from_civil(2026, 2, 15) * S_PER_DAY * NS_PER_S;
        assert_eq!(mid.end_ns(JAN31), feb15);
        assert_eq!(mid.start_ns(mid.id(JAN31)), days_from_civil(2026, 1, 15) * S_PER_DAY * NS_PER_S);
        assert_eq!(mid.id(feb15 - 1), mid.id(JAN31));
        assert_eq!(mid.id(feb15), mid.id(JAN31) + 1);
        // December → January crosses the year.
        let dec20 = days_from_civil(2026, 12, 20) * S_PER_DAY * NS_PER_S;
        assert_eq!(mid.end_ns(dec20), days_from_civil(2027, 1, 15) * S_PER_DAY * NS_PER_S);
    }
}
