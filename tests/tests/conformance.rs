//! The store conformance suite on every backend (Redis and Cluster on both Redis 7.0 and Valkey 9).

use idempotent_core::record::{Acquire, Labels};
use idempotent_core::store::{Cursor, Filter};
use idempotent_core::{Fingerprint, Key, KeyScope, MemoryStore, PostgresStore, RedisStore, SharedStore, SqliteStore};
use std::time::Duration;

const LEASE: Duration = Duration::from_secs(60);
use idempotent_tests::{Flavor, PgServer, RedisCluster, RedisServer, conformance};
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
    let store = SqliteStore::connect(dir.path().join("records.db")).await.unwrap();
    conformance::run_all(Arc::new(store.clone())).await;
    conformance::run_admin(&(Arc::new(store.clone()) as SharedStore)).await;
    // A second store on the same file takes over and replays the first one's records.
    let other = SqliteStore::connect(dir.path().join("records.db")).await.unwrap();
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
    redis_conforms(Flavor::Redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn valkey_store_conforms() {
    redis_conforms(Flavor::Valkey).await;
}

async fn redis_conforms(flavor: Flavor) {
    let server = RedisServer::start_flavor(flavor);
    let store = RedisStore::connect_lazy(server.url()).unwrap();
    store.warm_up().await.unwrap();
    let store: SharedStore = Arc::new(store);
    conformance::run_all(store.clone()).await;
    conformance::run_admin(&store).await;
}

/// Every acquire through the script, as on a server before Redis 7.0 (no `SET NX GET`); also
/// a plain-SET store and a script-only store on the same records.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_store_conforms_with_scripts_only() {
    let server = RedisServer::start();
    let store: SharedStore = Arc::new(RedisStore::builder(server.url()).set_get_acquire(false).connect_lazy().unwrap());
    conformance::run_all(store.clone()).await;
    conformance::run_admin(&store).await;
    let plain = RedisStore::connect_lazy(server.url()).unwrap();
    // Measured first, so that the plain store takes keys with SET NX from the start.
    plain.warm_up().await.unwrap();
    let scripts = RedisStore::builder(server.url()).set_get_acquire(false).connect_lazy().unwrap();
    conformance::run_mixed(Arc::new(plain), Arc::new(scripts)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_store_conforms() {
    cluster_conforms(Flavor::Redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn valkey_cluster_store_conforms() {
    cluster_conforms(Flavor::Valkey).await;
}

async fn cluster_conforms(flavor: Flavor) {
    let cluster = RedisCluster::start_flavor(flavor);
    let store: SharedStore = Arc::new(RedisStore::cluster_builder(cluster.urls()).connect_lazy().unwrap());
    conformance::run_all(store.clone()).await;
    conformance::run_admin(&store).await;
    // The records really are spread over the masters (one key per operation, any slot).
    let keys = cluster.keys_per_node();
    assert!(keys.iter().filter(|&&k| k > 0).count() >= 2, "records on one node only: {keys:?}");
    // A scan lists every record of every master, each once (no rehash happens here), across
    // pages: 60 records of one run, on all three masters.
    let run = idempotent_tests::unique("scan-cluster");
    let mut made = std::collections::BTreeSet::new();
    for i in 0..60 {
        let key = Key::derive(&KeyScope::new(&run, "scan"), &i).unwrap();
        let labels = Labels::step("scan").run(&run);
        let answer = store.acquire_labeled(&key, &Fingerprint::of(&i).unwrap(), LEASE, LEASE, labels).await.unwrap();
        assert!(matches!(answer, Acquire::Acquired(_)), "{answer:?}");
        made.insert(key);
    }
    let holder = |key: &Key| {
        let redis_key = format!("idem:{}", key.to_hex());
        // Another master answers MOVED.
        let holds = |n: &idempotent_tests::RedisServer| {
            idempotent_core::redis::cmd("EXISTS").arg(&redis_key).query::<i64>(&mut n.connection()) == Ok(1)
        };
        cluster.nodes.iter().position(holds).expect("on a master")
    };
    let masters: std::collections::BTreeSet<usize> = made.iter().map(holder).collect();
    assert_eq!(masters.len(), 3, "60 keys over three masters");
    let (mut listed, mut cursor, mut pages) = (std::collections::BTreeSet::new(), Cursor::start(), 0);
    loop {
        let page = store.scan(&Filter::all().run(&run), &cursor, 7).await.unwrap();
        assert!(page.records.len() <= 7);
        pages += 1;
        for record in page.records {
            assert!(listed.insert(record.key), "{record:?} listed twice");
        }
        match page.next {
            Some(next) => cursor = next,
            None => break,
        }
    }
    assert_eq!(listed, made, "the scan lists every record of the run, on every master");
    assert!(pages >= 9, "pages of 7: {pages}");
}
