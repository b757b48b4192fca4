//! Retry policies: the delay before retry `n` is a pure function of `n` and the record id (the jitter is
//! derived from both), so a schedule can be documented, tested, and recomputed after a restart.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use uuid::Uuid;
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::error::{Error, Result};

/// First retry after 100 ms: most transient faults (a broker failover, a dropped connection) are over by then.
pub const DEFAULT_INITIAL_DELAY: Duration = Duration::from_millis(100);
/// Doubling reaches the cap in about nine steps.
pub const DEFAULT_MULTIPLIER: f64 = 2.0;
/// Retries never wait longer than a minute, so a recovered downstream is noticed quickly.
pub const DEFAULT_MAX_DELAY: Duration = Duration::from_secs(60);
/// Ten retries with the defaults cover 82 to 102 seconds of outage (0.1 s doubling to 51.2 s, up to 20 %
/// less each) before the fallback / FAILED.
pub const DEFAULT_MAX_RETRIES: u32 = 10;
/// Up to 20 % less than the nominal delay, so keys that failed together do not retry in lockstep.
pub const DEFAULT_JITTER: f64 = 0.2;

/// How the nominal delay grows with the retry number `n` (1 for the first retry).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Backoff {
    /// `delay` every time.
    Fixed {
        /// The delay.
        #[serde(with = "humantime_serde")]
        delay: Duration,
    },
    /// `initial + (n - 1) × increment`.
    Linear {
        /// Delay before the first retry.
        #[serde(with = "humantime_serde")]
        initial: Duration,
        /// Added for each further retry.
        #[serde(with = "humantime_serde")]
        increment: Duration,
    },
    /// `initial × multiplier^(n - 1)`.
    Exponential {
        /// Delay before the first retry.
        #[serde(with = "humantime_serde")]
        initial: Duration,
        /// Growth factor, ≥ 1.
        multiplier: f64,
    },
}

impl Backoff {
    /// The delay before the first retry.
    fn first(&self) -> Duration {
        match *self {
            Backoff::Fixed { delay } => delay,
            Backoff::Linear { initial, .. } | Backoff::Exponential { initial, .. } => initial,
        }
    }
}

/// A retry policy: backoff, cap, jitter and how many retries before the fallback runs.
///
/// A record goes to the fallback (or FAILED) after `1 + max_retries` failed attempts. A call cut short
/// (a fence, a lease that ran out, a stop, a process that ended outside a partition taken over) counts
/// no attempt, so a handler may be called for one record more often than that.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RetryPolicy {
    /// Growth of the delay.
    pub backoff: Backoff,
    /// Retries after the first failed delivery; 0 sends a failure straight to the fallback.
    pub max_retries: u32,
    /// Cap on any delay, including a handler's retry-after.
    #[serde(with = "humantime_serde")]
    pub max_delay: Duration,
    /// Fraction in `[0, 1]` by which a delay may be shortened at random (derived from the record id).
    pub jitter: f64,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            backoff: Backoff::Exponential { initial: DEFAULT_INITIAL_DELAY, multiplier: DEFAULT_MULTIPLIER },
            max_retries: DEFAULT_MAX_RETRIES,
            max_delay: DEFAULT_MAX_DELAY,
            jitter: DEFAULT_JITTER,
        }
    }
}

impl RetryPolicy {
    /// A policy with a fixed delay and no jitter.
    pub fn fixed(delay: Duration, max_retries: u32) -> Self {
        Self::capped(Backoff::Fixed { delay }, delay, max_retries)
    }

    /// A policy with a linear delay and no jitter; delays are capped at [`DEFAULT_MAX_DELAY`], or at
    /// `initial` if longer ([`with_max_delay`](Self::with_max_delay) sets another cap).
    pub fn linear(initial: Duration, increment: Duration, max_retries: u32) -> Self {
        Self::capped(Backoff::Linear { initial, increment }, initial, max_retries)
    }

    /// A policy with an exponential delay and no jitter; delays are capped at [`DEFAULT_MAX_DELAY`], or
    /// at `initial` if longer ([`with_max_delay`](Self::with_max_delay) sets another cap).
    pub fn exponential(initial: Duration, multiplier: f64, max_retries: u32) -> Self {
        Self::capped(Backoff::Exponential { initial, multiplier }, initial, max_retries)
    }

    /// The default cap, never below the first delay asked for.
    fn capped(backoff: Backoff, first: Duration, max_retries: u32) -> Self {
        Self { backoff, max_retries, max_delay: first.max(DEFAULT_MAX_DELAY), jitter: 0.0 }
    }

    /// Sets the jitter fraction.
    pub fn with_jitter(mut self, jitter: f64) -> Self {
        self.jitter = jitter;
        self
    }

    /// Sets the cap on delays.
    pub fn with_max_delay(mut self, max_delay: Duration) -> Self {
        self.max_delay = max_delay;
        self
    }

    /// Checks the values.
    pub fn validate(&self) -> Result<()> {
        let bad = |msg: String| Err(Error::Config(msg));
        if !(0.0..=1.0).contains(&self.jitter) {
            return bad(format!("retry.jitter must be within 0..=1, got {}", self.jitter));
        }
        if self.max_delay.is_zero() || self.max_delay > crate::MAX_DELAY {
            return bad(format!("retry.max_delay must be above 0 and at most 100 years, got {:?}", self.max_delay));
        }
        // The constructors raise the cap to the first delay; a policy written out (in TOML, or with
        // `..RetryPolicy::default()`) keeps the default minute and would cut every delay to it unseen.
        let first = self.backoff.first();
        if first > self.max_delay {
            return bad(format!(
                "retry.max_delay ({:?}) is below the first delay ({first:?}), which it would cut; raise max_delay",
                self.max_delay
            ));
        }
        if let Backoff::Exponential { multiplier, .. } = self.backoff
            && !(multiplier.is_finite() && multiplier >= 1.0)
        {
            return bad(format!("retry.backoff.multiplier must be a finite number >= 1, got {multiplier}"));
        }
        Ok(())
    }

    /// The nominal delay before retry `n` (`n` ≥ 1), capped, without jitter.
    pub fn nominal_delay(&self, n: u32) -> Duration {
        let steps = n.saturating_sub(1);
        let delay = match self.backoff {
            Backoff::Fixed { delay } => delay,
            Backoff::Linear { initial, increment } => initial.saturating_add(increment.saturating_mul(steps)),
            Backoff::Exponential { initial, multiplier } => {
                // Compute in f64 seconds and cap before converting, so huge exponents cannot overflow
                // (and a multiplier that does not validate cannot make a negative or NaN delay). The
                // growth stays finite, so that no delay times it is NaN.
                let growth = multiplier.max(1.0).powf(f64::from(steps)).min(f64::MAX);
                let secs = initial.as_secs_f64() * growth;
                Duration::try_from_secs_f64(secs.min(self.max_delay.as_secs_f64())).unwrap_or(self.max_delay)
            }
        };
        delay.min(self.max_delay)
    }

    /// The delay before retry `n` of record `id`: the nominal delay shortened by up to `jitter`, by a
    /// fraction derived from `(id, n)`. Total even for a policy that does not validate: the jitter is
    /// taken within `0..=1`.
    pub fn delay(&self, id: Uuid, n: u32) -> Duration {
        let nominal = self.nominal_delay(n);
        let jitter = if self.jitter.is_nan() { 0.0 } else { self.jitter.clamp(0.0, 1.0) };
        if jitter == 0.0 {
            return nominal;
        }
        let unit = (xxh3_64_with_seed(id.as_bytes(), u64::from(n)) >> 11) as f64 / (1u64 << 53) as f64;
        nominal.mul_f64(1.0 - jitter * unit)
    }

    /// The longest a record's attempts can span, from the first one's start to the last one's end,
    /// each attempt lasting at most `per_attempt` and each retry waiting its nominal delay (a handler's
    /// retry-after aside). A JetStream stream's duplicate window shorter than this lets a record whose
    /// first publish was stored, its ack lost, land in the stream twice.
    pub fn longest_span(&self, per_attempt: Duration) -> Duration {
        let mut span = per_attempt;
        let mut previous = None;
        for n in 1..=self.max_retries {
            let delay = self.nominal_delay(n);
            if previous == Some(delay) {
                // The delays grow until they stop (at the cap, or never for a fixed one): the rest alike.
                let rest = self.max_retries - n + 1;
                return span.saturating_add(delay.saturating_add(per_attempt).saturating_mul(rest));
            }
            span = span.saturating_add(delay).saturating_add(per_attempt);
            previous = Some(delay);
        }
        span
    }

    /// Whether a record that has now failed `attempts` times may be retried.
    pub fn may_retry(&self, attempts: u32) -> bool {
        attempts <= self.max_retries
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The default policy's ten retries (0.1 s doubling, capped at a minute: 0.1 … 51.2 s, 102.3 s in
    /// all) and eleven attempts of 5 s each.
    #[test]
    fn the_longest_span_counts_every_delay_and_attempt() {
        let span = RetryPolicy::default().longest_span(Duration::from_secs(5));
        assert_eq!(span, MS(102_300) + Duration::from_secs(55));
        assert_eq!(RetryPolicy::fixed(MS(10), 0).longest_span(MS(3)), MS(3));
        assert_eq!(RetryPolicy::fixed(MS(10), 3).longest_span(MS(3)), MS(3 + 3 * 13));
        assert_eq!(RetryPolicy::linear(MS(10), MS(10), 3).longest_span(MS(0)), MS(60));
        assert_eq!(RetryPolicy::fixed(MS(10), u32::MAX).longest_span(Duration::MAX), Duration::MAX);
        assert_eq!(RetryPolicy::fixed(MS(10), u32::MAX).longest_span(MS(0)), MS(10) * u32::MAX);
    }

    const MS: fn(u64) -> Duration = Duration::from_millis;

    #[test]
    fn schedules_follow_the_documented_formulas() {
        let fixed = RetryPolicy::fixed(MS(50), 3);
        assert_eq!((1..=3).map(|n| fixed.nominal_delay(n)).collect::<Vec<_>>(), [MS(50); 3]);
        let linear = RetryPolicy::linear(MS(10), MS(20), 3);
        assert_eq!((1..=3).map(|n| linear.nominal_delay(n)).collect::<Vec<_>>(), [MS(10), MS(30), MS(50)]);
        let exp = RetryPolicy::exponential(MS(10), 3.0, 5).with_max_delay(MS(200));
        assert_eq!(
            (1..=5).map(|n| exp.nominal_delay(n)).collect::<Vec<_>>(),
            [MS(10), MS(30), MS(90), MS(200), MS(200)]
        );
        assert_eq!(exp.nominal_delay(u32::MAX), MS(200), "huge retry numbers stay capped");
        // A slow growth goes on growing past a thousand retries (it stopped at the 1,025th).
        let slow =
            RetryPolicy::exponential(Duration::from_secs(1), 1.001, 5000).with_max_delay(Duration::from_secs(3600));
        let expected = 1.001_f64.powi(1999);
        assert!((slow.nominal_delay(2000).as_secs_f64() - expected).abs() < 1e-6, "{:?}", slow.nominal_delay(2000));
        let immediate = RetryPolicy::exponential(Duration::ZERO, 10.0, 400);
        assert_eq!(immediate.nominal_delay(400), Duration::ZERO, "no delay grows from none, however many retries");
    }

    /// Every constructor caps delays at a minute, or at the first delay asked for if longer: a first
    /// retry is never cut short of it (linear and exponential policies capped it at a minute).
    #[test]
    fn the_default_cap_never_cuts_the_first_delay() {
        let s = |secs| Duration::from_secs(secs);
        assert_eq!(RetryPolicy::fixed(s(90), 3).nominal_delay(2), s(90));
        let linear = RetryPolicy::linear(s(90), s(30), 3);
        assert_eq!((1..=3).map(|n| linear.nominal_delay(n)).collect::<Vec<_>>(), [s(90); 3]);
        assert_eq!(RetryPolicy::exponential(s(90), 2.0, 3).nominal_delay(1), s(90));
        assert_eq!(RetryPolicy::linear(s(1), s(30), 5).nominal_delay(5), DEFAULT_MAX_DELAY);
    }

    /// The defaults' ten retries wait 102.3 s nominally, 82 s at the most jitter: what
    /// `DEFAULT_MAX_RETRIES` and the README say an outage may last before the fallback.
    #[test]
    fn the_default_retries_cover_82_to_102_seconds() {
        let policy = RetryPolicy::default();
        let nominal: Duration = (1..=DEFAULT_MAX_RETRIES).map(|n| policy.nominal_delay(n)).sum();
        assert_eq!(nominal, Duration::from_millis(102_300));
        assert_eq!(nominal.mul_f64(1.0 - DEFAULT_JITTER).as_secs_f64().round(), 82.0);
    }

    #[test]
    fn jitter_is_bounded_and_deterministic() {
        let p = RetryPolicy::fixed(MS(1000), 3).with_jitter(0.5);
        let mut distinct = std::collections::BTreeSet::new();
        for _ in 0..200 {
            let id = Uuid::now_v7();
            let d = p.delay(id, 1);
            assert!(d <= MS(1000) && d >= MS(500), "{d:?}");
            assert_eq!(d, p.delay(id, 1));
            distinct.insert(d);
        }
        assert!(distinct.len() > 100, "jitter should spread delays");
    }

    #[test]
    fn max_retries_counts_retries_not_attempts() {
        let p = RetryPolicy::fixed(MS(1), 2);
        assert!(p.may_retry(1) && p.may_retry(2) && !p.may_retry(3));
        assert!(!RetryPolicy::fixed(MS(1), 0).may_retry(1));
    }

    /// A policy that does not validate still gives a delay within its bounds instead of panicking.
    #[test]
    fn delays_are_total_even_for_invalid_policies() {
        for jitter in [1.5, -0.5, f64::NAN, f64::INFINITY] {
            let policy = RetryPolicy::fixed(MS(100), 3).with_jitter(jitter);
            let d = policy.delay(Uuid::now_v7(), 1);
            assert!(d <= MS(100), "jitter {jitter}: {d:?}");
        }
        for multiplier in [0.5, -2.0, f64::NAN] {
            let policy = RetryPolicy::exponential(MS(10), multiplier, 3);
            assert!(policy.delay(Uuid::now_v7(), 3) <= DEFAULT_MAX_DELAY, "multiplier {multiplier}");
        }
    }

    #[test]
    fn validate_rejects_nonsense() {
        assert!(RetryPolicy::default().validate().is_ok());
        assert!(RetryPolicy::default().with_jitter(1.5).validate().is_err());
        assert!(RetryPolicy::exponential(MS(1), 0.5, 1).validate().is_err());
        assert!(RetryPolicy::exponential(MS(1), f64::NAN, 1).validate().is_err());
        assert!(RetryPolicy::default().with_max_delay(Duration::ZERO).validate().is_err());
        // A route's policy too: a delay past what a clock can add to now panicked the processor.
        assert!(RetryPolicy::fixed(Duration::MAX, 3).validate().is_err());
        // A first delay over the cap, as a policy written out with the default cap has it.
        let written_out =
            RetryPolicy { backoff: Backoff::Fixed { delay: Duration::from_secs(300) }, ..Default::default() };
        let err = written_out.validate().unwrap_err().to_string();
        assert!(err.contains("max_delay") && err.contains("300s"), "{err}");
        assert!(written_out.with_max_delay(Duration::from_secs(300)).validate().is_ok());
        assert!(RetryPolicy::linear(Duration::from_secs(300), MS(1), 3).validate().is_ok());
    }
}
