//! The layer's refusals, as RFC 9457 problem details (HTTP) or gRPC statuses.
//!
//! Every refusal says what happened and what the client should do next. HTTP refusals are
//! `application/problem+json` documents:
//!
//! ```json
//! {"type":"tag:idempotent-tower,2025:key-in-use","title":"Request in progress","status":409,
//!  "detail":"A request with this Idempotency-Key is still being processed. Retry after the time in Retry-After to get its response."}
//! ```
//!
//! The `type` URIs are `tag:` URIs (RFC 4151, as RFC 9457 §3.1.1 suggests for types that are not
//! meant to be dereferenced); clients match on them. Refusals that a retry can cure (409, 503)
//! carry `Retry-After`.

use std::time::Duration;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderValue, Response, StatusCode};

use super::body::ResponseBody;
use super::grpc;
use super::key::KeyError;
use crate::GrpcCode;

/// Why the layer answered instead of the service.
#[derive(Debug)]
pub(crate) enum Refusal {
    MissingKey {
        header: String,
    },
    InvalidKey {
        header: String,
        error: KeyError,
    },
    BodyTooLarge {
        limit: usize,
    },
    BodyUnreadable,
    Mismatch {
        header: String,
    },
    InFlight {
        header: String,
        retry_after: Duration,
    },
    /// A previous attempt could not tell whether its effect happened; the record waits to be
    /// resolved.
    NeedsAttention {
        header: String,
        attempt: u32,
    },
    StoreUnavailable {
        retry_after: Duration,
    },
    StoreError,
    Corrupt,
    /// The layer's own configuration is invalid (a lease or retention out of bounds).
    Misconfigured {
        reason: String,
    },
}

impl Refusal {
    fn status(&self) -> StatusCode {
        match self {
            Refusal::MissingKey { .. } | Refusal::InvalidKey { .. } | Refusal::BodyUnreadable => {
                StatusCode::BAD_REQUEST
            }
            Refusal::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            Refusal::Mismatch { .. } => StatusCode::UNPROCESSABLE_ENTITY,
            Refusal::InFlight { .. } | Refusal::NeedsAttention { .. } => StatusCode::CONFLICT,
            Refusal::StoreUnavailable { .. } => StatusCode::SERVICE_UNAVAILABLE,
            Refusal::StoreError | Refusal::Corrupt | Refusal::Misconfigured { .. } => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    fn code(&self) -> GrpcCode {
        match self {
            Refusal::MissingKey { .. } | Refusal::InvalidKey { .. } | Refusal::BodyUnreadable => {
                GrpcCode::INVALID_ARGUMENT
            }
            Refusal::BodyTooLarge { .. } => GrpcCode::RESOURCE_EXHAUSTED,
            Refusal::Mismatch { .. } | Refusal::NeedsAttention { .. } => GrpcCode::FAILED_PRECONDITION,
            Refusal::InFlight { .. } => GrpcCode::ABORTED,
            Refusal::StoreUnavailable { .. } => GrpcCode::UNAVAILABLE,
            Refusal::StoreError | Refusal::Corrupt | Refusal::Misconfigured { .. } => GrpcCode::INTERNAL,
        }
    }

    fn kind(&self) -> (&'static str, &'static str) {
        match self {
            Refusal::MissingKey { .. } => ("key-missing", "Idempotency key required"),
            Refusal::InvalidKey { .. } => ("key-invalid", "Invalid idempotency key"),
            Refusal::BodyTooLarge { .. } => ("body-too-large", "Request body too large"),
            Refusal::BodyUnreadable => ("body-unreadable", "Request body could not be read"),
            Refusal::Mismatch { .. } => ("key-reused", "Idempotency key reused with another request"),
            Refusal::InFlight { .. } => ("key-in-use", "Request in progress"),
            Refusal::NeedsAttention { .. } => ("needs-attention", "Outcome unknown: needs attention"),
            Refusal::StoreUnavailable { .. } => ("store-unavailable", "Idempotency store unavailable"),
            Refusal::StoreError => ("store-error", "Idempotency store error"),
            Refusal::Corrupt => ("record-corrupt", "Stored response unreadable"),
            Refusal::Misconfigured { .. } => ("misconfigured", "Idempotency layer misconfigured"),
        }
    }

    /// What happened and what to do, in HTTP or gRPC terms.
    pub(crate) fn detail(&self, grpc: bool) -> String {
        let (field, request, parts, wait) = if grpc {
            ("metadata entry", "call", "method or message", "retry with backoff")
        } else {
            ("header", "request", "method, path, query or body", "retry after the time in Retry-After")
        };
        match self {
            Refusal::MissingKey { header } => format!(
                "This operation requires an {header} {field}. Generate a unique key (for example a UUID) \
                 for the operation and send the same key with every retry of it."
            ),
            Refusal::InvalidKey { header, error } => {
                format!("The {header} {field} is invalid: {error}. The {request} was not processed.")
            }
            Refusal::BodyTooLarge { limit } => format!(
                "A {request} with an idempotency key may carry at most {limit} bytes of body. It was not \
                 processed; send a smaller one."
            ),
            Refusal::BodyUnreadable => format!(
                "The {request} body ended with an error before it was complete. It was not processed; \
                 send it again with the same key."
            ),
            Refusal::Mismatch { header } => format!(
                "This {header} was already used for a {request} with a different {parts}. This {request} \
                 was not processed. Retry with the original {request}, or use a new key for a new operation."
            ),
            Refusal::InFlight { header, .. } => format!(
                "A {request} with this {header} is still being processed, so this one was not processed \
                 again; {wait} to get the first {request}'s response."
            ),
            Refusal::NeedsAttention { header, attempt } => format!(
                "An earlier attempt (number {attempt}) at the {request} with this {header} may or may not \
                 have taken effect, and the service could not tell which, so it was not processed again. \
                 It will not be until an operator resolves it; do not retry with this key. Contact the \
                 service operator with the key."
            ),
            Refusal::StoreUnavailable { .. } => format!(
                "The idempotency store could not be reached, so the {request} was not processed (running \
                 it unprotected could repeat its effect); {wait} with the same key."
            ),
            Refusal::StoreError => format!(
                "The idempotency store answered with an error; the {request} was not processed. Retry \
                 later with the same key."
            ),
            Refusal::Corrupt => format!(
                "A response was stored for this key but cannot be read back, so it is not replayed and \
                 the {request} was not processed again. Contact the service operator; do not retry with \
                 this key."
            ),
            Refusal::Misconfigured { reason } => format!(
                "The service's idempotency layer is misconfigured ({reason}), so the {request} was not \
                 processed. Contact the service operator."
            ),
        }
    }

    fn retry_after(&self) -> Option<Duration> {
        match self {
            Refusal::InFlight { retry_after, .. } | Refusal::StoreUnavailable { retry_after } => Some(*retry_after),
            _ => None,
        }
    }

    /// The refusal as an HTTP problem response, or a gRPC trailers-only response.
    pub(crate) fn into_response<B>(self, grpc: bool) -> Response<ResponseBody<B>> {
        if grpc {
            return grpc::trailers_only(self.code(), &self.detail(true), self.retry_after());
        }
        let status = self.status();
        let (slug, title) = self.kind();
        let doc = problem_document(status, slug, title, &self.detail(false));
        let mut res = Response::new(ResponseBody::full(doc, None));
        *res.status_mut() = status;
        res.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
        if let Some(after) = self.retry_after() {
            res.headers_mut().insert(RETRY_AFTER, HeaderValue::from(retry_after_secs(after)));
        }
        res
    }
}

/// The media type of problem documents.
pub(crate) const PROBLEM_JSON: &str = "application/problem+json";

/// An RFC 9457 problem document of type `tag:idempotent-tower,2025:{slug}`.
pub(crate) fn problem_document(status: StatusCode, slug: &str, title: &str, detail: &str) -> Bytes {
    let doc = serde_json::json!({
        "type": format!("tag:idempotent-tower,2025:{slug}"),
        "title": title,
        "status": status.as_u16(),
        "detail": detail,
    });
    Bytes::from(doc.to_string())
}

/// `Retry-After` in whole seconds, rounded up and at least 1 (0 would invite a busy loop).
pub(crate) fn retry_after_secs(after: Duration) -> u64 {
    let secs = after.as_secs() + u64::from(after.subsec_nanos() > 0);
    secs.max(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{BodyExt, Empty};

    type Res = Response<ResponseBody<Empty<Bytes>>>;

    async fn json(res: Res) -> serde_json::Value {
        serde_json::from_slice(&res.into_body().collect().await.unwrap().to_bytes()).unwrap()
    }

    #[tokio::test]
    async fn http_refusals_are_problem_documents() {
        let res: Res = Refusal::InFlight { header: "Idempotency-Key".into(), retry_after: Duration::from_millis(1500) }
            .into_response(false);
        assert_eq!(res.status(), StatusCode::CONFLICT);
        assert_eq!(res.headers()[CONTENT_TYPE], "application/problem+json");
        assert_eq!(res.headers()[RETRY_AFTER], "2");
        let doc = json(res).await;
        assert_eq!(doc["status"], 409);
        assert_eq!(doc["type"], "tag:idempotent-tower,2025:key-in-use");
        assert!(doc["detail"].as_str().unwrap().contains("Retry-After"));
    }

    #[tokio::test]
    async fn needs_attention_is_a_conflict_without_retry_after() {
        let res: Res = Refusal::NeedsAttention { header: "Idempotency-Key".into(), attempt: 3 }.into_response(false);
        assert_eq!(res.status(), StatusCode::CONFLICT);
        assert!(res.headers().get(RETRY_AFTER).is_none(), "a retry cannot cure it");
        let doc = json(res).await;
        assert_eq!(doc["type"], "tag:idempotent-tower,2025:needs-attention");
        let detail = doc["detail"].as_str().unwrap();
        assert!(detail.contains("number 3") && detail.contains("do not retry"), "{detail}");
    }

    #[test]
    fn grpc_refusals_are_statuses() {
        let cases: [(Refusal, &str); 6] = [
            (Refusal::NeedsAttention { header: "k".into(), attempt: 2 }, "9"),
            (Refusal::MissingKey { header: "idempotency-key".into() }, "3"),
            (Refusal::Mismatch { header: "idempotency-key".into() }, "9"),
            (Refusal::InFlight { header: "k".into(), retry_after: Duration::from_secs(1) }, "10"),
            (Refusal::StoreUnavailable { retry_after: Duration::from_secs(1) }, "14"),
            (Refusal::Corrupt, "13"),
        ];
        for (refusal, code) in cases {
            let res: Res = refusal.into_response(true);
            assert_eq!(res.status(), StatusCode::OK);
            assert_eq!(res.headers()["grpc-status"], code);
        }
    }

    #[test]
    fn retry_after_rounds_up_to_whole_seconds() {
        assert_eq!(retry_after_secs(Duration::ZERO), 1);
        assert_eq!(retry_after_secs(Duration::from_millis(10)), 1);
        assert_eq!(retry_after_secs(Duration::from_secs(3)), 3);
        assert_eq!(retry_after_secs(Duration::from_millis(3001)), 4);
    }
}
