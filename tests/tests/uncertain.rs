//! Uncertain outcomes on every store: a worker charges and dies before its outcome is stored
//! (another process, SIGKILLed; for the in-memory store, an aborted task), and the retry
//! verifies, runs again, or stops for a person. Also: storing the outcome fails, and verifiers
//! that fail or hang.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use futures_util::future::join_all;
use idempotent_core::record::Resolved;
use idempotent_core::{Attempt, Error, MemoryStore, OnInFlight, OnRecovered, RunContext, SharedStore, Store, Verdict};
use idempotent_tests::matrix::Kind;
use idempotent_tests::uncertain::{Backend, PAYLOAD, RUN, STEP, crash_after_charge, ledger_verifier};
use idempotent_tests::{HookedStore, RedisServer};

/// The worker that is killed after it charged.
const EFFECT_CHILD: &str = env!("CARGO_BIN_EXE_effect_child");

/// The worker's lease: the retry waits it out.
const LEASE: Duration = Duration::from_millis(400);

idempotent_tests::on_every_store!(
    a_verifier_that_finds_the_charge_stores_it_and_nothing_runs_again,
    a_verifier_that_finds_nothing_runs_the_action_once_more_under_the_same_downstream_key,
    an_unknown_verdict_stops_every_call_until_resolved_as_done,
    a_step_that_never_reruns_blindly_needs_attention_and_resolves_as_not_done,
    a_failing_or_hanging_verifier_leaves_the_record_for_the_next_call,
    a_failed_complete_makes_the_next_call_verify_at_once,
    a_lost_complete_reply_replays_without_verifying,
);

/// An action or verifier that must not be called.
fn never<T>(what: &'static str) -> impl FnOnce(Attempt) -> std::future::Ready<Result<T, Error>> {
    move |_| panic!("the {what} must not be called")
}

async fn a_verifier_that_finds_the_charge_stores_it_and_nothing_runs_again(b: Backend) {
    let ledger = b.ledger();
    let (key, fence) = crash_after_charge(b.worker(EFFECT_CHILD), &ledger, LEASE).await;
    let ctx = b.ctx();
    let verified = AtomicU32::new(0);
    let charge: String = ctx
        .step(STEP)
        .verify(|attempt: Attempt| {
            verified.fetch_add(1, Ordering::SeqCst);
            assert!(attempt.recovered(), "the worker died holding the key");
            assert!(attempt.fence() > fence);
            assert_eq!(attempt.downstream_key().as_str(), key, "the same downstream key across processes");
            ledger_verifier(&ledger)(attempt)
        })
        .run(&PAYLOAD, never("action"))
        .await
        .unwrap();
    assert_eq!(verified.load(Ordering::SeqCst), 1);
    assert_eq!(charge, ledger.find(&key).expect("the worker's charge").id);
    for _ in 0..3 {
        let again: String = ctx.step(STEP).verify(never("verifier")).run(&PAYLOAD, never("action")).await.unwrap();
        assert_eq!(again, charge, "replayed");
    }
    assert_eq!(ledger.charges().len(), 1, "charged once");
}

async fn a_verifier_that_finds_nothing_runs_the_action_once_more_under_the_same_downstream_key(b: Backend) {
    let ledger = b.ledger();
    let (key, _) = crash_after_charge(b.worker(EFFECT_CHILD), &ledger, LEASE).await;
    let ctx = b.ctx();
    let runs = AtomicU32::new(0);
    // The provider's lookup missed the charge (say, its search index lags): the action runs,
    // and the provider deduplicates it by the downstream key.
    let charge: String = ctx
        .step(STEP)
        .verify(|_| async { Ok::<_, Error>(Verdict::NotDone) })
        .run(&PAYLOAD, |attempt| async {
            let attempt = attempt;
            runs.fetch_add(1, Ordering::SeqCst);
            assert!(attempt.recovered());
            assert_eq!(attempt.downstream_key().as_str(), key);
            Ok::<_, Error>(ledger.charge(attempt.downstream_key().as_str(), PAYLOAD.1))
        })
        .await
        .unwrap();
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the action ran once more");
    assert_eq!(ledger.charges().len(), 1, "and the provider charged once, by the downstream key");
    assert_eq!(charge, ledger.charges()[0].id);
    let again: String = ctx.step(STEP).verify(never("verifier")).run(&PAYLOAD, never("action")).await.unwrap();
    assert_eq!(again, charge);
}

async fn an_unknown_verdict_stops_every_call_until_resolved_as_done(b: Backend) {
    let ledger = b.ledger();
    let (key, fence) = crash_after_charge(b.worker(EFFECT_CHILD), &ledger, LEASE).await;
    let ctx = b.ctx();
    let first: Result<String, Error> =
        ctx.step(STEP).verify(|_| async { Ok::<_, Error>(Verdict::Unknown) }).run(&PAYLOAD, never("action")).await;
    let Err(error @ Error::NeedsAttention { .. }) = first else { panic!("expected NeedsAttention, got {first:?}") };
    let message = error.to_string();
    assert!(message.contains("resolve_done") && message.contains(&key) && !message.contains("  "), "{message}");
    let Error::NeedsAttention { attempt, fence: marked, downstream_key, .. } = error else { unreachable!() };
    assert_eq!(attempt, 2, "the verifying attempt left it");
    assert!(marked > fence);
    assert_eq!(downstream_key, key);
    // 50 concurrent calls: nothing runs, every one is told.
    let calls = (0..50).map(|_| async {
        ctx.step(STEP).verify(never("verifier")).run::<_, String, Error, _, _, _>(&PAYLOAD, never("action")).await
    });
    for answer in join_all(calls).await {
        assert!(matches!(answer, Err(Error::NeedsAttention { attempt: 2, .. })), "{answer:?}");
    }
    // A person checks the provider, finds the charge, and resolves the record with it.
    let found = ledger.find(&key).unwrap().id;
    assert_eq!(ctx.step(STEP).resolve_done(&PAYLOAD, &found).await.unwrap(), Resolved::Ok);
    assert_eq!(ctx.step(STEP).resolve_done(&PAYLOAD, &found).await.unwrap(), Resolved::Unchanged);
    let calls = (0..50).map(|_| async {
        ctx.step(STEP).verify(never("verifier")).run::<_, String, Error, _, _, _>(&PAYLOAD, never("action")).await
    });
    for answer in join_all(calls).await {
        assert_eq!(answer.unwrap(), found, "the resolution replays");
    }
    assert_eq!(ledger.charges().len(), 1);
}

async fn a_step_that_never_reruns_blindly_needs_attention_and_resolves_as_not_done(b: Backend) {
    let ledger = b.ledger();
    crash_after_charge(b.worker(EFFECT_CHILD), &ledger, LEASE).await;
    let ctx = b.ctx();
    let first: Result<String, Error> =
        ctx.step(STEP).on_recovered(OnRecovered::NeedsAttention).run(&PAYLOAD, never("action")).await;
    assert!(matches!(first, Err(Error::NeedsAttention { attempt: 2, .. })), "{first:?}");
    // A step that would re-run blindly is stopped too: the record waits, whatever the caller.
    let blind: Result<String, Error> = ctx.step(STEP).run(&PAYLOAD, never("action")).await;
    assert!(matches!(blind, Err(Error::NeedsAttention { .. })), "{blind:?}");
    // The person finds no charge (say, the provider refunded it): resolved as not done.
    assert_eq!(ctx.step(STEP).resolve_not_done(&PAYLOAD).await.unwrap(), Resolved::Ok);
    let charge: String = ctx
        .step(STEP)
        .on_recovered(OnRecovered::NeedsAttention)
        .run(&PAYLOAD, |attempt| async move {
            assert!(!attempt.recovered(), "a fresh attempt after the resolution");
            assert_eq!(attempt.number(), 3);
            Ok::<_, Error>("ch_after_resolution".to_owned())
        })
        .await
        .unwrap();
    assert_eq!(charge, "ch_after_resolution");
}

async fn a_failing_or_hanging_verifier_leaves_the_record_for_the_next_call(b: Backend) {
    let ledger = b.ledger();
    let (key, _) = crash_after_charge(b.worker(EFFECT_CHILD), &ledger, LEASE).await;
    let ctx = b.ctx();
    let failed: Result<String, Error> = ctx
        .step(STEP)
        .verify(|_| async { Err(Error::Config("provider lookup: 502".into())) })
        .run(&PAYLOAD, never("action"))
        .await;
    assert!(matches!(&failed, Err(Error::Config(m)) if m.contains("502")), "{failed:?}");
    // The next call verifies again at once (no lease to wait out: `Reject` would say in flight).
    let hung: Result<String, Error> = ctx
        .step(STEP)
        .on_in_flight(OnInFlight::Reject)
        .verify_timeout(Duration::from_millis(200))
        .verify(|attempt: Attempt| async move {
            assert!(attempt.recovered());
            std::future::pending::<Result<Verdict<String>, Error>>().await
        })
        .run(&PAYLOAD, never("action"))
        .await;
    assert!(matches!(hung, Err(Error::VerifyTimeout { .. })), "{hung:?}");
    let charge: String = ctx
        .step(STEP)
        .on_in_flight(OnInFlight::Reject)
        .verify(ledger_verifier(&ledger))
        .run(&PAYLOAD, never("action"))
        .await
        .unwrap();
    assert_eq!(charge, ledger.find(&key).unwrap().id);
    assert_eq!(ledger.charges().len(), 1);
}

/// A store whose first `complete` fails: with `reaches` the call reaches the inner store first
/// (its reply is lost), without it nothing is stored.
fn failing_complete(inner: SharedStore, reaches: bool) -> SharedStore {
    let failed = AtomicU32::new(0);
    Arc::new(HookedStore::with_state(inner, failed).on_complete(move |call| {
        Box::pin(async move {
            if call.store.state().fetch_add(1, Ordering::SeqCst) > 0 {
                return call.forward().await;
            }
            let store = call.store.describe();
            if reaches {
                call.forward().await?;
            }
            Err(Error::Unavailable { store, op: "complete", reason: "connection reset".into(), source: None })
        })
    }))
}

async fn a_failed_complete_makes_the_next_call_verify_at_once(b: Backend) {
    let ledger = b.ledger();
    let ctx = RunContext::new(failing_complete(b.store.clone(), false), RUN);
    let first: Result<String, Error> = ctx
        .step(STEP)
        .verify(never("verifier"))
        .run(&PAYLOAD, |attempt| {
            let ledger = ledger.clone();
            async move { Ok(ledger.charge(attempt.downstream_key().as_str(), PAYLOAD.1)) }
        })
        .await;
    let err = first.unwrap_err();
    assert!(matches!(err, Error::Unavailable { op: "complete", .. }) && err.action_may_have_run(), "{err:?}");
    // Marked uncertain: the next call takes the key at once and verifies.
    let verified = AtomicU32::new(0);
    let charge: String = ctx
        .step(STEP)
        .on_in_flight(OnInFlight::Reject)
        .verify(|attempt: Attempt| {
            verified.fetch_add(1, Ordering::SeqCst);
            ledger_verifier(&ledger)(attempt)
        })
        .run(&PAYLOAD, never("action"))
        .await
        .unwrap();
    assert_eq!(verified.load(Ordering::SeqCst), 1);
    assert_eq!(charge, ledger.charges()[0].id);
    assert_eq!(ledger.charges().len(), 1);
}

async fn a_lost_complete_reply_replays_without_verifying(b: Backend) {
    let ledger = b.ledger();
    let ctx = RunContext::new(failing_complete(b.store.clone(), true), RUN);
    let first: Result<String, Error> = ctx
        .step(STEP)
        .verify(never("verifier"))
        .run(&PAYLOAD, |attempt| {
            let ledger = ledger.clone();
            async move { Ok(ledger.charge(attempt.downstream_key().as_str(), PAYLOAD.1)) }
        })
        .await;
    assert!(matches!(first, Err(Error::Unavailable { op: "complete", .. })), "{first:?}");
    // The outcome was stored after all: the mark changed nothing, and the next call replays.
    let charge: String = ctx
        .step(STEP)
        .on_in_flight(OnInFlight::Reject)
        .verify(never("verifier"))
        .run(&PAYLOAD, never("action"))
        .await
        .unwrap();
    assert_eq!(charge, ledger.charges()[0].id);
}

// ---------------------------------------------------------------------------------------------
// The executor's edges, on the in-memory store

/// A store whose renewals all fail: a lease held on it is lost once it runs out locally.
fn renewals_fail(inner: SharedStore) -> SharedStore {
    Arc::new(HookedStore::new(inner).on_renew(|call| {
        let store = call.store.describe();
        Box::pin(
            async move { Err(Error::Unavailable { store, op: "renew", reason: "partitioned".into(), source: None }) },
        )
    }))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_verifier_that_outlives_its_lease_runs_nothing() {
    let b = Backend::start(Kind::Memory).await;
    let ledger = b.ledger();
    crash_after_charge(b.worker(EFFECT_CHILD), &ledger, LEASE).await;
    let runs = Arc::new(AtomicU32::new(0));
    // A verifies on a partitioned link: its lease runs out while its verifier waits.
    let answer = Arc::new(tokio::sync::Notify::new());
    let verifying = Arc::new(tokio::sync::Notify::new());
    let a = {
        let ctx = RunContext::new(renewals_fail(b.store.clone()), RUN);
        let (runs, answer, verifying) = (runs.clone(), answer.clone(), verifying.clone());
        tokio::spawn(async move {
            ctx.step(STEP)
                .lease(LEASE)
                .verify(|_| async move {
                    verifying.notify_one();
                    answer.notified().await;
                    Ok::<_, Error>(Verdict::NotDone)
                })
                .run(&PAYLOAD, |_| async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    Ok::<_, Error>("ch_a".to_owned())
                })
                .await
        })
    };
    verifying.notified().await;
    // B takes over once A's lease has run out, finds nothing and runs the action.
    let charge: String = b
        .ctx()
        .step(STEP)
        .verify(|_| async { Ok::<_, Error>(Verdict::NotDone) })
        .run(&PAYLOAD, |_| async {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok::<_, Error>("ch_b".to_owned())
        })
        .await
        .unwrap();
    assert_eq!(charge, "ch_b");
    // A's verifier answers "not done" only now: its lease is gone, so it must not run the action.
    answer.notify_one();
    let a = a.await.unwrap();
    assert!(matches!(a, Err(Error::LeaseLost { .. })), "{a:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 1, "only B ran the action");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_result_too_large_to_store_leaves_the_next_attempt_recovered() {
    let ctx = RunContext::new(MemoryStore::new(), "too-large");
    let first: Result<String, Error> =
        ctx.step("charge").max_result_bytes(10).run(&1, |_| async { Ok::<_, Error>("x".repeat(100)) }).await;
    assert!(matches!(first, Err(Error::ResultTooLarge { .. })), "{first:?}");
    // The charge happened and nothing says so: the next attempt is recovered, so a step that
    // never re-runs blindly stops for a person instead of charging again.
    let second: Result<String, Error> = ctx
        .step("charge")
        .on_in_flight(OnInFlight::Reject)
        .on_recovered(OnRecovered::NeedsAttention)
        .run(&1, never("action"))
        .await;
    assert!(matches!(second, Err(Error::NeedsAttention { attempt: 2, .. })), "{second:?}");
    // A resolution is checked as a result is: too large is refused, and the record still waits.
    let big = ctx.step("charge").max_result_bytes(10).resolve_done(&1, &"y".repeat(100)).await;
    assert!(matches!(big, Err(Error::ResultTooLarge { .. })), "{big:?}");
    assert_eq!(ctx.step("charge").resolve_done(&1, "ch_1").await.unwrap(), Resolved::Ok);
    let replayed: String = ctx.step("charge").run(&1, never("action")).await.unwrap();
    assert_eq!(replayed, "ch_1");
}

/// An acquire that takes over an uncertain record and then fails (its reply is lost) releases
/// the key it took in the background: the record stays uncertain, so the next attempt is still
/// recovered (and verifies) instead of running blind.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failed_acquire_that_took_over_an_uncertain_record_leaves_it_uncertain() {
    use idempotent_core::record::{Abandon, Acquire, Transition};
    use idempotent_core::{Fingerprint, Key, RedisStore};
    use idempotent_tests::proxy::{Fault, FaultProxy};

    let server = RedisServer::start();
    let direct = RedisStore::connect_lazy(server.url()).unwrap();
    direct.warm_up().await.unwrap();
    let proxy = FaultProxy::start(([127, 0, 0, 1], server.port()).into()).await;
    // Script-only, so that the acquire itself takes the record over (a plain `SET NX GET` of an
    // existing record only reads it).
    let lossy = RedisStore::builder(proxy.url())
        .pool_size(1)
        .set_get_acquire(false)
        .command_timeout(Duration::from_millis(400))
        .connect_lazy()
        .unwrap();
    lossy.warm_up().await.unwrap();
    let (key, fp) = (Key::from_bytes([9; 32]), Fingerprint::from_bytes([1; 32]));
    let (lease, keep) = (Duration::from_secs(30), Duration::from_secs(60));
    let Acquire::Acquired(first) = direct.acquire(&key, &fp, lease, keep).await.unwrap() else { panic!("fresh key") };
    assert_eq!(direct.abandon(&key, &first.token, Abandon::Uncertain).await.unwrap(), Transition::Ok);
    // The takeover reaches the server; its reply does not.
    proxy.set(Fault::DropReplies);
    let failed = lossy.acquire(&key, &fp, lease, keep).await;
    assert!(failed.is_err(), "{failed:?}");
    proxy.set(Fault::Pass);
    // Once the background release has freed the key, the next attempt is recovered.
    let next = loop {
        match direct.acquire(&key, &fp, lease, keep).await.unwrap() {
            Acquire::Acquired(grant) => break grant,
            Acquire::InFlight { .. } => tokio::time::sleep(Duration::from_millis(20)).await,
            other => panic!("unexpected {other:?}"),
        }
    };
    assert!(next.attempt.recovered(), "the uncertain mark survived the failed takeover");
    assert_eq!(next.attempt.number(), 3, "the failed takeover counted as attempt 2");
}
