//! [`Attempt`]: what the code that performs the side effect knows about its attempt.
//!
//! One type for every caller: a step's action gets it as its argument, an HTTP or gRPC handler
//! behind `idempotent-tower`'s layer finds it in the request's extensions, and a store hands
//! one out with every acquisition ([`record::Grant`](crate::record::Grant)).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

use tokio::sync::Notify;

use crate::key::{DownstreamKey, Key};

/// What the action (or handler) knows about its attempt: the fence, the attempt number,
/// whether it recovers from an attempt that ran out, and whether its lease is still held.
///
/// Pass [`fence`](Self::fence) to downstream systems that can reject a stale writer (a database
/// row's version, a payment provider's own idempotency key suffix). Cheap to clone: clones share
/// the lease-lost signal.
#[derive(Clone)]
pub struct Attempt {
    key: Key,
    fence: u64,
    number: u32,
    recovered: bool,
    lease: LeaseState,
    /// How many state commit tokens this attempt derived so far (shared by its clones), so that
    /// the n-th state update of an action gets the same token on every attempt at it (see
    /// [`CommitToken`](crate::state::CommitToken)).
    state_commits: Arc<AtomicU32>,
}

#[derive(Clone)]
enum LeaseState {
    /// As a store hands it out: nothing watches the lease yet.
    Unwatched,
    /// Watched by a heartbeat, which raises the signal when the lease is lost.
    Watched(Arc<LeaseSignal>),
    /// No lease at all: the store was unreachable and the call fails open.
    Unprotected,
}

impl Attempt {
    /// The attempt a store grants on the operation `key`: `fence` (grows with every acquisition
    /// of the key), `number` (1 for the first acquisition, then one more for each) and
    /// `recovered` (a previous attempt's lease ran out without an outcome, or it said its
    /// outcome is uncertain).
    pub fn new(key: Key, fence: u64, number: u32, recovered: bool) -> Attempt {
        Attempt { key, fence, number, recovered, lease: LeaseState::Unwatched, state_commits: Arc::default() }
    }

    /// The attempt of a call on `key` that runs without protection: the store was unreachable
    /// and the call fails open. Its fence is 0, lower than any a store hands out.
    pub fn unprotected(key: Key) -> Attempt {
        Attempt {
            key,
            fence: 0,
            number: 1,
            recovered: false,
            lease: LeaseState::Unprotected,
            state_commits: Arc::default(),
        }
    }

    /// The same attempt, watched: [`lease_lost`](Self::lease_lost) and [`lost`](Self::lost)
    /// follow `signal`.
    pub(crate) fn watched(mut self, signal: Arc<LeaseSignal>) -> Attempt {
        self.lease = LeaseState::Watched(signal);
        self
    }

    /// A key for the downstream system's own deduplication (a payment provider's
    /// `Idempotency-Key` header): the same on every attempt at this operation, in every process
    /// and with every store handle, and different for every other operation (another tenant, run,
    /// step, version or payload).
    ///
    /// It is derived from the operation's key by a hash of its own, so it reveals nothing of the
    /// payload and cannot be used to find the record. 64 characters (`[0-9a-f]`), within every
    /// provider's limit (Stripe allows 255). Send it with every request of the side effect: a
    /// provider that deduplicates by it turns a retry after a crash into a replay of the first
    /// request's answer.
    pub fn downstream_key(&self) -> DownstreamKey {
        DownstreamKey::of(&self.key)
    }

    /// The number of the next state commit token this attempt derives: 0, 1, 2… in the order the
    /// action's state updates ask for one, the same on every attempt at the operation.
    pub(crate) fn next_state_commit(&self) -> u32 {
        self.state_commits.fetch_add(1, Ordering::Relaxed)
    }

    /// The operation's key (the store's): to resolve or inspect its record.
    pub fn key(&self) -> &Key {
        &self.key
    }

    /// The fencing token: higher for every later attempt at the same operation.
    pub fn fence(&self) -> u64 {
        self.fence
    }

    /// 1 for the first attempt at this operation, then one more for each.
    pub fn number(&self) -> u32 {
        self.number
    }

    /// Whether a previous attempt's lease ran out without an outcome (it crashed or was cancelled,
    /// and its side effect may or may not have happened).
    pub fn recovered(&self) -> bool {
        self.recovered
    }

    /// Whether the action runs without protection because the store was unreachable and the
    /// call fails open.
    pub fn is_unprotected(&self) -> bool {
        matches!(self.lease, LeaseState::Unprotected)
    }

    /// Whether the lease was lost: another attempt took over, or may have (no renewal reached the
    /// store for a whole lease). Long actions should check it before each side effect.
    ///
    /// The outcome is still offered to the store, which takes it only if no other attempt took
    /// the key. An action that stops early because its lease was lost should therefore return an
    /// error (from [`Step::run`](crate::Step::run), an `Err` releases the key; behind the HTTP
    /// layer, answer 503), so that its "stopped" answer is not stored as the operation's outcome.
    pub fn lease_lost(&self) -> bool {
        match &self.lease {
            LeaseState::Watched(signal) => signal.is_lost(),
            LeaseState::Unwatched | LeaseState::Unprotected => false,
        }
    }

    /// Runs `future` with this attempt as the [`current_attempt`] of everything it does: the
    /// state commits it makes derive their tokens from this attempt's key (see
    /// [`CommitToken::for_update`](crate::state::CommitToken::for_update)), and code deep inside
    /// it can read the fence.
    ///
    /// The executor does this for a step's action, and `idempotent-tower`'s layer for a covered
    /// request's handler. Call it for work of your own that runs under an attempt handed to it
    /// (a task you spawn from an action does not inherit the attempt: scope it again there).
    ///
    /// ```
    /// use idempotent_core::{Attempt, Key, current_attempt};
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let attempt = Attempt::new(Key::from_bytes([7; 32]), 3, 1, false);
    /// let fence = attempt.clone().scope(async { current_attempt().map(|a| a.fence()) }).await;
    /// assert_eq!(fence, Some(3));
    /// assert!(current_attempt().is_none());
    /// # }
    /// ```
    pub fn scope<F: std::future::Future>(self, future: F) -> tokio::task::futures::TaskLocalFuture<Attempt, F> {
        CURRENT_ATTEMPT.scope(self, future)
    }

    /// Completes when the lease is lost (never, if it is not). Race it against the work with
    /// `tokio::select!` to stop early (and return an error then: see
    /// [`lease_lost`](Self::lease_lost)).
    pub async fn lost(&self) {
        let LeaseState::Watched(signal) = &self.lease else {
            return std::future::pending().await;
        };
        loop {
            let notified = signal.notify.notified();
            if signal.is_lost() {
                return;
            }
            notified.await;
        }
    }
}

/// Attempts are equal when their key, fence, number, recovered flag and protection are; whether
/// a lease is watched does not count.
impl PartialEq for Attempt {
    fn eq(&self, other: &Self) -> bool {
        (self.key, self.fence, self.number, self.recovered, self.is_unprotected())
            == (other.key, other.fence, other.number, other.recovered, other.is_unprotected())
    }
}

impl Eq for Attempt {}

impl std::fmt::Debug for Attempt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Attempt")
            .field("fence", &self.fence)
            .field("number", &self.number)
            .field("recovered", &self.recovered)
            .field("unprotected", &self.is_unprotected())
            .field("lease_lost", &self.lease_lost())
            .finish()
    }
}

/// Raised once when a lease is lost; shared by the heartbeat and every clone of the attempt.
#[derive(Default)]
pub(crate) struct LeaseSignal {
    lost: AtomicBool,
    notify: Notify,
}

impl LeaseSignal {
    pub(crate) fn is_lost(&self) -> bool {
        self.lost.load(Ordering::Acquire)
    }

    pub(crate) fn mark_lost(&self) {
        self.lost.store(true, Ordering::Release);
        self.notify.notify_waiters();
    }
}

tokio::task_local! {
    pub(crate) static CURRENT_ATTEMPT: Attempt;
}

/// The [`Attempt`] of the step action being run by the current task, if any.
///
/// The executor makes the attempt available for the whole action, so code deep inside it (or a
/// function annotated with `#[idempotent]`, whose body has no `Attempt` parameter) can read the
/// fence or check whether the lease was lost.
///
/// ```
/// use idempotent_core::{MemoryStore, RunContext, current_attempt};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), idempotent_core::Error> {
/// assert!(current_attempt().is_none());
/// let ctx = RunContext::new(MemoryStore::new(), "run");
/// let fence: u64 = ctx.step("s").run(&(), |_| async {
///     Ok::<_, idempotent_core::Error>(current_attempt().expect("inside a step").fence())
/// }).await?;
/// assert!(fence > 0);
/// # Ok(()) }
/// ```
pub fn current_attempt() -> Option<Attempt> {
    CURRENT_ATTEMPT.try_with(Attempt::clone).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_watched_attempt_follows_its_signal_in_every_clone() {
        let signal = Arc::new(LeaseSignal::default());
        let key = Key::from_bytes([3; 32]);
        let attempt = Attempt::new(key, 7, 2, true).watched(signal.clone());
        let clone = attempt.clone();
        assert!(!attempt.lease_lost());
        let waiter = tokio::spawn(async move { clone.lost().await });
        signal.mark_lost();
        waiter.await.unwrap();
        assert!(attempt.lease_lost());
        assert_eq!(attempt, Attempt::new(key, 7, 2, true), "watching does not change what the attempt is");
        assert!(!Attempt::new(key, 7, 2, true).lease_lost());
        assert!(Attempt::unprotected(key).is_unprotected());
        assert_ne!(Attempt::unprotected(key), Attempt::new(key, 0, 1, false));
        assert_eq!(attempt.downstream_key(), Attempt::unprotected(key).downstream_key());
    }
}
