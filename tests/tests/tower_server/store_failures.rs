//! Store failures (Redis only: a memory store cannot be unreachable): failing closed, 503 and the
//! handler not called; failing open, the handler called unprotected, and a layer nested inside one
//! that failed open stands aside.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::routing::post;
use http::StatusCode;
use idempotent_core::{FailMode, RedisStore, SharedStore};
use idempotent_tests::{RedisServer, free_port};
use idempotent_tower::server::IdempotencyLayer;

use crate::app::{App, Effects, refund};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_unreachable_store_is_503_and_the_handler_is_not_called() {
    let mut server = RedisServer::start();
    let store: SharedStore =
        Arc::new(RedisStore::builder(server.url()).command_timeout(Duration::from_millis(500)).connect_lazy().unwrap());
    let app = App::start(&store, |l| l).await;
    assert_eq!(app.h1(app.post("/refunds", "before"), "{}").await.status, StatusCode::CREATED);
    server.kill();
    let reply = app.h1(app.post("/refunds", "during"), "{}").await;
    let doc = reply.problem(503, "store-unavailable");
    assert_eq!(reply.headers["retry-after"], "1");
    assert!(doc["detail"].as_str().unwrap().contains("not processed"));
    assert_eq!(app.effects.calls(), 1, "the handler ran although the store was down");
    // Requests the layer does not cover are unaffected.
    assert_eq!(app.h1(app.req("GET", "/refunds"), "").await.status, StatusCode::CREATED);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fail_open_calls_the_handler_when_the_store_is_unreachable() {
    // Nothing listens on this port.
    let url = format!("redis://127.0.0.1:{}", free_port(false));
    let store: SharedStore =
        Arc::new(RedisStore::builder(url).command_timeout(Duration::from_millis(500)).connect_lazy().unwrap());
    let closed = App::start(&store, |l| l).await;
    closed.h2(closed.post("/refunds", "k"), "{}").await.problem(503, "store-unavailable");
    assert_eq!(closed.effects.calls(), 0);
    let open = App::start(&store, |l| l.fail_mode(FailMode::Open)).await;
    for n in 1..=2 {
        let reply = open.h2(open.post("/refunds", "k"), "{}").await;
        assert_eq!(reply.status, StatusCode::CREATED);
        assert!(!reply.replayed());
        assert_eq!(open.effects.calls(), n);
        // Unprotected: the handler is told it holds no lease (an unprotected attempt, fence 0).
        assert_eq!(reply.headers["x-fence"], "0");
        assert_eq!(reply.headers["x-unprotected"], "StoreUnavailable");
    }
    // A layer inside one that failed open stands aside too, rather than refusing the request
    // the outer layer let through (this one fails closed).
    let effects = Effects::new();
    let router = Router::new()
        .route("/refunds", post(refund).layer(IdempotencyLayer::new(store.clone())))
        .with_state(effects.clone())
        .layer(IdempotencyLayer::new(store).fail_mode(FailMode::Open));
    let nested = App::serve(router, effects).await;
    let reply = nested.h1(nested.post("/refunds", "k"), "{}").await;
    assert_eq!((reply.status, &reply.headers["x-fence"]), (StatusCode::CREATED, &"0".parse().unwrap()));
    assert_eq!(nested.effects.calls(), 1);
}
