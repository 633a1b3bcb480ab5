//! Records an earlier release wrote (the old running, released and needs-attention layout, done
//! records with the result right after the token): replayed, acquired, completed and inspected.

use std::time::Duration;

use bytes::Bytes;
use idempotent_core::record::{Acquire, Labels, Resolved, Transition};
use idempotent_core::redis::Script;
use idempotent_core::store::redis::{layout, source};
use idempotent_core::store::{Deleted, RecordState};
use idempotent_core::{Fingerprint, RedisStore, Store};
use idempotent_tests::RedisServer;

use crate::{fresh, store};

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
