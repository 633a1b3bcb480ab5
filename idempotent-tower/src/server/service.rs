use std::collections::VecDeque;
use std::future::Future;
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::header::{CONTENT_LENGTH, CONTENT_TYPE};
use http::request::Parts;
use http::{HeaderMap, HeaderName, HeaderValue, Request, Response};
use http_body::{Body, Frame};
use http_body_util::BodyExt;
use idempotent_core::__private::{FinishOnDrop, poll_once};
use idempotent_core::canonical::with_canonical_json;
use idempotent_core::record::{Acquire, Lease, Transition};
use idempotent_core::{Error, FailMode, Fingerprint, Key, OnInFlight, ShortKey};
use tokio::time::Instant;
use tower::{BoxError, Service};
use tracing::Instrument;

use super::body::{RequestBody, ResponseBody};
use super::future::ResponseFuture;
use super::grpc;
use super::key;
use super::layer::{Config, STORE_DOWN_RETRY_AFTER};
use super::policy::Outcome;
use super::problem::Refusal;
use super::record::{self, StoredResponse, strip_hop_by_hop};

/// The header added to every replayed response.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// `Idempotent-Stored: false` marks a response that the service made but the layer could not
/// store (the store failed, or the request outlived its lease: another attempt took over, or no
/// renewal reached the store for a whole lease): the request ran, and a retry under the same
/// key may run it again.
pub const IDEMPOTENT_STORED: HeaderName = HeaderName::from_static("idempotent-stored");

/// The lease a request runs under, put in the request's extensions for the handler (in axum:
/// `Extension<RequestLease>`).
///
/// Pass [`fence`](Self::fence) to downstream systems that can reject a stale writer: when a
/// handler outlives its lease and a retry takes over, the retry's fence is higher.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct RequestLease {
    /// The fencing token: higher for every later attempt under the same key.
    pub fence: u64,
    /// 1 for the first attempt under this key, then one more for each.
    pub attempt: u32,
    /// A previous attempt's lease ran out without a response.
    pub recovered: bool,
}

/// Marks a request that an `IdempotencyLayer` has handled: it took the key, or let the request
/// through unprotected because the store was down and it fails open.
///
/// A private type rather than the [`RequestLease`]: a handler may copy its lease onto a request
/// of its own to another protected service, whose layer must still protect that request.
#[derive(Debug, Clone, Copy)]
struct Handled;

/// The longest `Retry-After` suggested to a duplicate of a running request: the first request
/// usually finishes long before its lease runs out, which is all the store can vouch for.
const IN_FLIGHT_RETRY_AFTER: Duration = Duration::from_secs(1);

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
        let key = match key::parse(&parts.headers, &config.header) {
            Ok(Some(client_key)) => {
                let tenant = config.tenant.as_ref().and_then(|extract| extract(&parts));
                Key::from_client_key(tenant.as_deref(), &config.scope, &client_key)
            }
            Ok(None) if !config.require_key => {
                let req = Request::from_parts(parts, RequestBody::stream(body));
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
        ResponseFuture::boxed(Box::pin(handle(inner, self.config.clone(), parts, body, key, grpc)))
    }
}

/// One covered request with a well-formed key, from reading its body to storing its response.
///
/// A function returning an `async move` block rather than an `async fn`: an `async fn` keeps
/// each argument twice in its future (as the argument and as the local it is moved into), and
/// this future is boxed for every request. For the same reason, values are kept out of `let`
/// bindings that would stay in scope across later awaits.
#[allow(clippy::manual_async_fn)]
fn handle<S, ReqBody, ResBody>(
    mut inner: S,
    config: Arc<Config>,
    parts: Parts,
    body: ReqBody,
    key: Key,
    grpc: bool,
) -> impl Future<Output = Result<Response<ResponseBody<ResBody>>, S::Error>>
where
    S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>>,
    ReqBody: Body<Data = Bytes>,
    ReqBody::Error: Into<BoxError>,
    // Sent to the task that stores the response (see below).
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    async move {
        let short = key.short_key();
        // Reading the body and taking the key run in a box of their own: their futures would
        // otherwise add to this one's size for the whole request, and past glibc's 1 032-byte
        // thread cache a box takes malloc's slow path (two boxes within it cost less).
        // Matched in the statement that awaits it, with no suspension in the arms, so that the
        // admission's room is not kept for the rest of this future.
        let (data, trailers, lease) = match Box::pin(admit(&config, &parts, body, &key, grpc)).await {
            Admission::Run { data, trailers, lease, acquired_at } => (data, trailers, Some((lease, acquired_at))),
            Admission::FailOpen { data, trailers } => (data, trailers, None),
            Admission::Respond(res) => return Ok(res),
        };
        let (lease, acquired_at) = match lease {
            Some(taken) => taken,
            None => {
                let res = inner.call(service_request(parts, data, trailers, None)).await?;
                return Ok(res.map(ResponseBody::stream));
            }
        };
        let marker = RequestLease { fence: lease.fence, attempt: lease.attempt, recovered: lease.recovered };
        let held = Held { valid_until: acquired_at + config.lease, lost: false, config, key, lease, short };
        let call = inner.call(service_request(parts, data, trailers, Some(marker)));
        // A statement of its own, so that the service's future is dropped before the key is
        // released or the response stored. `held` goes in and comes back out by value: a
        // borrowed local would keep its room in this future until the end.
        let (held, outcome) = held.run(pin!(call)).await;
        // Boxed, like the admission: this future then stays under glibc's thread cache limit.
        Box::pin(settle(held, outcome, grpc)).await
    }
}

/// After the service: stores its response, or gives the key up when it failed.
///
/// Storing must not depend on the client still waiting: hyper drops the request's future when
/// the client goes away, and the record would then stay `running` until its lease passed, and
/// the retry would run the request again. So the rest runs here, and moves to a task of its own
/// if this future is dropped first. A body that is complete at once (the usual case) is read
/// here, without a suspension (so nothing can drop this future meanwhile), so that the boxed
/// rest is small.
#[allow(clippy::manual_async_fn)]
fn settle<B, E>(
    held: Held,
    outcome: Result<Response<B>, E>,
    grpc: bool,
) -> impl Future<Output = Result<Response<ResponseBody<B>>, E>>
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    async move {
        let res = match outcome {
            Ok(res) => res,
            Err(e) => {
                // Like storing a response: giving the key up must not depend on the client.
                FinishOnDrop::new(async move { held.release("the service failed").await }.in_current_span(), drop)
                    .await;
                return Err(e);
            }
        };
        let limit = held.config.max_stored_response;
        match collect_at_once(res, limit).await {
            Ok(collected) => Ok(FinishOnDrop::new(held.store(collected, grpc).in_current_span(), drop).await),
            Err(collect) => Ok(FinishOnDrop::new(held.finish(collect, grpc).in_current_span(), drop).await),
        }
    }
}

/// What [`admit`] decided for a request.
enum Admission<B> {
    /// Call the service under `lease`, taken by an acquire sent at `acquired_at`.
    Run { data: Bytes, trailers: Option<HeaderMap>, lease: Lease, acquired_at: Instant },
    /// Call the service unprotected: the store is down and the layer fails open.
    FailOpen { data: Bytes, trailers: Option<HeaderMap> },
    /// Answer without calling the service: a replay or a refusal.
    Respond(Response<ResponseBody<B>>),
}

/// Reads the request body, fingerprints the request and takes its key.
async fn admit<ReqBody, B>(config: &Config, parts: &Parts, body: ReqBody, key: &Key, grpc: bool) -> Admission<B>
where
    ReqBody: Body<Data = Bytes>,
    ReqBody::Error: Into<BoxError>,
{
    let short = key.short_key();
    let (data, trailers) = match read_body(&parts.headers, body, config.max_request_body).await {
        Ok(read) => read,
        Err(ReadError::TooLarge) => {
            tracing::debug!(key = %short, limit = config.max_request_body, "idempotent.refused: request body too large");
            return Admission::Respond(Refusal::BodyTooLarge { limit: config.max_request_body }.into_response(grpc));
        }
        Err(ReadError::Failed(error)) => {
            tracing::debug!(key = %short, %error, "idempotent.refused: request body failed");
            return Admission::Respond(Refusal::BodyUnreadable.into_response(grpc));
        }
    };
    let fingerprint = if grpc { grpc::fingerprint(parts.uri.path(), &data) } else { http_fingerprint(parts, &data) };
    match acquire(config, key, &fingerprint, short).await {
        Acquired::Lease(lease, acquired_at) => {
            tracing::debug!(key = %short, fence = lease.fence, attempt = lease.attempt, recovered = lease.recovered, "idempotent.acquired");
            if lease.recovered {
                tracing::info!(key = %short, fence = lease.fence, "idempotent.recovered: a previous attempt's lease ran out without a response");
            }
            Admission::Run { data, trailers, lease, acquired_at }
        }
        Acquired::Replay(bytes) => Admission::Respond(replay(bytes, grpc, short)),
        Acquired::Refuse(refusal) => Admission::Respond(refusal.into_response(grpc)),
        Acquired::FailOpen => Admission::FailOpen { data, trailers },
    }
}

/// The request the service gets: the buffered body, marked so that a nested layer lets it pass,
/// and the lease it runs under (none when the store is down and the layer fails open). Built
/// only for requests that reach the service (a replay or a refusal never does).
fn service_request<B>(
    parts: Parts,
    data: Bytes,
    trailers: Option<HeaderMap>,
    lease: Option<RequestLease>,
) -> Request<RequestBody<B>> {
    let mut req = Request::from_parts(parts, RequestBody::full(data, trailers));
    req.extensions_mut().insert(Handled);
    if let Some(lease) = lease {
        req.extensions_mut().insert(lease);
    }
    req
}

enum ReadError {
    TooLarge,
    Failed(BoxError),
}

/// Reads the whole request body, refusing it as soon as it passes `limit` (whether or not it
/// announced its length).
async fn read_body<B>(headers: &HeaderMap, body: B, limit: usize) -> Result<(Bytes, Option<HeaderMap>), ReadError>
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

fn is_json(headers: &HeaderMap) -> bool {
    let Some(ct) = headers.get(CONTENT_TYPE).and_then(|v| v.to_str().ok()) else {
        return false;
    };
    let essence = ct.split(';').next().unwrap_or("").trim().as_bytes();
    let (prefix, suffix) = (b"application/".len(), b"+json".len());
    essence.eq_ignore_ascii_case(b"application/json")
        || (essence.len() > prefix + suffix
            && essence[..prefix].eq_ignore_ascii_case(b"application/")
            && essence[essence.len() - suffix..].eq_ignore_ascii_case(b"+json"))
}

/// The fingerprint of an HTTP request: method, path, query and body (canonical JSON when the
/// body is JSON, so that key order and whitespace do not count; the raw bytes otherwise).
fn http_fingerprint(parts: &Parts, body: &[u8]) -> Fingerprint {
    let of = |form: &[u8], payload: &[u8]| {
        Fingerprint::of_parts([
            &b"http"[..],
            parts.method.as_str().as_bytes(),
            parts.uri.path().as_bytes(),
            parts.uri.query().unwrap_or("").as_bytes(),
            form,
            payload,
        ])
    };
    // Canonical JSON from the thread's reused buffer: it is only hashed.
    let json = if is_json(&parts.headers) { with_canonical_json(body, |c| of(b"json", c)).ok() } else { None };
    json.unwrap_or_else(|| of(b"raw", body))
}

enum Acquired {
    /// The lease, and when the acquire that took it was sent: the lease runs from no earlier.
    Lease(Lease, Instant),
    Replay(Bytes),
    Refuse(Refusal),
    FailOpen,
}

async fn acquire(config: &Config, key: &Key, fingerprint: &Fingerprint, short: ShortKey) -> Acquired {
    let header = || config.header.as_str().to_owned();
    // When the first acquire was sent: the wait for a request in flight counts from there.
    let mut started = None;
    let mut backoff = Duration::from_millis(10);
    loop {
        let sent = Instant::now();
        let started = *started.get_or_insert(sent);
        match config.store.acquire(key, fingerprint, config.lease, config.retention).await {
            Ok(Acquire::Acquired(lease)) => return Acquired::Lease(lease, sent),
            Ok(Acquire::Replay(bytes)) => return Acquired::Replay(bytes),
            Ok(Acquire::Mismatch) => {
                tracing::info!(key = %short, "idempotent.mismatch: the key was used with another request");
                return Acquired::Refuse(Refusal::Mismatch { header: header() });
            }
            Ok(Acquire::InFlight { retry_after }) => {
                let refuse = || {
                    Acquired::Refuse(Refusal::InFlight {
                        header: header(),
                        retry_after: retry_after.min(IN_FLIGHT_RETRY_AFTER),
                    })
                };
                let OnInFlight::Wait { timeout } = config.on_in_flight else {
                    tracing::debug!(key = %short, ?retry_after, "idempotent.in_flight: rejected");
                    return refuse();
                };
                let waited = started.elapsed();
                if waited >= timeout {
                    tracing::debug!(key = %short, ?waited, "idempotent.in_flight: gave up waiting");
                    return refuse();
                }
                let nap = backoff.min(retry_after.max(Duration::from_millis(1))).min(timeout - waited);
                // Boxed: a timer is most of this future's size, and only waiting requests need one.
                Box::pin(tokio::time::sleep(nap)).await;
                backoff = (backoff * 2).min(Duration::from_millis(500));
            }
            Ok(other) => {
                tracing::error!(key = %short, answer = ?other, "idempotent.store_error: unknown answer to acquire");
                return Acquired::Refuse(Refusal::StoreError);
            }
            Err(e) if e.is_store_failure() => {
                if config.fail_mode == FailMode::Open {
                    tracing::warn!(key = %short, error = %e, "idempotent.store_error: failing open, calling the service unprotected");
                    return Acquired::FailOpen;
                }
                tracing::warn!(key = %short, error = %e, "idempotent.store_error: the request was refused (fail closed)");
                return Acquired::Refuse(Refusal::StoreUnavailable { retry_after: STORE_DOWN_RETRY_AFTER });
            }
            Err(e @ Error::Corrupt { .. }) => {
                tracing::error!(key = %short, error = %e, "idempotent.corrupt");
                return Acquired::Refuse(Refusal::Corrupt);
            }
            Err(e) => {
                tracing::error!(key = %short, error = %e, "idempotent.store_error");
                return Acquired::Refuse(Refusal::StoreError);
            }
        }
    }
}

fn replay<B>(bytes: Bytes, grpc: bool, short: ShortKey) -> Response<ResponseBody<B>> {
    let stored = match StoredResponse::decode(bytes) {
        Ok(stored) => stored,
        Err(error) => {
            tracing::error!(key = %short, %error, "idempotent.corrupt: the stored response cannot be decoded; it was not replayed");
            return Refusal::Corrupt.into_response(grpc);
        }
    };
    tracing::debug!(key = %short, status = stored.status.as_u16(), "idempotent.replayed");
    let mut res = Response::new(ResponseBody::full(stored.body, stored.trailers));
    *res.status_mut() = stored.status;
    *res.headers_mut() = stored.headers;
    strip_hop_by_hop(res.headers_mut());
    res.headers_mut().insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    res
}

/// A lease this request holds, and what this process knows about it.
struct Held {
    config: Arc<Config>,
    key: Key,
    lease: Lease,
    short: ShortKey,
    /// Until when the lease is known to hold: `lease` after the acquire or the last successful
    /// renewal was *sent*. The store started counting no earlier, so its deadline is no sooner.
    valid_until: Instant,
    /// The lease is gone, or may be: a renewal said so, or none reached the store in time.
    lost: bool,
}

/// What ended one wait of the heartbeat.
enum Beat<T> {
    Done(T),
    Renewed(Result<Transition, Error>, Instant),
    Expired,
}

impl Held {
    /// Drives `work`, renewing the lease every third of it. A renewal never delays the work:
    /// both are polled together, and the work's result wins a tie. When no renewal succeeds
    /// for a whole lease (the store is unreachable from here, while others may reach it), the
    /// lease counts as lost, although no store said so: another attempt may have taken over.
    ///
    /// `work` is pinned by the caller, so that it is not held twice in this future (as the
    /// argument and as the pinned local).
    async fn heartbeat<F: Future>(&mut self, mut work: Pin<&mut F>) -> F::Output {
        // Work that is done at its first poll needs no timer.
        if let Some(out) = poll_once(work.as_mut()).await {
            return out;
        }
        // The timers and the renewal live in a box of their own, allocated only for work that
        // has to wait: most of this future's size, kept out of every request's future.
        Box::pin(self.beat(work)).await
    }

    /// [`heartbeat`](Self::heartbeat), taking the lease by value and giving it back.
    async fn run<F: Future>(mut self, work: Pin<&mut F>) -> (Self, F::Output) {
        let out = self.heartbeat(work).await;
        (self, out)
    }

    async fn beat<F: Future>(&mut self, mut work: Pin<&mut F>) -> F::Output {
        let lease = self.config.lease;
        let period = (lease / 3).max(Duration::from_millis(1));
        loop {
            if self.lost {
                return work.await;
            }
            let next = (Instant::now() + period).min(self.valid_until);
            if let Ok(out) = tokio::time::timeout_at(next, work.as_mut()).await {
                return out;
            }
            if Instant::now() >= self.valid_until {
                self.expired();
                continue;
            }
            let beat = {
                let sent = Instant::now();
                let renew = self.config.store.renew(&self.key, &self.lease.token, lease);
                tokio::select! {
                    biased;
                    out = work.as_mut() => Beat::Done(out),
                    answer = renew => Beat::Renewed(answer, sent),
                    () = tokio::time::sleep_until(self.valid_until) => Beat::Expired,
                }
            };
            match beat {
                Beat::Done(out) => return out,
                Beat::Renewed(Ok(Transition::Ok), sent) => {
                    self.valid_until = sent + lease;
                    tracing::trace!(key = %self.short, "idempotent.renewed");
                }
                Beat::Renewed(Ok(Transition::LeaseLost), _) => {
                    tracing::warn!(key = %self.short, fence = self.lease.fence, "idempotent.lease_lost: another attempt took over while this request was running");
                    self.lost = true;
                }
                // The lease may still be ours until `valid_until`; keep trying.
                Beat::Renewed(Err(e), _) => {
                    tracing::warn!(key = %self.short, error = %e, "idempotent.store_error: lease renewal failed")
                }
                Beat::Expired => self.expired(),
            }
        }
    }

    fn expired(&mut self) {
        if !self.lost {
            tracing::warn!(key = %self.short, fence = self.lease.fence, "idempotent.lease_lost: no renewal reached the store within the lease; another attempt may take over, so the response will not be stored");
            self.lost = true;
        }
    }

    /// Reads the rest of the response body (renewing the lease meanwhile), then stores the
    /// response or releases the key (see [`store`](Self::store)).
    #[allow(clippy::manual_async_fn)]
    fn finish<B>(mut self, mut collect: Collect<B>, grpc: bool) -> impl Future<Output = Response<ResponseBody<B>>>
    where
        B: Body<Data = Bytes>,
        B::Error: Into<BoxError>,
    {
        async move {
            let collected = self.heartbeat(Pin::new(&mut collect)).await;
            self.store(collected, grpc).await
        }
    }

    /// Stores the response or releases the key, and returns the response for the client.
    ///
    /// An `async move` block, not an `async fn`, so that `self` and `collected` are not kept
    /// twice in the future (see `handle`): it is boxed for every stored response.
    #[allow(clippy::manual_async_fn)]
    fn store<B>(mut self, collected: Collected<B>, grpc: bool) -> impl Future<Output = Response<ResponseBody<B>>>
    where
        B: Body<Data = Bytes>,
        B::Error: Into<BoxError>,
    {
        async move {
            // The body may have ended between two beats.
            if Instant::now() >= self.valid_until {
                self.expired();
            }
            let short = self.short;
            match collected {
                Collected::Complete { mut parts, data, trailers } => {
                    let outcome =
                        Outcome { status: parts.status, headers: &parts.headers, trailers: trailers.as_ref(), grpc };
                    if self.config.policy.should_store(&outcome) {
                        let stored = record::encode(parts.status, &parts.headers, &data, trailers.as_ref());
                        if !self.complete(stored, &parts).await {
                            // The client still gets the response the service made, marked so that it
                            // knows a retry under this key may run the request again.
                            parts.headers.insert(IDEMPOTENT_STORED, HeaderValue::from_static("false"));
                        }
                    } else {
                        self.release("the store policy declined the response").await;
                    }
                    Response::from_parts(parts, ResponseBody::full(data, trailers))
                }
                Collected::TooLarge { parts, prefix, rest } => {
                    let limit = self.config.max_stored_response;
                    tracing::warn!(key = %short, limit, status = parts.status.as_u16(), "idempotent.not_stored: the response is larger than max_stored_response; releasing the key, so a retry runs the request again");
                    self.release("the response is too large to store").await;
                    Response::from_parts(parts, ResponseBody::resume(prefix, rest))
                }
                Collected::Failed { parts, prefix, error } => {
                    tracing::warn!(key = %short, %error, "idempotent.not_stored: the response body failed");
                    self.release("the response body failed").await;
                    Response::from_parts(parts, ResponseBody::failed(prefix, error))
                }
            }
        }
    }

    /// Stores the response; `false` when it was not stored.
    async fn complete(&self, bytes: Bytes, parts: &http::response::Parts) -> bool {
        let short = self.short;
        if self.lost {
            // Another attempt may hold the key by now, and may have run the request too: the
            // layer cannot vouch for this response, so it does not store it.
            tracing::warn!(key = %short, fence = self.lease.fence, "idempotent.not_stored: the lease was lost while the request ran");
            return false;
        }
        // Whatever the store says, the service ran and this is its response: the client gets it.
        match self.config.store.complete(&self.key, &self.lease.token, bytes, self.config.retention).await {
            Ok(Transition::Ok) => {
                tracing::debug!(key = %short, status = parts.status.as_u16(), "idempotent.stored");
                true
            }
            Ok(Transition::LeaseLost) => {
                tracing::warn!(
                    key = %short,
                    fence = self.lease.fence,
                    "idempotent.lease_lost: the response was not stored; another attempt took over the key"
                );
                false
            }
            Err(e) => {
                tracing::error!(
                    key = %short,
                    error = %e,
                    "idempotent.store_error: the service ran but its response was not stored; the key stays locked until its lease runs out"
                );
                false
            }
        }
    }

    async fn release(&self, why: &'static str) {
        let short = self.short;
        if self.lost {
            // Nothing to give up: the lease ran out, or another attempt holds the key.
            tracing::debug!(key = %short, why, "idempotent.lease_lost: nothing to release");
            return;
        }
        match self.config.store.release(&self.key, &self.lease.token).await {
            Ok(Transition::Ok) => tracing::debug!(key = %short, why, "idempotent.released"),
            Ok(Transition::LeaseLost) => {
                tracing::warn!(key = %short, why, "idempotent.lease_lost: released after losing the lease")
            }
            Err(e) => {
                tracing::warn!(key = %short, why, error = %e, "idempotent.store_error: could not release; the key frees itself when the lease runs out")
            }
        }
    }
}

enum Collected<B> {
    Complete { parts: http::response::Parts, data: Bytes, trailers: Option<HeaderMap> },
    TooLarge { parts: http::response::Parts, prefix: VecDeque<Frame<Bytes>>, rest: Pin<Box<B>> },
    Failed { parts: http::response::Parts, prefix: VecDeque<Frame<Bytes>>, error: BoxError },
}

/// Reads a response body up to `limit` bytes.
///
/// A future written by hand rather than an `async fn`: it is `Unpin`, so the layer can poll it
/// once in place and move it into the boxed rest of the request only when the body is not
/// complete at once.
struct Collect<B> {
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
fn collect_at_once<B>(res: Response<B>, limit: usize) -> impl Future<Output = Result<Collected<B>, Collect<B>>>
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

    fn parts(method: &str, uri: &str, ct: Option<&str>) -> Parts {
        let mut b = Request::builder().method(method).uri(uri);
        if let Some(ct) = ct {
            b = b.header(CONTENT_TYPE, ct);
        }
        b.body(()).unwrap().into_parts().0
    }

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

    #[test]
    fn json_bodies_are_fingerprinted_canonically() {
        let json = parts("POST", "/refunds?x=1", Some("application/json; charset=utf-8"));
        assert_eq!(
            http_fingerprint(&json, br#"{"a":1,"b":[1,2]}"#),
            http_fingerprint(&json, b"{ \"b\" : [1, 2],\n \"a\": 1 }")
        );
        assert_ne!(http_fingerprint(&json, br#"{"a":1}"#), http_fingerprint(&json, br#"{"a":2}"#));
        let problem = parts("POST", "/refunds?x=1", Some("application/merge-patch+json"));
        assert_eq!(http_fingerprint(&problem, br#"{"a":1,"b":2}"#), http_fingerprint(&problem, br#"{"b":2,"a":1}"#));
        // Not JSON after all: the raw bytes count.
        assert_ne!(http_fingerprint(&json, b"{oops"), http_fingerprint(&json, b"{oops "));
    }

    #[test]
    fn other_bodies_are_fingerprinted_raw() {
        let text = parts("POST", "/refunds", Some("text/plain"));
        assert_ne!(http_fingerprint(&text, br#"{"a":1,"b":2}"#), http_fingerprint(&text, br#"{"b":2,"a":1}"#));
    }

    #[test]
    fn method_path_and_query_count() {
        let base = http_fingerprint(&parts("POST", "/r?a=1", None), b"x");
        assert_ne!(base, http_fingerprint(&parts("PATCH", "/r?a=1", None), b"x"));
        assert_ne!(base, http_fingerprint(&parts("POST", "/s?a=1", None), b"x"));
        assert_ne!(base, http_fingerprint(&parts("POST", "/r?a=2", None), b"x"));
        assert_ne!(base, http_fingerprint(&parts("POST", "/r", None), b"x"));
        assert_eq!(base, http_fingerprint(&parts("POST", "http://other.example/r?a=1", None), b"x"));
    }

    #[tokio::test]
    async fn a_copied_lease_does_not_turn_another_layer_off() {
        use std::sync::atomic::{AtomicU32, Ordering};
        use tower::{Layer, ServiceExt, service_fn};

        // A handler may pass its lease on, on a request of its own to another protected
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
            req.extensions_mut().insert(RequestLease { fence: 7, attempt: 1, recovered: false });
            let res = svc.clone().oneshot(req).await.unwrap();
            assert_eq!(res.headers().contains_key(IDEMPOTENT_REPLAYED), replayed);
            assert_eq!(res.into_body().collect().await.unwrap().to_bytes(), "1");
        }
        assert_eq!(runs.load(Ordering::SeqCst), 1);
    }
}
