//! Transitions repeated by their own token (a retry after a lost reply): a late duplicate acquire
//! changes nothing, and a repeated `complete` or `abandon` writes the record again unchanged.

use std::time::Duration;

use bytes::Bytes;
use idempotent_core::record::{Abandon, Acquire, Transition};
use idempotent_core::redis::Script;
use idempotent_core::store::redis::{layout, source};
use idempotent_core::{Fingerprint, RedisStore, Store};
use idempotent_tests::RedisServer;

use crate::{fresh, pttl, record_of, store};

/// The scripts are idempotent per owner token: a late duplicate of an acquire (its first reply
/// was lost, the call retried, the owner already released) changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_duplicate_acquire_changes_nothing() {
    let server = RedisServer::start();
    let mut conn = server.connection();
    let (acquire, release) = (Script::new(source::ACQUIRE), Script::new(source::RELEASE));
    let key = "idem:late-duplicate";
    let (fp, token_1, token_2) = ("f".repeat(64), "1".repeat(32), "2".repeat(32));
    // acquire.lua's one argument: fingerprint, token, lease and retention, then no labels.
    let (lease, retention) = (layout::ARG_LEASE.len(), layout::ARG_RETENTION.len());
    let args = |token: &str| format!("{fp}{token}{:0lease$}{:0retention$}{}", 60_000, 60_000, layout::NO_LABELS);
    let first: Vec<i64> = acquire.key(key).arg(args(&token_1)).invoke(&mut conn).unwrap();
    assert_eq!((first[0], first[2]), (1, 1));
    let again: Vec<i64> = acquire.key(key).arg(args(&token_1)).invoke(&mut conn).unwrap();
    assert_eq!(again, first, "a retried acquire answers as the first did");
    let released: i64 = release.key(key).arg(&token_1).invoke(&mut conn).unwrap();
    assert_eq!(released, 1);
    let late: Vec<i64> = acquire.key(key).arg(args(&token_1)).invoke(&mut conn).unwrap();
    assert_eq!(late[1], first[1], "the late duplicate took a new fence");
    let record: String = idempotent_core::redis::cmd("GET").arg(key).query(&mut conn).unwrap();
    assert!(record.starts_with('X'), "the late duplicate took the key: {record}");
    // The next real owner is not told a crash happened.
    let next: Vec<i64> = acquire.key(key).arg(args(&token_2)).invoke(&mut conn).unwrap();
    assert_eq!((next[0], next[2], next[3]), (1, 2, 0));
    assert!(next[1] > first[1]);
}

/// A transition repeated by its own token (a retry after a lost reply) changes nothing, but
/// writes the record again as it is, TTL kept: so the repeat replicates, and a `WAIT` behind it
/// on a fresh connection covers the write instead of counting only that connection's history.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeated_transitions_write_the_record_again_unchanged() {
    use idempotent_core::record::Grant;
    let server = RedisServer::start();
    let store = store(&server);
    store.warm_up().await.unwrap();
    let minute = Duration::from_secs(60);
    let fp = Fingerprint::from_bytes([3; 32]);
    for ending in ["complete", "abandon"] {
        let (key, redis_key) = fresh(&store);
        let Acquire::Acquired(Grant { token, .. }) = store.acquire(&key, &fp, minute, minute).await.unwrap() else {
            panic!("a fresh key")
        };
        let end = |store: &RedisStore| {
            let (key, token) = (key, token.clone());
            let store = store.clone();
            async move {
                match ending {
                    "complete" => store.complete(&key, &token, Bytes::from_static(b"r"), minute).await.unwrap(),
                    _ => store.abandon(&key, &token, Abandon::Uncertain).await.unwrap(),
                }
            }
        };
        assert_eq!(end(&store).await, Transition::Ok);
        let (before, ttl) = (record_of(&server, &redis_key), pttl(&server, &redis_key));
        let monitor = server.monitor();
        assert_eq!(end(&store).await, Transition::Ok, "{ending}: the repeat is acknowledged");
        let seen = monitor.finish();
        assert_eq!(seen.client, ["fcall"], "{ending}");
        assert!(seen.script.iter().any(|c| c == "set"), "{ending}: the repeat writes the record again: {seen:?}");
        assert_eq!(record_of(&server, &redis_key), before, "{ending}: unchanged");
        let after = pttl(&server, &redis_key);
        assert!(after <= ttl && after > ttl - 5_000, "{ending}: the TTL is kept ({ttl} ms, then {after} ms)");
    }
}
