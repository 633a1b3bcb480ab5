//! Making a [`SqliteStore`]: its settings ([`SqliteStoreBuilder`]), the pool it opens on the
//! file (or the application's, checked), and the table names it takes.

use std::path::{Path, PathBuf};
use std::time::Duration;

use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous};

use super::{SqliteBackend, SqliteStore, writes};
use crate::error::Error;
use crate::store::sql::migrate::plain_table_name;
use crate::store::sql::table::Table;
use crate::store::sql::{Backend, SqlStore};

/// Where a [`SqliteStore`] gets its connections.
#[derive(Debug, Clone)]
enum Target {
    /// A pool of its own on this file.
    Path(PathBuf),
    /// The application's pool.
    Pool(SqlitePool),
}

/// Settings of a [`SqliteStore`], from [`SqliteStore::builder`] or
/// [`SqliteStore::builder_with_pool`], finished by [`connect`](Self::connect).
#[derive(Debug, Clone)]
pub struct SqliteStoreBuilder {
    target: Target,
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
    /// Ignored for a store on the application's pool, whose connections keep their own
    /// `busy_timeout` (read when the store connects).
    pub fn busy_timeout(mut self, timeout: Duration) -> Self {
        self.busy_timeout = timeout;
        self
    }

    /// The most connections the store's pool opens on the file (default 8; at least 1), for its
    /// reads and the application's queries; its writes go out on one more connection, of their
    /// own. Ignored for a store on the application's pool (whose options that connection takes).
    pub fn max_connections(mut self, n: u32) -> Self {
        self.max_connections = n.max(1);
        self
    }

    /// Opens the pool (creating the file if missing), or takes the application's (checking its
    /// settings, see [`SqliteStore::builder_with_pool`]), and creates or checks the table
    /// ([`SqliteStore::migrate`]).
    ///
    /// Fails with [`Error::Config`] for an invalid table name, an incompatible existing table or
    /// a pool that does not sync its commits, and with [`Error::Unavailable`] or
    /// [`Error::Timeout`] (op `open`) when the file cannot be opened.
    pub async fn connect(self) -> Result<SqliteStore, Error> {
        validate_table(&self.table)?;
        let (pool, describe, busy_timeout) = match self.target {
            Target::Path(path) => {
                let describe = format!("sqlite://{}", path.display());
                let options = SqliteConnectOptions::new()
                    .filename(&path)
                    .create_if_missing(true)
                    .journal_mode(SqliteJournalMode::Wal)
                    .synchronous(SqliteSynchronous::Full)
                    .busy_timeout(self.busy_timeout);
                let pool_options = SqlitePoolOptions::new()
                    .max_connections(self.max_connections)
                    .min_connections(0)
                    .acquire_timeout(self.busy_timeout)
                    // A connection to a local file does not go stale: no ping before each statement.
                    .test_before_acquire(false);
                // Several stores (or processes) opening a new file at once race to turn it to WAL
                // mode, which SQLite answers `SQLITE_BUSY` at once rather than in its busy
                // handler: looked at again until the busy timeout.
                let deadline = tokio::time::Instant::now() + self.busy_timeout;
                let pool = writes::while_busy(deadline, || pool_options.clone().connect_with(options.clone()))
                    .await
                    .map_err(|e| SqliteBackend::error(&describe, "open", self.busy_timeout, e))?;
                (pool, describe, self.busy_timeout)
            }
            Target::Pool(pool) => {
                let describe = format!("sqlite://{}", pool.connect_options().get_filename().display());
                let busy_timeout = checked_pool(&pool, &describe).await?;
                (pool, describe, busy_timeout)
            }
        };
        let store = SqliteStore::on(pool, describe, Table::new(None, self.table), busy_timeout, None);
        store.migrate().await?;
        store.choose_writes().await?;
        Ok(store)
    }
}

/// Checks that the application's `pool` syncs every commit, and reads its busy timeout.
async fn checked_pool(pool: &SqlitePool, describe: &str) -> Result<Duration, Error> {
    // Until the pool's own busy timeout is read: sqlx's default.
    let mut busy_timeout = Duration::from_secs(5);
    let err = |busy_timeout, e| SqliteBackend::error(describe, "open", busy_timeout, e);
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
    Ok(busy_timeout)
}

fn validate_table(name: &str) -> Result<(), Error> {
    let ok = plain_table_name(name, 64) && !name.to_ascii_lowercase().starts_with("sqlite_");
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

impl SqlStore<SqliteBackend> {
    /// Opens the store in the file at `path` (created if missing) with the default settings, and
    /// creates or checks the table: see [`SqliteStoreBuilder::connect`], and
    /// [`SqliteStore::builder`] for the settings.
    pub async fn connect(path: impl AsRef<Path>) -> Result<SqliteStore, Error> {
        SqliteStore::builder(path).connect().await
    }

    /// A store on an application's own pool, with the default settings: see
    /// [`builder_with_pool`](Self::builder_with_pool).
    pub async fn from_pool(pool: SqlitePool) -> Result<SqliteStore, Error> {
        SqliteStore::builder_with_pool(pool).connect().await
    }

    /// Settings for a store in the file at `path` (created if missing), in a pool of its own.
    pub fn builder(path: impl AsRef<Path>) -> SqliteStoreBuilder {
        SqliteStoreBuilder::new(Target::Path(path.as_ref().to_owned()))
    }

    /// Settings for a store on an application's own pool, with its records in the builder's
    /// [`table`](SqliteStoreBuilder::table) (created if missing, or checked, as
    /// [`migrate`](Self::migrate) does): the application's queries, the store's statements and
    /// the transactions of [`Step::run_in_transaction`](crate::Step::run_in_transaction) then
    /// share one pool and one file.
    ///
    /// The pool's settings are kept as they are (its size, its timeouts, its `busy_timeout`). On a
    /// file in WAL mode the store's own writes go out on one connection more, opened with the
    /// pool's connect options (not its `after_connect` hook), which waits for the write lock up
    /// to that busy timeout; otherwise (the rollback journal, an in-memory database) they run on
    /// the pool. One requirement: its connections sync every commit (`synchronous = FULL` or `EXTRA`; sqlx's
    /// default is `FULL`). With `NORMAL` or `OFF` a power loss can undo a committed `done`, and the
    /// step runs again: [`connect`](SqliteStoreBuilder::connect) then fails with an
    /// [`Error::Config`] saying how to set it. WAL mode
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
    /// let store = SqliteStore::builder_with_pool(pool.clone()).table("payment_records").connect().await?;
    /// assert!(store.pool().size() >= 1);
    /// # pool.close().await;
    /// # std::fs::remove_dir_all(&dir)?;
    /// # Ok(()) }
    /// ```
    pub fn builder_with_pool(pool: SqlitePool) -> SqliteStoreBuilder {
        SqliteStoreBuilder::new(Target::Pool(pool))
    }
}

impl SqliteStoreBuilder {
    fn new(target: Target) -> Self {
        SqliteStoreBuilder {
            target,
            table: "idempotent_records".to_owned(),
            busy_timeout: Duration::from_secs(5),
            max_connections: 8,
        }
    }
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
