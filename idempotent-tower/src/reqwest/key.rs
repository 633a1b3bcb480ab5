//! [`IdempotencyKeyMiddleware`]: one `Idempotency-Key` per logical reqwest request.

use std::sync::Arc;

use ::reqwest::header::{HeaderName, HeaderValue};
use ::reqwest::{Method, Request, Response};
use ::reqwest_middleware::{Middleware, Next, Result};
use http::Extensions;

use super::{BoxFuture, InsideRetry};
use crate::IDEMPOTENCY_KEY;
use crate::client::{UuidV4Key, default_methods, insert_key, needs_key};
use crate::header::key_digest;

/// The key of the operation a request belongs to, attached with
/// `RequestBuilder::with_extension`: the key middleware sends it instead of a random key.
///
/// A random key protects the retries of one process. A key derived from the operation's
/// identity ([`idempotent_core::Key::derive`] over a run id, a step name and the payload) also
/// protects a worker that crashes and sends the same request again after a restart: the server
/// replays the first outcome.
///
/// ```
/// use idempotent_core::{Key, KeyScope};
/// use idempotent_tower::reqwest::OperationKey;
///
/// let key = Key::derive(&KeyScope::new("run-42", "charge"), &("order-7", 1500)).unwrap();
/// let again = Key::derive(&KeyScope::new("run-42", "charge"), &("order-7", 1500)).unwrap();
/// assert_eq!(OperationKey::new(&key).header_value(), OperationKey::new(&again).header_value());
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OperationKey(HeaderValue);

impl OperationKey {
    /// The key's hex digest, as a structured-field string (`"3fa1…"`, quotes included).
    pub fn new(key: &idempotent_core::Key) -> Self {
        let value = format!("\"{}\"", key.to_hex());
        OperationKey(HeaderValue::from_str(&value).expect("quoted hex is a valid header value"))
    }

    /// The header value the middleware sends.
    pub fn header_value(&self) -> &HeaderValue {
        &self.0
    }
}

impl From<&idempotent_core::Key> for OperationKey {
    fn from(key: &idempotent_core::Key) -> Self {
        OperationKey::new(key)
    }
}

/// Stamps one `Idempotency-Key` on each logical request that lacks one; see the
/// [module docs](super).
///
/// Add it *before* [`RetryMiddleware`](super::RetryMiddleware) (`.with(key).with(retry)`), so
/// that every attempt of a request carries the key the first one carried. Where the key comes
/// from, in order: a key the caller set in the header is kept; else an [`OperationKey`] in the
/// request's extensions; else a random UUID v4.
#[derive(Debug, Clone)]
pub struct IdempotencyKeyMiddleware {
    header: HeaderName,
    methods: Arc<[Method]>,
}

impl IdempotencyKeyMiddleware {
    /// A middleware that stamps `POST` and `PATCH` requests, as
    /// [`IdempotencyKeyLayer::new`](crate::client::IdempotencyKeyLayer::new) does.
    pub fn new() -> Self {
        IdempotencyKeyMiddleware { header: IDEMPOTENCY_KEY, methods: default_methods() }
    }

    /// The header to read and write (default [`IDEMPOTENCY_KEY`]).
    pub fn header_name(mut self, header: HeaderName) -> Self {
        self.header = header;
        self
    }

    /// The methods that get a key (default `POST` and `PATCH`). Requests with other methods
    /// pass through untouched.
    pub fn methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.methods = methods.into_iter().collect();
        self
    }

    fn stamp(&self, request: &mut Request, extensions: &Extensions) {
        if !needs_key(&self.methods, request.method(), request.headers(), &self.header) {
            return;
        }
        let key = match extensions.get::<OperationKey>() {
            Some(key) => key.0.clone(),
            None => UuidV4Key::header_value(),
        };
        if extensions.get::<InsideRetry>().is_some() {
            // The retry middleware has already judged this request, without a key: it will not
            // retry it, and a retry of it would get a key of its own.
            tracing::warn!(
                method = %request.method(),
                key = %key_digest(&key),
                "idempotent.client_key: the key middleware runs inside the retry middleware, so this request is \
                 never retried; add IdempotencyKeyMiddleware before RetryMiddleware (`.with(key).with(retry)`)"
            );
        }
        insert_key(request.headers_mut(), &self.header, key);
    }
}

impl Default for IdempotencyKeyMiddleware {
    fn default() -> Self {
        Self::new()
    }
}

// By hand what `#[async_trait]` would write, so that this crate needs no proc macro for it.
impl Middleware for IdempotencyKeyMiddleware {
    fn handle<'life0, 'life1, 'life2, 'async_trait>(
        &'life0 self,
        mut request: Request,
        extensions: &'life1 mut Extensions,
        next: Next<'life2>,
    ) -> BoxFuture<'async_trait, Result<Response>>
    where
        'life0: 'async_trait,
        'life1: 'async_trait,
        'life2: 'async_trait,
        Self: 'async_trait,
    {
        self.stamp(&mut request, extensions);
        next.run(request, extensions)
    }
}
