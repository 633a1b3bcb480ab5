//! The shared cart of the `shared_cart` example: `GET /cart` answers the items with the state's
//! version as `ETag`; `PUT /cart` must carry `If-Match` (428 without it) naming the current
//! version (412 otherwise, with the current `ETag`), and its `Idempotency-Key` names the commit,
//! so that a retried `PUT` whose reply was lost is recognised instead of refused.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::State as AxumState;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use idempotent_core::state::{Commit, CommitToken, State};
use idempotent_tower::precondition::{Precondition, check_if_match, etag, parse_etag};

/// The cart: a versioned list of items.
pub type Cart = State<Vec<String>>;

/// The cart's routes: `GET /cart` and `PUT /cart`.
pub fn router(cart: Arc<Cart>) -> Router {
    Router::new().route("/cart", get(get_cart).put(put_cart)).with_state(cart)
}

async fn get_cart(AxumState(cart): AxumState<Arc<Cart>>) -> Response {
    match cart.load().await {
        Ok(loaded) => ([(header::ETAG, etag(loaded.version))], Json(loaded.value.unwrap_or_default())).into_response(),
        Err(e) => (StatusCode::SERVICE_UNAVAILABLE, e.to_string()).into_response(),
    }
}

async fn put_cart(
    AxumState(cart): AxumState<Arc<Cart>>,
    headers: HeaderMap,
    Json(items): Json<Vec<String>>,
) -> Response {
    // The client's key names the change: a retry of it commits under the same token, and is
    // recognised as applied even though its If-Match is stale by then (its own write).
    let token = match headers.get("idempotency-key").and_then(|v| v.to_str().ok()) {
        Some(key) => CommitToken::derive(key),
        None => CommitToken::random(),
    };
    // The commit on the tag's version is the check; a tag that names no version is checked
    // against the current one (and refused with its ETag).
    let tag = headers.get(header::IF_MATCH).and_then(|v| v.to_str().ok()).and_then(parse_etag);
    let expected = match tag {
        Some(v) => v,
        None => match cart.load().await {
            Ok(current) => match check_if_match(&headers, current.version) {
                Ok(v) => v,
                Err(refused) => return refused.into_response::<Body>(),
            },
            Err(e) => return (StatusCode::SERVICE_UNAVAILABLE, e.to_string()).into_response(),
        },
    };
    match cart.commit_with_token(expected, &items, &token).await {
        Ok(Commit::Committed { version, .. }) => ([(header::ETAG, etag(version))], Json(items)).into_response(),
        Ok(Commit::Conflict { current }) => Precondition::Failed { current: current.version }.into_response::<Body>(),
        Ok(_) => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
        Err(e) => (StatusCode::SERVICE_UNAVAILABLE, e.to_string()).into_response(),
    }
}
