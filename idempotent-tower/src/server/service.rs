use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderMap, Request, Response};
use http_body::Body;
use idempotent_core::lease::{self, End, Taken};
use idempotent_core::metrics::{self, CallEnd, Timer};
use idempotent_core::record::{Abandon, Labels};
use idempotent_core::{Attempt, Error, FailMode, Key, RunContext};
use tower::{BoxError, Service};

use super::body::{RequestBody, ResponseBody};
use super::buffer::{ReadError, read_body};
use super::config::{Config, STORE_DOWN_RETRY_AFTER};
use super::fingerprint::http_fingerprint;
use super::future::ResponseFuture;
use super::grpc;
use super::identity::{Unprotected, run_context};
use super::key;
use super::outcome::{end_with_response, replay};
use super::problem::Refusal;

/// Marks a request that an `IdempotencyLayer` has handled: it took the key, or let the request
/// through unprotected because the store was down and it fails open.
///
/// A private type rather than the [`Attempt`]: a handler may copy its attempt onto a request
/// of its own to another protected service, whose layer must still protect that request.
#[derive(Debug, Clone, Copy)]
struct Handled;

/// The middleware made by [`IdempotencyLayer`](super::IdempotencyLayer).
///
/// Cheap to clone (the configuration is shared); keeps the inner service's error type, since
/// every refusal is a response.
#[derive(Clone)]
pub struct Idempotency<S> {
    pub(crate) inner: S,
    pub(crate) config: Arc<Config>,
}

impl<S> std::fmt::Debug for Idempotency<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Idempotency").field("store", &self.config.store.describe()).finish_non_exhaustive()
    }
}

impl<S> Idempotency<S> {
    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The wrapped service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Unwraps the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for Idempotency<S>
where
    S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Body<Data = Bytes> + Send + 'static,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, ResBody, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        let config = &self.config;
        let grpc = grpc::is_grpc(req.headers());
        // An outer IdempotencyLayer already holds the key for this request: taking it again
        // here would find the request in flight behind itself.
        let nested = req.extensions().get::<Handled>().is_some();
        if nested || (!grpc && !config.methods.contains(req.method())) {
            return ResponseFuture::passthrough(self.inner.call(req.map(RequestBody::stream)));
        }
        let header = || config.header.as_str().to_owned();
        let (parts, body) = req.into_parts();
        // The key is derived here rather than in `handle`: the request's parts and the client's
        // key then need not be held in the boxed future twice (as arguments and as locals).
        let (key, tenant) = match key::parse(&parts.headers, &config.header) {
            Ok(Some(client_key)) => {
                let tenant = config.tenant.as_ref().and_then(|extract| extract(&parts));
                (Key::from_client_key(tenant.as_deref(), &config.scope, &client_key), tenant)
            }
            Ok(None) if !config.require_key => {
                let mut req = Request::from_parts(parts, RequestBody::stream(body));
                req.extensions_mut().insert(Unprotected::NoKey);
                return ResponseFuture::passthrough(self.inner.call(req));
            }
            Ok(None) => {
                tracing::debug!(grpc, "idempotent.refused: no key");
                return ResponseFuture::ready(Refusal::MissingKey { header: header() }.into_response(grpc));
            }
            Err(error) => {
                tracing::debug!(grpc, %error, "idempotent.refused: invalid key");
                return ResponseFuture::ready(Refusal::InvalidKey { header: header(), error }.into_response(grpc));
            }
        };
        // Take the service that was driven to readiness and leave a clone in its place.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        ResponseFuture::boxed(Box::pin(handle(inner, self.config.clone(), parts, body, key, tenant, grpc)))
    }
}

/// One covered request with a well-formed key, from reading its body to storing its response.
///
/// A function returning an `async move` block rather than an `async fn`: an `async fn` keeps
/// each argument twice in its future (as the argument and as the local it is moved into), and
/// this future is boxed for every request.
#[allow(clippy::manual_async_fn)]
fn handle<S, ReqBody, ResBody>(
    mut inner: S,
    config: Arc<Config>,
    parts: Parts,
    body: ReqBody,
    key: Key,
    tenant: Option<String>,
    grpc: bool,
) -> impl Future<Output = Result<Response<ResponseBody<ResBody>>, S::Error>>
where
    S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>>,
    ReqBody: Body<Data = Bytes>,
    ReqBody::Error: Into<BoxError>,
    // Sent to the task that stores the response (see `end_with_response`).
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    async move {
        // Matched in the statement that awaits it, so that the admission's room is shared with
        // the later states of this future (see BENCHMARKS.md, "Allocator and future-size notes").
        let (data, trailers, lease) = match admit(&config, &parts, body, &key, tenant.as_deref(), grpc).await {
            Admission::Run { data, trailers, lease } => (data, trailers, Some(lease)),
            Admission::FailOpen { data, trailers } => (data, trailers, None),
            Admission::Respond(res) => return Ok(res),
        };
        let ctx = run_context(&config, &key, tenant.as_deref());
        let Some(mut lease) = lease else {
            let attempt = Attempt::unprotected(key);
            let req = service_request(parts, data, trailers, attempt.clone(), ctx, Some(Unprotected::StoreUnavailable));
            let res = attempt.scope(call_in_scope(&mut inner, req)).await?;
            return Ok(res.map(ResponseBody::stream));
        };
        let attempt = lease.attempt().clone();
        let req = service_request(parts, data, trailers, attempt.clone(), ctx, None);
        // The attempt is in scope for the whole of the handler's future (and for the call that
        // makes it), so that what the handler does derives from the request's key.
        let call = attempt.scope(call_in_scope(&mut inner, req));
        // A statement of its own, so that the service's future is dropped before the key is
        // released or the response stored.
        let timer = Timer::start();
        let outcome = lease.run_boxed(pin!(call)).await;
        timer.action(&config.scope, &*config.store);
        // Boxed: storing is the largest state, and a replay or a refusal never reaches it.
        Box::pin(end_with_response(lease, &config, outcome, grpc)).await
    }
}

/// What [`admit`] decided for a request.
enum Admission<B> {
    /// Call the service under `lease`.
    Run { data: Bytes, trailers: Option<HeaderMap>, lease: lease::Lease },
    /// Call the service unprotected: the store is down and the layer fails open.
    FailOpen { data: Bytes, trailers: Option<HeaderMap> },
    /// Answer without calling the service: a replay or a refusal.
    Respond(Response<ResponseBody<B>>),
}

/// Reads the request body, fingerprints the request and takes its key.
async fn admit<ReqBody, B>(
    config: &Config,
    parts: &Parts,
    body: ReqBody,
    key: &Key,
    tenant: Option<&str>,
    grpc: bool,
) -> Admission<B>
where
    ReqBody: Body<Data = Bytes>,
    ReqBody::Error: Into<BoxError>,
{
    let short = key.short();
    let refuse = |refusal: Refusal| Admission::Respond(refusal.into_response(grpc));
    let count = |outcome| metrics::call(&config.scope, &*config.store, outcome);
    let (data, trailers) = match read_body(&parts.headers, body, config.max_request_body).await {
        Ok(read) => read,
        Err(ReadError::TooLarge) => {
            tracing::debug!(key = %short, limit = config.max_request_body, "idempotent.refused: request body too large");
            count(CallEnd::Failed);
            return refuse(Refusal::BodyTooLarge { limit: config.max_request_body });
        }
        Err(ReadError::Failed(error)) => {
            tracing::debug!(key = %short, %error, "idempotent.refused: request body failed");
            count(CallEnd::Failed);
            return refuse(Refusal::BodyUnreadable);
        }
    };
    let fingerprint = if grpc { grpc::fingerprint(parts.uri.path(), &data) } else { http_fingerprint(parts, &data) };
    let header = || config.header.as_str().to_owned();
    // The record is labelled with the layer's scope and the tenant; never the client's key.
    let labels = Labels::step(&config.scope).tenant(tenant);
    let taken = lease::acquire(&config.store, key, &fingerprint, &config.terms, labels).await;
    lease::count_acquired(&config.scope, &*config.store, &taken, config.fail_mode == FailMode::Open);
    match taken {
        Ok(Taken::Lease(lease)) if config.on_recovered.stops(lease.attempt()) => {
            let attempt = lease.attempt().number();
            tracing::warn!(key = %short, attempt, "idempotent.needs_attention: the previous attempt's outcome is uncertain and the layer does not re-run it blindly");
            // Boxed: a recovered attempt is rare, and this future's room is every request's.
            let _ = Box::pin(lease.end(End::Abandon(Abandon::NeedsAttention))).await;
            count(CallEnd::NeedsAttention);
            refuse(Refusal::NeedsAttention { header: header(), attempt })
        }
        Ok(Taken::Lease(lease)) => Admission::Run { data, trailers, lease },
        Ok(Taken::Replay(bytes)) => Admission::Respond(replay(config, bytes, grpc, short)),
        Ok(Taken::Mismatch) => {
            tracing::info!(key = %short, "idempotent.mismatch: the key was used with another request");
            refuse(Refusal::Mismatch { header: header() })
        }
        Ok(Taken::InFlight { retry_after }) => refuse(Refusal::InFlight {
            header: header(),
            retry_after: retry_after.min(idempotent_core::IN_FLIGHT_HINT),
        }),
        Ok(Taken::NeedsAttention { attempt, .. }) => refuse(Refusal::NeedsAttention { header: header(), attempt }),
        Ok(other) => {
            tracing::error!(key = %short, answer = ?other, "idempotent.store_error: unknown answer to acquire");
            refuse(Refusal::StoreError)
        }
        Err(e) if e.is_store_failure() => {
            if config.fail_mode == FailMode::Open {
                tracing::warn!(key = %short, error = %e, "idempotent.store_error: failing open, calling the service unprotected");
                return Admission::FailOpen { data, trailers };
            }
            tracing::warn!(key = %short, error = %e, "idempotent.store_error: the request was refused (fail closed)");
            refuse(Refusal::StoreUnavailable { retry_after: STORE_DOWN_RETRY_AFTER })
        }
        // Lease or retention out of bounds (`lease::acquire` checks them): nothing was sent.
        Err(e @ Error::Config(_)) => {
            tracing::error!(key = %short, error = %e, "idempotent.refused: the layer is misconfigured");
            refuse(Refusal::Misconfigured { reason: e.to_string() })
        }
        Err(e @ Error::Corrupt { .. }) => {
            tracing::error!(key = %short, error = %e, "idempotent.corrupt");
            refuse(Refusal::Corrupt)
        }
        Err(e) => {
            tracing::error!(key = %short, error = %e, "idempotent.store_error");
            refuse(Refusal::StoreError)
        }
    }
}

/// The request the service gets: the buffered body, marked so that a nested layer lets it pass,
/// with the request's identity (see [`identity`](super::identity)): the [`Attempt`] it runs
/// (unprotected when the store is down and the layer fails open), its [`RunContext`], and why
/// it is unprotected, if it is. Built only for requests that reach the service (a replay or a
/// refusal never does).
fn service_request<B>(
    parts: Parts,
    data: Bytes,
    trailers: Option<HeaderMap>,
    attempt: Attempt,
    ctx: RunContext,
    unprotected: Option<Unprotected>,
) -> Request<RequestBody<B>> {
    let mut req = Request::from_parts(parts, RequestBody::full(data, trailers));
    let extensions = req.extensions_mut();
    extensions.insert(Handled);
    extensions.insert(attempt);
    extensions.insert(ctx);
    if let Some(why) = unprotected {
        extensions.insert(why);
    }
    req
}

/// Calls the service inside the future, so that the call itself (which may start the handler's
/// work before returning its future) also runs with the attempt in scope.
async fn call_in_scope<S, R>(inner: &mut S, req: R) -> Result<S::Response, S::Error>
where
    S: Service<R>,
{
    inner.call(req).await
}

#[cfg(test)]
mod tests {
    use http_body_util::BodyExt;

    use super::*;
    use crate::server::IDEMPOTENT_REPLAYED;

    #[tokio::test]
    async fn a_copied_attempt_does_not_turn_another_layer_off() {
        use std::sync::atomic::{AtomicU32, Ordering};
        use tower::{Layer, ServiceExt, service_fn};

        // A handler may pass its attempt on, on a request of its own to another protected
        // service: that service's layer must still protect the request.
        let runs = Arc::new(AtomicU32::new(0));
        let counted = runs.clone();
        let svc = crate::IdempotencyLayer::new(idempotent_core::MemoryStore::new()).layer(service_fn(
            move |_req: Request<RequestBody<http_body_util::Empty<Bytes>>>| {
                let n = counted.fetch_add(1, Ordering::SeqCst) + 1;
                async move {
                    Ok::<_, std::convert::Infallible>(Response::new(http_body_util::Full::new(Bytes::from(
                        n.to_string(),
                    ))))
                }
            },
        ));
        for replayed in [false, true] {
            let mut req = Request::post("/inner")
                .header("idempotency-key", "k")
                .body(http_body_util::Empty::<Bytes>::new())
                .unwrap();
            req.extensions_mut().insert(Attempt::new(idempotent_core::Key::from_bytes([7; 32]), 7, 1, false));
            let res = svc.clone().oneshot(req).await.unwrap();
            assert_eq!(res.headers().contains_key(IDEMPOTENT_REPLAYED), replayed);
            assert_eq!(res.into_body().collect().await.unwrap().to_bytes(), "1");
        }
        assert_eq!(runs.load(Ordering::SeqCst), 1);
    }
}
