//! The reconciler on every store: stuck records (a killed worker's, or an attempt abandoned as
//! uncertain) settled by verifiers registered by step name, ahead of any retry; the rest
//! reported; bounded passes; two reconcilers at once never verify one record twice.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotent_core::reconcile::{Pass, Reconciler, Settled};
use idempotent_core::record::{Abandon, Acquire, Labels};
use idempotent_core::store::{Filter, RecordState};
use idempotent_core::{Attempt, Error, Key, RunContext, SharedStore, Verdict};
use idempotent_tests::uncertain::{Backend, PAYLOAD, RUN, STEP, crash_after_charge, ledger_verifier};

const EFFECT_CHILD: &str = env!("CARGO_BIN_EXE_effect_child");
const LEASE: Duration = Duration::from_millis(400);
const HOUR: Duration = Duration::from_secs(3600);

idempotent_tests::on_every_store!(
    a_killed_workers_charge_is_settled_before_any_retry,
    not_done_releases_the_key_and_the_next_call_runs_afresh,
    unknown_needs_attention_and_steps_without_a_verifier_are_reported,
    a_failing_or_hanging_verifier_leaves_the_record_stuck,
    passes_are_bounded_and_go_on_where_the_last_stopped,
    two_reconcilers_never_verify_one_record_twice,
    live_leases_and_settled_records_are_left_alone,
    run_settles_records_in_the_background,
);

/// Leaves the operation `step(payload)` of `run` stuck: acquired with its labels as the
/// executor would, then abandoned as uncertain (as a failed store call leaves it).
async fn stuck(store: &SharedStore, run: &str, step: &str, payload: u32) -> Key {
    let ctx = RunContext::new(store.clone(), run);
    let (key, fingerprint) = ctx.step(step).key_for(&payload).unwrap();
    let labels = Labels::step(step).run(run);
    let Acquire::Acquired(grant) = store.acquire_labeled(&key, &fingerprint, HOUR, HOUR, labels).await.unwrap() else {
        panic!("a fresh key")
    };
    store.abandon(&key, &grant.token, Abandon::Uncertain).await.unwrap();
    key
}

/// Passes until one settles something, for at most 20 s (the killed worker's lease must run
/// out on the store's clock first).
async fn pass_until_settled(reconciler: &Reconciler) -> Pass {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let pass = reconciler.pass().await.unwrap();
        if !pass.settled.is_empty() {
            return pass;
        }
        assert!(tokio::time::Instant::now() < deadline, "nothing became stuck");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Passes until a pass wraps, and answers every pass.
async fn passes_to_the_end(reconciler: &Reconciler) -> Vec<Pass> {
    let mut passes = Vec::new();
    loop {
        let pass = reconciler.pass().await.unwrap();
        let wrapped = pass.wrapped;
        passes.push(pass);
        if wrapped {
            return passes;
        }
        assert!(passes.len() < 10_000, "the scan does not end");
    }
}

fn never<T>(what: &'static str) -> impl FnOnce(Attempt) -> std::future::Ready<Result<T, Error>> {
    move |_| panic!("the {what} must not be called")
}

/// A worker charges and is killed before its outcome is stored; nobody retries. The reconciler
/// finds the record once the lease ran out, its verifier finds the charge, and the outcome is
/// stored: the retry, whenever it comes, replays it without verifying or charging.
async fn a_killed_workers_charge_is_settled_before_any_retry(b: Backend) {
    let ledger = b.ledger();
    let (downstream, fence) = crash_after_charge(b.worker(EFFECT_CHILD), &ledger, LEASE).await;
    let verified = Arc::new(AtomicU32::new(0));
    let reconciler = Reconciler::new(b.store.clone()).verifier(STEP, {
        let (ledger, verified, downstream) = (ledger.clone(), verified.clone(), downstream.clone());
        move |attempt: Attempt| {
            verified.fetch_add(1, Ordering::SeqCst);
            assert!(attempt.recovered() && attempt.fence() > fence, "{attempt:?}");
            assert_eq!(attempt.downstream_key().as_str(), downstream, "the operation's downstream key");
            ledger_verifier(&ledger)(attempt)
        }
    });
    let pass = pass_until_settled(&reconciler).await;
    assert_eq!(pass.settled.len(), 1, "{pass:?}");
    let (record, outcome) = &pass.settled[0];
    assert_eq!((outcome, record.step.as_str(), record.run.as_deref()), (&Settled::Done, STEP, Some(RUN)));
    assert_eq!(verified.load(Ordering::SeqCst), 1);
    // Looked up from the caller's side: the step and its payload.
    let stored = b.ctx().step(STEP).inspect(&PAYLOAD).await.unwrap().expect("the record");
    assert_eq!(stored.key, record.key);
    assert_eq!((stored.state, stored.attempt), (RecordState::Done, 2), "settled by the reconciler's attempt");

    let charge: String = b.ctx().step(STEP).verify(never("verifier")).run(&PAYLOAD, never("action")).await.unwrap();
    assert_eq!(charge, ledger.find(&downstream).expect("the worker's charge").id);
    assert_eq!(ledger.charges().len(), 1, "charged once");
    assert!(reconciler.pass().await.unwrap().settled.is_empty(), "nothing is stuck any more");
}

/// NotDone: the key is released cleanly, and the next call runs the action as a fresh attempt
/// (not recovered).
async fn not_done_releases_the_key_and_the_next_call_runs_afresh(b: Backend) {
    let run = idempotent_tests::unique("nd");
    let key = stuck(&b.store, &run, "send", 1).await;
    let reconciler = Reconciler::new(b.store.clone())
        .verifier("send", |_| async { Ok::<_, Error>(Verdict::<String>::NotDone) })
        .filter(Filter::all().run(&run));
    let pass = pass_until_settled(&reconciler).await;
    assert_eq!(pass.keys(&Settled::NotDone), vec![key]);
    assert_eq!(b.store.inspect(&key).await.unwrap().unwrap().state, RecordState::Released);
    let ran: u32 = RunContext::new(b.store.clone(), &run)
        .step("send")
        .verify(never("verifier"))
        .run(&1, |attempt: Attempt| async move {
            assert!(!attempt.recovered(), "the verifier said the effect did not happen");
            assert_eq!(attempt.number(), 3, "the stuck attempt, the reconciler's, this one");
            Ok::<_, Error>(7)
        })
        .await
        .unwrap();
    assert_eq!(ran, 7);
}

/// Unknown: the record needs attention and every call is refused; a stuck record of a step with
/// no verifier is reported and left stuck.
async fn unknown_needs_attention_and_steps_without_a_verifier_are_reported(b: Backend) {
    let run = idempotent_tests::unique("unk");
    let unknown = stuck(&b.store, &run, "refund", 1).await;
    let unverifiable = stuck(&b.store, &run, "email", 2).await;
    let reconciler = Reconciler::new(b.store.clone())
        .verifier("refund", |_| async { Ok::<_, Error>(Verdict::<u32>::Unknown) })
        .filter(Filter::all().run(&run));
    let passes = passes_to_the_end(&reconciler).await;
    let settled: HashMap<Key, Settled> =
        passes.iter().flat_map(|p| p.settled.iter().map(|(r, s)| (r.key, s.clone()))).collect();
    assert_eq!(settled.get(&unknown), Some(&Settled::NeedsAttention), "{settled:?}");
    assert_eq!(settled.get(&unverifiable), Some(&Settled::NoVerifier), "{settled:?}");
    assert_eq!(b.store.inspect(&unverifiable).await.unwrap().unwrap().state, RecordState::Stuck, "untouched");
    let refused: Result<u32, Error> =
        RunContext::new(b.store.clone(), &run).step("refund").run(&1, never("action")).await;
    assert!(matches!(refused, Err(Error::NeedsAttention { attempt: 2, .. })), "{refused:?}");
}

/// A verifier that fails, or does not answer in time, leaves the record stuck for the next pass.
async fn a_failing_or_hanging_verifier_leaves_the_record_stuck(b: Backend) {
    let run = idempotent_tests::unique("fail");
    let key = stuck(&b.store, &run, "charge", 1).await;
    let failing = Reconciler::new(b.store.clone())
        .verifier("charge", |_| async { Err::<Verdict<u32>, _>(Error::Config("provider lookup: 502".into())) })
        .filter(Filter::all().run(&run));
    let pass = pass_until_settled(&failing).await;
    assert!(matches!(&pass.settled[0].1, Settled::VerifyFailed(m) if m.contains("502")), "{pass:?}");
    assert_eq!(b.store.inspect(&key).await.unwrap().unwrap().state, RecordState::Stuck);

    let hanging = Reconciler::new(b.store.clone())
        .verifier("charge", |_| std::future::pending::<Result<Verdict<u32>, Error>>())
        .verify_timeout(Duration::from_millis(100))
        .filter(Filter::all().run(&run));
    let pass = pass_until_settled(&hanging).await;
    assert!(matches!(&pass.settled[0].1, Settled::VerifyFailed(m) if m.contains("did not answer")), "{pass:?}");
    assert_eq!(b.store.inspect(&key).await.unwrap().unwrap().state, RecordState::Stuck);

    let found = Reconciler::new(b.store.clone())
        .verifier("charge", |_| async { Ok::<_, Error>(Verdict::Done(42u32)) })
        .filter(Filter::all().run(&run));
    assert_eq!(pass_until_settled(&found).await.keys(&Settled::Done), vec![key]);
    let replayed: u32 = RunContext::new(b.store.clone(), &run).step("charge").run(&1, never("action")).await.unwrap();
    assert_eq!(replayed, 42);
}

/// A pass examines at most its batch; passes go on from where the last stopped and together
/// settle every stuck record once.
async fn passes_are_bounded_and_go_on_where_the_last_stopped(b: Backend) {
    let run = idempotent_tests::unique("batch");
    let mut keys = Vec::new();
    for i in 0..7 {
        keys.push(stuck(&b.store, &run, "charge", i).await);
    }
    let reconciler = Reconciler::new(b.store.clone())
        .verifier("charge", |attempt: Attempt| async move { Ok::<_, Error>(Verdict::Done(attempt.fence())) })
        .filter(Filter::all().run(&run))
        .batch(3);
    let passes = passes_to_the_end(&reconciler).await;
    assert!(passes.iter().all(|p| p.settled.len() <= 3), "a pass examined more than its batch");
    assert!(passes.len() >= 3, "7 records at 3 a pass take 3 passes at least");
    let mut done: Vec<Key> = passes.iter().flat_map(|p| p.keys(&Settled::Done)).collect();
    done.sort();
    keys.sort();
    assert_eq!(done, keys, "every stuck record settled once");
}

/// Two reconcilers (as on two hosts) pass over the same 16 stuck records at once: each record's
/// verifier runs once, and every record is settled.
async fn two_reconcilers_never_verify_one_record_twice(b: Backend) {
    let run = idempotent_tests::unique("two");
    let mut keys = Vec::new();
    for i in 0..16 {
        keys.push(stuck(&b.store, &run, "charge", i).await);
    }
    let verified: Arc<Mutex<HashMap<Key, u32>>> = Arc::default();
    let make = || {
        let verified = verified.clone();
        Arc::new(
            Reconciler::new(b.store.clone())
                .verifier("charge", move |attempt: Attempt| {
                    *verified.lock().unwrap().entry(*attempt.key()).or_default() += 1;
                    async move {
                        // Long enough that the other reconciler meets the lease.
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        Ok::<_, Error>(Verdict::Done(1u8))
                    }
                })
                .filter(Filter::all().run(&run))
                .batch(4),
        )
    };
    let (one, two) = (make(), make());
    let (a, b_passes) = tokio::join!(passes_to_the_end(&one), passes_to_the_end(&two));
    let settled = a.iter().chain(&b_passes).map(|p| p.count(&Settled::Done)).sum::<usize>();
    let verified = verified.lock().unwrap().clone();
    assert_eq!(verified.len(), 16, "every record was verified");
    assert!(verified.values().all(|&n| n == 1), "a record was verified twice: {verified:?}");
    assert_eq!(settled, 16);
    for key in keys {
        assert_eq!(b.store.inspect(&key).await.unwrap().unwrap().state, RecordState::Done);
    }
}

/// `run` keeps passing in the background: a record that becomes stuck later is settled without
/// anyone calling a pass.
async fn run_settles_records_in_the_background(b: Backend) {
    let run = idempotent_tests::unique("bg");
    let reconciler = Arc::new(
        Reconciler::new(b.store.clone())
            .verifier("charge", |_| async { Ok::<_, Error>(Verdict::Done(5u8)) })
            .filter(Filter::all().run(&run)),
    );
    let task = tokio::spawn({
        let reconciler = reconciler.clone();
        async move { reconciler.run(Duration::from_millis(20)).await }
    });
    let key = stuck(&b.store, &run, "charge", 1).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while b.store.inspect(&key).await.unwrap().unwrap().state != RecordState::Done {
        assert!(tokio::time::Instant::now() < deadline, "the background reconciler never settled it");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    task.abort();
    let replayed: u8 = RunContext::new(b.store.clone(), &run).step("charge").run(&1, never("action")).await.unwrap();
    assert_eq!(replayed, 5);
}

/// A record under a live lease, and a done one, are not the reconciler's: never verified.
async fn live_leases_and_settled_records_are_left_alone(b: Backend) {
    let run = idempotent_tests::unique("live");
    let ctx = RunContext::new(b.store.clone(), &run);
    let (key, fingerprint) = ctx.step("charge").key_for(&1u32).unwrap();
    let labels = Labels::step("charge").run(&run);
    let Acquire::Acquired(_holder) = b.store.acquire_labeled(&key, &fingerprint, HOUR, HOUR, labels).await.unwrap()
    else {
        panic!("fresh")
    };
    let done: u32 = ctx.step("charge").run(&2u32, |_| async { Ok::<_, Error>(2) }).await.unwrap();
    assert_eq!(done, 2);
    let reconciler = Reconciler::new(b.store.clone())
        .verifier("charge", |_: Attempt| -> std::future::Ready<Result<Verdict<u32>, Error>> {
            panic!("nothing here is stuck")
        })
        .filter(Filter::all().run(&run));
    let passes = passes_to_the_end(&reconciler).await;
    assert!(passes.iter().all(|p| p.settled.is_empty()), "{passes:?}");
    assert_eq!(b.store.inspect(&key).await.unwrap().unwrap().state, RecordState::Running);
}
