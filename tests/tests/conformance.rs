//! The store conformance suite on every backend.

use idempotent_core::{MemoryStore, PostgresStore, RedisStore, SharedStore, SqliteStore};
use idempotent_tests::{PgServer, RedisCluster, RedisServer, conformance};
use std::sync::Arc;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_store_conforms() {
    let store: SharedStore = Arc::new(MemoryStore::new());
    conformance::run_all(store.clone()).await;
    conformance::run_admin(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_store_conforms() {
    let dir = tempfile::TempDir::new().unwrap();
    let store = SqliteStore::open(dir.path().join("records.db")).await.unwrap();
    conformance::run_all(Arc::new(store.clone())).await;
    conformance::run_admin(&(Arc::new(store.clone()) as SharedStore)).await;
    // A second store on the same file takes over and replays the first one's records.
    let other = SqliteStore::open(dir.path().join("records.db")).await.unwrap();
    conformance::run_mixed(Arc::new(store), Arc::new(other)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_store_conforms() {
    let server = PgServer::start();
    let store = PostgresStore::connect(server.url()).await.unwrap();
    conformance::run_all(Arc::new(store.clone())).await;
    conformance::run_admin(&(Arc::new(store.clone()) as SharedStore)).await;
    // A second store (its own pool) on the same table takes over and replays the first one's records.
    let other = PostgresStore::connect(server.url()).await.unwrap();
    conformance::run_mixed(Arc::new(store), Arc::new(other)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_store_conforms() {
    let server = RedisServer::start();
    let store = RedisStore::connect(server.url()).unwrap();
    store.warm_up().await.unwrap();
    conformance::run_all(Arc::new(store)).await;
}

/// Every acquire through the script, as on a server before Redis 7.0 (no `SET NX GET`); also
/// a plain-SET store and a script-only store on the same records.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_store_conforms_with_scripts_only() {
    let server = RedisServer::start();
    let store: SharedStore = Arc::new(RedisStore::builder(server.url()).set_get_acquire(false).build().unwrap());
    conformance::run_all(store).await;
    let plain = RedisStore::connect(server.url()).unwrap();
    // Measured first, so that the plain store takes keys with SET NX from the start.
    plain.warm_up().await.unwrap();
    let scripts = RedisStore::builder(server.url()).set_get_acquire(false).build().unwrap();
    conformance::run_mixed(Arc::new(plain), Arc::new(scripts)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_store_conforms() {
    let cluster = RedisCluster::start();
    let store: SharedStore = Arc::new(RedisStore::cluster_builder(cluster.urls()).build().unwrap());
    conformance::run_all(store.clone()).await;
    // The records really are spread over the masters (one key per operation, any slot).
    let keys: Vec<i64> = cluster
        .nodes
        .iter()
        .map(|n| match n.cmd(&["DBSIZE"]) {
            idempotent_core::redis::Value::Int(k) => k,
            other => panic!("DBSIZE answered {other:?}"),
        })
        .collect();
    assert!(keys.iter().filter(|&&k| k > 0).count() >= 2, "records on one node only: {keys:?}");
}
