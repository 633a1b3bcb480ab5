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

impl Default for Backoff {
    /// 100 ms base, 10 s cap, 4 attempts.
    fn default() -> Self {
        Backoff::new(Duration::from_millis(100), Duration::from_secs(10))
    }
}
