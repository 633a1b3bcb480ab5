//! Deterministic operation keys and payload fingerprints.
//!
//! An operation's identity is (namespace, tenant, run id, step, step version, identity payload).
//! [`Key`] is the sha256 of those fields framed unambiguously: every field is written with its
//! length in front, so `("a:b", "c")` and `("a", "b:c")` never give the same key, and a missing
//! tenant is distinct from an empty one. The identity payload enters the key through its own hash,
//! so when identity and payload are the same value (the default) the payload is hashed once.
//!
//! The operation key ([`Key::derive`], [`Key::from_identity_hash`]) hashes, in this order, each
//! field length-prefixed (its length as a big-endian `u64`, then its bytes) unless said
//! otherwise: the namespace `idempotent/v1` (domain separation, bumped if the framing ever
//! changes); the tag `operation`; the tenant, as one byte `0` when there is none or a byte `1`
//! and the length-prefixed tenant; the run id; the step name; the step version, 4 bytes
//! big-endian; the 32-byte sha256 of the identity payload's canonical JSON. The key of a client's
//! key ([`Key::from_client_key`]) hashes the namespace, the tag `client-key`, the tenant framed
//! the same way, the scope and the client's key.
//!
//! A [`Fingerprint`] is the sha256 of the canonical JSON of the *whole* payload. Keeping the two
//! apart lets a caller key an operation on part of its arguments (an order id) while a retry that
//! changes another argument (the amount) under the same key is reported as a mismatch instead of
//! silently replaying the first result.
//!
//! ```
//! use idempotent_core::{Fingerprint, Key, KeyScope};
//!
//! let scope = KeyScope::new("run-42", "stripe_refund");
//! let key = Key::derive(&scope, &("order-7", 1500)).unwrap();
//! assert_eq!(key, Key::derive(&scope, &("order-7", 1500)).unwrap());
//! assert_ne!(key, Key::derive(&scope.clone().version(2), &("order-7", 1500)).unwrap());
//! assert_eq!(key.to_hex().len(), 64);
//! # let _ = Fingerprint::of(&1).unwrap();
//! ```

use std::fmt;

use serde::Serialize;
use sha2::{Digest, Sha256};

use crate::canonical::{CanonicalError, with_canonical};

/// Domain separation for every hash this crate makes; bump it if the framing ever changes.
const NAMESPACE: &[u8] = b"idempotent/v1";

/// The fields that, with the identity payload, name one operation.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct KeyScope {
    tenant: Option<String>,
    run_id: String,
    step: String,
    version: u32,
}

impl KeyScope {
    /// A scope for `step` inside the run `run_id`, with no tenant and version 0.
    pub fn new(run_id: impl Into<String>, step: impl Into<String>) -> Self {
        KeyScope { tenant: None, run_id: run_id.into(), step: step.into(), version: 0 }
    }

    /// Sets the tenant, so equal run ids of two tenants never share a record.
    pub fn tenant(mut self, tenant: impl Into<String>) -> Self {
        self.tenant = Some(tenant.into());
        self
    }

    /// Sets the step version; bumping it makes every key of the step new.
    pub fn version(mut self, version: u32) -> Self {
        self.version = version;
        self
    }

    /// The step name.
    pub fn step(&self) -> &str {
        &self.step
    }
}

/// Writes one length-prefixed field: `bytes`, its length first, so that fields cannot run into
/// each other.
pub(crate) fn field(h: &mut Sha256, bytes: &[u8]) {
    h.update((bytes.len() as u64).to_be_bytes());
    h.update(bytes);
}

/// The store key of one operation: a sha256 digest.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Key([u8; 32]);

/// Hashes the first 8 bytes only: a key is a SHA-256 digest, so they are as good as the whole,
/// and a keyed hasher (std's `RandomState`) still keeps their buckets unpredictable to clients.
impl std::hash::Hash for Key {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        let mut head = [0; 8];
        head.copy_from_slice(&self.0[..8]);
        state.write_u64(u64::from_le_bytes(head));
    }
}

impl Key {
    /// Derives the key from a scope and the identity payload (hashed as canonical JSON).
    pub fn derive<T: Serialize + ?Sized>(scope: &KeyScope, identity: &T) -> Result<Key, CanonicalError> {
        Ok(Key::from_identity_hash(scope, &Fingerprint::of(identity)?))
    }

    /// Derives the key from a scope and the hash of an identity payload.
    ///
    /// When the identity is the whole payload, its [`Fingerprint`] is that hash, so callers that
    /// already have the fingerprint pass it here instead of hashing the payload twice.
    pub fn from_identity_hash(scope: &KeyScope, identity: &Fingerprint) -> Key {
        Key::operation(scope.tenant.as_deref(), &scope.run_id, &scope.step, scope.version, identity)
    }

    /// [`from_identity_hash`](Self::from_identity_hash) from borrowed parts.
    pub(crate) fn operation(
        tenant: Option<&str>,
        run_id: &str,
        step: &str,
        version: u32,
        identity: &Fingerprint,
    ) -> Key {
        let mut h = Sha256::new();
        field(&mut h, NAMESPACE);
        field(&mut h, b"operation");
        match tenant {
            None => h.update([0u8]),
            Some(t) => {
                h.update([1u8]);
                field(&mut h, t.as_bytes());
            }
        }
        field(&mut h, run_id.as_bytes());
        field(&mut h, step.as_bytes());
        h.update(version.to_be_bytes());
        h.update(identity.0);
        Key(h.finalize().into())
    }

    /// The key for a client-supplied key (an HTTP `Idempotency-Key`) within a tenant and scope.
    ///
    /// Client keys are never used as store keys directly: hashing them means a client can't choose
    /// a cluster slot, collide with another tenant's key or inject characters into the store.
    /// `scope` separates independent uses (for example one per service).
    pub fn from_client_key(tenant: Option<&str>, scope: &str, client_key: &str) -> Key {
        let mut h = Sha256::new();
        field(&mut h, NAMESPACE);
        field(&mut h, b"client-key");
        match tenant {
            None => h.update([0u8]),
            Some(t) => {
                h.update([1u8]);
                field(&mut h, t.as_bytes());
            }
        }
        field(&mut h, scope.as_bytes());
        field(&mut h, client_key.as_bytes());
        Key(h.finalize().into())
    }

    /// The raw digest.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// Builds a key from a raw digest (for stores that read keys back).
    ///
    /// The bytes should be a digest: in-process maps hash a key by its first 8 bytes only, so
    /// keys made up by hand that share them all land in one bucket.
    pub const fn from_bytes(bytes: [u8; 32]) -> Key {
        Key(bytes)
    }

    /// The digest as 64 lowercase hex characters.
    pub fn to_hex(&self) -> String {
        hex(&self.0)
    }

    /// Reads a key back from its 64 hex characters ([`to_hex`](Self::to_hex); either case);
    /// `None` for anything else.
    pub fn from_hex(text: &str) -> Option<Key> {
        decode_hex(text).map(Key)
    }

    /// The first 12 hex characters: enough to tell keys apart in logs, useless to an attacker.
    /// A value that formats itself, for log fields (`key = %key.short()`) without a `String` per
    /// call; `key.short().to_string()` when a `String` is wanted.
    pub fn short(&self) -> ShortKey {
        let mut bytes = [0; 6];
        bytes.copy_from_slice(&self.0[..6]);
        ShortKey(bytes)
    }
}

/// The key an operation's side effect sends to a downstream system that deduplicates by it (a
/// payment provider's `Idempotency-Key`): see [`Attempt::downstream_key`](crate::Attempt::downstream_key).
///
/// The sha256 of the operation's [`Key`] under a label of its own, as 64 lowercase hex
/// characters: stable for the operation, one-way (it reveals neither the payload nor the store
/// key), and kept inline (no allocation).
///
/// ```
/// use idempotent_core::{DownstreamKey, Key, KeyScope};
///
/// let key = Key::derive(&KeyScope::new("run-42", "charge"), &("order-7", 1500)).unwrap();
/// let downstream = DownstreamKey::of(&key);
/// assert_eq!(downstream.as_str().len(), 64);
/// assert_ne!(downstream.as_str(), key.to_hex());
/// assert_eq!(downstream, DownstreamKey::of(&key));
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct DownstreamKey([u8; 64]);

impl DownstreamKey {
    /// The downstream key of the operation `key`.
    pub fn of(key: &Key) -> DownstreamKey {
        let mut h = Sha256::new();
        field(&mut h, NAMESPACE);
        field(&mut h, b"downstream");
        h.update(key.0);
        let digest: [u8; 32] = h.finalize().into();
        let mut text = [0; 64];
        encode_hex(&digest, &mut text);
        DownstreamKey(text)
    }

    /// The key's 64 hex characters.
    pub fn as_str(&self) -> &str {
        // Always ASCII hex (see `of`), so never the fallback.
        std::str::from_utf8(&self.0).unwrap_or_default()
    }
}

impl AsRef<str> for DownstreamKey {
    fn as_ref(&self) -> &str {
        self.as_str()
    }
}

impl fmt::Display for DownstreamKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.as_str())
    }
}

impl fmt::Debug for DownstreamKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DownstreamKey({})", &self.as_str()[..12])
    }
}

/// The first 12 hex characters of a [`Key`], formatted on demand (see [`Key::short`]).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct ShortKey([u8; 6]);

impl fmt::Display for ShortKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut text = [0; 12];
        encode_hex(&self.0, &mut text);
        f.pad(std::str::from_utf8(&text).unwrap_or_default())
    }
}

impl fmt::Debug for ShortKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Key({})", self.short())
    }
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.short(), f)
    }
}

/// The sha256 of a payload's canonical JSON (or of raw bytes, for opaque payloads).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// Fingerprints a payload through its canonical JSON.
    pub fn of<T: Serialize + ?Sized>(payload: &T) -> Result<Fingerprint, CanonicalError> {
        with_canonical(payload, Fingerprint::of_canonical)
    }

    /// Fingerprints bytes that are already canonical (or opaque).
    pub fn of_canonical(bytes: &[u8]) -> Fingerprint {
        Fingerprint(Sha256::digest(bytes).into())
    }

    /// Fingerprints several byte strings as one, framing each by its length.
    pub fn of_parts<'a>(parts: impl IntoIterator<Item = &'a [u8]>) -> Fingerprint {
        let mut h = Sha256::new();
        for p in parts {
            field(&mut h, p);
        }
        Fingerprint(h.finalize().into())
    }

    /// The raw digest.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// Builds a fingerprint from a raw digest (for stores that read it back).
    pub const fn from_bytes(bytes: [u8; 32]) -> Fingerprint {
        Fingerprint(bytes)
    }

    /// The digest as 64 lowercase hex characters.
    pub fn to_hex(&self) -> String {
        hex(&self.0)
    }

    /// Reads a fingerprint back from its 64 hex characters; `None` for anything else.
    pub fn from_hex(text: &str) -> Option<Fingerprint> {
        decode_hex(text).map(Fingerprint)
    }
}

/// 64 hex characters (either case) as 32 bytes.
pub(crate) fn decode_hex(text: &str) -> Option<[u8; 32]> {
    let text = text.as_bytes();
    if text.len() != 64 {
        return None;
    }
    let digit = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    let mut out = [0; 32];
    for (b, pair) in out.iter_mut().zip(text.chunks_exact(2)) {
        *b = digit(pair[0])? << 4 | digit(pair[1])?;
    }
    Some(out)
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({})", hex(&self.0[..6]))
    }
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    let mut s = String::with_capacity(bytes.len() * 2);
    push_hex(&mut s, bytes);
    s
}

/// Writes `bytes` in lowercase hex into `out`, which holds exactly twice as many bytes.
pub(crate) fn encode_hex(bytes: &[u8], out: &mut [u8]) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    for (pair, b) in out.chunks_exact_mut(2).zip(bytes) {
        pair[0] = HEX[(b >> 4) as usize];
        pair[1] = HEX[(b & 0xf) as usize];
    }
}

/// 32 bytes in lowercase hex, on the stack.
#[cfg(feature = "redis")]
pub(crate) fn hex_array(bytes: &[u8; 32]) -> [u8; 64] {
    let mut out = [0; 64];
    encode_hex(bytes, &mut out);
    out
}

/// Appends `bytes` in lowercase hex.
pub(crate) fn push_hex(out: &mut String, bytes: &[u8]) {
    for chunk in bytes.chunks(32) {
        let mut buf = [0; 64];
        let text = &mut buf[..2 * chunk.len()];
        encode_hex(chunk, text);
        out.push_str(std::str::from_utf8(text).unwrap_or_default());
    }
}

impl Key {
    /// Appends the key's 64 hex characters to `out` (what [`to_hex`](Self::to_hex) returns).
    #[cfg(feature = "redis")]
    pub(crate) fn push_hex(&self, out: &mut String) {
        push_hex(out, &self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    #[test]
    fn short_formats_as_twelve_hex_digits() {
        let mut bytes = [0; 32];
        bytes[..6].copy_from_slice(&[0x00, 0x1f, 0xa0, 0xff, 0x7e, 0x09]);
        let key = Key::from_bytes(bytes);
        assert_eq!(key.short().to_string(), "001fa0ff7e09");
        assert_eq!(format!("{:?}", key.short()), "001fa0ff7e09");
        assert_eq!(format!("{:>14}", key.short()), "  001fa0ff7e09");
        assert_eq!(key.to_string(), "001fa0ff7e09");
    }

    #[test]
    fn framing_is_unambiguous() {
        let a = Key::derive(&KeyScope::new("a:b", "c"), &()).unwrap();
        let b = Key::derive(&KeyScope::new("a", "b:c"), &()).unwrap();
        assert_ne!(a, b);
        let none = Key::derive(&KeyScope::new("r", "s"), &1).unwrap();
        let empty = Key::derive(&KeyScope::new("r", "s").tenant(""), &1).unwrap();
        assert_ne!(none, empty);
        assert_ne!(Key::from_client_key(Some("a:b"), "s", "c"), Key::from_client_key(Some("a"), "s", "b:c"));
        assert_ne!(Key::from_client_key(None, "s", "k"), Key::from_client_key(Some(""), "s", "k"));
    }

    #[test]
    fn every_field_changes_the_key() {
        let base = KeyScope::new("run", "step");
        let k = Key::derive(&base, &json!({"a": 1})).unwrap();
        for other in [
            Key::derive(&base.clone().tenant("t"), &json!({"a": 1})),
            Key::derive(&KeyScope::new("run2", "step"), &json!({"a": 1})),
            Key::derive(&KeyScope::new("run", "step2"), &json!({"a": 1})),
            Key::derive(&base.clone().version(1), &json!({"a": 1})),
            Key::derive(&base, &json!({"a": 2})),
        ] {
            assert_ne!(k, other.unwrap());
        }
    }

    #[test]
    fn identity_hash_shortcut_matches_derive() {
        let scope = KeyScope::new("run", "step");
        let payload = json!({"order": "o-1", "amount": 1500});
        assert_eq!(
            Key::derive(&scope, &payload).unwrap(),
            Key::from_identity_hash(&scope, &Fingerprint::of(&payload).unwrap())
        );
    }

    #[test]
    fn non_finite_payload_is_an_error() {
        assert!(Key::derive(&KeyScope::new("r", "s"), &(1, f64::NAN)).is_err());
        assert!(Fingerprint::of(&f64::INFINITY).is_err());
    }

    proptest! {
        #[test]
        fn map_order_never_changes_the_key(entries in proptest::collection::vec(("[a-z]{1,4}", any::<i64>()), 0..12)) {
            let forward: std::collections::HashMap<_, _> = entries.iter().cloned().collect();
            let mut obj = serde_json::Map::new();
            for (k, _) in entries.iter().rev() {
                obj.entry(k.clone()).or_insert(json!(forward[k]));
            }
            let scope = KeyScope::new("r", "s");
            prop_assert_eq!(Key::derive(&scope, &forward).unwrap(), Key::derive(&scope, &obj).unwrap());
        }

        #[test]
        fn downstream_keys_follow_the_operation(
            tenant in proptest::option::of("[a-z]{0,3}"),
            run in "[a-z:]{0,4}",
            step in "[a-z:]{0,4}",
            version in 0u32..3,
            payload in proptest::collection::vec(any::<i8>(), 0..3),
            which in 0usize..5,
        ) {
            let scope = |tenant: &Option<String>, run: &str, step: &str, version: u32| {
                let s = KeyScope::new(run, step).version(version);
                match tenant { Some(t) => s.tenant(t.as_str()), None => s }
            };
            let key = Key::derive(&scope(&tenant, &run, &step, version), &payload).unwrap();
            let again = Key::derive(&scope(&tenant, &run, &step, version), &payload.clone()).unwrap();
            prop_assert_eq!(DownstreamKey::of(&key), DownstreamKey::of(&again));
            let changed = match which {
                0 => Key::derive(&scope(&Some(format!("{}x", tenant.clone().unwrap_or_default())), &run, &step, version), &payload),
                1 => Key::derive(&scope(&tenant, &format!("{run}x"), &step, version), &payload),
                2 => Key::derive(&scope(&tenant, &run, &format!("{step}x"), version), &payload),
                3 => Key::derive(&scope(&tenant, &run, &step, version + 1), &payload),
                _ => Key::derive(&scope(&tenant, &run, &step, version), &[payload.clone(), vec![0]].concat()),
            }.unwrap();
            let downstream = DownstreamKey::of(&key);
            prop_assert_ne!(downstream, DownstreamKey::of(&changed));
            prop_assert_eq!(downstream.as_str().len(), 64);
            prop_assert!(downstream.as_str().bytes().all(|b| b.is_ascii_hexdigit()));
            prop_assert_ne!(downstream.as_str(), key.to_hex());
        }

        #[test]
        fn framing_never_collides(a in "[a:]{0,6}", b in "[a:]{0,6}", c in "[a:]{0,6}", d in "[a:]{0,6}") {
            prop_assume!((a.as_str(), b.as_str()) != (c.as_str(), d.as_str()));
            prop_assert_ne!(
                Key::derive(&KeyScope::new(a, b), &()).unwrap(),
                Key::derive(&KeyScope::new(c, d), &()).unwrap()
            );
        }
    }
}
