//! The fingerprint of an HTTP request: what makes a retry under the same key the same request.

use http::HeaderMap;
use http::header::CONTENT_TYPE;
use http::request::Parts;
use idempotent_core::Fingerprint;
use idempotent_core::canonical::with_canonical_json;

fn is_json(headers: &HeaderMap) -> bool {
    let Some(ct) = headers.get(CONTENT_TYPE).and_then(|v| v.to_str().ok()) else {
        return false;
    };
    let essence = ct.split(';').next().unwrap_or("").trim().as_bytes();
    let (prefix, suffix) = (b"application/".len(), b"+json".len());
    essence.eq_ignore_ascii_case(b"application/json")
        || (essence.len() > prefix + suffix
            && essence[..prefix].eq_ignore_ascii_case(b"application/")
            && essence[essence.len() - suffix..].eq_ignore_ascii_case(b"+json"))
}

/// The fingerprint of an HTTP request: method, path, query and body (canonical JSON when the
/// body is JSON, so that key order and whitespace do not count; the raw bytes otherwise).
pub(crate) fn http_fingerprint(parts: &Parts, body: &[u8]) -> Fingerprint {
    let of = |form: &[u8], payload: &[u8]| {
        Fingerprint::of_parts([
            &b"http"[..],
            parts.method.as_str().as_bytes(),
            parts.uri.path().as_bytes(),
            parts.uri.query().unwrap_or("").as_bytes(),
            form,
            payload,
        ])
    };
    // Canonical JSON from the thread's reused buffer: it is only hashed.
    let json = if is_json(&parts.headers) { with_canonical_json(body, |c| of(b"json", c)).ok() } else { None };
    json.unwrap_or_else(|| of(b"raw", body))
}

#[cfg(test)]
mod tests {
    use http::Request;

    use super::*;

    fn parts(method: &str, uri: &str, ct: Option<&str>) -> Parts {
        let mut b = Request::builder().method(method).uri(uri);
        if let Some(ct) = ct {
            b = b.header(CONTENT_TYPE, ct);
        }
        b.body(()).unwrap().into_parts().0
    }

    #[test]
    fn json_bodies_are_fingerprinted_canonically() {
        let json = parts("POST", "/refunds?x=1", Some("application/json; charset=utf-8"));
        assert_eq!(
            http_fingerprint(&json, br#"{"a":1,"b":[1,2]}"#),
            http_fingerprint(&json, b"{ \"b\" : [1, 2],\n \"a\": 1 }")
        );
        assert_ne!(http_fingerprint(&json, br#"{"a":1}"#), http_fingerprint(&json, br#"{"a":2}"#));
        let problem = parts("POST", "/refunds?x=1", Some("application/merge-patch+json"));
        assert_eq!(http_fingerprint(&problem, br#"{"a":1,"b":2}"#), http_fingerprint(&problem, br#"{"b":2,"a":1}"#));
        // Not JSON after all: the raw bytes count.
        assert_ne!(http_fingerprint(&json, b"{oops"), http_fingerprint(&json, b"{oops "));
    }

    #[test]
    fn other_bodies_are_fingerprinted_raw() {
        let text = parts("POST", "/refunds", Some("text/plain"));
        assert_ne!(http_fingerprint(&text, br#"{"a":1,"b":2}"#), http_fingerprint(&text, br#"{"b":2,"a":1}"#));
    }

    #[test]
    fn method_path_and_query_count() {
        let base = http_fingerprint(&parts("POST", "/r?a=1", None), b"x");
        assert_ne!(base, http_fingerprint(&parts("PATCH", "/r?a=1", None), b"x"));
        assert_ne!(base, http_fingerprint(&parts("POST", "/s?a=1", None), b"x"));
        assert_ne!(base, http_fingerprint(&parts("POST", "/r?a=2", None), b"x"));
        assert_ne!(base, http_fingerprint(&parts("POST", "/r", None), b"x"));
        assert_eq!(base, http_fingerprint(&parts("POST", "http://other.example/r?a=1", None), b"x"));
    }
}
