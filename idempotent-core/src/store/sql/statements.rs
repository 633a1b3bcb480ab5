//! The statements the two databases share, written once for a table and a backend's clock:
//! every transition but acquire's upsert and the purge, acquire's read, and the admin calls'.
//! The layout they work on and what each one does is in the [module docs](super).
//!
//! Placeholders are `$1`, `$2`, … in both dialects (SQLite reads `$N` as parameter N), and
//! booleans are `true`/`false` (SQLite stores them as 1/0 in its `INTEGER` column).

use std::sync::Arc;

use sqlx::{AssertSqlSafe, SqlSafeStr, SqlStr};

use super::backend::Backend;
use super::driver::Value;
use super::table::Table;
use super::{MAX_US, NEVER_US};
use crate::error::Error;
use crate::key::Key;
use crate::store::admin::{Cursor, Filter, MAX_PAGE};

/// A duration in µs, as the SQL stores bind it.
pub(crate) fn micros(d: std::time::Duration) -> i64 {
    i64::try_from(d.as_micros()).unwrap_or(MAX_US).min(MAX_US)
}

/// A statement text the store made (from a validated table name), as sqlx takes it.
pub(crate) fn sql(s: String) -> SqlStr {
    AssertSqlSafe(Arc::<str>::from(s)).into_sql_str()
}

/// The statements of one store, built when it is made.
pub(crate) struct Statements {
    /// acquire's read, when it reads first ([`AcquireOrder`](crate::store::AcquireOrder)): the
    /// live row of key `$1`, if any, in the columns of the upsert's answer ([`Found`](super::rows::Found)),
    /// its token left out (it is never the fresh token of the acquire reading it).
    pub(crate) acquire_read: SqlStr,
    /// acquire's upsert (the backend's): key `$1`, fingerprint `$2`, token `$3`, lease `$4` and
    /// expiry `$5` in µs, step `$6`, run `$7`, tenant `$8`.
    pub(crate) acquire: SqlStr,
    /// The owner's transitions: key `$1`, token `$2`, then result `$3` and retention `$4`
    /// (complete) or the lease `$3` (renew).
    pub(crate) complete: SqlStr,
    pub(crate) release: SqlStr,
    /// `release` for the key a failed or dropped acquire may have taken: the row keeps its
    /// `recovered` flag, so that a takeover of an uncertain record leaves it uncertain.
    pub(crate) release_orphan: SqlStr,
    pub(crate) renew: SqlStr,
    pub(crate) abandon_uncertain: SqlStr,
    pub(crate) abandon_attention: SqlStr,
    /// key `$1`, state `$2`, result `$3`, retention `$4` in µs.
    pub(crate) resolve: SqlStr,
    pub(crate) admin: AdminSql,
}

impl Statements {
    /// The statements on `table` in `B`'s dialect.
    pub(crate) fn new<B: Backend>(table: &Table) -> Self {
        let (now, greatest) = (B::NOW_US, B::GREATEST);
        let t = table;
        let acquire_read = format!(
            "SELECT '', fingerprint, state, fence, attempt, recovered, lease_until - {now}, result FROM {t}\n\
             WHERE key = $1 AND expires_at > {now}"
        );
        let owned = format!("key = $1 AND token = $2 AND expires_at > {now}");
        // A repeat by the same token (its row already in the state it asks for) changes nothing.
        let touched = format!("updated_at = CASE WHEN state = 'running' THEN {now} ELSE updated_at END");
        let complete = format!(
            "UPDATE {t} SET result = CASE WHEN state = 'done' THEN result ELSE $3 END,\n\
             expires_at = CASE WHEN state = 'done' THEN expires_at ELSE {now} + $4 END,\n\
             updated_at = CASE WHEN state = 'done' THEN updated_at ELSE {now} END,\n\
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
            "UPDATE {t} SET state = $2, result = $3, expires_at = {now} + $4, recovered = false, updated_at = {now}\n\
             WHERE key = $1 AND state = 'needs_attention'"
        );
        let renew = format!(
            "UPDATE {t} SET lease_until = {now} + $3, expires_at = {greatest}(expires_at, {now} + $3), \
             updated_at = {now}\n\
             WHERE {owned} AND state = 'running'"
        );
        Statements {
            acquire_read: sql(acquire_read),
            acquire: sql(B::acquire_sql(table)),
            complete: sql(complete),
            release: sql(release),
            release_orphan: sql(release_orphan),
            renew: sql(renew),
            abandon_uncertain: sql(abandon_uncertain),
            abandon_attention: sql(abandon_attention),
            resolve: sql(resolve),
            admin: AdminSql::new(table, now),
        }
    }
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

impl AdminSql {
    /// The statements on `table`, with `now` as the dialect's clock (fixed for the statement in
    /// both).
    pub(crate) fn new(table: &Table, now: &'static str) -> Self {
        let t = table;
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
    ) -> Result<(sqlx::SqlStr, Vec<Value<'static>>), Error> {
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
        let mut args = vec![Value::OwnedBytes(after), Value::Int(limit)];
        let mut conds = vec![format!("key > $1 AND expires_at > {now}")];
        let mut cond = |sql: &str, arg: Value<'static>| {
            args.push(arg);
            conds.push(sql.replace('?', &format!("${}", args.len())));
        };
        if let Some(state) = filter.state {
            cond(&format!("{} = ?", shown_state(now)), Value::OwnedText(state.as_str().to_owned()));
        }
        if let Some(step) = &filter.step {
            cond("step = ?", Value::OwnedText(step.clone()));
        }
        if let Some(run) = &filter.run {
            cond("run_id = ?", Value::OwnedText(run.clone()));
        }
        if let Some(tenant) = &filter.tenant {
            cond("tenant = ?", Value::OwnedText(tenant.clone()));
        }
        if let Some(idle) = filter.idle_for {
            cond(&format!("updated_at <= {now} - ?"), Value::Int(micros(idle)));
        }
        let sql = format!("{}\nWHERE {}\nORDER BY key LIMIT $2", self.select, conds.join(" AND "));
        Ok((AssertSqlSafe(sql).into_sql_str(), args))
    }
}
