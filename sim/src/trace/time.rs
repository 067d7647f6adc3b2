//! Timestamps, parsed exactly to the digits given (no floating point, no time-zone database).
//!
//! Every result is an `i128` of nanoseconds: on the Unix clock (since 1970-01-01T00:00:00 UTC) for
//! calendar timestamps, on the trace's own clock for relative seconds.

const NS_PER_SEC: i128 = 1_000_000_000;

/// Days from 1970-01-01 to the given proleptic Gregorian date (Howard Hinnant's `days_from_civil`).
fn days_from_civil(year: i64, month: u32, day: u32) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let m = i64::from(month);
    let mp = if m > 2 { m - 3 } else { m + 9 };
    let doy = (153 * mp + 2) / 5 + i64::from(day) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

fn is_leap(year: i64) -> bool {
    (year % 4 == 0 && year % 100 != 0) || year % 400 == 0
}

fn days_in_month(year: i64, month: u32) -> u32 {
    match month {
        2 if is_leap(year) => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// A cursor over the bytes of a timestamp.
struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn new(s: &'a str) -> Self {
        Cursor { bytes: s.as_bytes(), pos: 0 }
    }

    fn peek(&self) -> Option<u8> {
        self.bytes.get(self.pos).copied()
    }

    fn at_end(&self) -> bool {
        self.pos >= self.bytes.len()
    }

    /// Exactly `n` ASCII digits, as a number.
    fn digits(&mut self, n: usize, what: &str) -> Result<u32, String> {
        let mut value: u32 = 0;
        for _ in 0..n {
            match self.peek() {
                Some(b @ b'0'..=b'9') => {
                    value = value * 10 + u32::from(b - b'0');
                    self.pos += 1;
                }
                _ => return Err(format!("expected {n} digits of the {what}")),
            }
        }
        Ok(value)
    }

    fn expect(&mut self, byte: u8, after: &str) -> Result<(), String> {
        if self.peek() == Some(byte) {
            self.pos += 1;
            Ok(())
        } else {
            Err(format!("expected `{}` after the {after}", byte as char))
        }
    }

    /// `.` followed by 1 to 9 digits, as nanoseconds; nothing when there is no `.`.
    fn fraction(&mut self) -> Result<i128, String> {
        if self.peek() != Some(b'.') {
            return Ok(0);
        }
        self.pos += 1;
        let mut ns: i128 = 0;
        let mut n = 0;
        while let Some(b @ b'0'..=b'9') = self.peek() {
            n += 1;
            if n > 9 {
                return Err("more than 9 fractional digits (finer than a nanosecond)".into());
            }
            ns = ns * 10 + i128::from(b - b'0');
            self.pos += 1;
        }
        if n == 0 {
            return Err("expected digits after the decimal point".into());
        }
        for _ in n..9 {
            ns *= 10;
        }
        Ok(ns)
    }
}

/// Whether a calendar timestamp must, may or must not carry a UTC offset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Zone {
    /// RFC 3339: `Z` or `±HH:MM` is required.
    Required,
    /// Azure traces: the 2023 files have none (read as UTC), the 2024 ones end in `+00:00`.
    Optional,
}

/// `YYYY-MM-DD[T| ]HH:MM:SS[.fraction][Z|±HH:MM]` → Unix nanoseconds.
///
/// The fraction has 1 to 9 digits and is taken exactly. A timestamp without an offset (allowed by
/// [`Zone::Optional`] only) is read as UTC. Leap seconds (`:60`) are refused.
pub(crate) fn parse_datetime(s: &str, zone: Zone) -> Result<i128, String> {
    let mut c = Cursor::new(s);
    let year = i64::from(c.digits(4, "year")?);
    c.expect(b'-', "year")?;
    let month = c.digits(2, "month")?;
    c.expect(b'-', "month")?;
    let day = c.digits(2, "day")?;
    if !(1..=12).contains(&month) {
        return Err(format!("month {month} is not 01–12"));
    }
    if day == 0 || day > days_in_month(year, month) {
        return Err(format!("day {day:02} does not exist in {year:04}-{month:02}"));
    }
    match c.peek() {
        Some(b'T' | b't' | b' ') => c.pos += 1,
        _ => return Err("expected `T` or a space between the date and the time".into()),
    }
    let hour = c.digits(2, "hour")?;
    c.expect(b':', "hour")?;
    let minute = c.digits(2, "minute")?;
    c.expect(b':', "minute")?;
    let second = c.digits(2, "second")?;
    if hour > 23 || minute > 59 {
        return Err(format!("time {hour:02}:{minute:02} does not exist"));
    }
    if second == 60 {
        return Err("leap second (:60) is not supported".into());
    }
    if second > 59 {
        return Err(format!("second {second} is not 00–59"));
    }
    let fraction = c.fraction()?;
    let offset_s: i64 = match c.peek() {
        None if zone == Zone::Optional => 0,
        None => return Err("missing the UTC offset (`Z` or `±HH:MM`)".into()),
        Some(b'Z' | b'z') => {
            c.pos += 1;
            0
        }
        Some(sign @ (b'+' | b'-')) => {
            c.pos += 1;
            let oh = c.digits(2, "offset hours")?;
            c.expect(b':', "offset hours")?;
            let om = c.digits(2, "offset minutes")?;
            if oh > 23 || om > 59 {
                return Err(format!("offset {oh:02}:{om:02} is not a valid UTC offset"));
            }
            let magnitude = i64::from(oh) * 3600 + i64::from(om) * 60;
            if sign == b'-' {
                -magnitude
            } else {
                magnitude
            }
        }
        Some(_) => return Err("unexpected characters after the seconds".into()),
    };
    if !c.at_end() {
        return Err("unexpected characters after the UTC offset".into());
    }
    let days = days_from_civil(year, month, day);
    let local_s = days * 86_400 + i64::from(hour) * 3600 + i64::from(minute) * 60 + i64::from(second);
    Ok(i128::from(local_s - offset_s) * NS_PER_SEC + fraction)
}

/// Non-negative decimal seconds (`"604453"`, `"1796101396.540"`) → nanoseconds, exactly.
pub(crate) fn parse_decimal_seconds(s: &str) -> Result<i128, String> {
    let mut c = Cursor::new(s);
    let mut whole: i128 = 0;
    let mut n = 0;
    while let Some(b @ b'0'..=b'9') = c.peek() {
        n += 1;
        if n > 18 {
            return Err("too many digits".into());
        }
        whole = whole * 10 + i128::from(b - b'0');
        c.pos += 1;
    }
    if n == 0 {
        return Err(format!("expected non-negative decimal seconds, got {s:?}"));
    }
    let fraction = c.fraction().map_err(|e| format!("{e} in {s:?}"))?;
    if !c.at_end() {
        return Err(format!("expected non-negative decimal seconds, got {s:?}"));
    }
    Ok(whole * NS_PER_SEC + fraction)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn civil_days() {
        assert_eq!(days_from_civil(1970, 1, 1), 0);
        assert_eq!(days_from_civil(2000, 3, 1), 11_017);
        assert_eq!(days_from_civil(1969, 12, 31), -1);
    }

    #[test]
    fn datetimes() {
        // date -u -d '2023-11-16 18:15:46' +%s → 1700158546
        assert_eq!(parse_datetime("2023-11-16 18:15:46.6805900", Zone::Optional), Ok(1_700_158_546_680_590_000));
        assert_eq!(parse_datetime("2023-11-16T18:15:46Z", Zone::Required), Ok(1_700_158_546_000_000_000));
        assert_eq!(parse_datetime("2023-11-16T19:15:46.5+01:00", Zone::Required), Ok(1_700_158_546_500_000_000));
        assert_eq!(parse_datetime("2023-11-16T17:45:46.000000001-00:30", Zone::Required), Ok(1_700_158_546_000_000_001));
        assert_eq!(parse_datetime("2024-02-29t00:00:00z", Zone::Required), Ok(1_709_164_800_000_000_000));
        assert!(parse_datetime("2023-02-29T00:00:00Z", Zone::Required).is_err());
        assert!(parse_datetime("2023-11-16T18:15:46", Zone::Required).is_err());
        assert!(parse_datetime("2023-11-16T18:15:60Z", Zone::Required).is_err());
        assert!(parse_datetime("2023-11-16T18:15:46.Z", Zone::Required).is_err());
        assert!(parse_datetime("2023-11-16T18:15:46.1234567890Z", Zone::Required).is_err());
        assert!(parse_datetime("2023-11-16T18:15:46Zjunk", Zone::Required).is_err());
        assert!(parse_datetime("2023-13-16T18:15:46Z", Zone::Required).is_err());
        assert!(parse_datetime("23-11-16T18:15:46Z", Zone::Required).is_err());
    }

    #[test]
    fn decimal_seconds() {
        assert_eq!(parse_decimal_seconds("604453"), Ok(604_453_000_000_000));
        assert_eq!(parse_decimal_seconds("1796101396.540"), Ok(1_796_101_396_540_000_000));
        assert_eq!(parse_decimal_seconds("0.000000001"), Ok(1));
        assert!(parse_decimal_seconds("-1").is_err());
        assert!(parse_decimal_seconds("1e3").is_err());
        assert!(parse_decimal_seconds("").is_err());
        assert!(parse_decimal_seconds("1.").is_err());
    }
}
