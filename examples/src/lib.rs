//! What the example programs share.

use std::path::PathBuf;
use std::sync::Arc;

use idempotent_core::{Error, PostgresStore, RedisStore, SharedStore, SqliteStore, Store};

pub mod cart;
pub mod payments;

/// The store the examples run on, with a description to print:
///
/// - Redis when `REDIS_URL` is set (`redis://host:port`);
/// - else the database `DATABASE_URL` names: PostgreSQL (`postgres://user@host/db`), or a
///   SQLite file (`sqlite://path` or `sqlite:path`);
/// - else the embedded default, a SQLite file in the system's temporary directory
///   (`idempotent-examples.db`), so that records outlive the process: run an example twice with
///   the same run id and the second run replays.
pub async fn store_from_env() -> Result<(SharedStore, String), Error> {
    if let Some(url) = var("REDIS_URL") {
        let store = RedisStore::connect(&url)?;
        let describe = format!("RedisStore at {}", store.describe());
        return Ok((Arc::new(store), describe));
    }
    let path = match var("DATABASE_URL") {
        Some(url) if url.starts_with("postgres://") || url.starts_with("postgresql://") => {
            let store = PostgresStore::connect(url).await?;
            let describe = format!("PostgresStore at {}", store.describe());
            return Ok((Arc::new(store), describe));
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
    let store = SqliteStore::open(&path).await?;
    let describe =
        format!("SqliteStore at {} (set DATABASE_URL or REDIS_URL to use another database)", store.describe());
    Ok((Arc::new(store), describe))
}

/// An environment variable, when set and not empty.
fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}
