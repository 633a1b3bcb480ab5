//! Metrics through the [`metrics`](https://docs.rs/metrics) facade (feature `metrics`).
//!
//! With the feature on, the executor ([`Step::run`](crate::Step::run) and its siblings), the lease
//! lifecycle ([`lease`](crate::lease)) and `idempotent-tower`'s layer (its own `metrics`
//! feature turns this one on) report to whatever recorder the application installed (a
//! Prometheus exporter, `metrics-util`'s `DebuggingRecorder` in tests; with none installed,
//! the facade drops everything). Without the feature every function here compiles to nothing:
//! no clock is read, no label is built.
//!
//! | name | kind | labels | what |
//! |---|---|---|---|
//! | `idempotent_calls_total` | counter | `step`, `store`, `outcome` | one per call of a step (executor) or per request with a well-formed key (layer), by how it ended: the [`CallEnd`] |
//! | `idempotent_action_seconds` | histogram | `step`, `store` | how long the action ran (executor), or the service until it answered (layer), under the lease |
//! | `idempotent_store_call_seconds` | histogram | `store`, `op` | one per store call of the lease lifecycle: `op` is `acquire`, `complete`, `release`, `renew`, `abandon` or `resolve` (an acquire that waits for an attempt in flight makes one per poll) |
//! | `idempotent_leases_held` | gauge | `store` | leases this process holds now: up when an acquire takes a key, down when the lease is dropped (after its outcome is stored or the key given up, or when a call is dropped with it) |
//!
//! Label values:
//!
//! - `step`: the step's name (executor), or the layer's
//!   [`scope`](https://docs.rs/idempotent-tower/latest/idempotent_tower/server/struct.IdempotencyLayer.html#method.scope)
//!   (`http` by default);
//! - `store`: [`Store::kind`]: `memory`, `redis`, `sqlite`, `postgres`, or
//!   what a store of the application's own says (`custom` by default);
//! - `outcome`: [`CallEnd::as_str`];
//! - `op`: the store call.
//!
//! Never a key, a client's `Idempotency-Key`, a tenant, a run id or a payload: each would make
//! one time series per operation, and some are a client's data. A step name is the program's
//! own (keep it a fixed name, not one built from request data).
//!
//! Durations are in seconds (`metrics::Unit::Seconds` in the descriptions that
//! [`describe`] registers). Each call with the feature on and a recorder installed costs a
//! few allocations (the step label is copied, and the facade builds each metric's key): see
//! BENCHMARKS.md (the `metrics` row).

use crate::error::Error;
use crate::record::Transition;
use crate::store::Store;

/// The counter of calls, by step, store and [`CallEnd`].
pub const CALLS: &str = "idempotent_calls_total";
/// The histogram of action (layer: service) durations in seconds, by step and store.
pub const ACTION_SECONDS: &str = "idempotent_action_seconds";
/// The histogram of store-call durations in seconds, by store and operation.
pub const STORE_CALL_SECONDS: &str = "idempotent_store_call_seconds";
/// The gauge of leases this process holds, by store.
pub const LEASES_HELD: &str = "idempotent_leases_held";

/// How a call ended: the `outcome` label of [`CALLS`]. Exactly one per call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CallEnd {
    /// The action ran (or a verifier found its effect; the layer: the service was called), and
    /// the call's end reached the store: its outcome stored, or the key released after an
    /// error that is not stored (layer: a response the store policy does not store).
    Executed,
    /// The store answered with a stored outcome: nothing ran.
    Replayed,
    /// Another attempt holds the key (after waiting, when the call waits): nothing ran.
    InFlight,
    /// The key is stored with another payload: nothing ran.
    Mismatch,
    /// The record needs attention: refused, or this call left it so (a verifier that cannot
    /// tell, [`OnRecovered::NeedsAttention`](crate::OnRecovered::NeedsAttention)).
    NeedsAttention,
    /// The action ran, but another attempt took the key over: its outcome was not stored (or the
    /// lease was lost while a verifier ran, and nothing ran).
    LeaseLost,
    /// A store call failed: the acquire (nothing ran), or storing the outcome (the action ran,
    /// its outcome may not be stored).
    StoreError,
    /// The store failed at acquire and the call fails open: the action ran unprotected.
    Unprotected,
    /// Anything else: lease or retention out of bounds, a record that cannot be read, a result
    /// that cannot be stored, a verifier that failed or timed out; the layer also counts a
    /// request body too large or unreadable here.
    Failed,
}

impl CallEnd {
    /// The label value: `executed`, `replayed`, `in_flight`, `mismatch`, `needs_attention`,
    /// `lease_lost`, `store_error`, `unprotected` or `failed`.
    pub fn as_str(self) -> &'static str {
        match self {
            CallEnd::Executed => "executed",
            CallEnd::Replayed => "replayed",
            CallEnd::InFlight => "in_flight",
            CallEnd::Mismatch => "mismatch",
            CallEnd::NeedsAttention => "needs_attention",
            CallEnd::LeaseLost => "lease_lost",
            CallEnd::StoreError => "store_error",
            CallEnd::Unprotected => "unprotected",
            CallEnd::Failed => "failed",
        }
    }

    /// The outcome of a call whose work ran and whose lease ended with `answer`: `stored` when
    /// the end stored an outcome (a release after an error is [`Executed`](Self::Executed)
    /// whatever the store said: the key frees itself if the release failed).
    pub fn of_end(stored: bool, answer: &Result<Transition, Error>) -> CallEnd {
        match answer {
            _ if !stored => CallEnd::Executed,
            Ok(Transition::Ok) => CallEnd::Executed,
            Ok(Transition::LeaseLost) => CallEnd::LeaseLost,
            Err(_) => CallEnd::StoreError,
        }
    }
}

/// A store call of the lease lifecycle: the `op` label of [`STORE_CALL_SECONDS`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Op {
    /// [`Store::acquire`].
    Acquire,
    /// [`Store::complete`] (and a SQL store's completion inside a transaction).
    Complete,
    /// [`Store::release`].
    Release,
    /// [`Store::renew`].
    Renew,
    /// [`Store::abandon`].
    Abandon,
    /// [`Store::resolve`].
    Resolve,
}

impl Op {
    /// The label value: `acquire`, `complete`, `release`, `renew`, `abandon` or `resolve`.
    pub fn as_str(self) -> &'static str {
        match self {
            Op::Acquire => "acquire",
            Op::Complete => "complete",
            Op::Release => "release",
            Op::Renew => "renew",
            Op::Abandon => "abandon",
            Op::Resolve => "resolve",
        }
    }
}

/// Registers the descriptions and units of the metrics above with the installed recorder (an
/// exporter shows them as `# HELP` lines). Call it once after installing the recorder; the
/// metrics are recorded whether or not it is called.
pub fn describe() {
    #[cfg(feature = "metrics")]
    {
        use metrics::Unit;
        metrics::describe_counter!(CALLS, "Calls of a step (requests with a key, for the layer), by how they ended");
        metrics::describe_histogram!(
            ACTION_SECONDS,
            Unit::Seconds,
            "How long the action (the layer: the service) ran under the lease"
        );
        metrics::describe_histogram!(STORE_CALL_SECONDS, Unit::Seconds, "Store calls of the lease lifecycle");
        metrics::describe_gauge!(LEASES_HELD, "Leases this process holds");
    }
}

/// Counts one call of `step` on `store` that ended as `outcome`.
#[doc(hidden)]
#[inline(always)]
pub fn call(step: &str, store: &dyn Store, outcome: CallEnd) {
    #[cfg(feature = "metrics")]
    metrics::counter!(CALLS, "step" => step.to_owned(), "store" => store.kind(), "outcome" => outcome.as_str())
        .increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = (step, store, outcome);
}

/// Counts the call whose work ran and whose lease ended with `answer` ([`CallEnd::of_end`]).
#[doc(hidden)]
#[inline(always)]
pub fn ended(step: &str, store: &dyn Store, stored: bool, answer: &Result<Transition, Error>) {
    #[cfg(feature = "metrics")]
    call(step, store, CallEnd::of_end(stored, answer));
    #[cfg(not(feature = "metrics"))]
    let _ = (step, store, stored, answer);
}

/// A clock started where a measured span begins; nothing (no clock read) without the feature.
#[doc(hidden)]
#[derive(Debug, Clone, Copy)]
#[must_use]
pub struct Timer {
    #[cfg(feature = "metrics")]
    started: std::time::Instant,
}

impl Timer {
    /// Starts the clock.
    #[inline(always)]
    pub fn start() -> Timer {
        Timer {
            #[cfg(feature = "metrics")]
            started: std::time::Instant::now(),
        }
    }

    #[cfg(feature = "metrics")]
    fn elapsed(self) -> std::time::Duration {
        self.started.elapsed()
    }

    /// Records the time since the start as an action of `step` on `store`.
    #[inline(always)]
    pub fn action(self, step: &str, store: &dyn Store) {
        #[cfg(feature = "metrics")]
        metrics::histogram!(ACTION_SECONDS, "step" => step.to_owned(), "store" => store.kind()).record(self.elapsed());
        #[cfg(not(feature = "metrics"))]
        let _ = (step, store);
    }

    /// Records the time since the start as the store call `op` on `store`.
    #[inline(always)]
    pub fn store_call(self, store: &dyn Store, op: Op) {
        #[cfg(feature = "metrics")]
        metrics::histogram!(STORE_CALL_SECONDS, "store" => store.kind(), "op" => op.as_str()).record(self.elapsed());
        #[cfg(not(feature = "metrics"))]
        let _ = (store, op);
    }
}

/// One lease held, counted in [`LEASES_HELD`] until dropped; nothing without the feature.
pub(crate) struct Held {
    #[cfg(feature = "metrics")]
    store: &'static str,
}

impl Held {
    #[inline(always)]
    pub(crate) fn new(store: &dyn Store) -> Held {
        #[cfg(feature = "metrics")]
        {
            let store = store.kind();
            metrics::gauge!(LEASES_HELD, "store" => store).increment(1.0);
            Held { store }
        }
        #[cfg(not(feature = "metrics"))]
        {
            let _ = store;
            Held {}
        }
    }
}

#[cfg(feature = "metrics")]
impl Drop for Held {
    fn drop(&mut self) {
        metrics::gauge!(LEASES_HELD, "store" => self.store).decrement(1.0);
    }
}
