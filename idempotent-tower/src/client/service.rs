use std::sync::Arc;
use std::task::{Context, Poll};

use http::{HeaderName, Method, Request};
use tower::Service;

use super::key::{insert_key, needs_key};
use super::{IdempotencyKeyLayer, MakeIdempotencyKey, UuidV4Key};

/// The service made by [`IdempotencyKeyLayer`]: stamps an `Idempotency-Key` on requests that
/// lack one, then calls the inner service.
///
/// Cheap to clone (the configuration is shared), as tower's `Retry` and `Buffer` need.
#[derive(Debug)]
pub struct IdempotencyKey<S, G = UuidV4Key> {
    pub(crate) inner: S,
    pub(crate) header: HeaderName,
    pub(crate) methods: Arc<[Method]>,
    pub(crate) make_key: Arc<G>,
}

impl<S> IdempotencyKey<S> {
    /// Wraps `inner` with the defaults of [`IdempotencyKeyLayer::new`].
    pub fn new(inner: S) -> Self {
        tower::Layer::layer(&IdempotencyKeyLayer::new(), inner)
    }

    /// The default layer; same as [`IdempotencyKeyLayer::new`].
    pub fn layer() -> IdempotencyKeyLayer {
        IdempotencyKeyLayer::new()
    }
}

impl<S, G> IdempotencyKey<S, G> {
    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Unwraps the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S: Clone, G> Clone for IdempotencyKey<S, G> {
    fn clone(&self) -> Self {
        IdempotencyKey {
            inner: self.inner.clone(),
            header: self.header.clone(),
            methods: self.methods.clone(),
            make_key: self.make_key.clone(),
        }
    }
}

impl<S, G, B> Service<Request<B>> for IdempotencyKey<S, G>
where
    S: Service<Request<B>>,
    G: MakeIdempotencyKey<B>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: Request<B>) -> Self::Future {
        if needs_key(&self.methods, request.method(), request.headers(), &self.header)
            && let Some(key) = self.make_key.make_key(&request)
        {
            insert_key(request.headers_mut(), &self.header, key);
        }
        self.inner.call(request)
    }
}
