//! SQLite, the backend of [`SqliteStore`]: one file in WAL mode, shared by the tasks of a process
//! and by the processes of one host. What it does differently from PostgreSQL is here (its
//! settings and constructors in `builder.rs`); the layout, the statements and the durability
//! notes are in the [module docs](super).
//!
//! - Acquire's upsert always updates the row (`DO UPDATE SET <column> = CASE WHEN <free> …`): a
//!   write statement takes the file's one write lock whatever it changes, and a row written with
//!   its own values writes no page. In `excluded`, the row the statement would insert, `fence`
//!   holds the clock, so `excluded.fence` is "now" throughout the statement.
//! - On a file in WAL mode, the store's writes go out one at a time on a connection of their
//!   own, and together under load, in one transaction synced once (`writes.rs`); on an
//!   application's pool in the rollback journal or in memory, each runs on the pool. A write
//!   waits for another connection's (or process's) write lock up to the busy timeout (on its
//!   own connection looking again every millisecond, on the pool in SQLite's busy handler);
//!   reads wait for a connection of the pool as long (`SQLITE_BUSY` and `SQLITE_LOCKED`, and a
//!   pool that stayed busy, are [`Error::Timeout`]). A failed statement changed nothing (the
//!   file is local: no reply is lost); a write is stepped to its end, so that its commit's
//!   error is its answer.
//! - The purge sweeps by `rowid`, 256 rows a batch (there is no index on `expires_at`).
//! - A step's transaction is `BEGIN IMMEDIATE`, and the lease is not renewed while it holds the
//!   write lock; migrations take the same lock.

use std::sync::atomic::{AtomicI64, Ordering};

use sqlx::error::DatabaseError;
use sqlx::sqlite::SqliteRow;
use sqlx::{Row, SqlStr, Sqlite, Transaction};

use super::backend::{Backend, Failed, sealed};
use super::driver::{Driver, Value};
use super::statements::sql;
use super::table::Table;
use super::{CommitsWith, SqlStore};
use crate::error::Error;

mod builder;
mod writes;

pub use builder::SqliteStoreBuilder;
use writes::Want;
#[doc(hidden)]
pub use writes::Writes;

/// A store in one SQLite file, safe for many tasks and for several processes on one host.
///
/// See the [module documentation](super) for the layout, the statements and the durability
/// choices. Clones share the same pool.
///
/// ```
/// use idempotent_core::{RunContext, SqliteStore};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), idempotent_core::Error> {
/// let path = std::env::temp_dir().join(format!("idempotent-doc-{}.db", std::process::id()));
/// let store = SqliteStore::connect(&path).await?;
/// let ctx = RunContext::new(store.clone(), "run-1");
/// let n: u32 = ctx.step("count").run(&(), |_| async { Ok::<_, idempotent_core::Error>(7) }).await?;
/// assert_eq!(n, 7);
/// assert_eq!(store.describe(), format!("sqlite://{}", path.display()));
/// # store.close().await;
/// # for suffix in ["", "-wal", "-shm"] { let _ = std::fs::remove_file(format!("{}{suffix}", path.display())); }
/// # Ok(()) }
/// # use idempotent_core::Store;
/// ```
pub type SqliteStore = SqlStore<SqliteBackend>;

/// The SQLite [`Backend`] of [`SqliteStore`].
#[derive(Debug)]
pub struct SqliteBackend;

/// Rows examined per purge batch.
const PURGE_BATCH: i64 = 256;
/// The database clock in µs since the Unix epoch, read inside a statement.
const NOW_US: &str = "CAST(unixepoch('subsec') * 1000000 AS INTEGER)";
/// The columns of the records' table, in order.
const COLUMNS: [&str; 15] = [
    "key",
    "fingerprint",
    "state",
    "token",
    "fence",
    "attempt",
    "recovered",
    "lease_until",
    "expires_at",
    "result",
    "step",
    "run_id",
    "tenant",
    "created_at",
    "updated_at",
];

/// The purge's statements, and the last rowid the sweep examined (0: start a new pass).
#[doc(hidden)]
pub struct SqlitePurge {
    range: SqlStr,
    delete: SqlStr,
    cursor: AtomicI64,
}

impl sealed::Sealed for SqliteBackend {}

impl CommitsWith for Sqlite {
    type Store = SqliteStore;
}

impl Backend for SqliteBackend {
    type Db = Sqlite;
    type Purge = SqlitePurge;
    type Writes = Writes;

    const STORE: &'static str = "SqliteStore";
    const BUILDER_TABLE: &'static str = "SqliteStoreBuilder::table";
    const KIND: &'static str = "sqlite";
    const NOW_US: &'static str = NOW_US;
    const GREATEST: &'static str = "max";

    fn acquire_sql(table: &Table) -> String {
        let t = table;
        // The existing row is `r`; `excluded` the row acquire would insert.
        let now = "excluded.fence";
        let expired = format!("r.expires_at <= {now}");
        let free = format!(
            "({expired} OR (r.fingerprint = excluded.fingerprint AND (r.state = 'released' OR (r.state = \
             'running' AND r.lease_until <= {now}))))"
        );
        let pick = |col: &str, new: &str| format!("{col} = CASE WHEN {free} THEN {new} ELSE r.{col} END");
        let set = [
            pick("fingerprint", "excluded.fingerprint"),
            pick("state", "'running'"),
            pick("token", "excluded.token"),
            pick("fence", &format!("max(r.fence + 1, {now})")),
            pick("attempt", &format!("CASE WHEN {expired} THEN 1 ELSE r.attempt + 1 END")),
            // A released row's `recovered` says its release was uncertain.
            pick(
                "recovered",
                &format!("CASE WHEN {expired} THEN 0 WHEN r.state = 'running' THEN 1 ELSE r.recovered END"),
            ),
            pick("lease_until", "excluded.lease_until"),
            pick("expires_at", "excluded.expires_at"),
            pick("result", "NULL"),
            // A row that lives on keeps its labels and creation time; an expired one starts anew.
            pick("step", &format!("CASE WHEN {expired} THEN excluded.step ELSE r.step END")),
            pick("run_id", &format!("CASE WHEN {expired} THEN excluded.run_id ELSE r.run_id END")),
            pick("tenant", &format!("CASE WHEN {expired} THEN excluded.tenant ELSE r.tenant END")),
            pick("created_at", &format!("CASE WHEN {expired} THEN {now} ELSE r.created_at END")),
            pick("updated_at", now),
        ]
        .join(",\n  ");
        format!(
            "INSERT INTO {t} AS r ({cols})\n\
             SELECT ?1, ?2, 'running', ?3, now, 1, 0, now + ?4, now + ?5, NULL, ?6, ?7, ?8, now, now\n\
             FROM (SELECT {NOW_US} AS now)\n\
             WHERE true\n\
             ON CONFLICT(key) DO UPDATE SET\n  {set}\n\
             RETURNING token, fingerprint, state, fence, attempt, recovered, lease_until - {NOW_US}, result",
            cols = COLUMNS.join(", "),
        )
    }

    fn purge_for(table: &Table) -> SqlitePurge {
        let t = table;
        let range = format!(
            "SELECT max(rowid) FROM (SELECT rowid FROM {t} WHERE rowid > ?1 ORDER BY rowid LIMIT {PURGE_BATCH})"
        );
        let delete = format!("DELETE FROM {t} WHERE rowid > ?1 AND rowid <= ?2 AND expires_at <= {NOW_US}");
        SqlitePurge { range: sql(range), delete: sql(delete), cursor: AtomicI64::new(0) }
    }

    fn is_timeout(e: &dyn DatabaseError) -> bool {
        // SQLITE_BUSY (5) and SQLITE_LOCKED (6), with their extended codes.
        e.code().and_then(|c| c.parse::<i32>().ok()).is_some_and(|c| matches!(c & 0xff, 5 | 6))
    }

    async fn fetch_optional<'a>(
        store: &'a SqliteStore,
        op: &'static str,
        sql: &'a SqlStr,
        args: impl IntoIterator<Item = Value<'a>> + Send + 'a,
    ) -> Result<Option<SqliteRow>, Failed> {
        store.count();
        Ok(store.write(op, sql, args, Want::Row).await?.row)
    }

    fn read_optional<'a>(
        store: &'a SqliteStore,
        op: &'static str,
        sql: &'a SqlStr,
        args: impl IntoIterator<Item = Value<'a>> + Send + 'a,
    ) -> impl Future<Output = Result<Option<SqliteRow>, Failed>> + Send + 'a {
        let q = Sqlite::query(sql, args);
        async move {
            store.count();
            q.fetch_optional(&store.inner.pool).await.map_err(|e| Failed::not_sent(store.error(op, e)))
        }
    }

    fn fetch_all<'a>(
        store: &'a SqliteStore,
        op: &'static str,
        sql: &'a SqlStr,
        args: impl IntoIterator<Item = Value<'a>> + Send + 'a,
    ) -> impl Future<Output = Result<Vec<SqliteRow>, Failed>> + Send + 'a {
        let q = Sqlite::query(sql, args);
        async move {
            store.count();
            q.fetch_all(&store.inner.pool).await.map_err(|e| Failed::not_sent(store.error(op, e)))
        }
    }

    async fn execute<'a>(
        store: &'a SqliteStore,
        op: &'static str,
        sql: &'a SqlStr,
        args: impl IntoIterator<Item = Value<'a>> + Send + 'a,
    ) -> Result<u64, Failed> {
        store.count();
        Ok(store.write(op, sql, args, Want::Count).await?.changed)
    }

    fn execute_in<'a>(
        store: &'a SqliteStore,
        tx: &'a mut Transaction<'static, Sqlite>,
        op: &'static str,
        sql: &'a SqlStr,
        args: impl IntoIterator<Item = Value<'a>> + Send + 'a,
    ) -> impl Future<Output = Result<u64, Error>> + Send + 'a {
        let q = Sqlite::query(sql, args);
        async move {
            store.count();
            let done = q.execute(&mut **tx).await.map_err(|e| store.error(op, e))?;
            Ok(done.rows_affected())
        }
    }

    async fn close(store: &SqliteStore) {
        store.close_writes().await;
    }

    async fn begin(store: &SqliteStore) -> Result<Transaction<'static, Sqlite>, Error> {
        store.inner.pool.begin_with("BEGIN IMMEDIATE").await.map_err(|e| store.error("begin", e))
    }

    fn renews_during_transaction(_: &SqliteStore) -> bool {
        false
    }

    async fn purge(store: &SqliteStore) -> Result<u64, Error> {
        let purge = &store.inner.purge;
        let from = purge.cursor.load(Ordering::Relaxed);
        store.count();
        let to: Option<i64> = sqlx::query_scalar(purge.range.clone())
            .bind(from)
            .fetch_one(&store.inner.pool)
            .await
            .map_err(|e| store.error("purge", e))?;
        let Some(to) = to else {
            // Past the last row: the next batch starts a new pass.
            purge.cursor.store(0, Ordering::Relaxed);
            return Ok(0);
        };
        store.count();
        let done = sqlx::query(purge.delete.clone())
            .bind(from)
            .bind(to)
            .execute(&store.inner.pool)
            .await
            .map_err(|e| store.error("purge", e))?;
        purge.cursor.store(to, Ordering::Relaxed);
        Ok(done.rows_affected())
    }

    fn recovered(row: &SqliteRow) -> Result<bool, sqlx::Error> {
        row.try_get::<i64, _>(5).map(|recovered| recovered != 0)
    }

    async fn begin_migration(store: &SqliteStore) -> Result<Transaction<'static, Sqlite>, sqlx::Error> {
        store.inner.pool.begin_with("BEGIN IMMEDIATE").await
    }

    async fn bound_migration<'a, T: Send + 'a>(
        _: &'a SqliteStore,
        _: &'static str,
        work: impl Future<Output = Result<T, Error>> + Send + 'a,
    ) -> Result<T, Error> {
        // Each statement waits for the write lock up to the busy timeout already.
        work.await
    }

    async fn registered_version<'a>(
        tx: &'a mut Transaction<'static, Sqlite>,
        table: &'a Table,
    ) -> Result<Option<i64>, sqlx::Error> {
        sqlx::raw_sql(
            "CREATE TABLE IF NOT EXISTS idempotent_schema (name TEXT PRIMARY KEY NOT NULL, version INTEGER NOT NULL)",
        )
        .execute(&mut **tx)
        .await?;
        sqlx::query_scalar("SELECT version FROM idempotent_schema WHERE name = ?1")
            .bind(table.name())
            .fetch_optional(&mut **tx)
            .await
    }

    async fn register<'a>(
        tx: &'a mut Transaction<'static, Sqlite>,
        table: &'a Table,
        version: i64,
    ) -> Result<(), sqlx::Error> {
        sqlx::query("INSERT INTO idempotent_schema (name, version) VALUES (?1, ?2)")
            .bind(table.name())
            .bind(version)
            .execute(&mut **tx)
            .await
            .map(drop)
    }

    async fn exists<'a>(tx: &'a mut Transaction<'static, Sqlite>, table: &'a Table) -> Result<bool, sqlx::Error> {
        sqlx::query_scalar("SELECT count(*) > 0 FROM sqlite_master WHERE name = ?1")
            .bind(table.name())
            .fetch_one(&mut **tx)
            .await
    }

    async fn columns<'a>(
        tx: &'a mut Transaction<'static, Sqlite>,
        table: &'a Table,
    ) -> Result<Vec<String>, sqlx::Error> {
        sqlx::query_scalar("SELECT name FROM pragma_table_info(?1) ORDER BY cid")
            .bind(table.name())
            .fetch_all(&mut **tx)
            .await
    }

    fn expected_columns() -> Vec<String> {
        COLUMNS.map(str::to_owned).to_vec()
    }

    fn create_records(table: &Table) -> String {
        format!(
            "CREATE TABLE {table} (\n\
             key BLOB PRIMARY KEY NOT NULL CHECK (length(key) = 32),\n\
             fingerprint BLOB NOT NULL,\n\
             state TEXT NOT NULL CHECK (state IN ('running', 'released', 'done', 'needs_attention')),\n\
             token TEXT NOT NULL,\n\
             fence INTEGER NOT NULL,\n\
             attempt INTEGER NOT NULL,\n\
             recovered INTEGER NOT NULL,\n\
             lease_until INTEGER NOT NULL,\n\
             expires_at INTEGER NOT NULL,\n\
             result BLOB,\n\
             step text NOT NULL DEFAULT '',\n\
             run_id text,\n\
             tenant text,\n\
             created_at bigint NOT NULL DEFAULT 0,\n\
             updated_at bigint NOT NULL DEFAULT 0\n\
             )"
        )
    }

    fn create_state(table: &Table) -> String {
        format!(
            "CREATE TABLE {table} (\n\
             scope BLOB PRIMARY KEY NOT NULL CHECK (length(scope) = 32),\n\
             tenant TEXT,\n\
             name TEXT NOT NULL,\n\
             version INTEGER NOT NULL CHECK (version > 0),\n\
             value BLOB NOT NULL,\n\
             tokens BLOB NOT NULL\n\
             )"
        )
    }

    fn state_missing(e: &dyn DatabaseError) -> bool {
        e.message().contains("no such table") || e.message().contains("no such column")
    }
}
