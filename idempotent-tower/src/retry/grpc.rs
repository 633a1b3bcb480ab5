//! [`GrpcRetryPolicy`]: the retry decision for gRPC calls, by `grpc-status` and pushback.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use http::{HeaderMap, Request, Response, StatusCode};
use tower::retry::Policy;

use super::{AllErrorsTransient, ClassifyError, Common, Reason, common_setters, logged_key, retry_after};
use crate::GrpcCode;

/// A `tower::retry::Policy` for gRPC calls over `http::Request<B>` → `http::Response<_>`.
///
/// The call's status is read from the response headers: a refusal (from the server layer or
/// anything else) is a *trailers-only* response, whose `grpc-status` arrives with the headers.
/// A response whose status only comes in the trailers is a call that ran and streamed a body;
/// it is never retried. A non-200 HTTP status (a proxy's 503) counts as gRPC specifies
/// (429/502/503/504 as `UNAVAILABLE`). `grpc-retry-pushback-ms` is honoured (a negative or
/// malformed value means "do not retry"), else `Retry-After`, else the backoff.
///
/// Every gRPC call is a `POST`, so every call needs an `idempotency-key` to be retried: stamp
/// one with [`IdempotencyKeyLayer`](crate::client::IdempotencyKeyLayer) outside the retry layer.
///
/// ```
/// use std::time::Duration;
/// use idempotent_tower::retry::{Backoff, GrpcCode, GrpcRetryPolicy};
///
/// let policy = GrpcRetryPolicy::new()
///     .retry_codes([GrpcCode::UNAVAILABLE, GrpcCode::ABORTED])
///     .backoff(Backoff::new(Duration::from_millis(20), Duration::from_secs(1)));
/// # let _ = policy;
/// ```
pub struct GrpcRetryPolicy<C = AllErrorsTransient> {
    common: Common,
    codes: Arc<[GrpcCode]>,
    classify: Arc<C>,
}

impl GrpcRetryPolicy {
    /// A policy with the defaults of [`HttpRetryPolicy::new`](super::HttpRetryPolicy::new), retrying `UNAVAILABLE`,
    /// `ABORTED` and `RESOURCE_EXHAUSTED`.
    pub fn new() -> Self {
        GrpcRetryPolicy {
            common: Common::new(),
            codes: Arc::from([GrpcCode::UNAVAILABLE, GrpcCode::ABORTED, GrpcCode::RESOURCE_EXHAUSTED]),
            classify: Arc::new(AllErrorsTransient),
        }
    }
}

impl Default for GrpcRetryPolicy {
    fn default() -> Self {
        Self::new()
    }
}

impl<C> GrpcRetryPolicy<C> {
    common_setters!();

    /// The status codes worth a retry (default `UNAVAILABLE`, `ABORTED`, `RESOURCE_EXHAUSTED`).
    /// `DEADLINE_EXCEEDED` is not among them by default: the caller's deadline is spent.
    pub fn retry_codes(mut self, codes: impl IntoIterator<Item = GrpcCode>) -> Self {
        self.codes = codes.into_iter().collect();
        self
    }

    /// Retries only the errors `classify` calls transient; see
    /// [`HttpRetryPolicy::classify_errors`](super::HttpRetryPolicy::classify_errors).
    pub fn classify_errors<C2>(self, classify: C2) -> GrpcRetryPolicy<C2> {
        GrpcRetryPolicy { common: self.common, codes: self.codes, classify: Arc::new(classify) }
    }
}

impl<C> Clone for GrpcRetryPolicy<C> {
    fn clone(&self) -> Self {
        GrpcRetryPolicy { common: self.common.clone(), codes: self.codes.clone(), classify: self.classify.clone() }
    }
}

impl<C> fmt::Debug for GrpcRetryPolicy<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GrpcRetryPolicy").field("common", &self.common).field("codes", &self.codes).finish()
    }
}

/// The call's status, when the response headers already carry it.
fn status_in_headers(response_status: StatusCode, headers: &HeaderMap) -> Option<GrpcCode> {
    if response_status != StatusCode::OK {
        return Some(GrpcCode::from_http(response_status));
    }
    let code = headers.get("grpc-status")?.to_str().ok()?.trim().parse().ok()?;
    Some(GrpcCode::new(code))
}

/// What the server asked for: `Err(())` for "do not retry", `Ok(None)` for "no opinion".
fn grpc_pushback(headers: &HeaderMap) -> Result<Option<Duration>, ()> {
    match headers.get("grpc-retry-pushback-ms") {
        Some(value) => {
            let ms: i64 = value.to_str().map_err(|_| ())?.trim().parse().map_err(|_| ())?;
            u64::try_from(ms).map(|ms| Some(Duration::from_millis(ms))).map_err(|_| ())
        }
        None => Ok(retry_after(headers, SystemTime::now())),
    }
}

impl<B, ResB, E, C> Policy<Request<B>, Response<ResB>, E> for GrpcRetryPolicy<C>
where
    B: Clone,
    C: ClassifyError<E>,
{
    type Future = tokio::time::Sleep;

    fn retry(&mut self, request: &mut Request<B>, result: &mut Result<Response<ResB>, E>) -> Option<Self::Future> {
        let codes = &self.codes;
        self.common.decide(request.headers(), result.as_ref(), &*self.classify, |response, common, key| {
            let code = status_in_headers(response.status(), response.headers())?;
            if !codes.contains(&code) {
                return None;
            }
            let Ok(wait) = grpc_pushback(response.headers()) else {
                tracing::debug!(
                    attempt = common.retries + 1,
                    key = %logged_key(key),
                    "idempotent.give_up: the server's pushback says not to retry"
                );
                return None;
            };
            Some((Reason::Grpc(code), wait))
        })
    }

    fn clone_request(&mut self, request: &Request<B>) -> Option<Request<B>> {
        self.common.admit(request.method(), request.headers(), true).then(|| request.clone())
    }
}
