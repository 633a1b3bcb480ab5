//! Writing a step's outcome inside a transaction that also holds the step's own writes, so that
//! both commit together or not at all: [`TransactionalStore`], implemented once by [`SqlStore`],
//! and [`CommitsWith`], which maps a sqlx database to its store. `Step::run_in_transaction`
//! drives it (`executor/transaction.rs`), `Lease::complete_in` writes the outcome
//! (`lease/transaction.rs`).

use std::time::Duration;

use bytes::Bytes;

use super::SqlStore;
use super::backend::Backend;
use crate::error::Error;
use crate::key::Key;
use crate::record::{Token, Transition};
use crate::store::{BoxFuture, SharedStore, Store};

/// A store whose records live in a SQL database, so that a step's completion can be written in
/// the transaction that holds the step's business writes.
///
/// The acquisition is committed on its own before (so that a concurrent duplicate sees the
/// operation in flight); the completion is one statement inside the caller's transaction, which
/// the caller then commits. Commit both, or neither.
pub trait TransactionalStore: Store + Clone {
    /// The sqlx database the records live in.
    type Database: sqlx::Database;

    /// Begins a transaction on the store's pool (on SQLite, `BEGIN IMMEDIATE`: the write lock is
    /// taken at once, so the transaction cannot fail later for want of it; on PostgreSQL,
    /// `BEGIN` at the database's default isolation, with the `statement_timeout` of the store's
    /// connections).
    fn begin(&self) -> BoxFuture<'_, Result<sqlx::Transaction<'static, Self::Database>, Error>>;

    /// The statement of [`Store::complete`], run inside `tx` and not committed: marks the key
    /// done with `result` if `token` still owns it ([`Transition::Ok`]), or changes nothing
    /// ([`Transition::LeaseLost`]). On PostgreSQL the record's row stays locked until `tx`
    /// ends: an acquire that would take the key over waits for the commit, then finds it done.
    fn complete_in<'a>(
        &'a self,
        tx: &'a mut sqlx::Transaction<'static, Self::Database>,
        key: &'a Key,
        token: &'a Token,
        result: Bytes,
        retention: Duration,
    ) -> BoxFuture<'a, Result<Transition, Error>>;

    /// Whether the lease is renewed (from another connection) while the transaction is open.
    ///
    /// `false` for SQLite: an open write transaction holds the file's one write lock, so a
    /// renewal would wait for it, and no other attempt can take the key over meanwhile anyway.
    /// `true` for PostgreSQL: the transaction locks the record's row only from `complete_in` on,
    /// so the heartbeat renews the lease from another connection of the pool while the action
    /// runs (unless the pool has one connection only, which the transaction holds).
    fn renews_during_transaction(&self) -> bool;

    /// The name users write for this store (`SqliteStore`), for error messages.
    #[doc(hidden)]
    fn store_name() -> &'static str
    where
        Self: Sized,
    {
        short_type_name::<Self>()
    }
}

/// The sqlx databases a step can commit with, each mapped to its store: lets
/// `run_in_transaction` find the store from the type of the transaction its action takes.
pub trait CommitsWith: sqlx::Database {
    /// The store whose records live in this database.
    type Store: TransactionalStore<Database = Self>;
}

/// On SQLite, transactions begin with `BEGIN IMMEDIATE`, which takes the file's write lock at
/// once (waiting up to the busy timeout for it): a deferred `BEGIN` would take it at the first
/// write, and fail there with `SQLITE_BUSY` when another connection wrote since the
/// transaction's first read. The lock is held until the commit, so the lease is not renewed
/// meanwhile (a renewal from another connection would wait for that very lock) and no other
/// attempt can take the key over either. On PostgreSQL, `BEGIN` at the database's default
/// isolation, within the store's timeout; the transaction locks the record's row only from
/// `complete_in` on, so the lease is renewed from another connection while the step's own
/// writes run, when the pool has a second connection to renew from (a pool of one is held by
/// the step's transaction: give the step a lease longer than the transaction, or the pool a
/// second connection).
impl<B: Backend> TransactionalStore for SqlStore<B> {
    type Database = B::Db;

    fn begin(&self) -> BoxFuture<'_, Result<sqlx::Transaction<'static, B::Db>, Error>> {
        Box::pin(B::begin(self))
    }

    fn complete_in<'a>(
        &'a self,
        tx: &'a mut sqlx::Transaction<'static, B::Db>,
        key: &'a Key,
        token: &'a Token,
        result: Bytes,
        retention: Duration,
    ) -> BoxFuture<'a, Result<Transition, Error>> {
        Box::pin(SqlStore::complete_in(self, tx, key, token, result, retention))
    }

    fn renews_during_transaction(&self) -> bool {
        B::renews_during_transaction(self)
    }

    fn store_name() -> &'static str {
        B::STORE
    }
}

/// The store behind `store` if it is `DB`'s ([`CommitsWith::Store`]), for work that commits in
/// a transaction of `DB`.
pub(crate) fn store_of<DB: CommitsWith>(store: &SharedStore) -> Option<&DB::Store> {
    let any: &dyn std::any::Any = &**store;
    any.downcast_ref::<DB::Store>()
}

/// The [`Error::Config`] for a `store` that is not `DB`'s, naming both and what to do; the
/// message opens with `what` (the step).
pub(crate) fn wrong_store<DB: CommitsWith>(store: &SharedStore, what: &str) -> Error {
    let wanted = <DB::Store as TransactionalStore>::store_name();
    Error::Config(format!(
        "{what}: run_in_transaction with a transaction of {db} needs the run context's store to be a \
         {wanted}, the store whose records live in that database, but it is {found}; create the RunContext \
         with a {wanted} (itself, not a wrapper around it) on the database the step writes to, or run the \
         step with Step::run",
        db = short_type_name::<DB>(),
        found = store.describe(),
    ))
}

/// `MemoryStore` for `idempotent_core::store::memory::MemoryStore` (the last path segment).
fn short_type_name<T: ?Sized>() -> &'static str {
    let name = std::any::type_name::<T>();
    name.rsplit("::").next().unwrap_or(name)
}
