//! The SQLite store, on sqlx: one file, shared by the tasks of a process and by the processes of
//! one host.
//!
//! # Schema (version 3)
//!
//! One row per key, in a table named by [`SqliteStoreBuilder::table`] (`idempotent_records`
//! unless set):
//!
//! | column | type | meaning |
//! |---|---|---|
//! | `key` | `BLOB PRIMARY KEY` | the key's 32 bytes |
//! | `fingerprint` | `BLOB` | the payload's 32 bytes |
//! | `state` | `TEXT` | `running`, `released`, `done` or `needs_attention` |
//! | `token` | `TEXT` | owner token of the last acquisition (kept when done, released or needing attention, so that a repeated complete, release or abandon by it is acknowledged) |
//! | `fence` | `INTEGER` | fencing token of the last acquisition |
//! | `attempt` | `INTEGER` | its attempt number |
//! | `recovered` | `INTEGER` | running: 1 when it took over a lease that ran out; released: 1 when the release was uncertain ([`Abandon::Uncertain`]), so the next acquisition is recovered |
//! | `lease_until` | `INTEGER` | lease deadline, µs since the Unix epoch |
//! | `expires_at` | `INTEGER` | when the row counts as absent, µs since the Unix epoch; `i64::MAX` (never) while it needs attention |
//! | `result` | `BLOB` | the stored outcome, when done |
//! | `step` | `TEXT` | the acquisition's step ([`Labels`]); `''` when none was given |
//! | `run_id`, `tenant` | `TEXT` | its run id and tenant, or `NULL` |
//! | `created_at` | `INTEGER` | when the row's current life began (its first acquisition since it was absent), µs since the Unix epoch |
//! | `updated_at` | `INTEGER` | when it last changed, µs since the Unix epoch |
//!
//! and a table `idempotent_schema (name, version)` saying which tables this crate created and
//! at which version.
//!
//! A table of version 2 (before labels and times) is upgraded in place by `migrate`, in its
//! immediate transaction: `ALTER TABLE … ADD COLUMN` for each new column (no copy), and the rows'
//! `created_at` and `updated_at` set to their fence (the clock of their last acquisition). A
//! table of version 1 (before `needs_attention`) is upgraded to version 3 at once: SQLite cannot
//! change a `CHECK` constraint, so the rows are copied into a new table, which takes the old
//! one's name (a one-time cost of one pass over the table). Version 1's `recovered` on a released
//! row said whether that attempt had taken over a lease, so it is cleared. Upgrade every process
//! on the file together: one still on version 1 answers an error (fails closed) on a record that
//! needs attention, and ignores the uncertain mark of a released one; one on version 2 refuses
//! the table (its column check fails) until it is upgraded.
//!
//! There is no index besides the primary key: the acquire upsert sets every column (to its own
//! value when nothing changes), and SQLite rewrites the entries of every index on a column it
//! sets, so an index on `expires_at` (for the purge) or on `run_id` (for scans by run) would make
//! every upsert that finds the key taken write to the WAL and sync. The purge sweeps by `rowid`
//! instead, and a scan by run filters in key order.
//!
//! # Statements
//!
//! Every call of the [`Store`] trait is one statement in autocommit (acquire: one or two), so one
//! atomic transaction with its own connection from the pool, given back before the answer is:
//!
//! - acquire: the one atomic write statement that takes the key: `INSERT … ON CONFLICT(key) DO
//!   UPDATE SET <each column> = CASE WHEN <free> THEN <new value> ELSE <old value> END RETURNING
//!   …`, which judges "free" on the row as it is under the write lock. The row comes back whatever
//!   happened, and the returned token tells the outcome: ours, the key was taken; another's, the
//!   row says replay, in flight, needs attention or mismatch. Where nothing changes, SQLite finds
//!   the row's bytes equal and writes no page.
//!
//!   But a write statement takes the file's one write lock (and the WAL-index locks) even when it
//!   changes nothing, so with the upsert alone replays queue behind each other and behind every
//!   first execution (`BENCHMARKS.md` measured that at 0.4–0.5× a plain `SELECT`). So after a run
//!   of answers the existing row decided (replays, mostly), acquire reads first: `SELECT … WHERE
//!   key = ?1 AND expires_at > now`, a read transaction that takes no write lock. A row of another
//!   payload, or done, needing attention, or running on a lease that has not run out, is the
//!   answer, as it stood at the read's snapshot: a replay is this one read. Anything else (the key
//!   is absent, expired, released, or its lease ran out) and the upsert runs. Which one goes first
//!   is learnt from the store's recent answers (`AcquireOrder` in `store/acquire_order.rs`, shared with
//!   `PostgresStore`): a store whose calls are mostly first executions runs 2 statements for
//!   each, and one serving retries 1 read for each replay. No single statement can do both:
//!   SQLite takes the write lock when a write statement starts, whatever it then writes.
//! - complete, release, renew: `UPDATE … WHERE key = ? AND token = ? AND state IN (…) AND
//!   expires_at > now`; a repeat by the token that completed (or released) matches its own done
//!   (released) row and changes nothing, so it is acknowledged. Release writes `recovered =
//!   false`, so that a repeated clean release does not match an uncertain one.
//! - abandon: the same `UPDATE`, to `released` with `recovered` set ([`Abandon::Uncertain`]), or to
//!   `needs_attention` with `expires_at` never ([`Abandon::NeedsAttention`]); a repeat with the
//!   same mark matches its own row. A late complete by the marked attempt finds neither
//!   `running` nor `done`, and is refused.
//! - resolve: `UPDATE … SET state = ?2, result = ?3, expires_at = now + ?4 WHERE key = ?1 AND state =
//!   'needs_attention'`: of two resolves at once, the second finds the row settled and changes
//!   nothing ([`Resolved::Unchanged`]).
//! - inspect, scan, release_fenced, delete: the statements `PostgresStore` runs too (their text is
//!   shared): see [`Store::scan`] and the module docs of `PostgresStore`. Acquire writes the
//!   labels and times in its one statement above (a row that lives on keeps its labels and
//!   `created_at`); every other transition that changes the row sets `updated_at`.
//!
//! [`SqliteStore::statements`] counts them: a first execution is 2 (acquire's upsert, complete),
//! a replay 1; a first execution right after a run of replays 3 (acquire's read, its upsert,
//! complete) (`tests/tests/sqlite_store.rs` asserts all three, that replays leave the WAL as it
//! was, and that a replay read first answers while another connection holds the write lock).
//!
//! # Transactions
//!
//! The store is a [`TransactionalStore`], for steps whose writes commit with their record
//! ([`Step::run_in_transaction`](crate::Step::run_in_transaction)): [`begin`](TransactionalStore::begin)
//! is `BEGIN IMMEDIATE` on a connection of the store's pool, and
//! [`complete_in`](TransactionalStore::complete_in) the complete statement above, run in that
//! transaction (and counted in [`statements`](SqliteStore::statements)); the lease is not renewed
//! while the transaction holds the file's write lock. The business tables must be in the same
//! file: write them through the step's transaction, and elsewhere through
//! [`SqliteStore::pool`], or open the store on the application's pool with
//! [`SqliteStore::from_pool`].
//!
//! An acquire dropped before it answered (a timeout around the step) goes on in a task of its own
//! until its statement has ended, then releases the key if it took it, so that the key is not
//! held for a lease that nobody runs under.
//!
//! Time is the database's: `unixepoch('subsec')` read inside each statement (SQLite keeps it
//! fixed for the statement), which for a file on one host is the host clock, never the caller's
//! `Instant`. Fences are `max(previous fence + 1, now in µs)`, so they grow per key also after the
//! row was purged, unless the host clock steps back further than the time since the key's last
//! acquisition.
//!
//! # Purging
//!
//! `expires_at` is the record's expiry as the record protocol sets it
//! ([retention](crate::record#retention)); `i64::MAX` while the row needs attention, so that no
//! purge deletes it.
//! An expired row counts as absent at once (acquire takes it over, the fence still grows); it is
//! deleted by a sweep that walks the table in `rowid` order, 256 rows per batch, one batch for
//! every 64 acquisitions of a store (in a background task), so a sweep costs a bounded amount per
//! acquisition and a full pass ends before the table has grown by a quarter; expired rows are at
//! most a third of the live ones. [`SqliteStore::purge`] runs a batch by hand.
//!
//! # Durability
//!
//! The file is in WAL mode with `synchronous = FULL`: each commit is synced before it is
//! answered. With `NORMAL`, a power loss or OS crash can undo the last commits, and for this store
//! an undone `done` means the action runs again on the retry: exactly what it is there to
//! prevent. A replay commits nothing, so it does not sync.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteRow, SqliteSynchronous,
};
use sqlx::{AssertSqlSafe, Row, SqlSafeStr, SqlStr};

use super::admin::{Cursor, Deleted, Filter, Page, RecordInfo};
use super::sql::{
    AcquireCall, AdminSql, Arg, CommitsWith, Found, NEVER_US, OwnedLabels, ScanArg, TransactionalStore, V3_COLUMNS,
    acquire_read_sql, deleted, micros, page, read_record, resolved_row, upgrade_v2_sql,
};
use super::{AcquireOrder, BoxFuture, Store};
use crate::error::{BoxError, Error};
use crate::key::{Fingerprint, Key};
use crate::record::{Abandon, Acquire, Labels, Resolution, Resolved, Token, Transition};

/// The schema version this crate writes and reads.
const SCHEMA_VERSION: i64 = 3;
/// The version before, which `migrate` upgrades: it had no labels and no times.
const SCHEMA_V2: i64 = 2;
/// The version before that, which `migrate` upgrades too: it had no `needs_attention` state.
const SCHEMA_V1: i64 = 1;
/// Rows examined per purge batch.
const PURGE_BATCH: i64 = 256;
/// Acquisitions of one store between two purge batches.
const PURGE_EVERY: u64 = 64;
/// The database clock in µs since the Unix epoch, read inside a statement.
const NOW_US: &str = "CAST(unixepoch('subsec') * 1000000 AS INTEGER)";
/// The columns of a table of schema versions 1 and 2, in the order `migrate` created them;
/// version 3 adds [`V3_COLUMNS`] after them.
const V2_COLUMNS: [&str; 10] =
    ["key", "fingerprint", "state", "token", "fence", "attempt", "recovered", "lease_until", "expires_at", "result"];

/// The columns of a table of schema version 3, in order.
fn v3_columns() -> Vec<&'static str> {
    V2_COLUMNS.into_iter().chain(V3_COLUMNS.map(|(name, _)| name)).collect()
}

/// A store in one SQLite file, safe for many tasks and for several processes on one host.
///
/// See the [module documentation](self) for the schema, the statements and the durability
/// choices. Clones share the same pool.
///
/// ```
/// use idempotent_core::{RunContext, SqliteStore};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), idempotent_core::Error> {
/// let path = std::env::temp_dir().join(format!("idempotent-doc-{}.db", std::process::id()));
/// let store = SqliteStore::open(&path).await?;
/// let ctx = RunContext::new(store.clone(), "run-1");
/// let n: u32 = ctx.step("count").run(&(), |_| async { Ok::<_, idempotent_core::Error>(7) }).await?;
/// assert_eq!(n, 7);
/// assert_eq!(store.describe(), format!("sqlite://{}", path.display()));
/// # store.close().await;
/// # for suffix in ["", "-wal", "-shm"] { let _ = std::fs::remove_file(format!("{}{suffix}", path.display())); }
/// # Ok(()) }
/// # use idempotent_core::Store;
/// ```
#[derive(Clone)]
pub struct SqliteStore {
    inner: Arc<Inner>,
}

struct Inner {
    pool: SqlitePool,
    describe: String,
    table: String,
    busy_timeout: Duration,
    sql: Statements,
    acquisitions: AtomicU64,
    statements: AtomicU64,
    /// Whether acquire reads first.
    order: AcquireOrder,
    purging: AtomicBool,
    /// The last rowid the sweep examined (0: start a new pass).
    purge_cursor: AtomicI64,
}

struct Statements {
    /// acquire's read, when it reads first ([`AcquireOrder`]).
    acquire_read: SqlStr,
    acquire: SqlStr,
    complete: SqlStr,
    release: SqlStr,
    renew: SqlStr,
    abandon_uncertain: SqlStr,
    abandon_attention: SqlStr,
    resolve: SqlStr,
    purge_range: SqlStr,
    purge_delete: SqlStr,
    admin: AdminSql,
}

impl Statements {
    fn new(table: &str) -> Self {
        let t = format!("\"{table}\"");
        // The existing row is `r`; `excluded` the row acquire would insert, whose `fence` column
        // holds the database clock (so `excluded.fence` is "now" throughout the statement).
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
        let acquire = format!(
            "INSERT INTO {t} AS r ({cols})\n\
             SELECT ?1, ?2, 'running', ?3, now, 1, 0, now + ?4, now + ?5, NULL, ?6, ?7, ?8, now, now\n\
             FROM (SELECT {NOW_US} AS now)\n\
             WHERE true\n\
             ON CONFLICT(key) DO UPDATE SET\n  {set}\n\
             RETURNING token, fingerprint, state, fence, attempt, recovered, lease_until - {NOW_US}, result",
            cols = v3_columns().join(", "),
        );
        // The columns of acquire's `RETURNING`; `decides` tells whether the row is the answer.
        let acquire_read = acquire_read_sql(table, NOW_US);
        let owned = format!("key = ?1 AND token = ?2 AND expires_at > {NOW_US}");
        // A repeat by the same token (its row already in the state it asks for) changes nothing.
        let touched = format!("updated_at = CASE WHEN state = 'running' THEN {NOW_US} ELSE updated_at END");
        let complete = format!(
            "UPDATE {t} SET result = CASE WHEN state = 'done' THEN result ELSE ?3 END,\n\
             expires_at = CASE WHEN state = 'done' THEN expires_at ELSE {NOW_US} + ?4 END,\n\
             updated_at = CASE WHEN state = 'done' THEN updated_at ELSE {NOW_US} END,\n\
             state = 'done'\n\
             WHERE {owned} AND state IN ('running', 'done')"
        );
        let release = format!(
            "UPDATE {t} SET state = 'released', recovered = 0, {touched}\n\
             WHERE {owned} AND (state = 'running' OR (state = 'released' AND recovered = 0))"
        );
        let abandon_uncertain = format!(
            "UPDATE {t} SET state = 'released', recovered = 1, {touched}\n\
             WHERE {owned} AND (state = 'running' OR (state = 'released' AND recovered = 1))"
        );
        let abandon_attention = format!(
            "UPDATE {t} SET state = 'needs_attention', expires_at = {NEVER_US}, {touched}\n\
             WHERE {owned} AND state IN ('running', 'needs_attention')"
        );
        let resolve = format!(
            "UPDATE {t} SET state = ?2, result = ?3, expires_at = {NOW_US} + ?4, recovered = 0, updated_at = {NOW_US}\n\
             WHERE key = ?1 AND state = 'needs_attention'"
        );
        let renew = format!(
            "UPDATE {t} SET lease_until = {NOW_US} + ?3, expires_at = max(expires_at, {NOW_US} + ?3), updated_at = {NOW_US}\n\
             WHERE {owned} AND state = 'running'"
        );
        let purge_range = format!(
            "SELECT max(rowid) FROM (SELECT rowid FROM {t} WHERE rowid > ?1 ORDER BY rowid LIMIT {PURGE_BATCH})"
        );
        let purge_delete = format!("DELETE FROM {t} WHERE rowid > ?1 AND rowid <= ?2 AND expires_at <= {NOW_US}");
        let sql = |s: String| AssertSqlSafe(Arc::<str>::from(s)).into_sql_str();
        Statements {
            acquire_read: sql(acquire_read),
            acquire: sql(acquire),
            complete: sql(complete),
            release: sql(release),
            renew: sql(renew),
            abandon_uncertain: sql(abandon_uncertain),
            abandon_attention: sql(abandon_attention),
            resolve: sql(resolve),
            purge_range: sql(purge_range),
            purge_delete: sql(purge_delete),
            admin: AdminSql::new(table, NOW_US),
        }
    }
}

/// Settings of a [`SqliteStore`], from [`SqliteStore::builder`].
#[derive(Debug, Clone)]
pub struct SqliteStoreBuilder {
    path: PathBuf,
    table: String,
    busy_timeout: Duration,
    max_connections: u32,
}

impl SqliteStoreBuilder {
    /// The table holding the records (default `idempotent_records`): an identifier of ASCII
    /// letters, digits and `_`, not starting with a digit or `sqlite_`, at most 64 characters.
    pub fn table(mut self, name: impl Into<String>) -> Self {
        self.table = name.into();
        self
    }

    /// How long a statement waits for another connection's (or process's) write lock, and a
    /// call for a connection from the pool, before failing with [`Error::Timeout`] (default 5 s).
    pub fn busy_timeout(mut self, timeout: Duration) -> Self {
        self.busy_timeout = timeout;
        self
    }

    /// The most connections the store opens on the file (default 8; at least 1).
    pub fn max_connections(mut self, n: u32) -> Self {
        self.max_connections = n.max(1);
        self
    }

    /// Opens (creating if missing) the file and creates or checks the table
    /// ([`SqliteStore::migrate`]).
    ///
    /// Fails with [`Error::Config`] for an invalid table name or an incompatible existing table,
    /// and with [`Error::Unavailable`] or [`Error::Timeout`] (op `open`) when the file cannot be
    /// opened.
    pub async fn open(self) -> Result<SqliteStore, Error> {
        validate_table(&self.table)?;
        let describe = format!("sqlite://{}", self.path.display());
        let options = SqliteConnectOptions::new()
            .filename(&self.path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Full)
            .busy_timeout(self.busy_timeout);
        let pool = SqlitePoolOptions::new()
            .max_connections(self.max_connections)
            .min_connections(0)
            .acquire_timeout(self.busy_timeout)
            // A connection to a local file does not go stale: no ping before each statement.
            .test_before_acquire(false)
            .connect_with(options)
            .await;
        let busy_timeout = self.busy_timeout;
        let pool = pool.map_err(|e| store_error(&describe, "open", busy_timeout, e))?;
        let store = SqliteStore::on(pool, describe, self.table, busy_timeout);
        store.migrate().await?;
        Ok(store)
    }
}

/// The `CREATE TABLE` statement of schema version 3 for a table named `table`: the columns of
/// version 2, then [`V3_COLUMNS`], in the order an upgrade from version 2 leaves them.
fn create_table(table: &str) -> String {
    let v3: String = V3_COLUMNS.iter().map(|(name, decl)| format!(",\n{name} {decl}")).collect();
    format!(
        "CREATE TABLE \"{table}\" (\n\
         key BLOB PRIMARY KEY NOT NULL CHECK (length(key) = 32),\n\
         fingerprint BLOB NOT NULL,\n\
         state TEXT NOT NULL CHECK (state IN ('running', 'released', 'done', 'needs_attention')),\n\
         token TEXT NOT NULL,\n\
         fence INTEGER NOT NULL,\n\
         attempt INTEGER NOT NULL,\n\
         recovered INTEGER NOT NULL,\n\
         lease_until INTEGER NOT NULL,\n\
         expires_at INTEGER NOT NULL,\n\
         result BLOB{v3}\n\
         )"
    )
}

fn validate_table(name: &str) -> Result<(), Error> {
    let mut chars = name.chars();
    let ok = chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
        && name.len() <= 64
        && !name.to_ascii_lowercase().starts_with("sqlite_")
        && !name.eq_ignore_ascii_case("idempotent_schema");
    if ok {
        Ok(())
    } else {
        Err(Error::Config(format!(
            "SQLite table name {name:?} is not a plain identifier (ASCII letters, digits and `_`, not starting with \
             a digit or `sqlite_`, at most 64 characters, not `idempotent_schema`); choose another with \
             SqliteStoreBuilder::table"
        )))
    }
}

impl SqliteStore {
    /// Opens the store in the file at `path` with the default settings (see [`SqliteStore::builder`]).
    pub async fn open(path: impl AsRef<Path>) -> Result<SqliteStore, Error> {
        SqliteStore::builder(path).open().await
    }

    /// A store on an application's own pool, with its records in `table` (created if missing,
    /// or checked, as [`migrate`](Self::migrate) does): the application's queries, the store's
    /// statements and the transactions of [`Step::run_in_transaction`](crate::Step::run_in_transaction)
    /// then share one pool and one file.
    ///
    /// The pool's settings are kept as they are (its size, its timeouts, its `busy_timeout`), with
    /// one requirement: its connections sync every commit (`synchronous = FULL` or `EXTRA`; sqlx's
    /// default is `FULL`). With `NORMAL` or `OFF` a power loss can undo a committed `done`, and the
    /// step runs again: that is an [`Error::Config`] saying how to set it. WAL mode
    /// (`SqliteConnectOptions::journal_mode(SqliteJournalMode::Wal)`) is advised, not required: in
    /// the rollback journal a reader blocks the writers' commits.
    ///
    /// ```
    /// use idempotent_core::SqliteStore;
    /// use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let dir = std::env::temp_dir().join(format!("idempotent-doc-pool-{}", std::process::id()));
    /// # std::fs::create_dir_all(&dir)?;
    /// let options = SqliteConnectOptions::new()
    ///     .filename(dir.join("app.db"))
    ///     .create_if_missing(true)
    ///     .journal_mode(SqliteJournalMode::Wal);
    /// let pool = SqlitePoolOptions::new().connect_with(options).await?;
    /// let store = SqliteStore::from_pool(pool.clone(), "idempotent_records").await?;
    /// assert!(store.pool().size() >= 1);
    /// # pool.close().await;
    /// # std::fs::remove_dir_all(&dir)?;
    /// # Ok(()) }
    /// ```
    pub async fn from_pool(pool: SqlitePool, table: impl Into<String>) -> Result<SqliteStore, Error> {
        let table = table.into();
        validate_table(&table)?;
        let describe = format!("sqlite://{}", pool.connect_options().get_filename().display());
        // Until the pool's own busy timeout is read: sqlx's default.
        let mut busy_timeout = Duration::from_secs(5);
        let err = |busy_timeout, e| store_error(&describe, "open", busy_timeout, e);
        let mut conn = pool.acquire().await.map_err(|e| err(busy_timeout, e))?;
        let busy_ms: i64 =
            sqlx::query_scalar("PRAGMA busy_timeout").fetch_one(&mut *conn).await.map_err(|e| err(busy_timeout, e))?;
        busy_timeout = Duration::from_millis(busy_ms.max(0).unsigned_abs());
        let synchronous: i64 =
            sqlx::query_scalar("PRAGMA synchronous").fetch_one(&mut *conn).await.map_err(|e| err(busy_timeout, e))?;
        drop(conn);
        // 2 is FULL, 3 EXTRA.
        if synchronous < 2 {
            let mode = if synchronous == 1 { "NORMAL" } else { "OFF" };
            return Err(Error::Config(format!(
                "{describe}: the pool's connections run with synchronous = {mode}, so a power loss or OS crash can \
                 undo the last commits, and an undone `done` makes the step run again; open the pool with \
                 SqliteConnectOptions::synchronous(SqliteSynchronous::Full)"
            )));
        }
        let store = SqliteStore::on(pool, describe, table, busy_timeout);
        store.migrate().await?;
        Ok(store)
    }

    fn on(pool: SqlitePool, describe: String, table: String, busy_timeout: Duration) -> SqliteStore {
        SqliteStore {
            inner: Arc::new(Inner {
                pool,
                describe,
                sql: Statements::new(&table),
                table,
                busy_timeout,
                acquisitions: AtomicU64::new(0),
                statements: AtomicU64::new(0),
                order: AcquireOrder::default(),
                purging: AtomicBool::new(false),
                purge_cursor: AtomicI64::new(0),
            }),
        }
    }

    /// The store's pool: for the application's own queries on the same file (its business
    /// tables), so that one pool serves both.
    pub fn pool(&self) -> &SqlitePool {
        &self.inner.pool
    }

    /// Settings for a store in the file at `path` (created if missing).
    pub fn builder(path: impl AsRef<Path>) -> SqliteStoreBuilder {
        SqliteStoreBuilder {
            path: path.as_ref().to_owned(),
            table: "idempotent_records".to_owned(),
            busy_timeout: Duration::from_secs(5),
            max_connections: 8,
        }
    }

    /// Creates the table if it is missing, or checks that it is the one this crate creates.
    ///
    /// [`open`](Self::open) runs it already; running it again changes nothing. An existing table
    /// this crate did not create, or of another schema version, is an [`Error::Config`] saying what
    /// to do: it is never altered.
    pub async fn migrate(&self) -> Result<(), Error> {
        let table = self.inner.table.clone();
        self.migrate_table(&table).await
    }

    async fn migrate_table(&self, table: &str) -> Result<(), Error> {
        self.in_migration(async |conn| self.migrate_in(conn, table).await).await
    }

    /// Runs `work` in one immediate transaction (committed if it succeeds, rolled back if not),
    /// so that processes opening the file at once do not both create a table.
    pub(crate) async fn in_migration(
        &self,
        work: impl AsyncFnOnce(&mut sqlx::SqliteConnection) -> Result<(), Error>,
    ) -> Result<(), Error> {
        let err = |e: sqlx::Error| self.error("migrate", e);
        let mut conn = self.inner.pool.acquire().await.map_err(err)?;
        sqlx::raw_sql("BEGIN IMMEDIATE").execute(&mut *conn).await.map_err(err)?;
        let outcome = work(&mut conn).await;
        let end = if outcome.is_ok() { "COMMIT" } else { "ROLLBACK" };
        let ended = sqlx::raw_sql(end).execute(&mut *conn).await.map_err(err);
        outcome.and(ended.map(drop))
    }

    async fn migrate_in(&self, conn: &mut sqlx::SqliteConnection, table: &str) -> Result<(), Error> {
        let err = |e: sqlx::Error| self.error("migrate", e);
        let version = registered_version(conn, table).await.map_err(err)?;
        let columns: Vec<String> = sqlx::query_scalar("SELECT name FROM pragma_table_info(?1) ORDER BY cid")
            .bind(table)
            .fetch_all(&mut *conn)
            .await
            .map_err(err)?;
        let path = &self.inner.describe;
        let expected: Vec<&str> = match version {
            Some(SCHEMA_VERSION) => v3_columns(),
            _ => V2_COLUMNS.to_vec(),
        };
        match version {
            Some(SCHEMA_VERSION) if columns == expected => Ok(()),
            Some(SCHEMA_V2) if columns == expected => self.upgrade_v2(conn, table).await,
            Some(SCHEMA_V1) if columns == expected => self.upgrade_v1(conn, table).await,
            Some(v @ (SCHEMA_VERSION | SCHEMA_V2 | SCHEMA_V1)) => Err(Error::Config(format!(
                "{path}: table `{table}` is marked as idempotent schema version {v} but has the columns \
                 {columns:?} instead of {expected:?}; it was changed by hand. Restore it, or drop it and its row in \
                 idempotent_schema (losing its records), or choose another table with SqliteStoreBuilder::table"
            ))),
            Some(v) => Err(Error::Config(format!(
                "{path}: table `{table}` has idempotent schema version {v}, and this version of idempotent-core reads \
                 versions {SCHEMA_V1} and {SCHEMA_V2} (upgraded in place) and {SCHEMA_VERSION} only; use the \
                 idempotent-core that wrote it, or choose another table with SqliteStoreBuilder::table"
            ))),
            None if !columns.is_empty() => Err(Error::Config(format!(
                "{path}: table `{table}` exists (columns {columns:?}) but was not created by idempotent-core; it was \
                 left as it is. Choose another table with SqliteStoreBuilder::table, or drop that one"
            ))),
            None => {
                sqlx::raw_sql(AssertSqlSafe(create_table(table))).execute(&mut *conn).await.map_err(err)?;
                sqlx::query("INSERT INTO idempotent_schema (name, version) VALUES (?1, ?2)")
                    .bind(table)
                    .bind(SCHEMA_VERSION)
                    .execute(&mut *conn)
                    .await
                    .map_err(err)?;
                Ok(())
            }
        }
    }

    /// Upgrades `table` from schema version 1, inside `migrate`'s transaction, to version 3 at
    /// once: version 2 allowed the state `needs_attention`, and reads a released row's
    /// `recovered` as "released uncertain" (version 1 left there whether the released attempt had
    /// taken over a lease, so it is cleared). SQLite cannot change a `CHECK` constraint in place,
    /// so the table is copied into a new one of version 3 (no labels; times as in
    /// [`upgrade_v2_sql`]), which then takes its name.
    async fn upgrade_v1(&self, conn: &mut sqlx::SqliteConnection, table: &str) -> Result<(), Error> {
        let err = |e: sqlx::Error| self.error("migrate", e);
        let new = format!("{table}__idempotent_v{SCHEMA_VERSION}");
        let copy = format!(
            "{create};\n\
             INSERT INTO \"{new}\" ({cols}, created_at, updated_at)\n\
             SELECT key, fingerprint, state, token, fence, attempt, CASE WHEN state = 'released' THEN 0 ELSE recovered \
             END, lease_until, expires_at, result, fence, fence FROM \"{table}\" ORDER BY rowid;\n\
             DROP TABLE \"{table}\";\n\
             ALTER TABLE \"{new}\" RENAME TO \"{table}\"",
            create = create_table(&new),
            cols = V2_COLUMNS.join(", "),
        );
        sqlx::raw_sql(AssertSqlSafe(copy)).execute(&mut *conn).await.map_err(err)?;
        self.set_version(conn, table, SCHEMA_V1).await
    }

    /// Upgrades `table` from schema version 2, inside `migrate`'s transaction: `ALTER TABLE … ADD
    /// COLUMN` for each of [`V3_COLUMNS`] (in place, no copy), and the rows' times from their
    /// fences ([`upgrade_v2_sql`]).
    async fn upgrade_v2(&self, conn: &mut sqlx::SqliteConnection, table: &str) -> Result<(), Error> {
        let err = |e: sqlx::Error| self.error("migrate", e);
        sqlx::raw_sql(AssertSqlSafe(upgrade_v2_sql(table))).execute(&mut *conn).await.map_err(err)?;
        self.set_version(conn, table, SCHEMA_V2).await
    }

    /// Marks `table`, upgraded from version `from`, as of [`SCHEMA_VERSION`].
    async fn set_version(&self, conn: &mut sqlx::SqliteConnection, table: &str, from: i64) -> Result<(), Error> {
        let err = |e: sqlx::Error| self.error("migrate", e);
        sqlx::query("UPDATE idempotent_schema SET version = ?2 WHERE name = ?1")
            .bind(table)
            .bind(SCHEMA_VERSION)
            .execute(&mut *conn)
            .await
            .map_err(err)?;
        tracing::info!(store = %self.inner.describe, table, from, "idempotent.sqlite: upgraded the table to schema version {SCHEMA_VERSION}");
        Ok(())
    }

    /// The number of statements this store (and its clones) ran for the [`Store`] calls,
    /// [`complete_in`](TransactionalStore::complete_in) and purges since it was opened (not
    /// counting [`open`](Self::open), `migrate`, nor a transaction's `BEGIN` and `COMMIT`).
    pub fn statements(&self) -> u64 {
        self.inner.statements.load(Ordering::Relaxed)
    }

    /// Runs one purge batch: deletes the expired rows among the next 256 of the table (in
    /// `rowid` order, starting over after the last), and answers how many it deleted. The store
    /// runs one every 64 acquisitions on its own.
    pub async fn purge(&self) -> Result<u64, Error> {
        let inner = &self.inner;
        let from = inner.purge_cursor.load(Ordering::Relaxed);
        inner.statements.fetch_add(1, Ordering::Relaxed);
        let to: Option<i64> = sqlx::query_scalar(inner.sql.purge_range.clone())
            .bind(from)
            .fetch_one(&inner.pool)
            .await
            .map_err(|e| self.error("purge", e))?;
        let Some(to) = to else {
            // Past the last row: the next batch starts a new pass.
            inner.purge_cursor.store(0, Ordering::Relaxed);
            return Ok(0);
        };
        inner.statements.fetch_add(1, Ordering::Relaxed);
        let done = sqlx::query(inner.sql.purge_delete.clone())
            .bind(from)
            .bind(to)
            .execute(&inner.pool)
            .await
            .map_err(|e| self.error("purge", e))?;
        inner.purge_cursor.store(to, Ordering::Relaxed);
        Ok(done.rows_affected())
    }

    /// Closes the pool's connections, waiting for the calls under way.
    pub async fn close(&self) {
        self.inner.pool.close().await;
    }

    /// For the state store (`crate::state`): the records' table (its state table is named
    /// after it), the timeout of a call, and the store's mapping of driver errors.
    pub(crate) fn state_parts(&self) -> (&str, Duration) {
        (&self.inner.table, self.inner.busy_timeout)
    }

    /// The store's error for `e` during `op` (see [`state_parts`](Self::state_parts)).
    pub(crate) fn state_error(&self, op: &'static str, e: sqlx::Error) -> Error {
        self.error(op, e)
    }

    fn error(&self, op: &'static str, e: sqlx::Error) -> Error {
        store_error(&self.inner.describe, op, self.inner.busy_timeout, e)
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

    async fn acquire_now(
        &self,
        key: &Key,
        fp: &Fingerprint,
        lease: Duration,
        retention: Duration,
        labels: &OwnedLabels,
    ) -> Result<Acquire, Error> {
        let token = Token::unique();
        let inner = &self.inner;
        if inner.order.read_first() {
            // A replay (or another answer the row decides) is this read, and takes no write lock.
            inner.statements.fetch_add(1, Ordering::Relaxed);
            let row = sqlx::query(inner.sql.acquire_read.clone())
                .bind(&key.as_bytes()[..])
                .fetch_optional(&inner.pool)
                .await
                .map_err(|e| self.error("acquire", e))?;
            if let Some(row) = row {
                let found = read_found(key, &row)?;
                if found.decides(fp) {
                    // Another attempt's row (the token is fresh): never `Acquired`.
                    return found.judge(key, fp, &token);
                }
            }
        }
        inner.statements.fetch_add(1, Ordering::Relaxed);
        let row = sqlx::query(inner.sql.acquire.clone())
            .bind(&key.as_bytes()[..])
            .bind(&fp.as_bytes()[..])
            .bind(token.as_str())
            .bind(micros(lease))
            .bind(micros(lease.max(retention)))
            .bind(labels.step.as_str())
            .bind(labels.run.as_deref())
            .bind(labels.tenant.as_deref())
            .fetch_one(&inner.pool)
            .await
            .map_err(|e| self.error("acquire", e))?;
        let answer = read_acquire(key, fp, &token, &row)?;
        if matches!(answer, Acquire::Acquired(_)) {
            self.maybe_purge();
        }
        Ok(answer)
    }

    async fn transition(
        &self,
        op: &'static str,
        sql: &SqlStr,
        key: &Key,
        token: &Token,
        arg: Option<Arg>,
    ) -> Result<Transition, Error> {
        let done = self.transition_query(sql, key, token, arg).execute(&self.inner.pool).await;
        Ok(transition_of(done.map_err(|e| self.error(op, e))?))
    }

    /// One of the conditional `UPDATE`s with its arguments bound, counted in
    /// [`statements`](Self::statements).
    fn transition_query<'q>(
        &self,
        sql: &SqlStr,
        key: &'q Key,
        token: &'q Token,
        arg: Option<Arg>,
    ) -> sqlx::query::Query<'q, sqlx::Sqlite, sqlx::sqlite::SqliteArguments> {
        self.inner.statements.fetch_add(1, Ordering::Relaxed);
        let q = sqlx::query(sql.clone()).bind(&key.as_bytes()[..]).bind(token.as_str());
        match arg {
            Some(Arg::Result(result, retention)) => q.bind(result.to_vec()).bind(micros(retention)),
            Some(Arg::Lease(lease)) => q.bind(micros(lease)),
            None => q,
        }
    }
}

/// A conditional `UPDATE` changed the owner's row, or found none: another attempt holds the key.
fn transition_of(done: sqlx::sqlite::SqliteQueryResult) -> Transition {
    if done.rows_affected() == 1 { Transition::Ok } else { Transition::LeaseLost }
}

/// Tells the outcome of acquire from the row it returned.
fn read_acquire(key: &Key, fp: &Fingerprint, token: &Token, row: &SqliteRow) -> Result<Acquire, Error> {
    read_found(key, row)?.judge(key, fp, token)
}

/// The row of acquire's read or upsert, or [`Error::Corrupt`] for a column of the wrong type.
fn read_found(key: &Key, row: &SqliteRow) -> Result<Found, Error> {
    let get_err =
        |e: sqlx::Error| Error::Corrupt { key: key.short(), detail: format!("a column has the wrong type: {e}") };
    Ok(Found {
        token: row.try_get(0).map_err(get_err)?,
        fingerprint: row.try_get(1).map_err(get_err)?,
        state: row.try_get(2).map_err(get_err)?,
        fence: row.try_get(3).map_err(get_err)?,
        attempt: row.try_get(4).map_err(get_err)?,
        recovered: row.try_get::<i64, _>(5).map_err(get_err)? != 0,
        left_us: row.try_get(6).map_err(get_err)?,
        result: row.try_get(7).map_err(get_err)?,
    })
}

fn store_error(describe: &str, op: &'static str, busy_timeout: Duration, e: sqlx::Error) -> Error {
    let busy = match &e {
        sqlx::Error::PoolTimedOut => true,
        // SQLITE_BUSY (5) and SQLITE_LOCKED (6), with their extended codes.
        sqlx::Error::Database(db) => {
            db.code().and_then(|c| c.parse::<i32>().ok()).is_some_and(|c| matches!(c & 0xff, 5 | 6))
        }
        _ => false,
    };
    if busy {
        return Error::Timeout { store: describe.to_owned(), op, after: busy_timeout };
    }
    Error::Unavailable { store: describe.to_owned(), op, reason: e.to_string(), source: Some(Box::new(e) as BoxError) }
}

impl Store for SqliteStore {
    fn acquire_labeled<'a>(
        &'a self,
        key: &'a Key,
        fingerprint: &'a Fingerprint,
        lease: Duration,
        retention: Duration,
        labels: Labels<'a>,
    ) -> BoxFuture<'a, Result<Acquire, Error>> {
        let store = self.clone();
        let (key, fingerprint) = (*key, *fingerprint);
        let labels = OwnedLabels::from(labels);
        let abandoned = Arc::new(AtomicBool::new(false));
        let flag = abandoned.clone();
        let work = async move {
            let answer = store.acquire_now(&key, &fingerprint, lease, retention, &labels).await;
            if let Ok(answer) = &answer {
                store.inner.order.learn(answer);
            }
            if let Ok(Acquire::Acquired(grant)) = &answer
                && flag.load(Ordering::Acquire)
            {
                // Nobody will run under this grant: give the key back rather than leave it
                // taken for a whole lease.
                if let Err(e) = store.release(&key, &grant.token).await {
                    tracing::debug!(key = %key.short(), error = %e, "idempotent.sqlite: could not release the key a dropped acquire took; the lease runs out on its own");
                }
            }
            answer
        };
        Box::pin(AcquireCall::new(abandoned, work))
    }

    fn complete<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
        result: Bytes,
        retention: Duration,
    ) -> BoxFuture<'a, Result<Transition, Error>> {
        Box::pin(self.transition(
            "complete",
            &self.inner.sql.complete,
            key,
            token,
            Some(Arg::Result(result, retention)),
        ))
    }

    fn release<'a>(&'a self, key: &'a Key, token: &'a Token) -> BoxFuture<'a, Result<Transition, Error>> {
        Box::pin(self.transition("release", &self.inner.sql.release, key, token, None))
    }

    fn renew<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
        lease: Duration,
    ) -> BoxFuture<'a, Result<Transition, Error>> {
        Box::pin(self.transition("renew", &self.inner.sql.renew, key, token, Some(Arg::Lease(lease))))
    }

    fn abandon<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
        mark: Abandon,
    ) -> BoxFuture<'a, Result<Transition, Error>> {
        let sql = match mark {
            Abandon::Uncertain => &self.inner.sql.abandon_uncertain,
            Abandon::NeedsAttention => &self.inner.sql.abandon_attention,
        };
        Box::pin(self.transition("abandon", sql, key, token, None))
    }

    fn resolve<'a>(&'a self, key: &'a Key, resolution: Resolution) -> BoxFuture<'a, Result<Resolved, Error>> {
        Box::pin(async move {
            let (state, result, keep_us) = resolved_row(resolution);
            self.inner.statements.fetch_add(1, Ordering::Relaxed);
            let done = sqlx::query(self.inner.sql.resolve.clone())
                .bind(&key.as_bytes()[..])
                .bind(state)
                .bind(result.map(|r| r.to_vec()))
                .bind(keep_us)
                .execute(&self.inner.pool)
                .await
                .map_err(|e| self.error("resolve", e))?;
            Ok(if done.rows_affected() == 1 { Resolved::Ok } else { Resolved::Unchanged })
        })
    }

    fn describe(&self) -> String {
        self.inner.describe.clone()
    }

    fn inspect<'a>(&'a self, key: &'a Key) -> BoxFuture<'a, Result<Option<RecordInfo>, Error>> {
        Box::pin(async move {
            self.inner.statements.fetch_add(1, Ordering::Relaxed);
            let row = sqlx::query(self.inner.sql.admin.inspect.clone())
                .bind(&key.as_bytes()[..])
                .fetch_optional(&self.inner.pool)
                .await
                .map_err(|e| self.error("inspect", e))?;
            row.map(|row| read_record(&row)).transpose()
        })
    }

    fn scan<'a>(&'a self, filter: &'a Filter, cursor: &'a Cursor, limit: usize) -> BoxFuture<'a, Result<Page, Error>> {
        Box::pin(async move {
            let (sql, args) = self.inner.sql.admin.scan(&self.inner.describe, filter, cursor, limit)?;
            let mut q = sqlx::query(sql);
            for arg in args {
                q = match arg {
                    ScanArg::Bytes(b) => q.bind(b),
                    ScanArg::Text(t) => q.bind(t),
                    ScanArg::Int(n) => q.bind(n),
                };
            }
            self.inner.statements.fetch_add(1, Ordering::Relaxed);
            let rows = q.fetch_all(&self.inner.pool).await.map_err(|e| self.error("scan", e))?;
            let records = rows.iter().map(read_record).collect::<Result<Vec<_>, _>>()?;
            Ok(page(records, limit))
        })
    }

    fn release_fenced<'a>(&'a self, key: &'a Key, fence: u64) -> BoxFuture<'a, Result<Resolved, Error>> {
        Box::pin(async move {
            // A fence beyond an i64 is no row's.
            let Ok(fence) = i64::try_from(fence) else { return Ok(Resolved::Unchanged) };
            self.inner.statements.fetch_add(1, Ordering::Relaxed);
            let done = sqlx::query(self.inner.sql.admin.release_fenced.clone())
                .bind(&key.as_bytes()[..])
                .bind(fence)
                .execute(&self.inner.pool)
                .await
                .map_err(|e| self.error("release_fenced", e))?;
            Ok(if done.rows_affected() == 1 { Resolved::Ok } else { Resolved::Unchanged })
        })
    }

    fn delete<'a>(&'a self, key: &'a Key) -> BoxFuture<'a, Result<Deleted, Error>> {
        Box::pin(async move {
            self.inner.statements.fetch_add(1, Ordering::Relaxed);
            let kept: Option<bool> = sqlx::query_scalar(self.inner.sql.admin.delete.clone())
                .bind(&key.as_bytes()[..])
                .fetch_optional(&self.inner.pool)
                .await
                .map_err(|e| self.error("delete", e))?;
            Ok(deleted(kept))
        })
    }

    fn kind(&self) -> &'static str {
        "sqlite"
    }
}

/// Transactions begin with `BEGIN IMMEDIATE`, which takes the file's write lock at once (waiting
/// up to the busy timeout for it): a deferred `BEGIN` would take it at the first write, and fail
/// there with `SQLITE_BUSY` when another connection wrote since the transaction's first read. The
/// lock is held until the commit, so the lease is not renewed meanwhile (a renewal from another
/// connection would wait for that very lock) and no other attempt can take the key over either.
impl TransactionalStore for SqliteStore {
    type Database = sqlx::Sqlite;

    fn begin(&self) -> BoxFuture<'_, Result<sqlx::Transaction<'static, sqlx::Sqlite>, Error>> {
        Box::pin(async move { self.inner.pool.begin_with("BEGIN IMMEDIATE").await.map_err(|e| self.error("begin", e)) })
    }

    fn complete_in<'a>(
        &'a self,
        tx: &'a mut sqlx::Transaction<'static, sqlx::Sqlite>,
        key: &'a Key,
        token: &'a Token,
        result: Bytes,
        retention: Duration,
    ) -> BoxFuture<'a, Result<Transition, Error>> {
        Box::pin(async move {
            let arg = Some(Arg::Result(result, retention));
            let done = self.transition_query(&self.inner.sql.complete, key, token, arg).execute(&mut **tx).await;
            Ok(transition_of(done.map_err(|e| self.error("complete_in", e))?))
        })
    }

    fn renews_during_transaction(&self) -> bool {
        false
    }
}

impl CommitsWith for sqlx::Sqlite {
    type Store = SqliteStore;
}

impl fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqliteStore").field("store", &self.inner.describe).finish_non_exhaustive()
    }
}

/// Creates the schema registry `idempotent_schema` if it is missing, and answers the version it
/// holds for `table` (`None`: this crate did not create that table).
pub(crate) async fn registered_version(
    conn: &mut sqlx::SqliteConnection,
    table: &str,
) -> Result<Option<i64>, sqlx::Error> {
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS idempotent_schema (name TEXT PRIMARY KEY NOT NULL, version INTEGER NOT NULL)",
    )
    .execute(&mut *conn)
    .await?;
    sqlx::query_scalar("SELECT version FROM idempotent_schema WHERE name = ?1")
        .bind(table)
        .fetch_optional(&mut *conn)
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_names_must_be_identifiers() {
        for good in ["idempotent_records", "_x", "Records2"] {
            assert!(validate_table(good).is_ok(), "{good}");
        }
        for bad in ["", "x; DROP TABLE y", "2x", "a-b", "\"q\"", "sqlite_master", "idempotent_schema", &"a".repeat(65)]
        {
            assert!(matches!(validate_table(bad), Err(Error::Config(_))), "{bad:?}");
        }
    }
}
