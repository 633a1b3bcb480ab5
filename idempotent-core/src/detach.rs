//! Small future helpers: storing an outcome that outlives its caller, and polling once before arming a timer.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

/// Runs a future in place; if dropped before the future ends, hands it to a task of its own so
/// that it still runs to the end, and gives its output to `detached` there.
///
/// Storing an outcome must not depend on the caller still waiting (a timeout around a step, a
/// client that went away). This costs less than spawning up front (no task, no wake-up across
/// threads) in the usual case where the caller is still there.
pub struct FinishOnDrop<F: Future + Send + 'static, D: FnOnce(F::Output) + Send + 'static> {
    future: Option<Pin<Box<F>>>,
    detached: Option<D>,
}

impl<F: Future + Send + 'static, D: FnOnce(F::Output) + Send + 'static> FinishOnDrop<F, D> {
    /// Wraps `future`; `detached` receives its output if it had to finish in a task.
    pub fn new(future: F, detached: D) -> Self {
        FinishOnDrop { future: Some(Box::pin(future)), detached: Some(detached) }
    }
}

// Nothing is pinned in place: the future is boxed, and `detached` is only ever moved out.
impl<F: Future + Send + 'static, D: FnOnce(F::Output) + Send + 'static> Unpin for FinishOnDrop<F, D> {}

impl<F: Future + Send + 'static, D: FnOnce(F::Output) + Send + 'static> Future for FinishOnDrop<F, D> {
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

impl<F: Future + Send + 'static, D: FnOnce(F::Output) + Send + 'static> Drop for FinishOnDrop<F, D> {
    fn drop(&mut self) {
        let (Some(future), Some(detached)) = (self.future.take(), self.detached.take()) else { return };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => drop(runtime.spawn(async move { detached(future.await) })),
            Err(_) => tracing::warn!(
                "idempotent.store_error: dropped outside a tokio runtime before the outcome was stored; the key frees itself when the lease runs out"
            ),
        }
    }
}

/// Polls `future` once: its output if it is ready, `None` if it is pending (it has then
/// registered the task for a wake-up, as any poll does).
///
/// The heartbeats use it to skip their timer for work that is done at once: tokio takes its
/// timer driver's lock to drop even a timer that was never polled.
pub async fn poll_once<F: Future>(mut future: Pin<&mut F>) -> Option<F::Output> {
    std::future::poll_fn(|cx| {
        Poll::Ready(match future.as_mut().poll(cx) {
            Poll::Ready(out) => Some(out),
            Poll::Pending => None,
        })
    })
    .await
}
