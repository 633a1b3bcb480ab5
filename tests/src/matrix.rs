//! The store matrix: the one place that knows how to make each store a test runs on, and
//! [`on_every_store!`](crate::on_every_store), which runs a scenario on every one of them.
//!
//! Each test gets a store of its own, with nothing in it:
//!
//! | store | made as |
//! |---|---|
//! | `memory` | a new `MemoryStore` |
//! | `sqlite` | `SqliteStore::open` on a new file in the test's temporary directory |
//! | `postgres` | `PostgresStore::connect` on a schema of its own (`CREATE SCHEMA`, then `search_path` in the URL) on a server shared by the tests of the process |
//! | `redis` | `RedisStore::connect` on a throwaway `redis-server` of its own |
//!
//! The PostgreSQL server is shared because starting one (copying the template data directory,
//! then waiting for it) costs far more than a schema does. The tests hold it by an [`Arc`], and
//! the matrix keeps only a [`Weak`]: it is killed (by [`PgServer`]'s `Drop`) when the last test
//! using it ends, as any other test's server is, so it never outlives the test binary, and the
//! next test to need one starts another.

use std::any::Any;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};

use idempotent_core::{MemoryStore, PostgresStore, RedisStore, SharedStore, SqliteStore};

use crate::{PgServer, RedisServer};

/// The stores a test can run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `MemoryStore`.
    Memory,
    /// `SqliteStore` on a file.
    Sqlite,
    /// `PostgresStore` on a throwaway server.
    Postgres,
    /// `RedisStore` on a throwaway server.
    Redis,
}

/// A test's store, the URL another process reaches it by (none for memory), and what keeps it
/// alive.
pub struct Backend {
    /// The store.
    pub store: SharedStore,
    /// Its URL, for [`idempotent_core::store::open`] in another process (none for memory).
    pub url: Option<String>,
    /// A temporary directory for files of the test (the SQLite file, a ledger).
    pub dir: tempfile::TempDir,
    _server: Option<Box<dyn Any + Send>>,
}

impl Backend {
    /// Makes an empty store of the `kind` for one test.
    pub async fn start(kind: Kind) -> Backend {
        let dir = tempfile::Builder::new().prefix("idem-test-").tempdir().expect("create a temp dir");
        let (store, url, server): (SharedStore, Option<String>, Option<Box<dyn Any + Send>>) = match kind {
            Kind::Memory => (Arc::new(MemoryStore::new()), None, None),
            Kind::Sqlite => {
                let path = dir.path().join("records.db");
                let store = SqliteStore::open(&path).await.expect("open the SQLite store");
                (Arc::new(store), Some(format!("sqlite://{}", path.display())), None)
            }
            Kind::Postgres => {
                let server = shared_pg_server();
                let url = new_schema(&server).await;
                let store = PostgresStore::connect(url.clone())
                    .await
                    .unwrap_or_else(|e| panic!("connect to {url}: {e}; the server's log:\n{}", server.log()));
                (Arc::new(store), Some(url), Some(Box::new(server)))
            }
            Kind::Redis => {
                let server = RedisServer::start();
                let store = RedisStore::connect(server.url()).expect("connect to the test server");
                (Arc::new(store), Some(server.url()), Some(Box::new(server)))
            }
        };
        Backend { store, url, dir, _server: server }
    }
}

/// What a scenario run by [`on_every_store!`](crate::on_every_store) takes: the store alone,
/// or the whole [`Backend`] (for its URL or its directory).
pub trait Given: Sized {
    /// The scenario's argument, and what must live until the scenario ends.
    fn given(backend: Backend) -> (Self, Option<Backend>);
}

impl Given for SharedStore {
    fn given(backend: Backend) -> (Self, Option<Backend>) {
        (backend.store.clone(), Some(backend))
    }
}

impl Given for Backend {
    fn given(backend: Backend) -> (Self, Option<Backend>) {
        (backend, None)
    }
}

/// Runs `scenario` on a new, empty store of the `kind`: the body of each test
/// [`on_every_store!`](crate::on_every_store) generates.
pub async fn run<A: Given, F: Future<Output = ()>>(kind: Kind, scenario: impl FnOnce(A) -> F) {
    let (given, keep) = A::given(Backend::start(kind).await);
    scenario(given).await;
    drop(keep);
}

/// The PostgreSQL server of the tests running now: the one a running test holds, or a new one.
fn shared_pg_server() -> Arc<PgServer> {
    static SERVER: Mutex<Weak<PgServer>> = Mutex::new(Weak::new());
    // A start that panicked poisons the lock: the next test tries again and reports its own failure.
    let mut shared = SERVER.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(server) = shared.upgrade() {
        return server;
    }
    let server = Arc::new(PgServer::start());
    *shared = Arc::downgrade(&server);
    server
}

/// Creates a schema for one test on `server` and returns a URL whose connections use it (the
/// store creates its tables in the first schema of the `search_path`).
async fn new_schema(server: &PgServer) -> String {
    use sqlx::Connection;
    static N: AtomicU64 = AtomicU64::new(0);
    let schema = format!("test_{}", N.fetch_add(1, Ordering::Relaxed));
    let mut conn = server.connection().await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
        .execute(&mut conn)
        .await
        .unwrap_or_else(|e| panic!("CREATE SCHEMA {schema}: {e}; the server's log:\n{}", server.log()));
    conn.close().await.expect("close the set-up connection");
    format!("{}?options[search_path]={schema}", server.url())
}
