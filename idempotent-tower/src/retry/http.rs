//! [`HttpRetryPolicy`]: the retry decision for HTTP responses, by status and request method.

use std::fmt;
use std::sync::Arc;
use std::time::SystemTime;

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
fn is_idempotent(method: &Method) -> bool {
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

impl<B, ResB, E, C> Policy<Request<B>, Response<ResB>, E> for HttpRetryPolicy<C>
where
    B: Clone,
    C: ClassifyError<E>,
{
    type Future = tokio::time::Sleep;

    fn retry(&mut self, request: &mut Request<B>, result: &mut Result<Response<ResB>, E>) -> Option<Self::Future> {
        self.common.decide(request.headers(), result, &*self.classify, |response, _, _| {
            let reason = classify_status(response.status(), response.headers())?;
            Some((reason, retry_after(response.headers(), SystemTime::now())))
        })
    }

    fn clone_request(&mut self, request: &Request<B>) -> Option<Request<B>> {
        let needs_key = !is_idempotent(request.method());
        self.common.admit(request.method(), request.headers(), needs_key).then(|| request.clone())
    }
}
