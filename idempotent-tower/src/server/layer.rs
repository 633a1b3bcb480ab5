use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderName, Method};
use idempotent_core::{FailMode, IntoSharedStore, OnInFlight, OnRecovered, Terms};
use tower::Layer;

use super::config::{Config, DEFAULT_KEY_HEADER, DEFAULT_MAX_REQUEST_BODY, DEFAULT_MAX_STORED_RESPONSE};
use super::policy::{DefaultStorePolicy, StorePolicy};
use super::service::Idempotency;

/// A [`Layer`] that makes requests carrying an `Idempotency-Key` run at most once and replays
/// their response to every retry. See the [module docs](super) for the behaviour.
///
/// Cloning is cheap: the configuration sits behind an [`Arc`].
#[derive(Clone)]
#[must_use = "a layer does nothing until it wraps a service"]
pub struct IdempotencyLayer {
    pub(crate) config: Arc<Config>,
}

impl fmt::Debug for IdempotencyLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.config;
        f.debug_struct("IdempotencyLayer")
            .field("store", &c.store.describe())
            .field("header", &c.header)
            .field("methods", &c.methods)
            .field("require_key", &c.require_key)
            .field("tenant", &c.tenant.is_some())
            .field("scope", &c.scope)
            .field("max_request_body", &c.max_request_body)
            .field("max_stored_response", &c.max_stored_response)
            .field("lease", &c.terms.lease)
            .field("retention", &c.terms.retention)
            .field("on_in_flight", &c.terms.on_in_flight)
            .field("fail_mode", &c.fail_mode)
            .field("on_recovered", &c.on_recovered)
            .field("on_replay", &c.on_replay.is_some())
            .finish_non_exhaustive()
    }
}

impl IdempotencyLayer {
    /// A layer over `store` with the defaults: header `Idempotency-Key`, methods POST and PATCH,
    /// key optional, no tenant, request bodies up to 2 MiB, responses stored up to 1 MiB, lease
    /// 60 s (renewed while the handler runs), retention 24 h, duplicates in flight rejected with
    /// 409, fail closed, and [`DefaultStorePolicy`].
    ///
    /// Two of these defaults are choices worth knowing. A covered request *without* a key passes
    /// through unprotected: a layer over a whole router or tonic server also covers routes and
    /// gRPC methods that have no use for a key (health checks, reflection), and refusing those
    /// by default would break them; set [`require_key(true)`](Self::require_key) on the routes
    /// that need keys. A duplicate in flight gets 409 at once, where the executor waits
    /// ([`OnInFlight`] says why): an HTTP client has its own retry policy.
    pub fn new(store: impl IntoSharedStore) -> Self {
        IdempotencyLayer {
            config: Arc::new(Config {
                store: store.into_shared(),
                header: DEFAULT_KEY_HEADER,
                methods: vec![Method::POST, Method::PATCH],
                require_key: false,
                tenant: None,
                scope: "http".to_owned(),
                max_request_body: DEFAULT_MAX_REQUEST_BODY,
                max_stored_response: DEFAULT_MAX_STORED_RESPONSE,
                terms: Terms::default().on_in_flight(OnInFlight::Reject),
                fail_mode: FailMode::Closed,
                on_recovered: OnRecovered::Run,
                policy: Arc::new(DefaultStorePolicy),
                on_replay: None,
            }),
        }
    }

    fn config(&mut self) -> &mut Config {
        Arc::make_mut(&mut self.config)
    }

    /// Reads the key from `name` instead of `Idempotency-Key` (for HTTP and gRPC alike).
    pub fn header_name(mut self, name: HeaderName) -> Self {
        self.config().header = name;
        self
    }

    /// The HTTP methods the layer covers (default POST and PATCH). Requests with other methods
    /// pass through untouched, key or not. gRPC calls are always covered (gRPC-Web requests are
    /// HTTP POSTs here; see the [module docs](super#grpc)).
    pub fn methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.config().methods = methods.into_iter().collect();
        self
    }

    /// Whether covered requests without a key are refused with 400 (gRPC: INVALID_ARGUMENT)
    /// instead of passing through unprotected. Default `false`. To require keys on some routes
    /// only, add a second layer with `require_key(true)` to those routes (for example with
    /// axum's `MethodRouter::layer`): a request that an outer `IdempotencyLayer` already took
    /// the key for passes through inner ones, so the two never compete for the key.
    ///
    /// For gRPC, `true` refuses *every* call without a key, health checks and read-only
    /// methods included: put such a layer on the services that need keys only (the
    /// [module docs](super#grpc) show how with tonic).
    pub fn require_key(mut self, required: bool) -> Self {
        self.config().require_key = required;
        self
    }

    /// Derives the tenant from the request, so that equal keys of two tenants never share a
    /// record: typically the authenticated principal, which an authentication layer *outside*
    /// this one put into the request extensions. Requests for which it returns `None` share one
    /// tenant-less scope.
    pub fn tenant<F>(mut self, extract: F) -> Self
    where
        F: Fn(&http::request::Parts) -> Option<String> + Send + Sync + 'static,
    {
        self.config().tenant = Some(Arc::new(extract));
        self
    }

    /// Separates this layer's keys from those of other services on the same store (default
    /// `"http"`). Two layers with the same scope and store share their keys.
    pub fn scope(mut self, scope: impl Into<String>) -> Self {
        self.config().scope = scope.into();
        self
    }

    /// The most request body bytes read for fingerprinting (default 2 MiB); above it the
    /// request is refused with 413 (gRPC: RESOURCE_EXHAUSTED) and the service is not called.
    pub fn max_request_body(mut self, bytes: usize) -> Self {
        self.config().max_request_body = bytes;
        self
    }

    /// The largest response body that is stored (default 1 MiB). A larger response is sent to
    /// the client as it streams, the key is released (so a retry runs again), and a warning is
    /// logged.
    pub fn max_stored_response(mut self, bytes: usize) -> Self {
        self.config().max_stored_response = bytes;
        self
    }

    /// How long a request holds its key without renewing it (default 60 s), within
    /// [`MIN_LEASE`](idempotent_core::MIN_LEASE) ..= [`MAX_LEASE`](idempotent_core::MAX_LEASE):
    /// out of bounds, every covered request is refused with 500 (gRPC: INTERNAL) and the
    /// configuration error logged, as the executor refuses such a step with `Error::Config`.
    ///
    /// The lease is renewed every third of it while the service runs, so it bounds how long a
    /// key stays blocked by a request that no longer runs: one whose server crashed, or one
    /// dropped before the service answered (the client went away and the server dropped the
    /// request's future; once the service has answered, the response is stored even if the
    /// client is gone). A retry in that window gets 409. When no renewal reaches the store for a
    /// whole lease, the request's lease counts as lost and the handler's
    /// [`Attempt`](idempotent_core::Attempt) says so; its response is still offered to the
    /// store, which takes it only if no other attempt took the key meanwhile. Otherwise it goes
    /// to the client marked `Idempotent-Stored: false`.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.config().terms.lease = lease;
        self
    }

    /// How long a stored response is replayed (default 24 h), within
    /// [`MIN_RETENTION`](idempotent_core::MIN_RETENTION) ..=
    /// [`MAX_RETENTION`](idempotent_core::MAX_RETENTION) (10 years): out of bounds, covered
    /// requests are refused as for [`lease`](Self::lease).
    pub fn retention(mut self, retention: Duration) -> Self {
        self.config().terms.retention = retention;
        self
    }

    /// What a duplicate does while the first request runs: [`OnInFlight::Reject`] (the
    /// default) answers 409 with `Retry-After` (1 s: the first request usually finishes long
    /// before its lease runs out, which is all the store can vouch for); [`OnInFlight::Wait`]
    /// polls the store until the
    /// first response is stored and returns it (or, if the first request released the key,
    /// runs the request itself), answering 409 after the timeout.
    pub fn on_in_flight(mut self, policy: OnInFlight) -> Self {
        self.config().terms.on_in_flight = policy;
        self
    }

    /// What a request does when the previous attempt under its key ended without a stored
    /// response (its server died or was cancelled mid-request, or storing its response failed),
    /// so that its effect may or may not have happened: [`OnRecovered::Run`] (the default) calls
    /// the service, whose handler sees [`Attempt::recovered`](crate::Attempt::recovered) and its
    /// [`downstream_key`](crate::Attempt::downstream_key) to check with; with
    /// [`OnRecovered::NeedsAttention`] the layer calls nothing, leaves the record waiting for an
    /// operator, and answers 409 `needs-attention` to this and every later request under the
    /// key until the record is resolved ([`Store::resolve`](idempotent_core::Store::resolve)).
    pub fn on_recovered(mut self, policy: OnRecovered) -> Self {
        self.config().on_recovered = policy;
        self
    }

    /// What happens when the store is unreachable: [`FailMode::Closed`] (the default) answers
    /// 503 with `Retry-After` without calling the service; [`FailMode::Open`] calls the service
    /// unprotected and logs a warning.
    pub fn fail_mode(mut self, mode: FailMode) -> Self {
        self.config().fail_mode = mode;
        self
    }

    /// Decides which responses are stored (default [`DefaultStorePolicy`]).
    pub fn store_policy(mut self, policy: impl StorePolicy) -> Self {
        self.config().policy = Arc::new(policy);
        self
    }

    /// Runs `hook` on every replayed response before it is sent: its status, its headers (the
    /// stored ones, with [`Idempotent-Replayed: true`](super::IDEMPOTENT_REPLAYED) already
    /// added) and its extensions, to add or change headers (an `Age`, a header of your own, a
    /// request id of this request rather than the first one's). The body and trailers are the
    /// stored ones. Only replays reach the hook: not a first response, not a refusal. The
    /// default is no hook.
    ///
    /// ```
    /// use axum::{Router, body::Body, http::Request, routing::post};
    /// use idempotent_core::MemoryStore;
    /// use idempotent_tower::server::IdempotencyLayer;
    /// use tower::ServiceExt;
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).on_replay(|parts: &mut http::response::Parts| {
    ///     parts.headers.insert("x-cache", http::HeaderValue::from_static("replay"));
    /// });
    /// let app = Router::new().route("/refunds", post(|| async { "re_1" })).layer(layer);
    /// let request = || Request::post("/refunds").header("idempotency-key", "k-1").body(Body::empty()).unwrap();
    /// assert!(app.clone().oneshot(request()).await.unwrap().headers().get("x-cache").is_none());
    /// assert_eq!(app.oneshot(request()).await.unwrap().headers()["x-cache"], "replay");
    /// # }
    /// ```
    pub fn on_replay<F>(mut self, hook: F) -> Self
    where
        F: Fn(&mut http::response::Parts) + Send + Sync + 'static,
    {
        self.config().on_replay = Some(Arc::new(hook));
        self
    }
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = Idempotency<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Idempotency { inner, config: self.config.clone() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use idempotent_core::MemoryStore;

    #[tokio::test]
    async fn durations_out_of_bounds_are_refused_and_never_reach_the_store() {
        use std::sync::atomic::{AtomicU32, Ordering};
        use tower::{ServiceExt, service_fn};
        let calls = Arc::new(AtomicU32::new(0));
        for (lease, retention) in [
            (Duration::MAX, Duration::from_secs(1)),
            (Duration::ZERO, Duration::from_secs(1)),
            (Duration::from_secs(1), Duration::MAX),
        ] {
            // `MemoryStore` adds the lease and retention to an `Instant`: `Duration::MAX` overflows.
            let layer = IdempotencyLayer::new(MemoryStore::new()).lease(lease).retention(retention);
            let counted = calls.clone();
            let svc = layer.layer(service_fn(move |_req: http::Request<_>| {
                counted.fetch_add(1, Ordering::SeqCst);
                async {
                    Ok::<_, std::convert::Infallible>(http::Response::new(http_body_util::Full::new(
                        bytes::Bytes::from("ok"),
                    )))
                }
            }));
            let req = http::Request::post("/x")
                .header("idempotency-key", "k")
                .body(http_body_util::Empty::<bytes::Bytes>::new())
                .unwrap();
            let res = svc.oneshot(req).await.unwrap();
            assert_eq!(res.status(), 500, "{lease:?} / {retention:?}");
            let body = http_body_util::BodyExt::collect(res.into_body()).await.unwrap().to_bytes();
            let doc: serde_json::Value = serde_json::from_slice(&body).unwrap();
            assert_eq!(doc["type"], "tag:idempotent-tower,2025:misconfigured");
            assert!(doc["detail"].as_str().unwrap().contains("out of range: use between"), "{doc}");
        }
        assert_eq!(calls.load(Ordering::SeqCst), 0, "a misconfigured layer called the service");
    }
}
