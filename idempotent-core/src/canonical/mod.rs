//! Canonical JSON (RFC 8785, JCS) of any `Serialize` value, with exact integers.
//!
//! Keys hash the canonical form of a payload, so two payloads that mean the same thing must give the
//! same bytes, and two that differ must not. [`to_canonical_vec`] writes JCS directly from serde:
//!
//! - object members are sorted by their UTF-16 code units (RFC 8785 §3.2.3), so member order (a
//!   `HashMap`'s iteration order, a struct's field order) never changes the bytes; duplicate member
//!   names are an error;
//! - strings are escaped as JCS says and otherwise written as given: no Unicode normalization, so
//!   `"é"` (U+00E9) and `"e\u{301}"` are different payloads;
//! - floating-point numbers use the ECMAScript number formatting JCS requires (through `ryu-js`);
//!   `NaN` and `±Infinity` are rejected with [`CanonicalError::NonFinite`] — serde_json would
//!   silently write `null`, which would make every non-finite amount the same payload;
//! - integers are written exactly, in decimal. This is the one place where we depart from JCS, which
//!   formats every number as an IEEE double and so maps 2^53 + 1 onto 2^53: two different amounts
//!   must never share a key. For integers with magnitude up to 2^53 the output is JCS byte for byte.
//!   "Integer" means what serde hands over as an integer (`u64`, `i128`, …) and, in
//!   [`canonicalize_json`], a JSON number written without a fraction or exponent. A number written
//!   as `9007199254740993.0` or `9.007199254740993e15` is a double, as JCS says, and rounds like
//!   one; and a `serde_json::Value` parsed without serde_json's `arbitrary_precision` feature has
//!   already rounded integers beyond 64 bits before we see them;
//! - nesting deeper than [`MAX_DEPTH`] is rejected with [`CanonicalError::TooDeep`];
//! - map keys must be strings (or unit enum variants, written as their name); an integer or
//!   composite map key is rejected with [`CanonicalError::NonStringKey`].
//!
//! No crate on crates.io met all of these: `serde_jcs` and `serde_json_canonicalizer` follow JCS's
//! double formatting for integers (losing precision above 2^53), and going through
//! `serde_json::Value` turns NaN into `null`. Hence this serializer.
//!
//! ```
//! use idempotent_core::canonical::to_canonical_vec;
//! use serde_json::json;
//!
//! let a = to_canonical_vec(&json!({"b": 1, "a": [true, null, 1.5e30]})).unwrap();
//! assert_eq!(a, br#"{"a":[true,null,1.5e+30],"b":1}"#);
//! assert!(to_canonical_vec(&f64::NAN).is_err());
//! ```

use std::fmt::Display;

mod parse;
mod ser;
#[cfg(test)]
mod tests;
mod write;

pub use parse::{JsonError, canonicalize_json, with_canonical_json};
pub use ser::{to_canonical_vec, with_canonical, write_canonical};

/// The deepest nesting of arrays and objects [`to_canonical_vec`] accepts.
pub const MAX_DEPTH: usize = 128;

/// Why a value has no canonical JSON form.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum CanonicalError {
    /// A float was NaN or infinite; JSON cannot represent it.
    #[error(
        "payload contains the non-finite number {0}; JSON has no representation for NaN or \
         infinity, so it cannot be part of an idempotency key (pass it as a string, or reject it \
         before the call)"
    )]
    NonFinite(f64),
    /// Arrays and objects were nested deeper than [`MAX_DEPTH`].
    #[error(
        "payload is nested deeper than {max} levels; flatten it or leave the deep part out of \
         the key with skip(...)"
    )]
    TooDeep {
        /// The limit that was exceeded.
        max: usize,
    },
    /// A map key was not a string.
    #[error(
        "payload has a map whose keys are {kind}, not strings; JSON object keys must be strings \
         (convert the keys, e.g. to a BTreeMap<String, _>)"
    )]
    NonStringKey {
        /// What the key was.
        kind: &'static str,
    },
    /// The same member name appeared twice in one object.
    #[error("payload has the object member {0:?} twice; canonical JSON needs unique member names")]
    DuplicateKey(String),
    /// The value's `Serialize` implementation failed.
    #[error("payload could not be serialized: {0}")]
    Custom(String),
}

impl serde::ser::Error for CanonicalError {
    fn custom<T: Display>(msg: T) -> Self {
        CanonicalError::Custom(msg.to_string())
    }
}
