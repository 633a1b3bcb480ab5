//! The scripts: the library loaded one function per script and each script under the hash the
//! store sends; a server refusing `SET … NX GET` or functions (the acquire script, `EVALSHA`); the
//! library lost under `WAIT` for replicas, loaded again.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use idempotent_core::redis::{Script, Value};
use idempotent_core::store::redis::source;
use idempotent_core::{Error, RedisStore, RunContext};
use idempotent_tests::{RedisServer, unique};

use crate::{store, store_at};

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

    RedisStore::builder(server.url()).functions(false).connect_lazy().unwrap().warm_up().await.unwrap();
    for script in source::ALL {
        let hash = Script::new(script).get_hash().to_owned();
        assert_eq!(server.cmd(&["SCRIPT", "EXISTS", &hash]), Value::Array(vec![Value::Int(1)]));
        assert_eq!(server.cmd(&["SCRIPT", "LOAD", script]), Value::BulkString(hash.into_bytes()));
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
            // Not warmed up, the background measure of the clock also asks whether the server
            // has `SET … IFEQ` (a `set` Redis 7.0 refuses), and may land in this window too.
            let mut sent: Vec<String> =
                monitor.client_commands().into_iter().filter(|c| c != "auth" && c != "time").collect();
            if !warm
                && sent.iter().filter(|c| *c == "set").count() == 2
                && let Some(probe) = sent.iter().rposition(|c| c == "set")
            {
                sent.remove(probe);
            }
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
        .connect_lazy()
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
