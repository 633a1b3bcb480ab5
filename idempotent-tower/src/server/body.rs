//! The request and response bodies the layer hands on.
//!
//! A request with a key has its body read in full (to fingerprint it) before the inner service
//! sees it, so the inner service gets a [`RequestBody`] that is either the original stream
//! (requests the layer does not cover) or the buffered bytes. Responses are a [`ResponseBody`]:
//! the inner body passed through, a buffered or replayed body with its trailers, or a refusal.

use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;
use tower::BoxError;

pin_project! {
    /// The request body the inner service receives.
    pub struct RequestBody<B> {
        #[pin]
        kind: RequestKind<B>,
    }
}

pin_project! {
    #[project = RequestKindProj]
    enum RequestKind<B> {
        Stream { #[pin] body: B },
        Full { data: Option<Bytes>, trailers: Option<HeaderMap> },
    }
}

impl<B> RequestBody<B> {
    pub(crate) fn stream(body: B) -> Self {
        RequestBody { kind: RequestKind::Stream { body } }
    }

    pub(crate) fn full(data: Bytes, trailers: Option<HeaderMap>) -> Self {
        let data = if data.is_empty() { None } else { Some(data) };
        RequestBody { kind: RequestKind::Full { data, trailers } }
    }
}

impl<B> std::fmt::Debug for RequestBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.kind {
            RequestKind::Stream { .. } => f.write_str("RequestBody::Stream"),
            RequestKind::Full { data, .. } => {
                write!(f, "RequestBody::Full({} bytes)", data.as_ref().map_or(0, Bytes::len))
            }
        }
    }
}

impl<B> Body for RequestBody<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.project().kind.project() {
            RequestKindProj::Stream { body } => body.poll_frame(cx).map_err(Into::into),
            RequestKindProj::Full { data, trailers } => Poll::Ready(full_frame(data, trailers).map(Ok)),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            RequestKind::Stream { body } => body.is_end_stream(),
            RequestKind::Full { data, trailers } => data.is_none() && trailers.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            RequestKind::Stream { body } => body.size_hint(),
            RequestKind::Full { data, .. } => SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64)),
        }
    }
}

fn full_frame(data: &mut Option<Bytes>, trailers: &mut Option<HeaderMap>) -> Option<Frame<Bytes>> {
    if let Some(d) = data.take() {
        return Some(Frame::data(d));
    }
    trailers.take().map(Frame::trailers)
}

pin_project! {
    /// The response body the layer returns: the inner service's body, or one the layer built
    /// (a replay, a buffered first response, or a refusal).
    pub struct ResponseBody<B> {
        #[pin]
        kind: ResponseKind<B>,
    }
}

pin_project! {
    #[project = ResponseKindProj]
    enum ResponseKind<B> {
        Stream { #[pin] body: B },
        // The inner body, after the frames already read from it (boxed: it was pinned to read).
        Resumed { prefix: VecDeque<Frame<Bytes>>, body: Pin<Box<B>> },
        Full { data: Option<Bytes>, trailers: Option<HeaderMap> },
        // The inner body failed after `prefix`; the error is passed on so the connection shows it.
        Failed { prefix: VecDeque<Frame<Bytes>>, error: Option<BoxError> },
    }
}

impl<B> ResponseBody<B> {
    pub(crate) fn stream(body: B) -> Self {
        ResponseBody { kind: ResponseKind::Stream { body } }
    }

    pub(crate) fn resume(prefix: VecDeque<Frame<Bytes>>, body: Pin<Box<B>>) -> Self {
        ResponseBody { kind: ResponseKind::Resumed { prefix, body } }
    }

    pub(crate) fn full(data: Bytes, trailers: Option<HeaderMap>) -> Self {
        let data = if data.is_empty() { None } else { Some(data) };
        ResponseBody { kind: ResponseKind::Full { data, trailers } }
    }

    pub(crate) fn empty() -> Self {
        ResponseBody { kind: ResponseKind::Full { data: None, trailers: None } }
    }

    pub(crate) fn failed(prefix: VecDeque<Frame<Bytes>>, error: BoxError) -> Self {
        ResponseBody { kind: ResponseKind::Failed { prefix, error: Some(error) } }
    }
}

impl<B> std::fmt::Debug for ResponseBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.kind {
            ResponseKind::Stream { .. } => f.write_str("ResponseBody::Stream"),
            ResponseKind::Resumed { .. } => f.write_str("ResponseBody::Resumed"),
            ResponseKind::Full { data, .. } => {
                write!(f, "ResponseBody::Full({} bytes)", data.as_ref().map_or(0, Bytes::len))
            }
            ResponseKind::Failed { .. } => f.write_str("ResponseBody::Failed"),
        }
    }
}

impl<B> Body for ResponseBody<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.project().kind.project() {
            ResponseKindProj::Stream { body } => body.poll_frame(cx).map_err(Into::into),
            ResponseKindProj::Resumed { prefix, body } => match prefix.pop_front() {
                Some(frame) => Poll::Ready(Some(Ok(frame))),
                None => body.as_mut().poll_frame(cx).map_err(Into::into),
            },
            ResponseKindProj::Full { data, trailers } => Poll::Ready(full_frame(data, trailers).map(Ok)),
            ResponseKindProj::Failed { prefix, error } => Poll::Ready(match prefix.pop_front() {
                Some(frame) => Some(Ok(frame)),
                None => error.take().map(Err),
            }),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            ResponseKind::Stream { body } => body.is_end_stream(),
            ResponseKind::Resumed { prefix, body } => prefix.is_empty() && body.is_end_stream(),
            ResponseKind::Full { data, trailers } => data.is_none() && trailers.is_none(),
            ResponseKind::Failed { prefix, error } => prefix.is_empty() && error.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            ResponseKind::Stream { body } => body.size_hint(),
            ResponseKind::Resumed { prefix, body } => {
                let buffered: u64 = prefix.iter().filter_map(Frame::data_ref).map(|d| d.len() as u64).sum();
                let inner = body.size_hint();
                let mut hint = SizeHint::new();
                hint.set_lower(inner.lower() + buffered);
                if let Some(upper) = inner.upper() {
                    hint.set_upper(upper + buffered);
                }
                hint
            }
            ResponseKind::Full { data, .. } => SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64)),
            ResponseKind::Failed { .. } => SizeHint::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{BodyExt, Empty, Full};

    #[tokio::test]
    async fn full_bodies_yield_data_then_trailers() {
        let mut t = HeaderMap::new();
        t.insert("grpc-status", "0".parse().unwrap());
        let body: ResponseBody<Empty<Bytes>> = ResponseBody::full(Bytes::from_static(b"abc"), Some(t.clone()));
        assert_eq!(body.size_hint().exact(), Some(3));
        let collected = body.collect().await.unwrap();
        assert_eq!(collected.trailers(), Some(&t));
        assert_eq!(collected.to_bytes(), "abc");
        assert!(ResponseBody::<Empty<Bytes>>::empty().is_end_stream());
    }

    #[tokio::test]
    async fn resumed_bodies_replay_the_prefix_first() {
        let prefix = VecDeque::from([Frame::data(Bytes::from_static(b"ab"))]);
        let body = ResponseBody::resume(prefix, Box::pin(Full::new(Bytes::from_static(b"cd"))));
        assert_eq!(body.size_hint().exact(), Some(4));
        assert_eq!(body.collect().await.unwrap().to_bytes(), "abcd");
    }

    #[tokio::test]
    async fn failed_bodies_end_with_the_error() {
        let prefix = VecDeque::from([Frame::data(Bytes::from_static(b"ab"))]);
        let mut body = ResponseBody::<Empty<Bytes>>::failed(prefix, "boom".into());
        assert_eq!(body.frame().await.unwrap().unwrap().into_data().unwrap(), "ab");
        assert_eq!(body.frame().await.unwrap().unwrap_err().to_string(), "boom");
        assert!(body.frame().await.is_none());
    }

    #[tokio::test]
    async fn request_bodies_pass_through_or_replay_the_buffer() {
        let body = RequestBody::full(Bytes::from_static(b"xyz"), None);
        assert_eq!(RequestBody::<Empty<Bytes>>::collect(body).await.unwrap().to_bytes(), "xyz");
        let body = RequestBody::stream(Full::new(Bytes::from_static(b"xyz")));
        assert_eq!(body.collect().await.unwrap().to_bytes(), "xyz");
    }
}
