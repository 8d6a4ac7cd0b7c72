//! Delivery policy: which failures are worth another attempt, and how long to wait before it.
//!
//! Retry on what a later attempt may fix: no answer, a reset, a timeout, a call Envoy refused
//! (a cluster that is not there yet), 5xx, 404, 408, 409 and 429. Never on other 4xx (the
//! event itself is wrong for that subscriber) nor on 2xx/3xx. This is Knative's selective
//! retry, plus the dispatch error Knative has no equivalent of.
//!
//! The wait before a retry is the computed backoff, or longer when a subscriber that is
//! overloaded (429, 503) asks for more with `Retry-After` (seconds or an HTTP date), as
//! Knative's dispatcher reads it: never shorter than the backoff, never longer than `max_ms`.
//!
//! Nothing here knows about timers or proxy-wasm: the fan-out state asks for a delay,
//! `deliveries` keeps it with the root context's timer.

#[cfg(test)]
use serde::Deserialize;

use crate::call::Failure;

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
    /// The wait before retry `k` (1 for the first retry): the computed backoff, or the
    /// subscriber's `retry-after` (in ms from now) when that is longer; never longer than
    /// `max_ms`. A `retry-after` never shortens the backoff.
    pub fn delay_before(&self, k: u32, retry_after_ms: Option<u64>) -> u64 {
        let computed = match self.policy {
            BackoffPolicy::Linear => self.delay_ms.saturating_mul(u64::from(k)),
            BackoffPolicy::Exponential => {
                let factor = 1u64.checked_shl(k).unwrap_or(u64::MAX);
                self.delay_ms.saturating_mul(factor)
            }
        };
        computed.max(retry_after_ms.unwrap_or(0)).min(self.max_ms)
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
    let at = httpdate::parse_http_date(value).ok()?;
    let at_ms = at.duration_since(std::time::UNIX_EPOCH).ok()?.as_millis();
    Some(
        u64::try_from(at_ms)
            .unwrap_or(u64::MAX)
            .saturating_sub(now_ms),
    )
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
}
