//! The workload of the reliability tests: how a worker calls the step under test, recording every
//! call and execution in a [`History`], one timed call under a failover ([`probe`]), the final
//! pass and check, and a deterministic random schedule. Shared by the scenarios of every store.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use idempotent_core::store::BoxFuture;
use idempotent_core::{Attempt, Error, OnInFlight, RunContext, Verdict};
use tokio::sync::{Notify, oneshot, watch};

use crate::history::{Completion, History, Report};

/// How a worker calls the step.
#[derive(Clone, Copy)]
pub struct Cfg {
    /// The step's lease.
    pub lease: Duration,
    /// Whether the heartbeat renews it.
    pub heartbeat: bool,
    /// What a call does when another attempt holds the key.
    pub on_in_flight: OnInFlight,
    /// Whether the step verifies a recovered attempt against the effect ledger (the history's
    /// executions) instead of running the effect again.
    pub verify: bool,
}

impl Default for Cfg {
    fn default() -> Self {
        Cfg {
            lease: Duration::from_secs(2),
            heartbeat: true,
            on_in_flight: OnInFlight::Wait { timeout: Duration::from_secs(10) },
            verify: false,
        }
    }
}

/// Something the side effect waits for before it finishes (to hold it open deterministically).
pub type Hold = Box<dyn FnOnce() -> BoxFuture<'static, ()> + Send>;

/// Calls the step for `key` once, recording the call and any execution in `hist`.
pub async fn call(
    ctx: &RunContext,
    hist: &History,
    key: &str,
    cfg: Cfg,
    hold: Option<Hold>,
    final_pass: bool,
) -> Completion {
    let op = if final_pass { hist.invoke_final(key) } else { hist.invoke(key) };
    let step = ctx.step("effect").lease(cfg.lease).heartbeat(cfg.heartbeat).on_in_flight(cfg.on_in_flight);
    let effect = |attempt: Attempt| {
        let hist = hist.clone();
        async move {
            let (exec, value) = hist.effect_start(op, attempt.fence());
            if let Some(hold) = hold {
                hold().await;
            }
            hist.effect_end(exec);
            Ok(value)
        }
    };
    let res: Result<String, Error> = if cfg.verify {
        let ledger = hist.clone();
        let verify = |_| async move { Ok(ledger.effect_of(key).map_or(Verdict::NotDone, Verdict::Done)) };
        step.verify(verify).run(&key, effect).await
    } else {
        step.run(&key, effect).await
    };
    let outcome = Completion::of(&res);
    hist.complete(op, outcome.clone());
    outcome
}

/// After the faults healed: call every key once more, then check the whole history.
pub async fn final_pass_and_check(ctx: &RunContext, hist: &History, keys: &[String]) -> Report {
    final_pass(ctx, hist, keys, Cfg::default()).await;
    report(hist.check())
}

/// [`final_pass_and_check`] for a workload whose step verifies (`Cfg::verify`): the final pass
/// verifies too, and the check is [`History::check_exactly_once`].
pub async fn final_pass_and_check_exactly_once(ctx: &RunContext, hist: &History, keys: &[String]) -> Report {
    final_pass(ctx, hist, keys, Cfg { verify: true, ..Cfg::default() }).await;
    report(hist.check_exactly_once())
}

async fn final_pass(ctx: &RunContext, hist: &History, keys: &[String], cfg: Cfg) {
    for key in keys {
        let outcome = call(ctx, hist, key, cfg, None, true).await;
        assert!(matches!(outcome, Completion::Ok(_)), "{key}: final pass failed: {outcome:?}");
    }
}

/// Prints the checker's report, or fails with every violation it found.
fn report(checked: Result<Report, (Report, Vec<String>)>) -> Report {
    match checked {
        Ok(report) => {
            println!("history: {report}");
            assert_eq!(report.duplicates, 0);
            report
        }
        Err((report, errors)) => panic!("the checker found violations ({report}):\n{}", errors.join("\n")),
    }
}

/// A hold that lasts until `gate` opens.
pub fn held_until(gate: &watch::Receiver<bool>) -> Option<Hold> {
    let mut gate = gate.clone();
    Some(Box::new(move || {
        Box::pin(async move {
            let _ = gate.wait_for(|open| *open).await;
        })
    }))
}

/// The checker's report so far, violations or not.
pub fn snapshot(hist: &History) -> Report {
    hist.check().unwrap_or_else(|(report, _)| report)
}

/// A hold that signals `started`, then lasts until `release` is notified.
pub fn signal_then_hold(started: oneshot::Sender<()>, release: &Arc<Notify>) -> Option<Hold> {
    let n = release.clone();
    Some(Box::new(move || {
        Box::pin(async move {
            let _ = started.send(());
            n.notified().await;
        })
    }))
}

/// A deterministic xorshift generator: the nemesis schedule is the same on every run.
pub fn fastrand_like(seed: u64) -> impl FnMut() -> u64 {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    }
}

/// One nemesis worker: until `deadline`, calls the step on random keys with random terms (a
/// 500 ms lease, the heartbeat off one time in four, rejecting or waiting when the key is in
/// flight), actions that take 0 to 240 ms, and one call in ten abandoned after 150 ms as a
/// cancelled request would be. `seed` fixes the schedule.
pub async fn random_calls(
    ctx: RunContext,
    hist: History,
    keys: Vec<String>,
    deadline: tokio::time::Instant,
    seed: u64,
) {
    let mut rng = fastrand_like(seed);
    while tokio::time::Instant::now() < deadline {
        let key = &keys[(rng() % keys.len() as u64) as usize];
        let cfg = Cfg {
            lease: Duration::from_millis(500),
            heartbeat: !rng().is_multiple_of(4),
            on_in_flight: if rng().is_multiple_of(2) {
                OnInFlight::Reject
            } else {
                OnInFlight::Wait { timeout: Duration::from_secs(2) }
            },
            verify: false,
        };
        let work = rng() % 3;
        let hold: Option<Hold> =
            Some(Box::new(move || Box::pin(tokio::time::sleep(Duration::from_millis(work * 120)))));
        let call = call(&ctx, &hist, key, cfg, hold, false);
        if rng().is_multiple_of(10) {
            let _ = tokio::time::timeout(Duration::from_millis(150), call).await;
        } else {
            call.await;
        }
    }
}

/// One call of the step during a failover, and what became of it.
pub struct Probe {
    /// The key it called on.
    pub key: String,
    /// How it ended.
    pub outcome: Completion,
    /// Whether its action ran.
    pub ran: bool,
    /// When it started.
    pub started: Instant,
    /// How long it took.
    pub elapsed: Duration,
}

/// Calls the step on `key` once (a 2 s lease, rejecting when in flight), recording the call and
/// its execution in `hist`.
pub async fn probe(ctx: &RunContext, hist: &History, key: &str) -> Probe {
    let op = hist.invoke(key);
    let ran = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let res: Result<String, Error> = ctx
        .step("effect")
        .lease(Duration::from_secs(2))
        .on_in_flight(OnInFlight::Reject)
        .run(&key, |attempt| {
            let (hist, ran) = (hist.clone(), ran.clone());
            async move {
                ran.store(true, Ordering::SeqCst);
                let (exec, value) = hist.effect_start(op, attempt.fence());
                hist.effect_end(exec);
                Ok(value)
            }
        })
        .await;
    let outcome = Completion::of(&res);
    hist.complete(op, outcome.clone());
    Probe { key: key.to_owned(), outcome, ran: ran.load(Ordering::SeqCst), started, elapsed: started.elapsed() }
}
