//! Requests dropped mid-way, as hyper drops them when the client goes away: while the response's
//! body is read or `complete` is in flight the response is still stored, and while `release` is in
//! flight the key is still freed, so the retry does not wait out the lease.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::body::Body as AxumBody;
use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use idempotent_core::{OnInFlight, SharedStore};
use idempotent_tests::HookedStore;
use idempotent_tower::server::IdempotencyLayer;
use tokio::sync::{Notify, Semaphore};
use tower::ServiceExt;

use crate::app::{BoxError, Effects, in_process, routes};

idempotent_tests::on_every_store!(
    a_request_dropped_while_its_body_is_read_still_stores_the_response,
    a_request_dropped_while_complete_is_in_flight_still_stores_the_response,
    a_request_dropped_while_release_is_in_flight_still_frees_the_key,
);

async fn a_request_dropped_while_its_body_is_read_still_stores_the_response(store: SharedStore) {
    let effects = Effects::new();
    // A retry that waits for the first response; it gives up (409) long before a lease of 60 s
    // would free a key left `running`.
    let layer = IdempotencyLayer::new(store).on_in_flight(OnInFlight::Wait { timeout: Duration::from_secs(3) });
    let app = routes(&effects).layer(layer);
    tokio::select! {
        res = app.clone().oneshot(in_process("/slow-body", "dropped")) => {
            panic!("the response came before its body could be read: {:?}", res.map(|r| r.status()))
        }
        // The handler has answered and the layer is reading the body: drop the request.
        () = effects.entered.notified() => {}
    }
    effects.gate.add_permits(1);
    let retry = app.oneshot(in_process("/slow-body", "dropped")).await.unwrap();
    assert_eq!(retry.status(), StatusCode::CREATED, "the response was never stored");
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    assert_eq!(retry.into_body().collect().await.unwrap().to_bytes(), "slow re_1");
    assert_eq!(effects.calls(), 1, "the retry ran the handler again");
}

/// What a [`slow_complete`] or [`slow_release`] store shares with the test.
struct SlowComplete {
    entered: Notify,
    gate: Semaphore,
}

impl SlowComplete {
    /// Says the call started, then waits for the test to open the gate.
    async fn hold(&self) {
        self.entered.notify_one();
        self.gate.acquire().await.unwrap().forget();
    }
}

/// A store whose `release` waits at a gate after saying it started.
fn slow_release(store: SharedStore) -> Arc<HookedStore<SlowComplete>> {
    let state = SlowComplete { entered: Notify::new(), gate: Semaphore::new(0) };
    let slow = HookedStore::with_state(store, state).describe_as(|inner| format!("slow-release {inner}"));
    Arc::new(slow.on_release(|call| {
        Box::pin(async move {
            call.store.state().hold().await;
            call.forward().await
        })
    }))
}

/// A store whose `complete` waits at a gate after saying it started.
fn slow_complete(store: SharedStore) -> Arc<HookedStore<SlowComplete>> {
    let state = SlowComplete { entered: Notify::new(), gate: Semaphore::new(0) };
    let slow = HookedStore::with_state(store, state).describe_as(|inner| format!("slow-complete {inner}"));
    Arc::new(slow.on_complete(|call| {
        Box::pin(async move {
            call.store.state().hold().await;
            call.forward().await
        })
    }))
}

/// The service fails (a tower error, not a response), and the client goes away while the layer
/// gives the key up: the key is still freed, so the retry runs the service again instead of
/// waiting out the lease.
async fn a_request_dropped_while_release_is_in_flight_still_frees_the_key(store: SharedStore) {
    let slow = slow_release(store);
    let shared: SharedStore = slow.clone();
    let calls = Arc::new(AtomicUsize::new(0));
    let failing = tower::service_fn({
        let calls = calls.clone();
        move |_: Request<idempotent_tower::server::RequestBody<AxumBody>>| {
            calls.fetch_add(1, Ordering::SeqCst);
            async { Err::<Response<Full<Bytes>>, BoxError>("the upstream failed".into()) }
        }
    });
    let layer = IdempotencyLayer::new(shared).on_in_flight(OnInFlight::Wait { timeout: Duration::from_secs(3) });
    let svc = tower::Layer::layer(&layer, failing);
    tokio::select! {
        res = svc.clone().oneshot(in_process("/refunds", "dropped-error")) => {
            panic!("the call ended before the key was released: {:?}", res.map(|r| r.status()))
        }
        () = slow.state().entered.notified() => {}
    }
    slow.state().gate.add_permits(2);
    let retry = svc.oneshot(in_process("/refunds", "dropped-error")).await;
    assert!(retry.is_err(), "the retry should reach the failing service, got {:?}", retry.map(|r| r.status()));
    assert_eq!(calls.load(Ordering::SeqCst), 2, "the key stayed held: the retry did not reach the service");
}

async fn a_request_dropped_while_complete_is_in_flight_still_stores_the_response(store: SharedStore) {
    let slow = slow_complete(store);
    let effects = Effects::new();
    let shared: SharedStore = slow.clone();
    let layer = IdempotencyLayer::new(shared).on_in_flight(OnInFlight::Wait { timeout: Duration::from_secs(3) });
    let app = routes(&effects).layer(layer);
    tokio::select! {
        res = app.clone().oneshot(in_process("/refunds", "dropped")) => {
            panic!("the response came before it was stored: {:?}", res.map(|r| r.status()))
        }
        () = slow.state().entered.notified() => {}
    }
    slow.state().gate.add_permits(1);
    let retry = app.oneshot(in_process("/refunds", "dropped")).await.unwrap();
    assert_eq!(retry.status(), StatusCode::CREATED, "the response was never stored");
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    assert_eq!(retry.headers()["x-refund"], "re_1");
    assert_eq!(effects.calls(), 1, "the retry ran the handler again");
}
