//! Server side: [`IdempotencyLayer`] runs each request that carries an `Idempotency-Key` at most
//! once and replays its response to every retry.
//!
//! ```
//! use axum::{Router, body::Body, http::Request, routing::post};
//! use idempotent_core::MemoryStore;
//! use idempotent_tower::server::IdempotencyLayer;
//! use std::sync::atomic::{AtomicU32, Ordering};
//! use std::sync::Arc;
//! use tower::ServiceExt;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let refunds = Arc::new(AtomicU32::new(0));
//! let counter = refunds.clone();
//! let app = Router::new()
//!     .route("/refunds", post(move |body: String| async move {
//!         let n = counter.fetch_add(1, Ordering::SeqCst) + 1; // the side effect
//!         (axum::http::StatusCode::CREATED, format!("refund re_{n} for {body}"))
//!     }))
//!     .layer(IdempotencyLayer::new(MemoryStore::new()));
//!
//! let request = || {
//!     Request::post("/refunds")
//!         .header("idempotency-key", "\"8e03978e-40d5-43e8-bc93-6894a57f9324\"")
//!         .body(Body::from("order-7"))
//!         .unwrap()
//! };
//! let first = app.clone().oneshot(request()).await.unwrap();
//! let retry = app.clone().oneshot(request()).await.unwrap();
//! assert_eq!(first.status(), 201);
//! assert_eq!(retry.status(), 201);
//! assert_eq!(retry.headers()["idempotent-replayed"], "true");
//! let body = axum::body::to_bytes(retry.into_body(), usize::MAX).await.unwrap();
//! assert_eq!(body, "refund re_1 for order-7");
//! assert_eq!(refunds.load(Ordering::SeqCst), 1);
//! # }
//! ```
//!
//! # What the layer does
//!
//! Covered requests are those with a method in [`IdempotencyLayer::methods`] (POST and PATCH by
//! default) and every gRPC call. For a covered request:
//!
//! 1. **Key.** The `Idempotency-Key` header ([`header_name`](IdempotencyLayer::header_name)) is
//!    read as a structured-field string (`"…"`, as the IETF httpapi draft defines it) or in the
//!    bare form. Empty, longer than 255 bytes, not printable ASCII, malformed, or sent twice:
//!    400. Missing: the request passes through unprotected (marked [`Unprotected::NoKey`]), or
//!    400 with [`require_key`](IdempotencyLayer::require_key).
//! 2. **Identity.** The record is keyed by a hash of (tenant, scope, key), never by the client's
//!    key itself. The tenant comes from [`tenant`](IdempotencyLayer::tenant), so two principals'
//!    equal keys never share a record.
//! 3. **Fingerprint.** Method, path, query and body; a JSON body (`application/json` or
//!    `application/*+json`) is canonicalized first, so key order and whitespace alone are not a
//!    different request. The body is read in full, up to
//!    [`max_request_body`](IdempotencyLayer::max_request_body) (413 beyond it, whether or not
//!    the request announced a length); a body that fails mid-stream is 400.
//! 4. **Store.** One acquire on the store decides:
//!    - a stored response → **replayed**: its status, every header value (multi-valued fields
//!      such as `Set-Cookie` intact, hop-by-hop fields dropped), the exact body bytes and the
//!      trailers, plus `Idempotent-Replayed: true`. The service is not called. A hook given to
//!      [`on_replay`](IdempotencyLayer::on_replay) then sees the response's status, headers and
//!      extensions before it is sent, to add or change headers.
//!    - the key used with another fingerprint → **422**.
//!    - the key held by a request still running → **409** with `Retry-After`, or, with
//!      [`OnInFlight::Wait`](idempotent_core::OnInFlight::Wait), the first request's response
//!      once it is stored.
//!    - the key's record [needs attention](idempotent_core::Error::NeedsAttention) (an earlier
//!      attempt could not tell whether its effect happened, and left it for a person) →
//!      **409** with the problem type `tag:idempotent-tower,2025:needs-attention` and *no*
//!      `Retry-After` (gRPC: `FAILED_PRECONDITION`): a retry cannot cure it, and the retry
//!      policies of this crate do not retry it. The service is not called until an operator
//!      resolves the record ([`Store::resolve`](idempotent_core::Store::resolve); the record's
//!      key is `Key::from_client_key(tenant, scope, key)`). A layer with
//!      [`on_recovered(OnRecovered::NeedsAttention)`](IdempotencyLayer::on_recovered) leaves a
//!      record so itself when a request's previous attempt ended without a stored response.
//!    - the store unreachable → **503** with `Retry-After`, the service not called
//!      ([`fail_mode`](IdempotencyLayer::fail_mode) `Open` calls it unprotected instead, with
//!      [`Unprotected::StoreUnavailable`] and an [`Attempt::unprotected`] in its extensions).
//!    - the key is free → the service is called, its lease renewed while it runs. The request
//!      carries the [`Attempt`] as an extension (in axum: `Extension<Attempt>`), the same type a
//!      step's action gets: its fence to pass downstream, its
//!      [`downstream_key`](Attempt::downstream_key) (the same on every attempt under this
//!      `Idempotency-Key`, for a payment provider's own `Idempotency-Key`), its attempt number,
//!      whether it recovers from an attempt that ran out, and [`Attempt::lease_lost`]; and the
//!      request's [`RunContext`] for the handler's steps (see
//!      [What the handler runs under](#what-the-handler-runs-under)).
//! 5. **Outcome.** The response is buffered (up to
//!    [`max_stored_response`](IdempotencyLayer::max_stored_response)), then the
//!    [`StorePolicy`] decides: stored for replay (by default 2xx and final 4xx), or the key is
//!    released so that a retry runs again (5xx, 408, 409, 425, 429). A response too large to
//!    store is streamed to the client, the key released and a warning logged. A response the store
//!    did not take (the store went down, or the request outlived its lease and another attempt
//!    took the key over) still goes to the client, marked `Idempotent-Stored: false`: the request
//!    ran, and a retry under the same key may run it again. A request whose lease only ran out
//!    (no renewal reached the store for a whole lease) with no other attempt since is stored as
//!    usual: the store still knows it as the key's owner. A handler that stops early because
//!    [`Attempt::lease_lost`] is true should answer 503 (or another status the store policy
//!    releases on), so that its "stopped" answer is not stored as the operation's outcome.
//!
//! # When the client goes away
//!
//! A server drops the request's future when its client disconnects. Once the service has
//! answered, that no longer matters: reading the response body and storing the response (or
//! releasing the key) run in a task of their own, so a retry gets the replay. If the future is
//! dropped *before* the service answered, the service's work is cancelled with it, and the key
//! stays held until the lease passes ([`lease`](IdempotencyLayer::lease), 60 s by default): a
//! retry in that window gets 409, and the retry after it runs the request again with
//! [`Attempt::recovered`] set.
//!
//! # What the handler runs under
//!
//! Everything a covered handler does is keyed on (tenant, [`scope`](IdempotencyLayer::scope),
//! client key) and on the request's attempt, with no code of the handler's own (see
//! [`Unprotected`] for the requests that run without a key):
//!
//! - its steps, through the [`RunContext`] in the request's extensions (axum:
//!   `Extension<RunContext>`; tonic: `request.extensions().get::<RunContext>()`), on the layer's
//!   store; [`RunContext::store`] moves it to another store under the same identity;
//! - its state commits ([`State::update`](idempotent_core::state::State::update)), whose tokens
//!   derive from the request's key, because the request's [`Attempt`] is
//!   [`current_attempt`](idempotent_core::current_attempt) for the handler's whole future;
//! - the calls it makes to providers, with [`Attempt::downstream_key`] as their own idempotency
//!   key, and the verifiers of its steps, which ask those providers.
//!
//! Build the handler's context from the extension, never from the raw `Idempotency-Key` header:
//! a context made from the client's key alone is shared by every tenant that sends the same key
//! (one tenant would get another's result), and a header sent once quoted and once bare would
//! name two operations. (If you must build one by hand, use [`client_key`] and add the tenant the
//! layer's [`tenant`](IdempotencyLayer::tenant) extractor gives, with
//! [`RunContext::tenant`].)
//!
//! # Database writes that commit exactly once
//!
//! The layer stores the response after the handler has answered, in its own store; the
//! handler's database writes have committed before that, on their own. Between the two, a
//! crash, a store failure while the response is stored (`Idempotent-Stored: false`), or a lease
//! another attempt took over leaves the writes committed and no response stored: the retry runs
//! the handler again, and the writes happen twice.
//!
//! To make the database effect exactly once, the handler makes its writes a step whose record
//! commits with them ([`Step::run_in_transaction`](idempotent_core::Step::run_in_transaction),
//! on a [`SqliteStore`](idempotent_core::SqliteStore) or another SQL store of the database the
//! handler writes to), in the request's [`RunContext`]. The writes and the step's record commit
//! together or not at all; a retry that runs the handler again finds the step done, gets its
//! stored result back without writing anything, builds the same response from it, and the layer
//! stores that one. Build the response from the step's result only, so that the rebuilt response
//! is the first one. Two tenants sending the same key each get their own step, their own row
//! and their own response:
//!
//! ```
//! use axum::extract::State;
//! use axum::http::{Request, StatusCode};
//! use axum::{Extension, Router, body::Body, routing::post};
//! use idempotent_core::sqlx::{self, SqliteTransaction};
//! use idempotent_core::SqliteStore;
//! use idempotent_tower::{Error, IdempotencyLayer, RunContext};
//! use tower::ServiceExt;
//!
//! /// The principal an authentication layer (outside this one) puts in the extensions.
//! #[derive(Clone)]
//! struct Principal(String);
//!
//! async fn create_invoice(
//!     State(db): State<SqliteStore>,
//!     Extension(ctx): Extension<RunContext>, // keyed on (tenant, scope, Idempotency-Key)
//!     order: String,
//! ) -> (StatusCode, String) {
//!     let invoice = ctx
//!         .store(db) // the database the writes go to (here the layer's store as well)
//!         .step("create_invoice")
//!         .run_in_transaction(&order, async |tx: &mut SqliteTransaction<'_>, _| {
//!             let done = sqlx::query("INSERT INTO invoices (order_id) VALUES (?1)")
//!                 .bind(&order)
//!                 .execute(&mut **tx)
//!                 .await?; // a sqlx::Error is the action's own error, Error::Action
//!             Ok::<_, Error>(done.last_insert_rowid())
//!         })
//!         .await;
//!     match invoice {
//!         Ok(id) => (StatusCode::CREATED, format!("invoice {id}")),
//!         // 503: the default store policy releases the key, so the client's retry runs again.
//!         Err(e) => (StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
//!     }
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let path = std::env::temp_dir().join(format!("idempotent-tower-doc-{}.db", std::process::id()));
//! let db = SqliteStore::connect(&path).await?;
//! sqlx::query("CREATE TABLE IF NOT EXISTS invoices (order_id TEXT)").execute(db.pool()).await?;
//! let app = Router::new()
//!     .route("/invoices", post(create_invoice))
//!     .with_state(db.clone())
//!     .layer(
//!         IdempotencyLayer::new(db.clone())
//!             .tenant(|parts| parts.extensions.get::<Principal>().map(|p| p.0.clone()))
//!             .require_key(true),
//!     );
//! let request = |tenant: &str| {
//!     let mut req = Request::post("/invoices").header("idempotency-key", "k-7").body(Body::from("order-7")).unwrap();
//!     req.extensions_mut().insert(Principal(tenant.into())); // what the authentication layer does
//!     req
//! };
//! assert_eq!(app.clone().oneshot(request("acme")).await?.status(), 201);
//! assert_eq!(app.clone().oneshot(request("acme")).await?.headers()["idempotent-replayed"], "true");
//! let globex = app.clone().oneshot(request("globex")).await?; // the same key, another tenant
//! assert_eq!(globex.status(), 201);
//! assert!(globex.headers().get("idempotent-replayed").is_none());
//! let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM invoices").fetch_one(db.pool()).await?;
//! assert_eq!(rows, 2); // one invoice per tenant, however often each retries
//! # db.close().await;
//! # for suffix in ["", "-wal", "-shm"] { let _ = std::fs::remove_file(format!("{}{suffix}", path.display())); }
//! # Ok(()) }
//! ```
//!
//! What this does not make atomic is the response itself: the step's result is stored twice
//! (in the step's record, with the writes, and as the layer's stored response), and they are
//! kept apart because the layer keeps one store for every route while the handler's writes go
//! to its own database. The layer does not begin transactions for handlers: it would need the
//! database's type, a shared handle to the transaction in the request's extensions (which must
//! be `Clone`, so a handler could keep it past its response), the whole response body read
//! before the commit (on SQLite, with the file's write lock held all that time), and a 2xx
//! turned into a 503 when the commit fails; see DESIGN.md ("Steps that commit with their
//! record").
//!
//! Refusals are `application/problem+json` documents (RFC 9457) whose `detail` tells the
//! client what to do. Events are logged with `tracing` (`idempotent.acquired`, `.replayed`,
//! `.stored`, `.released`, `.in_flight`, `.mismatch`, `.store_error`, `.lease_lost`,
//! `.not_stored`, `.corrupt`, `.refused`) with a 12-hex-digit prefix of the hashed key; client
//! keys and bodies are never logged. With the `metrics` feature the layer also counts each
//! request with a key by how it ended, and times the service and the store calls, through the
//! `metrics` facade: the names and labels are in [`idempotent_core::metrics`] (the `step` label
//! is the layer's [`scope`](IdempotencyLayer::scope); never a key or a tenant).
//!
//! # gRPC
//!
//! The same layer serves tonic: `Server::builder().layer(IdempotencyLayer::new(store))`. Calls
//! are recognised by `content-type: application/grpc` (alone or with `+proto` and the like;
//! gRPC-Web is not, see below); the key comes from `idempotency-key` metadata; the fingerprint
//! is the method path and the message bytes; trailers (`grpc-status`, `grpc-message`, …) are
//! stored and replayed; the default policy releases the key on
//! UNAVAILABLE, ABORTED, RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED, INTERNAL, CANCELLED and
//! UNKNOWN. Refusals are trailers-only gRPC statuses: missing or invalid key INVALID_ARGUMENT,
//! body too large RESOURCE_EXHAUSTED, mismatch FAILED_PRECONDITION, in flight ABORTED, store
//! down UNAVAILABLE.
//!
//! **Streaming.** The fingerprint needs the whole request, so a client-streaming or
//! bidirectional call with a key is read to its end (up to
//! [`max_request_body`](IdempotencyLayer::max_request_body)) before the service sees its first
//! message: a bidirectional call that needs its messages interleaved with replies (a chat, a
//! request that waits for an answer before sending the next) does not work with a key; call it
//! without one, or keep such services out of the layer. A server-streaming response is
//! buffered up to [`max_stored_response`](IdempotencyLayer::max_stored_response) before the
//! client sees any of it; a longer stream is passed on as it comes and not stored.
//!
//! **`require_key(true)` applies to every gRPC call**, whatever its method: health checks,
//! reflection and read-only methods included, which their clients call without a key. Put the
//! layer with `require_key(true)` on the services that need it only, for example on their
//! route of a tonic [`Routes`](https://docs.rs/tonic/latest/tonic/service/struct.Routes.html):
//!
//! ```no_run
//! use std::convert::Infallible;
//!
//! use idempotent_core::MemoryStore;
//! use idempotent_tower::server::{IdempotencyLayer, RequestBody};
//! use tonic::service::Routes;
//! use tower::Layer;
//!
//! type Payments = tower::util::BoxCloneSyncService<
//!     http::Request<RequestBody<axum::body::Body>>,
//!     http::Response<tonic::body::Body>,
//!     Infallible,
//! >;
//!
//! # async fn serve(health: Routes, payments: Payments) -> Result<(), tonic::transport::Error> {
//! // `payments` is a generated server (`PaymentsServer::new(service)`), `health` the routes of
//! // the health service: keys are required on `payments.Payments` and nowhere else.
//! let keyed = IdempotencyLayer::new(MemoryStore::new()).require_key(true).layer(payments);
//! let routes = health.into_axum_router().route_service("/payments.Payments/{*method}", keyed);
//! tonic::transport::Server::builder()
//!     .add_routes(Routes::from(routes))
//!     .serve("127.0.0.1:50051".parse().unwrap())
//!     .await
//! # }
//! ```
//!
//! **gRPC-Web** (`application/grpc-web`, `application/grpc-web-text`) is not handled as gRPC: its
//! trailers, `grpc-status` included, travel inside the response body, where the store policy
//! cannot read them. It is handled as the HTTP POST it is: covered when POST is among
//! [`methods`](IdempotencyLayer::methods), fingerprinted by path, query and body, and a 200
//! (whatever `grpc-status` its body carries) stored and replayed byte for byte, in-body trailers
//! included. Its refusals are HTTP problem documents (400, 409, 422, 503), which gRPC-Web
//! clients report by HTTP status. Put the layer inside the gRPC-Web translation (e.g.
//! `tonic-web`) to have such calls handled as gRPC.
//!
//! ```no_run
//! use idempotent_core::MemoryStore;
//! use idempotent_tower::server::IdempotencyLayer;
//!
//! # async fn serve(routes: tonic::service::Routes) -> Result<(), tonic::transport::Error> {
//! tonic::transport::Server::builder()
//!     .layer(IdempotencyLayer::new(MemoryStore::new()))
//!     .add_routes(routes)
//!     .serve("127.0.0.1:50051".parse().unwrap())
//!     .await
//! # }
//! ```
//!
//! # Plain tower services
//!
//! The layer reads the request body to fingerprint it, and hands the inner service the buffered
//! body as [`RequestBody<B>`](RequestBody): the inner service must accept
//! `http::Request<RequestBody<B>>`, where `B` is the body type the layer itself receives. An
//! axum `Router` and a tonic server accept any body, so nothing changes for them. A plain
//! `tower::service_fn` names its request type: give it `Request<RequestBody<B>>`. If it names
//! another (`Request<Full<Bytes>>`), calling the wrapped service fails to compile with "the
//! method `oneshot` exists … but its trait bounds were not satisfied" (E0599): that is this
//! bound. `RequestBody<B>` is an `http_body::Body` like any other.
//!
//! ```
//! use bytes::Bytes;
//! use http::{Request, Response};
//! use http_body_util::{BodyExt, Full};
//! use idempotent_core::MemoryStore;
//! use idempotent_tower::server::{IdempotencyLayer, RequestBody};
//! use tower::{Layer, ServiceExt, service_fn};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let charge = service_fn(|req: Request<RequestBody<Full<Bytes>>>| async move {
//!     let order = req.into_body().collect().await.unwrap().to_bytes();
//!     Ok::<_, std::convert::Infallible>(Response::new(Full::new(Bytes::from(format!("charged {order:?}")))))
//! });
//! let svc = IdempotencyLayer::new(MemoryStore::new()).layer(charge);
//! let req = Request::post("/charges").header("idempotency-key", "k-1").body(Full::new(Bytes::from("o-7"))).unwrap();
//! let res = svc.oneshot(req).await.unwrap();
//! assert_eq!(res.into_body().collect().await.unwrap().to_bytes(), "charged b\"o-7\"");
//! # }
//! ```
//!
//! # Where to put it
//!
//! Put authentication *outside* this layer (added after it with `Router::layer`, or earlier in
//! a `ServiceBuilder`), so that the tenant extractor sees the principal and an unauthenticated
//! request never takes a key. Put this layer outside anything that should run at most once.
//! Retries are the client's business: a server-side retry layer inside this one would run the
//! handler again under the same lease.

mod body;
mod buffer;
mod config;
mod fingerprint;
mod future;
mod grpc;
mod identity;
pub(crate) mod key;
mod layer;
mod outcome;
mod policy;
pub(crate) mod problem;
pub(crate) mod record;
mod service;

pub use body::{RequestBody, ResponseBody};
pub use config::{DEFAULT_KEY_HEADER, DEFAULT_MAX_REQUEST_BODY, DEFAULT_MAX_STORED_RESPONSE, STORE_DOWN_RETRY_AFTER};
pub use future::ResponseFuture;
pub use idempotent_core::{Attempt, RunContext};
pub use identity::Unprotected;
pub use key::client_key;
pub use layer::IdempotencyLayer;
pub use outcome::{IDEMPOTENT_REPLAYED, IDEMPOTENT_STORED};
pub use policy::{DefaultStorePolicy, Outcome, StorePolicy};
pub use service::Idempotency;
