//! `#[idempotent]` end to end, on a real Redis server and on `MemoryStore`.
//!
//! Every check runs on both stores (`redis::*` and `memory::*`). Side effects are recorded in an
//! `Effects` outside the store, so "ran once" is checked against what the bodies actually did, not
//! against what the store says. Bodies that must stay open are held by channels, never by sleeps.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotent_core::record::Acquire;
use idempotent_core::{Error, MAX_LEASE, MAX_RETENTION, RunContext, SharedStore, current_attempt, idempotent};
use idempotent_tests::{HookedStore, unique};
use serde::{Deserialize, Serialize};
use tokio::sync::{Notify, watch};

/// What the bodies did, outside the store.
#[derive(Default)]
struct Effects {
    effects: Mutex<Vec<String>>,
}

impl Effects {
    /// Records an effect and returns how many effects there were before it.
    fn record(&self, effect: impl Into<String>) -> usize {
        let mut effects = self.effects.lock().unwrap();
        effects.push(effect.into());
        effects.len() - 1
    }

    fn count(&self) -> usize {
        self.effects.lock().unwrap().len()
    }

    fn effects(&self) -> Vec<String> {
        self.effects.lock().unwrap().clone()
    }
}

/// Holds a body open: the body says it started, then waits to be let go.
#[derive(Default)]
struct Gate {
    started: Notify,
    release: Notify,
}

impl Gate {
    async fn hold(&self) {
        self.started.notify_one();
        self.release.notified().await;
    }
}

/// A store that reports how many acquires were answered "in flight", so a test can wait until
/// every concurrent caller has met the running attempt before letting it finish.
fn watching(inner: SharedStore, in_flight: watch::Sender<usize>) -> SharedStore {
    Arc::new(HookedStore::with_state(inner, in_flight).on_acquire(|call| {
        Box::pin(async move {
            let in_flight = call.store.state();
            let answer = call.forward().await;
            if let Ok(Acquire::InFlight { .. }) = &answer {
                in_flight.send_modify(|n| *n += 1);
            }
            answer
        })
    }))
}

// ---- the annotated functions under test ----

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Refund {
    id: String,
    amount_cents: u64,
    fence: u64,
}

#[idempotent(step = "issue_refund", ttl = 3600, skip(effects))]
async fn issue_refund(ctx: &RunContext, effects: &Effects, order_id: &str, amount_cents: u64) -> Result<Refund, Error> {
    let n = effects.record(format!("refund {order_id} {amount_cents}"));
    let attempt = current_attempt().expect("the body runs inside a step");
    Ok(Refund { id: format!("re_{order_id}_{n}"), amount_cents, fence: attempt.fence() })
}

#[idempotent(step = "slow_refund", lease = 30, skip(effects, gate))]
async fn slow_refund(
    ctx: RunContext,
    effects: Arc<Effects>,
    gate: Arc<Gate>,
    order_id: String,
    amount_cents: u64,
) -> Result<Refund, Error> {
    gate.hold().await;
    let n = effects.record(format!("refund {order_id} {amount_cents}"));
    Ok(Refund { id: format!("re_{order_id}_{n}"), amount_cents, fence: current_attempt().unwrap().fence() })
}

#[idempotent(step = "held_refund", on_in_flight = "reject", skip(effects, gate))]
async fn held_refund(
    ctx: RunContext,
    effects: Arc<Effects>,
    gate: Arc<Gate>,
    order_id: String,
) -> Result<String, Error> {
    gate.hold().await;
    Ok(format!("re_{order_id}_{}", effects.record(format!("refund {order_id}"))))
}

#[idempotent(step = "charge", key(order_id), skip(effects))]
async fn charge(ctx: &RunContext, effects: &Effects, order_id: &str, amount_cents: u64) -> Result<String, Error> {
    Ok(format!("ch_{order_id}_{amount_cents}_{}", effects.record(format!("charge {order_id} {amount_cents}"))))
}

#[idempotent(step = "send_email", version = 1, skip(effects))]
async fn send_email_v1(ctx: &RunContext, effects: &Effects, to: &str) -> Result<usize, Error> {
    Ok(effects.record(format!("email v1 {to}")))
}

#[idempotent(step = "send_email", version = 2, skip(effects))]
async fn send_email_v2(ctx: &RunContext, effects: &Effects, to: &str) -> Result<usize, Error> {
    Ok(effects.record(format!("email v2 {to}")))
}

#[derive(Debug, PartialEq, Serialize, Deserialize)]
enum CardError {
    Declined { attempt: usize },
    Idempotency(String),
}

impl From<Error> for CardError {
    fn from(e: Error) -> Self {
        CardError::Idempotency(e.to_string())
    }
}

#[idempotent(step = "charge_card", store_errors, skip(effects))]
async fn charge_card_storing_errors(ctx: &RunContext, effects: &Effects, card: &str) -> Result<String, CardError> {
    Err(CardError::Declined { attempt: effects.record(format!("decline {card}")) })
}

#[idempotent(step = "charge_card_transient", skip(effects))]
async fn charge_card(ctx: &RunContext, effects: &Effects, card: &str) -> Result<String, CardError> {
    Err(CardError::Declined { attempt: effects.record(format!("decline {card}")) })
}

#[idempotent(step = "notify", skip(effects, trace_id))]
async fn notify(ctx: &RunContext, effects: &Effects, to: &str, trace_id: u64) -> Result<String, Error> {
    Ok(format!("sent to {to} (trace {trace_id}, effect {})", effects.record(format!("notify {to}"))))
}

#[idempotent(step = "measure", skip(effects))]
async fn measure(ctx: &RunContext, effects: &Effects, reading: f64) -> Result<f64, Error> {
    effects.record("measure");
    Ok(reading)
}

struct Mailer {
    effects: Effects,
    sent: usize,
}

impl Mailer {
    #[idempotent(step = "mailer_send")]
    async fn send(&self, ctx: &RunContext, to: &str, subject: String) -> Result<String, Error> {
        Ok(format!("{to}:{subject}:{}", self.effects.record(format!("mail {to}"))))
    }

    #[idempotent(step = "mailer_send_counted", ctx = run)]
    async fn send_counted(&mut self, run: Arc<RunContext>, to: String) -> Result<usize, Error> {
        self.sent += 1;
        self.effects.record(format!("counted {to}"));
        Ok(self.sent)
    }
}

/// A service that holds its run context, as handlers and workers often do.
struct Refunds {
    ctx: RunContext,
    effects: Effects,
}

impl Refunds {
    #[idempotent(step = "refunds_issue", retention = 3600, ctx = self.ctx)]
    async fn issue(&self, order_id: &str, amount_cents: u64) -> Result<String, Error> {
        Ok(format!("re_{order_id}_{}", self.effects.record(format!("refund {order_id} {amount_cents}"))))
    }
}

/// The same, behind an `Arc` and one field further in.
struct Shared {
    ctx: Arc<RunContext>,
}

struct Api {
    shared: Shared,
    effects: Effects,
}

impl Api {
    #[idempotent(step = "api_issue", ctx = self.shared.ctx)]
    async fn issue(&mut self, order_id: String) -> Result<String, Error> {
        Ok(format!("api_{order_id}_{}", self.effects.record(format!("api {order_id}"))))
    }
}

#[idempotent(step = "too_long_retention", ttl = 315_360_001, skip(effects))]
async fn too_long_retention(ctx: &RunContext, effects: &Effects) -> Result<(), Error> {
    effects.record("too long retention");
    Ok(())
}

#[idempotent(step = "too_long_lease", lease = 86_401, skip(effects))]
async fn too_long_lease(ctx: &RunContext, effects: &Effects) -> Result<(), Error> {
    effects.record("too long lease");
    Ok(())
}

// ---- the checks, each run on both stores ----

/// Fails the test instead of hanging when a signal never comes (for example because a second
/// body started and is waiting for a release meant for the first).
async fn within<F: std::future::Future>(fut: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(30), fut).await.expect("a step did not finish within 30 s")
}

fn ctx(store: &SharedStore) -> RunContext {
    RunContext::new(store.clone(), unique("run"))
}

async fn replay_returns_first_result(store: SharedStore) {
    let ctx = ctx(&store);
    let effects = Effects::default();
    let first = issue_refund(&ctx, &effects, "o-1", 1500).await.unwrap();
    assert!(first.fence > 0);
    for _ in 0..3 {
        assert_eq!(issue_refund(&ctx, &effects, "o-1", 1500).await.unwrap(), first);
    }
    assert_eq!(effects.effects(), ["refund o-1 1500"]);

    // Another argument is another operation; another run id too.
    let other = issue_refund(&ctx, &effects, "o-2", 1500).await.unwrap();
    assert_ne!(other.id, first.id);
    let next_run = RunContext::new(store.clone(), unique("run"));
    issue_refund(&next_run, &effects, "o-1", 1500).await.unwrap();
    assert_eq!(effects.count(), 3);
}

async fn concurrent_calls_run_the_body_once(store: SharedStore) {
    const CALLERS: usize = 16;
    let (in_flight, mut seen) = watch::channel(0);
    let watching = watching(store, in_flight);
    let ctx = ctx(&watching);
    let effects = Arc::new(Effects::default());
    let gate = Arc::new(Gate::default());

    let calls: Vec<_> = (0..CALLERS)
        .map(|_| tokio::spawn(slow_refund(ctx.clone(), effects.clone(), gate.clone(), "o-9".to_owned(), 700)))
        .collect();
    within(gate.started.notified()).await;
    // Every other caller has met the running attempt before it is let go.
    within(seen.wait_for(|n| *n >= CALLERS - 1)).await.unwrap();
    gate.release.notify_one();

    let mut results = Vec::new();
    for call in calls {
        // A second body would wait for a release that never comes: that fails here, not hangs.
        results.push(within(call).await.unwrap().unwrap());
    }
    assert_eq!(effects.effects(), ["refund o-9 700"]);
    assert!(results.iter().all(|r| r == &results[0]), "callers saw different results: {results:?}");
}

async fn reject_policy_gives_in_flight(store: SharedStore) {
    let ctx = ctx(&store);
    let effects = Arc::new(Effects::default());
    let gate = Arc::new(Gate::default());
    let first = tokio::spawn(held_refund(ctx.clone(), effects.clone(), gate.clone(), "o-3".to_owned()));
    within(gate.started.notified()).await;

    let duplicate = held_refund(ctx.clone(), effects.clone(), gate.clone(), "o-3".to_owned()).await;
    match duplicate {
        Err(Error::InFlight { retry_after, .. }) => assert!(retry_after > Duration::ZERO),
        other => panic!("expected Error::InFlight while the first call runs, got {other:?}"),
    }

    gate.release.notify_one();
    let id = within(first).await.unwrap().unwrap();
    assert_eq!(held_refund(ctx.clone(), effects.clone(), gate.clone(), "o-3".to_owned()).await.unwrap(), id);
    assert_eq!(effects.effects(), ["refund o-3"]);
}

async fn key_with_changed_argument_is_a_mismatch(store: SharedStore) {
    let ctx = ctx(&store);
    let effects = Effects::default();
    let first = charge(&ctx, &effects, "o-4", 1500).await.unwrap();

    match charge(&ctx, &effects, "o-4", 9900).await {
        Err(Error::Mismatch { step, .. }) => assert_eq!(step, "charge"),
        other => panic!("expected Error::Mismatch for a changed amount under the same key, got {other:?}"),
    }
    assert_eq!(charge(&ctx, &effects, "o-4", 1500).await.unwrap(), first);
    // A different key argument is a different operation.
    charge(&ctx, &effects, "o-5", 9900).await.unwrap();
    assert_eq!(effects.effects(), ["charge o-4 1500", "charge o-5 9900"]);
}

async fn version_bump_runs_again(store: SharedStore) {
    let ctx = ctx(&store);
    let effects = Effects::default();
    send_email_v1(&ctx, &effects, "ada@example.com").await.unwrap();
    send_email_v1(&ctx, &effects, "ada@example.com").await.unwrap();
    assert_eq!(effects.count(), 1);
    // Same step name and arguments, new version: a new operation.
    assert_eq!(send_email_v2(&ctx, &effects, "ada@example.com").await.unwrap(), 1);
    assert_eq!(send_email_v2(&ctx, &effects, "ada@example.com").await.unwrap(), 1);
    assert_eq!(effects.effects(), ["email v1 ada@example.com", "email v2 ada@example.com"]);
}

async fn store_errors_replays_the_error(store: SharedStore) {
    let ctx = ctx(&store);
    let effects = Effects::default();
    let first = charge_card_storing_errors(&ctx, &effects, "4242").await;
    assert_eq!(first, Err(CardError::Declined { attempt: 0 }));
    assert_eq!(charge_card_storing_errors(&ctx, &effects, "4242").await, first);
    assert_eq!(effects.count(), 1);

    // Without `store_errors` an error frees the key: the retry runs the body again.
    assert_eq!(charge_card(&ctx, &effects, "4242").await, Err(CardError::Declined { attempt: 1 }));
    assert_eq!(charge_card(&ctx, &effects, "4242").await, Err(CardError::Declined { attempt: 2 }));
    assert_eq!(effects.count(), 3);
}

async fn methods_on_a_struct(store: SharedStore) {
    let ctx = ctx(&store);
    let mailer = Mailer { effects: Effects::default(), sent: 0 };
    let first = mailer.send(&ctx, "ada@example.com", "welcome".into()).await.unwrap();
    assert_eq!(mailer.send(&ctx, "ada@example.com", "welcome".into()).await.unwrap(), first);
    assert_ne!(mailer.send(&ctx, "ada@example.com", "reminder".into()).await.unwrap(), first);
    assert_eq!(mailer.effects.count(), 2);

    // `self` is not part of the payload: another instance replays the same operation.
    let other = Mailer { effects: Effects::default(), sent: 0 };
    assert_eq!(other.send(&ctx, "ada@example.com", "welcome".into()).await.unwrap(), first);
    assert_eq!(other.effects.count(), 0);

    // `&mut self`, with the context named by `ctx = run`.
    let run = Arc::new(ctx.clone());
    let mut counted = Mailer { effects: Effects::default(), sent: 0 };
    assert_eq!(counted.send_counted(run.clone(), "bob@example.com".into()).await.unwrap(), 1);
    assert_eq!(counted.send_counted(run.clone(), "bob@example.com".into()).await.unwrap(), 1);
    assert_eq!(counted.sent, 1);
}

async fn skipped_parameter_does_not_change_the_key(store: SharedStore) {
    let ctx = ctx(&store);
    let effects = Effects::default();
    let first = notify(&ctx, &effects, "ada@example.com", 1).await.unwrap();
    assert_eq!(notify(&ctx, &effects, "ada@example.com", 2).await.unwrap(), first);
    assert_eq!(notify(&ctx, &effects, "ada@example.com", 3).await.unwrap(), first);
    assert_eq!(effects.count(), 1);
    // A parameter that is not skipped does change it.
    notify(&ctx, &effects, "bob@example.com", 1).await.unwrap();
    assert_eq!(effects.effects(), ["notify ada@example.com", "notify bob@example.com"]);
}

async fn payload_without_canonical_form_does_not_run(store: SharedStore) {
    let ctx = ctx(&store);
    let effects = Effects::default();
    match measure(&ctx, &effects, f64::NAN).await {
        Err(Error::Payload { step, source }) => {
            assert_eq!(step, "measure");
            assert!(source.to_string().contains("`reading`"), "the error names the parameter: {source}");
        }
        other => panic!("expected Error::Payload for a NaN argument, got {other:?}"),
    }
    assert_eq!(effects.count(), 0);
    assert_eq!(measure(&ctx, &effects, 1.5).await.unwrap(), 1.5);
    assert_eq!(measure(&ctx, &effects, 1.5).await.unwrap(), 1.5);
    assert_eq!(effects.count(), 1);
}

async fn context_from_a_field(store: SharedStore) {
    let ctx = ctx(&store);
    let refunds = Refunds { ctx: ctx.clone(), effects: Effects::default() };
    let first = refunds.issue("o-6", 1500).await.unwrap();
    for _ in 0..3 {
        assert_eq!(refunds.issue("o-6", 1500).await.unwrap(), first);
    }
    // A retry of the run builds its service anew around a context with the same run id.
    let retry = Refunds { ctx: RunContext::new(store.clone(), ctx.run_id()), effects: Effects::default() };
    assert_eq!(retry.issue("o-6", 1500).await.unwrap(), first);
    assert_eq!(retry.effects.count(), 0);
    assert_eq!(refunds.effects.effects(), ["refund o-6 1500"]);

    let mut api = Api { shared: Shared { ctx: Arc::new(ctx.clone()) }, effects: Effects::default() };
    let first = api.issue("o-6".into()).await.unwrap();
    assert_eq!(api.issue("o-6".into()).await.unwrap(), first);
    assert_eq!(api.effects.effects(), ["api o-6"]);
}

/// The macro checks only that a duration is a positive integer; its upper bound is the
/// executor's, which refuses the step before it touches the store or runs the body.
async fn out_of_range_durations_are_config_errors(store: SharedStore) {
    let ctx = ctx(&store);
    let effects = Effects::default();
    for (result, bound) in
        [(too_long_retention(&ctx, &effects).await, MAX_RETENTION), (too_long_lease(&ctx, &effects).await, MAX_LEASE)]
    {
        match result {
            Err(Error::Config(message)) => {
                assert!(message.contains(&format!("{bound:?}")), "the error names the bound {bound:?}: {message}")
            }
            other => panic!("expected Error::Config for a duration above {bound:?}, got {other:?}"),
        }
    }
    assert_eq!(effects.count(), 0);
}

idempotent_tests::on_every_store!(
    replay_returns_first_result,
    concurrent_calls_run_the_body_once,
    reject_policy_gives_in_flight,
    key_with_changed_argument_is_a_mismatch,
    version_bump_runs_again,
    store_errors_replays_the_error,
    methods_on_a_struct,
    skipped_parameter_does_not_change_the_key,
    payload_without_canonical_form_does_not_run,
    context_from_a_field,
    out_of_range_durations_are_config_errors,
);
