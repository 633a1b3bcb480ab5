//! Reaching the server: an outage fails calls closed within the timeout and calls work again once
//! the server is back; ACL credentials in the URL; a store on the application's own connection
//! pool. (`rediss://` is in `tests/redis_tls.rs`.)

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use idempotent_core::{Error, RedisStore, RunContext};
use idempotent_tests::{RedisOptions, RedisServer, unique};

use crate::store;

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

/// `connect` connects, as sqlx's pools do: a server that is not there, or a password it refuses,
/// fails it at once; `connect_lazy` makes the store and leaves that to the first call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_connects_and_connect_lazy_does_not() {
    let nobody = format!("redis://127.0.0.1:{}", idempotent_tests::free_port(false));
    let started = Instant::now();
    let err = RedisStore::connect(&nobody).await.unwrap_err();
    assert!(matches!(err, Error::Unavailable { .. }), "{err}");
    assert!(started.elapsed() < Duration::from_secs(2), "a refused connection waited for the timeout: {err}");
    let lazy = RedisStore::connect_lazy(&nobody).expect("a lazy store connects on first use");
    let err = RunContext::new(lazy, "r").step("s").run(&1, |_| async { Ok::<u8, Error>(1) }).await.unwrap_err();
    assert!(err.is_store_failure(), "{err}");

    let server = RedisServer::start();
    server.cmd(&["ACL", "SETUSER", "worker", "on", ">s3cret", "~idem:*", "+@all"]);
    let refused = format!("redis://worker:wrong@127.0.0.1:{}", server.port());
    let err = RedisStore::connect(&refused).await.unwrap_err();
    assert!(err.is_store_failure(), "{err}");
    assert!(!err.to_string().contains("wrong"), "the password leaked into the error: {err}");
    let store = RedisStore::connect(server.url()).await.unwrap();
    let v: u8 = RunContext::new(store, unique("run")).step("s").run(&1, |_| async { Ok::<_, Error>(2) }).await.unwrap();
    assert_eq!(v, 2);
}

/// ACL users and passwords in the URL work; a wrong password is a clear store error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acl_credentials_in_the_url() {
    let server = RedisServer::start();
    server.cmd(&["ACL", "SETUSER", "worker", "on", ">s3cret", "~idem:*", "+@all"]);
    let url = format!("redis://worker:s3cret@127.0.0.1:{}", server.port());
    let ctx = RunContext::new(RedisStore::connect_lazy(&url).unwrap(), unique("run"));
    let v: u8 = ctx.step("acl").run(&1, |_| async { Ok::<_, Error>(5) }).await.unwrap();
    assert_eq!(v, 5);
    let bad = format!("redis://worker:wrong@127.0.0.1:{}", server.port());
    let store = RedisStore::builder(bad).command_timeout(Duration::from_millis(500)).connect_lazy().unwrap();
    let err = RunContext::new(store, "r").step("acl").run(&1, |_| async { Ok::<u8, Error>(1) }).await.unwrap_err();
    assert!(err.is_store_failure(), "{err}");
    assert!(!err.to_string().contains("wrong"), "the password leaked into the error: {err}");
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
    let store = RedisStore::builder_with_pool(pool.clone())
        .key_prefix("app:idem:")
        .command_timeout(Duration::from_secs(2))
        .connect()
        .await
        .unwrap();
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
