//! Delivery policy: which failures are worth another attempt, and how long to wait before it.
//!
//! Retry on what a later attempt may fix: no answer, a reset, a timeout, a call Envoy refused
//! (a cluster that is not there yet), 5xx, 404, 408, 409 and 429. Never on other 4xx (the
//! event itself is wrong for that subscriber) nor on 2xx/3xx. This is Knative's selective
//! retry, plus the dispatch error Knative has no equivalent of.
//!
//! The wait before a retry is the computed backoff, spread by the subscriber's jitter, or
//! longer when a subscriber that is overloaded (429, 503) asks for more with `Retry-After`
//! (seconds or an HTTP date), as Knative's dispatcher reads it: never shorter than the
//! backoff, never longer than `max_ms`. One function decides it for every caller
//! (`RetryPolicy::wait_before`).
//!
//! Nothing here knows about timers or proxy-wasm: the fan-out state asks for a delay,
//! `deliveries` keeps it with the root context's timer.

#[cfg(test)]
use serde::Deserialize;

use crate::call::Failure;
use crate::jitter::{Jitter, JitterRng};

/// How the delay grows with each retry.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[cfg_attr(test, derive(Deserialize), serde(rename_all = "lowercase"))]
pub enum BackoffPolicy {
    /// `delay * k` before retry k.
    Linear,
    /// `delay * 2^k` before retry k.
    #[default]
    Exponential,
}

/// Retries and their spacing for one subscriber (or its dead-letter and reply calls).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Attempts after the first.
    pub retry: u32,
    pub policy: BackoffPolicy,
    pub delay_ms: u64,
    pub max_ms: u64,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            retry: 0,
            policy: BackoffPolicy::Exponential,
            delay_ms: DEFAULT_BACKOFF_DELAY_MS,
            max_ms: DEFAULT_BACKOFF_MAX_MS,
        }
    }
}

pub const DEFAULT_BACKOFF_DELAY_MS: u64 = 100;
pub const DEFAULT_BACKOFF_MAX_MS: u64 = 5_000;
/// The most retries a configuration may ask for.
pub const MAX_RETRY: u32 = 100;

/// Whether a failed call may succeed if tried again.
pub fn is_retryable(failure: &Failure) -> bool {
    match failure {
        Failure::NoResponse
        | Failure::Reset { .. }
        | Failure::Timeout
        | Failure::DispatchError { .. }
        // The circuit breaker frees up as the cluster's calls end.
        | Failure::Overflow { .. } => true,
        Failure::Status { status, .. } => {
            matches!(status, 500..=599 | 404 | 408 | 409 | 429)
        }
        // The subscriber would answer the same reply again.
        Failure::TooLarge { .. } => false,
    }
}

/// Whether an answer's `retry-after` is read: on the overload answers of data-plane.md (429
/// Too Many Requests, 503 Service Unavailable) only, as Knative's dispatcher does.
pub fn honours_retry_after(status: u16) -> bool {
    matches!(status, 429 | 503)
}

impl RetryPolicy {
    /// The wait before retry `k` (1 for the first retry), decided here for every caller: the
    /// computed backoff capped at `max_ms`, spread by the subscriber's `jitter` (drawing from
    /// `rng`), capped again, and never below what the subscriber's `retry-after` asked for
    /// (in ms from now), itself capped. Capping before the spread means a wait that reached
    /// the cap still spreads, below it; a `retry-after` never shortens the backoff.
    pub fn wait_before(
        &self,
        k: u32,
        retry_after_ms: Option<u64>,
        jitter: Jitter,
        rng: &mut JitterRng,
    ) -> u64 {
        self.bounded(k, retry_after_ms, |wait| jitter.spread(wait, rng))
    }

    /// [`RetryPolicy::wait_before`] without jitter: the wait as computed, and the longest any
    /// wait can be (a `retry-after` can ask for `max_ms`).
    pub fn delay_before(&self, k: u32, retry_after_ms: Option<u64>) -> u64 {
        self.bounded(k, retry_after_ms, |wait| wait)
    }

    /// The rule of [`RetryPolicy::wait_before`], the spread given.
    fn bounded(&self, k: u32, retry_after_ms: Option<u64>, spread: impl FnOnce(u64) -> u64) -> u64 {
        let computed = match self.policy {
            BackoffPolicy::Linear => self.delay_ms.saturating_mul(u64::from(k)),
            BackoffPolicy::Exponential => {
                let factor = 1u64.checked_shl(k).unwrap_or(u64::MAX);
                self.delay_ms.saturating_mul(factor)
            }
        };
        let floor = retry_after_ms.unwrap_or(0).min(self.max_ms);
        spread(computed.min(self.max_ms))
            .min(self.max_ms)
            .max(floor)
    }

    /// The longest all attempts of one call can take: every attempt times out and every wait
    /// is the longest it can be (a `retry-after` can ask for `max_ms` before any retry).
    pub fn worst_case_ms(&self, timeout_ms: u64) -> u64 {
        let attempts = u64::from(self.retry) + 1;
        let waits = u64::from(self.retry).saturating_mul(self.delay_before(1, Some(u64::MAX)));
        attempts.saturating_mul(timeout_ms).saturating_add(waits)
    }
}

/// How long a `retry-after` value asks to wait, in ms from `now_ms` (the host's wall clock,
/// ms since the Unix epoch): `delay-seconds`, or an HTTP date (IMF-fixdate, or the obsolete
/// RFC 850 and asctime forms), a date in the past being no wait. `None` for anything else.
pub fn parse_retry_after(value: &str, now_ms: u64) -> Option<u64> {
    let value = value.trim();
    if let Ok(secs) = value.parse::<u64>() {
        return Some(secs.saturating_mul(1000));
    }
    Some(parse_http_date(value)?.saturating_sub(now_ms))
}

/// The weekdays in the order of `(days since 1970-01-01 + 3) % 7`; the dates' abbreviations
/// are their first three letters.
const WEEKDAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];
const MONTHS: [&str; 12] = [
    "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
];

/// The three forms of an HTTP date (RFC 9110 5.6.7), a recipient having to accept all three:
/// IMF-fixdate, RFC 850 (with its two-digit year) and asctime. A layout's letters read a
/// field: `w` a weekday's abbreviation, `f` its full name, `n` a month's abbreviation, `y`
/// `d` `h` `m` `s` a digit of the year, day, hour, minute, second, `_` a space that stands
/// for a leading 0 of the day; anything else is itself.
const DATE_LAYOUTS: [&[u8]; 3] = [
    b"w, dd n yyyy hh:mm:ss GMT",
    b"f, dd-n-yy hh:mm:ss GMT",
    b"w n _d hh:mm:ss yyyy",
];

/// An HTTP date (white space around it allowed) in ms since the Unix epoch. `None` for
/// anything else: also for a day the month does not have, a weekday that is not the date's,
/// and a year before 1970 or after 9999. An RFC 850 year below 70 is in the 2000s.
fn parse_http_date(value: &str) -> Option<u64> {
    DATE_LAYOUTS
        .iter()
        .find_map(|layout| read_date(layout, value.trim().as_bytes()))
}

/// `text` read by one of [`DATE_LAYOUTS`].
fn read_date(layout: &[u8], text: &[u8]) -> Option<u64> {
    // year, month, day, hour, minute, second, weekday
    let mut at = [0u64; 7];
    let mut rest = text;
    for &c in layout {
        let (field, digit) = match c {
            b'w' | b'f' | b'n' => {
                let names: &[&str] = if c == b'n' { &MONTHS } else { &WEEKDAYS };
                let i = names
                    .iter()
                    .position(|name| rest.get(..3) == name.as_bytes().get(..3))?;
                let name = names.get(i)?.as_bytes();
                let len = if c == b'f' { name.len() } else { 3 };
                rest = rest.strip_prefix(name.get(..len)?)?;
                let slot = if c == b'n' { 1 } else { 6 };
                *at.get_mut(slot)? = i as u64;
                continue;
            }
            b'_' if rest.first() == Some(&b' ') => (2, 0),
            b'y' | b'_' | b'd' | b'h' | b'm' | b's' => {
                let digit = rest.first()?.checked_sub(b'0').filter(|d| *d < 10)?;
                let field = match c {
                    b'y' => 0,
                    b'_' | b'd' => 2,
                    b'h' => 3,
                    b'm' => 4,
                    _ => 5,
                };
                (field, u64::from(digit))
            }
            _ if rest.first() == Some(&c) => {
                rest = rest.get(1..)?;
                continue;
            }
            _ => return None,
        };
        let slot = at.get_mut(field)?;
        *slot = *slot * 10 + digit;
        rest = rest.get(1..)?;
    }
    if !rest.is_empty() {
        return None;
    }
    let [mut year, month, day, hour, minute, second, weekday] = at;
    if layout.starts_with(b"f") {
        year += if year < 70 { 2000 } else { 1900 };
    }
    let days = days_since_epoch(year, month, day)?;
    let valid = hour < 24 && minute < 60 && second < 60 && (days + 3) % 7 == weekday;
    valid.then_some((days * 86_400 + hour * 3600 + minute * 60 + second) * 1000)
}

/// The days from 1970-01-01 to a date (`month` from 0) of the years 1970 to 9999; `None` for
/// a day the month does not have.
fn days_since_epoch(year: u64, month: u64, day: u64) -> Option<u64> {
    let leap = year.is_multiple_of(4) && (!year.is_multiple_of(100) || year.is_multiple_of(400));
    let month_days = match month {
        1 => 28 + u64::from(leap),
        3 | 5 | 8 | 10 => 30,
        _ => 31,
    };
    if !(1970..=9999).contains(&year) || day == 0 || day > month_days {
        return None;
    }
    // From March: February, with its leap day, ends the year (the civil-from-days method).
    let (y, m) = if month < 2 {
        (year - 1, month + 10)
    } else {
        (year, month - 2)
    };
    let day_of_year = (153 * m + 2) / 5 + day - 1;
    let days = y * 365 + y / 4 - y / 100 + y / 400 + day_of_year;
    // 719,468 days from 0000-03-01 to 1970-01-01.
    days.checked_sub(719_468)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(s: u16) -> Failure {
        Failure::Status {
            status: s,
            detail: String::new(),
        }
    }

    #[test]
    fn retry_decision_table() {
        let retry = [
            Failure::NoResponse,
            Failure::Timeout,
            Failure::Reset {
                detail: String::new(),
            },
            Failure::DispatchError {
                detail: String::new(),
            },
            status(500),
            status(502),
            status(503),
            status(504),
            status(599),
            status(404),
            status(408),
            status(409),
            status(429),
        ];
        for failure in &retry {
            assert!(is_retryable(failure), "{failure:?} should be retried");
        }
        let never = [
            status(400),
            status(401),
            status(403),
            status(405),
            status(410),
            status(413),
            status(415),
            status(422),
            status(300),
            status(302),
            status(600),
            Failure::TooLarge { size: 2, limit: 1 },
        ];
        for failure in &never {
            assert!(!is_retryable(failure), "{failure:?} must not be retried");
        }
    }

    #[test]
    fn schedule_table() {
        let exp = RetryPolicy {
            retry: 5,
            policy: BackoffPolicy::Exponential,
            delay_ms: 100,
            max_ms: 1000,
        };
        let lin = RetryPolicy {
            policy: BackoffPolicy::Linear,
            ..exp
        };
        let cases = [
            (exp, 1, None, 200),
            (exp, 2, None, 400),
            (exp, 3, None, 800),
            (exp, 4, None, 1000),
            (exp, 60, None, 1000),
            (exp, 200, None, 1000),
            (lin, 1, None, 100),
            (lin, 2, None, 200),
            (lin, 9, None, 900),
            (lin, 11, None, 1000),
            // retry-after only ever lengthens the wait, still capped
            (exp, 1, Some(0), 200),
            (lin, 1, Some(0), 100),
            (lin, 2, Some(150), 200),
            (exp, 1, Some(500), 500),
            (exp, 3, Some(1000), 1000),
            (exp, 1, Some(30_000), 1000),
            (exp, 1, Some(u64::MAX), 1000),
        ];
        for (policy, k, after, want) in cases {
            assert_eq!(
                policy.delay_before(k, after),
                want,
                "{policy:?} k={k} after={after:?}"
            );
        }
    }

    #[test]
    fn worst_case_adds_every_timeout_and_wait() {
        let policy = RetryPolicy {
            retry: 3,
            policy: BackoffPolicy::Linear,
            delay_ms: 100,
            max_ms: 5000,
        };
        // A retry-after may ask for backoff_max_ms before every retry.
        assert_eq!(policy.worst_case_ms(1000), 4 * 1000 + 3 * 5000);
        assert_eq!(RetryPolicy::default().worst_case_ms(60_000), 60_000);
    }

    #[test]
    fn retry_after_is_read_on_overload_answers_only() {
        assert!(honours_retry_after(429));
        assert!(honours_retry_after(503));
        for status in [500, 502, 504, 404, 408, 409, 200, 301] {
            assert!(!honours_retry_after(status), "{status}");
        }
    }

    #[test]
    fn retry_after_seconds_and_http_dates() {
        // 2015-10-21T07:28:00Z, in ms since the epoch.
        let at = 1_445_412_480_000;
        let cases = [
            ("3", Some(3000)),
            (" 10 ", Some(10_000)),
            ("0", Some(0)),
            ("18446744073709551615", Some(u64::MAX)),
            // IMF-fixdate, and the obsolete forms HTTP still accepts, 2 s after `at - 2000`
            ("Wed, 21 Oct 2015 07:28:00 GMT", Some(2000)),
            ("Wednesday, 21-Oct-15 07:28:00 GMT", Some(2000)),
            ("Wed Oct 21 07:28:00 2015", Some(2000)),
            ("-1", None),
            ("1.5", None),
            ("", None),
            ("soon", None),
            ("Wed, 21 Oct 2015 07:28:00 CET", None),
        ];
        for (value, want) in cases {
            assert_eq!(parse_retry_after(value, at - 2000), want, "{value:?}");
        }
        // A date that has passed asks for no wait.
        assert_eq!(
            parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT", at + 60_000),
            Some(0)
        );
    }

    #[test]
    fn http_dates_in_each_form_and_what_is_not_one() {
        // 2000-02-29T23:59:59Z, a leap day of a year divisible by 400.
        let leap = Some(951_868_799_000);
        let cases = [
            ("Tue, 29 Feb 2000 23:59:59 GMT", leap),
            ("Tuesday, 29-Feb-00 23:59:59 GMT", leap),
            ("Tue Feb 29 23:59:59 2000", leap),
            ("Thu, 01 Jan 1970 00:00:00 GMT", Some(0)),
            ("Thursday, 01-Jan-70 00:00:00 GMT", Some(0)),
            ("Thu Jan  1 00:00:00 1970", Some(0)),
            ("Fri, 31 Dec 9999 23:59:59 GMT", Some(253_402_300_799_000)),
            // RFC 850's two-digit year: below 70 in the 2000s.
            ("Sunday, 06-Nov-94 08:49:37 GMT", Some(784_111_777_000)),
            ("Wednesday, 06-Nov-69 08:49:37 GMT", Some(3_150_953_377_000)),
            // not a day of that month, not that date's weekday, before 1970
            ("Wed, 29 Feb 2001 00:00:00 GMT", None),
            ("Mon, 29 Feb 2100 00:00:00 GMT", None),
            ("Fri, 31 Apr 2015 00:00:00 GMT", None),
            ("Thu, 21 Oct 2015 07:28:00 GMT", None),
            ("Wed, 31 Dec 1969 23:59:59 GMT", None),
            // out of range, or not the layout
            ("Wed, 21 Oct 2015 24:00:00 GMT", None),
            ("Wed, 21 Oct 2015 07:60:00 GMT", None),
            ("Wed, 21 Oct 2015 07:28:60 GMT", None),
            ("Wed, 00 Oct 2015 07:28:00 GMT", None),
            ("Wed, 21 Oct 2015 07:28:00 UTC", None),
            ("Wed, 21 Oct 2015 07:28:00 GMT.", None),
            ("Wed, 21 Oct 2015 7:28:00 GMT", None),
            ("Wed, 21 oct 2015 07:28:00 GMT", None),
            ("Wed 21 Oct 2015 07:28:00 GMT", None),
            ("Wed Oct 21 07:28:00 15", None),
            ("Wed, 21-Oct-15 07:28:00 GMT", None),
            ("Wed Oct 1 07:28:00 2015", None),
            ("Wednes, 21-Oct-15 07:28:00 GMT", None),
            ("", None),
        ];
        for (value, want) in cases {
            assert_eq!(parse_http_date(value), want, "{value:?}");
            assert_eq!(parse_http_date(value), httpdate_ms(value), "{value:?}");
        }
    }

    /// The `httpdate` crate's reading of an HTTP date, the reference.
    fn httpdate_ms(value: &str) -> Option<u64> {
        let at = httpdate::parse_http_date(value).ok()?;
        let ms = at.duration_since(std::time::UNIX_EPOCH).ok()?.as_millis();
        u64::try_from(ms).ok()
    }

    /// One instant in the three forms, from `httpdate`'s IMF-fixdate.
    fn three_forms(secs: u64) -> [String; 3] {
        let at = std::time::UNIX_EPOCH + std::time::Duration::from_secs(secs);
        let imf = httpdate::fmt_http_date(at);
        // "Sun, 06 Nov 1994 08:49:37 GMT"
        let (wday, day, month) = (&imf[..3], &imf[5..7], &imf[8..11]);
        let (year, time) = (&imf[12..16], &imf[17..25]);
        let full = WEEKDAYS.iter().find(|w| w.starts_with(wday)).unwrap();
        let asc_day = day
            .strip_prefix('0')
            .map_or(day.to_string(), |d| format!(" {d}"));
        [
            imf.clone(),
            format!("{full}, {day}-{month}-{} {time} GMT", &year[2..]),
            format!("{wday} {month} {asc_day} {time} {year}"),
        ]
    }

    #[test]
    fn http_dates_read_as_the_httpdate_crate_reads_them() {
        let mut rng = fastrand::Rng::with_seed(34);
        // 1970-01-01 to 9999-12-31, and the days around the leap years' ends of February.
        let mut instants: Vec<u64> = (0..3000).map(|_| rng.u64(..253_402_300_800)).collect();
        for year in [1972u64, 2000, 2024, 2100] {
            let march = days_since_epoch(year, 2, 1).unwrap() * 86_400;
            instants.extend([march - 1, march, march - 86_400 - 1, march + 86_399]);
        }
        for secs in instants {
            for form in three_forms(secs) {
                let ours = parse_http_date(&form);
                assert_eq!(ours, httpdate_ms(&form), "{form:?}");
                if form.contains('-') && !(1970..2070).contains(&(secs / 31_556_952 + 1970)) {
                    continue; // RFC 850 names the year by two digits only
                }
                assert_eq!(ours, Some(secs * 1000), "{form:?}");
            }
        }
    }

    #[test]
    fn http_dates_changed_by_one_byte_read_as_the_httpdate_crate_reads_them() {
        let bytes = b" 0123456789-:,aAGMTxNovFebSunday";
        for secs in [0, 784_111_777, 951_868_799, 1_445_412_480, 4_107_542_400] {
            for form in three_forms(secs) {
                // httpdate does not check the space between an RFC 850 date's year and its
                // time: ours needs it.
                let unchecked = form.find(':').filter(|_| form.contains('-')).map(|c| c - 3);
                for i in 0..=form.len() {
                    let mut variants = vec![format!(
                        "{}{}",
                        &form[..i],
                        &form[(i + 1).min(form.len())..]
                    )];
                    for b in bytes {
                        let c = char::from(*b);
                        variants.push(format!("{}{c}{}", &form[..i], &form[i..]));
                        if i < form.len() && Some(i) != unchecked {
                            variants.push(format!("{}{c}{}", &form[..i], &form[i + 1..]));
                        }
                    }
                    for v in variants {
                        assert_eq!(parse_http_date(&v), httpdate_ms(&v), "{v:?}");
                    }
                }
            }
        }
    }
}
