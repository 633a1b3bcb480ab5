//! The server's clock: fences of new keys and completion times follow it, and `complete` stamps
//! the time it is given, never before the record's last change.

use std::time::Duration;

use idempotent_core::record::Acquire;
use idempotent_core::redis::{Script, Value};
use idempotent_core::store::RecordState;
use idempotent_core::store::redis::source;
use idempotent_core::{Error, Fingerprint, RedisStore, RunContext, Store};
use idempotent_tests::{RedisServer, unique};

use crate::{fresh, store};

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
    let scripts = RunContext::new(
        RedisStore::builder(server.url()).set_get_acquire(false).connect_lazy().unwrap(),
        plain.run_id(),
    );
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
        let done = ctx.shared_store().inspect(&key).await.unwrap().unwrap();
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
