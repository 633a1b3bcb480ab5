//! Exactly-once side effects under retries.
//!
//! A pipeline step that charges a card, sends an email or writes a row must not do it twice when
//! the pipeline is retried. `idempotent-core` gives every call of such a step a deterministic key
//! (sha256 over the run id, the step name and the canonical JSON of its arguments), takes a lease
//! on that key in a store before running the action, and stores the action's result: a retry
//! replays the result instead of running the action again, and a concurrent duplicate waits for
//! the first call (or is told it is in flight) instead of running alongside it.
//!
//! ```
//! use idempotent_core::{MemoryStore, RunContext};
//! use std::sync::atomic::{AtomicU32, Ordering};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), idempotent_core::Error> {
//! let charges = &AtomicU32::new(0);
//! let ctx = RunContext::new(MemoryStore::new(), "order-7");
//!
//! for _retry in 0..3 {
//!     let refund_id: String = ctx
//!         .step("issue_refund")
//!         .run(&("order-7", 1500), |attempt| async move {
//!             charges.fetch_add(1, Ordering::SeqCst); // the side effect
//!             Ok::<_, idempotent_core::Error>(format!("re_{}", attempt.number()))
//!         })
//!         .await?;
//!     assert_eq!(refund_id, "re_1");
//! }
//! assert_eq!(charges.load(Ordering::SeqCst), 1);
//! # Ok(()) }
//! ```
//!
//! # Pieces
//!
//! - [`RunContext`] and [`Step`]: the executor. Options: [`Step::identity`] keys the operation on
//!   part of the payload while fingerprinting all of it (a changed amount under the same identity
//!   is [`Error::Mismatch`]); [`OnInFlight`] says whether a duplicate waits or fails at once;
//!   leases are renewed while the action runs and [`Attempt::lease_lost`] tells the action when
//!   another attempt took over; [`Step::run_storing_errors`] also replays permanent errors.
//! - [`Attempt`]: what the action knows about its attempt (fence, number, recovered, lease lost,
//!   and the [`downstream_key`](Attempt::downstream_key) to send a provider that deduplicates);
//!   `idempotent-tower` hands HTTP and gRPC handlers the same type.
//! - [`verify`]: what a step does when the previous attempt's outcome is uncertain (it died after
//!   the side effect, before the outcome was stored): [`Step::verify`] asks the downstream system
//!   ([`Verdict`]), [`OnRecovered::NeedsAttention`] stops for a person; a record that needs
//!   attention answers [`Error::NeedsAttention`] until [`Step::resolve_done`] or
//!   [`Step::resolve_not_done`] settles it.
//! - [`store::connect`]: a store from a URL (`redis://`, `postgres://`, `sqlite://`, `memory:`).
//! - [`lease`]: the lease lifecycle both the executor and `idempotent-tower`'s layer drive
//!   (acquire and wait, heartbeat, complete or release outliving the caller), and the bounds on
//!   lease and retention ([`Terms`]).
//! - [`Key`], [`Fingerprint`], [`canonical`]: deterministic keys over RFC 8785 canonical JSON.
//! - [`Store`]: the record protocol ([`record`]), with [`MemoryStore`] and, under the `redis`
//!   feature, [`RedisStore`] (standalone, cluster or through Sentinel; a replay and a first
//!   acquisition are one plain `SET NX GET`, and so is a first execution's completion where the
//!   server has `SET … IFEQ` (Valkey 8.1+, Redis 8.4+); the other transitions Lua scripts judged
//!   by the server clock; fail-closed timeouts; [`RedisStore::preflight`] with [`Preflight::ensure`]
//!   refuses at start-up a server that may lose records), under the `sqlite` feature,
//!   `SqliteStore` (one file in WAL mode, shared by tasks and processes on one host), and under
//!   the `postgres` feature, `PostgresStore` (one table, judged by the database clock; fail-closed
//!   timeouts; on its own pool or the application's). A replay is one statement on both, a read
//!   that takes no lock; a first execution is two on PostgreSQL and three on SQLite (acquire reads
//!   first, then upserts: in an embedded database a statement is a call, not a round trip).
//! - Steps that commit with their record (features `sqlite`, `postgres`): `Step::run_in_transaction`
//!   runs the action in a transaction of the SQL store's database and marks the record done in
//!   that same transaction, so the action's writes through it happen exactly once; the store
//!   implements `TransactionalStore`, and its database `CommitsWith` it. `sqlx` is re-exported.
//! - [`state`]: versioned shared state for parallel workers ([`State`]: load, commit on a version,
//!   update through a reducer), whose commits carry a [`CommitToken`] so that a retried commit is
//!   never applied twice; on [`MemoryStateStore`] and the Redis, SQLite and PostgreSQL stores.
//! - `#[idempotent]` (feature `macros`, on by default): the same as an attribute on an `async fn`
//!   (`transaction = tx` for a transactional step).
//! - [`reconcile`]: a [`Reconciler`] finds records stuck without an outcome and settles them with
//!   the steps' verifiers, ahead of the next retry.
//! - [`store::admin`]: what an operator (the `idempotent` command, the reconciler) reads of
//!   records, lists and deletes ([`store::RecordInfo`]).
//! - [`metrics`] (feature `metrics`): counters, histograms and a gauge through the `metrics`
//!   facade, by step, store and outcome.
//!
//! # Guarantees and limits
//!
//! While a record is retained (the step's `retention`), an action runs at most once per key unless its
//! lease runs out while it is still running; then a later attempt may take over, with a higher
//! [`Attempt::fence`], and the earlier attempt cannot store its result ([`Error::LeaseLost`]).
//! Give actions a lease longer than they run (the heartbeat renews it), and pass the fence to
//! downstream systems that can reject stale writers. When the store is unreachable the action is
//! not run ([`FailMode::Closed`]) unless the step opts into [`FailMode::Open`].
//!
//! One case is indeterminate by nature, and reported as such: when the store fails while the
//! outcome is being stored ([`Error::action_may_have_run`] is true), the record is marked
//! uncertain (or, if even that fails, the key stays taken until the lease runs out) and the next
//! attempt is [`recovered`](Attempt::recovered): it runs the action again, unless the step has a
//! verifier ([`Step::verify`]) or stops for a person ([`OnRecovered::NeedsAttention`]). An acquire that fails after it may
//! have reached the store (a timeout, a dropped connection) runs nothing; [`RedisStore`] then
//! releases the key that acquire may have taken, in the background, so that retries do not wait
//! out the lease (if the store stays unreachable, the lease runs out on its own).
//!
//! Events are logged with `tracing` under the names `idempotent.acquired`, `.replayed`,
//! `.in_flight`, `.mismatch`, `.lease_lost`, `.store_error`, `.recovered`, `.verified`,
//! `.verify_failed`, `.needs_attention`, with the step name and a 12-hex-digit
//! prefix of the key; payloads are never logged.

#![deny(unreachable_pub)]
#![warn(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod attempt;
mod backoff;
pub mod canonical;
mod error;
mod executor;
mod key;
pub mod lease;
pub mod metrics;
pub mod reconcile;
pub mod record;
pub mod state;
pub mod store;
pub mod verify;

pub use attempt::{Attempt, current_attempt};
pub use backoff::Backoff;
pub use error::{BoxError, Error};
pub use executor::{DEFAULT_MAX_RESULT_BYTES, Provenance, RunContext, Step, StepOptions, Verified};
pub use key::{DownstreamKey, Fingerprint, Key, KeyScope, ShortKey};
pub use lease::{
    DEFAULT_LEASE, DEFAULT_RETENTION, DEFAULT_WAIT, FailMode, IN_FLIGHT_HINT, MAX_LEASE, MAX_RETENTION, MIN_LEASE,
    MIN_RETENTION, OnInFlight, Terms,
};
pub use reconcile::Reconciler;
pub use state::{
    COMMIT_HISTORY, Commit, CommitToken, Loaded, MemoryStateStore, REDIS_COMMIT_HISTORY, RawState, Scope, State,
    StateStore, UpdatePolicy, Updated, Version,
};
#[cfg(any(feature = "sqlite", feature = "postgres"))]
pub use store::{CommitsWith, TransactionalStore};
pub use store::{IntoSharedStore, MemoryStore, SharedStore, Store};
#[cfg(feature = "postgres")]
pub use store::{PostgresStore, PostgresStoreBuilder};
#[cfg(feature = "redis")]
pub use store::{Preflight, RedisStore, RedisStoreBuilder, Risk};
#[cfg(feature = "sqlite")]
pub use store::{SqliteStore, SqliteStoreBuilder};
pub use verify::{OnRecovered, Verdict};

/// The Redis driver this crate uses, re-exported so that users share one version.
#[cfg(feature = "redis")]
pub use deadpool_redis;
/// The Redis client, re-exported from deadpool-redis.
#[cfg(feature = "redis")]
pub use deadpool_redis::redis;

/// The SQL driver the SQL stores use, re-exported so that users share one version: the
/// transactions of [`Step::run_in_transaction`] are its `sqlx::Transaction`s.
#[cfg(any(feature = "sqlite", feature = "postgres"))]
pub use sqlx;

#[cfg(feature = "macros")]
pub use idempotent_macros::idempotent;

/// The README's example is compiled and run as a doc test.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctest;

/// Items the `#[idempotent]` macro expands to. Not public API: may change in any release.
#[doc(hidden)]
pub mod __private {
    pub use crate::executor::RunContext;
    pub use crate::lease::{DEFAULT_WAIT, OnInFlight};
    pub use crate::verify::OnRecovered;
    pub use serde;
    pub use std::time::Duration;

    use crate::canonical::{CanonicalError, to_canonical_vec, write_canonical};
    use crate::key::Fingerprint;

    /// One argument in canonical JSON, or why it has none.
    pub type CanonicalArg = Result<Vec<u8>, CanonicalError>;

    /// Serializes one argument of an annotated function to canonical JSON.
    pub fn canonical<T: serde::Serialize + ?Sized>(value: &T) -> CanonicalArg {
        to_canonical_vec(value)
    }

    /// The payload of one call of an annotated function: its arguments by name, each already in
    /// canonical JSON.
    ///
    /// The payload owns bytes instead of borrowing the arguments, so the body can take the
    /// arguments by value while the executor still holds the payload.
    #[derive(Debug, Default)]
    pub struct Payload {
        fields: Vec<(&'static str, CanonicalArg)>,
    }

    impl Payload {
        /// An empty payload.
        pub fn new() -> Self {
            Payload::default()
        }

        /// Adds the argument `name`.
        pub fn push(&mut self, name: &'static str, value: CanonicalArg) {
            self.fields.push((name, value));
        }

        /// The digest of the whole payload, and of the `key` arguments when `key` is not empty.
        pub fn finish(self, key: &[&str]) -> (PayloadDigest, Option<PayloadDigest>) {
            let identity =
                (!key.is_empty()).then(|| PayloadDigest::of(self.fields.iter().filter(|(n, _)| key.contains(n))));
            (PayloadDigest::of(self.fields.iter()), identity)
        }
    }

    /// The sha256 of a payload's canonical JSON object (members sorted as RFC 8785 sorts them),
    /// standing in for the payload in `Step::run` and `Step::identity`. It serializes as its hex
    /// digest, or fails to serialize with the reason the payload has no canonical form, so the
    /// executor reports that as `Error::Payload` without running the action.
    #[derive(Debug)]
    pub struct PayloadDigest(Result<Fingerprint, String>);

    impl PayloadDigest {
        fn of<'a>(fields: impl Iterator<Item = &'a (&'static str, CanonicalArg)>) -> Self {
            let mut fields: Vec<_> = fields.collect();
            fields.sort_by(|a, b| a.0.encode_utf16().cmp(b.0.encode_utf16()));
            let mut out = vec![b'{'];
            for (i, (name, value)) in fields.into_iter().enumerate() {
                let value = match value {
                    Ok(value) => value,
                    Err(e) => return PayloadDigest(Err(format!("parameter `{name}`: {e}"))),
                };
                if i > 0 {
                    out.push(b',');
                }
                if let Err(e) = write_canonical(&mut out, name) {
                    return PayloadDigest(Err(format!("parameter `{name}`: {e}")));
                }
                out.push(b':');
                out.extend_from_slice(value);
            }
            out.push(b'}');
            PayloadDigest(Ok(Fingerprint::of_canonical(&out)))
        }
    }

    impl serde::Serialize for PayloadDigest {
        fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
            match &self.0 {
                Ok(fingerprint) => serializer.serialize_str(&fingerprint.to_hex()),
                Err(reason) => Err(serde::ser::Error::custom(reason)),
            }
        }
    }
}
