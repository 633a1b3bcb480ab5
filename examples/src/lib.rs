//! What the example programs share.

use std::sync::Arc;

use idempotent_core::{Error, MemoryStore, RedisStore, SharedStore, Store};

/// The store the examples run on: Redis when `REDIS_URL` is set, else an in-memory store; with a
/// description to print.
pub fn store_from_env() -> Result<(SharedStore, String), Error> {
    match std::env::var("REDIS_URL") {
        Ok(url) if !url.is_empty() => {
            let store = RedisStore::connect(&url)?;
            let describe = format!("RedisStore at {}", store.describe());
            Ok((Arc::new(store), describe))
        }
        _ => Ok((Arc::new(MemoryStore::new()), "MemoryStore (set REDIS_URL to use Redis)".to_owned())),
    }
}
