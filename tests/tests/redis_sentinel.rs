//! Redis Sentinel: a store that finds its master through three sentinels
//! ([`RedisStore::sentinel_builder`]) runs and replays, fails closed while the sentinels know
//! no master, follows a promotion, and, with `wait_for_replicas`, loses nothing to repeated
//! crash failovers; without it, the nemesis reports what was lost.
//!
//! Print the reports with `-- --nocapture`; IDEMPOTENT_SENTINEL_ROUNDS sets the nemesis' number
//! of failovers (3 by default).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use idempotent_core::redis::Value;
use idempotent_core::{Error, RedisStore, RunContext};
use idempotent_tests::history::{Completion, History, Report};
use idempotent_tests::workload::{Cfg, Probe, call, probe};
use idempotent_tests::{MASTER_NAME, RedisSentinel, unique};

/// Every store call's bound.
const TIMEOUT: Duration = Duration::from_millis(500);
/// How long the WAIT mode waits for the replica.
const WAIT: Duration = Duration::from_millis(100);
/// A nemesis worker's pace: at most one call per this (4 workers: up to 400 calls a second).
const PACE: Duration = Duration::from_millis(10);

async fn start() -> RedisSentinel {
    tokio::task::spawn_blocking(RedisSentinel::start).await.unwrap()
}

fn store(setup: &RedisSentinel, wait: bool) -> RedisStore {
    let builder = RedisStore::sentinel_builder(setup.urls(), MASTER_NAME).command_timeout(TIMEOUT);
    let builder = if wait { builder.wait_for_replicas(1, WAIT) } else { builder };
    builder.connect_lazy().unwrap()
}

fn exists(setup: &RedisSentinel, node: usize, redis_key: &str) -> bool {
    setup.nodes[node].cmd(&["EXISTS", redis_key]) == Value::Int(1)
}

/// Through the sentinels, the store runs a step once and replays it, on the master they name;
/// `store::connect` takes the same setup as a `redis+sentinel://` URL; a master name the
/// sentinels do not know fails to connect, within the command timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_through_sentinel_runs_and_replays() {
    let setup = start().await;
    let store = RedisStore::sentinel_builder(setup.urls(), MASTER_NAME).command_timeout(TIMEOUT).connect().await;
    let store = store.unwrap_or_else(|e| panic!("{e}; the sentinels' logs:\n{}", setup.logs()));
    let ctx = RunContext::new(store.clone(), unique("sentinel"));
    let hist = History::new();
    let first = probe(&ctx, &hist, "k1").await;
    let Completion::Ok(value) = &first.outcome else { panic!("first call: {:?}", first.outcome) };
    assert!(first.ran);
    let again = probe(&ctx, &hist, "k1").await;
    assert_eq!(again.outcome, first.outcome);
    assert!(!again.ran, "the replay ran the action");
    let (key, _) = ctx.step("effect").key_for(&"k1").unwrap();
    assert!(exists(&setup, setup.master(), &store.redis_key(&key)), "the record is not on the master");

    let hosts: Vec<String> = setup.urls().iter().map(|u| u.trim_start_matches("redis://").to_owned()).collect();
    let url = format!("redis+sentinel://{}/{MASTER_NAME}", hosts.join(","));
    let shared = idempotent_core::store::connect(&url).await.unwrap();
    let ctx = RunContext::new(shared, ctx.run_id());
    let third = probe(&ctx, &hist, "k1").await;
    assert_eq!(third.outcome, Completion::Ok(value.clone()), "through {url}");
    assert!(!third.ran);

    let started = Instant::now();
    let unknown = RedisStore::sentinel_builder(setup.urls(), "nosuchmaster").command_timeout(TIMEOUT).connect().await;
    let err = unknown.expect_err("a master name no sentinel monitors");
    assert!(matches!(err, Error::Unavailable { .. } | Error::Timeout { .. }), "{err}");
    assert!(started.elapsed() < TIMEOUT * 2, "took {:?}", started.elapsed());
}

/// Four callers on fresh keys while the master is killed: until the sentinels promote the
/// replica, calls fail closed within their bound and run nothing; after it, calls work again, on
/// the new master, and the records written before the crash replay there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_master_fails_closed_then_store_follows_the_promotion() {
    let setup = start().await;
    let store = store(&setup, false);
    let ctx = RunContext::new(store.clone(), unique("kill"));
    let hist = History::new();
    let mut before = Vec::new();
    for i in 0..20 {
        let p = probe(&ctx, &hist, &format!("before{i}")).await;
        let Completion::Ok(v) = &p.outcome else { panic!("before the crash: {:?}", p.outcome) };
        before.push((p.key, v.clone()));
    }
    setup.nodes[setup.master()].wait_replicated();

    let done = Arc::new(AtomicBool::new(false));
    let promoted = Arc::new(AtomicBool::new(false));
    let ok_after = Arc::new(AtomicUsize::new(0));
    let workers: Vec<_> = (0..4)
        .map(|w| {
            let (ctx, hist, done, promoted, ok_after) =
                (ctx.clone(), hist.clone(), done.clone(), promoted.clone(), ok_after.clone());
            tokio::spawn(async move {
                let mut probes = Vec::new();
                while !done.load(Ordering::SeqCst) {
                    let p = probe(&ctx, &hist, &format!("w{w}-{}", probes.len())).await;
                    if promoted.load(Ordering::SeqCst) && matches!(p.outcome, Completion::Ok(_)) {
                        ok_after.fetch_add(1, Ordering::SeqCst);
                    }
                    probes.push(p);
                    // A call that fails at once never waits: without this, a store that failed
                    // every call would keep the runtime's threads and the test would hang, not fail.
                    tokio::task::yield_now().await;
                }
                probes
            })
        })
        .collect();
    let (setup, (old, new), killed_at, promoted_at) = tokio::task::spawn_blocking(move || {
        let mut setup = setup;
        let killed_at = Instant::now();
        let nodes = setup.kill_master();
        (setup, nodes, killed_at, Instant::now())
    })
    .await
    .unwrap();
    promoted.store(true, Ordering::SeqCst);
    // The signal to stop: calls that ended ok after the promotion, on every worker's share.
    let deadline = Instant::now() + Duration::from_secs(10);
    while ok_after.load(Ordering::SeqCst) < 40 {
        assert!(Instant::now() < deadline, "calls did not resume after the promotion: {}", failures(&hist));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    done.store(true, Ordering::SeqCst);
    let mut probes = Vec::new();
    for w in workers {
        probes.extend(w.await.unwrap());
    }

    let bound = TIMEOUT * 4;
    for p in &probes {
        assert!(p.elapsed < bound, "{} took {:?} (bound {bound:?}): {:?}", p.key, p.elapsed, p.outcome);
        if let Completion::Fail(e) = &p.outcome {
            assert!(!p.ran, "{} ran its action although the call failed closed: {e}", p.key);
        }
    }
    let during: Vec<&Probe> = probes.iter().filter(|p| p.started >= killed_at && p.started < promoted_at).collect();
    let failed = during.iter().filter(|p| matches!(p.outcome, Completion::Fail(_))).count();
    assert!(failed > 0, "no call failed while the master was down ({} calls)", during.len());
    // Once a call went through on the new master, every later one does.
    let resumed = probes
        .iter()
        .filter(|p| p.started >= promoted_at && matches!(p.outcome, Completion::Ok(_)))
        .map(|p| p.started)
        .min()
        .expect("a call went through after the promotion");
    let late: Vec<&Probe> = probes.iter().filter(|p| p.started > resumed).collect();
    let late_failed: Vec<_> = late.iter().filter(|p| !matches!(p.outcome, Completion::Ok(_))).collect();
    assert!(late_failed.is_empty(), "after resuming: {:?}", late_failed.iter().map(|p| &p.outcome).collect::<Vec<_>>());
    let last = late.last().expect("calls after resuming");
    let (key, _) = ctx.step("effect").key_for(&last.key).unwrap();
    assert!(exists(&setup, new, &store.redis_key(&key)), "{} is not on the new master", last.key);
    println!(
        "kill: {} calls while no master ({failed} failed closed, {:.1} s), {} after, first ok {:?} after the promotion",
        during.len(),
        (promoted_at - killed_at).as_secs_f64(),
        late.len(),
        resumed.saturating_duration_since(promoted_at),
    );
    for (key, value) in &before {
        let p = probe(&ctx, &hist, key).await;
        assert_eq!(p.outcome, Completion::Ok(value.clone()), "{key} on the new master");
        assert!(!p.ran, "{key} ran again on the new master");
    }
    assert!(!setup.nodes[old].is_running());
}

fn failures(hist: &History) -> String {
    format!("{:?}", hist.failures().into_iter().rev().take(5).collect::<Vec<_>>())
}

/// Four workers, each on keys of its own (every call a first execution, one per [`PACE`]), while
/// IDEMPOTENT_SENTINEL_ROUNDS (3) crash failovers run: kill the master, wait for the promotion,
/// start the old one again as the new master's replica; between rounds, until the workers made
/// 100 calls more. Then a settle pass, the final pass over every key, and the checker.
async fn nemesis(wait: bool) -> (Report, Vec<String>) {
    let rounds: usize = std::env::var("IDEMPOTENT_SENTINEL_ROUNDS").ok().and_then(|s| s.parse().ok()).unwrap_or(3);
    let setup = start().await;
    let ctx = RunContext::new(store(&setup, wait), unique("nemesis"));
    let hist = History::new();
    let done = Arc::new(AtomicBool::new(false));
    let calls = Arc::new(AtomicUsize::new(0));
    let workers: Vec<_> = (0..4)
        .map(|w| {
            let (ctx, hist, done, calls) = (ctx.clone(), hist.clone(), done.clone(), calls.clone());
            tokio::spawn(async move {
                // At most one call per tick: the checker's time grows with keys times calls.
                let mut pace = tokio::time::interval(PACE);
                pace.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                let mut keys = Vec::new();
                while !done.load(Ordering::SeqCst) {
                    pace.tick().await;
                    let key = format!("w{w}-{}", keys.len());
                    call(&ctx, &hist, &key, Cfg { lease: Duration::from_millis(500), ..Cfg::default() }, None, false)
                        .await;
                    calls.fetch_add(1, Ordering::SeqCst);
                    keys.push(key);
                }
                keys
            })
        })
        .collect();
    let started = Instant::now();
    let counter = calls.clone();
    let setup = tokio::task::spawn_blocking(move || {
        let mut setup = setup;
        for _ in 0..rounds {
            let from = counter.load(Ordering::SeqCst);
            let deadline = Instant::now() + Duration::from_secs(20);
            while counter.load(Ordering::SeqCst) < from + 100 {
                assert!(Instant::now() < deadline, "the workers made no 100 calls within 20 s");
                std::thread::sleep(Duration::from_millis(20));
            }
            setup.failover_crash();
        }
        setup
    })
    .await
    .unwrap();
    done.store(true, Ordering::SeqCst);
    let secs = started.elapsed().as_secs_f64();
    // Each worker's keys once the failovers are over, on a task each: a call may still meet the
    // last switch (a connection to replace), so each key until it ends ok; then the final pass.
    let passes: Vec<_> = workers
        .into_iter()
        .map(|w| {
            let (ctx, hist) = (ctx.clone(), hist.clone());
            tokio::spawn(async move {
                let keys = w.await.unwrap();
                let mut settling = 0;
                for key in &keys {
                    for _ in 0..10 {
                        if matches!(call(&ctx, &hist, key, Cfg::default(), None, false).await, Completion::Ok(_)) {
                            break;
                        }
                        settling += 1;
                    }
                }
                for key in &keys {
                    call(&ctx, &hist, key, Cfg::default(), None, true).await;
                }
                settling
            })
        })
        .collect();
    let mut settling = 0;
    for pass in passes {
        settling += pass.await.unwrap();
    }
    let (report, errors) = match hist.check() {
        Ok(report) => (report, Vec::new()),
        Err(failed) => failed,
    };
    println!(
        "sentinel nemesis, WAIT {}: {rounds} crash failovers in {secs:.1} s, {settling} calls not ok once healed, {report}",
        if wait { "1" } else { "off" }
    );
    for e in &errors {
        println!("  {e}");
    }
    assert!(settling < 10, "{settling} calls failed after the last failover");
    assert!(report.ops > 100 * rounds, "the workers barely ran: {report}");
    drop(setup);
    (report, errors)
}

/// With WAIT 1 and one replica, what a caller acted on was on the replica the sentinels
/// promote: repeated crash failovers commit no key twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nemesis_crash_failovers_with_wait_have_no_duplicates() {
    let (report, errors) = nemesis(true).await;
    assert!(errors.is_empty(), "{report}: {errors:?}");
    assert_eq!(report.duplicates, 0);
}

/// Without WAIT a crash loses what the master acknowledged but had not sent to its replica: the
/// report counts it (RELIABILITY.md records the figures). Every violation must be one that a lost
/// write explains: a second committed result.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nemesis_crash_failovers_without_wait_measures_the_loss() {
    let (_, errors) = nemesis(false).await;
    for e in &errors {
        assert!(e.contains("different results were committed"), "a violation a lost write cannot explain: {e}");
    }
}

/// A master demoted by hand, its clients left connected, and the sentinels pointed at the new
/// master: the store's connections to the old one, which answer `READONLY` now, are dropped and
/// the call is sent again on one the sentinels name, not refused for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_drops_connections_to_a_demoted_master_and_asks_the_sentinels_again() {
    let setup = start().await;
    let store = store(&setup, false);
    store.warm_up().await.unwrap();
    let ctx = RunContext::new(store.clone(), unique("demoted"));
    let hist = History::new();
    let before = probe(&ctx, &hist, "before").await;
    assert!(matches!(before.outcome, Completion::Ok(_)), "{:?}", before.outcome);
    let (setup, (old, new)) = tokio::task::spawn_blocking(move || {
        let nodes = setup.switch_by_hand();
        (setup, nodes)
    })
    .await
    .unwrap();
    assert_eq!(setup.nodes[old].role(), "slave");
    for i in 0..5 {
        let p = probe(&ctx, &hist, &format!("after{i}")).await;
        assert!(matches!(p.outcome, Completion::Ok(_)), "after{i}: {:?}", p.outcome);
        let (key, _) = ctx.step("effect").key_for(&p.key).unwrap();
        assert!(exists(&setup, new, &store.redis_key(&key)), "after{i} is not on the new master");
    }
    let again = probe(&ctx, &hist, "before").await;
    assert_eq!(again.outcome, before.outcome);
    assert!(!again.ran);
}

/// `SENTINEL FAILOVER` with the master alive, callers on fresh keys meanwhile; returns how many
/// calls there were, how many did not end ok, and how many ended ok but their record is not on
/// the new master once the old one was demoted (acknowledged, then lost).
async fn forced(wait: bool) -> (usize, usize, usize) {
    let setup = start().await;
    let store = store(&setup, wait);
    store.warm_up().await.unwrap();
    let ctx = RunContext::new(store.clone(), unique("forced"));
    let hist = History::new();
    let done = Arc::new(AtomicBool::new(false));
    let flag = done.clone();
    let switch = tokio::task::spawn_blocking(move || {
        let nodes = setup.failover_forced();
        flag.store(true, Ordering::SeqCst);
        (setup, nodes)
    });
    let mut probes = Vec::new();
    while !done.load(Ordering::SeqCst) {
        probes.push(probe(&ctx, &hist, &format!("k{}", probes.len())).await);
    }
    let (setup, (_, new)) = switch.await.unwrap();
    let oks: Vec<&Probe> = probes.iter().filter(|p| matches!(p.outcome, Completion::Ok(_))).collect();
    let lost = oks
        .iter()
        .filter(|p| {
            let (key, _) = ctx.step("effect").key_for(&p.key).unwrap();
            !exists(&setup, new, &store.redis_key(&key))
        })
        .count();
    let failed = probes.len() - oks.len();
    println!(
        "SENTINEL FAILOVER, WAIT {}: {} calls, {failed} not ok, {lost} ended ok and were lost",
        if wait { "1" } else { "off" },
        probes.len()
    );
    (probes.len(), failed, lost)
}

/// What Sentinel does not do: fence the old master. After `SENTINEL FAILOVER` the old master
/// still takes writes until a sentinel demotes it (which closes its clients' connections), and
/// the store, whose connections to it still work, keeps writing there: those writes are lost.
/// If this fails because nothing was lost, the store learnt to follow a switch by itself: update
/// the docs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forced_failover_without_wait_loses_writes_to_the_old_master() {
    let (calls, _, lost) = forced(false).await;
    assert!(lost > 0, "none of {calls} calls was lost");
}

/// With WAIT 1, the old master has no replica left once the new one is promoted: every write
/// there fails, and nothing acknowledged is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forced_failover_with_wait_loses_nothing() {
    let (calls, failed, lost) = forced(true).await;
    assert_eq!(lost, 0, "{lost} of {calls} calls were acknowledged and lost");
    assert!(failed > 0, "no call met the old master after the switch");
}
