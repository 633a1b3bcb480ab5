//! The store matrix: the one place that knows how to make each store a test runs on, and
//! [`on_every_store!`](crate::on_every_store), which runs a scenario on every one of them.
//!
//! Each test gets a store of its own, with nothing in it:
//!
//! | store | made as |
//! |---|---|
//! | `memory` | a new `MemoryStore` |
//! | `sqlite` | `SqliteStore::connect` on a new file in the test's temporary directory |
//! | `postgres` | `PostgresStore::connect` on a schema of its own (`CREATE SCHEMA`, then `search_path` in the URL) on a server shared by the tests of the process |
//! | `redis` | `RedisStore::connect` on a throwaway `redis-server` of its own |
//! | `pgbouncer` (SQL scenarios only, named by `tests/tests/pgbouncer.rs`) | `PostgresStore::connect` on a database of its own (`CREATE DATABASE`), through a PgBouncer in transaction mode, with `?transaction_pooling=true`; both shared by the tests of the process |
//!
//! The scenarios of the SQL stores only (`on_every_store!(sql: …)`) take instead an empty
//! [`Database`] of SQLite or PostgreSQL, made the same way but with no store opened on it yet,
//! and typed by its backend ([`SqlDb`]).
//!
//! The PostgreSQL server is shared because starting one (copying the template data directory,
//! then waiting for it) costs far more than a schema does. The tests hold it by an [`Arc`], and
//! the matrix keeps only a [`Weak`]: it is killed (by [`PgServer`]'s `Drop`) when the last test
//! using it ends, as any other test's server is, so it never outlives the test binary, and the
//! next test to need one starts another.

use std::any::Any;
use std::future::Future;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};

use idempotent_core::store::sql::SqlStore;
use idempotent_core::{MemoryStore, PostgresStore, RedisStore, SharedStore, SqliteStore};

use crate::sql::{Conn, SqlDb};
use crate::{PgBouncer, PgServer, RedisServer};

/// Generates, for each scenario named, one `#[tokio::test]` on every store of the
/// [matrix](crate::matrix): `memory::<name>`, `sqlite::<name>`, `postgres::<name>` and `redis::<name>`,
/// each on an empty store of its own. A scenario is an `async fn` of a `SharedStore`, or of a
/// [`Backend`] when it needs the store's URL (for another process) or a directory.
///
/// `on_every_store!(sql: …)` runs the scenarios of the SQL stores only: `sqlite::<name>` and
/// `postgres::<name>`. Each is generic over the backend (`async fn <name><B: SqlDb>(db:
/// Database<B>)`, see [`SqlDb`] and [`Database`]) and runs on an empty database.
#[macro_export]
macro_rules! on_every_store {
    (@store $module:ident $kind:ident $backend:tt $($check:ident),*) => {
        mod $module {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $check() {
                    $crate::matrix::run($crate::matrix::Kind::$kind, $crate::on_every_store!(@scenario $backend $check)).await;
                }
            )*
        }
    };
    (@scenario [$($backend:ty)?] $check:ident) => {
        super::$check $(::<$backend>)?
    };
    (sql: $($check:ident),* $(,)?) => {
        $crate::on_every_store!(@store sqlite Sqlite [$crate::sql::SqliteBackend] $($check),*);
        $crate::on_every_store!(@store postgres Postgres [$crate::sql::PostgresBackend] $($check),*);
    };
    ($($check:ident),* $(,)?) => {
        $crate::on_every_store!(@store memory Memory [] $($check),*);
        $crate::on_every_store!(@store sqlite Sqlite [] $($check),*);
        $crate::on_every_store!(@store postgres Postgres [] $($check),*);
        $crate::on_every_store!(@store redis Redis [] $($check),*);
    };
}

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
    /// `PostgresStore` through a throwaway PgBouncer (`pool_mode = transaction`) in front of a
    /// throwaway server.
    PgBouncer,
}

/// A test's store, the URL another process reaches it by (none for memory), and what keeps it
/// alive.
pub struct Backend {
    /// The store.
    pub store: SharedStore,
    /// Its URL, for [`idempotent_core::store::connect`] in another process (none for memory).
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
                let (url, _, server) = sql_database(kind, &dir).await;
                let store = SqliteStore::connect(dir.path().join(SQLITE_FILE)).await.expect("open the SQLite store");
                (Arc::new(store), Some(url), server)
            }
            Kind::Postgres | Kind::PgBouncer => {
                let (url, _, server) = sql_database(kind, &dir).await;
                let store = PostgresStore::connect(url.clone())
                    .await
                    .unwrap_or_else(|e| panic!("connect to {url}: {e}; the server's log:\n{}", pg_log(&server)));
                (Arc::new(store), Some(url), server)
            }
            Kind::Redis => {
                let server = RedisServer::start();
                let store = RedisStore::connect_lazy(server.url()).expect("connect to the test server");
                (Arc::new(store), Some(server.url()), Some(Box::new(server)))
            }
        };
        Backend { store, url, dir, _server: server }
    }
}

/// An empty SQL database of the `B` kind for one test, with no store opened on it yet: what the
/// scenarios of the SQL stores only take.
pub struct Database<B: SqlDb> {
    /// Its URL: `sqlite://<file>` (the file does not exist yet), a PostgreSQL URL whose
    /// connections use a schema of the test's own, or a URL of a database of the test's own
    /// through PgBouncer (`?transaction_pooling=true`).
    pub url: String,
    /// Where [`connect`](Self::connect) goes when it is not `url`: the database itself, past
    /// PgBouncer, so that a test's own statements need not be written for the pooler.
    direct: Option<String>,
    /// A temporary directory for files of the test (the SQLite file is in it).
    pub dir: tempfile::TempDir,
    _server: Option<Box<dyn Any + Send>>,
    _backend: PhantomData<B>,
}

impl<B: SqlDb> Database<B> {
    /// Makes an empty database for one test.
    pub async fn start() -> Database<B> {
        Self::start_as(B::MATRIX).await
    }

    /// Makes an empty database of the `kind` for one test (`B::MATRIX`, or `PgBouncer` for
    /// PostgreSQL).
    pub async fn start_as(kind: Kind) -> Database<B> {
        let dir = tempfile::Builder::new().prefix("idem-test-").tempdir().expect("create a temp dir");
        let (url, direct, server) = sql_database(kind, &dir).await;
        Database { url, direct, dir, _server: server, _backend: PhantomData }
    }

    /// A store on it, with the default settings (the first one creates the tables).
    pub async fn open(&self) -> SqlStore<B> {
        let opened = B::open(&self.url).await;
        opened.unwrap_or_else(|e| {
            panic!("open a store on {}: {e}; the server's log:\n{}", self.url, pg_log(&self._server))
        })
    }

    /// A plain connection to it, outside any store (past PgBouncer, if there is one).
    pub async fn connect(&self) -> Conn<B> {
        B::connect(self.direct.as_deref().unwrap_or(&self.url)).await
    }
}

/// What a scenario run by [`on_every_store!`](crate::on_every_store) takes: the store alone,
/// the whole [`Backend`] (for its URL or its directory), or, for the SQL stores only, an empty
/// [`Database`].
pub trait Given: Sized {
    /// The scenario's argument, made for the `kind`, and what must live until the scenario ends.
    fn given(kind: Kind) -> impl Future<Output = (Self, Option<Backend>)>;
}

impl Given for SharedStore {
    async fn given(kind: Kind) -> (Self, Option<Backend>) {
        let backend = Backend::start(kind).await;
        (backend.store.clone(), Some(backend))
    }
}

impl Given for Backend {
    async fn given(kind: Kind) -> (Self, Option<Backend>) {
        (Backend::start(kind).await, None)
    }
}

impl<B: SqlDb> Given for Database<B> {
    async fn given(kind: Kind) -> (Self, Option<Backend>) {
        let through_pgbouncer = kind == Kind::PgBouncer && B::MATRIX == Kind::Postgres;
        assert!(kind == B::MATRIX || through_pgbouncer, "a scenario of a {:?} database run as {kind:?}", B::MATRIX);
        (Database::start_as(kind).await, None)
    }
}

/// Runs `scenario` on a new, empty store (or database) of the `kind`: the body of each test
/// [`on_every_store!`](crate::on_every_store) generates.
pub async fn run<A: Given, F: Future<Output = ()>>(kind: Kind, scenario: impl FnOnce(A) -> F) {
    let (given, keep) = A::given(kind).await;
    scenario(given).await;
    drop(keep);
}

/// The SQLite file of a test, in its directory.
pub const SQLITE_FILE: &str = "records.db";

/// An empty database of the SQL `kind` for a test whose directory is `dir`: its URL, the URL of
/// the database itself when that one goes through PgBouncer, and the servers that must live as
/// long as it does.
async fn sql_database(kind: Kind, dir: &tempfile::TempDir) -> (String, Option<String>, Option<Box<dyn Any + Send>>) {
    match kind {
        Kind::Sqlite => (format!("sqlite://{}", dir.path().join(SQLITE_FILE).display()), None, None),
        Kind::Postgres => {
            let server = shared_pg_server();
            let url = new_schema(&server).await;
            (url, None, Some(Box::new(server)))
        }
        Kind::PgBouncer => {
            let bounced = shared_pgbouncer();
            let database = new_database(&bounced.server).await;
            let url = format!("{}?transaction_pooling=true", bounced.bouncer.url(&database));
            let direct = format!("postgres://postgres@127.0.0.1:{}/{database}", bounced.server.port());
            (url, Some(direct), Some(Box::new(bounced)))
        }
        Kind::Memory | Kind::Redis => unreachable!("{kind:?} is not a SQL store"),
    }
}

/// The log of the PostgreSQL server a test holds, if it holds one (and PgBouncer's).
fn pg_log(server: &Option<Box<dyn Any + Send>>) -> String {
    let Some(server) = server.as_ref() else { return String::new() };
    if let Some(bounced) = server.downcast_ref::<Arc<Bounced>>() {
        return format!("{}\nPgBouncer's log:\n{}", bounced.server.log(), bounced.bouncer.log());
    }
    server.downcast_ref::<Arc<PgServer>>().map(|s| s.log()).unwrap_or_default()
}

/// A PgBouncer and the server behind it, shared like [`shared_pg_server`]'s (PgBouncer is
/// dropped, so killed, first).
struct Bounced {
    bouncer: PgBouncer,
    server: Arc<PgServer>,
}

fn shared_pgbouncer() -> Arc<Bounced> {
    static BOUNCED: Mutex<Weak<Bounced>> = Mutex::new(Weak::new());
    let mut shared = BOUNCED.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(bounced) = shared.upgrade() {
        return bounced;
    }
    let server = shared_pg_server();
    let bounced = Arc::new(Bounced { bouncer: PgBouncer::start(&server), server });
    *shared = Arc::downgrade(&bounced);
    bounced
}

/// A new database on `server`, for one test through PgBouncer (which passes every database name
/// on, and cannot pass a `search_path` on).
async fn new_database(server: &PgServer) -> String {
    use sqlx::Connection;
    static N: AtomicU64 = AtomicU64::new(0);
    let database = format!("bounced_{}", N.fetch_add(1, Ordering::Relaxed));
    let mut conn = server.connection().await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {database}")))
        .execute(&mut conn)
        .await
        .unwrap_or_else(|e| panic!("CREATE DATABASE {database}: {e}; the server's log:\n{}", server.log()));
    conn.close().await.expect("close the set-up connection");
    database
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
