//! Making a [`PostgresStore`]: its settings ([`PostgresStoreBuilder`]), its pool, and its first
//! connection, which says at once why the database cannot be reached.

use std::str::FromStr;
use std::time::Duration;

use sqlx::Connection;
use sqlx::postgres::{PgConnectOptions, PgConnection, PgPool, PgPoolOptions};

use super::url::{check_tls, describe, own_parameters, redact};
use super::{PostgresBackend, PostgresStore};
use crate::error::Error;
use crate::store::sql::SqlStore;
use crate::store::sql::backend::Backend;
use crate::store::sql::migrate::plain_table_name;
use crate::store::sql::table::Table;

/// The longest table name: the index names (`<table>_expires_at`, `<table>_run_id`) must fit
/// PostgreSQL's 63 bytes.
const MAX_TABLE_LEN: usize = 48;

/// The longest schema name PostgreSQL keeps whole (63 bytes).
const MAX_SCHEMA_LEN: usize = 63;

/// Connections idle for longer are pinged before use.
const IDLE_PING: Duration = Duration::from_secs(1);

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
    schema: Option<String>,
    timeout: Duration,
    max_connections: u32,
    transaction_pooling: Option<bool>,
}

impl PostgresStoreBuilder {
    /// The table holding the records (default `idempotent_records`): an identifier of ASCII
    /// letters, digits and `_`, not starting with a digit, at most 48 characters, not
    /// `idempotent_schema`. It is created in the [`schema`](Self::schema) if one is set, else in
    /// the connection's `current_schema()`.
    pub fn table(mut self, name: impl Into<String>) -> Self {
        self.table = name.into();
        self
    }

    /// The schema the store's tables live in (the records', the state table and the registry
    /// `idempotent_schema`), created if it is missing; every statement of the store names it, so
    /// the connection's `search_path` does not matter, and a step's transaction
    /// ([`run_in_transaction`](crate::Step::run_in_transaction)) sees the application's own
    /// tables as before. An identifier like the [`table`](Self::table)'s, at most 63 characters.
    /// Unset (the default), the tables go to the connection's `current_schema()`.
    ///
    /// A URL can set it too, with `?schema=<name>` (this setter wins over it).
    pub fn schema(mut self, name: impl Into<String>) -> Self {
        self.schema = Some(name.into());
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

    /// Whether the URL reaches PostgreSQL through a pooler in transaction mode, such as
    /// PgBouncer with `pool_mode = transaction`, which may hand each transaction of one client
    /// connection to another server connection (default `false`). Turn it on for such a
    /// pooler: without it PgBouncer refuses the store's connections (`unsupported startup
    /// parameter`: opening fails at once, naming this setting), and the store's named prepared
    /// statements would not survive the pooler. A URL can set it too, with
    /// `?transaction_pooling=true` (this setter wins over it).
    ///
    /// On, the store
    /// - sends each statement as one simple query, `SET LOCAL statement_timeout = …;
    ///   <statement>`, its values written in as literals: one message and one round trip (as a
    ///   cached prepared statement is), run as one implicit transaction, nothing prepared. The
    ///   server plans the statement each time;
    /// - sends no startup parameters a pooler refuses (sqlx's `extra_float_digits`, and the
    ///   `options` that would set `statement_timeout`: `SET LOCAL` sets it instead) and keeps no
    ///   statement cache;
    /// - begins a step's transaction ([`run_in_transaction`](crate::Step::run_in_transaction))
    ///   with `BEGIN; SET LOCAL statement_timeout = …`, and runs its own statement there
    ///   unnamed; the transaction keeps it on one server connection. The application's own
    ///   queries in that transaction must be unnamed as well: `sqlx::query(…).persistent(false)`
    ///   (a named one may land on a server connection where another client's statement of the
    ///   same name exists: `prepared statement "sqlx_s_1" already exists`).
    ///
    /// On a pool of the application's ([`PostgresStore::builder_with_pool`]) the statements
    /// are run the same way, but the pool's connect options are its own: give them
    /// `extra_float_digits(None)` and no `options`, or PgBouncer refuses its connections.
    ///
    /// The pooler needs no setting of its own for this: the tests run PgBouncer 1.18 in
    /// `pool_mode = transaction` as it comes (no `ignore_startup_parameters`, and no
    /// `max_prepared_statements`, which came with 1.21 and which this setting does not need).
    pub fn transaction_pooling(mut self, on: bool) -> Self {
        self.transaction_pooling = Some(on);
        self
    }

    /// Opens a first connection (so that a database that refuses it, or a URL it cannot use,
    /// fails here at once, with the reason), makes the pool (further connections are opened as
    /// calls need them), and creates or checks the table ([`PostgresStore::migrate`]).
    ///
    /// Fails with [`Error::Config`] for an invalid URL, table or schema name, a URL asking for
    /// TLS when the `tls-rustls` feature is off, or an incompatible existing table; with
    /// [`Error::Unavailable`] and the cause (refused, unknown host, TLS certificate not trusted
    /// or not for that host, authentication …) when the database cannot be reached; and with
    /// [`Error::Timeout`] (op `open`) when it does not answer within the timeout.
    pub async fn connect(self) -> Result<PostgresStore, Error> {
        validate_table(&self.table)?;
        if let Some(schema) = &self.schema {
            validate_schema(schema)?;
        }
        let timeout = self.timeout;
        let (pool, describe, schema, pooling) = match self.target {
            Target::Url(url) => {
                let (sqlx_url, in_url) = own_parameters(&url)?;
                let options = PgConnectOptions::from_str(&sqlx_url).map_err(|e| {
                    Error::Config(format!(
                        "invalid PostgreSQL URL {}: {e}; expected postgres://user[:password]@host[:port]/database",
                        redact(&url)
                    ))
                })?;
                if let Some(schema) = &in_url.schema {
                    validate_schema(schema)?;
                }
                check_tls(&options, cfg!(feature = "tls-rustls"), &url)?;
                let describe = describe(&options);
                let schema = self.schema.or(in_url.schema);
                let pooling = self.transaction_pooling.or(in_url.transaction_pooling).unwrap_or(false);
                let options = if pooling {
                    options.statement_cache_capacity(0).extra_float_digits(None)
                } else {
                    options.options([("statement_timeout", statement_timeout(timeout))])
                };
                first_connection(&options, &describe, timeout).await?;
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
                (pool, describe, schema, pooling)
            }
            Target::Pool(pool) => {
                let describe = describe(&pool.connect_options());
                (pool, describe, self.schema, self.transaction_pooling.unwrap_or(false))
            }
        };
        // Behind a transaction pooler, each statement is sent after it (in one message).
        let pooled = pooling.then(|| format!("SET LOCAL statement_timeout = '{}'", statement_timeout(timeout)));
        let store = PostgresStore::on(pool, describe, Table::new(schema, self.table), timeout, pooled);
        store.migrate_as("open").await?;
        Ok(store)
    }
}

/// `statement_timeout`'s value for the store's timeout.
pub(super) fn statement_timeout(timeout: Duration) -> String {
    format!("{}ms", timeout.as_millis().max(1))
}

/// Opens one connection with `options` and closes it: a refused connection, an unknown host, a
/// TLS or authentication failure is an [`Error::Unavailable`] with its cause at once (the pool
/// would retry a refused connection until its timeout and report only that it ran out).
async fn first_connection(options: &PgConnectOptions, describe: &str, timeout: Duration) -> Result<(), Error> {
    match tokio::time::timeout(timeout, PgConnection::connect_with(options)).await {
        Ok(Ok(conn)) => {
            // The pool opens its own; a failure to say goodbye changes nothing.
            let _ = conn.close().await;
            Ok(())
        }
        Ok(Err(e)) => Err(PostgresBackend::error(describe, "open", timeout, e)),
        Err(_) => Err(Error::Timeout { store: describe.to_owned(), op: "open", after: timeout }),
    }
}

fn validate_table(name: &str) -> Result<(), Error> {
    let ok = plain_table_name(name, MAX_TABLE_LEN);
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

fn validate_schema(name: &str) -> Result<(), Error> {
    let reserved = name.starts_with("pg_") || name.eq_ignore_ascii_case("information_schema");
    let identifier = plain_table_name(name, MAX_SCHEMA_LEN) || name.eq_ignore_ascii_case("idempotent_schema");
    if identifier && !reserved {
        Ok(())
    } else {
        Err(Error::Config(format!(
            "PostgreSQL schema name {name:?} is not a plain identifier (ASCII letters, digits and `_`, not starting \
             with a digit, at most {MAX_SCHEMA_LEN} characters, not starting with `pg_`, not \
             `information_schema`); choose another with PostgresStoreBuilder::schema or the URL's `?schema=`"
        )))
    }
}

impl SqlStore<PostgresBackend> {
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
}

impl PostgresStoreBuilder {
    fn new(target: Target) -> Self {
        PostgresStoreBuilder {
            target,
            table: "idempotent_records".to_owned(),
            schema: None,
            timeout: Duration::from_secs(5),
            max_connections: 8,
            transaction_pooling: None,
        }
    }
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
    fn schema_names_must_be_identifiers() {
        for good in ["payments", "_x", "Tenant2", &"s".repeat(63)] {
            assert!(validate_schema(good).is_ok(), "{good}");
        }
        for bad in ["", "a.b", "x; DROP SCHEMA y", "2x", "pg_catalog", "information_schema", &"s".repeat(64)] {
            assert!(matches!(validate_schema(bad), Err(Error::Config(_))), "{bad:?}");
        }
    }
}
