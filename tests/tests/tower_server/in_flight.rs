//! Duplicates of a request still running: 64 at once run the handler once and the others get 409;
//! with `OnInFlight::Wait` they all get the first response, or give up with 409 when the wait runs
//! out.

use std::sync::Arc;
use std::time::Duration;

use http::StatusCode;
use idempotent_core::{OnInFlight, SharedStore};

use crate::app::App;

idempotent_tests::on_every_store!(
    sixty_four_concurrent_requests_run_the_handler_once,
    sixty_four_waiting_requests_all_get_the_first_response,
    a_waiting_duplicate_gives_up_with_409,
);

async fn sixty_four_concurrent_requests_run_the_handler_once(store: SharedStore) {
    let app = Arc::new(App::start(&store, |l| l).await);
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    for i in 0..64 {
        let (app, tx) = (app.clone(), tx.clone());
        tokio::spawn(async move {
            // Half over HTTP/1.1 connections, half multiplexed on one HTTP/2 connection.
            let reply = if i % 2 == 0 {
                app.h1(app.post("/gated", "same-key"), "{}").await
            } else {
                app.h2(app.post("/gated", "same-key"), "{}").await
            };
            tx.send(reply).unwrap();
        });
    }
    // The handler that got the key is held at the gate, so the other 63 are answered first.
    let mut next = async || tokio::time::timeout(Duration::from_secs(20), rx.recv()).await.expect("a reply").unwrap();
    for _ in 0..63 {
        let reply = next().await;
        reply.problem(409, "key-in-use");
        let retry_after: u64 = reply.headers["retry-after"].to_str().unwrap().parse().unwrap();
        assert!((1..=60).contains(&retry_after));
    }
    assert_eq!(app.effects.calls(), 1);
    app.effects.gate.add_permits(1);
    let leader = next().await;
    assert_eq!(leader.status, StatusCode::CREATED);
    assert_eq!(leader.text(), "gated re_1");
    assert!(!leader.replayed());

    let again = app.h2(app.post("/gated", "same-key"), "{}").await;
    assert!(again.replayed());
    assert_eq!(again.body, leader.body);
    assert_eq!(app.effects.calls(), 1);
}

async fn sixty_four_waiting_requests_all_get_the_first_response(store: SharedStore) {
    let app =
        Arc::new(App::start(&store, |l| l.on_in_flight(OnInFlight::Wait { timeout: Duration::from_secs(20) })).await);
    let mut tasks = Vec::new();
    for i in 0..64 {
        let app = app.clone();
        tasks.push(tokio::spawn(async move {
            if i % 2 == 0 {
                app.h1(app.post("/gated", "wait-key"), "{}").await
            } else {
                app.h2(app.post("/gated", "wait-key"), "{}").await
            }
        }));
    }
    app.effects.entered.notified().await;
    app.effects.gate.add_permits(1);
    let mut fresh = 0;
    for t in tasks {
        let reply = tokio::time::timeout(Duration::from_secs(30), t).await.expect("a reply").unwrap();
        assert_eq!(reply.status, StatusCode::CREATED, "{}", reply.text());
        assert_eq!(reply.text(), "gated re_1");
        fresh += usize::from(!reply.replayed());
    }
    assert_eq!(fresh, 1);
    assert_eq!(app.effects.calls(), 1);
}

async fn a_waiting_duplicate_gives_up_with_409(store: SharedStore) {
    let app = Arc::new(
        App::start(&store, |l| l.on_in_flight(OnInFlight::Wait { timeout: Duration::from_millis(300) })).await,
    );
    let leader = {
        let app = app.clone();
        tokio::spawn(async move { app.h1(app.post("/gated", "patient"), "{}").await })
    };
    app.effects.entered.notified().await;
    let started = std::time::Instant::now();
    app.h2(app.post("/gated", "patient"), "{}").await.problem(409, "key-in-use");
    assert!(started.elapsed() >= Duration::from_millis(300), "gave up before the timeout");
    app.effects.gate.add_permits(1);
    assert_eq!(leader.await.unwrap().status, StatusCode::CREATED);
    assert!(app.h2(app.post("/gated", "patient"), "{}").await.replayed());
    assert_eq!(app.effects.calls(), 1);
}
