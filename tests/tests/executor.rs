//! The executor on every backend: replay, in-flight policies, errors, cancellation, leases.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use idempotent_core::store::redis::layout;
use idempotent_core::{Error, FailMode, MemoryStore, OnInFlight, RedisStore, RunContext, SharedStore, current_attempt};
use idempotent_tests::{HookedStore, RedisCluster, RedisServer, unique};
use serde::{Deserialize, Serialize};
use tokio::sync::{Barrier, Notify, oneshot};

idempotent_tests::on_every_store!(
    replay_returns_the_first_result,
    errors_release_the_key_for_a_retry,
    stored_errors_replay,
    reject_policy_reports_in_flight,
    wait_policy_returns_the_leaders_result,
    identity_with_changed_payload_is_a_mismatch,
    version_bump_runs_again,
    cancelled_action_is_recovered_with_a_higher_fence,
    heartbeat_keeps_a_long_action_alive,
    lost_lease_is_signalled_and_the_result_refused,
    bad_payloads_are_refused_before_anything_runs,
    runs_each_of_200_keys_once_with_8_callers,
    dropping_the_call_after_the_action_still_stores_the_outcome,
    failing_renewals_for_a_whole_lease_mark_it_lost,
);

async fn replay_returns_the_first_result(store: SharedStore) {
    let ctx = RunContext::new(store, unique("run"));
    let runs = &AtomicU32::new(0);
    for i in 0..3 {
        let out: String = ctx
            .step("refund")
            .run(&("order-1", 1500), |attempt| async move {
                runs.fetch_add(1, Ordering::SeqCst);
                assert_eq!(current_attempt().unwrap().fence(), attempt.fence());
                Ok::<_, Error>(format!("re_{}_{i}", attempt.number()))
            })
            .await
            .unwrap();
        assert_eq!(out, "re_1_0");
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

async fn errors_release_the_key_for_a_retry(store: SharedStore) {
    let ctx = RunContext::new(store, unique("run"));
    let first: Result<u32, Error> =
        ctx.step("flaky").run(&1, |_| async { Err(Error::Config("gateway 502".into())) }).await;
    assert!(matches!(first, Err(Error::Config(_))));
    let second: u32 = ctx
        .step("flaky")
        .run(&1, |attempt| async move {
            assert_eq!(attempt.number(), 2);
            assert!(!attempt.recovered());
            Ok::<_, Error>(7)
        })
        .await
        .unwrap();
    assert_eq!(second, 7);
}

#[derive(Debug, Serialize, Deserialize, PartialEq)]
enum PayError {
    Declined(String),
    Store(String),
}

impl From<Error> for PayError {
    fn from(e: Error) -> Self {
        PayError::Store(e.to_string())
    }
}

async fn stored_errors_replay(store: SharedStore) {
    let ctx = RunContext::new(store, unique("run"));
    let runs = AtomicU32::new(0);
    for _ in 0..3 {
        let res: Result<u32, PayError> = ctx
            .step("charge")
            .run_storing_errors(&("card", 100), |_| async {
                runs.fetch_add(1, Ordering::SeqCst);
                Err(PayError::Declined("insufficient funds".into()))
            })
            .await;
        assert_eq!(res, Err(PayError::Declined("insufficient funds".into())));
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

async fn reject_policy_reports_in_flight(store: SharedStore) {
    let ctx = RunContext::new(store, unique("run"));
    let (started_tx, started_rx) = oneshot::channel();
    let finish = Arc::new(Notify::new());
    let leader = {
        let (ctx, finish) = (ctx.clone(), finish.clone());
        tokio::spawn(async move {
            ctx.step("slow")
                .run(&(), |_| async move {
                    started_tx.send(()).unwrap();
                    finish.notified().await;
                    Ok::<_, Error>(1u8)
                })
                .await
        })
    };
    started_rx.await.unwrap();
    let err = ctx
        .step("slow")
        .on_in_flight(OnInFlight::Reject)
        .run(&(), |_| async { Ok::<_, Error>(2u8) })
        .await
        .unwrap_err();
    let Error::InFlight { retry_after, .. } = &err else { panic!("expected InFlight, got {err}") };
    assert!(*retry_after > Duration::ZERO && *retry_after <= idempotent_core::DEFAULT_LEASE);
    assert!(err.to_string().contains("still running"), "{err}");
    finish.notify_one();
    assert_eq!(leader.await.unwrap().unwrap(), 1);
}

async fn wait_policy_returns_the_leaders_result(store: SharedStore) {
    let ctx = RunContext::new(store, unique("run"));
    let runs = Arc::new(AtomicU32::new(0));
    let callers = 16;
    let barrier = Arc::new(Barrier::new(callers));
    let mut tasks = Vec::new();
    for _ in 0..callers {
        let (ctx, runs, barrier) = (ctx.clone(), runs.clone(), barrier.clone());
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            ctx.step("once")
                .on_in_flight(OnInFlight::Wait { timeout: Duration::from_secs(10) })
                .run(&"same", |a| async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    tokio::task::yield_now().await;
                    Ok::<_, Error>(a.fence())
                })
                .await
        }));
    }
    let mut results = Vec::new();
    for t in tasks {
        results.push(t.await.unwrap().unwrap());
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert!(results.windows(2).all(|w| w[0] == w[1]), "callers saw different results: {results:?}");
}

async fn identity_with_changed_payload_is_a_mismatch(store: SharedStore) {
    let ctx = RunContext::new(store, unique("run"));
    let first: u32 =
        ctx.step("refund").identity(&"order-9").run(&("order-9", 100), |_| async { Ok::<_, Error>(1) }).await.unwrap();
    assert_eq!(first, 1);
    let err = ctx
        .step("refund")
        .identity(&"order-9")
        .run(&("order-9", 999), |_| async { Ok::<u32, Error>(2) })
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Mismatch { .. }), "{err}");
    // Same identity and payload still replays.
    let again: u32 =
        ctx.step("refund").identity(&"order-9").run(&("order-9", 100), |_| async { Ok::<_, Error>(3) }).await.unwrap();
    assert_eq!(again, 1);
}

async fn version_bump_runs_again(store: SharedStore) {
    let ctx = RunContext::new(store, unique("run"));
    let v0: u32 = ctx.step("s").run(&1, |_| async { Ok::<_, Error>(0) }).await.unwrap();
    let v1: u32 = ctx.step("s").version(1).run(&1, |_| async { Ok::<_, Error>(1) }).await.unwrap();
    assert_eq!((v0, v1), (0, 1));
}

async fn cancelled_action_is_recovered_with_a_higher_fence(store: SharedStore) {
    let ctx = RunContext::new(store, unique("run"));
    let lease = Duration::from_millis(300);
    let (fence_tx, fence_rx) = oneshot::channel();
    let call = {
        let ctx = ctx.clone();
        tokio::spawn(async move {
            ctx.step("cancel")
                .lease(lease)
                .run(&(), |a| async move {
                    fence_tx.send(a.fence()).unwrap();
                    std::future::pending::<Result<u8, Error>>().await
                })
                .await
        })
    };
    let first_fence = fence_rx.await.unwrap();
    call.abort();
    assert!(call.await.unwrap_err().is_cancelled());
    // The key stays taken until the lease passes (the store's clock decides).
    let err = ctx
        .step("cancel")
        .lease(lease)
        .on_in_flight(OnInFlight::Reject)
        .run(&(), |_| async { Ok::<u8, Error>(0) })
        .await;
    assert!(matches!(err, Err(Error::InFlight { .. })));
    tokio::time::sleep(lease + Duration::from_millis(200)).await;
    let (recovered, fence, number) = ctx
        .step("cancel")
        .lease(lease)
        .run(&(), |a| async move { Ok::<_, Error>((a.recovered(), a.fence(), a.number())) })
        .await
        .unwrap();
    assert!(recovered);
    assert!(fence > first_fence);
    assert_eq!(number, 2);
}

async fn heartbeat_keeps_a_long_action_alive(store: SharedStore) {
    let ctx = RunContext::new(store, unique("run"));
    let lease = Duration::from_millis(300);
    let (started_tx, started_rx) = oneshot::channel();
    let finish = Arc::new(Notify::new());
    let leader = {
        let (ctx, finish) = (ctx.clone(), finish.clone());
        tokio::spawn(async move {
            ctx.step("long")
                .lease(lease)
                .run(&(), |a| async move {
                    started_tx.send(()).unwrap();
                    finish.notified().await;
                    assert!(!a.lease_lost());
                    Ok::<_, Error>("done".to_string())
                })
                .await
        })
    };
    started_rx.await.unwrap();
    // Three leases later the leader still holds the key, thanks to the heartbeat.
    tokio::time::sleep(lease * 3).await;
    let err = ctx
        .step("long")
        .lease(lease)
        .on_in_flight(OnInFlight::Reject)
        .run(&(), |_| async { Ok::<String, Error>("dup".into()) })
        .await;
    assert!(matches!(err, Err(Error::InFlight { .. })), "{err:?}");
    finish.notify_one();
    assert_eq!(leader.await.unwrap().unwrap(), "done");
}

async fn lost_lease_is_signalled_and_the_result_refused(store: SharedStore) {
    let ctx = RunContext::new(store, unique("run"));
    let lease = Duration::from_millis(200);
    let (started_tx, started_rx) = oneshot::channel();
    let (lost_tx, lost_rx) = oneshot::channel();
    let finish = Arc::new(Notify::new());
    let stale = {
        let (ctx, finish) = (ctx.clone(), finish.clone());
        tokio::spawn(async move {
            // No heartbeat: the lease runs out while the action still runs.
            ctx.step("stale")
                .lease(lease)
                .heartbeat(false)
                .run(&(), |a| async move {
                    started_tx.send(a.fence()).unwrap();
                    finish.notified().await;
                    lost_tx.send(()).ok();
                    Ok::<_, Error>("stale".to_string())
                })
                .await
        })
    };
    let stale_fence = started_rx.await.unwrap();
    tokio::time::sleep(lease + Duration::from_millis(200)).await;
    let fresh: String = ctx
        .step("stale")
        .lease(Duration::from_secs(10))
        .run(&(), |a| async move {
            assert!(a.recovered() && a.fence() > stale_fence);
            Ok::<_, Error>("fresh".to_string())
        })
        .await
        .unwrap();
    finish.notify_one();
    lost_rx.await.unwrap();
    let err = stale.await.unwrap().unwrap_err();
    assert!(matches!(err, Error::LeaseLost { fence, .. } if fence == stale_fence), "{err}");
    assert!(err.action_may_have_run());
    let replay: String = ctx.step("stale").run(&(), |_| async { Ok::<_, Error>("again".to_string()) }).await.unwrap();
    assert_eq!((fresh.as_str(), replay.as_str()), ("fresh", "fresh"));
}

async fn bad_payloads_are_refused_before_anything_runs(store: SharedStore) {
    let ctx = RunContext::new(store, unique("run"));
    let runs = AtomicU32::new(0);
    for bad in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
        let err = ctx
            .step("pay")
            .run(&("order", bad), |_| async {
                runs.fetch_add(1, Ordering::SeqCst);
                Ok::<u8, Error>(0)
            })
            .await
            .unwrap_err();
        assert!(matches!(err, Error::Payload { .. }), "{err}");
        assert!(err.to_string().contains("the action was not run"), "{err}");
    }
    let mut deep = serde_json::json!(0);
    for _ in 0..200 {
        deep = serde_json::json!([deep]);
    }
    let err = ctx.step("pay").run(&deep, |_| async { Ok::<u8, Error>(0) }).await.unwrap_err();
    assert!(matches!(err, Error::Payload { .. }), "{err}");
    // JSON object keys must be strings; an integer-keyed map is refused, not stringified.
    let by_id: std::collections::HashMap<u32, &str> = [(7, "seven")].into();
    let err = ctx.step("pay").run(&by_id, |_| async { Ok::<u8, Error>(0) }).await.unwrap_err();
    assert!(err.to_string().contains("keys are integers"), "{err}");
    // Identity taken from a non-finite value is refused too.
    let err = ctx.step("pay").identity(&f64::NAN).run(&1, |_| async { Ok::<u8, Error>(0) }).await.unwrap_err();
    assert!(matches!(err, Error::Payload { .. }), "{err}");
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    // Integers beyond 2^53 are never rounded onto their neighbours.
    let step = ctx.step("pay");
    let (a, _) = step.key_for(&(1u64 << 53)).unwrap();
    let (b, _) = step.key_for(&((1u64 << 53) + 1)).unwrap();
    assert_ne!(a, b);
    // Lone surrogates cannot exist in a Rust string; in JSON bytes they are refused.
    assert!(idempotent_core::canonical::canonicalize_json(br#"{"name":"\ud800"}"#).is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_open_runs_unprotected_and_fail_closed_does_not() {
    // A port nobody listens on: connection refused at once.
    let port = idempotent_tests::free_port(false);
    let store = RedisStore::builder(format!("redis://127.0.0.1:{port}"))
        .command_timeout(Duration::from_millis(300))
        .connect_lazy()
        .unwrap();
    let ctx = RunContext::new(store, unique("run"));
    let runs = &AtomicU32::new(0);
    let err = ctx
        .step("s")
        .run(&1, |_| async {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok::<u8, Error>(1)
        })
        .await
        .unwrap_err();
    assert!(err.is_store_failure(), "{err}");
    assert!(err.to_string().contains("the action was not run"), "{err}");
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    let out: bool = ctx
        .step("s")
        .fail_mode(FailMode::Open)
        .run(&1, |a| async move {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok::<_, Error>(a.is_unprotected())
        })
        .await
        .unwrap();
    assert!(out);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_runs_each_of_many_keys_once() {
    let cluster = RedisCluster::start();
    let store: SharedStore = Arc::new(RedisStore::cluster_builder(cluster.urls()).connect_lazy().unwrap());
    concurrent_keys(store, 50, 4).await;
}

async fn runs_each_of_200_keys_once_with_8_callers(store: SharedStore) {
    concurrent_keys(store, 200, 8).await;
}

/// `keys` operations × `callers` concurrent callers each: exactly `keys` actions run, and every
/// caller of a key sees the same result.
async fn concurrent_keys(store: SharedStore, keys: usize, callers: usize) {
    let ctx = RunContext::new(store, unique("run"));
    let ledger = Arc::new(std::sync::Mutex::new(std::collections::HashMap::<usize, u32>::new()));
    let mut tasks = Vec::new();
    for k in 0..keys {
        for _ in 0..callers {
            let (ctx, ledger) = (ctx.clone(), ledger.clone());
            tasks.push(tokio::spawn(async move {
                let fence: u64 = ctx
                    .step("effect")
                    .run(&k, |a| async move {
                        *ledger.lock().unwrap().entry(k).or_default() += 1;
                        Ok::<_, Error>(a.fence())
                    })
                    .await
                    .unwrap();
                (k, fence)
            }));
        }
    }
    let mut seen = std::collections::HashMap::new();
    for t in tasks {
        let (k, fence) = t.await.unwrap();
        assert_eq!(*seen.entry(k).or_insert(fence), fence, "key {k}: callers saw different results");
    }
    let ledger = ledger.lock().unwrap();
    assert_eq!(ledger.len(), keys);
    assert!(ledger.values().all(|&n| n == 1), "some key ran more than once: {ledger:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeat_tells_the_action_when_its_lease_was_taken_over() {
    let server = RedisServer::start();
    let store = RedisStore::connect_lazy(server.url()).unwrap();
    let ctx = RunContext::new(store.clone(), unique("run"));
    let lease = Duration::from_millis(600);
    let (started_tx, started_rx) = oneshot::channel();
    let holder = {
        let ctx = ctx.clone();
        tokio::spawn(async move {
            ctx.step("watched")
                .lease(lease)
                .run(&(), |a| async move {
                    started_tx.send(a.fence()).unwrap();
                    // Resolves only when a heartbeat finds another owner.
                    a.lost().await;
                    Ok::<_, Error>(a.lease_lost())
                })
                .await
        })
    };
    let fence = started_rx.await.unwrap();
    // Make the holder's lease look passed on the server, as a long GC pause or a partition would,
    // and let a second worker take over.
    let (key, _) = ctx.step("watched").key_for(&()).unwrap();
    // A running record with a lease deadline of 0 (a record SET NX wrote, state N, becomes R as
    // a renew would make it).
    let passed = format!(
        "redis.call('SETRANGE', KEYS[1], {}, '{}') return redis.call('SETRANGE', KEYS[1], {}, '{}')",
        layout::STATE,
        char::from(layout::RUNNING),
        layout::LEASE.start,
        "0".repeat(layout::LEASE.len())
    );
    server.cmd(&["EVAL", &passed, "1", &store.redis_key(&key)]);
    let (recovered, new_fence) = ctx
        .step("watched")
        .lease(Duration::from_secs(30))
        .heartbeat(false)
        .run(&(), |a| async move { Ok::<_, Error>((a.recovered(), a.fence())) })
        .await
        .unwrap();
    assert!(recovered && new_fence > fence);
    let err = holder.await.unwrap().unwrap_err();
    assert!(matches!(err, Error::LeaseLost { fence: f, .. } if f == fence), "{err}");
}

/// What a [`gated`] store's `complete` hook shares with the test.
struct Gate {
    complete_entered: std::sync::Mutex<Option<oneshot::Sender<()>>>,
    complete_gate: tokio::sync::watch::Receiver<bool>,
    complete_done: Arc<Notify>,
}

/// `store` with its `complete` and `renew` held or failed, to place faults exactly.
fn gated(
    store: SharedStore,
    renew_fails: bool,
) -> (Arc<HookedStore<Gate>>, oneshot::Receiver<()>, tokio::sync::watch::Sender<bool>) {
    let (entered_tx, entered_rx) = oneshot::channel();
    let (open, gate) = tokio::sync::watch::channel(false);
    let state = Gate {
        complete_entered: std::sync::Mutex::new(Some(entered_tx)),
        complete_gate: gate,
        complete_done: Arc::new(Notify::new()),
    };
    let store = HookedStore::with_state(store, state)
        .describe_as(|inner| format!("gated {inner} (test)"))
        .on_complete(|call| {
            Box::pin(async move {
                let s = call.store.state();
                if let Some(tx) = s.complete_entered.lock().unwrap().take() {
                    let _ = tx.send(());
                }
                let mut gate = s.complete_gate.clone();
                let _ = gate.wait_for(|open| *open).await;
                let t = call.forward().await;
                s.complete_done.notify_waiters();
                t
            })
        })
        .on_renew(move |call| {
            if renew_fails {
                return Box::pin(async { Err(Error::Config("renewals are failing in this test".into())) });
            }
            call.forward()
        });
    (Arc::new(store), entered_rx, open)
}

/// The caller's future is dropped after the action finished but before `complete` landed (a
/// timeout around the step): the outcome is still stored, and the retry replays it.
async fn dropping_the_call_after_the_action_still_stores_the_outcome(store: SharedStore) {
    let (store, complete_entered, open) = gated(store, false);
    let done = store.state().complete_done.clone();
    let ctx = RunContext::new(store.clone() as SharedStore, unique("run"));
    let runs = Arc::new(AtomicU32::new(0));
    let call = {
        let (ctx, runs) = (ctx.clone(), runs.clone());
        tokio::spawn(async move {
            ctx.step("refund")
                .run(&1, |_| async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    Ok::<_, Error>("re_1".to_string())
                })
                .await
        })
    };
    complete_entered.await.unwrap();
    call.abort();
    assert!(call.await.unwrap_err().is_cancelled());
    let stored = done.notified();
    open.send_replace(true);
    stored.await;
    let again: String = ctx.step("refund").run(&1, |_| async { Ok::<_, Error>("re_2".to_string()) }).await.unwrap();
    assert_eq!(again, "re_1");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// Renewals that keep failing for a whole lease count as a lost lease: the action is told.
async fn failing_renewals_for_a_whole_lease_mark_it_lost(store: SharedStore) {
    let (store, _entered, open) = gated(store, true);
    open.send_replace(true);
    let ctx = RunContext::new(store as SharedStore, unique("run"));
    let (was_lost, number) = ctx
        .step("long")
        .lease(Duration::from_millis(300))
        .run(&(), |a| async move {
            assert!(!a.lease_lost());
            // Resolves once the executor concludes the lease is over.
            a.lost().await;
            Ok::<_, Error>((a.lease_lost(), a.number()))
        })
        .await
        .unwrap();
    assert!(was_lost);
    assert_eq!(number, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_range_durations_are_refused_before_anything_runs() {
    let ctx = RunContext::new(MemoryStore::new(), unique("run"));
    for step in [
        ctx.step("s").lease(Duration::ZERO),
        ctx.step("s").lease(Duration::from_secs(2 * 24 * 3600)),
        ctx.step("s").retention(Duration::MAX),
        ctx.step("s").retention(Duration::ZERO),
    ] {
        let err = step.run(&1, |_| async { Ok::<u8, Error>(1) }).await.unwrap_err();
        assert!(matches!(err, Error::Config(ref m) if m.contains("out of range")), "{err}");
    }
    let ok: u8 = ctx
        .step("s")
        .retention(idempotent_core::MAX_RETENTION)
        .lease(idempotent_core::MAX_LEASE)
        .run(&1, |_| async { Ok::<_, Error>(2) })
        .await
        .unwrap();
    assert_eq!(ok, 2);
}
