//! What both SQL databases do alike, written once over sqlx's generic API: binding a
//! statement's [`Value`]s, reading the rows both read the same way (an admin select's, `delete`'s
//! answer, a state row), and the statements both run the same way (the state calls on the pool,
//! a migration's DDL). [`Driver`] holds it for every sqlx database that encodes and decodes the
//! store's types; its bounds are stated once, on that implementation, so that the generic store
//! asks for `B::Db: Driver` and nothing more. What differs is the [`Backend`](super::Backend)'s.

use std::future::Future;

use sqlx::query::Query;
use sqlx::{
    AssertSqlSafe, ColumnIndex, Database, Decode, Encode, Executor, IntoArguments, Pool, Row, SqlStr, Transaction, Type,
};

use super::rows::{Found, found_of, read_record};
use crate::error::Error;
use crate::key::Key;
use crate::store::admin::RecordInfo;

/// A value bound to a statement's next placeholder (`$1`, `$2`, … in order). Borrowed where the
/// caller holds the value; owned where it was made for the statement (a scan's filter).
#[derive(Debug)]
pub enum Value<'a> {
    /// `bytea` / `BLOB`.
    Bytes(&'a [u8]),
    /// `bytea` / `BLOB`, made for the statement.
    OwnedBytes(Vec<u8>),
    /// `bytea` / `BLOB`, or `NULL`.
    OptBytes(Option<&'a [u8]>),
    /// `text`.
    Text(&'a str),
    /// `text`, made for the statement.
    OwnedText(String),
    /// `text`, or `NULL`.
    OptText(Option<&'a str>),
    /// `bigint` / `INTEGER`.
    Int(i64),
}

impl Value<'_> {
    /// The same value, owning what it binds (for a statement that runs after its caller's
    /// values are gone: a queued write).
    pub(crate) fn into_owned(self) -> Value<'static> {
        match self {
            Value::Bytes(b) | Value::OptBytes(Some(b)) => Value::OwnedBytes(b.to_vec()),
            Value::OwnedBytes(b) => Value::OwnedBytes(b),
            Value::OptBytes(None) => Value::OptBytes(None),
            Value::Text(t) | Value::OptText(Some(t)) => Value::OwnedText(t.to_owned()),
            Value::OwnedText(t) => Value::OwnedText(t),
            Value::OptText(None) => Value::OptText(None),
            Value::Int(n) => Value::Int(n),
        }
    }

    /// The same value, borrowed from this one.
    pub(crate) fn borrowed(&self) -> Value<'_> {
        match self {
            Value::Bytes(b) => Value::Bytes(b),
            Value::OwnedBytes(b) => Value::Bytes(b),
            Value::OptBytes(b) => Value::OptBytes(*b),
            Value::Text(t) => Value::Text(t),
            Value::OwnedText(t) => Value::Text(t),
            Value::OptText(t) => Value::OptText(*t),
            Value::Int(n) => Value::Int(*n),
        }
    }
}

/// A state row as a commit reads it: version, value, token history.
pub(crate) type StateRow = (i64, Vec<u8>, Vec<u8>);

/// A statement's result, saying how many rows it changed (each driver has the method; sqlx has
/// no trait for it).
pub trait RowsAffected {
    /// How many rows the statement changed.
    fn rows_affected(&self) -> u64;
}

#[cfg(feature = "sqlite")]
impl RowsAffected for sqlx::sqlite::SqliteQueryResult {
    fn rows_affected(&self) -> u64 {
        sqlx::sqlite::SqliteQueryResult::rows_affected(self)
    }
}

#[cfg(feature = "postgres")]
impl RowsAffected for sqlx::postgres::PgQueryResult {
    fn rows_affected(&self) -> u64 {
        sqlx::postgres::PgQueryResult::rows_affected(self)
    }
}

/// A sqlx database the store's statements run on, with what it does as the other one does.
/// Implemented for every database that binds each kind of [`Value`], decodes the store's
/// columns and runs statements on its connections (SQLite and PostgreSQL).
pub trait Driver: Database {
    /// `sql` with `args` bound in order.
    fn query<'a>(sql: &SqlStr, args: impl IntoIterator<Item = Value<'a>>) -> Query<'a, Self, Self::Arguments>;

    /// Acquire's row, its `recovered` column read by `recovered`.
    fn found(
        key: &Key,
        row: &Self::Row,
        recovered: impl FnOnce(&Self::Row) -> Result<bool, sqlx::Error>,
    ) -> Result<Found, Error>;

    /// A row of an admin select (`AdminSql`'s).
    fn record(row: &Self::Row) -> Result<RecordInfo, Error>;

    /// The one boolean column of `delete`'s answer.
    fn kept(row: &Self::Row) -> Result<bool, sqlx::Error>;

    /// Runs `ddl` (several statements) in `tx`.
    fn run_ddl(
        tx: &mut Transaction<'static, Self>,
        ddl: String,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// The state statements' runner: `sql` with `args` on `pool`, not counted, answering the
    /// `(version, value, tokens)` of the row read.
    fn state_read<'a>(
        pool: &'a Pool<Self>,
        sql: SqlStr,
        args: impl IntoIterator<Item = Value<'a>> + Send + 'a,
    ) -> impl Future<Output = Result<Option<StateRow>, sqlx::Error>> + Send + 'a;

    /// The state statements' runner for a write: how many rows it changed.
    fn state_write<'a>(
        pool: &'a Pool<Self>,
        sql: SqlStr,
        args: impl IntoIterator<Item = Value<'a>> + Send + 'a,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send + 'a;
}

impl<DB> Driver for DB
where
    DB: Database,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    for<'a> &'a [u8]: Encode<'a, DB> + Type<DB>,
    for<'a> Vec<u8>: Encode<'a, DB> + Decode<'a, DB> + Type<DB>,
    for<'a> Option<&'a [u8]>: Encode<'a, DB> + Type<DB>,
    for<'a> &'a str: Encode<'a, DB> + Type<DB>,
    for<'a> String: Encode<'a, DB> + Decode<'a, DB> + Type<DB>,
    for<'a> Option<&'a str>: Encode<'a, DB> + Type<DB>,
    for<'a> i64: Encode<'a, DB> + Decode<'a, DB> + Type<DB>,
    for<'a> bool: Decode<'a, DB> + Type<DB>,
    usize: ColumnIndex<DB::Row>,
    DB::QueryResult: RowsAffected,
    DB::Arguments: IntoArguments<DB>,
{
    fn query<'a>(sql: &SqlStr, args: impl IntoIterator<Item = Value<'a>>) -> Query<'a, DB, DB::Arguments> {
        let mut q = sqlx::query(sql.clone());
        for arg in args {
            q = match arg {
                Value::Bytes(b) => q.bind(b),
                Value::OwnedBytes(b) => q.bind(b),
                Value::OptBytes(b) => q.bind(b),
                Value::Text(t) => q.bind(t),
                Value::OwnedText(t) => q.bind(t),
                Value::OptText(t) => q.bind(t),
                Value::Int(n) => q.bind(n),
            };
        }
        q
    }

    fn found(
        key: &Key,
        row: &DB::Row,
        recovered: impl FnOnce(&DB::Row) -> Result<bool, sqlx::Error>,
    ) -> Result<Found, Error> {
        found_of(key, row, recovered)
    }

    fn record(row: &DB::Row) -> Result<RecordInfo, Error> {
        read_record(row)
    }

    fn kept(row: &DB::Row) -> Result<bool, sqlx::Error> {
        row.try_get(0)
    }

    async fn run_ddl(tx: &mut Transaction<'static, DB>, ddl: String) -> Result<(), sqlx::Error> {
        sqlx::raw_sql(AssertSqlSafe(ddl)).execute(&mut **tx).await.map(drop)
    }

    fn state_read<'a>(
        pool: &'a Pool<DB>,
        sql: SqlStr,
        args: impl IntoIterator<Item = Value<'a>> + Send + 'a,
    ) -> impl Future<Output = Result<Option<StateRow>, sqlx::Error>> + Send + 'a {
        let q = DB::query(&sql, args);
        async move {
            let row = q.fetch_optional(pool).await?;
            row.map(|row| Ok((row.try_get(0)?, row.try_get(1)?, row.try_get(2)?))).transpose()
        }
    }

    fn state_write<'a>(
        pool: &'a Pool<DB>,
        sql: SqlStr,
        args: impl IntoIterator<Item = Value<'a>> + Send + 'a,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send + 'a {
        let q = DB::query(&sql, args);
        async move { Ok(q.execute(pool).await?.rows_affected()) }
    }
}
