//! A service whose handlers run nested work under the request's identity, as users compose it:
//! `IdempotencyLayer` (tenant from the authenticated principal, keys required) around handlers
//! that run steps, commit versioned state and charge a provider. Shared by
//! `tests/tests/tower_identity.rs` and the server process `src/bin/identity_server.rs`, which the
//! tests kill in the middle of a request.
//!
//! Routes (each a `POST` whose body is an order name):
//! - `/orders`: a step that writes a business row (in the process, for stores without a
//!   database) and answers `order <n> for <tenant>` from the step's result;
//! - `/invoices`: the same row written in a transaction of the SQL store's database, committed
//!   with the step's record (`Step::run_in_transaction`), on SQLite or PostgreSQL;
//! - `/count`: one increment of the shared counter the body names (`State::modify`), then a
//!   downstream call that fails on every third request (503: the layer releases the key and the
//!   client retries);
//! - `/refund`: a step with a verifier that charges the provider ledger under the step's
//!   downstream key.
//!
//! A request with the header `x-hang` stops after its effect (the commit, the charge), reports
//! it through the app's `hang` callback and never ends, so that its server can be killed there.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Extension, State as AppState};
use axum::http::{HeaderMap, Request, StatusCode};
use axum::routing::post;
use axum::{Router, body::Body};
use idempotent_core::state::{MemoryStateStore, Scope, SharedStateStore, State};
use idempotent_core::{Attempt, Error, OnInFlight, PostgresStore, RedisStore, RunContext, SharedStore, SqliteStore};
use idempotent_tower::IdempotencyLayer;
use sqlx::{PgTransaction, SqliteTransaction};

use crate::ledger::Ledger;
use crate::uncertain::ledger_verifier;

/// The authenticated principal, which the test's authentication layer puts in the extensions
/// from the `x-user` header.
#[derive(Debug, Clone)]
pub struct Principal(pub String);

/// Called with a line when a request sent with `x-hang` reached its stopping point.
pub type Hang = Arc<dyn Fn(String) + Send + Sync>;

/// The database of a SQL store, for `/invoices`.
#[derive(Clone)]
pub enum Database {
    /// None: `/invoices` answers 501.
    None,
    /// The SQLite file the store keeps its records in.
    Sqlite(SqliteStore),
    /// The PostgreSQL database the store keeps its records in.
    Postgres(PostgresStore),
}

/// What the handlers share.
#[derive(Clone)]
pub struct Shop {
    /// The store of the counters `/count` increments.
    pub states: SharedStateStore,
    /// The provider `/refund` charges.
    pub ledger: Ledger,
    /// Business rows of `/orders`: (tenant, order).
    pub rows: Arc<Mutex<Vec<(String, String)>>>,
    /// Requests of `/count` so far, for its downstream failures.
    pub counted: Arc<AtomicU64>,
    /// The database `/invoices` writes to.
    pub database: Database,
    /// Where a request sent with `x-hang` reports.
    pub hang: Option<Hang>,
}

impl Shop {
    /// A shop on `states` (the counter's store) charging `ledger`, writing invoices to `database`.
    pub fn new(states: SharedStateStore, ledger: Ledger, database: Database) -> Shop {
        Shop { states, ledger, rows: Arc::default(), counted: Arc::default(), database, hang: None }
    }

    /// The counter named `name`.
    pub fn counter(&self, name: &str) -> State<u64> {
        State::new(self.states.clone(), Scope::new(name).tenant("shop"))
    }

    /// Business rows of `tenant` (written by `/orders`).
    pub fn rows_of(&self, tenant: &str) -> Vec<String> {
        self.rows.lock().unwrap().iter().filter(|(t, _)| t == tenant).map(|(_, o)| o.clone()).collect()
    }

    /// Stops the request if it asked to (reporting `line`), for its server to be killed there.
    async fn maybe_hang(&self, headers: &HeaderMap, line: String) {
        if headers.contains_key("x-hang")
            && let Some(hang) = &self.hang
        {
            hang(line);
            std::future::pending::<()>().await;
        }
    }
}

/// The application: the routes above behind `IdempotencyLayer` on `store` (tenant from the
/// principal, keys required, duplicates in flight wait, the given lease), behind an
/// authentication layer.
pub fn app(store: SharedStore, shop: Shop, lease: Duration) -> Router {
    let layer = IdempotencyLayer::new(store)
        .tenant(|parts| parts.extensions.get::<Principal>().map(|p| p.0.clone()))
        .require_key(true)
        .lease(lease)
        .on_in_flight(OnInFlight::Wait { timeout: Duration::from_secs(20) });
    Router::new()
        .route("/orders", post(order))
        .route("/invoices", post(invoice))
        .route("/count", post(count))
        .route("/refund", post(refund))
        .with_state((shop, lease))
        .layer(layer)
        .layer(tower::util::MapRequestLayer::new(authenticate))
}

/// The test's authentication: the principal named by `x-user`.
fn authenticate(mut req: Request<Body>) -> Request<Body> {
    if let Some(user) = req.headers().get("x-user").and_then(|v| v.to_str().ok()) {
        let principal = Principal(user.to_owned());
        req.extensions_mut().insert(principal);
    }
    req
}

type Reply = (StatusCode, String);

fn unavailable(e: impl std::fmt::Display) -> Reply {
    (StatusCode::SERVICE_UNAVAILABLE, e.to_string())
}

async fn order(
    AppState((shop, _)): AppState<(Shop, Duration)>,
    Extension(ctx): Extension<RunContext>,
    Extension(Principal(user)): Extension<Principal>,
    order: String,
) -> Reply {
    let made = ctx
        .step("create_order")
        .run(&order, |_| async {
            let mut rows = shop.rows.lock().unwrap();
            rows.push((user.clone(), order.clone()));
            Ok::<_, Error>(format!("order {} for {user}", rows.len()))
        })
        .await;
    made.map_or_else(unavailable, |body| (StatusCode::CREATED, body))
}

async fn invoice(
    AppState((shop, _)): AppState<(Shop, Duration)>,
    Extension(ctx): Extension<RunContext>,
    Extension(Principal(user)): Extension<Principal>,
    order: String,
) -> Reply {
    let db = |e: sqlx::Error| Error::Config(e.to_string());
    // The same step on either database: only the transaction's type (which names the store the
    // step needs) differs.
    macro_rules! create_invoice {
        ($tx:ty) => {
            ctx.step("create_invoice")
                .run_in_transaction(&order, async |tx: &mut $tx, _| {
                    let id: i64 = sqlx::query_scalar(INSERT_INVOICE)
                        .bind(&user)
                        .bind(&order)
                        .fetch_one(&mut **tx)
                        .await
                        .map_err(db)?;
                    Ok::<_, Error>(format!("invoice {id} for {user}"))
                })
                .await
        };
    }
    let made = match shop.database {
        Database::None => return (StatusCode::NOT_IMPLEMENTED, "no database".into()),
        Database::Sqlite(_) => create_invoice!(SqliteTransaction<'_>),
        Database::Postgres(_) => create_invoice!(PgTransaction<'_>),
    };
    made.map_or_else(unavailable, |body| (StatusCode::CREATED, body))
}

async fn count(AppState((shop, _)): AppState<(Shop, Duration)>, headers: HeaderMap, counter: String) -> Reply {
    let updated = match shop.counter(&counter).modify(|n| *n += 1).await {
        Ok(updated) => updated,
        Err(e) => return unavailable(e),
    };
    shop.maybe_hang(&headers, format!("committed {}", updated.version)).await;
    // The downstream call after the commit fails now and then: the response is not stored, and
    // the client's retry runs the handler again.
    if shop.counted.fetch_add(1, Ordering::Relaxed) % 3 == 0 {
        return unavailable("the downstream call failed; retry");
    }
    (StatusCode::CREATED, format!("counted at version {}", updated.version))
}

async fn refund(
    AppState((shop, lease)): AppState<(Shop, Duration)>,
    Extension(ctx): Extension<RunContext>,
    Extension(request): Extension<Attempt>,
    headers: HeaderMap,
    order: String,
) -> (StatusCode, HeaderMap, String) {
    let (shop, headers) = (&shop, &headers);
    let charged = ctx
        .step("refund")
        .lease(lease)
        .verify(ledger_verifier(&shop.ledger))
        .run(&order, |attempt| async move {
            let key = attempt.downstream_key();
            let id = shop.ledger.charge(key.as_str(), 1500);
            shop.maybe_hang(headers, format!("charged {key}")).await;
            Ok::<_, Error>(id)
        })
        .await;
    let mut out = HeaderMap::new();
    out.insert("x-recovered", request.recovered().to_string().parse().unwrap());
    match charged {
        Ok(id) => (StatusCode::CREATED, out, id),
        Err(e) => (StatusCode::SERVICE_UNAVAILABLE, out, e.to_string()),
    }
}

/// `/invoices`' statements, the same on both databases (`$n` placeholders).
const INSERT_INVOICE: &str = "INSERT INTO invoices (tenant, order_id) VALUES ($1, $2) RETURNING id";
const SELECT_INVOICES: &str = "SELECT order_id FROM invoices WHERE tenant = $1 ORDER BY id";

/// The store behind a backend's URL (memory without one), its state store, and its database.
pub async fn open(url: Option<&str>, memory: SharedStore) -> (SharedStore, SharedStateStore, Database) {
    let Some(url) = url else {
        return (memory, Arc::new(MemoryStateStore::new()), Database::None);
    };
    if let Some(path) = url.strip_prefix("sqlite://") {
        let store = SqliteStore::connect(path).await.expect("open the SQLite store");
        sqlx::query("CREATE TABLE IF NOT EXISTS invoices (id INTEGER PRIMARY KEY, tenant TEXT, order_id TEXT)")
            .execute(store.pool())
            .await
            .unwrap();
        (Arc::new(store.clone()), Arc::new(store.clone()), Database::Sqlite(store))
    } else if url.starts_with("postgres://") {
        let store = PostgresStore::connect(url).await.expect("connect to the PostgreSQL store");
        sqlx::query("CREATE TABLE IF NOT EXISTS invoices (id BIGSERIAL PRIMARY KEY, tenant TEXT, order_id TEXT)")
            .execute(store.pool())
            .await
            .unwrap();
        (Arc::new(store.clone()), Arc::new(store.clone()), Database::Postgres(store))
    } else {
        let store = RedisStore::connect_lazy(url).expect("connect to the Redis store");
        (Arc::new(store.clone()), Arc::new(store), Database::None)
    }
}

/// The invoices `/invoices` wrote for `tenant`, in the database.
pub async fn invoices_of(database: &Database, tenant: &str) -> Vec<String> {
    match database {
        Database::None => Vec::new(),
        Database::Sqlite(store) => {
            sqlx::query_scalar(SELECT_INVOICES).bind(tenant).fetch_all(store.pool()).await.unwrap()
        }
        Database::Postgres(store) => {
            sqlx::query_scalar(SELECT_INVOICES).bind(tenant).fetch_all(store.pool()).await.unwrap()
        }
    }
}
