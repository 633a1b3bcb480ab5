use std::sync::Arc;

use http::{HeaderName, Method};
use tower::Layer;

use super::UuidV4Key;
use super::service::IdempotencyKey;
use crate::IDEMPOTENCY_KEY;

/// Stamps one `Idempotency-Key` on each logical request; see the [module docs](super).
///
/// Put it *outside* (before, in a `ServiceBuilder`) the retry layer, so that every attempt of
/// a request carries the key the first attempt carried.
#[derive(Debug, Clone)]
pub struct IdempotencyKeyLayer<G = UuidV4Key> {
    pub(crate) header: HeaderName,
    pub(crate) methods: Arc<[Method]>,
    pub(crate) make_key: Arc<G>,
}

impl IdempotencyKeyLayer {
    /// A layer that stamps a random UUID v4 on `POST` and `PATCH` requests without a key.
    pub fn new() -> Self {
        IdempotencyKeyLayer { header: IDEMPOTENCY_KEY, methods: default_methods(), make_key: Arc::new(UuidV4Key) }
    }
}

/// `POST` and `PATCH`, the methods HTTP does not define as idempotent: the methods the client
/// key layer and middleware stamp by default.
pub(crate) fn default_methods() -> Arc<[Method]> {
    Arc::from([Method::POST, Method::PATCH])
}

impl Default for IdempotencyKeyLayer {
    fn default() -> Self {
        Self::new()
    }
}

impl<G> IdempotencyKeyLayer<G> {
    /// The header to read and write (default [`IDEMPOTENCY_KEY`]).
    pub fn header_name(mut self, header: HeaderName) -> Self {
        self.header = header;
        self
    }

    /// The methods that get a key (default `POST` and `PATCH`, the methods HTTP does not define
    /// as idempotent). Requests with other methods pass through untouched.
    pub fn methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.methods = methods.into_iter().collect();
        self
    }

    /// Makes keys with `make_key` instead of random UUIDs: any
    /// [`MakeIdempotencyKey`](super::MakeIdempotencyKey), such as a
    /// `Fn(&Request<B>) -> HeaderValue` that derives the key from the request.
    pub fn generator<G2>(self, make_key: G2) -> IdempotencyKeyLayer<G2> {
        IdempotencyKeyLayer { header: self.header, methods: self.methods, make_key: Arc::new(make_key) }
    }
}

impl<S, G> Layer<S> for IdempotencyKeyLayer<G> {
    type Service = IdempotencyKey<S, G>;

    fn layer(&self, inner: S) -> Self::Service {
        IdempotencyKey {
            inner,
            header: self.header.clone(),
            methods: self.methods.clone(),
            make_key: self.make_key.clone(),
        }
    }
}
