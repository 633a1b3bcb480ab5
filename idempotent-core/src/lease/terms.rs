//! The terms a lease is taken on ([`Terms`]: lease, retention, what a duplicate in flight does,
//! the heartbeat), their bounds, and [`Terms::check`], the one place that enforces them.

use std::time::Duration;

use crate::error::Error;

/// Default lease: how long a crashed worker blocks its key.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(60);
/// Default retention: how long an outcome is kept and replayed.
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(24 * 60 * 60);
/// Default bound on waiting for another caller's attempt under [`OnInFlight::Wait`].
pub const DEFAULT_WAIT: Duration = Duration::from_secs(30);

/// The longest wait a server tells a client whose duplicate is in flight (HTTP's `Retry-After`
/// on a 409, the `retryAfterMs` of an MCP error), however long the running attempt's lease has
/// left: the attempt usually finishes well before its lease runs out, and a client told the whole
/// lease would wait that long for nothing.
pub const IN_FLIGHT_HINT: Duration = Duration::from_secs(1);
/// The shortest lease: a shorter one would run out as it is taken.
pub const MIN_LEASE: Duration = Duration::from_millis(1);
/// The longest lease: one day (the heartbeat renews it for longer work).
pub const MAX_LEASE: Duration = Duration::from_secs(24 * 60 * 60);
/// The shortest retention.
pub const MIN_RETENTION: Duration = Duration::from_millis(1);
/// The longest retention: ten years (3650 days). Stores turn it into a deadline, which must stay
/// representable (an `Instant`, and a Redis expiry in milliseconds written as digits).
pub const MAX_RETENTION: Duration = Duration::from_secs(3650 * 24 * 60 * 60);

/// What a call does when another attempt at the same operation is still running.
///
/// The executor waits by default ([`RunContext`](crate::RunContext)'s steps are retried by a
/// caller that wants the result, and the first attempt usually finishes soon);
/// `idempotent-tower`'s layer rejects by default (an HTTP client has its own retry policy, and
/// a server should not hold a connection open for the length of another request).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum OnInFlight {
    /// Fail at once with [`Error::InFlight`] (HTTP: 409), which carries a retry-after.
    Reject,
    /// Poll with backoff until the other attempt's outcome appears (and return it) or its lease
    /// passes or it gives the key up (and take over), failing as [`Reject`](Self::Reject) does
    /// after `timeout`.
    Wait {
        /// The longest the call waits.
        timeout: Duration,
    },
}

impl Default for OnInFlight {
    fn default() -> Self {
        OnInFlight::Wait { timeout: DEFAULT_WAIT }
    }
}

/// What a call does when the store cannot be reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum FailMode {
    /// Do not run the work; return the store error (HTTP: 503). The safe default.
    #[default]
    Closed,
    /// Run the work without protection (its [`Attempt::is_unprotected`](crate::Attempt::is_unprotected) is true) and log a
    /// warning. Only for work where a duplicate costs less than an outage.
    Open,
}

/// How one operation takes and holds its key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Terms {
    /// How long an attempt holds the key without renewing ([`MIN_LEASE`] ..= [`MAX_LEASE`]).
    /// Keep it at least three times the store's command timeout: the heartbeat renews every
    /// third of the lease, and a renewal that takes as long as the timeout must still land
    /// inside the lease.
    pub lease: Duration,
    /// How long an outcome is kept and replayed ([`MIN_RETENTION`] ..= [`MAX_RETENTION`]).
    pub retention: Duration,
    /// Renew the lease while the work runs (every third of the lease).
    pub heartbeat: bool,
    /// What to do when another attempt is running.
    pub on_in_flight: OnInFlight,
}

impl Default for Terms {
    /// [`DEFAULT_LEASE`], [`DEFAULT_RETENTION`], heartbeat on, and [`OnInFlight::default`].
    fn default() -> Self {
        Terms {
            lease: DEFAULT_LEASE,
            retention: DEFAULT_RETENTION,
            heartbeat: true,
            on_in_flight: OnInFlight::default(),
        }
    }
}

impl Terms {
    /// Sets the lease.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// Sets the retention.
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// Sets what to do when another attempt is running.
    pub fn on_in_flight(mut self, policy: OnInFlight) -> Self {
        self.on_in_flight = policy;
        self
    }

    /// Turns renewal while the work runs on or off.
    pub fn heartbeat(mut self, on: bool) -> Self {
        self.heartbeat = on;
        self
    }

    /// Checks the lease and the retention against their bounds: an [`Error::Config`] that names
    /// the value, the bounds and what to do, or `Ok`.
    pub fn check(&self) -> Result<(), Error> {
        if !(MIN_LEASE..=MAX_LEASE).contains(&self.lease) {
            return Err(Error::Config(format!(
                "lease {:?} is out of range: use between {MIN_LEASE:?} and {MAX_LEASE:?} (the heartbeat renews it \
                 while the work runs), and well above the store's command timeout",
                self.lease
            )));
        }
        if !(MIN_RETENTION..=MAX_RETENTION).contains(&self.retention) {
            return Err(Error::Config(format!(
                "retention {:?} is out of range: use between {MIN_RETENTION:?} and {MAX_RETENTION:?} (3650 days)",
                self.retention
            )));
        }
        Ok(())
    }
}
