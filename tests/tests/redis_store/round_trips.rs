//! Round trips: 64 callers on four store handles run the action once; the commands a first
//! execution and a replay cost, counted by the server; plain reads on one connection, writes on the
//! others in turn.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use idempotent_core::state::{Scope, State};
use idempotent_core::{Error, OnInFlight, RedisStore, RunContext, SharedStore};
use idempotent_tests::{Flavor, RedisServer, unique};
use tokio::sync::Barrier;

use crate::store;

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
        let s = RedisStore::builder(server.url()).set_get_acquire(set_get).functions(functions).connect_lazy().unwrap();
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
    let s = RedisStore::builder(server.url()).pool_size(4).connect_lazy().unwrap();
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

/// On a server that compares and sets (Valkey 9), a first execution is two plain commands: the
/// `SET NX GET` that takes the key and one `SET … IFEQ` that completes over the record it wrote;
/// no script runs. A completion over a record that changed (renewed) takes the script, as does
/// every completion with the plain form turned off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_execution_on_valkey_is_two_plain_sets() {
    let server = RedisServer::start_flavor(Flavor::Valkey);
    let s = RedisStore::builder(server.url()).connect().await.unwrap();
    let ctx = RunContext::new(s, unique("run"));
    let monitor = server.monitor();
    let v: u8 = ctx.step("s").heartbeat(false).run(&1, |_| async { Ok::<_, Error>(1) }).await.unwrap();
    assert_eq!(monitor.client_commands(), ["set", "set"], "first execution");
    assert_eq!(v, 1);
    let monitor = server.monitor();
    let again: u8 = ctx.step("s").run(&1, |_| async { Ok::<_, Error>(9) }).await.unwrap();
    assert_eq!((again, monitor.client_commands()), (1, vec!["set".to_owned()]), "replay");

    // Renewed mid-action by the heartbeat: the record is no longer the one SET NX wrote.
    let quick = RedisStore::builder(server.url()).command_timeout(Duration::from_millis(200)).connect().await.unwrap();
    let ctx_quick = RunContext::new(quick.clone(), unique("run"));
    let monitor = server.monitor();
    let _: u8 = ctx_quick
        .step("s")
        .lease(Duration::from_millis(900))
        .run(&3, |attempt| {
            let redis_key = quick.redis_key(attempt.key());
            let server = &server;
            async move {
                // Until the heartbeat's renewal has turned the new record (N) into a running one (R).
                let started = std::time::Instant::now();
                let running = || {
                    matches!(server.cmd(&["GET", &redis_key]), idempotent_core::redis::Value::BulkString(r) if r.first() == Some(&b'R'))
                };
                while !running() {
                    assert!(started.elapsed() < Duration::from_secs(5), "no renewal within 5 s");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                Ok::<_, Error>(3)
            }
        })
        .await
        .unwrap();
    let sent = monitor.client_commands();
    assert_eq!(sent.first().map(String::as_str), Some("set"), "{sent:?}");
    assert_eq!(sent.last().map(String::as_str), Some("fcall"), "a renewed record completes by script: {sent:?}");
    assert!(!sent.iter().skip(1).any(|c| c == "set"), "no plain completion over a renewed record: {sent:?}");

    let off = RedisStore::builder(server.url()).native_compare_and_set(false).connect().await.unwrap();
    let ctx = RunContext::new(off, unique("run"));
    let monitor = server.monitor();
    let _: u8 = ctx.step("s").heartbeat(false).run(&1, |_| async { Ok::<_, Error>(1) }).await.unwrap();
    assert_eq!(monitor.client_commands(), ["set", "fcall"], "turned off");
}
