//! The lease lifecycle, written once for every caller: the executor ([`RunContext::step`]) and
//! `idempotent-tower`'s HTTP/gRPC layer both drive it.
//!
//! 1. [`acquire`] takes the key, or reports a replay, a mismatch or another attempt in flight,
//!    waiting for that attempt when the [`Terms`] say so.
//! 2. [`Lease::run`] drives the work while renewing the lease every third of it; when the store
//!    says another attempt took over, or no renewal reached the store for a whole lease, the
//!    lease counts as lost and the work's [`Attempt`] is told.
//! 3. [`Lease::complete`] stores the outcome, [`Lease::release`] gives the key up. Once polled,
//!    both go on in a task of their own when the caller is dropped before the store answered (a
//!    timeout around the step, an HTTP client that went away, a panic elsewhere in the task), so
//!    that an outcome is not stranded and the key left to run again. The store decides whether the outcome is taken: only while
//!    this attempt's owner token still holds the key. A lease that ran out unseen, with no other
//!    attempt since, still stores its outcome; one that another attempt took over stores
//!    nothing ([`Transition::LeaseLost`]).
//!
//! The bounds on a lease and on retention are defined in `lease/terms.rs`, and [`Terms::check`]
//! is the one place that enforces them.
//!
//! [`RunContext::step`]: crate::RunContext::step

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use std::time::Duration;

use bytes::Bytes;
use tokio::time::Instant;

use crate::attempt::{Attempt, LeaseSignal};
use crate::error::Error;
use crate::key::Key;
use crate::metrics::{Held, Op, Timer};
use crate::record::{Abandon, Grant, Token, Transition};
use crate::store::SharedStore;

mod acquire;
mod finish;
mod terms;
#[cfg(any(feature = "sqlite", feature = "postgres"))]
mod transaction;

pub use acquire::{Taken, acquire, call_end, count_acquired};
pub use finish::FinishOnDrop;
use finish::poll_once;
pub use terms::{
    DEFAULT_LEASE, DEFAULT_RETENTION, DEFAULT_WAIT, FailMode, IN_FLIGHT_HINT, MAX_LEASE, MAX_RETENTION, MIN_LEASE,
    MIN_RETENTION, OnInFlight, Terms,
};
#[cfg(any(feature = "sqlite", feature = "postgres"))]
pub(crate) use transaction::ReleaseOnDrop;

/// How a [`Lease`] ends: the store call [`Lease::end`] makes.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum End {
    /// Store the outcome ([`Store::complete`](crate::store::Store::complete)).
    Complete(Bytes),
    /// Give the key up; the next attempt runs afresh ([`Store::release`](crate::store::Store::release)).
    Release,
    /// Give the key up without an outcome, marked as the [`Abandon`] says
    /// ([`Store::abandon`](crate::store::Store::abandon)).
    Abandon(Abandon),
}

/// A lease this caller holds on a key: the owner token, the [`Attempt`] it runs, and what this
/// process knows about how long it holds.
///
/// Made by [`acquire`]; consumed by [`complete`](Self::complete) or
/// [`release`](Self::release). Dropped without either, the key stays held until the lease runs
/// out (and the next attempt is [`recovered`](Attempt::recovered)).
pub struct Lease {
    store: SharedStore,
    key: Key,
    token: Token,
    attempt: Attempt,
    signal: Arc<LeaseSignal>,
    lease: Duration,
    retention: Duration,
    heartbeat: bool,
    /// Until when the lease is known to hold: `lease` after the acquire or the last successful
    /// renewal was *sent*. The store started counting no earlier, so its deadline is no sooner.
    valid_until: Instant,
    /// Counts this lease in the leases-held gauge while it lives (nothing without `metrics`).
    _held: Held,
}

impl std::fmt::Debug for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lease")
            .field("store", &self.store.describe())
            .field("key", &self.key.short())
            .field("token", &self.token)
            .field("attempt", &self.attempt)
            .field("lease", &self.lease)
            .finish_non_exhaustive()
    }
}

/// What ended one wait of the heartbeat.
enum Beat<T> {
    Done(T),
    Renewed(Result<Transition, Error>, Instant),
    Expired,
}

impl Lease {
    fn new(store: SharedStore, key: Key, grant: Grant, terms: &Terms, sent: Instant) -> Lease {
        let signal = Arc::new(LeaseSignal::default());
        let attempt = grant.attempt.watched(signal.clone());
        let short = key.short();
        tracing::debug!(key = %short, fence = attempt.fence(), attempt = attempt.number(), recovered = attempt.recovered(), "idempotent.acquired");
        if attempt.recovered() {
            tracing::info!(key = %short, fence = attempt.fence(), attempt = attempt.number(), "idempotent.recovered: a previous attempt's lease ran out without an outcome");
        }
        let held = Held::new(&*store);
        Lease {
            store,
            key,
            token: grant.token,
            attempt,
            signal,
            lease: terms.lease,
            retention: terms.retention,
            heartbeat: terms.heartbeat,
            valid_until: sent + terms.lease,
            _held: held,
        }
    }

    /// The attempt this lease runs: hand it to the work (a clone follows the lease's loss).
    pub fn attempt(&self) -> &Attempt {
        &self.attempt
    }

    /// The key held.
    pub fn key(&self) -> &Key {
        &self.key
    }

    /// Whether the lease is lost, or may be (see [`Attempt::lease_lost`]): also when it ran out
    /// since the heartbeat last looked (work that ended between two beats), which this marks.
    pub fn is_lost(&self) -> bool {
        self.check_deadline();
        self.signal.is_lost()
    }

    /// Drives `work` to its end, renewing the lease every third of it (when the terms have the
    /// heartbeat on). A renewal never delays the work: both are polled together, and the work
    /// wins a tie. Work that is done at its first poll costs no timer.
    ///
    /// `work` is pinned by the caller, so that it is not kept twice in this future.
    pub async fn run<F: Future>(&mut self, mut work: Pin<&mut F>) -> F::Output {
        match self.first_poll(work.as_mut()).await {
            Some(out) => out,
            None => self.beat(work).await,
        }
    }

    /// [`run`](Self::run), with the heartbeat's timers and renewal in a box of their own,
    /// allocated only when the work is not done at its first poll: for callers whose own
    /// future is allocated per call and should stay small (see BENCHMARKS.md, "Allocator and
    /// future-size notes").
    pub async fn run_boxed<F: Future>(&mut self, mut work: Pin<&mut F>) -> F::Output {
        match self.first_poll(work.as_mut()).await {
            Some(out) => out,
            None => Box::pin(self.beat(work)).await,
        }
    }

    /// The work's output if it is done at its first poll (or the heartbeat is off).
    async fn first_poll<F: Future>(&mut self, work: Pin<&mut F>) -> Option<F::Output> {
        if !self.heartbeat {
            return Some(work.await);
        }
        poll_once(work).await
    }

    async fn beat<F: Future>(&mut self, mut work: Pin<&mut F>) -> F::Output {
        let period = (self.lease / 3).max(Duration::from_millis(1));
        loop {
            if self.signal.is_lost() {
                return work.await;
            }
            let next = (Instant::now() + period).min(self.valid_until);
            if let Ok(out) = tokio::time::timeout_at(next, work.as_mut()).await {
                return out;
            }
            if Instant::now() >= self.valid_until {
                self.expired();
                continue;
            }
            let beat = {
                let sent = Instant::now();
                let timer = Timer::start();
                let renew = self.store.renew(&self.key, &self.token, self.lease);
                tokio::select! {
                    biased;
                    out = work.as_mut() => Beat::Done(out),
                    answer = renew => {
                        timer.store_call(&*self.store, Op::Renew);
                        Beat::Renewed(answer, sent)
                    }
                    () = tokio::time::sleep_until(self.valid_until) => Beat::Expired,
                }
            };
            let short = self.key.short();
            match beat {
                Beat::Done(out) => return out,
                Beat::Renewed(Ok(Transition::Ok), sent) => {
                    self.valid_until = sent + self.lease;
                    tracing::trace!(key = %short, "idempotent.renewed");
                }
                Beat::Renewed(Ok(Transition::LeaseLost), _) => {
                    tracing::warn!(key = %short, fence = self.attempt.fence(), "idempotent.lease_lost: another attempt took over while this one was running");
                    self.signal.mark_lost();
                }
                // The lease may still be ours until `valid_until`: keep trying.
                Beat::Renewed(Err(e), _) => {
                    tracing::warn!(key = %short, error = %e, "idempotent.store_error: lease renewal failed")
                }
                Beat::Expired => self.expired(),
            }
        }
    }

    fn expired(&self) {
        if !self.signal.is_lost() {
            tracing::warn!(key = %self.key.short(), fence = self.attempt.fence(), "idempotent.lease_lost: no renewal reached the store within the lease; another attempt may take over");
            self.signal.mark_lost();
        }
    }

    /// Marks the lease lost if it ran out since the heartbeat last looked (the work may have
    /// ended between two beats).
    fn check_deadline(&self) {
        if self.heartbeat && Instant::now() >= self.valid_until {
            self.expired();
        }
    }

    /// Stores `outcome` as the operation's result, kept for the retention.
    ///
    /// [`Transition::LeaseLost`] when another attempt took the key over: nothing is stored. A
    /// lease that only ran out (no renewal reached the store for a whole lease) still stores,
    /// if no other attempt has taken the key since. Once polled, the call goes on in a task of
    /// its own if this future is dropped before the store answered (also when the task unwinds
    /// from a panic elsewhere; not when the store call itself panicked, or outside a runtime).
    pub async fn complete(self, outcome: Bytes) -> Result<Transition, Error> {
        self.end(End::Complete(outcome)).await
    }

    /// Gives the key up without an outcome (the fence is kept), so that a retry runs the work
    /// again; [`Transition::LeaseLost`] when another attempt holds the key. Once polled, the call
    /// goes on after a drop as [`complete`](Self::complete)'s does.
    pub async fn release(self) -> Result<Transition, Error> {
        self.end(End::Release).await
    }

    /// Gives the key up without an outcome, leaving the record as `mark` says: the next attempt
    /// [`recovered`](Attempt::recovered) ([`Abandon::Uncertain`]), or every call refused until
    /// the record is resolved ([`Abandon::NeedsAttention`]). Once polled, the call goes on after
    /// a drop as [`complete`](Self::complete)'s does.
    pub async fn abandon(self, mark: Abandon) -> Result<Transition, Error> {
        self.end(End::Abandon(mark)).await
    }

    /// [`complete`](Self::complete), [`release`](Self::release) or [`abandon`](Self::abandon) as
    /// `end` says, borrowing the lease: for callers that decide between them, and keep the lease
    /// in a future of their own that should hold one store call's room, not a second lease.
    pub async fn end(&self, end: End) -> Result<Transition, Error> {
        self.check_deadline();
        let ending = Ending::of(&end);
        // Keeps what the call needs to be sent again from a task of its own, should this future
        // be dropped before the store answered: every transition is idempotent for its owner
        // token, so a call that had already reached the store is harmless to repeat. The guard's
        // clone of the outcome costs at most the one allocation a box for the call would (see
        // BENCHMARKS.md, "Allocator and future-size notes").
        let mut guard = EndOnDrop { lease: self, end: Some(end.clone()), in_call: false };
        // The store is the authority: it takes the outcome only while this attempt's token still
        // owns the key, which no other attempt can have taken without replacing it. A lease that
        // ran out unseen, with no other attempt since, still stores its outcome (a retry would
        // otherwise run the work a second time).
        let timer = Timer::start();
        let mut call = self.send(end);
        let answer = std::future::poll_fn(|cx| {
            // Marks the polls of the store call itself: a panic there is not repeated (see
            // `EndOnDrop`), a panic anywhere else in the task is.
            guard.in_call = true;
            let poll = call.as_mut().poll(cx);
            guard.in_call = false;
            poll
        })
        .await;
        guard.end = None;
        timer.store_call(&*self.store, ending.op());
        self.log_end(ending, &answer);
        if ending == Ending::Complete && answer.is_err() {
            // The work ran, and its outcome may not have been stored: mark the record uncertain,
            // so that the next attempt is recovered at once rather than after the lease. If the
            // outcome was stored after all (only the reply was lost), the mark finds the record
            // done and changes nothing.
            let timer = Timer::start();
            let marked = self.send(End::Abandon(Abandon::Uncertain)).await;
            timer.store_call(&*self.store, Op::Abandon);
            self.log_end(Ending::Mark(Abandon::Uncertain), &marked);
        }
        answer
    }

    fn log_end(&self, ending: Ending, answer: &Result<Transition, Error>) {
        let (short, fence) = (self.key.short(), self.attempt.fence());
        match (ending, answer) {
            (Ending::Complete, Ok(Transition::Ok)) if self.is_lost() => {
                tracing::info!(key = %short, fence, "idempotent.stored: the lease had run out, but no other attempt took the key")
            }
            (Ending::Complete, Ok(Transition::Ok)) => tracing::debug!(key = %short, fence, "idempotent.stored"),
            (Ending::Complete, Ok(Transition::LeaseLost)) => {
                tracing::warn!(key = %short, fence, "idempotent.lease_lost: the outcome was not stored; another attempt took over the key")
            }
            (Ending::Complete, Err(e)) => {
                tracing::error!(key = %short, error = %e, "idempotent.store_error: the work ran but its outcome may not have been stored; marking the record uncertain")
            }
            (Ending::Release, Ok(Transition::Ok)) => tracing::debug!(key = %short, "idempotent.released"),
            (Ending::Release, Ok(Transition::LeaseLost)) => {
                tracing::debug!(key = %short, fence, "idempotent.lease_lost: nothing to release; another attempt took over the key")
            }
            (Ending::Release, Err(e)) => {
                tracing::warn!(key = %short, error = %e, "idempotent.store_error: could not release; the key frees itself when the lease runs out")
            }
            (Ending::Mark(Abandon::Uncertain), Ok(Transition::Ok)) => {
                tracing::info!(key = %short, fence, "idempotent.released: uncertain, the next attempt is recovered")
            }
            // The `needs_attention` event itself is logged by whoever decided on it.
            (Ending::Mark(Abandon::NeedsAttention), Ok(Transition::Ok)) => {
                tracing::debug!(key = %short, fence, "idempotent.marked: the record waits to be resolved")
            }
            (Ending::Mark(_), Ok(Transition::LeaseLost)) => {
                tracing::debug!(key = %short, fence, "idempotent.not_marked: the record is done, or another attempt took the key over")
            }
            (Ending::Mark(_), Err(e)) => {
                tracing::warn!(key = %short, error = %e, "idempotent.store_error: could not mark the record; the key stays taken until its lease runs out, and the next attempt is recovered")
            }
        }
    }

    /// The store call that ends the lease as `end` says.
    fn send(&self, end: End) -> crate::store::BoxFuture<'_, Result<Transition, Error>> {
        send(&self.store, &self.key, &self.token, self.retention, end)
    }
}

/// The store call that ends a lease on `key` held by `token` as `end` says.
fn send<'a>(
    store: &'a SharedStore,
    key: &'a Key,
    token: &'a Token,
    retention: Duration,
    end: End,
) -> crate::store::BoxFuture<'a, Result<Transition, Error>> {
    match end {
        End::Complete(bytes) => store.complete(key, token, bytes, retention),
        End::Release => store.release(key, token),
        End::Abandon(mark) => store.abandon(key, token, mark),
    }
}

/// Which call ends a lease, for its log line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ending {
    Complete,
    Release,
    Mark(Abandon),
}

impl Ending {
    fn of(end: &End) -> Ending {
        match end {
            End::Complete(_) => Ending::Complete,
            End::Release => Ending::Release,
            End::Abandon(mark) => Ending::Mark(*mark),
        }
    }

    fn op(self) -> Op {
        match self {
            Ending::Complete => Op::Complete,
            Ending::Release => Op::Release,
            Ending::Mark(_) => Op::Abandon,
        }
    }
}

/// Sends a lease's ending again from a task of its own if dropped while `end` is still `Some`
/// (the call has not finished).
///
/// Also while the thread unwinds: tokio drops a task's future during the unwind of a panic
/// anywhere in that task (a sibling in a `join!`), and the outcome must still be stored. Only a
/// panic inside the store call itself (`in_call`) is not repeated: it would most likely panic
/// again.
struct EndOnDrop<'a> {
    lease: &'a Lease,
    end: Option<End>,
    in_call: bool,
}

impl Drop for EndOnDrop<'_> {
    fn drop(&mut self) {
        let Some(end) = self.end.take() else { return };
        let lease = self.lease;
        if self.in_call && std::thread::panicking() {
            tracing::error!(key = %lease.key.short(), "idempotent.store_error: the store panicked while storing the outcome; the key frees itself when the lease runs out");
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::warn!(key = %lease.key.short(), "idempotent.store_error: dropped while ending the lease (storing the outcome, releasing or marking the key), outside a runtime; the key frees itself when the lease runs out");
            return;
        };
        let (store, key, token, retention) = (lease.store.clone(), lease.key, lease.token.clone(), lease.retention);
        let again = async move {
            let (op, timer) = (Ending::of(&end).op(), Timer::start());
            let answer = send(&store, &key, &token, retention, end).await;
            timer.store_call(&*store, op);
            if let Err(e) = answer {
                tracing::warn!(key = %key.short(), error = %e, "idempotent.store_error: ending the lease after the caller went away failed");
            }
        };
        runtime.spawn(tracing::Instrument::in_current_span(again));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::Fingerprint;
    use crate::record::{Acquire, Labels};

    #[test]
    fn terms_out_of_bounds_are_config_errors_that_name_the_bound() {
        let ok = Terms::default();
        assert!(ok.check().is_ok());
        assert!(ok.lease(MIN_LEASE).retention(MAX_RETENTION).check().is_ok());
        assert!(ok.lease(MAX_LEASE).retention(MIN_RETENTION).check().is_ok());
        for (terms, word) in [
            (ok.lease(Duration::ZERO), "lease"),
            (ok.lease(MAX_LEASE + Duration::from_nanos(1)), "lease"),
            (ok.retention(Duration::from_micros(999)), "retention"),
            (ok.retention(Duration::MAX), "retention"),
        ] {
            let Err(Error::Config(message)) = terms.check() else { panic!("{terms:?} passed the check") };
            assert!(message.starts_with(word), "{message}");
            assert!(message.contains("out of range: use between"), "{message}");
        }
    }

    #[tokio::test]
    async fn a_dropped_completion_still_reaches_the_store() {
        use crate::store::{IntoSharedStore, MemoryStore, Store};
        // A store whose complete waits for a permit, so that the caller can be dropped while
        // the call is under way.
        struct Gated(MemoryStore, Arc<tokio::sync::Semaphore>);
        impl Store for Gated {
            fn acquire_labeled<'a>(
                &'a self,
                key: &'a Key,
                fp: &'a Fingerprint,
                lease: Duration,
                retention: Duration,
                labels: crate::record::Labels<'a>,
            ) -> crate::store::BoxFuture<'a, Result<Acquire, Error>> {
                self.0.acquire_labeled(key, fp, lease, retention, labels)
            }
            fn complete<'a>(
                &'a self,
                key: &'a Key,
                token: &'a Token,
                result: Bytes,
                retention: Duration,
            ) -> crate::store::BoxFuture<'a, Result<Transition, Error>> {
                Box::pin(async move {
                    let _permit = self.1.acquire().await.unwrap();
                    self.0.complete(key, token, result, retention).await
                })
            }
            fn release<'a>(
                &'a self,
                key: &'a Key,
                token: &'a Token,
            ) -> crate::store::BoxFuture<'a, Result<Transition, Error>> {
                self.0.release(key, token)
            }
            fn renew<'a>(
                &'a self,
                key: &'a Key,
                token: &'a Token,
                lease: Duration,
            ) -> crate::store::BoxFuture<'a, Result<Transition, Error>> {
                self.0.renew(key, token, lease)
            }
            fn abandon<'a>(
                &'a self,
                key: &'a Key,
                token: &'a Token,
                mark: Abandon,
            ) -> crate::store::BoxFuture<'a, Result<Transition, Error>> {
                self.0.abandon(key, token, mark)
            }
            fn resolve<'a>(
                &'a self,
                key: &'a Key,
                resolution: crate::record::Resolution,
            ) -> crate::store::BoxFuture<'a, Result<crate::record::Resolved, Error>> {
                self.0.resolve(key, resolution)
            }
            fn describe(&self) -> String {
                "gated".into()
            }
            fn inspect<'a>(
                &'a self,
                key: &'a Key,
            ) -> crate::store::BoxFuture<'a, Result<Option<crate::store::RecordInfo>, Error>> {
                self.0.inspect(key)
            }
            fn scan<'a>(
                &'a self,
                filter: &'a crate::store::Filter,
                cursor: &'a crate::store::Cursor,
                limit: usize,
            ) -> crate::store::BoxFuture<'a, Result<crate::store::Page, Error>> {
                self.0.scan(filter, cursor, limit)
            }
            fn release_fenced<'a>(
                &'a self,
                key: &'a Key,
                fence: u64,
            ) -> crate::store::BoxFuture<'a, Result<crate::record::Resolved, Error>> {
                self.0.release_fenced(key, fence)
            }
            fn delete<'a>(&'a self, key: &'a Key) -> crate::store::BoxFuture<'a, Result<crate::store::Deleted, Error>> {
                self.0.delete(key)
            }
        }
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        let store = Gated(MemoryStore::new(), gate.clone()).into_shared();
        let (key, fp) = (Key::from_bytes([7; 32]), Fingerprint::of(&1).unwrap());
        let Taken::Lease(lease) = acquire(&store, &key, &fp, &Terms::default(), Labels::step("gated")).await.unwrap()
        else {
            panic!("the key was free")
        };
        let mut completing = Box::pin(lease.complete(Bytes::from_static(b"done")));
        assert!(poll_once(completing.as_mut()).await.is_none(), "the gate holds the completion");
        drop(completing);
        gate.add_permits(1);
        // The completion finishes in its own task: the next acquire replays, once it has.
        loop {
            match acquire(&store, &key, &fp, &Terms::default(), Labels::step("gated")).await.unwrap() {
                Taken::Replay(bytes) => break assert_eq!(bytes, "done"),
                Taken::InFlight { .. } => tokio::task::yield_now().await,
                other => panic!("unexpected {other:?}"),
            }
        }
    }
}
