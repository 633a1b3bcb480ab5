//! What the layer answers with once it has decided: a stored response replayed, or the
//! service's response stored (or the key given up) and passed on.

use std::pin::Pin;
use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderName, HeaderValue, Response};
use http_body::Body;
use idempotent_core::ShortKey;
use idempotent_core::lease::{End, FinishOnDrop, Lease};
use idempotent_core::record::Transition;
use tower::BoxError;
use tracing::Instrument;

use super::body::ResponseBody;
use super::buffer::{Collect, Collected, collect_at_once};
use super::config::Config;
use super::policy::Outcome;
use super::problem::Refusal;
use super::record::{self, StoredResponse, strip_hop_by_hop};

/// The header added to every replayed response.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// `Idempotent-Stored: false` marks a response that the service made but the store did not take
/// (the store failed, or the request outlived its lease and another attempt took the key over):
/// the request ran, and a retry under the same key may run it again.
pub const IDEMPOTENT_STORED: HeaderName = HeaderName::from_static("idempotent-stored");

/// A stored response, as the client gets it again: marked `Idempotent-Replayed: true`, then
/// passed to the layer's [`on_replay`](super::IdempotencyLayer::on_replay) hook.
pub(crate) fn replay<B>(config: &Config, bytes: Bytes, grpc: bool, short: ShortKey) -> Response<ResponseBody<B>> {
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
    match &config.on_replay {
        None => res,
        Some(hook) => {
            let (mut parts, body) = res.into_parts();
            hook(&mut parts);
            Response::from_parts(parts, body)
        }
    }
}

/// After the service: stores its response, or gives the key up when it failed.
///
/// Storing must not depend on the client still waiting: hyper drops the request's future when
/// the client goes away, and the record would then stay `running` until its lease passed, and
/// the retry would run the request again. The lease's own complete and release go on after a
/// drop; a body that is not complete at once is read on (renewing the lease) in a future that
/// moves to a task of its own when this one is dropped. A body that is complete at once (the
/// usual case) is read here, without a suspension, so nothing can drop this future meanwhile.
///
/// Every path ends in the one [`Lease::end`] below, so that this future (kept inside the
/// request's own) holds one store call's room, not one per outcome.
pub(crate) async fn end_with_response<B, E>(
    lease: Lease,
    config: &Arc<Config>,
    outcome: Result<Response<B>, E>,
    grpc: bool,
) -> Result<Response<ResponseBody<B>>, E>
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let (reply, stored) = match outcome {
        Err(e) => (Err(e), None),
        Ok(res) => match collect_at_once(res, config.max_stored_response).await {
            Ok(collected) => {
                let (res, stored) = decide(config, collected, grpc, lease.key().short());
                (Ok(res), stored)
            }
            Err(collect) => {
                let finish = finish(lease, config.clone(), collect, grpc).in_current_span();
                return Ok(FinishOnDrop::new(finish).await);
            }
        },
    };
    let wanted = stored.is_some();
    let answer = lease.end(stored.map_or(End::Release, End::Complete)).await;
    idempotent_core::metrics::ended(&config.scope, &*config.store, wanted, &answer);
    reply.map(|res| mark(res, wanted, answer))
}

/// Reads the rest of the response body (renewing the lease meanwhile), then stores the
/// response or releases the key, as [`end_with_response`] does.
async fn finish<B>(
    mut lease: Lease,
    config: Arc<Config>,
    mut collect: Collect<B>,
    grpc: bool,
) -> Response<ResponseBody<B>>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let collected = lease.run(Pin::new(&mut collect)).await;
    let (res, stored) = decide(&config, collected, grpc, lease.key().short());
    let wanted = stored.is_some();
    let answer = lease.end(stored.map_or(End::Release, End::Complete)).await;
    idempotent_core::metrics::ended(&config.scope, &*config.store, wanted, &answer);
    mark(res, wanted, answer)
}

/// The response for the client, and what to store for replay (`None`: give the key up).
fn decide<B>(
    config: &Config,
    collected: Collected<B>,
    grpc: bool,
    short: ShortKey,
) -> (Response<ResponseBody<B>>, Option<Bytes>)
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    match collected {
        Collected::Complete { parts, data, trailers } => {
            let outcome = Outcome { status: parts.status, headers: &parts.headers, trailers: trailers.as_ref(), grpc };
            let stored = if config.policy.should_store(&outcome) {
                Some(record::encode(parts.status, &parts.headers, &data, trailers.as_ref()))
            } else {
                tracing::debug!(key = %short, status = parts.status.as_u16(), "idempotent.not_stored: the store policy declined the response");
                None
            };
            (Response::from_parts(parts, ResponseBody::full(data, trailers)), stored)
        }
        Collected::TooLarge { parts, prefix, rest } => {
            let limit = config.max_stored_response;
            tracing::warn!(key = %short, limit, status = parts.status.as_u16(), "idempotent.not_stored: the response is larger than max_stored_response; releasing the key, so a retry runs the request again");
            (Response::from_parts(parts, ResponseBody::resume(prefix, rest)), None)
        }
        Collected::Failed { parts, prefix, error } => {
            tracing::warn!(key = %short, %error, "idempotent.not_stored: the response body failed");
            (Response::from_parts(parts, ResponseBody::failed(prefix, error)), None)
        }
    }
}

/// Whatever the store said, the service ran and this is its response: the client gets it,
/// marked `Idempotent-Stored: false` when it was to be stored and was not (a retry under this
/// key may run the request again).
fn mark<B>(mut res: Response<B>, wanted: bool, answer: Result<Transition, idempotent_core::Error>) -> Response<B> {
    if wanted && !matches!(answer, Ok(Transition::Ok)) {
        res.headers_mut().insert(IDEMPOTENT_STORED, HeaderValue::from_static("false"));
    }
    res
}
