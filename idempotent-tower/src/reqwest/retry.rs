//! [`RetryMiddleware`]: the retry rules of [`HttpRetryPolicy`] for reqwest.

use std::fmt;

use ::reqwest::{Request, Response};
use ::reqwest_middleware::{Error, Middleware, Next, Result};
use http::Extensions;

use super::{BoxFuture, InsideRetry};
use crate::retry::{AllErrorsTransient, ClassifyError, HttpRetryPolicy};

/// Retries a reqwest request by the rules of an [`HttpRetryPolicy`]: the statuses and errors
/// worth a retry, `Retry-After`, the full-jitter backoff, the attempt limit and the budget; see
/// [`crate::retry`] for the table and the [module docs](super) for the order of middleware.
///
/// A non-idempotent request (`POST`, `PATCH`) is retried only when it carries an
/// idempotency key, and a request whose body is a stream is never retried (it cannot be sent
/// twice); both are logged at `debug` as `idempotent.retry_disabled`.
///
/// Errors are judged by [`ReqwestErrors`] unless the policy was given a classifier of its own
/// ([`from_policy`](Self::from_policy)).
pub struct RetryMiddleware<C = ReqwestErrors> {
    policy: HttpRetryPolicy<C>,
}

impl RetryMiddleware {
    /// Retries by `policy`'s rules, judging errors with [`ReqwestErrors`].
    pub fn new(policy: HttpRetryPolicy<AllErrorsTransient>) -> Self {
        RetryMiddleware { policy: policy.classify_errors(ReqwestErrors) }
    }
}

impl Default for RetryMiddleware {
    fn default() -> Self {
        Self::new(HttpRetryPolicy::new())
    }
}

impl<C> RetryMiddleware<C>
where
    C: ClassifyError<Error> + Send + Sync + 'static,
{
    /// Retries by `policy`'s rules, with the error classifier the policy was given
    /// ([`HttpRetryPolicy::classify_errors`] over `reqwest_middleware::Error`).
    pub fn from_policy(policy: HttpRetryPolicy<C>) -> Self {
        RetryMiddleware { policy }
    }

    async fn run(&self, mut request: Request, extensions: &mut Extensions, next: Next<'_>) -> Result<Response> {
        extensions.insert(InsideRetry);
        let mut retries = self.policy.start(request.method(), request.headers());
        if retries.is_some() && request.try_clone().is_none() {
            tracing::debug!(method = %request.method(), "idempotent.retry_disabled: a request with a streaming body is never retried");
            retries = None;
        }
        let Some(mut retries) = retries else {
            return next.run(request, extensions).await;
        };
        loop {
            let copy = request.try_clone().expect("checked above: the body can be cloned");
            let result = next.clone().run(request, extensions).await;
            let sleep =
                retries.after(copy.headers(), result.as_ref().map(|response| (response.status(), response.headers())));
            match sleep {
                None => return result,
                Some(sleep) => {
                    // Dropped before the wait, not held through it: an unread response keeps its
                    // connection busy (dropping it closes that connection instead).
                    drop(result);
                    sleep.await;
                    request = copy;
                }
            }
        }
    }
}

impl<C> fmt::Debug for RetryMiddleware<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("RetryMiddleware").field(&self.policy).finish()
    }
}

// By hand what `#[async_trait]` would write, so that this crate needs no proc macro for it.
impl<C> Middleware for RetryMiddleware<C>
where
    C: ClassifyError<Error> + Send + Sync + 'static,
{
    fn handle<'life0, 'life1, 'life2, 'async_trait>(
        &'life0 self,
        request: Request,
        extensions: &'life1 mut Extensions,
        next: Next<'life2>,
    ) -> BoxFuture<'async_trait, Result<Response>>
    where
        'life0: 'async_trait,
        'life1: 'async_trait,
        'life2: 'async_trait,
        Self: 'async_trait,
    {
        Box::pin(self.run(request, extensions, next))
    }
}

/// The default error classification of [`RetryMiddleware`]: an error from reqwest is worth a
/// retry when no answer arrived (connection refused or reset, a timeout, a reply cut off), not
/// when the request could not be built, redirects looped, or the body did not decode: those
/// repeat. An error from another middleware is not retried: this one cannot know what it means.
#[derive(Debug, Clone, Copy, Default)]
pub struct ReqwestErrors;

impl ClassifyError<Error> for ReqwestErrors {
    fn is_transient(&self, error: &Error) -> bool {
        match error {
            Error::Reqwest(e) => !(e.is_builder() || e.is_redirect() || e.is_status() || e.is_decode()),
            Error::Middleware(_) => false,
        }
    }
}
