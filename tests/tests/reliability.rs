//! Reliability under faults: every scenario records a history of calls and side effects and runs
//! the exactly-once checker over it (see `idempotent_tests::history`).
//!
//! Faults come from a TCP proxy between the store and the server (latency, resets, blackholes,
//! dropped replies) and from the server process itself (SIGSTOP/SIGCONT, kill -9 and restart,
//! SCRIPT FLUSH and FUNCTION FLUSH, memory limits), on Redis 7.0 and on Valkey 9 alike. Print the
//! reports with `-- --nocapture`.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idempotent_core::record::{Acquire, Grant, Token, Transition};
use idempotent_core::{Error, MemoryStore, OnInFlight, RedisStore, RunContext, SharedStore, Store};
use idempotent_tests::history::{Completion, History};
use idempotent_tests::proxy::{Fault, FaultProxy};
use idempotent_tests::workload::{
    Cfg, Hold, call, fastrand_like, final_pass_and_check, held_until, random_calls, signal_then_hold, snapshot,
};
use idempotent_tests::{Flavor, HookedStore, RedisOptions, RedisServer, unique};
use tokio::sync::{Notify, oneshot, watch};

// Every scenario on a server runs on Redis 7.0 and on Valkey 9 (`redis::…` and `valkey::…`).
macro_rules! on_both_servers {
    ($($scenario:ident),* $(,)?) => {
        mod redis {
            use idempotent_tests::Flavor;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $scenario() {
                    super::$scenario(Flavor::Redis).await;
                }
            )*
        }
        mod valkey {
            use idempotent_tests::Flavor;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $scenario() {
                    super::$scenario(Flavor::Valkey).await;
                }
            )*
        }
    };
}

on_both_servers!(
    lease_expiry_without_heartbeat_fences_the_old_holder,
    lease_renewed_by_heartbeat_keeps_duplicates_out,
    holder_cut_off_past_its_lease_cannot_commit,
    cancellation_mid_effect_is_recovered_by_the_next_attempt,
    lost_reply_to_acquire_runs_nothing_and_frees_the_key_before_the_lease_ends,
    lost_reply_to_complete_still_replays_the_committed_result,
    lost_request_of_complete_is_verified_by_the_next_call,
    reset_between_acquire_and_effect,
    redis_paused_for_twice_the_timeout_fails_closed_then_heals,
    redis_killed_and_restarted_mid_run_with_aof,
    restart_without_persistence_is_caught_by_the_checker_and_the_preflight,
    noscript_after_script_flush_mid_run,
    latency_jitter_with_32_workers,
    slow_actions_do_not_exhaust_the_pool,
    out_of_memory_under_noeviction_fails_closed,
    large_results_are_capped_and_do_not_starve_heartbeats,
    nemesis_mixed_faults_with_8_workers,
);

const TIMEOUT: Duration = Duration::from_millis(400);

struct Setup {
    server: RedisServer,
    proxy: FaultProxy,
    /// Through the proxy.
    ctx: RunContext,
    /// Straight to the server (a second worker on a healthy network).
    direct: RunContext,
    hist: History,
}

async fn setup(options: RedisOptions) -> Setup {
    let server = RedisServer::start_with(options);
    let proxy = FaultProxy::start(([127, 0, 0, 1], server.port()).into()).await;
    let run = unique("rel");
    // One connection, so a fault set mid-call hits the connection the call uses, not a new one.
    let via_proxy = RedisStore::builder(proxy.url()).pool_size(1).command_timeout(TIMEOUT).connect_lazy().unwrap();
    let direct = RedisStore::builder(server.url()).command_timeout(TIMEOUT).connect_lazy().unwrap();
    Setup {
        ctx: RunContext::new(via_proxy, &run),
        direct: RunContext::new(direct, &run),
        server,
        proxy,
        hist: History::new(),
    }
}

async fn lease_expiry_without_heartbeat_fences_the_old_holder(flavor: Flavor) {
    let s = setup(RedisOptions { flavor, ..Default::default() }).await;
    let key = "k".to_string();
    let release = Arc::new(Notify::new());
    let (started_tx, started_rx) = oneshot::channel();
    let cfg = Cfg { lease: Duration::from_millis(300), heartbeat: false, ..Cfg::default() };
    let holder = {
        let (ctx, hist, key, hold) =
            (s.ctx.clone(), s.hist.clone(), key.clone(), signal_then_hold(started_tx, &release));
        tokio::spawn(async move { call(&ctx, &hist, &key, cfg, hold, false).await })
    };
    started_rx.await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    // The lease passed: a second worker takes over and commits.
    let second = call(&s.direct, &s.hist, &key, Cfg::default(), None, false).await;
    assert!(matches!(second, Completion::Ok(_)), "{second:?}");
    release.notify_one();
    let first = holder.await.unwrap();
    assert!(matches!(&first, Completion::Indeterminate(e) if e.contains("lease")), "{first:?}");
    let report = final_pass_and_check(&s.direct, &s.hist, &[key]).await;
    assert_eq!(report.re_executions, 1);
}

async fn lease_renewed_by_heartbeat_keeps_duplicates_out(flavor: Flavor) {
    let s = setup(RedisOptions { flavor, ..Default::default() }).await;
    let key = "k".to_string();
    let release = Arc::new(Notify::new());
    let (started_tx, started_rx) = oneshot::channel();
    let cfg = Cfg { lease: Duration::from_millis(300), ..Cfg::default() };
    let holder = {
        let (ctx, hist, key, hold) =
            (s.ctx.clone(), s.hist.clone(), key.clone(), signal_then_hold(started_tx, &release));
        tokio::spawn(async move { call(&ctx, &hist, &key, cfg, hold, false).await })
    };
    started_rx.await.unwrap();
    let reject = Cfg { on_in_flight: OnInFlight::Reject, ..cfg };
    for _ in 0..4 {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let dup = call(&s.direct, &s.hist, &key, reject, None, false).await;
        assert!(matches!(&dup, Completion::Fail(e) if e.contains("still running")), "{dup:?}");
    }
    release.notify_one();
    assert!(matches!(holder.await.unwrap(), Completion::Ok(_)));
    let report = final_pass_and_check(&s.direct, &s.hist, &[key]).await;
    assert_eq!(report.re_executions, 0);
}

async fn holder_cut_off_past_its_lease_cannot_commit(flavor: Flavor) {
    let s = setup(RedisOptions { flavor, ..Default::default() }).await;
    let key = "k".to_string();
    let release = Arc::new(Notify::new());
    let (started_tx, started_rx) = oneshot::channel();
    let cfg = Cfg { lease: Duration::from_millis(400), ..Cfg::default() };
    let holder = {
        let (ctx, hist, key, hold) =
            (s.ctx.clone(), s.hist.clone(), key.clone(), signal_then_hold(started_tx, &release));
        tokio::spawn(async move { call(&ctx, &hist, &key, cfg, hold, false).await })
    };
    started_rx.await.unwrap();
    // The holder is cut off (as in a long GC pause or a partition): its renewals go nowhere.
    s.proxy.set(Fault::Blackhole);
    tokio::time::sleep(Duration::from_millis(700)).await;
    let second = call(&s.direct, &s.hist, &key, Cfg::default(), None, false).await;
    assert!(matches!(second, Completion::Ok(_)), "{second:?}");
    s.proxy.set(Fault::Pass);
    release.notify_one();
    let first = holder.await.unwrap();
    assert!(matches!(first, Completion::Indeterminate(_)), "{first:?}");
    final_pass_and_check(&s.direct, &s.hist, &[key]).await;
}

async fn cancellation_mid_effect_is_recovered_by_the_next_attempt(flavor: Flavor) {
    let s = setup(RedisOptions { flavor, ..Default::default() }).await;
    let key = "k".to_string();
    let never = Arc::new(Notify::new());
    let (started_tx, started_rx) = oneshot::channel();
    let cfg = Cfg { lease: Duration::from_millis(300), ..Cfg::default() };
    let holder = {
        let (ctx, hist, key, hold) = (s.ctx.clone(), s.hist.clone(), key.clone(), signal_then_hold(started_tx, &never));
        tokio::spawn(async move { call(&ctx, &hist, &key, cfg, hold, false).await })
    };
    started_rx.await.unwrap();
    holder.abort();
    assert!(holder.await.unwrap_err().is_cancelled());
    let next = call(&s.direct, &s.hist, &key, cfg, None, false).await;
    assert!(matches!(next, Completion::Ok(_)), "{next:?}");
    let report = final_pass_and_check(&s.direct, &s.hist, &[key]).await;
    assert_eq!(report.re_executions, 1);
}

async fn lost_reply_to_acquire_runs_nothing_and_frees_the_key_before_the_lease_ends(flavor: Flavor) {
    let s = setup(RedisOptions { flavor, ..Default::default() }).await;
    let key = "k".to_string();
    // Load the scripts first: with a lost reply to a NOSCRIPT answer the acquire never ran.
    call(&s.ctx, &s.hist, "warm-up", Cfg::default(), None, false).await;
    // A lease far longer than the next caller is willing to wait (10 s).
    let cfg = Cfg { lease: Duration::from_secs(60), ..Cfg::default() };
    s.proxy.set(Fault::DropReplies);
    let lost = call(&s.ctx, &s.hist, &key, cfg, None, false).await;
    assert!(matches!(lost, Completion::Fail(_)), "{lost:?}");
    s.proxy.set(Fault::Pass);
    // The server did take the lease, for a token nobody uses: the store releases it in the
    // background, so the next caller gets the key within its wait, long before the lease ends.
    let next = call(&s.ctx, &s.hist, &key, cfg, None, false).await;
    assert!(matches!(next, Completion::Ok(_)), "the key stayed taken by the lost acquire: {next:?}");
    let report = final_pass_and_check(&s.direct, &s.hist, &[key, "warm-up".into()]).await;
    assert_eq!(report.executions, 2, "one execution per key");
}

async fn lost_reply_to_complete_still_replays_the_committed_result(flavor: Flavor) {
    let s = setup(RedisOptions { flavor, ..Default::default() }).await;
    let key = "k".to_string();
    // Load the scripts first: a lost reply to a NOSCRIPT answer would mean `complete` never ran.
    call(&s.ctx, &s.hist, "warm-up", Cfg::default(), None, false).await;
    let proxy = Arc::new(s.proxy);
    let cfg = Cfg { heartbeat: false, ..Cfg::default() };
    let p = proxy.clone();
    // The effect runs, then the reply to `complete` is lost on the way back.
    let hold: Option<Hold> = Some(Box::new(move || {
        Box::pin(async move {
            p.set(Fault::DropReplies);
        })
    }));
    let first = call(&s.ctx, &s.hist, &key, cfg, hold, false).await;
    assert!(matches!(&first, Completion::Indeterminate(e) if e.contains("complete")), "{first:?}");
    proxy.set(Fault::Pass);
    let second = call(&s.ctx, &s.hist, &key, cfg, None, false).await;
    assert!(matches!(second, Completion::Ok(_)), "{second:?}");
    let report = final_pass_and_check(&s.direct, &s.hist, &[key, "warm-up".into()]).await;
    assert_eq!(report.executions, 2, "the committed result was replayed, not re-run");
}

/// The request of `complete` never reaches the server (held by a partition, then dropped with
/// its connection), and neither does the executor's uncertain mark: the next call, on a step
/// with a verifier, is recovered once the lease passes, finds the effect in the ledger and
/// stores it. Nothing ran twice and no effect is unknown to the record.
async fn lost_request_of_complete_is_verified_by_the_next_call(flavor: Flavor) {
    let s = setup(RedisOptions { flavor, ..Default::default() }).await;
    let key = "k".to_string();
    let cfg = Cfg { heartbeat: false, lease: Duration::from_millis(600), verify: true, ..Cfg::default() };
    call(&s.ctx, &s.hist, "warm-up", cfg, None, false).await;
    let proxy = Arc::new(s.proxy);
    let p = proxy.clone();
    // The effect runs, then every byte to the server is held: `complete` and the mark time out.
    let hold: Option<Hold> = Some(Box::new(move || {
        Box::pin(async move {
            p.set(Fault::Blackhole);
        })
    }));
    let first = call(&s.ctx, &s.hist, &key, cfg, hold, false).await;
    assert!(matches!(&first, Completion::Indeterminate(e) if e.contains("complete")), "{first:?}");
    // The held bytes are dropped with their connection: nothing of them reached the server.
    proxy.reset_all().await;
    proxy.set(Fault::Pass);
    let second = call(&s.ctx, &s.hist, &key, cfg, None, false).await;
    assert!(matches!(second, Completion::Ok(_)), "{second:?}");
    let keys = [key, "warm-up".into()];
    let report = idempotent_tests::workload::final_pass_and_check_exactly_once(&s.direct, &s.hist, &keys).await;
    assert_eq!((report.executions, report.re_executions, report.lost_effects), (2, 0, 0), "{report}");
}

async fn reset_between_acquire_and_effect(flavor: Flavor) {
    let s = setup(RedisOptions { flavor, ..Default::default() }).await;
    let key = "k".to_string();
    let proxy = Arc::new(s.proxy);
    let cfg = Cfg { lease: Duration::from_millis(300), heartbeat: false, ..Cfg::default() };
    let p = proxy.clone();
    let hold: Option<Hold> = Some(Box::new(move || {
        Box::pin(async move {
            p.set(Fault::Reset);
        })
    }));
    let first = call(&s.ctx, &s.hist, &key, cfg, hold, false).await;
    assert!(matches!(first, Completion::Indeterminate(_)), "{first:?}");
    proxy.set(Fault::Pass);
    let second = call(&s.ctx, &s.hist, &key, cfg, None, false).await;
    assert!(matches!(second, Completion::Ok(_)), "{second:?}");
    final_pass_and_check(&s.direct, &s.hist, &[key]).await;
}

async fn redis_paused_for_twice_the_timeout_fails_closed_then_heals(flavor: Flavor) {
    let s = setup(RedisOptions { flavor, ..Default::default() }).await;
    let keys: Vec<String> = (0..4).map(|i| format!("k{i}")).collect();
    s.server.pause();
    for key in &keys {
        let out = call(&s.direct, &s.hist, key, Cfg::default(), None, false).await;
        assert!(matches!(&out, Completion::Fail(e) if e.contains("did not answer")), "{out:?}");
    }
    tokio::time::sleep(TIMEOUT * 2).await;
    s.server.resume();
    let report = final_pass_and_check(&s.direct, &s.hist, &keys).await;
    assert_eq!(report.executions, keys.len());
}

/// Workers keep calling while the server is killed and restarted from its append-only file.
async fn redis_killed_and_restarted_mid_run_with_aof(flavor: Flavor) {
    let mut s = setup(RedisOptions { aof: true, flavor, ..Default::default() }).await;
    let keys: Vec<String> = (0..12).map(|i| format!("k{i}")).collect();
    for key in &keys[..6] {
        assert!(matches!(call(&s.direct, &s.hist, key, Cfg::default(), None, false).await, Completion::Ok(_)));
    }
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut workers = Vec::new();
    for w in 0..4 {
        let (ctx, hist, keys, stop) = (s.direct.clone(), s.hist.clone(), keys.clone(), stop.clone());
        workers.push(tokio::spawn(async move {
            let mut i = w;
            while !stop.load(Ordering::SeqCst) {
                let cfg = Cfg { on_in_flight: OnInFlight::Reject, ..Cfg::default() };
                call(&ctx, &hist, &keys[i % keys.len()], cfg, None, false).await;
                i += 1;
                tokio::task::yield_now().await;
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    s.server.kill();
    tokio::time::sleep(Duration::from_millis(200)).await;
    s.server.restart();
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::SeqCst);
    for w in workers {
        w.await.unwrap();
    }
    // Leases taken just before the kill survive in the AOF; waiting calls take over after them.
    final_pass_and_check(&s.direct, &s.hist, &keys).await;
}

/// Without persistence a restart forgets completed operations and they run again: the checker
/// catches it, and the preflight warned about it beforehand.
async fn restart_without_persistence_is_caught_by_the_checker_and_the_preflight(flavor: Flavor) {
    let mut server = RedisServer::start_flavor(flavor);
    let store = RedisStore::builder(server.url()).command_timeout(TIMEOUT).connect_lazy().unwrap();
    let preflight = store.preflight().await.unwrap();
    assert!(preflight.problems.iter().any(|p| p.to_string().contains("persistence is off")), "{preflight}");
    let ctx = RunContext::new(store, unique("rel"));
    let hist = History::new();
    let keys = vec!["a".to_string(), "b".to_string()];
    for key in &keys {
        assert!(matches!(call(&ctx, &hist, key, Cfg::default(), None, false).await, Completion::Ok(_)));
    }
    server.kill();
    server.restart();
    for key in &keys {
        let mut out = call(&ctx, &hist, key, Cfg::default(), None, true).await;
        for _ in 0..20 {
            if matches!(out, Completion::Ok(_)) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            out = call(&ctx, &hist, key, Cfg::default(), None, true).await;
        }
    }
    let (report, errors) = hist.check().expect_err("the checker must catch records lost in a restart");
    assert_eq!(report.duplicates, 2, "{errors:?}");
}

async fn noscript_after_script_flush_mid_run(flavor: Flavor) {
    let s = setup(RedisOptions { flavor, ..Default::default() }).await;
    let keys: Vec<String> = (0..6).map(|i| format!("k{i}")).collect();
    for (i, key) in keys.iter().enumerate() {
        if i % 2 == 0 {
            s.server.cmd(&["SCRIPT", "FLUSH"]);
            s.server.cmd(&["FUNCTION", "FLUSH"]);
        }
        assert!(matches!(call(&s.ctx, &s.hist, key, Cfg::default(), None, false).await, Completion::Ok(_)));
    }
    final_pass_and_check(&s.ctx, &s.hist, &keys).await;
}

async fn latency_jitter_with_32_workers(flavor: Flavor) {
    let s = setup(RedisOptions { flavor, ..Default::default() }).await;
    s.proxy.set(Fault::Latency { min: Duration::from_millis(50), max: Duration::from_millis(300) });
    let store = RedisStore::builder(s.proxy.url()).command_timeout(Duration::from_secs(3)).connect_lazy().unwrap();
    let ctx = RunContext::new(store, unique("jitter"));
    let keys: Vec<String> = (0..16).map(|i| format!("k{i}")).collect();
    let mut workers = Vec::new();
    for w in 0..32 {
        let (ctx, hist, keys) = (ctx.clone(), s.hist.clone(), keys.clone());
        workers.push(tokio::spawn(async move {
            for i in 0..3 {
                call(&ctx, &hist, &keys[(w + i * 7) % keys.len()], Cfg::default(), None, false).await;
            }
        }));
    }
    for w in workers {
        w.await.unwrap();
    }
    s.proxy.set(Fault::Pass);
    let report = final_pass_and_check(&ctx, &s.hist, &keys).await;
    // Latency alone never re-runs an action: a re-execution needs a call whose outcome could not
    // be stored (indeterminate: `complete` timed out under the jitter, so the key waited out its
    // lease). Usually none is; on a loaded machine one in several runs has one.
    assert!(
        report.re_executions <= report.indeterminate,
        "{report}: a key re-ran without an indeterminate call: {:?}",
        s.hist.failures()
    );
}

/// Slow actions never hold a connection: 64 of them on a one-connection pool all proceed at once,
/// and none waits for another.
async fn slow_actions_do_not_exhaust_the_pool(flavor: Flavor) {
    let server = RedisServer::start_flavor(flavor);
    let store = RedisStore::builder(server.url()).pool_size(1).command_timeout(TIMEOUT).connect_lazy().unwrap();
    let ctx = RunContext::new(store, unique("pool"));
    let hist = History::new();
    let running = Arc::new(AtomicUsize::new(0));
    let all_in = Arc::new(Notify::new());
    let keys: Vec<String> = (0..64).map(|i| format!("k{i}")).collect();
    let mut tasks = Vec::new();
    for key in keys.clone() {
        let (ctx, hist, running, all_in) = (ctx.clone(), hist.clone(), running.clone(), all_in.clone());
        tasks.push(tokio::spawn(async move {
            let hold: Option<Hold> = Some(Box::new(move || {
                Box::pin(async move {
                    let notified = all_in.notified();
                    if running.fetch_add(1, Ordering::SeqCst) + 1 == 64 {
                        all_in.notify_waiters();
                    } else {
                        notified.await;
                    }
                })
            }));
            call(&ctx, &hist, &key, Cfg::default(), hold, false).await
        }));
    }
    let all = async {
        let mut outs = Vec::new();
        for t in tasks {
            outs.push(t.await.unwrap());
        }
        outs
    };
    // All 64 actions are inside their side effect at the same moment; a hang here would mean a
    // connection is held while an action runs.
    let outs = tokio::time::timeout(Duration::from_secs(20), all).await.expect("slow actions hung on the pool");
    assert!(outs.iter().all(|o| matches!(o, Completion::Ok(_))), "{outs:?}");
    final_pass_and_check(&ctx, &hist, &keys).await;
}

async fn out_of_memory_under_noeviction_fails_closed(flavor: Flavor) {
    let server = RedisServer::start_with(RedisOptions {
        flavor,
        extra: vec![("maxmemory".into(), "3mb".into()), ("maxmemory-policy".into(), "noeviction".into())],
        ..Default::default()
    });
    let store = RedisStore::builder(server.url()).command_timeout(TIMEOUT).connect_lazy().unwrap();
    store.warm_up().await.unwrap();
    let ctx = RunContext::new(store.clone(), unique("oom"));
    // A done record, for the operator's calls below.
    let _: u8 = ctx.step("kept").run(&1, |_| async { Ok::<_, Error>(1) }).await.unwrap();
    let (kept, _) = ctx.step("kept").key_for(&1).unwrap();
    let hist = History::new();
    let mut conn = server.connection();
    let filler = "x".repeat(64 * 1024);
    for i in 0.. {
        let r: Result<(), _> =
            idempotent_core::redis::cmd("SET").arg(format!("junk:{i}")).arg(&filler).query(&mut conn);
        if r.is_err() {
            break;
        }
        assert!(i < 10_000, "maxmemory was never reached");
    }
    // Right at the limit, a small write may still fit once the refused one's buffer is freed:
    // the limit goes well below what the server holds.
    server.cmd(&["CONFIG", "SET", "maxmemory", "1mb"]);
    let out = call(&ctx, &hist, "k", Cfg::default(), None, false).await;
    assert!(matches!(&out, Completion::Fail(e) if e.contains("OOM")), "{out:?}");
    // Reading a record and deleting one still work over the limit (their functions are flagged
    // `no-writes` and `allow-oom`), so an operator can free memory through the store.
    let monitor = server.monitor();
    let info = store.inspect(&kept).await.unwrap().expect("the done record");
    assert_eq!(info.state, idempotent_core::store::RecordState::Done);
    assert_eq!(store.delete(&kept).await.unwrap(), idempotent_core::store::Deleted::Ok);
    assert_eq!(monitor.client_commands(), ["fcall", "fcall"]);
    let report = hist.check().map_err(|(_, e)| e).expect_err("no final pass yet");
    assert!(report.iter().any(|e| e.contains("final pass")));
    // Memory freed: the operation runs, once.
    server.cmd(&["FLUSHALL"]);
    server.cmd(&["CONFIG", "SET", "maxmemory", "3mb"]);
    let report = final_pass_and_check(&ctx, &hist, &["k".to_string()]).await;
    assert_eq!(report.executions, 1);
}

/// 10 MiB results are stored within the default 16 MiB cap while another holder's heartbeats keep
/// its lease; a 20 MiB result is refused with a clear error.
///
/// The lease (1 s, renewed every third of it) is short next to the big writes, which go out on
/// the same connections as the renewals, yet long enough that a loaded two-core machine running
/// the whole suite does not lose it to scheduling alone (at 300 ms it did, once in a full run).
async fn large_results_are_capped_and_do_not_starve_heartbeats(flavor: Flavor) {
    let server = RedisServer::start_flavor(flavor);
    let store = RedisStore::builder(server.url()).command_timeout(Duration::from_secs(2)).connect_lazy().unwrap();
    let ctx = RunContext::new(store, unique("big"));
    let lease = Duration::from_secs(1);
    let release = Arc::new(Notify::new());
    let (started_tx, started_rx) = oneshot::channel();
    let holder = {
        let (ctx, release) = (ctx.clone(), release.clone());
        tokio::spawn(async move {
            ctx.step("small")
                .lease(lease)
                .run(&(), |a| async move {
                    started_tx.send(()).unwrap();
                    release.notified().await;
                    Ok::<_, Error>(a.lease_lost())
                })
                .await
        })
    };
    started_rx.await.unwrap();
    // Written one after another for two leases (at least 3, at most 10 of them): the renewals
    // must get through between (and on the connections of) the big writes.
    let started = tokio::time::Instant::now();
    let mut written = 0;
    while written < 3 || (started.elapsed() < 2 * lease && written < 10) {
        let big: String =
            ctx.step("big").run(&unique("payload"), |_| async { Ok::<_, Error>("y".repeat(10 << 20)) }).await.unwrap();
        assert_eq!(big.len(), 10 << 20);
        written += 1;
    }
    let dup = ctx
        .step("small")
        .lease(lease)
        .on_in_flight(OnInFlight::Reject)
        .run(&(), |_| async { Ok::<bool, Error>(true) })
        .await;
    assert!(
        matches!(dup, Err(Error::InFlight { .. })),
        "the holder lost its lease while {written} big results were written: {dup:?}"
    );
    release.notify_one();
    assert!(!holder.await.unwrap().unwrap(), "the heartbeat reported a lost lease");

    let err = ctx.step("huge").run(&1, |_| async { Ok::<_, Error>("z".repeat(20 << 20)) }).await.unwrap_err();
    assert!(matches!(err, Error::ResultTooLarge { .. }) && err.to_string().contains("max_result_bytes"), "{err}");
    // Nothing was stored: the key was released and a smaller result can be stored.
    let ok: String = ctx.step("huge").run(&1, |_| async { Ok::<_, Error>("small".into()) }).await.unwrap();
    assert_eq!(ok, "small");
}

/// Mixed faults for a while (60 s by default; IDEMPOTENT_NEMESIS_SECS overrides) with 8 workers
/// on random keys, then heal, a final pass and the checker.
async fn nemesis_mixed_faults_with_8_workers(flavor: Flavor) {
    let secs: u64 = std::env::var("IDEMPOTENT_NEMESIS_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(60);
    let s = setup(RedisOptions { aof: true, flavor, ..Default::default() }).await;
    let keys: Vec<String> = (0..40).map(|i| format!("k{i}")).collect();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    let proxy = Arc::new(s.proxy);
    let mut workers = Vec::new();
    for w in 0..8u64 {
        workers.push(tokio::spawn(random_calls(s.ctx.clone(), s.hist.clone(), keys.clone(), deadline, w + 1)));
    }
    let nemesis = {
        let proxy = proxy.clone();
        let server = &s.server;
        async move {
            let mut rng = fastrand_like(99);
            let mut faults = 0;
            while tokio::time::Instant::now() < deadline {
                let fault = match rng() % 6 {
                    0 => Fault::Latency { min: Duration::from_millis(5), max: Duration::from_millis(200) },
                    1 => Fault::Reset,
                    2 => Fault::DropReplies,
                    3 => Fault::Blackhole,
                    4 => {
                        server.cmd(&["SCRIPT", "FLUSH"]);
                        server.cmd(&["FUNCTION", "FLUSH"]);
                        Fault::Pass
                    }
                    _ => Fault::Pass,
                };
                proxy.set(fault);
                faults += 1;
                tokio::time::sleep(Duration::from_millis(100 + rng() % 400)).await;
                proxy.set(Fault::Pass);
                tokio::time::sleep(Duration::from_millis(100 + rng() % 300)).await;
            }
            faults
        }
    };
    let faults = nemesis.await;
    for w in workers {
        w.await.unwrap();
    }
    proxy.set(Fault::Pass);
    let report = final_pass_and_check(&s.direct, &s.hist, &keys).await;
    println!("nemesis: {secs} s, {faults} faults injected, {report}");
    assert!(report.ops > 100, "the workers barely ran: {report}");
}

/// A store with the lease check turned off: it hands the key to every caller. The negative
/// control: the checker must catch what it lets through.
fn no_lease_check() -> SharedStore {
    let store = HookedStore::new(Arc::new(MemoryStore::new()))
        .describe_as(|_| "no-lease-check (test only)".into())
        .on_acquire(|call| {
            Box::pin(async move {
                let call_key = call.key;
                match call.forward().await? {
                    Acquire::InFlight { .. } => Ok(Acquire::Acquired(Grant {
                        token: Token::unique(),
                        attempt: idempotent_core::Attempt::new(*call_key, 0, 1, false),
                    })),
                    other => Ok(other),
                }
            })
        })
        .on_complete(|call| {
            Box::pin(async move {
                // Accept any token: a stale holder's result is "stored" too.
                let _ = call.forward().await?;
                Ok(Transition::Ok)
            })
        });
    Arc::new(store)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negative_control_the_checker_catches_a_store_without_lease_checks() {
    for store in [no_lease_check(), Arc::new(MemoryStore::new()) as SharedStore] {
        let broken = store.describe().contains("no-lease-check");
        let ctx = RunContext::new(store, unique("neg"));
        let hist = History::new();
        let (open, gate) = watch::channel(false);
        let mut tasks = Vec::new();
        for _ in 0..4 {
            let (ctx, hist, hold) = (ctx.clone(), hist.clone(), held_until(&gate));
            let cfg = Cfg { on_in_flight: OnInFlight::Reject, ..Cfg::default() };
            tasks.push(tokio::spawn(async move { call(&ctx, &hist, "k", cfg, hold, false).await }));
        }
        // Every caller is either inside the side effect or was turned away.
        loop {
            let r = snapshot(&hist);
            if r.executions + r.fail == 4 {
                break;
            }
            tokio::task::yield_now().await;
        }
        open.send_replace(true);
        for t in tasks {
            t.await.unwrap();
        }
        let verdict = {
            for key in ["k"] {
                call(&ctx, &hist, key, Cfg::default(), None, true).await;
            }
            hist.check()
        };
        if broken {
            let (report, errors) = verdict.expect_err("the checker missed duplicate executions");
            assert!(report.duplicates >= 1, "{errors:?}");
            assert!(
                errors
                    .iter()
                    .any(|e| e.contains("overlapped without a higher fence") || e.contains("different results"))
            );
        } else {
            let report = verdict.unwrap_or_else(|(_, e)| panic!("{e:?}"));
            assert_eq!(report.executions, 1);
        }
    }
}
