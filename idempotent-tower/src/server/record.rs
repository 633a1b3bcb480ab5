//! The stored form of a response.
//!
//! The store keeps opaque bytes; this module decides what they are. The format is a small binary
//! framing, every length written in front of its bytes, all integers big-endian:
//!
//! ```text
//! "IDRS"  u8 version (1)  u16 status
//! u32 header count   { u16 name length, name, u32 value length, value } …
//! u64 body length    body
//! u8 trailers flag (0 none, 1 present)  [u32 trailer count  { same as headers } …]
//! ```
//!
//! Header names are stored lowercase as `http` gives them, and a name with several values is
//! written once per value, in order, so `Set-Cookie` and other multi-valued fields come back
//! intact. Hop-by-hop fields (RFC 9110 §7.6.1: `Connection` and the fields it names,
//! `Keep-Alive`, `Proxy-Connection`, `TE`, `Transfer-Encoding`, `Upgrade`) and `Content-Length`
//! (framing, which the server recomputes from the exact body) are not stored.
//!
//! Decoding checks every length against the remaining bytes, every name, value and status for
//! validity, and that nothing follows the last field: anything else is a [`DecodeError`], never a
//! panic, and garbage is never replayed.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::header::{CONNECTION, CONTENT_LENGTH, TE, TRANSFER_ENCODING, UPGRADE};
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};

const MAGIC: &[u8; 4] = b"IDRS";
const VERSION: u8 = 1;

/// A response as stored: status, headers, the whole body and the trailers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StoredResponse {
    pub(crate) status: StatusCode,
    pub(crate) headers: HeaderMap,
    pub(crate) body: Bytes,
    pub(crate) trailers: Option<HeaderMap>,
}

/// Why stored bytes are not a response this module wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DecodeError(pub(crate) &'static str);

impl std::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0)
    }
}

/// Whether a header must not be stored or replayed.
pub(crate) fn is_hop_by_hop(name: &HeaderName, headers: &HeaderMap) -> bool {
    if name == CONNECTION || name == TE || name == TRANSFER_ENCODING || name == UPGRADE || name == CONTENT_LENGTH {
        return true;
    }
    if name.as_str() == "keep-alive" || name.as_str() == "proxy-connection" {
        return true;
    }
    // Fields named by `Connection` are hop-by-hop for this message.
    headers.get_all(CONNECTION).iter().filter_map(|v| v.to_str().ok()).flat_map(|v| v.split(',')).any(|token| {
        let token = token.trim();
        !token.is_empty() && name.as_str().eq_ignore_ascii_case(token)
    })
}

/// Removes the hop-by-hop fields from `headers`.
pub(crate) fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let drop: Vec<HeaderName> = headers.keys().filter(|n| is_hop_by_hop(n, headers)).cloned().collect();
    for name in drop {
        headers.remove(name);
    }
}

impl StoredResponse {
    /// The stored bytes.
    pub(crate) fn encode(&self) -> Bytes {
        encode(self.status, &self.headers, &self.body, self.trailers.as_ref())
    }

    /// Reads stored bytes back.
    pub(crate) fn decode(mut buf: Bytes) -> Result<StoredResponse, DecodeError> {
        if buf.len() < MAGIC.len() + 1 || &buf[..4] != MAGIC {
            return Err(DecodeError("not a stored HTTP response (bad magic)"));
        }
        buf.advance(4);
        if buf.get_u8() != VERSION {
            return Err(DecodeError("stored by an unknown format version"));
        }
        let status = take_u16(&mut buf)?;
        let status = StatusCode::from_u16(status).map_err(|_| DecodeError("invalid status code"))?;
        // Two fields to spare: a replay adds `Idempotent-Replayed`, and the server `Content-Length`.
        let headers = take_fields(&mut buf, 2)?;
        let body_len = take_u64(&mut buf)?;
        let body_len = usize::try_from(body_len).map_err(|_| DecodeError("body length out of range"))?;
        let body = take_bytes(&mut buf, body_len)?;
        let trailers = match take_u8(&mut buf)? {
            0 => None,
            1 => Some(take_fields(&mut buf, 0)?),
            _ => return Err(DecodeError("invalid trailers flag")),
        };
        if buf.has_remaining() {
            return Err(DecodeError("trailing bytes after the stored response"));
        }
        Ok(StoredResponse { status, headers, body, trailers })
    }
}

/// The stored bytes of a response, from its parts (nothing is copied but into the output).
pub(crate) fn encode(status: StatusCode, headers: &HeaderMap, body: &[u8], trailers: Option<&HeaderMap>) -> Bytes {
    // Sized exactly: a buffer filled to its capacity becomes `Bytes` without another allocation.
    let len = MAGIC.len()
        + 1
        + 2
        + fields_len(headers, true)
        + 8
        + body.len()
        + 1
        + trailers.map_or(0, |t| fields_len(t, false));
    let mut out = BytesMut::with_capacity(len);
    out.put_slice(MAGIC);
    out.put_u8(VERSION);
    out.put_u16(status.as_u16());
    put_fields(&mut out, headers, true);
    out.put_u64(body.len() as u64);
    out.put_slice(body);
    match trailers {
        None => out.put_u8(0),
        Some(t) => {
            out.put_u8(1);
            put_fields(&mut out, t, false);
        }
    }
    debug_assert_eq!(out.len(), len, "encode's length");
    out.freeze()
}

/// The fields that are stored: all of them, or (`strip`) all but the hop-by-hop ones.
fn stored_fields(fields: &HeaderMap, strip: bool) -> impl Iterator<Item = (&HeaderName, &HeaderValue)> {
    fields.iter().filter(move |(name, _)| !strip || !is_hop_by_hop(name, fields))
}

/// The encoded length of `fields` (see `put_fields`).
fn fields_len(fields: &HeaderMap, strip: bool) -> usize {
    4 + stored_fields(fields, strip).map(|(name, value)| 2 + name.as_str().len() + 4 + value.len()).sum::<usize>()
}

fn put_fields(out: &mut BytesMut, fields: &HeaderMap, strip: bool) {
    // One pass over the fields: the count is written in front once it is known.
    let count_at = out.len();
    out.put_u32(0);
    let mut count: u32 = 0;
    for (name, value) in stored_fields(fields, strip) {
        count += 1;
        // `http` bounds names well below u16::MAX and values below u32::MAX.
        out.put_u16(name.as_str().len() as u16);
        out.put_slice(name.as_str().as_bytes());
        out.put_u32(value.len() as u32);
        out.put_slice(value.as_bytes());
    }
    out[count_at..count_at + 4].copy_from_slice(&count.to_be_bytes());
}

fn take_fields(buf: &mut Bytes, spare: usize) -> Result<HeaderMap, DecodeError> {
    let count = take_u32(buf)? as usize;
    // Each field needs at least 6 length bytes: a count beyond that is a lie, not an allocation.
    if count > buf.remaining() / 6 {
        return Err(DecodeError("field count larger than the record"));
    }
    let mut map = HeaderMap::try_with_capacity(count + spare).map_err(|_| DecodeError("too many fields"))?;
    for _ in 0..count {
        let name_len = take_u16(buf)? as usize;
        let name = take_bytes(buf, name_len)?;
        let name = HeaderName::from_bytes(&name).map_err(|_| DecodeError("invalid field name"))?;
        let value_len = take_u32(buf)? as usize;
        let value = take_bytes(buf, value_len)?;
        let value = HeaderValue::from_maybe_shared(value).map_err(|_| DecodeError("invalid field value"))?;
        map.try_append(name, value).map_err(|_| DecodeError("too many fields"))?;
    }
    Ok(map)
}

fn take_bytes(buf: &mut Bytes, n: usize) -> Result<Bytes, DecodeError> {
    if buf.remaining() < n {
        return Err(DecodeError("truncated record"));
    }
    Ok(buf.split_to(n))
}

fn take_u8(buf: &mut Bytes) -> Result<u8, DecodeError> {
    buf.try_get_u8().map_err(|_| DecodeError("truncated record"))
}

fn take_u16(buf: &mut Bytes) -> Result<u16, DecodeError> {
    buf.try_get_u16().map_err(|_| DecodeError("truncated record"))
}

fn take_u32(buf: &mut Bytes) -> Result<u32, DecodeError> {
    buf.try_get_u32().map_err(|_| DecodeError("truncated record"))
}

fn take_u64(buf: &mut Bytes) -> Result<u64, DecodeError> {
    buf.try_get_u64().map_err(|_| DecodeError("truncated record"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample() -> StoredResponse {
        let mut headers = HeaderMap::new();
        headers.append("set-cookie", HeaderValue::from_static("a=1; Path=/"));
        headers.append("set-cookie", HeaderValue::from_static("b=2; HttpOnly"));
        headers.append("content-type", HeaderValue::from_static("application/json"));
        headers.append("x-opaque", HeaderValue::from_bytes(b"caf\xe9").unwrap());
        let mut trailers = HeaderMap::new();
        trailers.append("grpc-status", HeaderValue::from_static("0"));
        trailers.append("grpc-message", HeaderValue::from_static(""));
        StoredResponse {
            status: StatusCode::CREATED,
            headers,
            body: Bytes::from_static(b"\x00\xff{\"id\":1}\r\n"),
            trailers: Some(trailers),
        }
    }

    #[test]
    fn round_trip_keeps_every_value_in_order() {
        let r = sample();
        let back = StoredResponse::decode(r.encode()).unwrap();
        assert_eq!(back, r);
        let cookies: Vec<_> = back.headers.get_all("set-cookie").iter().collect();
        assert_eq!(cookies, ["a=1; Path=/", "b=2; HttpOnly"]);
        let none = StoredResponse { trailers: None, body: Bytes::new(), ..sample() };
        assert_eq!(StoredResponse::decode(none.encode()).unwrap(), none);
        let empty_trailers = StoredResponse { trailers: Some(HeaderMap::new()), ..sample() };
        assert_eq!(StoredResponse::decode(empty_trailers.encode()).unwrap(), empty_trailers);
    }

    #[test]
    fn hop_by_hop_and_framing_fields_are_not_stored() {
        let mut r = sample();
        r.headers.insert("connection", HeaderValue::from_static("keep-alive, x-hop"));
        r.headers.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        r.headers.insert("x-hop", HeaderValue::from_static("1"));
        r.headers.insert("transfer-encoding", HeaderValue::from_static("chunked"));
        r.headers.insert("upgrade", HeaderValue::from_static("h2c"));
        r.headers.insert("content-length", HeaderValue::from_static("11"));
        r.headers.insert("proxy-connection", HeaderValue::from_static("close"));
        let back = StoredResponse::decode(r.encode()).unwrap();
        assert_eq!(back, sample());
    }

    #[test]
    fn garbage_is_an_error() {
        for bad in [&b""[..], b"IDRS", b"IDRS\x02\x00\xc8", b"XXXX\x01\x00\xc8", b"{\"status\":200}"] {
            assert!(StoredResponse::decode(Bytes::copy_from_slice(bad)).is_err(), "{bad:?}");
        }
        let mut trailing = sample().encode().to_vec();
        trailing.push(0);
        assert_eq!(
            StoredResponse::decode(trailing.into()),
            Err(DecodeError("trailing bytes after the stored response"))
        );
        let mut bad_status = sample().encode().to_vec();
        bad_status[5..7].copy_from_slice(&1000u16.to_be_bytes());
        assert_eq!(StoredResponse::decode(bad_status.into()), Err(DecodeError("invalid status code")));
        // A huge field count with no bytes behind it is refused before allocating.
        let mut huge = b"IDRS\x01\x00\xc8".to_vec();
        huge.extend_from_slice(&u32::MAX.to_be_bytes());
        assert_eq!(StoredResponse::decode(huge.into()), Err(DecodeError("field count larger than the record")));
    }

    #[test]
    fn every_truncation_is_an_error() {
        let full = sample().encode();
        for n in 0..full.len() {
            assert!(StoredResponse::decode(full.slice(..n)).is_err(), "prefix of {n} bytes decoded");
        }
    }

    proptest! {
        #[test]
        fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = StoredResponse::decode(Bytes::from(bytes));
        }

        #[test]
        fn flipped_bytes_never_panic(pos in 0usize..200, byte in any::<u8>()) {
            let mut b = sample().encode().to_vec();
            let i = pos % b.len();
            b[i] = byte;
            if let Ok(r) = StoredResponse::decode(Bytes::from(b)) {
                // Whatever decodes is a valid response again.
                prop_assert!(StoredResponse::decode(r.encode()).is_ok());
            }
        }

        #[test]
        fn random_prefix_after_magic_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..128)) {
            let mut b = b"IDRS\x01".to_vec();
            b.extend(bytes);
            let _ = StoredResponse::decode(Bytes::from(b));
        }
    }
}
