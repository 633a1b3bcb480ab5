//! Steps that commit with their record: [`Step::run_in_transaction`] runs the action in a
//! transaction of the store's database and marks the record done in the same transaction, so
//! that the action's writes and the record commit together, or neither does.

use std::pin::pin;

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::run::{Begun, Keep};
use super::{Provenance, Step};
use crate::attempt::{Attempt, CURRENT_ATTEMPT};
use crate::error::Error;
use crate::key::Key;
use crate::lease::ReleaseOnDrop;
use crate::metrics::{CallEnd, Timer};
use crate::record::Transition;
use crate::store::sql::{self, CommitsWith, TransactionalStore};

/// Steps that commit with their record: the action's database writes and the step's `done`
/// record share one transaction.
impl Step<'_> {
    /// Runs the action inside a transaction of the store's database, and stores its result in
    /// the same transaction: the action's writes and the step's record commit together, or
    /// neither does. The **database effect happens exactly once**.
    ///
    /// The run context's store must be the SQL store of `DB` (for `sqlx::Sqlite`, a
    /// [`SqliteStore`](crate::SqliteStore); for `sqlx::Postgres`, a
    /// [`PostgresStore`](crate::PostgresStore)), on the database the action writes to; any other
    /// store (a `MemoryStore`, or a wrapper around a SQL store) is an [`Error::Config`], and
    /// nothing runs. The transaction is the store's ([`TransactionalStore::begin`]): open the
    /// store on the application's own pool ([`SqliteStore::from_pool`](crate::SqliteStore::from_pool),
    /// [`PostgresStore::from_pool`](crate::PostgresStore::from_pool)), on the file that holds the
    /// business tables, or on the database that does.
    ///
    /// The action is an async closure taking the transaction and the [`Attempt`]. Write the
    /// transaction's type, with `'_` for its lifetime (`&mut sqlx::SqliteTransaction<'_>`,
    /// `&mut sqlx::PgTransaction<'_>`, or `&mut sqlx::Transaction<'_, DB>`): it names the
    /// database, and so the store the call needs.
    ///
    /// ```
    /// use idempotent_core::{Error, RunContext, SqliteStore, sqlx};
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Error> {
    /// # let path = std::env::temp_dir().join(format!("idempotent-doc-tx-{}.db", std::process::id()));
    /// let store = SqliteStore::connect(&path).await?;
    /// sqlx::query("CREATE TABLE IF NOT EXISTS invoices (order_id TEXT, amount INTEGER, fence INTEGER)")
    ///     .execute(store.pool()).await?;
    /// let ctx = RunContext::new(store.clone(), "order-7");
    /// for _retry in 0..2 {
    ///     let fence: u64 = ctx
    ///         .step("create_invoice")
    ///         .run_in_transaction(&("order-7", 1500), async |tx: &mut sqlx::SqliteTransaction<'_>, attempt| {
    ///             sqlx::query("INSERT INTO invoices VALUES (?1, ?2, ?3)")
    ///                 .bind("order-7")
    ///                 .bind(1500)
    ///                 .bind(attempt.fence() as i64)
    ///                 .execute(&mut **tx)
    ///                 .await?; // a sqlx::Error is the action's own error, Error::Action
    ///             Ok::<_, Error>(attempt.fence())
    ///         })
    ///         .await?;
    ///     assert!(fence > 0);
    /// }
    /// let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM invoices").fetch_one(store.pool()).await?;
    /// assert_eq!(rows, 1); // the retry replayed the stored fence; the insert ran once
    /// # store.close().await;
    /// # for suffix in ["", "-wal", "-shm"] { let _ = std::fs::remove_file(format!("{}{suffix}", path.display())); }
    /// # Ok(()) }
    /// ```
    ///
    /// On PostgreSQL the same, with a [`PostgresStore`](crate::PostgresStore), `$1` placeholders
    /// and `sqlx::PgTransaction<'_>`:
    ///
    /// ```no_run
    /// use idempotent_core::{Error, PostgresStore, RunContext, sqlx};
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Error> {
    /// let store = PostgresStore::connect("postgres://app@127.0.0.1:5432/app").await?;
    /// let ctx = RunContext::new(store.clone(), "order-7");
    /// let fence: u64 = ctx
    ///     .step("create_invoice")
    ///     .run_in_transaction(&("order-7", 1500), async |tx: &mut sqlx::PgTransaction<'_>, attempt| {
    ///         sqlx::query("INSERT INTO invoices (order_id, amount, fence) VALUES ($1, $2, $3)")
    ///             .bind("order-7")
    ///             .bind(1500)
    ///             .bind(attempt.fence() as i64)
    ///             .execute(&mut **tx)
    ///             .await?;
    ///         Ok::<_, Error>(attempt.fence())
    ///     })
    ///     .await?;
    /// # let _ = fence;
    /// # Ok(()) }
    /// ```
    ///
    /// # What happens
    ///
    /// 1. The key is acquired and that is committed on its own, as for [`run`](Self::run): a
    ///    concurrent duplicate sees the operation in flight; a replay, a mismatch or a key in
    ///    flight are answered the same way, and the action does not run.
    /// 2. A transaction begins ([`TransactionalStore::begin`]; on SQLite `BEGIN IMMEDIATE`, on
    ///    PostgreSQL `BEGIN` at the database's default isolation, on a connection of the store's
    ///    pool).
    /// 3. The action runs with the transaction and its [`Attempt`] (also
    ///    [`current_attempt`](crate::current_attempt)). It writes through the transaction
    ///    (`&mut **tx` is the connection).
    /// 4. `Ok(value)`: the value is encoded and the record marked done inside the transaction,
    ///    which is then committed. If another attempt took the key over meanwhile, the transaction
    ///    is rolled back and the call fails with [`Error::LeaseLost`]: the winner's writes are the
    ///    only ones.
    /// 5. `Err(e)` from the action, a result that cannot be stored ([`Error::Encode`],
    ///    [`Error::ResultTooLarge`]), a failed `begin` or completion statement, or a failed
    ///    `commit`: the transaction is rolled back, the key released, and the error returned, so
    ///    a retry runs the action again on a database without this attempt's writes. (A commit
    ///    whose reply was lost may have committed: its record is then done, the release changes
    ///    nothing, and a retry replays the result.)
    ///
    /// A crash (or a lost connection) before the commit leaves neither the action's writes nor a
    /// done record: once the lease runs out the retry runs, [`recovered`](Attempt::recovered),
    /// on a database without the first attempt's writes. A call **cancelled** before its commit
    /// (its future dropped: a timeout, a `select!`) rolls the transaction back and releases the
    /// key from a task of its own, so a retry runs at once, as a new attempt (not
    /// `recovered`: nothing of the cancelled one is in the database).
    ///
    /// # What it does not cover
    ///
    /// Only the writes made through `tx` commit with the record. Anything else the action does
    /// (a payment provider's API, an email, a write to another database) can happen again on
    /// a retry after a crash, a cancellation or a failed commit; pass
    /// [`Attempt::fence`] (or a key derived from the operation) to such systems as their own
    /// idempotency key, or run them in steps of their own. Errors are not stored (there is no
    /// `run_in_transaction_storing_errors`): an `Err` rolls back and frees the key.
    ///
    /// # Store specifics
    ///
    /// On SQLite the transaction holds the file's one write lock from `BEGIN IMMEDIATE` to the
    /// commit: every other writer of the file (other steps' acquires, in this process or any
    /// other) waits up to the busy timeout for it, and fails with [`Error::Timeout`] after that.
    /// Keep the transaction short, and do not run other steps on the same file from inside the
    /// action (they would wait for this very lock). The lease is not renewed while the
    /// transaction is open ([`TransactionalStore::renews_during_transaction`]): no other
    /// attempt can take the key over while the lock is held.
    ///
    /// On PostgreSQL the transaction holds one connection of the store's pool from `begin` to
    /// the commit, and locks only the rows it writes. While the action runs, the heartbeat
    /// renews the lease from another connection of the pool (give the pool two connections at
    /// least), so an action may run longer than the lease. From
    /// [`Lease::complete_in`](crate::lease::Lease::complete_in) (after the action) until the
    /// commit, the transaction holds the lock of the record's row: a duplicate meanwhile sees
    /// the key in flight (and, with
    /// [`OnInFlight::Wait`](crate::OnInFlight::Wait), waits for the outcome); one that finds the
    /// lease run out (the heartbeat ends with the action) waits for that row lock, then finds
    /// the record done and replays it, so no second attempt starts while the commit is under
    /// way. On a store made with [`PostgresStore::connect`](crate::PostgresStore::connect) or
    /// [`builder`](crate::PostgresStore::builder), the connections run with `statement_timeout`
    /// set to the store's timeout, and it applies to the action's statements too: raise it with
    /// `SET LOCAL statement_timeout` in the action if a statement needs longer. (A store on the
    /// application's pool keeps that pool's settings.)
    ///
    /// # Fail-open
    ///
    /// With [`FailMode::Open`](crate::FailMode::Open), a store failure at acquire runs the action in a transaction of
    /// its own, committed without any record and with an unprotected [`Attempt`]: the writes
    /// are the action's alone, and a retry runs it again. The store and the action's database
    /// being one, such a failure usually makes the transaction fail too.
    ///
    /// The future is `Send` when the action's is, so it can be spawned.
    pub async fn run_in_transaction<P, T, E, DB, F>(self, payload: &P, action: F) -> Result<T, E>
    where
        P: Serialize + ?Sized,
        T: Serialize + DeserializeOwned,
        E: From<Error>,
        DB: CommitsWith,
        F: for<'t> AsyncFnOnce(&mut sqlx::Transaction<'t, DB>, Attempt) -> Result<T, E>,
    {
        self.run_in_transaction_traced(payload, action).await.map(|(value, _)| value)
    }

    /// Like [`run_in_transaction`](Self::run_in_transaction), and says where the value came
    /// from, as [`run_traced`](Self::run_traced) does: [`Provenance::Executed`] when this call's
    /// transaction committed it, [`Provenance::Replayed`] when it was stored earlier (nothing ran),
    /// [`Provenance::Unprotected`] when the store failed and the step fails open.
    ///
    /// ```
    /// use idempotent_core::{Error, Provenance, RunContext, SqliteStore, sqlx};
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Error> {
    /// # let path = std::env::temp_dir().join(format!("idempotent-doc-traced-{}.db", std::process::id()));
    /// let store = SqliteStore::connect(&path).await?;
    /// let ctx = RunContext::new(store, "order-7");
    /// let note = async |tx: &mut sqlx::SqliteTransaction<'_>, attempt: idempotent_core::Attempt| {
    ///     sqlx::query("SELECT 1").execute(&mut **tx).await?;
    ///     Ok::<_, Error>(attempt.number())
    /// };
    /// let (n, how) = ctx.step("note").run_in_transaction_traced(&7, note).await?;
    /// assert_eq!((n, how), (1, Provenance::Executed { attempt: 1 }));
    /// let (n, how) = ctx.step("note").run_in_transaction_traced(&7, note).await?;
    /// assert_eq!((n, how), (1, Provenance::Replayed { attempt: Some(1) }));
    /// # for suffix in ["", "-wal", "-shm"] { let _ = std::fs::remove_file(format!("{}{suffix}", path.display())); }
    /// # Ok(()) }
    /// ```
    pub async fn run_in_transaction_traced<P, T, E, DB, F>(self, payload: &P, action: F) -> Result<(T, Provenance), E>
    where
        P: Serialize + ?Sized,
        T: Serialize + DeserializeOwned,
        E: From<Error>,
        DB: CommitsWith,
        F: for<'t> AsyncFnOnce(&mut sqlx::Transaction<'t, DB>, Attempt) -> Result<T, E>,
    {
        let Some(store) = sql::store_of::<DB>(&self.ctx.store) else {
            return Err(sql::wrong_store::<DB>(&self.ctx.store, &format!("step `{}`", self.name)).into());
        };
        let (key, fingerprint) = self.key_for(payload).inspect_err(|_| self.count(CallEnd::Failed))?;
        let opts = &self.options;
        let terms = opts.terms().heartbeat(opts.heartbeat && store.renews_during_transaction());
        let lease = match self.begin(&key, &fingerprint, &terms, |_| Err(())).await {
            Begun::Run(lease) => lease,
            Begun::Answered(answer) => return answer,
            Begun::FailOpen => {
                return unprotected_in_transaction(store, key, action)
                    .await
                    .map(|value| (value, Provenance::Unprotected));
            }
        };
        // From here until the outcome is settled, a drop releases the key: the transaction,
        // dropped with this future, is rolled back.
        let mut lease = ReleaseOnDrop::new(lease);
        let mut tx = match store.begin().await {
            Ok(tx) => tx,
            Err(e) => {
                let _ = lease.disarm().release().await;
                self.count(CallEnd::StoreError);
                return Err(e.into());
            }
        };
        let attempt = lease.attempt().clone();
        let result = {
            let timer = Timer::start();
            let action = pin!(CURRENT_ATTEMPT.scope(attempt.clone(), action(&mut tx, attempt)));
            let result = lease.run(action).await;
            timer.action(&self.name, &*self.ctx.store);
            result
        };
        let fence = lease.attempt().fence();
        let number = lease.attempt().number();
        let failed = match self.outcome(&key, lease.attempt().number(), &result, |_: &E| None) {
            Keep::Store(bytes) => match lease.complete_in(&mut tx, bytes).await {
                Ok(Transition::Ok) => match commit(store, tx).await {
                    Ok(()) => {
                        tracing::debug!(step = %self.name, key = %key.short(), fence, "idempotent.stored: committed with the transaction");
                        // Done: nothing to release.
                        drop(lease.disarm());
                        self.count(CallEnd::Executed);
                        return result.map(|value| (value, Provenance::Executed { attempt: number }));
                    }
                    Err(e) => {
                        let _ = lease.disarm().release().await;
                        self.count(CallEnd::StoreError);
                        return Err(e.into());
                    }
                },
                Ok(Transition::LeaseLost) => {
                    roll_back(store, tx).await;
                    // The key is another attempt's: nothing to release.
                    drop(lease.disarm());
                    self.count(CallEnd::LeaseLost);
                    return Err(self.lease_lost(&key, fence).into());
                }
                Err(e) => Err((CallEnd::StoreError, e)),
            },
            Keep::Release => Ok(()),
            Keep::Fail(e) => Err((CallEnd::Failed, e)),
        };
        // The transaction ends before the key is released: on a pool of one connection, the
        // release needs the transaction's.
        roll_back(store, tx).await;
        let _ = lease.disarm().release().await;
        self.count(failed.as_ref().map_or_else(|(counted, _)| *counted, |()| CallEnd::Executed));
        let failed = failed.map_err(|(_, e)| e);
        match failed {
            Ok(()) => result.map(|value| (value, Provenance::Executed { attempt: number })),
            Err(e) => Err(e.into()),
        }
    }
}

/// [`Step::run_in_transaction`] when the store failed and the step fails open: the action runs
/// in a transaction of its own, with no record.
async fn unprotected_in_transaction<S, T, E, F>(store: &S, key: Key, action: F) -> Result<T, E>
where
    S: TransactionalStore,
    E: From<Error>,
    F: for<'t> AsyncFnOnce(&mut sqlx::Transaction<'t, S::Database>, Attempt) -> Result<T, E>,
{
    let mut tx = store.begin().await?;
    match action(&mut tx, Attempt::unprotected(key)).await {
        Ok(value) => {
            commit(store, tx).await?;
            Ok(value)
        }
        Err(e) => {
            roll_back(store, tx).await;
            Err(e)
        }
    }
}

async fn commit<S: TransactionalStore>(store: &S, tx: sqlx::Transaction<'static, S::Database>) -> Result<(), Error> {
    tx.commit().await.map_err(|e| {
        let error = Error::Unavailable {
            store: store.describe(),
            op: "commit",
            reason: e.to_string(),
            source: Some(Box::new(e)),
        };
        tracing::warn!(error = %error, "idempotent.store_error: the transaction did not commit; its writes are rolled back");
        error
    })
}

/// Rolls back; a rollback that fails is logged (the connection rolls back when it is dropped).
async fn roll_back<S: TransactionalStore>(store: &S, tx: sqlx::Transaction<'static, S::Database>) {
    if let Err(e) = tx.rollback().await {
        tracing::warn!(store = %store.describe(), error = %e, "idempotent.store_error: rollback failed; the connection rolls back as it is dropped");
    }
}
