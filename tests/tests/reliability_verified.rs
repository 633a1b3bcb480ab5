//! Workers killed mid-action, on every store, with a step whose verifier asks the effect ledger:
//! the checker's strictest form (`History::check_exactly_once`) must find 0 duplicate and 0 lost
//! effects. Without the verifier, the same schedule re-runs effects (the negative control).

use std::sync::Arc;
use std::time::Duration;

use idempotent_core::{MemoryStore, OnInFlight, RunContext, SharedStore};
use idempotent_tests::history::History;
use idempotent_tests::workload::{Cfg, call, fastrand_like, final_pass_and_check_exactly_once, signal_then_hold};
use idempotent_tests::{PgServer, RedisServer};
use tokio::sync::{Notify, oneshot};

/// Calls per worker.
const CALLS: usize = 30;
/// Workers.
const WORKERS: u64 = 6;

/// One worker: calls random keys; each call whose effect starts is killed there (its task
/// aborted, as a SIGKILL would end it) one time in three, and let finish otherwise.
async fn killing_worker(ctx: RunContext, hist: History, keys: Arc<Vec<String>>, cfg: Cfg, seed: u64) -> usize {
    let mut rng = fastrand_like(seed);
    let mut kills = 0;
    for _ in 0..CALLS {
        let key = keys[(rng() % keys.len() as u64) as usize].clone();
        let (started, on_start) = oneshot::channel();
        let release = Arc::new(Notify::new());
        let hold = signal_then_hold(started, &release);
        let (ctx, hist) = (ctx.clone(), hist.clone());
        let mut task = tokio::spawn(async move { call(&ctx, &hist, &key, cfg, hold, false).await });
        tokio::select! {
            // The call ended without running the effect (a replay, a verification, in flight).
            ended = &mut task => { ended.unwrap(); }
            Ok(()) = on_start => {
                if rng().is_multiple_of(3) {
                    task.abort();
                    assert!(task.await.unwrap_err().is_cancelled());
                    kills += 1;
                } else {
                    release.notify_one();
                    task.await.unwrap();
                }
            }
        }
    }
    kills
}

/// Runs the killing workers on `store`, then the final pass and the exactly-once check.
async fn workers_killed_mid_action_leave_every_effect_once(store: SharedStore) {
    let ctx = RunContext::new(store, idempotent_tests::unique("killed"));
    let hist = History::new();
    let keys: Arc<Vec<String>> = Arc::new((0..48).map(|i| format!("k{i}")).collect());
    let cfg = Cfg {
        lease: Duration::from_millis(300),
        on_in_flight: OnInFlight::Wait { timeout: Duration::from_secs(5) },
        verify: true,
        ..Cfg::default()
    };
    let workers: Vec<_> = (0..WORKERS)
        .map(|w| tokio::spawn(killing_worker(ctx.clone(), hist.clone(), keys.clone(), cfg, w + 7)))
        .collect();
    let mut kills = 0;
    for w in workers {
        kills += w.await.unwrap();
    }
    let report = final_pass_and_check_exactly_once(&ctx, &hist, &keys).await;
    println!("killed {kills} workers mid-action: {report}");
    assert!(kills >= 10, "the schedule killed too few workers to matter: {kills}");
    assert_eq!((report.duplicates, report.re_executions, report.lost_effects), (0, 0, 0));
    assert_eq!(report.executions, keys.len(), "one effect per key");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn memory() {
    workers_killed_mid_action_leave_every_effect_once(Arc::new(MemoryStore::new())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis() {
    let server = RedisServer::start();
    workers_killed_mid_action_leave_every_effect_once(idempotent_core::store::connect(&server.url()).await.unwrap())
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite() {
    let dir = tempfile::TempDir::new().unwrap();
    let url = format!("sqlite://{}", dir.path().join("records.db").display());
    workers_killed_mid_action_leave_every_effect_once(idempotent_core::store::connect(&url).await.unwrap()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres() {
    let server = PgServer::start();
    workers_killed_mid_action_leave_every_effect_once(idempotent_core::store::connect(&server.url()).await.unwrap())
        .await;
}

/// The negative control: the same schedule without the verifier re-runs the killed effects, and
/// the strict check says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn negative_control_without_the_verifier_effects_run_again() {
    let ctx = RunContext::new(MemoryStore::new(), "unverified");
    let hist = History::new();
    let keys: Arc<Vec<String>> = Arc::new((0..48).map(|i| format!("k{i}")).collect());
    let cfg = Cfg { lease: Duration::from_millis(300), ..Cfg::default() };
    let kills = killing_worker(ctx.clone(), hist.clone(), keys.clone(), cfg, 7).await;
    assert!(kills > 0);
    let (report, errors) = hist.check_exactly_once().expect_err("killed effects ran again");
    assert!(report.re_executions > 0 && report.lost_effects > 0, "{report}");
    assert!(errors.iter().any(|e| e.contains("ran again")), "{errors:?}");
}
