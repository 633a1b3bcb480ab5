//! What the lease does for work that commits with its record in a SQL transaction
//! ([`Step::run_in_transaction`](crate::Step::run_in_transaction)).

use bytes::Bytes;

use super::Lease;
use crate::error::Error;
use crate::record::Transition;
use crate::store::sql::{self, CommitsWith, TransactionalStore};

impl Lease {
    /// Stores `outcome` with the statement of [`Store::complete`](crate::Store::complete) run
    /// inside `tx`, a transaction on the lease's own store, and not committed: the caller commits
    /// (the outcome and the transaction's other writes together) or rolls back (neither).
    ///
    /// [`Transition::LeaseLost`] when another attempt took the key over: roll back. Unlike
    /// [`complete`](Self::complete), nothing goes on after a drop: the transaction it wrote in is
    /// dropped (rolled back) with the caller. An [`Error::Config`] when the lease's store is not
    /// `DB`'s [`CommitsWith::Store`].
    pub async fn complete_in<DB: CommitsWith>(
        &self,
        tx: &mut sqlx::Transaction<'static, DB>,
        outcome: Bytes,
    ) -> Result<Transition, Error> {
        self.check_deadline();
        let Some(store) = sql::store_of::<DB>(&self.store) else {
            return Err(sql::wrong_store::<DB>(&self.store, "Lease::complete_in"));
        };
        let timer = crate::metrics::Timer::start();
        let answer = store.complete_in(tx, &self.key, &self.token, outcome, self.retention).await;
        timer.store_call(&*self.store, crate::metrics::Op::Complete);
        let (short, fence) = (self.key.short(), self.attempt.fence());
        match &answer {
            Ok(Transition::Ok) => tracing::trace!(key = %short, fence, "idempotent.completed_in_transaction"),
            Ok(Transition::LeaseLost) => {
                tracing::warn!(key = %short, fence, "idempotent.lease_lost: another attempt took over the key; the transaction is rolled back")
            }
            Err(e) => {
                tracing::warn!(key = %short, error = %e, "idempotent.store_error: the outcome could not be written in the transaction, which is rolled back")
            }
        }
        answer
    }
}

/// A lease that gives its key up, from a task of its own, if it is dropped before the caller
/// [`disarm`](Self::disarm)s it.
///
/// For work whose cancellation is known to leave nothing behind, such as writes in a
/// transaction that never committed: a retry then runs at once instead of waiting for the lease
/// to run out. A release that reaches the store after the key was completed changes nothing
/// (release is a no-op on a done record), so a drop while a commit is under way is safe too.
pub(crate) struct ReleaseOnDrop(Option<Lease>);

impl ReleaseOnDrop {
    pub(crate) fn new(lease: Lease) -> Self {
        ReleaseOnDrop(Some(lease))
    }

    /// The lease, no longer released on drop: complete it, release it, or drop it to leave the
    /// key as the store has it.
    pub(crate) fn disarm(mut self) -> Lease {
        self.0.take().expect("a ReleaseOnDrop holds its lease until it is disarmed")
    }
}

impl std::ops::Deref for ReleaseOnDrop {
    type Target = Lease;

    fn deref(&self) -> &Lease {
        self.0.as_ref().expect("a ReleaseOnDrop holds its lease until it is disarmed")
    }
}

impl std::ops::DerefMut for ReleaseOnDrop {
    fn deref_mut(&mut self) -> &mut Lease {
        self.0.as_mut().expect("a ReleaseOnDrop holds its lease until it is disarmed")
    }
}

impl Drop for ReleaseOnDrop {
    fn drop(&mut self) {
        let Some(lease) = self.0.take() else { return };
        let short = lease.key.short();
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::warn!(key = %short, "idempotent.store_error: dropped outside a runtime before the outcome was stored; the key frees itself when the lease runs out");
            return;
        };
        tracing::debug!(key = %short, "idempotent.cancelled: releasing the key");
        // `release` logs its own failure.
        runtime.spawn(tracing::Instrument::in_current_span(async move { drop(lease.release().await) }));
    }
}
