//! What the SQL stores share: writing a step's outcome inside a transaction that also holds the
//! step's own writes, so that both commit together or not at all; and, inside the crate, how an
//! acquire's row is judged, how a dropped acquire finishes, the columns schema version 3 added,
//! and the statements of the record-admin calls (`inspect`, `scan`, `release_fenced`, `delete`),
//! whose text the two dialects share.
//!
//! [`SqliteStore`](super::SqliteStore) and [`PostgresStore`](super::PostgresStore) implement
//! [`TransactionalStore`]; `Step::run_in_transaction` drives it.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use sqlx::SqlSafeStr;

use super::admin::{Cursor, Deleted, Filter, MAX_PAGE, Page, RecordInfo, RecordState};
use super::{BoxFuture, SharedStore, Store};
use crate::attempt::Attempt;
use crate::error::Error;
use crate::key::{Fingerprint, Key};
use crate::lease::FinishOnDrop;
use crate::record::{Acquire, Grant, KEEP_RESOLVED_RELEASE, Labels, Resolution, Token, Transition};

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
}

/// The sqlx databases a step can commit with, each mapped to its store: lets
/// `run_in_transaction` find the store from the type of the transaction its action takes.
pub trait CommitsWith: sqlx::Database {
    /// The store whose records live in this database.
    type Store: TransactionalStore<Database = Self>;
}

/// Durations are clamped to 100 years, so that `now + d` stays within an `i64` of µs.
pub(crate) const MAX_US: i64 = 100 * 365 * 24 * 60 * 60 * 1_000_000;

/// The `expires_at` of a `needs_attention` row: never (it waits to be resolved, and the purge,
/// which deletes rows whose `expires_at` has passed, never reaches it).
pub(crate) const NEVER_US: i64 = i64::MAX;

/// A duration in µs, as the SQL stores bind it.
pub(crate) fn micros(d: Duration) -> i64 {
    i64::try_from(d.as_micros()).unwrap_or(MAX_US).min(MAX_US)
}

/// The argument a transition binds after the key and the token.
pub(crate) enum Arg {
    /// complete: the outcome and its retention.
    Result(Bytes, Duration),
    /// renew: the new lease.
    Lease(Duration),
}

/// What the resolve statement writes over a `needs_attention` row: its new state, its result, and
/// how long from now it is kept.
pub(crate) fn resolved_row(resolution: Resolution) -> (&'static str, Option<Bytes>, i64) {
    match resolution {
        Resolution::Done { outcome, retention } => ("done", Some(outcome), micros(retention)),
        Resolution::NotDone => ("released", None, micros(KEEP_RESOLVED_RELEASE)),
    }
}

/// The row an acquire statement returns, read out of the driver's row type.
pub(crate) struct Found {
    pub(crate) token: String,
    pub(crate) fingerprint: Vec<u8>,
    pub(crate) state: String,
    pub(crate) fence: i64,
    pub(crate) attempt: i64,
    pub(crate) recovered: bool,
    /// µs until the lease deadline (meaningful for a running record of another attempt).
    pub(crate) left_us: i64,
    pub(crate) result: Option<Vec<u8>>,
}

impl Found {
    /// Whether a live row that another attempt's acquisition left decides an acquire with
    /// `fingerprint` by itself, with no write: another payload's (mismatch), done (replay),
    /// needing attention, or running on a lease that has not run out (in flight). Otherwise (a
    /// released row, or a lease that ran out) the key is free, and only the atomic upsert may
    /// take it.
    pub(crate) fn decides(&self, fingerprint: &Fingerprint) -> bool {
        self.fingerprint != fingerprint.as_bytes()
            || matches!(self.state.as_str(), "done" | "needs_attention")
            || (self.state == "running" && self.left_us > 0)
    }

    /// Tells the outcome of an acquire by `token` with `fingerprint` from the row it returned:
    /// ours, the key was taken; another's, the row says replay, in flight, needs attention or
    /// mismatch.
    pub(crate) fn judge(self, key: &Key, fingerprint: &Fingerprint, token: &Token) -> Result<Acquire, Error> {
        let corrupt = |detail: String| Error::Corrupt { key: key.short(), detail };
        let fence = || u64::try_from(self.fence).map_err(|_| corrupt(format!("negative fence {}", self.fence)));
        let attempt =
            || u32::try_from(self.attempt).map_err(|_| corrupt(format!("attempt {} out of range", self.attempt)));
        if self.token == token.as_str() {
            let (fence, attempt) = (fence()?, attempt()?);
            return Ok(Acquire::Acquired(Grant {
                token: token.clone(),
                attempt: Attempt::new(*key, fence, attempt, self.recovered),
            }));
        }
        if self.fingerprint != fingerprint.as_bytes() {
            return Ok(Acquire::Mismatch);
        }
        match self.state.as_str() {
            "done" => {
                let result = self.result.ok_or_else(|| corrupt("a done record without a result".to_owned()))?;
                Ok(Acquire::Replay(Bytes::from(result)))
            }
            "running" => {
                Ok(Acquire::InFlight { retry_after: Duration::from_micros(self.left_us.max(0).unsigned_abs()) })
            }
            "needs_attention" => Ok(Acquire::NeedsAttention { attempt: attempt()?, fence: fence()? }),
            other => Err(corrupt(format!("the record is {other:?} and another attempt's, yet was not taken"))),
        }
    }
}

/// Acquire's read (when it reads first: [`AcquireOrder`](super::AcquireOrder)), in both
/// dialects: the live row of key `$1`, if any, in the columns of the upsert's answer ([`Found`]),
/// its token left out (it is never the fresh token of the acquire reading it); `now` is the
/// dialect's clock.
pub(crate) fn acquire_read_sql(table: &str, now: &str) -> String {
    format!(
        "SELECT '', fingerprint, state, fence, attempt, recovered, lease_until - {now}, result FROM \"{table}\"\n\
         WHERE key = $1 AND expires_at > {now}"
    )
}

/// An acquire in flight. Dropped before it answered (a timeout around the step, a caller that
/// went away), it goes on in a task of its own: the statement may already be running on its
/// connection, and only once it has ended can the key it may have taken be released. The work
/// reads `abandoned` to know whether anyone will use what it took.
pub(crate) struct AcquireCall<F: Future + Send + 'static> {
    abandoned: Arc<AtomicBool>,
    work: FinishOnDrop<F>,
}

impl<F: Future + Send + 'static> AcquireCall<F> {
    /// Wraps `work`, which sees `abandoned` set once the call was dropped unanswered.
    pub(crate) fn new(abandoned: Arc<AtomicBool>, work: F) -> Self {
        AcquireCall { abandoned, work: FinishOnDrop::new(work) }
    }
}

impl<F: Future + Send + 'static> Future for AcquireCall<F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        Pin::new(&mut self.work).poll(cx)
    }
}

impl<F: Future + Send + 'static> Drop for AcquireCall<F> {
    fn drop(&mut self) {
        // Runs before `work` is dropped (and handed to a task), so that the task sees the flag.
        self.abandoned.store(true, Ordering::Release);
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

/// The columns schema version 3 added, after `result`, with their declarations (the same text in
/// both dialects: SQLite reads `bigint` as an integer). A table of version 2 gets them by
/// `ALTER TABLE … ADD COLUMN`, a new table at its end, so both have the same shape.
pub(crate) const V3_COLUMNS: [(&str, &str); 5] = [
    // The acquisition's labels (`Labels`): the step ('' when none was given), the run, the tenant.
    ("step", "text NOT NULL DEFAULT ''"),
    ("run_id", "text"),
    ("tenant", "text"),
    // When the row's current life began, and when it last changed: µs on the database clock.
    ("created_at", "bigint NOT NULL DEFAULT 0"),
    ("updated_at", "bigint NOT NULL DEFAULT 0"),
];

/// The statements that upgrade `table` from schema version 2 to 3: the new columns, and the
/// times of the rows already there, read as their last acquisition's (its fence is the
/// database clock of that acquisition, or just above it).
pub(crate) fn upgrade_v2_sql(table: &str) -> String {
    let mut sql = String::new();
    for (name, decl) in V3_COLUMNS {
        sql.push_str(&format!("ALTER TABLE \"{table}\" ADD COLUMN {name} {decl};\n"));
    }
    sql.push_str(&format!("UPDATE \"{table}\" SET created_at = fence, updated_at = fence"));
    sql
}

/// A row's [`RecordState`] as SQL (`running`, `stuck`, `released`, `needs_attention` or
/// `done`), judged at `now`: a running row whose lease passed, or a row released uncertain
/// (`recovered` set), is stuck.
fn shown_state(now: &str) -> String {
    format!(
        "(CASE WHEN state = 'running' AND lease_until > {now} THEN 'running' WHEN state = 'running' OR (state = \
         'released' AND recovered) THEN 'stuck' ELSE state END)"
    )
}

/// The statements of the record-admin calls, for a table and a dialect's clock.
pub(crate) struct AdminSql {
    /// The clock expression, µs since the Unix epoch.
    now: &'static str,
    /// `SELECT <info columns> FROM <table>`, without a `WHERE`.
    select: String,
    /// `inspect`: the row of key `$1`, unless expired.
    pub(crate) inspect: sqlx::SqlStr,
    /// `release_fenced`: key `$1`, fence `$2`.
    pub(crate) release_fenced: sqlx::SqlStr,
    /// `delete`: key `$1`; returns one row (whether a live lease kept it) unless it was absent.
    pub(crate) delete: sqlx::SqlStr,
}

/// An argument of a scan statement, in the order of its placeholders.
pub(crate) enum ScanArg {
    /// A key's bytes.
    Bytes(Vec<u8>),
    /// A text (a state, a step, a run, a tenant).
    Text(String),
    /// An integer (the limit, an idle time in µs).
    Int(i64),
}

impl AdminSql {
    /// The statements on `table` (a validated identifier), with `now` as the dialect's clock
    /// (fixed for the statement in both).
    pub(crate) fn new(table: &str, now: &'static str) -> Self {
        let t = format!("\"{table}\"");
        let select = format!(
            "SELECT key, fingerprint, {state}, step, run_id, tenant, attempt, fence, created_at, updated_at, CASE WHEN \
             state = 'running' THEN lease_until END, CASE WHEN state <> 'needs_attention' THEN expires_at END, CASE \
             WHEN state = 'done' THEN CAST(length(result) AS bigint) END\nFROM {t}",
            state = shown_state(now),
        );
        let inspect = format!("{select}\nWHERE key = $1 AND expires_at > {now}");
        // The holder's token is kept, so its repeated abandon (uncertain) is acknowledged as
        // before; its complete, renew and release find no running row and are refused.
        let release_fenced = format!(
            "UPDATE {t} SET state = 'released', recovered = true, updated_at = {now}\n\
             WHERE key = $1 AND fence = $2 AND state = 'running' AND expires_at > {now}"
        );
        // Deleting marks the row expired: it counts as absent at once (as any expired row), and
        // the purge removes it later; until then it keeps the fence, so the next acquisition's
        // fence grows past it even within one tick of the clock. A live lease keeps the row as
        // it is (every column set to its own value).
        let live = format!("(state = 'running' AND lease_until > {now})");
        let delete = format!(
            "UPDATE {t} SET expires_at = CASE WHEN {live} THEN expires_at ELSE {now} END,\n\
             result = CASE WHEN {live} THEN result ELSE NULL END,\n\
             updated_at = CASE WHEN {live} THEN updated_at ELSE {now} END\n\
             WHERE key = $1 AND expires_at > {now}\n\
             RETURNING {live}"
        );
        let sql = |s: String| sqlx::AssertSqlSafe(Arc::<str>::from(s)).into_sql_str();
        AdminSql { now, inspect: sql(inspect), release_fenced: sql(release_fenced), delete: sql(delete), select }
    }

    /// The scan statement for `filter` from `cursor`, and its arguments: `WHERE key > <cursor>
    /// AND <filter> ORDER BY key LIMIT <limit>`, on the primary key. The cursor is the last key
    /// listed, in hex; anything else is an [`Error::Config`].
    pub(crate) fn scan(
        &self,
        describe: &str,
        filter: &Filter,
        cursor: &Cursor,
        limit: usize,
    ) -> Result<(sqlx::SqlStr, Vec<ScanArg>), Error> {
        let after = if cursor.is_start() {
            Vec::new()
        } else {
            let key = Key::from_hex(cursor.as_str()).ok_or_else(|| {
                Error::Config(format!(
                    "{describe}: `{}` is not a cursor of this store's scan (the last key listed, 64 hex digits); \
                     start the scan again from Cursor::start",
                    cursor.as_str()
                ))
            })?;
            key.as_bytes().to_vec()
        };
        let now = self.now;
        let limit = i64::try_from(limit.clamp(1, MAX_PAGE)).unwrap_or(1);
        let mut args = vec![ScanArg::Bytes(after), ScanArg::Int(limit)];
        let mut conds = vec![format!("key > $1 AND expires_at > {now}")];
        let mut cond = |sql: &str, arg: ScanArg| {
            args.push(arg);
            conds.push(sql.replace('?', &format!("${}", args.len())));
        };
        if let Some(state) = filter.state {
            cond(&format!("{} = ?", shown_state(now)), ScanArg::Text(state.as_str().to_owned()));
        }
        if let Some(step) = &filter.step {
            cond("step = ?", ScanArg::Text(step.clone()));
        }
        if let Some(run) = &filter.run {
            cond("run_id = ?", ScanArg::Text(run.clone()));
        }
        if let Some(tenant) = &filter.tenant {
            cond("tenant = ?", ScanArg::Text(tenant.clone()));
        }
        if let Some(idle) = filter.idle_for {
            cond(&format!("updated_at <= {now} - ?"), ScanArg::Int(micros(idle)));
        }
        let sql = format!("{}\nWHERE {}\nORDER BY key LIMIT $2", self.select, conds.join(" AND "));
        Ok((sqlx::AssertSqlSafe(sql).into_sql_str(), args))
    }
}

/// A record as the admin statements return it, read out of the driver's row type (the columns
/// of [`AdminSql`]'s select, in order).
struct Info {
    key: Vec<u8>,
    fingerprint: Vec<u8>,
    state: String,
    step: String,
    run: Option<String>,
    tenant: Option<String>,
    attempt: i64,
    fence: i64,
    created_us: i64,
    updated_us: i64,
    lease_until_us: Option<i64>,
    expires_us: Option<i64>,
    result_bytes: Option<i64>,
}

/// Reads a row of an admin select into a [`RecordInfo`], or answers [`Error::Corrupt`].
pub(crate) fn read_record<R: sqlx::Row>(row: &R) -> Result<RecordInfo, Error>
where
    usize: sqlx::ColumnIndex<R>,
    for<'r> Vec<u8>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    let read = || -> Result<Info, sqlx::Error> {
        Ok(Info {
            key: row.try_get(0)?,
            fingerprint: row.try_get(1)?,
            state: row.try_get(2)?,
            step: row.try_get(3)?,
            run: row.try_get(4)?,
            tenant: row.try_get(5)?,
            attempt: row.try_get(6)?,
            fence: row.try_get(7)?,
            created_us: row.try_get(8)?,
            updated_us: row.try_get(9)?,
            lease_until_us: row.try_get(10)?,
            expires_us: row.try_get(11)?,
            result_bytes: row.try_get(12)?,
        })
    };
    let info = read().map_err(|e| {
        let key = row.try_get::<Vec<u8>, _>(0).ok().and_then(|k| <[u8; 32]>::try_from(k).ok());
        Error::Corrupt {
            key: key.map_or_else(|| "?".to_owned(), |k| Key::from_bytes(k).short()),
            detail: format!("a column has the wrong type: {e}"),
        }
    })?;
    info.into_info()
}

/// The page of a scan that asked for `limit` records and got `records`: a full page goes on
/// after its last key, a shorter one is the end.
pub(crate) fn page(records: Vec<RecordInfo>, limit: usize) -> Page {
    let next =
        (records.len() >= limit.clamp(1, MAX_PAGE)).then(|| records.last().map(|r| Cursor::from_text(r.key.to_hex())));
    Page::new(records, next.flatten())
}

/// The answer of `delete` from what its statement returned: no row, the key was absent; else
/// whether a live lease kept the row.
pub(crate) fn deleted(kept: Option<bool>) -> Deleted {
    match kept {
        None => Deleted::Absent,
        Some(true) => Deleted::Running,
        Some(false) => Deleted::Ok,
    }
}

/// An acquisition's [`Labels`], owned: an acquire's work may go on after its caller dropped it.
pub(crate) struct OwnedLabels {
    pub(crate) step: String,
    pub(crate) run: Option<String>,
    pub(crate) tenant: Option<String>,
}

impl From<Labels<'_>> for OwnedLabels {
    fn from(labels: Labels<'_>) -> Self {
        OwnedLabels {
            step: labels.step.to_owned(),
            run: labels.run.map(str::to_owned),
            tenant: labels.tenant.map(str::to_owned),
        }
    }
}

impl Info {
    /// The [`RecordInfo`] the row describes, or [`Error::Corrupt`] for values no store writes.
    fn into_info(self) -> Result<RecordInfo, Error> {
        let bytes32 = |v: &[u8]| <[u8; 32]>::try_from(v).ok();
        let key = bytes32(&self.key).map(Key::from_bytes).ok_or_else(|| Error::Corrupt {
            key: "?".to_owned(),
            detail: format!("a key of {} bytes", self.key.len()),
        })?;
        let corrupt = |detail: String| Error::Corrupt { key: key.short(), detail };
        let fingerprint = bytes32(&self.fingerprint)
            .map(Fingerprint::from_bytes)
            .ok_or_else(|| corrupt(format!("a fingerprint of {} bytes", self.fingerprint.len())))?;
        let state = self.state.parse::<RecordState>().map_err(corrupt)?;
        let attempt =
            u32::try_from(self.attempt).map_err(|_| corrupt(format!("attempt {} out of range", self.attempt)))?;
        let fence = u64::try_from(self.fence).map_err(|_| corrupt(format!("negative fence {}", self.fence)))?;
        let result_bytes = self
            .result_bytes
            .map(|n| usize::try_from(n).map_err(|_| corrupt(format!("a result of {n} bytes"))))
            .transpose()?;
        Ok(RecordInfo {
            key,
            fingerprint,
            state,
            step: self.step,
            run: self.run,
            tenant: self.tenant,
            attempt,
            fence,
            created: wall(self.created_us),
            updated: wall(self.updated_us),
            lease_until: self.lease_until_us.map(wall),
            expires: self.expires_us.map(wall),
            result_bytes,
        })
    }
}

/// µs since the Unix epoch as a wall-clock time (before the epoch reads as the epoch).
fn wall(us: i64) -> SystemTime {
    UNIX_EPOCH + Duration::from_micros(us.max(0).unsigned_abs())
}
