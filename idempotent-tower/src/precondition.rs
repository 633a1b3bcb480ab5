//! Optimistic concurrency over HTTP for versioned shared state ([`idempotent_core::state`]):
//! the state's version is the resource's entity tag (`ETag`), and a write carries the tag it was
//! computed from in `If-Match`.
//!
//! A handler answers `GET` with [`etag`] of the state's version. A write commits on the version
//! its `If-Match` names ([`parse_etag`]), without loading the state first: the store takes the
//! commit only while that version is current, so a stale tag comes back as the commit's conflict,
//! answered `412 Precondition Failed` with the current `ETag` ([`Precondition::Failed`]). What
//! [`parse_etag`] cannot read (no `If-Match`, `*`, a weak or foreign tag) goes through
//! [`check_if_match`] against the version the handler loads: a missing tag is `428 Precondition
//! Required`, a tag that names no current version 412, and `*` matches a state that exists. Both
//! refusals are problem documents (RFC 9457) saying what to do. Tags are strong (`"<version>"`): a
//! weak tag (`W/"…"`) never matches, as RFC 9110 §13.1.1 requires for `If-Match`. The
//! `shared_cart` example's `PUT /cart` is this handler.
//!
//! ```
//! use idempotent_core::state::Version;
//! use idempotent_tower::http::{HeaderMap, StatusCode, header::IF_MATCH};
//! use idempotent_tower::precondition::{Precondition, check_if_match, etag};
//!
//! let current = Version::new(3);
//! let mut headers = HeaderMap::new();
//! assert!(matches!(check_if_match(&headers, current), Err(Precondition::Required)));
//! headers.insert(IF_MATCH, etag(Version::new(2)));
//! let stale = check_if_match(&headers, current).unwrap_err();
//! assert_eq!(stale.status(), StatusCode::PRECONDITION_FAILED);
//! headers.insert(IF_MATCH, etag(current));
//! assert_eq!(check_if_match(&headers, current).unwrap(), current);
//! ```

use bytes::Bytes;
use http::header::{CONTENT_TYPE, ETAG, IF_MATCH};
use http::{HeaderMap, HeaderValue, Response, StatusCode};
use idempotent_core::state::Version;

use crate::server::problem::{PROBLEM_JSON, problem_document};

/// The entity tag of `version`: `"<version>"` (strong).
pub fn etag(version: Version) -> HeaderValue {
    // Digits between quotes: always a valid header value.
    HeaderValue::try_from(format!("\"{}\"", version.get())).unwrap_or(HeaderValue::from_static("\"0\""))
}

/// The version an entity tag of [`etag`] names; `None` for a weak or foreign tag.
pub fn parse_etag(tag: &str) -> Option<Version> {
    let digits = tag.trim().strip_prefix('"')?.strip_suffix('"')?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok().map(Version::new)
}

/// Why a write was refused before it was made.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Precondition {
    /// The request has no `If-Match`: 428.
    Required,
    /// `If-Match` names no current version (or the state changed before the commit): 412.
    Failed {
        /// The version now, whose tag the response carries.
        current: Version,
    },
}

impl Precondition {
    /// 428 or 412.
    pub fn status(&self) -> StatusCode {
        match self {
            Precondition::Required => StatusCode::PRECONDITION_REQUIRED,
            Precondition::Failed { .. } => StatusCode::PRECONDITION_FAILED,
        }
    }

    /// What happened and what the client should do.
    pub fn detail(&self) -> String {
        match self {
            Precondition::Required => "This resource is shared by several writers, so a write must say which \
                 version it was computed from. GET the resource, apply your change to what it returns, and send \
                 the write with If-Match set to the ETag of that response."
                .to_owned(),
            Precondition::Failed { current } => format!(
                "The resource changed since the version in If-Match (it is at ETag \"{current}\" now), so this \
                 write was not applied. GET the resource again, re-apply your change to the current value, and \
                 send it with If-Match: \"{current}\" or the newer ETag you get."
            ),
        }
    }

    /// The refusal as an `application/problem+json` response (a 412 carries the current
    /// `ETag`).
    pub fn into_response<B: From<Bytes>>(self) -> Response<B> {
        let status = self.status();
        let (slug, title) = match self {
            Precondition::Required => ("precondition-required", "If-Match required"),
            Precondition::Failed { .. } => ("precondition-failed", "Resource changed"),
        };
        let mut res = Response::new(B::from(problem_document(status, slug, title, &self.detail())));
        *res.status_mut() = status;
        res.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
        if let Precondition::Failed { current } = self {
            res.headers_mut().insert(ETAG, etag(current));
        }
        res
    }
}

/// Checks the request's `If-Match` against `current`, the state's version: answers the version
/// to commit on, or the refusal (missing: [`Precondition::Required`]; no listed tag is current,
/// or `*` on an absent state: [`Precondition::Failed`]).
pub fn check_if_match(headers: &HeaderMap, current: Version) -> Result<Version, Precondition> {
    let mut values = headers.get_all(IF_MATCH).iter().peekable();
    if values.peek().is_none() {
        return Err(Precondition::Required);
    }
    let failed = Precondition::Failed { current };
    for value in values {
        let Ok(text) = value.to_str() else { return Err(failed) };
        for tag in text.split(',') {
            if tag.trim() == "*" {
                return if current.is_absent() { Err(failed) } else { Ok(current) };
            }
            if parse_etag(tag) == Some(current) {
                return Ok(current);
            }
        }
    }
    Err(failed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    #[test]
    fn tags_round_trip_and_weak_or_foreign_tags_never_match() {
        let v = Version::new(42);
        assert_eq!(etag(v), "\"42\"");
        assert_eq!(parse_etag("\"42\""), Some(v));
        for bad in ["W/\"42\"", "42", "\"4x\"", "\"\""] {
            assert_eq!(parse_etag(bad), None, "{bad}");
        }
        let mut headers = HeaderMap::new();
        headers.insert(IF_MATCH, HeaderValue::from_static("W/\"42\""));
        assert_eq!(check_if_match(&headers, v), Err(Precondition::Failed { current: v }));
        headers.insert(IF_MATCH, HeaderValue::from_static("\"7\", \"42\""));
        assert_eq!(check_if_match(&headers, v), Ok(v));
        headers.insert(IF_MATCH, HeaderValue::from_static("*"));
        assert_eq!(check_if_match(&headers, v), Ok(v));
        assert_eq!(check_if_match(&headers, Version::ABSENT), Err(Precondition::Failed { current: Version::ABSENT }));
    }

    #[tokio::test]
    async fn refusals_are_problem_documents_saying_what_to_do() {
        let res: Response<http_body_util::Full<Bytes>> =
            Precondition::Failed { current: Version::new(5) }.into_response();
        assert_eq!(res.status(), StatusCode::PRECONDITION_FAILED);
        assert_eq!(res.headers()[CONTENT_TYPE], PROBLEM_JSON);
        assert_eq!(res.headers()[ETAG], "\"5\"");
        let doc: serde_json::Value =
            serde_json::from_slice(&res.into_body().collect().await.unwrap().to_bytes()).unwrap();
        assert_eq!(doc["status"], 412);
        assert!(doc["detail"].as_str().unwrap().contains("GET the resource again"), "{doc}");
        let res: Response<http_body_util::Full<Bytes>> = Precondition::Required.into_response();
        assert_eq!(res.status(), StatusCode::PRECONDITION_REQUIRED);
        let doc: serde_json::Value =
            serde_json::from_slice(&res.into_body().collect().await.unwrap().to_bytes()).unwrap();
        assert_eq!(doc["type"], "tag:idempotent-tower,2025:precondition-required");
    }
}
