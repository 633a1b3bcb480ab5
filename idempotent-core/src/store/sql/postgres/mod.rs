//! PostgreSQL, the backend of [`PostgresStore`]: one table, shared by every process that
//! reaches the database. What it does differently from SQLite is here; the layout, the
//! statements and the durability notes are in the [module docs](super).
//!
//! # Where the store lives: TLS, a schema, PgBouncer
//!
//! - **TLS** (feature `tls-rustls`: sqlx's rustls with the ring provider, trusting the
//!   system's root certificates): the URL's `sslmode` and `sslrootcert` are sqlx's, as libpq
//!   reads them. `sslmode=verify-full&sslrootcert=/path/ca.crt` checks the CA and the host name,
//!   `verify-ca` the CA only, `require` encrypts without checking. Without the feature, a URL
//!   asking for TLS is an [`Error::Config`] naming it. A certificate no trusted CA signed, or not
//!   for the URL's host, fails opening the store with an [`Error::Unavailable`] that says so.
//! - **A schema** ([`PostgresStoreBuilder::schema`], or `?schema=` in the URL, which is how the
//!   CLI reaches such a store): the records' table, the state table and the registry
//!   `idempotent_schema` live in it, created if missing, and every statement names it; the
//!   connection's `search_path` is left alone, so a step's transaction finds the application's
//!   tables as before.
//! - **PgBouncer in transaction pooling mode** (`pool_mode = transaction`) needs
//!   [`PostgresStoreBuilder::transaction_pooling`]`(true)` (or `?transaction_pooling=true`),
//!   and nothing on PgBouncer's side. The pooler hands each transaction to any server
//!   connection, and an autocommit statement of sqlx is two (its parse, then its execution), so
//!   the store's named prepared statements would land on server connections that do not have
//!   them, or collide with another client's of the same name. Without the setting, PgBouncer
//!   1.18 refuses sqlx's startup parameter `extra_float_digits`, and opening the store fails at
//!   once with an [`Error::Unavailable`] that names this setting. With it, each statement is
//!   sent as one simple query, `SET LOCAL statement_timeout = …; <statement>` with its values
//!   written in (`inline.rs`): one message, one round trip, one implicit transaction, nothing
//!   prepared. A step's transaction begins with `BEGIN; SET LOCAL statement_timeout = …`, and
//!   its statements (the store's `complete_in`, and the application's own, which must be
//!   written so: `.persistent(false)`) are unnamed: the transaction keeps them on one server
//!   connection.
//!
//! # Timeouts and failures
//!
//! Opening the store opens one connection on its own first, so that a database that refuses it
//! (nothing listening, a TLS or authentication failure) fails the open at once with
//! [`Error::Unavailable`] and the driver's reason; the pool, which retries a refused connection
//! until its timeout, would only say that it ran out. The same holds for an open store whose
//! database went away: while the pool has no connection left, or after a call failed on its
//! connection and none has succeeded since, a record call (acquire, complete, and the other
//! transitions and reads of records) opens one directly first, and a refusal fails it at once,
//! saying so. Versioned-state calls and the `BEGIN` of
//! `run_in_transaction` take the pool's connections as they are.
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
//! happened: it acts only on a record that token holds. A serialization failure or a deadlock
//! (under a default isolation stricter than `READ COMMITTED`) rolled the statement back: acquire
//! runs it again.
//!
//! Connections that sat idle for more than a second are pinged before use, so that after a
//! database restart the pool replaces them rather than fail a call on each; connections in
//! steady use are not, so a call waits for one round trip. (sqlx itself checks each connection
//! with a `Sync` message as it goes back to the pool, after the call has answered.)
//!
//! # Indexes and HOT updates
//!
//! `expires_at` is indexed for the purge, so a statement that moves it (acquire taking over a
//! row, complete, resolve, abandon as needing attention, a renewal past the expiry) adds an entry
//! to each of the table's indexes; release, an uncertain abandon and a renewal within the expiry
//! change no indexed column, and PostgreSQL updates the row in place (a HOT update) when its page
//! has room, which the table's `fillfactor = 90` leaves. Complete could keep acquire's expiry and
//! be a HOT update too, but only by keeping a done record longer than its retention, which no
//! other store does.

use std::sync::atomic::Ordering;

use sqlx::error::DatabaseError;
use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgArguments, PgConnection, PgRow, Postgres};
use sqlx::query::Query;
use sqlx::{AssertSqlSafe, Connection, Row, SqlStr, Transaction};
use tokio::time::Instant;

use self::inline::inline;
use super::backend::{Backend, Effect, Failed, sealed};
use super::driver::{Driver, StateRow, Value};
use super::statements::sql;
use super::table::Table;
use super::{CommitsWith, SqlStore};
use crate::error::Error;

mod builder;
mod inline;
mod url;

pub use builder::PostgresStoreBuilder;

/// A store in one PostgreSQL table, safe for many tasks and for many processes on many hosts.
///
/// See the [module documentation](super) for the schema, the statements, the timeouts and the
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
pub type PostgresStore = SqlStore<PostgresBackend>;

/// The PostgreSQL [`Backend`] of [`PostgresStore`].
#[derive(Debug)]
pub struct PostgresBackend;

/// The states a row can be in (the table's `CHECK` constraint).
const STATES: &str = "'running', 'released', 'done', 'needs_attention'";
/// Expired rows deleted per purge batch at most.
const PURGE_BATCH: i64 = 256;
/// The database clock in µs since the Unix epoch, fixed for the statement.
const NOW_US: &str = "(extract(epoch FROM statement_timestamp()) * 1000000)::bigint";
/// The columns of the records' table and their types (as `format_type` spells them), in order.
const COLUMNS: [(&str, &str); 15] = [
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
    ("step", "text"),
    ("run_id", "text"),
    ("tenant", "text"),
    ("created_at", "bigint"),
    ("updated_at", "bigint"),
];
/// The advisory lock migrations hold for their transaction ("idempote" in ASCII).
const MIGRATE_LOCK: i64 = 0x6964_656d_706f_7465;

/// A statement ready to send ([`PostgresStore::ready`]).
enum Ready<'a> {
    /// Prepared (unnamed or cached by sqlx), its arguments bound.
    Bound(Query<'a, Postgres, PgArguments>),
    /// One simple query, its values written in (`inline.rs`).
    Written(String),
}

/// A serialization failure or a deadlock: the statement was rolled back and may run again.
fn serialization_failure(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(db) if matches!(db.code().as_deref(), Some("40001" | "40P01")))
}

impl PostgresStore {
    /// A connection of the pool for one statement, counted, and the deadline of the call (the
    /// timeout from now), which taking the connection counts against.
    ///
    /// With no connection in the pool (none opened yet, or every one lost with the database), or
    /// after a call failed on its connection and none has succeeded since, the call opens one
    /// directly first: the pool retries a refused connection until the timeout and reports only
    /// that it ran out, where this says at once that, and why, the database refused. (After a
    /// quiet spell that emptied the pool, the first calls each pay for one connection more.)
    /// After such a failure, the pool's connections are pinged before use until a call succeeds:
    /// those the database dropped meanwhile are closed, not handed out.
    async fn connection(&self, op: &'static str) -> Result<(PoolConnection<Postgres>, Instant), Failed> {
        let deadline = Instant::now() + self.inner.timeout;
        let troubled = self.inner.troubled.load(Ordering::Relaxed);
        if self.inner.pool.size() == 0 || troubled {
            let options = self.inner.pool.connect_options();
            match tokio::time::timeout_at(deadline, PgConnection::connect_with(&options)).await {
                // The pool opens its own; a failure to say goodbye changes nothing.
                Ok(Ok(conn)) => drop(conn.close().await),
                Ok(Err(e)) => return Err(Failed::not_sent(self.error(op, e))),
                Err(_) => return Err(Failed::not_sent(self.timed_out(op))),
            }
        }
        loop {
            match tokio::time::timeout_at(deadline, self.inner.pool.acquire()).await {
                Ok(Ok(mut conn)) => {
                    if troubled && !matches!(tokio::time::timeout_at(deadline, conn.ping()).await, Ok(Ok(()))) {
                        // Dropped by the database: closed, and another taken.
                        conn.close_on_drop();
                        continue;
                    }
                    self.count();
                    return Ok((conn, deadline));
                }
                Ok(Err(e)) => return Err(Failed::not_sent(self.troubled(self.error(op, e)))),
                Err(_) => return Err(Failed::not_sent(self.troubled(self.timed_out(op)))),
            }
        }
    }

    /// Notes that a call failed on the way to the database (the next calls open a connection
    /// directly first, see [`connection`](Self::connection)), and passes `error` on.
    fn troubled(&self, error: Error) -> Error {
        self.inner.troubled.store(true, Ordering::Relaxed);
        error
    }

    /// What a statement run on `conn` came to.
    fn ended<T>(
        &self,
        op: &'static str,
        mut conn: PoolConnection<Postgres>,
        outcome: Result<Result<T, sqlx::Error>, tokio::time::error::Elapsed>,
    ) -> Result<T, Failed> {
        match outcome {
            Ok(Ok(done)) => {
                // A write only when it changes, so that calls share the line read-only.
                if self.inner.troubled.load(Ordering::Relaxed) {
                    self.inner.troubled.store(false, Ordering::Relaxed);
                }
                Ok(done)
            }
            Ok(Err(e)) => {
                let effect = if serialization_failure(&e) { Effect::RolledBack } else { Effect::Unknown };
                let error = self.error(op, e);
                let error = if matches!(error, Error::Unavailable { .. }) { self.troubled(error) } else { error };
                Err(Failed { error, effect })
            }
            Err(_) => {
                // The statement may still be in the connection's pipe: never hand it out again.
                conn.close_on_drop();
                Err(Failed { error: self.timed_out(op), effect: Effect::Unknown })
            }
        }
    }

    /// `sql` with `args`, ready to send: prepared with its arguments bound, or, behind a pooler
    /// in transaction mode, written out with its values after `SET LOCAL statement_timeout`.
    fn ready<'a>(&self, sql: &SqlStr, args: impl IntoIterator<Item = Value<'a>>) -> Ready<'a> {
        match &self.inner.pooled {
            None => Ready::Bound(Postgres::query(sql, args)),
            Some(set) => Ready::Written(format!("{set}; {}", inline(sql.as_str(), args))),
        }
    }

    /// Runs `statement` on a connection of its own within the timeout, and returns its rows.
    async fn fetch(&self, op: &'static str, statement: Ready<'_>) -> Result<Vec<PgRow>, Failed> {
        let (mut conn, deadline) = self.connection(op).await?;
        let work = async {
            match statement {
                Ready::Bound(query) => query.fetch_all(&mut *conn).await,
                Ready::Written(text) => sqlx::raw_sql(AssertSqlSafe(text)).fetch_all(&mut *conn).await,
            }
        };
        let outcome = tokio::time::timeout_at(deadline, work).await;
        self.ended(op, conn, outcome)
    }

    /// [`fetch`](Self::fetch), for the number of rows the statement changed.
    async fn run(&self, op: &'static str, statement: Ready<'_>) -> Result<u64, Failed> {
        let (mut conn, deadline) = self.connection(op).await?;
        let work = async {
            match statement {
                Ready::Bound(query) => query.execute(&mut *conn).await,
                Ready::Written(text) => sqlx::raw_sql(AssertSqlSafe(text)).execute(&mut *conn).await,
            }
        };
        let outcome = tokio::time::timeout_at(deadline, work).await;
        self.ended(op, conn, outcome).map(|done| done.rows_affected())
    }

    /// Within the store's timeout.
    async fn within<T>(
        &self,
        op: &'static str,
        work: impl Future<Output = Result<T, sqlx::Error>>,
    ) -> Result<T, Error> {
        match tokio::time::timeout(self.inner.timeout, work).await {
            Ok(done) => done.map_err(|e| self.error(op, e)),
            Err(_) => Err(self.timed_out(op)),
        }
    }
}

impl sealed::Sealed for PostgresBackend {}

impl CommitsWith for Postgres {
    type Store = PostgresStore;
}

impl Backend for PostgresBackend {
    type Db = Postgres;
    type Purge = SqlStr;
    type Writes = ();

    const STORE: &'static str = "PostgresStore";
    const BUILDER_TABLE: &'static str = "PostgresStoreBuilder::table";
    const KIND: &'static str = "postgres";
    const NOW_US: &'static str = NOW_US;
    const GREATEST: &'static str = "greatest";

    fn acquire_sql(table: &Table) -> String {
        let t = table;
        let cols = COLUMNS.map(|(name, _)| name).join(", ");
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
        format!(
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
        )
    }

    fn purge_for(table: &Table) -> SqlStr {
        let t = table;
        let purge = format!(
            "DELETE FROM {t} WHERE key IN (\n\
             SELECT key FROM {t} WHERE expires_at <= {NOW_US} ORDER BY expires_at LIMIT {PURGE_BATCH} FOR UPDATE SKIP \
             LOCKED\n\
             ) AND expires_at <= {NOW_US}"
        );
        sql(purge)
    }

    fn reason(e: &sqlx::Error) -> String {
        let said = e.to_string();
        // rustls's words (sqlx passes them on as an I/O error) for a certificate no trusted CA
        // signed, and for one that does not name the host of the URL.
        let hint = if said.contains("UnknownIssuer") {
            "; the server's TLS certificate is not signed by a CA this client trusts: name the CA's certificate \
             with sslrootcert=<file> in the URL"
        } else if said.contains("not valid for name") || said.contains("NotValidForName") {
            "; the server's TLS certificate is not valid for the host name in the URL (sslmode=verify-full checks \
             it): connect by a name the certificate lists, or use sslmode=verify-ca"
        } else if said.contains("unsupported startup parameter") {
            // PgBouncer's refusal of sqlx's `extra_float_digits` (or the store's `options`).
            "; a connection pooler (PgBouncer?) is between the store and PostgreSQL: set \
             PostgresStoreBuilder::transaction_pooling(true), or ?transaction_pooling=true in the URL"
        } else if matches!(e, sqlx::Error::Tls(_)) || said.contains("invalid peer certificate") {
            "; the TLS handshake with the server failed"
        } else {
            ""
        };
        format!("{said}{hint}")
    }

    fn is_timeout(e: &dyn DatabaseError) -> bool {
        // query_canceled (`statement_timeout`) and lock_not_available (`lock_timeout`).
        matches!(e.code().as_deref(), Some("57014" | "55P03"))
    }

    fn fetch_optional<'a>(
        store: &'a PostgresStore,
        op: &'static str,
        sql: &'a SqlStr,
        args: impl IntoIterator<Item = Value<'a>> + Send + 'a,
    ) -> impl Future<Output = Result<Option<PgRow>, Failed>> + Send + 'a {
        // Bound before the future, which then holds the query only. All the rows are read, as
        // acquire's statement must run to its end (its read may answer and its write not, or the
        // other way round).
        let q = store.ready(sql, args);
        async move { Ok(store.fetch(op, q).await?.into_iter().next()) }
    }

    fn fetch_all<'a>(
        store: &'a PostgresStore,
        op: &'static str,
        sql: &'a SqlStr,
        args: impl IntoIterator<Item = Value<'a>> + Send + 'a,
    ) -> impl Future<Output = Result<Vec<PgRow>, Failed>> + Send + 'a {
        store.fetch(op, store.ready(sql, args))
    }

    fn execute<'a>(
        store: &'a PostgresStore,
        op: &'static str,
        sql: &'a SqlStr,
        args: impl IntoIterator<Item = Value<'a>> + Send + 'a,
    ) -> impl Future<Output = Result<u64, Failed>> + Send + 'a {
        store.run(op, store.ready(sql, args))
    }

    fn execute_in<'a>(
        store: &'a PostgresStore,
        tx: &'a mut Transaction<'static, Postgres>,
        op: &'static str,
        sql: &'a SqlStr,
        args: impl IntoIterator<Item = Value<'a>> + Send + 'a,
    ) -> impl Future<Output = Result<u64, Error>> + Send + 'a {
        // Behind a transaction pooler nothing named may outlive the transaction.
        let q = Postgres::query(sql, args).persistent(store.inner.pooled.is_none());
        async move {
            store.count();
            Ok(store.within(op, q.execute(&mut **tx)).await?.rows_affected())
        }
    }

    async fn begin(store: &PostgresStore) -> Result<Transaction<'static, Postgres>, Error> {
        match &store.inner.pooled {
            Some(set) => {
                store.within("begin", store.inner.pool.begin_with(AssertSqlSafe(format!("BEGIN; {set}")))).await
            }
            None => store.within("begin", store.inner.pool.begin()).await,
        }
    }

    fn state_read<'a>(
        store: &'a PostgresStore,
        sql: SqlStr,
        args: impl IntoIterator<Item = Value<'a>> + Send + 'a,
    ) -> impl Future<Output = Result<Option<StateRow>, sqlx::Error>> + Send + 'a {
        let statement = store.ready(&sql, args);
        async move {
            let row = match statement {
                Ready::Bound(query) => query.fetch_optional(&store.inner.pool).await?,
                Ready::Written(text) => sqlx::raw_sql(AssertSqlSafe(text)).fetch_optional(&store.inner.pool).await?,
            };
            row.map(|row| Ok((row.try_get(0)?, row.try_get(1)?, row.try_get(2)?))).transpose()
        }
    }

    fn state_write<'a>(
        store: &'a PostgresStore,
        sql: SqlStr,
        args: impl IntoIterator<Item = Value<'a>> + Send + 'a,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send + 'a {
        let statement = store.ready(&sql, args);
        async move {
            let done = match statement {
                Ready::Bound(query) => query.execute(&store.inner.pool).await?,
                Ready::Written(text) => sqlx::raw_sql(AssertSqlSafe(text)).execute(&store.inner.pool).await?,
            };
            Ok(done.rows_affected())
        }
    }

    fn renews_during_transaction(store: &PostgresStore) -> bool {
        store.pool().options().get_max_connections() >= 2
    }

    async fn purge(store: &PostgresStore) -> Result<u64, Error> {
        Self::execute(store, "purge", &store.inner.purge, []).await.map_err(|f| f.error)
    }

    fn recovered(row: &PgRow) -> Result<bool, sqlx::Error> {
        row.try_get(5)
    }

    async fn begin_migration(store: &PostgresStore) -> Result<Transaction<'static, Postgres>, sqlx::Error> {
        let mut tx = store.inner.pool.begin().await?;
        sqlx::query("SELECT pg_advisory_xact_lock($1)").persistent(false).bind(MIGRATE_LOCK).execute(&mut *tx).await?;
        if let Some(schema) = store.inner.table.schema() {
            // Created only when missing: `CREATE SCHEMA IF NOT EXISTS` asks for the right to
            // create schemas even when the schema exists, which a user may not have.
            let exists: bool = sqlx::query_scalar("SELECT EXISTS (SELECT FROM pg_namespace WHERE nspname = $1)")
                .persistent(false)
                .bind(schema)
                .fetch_one(&mut *tx)
                .await?;
            if !exists {
                sqlx::raw_sql(AssertSqlSafe(format!("CREATE SCHEMA \"{schema}\""))).execute(&mut *tx).await?;
            }
        }
        Ok(tx)
    }

    async fn bound_migration<'a, T: Send + 'a>(
        store: &'a PostgresStore,
        op: &'static str,
        work: impl Future<Output = Result<T, Error>> + Send + 'a,
    ) -> Result<T, Error> {
        store.bounded(op, work).await
    }

    async fn registered_version<'a>(
        tx: &'a mut Transaction<'static, Postgres>,
        table: &'a Table,
    ) -> Result<Option<i64>, sqlx::Error> {
        let registry = table.registry();
        let create =
            format!("CREATE TABLE IF NOT EXISTS {registry} (name text PRIMARY KEY NOT NULL, version integer NOT NULL)");
        sqlx::raw_sql(AssertSqlSafe(create)).execute(&mut **tx).await?;
        let select = format!("SELECT version FROM {registry} WHERE name = $1");
        let version: Option<i32> = sqlx::query_scalar(AssertSqlSafe(select))
            .persistent(false)
            .bind(table.name())
            .fetch_optional(&mut **tx)
            .await?;
        Ok(version.map(i64::from))
    }

    async fn register<'a>(
        tx: &'a mut Transaction<'static, Postgres>,
        table: &'a Table,
        version: i64,
    ) -> Result<(), sqlx::Error> {
        let version = i32::try_from(version).unwrap_or(i32::MAX);
        let insert = format!("INSERT INTO {} (name, version) VALUES ($1, $2)", table.registry());
        sqlx::query(AssertSqlSafe(insert))
            .persistent(false)
            .bind(table.name())
            .bind(version)
            .execute(&mut **tx)
            .await
            .map(drop)
    }

    async fn exists<'a>(tx: &'a mut Transaction<'static, Postgres>, table: &'a Table) -> Result<bool, sqlx::Error> {
        sqlx::query_scalar("SELECT to_regclass(format('%I.%I', coalesce($2, current_schema()), $1::text)) IS NOT NULL")
            .persistent(false)
            .bind(table.name())
            .bind(table.schema())
            .fetch_one(&mut **tx)
            .await
    }

    async fn columns<'a>(
        tx: &'a mut Transaction<'static, Postgres>,
        table: &'a Table,
    ) -> Result<Vec<String>, sqlx::Error> {
        let columns: Vec<(String, String)> = sqlx::query_as(
            "SELECT a.attname::text, format_type(a.atttypid, a.atttypmod) FROM pg_attribute a \
             WHERE a.attrelid = to_regclass(format('%I.%I', coalesce($2, current_schema()), $1::text)) AND a.attnum > 0 \
             AND NOT a.attisdropped ORDER BY a.attnum",
        )
        .persistent(false)
        .bind(table.name())
        .bind(table.schema())
        .fetch_all(&mut **tx)
        .await?;
        Ok(columns.into_iter().map(|(name, ty)| format!("{name} {ty}")).collect())
    }

    fn expected_columns() -> Vec<String> {
        COLUMNS.iter().map(|(name, ty)| format!("{name} {ty}")).collect()
    }

    fn create_records(table: &Table) -> String {
        format!(
            "CREATE TABLE {table} (\n\
             key bytea PRIMARY KEY NOT NULL CHECK (length(key) = 32),\n\
             fingerprint bytea NOT NULL,\n\
             state text NOT NULL CONSTRAINT \"{name}_state_check\" CHECK (state IN ({STATES})),\n\
             token text NOT NULL,\n\
             fence bigint NOT NULL,\n\
             attempt bigint NOT NULL,\n\
             recovered boolean NOT NULL,\n\
             lease_until bigint NOT NULL,\n\
             expires_at bigint NOT NULL,\n\
             result bytea,\n\
             step text NOT NULL DEFAULT '',\n\
             run_id text,\n\
             tenant text,\n\
             created_at bigint NOT NULL DEFAULT 0,\n\
             updated_at bigint NOT NULL DEFAULT 0\n\
             ) WITH (fillfactor = 90);\n\
             CREATE INDEX \"{name}_expires_at\" ON {table} (expires_at);\n\
             CREATE INDEX \"{name}_run_id\" ON {table} (run_id, key)",
            name = table.name()
        )
    }

    fn create_state(table: &Table) -> String {
        format!(
            "CREATE TABLE {table} (\n\
             scope bytea PRIMARY KEY NOT NULL CHECK (length(scope) = 32),\n\
             tenant text,\n\
             name text NOT NULL,\n\
             version bigint NOT NULL CHECK (version > 0),\n\
             value bytea NOT NULL,\n\
             tokens bytea NOT NULL\n\
             )"
        )
    }

    fn state_missing(e: &dyn DatabaseError) -> bool {
        // undefined_table, undefined_column.
        matches!(e.code().as_deref(), Some("42P01" | "42703"))
    }
}
