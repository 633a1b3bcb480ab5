//! What a caller can observe of a call: its metrics (feature `metrics`; `idempotent_core::metrics`),
//! where a result came from (`Step::run_traced`), the layer's `on_replay` hook, and the axum
//! example's `/metrics`.
//!
//! The metrics tests record into a `DebuggingRecorder` set as the thread's local recorder, on a
//! current-thread runtime, so that each test sees its own calls only.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU32, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::routing::post;
use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use idempotent_core::lease::{self, Taken, Terms};
use idempotent_core::metrics::{ACTION_SECONDS, CALLS, LEASES_HELD, STORE_CALL_SECONDS};
use idempotent_core::record::{Acquire, Labels, Transition, encode_ok};
use idempotent_core::store::BoxFuture;
use idempotent_core::{
    Error, FailMode, Key, MemoryStore, OnInFlight, OnRecovered, Provenance, RunContext, SharedStore,
};
use idempotent_tests::{HookedStore, unique};
use idempotent_tower::IdempotencyLayer;
use metrics_util::MetricKind;
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use tokio::sync::Notify;
use tower::ServiceExt;

// ---------------------------------------------------------------------------------------------
// Where a result came from, on every store.

idempotent_tests::on_every_store!(
    run_traced_tells_executed_then_replayed_with_the_attempt,
    an_outcome_stored_without_its_attempt_still_replays,
);

async fn run_traced_tells_executed_then_replayed_with_the_attempt(store: SharedStore) {
    let ctx = RunContext::new(store, unique("run"));
    let (value, how) =
        ctx.step("refund").run_traced(&("o-1", 1500), |a| async move { Ok::<_, Error>(a.number()) }).await.unwrap();
    assert_eq!((value, how), (1, Provenance::Executed { attempt: 1 }));
    assert!(!how.is_replayed());
    let (value, how) = ctx.step("refund").run_traced(&("o-1", 1500), |_| async { Ok::<u32, Error>(99) }).await.unwrap();
    assert_eq!((value, how), (1, Provenance::Replayed { attempt: Some(1) }));
    assert!(how.is_replayed());

    // An error releases the key: the second attempt produces the result, and the replay says so.
    let failed: Result<(u32, _), Error> =
        ctx.step("flaky").run_traced(&7, |_| async { Err(Error::Config("502".into())) }).await;
    assert!(failed.is_err());
    let (_, how) = ctx.step("flaky").run_traced(&7, |a| async move { Ok::<_, Error>(a.number()) }).await.unwrap();
    assert_eq!(how, Provenance::Executed { attempt: 2 });
    let (value, how) = ctx.step("flaky").run_traced(&7, |_| async { Ok::<u32, Error>(0) }).await.unwrap();
    assert_eq!((value, how.attempt(), how.is_replayed()), (2, Some(2), true));
}

async fn an_outcome_stored_without_its_attempt_still_replays(store: SharedStore) {
    // As an older version of the executor stored it (and as `resolve_done` stores one): a tag
    // and the JSON, no attempt.
    let ctx = RunContext::new(store.clone(), unique("run"));
    let (key, fingerprint) = ctx.step("refund").key_for(&("o-2", 700)).unwrap();
    let Taken::Lease(held) =
        lease::acquire(&store, &key, &fingerprint, &Terms::default(), Labels::step("held")).await.unwrap()
    else {
        panic!("the key was free")
    };
    assert_eq!(held.complete(encode_ok("re_old").unwrap()).await.unwrap(), Transition::Ok);
    let (value, how) = ctx
        .step("refund")
        .run_traced(&("o-2", 700), |_| async { Ok::<String, Error>("ran again".into()) })
        .await
        .unwrap();
    assert_eq!((value.as_str(), how), ("re_old", Provenance::Replayed { attempt: None }));
}

// ---------------------------------------------------------------------------------------------
// Metrics: every outcome in its situation, and labels that never carry a key, run id or tenant.

/// One metric as the recorder saw it since the last snapshot.
#[derive(Debug)]
struct Seen {
    kind: MetricKind,
    name: String,
    labels: BTreeMap<String, String>,
    value: DebugValue,
}

/// Everything recorded since the last call; checks that no label value is one of `secrets`
/// (nor contains one).
fn take(snapshotter: &Snapshotter, secrets: &[&str]) -> Vec<Seen> {
    let seen: Vec<Seen> = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .map(|(ck, _, _, value)| {
            let (kind, key) = ck.into_parts();
            let labels = key.labels().map(|l| (l.key().to_owned(), l.value().to_owned())).collect();
            Seen { kind, name: key.name().to_owned(), labels, value }
        })
        .collect();
    for s in &seen {
        for (label, value) in &s.labels {
            for secret in secrets {
                assert!(!value.contains(secret), "label {label}={value} of {} carries {secret:?}", s.name);
            }
        }
    }
    seen
}

/// The calls counted, by outcome, for `step` (asserting the labels are exactly step, store,
/// outcome and the store is `store`).
fn calls(seen: &[Seen], step: &str, store: &str) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for s in seen.iter().filter(|s| s.name == CALLS) {
        assert_eq!(s.kind, MetricKind::Counter);
        assert_eq!(s.labels.keys().collect::<Vec<_>>(), ["outcome", "step", "store"], "{s:?}");
        assert_eq!(s.labels["store"], store, "{s:?}");
        let DebugValue::Counter(n) = s.value else { panic!("{s:?}") };
        if s.labels["step"] == step && n > 0 {
            *out.entry(s.labels["outcome"].clone()).or_default() += n;
        }
    }
    out
}

fn one(outcome: &str) -> BTreeMap<String, u64> {
    BTreeMap::from([(outcome.to_owned(), 1)])
}

/// How many values a histogram got since the last snapshot, for these labels.
fn observed(seen: &[Seen], name: &str, labels: &[(&str, &str)]) -> usize {
    seen.iter()
        .filter(|s| s.name == name && labels.iter().all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v)))
        .map(|s| match &s.value {
            DebugValue::Histogram(values) => values.len(),
            other => panic!("{name} is not a histogram: {other:?}"),
        })
        .sum()
}

/// The net change of the leases-held gauge since the last snapshot.
fn leases_held(seen: &[Seen]) -> f64 {
    seen.iter()
        .filter(|s| s.name == LEASES_HELD)
        .map(|s| match s.value {
            DebugValue::Gauge(v) => v.into_inner(),
            ref other => panic!("{other:?}"),
        })
        .sum()
}

/// What the test store's hooks do: 0 forward, 1 answer `LeaseLost`, 2 fail.
#[derive(Default)]
struct Faults {
    acquire: AtomicU8,
    complete: AtomicU8,
}

fn unavailable(op: &'static str) -> Error {
    Error::Unavailable { store: "memory".into(), op, reason: "injected by the test".into(), source: None }
}

fn faulty_store() -> (SharedStore, Arc<HookedStore<Faults>>) {
    let hooked = Arc::new(
        HookedStore::with_state(Arc::new(MemoryStore::new()), Faults::default())
            .on_acquire(|call| {
                Box::pin(async move {
                    match call.store.state().acquire.load(Ordering::SeqCst) {
                        0 => call.forward().await,
                        _ => Err(unavailable("acquire")),
                    }
                }) as BoxFuture<'_, Result<Acquire, Error>>
            })
            .on_complete(|call| {
                Box::pin(async move {
                    match call.store.state().complete.load(Ordering::SeqCst) {
                        0 => call.forward().await,
                        1 => Ok(Transition::LeaseLost),
                        _ => Err(unavailable("complete")),
                    }
                }) as BoxFuture<'_, Result<Transition, Error>>
            }),
    );
    (hooked.clone() as SharedStore, hooked)
}

#[tokio::test(flavor = "current_thread")]
async fn every_executor_outcome_is_counted_in_its_situation() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _local = metrics::set_default_local_recorder(&recorder);
    let (store, hooked) = faulty_store();
    let faults = hooked.state();
    let (run, tenant) = (unique("secret-run"), "secret-tenant");
    let ctx = RunContext::new(store, &run).tenant(tenant);
    let key = ctx.step("refund").key_for(&("order-1", 1500)).unwrap().0;
    let (hex, short) = (key.to_hex(), key.short().to_string());
    let secrets = [run.as_str(), tenant, &hex, &short, "order-1", "order-2"];
    let seen = || take(&snapshotter, &secrets);
    let ok = |v: u32| move |_| async move { Ok::<_, Error>(v) };

    // executed: the action ran and its result was stored.
    let _: u32 = ctx.step("refund").run(&("order-1", 1500), ok(1)).await.unwrap();
    let s = seen();
    assert_eq!(calls(&s, "refund", "memory"), one("executed"));
    assert_eq!(observed(&s, ACTION_SECONDS, &[("step", "refund"), ("store", "memory")]), 1);
    assert_eq!(observed(&s, STORE_CALL_SECONDS, &[("store", "memory"), ("op", "acquire")]), 1);
    assert_eq!(observed(&s, STORE_CALL_SECONDS, &[("store", "memory"), ("op", "complete")]), 1);
    assert_eq!(leases_held(&s), 0.0, "the lease was counted and given back");
    for m in s.iter().filter(|m| m.name == STORE_CALL_SECONDS) {
        assert_eq!(m.labels.keys().collect::<Vec<_>>(), ["op", "store"]);
    }

    // replayed: nothing ran, no lease was taken.
    let _: u32 = ctx.step("refund").run(&("order-1", 1500), ok(2)).await.unwrap();
    let s = seen();
    assert_eq!(calls(&s, "refund", "memory"), one("replayed"));
    assert_eq!(observed(&s, ACTION_SECONDS, &[]), 0);

    // in_flight: a duplicate that does not wait, while the first call holds the key. The
    // gauge shows the lease held meanwhile.
    let (started, go) = (Notify::new(), Notify::new());
    let holder = ctx.step("slow").run(&("order-2", 1), |_| async {
        started.notify_one();
        go.notified().await;
        Ok::<_, Error>(1u32)
    });
    let duplicate = async {
        started.notified().await;
        let s = seen();
        assert_eq!(leases_held(&s), 1.0, "one lease held while the first call runs");
        let refused: Result<u32, Error> =
            ctx.step("slow").on_in_flight(OnInFlight::Reject).run(&("order-2", 1), ok(2)).await;
        assert!(matches!(refused, Err(Error::InFlight { .. })), "{refused:?}");
        assert_eq!(calls(&seen(), "slow", "memory"), one("in_flight"));
        go.notify_one();
    };
    let (first, ()) = tokio::join!(holder, duplicate);
    assert_eq!(first.unwrap(), 1);
    let s = seen();
    assert_eq!(calls(&s, "slow", "memory"), one("executed"));
    assert_eq!(leases_held(&s), -1.0);

    // mismatch: the same identity with another payload.
    let _: u32 = ctx.step("pay").identity(&"order-2").run(&100, ok(1)).await.unwrap();
    seen();
    let mismatch: Result<u32, Error> = ctx.step("pay").identity(&"order-2").run(&200, ok(2)).await;
    assert!(matches!(mismatch, Err(Error::Mismatch { .. })));
    assert_eq!(calls(&seen(), "pay", "memory"), one("mismatch"));

    // lease_lost: another attempt took the key over before the outcome was stored.
    faults.complete.store(1, Ordering::SeqCst);
    let lost: Result<u32, Error> = ctx.step("lost").run(&1, ok(1)).await;
    assert!(matches!(lost, Err(Error::LeaseLost { .. })), "{lost:?}");
    assert_eq!(calls(&seen(), "lost", "memory"), one("lease_lost"));

    // store_error at acquire: nothing ran.
    faults.complete.store(0, Ordering::SeqCst);
    faults.acquire.store(2, Ordering::SeqCst);
    let down: Result<u32, Error> = ctx.step("down").run(&1, |_| async { unreachable!("nothing runs") }).await;
    assert!(matches!(down, Err(Error::Unavailable { .. })), "{down:?}");
    assert_eq!(calls(&seen(), "down", "memory"), one("store_error"));

    // unprotected: the same failure, failing open.
    let open: u32 = ctx.step("down").fail_mode(FailMode::Open).run(&1, ok(5)).await.unwrap();
    assert_eq!(open, 5);
    assert_eq!(calls(&seen(), "down", "memory"), one("unprotected"));
    faults.acquire.store(0, Ordering::SeqCst);

    // store_error while storing: the action ran, its outcome may not be stored; the record is
    // marked uncertain (an abandon).
    faults.complete.store(2, Ordering::SeqCst);
    let unsure: Result<u32, Error> = ctx.step("unsure").run(&1, ok(1)).await;
    assert!(unsure.as_ref().is_err_and(Error::action_may_have_run), "{unsure:?}");
    let s = seen();
    assert_eq!(calls(&s, "unsure", "memory"), one("store_error"));
    assert_eq!(observed(&s, STORE_CALL_SECONDS, &[("op", "abandon")]), 1);
    faults.complete.store(0, Ordering::SeqCst);

    // needs_attention: the next attempt is recovered and the step stops for a person; every
    // call after it is refused, until the record is resolved.
    let careful = || ctx.step("unsure").on_recovered(OnRecovered::NeedsAttention);
    for _ in 0..2 {
        let stopped: Result<u32, Error> = careful().run(&1, |_| async { unreachable!("nothing runs") }).await;
        assert!(matches!(stopped, Err(Error::NeedsAttention { .. })), "{stopped:?}");
        assert_eq!(calls(&seen(), "unsure", "memory"), one("needs_attention"));
    }
    careful().resolve_not_done(&1).await.unwrap();
    assert_eq!(observed(&seen(), STORE_CALL_SECONDS, &[("op", "resolve")]), 1);

    // failed: a lease out of bounds; nothing reaches the store.
    let bad: Result<u32, Error> = ctx.step("bad").lease(Duration::ZERO).run(&1, ok(1)).await;
    assert!(matches!(bad, Err(Error::Config(_))));
    let s = seen();
    assert_eq!(calls(&s, "bad", "memory"), one("failed"));
    assert_eq!(observed(&s, STORE_CALL_SECONDS, &[]), 0);
}

async fn send(app: &Router, key: &str, body: &str) -> http::Response<Body> {
    let req = Request::post("/refunds")
        .header("idempotency-key", key)
        .header("authorization", "secret-tenant")
        .body(Body::from(body.to_owned()))
        .unwrap();
    app.clone().oneshot(req).await.unwrap()
}

#[tokio::test(flavor = "current_thread")]
async fn every_layer_outcome_is_counted_in_its_situation() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _local = metrics::set_default_local_recorder(&recorder);
    let (store, hooked) = faulty_store();
    let faults = hooked.state();
    let (started, go) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let runs = Arc::new(AtomicU32::new(0));
    let handler = {
        let (started, go, runs) = (started.clone(), go.clone(), runs.clone());
        move |body: String| async move {
            runs.fetch_add(1, Ordering::SeqCst);
            if body == "hold" {
                started.notify_one();
                go.notified().await;
            }
            (http::StatusCode::CREATED, "re_1")
        }
    };
    let layer = IdempotencyLayer::new(store)
        .scope("refunds-api")
        .tenant(|parts| parts.headers.get("authorization").and_then(|v| v.to_str().ok()).map(str::to_owned));
    let app = Router::new().route("/refunds", post(handler)).layer(layer);
    let tenant_key = Key::from_client_key(Some("secret-tenant"), "refunds-api", "secret-key-1");
    let (hex, short) = (tenant_key.to_hex(), tenant_key.short().to_string());
    let secrets = ["secret-tenant", "secret-key", &hex, &short];
    let seen = || take(&snapshotter, &secrets);
    let outcomes = || calls(&seen(), "refunds-api", "memory");

    assert_eq!(send(&app, "secret-key-1", "a").await.status(), 201);
    let s = seen();
    assert_eq!(calls(&s, "refunds-api", "memory"), one("executed"));
    assert_eq!(observed(&s, ACTION_SECONDS, &[("step", "refunds-api"), ("store", "memory")]), 1);
    assert_eq!(send(&app, "secret-key-1", "a").await.headers()["idempotent-replayed"], "true");
    assert_eq!(outcomes(), one("replayed"));
    assert_eq!(send(&app, "secret-key-1", "b").await.status(), 422);
    assert_eq!(outcomes(), one("mismatch"));

    let holder = send(&app, "secret-key-2", "hold");
    let duplicate = async {
        started.notified().await;
        assert_eq!(send(&app, "secret-key-2", "hold").await.status(), 409);
        assert_eq!(outcomes(), one("in_flight"));
        go.notify_one();
    };
    let (first, ()) = tokio::join!(holder, duplicate);
    assert_eq!(first.status(), 201);
    assert_eq!(outcomes(), one("executed"));

    faults.complete.store(1, Ordering::SeqCst);
    assert_eq!(send(&app, "secret-key-3", "a").await.headers()["idempotent-stored"], "false");
    assert_eq!(outcomes(), one("lease_lost"));
    faults.complete.store(0, Ordering::SeqCst);

    faults.acquire.store(2, Ordering::SeqCst);
    assert_eq!(send(&app, "secret-key-4", "a").await.status(), 503);
    assert_eq!(outcomes(), one("store_error"));
    faults.acquire.store(0, Ordering::SeqCst);
    // Three requests reached the handler: the first, the held one and the lease-lost one.
    assert_eq!(runs.load(Ordering::SeqCst), 3);
}

// ---------------------------------------------------------------------------------------------
// The axum example's `/metrics`.

#[tokio::test(flavor = "current_thread")]
async fn the_axum_example_serves_its_counters_at_metrics() {
    use hyper_util::client::legacy::Client;
    use hyper_util::rt::TokioExecutor;
    use idempotent_examples::payments::{Provider, SCOPE, app};

    // The example installs a Prometheus recorder for the process; here it is this thread's,
    // and the server and client run on this thread too.
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    let _local = metrics::set_default_local_recorder(&recorder);
    let provider = Arc::new(Provider::default());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = axum::serve(listener, app(Arc::new(MemoryStore::new()), provider.clone(), handle));
    tokio::spawn(async move { server.await });

    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let refund = || {
        Request::post(format!("http://{addr}/refunds"))
            .header("authorization", "Bearer acct_secret")
            .header("content-type", "application/json")
            .header("idempotency-key", "\"refund-secret-7\"")
            .body(Full::new(Bytes::from(r#"{"order_id":"o-7","amount_cents":1500}"#)))
            .unwrap()
    };
    let first = client.request(refund()).await.unwrap();
    assert_eq!(first.status(), 201);
    let replay = client.request(refund()).await.unwrap();
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(provider.refunds(), 1);

    let res =
        client.request(Request::get(format!("http://{addr}/metrics")).body(Full::default()).unwrap()).await.unwrap();
    assert_eq!(res.status(), 200);
    let text = String::from_utf8(res.into_body().collect().await.unwrap().to_bytes().to_vec()).unwrap();
    let count = |outcome: &str| -> Option<f64> {
        text.lines().filter(|l| l.starts_with(&format!("{CALLS}{{"))).find_map(|line| {
            let (labels, value) = line.rsplit_once(' ')?;
            let wanted = [format!("step=\"{SCOPE}\""), "store=\"memory\"".into(), format!("outcome=\"{outcome}\"")];
            wanted.iter().all(|w| labels.contains(w.as_str())).then(|| value.parse().unwrap())
        })
    };
    assert_eq!(count("executed"), Some(1.0), "{text}");
    assert_eq!(count("replayed"), Some(1.0), "{text}");
    assert_eq!(count("mismatch"), None, "{text}");
    assert!(text.contains(STORE_CALL_SECONDS), "{text}");
    assert!(text.contains(ACTION_SECONDS), "{text}");
    for secret in ["acct_secret", "refund-secret-7", "o-7"] {
        assert!(!text.contains(secret), "/metrics shows {secret:?}:\n{text}");
    }
}
