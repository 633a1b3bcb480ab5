//! reqwest middleware (feature `reqwest`): one `Idempotency-Key` per logical request, kept
//! across the retries of [`HttpRetryPolicy`](crate::retry::HttpRetryPolicy)'s rules.
//!
//! `reqwest::Client` is not a tower `Service`, so [`IdempotencyKeyLayer`](crate::IdempotencyKeyLayer)
//! and tower's `Retry` do not wrap it. [`reqwest_middleware`] does: add
//! [`IdempotencyKeyMiddleware`] and then [`RetryMiddleware`] to its `ClientBuilder`.
//!
//! ```
//! use std::sync::Arc;
//! use std::sync::atomic::{AtomicU32, Ordering};
//! use std::time::Duration;
//!
//! use axum::Router;
//! use axum::http::StatusCode;
//! use axum::routing::post;
//! use idempotent_tower::reqwest::{IdempotencyKeyMiddleware, RetryMiddleware, reqwest, reqwest_middleware};
//! use idempotent_tower::retry::{Backoff, HttpRetryPolicy};
//! use idempotent_tower::{IdempotencyLayer, MemoryStore};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // A refund service behind the server layer, whose first answer is an overloaded proxy's 503
//! // (after the refund was made).
//! let refunds = Arc::new(AtomicU32::new(0));
//! let app = Router::new()
//!     .route("/refunds", post({
//!         let refunds = refunds.clone();
//!         move || async move { refunds.fetch_add(1, Ordering::SeqCst); (StatusCode::CREATED, "re_1") }
//!     }))
//!     .layer(IdempotencyLayer::new(MemoryStore::new()))
//!     .layer(axum::middleware::map_response({
//!         let answers = Arc::new(AtomicU32::new(0));
//!         move |response: axum::response::Response| {
//!             let first = answers.fetch_add(1, Ordering::SeqCst) == 0;
//!             async move { if first { StatusCode::SERVICE_UNAVAILABLE.into_response() } else { response } }
//!         }
//!     }));
//! # use axum::response::IntoResponse;
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
//! let url = format!("http://{}/refunds", listener.local_addr()?);
//! tokio::spawn(async move { axum::serve(listener, app).await });
//!
//! let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
//!     .with(IdempotencyKeyMiddleware::new()) // first: one key per logical request
//!     .with(RetryMiddleware::new(
//!         HttpRetryPolicy::new().backoff(Backoff::new(Duration::from_millis(10), Duration::from_millis(100))),
//!     )) // then: every attempt reuses it
//!     .build();
//!
//! let response = client.post(&url).body(r#"{"order":7}"#).send().await?;
//! assert_eq!(response.status(), StatusCode::CREATED);
//! assert_eq!(response.headers()["idempotent-replayed"], "true"); // the second attempt was a replay
//! assert_eq!(refunds.load(Ordering::SeqCst), 1);
//! # Ok(()) }
//! ```
//!
//! # Order matters: the key middleware goes first
//!
//! reqwest-middleware runs middleware in the order they were added, each calling the next.
//! [`RetryMiddleware`] sends a copy of the request it was handed on every retry, so a key
//! stamped by a middleware *after* it is missing from the copy, and each attempt would get a new
//! key. The retry middleware fails safe there: it sees a `POST` without a key and never retries
//! it; and the key middleware notices that it runs inside the retry middleware and logs a
//! warning (`idempotent.client_key`, with the fix). A hand-written retry that resends
//! regardless would duplicate the side effect. `tests/tests/reqwest_client.rs` pins both
//! orders.
//!
//! ```text
//! right: ClientBuilder::new(client).with(IdempotencyKeyMiddleware::new()).with(RetryMiddleware::new(policy))
//! wrong: ClientBuilder::new(client).with(RetryMiddleware::new(policy)).with(IdempotencyKeyMiddleware::new())
//! ```
//!
//! # Where keys come from
//!
//! A key the caller set in the header is kept. Otherwise an [`OperationKey`] attached with
//! `.with_extension(OperationKey::new(&key))` (derived with [`idempotent_core::Key::derive`],
//! so a worker restarted after a crash sends the same key), or else a random UUID v4.
//!
//! # Why not `reqwest-retry`
//!
//! `reqwest-retry` brings its own backoff (`retry-policies`) and its own classification; it has
//! no retry budget, and no rule that a non-idempotent request needs a key. [`RetryMiddleware`]
//! drives [`HttpRetryPolicy`](crate::retry::HttpRetryPolicy) instead, so a tower client and a
//! reqwest client of the same service retry by one set of rules, configured the same way.
//!
//! # TLS
//!
//! The feature turns on no TLS backend: `reqwest` is built with `default-features = false`
//! here, and the application's own `reqwest` dependency (its default is rustls) decides.
//! [`reqwest`] and [`reqwest_middleware`] are re-exported so that the versions match.

use std::future::Future;
use std::pin::Pin;

mod key;
mod retry;

pub use key::{IdempotencyKeyMiddleware, OperationKey};
pub use retry::{ReqwestErrors, RetryMiddleware};

/// The reqwest crate this module's middleware takes requests of.
pub use ::reqwest;
/// The reqwest-middleware crate whose `Middleware` trait this module implements.
pub use ::reqwest_middleware;

/// What `#[async_trait]` makes `Middleware::handle` return.
type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Put in the extensions by [`RetryMiddleware`], so that a key middleware after it can tell
/// that it was added in the wrong order.
#[derive(Debug, Clone, Copy)]
struct InsideRetry;
