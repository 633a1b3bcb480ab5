//! Leases while the handler runs: the heartbeat keeps a long request in flight; renewals that keep
//! failing still store the response when no one took over; a renewal that never answers loses the
//! lease when it runs out; and a lease or retention out of range is refused.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body as AxumBody;
use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use idempotent_core::{Error, SharedStore, Store};
use idempotent_tests::HookedStore;
use idempotent_tower::Attempt;
use idempotent_tower::server::IdempotencyLayer;
use tower::{Layer, ServiceExt};

use crate::app::{App, Effects, in_process, routes};

idempotent_tests::on_every_store!(
    the_heartbeat_keeps_a_long_request_in_flight,
    a_lease_whose_renewals_keep_failing_still_stores_when_no_one_took_over,
    absurd_lease_and_retention_are_refused,
);

async fn the_heartbeat_keeps_a_long_request_in_flight(store: SharedStore) {
    // 1 s: a 300 ms lease was lost to scheduling on a loaded two-core machine (renewals every
    // 100 ms that ran late), on every store alike.
    let lease = Duration::from_secs(1);
    let app = Arc::new(App::start(&store, |l| l.lease(lease)).await);
    let leader = {
        let app = app.clone();
        tokio::spawn(async move { app.h1(app.post("/gated", "slow"), "{}").await })
    };
    app.effects.entered.notified().await;
    // Time passing is the point here: outlive the lease several times over.
    tokio::time::sleep(lease * 3).await;
    // Without renewals the duplicate would take the key and block at the gate too.
    let duplicate = tokio::time::timeout(Duration::from_secs(10), app.h2(app.post("/gated", "slow"), "{}"))
        .await
        .expect("the duplicate ran the handler: the lease ran out while the first request was running");
    duplicate.problem(409, "key-in-use");
    assert_eq!(app.effects.calls(), 1, "the lease ran out while the handler was running");
    app.effects.gate.add_permits(1);
    let first = leader.await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED);
    let replay = app.h2(app.post("/gated", "slow"), "{}").await;
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
}

/// A store that cannot renew: every renewal fails as if the store were out of reach, or, with
/// `hang`, never answers.
fn renew_fails(store: SharedStore, hang: bool) -> SharedStore {
    let failing = HookedStore::new(store).describe_as(|inner| format!("renew-fails {inner}")).on_renew(move |call| {
        if hang {
            return Box::pin(std::future::pending());
        }
        Box::pin(std::future::ready(Err(Error::Unavailable {
            store: call.store.describe(),
            op: "renew",
            reason: "connection refused (injected)".into(),
            source: None,
        })))
    });
    Arc::new(failing)
}

async fn a_lease_whose_renewals_keep_failing_still_stores_when_no_one_took_over(store: SharedStore) {
    let lease = Duration::from_millis(300);
    let failing = renew_fails(store, false);
    let app = Arc::new(App::start(&failing, |l| l.lease(lease)).await);
    let leader = {
        let app = app.clone();
        tokio::spawn(async move { app.h1(app.post("/gated", "unrenewed"), "{}").await })
    };
    app.effects.entered.notified().await;
    // Time passing is the point: outlive the lease with every renewal failing.
    tokio::time::sleep(lease * 4).await;
    app.effects.gate.add_permits(1);
    let first = leader.await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(first.text(), "gated re_1", "the client gets the response");
    // No other attempt took the key while the lease was out of reach: the store still knows
    // this request as its owner and takes the response, so a retry replays it instead of
    // running the request a second time.
    assert!(first.headers.get("idempotent-stored").is_none(), "the store took the response");
    let retry = app.h2(app.post("/gated", "unrenewed"), "{}").await;
    assert!(retry.replayed());
    assert_eq!(retry.text(), "gated re_1");
    assert_eq!(app.effects.calls(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_renewal_that_never_answers_loses_the_lease_when_it_runs_out() {
    let lease = Duration::from_secs(30);
    let store = renew_fails(Arc::new(idempotent_core::MemoryStore::new()), true);
    let effects = Effects::new();
    let lost = Arc::new(tokio::sync::Notify::new());
    let app = routes(&effects).layer(IdempotencyLayer::new(store).lease(lease));
    let watcher = {
        let lost = lost.clone();
        tower::service_fn(move |req: Request<idempotent_tower::server::RequestBody<AxumBody>>| {
            // The handler's attempt is told when the lease runs out, not when (if ever) the
            // hung renewal answers.
            let attempt = req.extensions().get::<Attempt>().cloned().expect("the layer hands the handler its attempt");
            let lost = lost.clone();
            async move {
                attempt.lost().await;
                lost.notify_one();
                Ok::<_, std::convert::Infallible>(Response::new(Full::new(Bytes::from(
                    attempt.lease_lost().to_string(),
                ))))
            }
        })
    };
    let watched = IdempotencyLayer::new(renew_fails(Arc::new(idempotent_core::MemoryStore::new()), true))
        .lease(lease)
        .layer(watcher);
    let watching = tokio::spawn(watched.oneshot(in_process("/watch", "hung")));
    let leader = tokio::spawn(app.clone().oneshot(in_process("/gated", "hung")));
    effects.entered.notified().await;
    // The first renewal (at a third of the lease) hangs; the lease must still count as lost
    // once it has run out.
    tokio::time::sleep(lease + Duration::from_secs(1)).await;
    lost.notified().await;
    let watched = watching.await.unwrap().unwrap();
    assert_eq!(watched.into_body().collect().await.unwrap().to_bytes(), "true");
    effects.gate.add_permits(1);
    let first = leader.await.unwrap().unwrap();
    assert_eq!(first.status(), StatusCode::CREATED);
    // No other attempt took the key: the store still takes the response.
    assert!(first.headers().get("idempotent-stored").is_none());
    let retry = app.oneshot(in_process("/gated", "hung")).await.unwrap();
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    assert_eq!(effects.calls(), 1);
}

async fn absurd_lease_and_retention_are_refused(store: SharedStore) {
    for d in [Duration::ZERO, Duration::MAX] {
        let app = App::start(&store, |l| l.lease(d).retention(d).scope(format!("{d:?}"))).await;
        for _ in 0..2 {
            let reply = app.h1(app.post("/refunds", "absurd"), "{}").await;
            reply.problem(500, "misconfigured");
            assert!(reply.text().contains("out of range"), "{d:?}: {}", reply.text());
        }
        assert_eq!(app.effects.calls(), 0, "{d:?}: a misconfigured layer ran the handler");
    }
}
