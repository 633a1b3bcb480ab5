//! What the example programs share.

use std::path::PathBuf;
use std::sync::Arc;

use idempotent_core::state::SharedStateStore;
use idempotent_core::{Error, PostgresStore, RedisStore, SharedStore, SqliteStore, Store};

pub mod cart;
pub mod payments;

/// The store the examples run on, as [`stores_from_env`] picks it: its records and the
/// description to print.
pub async fn store_from_env() -> Result<(SharedStore, String), Error> {
    let stores = stores_from_env().await?;
    Ok((stores.records, stores.describe))
}

/// The database the examples run on, as a store of records and a store of versioned state (the
/// same database: every store of the crate keeps both).
pub struct Stores {
    /// The records of steps and requests.
    pub records: SharedStore,
    /// Versioned shared state ([`idempotent_core::state::State`]).
    pub state: SharedStateStore,
    /// A description to print: which store, where.
    pub describe: String,
}

/// The database the examples run on, with a description to print:
///
/// - Redis when `REDIS_URL` is set (`redis://host:port`);
/// - else the database `DATABASE_URL` names: PostgreSQL (`postgres://user@host/db`), or a
///   SQLite file (`sqlite://path` or `sqlite:path`);
/// - else the embedded default, a SQLite file in the system's temporary directory
///   (`idempotent-examples.db`), so that records outlive the process: run an example twice with
///   the same run id and the second run replays.
pub async fn stores_from_env() -> Result<Stores, Error> {
    if let Some(url) = var("REDIS_URL") {
        let store = RedisStore::connect(&url).await?;
        let describe = format!("RedisStore at {}", store.describe());
        return Ok(Stores { records: Arc::new(store.clone()), state: Arc::new(store), describe });
    }
    let path = match var("DATABASE_URL") {
        Some(url) if url.starts_with("postgres://") || url.starts_with("postgresql://") => {
            let store = PostgresStore::connect(url).await?;
            let describe = format!("PostgresStore at {}", store.describe());
            return Ok(Stores { records: Arc::new(store.clone()), state: Arc::new(store), describe });
        }
        Some(url) => match url.strip_prefix("sqlite://").or_else(|| url.strip_prefix("sqlite:")) {
            Some(path) => PathBuf::from(path),
            None => {
                return Err(Error::Config(format!(
                    "DATABASE_URL={url:?} is not a database the examples know: use postgres://… or sqlite://<path> \
                     (or set REDIS_URL=redis://host:port for Redis)"
                )));
            }
        },
        None => std::env::temp_dir().join("idempotent-examples.db"),
    };
    let store = SqliteStore::connect(&path).await?;
    let describe =
        format!("SqliteStore at {} (set DATABASE_URL or REDIS_URL to use another database)", store.describe());
    Ok(Stores { records: Arc::new(store.clone()), state: Arc::new(store), describe })
}

/// An id no earlier run of an example used (`<prefix>-<ms since 1970>-<pid>`), for the examples
/// that show one run and must not replay an earlier run's records from a durable store.
pub fn fresh_id(prefix: &str) -> String {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    format!("{prefix}-{}-{}", now.as_millis(), std::process::id())
}

/// The examples' logs: `RUST_LOG` when set, else INFO (sqlx at WARN: at INFO it passes on
/// PostgreSQL's notices, such as "relation … already exists, skipping" on every start), in
/// colour only when standard output is a terminal (piped into a file or another program, the
/// lines carry no escape codes). Finish with `.init()`, or adjust it first.
pub fn logs() -> tracing_subscriber::fmt::SubscriberBuilder<
    tracing_subscriber::fmt::format::DefaultFields,
    tracing_subscriber::fmt::format::Format,
    tracing_subscriber::EnvFilter,
> {
    use std::io::IsTerminal;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,sqlx=warn"));
    tracing_subscriber::fmt().with_env_filter(filter).with_ansi(std::io::stdout().is_terminal())
}

/// An environment variable, when set and not empty.
fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}
