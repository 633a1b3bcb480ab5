//! Keys stopped for an operator: a recovered request that a layer with
//! `OnRecovered::NeedsAttention` will not rerun blindly, and a key whose outcome was left needing
//! attention; both are 409 and run nothing until an operator resolves the record.

use std::sync::Arc;
use std::time::Duration;

use http::StatusCode;
use http_body_util::BodyExt;
use idempotent_core::{OnInFlight, SharedStore};
use idempotent_tests::HookedStore;
use idempotent_tower::server::IdempotencyLayer;
use tower::ServiceExt;

use crate::app::{App, Effects, in_process, routes};

idempotent_tests::on_every_store!(
    a_key_that_needs_attention_is_409_and_runs_nothing_until_resolved,
    a_layer_that_never_reruns_blindly_stops_a_recovered_request_for_an_operator,
);

async fn a_layer_that_never_reruns_blindly_stops_a_recovered_request_for_an_operator(store: SharedStore) {
    use idempotent_core::OnRecovered;
    use idempotent_core::record::{Resolution, Resolved};
    let effects = Effects::new();
    let layer = IdempotencyLayer::new(store.clone())
        .lease(Duration::from_millis(300))
        .on_in_flight(OnInFlight::Wait { timeout: Duration::from_secs(5) })
        .on_recovered(OnRecovered::NeedsAttention);
    let app = routes(&effects).layer(layer);
    // The first request dies inside its handler (the server dropped it): its lease runs out.
    tokio::select! {
        res = app.clone().oneshot(in_process("/gated", "rec-1")) => panic!("the gated handler answered: {res:?}"),
        () = effects.entered.notified() => {}
    }
    for _ in 0..2 {
        let res = app.clone().oneshot(in_process("/gated", "rec-1")).await.unwrap();
        assert_eq!(res.status(), StatusCode::CONFLICT);
        let doc: serde_json::Value =
            serde_json::from_slice(&res.into_body().collect().await.unwrap().to_bytes()).unwrap();
        assert_eq!(doc["type"], "tag:idempotent-tower,2025:needs-attention", "{doc}");
    }
    assert_eq!(effects.calls(), 1, "the handler did not run again");
    // The operator checks, finds nothing happened, and resolves the key's record as not done.
    let key = idempotent_core::Key::from_client_key(None, "http", "rec-1");
    assert_eq!(store.resolve(&key, Resolution::NotDone).await.unwrap(), Resolved::Ok);
    effects.gate.add_permits(1);
    let res = app.oneshot(in_process("/gated", "rec-1")).await.unwrap();
    assert_eq!(res.status(), StatusCode::CREATED);
    assert_eq!(effects.calls(), 2);
}

/// A store whose first `complete` marks the record as needing attention instead (what an attempt
/// that could not tell whether its effect happened leaves behind), remembering the key.
fn marking(store: SharedStore) -> Arc<HookedStore<std::sync::Mutex<Option<idempotent_core::Key>>>> {
    let marking = HookedStore::with_state(store, std::sync::Mutex::new(None)).on_complete(|call| {
        Box::pin(async move {
            let mut marked = call.store.state().lock().unwrap().replace(*call.key);
            if marked.take().is_some() {
                return call.forward().await;
            }
            call.store.inner().abandon(call.key, call.token, idempotent_core::record::Abandon::NeedsAttention).await
        })
    });
    Arc::new(marking)
}

async fn a_key_that_needs_attention_is_409_and_runs_nothing_until_resolved(store: SharedStore) {
    let marking = marking(store);
    let shared: SharedStore = marking.clone();
    let app = App::start(&shared, |l| l).await;
    // The first request ran the handler; its outcome was left needing attention.
    app.h1(app.post("/refunds", "na-1"), "{}").await;
    assert_eq!(app.effects.calls(), 1);
    for _ in 0..3 {
        let reply = app.h2(app.post("/refunds", "na-1"), "{}").await;
        let doc = reply.problem(409, "needs-attention");
        assert!(reply.headers.get("retry-after").is_none(), "a retry cannot cure it: no Retry-After");
        assert!(doc["detail"].as_str().unwrap().contains("do not retry"), "{doc}");
        assert!(!reply.replayed());
    }
    assert_eq!(app.effects.calls(), 1, "nothing ran while the key needs attention");
    // An operator finds that the refund did not happen, and resolves the record as not done.
    let key = marking.state().lock().unwrap().expect("the marked key");
    let resolved = shared.resolve(&key, idempotent_core::record::Resolution::NotDone).await.unwrap();
    assert_eq!(resolved, idempotent_core::record::Resolved::Ok);
    let reply = app.h1(app.post("/refunds", "na-1"), "{}").await;
    assert_eq!(reply.status, StatusCode::CREATED);
    assert_eq!(app.effects.calls(), 2, "the next request ran the handler");
    let again = app.h1(app.post("/refunds", "na-1"), "{}").await;
    assert!(again.replayed() && again.body == reply.body);
}
