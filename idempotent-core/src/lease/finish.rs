//! Futures that finish what they started: [`FinishOnDrop`], and a single poll for the heartbeat.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

/// Runs a future in place; if dropped before the future ends, hands it to a task of its own so
/// that it still runs to the end (its output is then dropped).
///
/// Storing an outcome must not depend on the caller still waiting. This costs less than
/// spawning up front (no task, no wake-up across threads) in the usual case where the caller is
/// still there: one box, so that the future can move to a task after it was first polled.
#[must_use = "futures do nothing unless polled"]
pub struct FinishOnDrop<F: Future + Send + 'static> {
    future: Option<Pin<Box<F>>>,
}

impl<F: Future + Send + 'static> FinishOnDrop<F> {
    /// Wraps `future`.
    pub fn new(future: F) -> Self {
        FinishOnDrop { future: Some(Box::pin(future)) }
    }
}

impl<F: Future + Send + 'static> std::fmt::Debug for FinishOnDrop<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FinishOnDrop").field("finished", &self.future.is_none()).finish()
    }
}

// Nothing is pinned in place: the future is boxed.
impl<F: Future + Send + 'static> Unpin for FinishOnDrop<F> {}

impl<F: Future + Send + 'static> Future for FinishOnDrop<F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        // Taken out while polled: a future that panics is dropped with the unwinding, not
        // handed to a task that would poll it again.
        let Some(mut future) = self.future.take() else {
            panic!("FinishOnDrop polled after it completed");
        };
        match future.as_mut().poll(cx) {
            Poll::Ready(out) => Poll::Ready(out),
            Poll::Pending => {
                self.future = Some(future);
                Poll::Pending
            }
        }
    }
}

impl<F: Future + Send + 'static> Drop for FinishOnDrop<F> {
    fn drop(&mut self) {
        let Some(future) = self.future.take() else { return };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => drop(runtime.spawn(async move { drop(future.await) })),
            Err(_) => tracing::warn!(
                "idempotent.store_error: dropped outside a tokio runtime before the outcome was stored; the key frees itself when the lease runs out"
            ),
        }
    }
}

/// Polls `future` once: its output if it is ready, `None` if it is pending (it has then
/// registered the task for a wake-up, as any poll does).
///
/// The heartbeat uses it to skip its timer for work that is done at once: tokio takes its
/// timer driver's lock to drop even a timer that was never polled.
pub(super) async fn poll_once<F: Future>(mut future: Pin<&mut F>) -> Option<F::Output> {
    std::future::poll_fn(|cx| {
        Poll::Ready(match future.as_mut().poll(cx) {
            Poll::Ready(out) => Some(out),
            Poll::Pending => None,
        })
    })
    .await
}
