//! Retry policies for tower's `Retry` that know which failures are safe to retry.
//!
//! ```
//! use std::sync::Arc;
//! use std::sync::atomic::{AtomicU32, Ordering};
//! use std::time::Duration;
//!
//! use bytes::Bytes;
//! use http::{Request, Response, StatusCode};
//! use http_body_util::Full;
//! use idempotent_tower::retry::{Backoff, HttpRetryPolicy};
//! use tower::retry::RetryLayer;
//! use tower::{ServiceBuilder, ServiceExt, service_fn};
//!
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() {
//! // A server that is overloaded for the first two attempts.
//! let calls = Arc::new(AtomicU32::new(0));
//! let api = service_fn({
//!     let calls = calls.clone();
//!     move |_request: Request<Full<Bytes>>| {
//!         let status = match calls.fetch_add(1, Ordering::SeqCst) {
//!             0 | 1 => StatusCode::SERVICE_UNAVAILABLE,
//!             _ => StatusCode::OK,
//!         };
//!         std::future::ready(Ok::<_, std::convert::Infallible>(Response::builder().status(status).body(()).unwrap()))
//!     }
//! });
//!
//! let policy = HttpRetryPolicy::new()
//!     .backoff(Backoff::new(Duration::from_millis(50), Duration::from_secs(2)).max_attempts(5));
//! let client = ServiceBuilder::new().layer(RetryLayer::new(policy)).service(api);
//!
//! let request = Request::get("https://api.example/orders/7").body(Full::default()).unwrap();
//! let response = client.oneshot(request).await.unwrap();
//! assert_eq!(response.status(), StatusCode::OK);
//! assert_eq!(calls.load(Ordering::SeqCst), 3);
//! # }
//! ```
//!
//! [`HttpRetryPolicy`] judges `http::Response`s by their status; [`GrpcRetryPolicy`] judges gRPC
//! calls by their `grpc-status`. Both share [`Backoff`], the retry budget and the rules below.
//!
//! # What is retried
//!
//! | outcome | retried? | why |
//! |---|---|---|
//! | an error from the inner service (connection refused or reset, a dropped reply, a tower `Timeout`) | yes | no answer arrived; the request may or may not have been processed |
//! | 408, 425, 429, 500, 502, 503, 504 | yes | the server, or something in front of it, says "not now" |
//! | 409 with `Retry-After` | yes | the server layer's "the same key is still running" (problem type `tag:idempotent-tower,2025:key-in-use`, always with `Retry-After`): a retry gets that attempt's outcome once it finishes |
//! | 400, 401, 403, 404, 409 without `Retry-After`, 413, 422, every other status | no | the same request gets the same answer |
//! | gRPC `UNAVAILABLE`, `ABORTED` (the server layer's "in flight"), `RESOURCE_EXHAUSTED` | yes | the gRPC equivalents of 503, 409-in-flight and 429; see [`GrpcRetryPolicy::retry_codes`] |
//!
//! [`HttpRetryPolicy::classify_errors`] narrows which errors count as transient.
//!
//! **Non-idempotent requests are retried only when they carry an idempotency key.** A `POST`
//! whose reply was lost may have charged the card; sending it again is only harmless when the
//! server can recognise it as the same request, which is what the `Idempotency-Key` header is
//! for (stamp it with [`IdempotencyKeyLayer`](crate::client::IdempotencyKeyLayer), *outside* the
//! retry layer). `GET`, `HEAD`, `OPTIONS`, `TRACE`, `PUT` and `DELETE` are idempotent by HTTP's
//! definition and are retried with or without a key; every other method, and every gRPC call
//! (all gRPC calls are `POST`s), needs the key.
//!
//! # How long to wait
//!
//! Between attempts the policy sleeps for a *full-jitter* exponential backoff: a delay drawn
//! uniformly from `0..=min(cap, base × 2^retry)`. Without the jitter, every client that failed
//! together retries together and the overloaded server sees the same spike again; full jitter
//! spreads them over the whole window. When the response says how long to wait — `Retry-After`
//! as delta-seconds or as an HTTP-date, or gRPC's `grpc-retry-pushback-ms` — the policy waits
//! that long instead, plus a small jitter: up to a tenth of the wait, at least 50 ms and at
//! most 250 ms (so up to 100 ms on top of `Retry-After: 1`). A server answers every client of a
//! spike with the same `Retry-After`, and without the jitter they would all come back in the
//! same instant. A wait longer than [`max_retry_after`](HttpRetryPolicy::max_retry_after) is not
//! honoured: the policy gives up and returns that response, since the caller is usually better
//! placed to decide about a long wait.
//!
//! # Why a budget as well as a maximum number of attempts
//!
//! [`Backoff::max_attempts`] bounds one request. It does not bound the load retries add when the
//! server is down for everyone: with 4 attempts, an outage quadruples the traffic it gets. A
//! retry budget (tower's [`TpsBudget`]: each request deposits, each retry withdraws) caps retries
//! at a fraction of recent requests plus a small reserve, so a healthy client retries freely and
//! a client facing an outage quickly stops adding to it. The default is
//! `TpsBudget::default()` (20% of the last 10 s, at least 10 retries per second); clones of a
//! policy share one budget.
//!
//! # Bodies
//!
//! tower's `Retry` sends a copy of the request on each retry, so the policy needs a request body
//! it can copy: the policies are `Policy<http::Request<B>, …>` for `B: Clone`. That includes
//! `http_body_util::Full<Bytes>` (the usual choice), `Empty<Bytes>`, `String`, `Bytes` and `()`.
//! Streaming bodies (`hyper::body::Incoming`, `axum::body::Body`, `tonic::body::Body`,
//! `BoxBody`) are not `Clone`: collect them into a `Full<Bytes>` above the retry layer, and, if
//! the inner client wants its own body type, map the `Full` back with `map_request` below it.
//!
//! # Observability
//!
//! `tracing` events, with the hashed key (the first 12 hex digits of its sha256, never the key
//! itself): `idempotent.retry` (debug; the attempt about to be made, the delay and the reason),
//! `idempotent.give_up` (warn; attempts exhausted, budget exhausted, `Retry-After` too long, or a
//! permanent error), and `idempotent.retry_disabled` (debug; a non-idempotent request without a
//! key, which is never retried).

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

// `::http`, the crate, not the `http` module below.
use ::http::{HeaderMap, HeaderValue, Method, StatusCode};

pub use crate::GrpcCode;
pub use idempotent_core::Backoff;
// tower's retry budgets, re-exported so that tuning a policy's budget needs no `tower` import.
pub use tower::retry::budget::{Budget, TpsBudget};

use crate::IDEMPOTENCY_KEY;
use crate::header::key_digest;

mod grpc;
mod http;

pub use grpc::GrpcRetryPolicy;
pub use http::HttpRetryPolicy;

/// Decides whether an error from the inner service is worth a retry.
///
/// Implemented by [`AllErrorsTransient`] (the default) and by every `Fn(&E) -> bool`.
pub trait ClassifyError<E> {
    /// `true` when a retry may succeed (connection refused or reset, a timeout, a lost reply).
    fn is_transient(&self, error: &E) -> bool;
}

/// Treats every error as transient: an error means no response arrived, whatever the cause.
#[derive(Debug, Clone, Copy, Default)]
pub struct AllErrorsTransient;

impl<E> ClassifyError<E> for AllErrorsTransient {
    fn is_transient(&self, _error: &E) -> bool {
        true
    }
}

impl<E, F> ClassifyError<E> for F
where
    F: Fn(&E) -> bool,
{
    fn is_transient(&self, error: &E) -> bool {
        self(error)
    }
}

/// Why an attempt is retried (for the logs).
#[derive(Debug, Clone, Copy)]
enum Reason {
    Error,
    Status(StatusCode),
    InFlight,
    Grpc(GrpcCode),
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Reason::Error => f.write_str("error"),
            Reason::Status(status) => write!(f, "status {}", status.as_u16()),
            Reason::InFlight => f.write_str("in flight (409)"),
            Reason::Grpc(code) => write!(f, "grpc-status {}", code.get()),
        }
    }
}

/// The state both policies share: configuration, the budget and jitter source (shared by all
/// clones), and the number of retries made for the current request.
#[derive(Clone)]
struct Common {
    backoff: Backoff,
    budget: Arc<dyn Budget + Send + Sync>,
    max_retry_after: Duration,
    key_header: ::http::HeaderName,
    rng: Arc<Mutex<fastrand::Rng>>,
    /// Retries already made for this request. `Retry` keeps the configured policy and clones it
    /// per request; only the clone's counter ever moves (in `retry`), so the configured policy
    /// always reads 0 and `clone_request` can tell a first attempt from a retry.
    retries: u32,
}

impl fmt::Debug for Common {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryPolicy")
            .field("backoff", &self.backoff)
            .field("max_retry_after", &self.max_retry_after)
            .field("key_header", &self.key_header)
            .field("retries", &self.retries)
            .finish_non_exhaustive()
    }
}

impl Common {
    fn new() -> Self {
        Common {
            backoff: Backoff::default(),
            budget: Arc::new(TpsBudget::default()),
            max_retry_after: Duration::from_secs(60),
            key_header: IDEMPOTENCY_KEY,
            rng: Arc::new(Mutex::new(fastrand::Rng::new())),
            retries: 0,
        }
    }

    /// Called from `clone_request`: counts first attempts into the budget and tells whether the
    /// request may be retried at all.
    fn admit(&self, method: &Method, headers: &HeaderMap, needs_key: bool) -> bool {
        if self.retries == 0 {
            self.budget.deposit();
        }
        if needs_key && !headers.contains_key(&self.key_header) {
            if self.retries == 0 {
                tracing::debug!(%method, "idempotent.retry_disabled: a non-idempotent request without an idempotency key is never retried");
            }
            return false;
        }
        true
    }

    /// Decides on a retry the classification allowed; `Some(sleep)` means retry after it.
    fn next(
        &mut self,
        reason: Reason,
        wait: Option<Duration>,
        key: Option<&HeaderValue>,
    ) -> Option<tokio::time::Sleep> {
        let attempt = self.retries + 1;
        let key = logged_key(key);
        if attempt >= self.backoff.attempts() {
            tracing::warn!(attempt, %reason, %key, "idempotent.give_up: attempts exhausted");
            return None;
        }
        if let Some(wait) = wait
            && wait > self.max_retry_after
        {
            tracing::warn!(attempt, %reason, %key, retry_after_ms = wait.as_millis() as u64, max_ms = self.max_retry_after.as_millis() as u64, "idempotent.give_up: the server asked to wait longer than max_retry_after");
            return None;
        }
        if !self.budget.withdraw() {
            tracing::warn!(attempt, %reason, %key, "idempotent.give_up: retry budget exhausted");
            return None;
        }
        let delay = {
            let mut rng = self.rng.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            match wait {
                Some(wait) => wait.saturating_add(Backoff::hint_jitter(wait, rng.u64(..))),
                None => self.backoff.delay(self.retries, rng.u64(..)),
            }
        };
        self.retries += 1;
        tracing::debug!(attempt = attempt + 1, delay_ms = delay.as_millis() as u64, %reason, %key, "idempotent.retry");
        Some(tokio::time::sleep(delay))
    }

    fn give_up_permanent(&self, key: Option<&HeaderValue>) {
        let key = logged_key(key);
        tracing::debug!(attempt = self.retries + 1, %key, "idempotent.give_up: permanent error");
    }

    /// The retry decision both policies make (`Policy::retry`): an error is retried when
    /// `errors` calls it transient; a response when the protocol's `classify` gives a reason to
    /// (and the wait the server asked for, if any). [`next`](Self::next) then applies the
    /// attempt count, the budget, the longest wait honoured and the backoff.
    ///
    /// `classify` also gets the policy's state and the request's key, for its own logs.
    ///
    /// `R` is the client's response type: `http::Response<_>` for the tower policies, the
    /// status and headers of a `reqwest::Response` for the reqwest middleware.
    fn decide<R, E>(
        &mut self,
        request: &HeaderMap,
        result: Result<&R, &E>,
        errors: &(impl ClassifyError<E> + ?Sized),
        classify: impl FnOnce(&R, &Common, Option<&HeaderValue>) -> Option<(Reason, Option<Duration>)>,
    ) -> Option<tokio::time::Sleep> {
        let key = request.get(&self.key_header);
        let (reason, wait) = match result {
            Ok(response) => classify(response, self, key)?,
            Err(error) => {
                if !errors.is_transient(error) {
                    self.give_up_permanent(key);
                    return None;
                }
                (Reason::Error, None)
            }
        };
        self.next(reason, wait, key)
    }
}

/// Setters both policies share. Paths are spelled in full so that the expansion needs no import
/// in the policy's own file.
macro_rules! common_setters {
    () => {
        /// The backoff between attempts and the number of attempts (default:
        /// [`Backoff::default`](crate::retry::Backoff::default)).
        pub fn backoff(mut self, backoff: $crate::retry::Backoff) -> Self {
            self.common.backoff = backoff;
            self
        }

        /// The retry budget shared by every clone of this policy (default
        /// [`TpsBudget::default`](tower::retry::budget::TpsBudget::default): 20% of the last
        /// 10 s of requests, at least 10 retries a second). Any tower
        /// [`Budget`](tower::retry::budget::Budget) fits.
        pub fn budget<Bu>(mut self, budget: Bu) -> Self
        where
            Bu: ::tower::retry::budget::Budget + Send + Sync + 'static,
        {
            self.common.budget = ::std::sync::Arc::new(budget);
            self
        }

        /// The longest server-requested wait (`Retry-After`, gRPC pushback) honoured; a response
        /// asking for more is returned to the caller instead of retried (default 60 s).
        pub fn max_retry_after(mut self, max: ::std::time::Duration) -> Self {
            self.common.max_retry_after = max;
            self
        }

        /// The header that carries the idempotency key (default
        /// [`IDEMPOTENCY_KEY`](crate::IDEMPOTENCY_KEY)).
        pub fn key_header(mut self, header: ::http::HeaderName) -> Self {
            self.common.key_header = header;
            self
        }

        /// Seeds the jitter (of the backoff and of server-requested waits), so that delays are
        /// reproducible (tests). Unseeded by default.
        pub fn jitter_seed(mut self, seed: u64) -> Self {
            self.common.rng = ::std::sync::Arc::new(::std::sync::Mutex::new(::fastrand::Rng::with_seed(seed)));
            self
        }
    };
}
use common_setters;

/// The key as the logs show it: its digest, or `-` for a request without one.
fn logged_key(key: Option<&HeaderValue>) -> String {
    key.map_or_else(|| "-".to_owned(), key_digest)
}

/// Parses `Retry-After` (delta-seconds or an HTTP-date) relative to `now`. A date in the past
/// means "now". Anything else is ignored (the backoff applies).
fn retry_after(headers: &HeaderMap, now: SystemTime) -> Option<Duration> {
    let value = headers.get(::http::header::RETRY_AFTER)?.to_str().ok()?.trim();
    if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) {
        return Some(Duration::from_secs(value.parse().unwrap_or(u64::MAX)));
    }
    let date = httpdate::parse_http_date(value).ok()?;
    Some(date.duration_since(now).unwrap_or(Duration::ZERO))
}

#[cfg(test)]
mod tests;
