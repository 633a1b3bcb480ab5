//! The PostgreSQL store, on sqlx: one table, shared by every process that reaches the database.
//!
//! # Schema (version 3)
//!
//! One row per key, in a table named by [`PostgresStoreBuilder::table`] (`idempotent_records`
//! unless set), in the first schema of the connection's `search_path` (`current_schema()`):
//!
//! | column | type | meaning |
//! |---|---|---|
//! | `key` | `bytea PRIMARY KEY` | the key's 32 bytes |
//! | `fingerprint` | `bytea` | the payload's 32 bytes |
//! | `state` | `text` | `running`, `released`, `done` or `needs_attention` |
//! | `token` | `text` | owner token of the last acquisition (kept when done, released or needing attention, so that a repeated complete, release or abandon by it is acknowledged) |
//! | `fence` | `bigint` | fencing token of the last acquisition |
//! | `attempt` | `bigint` | its attempt number |
//! | `recovered` | `boolean` | running: it took over a lease that ran out; released: the release was uncertain ([`Abandon::Uncertain`]), so the next acquisition is recovered |
//! | `lease_until` | `bigint` | lease deadline, µs since the Unix epoch on the database clock |
//! | `expires_at` | `bigint` | when the row counts as absent, µs since the Unix epoch; `i64::MAX` (never) while it needs attention; indexed (`<table>_expires_at`) for the purge |
//! | `result` | `bytea` | the stored outcome, when done |
//! | `step` | `text` | the acquisition's step ([`Labels`]); `''` when none was given |
//! | `run_id`, `tenant` | `text` | its run id and tenant, or `NULL`; `(run_id, key)` is indexed (`<table>_run_id`) for scans by run |
//! | `created_at` | `bigint` | when the row's current life began (its first acquisition since it was absent), µs since the Unix epoch |
//! | `updated_at` | `bigint` | when it last changed, µs since the Unix epoch |
//!
//! and a table `idempotent_schema (name, version)` saying which tables this crate created and
//! at which version. Times are integers of µs rather than `timestamptz` so that the fence and the
//! deadlines are one arithmetic, as in [`SqliteStore`](super::SqliteStore); read them with
//! `to_timestamp(expires_at / 1e6)`.
//!
//! The table is created on first use (by [`PostgresStore::connect`], or
//! [`PostgresStore::migrate`]) in one transaction under an advisory lock, so that processes
//! starting at once do not both create it. A table of that name that this crate did not create,
//! or of another version or shape, is an [`Error::Config`] saying what to do, and is never
//! altered.
//!
//! A table of version 2 (before labels and times) is upgraded in place by `migrate`, in its
//! transaction under the advisory lock: `ALTER TABLE … ADD COLUMN` for each new column (with
//! constant defaults, so no rewrite), the rows' `created_at` and `updated_at` set to their fence
//! (the clock of their last acquisition; one pass over the table), and the index by run built.
//! The `ALTER TABLE` waits for the calls under way, and they for it. A table of version 1 (before
//! `needs_attention`) goes through version 2: its state constraint `<table>_state_check` is
//! replaced, and version 1's `recovered` on a released row (whether that attempt had taken over a
//! lease) is cleared. Upgrade every process on the table together: one still on version 1 answers
//! an error (fails closed) on a record that needs attention, and ignores the uncertain mark of a
//! released one; one on version 2 refuses the table (its column check fails) until it is
//! upgraded.
//!
//! # Statements
//!
//! Every call of the [`Store`] trait is one statement in autocommit, on a connection taken from
//! the pool for that statement only and given back before the answer is (so no connection is held
//! while the caller's action runs):
//!
//! - acquire: `WITH cur AS (SELECT … WHERE key = $1), taken AS (INSERT … SELECT … WHERE NOT
//!   EXISTS (<cur is not free>) ON CONFLICT (key) DO UPDATE SET … WHERE <free> RETURNING …)
//!   SELECT … FROM taken UNION ALL SELECT … FROM cur WHERE NOT free`. When the row the statement
//!   reads says the key is not free (done, in flight, another payload) the insert does nothing
//!   and the row is the answer: a replay is one pure read, which takes no row lock and writes no
//!   WAL, so it does not wait for a disk flush either. Otherwise the upsert takes the key, judging
//!   "free" again on the newest row version it locks, and returns it. The alternative, a `DO
//!   UPDATE` that always updates with a `CASE` per column (as `SqliteStore` does), returns the row
//!   in every case, but in PostgreSQL every replay would then write a row version, and even a `DO
//!   UPDATE … WHERE false` locks the row, which is a WAL record and a flushed commit.
//!
//!   The read sees the statement's snapshot, while the upsert sees the newest committed row. They
//!   differ only when another call changed the key in between (a first acquisition by two callers
//!   at once, say): the upsert then finds the key taken and the read finds it absent or free, the
//!   statement returns no row, and it is run again, once, on a fresh snapshot (a serialization
//!   failure, under a database whose default isolation is stricter than `READ COMMITTED`, is
//!   run again the same way). An answer from the snapshot is true as of the statement's start:
//!   a done record stays done until it expires, and expiry is judged at that same time.
//!
//!   Even answering a replay without a lock, that statement sets up its `INSERT … ON CONFLICT`
//!   node on every run (25–35 µs of server CPU, `BENCHMARKS.md`), which a plain `SELECT` does
//!   not. So after a run of answers the existing row decided (replays, mostly), acquire reads
//!   first: `SELECT … WHERE key = $1 AND expires_at > now` (the text `SqliteStore` runs too),
//!   and only when that row does not decide the answer, the statement above. Which one goes first
//!   is learnt from the store's recent answers (see `AcquireOrder` in `store/acquire_order.rs`); both judge
//!   the same row by the same rules, and only the upsert takes a key.
//! - complete, release, renew: `UPDATE … WHERE key = $1 AND token = $2 AND state IN (…) AND
//!   expires_at > now`; a repeat by the token that completed (or released) matches its own done
//!   (released) row and changes nothing, so it is acknowledged. Release writes `recovered =
//!   false`, so that a repeated clean release does not match an uncertain one.
//! - abandon: the same `UPDATE`, to `released` with `recovered` set ([`Abandon::Uncertain`]), or to
//!   `needs_attention` with `expires_at` never ([`Abandon::NeedsAttention`]); a repeat with the
//!   same mark matches its own row. A late complete by the marked attempt finds neither
//!   `running` nor `done`, and is refused.
//! - resolve: `UPDATE … SET state = $2, result = $3, expires_at = now + $4 WHERE key = $1 AND state =
//!   'needs_attention'`: of two resolves at once, the second finds the row settled and changes
//!   nothing ([`Resolved::Unchanged`]).
//! - inspect: `SELECT … WHERE key = $1 AND expires_at > now`, the state judged in the statement
//!   (a running row whose lease passed, or one released uncertain, reads as stuck).
//! - scan: `SELECT … WHERE key > $1 AND expires_at > now AND <filter> ORDER BY key LIMIT $2`, every
//!   filter in SQL (state, step, run, tenant, `updated_at <= now - idle`); the cursor is the last
//!   key listed, in hex (anything else is an [`Error::Config`]), and a short page ends the scan.
//! - release_fenced: `UPDATE … SET state = 'released', recovered = true WHERE key = $1 AND fence =
//!   $2 AND state = 'running' AND expires_at > now`, live lease or not: the row is left as an
//!   uncertain abandon leaves it, and the holder's complete, renew and release are refused.
//! - delete: `UPDATE … SET expires_at = now, result = NULL … WHERE key = $1 AND expires_at > now
//!   RETURNING <a live lease held it>`, each column kept as it is when a live lease holds the row
//!   ([`Deleted::Running`]); no row back, the key was absent. The row,
//!   expired, counts as absent at once and the purge deletes it later; until then it keeps the
//!   fence, so the next acquisition's fence grows past it even within one tick of the clock.
//!
//! The statements of the last four are shared with [`SqliteStore`](super::SqliteStore). Acquire
//! writes the labels and times in its one statement above (a row that lives on keeps its labels
//! and `created_at`); every other transition that changes the row sets `updated_at`.
//!
//! [`PostgresStore::statements`] counts them: a first execution is 2 (acquire, complete), a replay
//! 1; a first execution right after a run of replays 3 (acquire's read, its upsert, complete)
//! (`tests/tests/postgres_store.rs` asserts all three, and that replays leave the row version as
//! it was: no new version, no lock).
//!
//! # Timeouts and failures
//!
//! [`PostgresStoreBuilder::timeout`] (5 s unless set) bounds each call as a whole: taking a
//! connection from the pool (opening one included: the TCP connect and the handshake) and running
//! the statement. A database that is down, unreachable or stopped fails the call with
//! [`Error::Timeout`] or [`Error::Unavailable`] within it: acquire fails closed. A statement given
//! up on closes its connection rather than return it to the pool. The store's own connections
//! also run with `statement_timeout` set to the timeout, so that a statement the client gave up
//! on (waiting for a row lock, say) does not go on in the server for long; this applies to the
//! statements of a step's transaction on the store's pool too (raise it there with `SET LOCAL
//! statement_timeout` if a step needs longer).
//!
//! An acquire that failed after its statement was sent may still take the key in the server (a
//! paused server runs it when it resumes; a crash may lose the reply of a committed one). Nobody
//! would run under that acquisition, so a task releases the key for the acquire's token: until
//! the database answers (trying once a timeout, at most 32 times), then once more two timeouts
//! later, once any statement still under way for it has ended. Releasing is safe whatever
//! happened: it acts only on a record that token holds. An acquire dropped before it answered
//! (a timeout around the step) goes on in a task of its own until its statement has ended, then
//! releases the key if it took it.
//!
//! Connections that sat idle for more than a second are pinged before use, so that after a
//! database restart the pool replaces them rather than fail a call on each; connections in
//! steady use are not, so a call waits for one round trip. (sqlx itself checks each connection
//! with a `Sync` message as it goes back to the pool, after the call has answered.)
//!
//! # Clock
//!
//! Time is the database's: `statement_timestamp()` (fixed for the statement, and the same for
//! every caller), never the caller's clock. Fences are `greatest(previous fence + 1, now in µs)`,
//! so they grow per key also after the row was purged, unless the database clock steps back
//! further than the time since the key's last acquisition.
//!
//! # Purging
//!
//! `expires_at` is the record's expiry as the record protocol sets it
//! ([retention](crate::record#retention)), on the database clock; `i64::MAX` while the row needs
//! attention, so that no purge deletes it. The column is indexed for the purge, so a statement
//! that moves it (acquire taking over a row, complete, resolve, abandon as needing attention, a
//! renewal past the expiry) adds an entry to each of the table's indexes; release, an uncertain
//! abandon and a renewal within the expiry change no indexed column, and PostgreSQL updates the
//! row in place (a HOT update) when its page has room, which the table's `fillfactor = 90` leaves.
//! Complete could keep acquire's expiry and be a HOT update too, but only by keeping a done record
//! longer than its retention (acquire writing the retention past the lease's end), which no other
//! store does.
//! An expired row counts as absent at once (acquire takes it over, the fence still grows); it is
//! deleted by a purge that takes up to 256 expired rows by the `expires_at` index (`FOR UPDATE
//! SKIP LOCKED`, so it never waits for a call) and deletes them, one batch for every 64
//! acquisitions of a store (in a background task, one at a time). [`PostgresStore::purge`] runs a
//! batch by hand.
//!
//! # Durability
//!
//! A record is as durable as the database's commits: with `synchronous_commit = on` (the default)
//! and `fsync = on`, a completion that was answered survives a crash. With `synchronous_commit =
//! off`, a crash can undo the last commits, and for this store an undone `done` means the action
//! runs again on the retry; do not turn it off for this table's database. A replay commits
//! nothing, so it never waits for a flush.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgArguments, PgConnectOptions, PgPool, PgPoolOptions, PgRow, Postgres};
use sqlx::query::Query;
use sqlx::{AssertSqlSafe, Connection, Row, SqlSafeStr, SqlStr};
use tokio::time::Instant;

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
const SCHEMA_VERSION: i32 = 3;
/// The version before, which `migrate` upgrades: it had no labels and no times.
const SCHEMA_V2: i32 = 2;
/// The version before that, which `migrate` upgrades too: it had no `needs_attention` state.
const SCHEMA_V1: i32 = 1;
/// The states a row can be in (the table's `CHECK` constraint).
const STATES: &str = "'running', 'released', 'done', 'needs_attention'";
/// Expired rows deleted per purge batch at most.
const PURGE_BATCH: i64 = 256;
/// Acquisitions of one store between two purge batches.
const PURGE_EVERY: u64 = 64;
/// The database clock in µs since the Unix epoch, fixed for the statement.
const NOW_US: &str = "(extract(epoch FROM statement_timestamp()) * 1000000)::bigint";
/// The columns of a table of schema versions 1 and 2 and their types (as `format_type` spells
/// them), in the order `migrate` created them; version 3 adds [`V3_COLUMNS`] after them.
const V2_COLUMNS: [(&str, &str); 10] = [
    ("key", "bytea"),
    ("fingerprint", "bytea"),
    ("state", "text"),
    ("token", "text"),
    ("fence", "bigint"),
    ("attempt", "bigint"),
    ("recovered", "boolean"),
    ("lease_until", "bigint"),
    ("expires_at", "bigint"),
    ("result", "bytea"),
];
/// The columns of a table of schema version 3 and their types, in order.
fn v3_columns() -> Vec<(&'static str, &'static str)> {
    // The type is the declaration's first word (`text`, `bigint`).
    let v3 = V3_COLUMNS.map(|(name, decl)| (name, decl.split(' ').next().unwrap_or(decl)));
    V2_COLUMNS.into_iter().chain(v3).collect()
}

/// The index of schema version 3 that serves scans by run (`Filter::run`), in key order.
fn run_index_sql(table: &str) -> String {
    format!("CREATE INDEX \"{table}_run_id\" ON \"{table}\" (run_id, key)")
}

/// The advisory lock `migrate` holds for its transaction ("idempote" in ASCII).
const MIGRATE_LOCK: i64 = 0x6964_656d_706f_7465;
/// How often acquire runs its statement when the record keeps changing under it.
const ACQUIRE_TRIES: u32 = 8;
/// How often the release after a failed acquire is tried before the lease is left to run out.
const ORPHAN_TRIES: u32 = 32;
/// Connections idle for longer are pinged before use.
const IDLE_PING: Duration = Duration::from_secs(1);
/// The longest table name: the index names (`<table>_expires_at`, `<table>_run_id`) must fit
/// PostgreSQL's 63 bytes.
const MAX_TABLE_LEN: usize = 48;

/// A store in one PostgreSQL table, safe for many tasks and for many processes on many hosts.
///
/// See the [module documentation](self) for the schema, the statements, the timeouts and the
/// durability choices. Clones share the same pool.
///
/// ```no_run
/// use std::time::Duration;
/// use idempotent_core::{PostgresStore, RunContext, Store};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), idempotent_core::Error> {
/// let store = PostgresStore::builder("postgres://app:secret@127.0.0.1:5432/app")
///     .timeout(Duration::from_secs(2))
///     .connect()
///     .await?;
/// let ctx = RunContext::new(store.clone(), "order-7");
/// let id: String = ctx
///     .step("charge")
///     .run(&("order-7", 1500), |attempt| async move {
///         Ok::<_, idempotent_core::Error>(format!("ch_{}", attempt.fence()))
///     })
///     .await?;
/// println!("{id}");
/// // The password is never shown.
/// assert_eq!(store.describe(), "postgres://app@127.0.0.1:5432/app");
/// store.close().await;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct PostgresStore {
    inner: Arc<Inner>,
}

struct Inner {
    pool: PgPool,
    describe: String,
    table: String,
    timeout: Duration,
    sql: Statements,
    acquisitions: AtomicU64,
    statements: AtomicU64,
    /// Whether acquire reads first.
    order: AcquireOrder,
    purging: AtomicBool,
}

struct Statements {
    /// acquire's read, when it reads first ([`AcquireOrder`]).
    acquire_read: SqlStr,
    acquire: SqlStr,
    complete: SqlStr,
    release: SqlStr,
    /// `release` for the key a failed acquire may have taken: the row keeps its `recovered` flag,
    /// so that a takeover of an uncertain record leaves it uncertain.
    release_orphan: SqlStr,
    renew: SqlStr,
    abandon_uncertain: SqlStr,
    abandon_attention: SqlStr,
    resolve: SqlStr,
    purge: SqlStr,
    admin: AdminSql,
}

impl Statements {
    fn new(table: &str) -> Self {
        let t = format!("\"{table}\"");
        let cols = v3_columns().into_iter().map(|(name, _)| name).collect::<Vec<_>>().join(", ");
        // Judged on the snapshot's row `r` at the statement's time.
        let free_now = format!(
            "(r.expires_at <= {NOW_US} OR (r.fingerprint = $2 AND (r.state = 'released' OR (r.state = 'running' AND \
             r.lease_until <= {NOW_US}))))"
        );
        // Judged on the newest row version `r`, which the upsert has locked; `excluded` is the
        // row it would insert, whose `fence` column holds the clock.
        let now = "excluded.fence";
        let expired = format!("r.expires_at <= {now}");
        let free = format!(
            "({expired} OR (r.fingerprint = excluded.fingerprint AND (r.state = 'released' OR (r.state = 'running' \
             AND r.lease_until <= {now}))))"
        );
        let acquire = format!(
            "WITH cur AS (\n\
             SELECT r.token, r.fingerprint, r.state, r.fence, r.attempt, r.recovered, r.lease_until - {NOW_US} AS \
             left_us, r.result, {free_now} AS free\n\
             FROM {t} r WHERE r.key = $1\n\
             ), taken AS (\n\
             INSERT INTO {t} AS r ({cols})\n\
             SELECT $1, $2, 'running', $3, {NOW_US}, 1, false, {NOW_US} + $4, {NOW_US} + $5, NULL, $6, $7, $8, \
             {NOW_US}, {NOW_US}\n\
             WHERE NOT EXISTS (SELECT FROM cur WHERE NOT cur.free)\n\
             ON CONFLICT (key) DO UPDATE SET\n  \
             fingerprint = excluded.fingerprint, state = 'running', token = excluded.token,\n  \
             fence = greatest(r.fence + 1, {now}),\n  \
             attempt = CASE WHEN {expired} THEN 1 ELSE r.attempt + 1 END,\n  \
             recovered = NOT {expired} AND (r.state = 'running' OR r.recovered),\n  \
             lease_until = excluded.lease_until, expires_at = excluded.expires_at, result = NULL,\n  \
             step = CASE WHEN {expired} THEN excluded.step ELSE r.step END,\n  \
             run_id = CASE WHEN {expired} THEN excluded.run_id ELSE r.run_id END,\n  \
             tenant = CASE WHEN {expired} THEN excluded.tenant ELSE r.tenant END,\n  \
             created_at = CASE WHEN {expired} THEN {now} ELSE r.created_at END, updated_at = {now}\n\
             WHERE {free}\n\
             RETURNING r.token, r.fingerprint, r.state, r.fence, r.attempt, r.recovered\n\
             )\n\
             SELECT token, fingerprint, state, fence, attempt, recovered, 0::bigint, NULL::bytea FROM taken\n\
             UNION ALL\n\
             SELECT token, fingerprint, state, fence, attempt, recovered, left_us, result FROM cur WHERE NOT free"
        );
        let owned = format!("key = $1 AND token = $2 AND expires_at > {NOW_US}");
        // A repeat by the same token (its row already in the state it asks for) changes nothing.
        let touched = format!("updated_at = CASE WHEN state = 'running' THEN {NOW_US} ELSE updated_at END");
        let complete = format!(
            "UPDATE {t} SET result = CASE WHEN state = 'done' THEN result ELSE $3 END,\n\
             expires_at = CASE WHEN state = 'done' THEN expires_at ELSE {NOW_US} + $4 END,\n\
             updated_at = CASE WHEN state = 'done' THEN updated_at ELSE {NOW_US} END,\n\
             state = 'done'\n\
             WHERE {owned} AND state IN ('running', 'done')"
        );
        let release = format!(
            "UPDATE {t} SET state = 'released', recovered = false, {touched}\n\
             WHERE {owned} AND (state = 'running' OR (state = 'released' AND NOT recovered))"
        );
        let release_orphan =
            format!("UPDATE {t} SET state = 'released', {touched}\nWHERE {owned} AND state = 'running'");
        let abandon_uncertain = format!(
            "UPDATE {t} SET state = 'released', recovered = true, {touched}\n\
             WHERE {owned} AND (state = 'running' OR (state = 'released' AND recovered))"
        );
        let abandon_attention = format!(
            "UPDATE {t} SET state = 'needs_attention', expires_at = {NEVER_US}, {touched}\n\
             WHERE {owned} AND state IN ('running', 'needs_attention')"
        );
        let resolve = format!(
            "UPDATE {t} SET state = $2, result = $3, expires_at = {NOW_US} + $4, recovered = false, updated_at = \
             {NOW_US}\n\
             WHERE key = $1 AND state = 'needs_attention'"
        );
        let renew = format!(
            "UPDATE {t} SET lease_until = {NOW_US} + $3, expires_at = greatest(expires_at, {NOW_US} + $3), \
             updated_at = {NOW_US}\n\
             WHERE {owned} AND state = 'running'"
        );
        let purge = format!(
            "DELETE FROM {t} WHERE key IN (\n\
             SELECT key FROM {t} WHERE expires_at <= {NOW_US} ORDER BY expires_at LIMIT {PURGE_BATCH} FOR UPDATE SKIP \
             LOCKED\n\
             ) AND expires_at <= {NOW_US}"
        );
        let sql = |s: String| AssertSqlSafe(Arc::<str>::from(s)).into_sql_str();
        Statements {
            acquire_read: sql(acquire_read_sql(table, NOW_US)),
            acquire: sql(acquire),
            complete: sql(complete),
            release: sql(release),
            release_orphan: sql(release_orphan),
            renew: sql(renew),
            abandon_uncertain: sql(abandon_uncertain),
            abandon_attention: sql(abandon_attention),
            resolve: sql(resolve),
            purge: sql(purge),
            admin: AdminSql::new(table, NOW_US),
        }
    }
}

/// Where a [`PostgresStore`] gets its connections.
#[derive(Debug, Clone)]
enum Target {
    Url(String),
    Pool(PgPool),
}

/// Settings of a [`PostgresStore`], from [`PostgresStore::builder`] or
/// [`PostgresStore::builder_with_pool`].
#[derive(Debug, Clone)]
pub struct PostgresStoreBuilder {
    target: Target,
    table: String,
    timeout: Duration,
    max_connections: u32,
}

impl PostgresStoreBuilder {
    /// The table holding the records (default `idempotent_records`): an identifier of ASCII
    /// letters, digits and `_`, not starting with a digit, at most 48 characters, not
    /// `idempotent_schema`. It is created in the connection's `current_schema()`.
    pub fn table(mut self, name: impl Into<String>) -> Self {
        self.table = name.into();
        self
    }

    /// How long a call may take as a whole, connecting included, before it fails with
    /// [`Error::Timeout`] (default 5 s; at least 1 ms). The store's own connections also get it
    /// as `statement_timeout`.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout.max(Duration::from_millis(1));
        self
    }

    /// The most connections the store opens (default 8; at least 1). Ignored for a store on a
    /// pool of the application's ([`PostgresStore::builder_with_pool`]).
    pub fn max_connections(mut self, n: u32) -> Self {
        self.max_connections = n.max(1);
        self
    }

    /// Makes the pool (connections are opened as calls need them) and creates or checks the
    /// table ([`PostgresStore::migrate`]).
    ///
    /// Fails with [`Error::Config`] for an invalid URL or table name or an incompatible existing
    /// table, and with [`Error::Unavailable`] or [`Error::Timeout`] (op `open`) when the database
    /// cannot be reached within the timeout.
    pub async fn connect(self) -> Result<PostgresStore, Error> {
        validate_table(&self.table)?;
        let timeout = self.timeout;
        let (pool, describe) = match self.target {
            Target::Url(url) => {
                let options = PgConnectOptions::from_str(&url).map_err(|e| {
                    Error::Config(format!(
                        "invalid PostgreSQL URL {}: {e}; expected postgres://user[:password]@host[:port]/database",
                        redact(&url)
                    ))
                })?;
                let describe = describe(&options);
                let options = options.options([("statement_timeout", format!("{}ms", timeout.as_millis().max(1)))]);
                let pool = PgPoolOptions::new()
                    .max_connections(self.max_connections)
                    .min_connections(0)
                    .acquire_timeout(timeout)
                    .test_before_acquire(false)
                    .before_acquire(|conn, meta| {
                        Box::pin(async move {
                            if meta.idle_for > IDLE_PING {
                                conn.ping().await?;
                            }
                            Ok(true)
                        })
                    })
                    .connect_lazy_with(options);
                (pool, describe)
            }
            Target::Pool(pool) => {
                let describe = describe(&pool.connect_options());
                (pool, describe)
            }
        };
        let store = PostgresStore {
            inner: Arc::new(Inner {
                pool,
                describe,
                table: self.table.clone(),
                timeout,
                sql: Statements::new(&self.table),
                acquisitions: AtomicU64::new(0),
                statements: AtomicU64::new(0),
                order: AcquireOrder::default(),
                purging: AtomicBool::new(false),
            }),
        };
        store.migrate_as("open").await?;
        Ok(store)
    }
}

fn validate_table(name: &str) -> Result<(), Error> {
    let mut chars = name.chars();
    let ok = chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
        && name.len() <= MAX_TABLE_LEN
        && !name.eq_ignore_ascii_case("idempotent_schema");
    if ok {
        Ok(())
    } else {
        Err(Error::Config(format!(
            "PostgreSQL table name {name:?} is not a plain identifier (ASCII letters, digits and `_`, not starting \
             with a digit, at most {MAX_TABLE_LEN} characters, not `idempotent_schema`); choose another with \
             PostgresStoreBuilder::table"
        )))
    }
}

/// `postgres://user@host:port/database`: the connection's target without its password.
fn describe(options: &PgConnectOptions) -> String {
    let user = options.get_username();
    let db = options.get_database().unwrap_or(user);
    match options.get_socket() {
        Some(dir) => format!("postgres://{user}@/{db}?host={}&port={}", dir.display(), options.get_port()),
        None => format!("postgres://{user}@{}:{}/{db}", options.get_host(), options.get_port()),
    }
}

/// The URL with the password of its user part, if any, replaced by `***`.
fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else { return "(not a URL)".to_owned() };
    let Some((userinfo, host)) = rest.rsplit_once('@') else { return url.to_owned() };
    match userinfo.split_once(':') {
        Some((user, _)) => format!("{scheme}://{user}:***@{host}"),
        None => url.to_owned(),
    }
}

/// A call that failed, and whether its statement may have taken effect.
struct Failed {
    error: Error,
    effect: Effect,
}

/// Whether a failed statement may have changed the database.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Effect {
    /// It was not sent (no connection).
    NotSent,
    /// The database rolled it back (a serialization failure or a deadlock): it may run again.
    RolledBack,
    /// It was sent and may have been committed.
    Unknown,
}

impl PostgresStore {
    /// Connects with the default settings (see [`PostgresStore::builder`]) and creates or checks
    /// the table.
    pub async fn connect(url: impl Into<String>) -> Result<PostgresStore, Error> {
        PostgresStore::builder(url).connect().await
    }

    /// A store on a pool of the application's, with the default settings (see
    /// [`PostgresStore::builder_with_pool`]); creates or checks the table.
    pub async fn from_pool(pool: PgPool) -> Result<PostgresStore, Error> {
        PostgresStore::builder_with_pool(pool).connect().await
    }

    /// Settings for a store on the database at `url` (`postgres://user:password@host:port/db`,
    /// with the query parameters sqlx's `PgConnectOptions` reads), in its own pool.
    pub fn builder(url: impl Into<String>) -> PostgresStoreBuilder {
        PostgresStoreBuilder::new(Target::Url(url.into()))
    }

    /// Settings for a store on `pool`, shared with the application: the store takes a connection
    /// for each statement and gives it back before it answers. Its connections keep the pool's
    /// own settings (no `statement_timeout` is added; the store's timeout still bounds each call).
    pub fn builder_with_pool(pool: PgPool) -> PostgresStoreBuilder {
        PostgresStoreBuilder::new(Target::Pool(pool))
    }

    /// The pool the store runs on, to share with the application.
    pub fn pool(&self) -> &PgPool {
        &self.inner.pool
    }

    /// Creates the table if it is missing, or checks that it is the one this crate creates.
    ///
    /// [`connect`](Self::connect) runs it already; running it again changes nothing. An existing
    /// table this crate did not create, or of another schema version or shape, is an
    /// [`Error::Config`] saying what to do: it is never altered.
    pub async fn migrate(&self) -> Result<(), Error> {
        self.migrate_as("migrate").await
    }

    async fn migrate_as(&self, op: &'static str) -> Result<(), Error> {
        let inner = &self.inner;
        match tokio::time::timeout(inner.timeout, self.migrate_in(op)).await {
            Ok(outcome) => outcome,
            Err(_) => Err(Error::Timeout { store: inner.describe.clone(), op, after: inner.timeout }),
        }
    }

    async fn migrate_in(&self, op: &'static str) -> Result<(), Error> {
        let err = |e: sqlx::Error| self.error(op, e);
        let table = self.inner.table.as_str();
        let db = &self.inner.describe;
        // One transaction under an advisory lock, so that processes opening the store at once do
        // not both create the tables.
        let mut tx = begin_migration(&self.inner.pool).await.map_err(err)?;
        let version = registered_version(&mut tx, table).await.map_err(err)?;
        let columns: Vec<(String, String)> = sqlx::query_as(
            "SELECT a.attname::text, format_type(a.atttypid, a.atttypmod) FROM pg_attribute a \
             WHERE a.attrelid = to_regclass(format('%I.%I', current_schema(), $1::text)) AND a.attnum > 0 \
             AND NOT a.attisdropped ORDER BY a.attnum",
        )
        .bind(table)
        .fetch_all(&mut *tx)
        .await
        .map_err(err)?;
        let exists: bool =
            sqlx::query_scalar("SELECT to_regclass(format('%I.%I', current_schema(), $1::text)) IS NOT NULL")
                .bind(table)
                .fetch_one(&mut *tx)
                .await
                .map_err(err)?;
        let expected: Vec<(String, String)> = match version {
            Some(SCHEMA_VERSION) => v3_columns(),
            _ => V2_COLUMNS.to_vec(),
        }
        .into_iter()
        .map(|(n, t)| (n.to_owned(), t.to_owned()))
        .collect();
        let shown =
            |cols: &[(String, String)]| cols.iter().map(|(n, t)| format!("{n} {t}")).collect::<Vec<_>>().join(", ");
        match version {
            Some(SCHEMA_VERSION) if columns == expected => {}
            Some(SCHEMA_V2) if columns == expected => self.upgrade_v2(&mut tx, op).await?,
            Some(SCHEMA_V1) if columns == expected => {
                self.upgrade_v1(&mut tx, op).await?;
                self.upgrade_v2(&mut tx, op).await?;
            }
            Some(v @ (SCHEMA_VERSION | SCHEMA_V2 | SCHEMA_V1)) => {
                return Err(Error::Config(format!(
                    "{db}: table `{table}` is marked as idempotent schema version {v} but has the \
                     columns ({}) instead of ({}); it was changed by hand. Restore it, or drop it and its row in \
                     idempotent_schema (losing its records), or choose another table with PostgresStoreBuilder::table",
                    shown(&columns),
                    shown(&expected)
                )));
            }
            Some(v) => {
                return Err(Error::Config(format!(
                    "{db}: table `{table}` has idempotent schema version {v}, and this version of idempotent-core \
                     reads versions {SCHEMA_V1} and {SCHEMA_V2} (upgraded in place) and {SCHEMA_VERSION} only; use the \
                     idempotent-core that wrote it, or choose another table with PostgresStoreBuilder::table"
                )));
            }
            None if exists => {
                return Err(Error::Config(format!(
                    "{db}: relation `{table}` exists (columns: {}) but was not created by idempotent-core; it was \
                     left as it is. Choose another table with PostgresStoreBuilder::table, or drop that one",
                    shown(&columns)
                )));
            }
            None => {
                let v3: String = V3_COLUMNS.iter().map(|(name, decl)| format!(",\n{name} {decl}")).collect();
                let create = format!(
                    "CREATE TABLE \"{table}\" (\n\
                     key bytea PRIMARY KEY NOT NULL CHECK (length(key) = 32),\n\
                     fingerprint bytea NOT NULL,\n\
                     state text NOT NULL CONSTRAINT \"{table}_state_check\" CHECK (state IN ({STATES})),\n\
                     token text NOT NULL,\n\
                     fence bigint NOT NULL,\n\
                     attempt bigint NOT NULL,\n\
                     recovered boolean NOT NULL,\n\
                     lease_until bigint NOT NULL,\n\
                     expires_at bigint NOT NULL,\n\
                     result bytea{v3}\n\
                     ) WITH (fillfactor = 90);\n\
                     CREATE INDEX \"{table}_expires_at\" ON \"{table}\" (expires_at);\n\
                     {run_index}",
                    run_index = run_index_sql(table),
                );
                sqlx::raw_sql(AssertSqlSafe(create)).execute(&mut *tx).await.map_err(err)?;
                sqlx::query("INSERT INTO idempotent_schema (name, version) VALUES ($1, $2)")
                    .bind(table)
                    .bind(SCHEMA_VERSION)
                    .execute(&mut *tx)
                    .await
                    .map_err(err)?;
            }
        }
        tx.commit().await.map_err(err)
    }

    /// Upgrades the table from schema version 1, inside `migrate`'s transaction: version 2 allows
    /// the state `needs_attention` (its `CHECK` constraint is replaced), and reads a released
    /// row's `recovered` as "released uncertain" (version 1 left there whether the released
    /// attempt had taken over a lease, so it is cleared).
    async fn upgrade_v1(&self, tx: &mut sqlx::Transaction<'static, Postgres>, op: &'static str) -> Result<(), Error> {
        let table = self.inner.table.as_str();
        let db = &self.inner.describe;
        // The name PostgreSQL gave version 1's column constraint.
        let check = format!("{table}_state_check");
        let upgrade = format!(
            "ALTER TABLE \"{table}\" DROP CONSTRAINT \"{check}\",\n\
             ADD CONSTRAINT \"{check}\" CHECK (state IN ({STATES}));\n\
             UPDATE \"{table}\" SET recovered = false WHERE state = 'released' AND recovered"
        );
        sqlx::raw_sql(AssertSqlSafe(upgrade)).execute(&mut **tx).await.map_err(|e| match e {
            sqlx::Error::Database(e) if e.code().as_deref() == Some("42704") => Error::Config(format!(
                "{db}: table `{table}` has idempotent schema version {SCHEMA_V1} but no constraint `{check}` on its \
                 state, so it cannot be upgraded to version {SCHEMA_VERSION}; it was changed by hand. Restore the \
                 constraint (CHECK (state IN ('running', 'released', 'done'))), or choose another table with \
                 PostgresStoreBuilder::table"
            )),
            e => self.error(op, e),
        })?;
        tracing::info!(store = %db, table, "idempotent.postgres: upgraded the table from schema version {SCHEMA_V1} to {SCHEMA_V2}");
        Ok(())
    }

    /// Upgrades the table from schema version 2, inside `migrate`'s transaction: `ALTER TABLE …
    /// ADD COLUMN` for each of [`V3_COLUMNS`] (defaults that need no rewrite of the table), the
    /// rows' times from their fences ([`upgrade_v2_sql`]: one pass over the table), and the index
    /// by run.
    async fn upgrade_v2(&self, tx: &mut sqlx::Transaction<'static, Postgres>, op: &'static str) -> Result<(), Error> {
        let table = self.inner.table.as_str();
        let upgrade = format!("{};\n{}", upgrade_v2_sql(table), run_index_sql(table));
        sqlx::raw_sql(AssertSqlSafe(upgrade)).execute(&mut **tx).await.map_err(|e| self.error(op, e))?;
        sqlx::query("UPDATE idempotent_schema SET version = $2 WHERE name = $1")
            .bind(table)
            .bind(SCHEMA_VERSION)
            .execute(&mut **tx)
            .await
            .map_err(|e| self.error(op, e))?;
        let db = &self.inner.describe;
        tracing::info!(store = %db, table, "idempotent.postgres: upgraded the table to schema version {SCHEMA_VERSION}");
        Ok(())
    }

    /// The number of statements this store (and its clones) ran for the [`Store`] calls,
    /// [`TransactionalStore::complete_in`] and purges since it was made (not counting `connect`
    /// and `migrate`).
    pub fn statements(&self) -> u64 {
        self.inner.statements.load(Ordering::Relaxed)
    }

    /// Runs one purge batch: deletes up to 256 expired rows (the longest expired first, skipping
    /// rows a call has locked), and answers how many it deleted. The store runs one every 64
    /// acquisitions on its own.
    pub async fn purge(&self) -> Result<u64, Error> {
        let q = sqlx::query(self.inner.sql.purge.clone());
        self.execute("purge", q).await.map_err(|f| f.error)
    }

    /// Closes the pool's connections, waiting for the calls under way. On a store made with
    /// [`from_pool`](Self::from_pool), this closes the application's pool.
    pub async fn close(&self) {
        self.inner.pool.close().await;
    }

    /// For the state store (`crate::state`): the records' table (its state table is named
    /// after it), the timeout of a call, and the store's mapping of driver errors.
    pub(crate) fn state_parts(&self) -> (&str, Duration) {
        (&self.inner.table, self.inner.timeout)
    }

    /// The store's error for `e` during `op` (see [`state_parts`](Self::state_parts)).
    pub(crate) fn state_error(&self, op: &'static str, e: sqlx::Error) -> Error {
        self.error(op, e)
    }

    fn error(&self, op: &'static str, e: sqlx::Error) -> Error {
        store_error(&self.inner.describe, op, self.inner.timeout, e)
    }

    fn timed_out(&self, op: &'static str) -> Error {
        Error::Timeout { store: self.inner.describe.clone(), op, after: self.inner.timeout }
    }

    /// A connection of the pool for one statement, and the deadline of the call (the timeout
    /// from now), which taking the connection counts against.
    async fn connection(&self, op: &'static str) -> Result<(PoolConnection<Postgres>, Instant), Failed> {
        let inner = &self.inner;
        let deadline = Instant::now() + inner.timeout;
        match tokio::time::timeout_at(deadline, inner.pool.acquire()).await {
            Ok(Ok(conn)) => {
                inner.statements.fetch_add(1, Ordering::Relaxed);
                Ok((conn, deadline))
            }
            Ok(Err(e)) => Err(Failed { error: self.error(op, e), effect: Effect::NotSent }),
            Err(_) => Err(Failed { error: self.timed_out(op), effect: Effect::NotSent }),
        }
    }

    /// What a statement run on `conn` came to.
    fn ended<T>(
        &self,
        op: &'static str,
        mut conn: PoolConnection<Postgres>,
        outcome: Result<Result<T, sqlx::Error>, tokio::time::error::Elapsed>,
    ) -> Result<T, Failed> {
        match outcome {
            Ok(Ok(done)) => Ok(done),
            Ok(Err(e)) => {
                let effect = if serialization_failure(&e) { Effect::RolledBack } else { Effect::Unknown };
                Err(Failed { error: self.error(op, e), effect })
            }
            Err(_) => {
                // The statement may still be in the connection's pipe: never hand it out again.
                conn.close_on_drop();
                Err(Failed { error: self.timed_out(op), effect: Effect::Unknown })
            }
        }
    }

    /// Runs `query` on a connection of its own within the timeout, and returns its rows.
    async fn fetch(
        &self,
        op: &'static str,
        query: Query<'static, Postgres, PgArguments>,
    ) -> Result<Vec<PgRow>, Failed> {
        let (mut conn, deadline) = self.connection(op).await?;
        let outcome = tokio::time::timeout_at(deadline, query.fetch_all(&mut *conn)).await;
        self.ended(op, conn, outcome)
    }

    /// Runs `query` on a connection of its own within the timeout, and returns how many rows it
    /// changed.
    async fn execute(&self, op: &'static str, query: Query<'static, Postgres, PgArguments>) -> Result<u64, Failed> {
        let (mut conn, deadline) = self.connection(op).await?;
        let outcome = tokio::time::timeout_at(deadline, query.execute(&mut *conn)).await;
        self.ended(op, conn, outcome).map(|done| done.rows_affected())
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

    /// Acquire's work for `token`: the acquire statement, run again while the record changes
    /// between its read and its upsert.
    async fn take(
        &self,
        key: &Key,
        fp: &Fingerprint,
        token: &Token,
        lease: Duration,
        retention: Duration,
        labels: &OwnedLabels,
    ) -> Result<Acquire, Failed> {
        let inner = &self.inner;
        if inner.order.read_first() {
            let q = sqlx::query(inner.sql.acquire_read.clone()).bind(&key.as_bytes()[..]);
            // A read takes nothing, so its failure leaves nothing to release.
            let rows = self.fetch("acquire", q).await.map_err(|f| Failed { effect: Effect::NotSent, ..f })?;
            if let Some(row) = rows.first() {
                let found = read_found(key, row).map_err(|error| Failed { error, effect: Effect::NotSent })?;
                if found.decides(fp) {
                    // Another attempt's row (the token is fresh): never `Acquired`.
                    return found.judge(key, fp, token).map_err(|error| Failed { error, effect: Effect::NotSent });
                }
            }
        }
        for _ in 0..ACQUIRE_TRIES {
            let q = sqlx::query(inner.sql.acquire.clone())
                .bind(&key.as_bytes()[..])
                .bind(&fp.as_bytes()[..])
                .bind(token.as_str())
                .bind(micros(lease))
                .bind(micros(lease.max(retention)))
                .bind(labels.step.clone())
                .bind(labels.run.clone())
                .bind(labels.tenant.clone());
            let rows = match self.fetch("acquire", q).await {
                Ok(rows) => rows,
                // Nothing was committed: run it again on a fresh snapshot.
                Err(Failed { effect: Effect::RolledBack, .. }) => continue,
                Err(failed) => return Err(failed),
            };
            match rows.first() {
                // A row of ours that cannot be read was taken all the same.
                Some(row) => {
                    return read_acquire(key, fp, token, row)
                        .map_err(|error| Failed { error, effect: Effect::Unknown });
                }
                // Changed between the statement's read and its upsert; nothing was written.
                None => continue,
            }
        }
        Err(Failed {
            error: Error::Unavailable {
                store: inner.describe.clone(),
                op: "acquire",
                reason: format!("the record changed under each of {ACQUIRE_TRIES} tries"),
                source: None,
            },
            effect: Effect::NotSent,
        })
    }

    async fn transition(
        &self,
        op: &'static str,
        sql: &SqlStr,
        key: &Key,
        token: &Token,
        arg: Option<Arg>,
    ) -> Result<Transition, Error> {
        let q = bind_transition(sqlx::query(sql.clone()), key, token, arg.as_ref());
        let n = self.execute(op, q).await.map_err(|f| f.error)?;
        Ok(if n == 1 { Transition::Ok } else { Transition::LeaseLost })
    }

    /// After an acquire that failed once its statement was sent, the database may still take
    /// the key for `token` (when a paused server resumes, or in a commit whose reply a crash
    /// lost), and nobody will run under it; nor under the key an acquire dropped by its caller
    /// took. A task of its own releases it instead: until the database answers, then (after a
    /// store failure, `store_failure`) once more two timeouts later, once a statement still
    /// under way for the acquire has ended (its `statement_timeout` is the timeout).
    fn release_orphan(&self, key: Key, token: Token, store_failure: bool) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else { return };
        let store = self.clone();
        runtime.spawn(async move {
            let timeout = store.inner.timeout;
            let mut answered = false;
            for _ in 0..ORPHAN_TRIES {
                let started = Instant::now();
                match store.transition("release", &store.inner.sql.release_orphan, &key, &token, None).await {
                    Ok(Transition::Ok) => {
                        tracing::debug!(key = %key.short(), "idempotent.postgres: released the key a failed acquire took");
                        return;
                    }
                    Ok(Transition::LeaseLost) if answered || !store_failure => return,
                    Ok(Transition::LeaseLost) => {
                        answered = true;
                        tokio::time::sleep(2 * timeout).await;
                    }
                    Err(e) => {
                        if store.inner.pool.is_closed() {
                            return;
                        }
                        tracing::debug!(key = %key.short(), error = %e, "idempotent.postgres: could not release after a failed acquire; trying again");
                        tokio::time::sleep_until(started + timeout).await;
                    }
                }
            }
        });
    }
}

impl PostgresStoreBuilder {
    fn new(target: Target) -> Self {
        PostgresStoreBuilder {
            target,
            table: "idempotent_records".to_owned(),
            timeout: Duration::from_secs(5),
            max_connections: 8,
        }
    }
}

fn bind_transition<'q>(
    q: Query<'q, Postgres, PgArguments>,
    key: &Key,
    token: &Token,
    arg: Option<&Arg>,
) -> Query<'q, Postgres, PgArguments> {
    let q = q.bind(&key.as_bytes()[..]).bind(token.as_str());
    match arg {
        Some(Arg::Result(result, retention)) => q.bind(&result[..]).bind(micros(*retention)),
        Some(Arg::Lease(lease)) => q.bind(micros(*lease)),
        None => q,
    }
}

/// Tells the outcome of acquire from the row it returned.
fn read_acquire(key: &Key, fp: &Fingerprint, token: &Token, row: &PgRow) -> Result<Acquire, Error> {
    read_found(key, row)?.judge(key, fp, token)
}

/// The row acquire's read or its upsert returned.
fn read_found(key: &Key, row: &PgRow) -> Result<Found, Error> {
    let get_err =
        |e: sqlx::Error| Error::Corrupt { key: key.short(), detail: format!("a column has the wrong type: {e}") };
    Ok(Found {
        token: row.try_get(0).map_err(get_err)?,
        fingerprint: row.try_get(1).map_err(get_err)?,
        state: row.try_get(2).map_err(get_err)?,
        fence: row.try_get(3).map_err(get_err)?,
        attempt: row.try_get(4).map_err(get_err)?,
        recovered: row.try_get(5).map_err(get_err)?,
        left_us: row.try_get(6).map_err(get_err)?,
        result: row.try_get(7).map_err(get_err)?,
    })
}

/// A serialization failure or a deadlock: the statement was rolled back and may run again.
fn serialization_failure(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(db) if matches!(db.code().as_deref(), Some("40001" | "40P01")))
}

fn store_error(describe: &str, op: &'static str, timeout: Duration, e: sqlx::Error) -> Error {
    let timed_out = match &e {
        sqlx::Error::PoolTimedOut => true,
        // query_canceled (`statement_timeout`) and lock_not_available (`lock_timeout`).
        sqlx::Error::Database(db) => matches!(db.code().as_deref(), Some("57014" | "55P03")),
        _ => false,
    };
    if timed_out {
        return Error::Timeout { store: describe.to_owned(), op, after: timeout };
    }
    Error::Unavailable { store: describe.to_owned(), op, reason: e.to_string(), source: Some(Box::new(e) as BoxError) }
}

impl Store for PostgresStore {
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
            let token = Token::unique();
            match store.take(&key, &fingerprint, &token, lease, retention, &labels).await {
                Ok(answer) => {
                    store.inner.order.learn(&answer);
                    if let Acquire::Acquired(grant) = &answer {
                        if flag.load(Ordering::Acquire) {
                            // Nobody will run under this grant: give the key back rather than
                            // leave it taken for a whole lease.
                            store.release_orphan(key, grant.token.clone(), false);
                        } else {
                            store.maybe_purge();
                        }
                    }
                    Ok(answer)
                }
                Err(Failed { error, effect }) => {
                    if effect == Effect::Unknown {
                        store.release_orphan(key, token, error.is_store_failure());
                    }
                    Err(error)
                }
            }
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
            let q = sqlx::query(self.inner.sql.resolve.clone())
                .bind(&key.as_bytes()[..])
                .bind(state)
                .bind(result.map(|r| r.to_vec()))
                .bind(keep_us);
            let n = self.execute("resolve", q).await.map_err(|f| f.error)?;
            Ok(if n == 1 { Resolved::Ok } else { Resolved::Unchanged })
        })
    }

    fn describe(&self) -> String {
        self.inner.describe.clone()
    }

    fn inspect<'a>(&'a self, key: &'a Key) -> BoxFuture<'a, Result<Option<RecordInfo>, Error>> {
        Box::pin(async move {
            let q = sqlx::query(self.inner.sql.admin.inspect.clone()).bind(key.as_bytes().to_vec());
            let rows = self.fetch("inspect", q).await.map_err(|f| f.error)?;
            rows.first().map(read_record).transpose()
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
            let rows = self.fetch("scan", q).await.map_err(|f| f.error)?;
            let records = rows.iter().map(read_record).collect::<Result<Vec<_>, _>>()?;
            Ok(page(records, limit))
        })
    }

    fn release_fenced<'a>(&'a self, key: &'a Key, fence: u64) -> BoxFuture<'a, Result<Resolved, Error>> {
        Box::pin(async move {
            // A fence beyond a bigint is no row's.
            let Ok(fence) = i64::try_from(fence) else { return Ok(Resolved::Unchanged) };
            let q = sqlx::query(self.inner.sql.admin.release_fenced.clone()).bind(key.as_bytes().to_vec()).bind(fence);
            let n = self.execute("release_fenced", q).await.map_err(|f| f.error)?;
            Ok(if n == 1 { Resolved::Ok } else { Resolved::Unchanged })
        })
    }

    fn delete<'a>(&'a self, key: &'a Key) -> BoxFuture<'a, Result<Deleted, Error>> {
        Box::pin(async move {
            let q = sqlx::query(self.inner.sql.admin.delete.clone()).bind(key.as_bytes().to_vec());
            let rows = self.fetch("delete", q).await.map_err(|f| f.error)?;
            let kept = match rows.first() {
                Some(row) => Some(row.try_get::<bool, _>(0).map_err(|e| Error::Corrupt {
                    key: key.short(),
                    detail: format!("delete answered a column of the wrong type: {e}"),
                })?),
                None => None,
            };
            Ok(deleted(kept))
        })
    }

    fn kind(&self) -> &'static str {
        "postgres"
    }
}

impl TransactionalStore for PostgresStore {
    type Database = Postgres;

    /// Begins a transaction on the store's pool (`BEGIN`, at the database's default isolation),
    /// within the store's timeout.
    fn begin(&self) -> BoxFuture<'_, Result<sqlx::Transaction<'static, Postgres>, Error>> {
        Box::pin(async move {
            match tokio::time::timeout(self.inner.timeout, self.inner.pool.begin()).await {
                Ok(tx) => tx.map_err(|e| self.error("begin", e)),
                Err(_) => Err(self.timed_out("begin")),
            }
        })
    }

    fn complete_in<'a>(
        &'a self,
        tx: &'a mut sqlx::Transaction<'static, Postgres>,
        key: &'a Key,
        token: &'a Token,
        result: Bytes,
        retention: Duration,
    ) -> BoxFuture<'a, Result<Transition, Error>> {
        Box::pin(async move {
            let arg = Arg::Result(result, retention);
            let q = bind_transition(sqlx::query(self.inner.sql.complete.clone()), key, token, Some(&arg));
            self.inner.statements.fetch_add(1, Ordering::Relaxed);
            let done = match tokio::time::timeout(self.inner.timeout, q.execute(&mut **tx)).await {
                Ok(done) => done.map_err(|e| self.error("complete", e))?,
                Err(_) => return Err(self.timed_out("complete")),
            };
            Ok(if done.rows_affected() == 1 { Transition::Ok } else { Transition::LeaseLost })
        })
    }

    /// `true`: the transaction holds a lock on the record's row only from `complete_in` on, so
    /// the lease is renewed from another connection while the step's own writes run.
    /// `true` when the pool has a second connection to renew from: a pool of one connection is
    /// held by the step's transaction, so a renewal would wait for it (and time out). The lease of
    /// a step in a transaction on such a pool is not renewed: give it a lease longer than the
    /// transaction, or the pool a second connection.
    fn renews_during_transaction(&self) -> bool {
        self.pool().options().get_max_connections() >= 2
    }
}

impl CommitsWith for Postgres {
    type Store = PostgresStore;
}

impl fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresStore").field("store", &self.inner.describe).finish_non_exhaustive()
    }
}

/// A transaction holding the migrations' advisory lock, so that processes opening the store at
/// once do not both create a table.
pub(crate) async fn begin_migration(pool: &PgPool) -> Result<sqlx::Transaction<'static, Postgres>, sqlx::Error> {
    let mut tx = pool.begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock($1)").bind(MIGRATE_LOCK).execute(&mut *tx).await?;
    Ok(tx)
}

/// Creates the schema registry `idempotent_schema` if it is missing, and answers the version it
/// holds for `table` (`None`: this crate did not create that table).
pub(crate) async fn registered_version(conn: &mut sqlx::PgConnection, table: &str) -> Result<Option<i32>, sqlx::Error> {
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS idempotent_schema (name text PRIMARY KEY NOT NULL, version integer NOT NULL)",
    )
    .execute(&mut *conn)
    .await?;
    sqlx::query_scalar("SELECT version FROM idempotent_schema WHERE name = $1")
        .bind(table)
        .fetch_optional(&mut *conn)
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_names_must_be_identifiers() {
        for good in ["idempotent_records", "_x", "Records2", &"a".repeat(48)] {
            assert!(validate_table(good).is_ok(), "{good}");
        }
        for bad in
            ["", "x; DROP TABLE y", "2x", "a-b", "\"q\"", "idempotent_schema", "IDEMPOTENT_SCHEMA", &"a".repeat(49)]
        {
            assert!(matches!(validate_table(bad), Err(Error::Config(_))), "{bad:?}");
        }
    }

    #[test]
    fn descriptions_and_errors_never_show_the_password() {
        let options = PgConnectOptions::from_str("postgres://app:s3cret@db.internal:6543/orders").unwrap();
        assert_eq!(describe(&options), "postgres://app@db.internal:6543/orders");
        assert_eq!(redact("postgres://app:s3cret@db/x"), "postgres://app:***@db/x");
        assert_eq!(redact("postgres://app@db/x"), "postgres://app@db/x");
        assert!(!redact("postgres://a:b:c@d/x").contains('b'));
    }
}
