//! Time as the cache policies see it: a monotonic clock and a wall clock that tests can move forward.
//!
//! The cache computes every age itself from these clocks (moka has no expiry of its own here), so policy
//! tests advance time without sleeping; the cache's sweep reads them too.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, Instant};

#[derive(Clone)]
pub struct Clock {
    inner: Arc<Inner>,
}

struct Inner {
    start: Instant,
    /// Added to both clocks; only tests move it.
    offset_ms: AtomicI64,
}

impl Default for Clock {
    fn default() -> Self {
        Self {
            inner: Arc::new(Inner {
                start: Instant::now(),
                offset_ms: AtomicI64::new(0),
            }),
        }
    }
}

impl Clock {
    /// Monotonic milliseconds since the clock was made.
    pub fn now_ms(&self) -> i64 {
        self.inner.start.elapsed().as_millis() as i64 + self.inner.offset_ms.load(Ordering::Relaxed)
    }

    /// Wall-clock milliseconds since the Unix epoch (for event timestamps and `max_age`).
    pub fn wall_ms(&self) -> i64 {
        crate::value::now_ms() + self.inner.offset_ms.load(Ordering::Relaxed)
    }

    /// Moves both clocks forward (tests).
    pub fn advance(&self, d: Duration) {
        self.inner
            .offset_ms
            .fetch_add(d.as_millis() as i64, Ordering::Relaxed);
    }
}

/// Milliseconds since the Unix epoch of an RFC 3339 date-time (`2026-11-01T12:00:00Z`,
/// `2026-11-01T13:00:00.250+01:00`): `T` and `Z` in either case, or a space for `T` (RFC 3339 §5.6),
/// a fraction of any length (truncated to milliseconds), and `Z` or a `±HH:MM` offset, which is applied.
/// `None` for anything else, including a date that does not exist.
pub fn rfc3339_ms(s: &str) -> Option<i64> {
    let b = s.as_bytes();
    let num = |from: usize, len: usize| -> Option<i64> {
        let digits = b.get(from..from + len)?;
        digits.iter().try_fold(0i64, |n, d| {
            d.is_ascii_digit().then(|| n * 10 + i64::from(d - b'0'))
        })
    };
    let at = |i: usize, c: &[u8]| b.get(i).is_some_and(|x| c.contains(x));
    if !(at(4, b"-") && at(7, b"-") && at(10, b"Tt ") && at(13, b":") && at(16, b":")) {
        return None;
    }
    let (year, month, day) = (num(0, 4)?, num(5, 2)?, num(8, 2)?);
    let (hour, minute, second) = (num(11, 2)?, num(14, 2)?, num(17, 2)?);
    if !(1..=12).contains(&month)
        || day < 1
        || day > days_in_month(year, month)
        || hour > 23
        || minute > 59
        || second > 60
        || (second == 60 && (hour, minute) != (23, 59))
    {
        // Second 60 exists only as a leap second, at 23:59:60.
        return None;
    }
    let mut i = 19;
    let mut millis = 0;
    if at(i, b".") {
        let digits = b[i + 1..].iter().take_while(|d| d.is_ascii_digit()).count();
        if digits == 0 {
            return None;
        }
        for k in 0..3 {
            millis = millis * 10 + if k < digits { num(i + 1 + k, 1)? } else { 0 };
        }
        i += 1 + digits;
    }
    let offset_minutes = match b.get(i)? {
        b'Z' | b'z' if b.len() == i + 1 => 0,
        sign @ (b'+' | b'-') if b.len() == i + 6 && at(i + 3, b":") => {
            let (h, m) = (num(i + 1, 2)?, num(i + 4, 2)?);
            if h > 23 || m > 59 {
                return None;
            }
            if *sign == b'-' {
                -(h * 60 + m)
            } else {
                h * 60 + m
            }
        }
        _ => return None,
    };
    let days = days_from_civil(year, month, day);
    let seconds = ((days * 24 + hour) * 60 + minute - offset_minutes) * 60 + second;
    Some(seconds * 1000 + millis)
}

fn days_in_month(year: i64, month: i64) -> i64 {
    match month {
        2 if year % 4 == 0 && (year % 100 != 0 || year % 400 == 0) => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// Days from 1970-01-01 to the given proleptic Gregorian date (Howard Hinnant's `days_from_civil`).
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The proleptic Gregorian date `days` after 1970-01-01 (Howard Hinnant's `civil_from_days`), the inverse
/// of [`days_from_civil`].
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// Milliseconds since the Unix epoch, displayed as RFC 3339 in UTC the way protobuf's JSON writes a
/// `Timestamp`: `1970-01-01T00:00:00Z`, with three fractional digits when there are milliseconds, and
/// clamped to the years 1 to 9999. [`rfc3339_ms`] reads it back.
#[derive(Debug, Clone, Copy)]
pub struct Rfc3339(pub i64);

impl std::fmt::Display for Rfc3339 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        const MIN: i64 = -62_135_596_800_000;
        const MAX: i64 = 253_402_300_799_999;
        let ms = self.0.clamp(MIN, MAX);
        let in_day = ms.rem_euclid(86_400_000);
        let (year, month, day) = civil_from_days(ms.div_euclid(86_400_000));
        let (h, m, sec, milli) = (
            in_day / 3_600_000,
            in_day / 60_000 % 60,
            in_day / 1000 % 60,
            in_day % 1000,
        );
        write!(f, "{year:04}-{month:02}-{day:02}T{h:02}:{m:02}:{sec:02}")?;
        if milli != 0 {
            write!(f, ".{milli:03}")?;
        }
        f.write_str("Z")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_times_apply_their_offset() {
        let utc = rfc3339_ms("2026-10-23T10:05:17.250Z");
        assert_eq!(utc, Some(1_792_749_917_250));
        for same in [
            "2026-10-23T22:05:17.25+12:00",
            "2026-10-23T05:05:17.250-05:00",
            "2026-10-23t10:05:17.250z",
            "2026-10-23 10:05:17.2509Z",
            "2026-10-23T10:05:17.250-00:00",
        ] {
            assert_eq!(rfc3339_ms(same), utc, "{same}");
        }
        assert_eq!(rfc3339_ms("1970-01-01T00:00:00Z"), Some(0));
        // A leap second reads as the next second, the most a millisecond clock can say.
        assert_eq!(
            rfc3339_ms("2016-12-31T23:59:60Z"),
            rfc3339_ms("2017-01-01T00:00:00Z")
        );
        assert_eq!(rfc3339_ms("2024-02-29T00:00:00Z"), Some(1_709_164_800_000));
        assert_eq!(rfc3339_ms("1969-12-31T23:59:59Z"), Some(-1000));
        for bad in [
            "2026-10-23T12:00:00.Z",
            "2026-10-23T12:00:00Z ",
            "2026-10-23T12:00:00",
            "2026-10-23",
            "2025-02-29T00:00:00Z",
            "2026-13-01T00:00:00Z",
            "2026-10-23T24:00:00Z",
            "2026-10-23T12:00:00+1:00",
            "2026-10-23T12:00:00+01:60",
            "2026-10-23T12:00:00+0100",
            "2026-11-22T10:00:60Z",
            "2026-1O-23T12:00:00Z",
            "",
        ] {
            assert_eq!(rfc3339_ms(bad), None, "{bad}");
        }
    }

    #[test]
    fn formatted_times_read_back_as_the_same_instant() {
        assert_eq!(Rfc3339(0).to_string(), "1970-01-01T00:00:00Z");
        assert_eq!(Rfc3339(-1).to_string(), "1969-12-31T23:59:59.999Z");
        assert_eq!(
            Rfc3339(1_709_164_800_000).to_string(),
            "2024-02-29T00:00:00Z"
        );
        for ms in [
            0,
            1,
            999,
            86_399_999,
            951_782_400_000,
            1_792_749_917_250,
            -86_400_001,
            253_402_300_799_999,
            -62_135_596_800_000,
        ] {
            let text = Rfc3339(ms).to_string();
            assert_eq!(rfc3339_ms(&text), Some(ms), "{text}");
        }
        assert_eq!(Rfc3339(i64::MAX).to_string(), "9999-12-31T23:59:59.999Z");
        assert_eq!(Rfc3339(i64::MIN).to_string(), "0001-01-01T00:00:00Z");
    }
}
