//! gRPC calls: how they are recognised, fingerprinted and refused.
//!
//! A request whose `content-type` is `application/grpc` (or `application/grpc+proto`, and so on)
//! is a gRPC call; gRPC-Web (`application/grpc-web*`) is not (see `is_grpc`). A call's key
//! comes from the same header as for HTTP (`idempotency-key` metadata by default; gRPC metadata
//! keys are lowercase HTTP/2 headers), whatever the method list says.
//! Its fingerprint is the path (`/package.Service/Method`) and the request's message bytes as
//! framed on the wire. Refusals are trailers-only responses — HTTP 200 with `grpc-status` and
//! `grpc-message` in the headers and no body — because a gRPC client reads its status from
//! there, not from the HTTP status: a missing or invalid key is INVALID_ARGUMENT, another payload
//! under the key FAILED_PRECONDITION, a call still running ABORTED, the store down UNAVAILABLE.

use std::time::Duration;

use http::header::CONTENT_TYPE;
use http::{HeaderMap, HeaderValue, Response, StatusCode};
use idempotent_core::Fingerprint;

use super::body::ResponseBody;
use crate::GrpcCode;

/// Whether the request is a gRPC call: `application/grpc`, alone or followed by `+codec` or
/// parameters.
///
/// gRPC-Web (`application/grpc-web`, `application/grpc-web-text`, with or without a codec) is
/// not: its trailers travel inside the response body, so the response carries no `grpc-status`
/// for the store policy to read. It goes through the HTTP path instead (covered by its method,
/// POST; fingerprinted by its body; a 200 stored and replayed byte for byte, in-body trailers
/// included; refusals as HTTP problem documents).
pub(crate) fn is_grpc(headers: &HeaderMap) -> bool {
    const GRPC: &[u8] = b"application/grpc";
    let Some(ct) = headers.get(CONTENT_TYPE).map(HeaderValue::as_bytes) else {
        return false;
    };
    ct.len() >= GRPC.len()
        && ct[..GRPC.len()].eq_ignore_ascii_case(GRPC)
        && matches!(ct.get(GRPC.len()), None | Some(b'+' | b';' | b' ' | b'\t'))
}

/// The fingerprint of a gRPC call: its path and its framed message bytes.
pub(crate) fn fingerprint(path: &str, body: &[u8]) -> Fingerprint {
    Fingerprint::of_parts([&b"grpc"[..], path.as_bytes(), body])
}

/// A trailers-only response carrying `code` and `message`.
pub(crate) fn trailers_only<B>(
    code: GrpcCode,
    message: &str,
    retry_after: Option<Duration>,
) -> Response<ResponseBody<B>> {
    let mut res = Response::new(ResponseBody::empty());
    *res.status_mut() = StatusCode::OK;
    let h = res.headers_mut();
    h.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
    h.insert("grpc-status", HeaderValue::from(code.get()));
    if let Ok(v) = HeaderValue::from_str(&percent_encode(message)) {
        h.insert("grpc-message", v);
    }
    if let Some(after) = retry_after {
        // gRPC's own pushback hint, honoured by clients with a retry policy.
        h.insert("grpc-retry-pushback-ms", HeaderValue::from(after.as_millis().min(u64::MAX as u128) as u64));
    }
    res
}

/// Percent-encodes a `grpc-message` as the gRPC HTTP/2 protocol requires.
pub(crate) fn percent_encode(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    for b in message.bytes() {
        if (0x20..=0x7e).contains(&b) && b != b'%' {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::Empty;

    #[test]
    fn grpc_content_types_are_recognised() {
        for ct in ["application/grpc", "application/grpc+proto", "application/GRPC+json", "application/grpc; charset=x"]
        {
            let mut h = HeaderMap::new();
            h.insert(CONTENT_TYPE, HeaderValue::from_str(ct).unwrap());
            assert!(is_grpc(&h), "{ct}");
        }
        // gRPC-Web carries its trailers in the body: it takes the HTTP path.
        let web =
            ["application/grpc-web", "application/grpc-web+proto", "application/grpc-web-text", "application/grpcx"];
        for ct in web.into_iter().chain(["application/json", "application/grp", "text/plain"]) {
            let mut h = HeaderMap::new();
            h.insert(CONTENT_TYPE, HeaderValue::from_str(ct).unwrap());
            assert!(!is_grpc(&h), "{ct}");
        }
        assert!(!is_grpc(&HeaderMap::new()));
    }

    #[test]
    fn messages_are_percent_encoded() {
        assert_eq!(percent_encode("key in use: 50% done"), "key in use: 50%25 done");
        assert_eq!(percent_encode("é\n"), "%C3%A9%0A");
    }

    #[test]
    fn trailers_only_carries_the_status_in_headers() {
        let res = trailers_only::<Empty<bytes::Bytes>>(GrpcCode::ABORTED, "busy", Some(Duration::from_secs(2)));
        assert_eq!(res.status(), StatusCode::OK);
        assert_eq!(res.headers()["grpc-status"], "10");
        assert_eq!(res.headers()["grpc-message"], "busy");
        assert_eq!(res.headers()["grpc-retry-pushback-ms"], "2000");
        assert_eq!(res.headers()[CONTENT_TYPE], "application/grpc");
    }

    #[test]
    fn path_and_message_both_count() {
        assert_ne!(fingerprint("/a.S/M", b"x"), fingerprint("/a.S/N", b"x"));
        assert_ne!(fingerprint("/a.S/M", b"x"), fingerprint("/a.S/M", b"y"));
        assert_eq!(fingerprint("/a.S/M", b"x"), fingerprint("/a.S/M", b"x"));
    }
}
