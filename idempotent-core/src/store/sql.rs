//! What the SQL stores share: writing a step's outcome inside a transaction that also holds the
//! step's own writes, so that both commit together or not at all.
//!
//! [`SqliteStore`](super::SqliteStore) and `PostgresStore` implement [`TransactionalStore`];
//! `Step::run_in_transaction` drives it.

use std::time::Duration;

use bytes::Bytes;

use super::{BoxFuture, SharedStore, Store};
use crate::error::Error;
use crate::key::Key;
use crate::record::{Token, Transition};

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
    /// taken at once, so the transaction cannot fail later for want of it).
    fn begin(&self) -> BoxFuture<'_, Result<sqlx::Transaction<'static, Self::Database>, Error>>;

    /// The statement of [`Store::complete`], run inside `tx` and not committed: marks the key
    /// done with `result` if `token` still owns it ([`Transition::Ok`]), or changes nothing
    /// ([`Transition::LeaseLost`]).
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
    fn renews_during_transaction(&self) -> bool;
}

/// The sqlx databases a step can commit with, each mapped to its store: lets
/// `run_in_transaction` find the store from the type of the transaction its action takes.
pub trait CommitsWith: sqlx::Database {
    /// The store whose records live in this database.
    type Store: TransactionalStore<Database = Self>;
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
    let wanted = short_type_name::<DB::Store>();
    Error::Config(format!(
        "{what}: run_in_transaction with a transaction of {db} needs the run context's store to be a \
         {wanted}, the store whose records live in that database, but it is {found}; create the RunContext \
         with a {wanted} (itself, not a wrapper around it) on the database the step writes to, or run the \
         step with Step::run",
        db = short_type_name::<DB>(),
        found = store.describe(),
    ))
}

/// `SqliteStore` for `idempotent_core::store::sqlite::SqliteStore`.
fn short_type_name<T: ?Sized>() -> &'static str {
    let name = std::any::type_name::<T>();
    name.rsplit("::").next().unwrap_or(name)
}
