//! What a step does when the previous attempt's outcome is uncertain.
//!
//! An attempt is [`recovered`](crate::Attempt::recovered) when the one before it ended without an
//! outcome the store could keep: its worker died, its lease ran out, or storing its outcome
//! failed. Its side effect may or may not have happened. A step decides what then:
//!
//! - with a verifier ([`Step::verify`](crate::Step::verify)), it asks the downstream system
//!   (by the attempt's [`downstream_key`](crate::Attempt::downstream_key)) and acts on the
//!   [`Verdict`]: store what was found, run the action, or stop and wait for a person;
//! - without one, it runs the action again ([`OnRecovered::Run`], the default: right for
//!   effects that are safe to repeat, or deduplicated downstream by the downstream key), or
//!   stops and waits for a person ([`OnRecovered::NeedsAttention`]: for effects that must never
//!   be repeated blindly).
//!
//! A record that waits for a person answers every call with
//! [`Error::NeedsAttention`](crate::Error::NeedsAttention), and runs nothing, until it is
//! resolved ([`Step::resolve_done`](crate::Step::resolve_done),
//! [`Step::resolve_not_done`](crate::Step::resolve_not_done), or
//! [`Store::resolve`](crate::Store::resolve)).
//!
//! ```
//! use idempotent_core::{MemoryStore, RunContext, Verdict};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), idempotent_core::Error> {
//! let ctx = RunContext::new(MemoryStore::new(), "order-7");
//! let charge: String = ctx
//!     .step("charge")
//!     // Called instead of the action when the previous attempt's outcome is uncertain: ask the
//!     // provider for a charge under this operation's downstream key.
//!     .verify(|attempt| async move {
//!         let _ask_for = attempt.downstream_key();
//!         Ok::<_, idempotent_core::Error>(Verdict::NotDone)
//!     })
//!     .run(&("order-7", 1500), |attempt| async move {
//!         // Send `attempt.downstream_key()` as the provider's Idempotency-Key.
//!         Ok::<_, idempotent_core::Error>(format!("ch_{}", &attempt.downstream_key().as_str()[..8]))
//!     })
//!     .await?;
//! assert!(charge.starts_with("ch_"));
//! # Ok(()) }
//! ```

use std::time::Duration;

/// A verifier's answer: did the previous, uncertain attempt's side effect happen?
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict<T> {
    /// It happened, and this is its result: stored as the operation's outcome (and replayed from
    /// then on) without running the action.
    Done(T),
    /// It did not happen: the action runs, as on a first attempt.
    NotDone,
    /// The verifier cannot tell: the record waits for a person
    /// ([`Error::NeedsAttention`](crate::Error::NeedsAttention)), and nothing runs.
    Unknown,
}

/// What a step without a verifier does with a [`recovered`](crate::Attempt::recovered) attempt.
///
/// A step that fails open ([`FailMode::Open`](crate::FailMode::Open)) runs its action
/// unprotected when the store is unreachable, and so cannot see a record that waits for a
/// person either: do not combine `Open` with a step that must never re-run blindly.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum OnRecovered {
    /// Run the action again (the default). Right when the effect is safe to repeat, or when the
    /// downstream system deduplicates by the attempt's
    /// [`downstream_key`](crate::Attempt::downstream_key).
    #[default]
    Run,
    /// Run nothing, and leave the record waiting for a person: for effects that are never safe
    /// to repeat blindly.
    NeedsAttention,
}

/// Default bound on a verifier's answer: 30 seconds.
pub const DEFAULT_VERIFY_TIMEOUT: Duration = Duration::from_secs(30);
