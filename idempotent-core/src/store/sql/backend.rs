//! What differs between the SQL databases, and nothing else: the [`Backend`] a [`SqlStore`] is
//! generic over.
//!
//! As sqlx keeps one `Pool<DB>` and a narrow per-driver trait (`Migrate`), the store is written
//! once and asks its backend only for what the two databases do differently: acquire's upsert,
//! the purge, how a statement is run and bounded in time (and what a failure may have left
//! behind), which database errors are timeouts or a missing state table, how acquire's
//! `recovered` column decodes, and the DDL, catalog reads and lock of a migration. Every
//! statement the backends share is built once, in `statements.rs`; what the two drivers do alike
//! (binding values, reading the rows both read the same way, the state calls, running DDL), in
//! `driver.rs`.

use std::borrow::Borrow;
use std::future::Future;
use std::time::Duration;

use sqlx::error::DatabaseError;
use sqlx::{Database, SqlStr, Transaction};

use super::SqlStore;
use super::driver::{Driver, StateRow, Value};
use super::rows::Found;
use super::table::Table;
use crate::error::{BoxError, Error};
use crate::key::Key;

pub(crate) mod sealed {
    /// Only this crate's backends implement [`Backend`](super::Backend).
    pub trait Sealed {}
}

/// A statement that failed, and whether it may have taken effect.
#[derive(Debug)]
pub struct Failed {
    /// The error the call answers.
    pub(crate) error: Error,
    /// What the statement may have done.
    pub(crate) effect: Effect,
}

impl Failed {
    /// A failure of a statement that cannot have changed anything (a read, a decoding error).
    pub(crate) fn not_sent(error: Error) -> Self {
        Failed { error, effect: Effect::NotSent }
    }
}

/// Whether a failed statement may have changed the database.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Effect {
    /// It was not sent (no connection), or the database answered that it did nothing.
    NotSent,
    /// The database rolled it back (a serialization failure or a deadlock): it may run again.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    RolledBack,
    /// It was sent and may have been committed (PostgreSQL: a paused server runs it when it
    /// resumes, a crash may lose the reply of a committed one).
    Unknown,
}

/// A database a [`SqlStore`] can keep its records in: SQLite ([`SqliteBackend`](super::SqliteBackend))
/// or PostgreSQL ([`PostgresBackend`](super::PostgresBackend)). Sealed: its methods are the
/// store's internals.
pub trait Backend: sealed::Sealed + Send + Sync + Sized + 'static {
    /// The sqlx database.
    type Db: Driver;
    /// The backend's purge: its statements and where its sweep goes on from.
    type Purge: Send + Sync;
    /// How the backend runs the store's writes (SQLite: one at a time from the process, and
    /// together under load; PostgreSQL: nothing of its own).
    type Writes: Default + Send + Sync;

    /// The name users write (`SqliteStore`), for `Debug` and error messages.
    const STORE: &'static str;
    /// The builder's `table` setter, which error messages point to.
    const BUILDER_TABLE: &'static str;
    /// [`Store::kind`](crate::Store::kind).
    const KIND: &'static str;
    /// The database clock in µs since the Unix epoch, fixed for the statement.
    const NOW_US: &'static str;
    /// The SQL function of the larger of two values (`max`, `greatest`).
    const GREATEST: &'static str;

    /// Acquire's upsert on `table` (a validated identifier), with the placeholders of
    /// `Statements`' acquire, returning a `Found` row of the
    /// key whatever happened (the caller's token in it if the key was taken), or, on PostgreSQL,
    /// no row when the record changed between the statement's read and its write.
    fn acquire_sql(table: &Table) -> String;

    /// The purge's statements and state for `table`.
    fn purge_for(table: &Table) -> Self::Purge;

    /// Whether the database's error `e` is its way of saying a bound ran out (a statement or
    /// lock timeout, a busy file). The pool's wait running out is a timeout on both.
    fn is_timeout(e: &dyn DatabaseError) -> bool;

    /// The store's error for the driver's `e` during `op`: [`Error::Timeout`] after `timeout`
    /// when the pool's wait ran out or [`is_timeout`](Self::is_timeout) says so,
    /// [`Error::Unavailable`] with its cause otherwise.
    /// `e` is the driver's error, or one shared by several calls (an `Arc` of it).
    fn error<E>(describe: &str, op: &'static str, timeout: Duration, e: E) -> Error
    where
        E: Borrow<sqlx::Error> + std::error::Error + Send + Sync + 'static,
    {
        let driver = e.borrow();
        if matches!(driver, sqlx::Error::PoolTimedOut) || driver.as_database_error().is_some_and(Self::is_timeout) {
            return Error::Timeout { store: describe.to_owned(), op, after: timeout };
        }
        Error::Unavailable {
            store: describe.to_owned(),
            op,
            reason: Self::reason(driver),
            source: Some(Box::new(e) as BoxError),
        }
    }

    /// What went wrong, for [`Error::Unavailable`]'s `reason`: the driver's message, which a
    /// backend may follow with what to do about it.
    fn reason(e: &sqlx::Error) -> String {
        e.to_string()
    }

    /// Runs `sql` with `args`, counted in [`statements`](SqlStore::statements), and returns its
    /// first row: on a connection of the store's pool (SQLite: a statement that may write goes
    /// through the store's writes; one that only reads is [`read_optional`](Self::read_optional)).
    fn fetch_optional<'a>(
        store: &'a SqlStore<Self>,
        op: &'static str,
        sql: &'a SqlStr,
        args: impl IntoIterator<Item = Value<'a>> + Send + 'a,
    ) -> impl Future<Output = Result<Option<<Self::Db as Database>::Row>, Failed>> + Send + 'a;

    /// [`fetch_optional`](Self::fetch_optional) for a statement that only reads (SQLite: on the
    /// pool at once, not through the store's writes).
    fn read_optional<'a>(
        store: &'a SqlStore<Self>,
        op: &'static str,
        sql: &'a SqlStr,
        args: impl IntoIterator<Item = Value<'a>> + Send + 'a,
    ) -> impl Future<Output = Result<Option<<Self::Db as Database>::Row>, Failed>> + Send + 'a {
        Self::fetch_optional(store, op, sql, args)
    }

    /// [`fetch_optional`](Self::fetch_optional), all the rows.
    fn fetch_all<'a>(
        store: &'a SqlStore<Self>,
        op: &'static str,
        sql: &'a SqlStr,
        args: impl IntoIterator<Item = Value<'a>> + Send + 'a,
    ) -> impl Future<Output = Result<Vec<<Self::Db as Database>::Row>, Failed>> + Send + 'a;

    /// [`fetch_optional`](Self::fetch_optional), answering how many rows the statement changed.
    fn execute<'a>(
        store: &'a SqlStore<Self>,
        op: &'static str,
        sql: &'a SqlStr,
        args: impl IntoIterator<Item = Value<'a>> + Send + 'a,
    ) -> impl Future<Output = Result<u64, Failed>> + Send + 'a;

    /// [`execute`](Self::execute) inside `tx`, within the store's timeout.
    fn execute_in<'a>(
        store: &'a SqlStore<Self>,
        tx: &'a mut Transaction<'static, Self::Db>,
        op: &'static str,
        sql: &'a SqlStr,
        args: impl IntoIterator<Item = Value<'a>> + Send + 'a,
    ) -> impl Future<Output = Result<u64, Error>> + Send + 'a;

    /// A state statement: `sql` with `args`, not counted, answering the `(version, value,
    /// tokens)` of the row it read. On the store's pool, as the driver runs it, unless the
    /// backend runs it otherwise (PostgreSQL behind a transaction pooler).
    fn state_read<'a>(
        store: &'a SqlStore<Self>,
        sql: SqlStr,
        args: impl IntoIterator<Item = Value<'a>> + Send + 'a,
    ) -> impl Future<Output = Result<Option<StateRow>, sqlx::Error>> + Send + 'a {
        Self::Db::state_read(&store.inner.pool, sql, args)
    }

    /// [`state_read`](Self::state_read), answering how many rows the statement changed.
    fn state_write<'a>(
        store: &'a SqlStore<Self>,
        sql: SqlStr,
        args: impl IntoIterator<Item = Value<'a>> + Send + 'a,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send + 'a {
        Self::Db::state_write(&store.inner.pool, sql, args)
    }

    /// Closes what the backend holds besides the pool, once the pool is closed (SQLite: the
    /// writes' connection).
    fn close(store: &SqlStore<Self>) -> impl Future<Output = ()> + Send + '_ {
        let _ = store;
        std::future::ready(())
    }

    /// Begins a step's transaction on the store's pool (SQLite: `BEGIN IMMEDIATE`).
    fn begin(store: &SqlStore<Self>)
    -> impl Future<Output = Result<Transaction<'static, Self::Db>, Error>> + Send + '_;

    /// See [`TransactionalStore::renews_during_transaction`](super::TransactionalStore::renews_during_transaction).
    fn renews_during_transaction(store: &SqlStore<Self>) -> bool;

    /// One purge batch; answers how many rows it deleted.
    fn purge(store: &SqlStore<Self>) -> impl Future<Output = Result<u64, Error>> + Send + '_;

    /// The `recovered` column of acquire's row (its column 5): an integer on SQLite, a boolean on
    /// PostgreSQL.
    fn recovered(row: &<Self::Db as Database>::Row) -> Result<bool, sqlx::Error>;

    /// The row of acquire's read or upsert, or [`Error::Corrupt`] for a column of the wrong type.
    fn found(key: &Key, row: &<Self::Db as Database>::Row) -> Result<Found, Error> {
        Self::Db::found(key, row, Self::recovered)
    }

    /// Begins a migration's transaction, holding what keeps two processes from migrating at once
    /// (SQLite: `BEGIN IMMEDIATE`; PostgreSQL: an advisory lock).
    fn begin_migration(
        store: &SqlStore<Self>,
    ) -> impl Future<Output = Result<Transaction<'static, Self::Db>, sqlx::Error>> + Send + '_;

    /// Bounds a migration in time where the database does not (PostgreSQL: the store's timeout,
    /// reported as `op`).
    fn bound_migration<'a, T: Send + 'a>(
        store: &'a SqlStore<Self>,
        op: &'static str,
        work: impl Future<Output = Result<T, Error>> + Send + 'a,
    ) -> impl Future<Output = Result<T, Error>> + Send + 'a;

    /// Creates the schema registry `idempotent_schema` (next to `table`) if it is missing, and
    /// answers the version it holds for `table` (`None`: this crate did not create that table).
    fn registered_version<'a>(
        tx: &'a mut Transaction<'static, Self::Db>,
        table: &'a Table,
    ) -> impl Future<Output = Result<Option<i64>, sqlx::Error>> + Send + 'a;

    /// Registers `table` at `version`.
    fn register<'a>(
        tx: &'a mut Transaction<'static, Self::Db>,
        table: &'a Table,
        version: i64,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a;

    /// Whether a relation named `table` exists (where the store would create it).
    fn exists<'a>(
        tx: &'a mut Transaction<'static, Self::Db>,
        table: &'a Table,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'a;

    /// The columns of `table` as the records' check compares them (SQLite: names; PostgreSQL:
    /// names and types), in order; none when it does not exist.
    fn columns<'a>(
        tx: &'a mut Transaction<'static, Self::Db>,
        table: &'a Table,
    ) -> impl Future<Output = Result<Vec<String>, sqlx::Error>> + Send + 'a;

    /// What [`columns`](Self::columns) answers for a table of the current schema.
    fn expected_columns() -> Vec<String>;

    /// The DDL of the records' table (and its indexes).
    fn create_records(table: &Table) -> String;

    /// The DDL of a state table.
    fn create_state(table: &Table) -> String;

    /// The database's error `e` says the state table is missing, or lacks a column (then
    /// `migrate_state` says why).
    fn state_missing(e: &dyn DatabaseError) -> bool;
}
