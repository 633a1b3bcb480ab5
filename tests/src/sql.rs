//! What a scenario written once for both SQL stores asks of its database: [`SqlDb`], implemented
//! for [`SqliteBackend`] and [`PostgresBackend`] (the backends `SqlStore<B>` is generic over).
//!
//! The scenarios themselves (`transaction.rs`, `sql_store.rs`) are generic over `B: SqlDb`, and
//! [`on_every_store!(sql: …)`](crate::on_every_store) runs each on an empty database of both
//! ([`matrix::Database`](crate::matrix::Database)). What differs between the two is here and
//! only here: how a store is opened, the few statements whose SQL is not the same, and the
//! texts the tests expect in errors. Every statement a scenario runs on its own goes through a
//! method of [`SqlDb`], since sqlx's generic bounds would otherwise follow it everywhere.

use std::future::Future;
use std::time::{Duration, Instant};

use idempotent_core::store::sql::{Backend, SqlStore};
pub use idempotent_core::store::sql::{PostgresBackend, SqliteBackend};
use idempotent_core::{CommitsWith, Error, Key, PostgresStore, SqliteStore};
use sqlx::pool::PoolConnection;
use sqlx::{Connection, Transaction};

use crate::matrix::Kind;

/// A plain connection of `B`'s database.
pub type Conn<B> = <<B as Backend>::Db as sqlx::Database>::Connection;

/// A SQL store's backend, as the scenarios written once for both databases use it.
pub trait SqlDb: Backend<Db: CommitsWith<Store = SqlStore<Self>>> {
    /// The matrix's kind of this store.
    const MATRIX: Kind;
    /// The store's name, as errors say it.
    const STORE_NAME: &'static str;
    /// The builder's `table` setter, which errors about the table point to.
    const TABLE_SETTER: &'static str;
    /// How the store's description begins.
    const SCHEME: &'static str;
    /// The database clock in µs, as the store's `lease_until` and `expires_at` count it.
    const CLOCK_US: &'static str;
    /// The business table of the transactional scenarios: `invoices (id, order_id, fence)`, in
    /// insertion order by `id`.
    const CREATE_INVOICES: &'static str;
    /// What the database says when a deferred foreign key fails a commit.
    const FOREIGN_KEY_VIOLATION: &'static str;
    /// A change by hand of the table `records` (of the current schema version), and what the
    /// error that refuses it says besides "changed by hand".
    const CHANGED_BY_HAND: (&'static str, &'static str);
    /// The names of the columns of the table `$1`, in order.
    const COLUMNS: &'static str;
    /// The names of the tables a store on the database would see, in order.
    const TABLES: &'static str;

    /// A store on the database at `url`, with the default settings.
    fn open(url: &str) -> impl Future<Output = Result<SqlStore<Self>, Error>>;
    /// A store on the database at `url`, with its records in `table`.
    fn open_table(url: &str, table: &str) -> impl Future<Output = Result<SqlStore<Self>, Error>>;
    /// A store on the database at `url`, on a pool of at most `connections` connections.
    fn open_pool(url: &str, connections: u32) -> impl Future<Output = Result<SqlStore<Self>, Error>>;
    /// A plain connection to the database at `url`, outside any store (an SQLite file is
    /// created if missing).
    fn connect(url: &str) -> impl Future<Output = Conn<Self>>;

    /// Runs `sql` (statements without parameters).
    fn exec(conn: &mut Conn<Self>, sql: &str) -> impl Future<Output = Result<(), sqlx::Error>> + Send;
    /// Runs `sql` with `binds` for `$1`, `$2`, …, answering how many rows it changed.
    fn execute_bytes(conn: &mut Conn<Self>, sql: &str, binds: &[&[u8]]) -> impl Future<Output = u64> + Send;
    /// The one integer `sql` answers (a `SELECT count(*) …`).
    fn count(conn: &mut Conn<Self>, sql: &str) -> impl Future<Output = i64> + Send;
    /// The text column of every row `sql` answers.
    fn strings(conn: &mut Conn<Self>, sql: &str) -> impl Future<Output = Vec<String>> + Send;
    /// The names of the columns of `table`, in order ([`COLUMNS`](Self::COLUMNS)).
    fn column_names(conn: &mut Conn<Self>, table: &str) -> impl Future<Output = Vec<String>> + Send;
    /// The (state, attempt) of `key`'s record, if it has a row.
    fn state_of(conn: &mut Conn<Self>, key: &Key) -> impl Future<Output = Option<(String, i64)>> + Send;
    /// Every (key, state, attempt) in the records' table.
    fn records(conn: &mut Conn<Self>) -> impl Future<Output = Vec<(Vec<u8>, String, i64)>> + Send;
    /// Inserts the invoice `(order_id, fence)` in the step's transaction.
    fn insert(
        tx: &mut Transaction<'_, Self::Db>,
        order_id: &str,
        fence: u64,
    ) -> impl Future<Output = Result<(), Error>> + Send;
    /// The invoices, in insertion order.
    fn invoices(conn: &mut Conn<Self>) -> impl Future<Output = Vec<(String, i64)>> + Send;
    /// The committed state of the one record in the store's table, if there is one.
    fn record_state(conn: &mut Conn<Self>) -> impl Future<Output = Option<String>> + Send;
}

/// A database error of a test's own statements, as an action's error.
pub fn db(e: sqlx::Error) -> Error {
    Error::Config(format!("test database: {e}"))
}

/// A connection of `store`'s pool, for the test's own statements.
pub async fn pooled<B: SqlDb>(store: &SqlStore<B>) -> PoolConnection<B::Db> {
    store.pool().acquire().await.expect("a connection of the store's pool")
}

/// Polls the record of `key` on `conn` until it is `want` (another task changes it), and
/// answers its attempt number.
pub async fn wait_for_state<B: SqlDb>(conn: &mut Conn<B>, key: &Key, want: &str, within: Duration) -> i64 {
    let deadline = Instant::now() + within;
    loop {
        let now = B::state_of(conn, key).await;
        if let Some((state, attempt)) = &now
            && state == want
        {
            return *attempt;
        }
        assert!(Instant::now() < deadline, "the record stayed {now:?}, not {want}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Polls `count` (a `SELECT count(*) …`) on `conn` until it is at least `want`: another task or
/// process, or the database's clock, gets there.
pub async fn wait_for_count<B: SqlDb>(conn: &mut Conn<B>, count: &str, want: i64) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let n = B::count(conn, count).await;
        if n >= want {
            return;
        }
        assert!(Instant::now() < deadline, "`{count}` stayed {n}, below {want}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The methods whose text is the same on both databases (sqlx's calls resolve per database).
// The statements without parameters go by the simple query protocol (`raw_sql`): one message,
// so that they work on the store's pool also through PgBouncer in transaction mode, where a
// prepared statement's parse and execution may reach two server connections.
macro_rules! same_on_both {
    () => {
        async fn exec(conn: &mut Conn<Self>, sql: &str) -> Result<(), sqlx::Error> {
            sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned())).execute(conn).await.map(drop)
        }

        async fn execute_bytes(conn: &mut Conn<Self>, sql: &str, binds: &[&[u8]]) -> u64 {
            let mut query = sqlx::query(sqlx::AssertSqlSafe(sql.to_owned()));
            for bind in binds {
                query = query.bind(bind.to_vec());
            }
            let done = query.execute(conn).await;
            done.unwrap_or_else(|e| panic!("`{sql}`: {e}")).rows_affected()
        }

        async fn count(conn: &mut Conn<Self>, sql: &str) -> i64 {
            let row = sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned())).fetch_one(conn).await;
            let row = row.unwrap_or_else(|e| panic!("`{sql}`: {e}"));
            sqlx::Row::try_get(&row, 0).unwrap_or_else(|e| panic!("`{sql}`: {e}"))
        }

        async fn strings(conn: &mut Conn<Self>, sql: &str) -> Vec<String> {
            let rows = sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned())).fetch_all(conn).await;
            let rows = rows.unwrap_or_else(|e| panic!("`{sql}`: {e}"));
            rows.iter().map(|row| sqlx::Row::try_get(row, 0).unwrap_or_else(|e| panic!("`{sql}`: {e}"))).collect()
        }

        async fn column_names(conn: &mut Conn<Self>, table: &str) -> Vec<String> {
            sqlx::query_scalar(Self::COLUMNS).bind(table).fetch_all(conn).await.unwrap()
        }

        async fn state_of(conn: &mut Conn<Self>, key: &Key) -> Option<(String, i64)> {
            sqlx::query_as("SELECT state, attempt FROM idempotent_records WHERE key = $1")
                .bind(&key.as_bytes()[..])
                .fetch_optional(conn)
                .await
                .unwrap()
        }

        async fn records(conn: &mut Conn<Self>) -> Vec<(Vec<u8>, String, i64)> {
            let rows = sqlx::raw_sql("SELECT key, state, attempt FROM idempotent_records ORDER BY key")
                .fetch_all(conn)
                .await
                .unwrap();
            let read = |row: &<Self::Db as sqlx::Database>::Row| {
                (sqlx::Row::get(row, 0), sqlx::Row::get(row, 1), sqlx::Row::get(row, 2))
            };
            rows.iter().map(read).collect()
        }

        async fn insert(tx: &mut Transaction<'_, Self::Db>, order_id: &str, fence: u64) -> Result<(), Error> {
            // Unnamed, as a step's own statements must be behind PgBouncer in transaction mode.
            sqlx::query("INSERT INTO invoices (order_id, fence) VALUES ($1, $2)")
                .persistent(false)
                .bind(order_id)
                .bind(fence as i64)
                .execute(&mut **tx)
                .await
                .map_err(db)?;
            Ok(())
        }

        async fn invoices(conn: &mut Conn<Self>) -> Vec<(String, i64)> {
            let rows = sqlx::raw_sql("SELECT order_id, fence FROM invoices ORDER BY id").fetch_all(conn).await.unwrap();
            rows.iter().map(|row| (sqlx::Row::get(row, 0), sqlx::Row::get(row, 1))).collect()
        }

        async fn record_state(conn: &mut Conn<Self>) -> Option<String> {
            let row = sqlx::raw_sql("SELECT state FROM idempotent_records").fetch_optional(conn).await.unwrap();
            row.map(|row| sqlx::Row::get(&row, 0))
        }
    };
}

/// The file of a `sqlite://` URL.
fn sqlite_path(url: &str) -> &str {
    url.strip_prefix("sqlite://").unwrap_or_else(|| panic!("not a sqlite:// URL: {url}"))
}

impl SqlDb for SqliteBackend {
    const MATRIX: Kind = Kind::Sqlite;
    const STORE_NAME: &'static str = "SqliteStore";
    const TABLE_SETTER: &'static str = "SqliteStoreBuilder::table";
    const SCHEME: &'static str = "sqlite://";
    const CLOCK_US: &'static str = "CAST(unixepoch('subsec') * 1000000 AS INTEGER)";
    const CREATE_INVOICES: &'static str =
        "CREATE TABLE IF NOT EXISTS invoices (id INTEGER PRIMARY KEY, order_id TEXT NOT NULL, fence INTEGER NOT NULL)";
    const FOREIGN_KEY_VIOLATION: &'static str = "FOREIGN KEY";
    const CHANGED_BY_HAND: (&'static str, &'static str) = ("ALTER TABLE records DROP COLUMN updated_at", "version 3");
    const COLUMNS: &'static str = "SELECT name FROM pragma_table_info($1) ORDER BY cid";
    const TABLES: &'static str = "SELECT name FROM sqlite_schema WHERE type = 'table' ORDER BY name";

    async fn open(url: &str) -> Result<SqliteStore, Error> {
        SqliteStore::connect(sqlite_path(url)).await
    }

    async fn open_table(url: &str, table: &str) -> Result<SqliteStore, Error> {
        SqliteStore::builder(sqlite_path(url)).table(table).connect().await
    }

    async fn open_pool(url: &str, connections: u32) -> Result<SqliteStore, Error> {
        SqliteStore::builder(sqlite_path(url)).max_connections(connections).connect().await
    }

    async fn connect(url: &str) -> sqlx::SqliteConnection {
        let url = format!("{url}?mode=rwc");
        sqlx::SqliteConnection::connect(&url).await.unwrap_or_else(|e| panic!("connect to {url}: {e}"))
    }

    same_on_both!();
}

impl SqlDb for PostgresBackend {
    const MATRIX: Kind = Kind::Postgres;
    const STORE_NAME: &'static str = "PostgresStore";
    const TABLE_SETTER: &'static str = "PostgresStoreBuilder::table";
    const SCHEME: &'static str = "postgres://";
    const CLOCK_US: &'static str = "(extract(epoch FROM clock_timestamp()) * 1000000)::bigint";
    const CREATE_INVOICES: &'static str =
        "CREATE TABLE IF NOT EXISTS invoices (id bigserial PRIMARY KEY, order_id text NOT NULL, fence bigint NOT NULL)";
    const FOREIGN_KEY_VIOLATION: &'static str = "violates foreign key constraint";
    const CHANGED_BY_HAND: (&'static str, &'static str) =
        ("ALTER TABLE records ALTER COLUMN attempt TYPE integer", "attempt integer");
    // The schema of the store's connections (the matrix gives each test one of its own).
    const COLUMNS: &'static str = "SELECT column_name::text FROM information_schema.columns WHERE table_name = $1 \
                                   AND table_schema = current_schema() ORDER BY ordinal_position";
    const TABLES: &'static str =
        "SELECT tablename::text FROM pg_tables WHERE schemaname = current_schema() ORDER BY tablename";

    async fn open(url: &str) -> Result<PostgresStore, Error> {
        PostgresStore::connect(url).await
    }

    async fn open_table(url: &str, table: &str) -> Result<PostgresStore, Error> {
        PostgresStore::builder(url).table(table).connect().await
    }

    async fn open_pool(url: &str, connections: u32) -> Result<PostgresStore, Error> {
        PostgresStore::builder(url).max_connections(connections).connect().await
    }

    async fn connect(url: &str) -> sqlx::PgConnection {
        sqlx::PgConnection::connect(url).await.unwrap_or_else(|e| panic!("connect to {url}: {e}"))
    }

    same_on_both!();
}
