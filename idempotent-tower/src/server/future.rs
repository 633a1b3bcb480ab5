//! The service's future.
//!
//! Requests the layer does not touch (other methods, no key) poll the inner service's future
//! directly, with no allocation. A covered request runs as one boxed `async` block: it awaits
//! the admission (body, fingerprint, acquire), then the inner service under the lease
//! heartbeat, then the storing of the response in a box of its own; written by hand that would be a state
//! machine of a dozen states and pin projections, for allocations that cost little next to the
//! store round trip they wait on (their sizes: BENCHMARKS.md, "Allocator and future-size
//! notes"). Once the inner service has answered, the rest (reading the response body, complete
//! or release) moves to a task of its own if this future is dropped (the client went away), so
//! that the key is not left held until its lease passes.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use futures_util::future::BoxFuture;
use http::Response;
use pin_project_lite::pin_project;

use super::body::ResponseBody;

pin_project! {
    /// Response future of [`Idempotency`](super::Idempotency).
    pub struct ResponseFuture<F, B, E> {
        #[pin]
        kind: Kind<F, B, E>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<F, B, E> {
        Passthrough { #[pin] future: F },
        Ready { response: Option<Response<ResponseBody<B>>> },
        Idempotent { future: BoxFuture<'static, Result<Response<ResponseBody<B>>, E>> },
    }
}

impl<F, B, E> ResponseFuture<F, B, E> {
    pub(crate) fn passthrough(future: F) -> Self {
        ResponseFuture { kind: Kind::Passthrough { future } }
    }

    pub(crate) fn ready(response: Response<ResponseBody<B>>) -> Self {
        ResponseFuture { kind: Kind::Ready { response: Some(response) } }
    }

    pub(crate) fn boxed(future: BoxFuture<'static, Result<Response<ResponseBody<B>>, E>>) -> Self {
        ResponseFuture { kind: Kind::Idempotent { future } }
    }
}

impl<F, B, E> std::fmt::Debug for ResponseFuture<F, B, E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match &self.kind {
            Kind::Passthrough { .. } => "Passthrough",
            Kind::Ready { .. } => "Ready",
            Kind::Idempotent { .. } => "Idempotent",
        };
        f.debug_struct("ResponseFuture").field("kind", &kind).finish()
    }
}

impl<F, B, E> Future for ResponseFuture<F, B, E>
where
    F: Future<Output = Result<Response<B>, E>>,
{
    type Output = Result<Response<ResponseBody<B>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().kind.project() {
            KindProj::Passthrough { future } => {
                let res = ready!(future.poll(cx))?;
                Poll::Ready(Ok(res.map(ResponseBody::stream)))
            }
            KindProj::Ready { response } => {
                Poll::Ready(Ok(response.take().expect("ResponseFuture polled after completion")))
            }
            KindProj::Idempotent { future } => future.as_mut().poll(cx),
        }
    }
}
