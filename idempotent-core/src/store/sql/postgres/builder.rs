//! Making a [`PostgresStore`]: its settings ([`PostgresStoreBuilder`]), its pool, and how it
//! names its database in logs and errors (never with the password).

use std::str::FromStr;
use std::time::Duration;

use sqlx::Connection;
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};

use super::{PostgresBackend, PostgresStore};
use crate::error::Error;
use crate::store::sql::SqlStore;
use crate::store::sql::migrate::plain_table_name;

/// The longest table name: the index names (`<table>_expires_at`, `<table>_run_id`) must fit
/// PostgreSQL's 63 bytes.
const MAX_TABLE_LEN: usize = 48;

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
        let store = PostgresStore::on(pool, describe, self.table, timeout);
        store.migrate_as("open").await?;
        Ok(store)
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
            timeout: Duration::from_secs(5),
            max_connections: 8,
        }
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
