//! RedisStore against spawned servers: shared handles, round trips, outages, preflight, scripts,
//! the server's clock, needs-attention records, garbage and records of earlier releases.
//!
//! This file holds the helpers the modules share (a store on a server, a fresh key, a record's
//! bytes and TTL); the tests are in the modules:
//!
//! - `round_trips`: one action for many callers, the commands a call costs, the connections used.
//! - `reads_together`: replays' reads under load, sent together as one `MGET`, and their timeouts.
//! - `connections`: outages, ACL credentials and TLS in the URL, a store on the application's pool.
//! - `preflight`: the settings that break the guarantee, found and explained, or accepted.
//! - `scripts`: the library and scripts loaded, `EVALSHA` when functions are refused, `SET NX GET`.
//! - `transitions`: a transition repeated by its own token (a late duplicate, a retry) changes nothing.
//! - `server_clock`: fences and completion times that follow the server's clock.
//! - `needs_attention`: needs-attention records: no TTL until resolved, read alike by both paths.
//! - `corrupt_records`: records this crate did not write are corrupt errors, never replays.

use std::time::Duration;

use idempotent_core::redis::Value;
use idempotent_core::{Key, KeyScope, RedisStore};
use idempotent_tests::{RedisServer, unique};

mod connections;
mod corrupt_records;
mod needs_attention;
mod preflight;
mod reads_together;
mod round_trips;
mod scripts;
mod server_clock;
mod transitions;

fn store(server: &RedisServer) -> RedisStore {
    store_at(server.url())
}

fn store_at(url: String) -> RedisStore {
    RedisStore::builder(url).command_timeout(Duration::from_millis(500)).connect_lazy().unwrap()
}

/// A fresh key of its own, and the Redis key `store` keeps its record under.
fn fresh(store: &RedisStore) -> (Key, String) {
    let key = Key::derive(&KeyScope::new(unique("run"), "step"), &()).unwrap();
    let redis_key = store.redis_key(&key);
    (key, redis_key)
}

fn pttl(server: &RedisServer, redis_key: &str) -> i64 {
    match server.cmd(&["PTTL", redis_key]) {
        Value::Int(ms) => ms,
        other => panic!("PTTL answered {other:?}"),
    }
}

fn record_of(server: &RedisServer, redis_key: &str) -> Vec<u8> {
    match server.cmd(&["GET", redis_key]) {
        Value::BulkString(record) => record,
        other => panic!("GET answered {other:?}"),
    }
}
