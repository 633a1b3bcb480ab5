use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderName, Method};
use idempotent_core::{DEFAULT_LEASE, DEFAULT_TTL, FailMode, IntoSharedStore, OnInFlight, SharedStore};
use tower::Layer;

use super::policy::{DefaultStorePolicy, StorePolicy};
use super::service::Idempotency;

/// The default key header, `Idempotency-Key`.
pub const DEFAULT_KEY_HEADER: HeaderName = HeaderName::from_static("idempotency-key");
/// The default cap on a request body read for fingerprinting: 2 MiB (axum's default body limit).
pub const DEFAULT_MAX_REQUEST_BODY: usize = 2 * 1024 * 1024;
/// The default cap on a response body that is stored: 1 MiB.
pub const DEFAULT_MAX_STORED_RESPONSE: usize = 1024 * 1024;
/// The `Retry-After` sent with 503 when the store is unreachable.
pub const STORE_DOWN_RETRY_AFTER: Duration = Duration::from_secs(1);

/// Bounds on [`IdempotencyLayer::lease`]: a zero lease would expire as it is taken, and the
/// stores cannot represent a deadline near `Duration::MAX` (an `Instant` overflows; Redis
/// scripts would see the number in exponent notation).
const LEASE_BOUNDS: (Duration, Duration) = (Duration::from_millis(10), Duration::from_secs(24 * 60 * 60));
/// Bounds on [`IdempotencyLayer::retention`], for the same reasons.
const RETENTION_BOUNDS: (Duration, Duration) = (Duration::from_millis(1), Duration::from_secs(10 * 365 * 24 * 60 * 60));

type TenantFn = dyn Fn(&http::request::Parts) -> Option<String> + Send + Sync;

/// Everything the service needs, shared by every clone of it.
#[derive(Clone)]
pub(crate) struct Config {
    pub(crate) store: SharedStore,
    pub(crate) header: HeaderName,
    pub(crate) methods: Vec<Method>,
    pub(crate) require_key: bool,
    pub(crate) tenant: Option<Arc<TenantFn>>,
    pub(crate) scope: String,
    pub(crate) max_request_body: usize,
    pub(crate) max_stored_response: usize,
    pub(crate) lease: Duration,
    pub(crate) retention: Duration,
    pub(crate) on_in_flight: OnInFlight,
    pub(crate) fail_mode: FailMode,
    pub(crate) policy: Arc<dyn StorePolicy>,
}

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
            .field("lease", &c.lease)
            .field("retention", &c.retention)
            .field("on_in_flight", &c.on_in_flight)
            .field("fail_mode", &c.fail_mode)
            .finish_non_exhaustive()
    }
}

impl IdempotencyLayer {
    /// A layer over `store` with the defaults: header `Idempotency-Key`, methods POST and PATCH,
    /// key optional, no tenant, request bodies up to 2 MiB, responses stored up to 1 MiB, lease
    /// 60 s (renewed while the handler runs), retention 24 h, duplicates in flight rejected with
    /// 409, fail closed, and [`DefaultStorePolicy`].
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
                lease: DEFAULT_LEASE,
                retention: DEFAULT_TTL,
                on_in_flight: OnInFlight::Reject,
                fail_mode: FailMode::Closed,
                policy: Arc::new(DefaultStorePolicy),
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

    /// How long a request holds its key without renewing it (default 60 s), clamped to
    /// 10 ms ..= 1 day.
    ///
    /// The lease is renewed every third of it while the service runs, so it bounds how long a
    /// key stays blocked by a request that no longer runs: one whose server crashed, or one
    /// dropped before the service answered (the client went away and the server dropped the
    /// request's future; once the service has answered, the response is stored even if the
    /// client is gone). A retry in that window gets 409. When no renewal reaches the store for a
    /// whole lease, the request's lease counts as lost: its response still goes to the client,
    /// marked `Idempotent-Stored: false`, and is not stored.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.config().lease = lease.clamp(LEASE_BOUNDS.0, LEASE_BOUNDS.1);
        self
    }

    /// How long a stored response is replayed (default 24 h), clamped to 1 ms ..= 10 years
    /// (3650 days).
    pub fn retention(mut self, retention: Duration) -> Self {
        self.config().retention = retention.clamp(RETENTION_BOUNDS.0, RETENTION_BOUNDS.1);
        self
    }

    /// What a duplicate does while the first request runs: [`OnInFlight::Reject`] (the
    /// default) answers 409 with `Retry-After` (1 s: the first request usually finishes long
    /// before its lease runs out, which is all the store can vouch for); [`OnInFlight::Wait`]
    /// polls the store until the
    /// first response is stored and returns it (or, if the first request released the key,
    /// runs the request itself), answering 409 after the timeout.
    pub fn on_in_flight(mut self, policy: OnInFlight) -> Self {
        self.config().on_in_flight = policy;
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

    #[test]
    fn lease_and_retention_are_clamped() {
        let layer = IdempotencyLayer::new(MemoryStore::new()).lease(Duration::ZERO).retention(Duration::ZERO);
        assert_eq!(layer.config.lease, Duration::from_millis(10));
        assert_eq!(layer.config.retention, Duration::from_millis(1));
        let layer = IdempotencyLayer::new(MemoryStore::new()).lease(Duration::MAX).retention(Duration::MAX);
        assert_eq!(layer.config.lease, Duration::from_secs(86_400));
        assert_eq!(layer.config.retention, Duration::from_secs(3650 * 86_400));
        let layer =
            IdempotencyLayer::new(MemoryStore::new()).lease(Duration::from_secs(5)).retention(Duration::from_secs(7));
        assert_eq!((layer.config.lease, layer.config.retention), (Duration::from_secs(5), Duration::from_secs(7)));
    }

    #[tokio::test]
    async fn absurd_durations_never_reach_the_store() {
        use tower::{ServiceExt, service_fn};
        // `MemoryStore` adds the lease and retention to an `Instant`: `Duration::MAX` overflows.
        let layer = IdempotencyLayer::new(MemoryStore::new()).lease(Duration::MAX).retention(Duration::MAX);
        let svc = layer.layer(service_fn(|_req: http::Request<_>| async {
            Ok::<_, std::convert::Infallible>(http::Response::new(http_body_util::Full::new(bytes::Bytes::from("ok"))))
        }));
        for replayed in [false, true] {
            let req = http::Request::post("/x")
                .header("idempotency-key", "k")
                .body(http_body_util::Empty::<bytes::Bytes>::new())
                .unwrap();
            let res = svc.clone().oneshot(req).await.unwrap();
            assert_eq!(res.status(), 200);
            assert_eq!(res.headers().contains_key("idempotent-replayed"), replayed);
        }
    }
}
