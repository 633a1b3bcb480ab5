//! Reading the client's idempotency key from a request.
//!
//! The IETF httpapi draft defines `Idempotency-Key` as a Structured Field Item of type String
//! (`Idempotency-Key: "8e03978e-40d5-43e8-bc93-6894a57f9324"`). Many clients send the bare value
//! instead (`Idempotency-Key: 8e03978e-…`), so both are accepted and mean the same key. A value
//! that opens with `"` is always read as an sf-string, so a malformed quoted value is an error
//! rather than a bare key with a stray quote in it.

use std::borrow::Cow;

use http::{HeaderMap, HeaderName};

/// The longest key accepted, in bytes (the draft's common practice; Stripe uses the same bound).
pub(crate) const MAX_KEY_LEN: usize = 255;

/// Why a key was refused. The message is shown to the client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum KeyError {
    Repeated,
    Empty,
    TooLong(usize),
    NotPrintable,
    BadString(String),
}

impl std::fmt::Display for KeyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KeyError::Repeated => f.write_str("the key header was sent more than once; send exactly one key"),
            KeyError::Empty => f.write_str("the key is empty; send a unique value such as a UUID"),
            KeyError::TooLong(n) => write!(f, "the key is {n} bytes long; keys may be at most {MAX_KEY_LEN} bytes"),
            KeyError::NotPrintable => {
                f.write_str("the key contains characters other than printable ASCII; use for example a UUID")
            }
            KeyError::BadString(why) => write!(
                f,
                "the key is not a valid structured-field string ({why}); send it as \"8e03978e-40d5\" or bare"
            ),
        }
    }
}

/// Reads the key from `headers[name]`: `Ok(None)` when absent.
pub(crate) fn parse<'h>(headers: &'h HeaderMap, name: &HeaderName) -> Result<Option<Cow<'h, str>>, KeyError> {
    let mut values = headers.get_all(name).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(KeyError::Repeated);
    }
    parse_value(value.as_bytes()).map(Some)
}

/// The client's idempotency key in `headers[name]` as the layer reads it: the contents of an
/// sf-string (`"8e03978e-40d5"`) or the bare value (`8e03978e-40d5`), which name the same key;
/// `None` when the header is missing, repeated or not a valid key.
///
/// A handler behind [`IdempotencyLayer`](super::IdempotencyLayer) does not need it for its
/// steps: the request's [`RunContext`](idempotent_core::RunContext) in its extensions is already
/// keyed on (tenant, scope, key) (see [What the handler runs
/// under](super#what-the-handler-runs-under)). For work keyed by hand on the request's key, use
/// this rather than the raw header value, which differs between the two forms (a retry sent in
/// the other form would be another operation), and add the tenant the layer scopes keys by (its
/// [`tenant`](super::IdempotencyLayer::tenant) extractor) to whatever the key names: a key alone
/// is shared by every tenant that sends it.
pub fn client_key(headers: &HeaderMap, name: &HeaderName) -> Option<String> {
    parse(headers, name).ok().flatten().map(Cow::into_owned)
}

/// Parses one header value (sf-string or bare form) into the key string, borrowed from the
/// value in the bare form.
pub(crate) fn parse_value(raw: &[u8]) -> Result<Cow<'_, str>, KeyError> {
    let trimmed = trim_ows(raw);
    let key = if trimmed.first() == Some(&b'"') {
        let item: sfv::Item =
            sfv::Parser::new(trimmed).parse().map_err(|e: sfv::Error| KeyError::BadString(e.to_string()))?;
        match item.bare_item {
            sfv::BareItem::String(s) => Cow::Owned(s.as_str().to_owned()),
            // Unreachable for input that opens with `"`, but never trust that to a panic.
            _ => return Err(KeyError::BadString("not a string".into())),
        }
    } else {
        if !trimmed.iter().all(|b| (0x20..=0x7e).contains(b)) {
            return Err(KeyError::NotPrintable);
        }
        // Only printable ASCII remains, which is UTF-8.
        Cow::Borrowed(std::str::from_utf8(trimmed).map_err(|_| KeyError::NotPrintable)?)
    };
    if key.is_empty() {
        return Err(KeyError::Empty);
    }
    if key.len() > MAX_KEY_LEN {
        return Err(KeyError::TooLong(key.len()));
    }
    Ok(key)
}

fn trim_ows(mut b: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = b {
        b = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = b {
        b = rest;
    }
    b
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn one(v: &[u8]) -> Result<Option<String>, KeyError> {
        let mut h = HeaderMap::new();
        h.insert("idempotency-key", HeaderValue::from_bytes(v).unwrap());
        parse(&h, &HeaderName::from_static("idempotency-key")).map(|k| k.map(Cow::into_owned))
    }

    #[test]
    fn sf_string_and_bare_forms_name_the_same_key() {
        assert_eq!(one(b"\"8e03978e-40d5\"").unwrap().as_deref(), Some("8e03978e-40d5"));
        assert_eq!(one(b"8e03978e-40d5").unwrap().as_deref(), Some("8e03978e-40d5"));
        assert_eq!(one(b"  \"abc\"  ").unwrap().as_deref(), Some("abc"));
        // Escapes in sf-strings are decoded; parameters are allowed and ignored.
        assert_eq!(one(br#""a\"b\\c""#).unwrap().as_deref(), Some("a\"b\\c"));
        assert_eq!(one(b"\"k\";v=1").unwrap().as_deref(), Some("k"));
        // Interior spaces are printable.
        assert_eq!(one(b"order 7").unwrap().as_deref(), Some("order 7"));
    }

    #[test]
    fn missing_is_none() {
        assert_eq!(parse(&HeaderMap::new(), &HeaderName::from_static("idempotency-key")), Ok(None));
    }

    #[test]
    fn client_key_is_the_parsed_key_or_none() {
        let name = HeaderName::from_static("idempotency-key");
        let mut h = HeaderMap::new();
        assert_eq!(client_key(&h, &name), None);
        h.insert(&name, HeaderValue::from_static("\"k-1\""));
        assert_eq!(client_key(&h, &name).as_deref(), Some("k-1"));
        h.insert(&name, HeaderValue::from_static("k-1"));
        assert_eq!(client_key(&h, &name).as_deref(), Some("k-1"));
        h.insert(&name, HeaderValue::from_static("\"unterminated"));
        assert_eq!(client_key(&h, &name), None);
    }

    #[test]
    fn empty_keys_are_refused() {
        assert_eq!(one(b""), Err(KeyError::Empty));
        assert_eq!(one(b"\"\""), Err(KeyError::Empty));
        assert_eq!(one(b"   "), Err(KeyError::Empty));
    }

    #[test]
    fn length_is_capped_at_255() {
        let ok = "k".repeat(255);
        assert_eq!(one(ok.as_bytes()).unwrap(), Some(ok.clone()));
        assert_eq!(one(format!("\"{ok}\"").as_bytes()).unwrap(), Some(ok));
        assert_eq!(one("k".repeat(256).as_bytes()), Err(KeyError::TooLong(256)));
        assert_eq!(one(format!("\"{}\"", "k".repeat(256)).as_bytes()), Err(KeyError::TooLong(256)));
    }

    #[test]
    fn non_printable_ascii_is_refused() {
        assert_eq!(one(b"caf\xc3\xa9"), Err(KeyError::NotPrintable));
        assert_eq!(one(b"a\tb"), Err(KeyError::NotPrintable));
        assert!(matches!(one(b"\"caf\xc3\xa9\""), Err(KeyError::BadString(_))));
    }

    #[test]
    fn malformed_sf_values_are_refused() {
        assert!(matches!(one(b"\"abc"), Err(KeyError::BadString(_))));
        assert!(matches!(one(b"\"a\" \"b\""), Err(KeyError::BadString(_))));
        assert!(matches!(one(b"\"a\", \"b\""), Err(KeyError::BadString(_))));
    }

    #[test]
    fn a_repeated_header_is_refused() {
        let mut h = HeaderMap::new();
        h.append("idempotency-key", HeaderValue::from_static("a"));
        h.append("idempotency-key", HeaderValue::from_static("a"));
        assert_eq!(parse(&h, &HeaderName::from_static("idempotency-key")), Err(KeyError::Repeated));
    }

    #[test]
    fn every_error_says_what_to_do() {
        for e in [
            KeyError::Repeated,
            KeyError::Empty,
            KeyError::TooLong(300),
            KeyError::NotPrintable,
            KeyError::BadString("x".into()),
        ] {
            assert!(e.to_string().len() > 20, "{e}");
        }
    }
}
