//! RedisStore against spawned servers: shared handles, round trips, outages, preflight, garbage.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use idempotent_core::record::{Abandon, Acquire, KEEP_RESOLVED_RELEASE, Labels, Resolution, Resolved, Transition};
use idempotent_core::redis::{Script, Value};
use idempotent_core::state::{Scope, State};
use idempotent_core::store::redis::{layout, source};
use idempotent_core::store::{Cursor, Deleted, Filter, RecordState};
use idempotent_core::{
    Error, Fingerprint, Key, KeyScope, OnInFlight, RedisStore, RedisStoreBuilder, Risk, RunContext, SharedStore, Store,
};
use idempotent_tests::{Monitored, RedisOptions, RedisServer, unique};
use tokio::sync::Barrier;

fn store(server: &RedisServer) -> RedisStore {
    store_at(server.url())
}

fn store_at(url: String) -> RedisStore {
    RedisStore::builder(url).command_timeout(Duration::from_millis(500)).build().unwrap()
}

/// 64 tasks on 4 separate store handles (4 pools) hit one key: one action, one result.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_callers_on_four_handles_run_once() {
    let server = RedisServer::start();
    let run = unique("run");
    let handles: Vec<SharedStore> = (0..4).map(|_| Arc::new(store(&server)) as SharedStore).collect();
    let runs = Arc::new(AtomicU32::new(0));
    let barrier = Arc::new(Barrier::new(64));
    let mut tasks = Vec::new();
    for i in 0..64 {
        let ctx = RunContext::new(handles[i % 4].clone(), &run);
        let (runs, barrier) = (runs.clone(), barrier.clone());
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            ctx.step("charge")
                .on_in_flight(OnInFlight::Wait { timeout: Duration::from_secs(20) })
                .run(&("card", 4200), |a| async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    tokio::task::yield_now().await;
                    Ok::<_, Error>(format!("ch_{}", a.fence()))
                })
                .await
                .unwrap()
        }));
    }
    let mut results = Vec::new();
    for t in tasks {
        results.push(t.await.unwrap());
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    results.dedup();
    assert_eq!(results.len(), 1, "callers saw different results");
}

/// First execution: 2 commands (acquire, complete). Replay: 1. Counted by the server, and
/// neither a replay nor a first acquisition runs a script. After a run of replays a replay is a
/// plain `GET`, and a first execution the `GET` and the two. Scripts are called as functions
/// (`FCALL`), or by `EVALSHA` with functions off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_execution_costs_two_commands_and_replay_one() {
    let server = RedisServer::start();
    // The plain SET turned off, as on a server before Redis 7.0: each is one script.
    for (set_get, functions, first, replay) in [
        (true, true, &["set", "fcall"][..], &["set"][..]),
        (false, true, &["fcall", "fcall"][..], &["fcall"][..]),
        (true, false, &["set", "evalsha"][..], &["set"][..]),
    ] {
        let s = RedisStore::builder(server.url()).set_get_acquire(set_get).functions(functions).build().unwrap();
        // Open the connections, load the scripts and measure the clock first, so that none counts.
        s.warm_up().await.unwrap();
        let ctx = RunContext::new(s, unique("run"));
        let monitor = server.monitor();
        let _: u8 = ctx.step("s").heartbeat(false).run(&1, |_| async { Ok::<_, Error>(1) }).await.unwrap();
        assert_eq!(monitor.client_commands(), first, "first execution, SET NX GET {set_get}");
        let monitor = server.monitor();
        let _: u8 = ctx.step("s").run(&1, |_| async { Ok::<_, Error>(9) }).await.unwrap();
        assert_eq!(monitor.client_commands(), replay, "replay, SET NX GET {set_get}");

        // After replays in a row the store reads first: a replay is one plain GET, and a first
        // execution then costs the GET more (until first executions in a row switch it back).
        for _ in 0..16 {
            let _: u8 = ctx.step("s").run(&1, |_| async { Ok::<_, Error>(9) }).await.unwrap();
        }
        let monitor = server.monitor();
        let _: u8 = ctx.step("s").run(&1, |_| async { Ok::<_, Error>(9) }).await.unwrap();
        assert_eq!(monitor.client_commands(), ["get"], "replay read first, SET NX GET {set_get}");
        let monitor = server.monitor();
        let _: u8 = ctx.step("s").heartbeat(false).run(&2, |_| async { Ok::<_, Error>(2) }).await.unwrap();
        let read_first: Vec<&str> = std::iter::once("get").chain(first.iter().copied()).collect();
        assert_eq!(monitor.client_commands(), read_first, "first execution read first, SET NX GET {set_get}");
        for i in 3..19 {
            let _: u8 = ctx.step("s").heartbeat(false).run(&i, |_| async move { Ok::<_, Error>(i) }).await.unwrap();
        }
        let monitor = server.monitor();
        let _: u8 = ctx.step("s").heartbeat(false).run(&100, |_| async { Ok::<_, Error>(100) }).await.unwrap();
        assert_eq!(monitor.client_commands(), first, "write first again, SET NX GET {set_get}");
    }
}

/// Plain reads go out on one connection, so that many callers' reads share its socket writes;
/// script calls and writes take the store's other connections in turn. Seen by the server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_share_one_connection_and_writes_take_the_others_in_turn() {
    let server = RedisServer::start();
    let s = RedisStore::builder(server.url()).pool_size(4).build().unwrap();
    s.warm_up().await.unwrap();
    let state: State<Vec<String>> = State::new(s.clone(), Scope::new(unique("thread")));
    let ctx = RunContext::new(s, unique("run"));
    let _: u8 = ctx.step("s").run(&0, |_| async { Ok::<_, Error>(0) }).await.unwrap();
    // After replays in a row, acquire reads first: each call below starts with a GET.
    for _ in 0..16 {
        let _: u8 = ctx.step("s").run(&0, |_| async { Ok::<_, Error>(9) }).await.unwrap();
    }
    let monitor = server.monitor();
    for i in 1..=4u8 {
        let _: u8 = ctx.step("s").run(&0, |_| async { Ok::<_, Error>(9) }).await.unwrap();
        let _: u8 = ctx.step("s").heartbeat(false).run(&i, |_| async move { Ok::<_, Error>(i) }).await.unwrap();
    }
    // A state load is a plain read too.
    assert_eq!(state.load().await.unwrap().value, None);
    let seen = monitor.finish();
    let sources = |wanted: fn(&str) -> bool| -> std::collections::BTreeSet<&str> {
        seen.client.iter().zip(&seen.sources).filter(|(c, _)| wanted(c)).map(|(_, s)| s.as_str()).collect()
    };
    let reads = sources(|c| c == "get" || c == "hmget");
    let writes = sources(|c| c != "get" && c != "hmget");
    assert_eq!(seen.client.iter().filter(|c| *c == "get").count(), 8, "{:?}", seen.client);
    assert_eq!(seen.client.iter().filter(|c| *c == "hmget").count(), 1, "{:?}", seen.client);
    assert_eq!(reads.len(), 1, "the reads came on several connections: {reads:?} ({:?})", seen.client);
    // Four first executions: four SET NX GET and four complete calls, in turn over the other 3.
    assert_eq!(seen.client.len() - 9, 8, "{:?}", seen.client);
    assert_eq!(writes.len(), 3, "the writes did not take the other 3 connections in turn: {writes:?}");
    assert!(reads.is_disjoint(&writes), "a write went out on the reads' connection: {reads:?} {writes:?}");
}

/// Callers whose records are done (caller `i`'s result is `i * 7`), on a store that has replayed
/// enough in a row to read first.
async fn replaying(store: RedisStore, callers: u32) -> RunContext {
    let ctx = RunContext::new(store, unique("run"));
    for i in 0..callers {
        let _: u32 = ctx.step("s").run(&i, |_| async move { Ok::<_, Error>(i * 7) }).await.unwrap();
    }
    for _ in 0..16 {
        let _: u32 = ctx.step("s").run(&0, |_| async { Ok::<_, Error>(1) }).await.unwrap();
    }
    ctx
}

/// Starts the replays of `replaying`'s callers while the server is stopped. On a one-thread
/// runtime, when this returns every caller has run up to its read (sent, or waiting to go out):
/// each yields only there, and each of this task's yields lets the scheduler run up to a tick's
/// worth of the others (61 in tokio 1.54) before this one runs again; one yield per caller is
/// more than enough.
async fn replays_while_stopped(
    server: &RedisServer,
    ctx: &RunContext,
    callers: u32,
) -> Vec<tokio::task::JoinHandle<Result<u32, Error>>> {
    server.pause();
    let started = (0..callers)
        .map(|i| {
            let ctx = ctx.clone();
            tokio::spawn(async move {
                ctx.step("s").run(&i, |_| async { Err::<u32, _>(Error::Config("ran again".into())) }).await
            })
        })
        .collect();
    for _ in 0..callers {
        tokio::task::yield_now().await;
    }
    started
}

/// `callers` replays on a store of two connections from `builder`, all started while the server
/// is stopped (`replays_while_stopped`), so that their reads go out under load; each caller must
/// get its own record. Returns the commands `MONITOR` saw the replays send.
async fn replayed_together(server: &RedisServer, builder: RedisStoreBuilder, callers: u32) -> Monitored {
    let s = builder.pool_size(2).build().unwrap();
    s.warm_up().await.unwrap();
    let ctx = replaying(s, callers).await;
    let monitor = server.monitor();
    let started = replays_while_stopped(server, &ctx, callers).await;
    server.resume();
    for (i, caller) in (0..callers).zip(started) {
        assert_eq!(caller.await.expect("a caller panicked").unwrap(), i * 7, "caller {i} did not get its own record");
    }
    monitor.finish()
}

/// Under load, replays' reads wait for a read out to come back and go out together as one
/// `MGET`; each caller still gets its own record.
#[tokio::test(flavor = "current_thread")]
async fn reads_under_load_go_out_together_and_each_caller_gets_its_own_record() {
    const CALLERS: u32 = 100;
    let server = RedisServer::start();
    let seen = replayed_together(&server, RedisStore::builder(server.url()), CALLERS).await;
    let keys = |name: &str| -> Vec<usize> {
        seen.client.iter().zip(&seen.args).filter(|(c, _)| *c == name).map(|(_, n)| *n).collect()
    };
    let (gets, mgets) = (keys("get"), keys("mget"));
    assert_eq!(seen.client.len(), gets.len() + mgets.len(), "a replay sent more than reads: {:?}", seen.client);
    assert!(gets.iter().all(|n| *n == 1), "{gets:?}");
    assert!(
        mgets.iter().any(|n| *n > 1),
        "no read went out together with others: {} GETs, MGETs of {mgets:?} keys",
        gets.len()
    );
    assert_eq!(gets.len() + mgets.iter().sum::<usize>(), CALLERS as usize, "each caller's record is read once");
}

/// A command timeout too long to add to the clock (`Duration::MAX`, no bound in effect) is
/// taken by reads that wait to go out together as by every other call: no panic, each caller
/// its own record.
#[tokio::test(flavor = "current_thread")]
async fn waiting_reads_take_a_command_timeout_too_long_for_the_clock() {
    const CALLERS: u32 = 40;
    let server = RedisServer::start();
    let builder = RedisStore::builder(server.url()).command_timeout(Duration::MAX);
    let seen = replayed_together(&server, builder, CALLERS).await;
    assert!(seen.client.iter().any(|c| c == "mget"), "no read waited to go out together: {:?}", seen.client);
}

/// A caller that gives up while its read is out or waits holds up none of the others; and with
/// no answer at all, a read that waits fails within the command timeout like one that is out.
#[tokio::test(flavor = "current_thread")]
async fn reads_waiting_together_outlive_callers_that_give_up_and_fail_in_time() {
    const CALLERS: u32 = 100;
    let server = RedisServer::start();
    let s = RedisStore::builder(server.url()).pool_size(2).command_timeout(Duration::from_millis(300)).build().unwrap();
    s.warm_up().await.unwrap();
    let ctx = replaying(s, CALLERS).await;

    // Every third caller gives up: the first ones had their reads out, the later ones waited.
    let callers = replays_while_stopped(&server, &ctx, CALLERS).await;
    for caller in callers.iter().step_by(3) {
        caller.abort();
    }
    server.resume();
    for (i, caller) in (0..CALLERS).zip(callers) {
        match caller.await {
            Err(e) => assert!(i % 3 == 0 && e.is_cancelled(), "caller {i}: {e}"),
            Ok(res) => assert_eq!(res.unwrap(), i * 7, "caller {i} did not get its own record"),
        }
    }

    // No answer: every caller fails, those whose reads waited too, within the timeout's bound.
    let started = Instant::now();
    let callers = replays_while_stopped(&server, &ctx, CALLERS).await;
    for (i, caller) in (0..CALLERS).zip(callers) {
        let err = caller.await.unwrap().unwrap_err();
        assert!(err.is_store_failure(), "caller {i}: {err}");
    }
    let took = started.elapsed();
    server.resume();
    assert!(took < Duration::from_secs(3), "the callers took {took:?} to fail, far beyond the 300 ms timeout");
    let again: u32 = ctx.step("s").run(&5, |_| async { Ok::<_, Error>(0) }).await.unwrap();
    assert_eq!(again, 35, "after the outage the record replays");
}

/// A read out whose caller stops polling it holds up the reads waiting behind it for no longer
/// than half the command timeout: they then go out alone.
#[tokio::test(flavor = "current_thread")]
async fn waiting_reads_go_out_alone_when_the_reads_out_are_never_polled_again() {
    let server = RedisServer::start();
    let s = RedisStore::builder(server.url()).pool_size(2).command_timeout(Duration::from_millis(400)).build().unwrap();
    s.warm_up().await.unwrap();
    let ctx = replaying(s, 24).await;
    let replay = |i: u32| {
        let ctx = ctx.clone();
        async move { ctx.step("s").run(&i, |_| async { Err::<u32, _>(Error::Config("ran again".into())) }).await }
    };
    // Sixteen replays polled once (each sends its read) and then never again: their reads stay
    // counted as out, so the store is busy and every further read waits.
    let mut held: Vec<futures_util::future::LocalBoxFuture<'_, Result<u32, Error>>> =
        (0..16).map(|i| Box::pin(replay(i)) as _).collect();
    for f in &mut held {
        std::future::poll_fn(|cx| {
            assert!(f.as_mut().poll(cx).is_pending(), "a replay answered before its reply could arrive");
            std::task::Poll::Ready(())
        })
        .await;
    }
    let started = Instant::now();
    for i in 16..24 {
        assert_eq!(replay(i).await.unwrap(), i * 7, "caller {i} did not get its own record");
    }
    let took = started.elapsed();
    assert!(took >= Duration::from_millis(8 * 200), "the waiting reads did not wait: {took:?}");
    assert!(took < Duration::from_secs(8), "the waiting reads took {took:?}");
    drop(held);
}

/// An unreachable server fails the call closed within its timeout; when the server is back
/// (restarted, scripts flushed) calls work again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outage_fails_closed_within_the_timeout_then_recovers() {
    let mut server = RedisServer::start_with(RedisOptions { aof: true, ..Default::default() });
    let ctx = RunContext::new(store(&server), unique("run"));
    let runs = Arc::new(AtomicU32::new(0));
    let call = |step: &'static str| {
        let (ctx, runs) = (ctx.clone(), runs.clone());
        async move {
            ctx.step(step)
                .run(&1, |_| async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    Ok::<_, Error>(step.to_owned())
                })
                .await
        }
    };
    assert_eq!(call("before").await.unwrap(), "before");

    // Paused: the socket accepts but nothing answers, so only the timeout ends the call.
    server.pause();
    let started = Instant::now();
    let err = call("paused").await.unwrap_err();
    let took = started.elapsed();
    server.resume();
    assert!(matches!(err, Error::Timeout { op: "acquire", .. }), "{err}");
    assert!(took < Duration::from_secs(3), "the call took {took:?}, far beyond its 500 ms timeout");
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the action ran while the store was paused");

    // Killed: connections are refused or reset.
    server.kill();
    let err = call("down").await.unwrap_err();
    assert!(err.is_store_failure(), "{err}");
    assert!(err.to_string().contains("the action was not run"), "{err}");
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    // Restarted from its AOF: the completed record survived, and the scripts were forgotten
    // (NOSCRIPT is answered by reloading them).
    server.restart();
    let mut recovered = None;
    for _ in 0..50 {
        match call("before").await {
            Ok(v) => {
                recovered = Some(v);
                break;
            }
            Err(e) if e.is_store_failure() => tokio::time::sleep(Duration::from_millis(100)).await,
            Err(e) => panic!("{e}"),
        }
    }
    assert_eq!(recovered.as_deref(), Some("before"));
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the completed step ran again after the restart");
    server.cmd(&["SCRIPT", "FLUSH"]);
    server.cmd(&["FUNCTION", "FLUSH"]);
    assert_eq!(call("after-flush").await.unwrap(), "after-flush");
    assert_eq!(call("after-flush").await.unwrap(), "after-flush");
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

/// The preflight flags eviction policies and missing persistence, and passes a safe server;
/// `ensure` turns each finding into an error that names the setting and its fix, unless its
/// risk is accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preflight_reports_settings_that_break_the_guarantee() {
    let server = RedisServer::start();
    let s = store(&server);
    let report = s.preflight().await.unwrap();
    assert!(!report.is_ok());
    assert!(report.problems.iter().any(|p| p.to_string().contains("persistence is off")), "{report}");
    let err = report.ensure().unwrap_err();
    assert!(matches!(err, Error::UnsafeStore { .. }), "{err}");
    assert!(err.to_string().contains("CONFIG SET appendonly yes"), "{err}");
    s.preflight().await.unwrap().accept_risk(Risk::NoPersistence).ensure().unwrap();

    // Eviction on: ensure fails and names the setting, its value and the fix.
    server.cmd(&["CONFIG", "SET", "maxmemory-policy", "volatile-lru"]);
    let report = s.preflight().await.unwrap();
    assert!(report.problems.iter().any(|p| p.to_string().contains("maxmemory-policy is volatile-lru")), "{report}");
    let err = report.accept_risk(Risk::NoPersistence).ensure().unwrap_err().to_string();
    for part in ["maxmemory-policy is volatile-lru", "CONFIG SET maxmemory-policy noeviction", "Risk::Eviction"] {
        assert!(err.contains(part), "{part:?} missing from: {err}");
    }
    assert!(!err.contains("appendonly"), "an accepted risk failed ensure: {err}");
    // Accepted: it passes.
    let accepted = s.preflight().await.unwrap().accept_risk(Risk::NoPersistence).accept_risk(Risk::Eviction);
    assert!(accepted.ensure().is_ok());
    // Fixed as the messages say: it passes with nothing accepted.
    server.cmd(&["CONFIG", "SET", "maxmemory-policy", "noeviction"]);
    server.cmd(&["CONFIG", "SET", "appendonly", "yes"]);
    s.preflight().await.unwrap().ensure().unwrap();

    let safe = RedisServer::start_with(RedisOptions { aof: true, ..Default::default() });
    let report = store(&safe).preflight().await.unwrap();
    assert!(report.is_ok(), "{report}");
    report.ensure().unwrap();
}

/// Settings the store may not read (`CONFIG` refused, as on managed Redis) are unchecked, and
/// fail `ensure` until their risks are accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preflight_without_config_fails_until_the_risks_are_accepted() {
    let server = RedisServer::start_with(RedisOptions { aof: true, ..Default::default() });
    server.cmd(&["ACL", "SETUSER", "app", "on", ">s3cret", "~*", "+@all", "-config"]);
    let s = store_at(format!("redis://app:s3cret@127.0.0.1:{}", server.port()));
    let report = s.preflight().await.unwrap();
    assert_eq!((report.problems.len(), &report.unchecked[..]), (0, &[Risk::Eviction, Risk::NoPersistence][..]));
    let err = report.ensure().unwrap_err().to_string();
    assert!(err.contains("maxmemory-policy could not be read") && err.contains("Risk::Eviction"), "{err}");
    assert!(report.accept_risk(Risk::Eviction).accept_risk(Risk::NoPersistence).ensure().is_ok());
}

/// `warm_up` loads the library, one function per script; with functions off, every script is
/// its source behind the layout prelude, and the server knows it under the hash redis-rs
/// computed: `warm_up` loaded each, and `SCRIPT LOAD` of the same text agrees.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scripts_load_under_the_hash_the_store_sends() {
    let server = RedisServer::start();
    store(&server).warm_up().await.unwrap();
    let listed = format!("{:?}", server.cmd(&["FUNCTION", "LIST", "LIBRARYNAME", source::library_name()]));
    for function in
        ["acquire", "complete", "release", "renew", "abandon", "resolve", "read", "release_fenced", "delete"]
    {
        let name = format!("{}_{function}", source::library_name());
        assert!(listed.contains(&format!("\"{name}\"")), "{name} is not in {listed}");
    }
    assert!(listed.contains("no-writes"), "read is flagged no-writes: {listed}");
    assert_eq!(
        server.cmd(&["SCRIPT", "EXISTS", Script::new(source::COMPLETE).get_hash()]),
        Value::Array(vec![Value::Int(0)])
    );

    RedisStore::builder(server.url()).functions(false).build().unwrap().warm_up().await.unwrap();
    for script in source::ALL {
        let hash = Script::new(script).get_hash().to_owned();
        assert_eq!(server.cmd(&["SCRIPT", "EXISTS", &hash]), Value::Array(vec![Value::Int(1)]));
        assert_eq!(server.cmd(&["SCRIPT", "LOAD", script]), Value::BulkString(hash.into_bytes()));
    }
}

/// A record this crate did not write is reported as corrupt: no panic, no replay of garbage,
/// the action does not run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_records_are_errors_not_replays() {
    let server = RedisServer::start();
    let s = store(&server);
    // So that every acquire below reads the garbage with SET NX GET; the scripts-only store
    // below reads it with the acquire script.
    s.warm_up().await.unwrap();
    let ctx = RunContext::new(s.clone(), unique("run"));
    let runs = AtomicU32::new(0);
    let (key, fp) = ctx.step("g").key_for(&1).unwrap();
    let redis_key = s.redis_key(&key);
    let fp = fp.to_hex();
    let token = "t".repeat(32);
    let record = |state: &str, tail: &str| format!("{state}{fp}{token}{tail}");
    let tail = layout::OLD_RUNNING_LEN - layout::LEASE.start;
    let (exploded, short, bad_result) =
        (record("Q", &"0".repeat(tail)), record("R", "123"), record("D", "\u{1}garbage"));
    // A done record cut short inside its token, before any result.
    let short_done = format!("D{fp}{}", &token[..10]);
    // Numbers Lua's `tonumber` would take but the record never holds.
    let (lease, fence, attempt) = (layout::LEASE.len(), layout::FENCE.len(), layout::ATTEMPT.len());
    let (bad_lease, nan_fence, inf_lease, exp_fence, huge_fence) = (
        record("R", &format!("{}{:0fence$}{:0attempt$}0", "x".repeat(lease), 1, 1)),
        record("R", &format!("{:0lease$}{:>fence$}{:0attempt$}0", 1, "nan", 1)),
        record("R", &format!("{:>lease$}{:0fence$}{:0attempt$}0", "inf", 1, 1)),
        record("R", &format!("{:0lease$}{:>fence$}{:0attempt$}0", 1, "1e18", 1)),
        record("R", &format!("{:0lease$}{:0fence$}{:0attempt$}0", 1, layout::MAX_FENCE, 1)),
    );
    let garbage: [&[&str]; 12] = [
        &["SET", &redis_key, "not a record"],
        &["HSET", &redis_key, "st", "running", "fp", &fp],
        &["RPUSH", &redis_key, "a list"],
        &["SET", &redis_key, &exploded],
        &["SET", &redis_key, &short],
        &["SET", &redis_key, &bad_lease],
        &["SET", &redis_key, &nan_fence],
        &["SET", &redis_key, &inf_lease],
        &["SET", &redis_key, &exp_fence],
        &["SET", &redis_key, &huge_fence],
        &["SET", &redis_key, &bad_result],
        &["SET", &redis_key, &short_done],
    ];
    let scripts =
        RunContext::new(RedisStore::builder(server.url()).set_get_acquire(false).build().unwrap(), ctx.run_id());
    for (how, c) in [("SET NX GET", &ctx), ("script", &scripts)] {
        for cmd in garbage {
            server.cmd(&["DEL", &redis_key]);
            server.cmd(cmd);
            let err = c
                .step("g")
                .run(&1, |_| async {
                    runs.fetch_add(1, Ordering::SeqCst);
                    Ok::<u32, Error>(1)
                })
                .await
                .unwrap_err();
            assert!(matches!(err, Error::Corrupt { .. } | Error::Decode { .. }), "{how}, {cmd:?}: {err}");
        }
    }
    // A stored result of the wrong type is a decode error that says what to do.
    server.cmd(&["DEL", &redis_key]);
    let _: String = ctx.step("g").run(&1, |_| async { Ok::<_, Error>("text".to_string()) }).await.unwrap();
    let err = ctx.step("g").run(&1, |_| async { Ok::<u32, Error>(1) }).await.unwrap_err();
    assert!(matches!(err, Error::Decode { .. }) && err.to_string().contains("bump the step version"), "{err}");
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    assert!(matches!(server.cmd(&["TYPE", &redis_key]), Value::SimpleString(t) if t == "string"));
}

/// ACL users and passwords in the URL work; a wrong password is a clear store error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acl_credentials_in_the_url() {
    let server = RedisServer::start();
    server.cmd(&["ACL", "SETUSER", "worker", "on", ">s3cret", "~idem:*", "+@all"]);
    let url = format!("redis://worker:s3cret@127.0.0.1:{}", server.port());
    let ctx = RunContext::new(RedisStore::connect(&url).unwrap(), unique("run"));
    let v: u8 = ctx.step("acl").run(&1, |_| async { Ok::<_, Error>(5) }).await.unwrap();
    assert_eq!(v, 5);
    let bad = format!("redis://worker:wrong@127.0.0.1:{}", server.port());
    let store = RedisStore::builder(bad).command_timeout(Duration::from_millis(500)).build().unwrap();
    let err = RunContext::new(store, "r").step("acl").run(&1, |_| async { Ok::<u8, Error>(1) }).await.unwrap_err();
    assert!(err.is_store_failure(), "{err}");
    assert!(!err.to_string().contains("wrong"), "the password leaked into the error: {err}");
}

/// `rediss://` URLs connect over TLS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_url_connects_over_tls() {
    let server = RedisServer::start_with(RedisOptions { tls: true, ..Default::default() });
    let url = server.tls_url().unwrap();
    let store = RedisStore::builder(&url).command_timeout(Duration::from_secs(2)).build().unwrap();
    let ctx = RunContext::new(store, unique("run"));
    let v: u8 = ctx.step("tls").run(&1, |_| async { Ok::<_, Error>(3) }).await.unwrap();
    assert_eq!(v, 3);
    let again: u8 = ctx.step("tls").run(&1, |_| async { Ok::<_, Error>(4) }).await.unwrap();
    assert_eq!(again, 3);
    // Plain text to the TLS port is not a Redis conversation: a clear store error, no panic.
    let plain = url.replace("rediss://", "redis://").replace("/#insecure", "");
    let store = RedisStore::builder(plain).command_timeout(Duration::from_millis(500)).build().unwrap();
    let err = RunContext::new(store, "r").step("tls").run(&1, |_| async { Ok::<u8, Error>(1) }).await.unwrap_err();
    assert!(err.is_store_failure(), "{err}");
}

/// The scripts are idempotent per owner token: a late duplicate of an acquire (its first reply
/// was lost, the call retried, the owner already released) changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_duplicate_acquire_changes_nothing() {
    let server = RedisServer::start();
    let mut conn = server.connection();
    let (acquire, release) = (Script::new(source::ACQUIRE), Script::new(source::RELEASE));
    let key = "idem:late-duplicate";
    let (fp, token_1, token_2) = ("f".repeat(64), "1".repeat(32), "2".repeat(32));
    // acquire.lua's one argument: fingerprint, token, lease and retention, then no labels.
    let (lease, retention) = (layout::ARG_LEASE.len(), layout::ARG_RETENTION.len());
    let args = |token: &str| format!("{fp}{token}{:0lease$}{:0retention$}{}", 60_000, 60_000, layout::NO_LABELS);
    let first: Vec<i64> = acquire.key(key).arg(args(&token_1)).invoke(&mut conn).unwrap();
    assert_eq!((first[0], first[2]), (1, 1));
    let again: Vec<i64> = acquire.key(key).arg(args(&token_1)).invoke(&mut conn).unwrap();
    assert_eq!(again, first, "a retried acquire answers as the first did");
    let released: i64 = release.key(key).arg(&token_1).invoke(&mut conn).unwrap();
    assert_eq!(released, 1);
    let late: Vec<i64> = acquire.key(key).arg(args(&token_1)).invoke(&mut conn).unwrap();
    assert_eq!(late[1], first[1], "the late duplicate took a new fence");
    let record: String = idempotent_core::redis::cmd("GET").arg(key).query(&mut conn).unwrap();
    assert!(record.starts_with('X'), "the late duplicate took the key: {record}");
    // The next real owner is not told a crash happened.
    let next: Vec<i64> = acquire.key(key).arg(args(&token_2)).invoke(&mut conn).unwrap();
    assert_eq!((next[0], next[2], next[3]), (1, 2, 0));
    assert!(next[1] > first[1]);
}

/// A store on the application's own pool leaves connections to the application and serves a
/// burst of first calls larger than the pool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn from_pool_shares_the_pool_with_the_application() {
    let server = RedisServer::start();
    let pool = idempotent_core::deadpool_redis::Config::from_url(server.url())
        .builder()
        .unwrap()
        .max_size(4)
        .wait_timeout(Some(Duration::from_secs(1)))
        .runtime(idempotent_core::deadpool_redis::Runtime::Tokio1)
        .build()
        .unwrap();
    let store = RedisStore::from_pool(pool.clone(), "app:idem:", Duration::from_secs(2));
    let ctx = RunContext::new(store, unique("run"));
    let mut tasks = Vec::new();
    for i in 0..16 {
        let ctx = ctx.clone();
        tasks.push(tokio::spawn(async move { ctx.step("s").run(&i, |_| async move { Ok::<_, Error>(i) }).await }));
    }
    for (i, t) in tasks.into_iter().enumerate() {
        assert_eq!(t.await.unwrap().unwrap(), i);
    }
    // The application still gets connections from its pool.
    let mut mine = Vec::new();
    for _ in 0..2 {
        mine.push(pool.get().await.expect("the store took the whole pool"));
    }
    let pong: String = idempotent_core::redis::cmd("PING").query_async(&mut *mine[0]).await.unwrap();
    assert_eq!(pong, "PONG");
    let keys: Vec<String> =
        idempotent_core::redis::cmd("KEYS").arg("app:idem:*").query_async(&mut *mine[1]).await.unwrap();
    assert_eq!(keys.len(), 16);
}

/// A key taken by `SET NX` (which cannot read the server's clock) gets a fence from the
/// process's monotonic clock plus the measured offset: close to the server's `TIME` in
/// microseconds (without the offset it would be microseconds since the process started), like
/// a fence the acquire script gives, so a key's fences keep growing when its record is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fences_of_new_keys_follow_the_servers_clock() {
    let server = RedisServer::start();
    let server_micros = || match server.cmd(&["TIME"]) {
        Value::Array(parts) => {
            let n = |v: &Value| match v {
                Value::BulkString(b) => std::str::from_utf8(b).unwrap().parse::<u64>().unwrap(),
                other => panic!("TIME answered {other:?}"),
            };
            n(&parts[0]) * 1_000_000 + n(&parts[1])
        }
        other => panic!("TIME answered {other:?}"),
    };
    let s = store(&server);
    s.warm_up().await.unwrap();
    let plain = RunContext::new(s, unique("run"));
    let scripts =
        RunContext::new(RedisStore::builder(server.url()).set_get_acquire(false).build().unwrap(), plain.run_id());
    let fence = |ctx: &RunContext, step: &'static str| {
        let ctx = ctx.clone();
        async move { ctx.step(step).run(&(), |a| async move { Ok::<_, Error>(a.fence()) }).await.unwrap() }
    };
    let before = server_micros();
    let a = fence(&plain, "a").await;
    let b = fence(&scripts, "b").await;
    let c = fence(&plain, "c").await;
    let after = server_micros();
    // Within a second of the server's clock (the offset is measured to half a round trip).
    for f in [a, b, c] {
        assert!(
            f + 1_000_000 > before && f < after + 1_000_000,
            "fence {f} is not near the server's clock {before}..{after}"
        );
    }
    assert!(a < c, "fences of new keys went backwards: {a}, then {c}");
    // Their completions are stamped near the server's clock (by the client's estimate where it
    // has one, else by the script's `TIME`), never before the record's creation.
    let near = |t: std::time::SystemTime| {
        let us = t.duration_since(std::time::UNIX_EPOCH).unwrap().as_micros() as u64;
        us + 1_000_000 > before && us < after + 1_000_000
    };
    for (ctx, step) in [(&plain, "a"), (&scripts, "b"), (&plain, "c")] {
        let (key, _) = ctx.step(step).key_for(&()).unwrap();
        let done = ctx.store().inspect(&key).await.unwrap().unwrap();
        assert_eq!(done.state, RecordState::Done, "{step}");
        assert!(near(done.updated), "{step}: completed at {:?}, not near the server's clock", done.updated);
        assert!(done.updated >= done.created, "{step}: completed at {:?}, before {:?}", done.updated, done.created);
    }
}

/// `complete` stamps the done record with the update time it is given (the client's estimate of
/// the server's clock), never before the record's last change, and reads `TIME` when given none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn complete_stamps_the_time_it_is_given_never_before_the_last_change() {
    let server = RedisServer::start();
    let s = store(&server);
    let (fp, minute) = (Fingerprint::from_bytes([3; 32]), Duration::from_secs(60));
    let ms = |t: std::time::SystemTime| t.duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64;
    // (the time given, relative to the record's last change; None: an empty argument)
    for given in [Some(5_000i64), Some(-1_000_000_000), None] {
        let (key, redis_key) = fresh(&s);
        let Acquire::Acquired(grant) = s.acquire(&key, &fp, minute, minute).await.unwrap() else {
            panic!("a fresh key was not acquired")
        };
        let running = s.inspect(&key).await.unwrap().unwrap();
        let last = ms(running.updated);
        let arg = given.map_or(String::new(), |d| format!("{:015}", (last as i64 + d).max(0)));
        let before = ms(std::time::SystemTime::now());
        let completed: i64 = Script::new(source::COMPLETE)
            .key(&redis_key)
            .arg(grant.token.as_str())
            .arg("o1")
            .arg(60_000)
            .arg(&arg)
            .invoke(&mut server.connection())
            .unwrap();
        assert_eq!(completed, 1, "{given:?}");
        let done = s.inspect(&key).await.unwrap().unwrap();
        assert_eq!((done.state, done.created), (RecordState::Done, running.created), "{given:?}");
        match given {
            Some(5_000) => assert_eq!(ms(done.updated), last + 5_000, "the time given"),
            Some(_) => assert_eq!(ms(done.updated), last, "a time before the last change"),
            // The server's clock: the test and the server share this machine's wall clock.
            None => assert!(ms(done.updated).abs_diff(before) < 2_000, "TIME: {:?}", done.updated),
        }
    }
}

/// The store falls back to the acquire script when the server answers `SET … NX GET` with a
/// syntax error (Redis before 7.0 answers exactly that; 7.0 answers it for `NX XX`): this pins
/// that redis-rs shows the server's words, which the store looks for.
#[test]
fn a_refused_set_reads_as_a_syntax_error() {
    let server = RedisServer::start();
    let err = idempotent_core::redis::cmd("SET")
        .arg("k")
        .arg("v")
        .arg("NX")
        .arg("XX")
        .query::<Value>(&mut server.connection())
        .unwrap_err();
    assert!(err.to_string().contains("syntax error"), "{err}");
}

/// A fresh key of its own, and the Redis key `store` keeps its record under.
fn fresh(store: &RedisStore) -> (Key, String) {
    let key = Key::derive(&KeyScope::new(unique("run"), "step"), &()).unwrap();
    let redis_key = store.redis_key(&key);
    (key, redis_key)
}

fn pttl(server: &RedisServer, redis_key: &str) -> i64 {
    match server.cmd(&["PTTL", redis_key]) {
        Value::Int(ms) => ms,
        other => panic!("PTTL answered {other:?}"),
    }
}

fn record_of(server: &RedisServer, redis_key: &str) -> Vec<u8> {
    match server.cmd(&["GET", redis_key]) {
        Value::BulkString(record) => record,
        other => panic!("GET answered {other:?}"),
    }
}

/// A record marked needs-attention loses its TTL (it waits to be resolved, however long that
/// takes); an uncertain release keeps the TTL, as a release does; resolving gives the record the
/// TTL it asks for. The recovered byte of a released record says how it was released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn needs_attention_has_no_ttl_until_resolved() {
    let server = RedisServer::start();
    let s = store(&server);
    s.warm_up().await.unwrap();
    let (key, redis_key) = fresh(&s);
    let (fp, minute) = (Fingerprint::from_bytes([7; 32]), Duration::from_secs(60));
    let grant = |answer: Acquire| match answer {
        Acquire::Acquired(grant) => grant,
        other => panic!("expected Acquired, got {other:?}"),
    };

    let first = grant(s.acquire(&key, &fp, minute, minute).await.unwrap());
    assert!((1..=60_000).contains(&pttl(&server, &redis_key)));
    assert_eq!(s.abandon(&key, &first.token, Abandon::NeedsAttention).await.unwrap(), Transition::Ok);
    assert_eq!(pttl(&server, &redis_key), -1, "a record that needs attention must not expire");
    assert_eq!(record_of(&server, &redis_key)[layout::STATE], layout::NEEDS_ATTENTION);
    assert_eq!(s.abandon(&key, &first.token, Abandon::NeedsAttention).await.unwrap(), Transition::Ok);
    assert_eq!(pttl(&server, &redis_key), -1, "a retried mark");

    assert_eq!(s.resolve(&key, Resolution::NotDone).await.unwrap(), Resolved::Ok);
    let keep = KEEP_RESOLVED_RELEASE.as_millis() as i64;
    assert!((keep - 60_000..=keep).contains(&pttl(&server, &redis_key)), "kept for KEEP_RESOLVED_RELEASE");
    let released = record_of(&server, &redis_key);
    assert_eq!((released[layout::STATE], released[layout::RECOVERED]), (layout::RELEASED, b'0'));

    let second = grant(s.acquire(&key, &fp, minute, minute).await.unwrap());
    assert_eq!((second.attempt.number(), second.attempt.recovered()), (2, false));
    let before = pttl(&server, &redis_key);
    assert_eq!(s.abandon(&key, &second.token, Abandon::Uncertain).await.unwrap(), Transition::Ok);
    let after = pttl(&server, &redis_key);
    assert!(after > 0 && after <= before, "an uncertain release keeps the TTL: {before} then {after}");
    let uncertain = record_of(&server, &redis_key);
    assert_eq!((uncertain[layout::STATE], uncertain[layout::RECOVERED]), (layout::RELEASED, b'1'));
    // A clean release by the same token is another transition: refused, and the mark stays.
    assert_eq!(s.release(&key, &second.token).await.unwrap(), Transition::LeaseLost);
    assert_eq!(record_of(&server, &redis_key), uncertain);

    let third = grant(s.acquire(&key, &fp, minute, minute).await.unwrap());
    assert_eq!((third.attempt.number(), third.attempt.recovered()), (3, true));
    assert_eq!(s.abandon(&key, &third.token, Abandon::NeedsAttention).await.unwrap(), Transition::Ok);
    let done = Resolution::Done { outcome: Bytes::from_static(b"settled"), retention: Duration::from_secs(5) };
    assert_eq!(s.resolve(&key, done).await.unwrap(), Resolved::Ok);
    assert!((1..=5_000).contains(&pttl(&server, &redis_key)), "kept for the given retention");
    assert_eq!(s.acquire(&key, &fp, minute, minute).await.unwrap(), Acquire::Replay(Bytes::from_static(b"settled")));
}

/// A server that refuses functions gets the scripts by `EVALSHA`: here ACL users, as on managed
/// servers that disable functions (before Redis 7.0 the commands are unknown). One may not run
/// `FCALL` (the first call is refused), one may not run `FUNCTION LOAD` (the first call finds no
/// function and its load is refused). Each pass starts with the server's scripts flushed: without
/// `warm_up` the `EVALSHA` then meets `NOSCRIPT` and loads its script; with it, `warm_up` loaded
/// the scripts. Either way the store notices once, and every later call is `EVALSHA`; results and
/// the action's single run are as with functions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_refusing_functions_gets_evalsha() {
    let server = RedisServer::start();
    server.cmd(&[
        "ACL",
        "SETUSER",
        "nofcall",
        "on",
        ">s3cret",
        "~*",
        "&*",
        "+@all",
        "-fcall",
        "-fcall_ro",
        "-function",
    ]);
    server.cmd(&["ACL", "SETUSER", "noload", "on", ">s3cret", "~*", "&*", "+@all", "-function"]);
    for user in ["nofcall", "noload"] {
        let url = format!("redis://{user}:s3cret@127.0.0.1:{}", server.port());
        for warm in [false, true] {
            server.cmd(&["SCRIPT", "FLUSH"]);
            let s = store_at(url.clone());
            if warm {
                s.warm_up().await.unwrap();
            }
            let ctx = RunContext::new(s, unique("run"));
            let runs = Arc::new(AtomicU32::new(0));
            for _ in 0..2 {
                let runs = runs.clone();
                let got: u8 = ctx
                    .step("s")
                    .run(&1, |_| async move {
                        runs.fetch_add(1, Ordering::SeqCst);
                        Ok::<_, Error>(7)
                    })
                    .await
                    .unwrap();
                assert_eq!(got, 7, "{user}, warm_up {warm}");
            }
            assert_eq!(runs.load(Ordering::SeqCst), 1, "{user}, warm_up {warm}");
            let monitor = server.monitor();
            let _: u8 = ctx.step("s").heartbeat(false).run(&2, |_| async { Ok::<_, Error>(2) }).await.unwrap();
            // The acquire is `SET NX` once the store's background measure of the server's clock
            // has landed (`warm_up` makes it; without it, the first acquire starts it, and a busy
            // machine can still be waiting), else the acquire script: either way every script
            // goes by `EVALSHA`.
            // Only the call's own commands: on a loaded machine the store's background measure
            // of the clock (`TIME`, started by the first acquire when not warmed up) can still
            // run in this window, and a connection opened in it authenticates first (`AUTH`; the
            // store reopens its connections after a call timed out). Both seen in full test
            // runs: `time, evalsha, time, time, evalsha` and `auth, auth, evalsha, evalsha`.
            let sent: Vec<String> =
                monitor.client_commands().into_iter().filter(|c| c != "auth" && c != "time").collect();
            assert!(
                matches!(sent.as_slice(), [first, second] if (first == "set" || first == "evalsha") && second == "evalsha"),
                "{user}, warm_up {warm}: {sent:?}"
            );
            if warm {
                assert_eq!(sent, ["set", "evalsha"], "{user}: warm_up measured the clock");
            }
        }
    }
    assert_eq!(
        server.cmd(&["FUNCTION", "LIST", "LIBRARYNAME", source::library_name()]),
        Value::Array(vec![]),
        "the library was loaded by a user who may not"
    );
}

/// The library lost (`FUNCTION FLUSH`, as after a restart without persistence) is loaded again
/// also on the path that pipelines a `WAIT` behind each write: the calls go on, each action
/// runs once, and the replica has the library too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn functions_lost_under_wait_for_replicas_are_loaded_again() {
    let server = RedisServer::start();
    let replica = RedisServer::replica_of(&server);
    let s = RedisStore::builder(server.url())
        .command_timeout(Duration::from_secs(2))
        .wait_for_replicas(1, Duration::from_millis(500))
        .build()
        .unwrap();
    s.warm_up().await.unwrap();
    let ctx = RunContext::new(s, unique("run"));
    let runs = Arc::new(AtomicU32::new(0));
    for i in 0..3u8 {
        server.cmd(&["FUNCTION", "FLUSH"]);
        for _ in 0..2 {
            let runs = runs.clone();
            let got: u8 = ctx
                .step("s")
                .run(&i, |_| async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    Ok::<_, Error>(i)
                })
                .await
                .unwrap();
            assert_eq!(got, i);
        }
    }
    assert_eq!(runs.load(Ordering::SeqCst), 3);
    let listed = format!("{:?}", replica.cmd(&["FUNCTION", "LIST", "LIBRARYNAME", source::library_name()]));
    assert!(
        listed.contains(&format!("{}_complete", source::library_name())),
        "the replica lacks the library: {listed}"
    );
}

/// A needs-attention record (written by hand, so that its attempt and fence are known) is
/// answered alike by `SET NX GET`, which reads it in Rust without a script, and by the acquire
/// script, for the record's own token too; nothing changes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn needs_attention_reads_alike_on_both_acquire_paths() {
    let server = RedisServer::start();
    let plain = store(&server);
    plain.warm_up().await.unwrap();
    let scripts = RedisStore::builder(server.url()).set_get_acquire(false).build().unwrap();
    scripts.warm_up().await.unwrap();
    let (key, redis_key) = fresh(&plain);
    let (fp, other_fp) = (Fingerprint::from_bytes([3; 32]), Fingerprint::from_bytes([4; 32]));
    let (token, fence, attempt) = ("a".repeat(32), 4_503_599_627_370_497_u64, 7_u32);
    let (lease, fence_len, attempt_len) = (layout::LEASE.len(), layout::FENCE.len(), layout::ATTEMPT.len());
    let record = format!("A{}{token}{:0lease$}{fence:0fence_len$}{attempt:0attempt_len$}0", fp.to_hex(), 12);
    assert_eq!(record.len(), layout::OLD_RUNNING_LEN, "a needs-attention record as an earlier release wrote it");
    server.cmd(&["SET", &redis_key, &record]);

    let minute = Duration::from_secs(60);
    let waiting = Acquire::NeedsAttention { attempt, fence };
    for (how, s, sent) in [("SET NX GET", &plain, "set"), ("script", &scripts, "fcall")] {
        let monitor = server.monitor();
        assert_eq!(s.acquire(&key, &fp, minute, minute).await.unwrap(), waiting, "{how}");
        assert_eq!(s.acquire(&key, &other_fp, minute, minute).await.unwrap(), Acquire::Mismatch, "{how}");
        assert_eq!(monitor.client_commands(), [sent, sent], "{how}: one command per acquire");
    }
    // The record's own token (a late duplicate of the acquire that took it) is answered alike.
    let (arg_lease, arg_retention) = (layout::ARG_LEASE.len(), layout::ARG_RETENTION.len());
    let args = format!("{}{token}{:0arg_lease$}{:0arg_retention$}{}", fp.to_hex(), 60_000, 60_000, layout::NO_LABELS);
    let own: Vec<i64> =
        Script::new(source::ACQUIRE).key(&redis_key).arg(args).invoke(&mut server.connection()).unwrap();
    assert_eq!(own, [5, i64::from(attempt), fence as i64]);
    assert_eq!(String::from_utf8(record_of(&server, &redis_key)).unwrap(), record, "an acquire changed the record");
    assert_eq!(pttl(&server, &redis_key), -1);
}

/// A needs-attention record this crate did not write (cut short, a malformed number, a fence
/// beyond 2^53) is reported as corrupt by both acquire paths and by resolve, and left as it is;
/// so is any key resolve finds holding something that is not a record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupt_needs_attention_records_are_errors() {
    let server = RedisServer::start();
    let plain = store(&server);
    plain.warm_up().await.unwrap();
    let scripts = RedisStore::builder(server.url()).set_get_acquire(false).build().unwrap();
    let (key, redis_key) = fresh(&plain);
    let fp = Fingerprint::from_bytes([5; 32]);
    let head = format!("A{}{}", fp.to_hex(), "a".repeat(32));
    let (lease, fence, attempt) = (layout::LEASE.len(), layout::FENCE.len(), layout::ATTEMPT.len());
    let records = [
        format!("{head}123"),
        format!("{head}{:0lease$}{:>fence$}{:0attempt$}0", 1, "nan", 1),
        format!("{head}{:0lease$}{:0fence$}{:>attempt$}0", 1, 1, "x"),
        format!("{head}{:0lease$}{:0fence$}{:0attempt$}0", 1, layout::MAX_FENCE, 1),
    ];
    let minute = Duration::from_secs(60);
    for record in &records {
        server.cmd(&["SET", &redis_key, record]);
        for (how, s) in [("SET NX GET", &plain), ("script", &scripts)] {
            let err = s.acquire(&key, &fp, minute, minute).await.unwrap_err();
            assert!(matches!(err, Error::Corrupt { .. }), "{how}, {record}: {err}");
        }
        for resolution in [Resolution::NotDone, Resolution::Done { outcome: Bytes::new(), retention: minute }] {
            let err = plain.resolve(&key, resolution).await.unwrap_err();
            assert!(matches!(err, Error::Corrupt { .. }), "resolve, {record}: {err}");
        }
        assert_eq!(&String::from_utf8(record_of(&server, &redis_key)).unwrap(), record);
    }
    for garbage in [&["SET", &redis_key, "not a record"][..], &["HSET", &redis_key, "st", "A"]] {
        server.cmd(&["DEL", &redis_key]);
        server.cmd(garbage);
        let err = plain.resolve(&key, Resolution::NotDone).await.unwrap_err();
        assert!(matches!(err, Error::Corrupt { .. }), "resolve, {garbage:?}: {err}");
    }
}

/// A transition repeated by its own token (a retry after a lost reply) changes nothing, but
/// writes the record again as it is, TTL kept: so the repeat replicates, and a `WAIT` behind it
/// on a fresh connection covers the write instead of counting only that connection's history.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeated_transitions_write_the_record_again_unchanged() {
    use idempotent_core::record::Grant;
    let server = RedisServer::start();
    let store = store(&server);
    store.warm_up().await.unwrap();
    let minute = Duration::from_secs(60);
    let fp = Fingerprint::from_bytes([3; 32]);
    for ending in ["complete", "abandon"] {
        let (key, redis_key) = fresh(&store);
        let Acquire::Acquired(Grant { token, .. }) = store.acquire(&key, &fp, minute, minute).await.unwrap() else {
            panic!("a fresh key")
        };
        let end = |store: &RedisStore| {
            let (key, token) = (key, token.clone());
            let store = store.clone();
            async move {
                match ending {
                    "complete" => store.complete(&key, &token, Bytes::from_static(b"r"), minute).await.unwrap(),
                    _ => store.abandon(&key, &token, Abandon::Uncertain).await.unwrap(),
                }
            }
        };
        assert_eq!(end(&store).await, Transition::Ok);
        let (before, ttl) = (record_of(&server, &redis_key), pttl(&server, &redis_key));
        let monitor = server.monitor();
        assert_eq!(end(&store).await, Transition::Ok, "{ending}: the repeat is acknowledged");
        let seen = monitor.finish();
        assert_eq!(seen.client, ["fcall"], "{ending}");
        assert!(seen.script.iter().any(|c| c == "set"), "{ending}: the repeat writes the record again: {seen:?}");
        assert_eq!(record_of(&server, &redis_key), before, "{ending}: unchanged");
        let after = pttl(&server, &redis_key);
        assert!(after <= ttl && after > ttl - 5_000, "{ending}: the TTL is kept ({ttl} ms, then {after} ms)");
    }
}

/// Records an earlier release wrote (running, released and needs-attention records of
/// `OLD_RUNNING_LEN` bytes without times or labels; done records `D` with the result right after
/// the token) are still read: replayed, acquired, completed and inspected, on both acquire paths.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_an_earlier_release_wrote_are_still_read() {
    let server = RedisServer::start();
    let plain = store(&server);
    plain.warm_up().await.unwrap();
    let scripts = RedisStore::builder(server.url()).set_get_acquire(false).build().unwrap();
    let minute = Duration::from_secs(60);
    let fp = Fingerprint::from_bytes([6; 32]);
    let (lease, fence_len, attempt_len) = (layout::LEASE.len(), layout::FENCE.len(), layout::ATTEMPT.len());
    let old_running = |state: char, deadline: u64, fence: u64, attempt: u32| {
        let token = "t".repeat(32);
        format!("{state}{}{token}{deadline:0lease$}{fence:0fence_len$}{attempt:0attempt_len$}0", fp.to_hex())
    };
    for (how, s) in [("SET NX GET", &plain), ("script", &scripts)] {
        // Done: replayed, and inspected with what it holds (no fence, attempt, times or labels).
        let (key, redis_key) = fresh(s);
        server.cmd(&["SET", &redis_key, &format!("D{}{}o\"old\"", fp.to_hex(), "t".repeat(32)), "PX", "60000"]);
        assert_eq!(s.acquire(&key, &fp, minute, minute).await.unwrap(), Acquire::Replay(Bytes::from("o\"old\"")));
        let done = s.inspect(&key).await.unwrap().unwrap();
        assert_eq!((done.state, done.result_bytes, done.attempt, done.fence), (RecordState::Done, Some(6), 0, 0));
        assert_eq!((done.step.as_str(), done.created), ("", std::time::UNIX_EPOCH), "{how}");

        // Running, its lease passed: the next acquisition is recovered, fenced higher, and
        // writes this release's layout with its labels.
        let (key, redis_key) = fresh(s);
        server.cmd(&["SET", &redis_key, &old_running('R', 0, 1000, 3), "PX", "60000"]);
        let stuck = s.inspect(&key).await.unwrap().unwrap();
        assert_eq!((stuck.state, stuck.attempt, stuck.fence), (RecordState::Stuck, 3, 1000), "{how}");
        let labels = Labels::step("upgraded").run("r1");
        let grant = match s.acquire_labeled(&key, &fp, minute, minute, labels).await.unwrap() {
            Acquire::Acquired(grant) => grant,
            other => panic!("{how}: {other:?}"),
        };
        assert_eq!((grant.attempt.number(), grant.attempt.recovered()), (4, true), "{how}");
        assert!(grant.attempt.fence() > 1000);
        let running = s.inspect(&key).await.unwrap().unwrap();
        assert_eq!(
            (running.state, running.step.as_str(), running.run.as_deref()),
            (RecordState::Running, "upgraded", Some("r1"))
        );
        assert_eq!(running.created, std::time::UNIX_EPOCH, "{how}: the record's creation is unknown");
        assert_eq!(s.complete(&key, &grant.token, Bytes::from_static(b"new"), minute).await.unwrap(), Transition::Ok);
        assert_eq!(s.acquire(&key, &fp, minute, minute).await.unwrap(), Acquire::Replay(Bytes::from_static(b"new")));

        // Running, live, completed by its (earlier release's) holder through the script.
        let (key, redis_key) = fresh(s);
        server.cmd(&["SET", &redis_key, &old_running('R', u64::from(u32::MAX) * 1000, 77, 2), "PX", "60000"]);
        assert!(matches!(s.acquire(&key, &fp, minute, minute).await.unwrap(), Acquire::InFlight { .. }), "{how}");
        let completed: i64 = Script::new(source::COMPLETE)
            .key(&redis_key)
            .arg("t".repeat(32))
            .arg("done")
            .arg(60_000)
            .invoke(&mut server.connection())
            .unwrap();
        assert_eq!(completed, 1);
        assert_eq!(s.acquire(&key, &fp, minute, minute).await.unwrap(), Acquire::Replay(Bytes::from_static(b"done")));
        let done = s.inspect(&key).await.unwrap().unwrap();
        assert_eq!(
            (done.state, done.attempt, done.fence, done.result_bytes),
            (RecordState::Done, 2, 77, Some(4)),
            "{how}"
        );
        assert!(done.updated > std::time::UNIX_EPOCH, "{how}: the completion has a time");

        // Released by fence, and deleted.
        let (key, redis_key) = fresh(s);
        server.cmd(&["SET", &redis_key, &old_running('N', 0, 55, 1), "PX", "60000"]);
        assert_eq!(s.release_fenced(&key, 55).await.unwrap(), Resolved::Ok, "{how}");
        assert_eq!(s.inspect(&key).await.unwrap().unwrap().state, RecordState::Stuck);
        assert_eq!(s.delete(&key).await.unwrap(), Deleted::Ok);
    }
}

/// inspect, release_fenced and delete on a key that holds something this store did not write
/// answer a corrupt-record error and leave it as it is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_calls_on_garbage_are_corrupt_errors() {
    let server = RedisServer::start();
    let s = store(&server);
    let (key, redis_key) = fresh(&s);
    for garbage in [&["SET", &redis_key, "not a record"][..], &["HSET", &redis_key, "st", "R"]] {
        server.cmd(&["DEL", &redis_key]);
        server.cmd(garbage);
        assert!(matches!(s.inspect(&key).await.unwrap_err(), Error::Corrupt { .. }), "{garbage:?}");
        assert!(matches!(s.release_fenced(&key, 1).await.unwrap_err(), Error::Corrupt { .. }), "{garbage:?}");
        assert!(matches!(s.delete(&key).await.unwrap_err(), Error::Corrupt { .. }), "{garbage:?}");
        assert_eq!(server.cmd(&["EXISTS", &redis_key]), Value::Int(1));
    }
    // A scan leaves such a key out, and lists the records around it.
    let (good, _) = fresh(&s);
    s.acquire_labeled(
        &good,
        &Fingerprint::from_bytes([1; 32]),
        Duration::from_secs(60),
        Duration::from_secs(60),
        Labels::step("good"),
    )
    .await
    .unwrap();
    let page = s.scan(&Filter::all(), &Cursor::start(), 1000).await.unwrap();
    assert_eq!(page.records.iter().map(|r| r.key).collect::<Vec<_>>(), vec![good]);
    assert_eq!(page.next, None);
}
