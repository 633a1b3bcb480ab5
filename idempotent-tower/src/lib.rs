//! Tower layers that make HTTP and gRPC requests idempotent by their `Idempotency-Key`.
//!
//! - [`server`]: `IdempotencyLayer`, for axum routers and tonic servers.
//! - [`client`]: a layer that stamps one `Idempotency-Key` per logical request and keeps it
//!   across retries.
//! - [`retry`]: a `tower::retry::Policy` that knows which failures are safe to retry.
//! - [`precondition`]: optimistic concurrency over HTTP for versioned shared state
//!   (`idempotent_core::state`): `ETag` from the version, `If-Match` checked (412, 428).
//! - `reqwest` (feature `reqwest`): the key and the retry rules as `reqwest-middleware`
//!   middleware, for clients built on `reqwest::Client`.
//! - `client::hedge` (feature `hedge`): a policy for tower's `hedge` middleware that hedges only
//!   requests the server can recognise as duplicates.
//!
//! This crate is the one dependency a tower user needs: it re-exports the stores and options of
//! [`idempotent_core`] (and the crate itself), the [`RunContext`] a handler's steps run in and
//! the versioned [`state`], `RedisStore` under the `redis` feature, `SqliteStore` and
//! `PostgresStore` (with `sqlx`) under the `sqlite` and `postgres` features, the [`http`] crate
//! whose types the tenant closure takes, and tower's retry budget ([`retry::TpsBudget`]).
//!
//! ```
//! use std::time::Duration;
//!
//! use idempotent_tower::http::request::Parts;
//! use idempotent_tower::retry::{Backoff, HttpRetryPolicy, TpsBudget};
//! use idempotent_tower::{IdempotencyLayer, MemoryStore, OnInFlight};
//!
//! /// The principal an authentication layer (outside this one) put into the extensions.
//! #[derive(Clone)]
//! struct User(String);
//!
//! let layer = IdempotencyLayer::new(MemoryStore::new()) // `RedisStore` to share it (feature `redis`)
//!     .tenant(|parts: &Parts| parts.extensions.get::<User>().map(|user| user.0.clone()))
//!     .on_in_flight(OnInFlight::Wait { timeout: Duration::from_secs(5) });
//!
//! // A client's retry policy, with a budget of 10% of the last 30 s of requests.
//! let retry = HttpRetryPolicy::new()
//!     .backoff(Backoff::new(Duration::from_millis(50), Duration::from_secs(2)))
//!     .budget(TpsBudget::new(Duration::from_secs(30), 5, 0.1));
//! # let _ = (layer, retry);
//! ```
//!
//! # Features
//!
//! - `redis`: `RedisStore`, `RedisStoreBuilder` and `Preflight`, re-exported from
//!   idempotent-core.
//! - `cluster`: Redis Cluster support in `RedisStore` (`RedisStore::cluster_builder`).
//! - `sentinel`: Redis Sentinel support in `RedisStore` (`RedisStore::sentinel_builder`).
//! - `tls-rustls`, `tls-native-tls`: TLS through rustls (to Redis, `rediss://`, and to
//!   PostgreSQL, `sslmode=verify-full&sslrootcert=…`) or through the system's native TLS library
//!   (to Redis only): idempotent-core's features of the same names.
//! - `sqlite`: `SqliteStore` and `SqliteStoreBuilder` (idempotent-core's `sqlite`), and `sqlx`.
//! - `postgres`: `PostgresStore` and `PostgresStoreBuilder` (idempotent-core's `postgres`), and
//!   `sqlx`.
//! - `reqwest`: `idempotent_tower::reqwest`, `IdempotencyKeyMiddleware` and `RetryMiddleware`
//!   for `reqwest-middleware` (no TLS backend of its own: the application's reqwest picks it).
//! - `hedge`: `idempotent_tower::client::hedge`, hedged requests under the key layer.

#![deny(unreachable_pub)]
#![warn(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod client;
mod grpc_code;
mod header;
pub mod precondition;
#[cfg(feature = "reqwest")]
#[cfg_attr(docsrs, doc(cfg(feature = "reqwest")))]
pub mod reqwest;
pub mod retry;
pub mod server;

// shared by the server, the client and the retry policies
pub use grpc_code::GrpcCode;
pub use header::IDEMPOTENCY_KEY;
// server re-exports
pub use server::{Attempt, Idempotency, IdempotencyLayer, Unprotected};
// client re-exports
pub use client::{IdempotencyKey, IdempotencyKeyLayer};
// retry re-exports
pub use retry::{Backoff, GrpcRetryPolicy, HttpRetryPolicy, TpsBudget};

/// The core crate: keys, the record protocol, the stores and the executor.
pub use idempotent_core;
// The stores and the options a server needs, so that one dependency line is enough. (Plain
// comments: a doc comment here would be prepended to each item's own docs.)
/// The SQL driver of the SQL stores (features `sqlite`, `postgres`), whose transactions a
/// handler's steps commit their writes in (`Step::run_in_transaction`).
#[cfg(any(feature = "sqlite", feature = "postgres"))]
pub use idempotent_core::sqlx;
pub use idempotent_core::{
    Error, FailMode, IntoSharedStore, MemoryStore, OnInFlight, OnRecovered, RunContext, SharedStore, Store, state,
};
#[cfg(feature = "postgres")]
pub use idempotent_core::{PostgresStore, PostgresStoreBuilder};
#[cfg(feature = "redis")]
pub use idempotent_core::{Preflight, RedisStore, RedisStoreBuilder};
#[cfg(feature = "sqlite")]
pub use idempotent_core::{SqliteStore, SqliteStoreBuilder};

/// The `http` crate, whose types this crate's API takes (the tenant closure gets
/// `&http::request::Parts`).
pub use http;

/// The README's example is compiled as a doc test (not run: it serves on a port).
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctest;

/// Entry points for the fuzz targets in `fuzz/`. Not public API: may change in any release.
#[doc(hidden)]
pub mod __fuzz {
    /// Parses one `Idempotency-Key` header value (sf-string or bare form).
    pub fn parse_key(raw: &[u8]) -> Result<String, String> {
        crate::server::key::parse_value(raw).map(String::from).map_err(|e| e.to_string())
    }

    /// Decodes a stored response; when it decodes, re-encodes it and checks the round trip.
    pub fn decode_record(bytes: &[u8]) -> bool {
        use crate::server::record::StoredResponse;
        match StoredResponse::decode(bytes::Bytes::copy_from_slice(bytes)) {
            Ok(resp) => {
                // Encoding drops hop-by-hop fields, so compare encodings: they must be stable.
                let encoded = resp.encode();
                let again = StoredResponse::decode(encoded.clone()).expect("a re-encoded record decodes");
                assert_eq!(again.encode(), encoded, "record round trip changed the response");
                true
            }
            Err(_) => false,
        }
    }
}
