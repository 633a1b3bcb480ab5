//! Versioned shared state: optimistic concurrency for parallel workers, without lost or doubled
//! updates.
//!
//! Parallel sub-agents and workers that update one shared value (a cart, the findings of a run)
//! each read it with its version, compute a new value, and commit it only if the version is
//! still the one they read. A stale commit is refused with the current version and value
//! ([`Commit::Conflict`]); [`State::update`] then loads again and re-applies its reducer, with
//! full-jitter backoff between conflicts ([`Backoff`]), bounded by attempts and time
//! ([`UpdatePolicy`]), and ends in [`Error::Contention`] saying how many attempts it made.
//!
//! ```
//! use idempotent_core::state::{MemoryStateStore, Scope, State};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), idempotent_core::Error> {
//! let store = MemoryStateStore::new();
//! let cart: State<Vec<String>> = State::new(store, Scope::new("cart-42").tenant("acme"));
//!
//! let loaded = cart.load().await?;
//! assert!(loaded.value.is_none() && loaded.version.is_absent());
//!
//! // Load, apply, commit; again on a conflict.
//! let updated = cart.modify(|items| items.push("tea".into())).await?;
//! assert_eq!(updated.value, ["tea"]);
//!
//! // A commit on a version that is no longer current is refused.
//! let stale = loaded.version;
//! assert!(cart.commit(stale, &vec!["coffee".into()]).await?.is_conflict());
//! assert_eq!(cart.load().await?.value.unwrap(), ["tea"]);
//! # Ok(()) }
//! ```
//!
//! # Retries without doubled updates
//!
//! A naive loop applies a delta twice when the reply to a successful commit is lost: the retry
//! finds the version moved (by its own write), reloads and applies again. Here every commit
//! carries a [`CommitToken`], and the store keeps the tokens of the last [`COMMIT_HISTORY`]
//! commits of each scope ([`REDIS_COMMIT_HISTORY`] on Redis) with the version each produced. A commit whose token is among them was
//! already applied: it answers [`Commit::Committed`] with that version and `replayed: true`,
//! changes nothing, and never reports a conflict with itself.
//!
//! By default the token is derived from the calling step's operation key (the [`Attempt`] of
//! [`current_attempt`](crate::current_attempt)) and the scope, and numbered by the order of the
//! action's state updates: the n-th update of an action gets the same token on every attempt at
//! the step, so a step retried after a lost reply (or a crash after the commit) replays its
//! update instead of applying it again. A handler behind `idempotent-tower`'s `IdempotencyLayer`
//! runs with its request's attempt in scope, so its updates are tied to the request's key the
//! same way: a request retried after its response was lost replays them.
//!
//! Outside both, each [`State::update`] draws a random token, which covers the retries inside
//! that one call only. When such an update gives up after a commit whose answer was lost, the
//! commit may have landed, and it says so: [`Error::CommitUnanswered`]
//! ([`action_may_have_run`](Error::action_may_have_run) is true, and it is not
//! [transient](Error::is_transient), since calling `update` again would draw a new token). It
//! carries the token ([`Error::commit_token`]): retry under it with [`State::update_with_token`],
//! which applies the update at most once. A caller that retries logical updates of its own
//! gives each one a token from the start, derived from the update's id with
//! [`CommitToken::derive`] ([`State::update_with_token`], [`State::commit_with_token`]).
//!
//! ```
//! use idempotent_core::state::{CommitToken, MemoryStateStore, Scope, State};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), idempotent_core::Error> {
//! let counter: State<u64> = State::new(MemoryStateStore::new(), Scope::new("visits"));
//! let token = CommitToken::derive("visit-7f3a"); // the logical update's own id
//! for _retry in 0..3 {
//!     // However often this runs (retried after a lost reply, after a crash), it counts once.
//!     counter.update_with_token(&token, |n| Ok::<_, std::convert::Infallible>(n.unwrap_or(0) + 1)).await?;
//! }
//! assert_eq!(counter.load().await?.value, Some(1));
//! # Ok(()) }
//! ```
//!
//! **The bound.** A retry is recognised as long as fewer than [`StateStore::commit_history`] other
//! commits (128; 1024 on Redis) landed on the scope between the lost reply and the retry. [`State::update`] sends a
//! commit that failed on the way again as it was, after the shortest backoff delay, and checks
//! the bound itself: if the answer is a conflict with a state that moved on by the whole history
//! or more since, it stops with [`Error::StateUncertain`] instead of risking a second
//! application.
//!
//! # Stores
//!
//! [`StateStore`] is the raw protocol (bytes, versions, tokens). [`MemoryStateStore`] keeps
//! states in the process; the record stores implement it too, each on its own connections:
//! `RedisStore` (one hash per scope, one Lua script per commit, so cluster safe), `SqliteStore`
//! and `PostgresStore` (a table of their own next to the records', `UPDATE … WHERE version =
//! $n` and insert-if-absent). Values are the canonical JSON ([`crate::canonical`]) of the
//! handle's type; [`RawState`] is the same handle over bytes.
//!
//! # With steps
//!
//! A step whose action is a state update commits under the step's token, so a retried step never
//! applies its update twice; a step's result merged into a thread's state is that same pattern,
//! with the merge as the reducer:
//!
//! ```
//! use idempotent_core::state::{MemoryStateStore, Scope, State};
//! use idempotent_core::{Error, MemoryStore, RunContext};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Error> {
//! let findings: State<Vec<String>> = State::new(MemoryStateStore::new(), Scope::new("thread-9"));
//! let ctx = RunContext::new(MemoryStore::new(), "thread-9");
//! for _retry in 0..2 {
//!     ctx.step("search").run(&"rust occ", |_| async {
//!         let found = "crate: idempotent".to_string(); // the step's work
//!         findings.modify(|all| all.push(found.clone())).await?; // merged into the thread's state
//!         Ok::<_, Error>(())
//!     }).await?;
//! }
//! assert_eq!(findings.load().await?.value.unwrap(), ["crate: idempotent"]);
//! # Ok(()) }
//! ```
//!
//! The action may run again (a retry after its step's result was lost, a recovered attempt), and
//! its update then replays; keep reducers pure, as they may run more than once per update.

mod memory;
mod protocol;
mod raw;
#[cfg(feature = "redis")]
mod redis;
mod scope;
pub(crate) mod token;
mod typed;

pub use memory::MemoryStateStore;
pub(crate) use protocol::history;
pub use protocol::{Commit, IntoSharedStateStore, Loaded, SharedStateStore, StateStore, Version};
pub use raw::{RawState, UpdatePolicy, Updated};
pub use scope::Scope;
pub use token::{COMMIT_HISTORY, CommitToken, REDIS_COMMIT_HISTORY};
pub use typed::State;

#[cfg(doc)]
use crate::attempt::Attempt;
#[cfg(doc)]
use crate::backoff::Backoff;
#[cfg(doc)]
use crate::error::Error;
