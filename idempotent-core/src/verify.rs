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
//!
//! This module is also where that decision is made, once, for the executor and the
//! [reconciler](crate::reconcile) (`idempotent-tower`'s layer has no verifier: it asks
//! [`OnRecovered::stops`]).

use std::future::Future;
use std::pin::pin;
use std::time::Duration;

use crate::attempt::{Attempt, CURRENT_ATTEMPT};
use crate::lease::Lease;
use crate::record::Abandon;

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

impl OnRecovered {
    /// Whether a call without a verifier stops at `attempt`, leaving the record for a person:
    /// when the attempt is [recovered](Attempt::recovered) and the policy is
    /// [`NeedsAttention`](Self::NeedsAttention).
    pub fn stops(self, attempt: &Attempt) -> bool {
        attempt.recovered() && self == OnRecovered::NeedsAttention
    }
}

/// Default bound on a verifier's answer: 30 seconds.
pub const DEFAULT_VERIFY_TIMEOUT: Duration = Duration::from_secs(30);

/// What a recovered attempt does, as its verifier or its [`OnRecovered`] decided.
pub(crate) enum Decision<T, E> {
    /// Run the action: the attempt is fresh, or the policy re-runs blindly, or the verifier
    /// found that the effect did not happen.
    Run,
    /// The verifier found the effect: store this as the outcome, without running the action.
    Found(T),
    /// Run nothing, and mark the record with the [`Abandon`]: see [`Stopped`] for why.
    Stop(Abandon, Stopped<E>),
}

/// Why a recovered attempt runs nothing.
pub(crate) enum Stopped<E> {
    /// The record waits for a person ([`Abandon::NeedsAttention`]): the policy says so, or the
    /// verifier cannot tell.
    NeedsAttention,
    /// The lease was lost while the verifier ran: another attempt may have taken the key and run
    /// the action.
    LeaseLost,
    /// The verifier failed: the record is left for the next call to verify.
    Failed(E),
    /// The verifier did not answer within this bound: likewise.
    TimedOut(Duration),
}

/// Decides what the attempt under `lease` does: a fresh attempt runs; a recovered one asks
/// `verifier` (under the lease, renewed as an action's is, with the attempt as
/// [`current_attempt`](crate::current_attempt), within `timeout`), or without one follows
/// `on_recovered`. Logs the decision for `step` (`idempotent.verified`,
/// `idempotent.needs_attention`, `idempotent.verify_failed`, `idempotent.lease_lost`).
pub(crate) async fn decide<T, E, V, VFut>(
    lease: &mut Lease,
    step: &str,
    verifier: Option<V>,
    on_recovered: OnRecovered,
    timeout: Duration,
) -> Decision<T, E>
where
    V: FnOnce(Attempt) -> VFut,
    VFut: Future<Output = Result<Verdict<T>, E>>,
{
    if !lease.attempt().recovered() {
        return Decision::Run;
    }
    let attempt = lease.attempt().clone();
    let short = lease.key().short();
    let fence = attempt.fence();
    let Some(verify) = verifier else {
        if on_recovered.stops(&attempt) {
            tracing::warn!(step, key = %short, fence, "idempotent.needs_attention: the previous attempt's outcome is uncertain and the step does not re-run it blindly");
            return Decision::Stop(Abandon::NeedsAttention, Stopped::NeedsAttention);
        }
        return Decision::Run;
    };
    let verdict = {
        let check = pin!(tokio::time::timeout(timeout, CURRENT_ATTEMPT.scope(attempt.clone(), verify(attempt))));
        lease.run(check).await
    };
    match verdict {
        Ok(Ok(Verdict::Done(value))) => {
            tracing::info!(step, key = %short, fence, "idempotent.verified: the previous attempt's effect happened; storing what the verifier found");
            Decision::Found(value)
        }
        // The lease was lost while the verifier ran: another attempt may have taken the key
        // and run the action. Run nothing.
        Ok(Ok(Verdict::NotDone)) if lease.is_lost() => {
            tracing::warn!(step, key = %short, fence, "idempotent.lease_lost: the lease was lost while the verifier ran; the action was not run");
            Decision::Stop(Abandon::Uncertain, Stopped::LeaseLost)
        }
        Ok(Ok(Verdict::NotDone)) => {
            tracing::info!(step, key = %short, fence, "idempotent.verified: the previous attempt's effect did not happen; running the action");
            Decision::Run
        }
        Ok(Ok(Verdict::Unknown)) => {
            tracing::warn!(step, key = %short, fence, "idempotent.needs_attention: the verifier cannot tell whether the previous attempt's effect happened");
            Decision::Stop(Abandon::NeedsAttention, Stopped::NeedsAttention)
        }
        Ok(Err(e)) => {
            tracing::warn!(step, key = %short, "idempotent.verify_failed: the verifier failed; the record is left for the next call to verify");
            Decision::Stop(Abandon::Uncertain, Stopped::Failed(e))
        }
        Err(_) => {
            tracing::warn!(step, key = %short, ?timeout, "idempotent.verify_failed: the verifier timed out; the record is left for the next call to verify");
            Decision::Stop(Abandon::Uncertain, Stopped::TimedOut(timeout))
        }
    }
}
