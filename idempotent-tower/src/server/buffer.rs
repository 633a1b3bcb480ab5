//! Reading bodies into memory: the request body, whole, for its fingerprint; the response
//! body, up to the stored-response limit, for the store.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::{Pin, pin};
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http::header::CONTENT_LENGTH;
use http::{HeaderMap, Response};
use http_body::{Body, Frame};
use http_body_util::BodyExt;
use tower::BoxError;

/// Why a request body was not read.
pub(crate) enum ReadError {
    TooLarge,
    Failed(BoxError),
}

/// Reads the whole request body, refusing it as soon as it passes `limit` (whether or not it
/// announced its length).
pub(crate) async fn read_body<B>(
    headers: &HeaderMap,
    body: B,
    limit: usize,
) -> Result<(Bytes, Option<HeaderMap>), ReadError>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let announced = headers.get(CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    if announced.is_some_and(|n| n > limit as u64) || body.size_hint().lower() > limit as u64 {
        return Err(ReadError::TooLarge);
    }
    let mut body = pin!(body);
    let mut chunks = Chunks::default();
    let mut trailers = None;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| ReadError::Failed(e.into()))?;
        match frame.into_data() {
            Ok(data) => {
                if chunks.len + data.len() > limit {
                    return Err(ReadError::TooLarge);
                }
                chunks.push(data);
            }
            Err(frame) => {
                if let Ok(t) = frame.into_trailers() {
                    trailers = Some(t);
                }
            }
        }
    }
    Ok((chunks.into_bytes(), trailers))
}

/// Body chunks read so far; one chunk is kept as is (without a vector: most bodies are one
/// chunk), more are joined once at the end.
#[derive(Default)]
struct Chunks {
    first: Option<Bytes>,
    more: Vec<Bytes>,
    len: usize,
}

impl Chunks {
    fn push(&mut self, b: Bytes) {
        if b.is_empty() {
            return;
        }
        self.len += b.len();
        if self.first.is_none() {
            self.first = Some(b);
        } else {
            self.more.push(b);
        }
    }

    fn into_bytes(self) -> Bytes {
        match self.first {
            None => Bytes::new(),
            Some(first) if self.more.is_empty() => first,
            Some(first) => {
                let mut buf = BytesMut::with_capacity(self.len);
                buf.extend_from_slice(&first);
                for p in &self.more {
                    buf.extend_from_slice(p);
                }
                buf.freeze()
            }
        }
    }

    fn into_frames(self) -> VecDeque<Frame<Bytes>> {
        self.first.into_iter().chain(self.more).map(Frame::data).collect()
    }
}

/// A response body read up to the limit: whole, or the part read before it passed the limit
/// or failed.
pub(crate) enum Collected<B> {
    Complete { parts: http::response::Parts, data: Bytes, trailers: Option<HeaderMap> },
    TooLarge { parts: http::response::Parts, prefix: VecDeque<Frame<Bytes>>, rest: Pin<Box<B>> },
    Failed { parts: http::response::Parts, prefix: VecDeque<Frame<Bytes>>, error: BoxError },
}

/// Reads a response body up to `limit` bytes.
///
/// A future written by hand rather than an `async fn`: it is `Unpin`, so the layer can poll it
/// once in place and move it into the boxed rest of the request only when the body is not
/// complete at once.
pub(crate) struct Collect<B> {
    /// Taken when the future ends.
    parts: Option<http::response::Parts>,
    body: Option<Pin<Box<B>>>,
    chunks: Chunks,
    trailers: Option<HeaderMap>,
    limit: usize,
    started: bool,
}

impl<B> Collect<B> {
    fn new(res: Response<B>, limit: usize) -> Self {
        let (parts, body) = res.into_parts();
        Collect {
            parts: Some(parts),
            body: Some(Box::pin(body)),
            chunks: Chunks::default(),
            trailers: None,
            limit,
            started: false,
        }
    }

    fn too_large(&mut self) -> Collected<B> {
        let (parts, rest) = self.parts_and_body();
        Collected::TooLarge { parts, prefix: std::mem::take(&mut self.chunks).into_frames(), rest }
    }

    fn parts_and_body(&mut self) -> (http::response::Parts, Pin<Box<B>>) {
        let ended = "Collect polled after it ended";
        (self.parts.take().expect(ended), self.body.take().expect(ended))
    }
}

impl<B> Future for Collect<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Output = Collected<B>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Collected<B>> {
        let this = &mut *self;
        let Some(body) = this.body.as_mut() else {
            panic!("Collect polled after it ended");
        };
        if !this.started {
            this.started = true;
            if body.size_hint().lower() > this.limit as u64 {
                return Poll::Ready(this.too_large());
            }
        }
        loop {
            let Some(body) = this.body.as_mut() else {
                panic!("Collect polled after it ended");
            };
            let frame = match std::task::ready!(body.as_mut().poll_frame(cx)) {
                None => {
                    let (parts, _) = this.parts_and_body();
                    let data = std::mem::take(&mut this.chunks).into_bytes();
                    return Poll::Ready(Collected::Complete { parts, data, trailers: this.trailers.take() });
                }
                Some(Ok(frame)) => frame,
                Some(Err(e)) => {
                    let (parts, _) = this.parts_and_body();
                    let prefix = std::mem::take(&mut this.chunks).into_frames();
                    return Poll::Ready(Collected::Failed { parts, prefix, error: e.into() });
                }
            };
            match frame.into_data() {
                Ok(data) => {
                    let over = this.chunks.len + data.len() > this.limit;
                    this.chunks.push(data);
                    if over {
                        return Poll::Ready(this.too_large());
                    }
                }
                Err(frame) => {
                    if let Ok(t) = frame.into_trailers() {
                        this.trailers = Some(t);
                    }
                }
            }
        }
    }
}

/// Polls a [`Collect`] of `res` once: what it read if the body was complete at once, or the
/// `Collect` to go on with. Nothing is held across a suspension but the response itself.
pub(crate) fn collect_at_once<B>(
    res: Response<B>,
    limit: usize,
) -> impl Future<Output = Result<Collected<B>, Collect<B>>>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let mut res = Some(res);
    std::future::poll_fn(move |cx| {
        let mut collect = Collect::new(res.take().expect("polled after it ended"), limit);
        Poll::Ready(match Pin::new(&mut collect).poll(cx) {
            Poll::Ready(collected) => Ok(collected),
            Poll::Pending => Err(collect),
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_are_joined_in_order() {
        let mut one = Chunks::default();
        one.push(Bytes::from_static(b"only"));
        assert_eq!(one.into_bytes(), Bytes::from_static(b"only"));
        let mut many = Chunks::default();
        for part in [&b"ab"[..], b"", b"cd", b"e"] {
            many.push(Bytes::copy_from_slice(part));
        }
        assert_eq!(many.len, 5);
        let frames: Vec<Bytes> = many.into_frames().into_iter().map(|f| f.into_data().unwrap()).collect();
        assert_eq!(frames, [&b"ab"[..], b"cd", b"e"]);
        let mut again = Chunks::default();
        for part in [&b"ab"[..], b"cd", b"e"] {
            again.push(Bytes::copy_from_slice(part));
        }
        assert_eq!(again.into_bytes(), Bytes::from_static(b"abcde"));
        assert_eq!(Chunks::default().into_bytes(), Bytes::new());
    }
}
