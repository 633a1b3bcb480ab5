//! Tower layers that make HTTP and gRPC requests idempotent by their `Idempotency-Key`.
//!
//! - [`server`]: `IdempotencyLayer`, for axum routers and tonic servers.
//! - [`client`]: a layer that stamps one `Idempotency-Key` per logical request and keeps it
//!   across retries.
//! - [`retry`]: a `tower::retry::Policy` that knows which failures are safe to retry.

#![deny(unreachable_pub)]
#![warn(missing_docs)]

pub mod client;
pub mod retry;
pub mod server;

// server re-exports
pub use server::{Idempotency, IdempotencyLayer};
// client re-exports
pub use client::{IdempotencyKey, IdempotencyKeyLayer};
// retry re-exports
pub use retry::{Backoff, GrpcRetryPolicy, HttpRetryPolicy};
