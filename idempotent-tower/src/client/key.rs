//! Where a request's key comes from when the caller did not set one.

use http::{HeaderMap, HeaderName, HeaderValue, Method, Request};

use crate::header::key_digest;

/// Makes the `Idempotency-Key` value for a request that has none.
///
/// Implemented by [`UuidV4Key`] (the default) and by every `Fn(&Request<B>) -> HeaderValue`, so a
/// caller can derive keys from the request itself, for example with
/// [`idempotent_core::Key::derive`] over a run id, a step name and the payload: a worker that
/// restarts and sends the same logical request again then sends the same key, and the server
/// replays the first outcome instead of running the side effect again.
pub trait MakeIdempotencyKey<B> {
    /// The key for `request`, or `None` to send it without one (and so without retries, if its
    /// method is not idempotent: see [`crate::retry`]).
    fn make_key(&self, request: &Request<B>) -> Option<HeaderValue>;
}

/// Generates a random UUID v4 per logical request, written as a structured-field string
/// (`"8e03978e-40d5-43e8-bc93-6894a57f9324"`, quotes included) as the IETF
/// `Idempotency-Key` draft specifies.
///
/// A random key protects the retries of one process. It does not survive a restart of the
/// caller: a worker that crashes and resends the request after restarting makes a new key. Derive
/// the key from the operation's identity instead when that matters (see [`MakeIdempotencyKey`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct UuidV4Key;

impl UuidV4Key {
    /// A new random key, as an `Idempotency-Key` header value (a structured-field string): for
    /// a client that sends one logical request itself and keeps the key across its retries.
    pub fn header_value() -> HeaderValue {
        let value = format!("\"{}\"", uuid::Uuid::new_v4().hyphenated());
        HeaderValue::from_str(&value).expect("a hyphenated UUID in quotes is a valid header value")
    }
}

impl<B> MakeIdempotencyKey<B> for UuidV4Key {
    fn make_key(&self, _request: &Request<B>) -> Option<HeaderValue> {
        Some(UuidV4Key::header_value())
    }
}

impl<B, F> MakeIdempotencyKey<B> for F
where
    F: Fn(&Request<B>) -> HeaderValue,
{
    fn make_key(&self, request: &Request<B>) -> Option<HeaderValue> {
        Some(self(request))
    }
}

/// Whether a request needs a key stamped: its method is one of `methods` and it carries no
/// `header` yet (a caller's own key is kept, and logged as kept). Shared by the tower layer and
/// the reqwest middleware.
pub(crate) fn needs_key(methods: &[Method], method: &Method, headers: &HeaderMap, header: &HeaderName) -> bool {
    if !methods.contains(method) {
        return false;
    }
    match headers.get(header) {
        Some(existing) => {
            tracing::trace!(key = %key_digest(existing), "idempotent.client_key: kept the caller's key");
            false
        }
        None => true,
    }
}

/// Stamps `key` under `header` (after [`needs_key`] said so), and logs it.
pub(crate) fn insert_key(headers: &mut HeaderMap, header: &HeaderName, key: HeaderValue) {
    tracing::trace!(key = %key_digest(&key), "idempotent.client_key: stamped a new key");
    headers.insert(header.clone(), key);
}
