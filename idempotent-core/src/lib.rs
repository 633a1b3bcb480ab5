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
//! - [`Key`], [`Fingerprint`], [`canonical`]: deterministic keys over RFC 8785 canonical JSON.
//! - [`Store`]: the record protocol ([`record`]), with [`MemoryStore`] and, under the `redis`
//!   feature, [`RedisStore`] (standalone or cluster, deadpool pooled, Lua scripts judged by the
//!   server clock, fail-closed timeouts, a [`RedisStore::preflight`] check).
//! - `#[idempotent]` (feature `macros`, on by default): the same as an attribute on an `async fn`.
//!
//! # Guarantees and limits
//!
//! While a record is retained (the step's `ttl`), an action runs at most once per key unless its
//! lease runs out while it is still running; then a later attempt may take over, with a higher
//! [`Attempt::fence`], and the earlier attempt cannot store its result ([`Error::LeaseLost`]).
//! Give actions a lease longer than they run (the heartbeat renews it), and pass the fence to
//! downstream systems that can reject stale writers. When the store is unreachable the action is
//! not run ([`FailMode::Closed`]) unless the step opts into [`FailMode::Open`].
//!
//! Events are logged with `tracing` under the names `idempotent.acquired`, `.replayed`,
//! `.in_flight`, `.mismatch`, `.lease_lost`, `.store_error`, with the step name and a 12-hex-digit
//! prefix of the key; payloads are never logged.

#![deny(unreachable_pub)]
#![warn(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod canonical;
mod error;
mod executor;
mod key;
pub mod record;
pub mod store;

pub use error::{BoxError, Error};
pub use executor::{
    Attempt, DEFAULT_LEASE, DEFAULT_TTL, DEFAULT_WAIT, FailMode, OnInFlight, RunContext, Step, StepOptions,
    current_attempt,
};
pub use key::{Fingerprint, Key, KeyScope};
pub use store::{IntoSharedStore, MemoryStore, SharedStore, Store};
#[cfg(feature = "redis")]
pub use store::{Preflight, RedisStore, RedisStoreBuilder};

/// The Redis driver this crate uses, re-exported so that users share one version.
#[cfg(feature = "redis")]
pub use deadpool_redis;
/// The Redis client, re-exported from deadpool-redis.
#[cfg(feature = "redis")]
pub use deadpool_redis::redis;

#[cfg(feature = "macros")]
pub use idempotent_macros::idempotent;

/// Items the `#[idempotent]` macro expands to. Not public API: may change in any release.
#[doc(hidden)]
pub mod __private {
    pub use crate::error::Error;
    pub use crate::executor::{Attempt, FailMode, OnInFlight, RunContext, Step};
    pub use serde;
    pub use std::time::Duration;
}
