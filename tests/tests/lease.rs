//! The lease lifecycle as the executor and the layer drive it: an outcome still reaches the store
//! when the caller's task unwinds from an unrelated panic, and a lease another attempt took over
//! stores nothing.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use idempotent_core::record::Acquire;
use idempotent_core::{Error, MemoryStore, RunContext, SharedStore, Store};
use idempotent_tests::HookedStore;
use idempotent_tower::server::{IdempotencyLayer, RequestBody};
use tokio::sync::{Notify, Semaphore};
use tower::{Layer, ServiceExt, service_fn};

/// What a [`gated_complete`] store shares with the test.
struct Gate {
    /// A `complete` has started.
    entered: Notify,
    /// Permits for `complete`s to go on.
    open: Semaphore,
    /// A `complete` has reached the inner store and answered.
    done: Notify,
}

/// A store whose `complete` says it started, waits for a permit, then goes on.
fn gated_complete() -> (SharedStore, Arc<Gate>) {
    let gate = Arc::new(Gate { entered: Notify::new(), open: Semaphore::new(0), done: Notify::new() });
    let hooked = HookedStore::new(Arc::new(MemoryStore::new())).on_complete({
        let gate = gate.clone();
        move |call| {
            let gate = gate.clone();
            Box::pin(async move {
                gate.entered.notify_one();
                let _permit = gate.open.acquire().await.unwrap();
                let answer = call.forward().await;
                gate.done.notify_one();
                answer
            })
        }
    });
    (Arc::new(hooked), gate)
}

/// A store whose renewals all fail, as if it were out of reach.
fn renew_fails(store: SharedStore) -> SharedStore {
    Arc::new(HookedStore::new(store).on_renew(|call| {
        Box::pin(std::future::ready(Err(Error::Unavailable {
            store: call.store.describe(),
            op: "renew",
            reason: "connection refused (injected)".into(),
            source: None,
        })))
    }))
}

/// The action has run and its `complete` is under way when a sibling future in the same task
/// panics: tokio drops the task's future while the thread unwinds, and the outcome must still be
/// stored (the key would otherwise stay taken for a whole lease, and the next retry run again).
#[tokio::test]
async fn an_executor_completion_dropped_by_a_siblings_panic_still_reaches_the_store() {
    let (store, gate) = gated_complete();
    let ctx = RunContext::new(store.clone(), "sibling-panic");
    let task = tokio::spawn({
        let (ctx, gate) = (ctx.clone(), gate.clone());
        async move {
            let step = ctx.step("charge").run(&1, |_| async { Ok::<u32, Error>(7) });
            let sibling = async {
                gate.entered.notified().await;
                panic!("an unrelated failure in the same task")
            };
            tokio::join!(step, sibling)
        }
    });
    assert!(task.await.unwrap_err().is_panic());
    let done = gate.done.notified();
    gate.open.add_permits(1);
    tokio::time::timeout(Duration::from_secs(10), done).await.expect("the dropped completion never reached the store");
    let (key, fp) = ctx.step("charge").key_for(&1).unwrap();
    let answer = store.acquire(&key, &fp, Duration::from_secs(60), Duration::from_secs(60)).await.unwrap();
    assert!(matches!(answer, Acquire::Replay(_)), "the outcome was not stored: {answer:?}");
}

#[tokio::test]
async fn a_layer_completion_dropped_by_a_siblings_panic_still_reaches_the_store() {
    let (store, gate) = gated_complete();
    let svc = IdempotencyLayer::new(store).layer(service_fn(|_req: Request<RequestBody<Full<Bytes>>>| async {
        Ok::<_, std::convert::Infallible>(
            Response::builder().status(201).body(Full::new(Bytes::from("charged"))).unwrap(),
        )
    }));
    let req = || Request::post("/charge").header("idempotency-key", "k").body(Full::new(Bytes::from("x"))).unwrap();
    let task = tokio::spawn({
        let (svc, gate) = (svc.clone(), gate.clone());
        async move {
            let sibling = async {
                gate.entered.notified().await;
                panic!("an unrelated failure in the same task")
            };
            tokio::join!(svc.oneshot(req()), sibling)
        }
    });
    assert!(task.await.unwrap_err().is_panic());
    let done = gate.done.notified();
    gate.open.add_permits(1);
    tokio::time::timeout(Duration::from_secs(10), done).await.expect("the dropped completion never reached the store");
    let retry = svc.oneshot(req()).await.unwrap();
    assert_eq!(retry.status(), StatusCode::CREATED);
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
}

/// Renewals fail for a whole lease and a retry takes the key over: the first request's
/// response is not stored (marked `Idempotent-Stored: false`), and the retry's is what replays.
#[tokio::test(start_paused = true)]
async fn a_lease_another_attempt_took_over_stores_nothing() {
    let gate = Arc::new(Semaphore::new(0));
    let entered = Arc::new(Notify::new());
    let calls = Arc::new(AtomicU32::new(0));
    let store = renew_fails(Arc::new(MemoryStore::new()));
    let (g, e, c) = (gate.clone(), entered.clone(), calls.clone());
    let svc = IdempotencyLayer::new(store).lease(Duration::from_millis(300)).layer(service_fn(
        move |_req: Request<RequestBody<Full<Bytes>>>| {
            let (g, e, c) = (g.clone(), e.clone(), c.clone());
            async move {
                let n = c.fetch_add(1, Ordering::SeqCst) + 1;
                e.notify_one();
                if n == 1 {
                    let _permit = g.acquire().await.unwrap();
                }
                Ok::<_, std::convert::Infallible>(Response::new(Full::new(Bytes::from(format!("re_{n}")))))
            }
        },
    ));
    let req = || Request::post("/charge").header("idempotency-key", "k").body(Full::new(Bytes::from("x"))).unwrap();
    let first = tokio::spawn(svc.clone().oneshot(req()));
    entered.notified().await;
    // Time passing is the point: the first request's lease runs out with every renewal failing.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let second = svc.clone().oneshot(req()).await.unwrap();
    assert!(second.headers().get("idempotent-stored").is_none());
    assert_eq!(second.into_body().collect().await.unwrap().to_bytes(), "re_2");
    gate.add_permits(1);
    let first = first.await.unwrap().unwrap();
    assert_eq!(first.headers()["idempotent-stored"], "false");
    let replay = svc.oneshot(req()).await.unwrap();
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(replay.into_body().collect().await.unwrap().to_bytes(), "re_2");
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}
