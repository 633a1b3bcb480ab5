//! Connecting to the store a URL names: what a command-line tool, an example or a worker process that is
//! told where its records live does.

use super::SharedStore;
use crate::error::Error;

/// Connects to the store a URL names, with its default settings (each store's own `connect`):
///
/// | URL | store | feature |
/// |---|---|---|
/// | `redis://host:port[/db]`, `rediss://…` | [`RedisStore`](crate::RedisStore) | `redis` (`tls-rustls` or `tls-native-tls` for `rediss`) |
/// | `redis://host1:port1,redis://host2:port2,…` (several, comma-separated) | a [`RedisStore`](crate::RedisStore) on the Redis Cluster those nodes belong to | `cluster` |
/// | `redis+sentinel://host1:port1,host2:port2/master-name` (port 26379 when none is given) | a [`RedisStore`](crate::RedisStore) on the master those sentinels monitor under that name, following its failovers (`RedisStore::sentinel_builder`) | `sentinel` |
/// | `postgres://user@host:port/db`, `postgresql://…` | [`PostgresStore`](crate::PostgresStore) (its table is created if missing) | `postgres` |
/// | `sqlite://path`, `sqlite:path` | [`SqliteStore`](crate::SqliteStore) on that file (created if missing) | `sqlite` |
/// | `memory:` | a new, empty [`MemoryStore`](crate::MemoryStore) (for tests) | — |
///
/// A URL of a store whose feature is not compiled in, or of no known store, is an
/// [`Error::Config`] that says which.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), idempotent_core::Error> {
/// let store = idempotent_core::store::connect("memory:").await?;
/// assert_eq!(store.describe(), "memory");
/// let Err(refused) = idempotent_core::store::connect("mysql://db/records").await else { unreachable!() };
/// assert!(refused.to_string().contains("mysql://"));
/// # Ok(()) }
/// ```
pub async fn connect(url: &str) -> Result<SharedStore, Error> {
    let scheme = url.split_once(':').map(|(scheme, _)| scheme).unwrap_or_default();
    // Unused when every store's feature is on.
    #[cfg_attr(
        all(feature = "cluster", feature = "sentinel", feature = "postgres", feature = "sqlite"),
        allow(unused_variables)
    )]
    let missing = |feature: &str| {
        Error::Config(format!(
            "{scheme}:// URLs need idempotent-core's `{feature}` feature, which this program was built without"
        ))
    };
    match scheme {
        "memory" => Ok(std::sync::Arc::new(super::MemoryStore::new())),
        "redis" | "rediss" if url.contains(',') => {
            #[cfg(feature = "cluster")]
            {
                let nodes = url.split(',').map(str::trim).filter(|node| !node.is_empty());
                Ok(std::sync::Arc::new(super::RedisStore::cluster_builder(nodes).connect().await?))
            }
            #[cfg(not(feature = "cluster"))]
            {
                Err(missing("cluster"))
            }
        }
        "redis+sentinel" => {
            #[cfg(feature = "sentinel")]
            {
                let (sentinels, master) = crate::store::redis::sentinel::parse_url(url)?;
                Ok(std::sync::Arc::new(super::RedisStore::sentinel_builder(sentinels, master).connect().await?))
            }
            #[cfg(not(feature = "sentinel"))]
            {
                Err(missing("sentinel"))
            }
        }
        "redis" | "rediss" => {
            #[cfg(feature = "redis")]
            {
                Ok(std::sync::Arc::new(super::RedisStore::connect(url).await?))
            }
            #[cfg(not(feature = "redis"))]
            {
                Err(missing("redis"))
            }
        }
        "postgres" | "postgresql" => {
            #[cfg(feature = "postgres")]
            {
                Ok(std::sync::Arc::new(super::PostgresStore::connect(url).await?))
            }
            #[cfg(not(feature = "postgres"))]
            {
                Err(missing("postgres"))
            }
        }
        "sqlite" => {
            #[cfg(feature = "sqlite")]
            {
                let path = url.strip_prefix("sqlite://").or_else(|| url.strip_prefix("sqlite:")).unwrap_or(url);
                Ok(std::sync::Arc::new(super::SqliteStore::connect(path).await?))
            }
            #[cfg(not(feature = "sqlite"))]
            {
                Err(missing("sqlite"))
            }
        }
        _ => Err(Error::Config(format!(
            "{url:?} names no store this crate knows: use redis://host:port, \
             redis+sentinel://host:port/master-name, postgres://user@host/db, sqlite://path or memory:"
        ))),
    }
}
