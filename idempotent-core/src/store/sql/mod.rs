//! The SQL stores: one [`SqlStore`] written once, over a small sealed [`Backend`] that holds
//! what SQLite and PostgreSQL do differently. Users write [`SqliteStore`] (feature `sqlite`: one
//! file, shared by the tasks of a process and the processes of one host) and [`PostgresStore`]
//! (feature `postgres`: one table, shared by every process that reaches the database); each has
//! its constructors and builder in its backend's module.
//!
//! | file | what it holds |
//! |---|---|
//! | `mod.rs` | these docs (the layout, the statements per transition, durability), the store's state |
//! | `backend.rs` | the [`Backend`] trait: what differs |
//! | `driver.rs` | what the two drivers do alike: binding values, reading the rows both read the same way, the state calls, running DDL |
//! | `statements.rs` | the statements both databases share, built once per store |
//! | `rows.rs` | reading and judging what the statements return |
//! | `store.rs` | the [`Store`](crate::Store) implementation |
//! | `migrate.rs` | creating and checking the tables |
//! | `table.rs` | how the statements name the tables (quoted, in the store's schema if any) |
//! | `state.rs` | the [`StateStore`](crate::state::StateStore) implementation |
//! | `transaction.rs` | [`TransactionalStore`], [`CommitsWith`] |
//! | `sqlite/mod.rs`, `sqlite/builder.rs`, `sqlite/writes.rs` | the SQLite backend; [`SqliteStoreBuilder`] and `SqliteStore::connect`/`from_pool`/`builder`/`builder_with_pool`; its writes, one at a time and together under load |
//! | `postgres/mod.rs`, `postgres/builder.rs`, `postgres/url.rs` | the PostgreSQL backend; [`PostgresStoreBuilder`] and `PostgresStore::connect`/`from_pool`/`builder`; the URL's own parameters (`schema`, `transaction_pooling`), the TLS check, descriptions without the password |
//!
//! # Layout (schema version 3)
//!
//! One row per key, in a table named by the builder's `table` (`idempotent_records` unless set;
//! on PostgreSQL in the builder's `schema` if set, else in the connection's `current_schema()`):
//!
//! | column | SQLite | PostgreSQL | meaning |
//! |---|---|---|---|
//! | `key` | `BLOB PRIMARY KEY` | `bytea PRIMARY KEY` | the key's 32 bytes |
//! | `fingerprint` | `BLOB` | `bytea` | the payload's 32 bytes |
//! | `state` | `TEXT` | `text` | `running`, `released`, `done` or `needs_attention` |
//! | `token` | `TEXT` | `text` | owner token of the last acquisition (kept when done, released or needing attention, so that a repeated complete, release or abandon by it is acknowledged) |
//! | `fence` | `INTEGER` | `bigint` | fencing token of the last acquisition |
//! | `attempt` | `INTEGER` | `bigint` | its attempt number |
//! | `recovered` | `INTEGER` (0/1) | `boolean` | the next attempt granted on this row must assume the effect may have happened: set by an acquisition that took over a lease that ran out (and read back as that attempt's [`Attempt::recovered`](crate::Attempt::recovered)), and by an uncertain release ([`Abandon::Uncertain`](crate::record::Abandon::Uncertain)), which the next acquisition inherits; a clean release clears it |
//! | `lease_until` | `INTEGER` | `bigint` | lease deadline, µs since the Unix epoch on the database clock |
//! | `expires_at` | `INTEGER` | `bigint` | when the row counts as absent, µs since the Unix epoch; `i64::MAX` (never) while it needs attention; PostgreSQL indexes it (`<table>_expires_at`) for the purge |
//! | `result` | `BLOB` | `bytea` | the stored outcome, when done |
//! | `step` | `TEXT` | `text` | the acquisition's step ([`Labels`](crate::record::Labels)); `''` when none was given |
//! | `run_id`, `tenant` | `TEXT` | `text` | its run id and tenant, or `NULL`; PostgreSQL indexes `(run_id, key)` (`<table>_run_id`) for scans by run |
//! | `created_at` | `INTEGER` | `bigint` | when the row's current life began (its first acquisition since it was absent), µs since the Unix epoch |
//! | `updated_at` | `INTEGER` | `bigint` | when it last changed, µs since the Unix epoch |
//!
//! and a table `idempotent_schema (name, version)` (next to it, in the same schema) saying which
//! tables this crate created and at which version. Times are integers of µs rather than timestamps so that the fence and the
//! deadlines are one arithmetic (read them on PostgreSQL with `to_timestamp(expires_at / 1e6)`).
//!
//! The tables are created on first use (by `open`/`connect`/`from_pool`, or `migrate`) in one
//! transaction that two processes cannot run at once (SQLite: `BEGIN IMMEDIATE`; PostgreSQL:
//! under an advisory lock). A table of that name that this crate did not create, or of another
//! schema version or shape, is an [`Error::Config`] saying what to do, and
//! is never altered.
//!
//! SQLite has no index besides the primary key: its acquire upsert sets every column (to its own
//! value when nothing changes), and SQLite rewrites the entries of every index on a column it
//! sets, so an index on `expires_at` or `run_id` would make every upsert that finds the key taken
//! write to the WAL and sync. Its purge sweeps by `rowid` instead, and a scan by run filters in
//! key order. PostgreSQL's table has `fillfactor = 90`, so that the transitions that change no
//! indexed column (release, an uncertain abandon, a renewal within the expiry) are HOT updates.
//!
//! # Statements per transition
//!
//! Every call of the [`Store`](crate::Store) trait is one statement (acquire: one or two), in
//! autocommit on a connection taken from the pool for that statement only and given back before
//! the answer is, so no connection is held while the caller's action runs. SQLite's writes on a
//! file in WAL mode are the exception in how they go out, not in what they do: they go out one
//! at a time on a connection the store keeps for them, and those that arrive while one is out go
//! out together in one transaction, synced once (group commit; `sqlite/writes.rs`). Time is the database's,
//! read inside each statement and fixed for it (SQLite: `unixepoch('subsec')`, the host clock;
//! PostgreSQL: `statement_timestamp()`), never the caller's. Fences are
//! `greatest(previous fence + 1, now in µs)`, so they grow per key also after the row was purged, unless the clock steps
//! back further than the time since the key's last acquisition.
//!
//! - **acquire**, one atomic write that takes the key, judging "free" (absent, expired, released
//!   or a lease that ran out, of the same payload) on the row as it is under the write lock;
//!   the row comes back whatever happened, and the returned token tells the outcome: ours, the
//!   key was taken; another's, the row says replay, in flight, needs attention or mismatch.
//!   - SQLite: `INSERT … ON CONFLICT(key) DO UPDATE SET <each column> = CASE WHEN <free> THEN
//!     <new value> ELSE <old value> END RETURNING …`. Where nothing changes, SQLite finds the
//!     row's bytes equal and writes no page.
//!   - PostgreSQL: `WITH cur AS (SELECT … WHERE key = $1), taken AS (INSERT … SELECT … WHERE NOT
//!     EXISTS (<cur is not free>) ON CONFLICT (key) DO UPDATE SET … WHERE <free> RETURNING …)
//!     SELECT … FROM taken UNION ALL SELECT … FROM cur WHERE NOT free`: when the snapshot's row
//!     is not free the insert does nothing and the row is the answer, so a replay takes no row
//!     lock and writes no WAL (a `DO UPDATE` that always updates would write a row version, and
//!     even `DO UPDATE … WHERE false` locks the row: a WAL record and a flushed commit). The read
//!     sees the statement's snapshot and the upsert the newest committed row; they differ only
//!     when another call changed the key in between, and then the statement returns no row and
//!     is run again on a fresh snapshot (up to 8 times; a serialization failure likewise).
//!
//!   After a run of answers the existing row decided (replays, mostly), acquire **reads first**:
//!   `SELECT … WHERE key = $1 AND expires_at > now`, which takes no write lock (SQLite: a write
//!   statement takes the file's one write lock even when it changes nothing; PostgreSQL: the
//!   upsert sets up its `INSERT … ON CONFLICT` node on every run; `BENCHMARKS.md` measured both).
//!   A row of another payload, done, needing attention, or running on a live lease is the answer;
//!   anything else and the upsert runs. Which goes first is learnt from the store's recent
//!   answers (`AcquireOrder` in `store/acquire_order.rs`); both judge the same row by the same
//!   rules, and only the upsert takes a key.
//! - **complete, release, renew**: `UPDATE … WHERE key = $1 AND token = $2 AND state IN (…) AND
//!   expires_at > now`; a repeat by the token that completed (or released) matches its own done
//!   (released) row and changes nothing, so it is acknowledged. Release writes `recovered =
//!   false`, so that a repeated clean release does not match an uncertain one. What each one does
//!   to `expires_at` is the record protocol's ([retention](crate::record#retention)).
//! - **abandon**: the same `UPDATE`, to `released` with `recovered` set (uncertain), or to
//!   `needs_attention` with `expires_at` never; a repeat with the same mark matches its own row.
//!   A late complete by the marked attempt finds neither `running` nor `done`, and is refused.
//! - **resolve**: `UPDATE … SET state = $2, result = $3, expires_at = now + $4 WHERE key = $1 AND
//!   state = 'needs_attention'`: of two resolves at once, the second finds the row settled and
//!   changes nothing.
//! - **inspect**: `SELECT … WHERE key = $1 AND expires_at > now`, the state judged in the
//!   statement (a running row whose lease passed, or one released uncertain, reads as stuck).
//! - **scan**: `SELECT … WHERE key > $1 AND expires_at > now AND <filter> ORDER BY key LIMIT $2`,
//!   every filter in SQL; the cursor is the last key listed, in hex, and a short page ends it.
//! - **release_fenced**: `UPDATE … SET state = 'released', recovered = true WHERE key = $1 AND
//!   fence = $2 AND state = 'running' AND expires_at > now`, live lease or not.
//! - **delete**: `UPDATE … SET expires_at = now, result = NULL … WHERE key = $1 AND expires_at >
//!   now RETURNING <a live lease held it>`, each column kept as it is when a live lease holds the
//!   row. The row, expired, counts as absent at once and keeps its fence until purged.
//!
//! Acquire writes the labels and times (a row that lives on keeps its labels and `created_at`);
//! every other transition that changes the row sets `updated_at`. An acquire dropped before it
//! answered goes on in a task of its own until its statement has ended, then releases the key
//! if it took it (`release_orphan`, which keeps the `recovered` mark); on PostgreSQL, so does an
//! acquire that failed after its statement was sent (a paused server runs it when it resumes).
//!
//! `statements()` counts them (and purges, and `complete_in`; not migrations, `BEGIN` or
//! `COMMIT`): a first execution is 2 (acquire's upsert, complete), a replay 1, a first execution
//! right after a run of replays 3 (acquire's read, its upsert, complete).
//!
//! # Purging
//!
//! An expired row counts as absent at once (acquire takes it over, the fence still grows); it is
//! deleted later, one batch for every 64 acquisitions of a store (in a background task, one at a
//! time), or by `purge()`. SQLite sweeps the table in `rowid` order, 256 rows per batch, so a
//! sweep costs a bounded amount per acquisition and expired rows stay under a third of the live
//! ones; PostgreSQL deletes up to 256 expired rows by the `expires_at` index (`FOR UPDATE SKIP
//! LOCKED`, so it never waits for a call). A row that needs attention never expires, so no purge
//! deletes it.
//!
//! # Durability
//!
//! A record is as durable as the database's commits, and an undone `done` means the action runs
//! again on the retry: exactly what the store is there to prevent.
//!
//! - SQLite: the file is in WAL mode with `synchronous = FULL`, each commit synced before it is
//!   answered (`from_pool` refuses a pool with `NORMAL` or `OFF`); a write that went out with
//!   others is answered once their one commit is synced.
//! - PostgreSQL: with `synchronous_commit = on` (the default) and `fsync = on`, a completion that
//!   was answered survives a crash; do not turn `synchronous_commit` off for this database.
//!
//! A replay commits nothing, so it never waits for a sync.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

mod backend;
mod driver;
mod migrate;
#[cfg(feature = "postgres")]
pub mod postgres;
mod rows;
#[cfg(feature = "sqlite")]
pub mod sqlite;
mod state;
mod statements;
mod store;
mod table;
mod transaction;

pub use backend::Backend;
#[cfg(feature = "postgres")]
pub use postgres::{PostgresBackend, PostgresStore, PostgresStoreBuilder};
#[cfg(feature = "sqlite")]
pub use sqlite::{SqliteBackend, SqliteStore, SqliteStoreBuilder};
pub use transaction::{CommitsWith, TransactionalStore};
pub(crate) use transaction::{store_of, wrong_store};

use self::statements::Statements;
use self::table::Table;
use super::AcquireOrder;
use crate::error::Error;

/// Durations are clamped to 100 years, so that `now + d` stays within an `i64` of µs.
pub(crate) const MAX_US: i64 = 100 * 365 * 24 * 60 * 60 * 1_000_000;

/// The `expires_at` of a `needs_attention` row: never (it waits to be resolved, and the purge,
/// which deletes rows whose `expires_at` has passed, never reaches it).
pub(crate) const NEVER_US: i64 = i64::MAX;

/// Acquisitions of one store between two purge batches.
const PURGE_EVERY: u64 = 64;

/// A store of records in a SQL database: [`SqliteStore`] or [`PostgresStore`], by backend.
///
/// See the [module documentation](self) for the layout, the statements and the durability
/// choices. Clones share the same pool.
pub struct SqlStore<B: Backend> {
    inner: Arc<Inner<B>>,
}

impl<B: Backend> Clone for SqlStore<B> {
    fn clone(&self) -> Self {
        SqlStore { inner: self.inner.clone() }
    }
}

struct Inner<B: Backend> {
    pool: sqlx::Pool<B::Db>,
    /// The target without credentials, for logs and errors.
    describe: String,
    table: Table,
    /// How long a call may take (SQLite: the busy timeout; PostgreSQL: the call's timeout).
    timeout: Duration,
    /// Set when a pooler in transaction mode stands between the store and its database
    /// (PostgreSQL's `transaction_pooling`): `SET LOCAL statement_timeout = …`, which each
    /// statement is sent after, its values written in (`postgres/inline.rs`). Never on SQLite.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pooled: Option<String>,
    sql: Statements,
    purge: B::Purge,
    writes: B::Writes,
    acquisitions: AtomicU64,
    statements: AtomicU64,
    /// Whether acquire reads first.
    order: AcquireOrder,
    purging: AtomicBool,
    /// A call failed on the way to the database and none has succeeded since (PostgreSQL,
    /// `postgres/mod.rs`: the next calls open a connection directly first).
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    troubled: AtomicBool,
}

impl<B: Backend> SqlStore<B> {
    /// A store on `pool`, with its records in `table` (validated), before any migration; `pooled`
    /// as [`Inner`]'s.
    fn on(pool: sqlx::Pool<B::Db>, describe: String, table: Table, timeout: Duration, pooled: Option<String>) -> Self {
        SqlStore {
            inner: Arc::new(Inner {
                pool,
                describe,
                sql: Statements::new::<B>(&table),
                purge: B::purge_for(&table),
                writes: B::Writes::default(),
                table,
                timeout,
                pooled,
                acquisitions: AtomicU64::new(0),
                statements: AtomicU64::new(0),
                order: AcquireOrder::default(),
                purging: AtomicBool::new(false),
                troubled: AtomicBool::new(false),
            }),
        }
    }

    /// The store's pool: for the application's own queries on the same database (its business
    /// tables), so that one pool serves both.
    pub fn pool(&self) -> &sqlx::Pool<B::Db> {
        &self.inner.pool
    }

    /// Creates the table if it is missing, or checks that it is the one this crate creates.
    ///
    /// Opening the store runs it already; running it again changes nothing. An existing table
    /// this crate did not create, or of another schema version or shape, is an
    /// [`Error::Config`] saying what to do: it is never altered.
    pub async fn migrate(&self) -> Result<(), Error> {
        self.migrate_as("migrate").await
    }

    /// The number of statements this store (and its clones) ran for the [`Store`](crate::Store)
    /// calls, [`complete_in`](TransactionalStore::complete_in) and purges since it was made (not
    /// counting opening it, `migrate`, nor a transaction's `BEGIN` and `COMMIT`).
    pub fn statements(&self) -> u64 {
        self.inner.statements.load(Ordering::Relaxed)
    }

    /// Runs one purge batch (see the [module docs](self#purging)) and answers how many rows it
    /// deleted. The store runs one every 64 acquisitions on its own.
    pub async fn purge(&self) -> Result<u64, Error> {
        B::purge(self).await
    }

    /// Closes the pool's connections, waiting for the calls under way, and the connection a
    /// `SqliteStore` writes on. On a store made on the application's pool, this closes that
    /// pool. Calls after it fail.
    pub async fn close(&self) {
        self.inner.pool.close().await;
        B::close(self).await;
    }

    /// Counts one statement in [`statements`](Self::statements) (the backends count as they run).
    fn count(&self) {
        self.inner.statements.fetch_add(1, Ordering::Relaxed);
    }

    /// The timeout error of `op`: it did not end within the store's timeout.
    fn timed_out(&self, op: &'static str) -> Error {
        Error::Timeout { store: self.inner.describe.clone(), op, after: self.inner.timeout }
    }

    /// `work` within the store's timeout: its answer, or the timeout error of `op`.
    async fn bounded<T>(&self, op: &'static str, work: impl Future<Output = Result<T, Error>>) -> Result<T, Error> {
        match tokio::time::timeout(self.inner.timeout, work).await {
            Ok(outcome) => outcome,
            Err(_) => Err(self.timed_out(op)),
        }
    }

    /// The store's error for `e` during `op`.
    fn error<E>(&self, op: &'static str, e: E) -> Error
    where
        E: std::borrow::Borrow<sqlx::Error> + std::error::Error + Send + Sync + 'static,
    {
        B::error(&self.inner.describe, op, self.inner.timeout, e)
    }

    /// Every `PURGE_EVERY` acquisitions, one purge batch in the background (one at a time).
    fn maybe_purge(&self) {
        let n = self.inner.acquisitions.fetch_add(1, Ordering::Relaxed) + 1;
        if !n.is_multiple_of(PURGE_EVERY) || self.inner.purging.swap(true, Ordering::Acquire) {
            return;
        }
        let store = self.clone();
        tokio::spawn(async move {
            if let Err(e) = store.purge().await {
                tracing::warn!(store = %store.inner.describe, error = %e, "idempotent.purge_failed");
            }
            store.inner.purging.store(false, Ordering::Release);
        });
    }
}

impl<B: Backend> fmt::Debug for SqlStore<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct(B::STORE).field("store", &self.inner.describe).finish_non_exhaustive()
    }
}
