//! [`HttpRetryPolicy`]: the retry decision for HTTP responses, by status and request method.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use http::{HeaderMap, Method, Request, Response, StatusCode};
use tower::retry::Policy;

use super::{AllErrorsTransient, ClassifyError, Common, Reason, common_setters, retry_after};

/// A `tower::retry::Policy` for `http::Request<B>` → `http::Response<_>`; see the
/// [module docs](super) for what it retries and how long it waits.
///
/// `C` classifies errors of the inner service (default: all of them are transient).
pub struct HttpRetryPolicy<C = AllErrorsTransient> {
    common: Common,
    classify: Arc<C>,
}

impl HttpRetryPolicy {
    /// A policy with the defaults: [`Backoff::default`](super::Backoff::default), `TpsBudget::default()`, `Retry-After`
    /// honoured up to 60 s, keys in `idempotency-key`.
    pub fn new() -> Self {
        HttpRetryPolicy { common: Common::new(), classify: Arc::new(AllErrorsTransient) }
    }
}

impl Default for HttpRetryPolicy {
    fn default() -> Self {
        Self::new()
    }
}

impl<C> HttpRetryPolicy<C> {
    common_setters!();

    /// Retries only the errors `classify` calls transient: any [`ClassifyError`], such as a
    /// `Fn(&E) -> bool` over the inner service's error type.
    pub fn classify_errors<C2>(self, classify: C2) -> HttpRetryPolicy<C2> {
        HttpRetryPolicy { common: self.common, classify: Arc::new(classify) }
    }
}

impl<C> Clone for HttpRetryPolicy<C> {
    fn clone(&self) -> Self {
        HttpRetryPolicy { common: self.common.clone(), classify: self.classify.clone() }
    }
}

impl<C> fmt::Debug for HttpRetryPolicy<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("HttpRetryPolicy").field(&self.common).finish()
    }
}

/// `GET`, `HEAD`, `OPTIONS`, `TRACE`, `PUT`, `DELETE` (RFC 9110 §9.2.2).
pub(crate) fn is_idempotent(method: &Method) -> bool {
    matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE | Method::PUT | Method::DELETE)
}

/// Why an HTTP response is worth a retry, if it is.
fn classify_status(status: StatusCode, headers: &HeaderMap) -> Option<Reason> {
    match status.as_u16() {
        408 | 425 | 429 | 500 | 502 | 503 | 504 => Some(Reason::Status(status)),
        // The server layer's "same key still running" carries Retry-After; a 409 without it is
        // an ordinary conflict that a retry would only repeat.
        409 if headers.contains_key(http::header::RETRY_AFTER) => Some(Reason::InFlight),
        _ => None,
    }
}

/// The HTTP rules for one response: why it is worth a retry, and the wait the server asked for.
fn judge(status: StatusCode, headers: &HeaderMap) -> Option<(Reason, Option<Duration>)> {
    let reason = classify_status(status, headers)?;
    Some((reason, retry_after(headers, SystemTime::now())))
}

impl<B, ResB, E, C> Policy<Request<B>, Response<ResB>, E> for HttpRetryPolicy<C>
where
    B: Clone,
    C: ClassifyError<E>,
{
    type Future = tokio::time::Sleep;

    fn retry(&mut self, request: &mut Request<B>, result: &mut Result<Response<ResB>, E>) -> Option<Self::Future> {
        self.common.decide(request.headers(), result.as_ref(), &*self.classify, |response, _, _| {
            judge(response.status(), response.headers())
        })
    }

    fn clone_request(&mut self, request: &Request<B>) -> Option<Request<B>> {
        let needs_key = !is_idempotent(request.method());
        self.common.admit(request.method(), request.headers(), needs_key).then(|| request.clone())
    }
}

/// One logical request's retries under an [`HttpRetryPolicy`], for a client that is not a tower
/// service (the reqwest middleware): the same rules, budget and backoff as the tower `Policy`,
/// driven by the client's own loop.
#[cfg(feature = "reqwest")]
pub(crate) struct HttpRetries<'p, C> {
    common: Common,
    classify: &'p C,
}

#[cfg(feature = "reqwest")]
impl<C> HttpRetryPolicy<C> {
    /// Starts a logical request; `None` when it may never be retried (a non-idempotent method
    /// without a key). Counts the request into the budget either way, as `clone_request` does.
    pub(crate) fn start(&self, method: &Method, headers: &HeaderMap) -> Option<HttpRetries<'_, C>> {
        let mut common = self.common.clone();
        common.retries = 0;
        common.admit(method, headers, !is_idempotent(method)).then(|| HttpRetries { common, classify: &*self.classify })
    }
}

#[cfg(feature = "reqwest")]
impl<C> HttpRetries<'_, C> {
    /// After an attempt: `Some(sleep)` to retry after it, `None` to return this outcome.
    /// `result` is the response's status and headers, or the client's error.
    pub(crate) fn after<E>(
        &mut self,
        request: &HeaderMap,
        result: Result<(StatusCode, &HeaderMap), &E>,
    ) -> Option<tokio::time::Sleep>
    where
        C: ClassifyError<E>,
    {
        self.common.decide(request, result.as_ref().map_err(|e| *e), self.classify, |(status, headers), _, _| {
            judge(*status, headers)
        })
    }
}
