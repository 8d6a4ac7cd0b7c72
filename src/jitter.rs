//! Jittered backoff: `delivery.backoff_jitter` spreads the waits before retries, so that
//! subscribers that failed together (a shared database went away) are not all retried in the
//! same instant.
//!
//! The spread is a uniformly random factor in [1 − j, 1 + j] ([`Jitter::spread`]); where it
//! sits in a retry's wait (after the cap, before the cap again and the `Retry-After` floor)
//! is `retry.rs`'s `RetryPolicy::wait_before`, the one rule of a retry's wait.
//!
//! proxy-wasm offers no random numbers, and jitter needs no secret ones: a [`JitterRng`]
//! (`fastrand`'s wyrand, a generator with no host calls when seeded explicitly) per VM,
//! seeded with [`seed`] from values the glue reads (the host's clock, context ids). This
//! module never reads a clock itself; tests fix the seed.

use std::hash::{DefaultHasher, Hash, Hasher};

/// `backoff_jitter`: a fraction from 0 (no jitter, the default) to 1.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Jitter(f64);

impl Jitter {
    /// No jitter: every wait as computed.
    pub const NONE: Jitter = Jitter(0.0);

    /// A configured fraction; the error is the message for its config field.
    pub fn new(fraction: f64) -> Result<Jitter, String> {
        if (0.0..=1.0).contains(&fraction) {
            Ok(Jitter(fraction))
        } else {
            Err(format!(
                "must be from 0.0 (no jitter) to 1.0 (waits from 0 to twice the backoff), got \
                 {}",
                crate::json::number_text(fraction)
            ))
        }
    }

    #[cfg(test)]
    pub fn fraction(self) -> f64 {
        self.0
    }

    /// `wait_ms` spread: times a factor drawn from [1 − j, 1 + j]. Without jitter (or for no
    /// wait) it draws nothing. The cap and the `Retry-After` floor around it are the retry's
    /// (`RetryPolicy::wait_before`, the one place a retry's wait is decided).
    pub fn spread(self, wait_ms: u64, rng: &mut JitterRng) -> u64 {
        if self.0 == 0.0 || wait_ms == 0 {
            return wait_ms;
        }
        let factor = 1.0 - self.0 + 2.0 * self.0 * rng.unit();
        // A float to int cast saturates (and a NaN, which cannot occur here, would be 0).
        (wait_ms as f64 * factor).round() as u64
    }
}

/// The random numbers of one VM's jitter.
#[derive(Debug, Clone)]
pub struct JitterRng(fastrand::Rng);

impl JitterRng {
    pub fn with_seed(seed: u64) -> Self {
        JitterRng(fastrand::Rng::with_seed(seed))
    }

    /// A seed for another generator drawn from this one (one per fan-out).
    pub fn next_seed(&mut self) -> u64 {
        self.0.u64(..)
    }

    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        self.0.f64()
    }
}

/// A seed from several values that differ between VMs and between runs (the host's clock in
/// nanoseconds when the VM started, the root context's id, the first stream's id): each bit
/// of every part affects every bit of the seed, so VMs started in the same millisecond, or
/// with the same root context id, still draw different waits.
pub fn seed(parts: &[u64]) -> u64 {
    // SipHash with fixed keys: the same parts give the same seed (tests), no host call.
    let mut hasher = DefaultHasher::new();
    parts.hash(&mut hasher);
    hasher.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::retry::{BackoffPolicy, RetryPolicy};

    impl Jitter {
        /// The wait before a retry whose computed backoff is `wait_ms`, `Retry-After` asking
        /// for `floor_ms`, capped at `max_ms`: the retry's rule (`RetryPolicy::wait_before`)
        /// with this jitter.
        fn apply(self, wait_ms: u64, floor_ms: u64, max_ms: u64, rng: &mut JitterRng) -> u64 {
            let policy = RetryPolicy {
                retry: 1,
                policy: BackoffPolicy::Linear,
                delay_ms: wait_ms,
                max_ms,
            };
            policy.wait_before(1, Some(floor_ms), self, rng)
        }

        /// The longest wait [`Jitter::apply`] can give for `wait_ms`.
        fn longest(self, wait_ms: u64, floor_ms: u64, max_ms: u64) -> u64 {
            let wait = wait_ms.min(max_ms);
            let longest = (wait as f64 * (1.0 + self.0)).ceil() as u64;
            longest.min(max_ms).max(floor_ms.min(max_ms))
        }
    }

    fn jitter(j: f64) -> Jitter {
        Jitter::new(j).unwrap()
    }

    #[test]
    fn the_fraction_is_from_zero_to_one() {
        for ok in [0.0, 0.0001, 0.25, 0.5, 1.0] {
            assert_eq!(Jitter::new(ok).map(Jitter::fraction), Ok(ok));
        }
        for bad in [
            -0.0001,
            -1.0,
            1.0001,
            2.0,
            f64::NAN,
            f64::INFINITY,
            f64::NEG_INFINITY,
        ] {
            let message = Jitter::new(bad).unwrap_err();
            assert!(message.starts_with("must be from 0.0"), "{bad}: {message}");
        }
        assert_eq!(Jitter::default(), Jitter::NONE);
    }

    #[test]
    fn no_jitter_is_the_computed_wait_and_draws_nothing() {
        let mut rng = JitterRng::with_seed(7);
        let cases = [
            // (wait, floor, max, expected)
            (100, 0, 5000, 100),
            (0, 0, 5000, 0),
            (9000, 0, 5000, 5000),
            (u64::MAX, 0, 5000, 5000),
            (100, 3000, 5000, 3000),
            (100, 60_000, 5000, 5000),
            (4000, 1000, 5000, 4000),
        ];
        for (wait, floor, max, want) in cases {
            assert_eq!(
                Jitter::NONE.apply(wait, floor, max, &mut rng),
                want,
                "wait {wait} floor {floor} max {max}"
            );
            assert_eq!(Jitter::NONE.longest(wait, floor, max), want);
        }
        // The generator did not move.
        assert_eq!(rng.unit(), JitterRng::with_seed(7).unit());
    }

    #[test]
    fn draws_stay_within_the_factor_and_cover_it_uniformly() {
        const DRAWS: usize = 20_000;
        const BUCKETS: usize = 10;
        for j in [0.1, 0.5, 1.0] {
            let mut rng = JitterRng::with_seed(42);
            let (low, high) = ((1000.0 * (1.0 - j)) as u64, (1000.0 * (1.0 + j)) as u64);
            let mut buckets = [0usize; BUCKETS];
            let mut sum = 0u64;
            for _ in 0..DRAWS {
                let wait = jitter(j).apply(1000, 0, 1_000_000, &mut rng);
                assert!((low..=high).contains(&wait), "j={j}: {wait}");
                sum += wait;
                let bucket = ((wait - low) as f64 / (high - low) as f64 * BUCKETS as f64) as usize;
                buckets[bucket.min(BUCKETS - 1)] += 1;
            }
            let mean = sum as f64 / DRAWS as f64;
            assert!(
                (mean - 1000.0).abs() < 1000.0 * j * 0.03,
                "j={j}: mean {mean}"
            );
            // Uniform: every tenth of the range gets its share, within a fifth of it (the
            // seed is fixed, so this is not a flaky statistical test).
            let share = DRAWS / BUCKETS;
            for (i, n) in buckets.iter().enumerate() {
                assert!(n.abs_diff(share) < share / 5, "j={j}: bucket {i} has {n}");
            }
        }
    }

    #[test]
    fn the_cap_and_the_retry_after_floor_bound_every_draw() {
        let mut rng = JitterRng::with_seed(3);
        let mut at_cap = 0;
        let mut below_cap = 0;
        for _ in 0..10_000 {
            // A wait at the cap spreads below it and never above.
            let wait = jitter(0.5).apply(5000, 0, 5000, &mut rng);
            assert!((2500..=5000).contains(&wait), "{wait}");
            if wait == 5000 {
                at_cap += 1;
            } else {
                below_cap += 1;
            }
            // Far above the cap: capped first, so it spreads the same way.
            let wait = jitter(0.5).apply(u64::MAX, 0, 5000, &mut rng);
            assert!((2500..=5000).contains(&wait), "{wait}");
            // Never below Retry-After.
            let wait = jitter(1.0).apply(1000, 800, 5000, &mut rng);
            assert!((800..=2000).contains(&wait), "{wait}");
            // A Retry-After beyond the cap is held to the cap.
            let wait = jitter(1.0).apply(1000, 60_000, 5000, &mut rng);
            assert_eq!(wait, 5000);
        }
        // The upper half of the factor lands on the cap, the lower half spreads below it.
        assert!(
            below_cap > 4000 && at_cap > 4000,
            "{below_cap} below, {at_cap} at"
        );
    }

    #[test]
    fn the_longest_wait_bounds_every_draw() {
        let cases = [
            (0.5, 1000, 0, 5000, 1500),
            (1.0, 1000, 0, 5000, 2000),
            (1.0, 4000, 0, 5000, 5000),
            (0.5, 100, 3000, 5000, 3000),
            (0.25, u64::MAX, 0, u64::MAX, u64::MAX),
        ];
        let mut rng = JitterRng::with_seed(11);
        for (j, wait, floor, max, want) in cases {
            let longest = jitter(j).longest(wait, floor, max);
            assert_eq!(longest, want, "j={j} wait {wait}");
            for _ in 0..1000 {
                assert!(jitter(j).apply(wait, floor, max, &mut rng) <= longest);
            }
        }
    }

    #[test]
    fn a_zero_wait_stays_zero() {
        let mut rng = JitterRng::with_seed(5);
        assert_eq!(jitter(1.0).apply(0, 0, 5000, &mut rng), 0);
        assert_eq!(jitter(1.0).apply(10, 0, 0, &mut rng), 0);
    }

    #[test]
    fn seeds_differ_with_every_part_and_repeat_for_the_same_parts() {
        let base = seed(&[1_700_000_000_123_456_789, 1, 2]);
        assert_eq!(base, seed(&[1_700_000_000_123_456_789, 1, 2]));
        let others = [
            seed(&[1_700_000_000_123_456_790, 1, 2]),
            seed(&[1_700_000_000_123_456_789, 2, 2]),
            seed(&[1_700_000_000_123_456_789, 1, 3]),
            seed(&[1_700_000_000_123_456_789, 1]),
        ];
        for other in others {
            assert_ne!(other, base);
            // Neighbouring inputs give unrelated seeds, not neighbouring ones.
            assert!((other ^ base).count_ones() > 8, "{other:x} vs {base:x}");
        }
        // Two VMs seeded differently draw different waits.
        let draws = |s: u64| -> Vec<u64> {
            let mut rng = JitterRng::with_seed(s);
            (0..8)
                .map(|_| jitter(0.5).apply(1000, 0, 5000, &mut rng))
                .collect()
        };
        assert_ne!(draws(base), draws(others[0]));
        assert_eq!(draws(base), draws(base));
    }
}
