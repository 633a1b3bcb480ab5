//! Hedged requests under the key layer (feature `hedge`): [`HedgePolicy`] for tower's
//! `tower::hedge::Hedge`, and [`HedgeLayer`] to build one.
//!
//! A hedge sends a second copy of a request that has been outstanding longer than a latency
//! percentile and takes whichever answer comes first. For a `POST`, that is a duplicate on
//! purpose, and it is safe only because both copies carry the same `Idempotency-Key`: the
//! server layer runs the first copy to arrive and hands the other the same outcome.
//!
//! ```text
//! ServiceBuilder::new()
//!     .layer(IdempotencyKeyLayer::new())   // outside: both copies carry one key
//!     .layer(HedgeLayer::new())            // a copy after the p95 latency of the last 10 s
//!     .service(http_client)
//!
//! the first copy is slow before it reaches the layer (a queue, a slow connection, a GC pause):
//!   copy 2 (K) ──► runs the effect ──► answers: the caller gets this one
//!   copy 1 (K) ──► arrives late, finds K done ──► replays copy 2's response (dropped)
//!
//! the first copy is slow inside the handler (it holds K):
//!   copy 2 (K) ──► K in flight: waits for copy 1 (OnInFlight::Wait) ──► copy 1's response
//! ```
//!
//! The effect runs once either way; hedging only shortens the first case. A tail that lives
//! in the handler itself is not helped, since a copy can only wait for the attempt holding the
//! key (`BENCHMARKS.md` measures both).
//!
//! # Where hedging must not be used
//!
//! - **Requests without a key** (a `POST` or `PATCH` sent without `Idempotency-Key`):
//!   the copy would run the effect a second time. [`HedgePolicy`] never hedges them: only
//!   requests with a key, and the safe methods (`GET`, `HEAD`, `OPTIONS`, `TRACE`), are copied.
//!   A `PUT` or `DELETE` is idempotent by HTTP's definition, so a *retry* of one after it failed
//!   is harmless, but a hedge runs both copies at the same time, and a server whose `DELETE`
//!   refunds or notifies would do it twice: they are hedged only with a key. Put the key layer
//!   *outside* the hedge, or the hedge sees the request before it has a key and hedges nothing.
//! - **Servers that reject a key in flight instead of waiting** (the server layer's default,
//!   `OnInFlight::Reject`, or any server answering 409 to a duplicate): the copy's 409 comes
//!   back *first*, while the first copy still runs, and the hedge hands the caller that 409.
//!   Hedge only against a server layer with `.on_in_flight(OnInFlight::Wait { .. })`.
//! - Servers without an idempotency layer at all, for anything but idempotent methods.
//!
//! Hedging adds load (the share of requests above the percentile, e.g. 5% at p95, is sent
//! twice). tower's `Hedge` reads the latencies of the last *full* `period`, so it hedges nothing
//! in its first period, nor while that period holds fewer than `min_data_points`. It is not
//! `Clone`: share one (and its latency histogram) behind a `tower::buffer::Buffer`, as
//! `benches/src/bin/hedge_bench.rs` and the `agent_loop` example do.

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use http::{HeaderName, Request};
use tower::hedge::Hedge;
use tower::{BoxError, Layer, Service};

use crate::IDEMPOTENCY_KEY;
use crate::header::key_digest;

/// Whether HTTP defines `method` as safe (read-only): two copies running at once change nothing.
fn is_safe(method: &http::Method) -> bool {
    use http::Method;
    matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE)
}

/// A `tower::hedge::Policy` that copies a request only when a duplicate is harmless: its method
/// is safe by HTTP's definition, or it carries an idempotency key.
///
/// Clones share a count of the hedges sent ([`hedges`](Self::hedges)).
#[derive(Clone)]
pub struct HedgePolicy {
    key_header: HeaderName,
    hedges: Arc<AtomicU64>,
}

impl HedgePolicy {
    /// A policy that reads keys from [`IDEMPOTENCY_KEY`].
    pub fn new() -> Self {
        HedgePolicy { key_header: IDEMPOTENCY_KEY, hedges: Arc::default() }
    }

    /// The header that carries the idempotency key (default [`IDEMPOTENCY_KEY`]).
    pub fn key_header(mut self, header: HeaderName) -> Self {
        self.key_header = header;
        self
    }

    /// How many hedges (second copies) this policy and its clones have sent.
    pub fn hedges(&self) -> u64 {
        self.hedges.load(Ordering::Relaxed)
    }
}

impl Default for HedgePolicy {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for HedgePolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HedgePolicy").field("key_header", &self.key_header).field("hedges", &self.hedges()).finish()
    }
}

impl<B: Clone> tower::hedge::Policy<Request<B>> for HedgePolicy {
    fn clone_request(&self, request: &Request<B>) -> Option<Request<B>> {
        if is_safe(request.method()) || request.headers().contains_key(&self.key_header) {
            return Some(request.clone());
        }
        tracing::debug!(method = %request.method(), "idempotent.hedge_disabled: a non-idempotent request without an idempotency key is never hedged");
        None
    }

    fn can_retry(&self, request: &Request<B>) -> bool {
        self.hedges.fetch_add(1, Ordering::Relaxed);
        let key = request.headers().get(&self.key_header).map_or_else(|| "-".to_owned(), key_digest);
        tracing::debug!(method = %request.method(), %key, "idempotent.hedge: the request is slow; sending a copy with the same key");
        true
    }
}

/// Builds tower's [`Hedge`] with a [`HedgePolicy`]: a copy of a slow request after the
/// `percentile` latency of the last `period`, once `min_data_points` latencies are known.
///
/// `B` is the request body type (inferred from the service it wraps). Defaults: p95, 10 s,
/// 100 data points.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// use std::time::Duration;
///
/// use bytes::Bytes;
/// use http::{Request, Response};
/// use http_body_util::Full;
/// use idempotent_tower::IdempotencyKeyLayer;
/// use idempotent_tower::client::hedge::HedgeLayer;
/// use tower::{ServiceBuilder, ServiceExt, service_fn};
///
/// let http_client = service_fn(|_: Request<Full<Bytes>>| async { Ok::<_, std::io::Error>(Response::new(())) });
/// let hedge = HedgeLayer::new().percentile(0.9).period(Duration::from_secs(30));
/// let policy = hedge.shared_policy().clone(); // shares the count of hedges sent
/// let client = ServiceBuilder::new()
///     .layer(IdempotencyKeyLayer::new()) // outside: both copies carry one key
///     .layer(hedge)
///     .service(http_client);
/// client.oneshot(Request::post("http://api.example/refunds").body(Full::default()).unwrap()).await.unwrap();
/// assert_eq!(policy.hedges(), 0, "no latencies known yet: nothing is hedged");
/// # }
/// ```
pub struct HedgeLayer<B = ()> {
    policy: HedgePolicy,
    percentile: f32,
    period: Duration,
    min_data_points: u64,
    body: PhantomData<fn(B)>,
}

impl<B> HedgeLayer<B> {
    /// A layer with the defaults (p95 of the last 10 s, after 100 data points).
    pub fn new() -> Self {
        HedgeLayer {
            policy: HedgePolicy::new(),
            percentile: 0.95,
            period: Duration::from_secs(10),
            min_data_points: 100,
            body: PhantomData,
        }
    }

    /// The latency percentile after which a copy is sent, in `0.0..=1.0` (default 0.95). A
    /// value outside it is taken as the nearest bound, and NaN as the default.
    pub fn percentile(mut self, percentile: f32) -> Self {
        self.percentile = if percentile.is_nan() { 0.95 } else { percentile.clamp(0.0, 1.0) };
        self
    }

    /// The window the latencies are taken from (default 10 s; tower keeps two and rotates).
    pub fn period(mut self, period: Duration) -> Self {
        self.period = period;
        self
    }

    /// The latencies needed before anything is hedged (default 100).
    pub fn min_data_points(mut self, points: u64) -> Self {
        self.min_data_points = points;
        self
    }

    /// The policy (replacing the key header, say); see [`HedgePolicy`].
    pub fn policy(mut self, policy: HedgePolicy) -> Self {
        self.policy = policy;
        self
    }

    /// The policy every service this layer makes shares: its [`hedges`](HedgePolicy::hedges)
    /// counts theirs.
    pub fn shared_policy(&self) -> &HedgePolicy {
        &self.policy
    }
}

impl<B> Default for HedgeLayer<B> {
    fn default() -> Self {
        Self::new()
    }
}

impl<B> Clone for HedgeLayer<B> {
    fn clone(&self) -> Self {
        HedgeLayer { policy: self.policy.clone(), body: PhantomData, ..*self }
    }
}

impl<B> fmt::Debug for HedgeLayer<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HedgeLayer")
            .field("policy", &self.policy)
            .field("percentile", &self.percentile)
            .field("period", &self.period)
            .field("min_data_points", &self.min_data_points)
            .finish()
    }
}

impl<S, B> Layer<S> for HedgeLayer<B>
where
    S: Service<Request<B>> + Clone,
    S::Error: Into<BoxError>,
    B: Clone,
{
    type Service = Hedge<S, HedgePolicy>;

    fn layer(&self, inner: S) -> Self::Service {
        Hedge::new::<Request<B>>(inner, self.policy.clone(), self.min_data_points, self.percentile, self.period)
    }
}

#[cfg(test)]
mod tests {
    use http::{Method, Request};
    use tower::hedge::Policy;

    use super::HedgePolicy;

    #[test]
    fn only_safe_methods_and_keyed_requests_are_copied() {
        let policy = HedgePolicy::new();
        let custom = HedgePolicy::new().key_header(http::HeaderName::from_static("x-request-key"));
        let request = |method: Method, header: Option<&str>| {
            let mut builder = Request::builder().method(method).uri("http://api.example/refunds");
            if let Some(name) = header {
                builder = builder.header(name, "k-1");
            }
            builder.body(()).unwrap()
        };
        for method in [Method::GET, Method::HEAD, Method::OPTIONS, Method::TRACE] {
            assert!(policy.clone_request(&request(method.clone(), None)).is_some(), "{method} is safe to copy");
        }
        for method in [Method::POST, Method::PATCH, Method::PUT, Method::DELETE] {
            assert!(policy.clone_request(&request(method.clone(), None)).is_none(), "{method} without a key");
            assert!(
                policy.clone_request(&request(method.clone(), Some("idempotency-key"))).is_some(),
                "{method} with a key"
            );
            assert!(
                custom.clone_request(&request(method.clone(), Some("idempotency-key"))).is_none(),
                "{method}: another header"
            );
            assert!(
                custom.clone_request(&request(method.clone(), Some("x-request-key"))).is_some(),
                "{method}: its header"
            );
        }
        assert_eq!(policy.hedges(), 0, "copying is not hedging: can_retry counts");
    }

    #[test]
    fn a_percentile_out_of_range_is_taken_as_its_bound() {
        let shown = |p: f32| format!("{:?}", super::HedgeLayer::<()>::new().percentile(p));
        assert!(shown(f32::NAN).contains("percentile: 0.95"), "{}", shown(f32::NAN));
        assert!(shown(1.5).contains("percentile: 1.0"), "{}", shown(1.5));
        assert!(shown(-2.0).contains("percentile: 0.0"), "{}", shown(-2.0));
        assert!(shown(0.5).contains("percentile: 0.5"), "{}", shown(0.5));
    }
}
