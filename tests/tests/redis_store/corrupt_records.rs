//! Records this crate did not write: errors, never replays, on both acquire paths, for
//! needs-attention records and resolve, and for the admin calls; a scan leaves them out.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use bytes::Bytes;
use idempotent_core::record::{Labels, Resolution};
use idempotent_core::redis::Value;
use idempotent_core::store::redis::layout;
use idempotent_core::store::{Cursor, Filter};
use idempotent_core::{Error, Fingerprint, RedisStore, RunContext, Store};
use idempotent_tests::{RedisServer, unique};

use crate::{fresh, record_of, store};

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
    let tail = layout::HEADER_LEN - layout::LEASE.start;
    let (exploded, short, bad_result) =
        (record("Q", &"0".repeat(tail)), record("R", "123"), record("D", "\u{1}garbage"));
    // A done record cut short inside its token, before any result.
    let short_done = format!("D{fp}{}", &token[..10]);
    // Numbers Lua's `tonumber` would take but the record never holds, in records of the right
    // shape (times and an empty labels section after them).
    let (lease, fence, attempt) = (layout::LEASE.len(), layout::FENCE.len(), layout::ATTEMPT.len());
    let rest = format!("{}{}", "0".repeat(layout::CREATED.len() + layout::UPDATED.len()), layout::NO_LABELS);
    let (bad_lease, nan_fence, inf_lease, exp_fence, huge_fence) = (
        record("R", &format!("{}{:0fence$}{:0attempt$}0{rest}", "x".repeat(lease), 1, 1)),
        record("R", &format!("{:0lease$}{:>fence$}{:0attempt$}0{rest}", 1, "nan", 1)),
        record("R", &format!("{:>lease$}{:0fence$}{:0attempt$}0{rest}", "inf", 1, 1)),
        record("R", &format!("{:0lease$}{:>fence$}{:0attempt$}0{rest}", 1, "1e18", 1)),
        record("R", &format!("{:0lease$}{:0fence$}{:0attempt$}0{rest}", 1, layout::MAX_FENCE, 1)),
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
        RunContext::new(RedisStore::builder(server.url()).set_get_acquire(false).connect_lazy().unwrap(), ctx.run_id());
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

/// A needs-attention record this crate did not write (cut short, a malformed number, a fence
/// beyond 2^53) is reported as corrupt by both acquire paths and by resolve, and left as it is;
/// so is any key resolve finds holding something that is not a record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupt_needs_attention_records_are_errors() {
    let server = RedisServer::start();
    let plain = store(&server);
    plain.warm_up().await.unwrap();
    let scripts = RedisStore::builder(server.url()).set_get_acquire(false).connect_lazy().unwrap();
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
