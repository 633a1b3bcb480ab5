//! The `Idempotency-Key` header, shared by the server layer, the client layer and the retry
//! policies, and the form in which a key appears in their logs.

use http::{HeaderName, HeaderValue};

/// `Idempotency-Key`, the header of the IETF httpapi draft (and of Stripe, PayPal and others):
/// the default of the server layer, the client layer and the retry policies alike. gRPC
/// metadata keys are lowercase HTTP/2 headers, so it is also the `idempotency-key` metadata of
/// a gRPC call.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// The first 12 hex digits of the key's sha256: enough to follow one request through the logs,
/// useless for replaying it.
pub(crate) fn key_digest(key: &HeaderValue) -> String {
    let mut hex = idempotent_core::Fingerprint::of_canonical(key.as_bytes()).to_hex();
    hex.truncate(12);
    hex
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_digest_is_a_short_sha256_prefix() {
        let digest = key_digest(&HeaderValue::from_static("secret-key"));
        assert_eq!(digest.len(), 12);
        assert!(digest.bytes().all(|b| b.is_ascii_hexdigit()));
        assert_eq!(digest, idempotent_core::Fingerprint::of_canonical(b"secret-key").to_hex()[..12]);
        assert_ne!(digest, key_digest(&HeaderValue::from_static("secret-kez")));
    }
}
