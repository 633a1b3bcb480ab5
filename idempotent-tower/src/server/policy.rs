//! Which responses are stored and replayed, and which free the key for a retry.

use http::{HeaderMap, StatusCode};

use crate::GrpcCode;

/// A finished response, as seen by a [`StorePolicy`].
#[derive(Debug, Clone, Copy)]
pub struct Outcome<'a> {
    pub(crate) status: StatusCode,
    pub(crate) headers: &'a HeaderMap,
    pub(crate) trailers: Option<&'a HeaderMap>,
    pub(crate) grpc: bool,
}

impl<'a> Outcome<'a> {
    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The response headers.
    pub fn headers(&self) -> &'a HeaderMap {
        self.headers
    }

    /// The response trailers, if the body ended with any.
    pub fn trailers(&self) -> Option<&'a HeaderMap> {
        self.trailers
    }

    /// Whether the request was a gRPC call (`content-type: application/grpc*`).
    pub fn is_grpc(&self) -> bool {
        self.grpc
    }

    /// The gRPC status code (`grpc-status`), from the trailers or, for a trailers-only response,
    /// from the headers. `None` when absent or not a number.
    pub fn grpc_status(&self) -> Option<GrpcCode> {
        self.trailers
            .and_then(|t| t.get("grpc-status"))
            .or_else(|| self.headers.get("grpc-status"))
            .and_then(|v| v.to_str().ok())
            .and_then(|s| s.trim().parse().ok())
            .map(GrpcCode::new)
    }
}

/// Decides whether a response is stored (and replayed to every retry) or the key is released.
///
/// A stored response is final: every retry with the key gets it back. So only outcomes that a
/// retry could not change should be stored. [`DefaultStorePolicy`] stores 2xx and the final 4xx
/// and releases the key on everything that invites a retry: 5xx, 408 Request Timeout,
/// 409 Conflict, 425 Too Early and 429 Too Many Requests. For gRPC responses it reads
/// `grpc-status` instead and releases on UNAVAILABLE, ABORTED, RESOURCE_EXHAUSTED,
/// DEADLINE_EXCEEDED, INTERNAL, and also on CANCELLED and UNKNOWN (neither says anything final),
/// or when the status is missing altogether.
///
/// ```
/// use http::StatusCode;
/// use idempotent_tower::server::{DefaultStorePolicy, IdempotencyLayer, Outcome, StorePolicy};
/// use idempotent_core::MemoryStore;
///
/// // Also replay 503s that carry a `x-final` header; otherwise behave like the default.
/// let layer = IdempotencyLayer::new(MemoryStore::new()).store_policy(|outcome: &Outcome<'_>| {
///     (outcome.status() == StatusCode::SERVICE_UNAVAILABLE && outcome.headers().contains_key("x-final"))
///         || DefaultStorePolicy.should_store(outcome)
/// });
/// # let _ = layer;
/// ```
///
/// Implemented for closures `Fn(&Outcome<'_>) -> bool`.
pub trait StorePolicy: Send + Sync + 'static {
    /// `true` to store the response, `false` to release the key so that a retry runs again.
    fn should_store(&self, outcome: &Outcome<'_>) -> bool;
}

impl<F> StorePolicy for F
where
    F: Fn(&Outcome<'_>) -> bool + Send + Sync + 'static,
{
    fn should_store(&self, outcome: &Outcome<'_>) -> bool {
        self(outcome)
    }
}

/// The default [`StorePolicy`]: store 2xx and final 4xx; release on 5xx, 408, 409, 425, 429 and
/// on transient gRPC statuses. See [`StorePolicy`].
#[derive(Debug, Clone, Copy, Default)]
pub struct DefaultStorePolicy;

/// gRPC codes after which a retry may succeed, so the key is released.
const GRPC_RELEASE: [GrpcCode; 7] = [
    GrpcCode::CANCELLED,
    GrpcCode::UNKNOWN,
    GrpcCode::DEADLINE_EXCEEDED,
    GrpcCode::RESOURCE_EXHAUSTED,
    GrpcCode::ABORTED,
    GrpcCode::INTERNAL,
    GrpcCode::UNAVAILABLE,
];

impl StorePolicy for DefaultStorePolicy {
    fn should_store(&self, outcome: &Outcome<'_>) -> bool {
        if outcome.grpc && outcome.status == StatusCode::OK {
            return match outcome.grpc_status() {
                Some(code) => !GRPC_RELEASE.contains(&code),
                None => false,
            };
        }
        let s = outcome.status;
        if s.is_success() {
            return true;
        }
        if s.is_client_error() {
            return !matches!(s.as_u16(), 408 | 409 | 425 | 429);
        }
        // 1xx never reach a service's final response; 3xx are final answers too.
        s.is_redirection()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn http(status: u16) -> bool {
        let h = HeaderMap::new();
        DefaultStorePolicy.should_store(&Outcome {
            status: StatusCode::from_u16(status).unwrap(),
            headers: &h,
            trailers: None,
            grpc: false,
        })
    }

    fn grpc(code: Option<&'static str>, in_trailers: bool) -> bool {
        let mut h = HeaderMap::new();
        let mut t = HeaderMap::new();
        if let Some(c) = code {
            let target = if in_trailers { &mut t } else { &mut h };
            target.insert("grpc-status", HeaderValue::from_static(c));
        }
        DefaultStorePolicy.should_store(&Outcome {
            status: StatusCode::OK,
            headers: &h,
            trailers: in_trailers.then_some(&t),
            grpc: true,
        })
    }

    #[test]
    fn success_and_final_client_errors_are_stored() {
        for s in [200, 201, 202, 204, 301, 400, 401, 403, 404, 410, 422] {
            assert!(http(s), "{s} should be stored");
        }
    }

    #[test]
    fn retryable_outcomes_release_the_key() {
        for s in [408, 409, 425, 429, 500, 502, 503, 504] {
            assert!(!http(s), "{s} should release");
        }
    }

    #[test]
    fn grpc_statuses_decide_for_grpc_calls() {
        for ok in ["0", "3", "5", "6", "7", "9", "11", "12", "16"] {
            assert!(grpc(Some(ok), true), "grpc {ok} should be stored");
            assert!(grpc(Some(ok), false), "trailers-only grpc {ok} should be stored");
        }
        for transient in ["1", "2", "4", "8", "10", "13", "14"] {
            assert!(!grpc(Some(transient), true), "grpc {transient} should release");
            assert!(!grpc(Some(transient), false), "trailers-only grpc {transient} should release");
        }
        assert!(!grpc(None, true), "a gRPC response without a status is broken");
        assert!(!grpc(Some("zero"), true));
    }

    #[test]
    fn closures_are_policies() {
        let never = |_: &Outcome<'_>| false;
        let h = HeaderMap::new();
        assert!(!never.should_store(&Outcome { status: StatusCode::OK, headers: &h, trailers: None, grpc: false }));
    }
}
