//! Exponential backoff: the one schedule the crates wait by, between retries of a request and
//! between polls of an operation that another attempt is still running.

use std::time::Duration;

/// Exponential backoff with full jitter: before retry number `n` (0-based), a delay drawn
/// uniformly from `0..=min(cap, base × 2^n)`.
///
/// ```
/// use std::time::Duration;
/// use idempotent_core::Backoff;
///
/// let backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(1)).max_attempts(6);
/// assert_eq!(backoff.ceiling(0), Duration::from_millis(100));
/// assert_eq!(backoff.ceiling(3), Duration::from_millis(800));
/// assert_eq!(backoff.ceiling(4), Duration::from_secs(1)); // capped
/// assert_eq!(backoff.attempts(), 6);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    base: Duration,
    cap: Duration,
    max_attempts: u32,
}

impl Backoff {
    /// Backoff from `base`, doubling per retry, never above `cap`; 4 attempts in all.
    pub const fn new(base: Duration, cap: Duration) -> Self {
        Backoff { base, cap, max_attempts: 4 }
    }

    /// How many attempts a request gets in all, the first included (at least 1: 1 means no
    /// retries).
    pub const fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = if attempts == 0 { 1 } else { attempts };
        self
    }

    /// The number of attempts set with [`max_attempts`](Self::max_attempts).
    pub const fn attempts(&self) -> u32 {
        self.max_attempts
    }

    /// The longest delay before retry number `retry` (0-based): `min(cap, base × 2^retry)`.
    pub fn ceiling(&self, retry: u32) -> Duration {
        let factor = 1u32.checked_shl(retry).unwrap_or(u32::MAX);
        self.base.checked_mul(factor).unwrap_or(self.cap).min(self.cap)
    }

    /// The full-jitter delay before retry number `retry`: `random` (a uniformly drawn `u64`)
    /// mapped onto `0..=ceiling(retry)`, uniformly to within a nanosecond.
    pub fn delay(&self, retry: u32, random: u64) -> Duration {
        let ceiling = u64::try_from(self.ceiling(retry).as_nanos()).unwrap_or(u64::MAX - 1);
        let nanos = (u128::from(random) * (u128::from(ceiling) + 1)) >> 64;
        Duration::from_nanos(nanos as u64)
    }
}

impl Backoff {
    /// The jitter to add to a wait the server asked for (HTTP's `Retry-After`, gRPC's pushback,
    /// the `retryAfterMs` of an MCP error): `random` (a uniformly drawn `u64`) mapped onto whole
    /// milliseconds from zero to a tenth of `wait`, kept within 50 ms ..= 250 ms. Enough to
    /// spread clients that were told the same wait, too little to matter to the server that
    /// asked for it.
    ///
    /// ```
    /// use std::time::Duration;
    /// use idempotent_core::Backoff;
    ///
    /// assert_eq!(Backoff::hint_jitter(Duration::from_secs(1), 0), Duration::ZERO);
    /// assert_eq!(Backoff::hint_jitter(Duration::from_secs(1), u64::MAX), Duration::from_millis(100));
    /// assert_eq!(Backoff::hint_jitter(Duration::from_secs(60), u64::MAX), Duration::from_millis(250));
    /// assert_eq!(Backoff::hint_jitter(Duration::ZERO, u64::MAX), Duration::from_millis(50));
    /// ```
    pub fn hint_jitter(wait: Duration, random: u64) -> Duration {
        let spread = (wait / 10).clamp(HINT_JITTER.0, HINT_JITTER.1).as_millis() as u64;
        Duration::from_millis(((u128::from(random) * (u128::from(spread) + 1)) >> 64) as u64)
    }
}

/// The bounds of [`Backoff::hint_jitter`].
const HINT_JITTER: (Duration, Duration) = (Duration::from_millis(50), Duration::from_millis(250));

impl Default for Backoff {
    /// 100 ms base, 10 s cap, 4 attempts.
    fn default() -> Self {
        Backoff::new(Duration::from_millis(100), Duration::from_secs(10))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_ceiling_doubles_from_base_and_stops_at_cap() {
        let b = Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
        let ceilings: Vec<_> = (0..7).map(|n| b.ceiling(n).as_millis()).collect();
        assert_eq!(ceilings, [100, 200, 400, 800, 1600, 2000, 2000]);
        assert_eq!(b.ceiling(40), Duration::from_secs(2), "no overflow for large retry numbers");
        assert_eq!(b.max_attempts(0).attempts(), 1, "zero attempts means one attempt, no retries");
    }

    #[test]
    fn full_jitter_covers_zero_to_ceiling() {
        let b = Backoff::new(Duration::from_millis(100), Duration::from_secs(10));
        let mut rng = fastrand::Rng::with_seed(7);
        for retry in 0..5 {
            let ceiling = b.ceiling(retry);
            let delays: Vec<_> = (0..2000).map(|_| b.delay(retry, rng.u64(..))).collect();
            assert!(delays.iter().all(|d| *d <= ceiling), "retry {retry}: a delay above {ceiling:?}");
            let min = *delays.iter().min().unwrap();
            let max = *delays.iter().max().unwrap();
            assert!(min < ceiling / 20, "retry {retry}: full jitter reaches near zero, lowest was {min:?}");
            assert!(
                max > ceiling * 19 / 20,
                "retry {retry}: full jitter reaches near the ceiling, highest was {max:?}"
            );
            let mean = delays.iter().sum::<Duration>() / delays.len() as u32;
            assert!(
                mean > ceiling * 2 / 5 && mean < ceiling * 3 / 5,
                "retry {retry}: uniform mean ≈ ceiling/2, was {mean:?}"
            );
        }
    }
}
