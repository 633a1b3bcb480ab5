//! Client side: one `Idempotency-Key` per logical request, kept across retries.
//!
//! ```
//! use std::sync::{Arc, Mutex};
//!
//! use bytes::Bytes;
//! use http::{Request, Response, StatusCode};
//! use http_body_util::Full;
//! use idempotent_tower::client::IdempotencyKeyLayer;
//! use idempotent_tower::retry::HttpRetryPolicy;
//! use tower::retry::RetryLayer;
//! use tower::{ServiceBuilder, ServiceExt, service_fn};
//!
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() {
//! // A remote API that answers 503 twice before it processes the refund.
//! let keys_seen = Arc::new(Mutex::new(Vec::new()));
//! let api = service_fn({
//!     let keys_seen = keys_seen.clone();
//!     move |request: Request<Full<Bytes>>| {
//!         let mut keys_seen = keys_seen.lock().unwrap();
//!         keys_seen.push(request.headers()["idempotency-key"].clone());
//!         let status = if keys_seen.len() < 3 { StatusCode::SERVICE_UNAVAILABLE } else { StatusCode::CREATED };
//!         std::future::ready(Ok::<_, std::convert::Infallible>(Response::builder().status(status).body(()).unwrap()))
//!     }
//! });
//!
//! let client = ServiceBuilder::new()
//!     .layer(IdempotencyKeyLayer::new()) // outside: one key per logical request
//!     .layer(RetryLayer::new(HttpRetryPolicy::new())) // inside: every attempt reuses it
//!     .service(api);
//!
//! let refund = Request::post("https://api.example/refunds").body(Full::from(r#"{"order":7}"#)).unwrap();
//! let response = client.oneshot(refund).await.unwrap();
//!
//! assert_eq!(response.status(), StatusCode::CREATED);
//! let keys_seen = keys_seen.lock().unwrap();
//! assert_eq!(keys_seen.len(), 3);
//! assert!(keys_seen.iter().all(|key| key == &keys_seen[0]));
//! # }
//! ```
//!
//! # Order matters: the key layer goes outside the retry layer
//!
//! tower's `Retry` keeps a copy of each request (made by the policy's `clone_request`) *before*
//! it calls the service below it, and sends that copy again on a retry. Whatever a layer below
//! `Retry` writes into the request is therefore missing from the copy. So:
//!
//! ```text
//! right: ServiceBuilder::new().layer(IdempotencyKeyLayer::new()).layer(RetryLayer::new(policy))
//!
//!   caller ─► IdempotencyKey ─► Retry ─────────────► HTTP client ─► server
//!             stamps K          keeps a copy with K
//!                               attempt 1  (K) ──────────────────► runs the refund; reply lost
//!                               attempt 2  (K) ──────────────────► replays the stored reply
//!
//! wrong: ServiceBuilder::new().layer(RetryLayer::new(policy)).layer(IdempotencyKeyLayer::new())
//!
//!   caller ─► Retry ─────────────────► IdempotencyKey ─► HTTP client ─► server
//!             keeps a copy, no key
//!             attempt 1 (no key) ────► stamps K1 ──────────────────────► runs the refund; reply lost
//!             attempt 2 (no key) ────► stamps K2 ──────────────────────► runs it AGAIN: new key
//! ```
//!
//! In the wrong order every attempt carries a new key and the server cannot tell a retry from a
//! new request. [`HttpRetryPolicy`](crate::retry::HttpRetryPolicy) fails safe there: it sees the
//! copy without a key and does not retry the `POST` at all. A policy that retries regardless
//! duplicates the side effect. The tests of this crate pin both behaviours.
//!
//! # Where keys come from
//!
//! - A key the caller already put in the header is kept as it is.
//! - Otherwise [`UuidV4Key`] makes a random one (the default), or the layer's
//!   [`generator`](IdempotencyKeyLayer::generator) makes one from the request. A random key
//!   protects the retries of this process only. A key derived from the operation's identity
//!   (with [`idempotent_core::Key::derive`]) also protects a worker that crashes and sends the
//!   same request again after a restart:
//!
//! ```
//! use bytes::Bytes;
//! use http::{HeaderValue, Request};
//! use http_body_util::Full;
//! use idempotent_core::{Key, KeyScope};
//! use idempotent_tower::client::IdempotencyKeyLayer;
//! use tower::{Layer, ServiceExt, service_fn};
//!
//! /// What the worker is doing, attached to each request it sends.
//! #[derive(Clone)]
//! struct Job {
//!     run_id: String,
//!     step: &'static str,
//!     payload: serde_json::Value,
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let layer = IdempotencyKeyLayer::new().generator(|request: &Request<Full<Bytes>>| {
//!     let job = request.extensions().get::<Job>().expect("every request carries its job");
//!     let key = Key::derive(&KeyScope::new(job.run_id.as_str(), job.step), &job.payload)
//!         .expect("a JSON value always has a canonical form");
//!     HeaderValue::from_str(&key.to_hex()).expect("hex is a valid header value")
//! });
//! let sent_key = || {
//!     let layer = layer.clone();
//!     async move {
//!         let echo = service_fn(|request: Request<Full<Bytes>>| async move {
//!             Ok::<_, std::convert::Infallible>(request.headers()["idempotency-key"].clone())
//!         });
//!         let mut request = Request::post("https://api.example/refunds").body(Full::default()).unwrap();
//!         let job = Job { run_id: "run-42".into(), step: "refund", payload: serde_json::json!({"order": 7}) };
//!         request.extensions_mut().insert(job);
//!         layer.layer(echo).oneshot(request).await.unwrap()
//!     }
//! };
//! // The worker's first life, then its life after a crash: same job, same key.
//! assert_eq!(sent_key().await, sent_key().await);
//! # }
//! ```
//!
//! # What gets a key
//!
//! By default `POST` and `PATCH` requests, the methods HTTP does not define as idempotent;
//! [`methods`](IdempotencyKeyLayer::methods) changes the set and
//! [`header_name`](IdempotencyKeyLayer::header_name) the header. gRPC calls are `POST`s, and the
//! gRPC metadata `idempotency-key` is that same header, so the layer works on a tonic `Channel`
//! unchanged. Keys are logged (at `trace` level) only as a short sha256 prefix.

#[cfg(feature = "hedge")]
#[cfg_attr(docsrs, doc(cfg(feature = "hedge")))]
pub mod hedge;
mod key;
mod layer;
mod service;

pub use key::{MakeIdempotencyKey, UuidV4Key};
#[cfg(feature = "reqwest")]
pub(crate) use key::{insert_key, needs_key};
pub use layer::IdempotencyKeyLayer;
#[cfg(feature = "reqwest")]
pub(crate) use layer::default_methods;
pub use service::IdempotencyKey;

#[cfg(test)]
mod tests;
