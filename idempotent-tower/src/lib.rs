//! Tower layers that make HTTP and gRPC requests idempotent by their `Idempotency-Key`.
//!
//! - [`server`]: `IdempotencyLayer`, for axum routers and tonic servers.
//! - [`client`]: a layer that stamps one `Idempotency-Key` per logical request and keeps it
//!   across retries.
//! - [`retry`]: a `tower::retry::Policy` that knows which failures are safe to retry.

#![deny(unreachable_pub)]
#![warn(missing_docs)]

pub mod client;
mod grpc_code;
mod header;
pub mod retry;
pub mod server;

// shared by the server, the client and the retry policies
pub use grpc_code::GrpcCode;
pub use header::IDEMPOTENCY_KEY;
// server re-exports
pub use server::{Attempt, Idempotency, IdempotencyLayer};
// client re-exports
pub use client::{IdempotencyKey, IdempotencyKeyLayer};
// retry re-exports
pub use retry::{Backoff, GrpcRetryPolicy, HttpRetryPolicy};

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
