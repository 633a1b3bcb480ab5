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
//! | `scope` | `BLOB`/`bytea PRIMARY KEY` | the scope's digest ([`Scope::digest`]) |
//! | `tenant`, `name` | `TEXT` | the scope, for people reading the table |
//! | `version` | `INTEGER`/`bigint` | the version (≥ 1: an absent state has no row) |
//! | `value` | `BLOB`/`bytea` | the value |
//! | `tokens` | `BLOB`/`bytea` | the last [`COMMIT_HISTORY`](super::COMMIT_HISTORY) commit tokens, 16 bytes each, newest last (the newest produced `version`) |
//!
//! The table is created on first use (when the database says it is missing, or lacks a column;
//! or by `migrate_state`), in one transaction (SQLite:
//! `BEGIN IMMEDIATE`; PostgreSQL: under an advisory lock), so that processes starting at once do
//! not both create it. A table of that name this crate did not create, or of another version, is
//! an [`Error::Config`] saying what to do, and is never altered.
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
use sqlx::AssertSqlSafe;

use super::{Commit, CommitToken, Loaded, Scope, StateStore, Version, history};
use crate::error::Error;
use crate::store::{BoxFuture, Store};

/// The schema version of the state table this crate writes and reads.
const STATE_SCHEMA_VERSION: i64 = 1;

/// The state table of a store whose records are in `table`.
fn state_table(table: &str) -> String {
    format!("{table}_state")
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
            key: crate::Key::from_bytes(*scope.digest()).short(),
            detail: format!("state {scope}: its row has version {v}, below 1"),
        }),
    }
}

fn i64_of(v: Version) -> i64 {
    i64::try_from(v.get()).unwrap_or(i64::MAX)
}

/// Stamps out the [`StateStore`] implementation and `migrate_state` for one SQL store; `$p` is
/// the database's parameter prefix.
macro_rules! sql_state_store {
    ($store:ty, $p:literal, $missing:expr, $migrate:ident) => {
        impl $store {
            /// Creates the state table (see [`crate::state`]) if it is missing, or checks that it
            /// is the one this crate creates. The first state call does it already; running it
            /// again changes nothing.
            pub async fn migrate_state(&self) -> Result<(), Error> {
                let (table, timeout) = self.state_parts();
                let table = state_table(table);
                match tokio::time::timeout(timeout, $migrate(self, &table)).await {
                    Ok(res) => res,
                    Err(_) => Err(Error::Timeout { store: Store::describe(self), op: "migrate", after: timeout }),
                }
            }

            /// Runs `work` within the store's timeout, creating the state table first if the
            /// database says it is missing (then once more).
            async fn state_call<T, F, Fut>(&self, op: &'static str, mut work: F) -> Result<T, Error>
            where
                F: FnMut(String) -> Fut,
                Fut: std::future::Future<Output = Result<T, sqlx::Error>>,
            {
                let (table, timeout) = self.state_parts();
                let table = state_table(table);
                let timed = |fut: Fut| async move {
                    match tokio::time::timeout(timeout, fut).await {
                        Ok(res) => Ok(res),
                        Err(_) => Err(Error::Timeout { store: Store::describe(self), op, after: timeout }),
                    }
                };
                match timed(work(table.clone())).await? {
                    Ok(v) => Ok(v),
                    Err(e) if $missing(&e) => {
                        self.migrate_state().await?;
                        timed(work(table)).await?.map_err(|e| self.state_error(op, e))
                    }
                    Err(e) => Err(self.state_error(op, e)),
                }
            }

            async fn read_row(&self, op: &'static str, scope: &Scope) -> Result<Option<Row>, Error> {
                let pool = self.pool();
                let row: Option<(i64, Vec<u8>, Vec<u8>)> = self
                    .state_call(op, |table| {
                        let sql = format!(
                            "SELECT version, value, tokens FROM \"{table}\" WHERE scope = {p}1",
                            p = $p
                        );
                        async move {
                            sqlx::query_as(AssertSqlSafe(sql))
                                .bind(&scope.digest()[..])
                                .fetch_optional(pool)
                                .await
                        }
                    })
                    .await?;
                Ok(row.map(|(version, value, tokens)| Row { version, value, tokens }))
            }
        }

        impl StateStore for $store {
            fn load<'a>(&'a self, scope: &'a Scope) -> BoxFuture<'a, Result<Loaded<Bytes>, Error>> {
                Box::pin(async move {
                    Ok(match self.read_row("state load", scope).await? {
                        Some(row) => {
                            Loaded { value: Some(Bytes::from(row.value)), version: version_of(scope, row.version)? }
                        }
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
                    let pool = self.pool();
                    // A write that matches no row lost a race; the next read sees the winner, so
                    // the loop ends there (versions only grow, and rows are never deleted).
                    loop {
                        let row = self.read_row(op, scope).await?;
                        let tokens = match judge(scope, row, expected, token)? {
                            Judged::Answer(answer) => return Ok(answer),
                            Judged::Write { tokens } => tokens,
                        };
                        let (tokens, value) = (&tokens, &value);
                        let written = self
                            .state_call(op, |table| {
                                let sql = if expected.is_absent() {
                                    format!(
                                        "INSERT INTO \"{table}\" (scope, tenant, name, version, value, tokens) \
                                         VALUES ({p}1, {p}2, {p}3, 1, {p}4, {p}5) ON CONFLICT (scope) DO NOTHING",
                                        p = $p
                                    )
                                } else {
                                    format!(
                                        "UPDATE \"{table}\" SET version = {p}2 + 1, value = {p}3, tokens = {p}4 \
                                         WHERE scope = {p}1 AND version = {p}2",
                                        p = $p
                                    )
                                };
                                let q = sqlx::query(AssertSqlSafe(sql)).bind(&scope.digest()[..]);
                                let q = if expected.is_absent() {
                                    q.bind(scope.tenant_name()).bind(scope.name()).bind(&value[..]).bind(&tokens[..])
                                } else {
                                    q.bind(i64_of(expected)).bind(&value[..]).bind(&tokens[..])
                                };
                                async move { q.execute(pool).await.map(|done| done.rows_affected()) }
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
    };
}

#[cfg(feature = "sqlite")]
mod sqlite {
    use super::*;
    use crate::store::SqliteStore;

    /// The table is missing, or is not the one this crate creates (then `migrate_state` says so).
    fn missing(e: &sqlx::Error) -> bool {
        matches!(e, sqlx::Error::Database(db)
            if db.message().contains("no such table") || db.message().contains("no such column"))
    }

    async fn migrate(store: &SqliteStore, table: &str) -> Result<(), Error> {
        store.in_migration(async |conn| migrate_in(store, conn, table).await).await
    }

    async fn migrate_in(store: &SqliteStore, conn: &mut sqlx::SqliteConnection, table: &str) -> Result<(), Error> {
        let err = |e: sqlx::Error| store.state_error("migrate", e);
        let version = crate::store::sqlite::registered_version(conn, table).await.map_err(err)?;
        let exists: bool = sqlx::query_scalar("SELECT count(*) > 0 FROM sqlite_master WHERE name = ?1")
            .bind(table)
            .fetch_one(&mut *conn)
            .await
            .map_err(err)?;
        let db = Store::describe(store);
        match version {
            Some(STATE_SCHEMA_VERSION) if exists => Ok(()),
            Some(v) => Err(Error::Config(format!(
                "{db}: state table `{table}` is marked as schema version {v} (or is missing), and this version of \
                 idempotent-core reads version {STATE_SCHEMA_VERSION} only; use the idempotent-core that wrote it, \
                 or drop it and its row in idempotent_schema (losing its states)"
            ))),
            None if exists => Err(Error::Config(format!(
                "{db}: table `{table}` exists but was not created by idempotent-core; it was left as it is. Drop \
                 it, or name the store's table otherwise (SqliteStoreBuilder::table), which renames the state table"
            ))),
            None => {
                let create = format!(
                    "CREATE TABLE \"{table}\" (\n\
                     scope BLOB PRIMARY KEY NOT NULL CHECK (length(scope) = 32),\n\
                     tenant TEXT,\n\
                     name TEXT NOT NULL,\n\
                     version INTEGER NOT NULL CHECK (version > 0),\n\
                     value BLOB NOT NULL,\n\
                     tokens BLOB NOT NULL\n\
                     )"
                );
                sqlx::raw_sql(AssertSqlSafe(create)).execute(&mut *conn).await.map_err(err)?;
                sqlx::query("INSERT INTO idempotent_schema (name, version) VALUES (?1, ?2)")
                    .bind(table)
                    .bind(STATE_SCHEMA_VERSION)
                    .execute(&mut *conn)
                    .await
                    .map_err(err)?;
                Ok(())
            }
        }
    }

    sql_state_store!(SqliteStore, "?", missing, migrate);
}

#[cfg(feature = "postgres")]
mod postgres {
    use super::*;
    use crate::store::PostgresStore;

    /// The table is missing (`undefined_table`), or is not the one this crate creates
    /// (`undefined_column`; then `migrate_state` says so).
    fn missing(e: &sqlx::Error) -> bool {
        matches!(e, sqlx::Error::Database(db) if matches!(db.code().as_deref(), Some("42P01" | "42703")))
    }

    async fn migrate(store: &PostgresStore, table: &str) -> Result<(), Error> {
        let err = |e: sqlx::Error| store.state_error("migrate", e);
        let mut tx = crate::store::postgres::begin_migration(store.pool()).await.map_err(err)?;
        let version = crate::store::postgres::registered_version(&mut tx, table).await.map_err(err)?;
        let exists: bool =
            sqlx::query_scalar("SELECT to_regclass(format('%I.%I', current_schema(), $1::text)) IS NOT NULL")
                .bind(table)
                .fetch_one(&mut *tx)
                .await
                .map_err(err)?;
        let db = Store::describe(store);
        match version.map(i64::from) {
            Some(STATE_SCHEMA_VERSION) if exists => {}
            Some(v) => {
                return Err(Error::Config(format!(
                    "{db}: state table `{table}` is marked as schema version {v} (or is missing), and this version \
                     of idempotent-core reads version {STATE_SCHEMA_VERSION} only; use the idempotent-core that \
                     wrote it, or drop it and its row in idempotent_schema (losing its states)"
                )));
            }
            None if exists => {
                return Err(Error::Config(format!(
                    "{db}: relation `{table}` exists but was not created by idempotent-core; it was left as it is. \
                     Drop it, or name the store's table otherwise (PostgresStoreBuilder::table), which renames the \
                     state table"
                )));
            }
            None => {
                let create = format!(
                    "CREATE TABLE \"{table}\" (\n\
                     scope bytea PRIMARY KEY NOT NULL CHECK (length(scope) = 32),\n\
                     tenant text,\n\
                     name text NOT NULL,\n\
                     version bigint NOT NULL CHECK (version > 0),\n\
                     value bytea NOT NULL,\n\
                     tokens bytea NOT NULL\n\
                     )"
                );
                sqlx::raw_sql(AssertSqlSafe(create)).execute(&mut *tx).await.map_err(err)?;
                sqlx::query("INSERT INTO idempotent_schema (name, version) VALUES ($1, $2)")
                    .bind(table)
                    .bind(STATE_SCHEMA_VERSION as i32)
                    .execute(&mut *tx)
                    .await
                    .map_err(err)?;
            }
        }
        tx.commit().await.map_err(err)
    }

    sql_state_store!(PostgresStore, "$", missing, migrate);
}
