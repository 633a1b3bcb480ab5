//! The state protocol on the SQL stores: a table of its own next to the records'.
//!
//! # Schema (version 1)
//!
//! One row per scope, in the table `<records table>_state` (`idempotent_records_state` unless
//! the store's table was named otherwise), registered in `idempotent_schema` like the records'
//! table:
//!
//! | column | type | meaning |
//! |---|---|---|
//! | `scope` | `BLOB`/`bytea PRIMARY KEY` | the scope's digest ([`Scope::digest`](crate::state::Scope::digest)) |
//! | `tenant`, `name` | `TEXT` | the scope, for people reading the table |
//! | `version` | `INTEGER`/`bigint` | the version (≥ 1: an absent state has no row) |
//! | `value` | `BLOB`/`bytea` | the value |
//! | `tokens` | `BLOB`/`bytea` | the last [`COMMIT_HISTORY`](crate::state::COMMIT_HISTORY) commit tokens, 16 bytes each, newest last (the newest produced `version`) |
//!
//! The table is created on first use (when the database says it is missing, or lacks a column;
//! or by `migrate_state`), in one transaction (SQLite:
//! `BEGIN IMMEDIATE`; PostgreSQL: under an advisory lock), so that processes starting at once do
//! not both create it. A table of that name this crate did not create, or of another version, is
//! an [`Error::Config`](crate::Error::Config) saying what to do, and is never altered.
//!
//! # Statements
//!
//! A load is one `SELECT`. A commit is a `SELECT` of the row (its token history answers a
//! retried commit at once, and its version a stale one), then, for a commit that may go in,
//! `UPDATE … SET version = $n + 1, … WHERE scope = $1 AND version = $n`, or for an absent state
//! `INSERT … ON CONFLICT (scope) DO NOTHING`, each in autocommit. A write that matched no row
//! lost a race since the `SELECT`: the commit reads again and answers from what it finds (a
//! conflict). No transaction holds a lock across statements, and the version check in the
//! write makes the pair atomic: the history read belongs to the version the write expects.
//! Each call is bounded by the store's timeout (PostgreSQL) or busy timeout (SQLite).

use bytes::Bytes;
use sqlx::{AssertSqlSafe, SqlSafeStr};

use super::SqlStore;
use super::backend::Backend;
use super::driver::Value;
use super::table::Table;
use crate::error::Error;
use crate::state::{Commit, CommitToken, Loaded, Scope, StateStore, Version, history};
use crate::store::{BoxFuture, Store};

/// The state table of a store whose records are in `table` (in the same schema).
fn state_table(table: &Table) -> Table {
    table.sibling(format!("{}_state", table.name()))
}

/// What a commit found in the row.
struct Row {
    version: i64,
    value: Vec<u8>,
    tokens: Vec<u8>,
}

/// How a commit goes on from the row it read.
enum Judged {
    Answer(Commit<Bytes>),
    /// Write `tokens` with the value on `expected`.
    Write {
        tokens: Vec<u8>,
    },
}

fn judge(scope: &Scope, row: Option<Row>, expected: Version, token: &CommitToken) -> Result<Judged, Error> {
    let Some(row) = row else {
        return Ok(if expected.is_absent() {
            Judged::Write { tokens: token.as_bytes().to_vec() }
        } else {
            Judged::Answer(Commit::Conflict { current: Loaded { value: None, version: Version::ABSENT } })
        });
    };
    let version = version_of(scope, row.version)?;
    if let Some(produced) = history::find(&row.tokens, version, token) {
        return Ok(Judged::Answer(Commit::Committed { version: produced, replayed: true }));
    }
    if version != expected {
        let current = Loaded { value: Some(Bytes::from(row.value)), version };
        return Ok(Judged::Answer(Commit::Conflict { current }));
    }
    Ok(Judged::Write { tokens: history::push(&row.tokens, token) })
}

fn version_of(scope: &Scope, v: i64) -> Result<Version, Error> {
    match u64::try_from(v) {
        Ok(v) if v > 0 => Ok(Version::new(v)),
        _ => Err(Error::Corrupt {
            key: crate::Key::from_bytes(*scope.digest()).short().to_string(),
            detail: format!("state {scope}: its row has version {v}, below 1"),
        }),
    }
}

fn i64_of(v: Version) -> i64 {
    i64::try_from(v.get()).unwrap_or(i64::MAX)
}

impl<B: Backend> SqlStore<B> {
    /// Creates the state table (see [`crate::state`]) if it is missing, or checks that it is the
    /// one this crate creates. The first state call does it already; running it again changes
    /// nothing.
    pub async fn migrate_state(&self) -> Result<(), Error> {
        let table = state_table(&self.inner.table);
        self.bounded("migrate", self.migrate_state_table(&table)).await
    }

    /// Runs `work` within the store's timeout, creating the state table first if the database
    /// says it is missing (then once more).
    async fn state_call<T, F, Fut>(&self, op: &'static str, mut work: F) -> Result<T, Error>
    where
        F: FnMut(Table) -> Fut,
        Fut: std::future::Future<Output = Result<T, sqlx::Error>>,
    {
        let timeout = self.inner.timeout;
        let table = state_table(&self.inner.table);
        let timed = |fut: Fut| async move {
            match tokio::time::timeout(timeout, fut).await {
                Ok(res) => Ok(res),
                Err(_) => Err(self.timed_out(op)),
            }
        };
        match timed(work(table.clone())).await? {
            Ok(v) => Ok(v),
            Err(e) if e.as_database_error().is_some_and(B::state_missing) => {
                self.migrate_state().await?;
                timed(work(table)).await?.map_err(|e| self.error(op, e))
            }
            Err(e) => Err(self.error(op, e)),
        }
    }

    async fn read_row(&self, op: &'static str, scope: &Scope) -> Result<Option<Row>, Error> {
        let row = self
            .state_call(op, |table| {
                let sql = format!("SELECT version, value, tokens FROM {table} WHERE scope = $1");
                B::state_read(self, AssertSqlSafe(sql).into_sql_str(), [Value::Bytes(&scope.digest()[..])])
            })
            .await?;
        Ok(row.map(|(version, value, tokens)| Row { version, value, tokens }))
    }
}

impl<B: Backend> StateStore for SqlStore<B> {
    fn load<'a>(&'a self, scope: &'a Scope) -> BoxFuture<'a, Result<Loaded<Bytes>, Error>> {
        Box::pin(async move {
            Ok(match self.read_row("state load", scope).await? {
                Some(row) => Loaded { value: Some(Bytes::from(row.value)), version: version_of(scope, row.version)? },
                None => Loaded { value: None, version: Version::ABSENT },
            })
        })
    }

    fn commit<'a>(
        &'a self,
        scope: &'a Scope,
        expected: Version,
        value: Bytes,
        token: &'a CommitToken,
    ) -> BoxFuture<'a, Result<Commit<Bytes>, Error>> {
        Box::pin(async move {
            let op = "state commit";
            // A write that matches no row lost a race; the next read sees the winner, so the loop
            // ends there (versions only grow, and rows are never deleted).
            loop {
                let row = self.read_row(op, scope).await?;
                let tokens = match judge(scope, row, expected, token)? {
                    Judged::Answer(answer) => return Ok(answer),
                    Judged::Write { tokens } => tokens,
                };
                let (tokens, value) = (&tokens, &value);
                let written = self
                    .state_call(op, |table| {
                        let digest = Value::Bytes(&scope.digest()[..]);
                        let (sql, args) = if expected.is_absent() {
                            let sql = format!(
                                "INSERT INTO {table} (scope, tenant, name, version, value, tokens) \
                                 VALUES ($1, $2, $3, 1, $4, $5) ON CONFLICT (scope) DO NOTHING"
                            );
                            let args = [
                                Some(digest),
                                Some(Value::OptText(scope.tenant_name())),
                                Some(Value::Text(scope.name())),
                                Some(Value::Bytes(&value[..])),
                                Some(Value::Bytes(&tokens[..])),
                            ];
                            (sql, args)
                        } else {
                            let sql = format!(
                                "UPDATE {table} SET version = $2 + 1, value = $3, tokens = $4 \
                                 WHERE scope = $1 AND version = $2"
                            );
                            let args = [
                                Some(digest),
                                Some(Value::Int(i64_of(expected))),
                                Some(Value::Bytes(&value[..])),
                                Some(Value::Bytes(&tokens[..])),
                                None,
                            ];
                            (sql, args)
                        };
                        B::state_write(self, AssertSqlSafe(sql).into_sql_str(), args.into_iter().flatten())
                    })
                    .await?;
                if written == 1 {
                    return Ok(Commit::Committed { version: expected.next(), replayed: false });
                }
            }
        })
    }

    fn describe(&self) -> String {
        Store::describe(self)
    }
}
