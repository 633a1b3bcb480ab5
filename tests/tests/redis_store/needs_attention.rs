//! Needs-attention records: no TTL until resolved (an uncertain release keeps it), and answered
//! alike by `SET NX GET` and the acquire script, which leave them unchanged.

use std::time::Duration;

use bytes::Bytes;
use idempotent_core::record::{Abandon, Acquire, KEEP_RESOLVED_RELEASE, Resolution, Resolved, Transition};
use idempotent_core::redis::Script;
use idempotent_core::store::redis::{layout, source};
use idempotent_core::{Fingerprint, RedisStore, Store};
use idempotent_tests::RedisServer;

use crate::{fresh, pttl, record_of, store};

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

/// A needs-attention record (written by hand, so that its attempt and fence are known) is
/// answered alike by `SET NX GET`, which reads it in Rust without a script, and by the acquire
/// script, for the record's own token too; nothing changes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn needs_attention_reads_alike_on_both_acquire_paths() {
    let server = RedisServer::start();
    let plain = store(&server);
    plain.warm_up().await.unwrap();
    let scripts = RedisStore::builder(server.url()).set_get_acquire(false).connect_lazy().unwrap();
    scripts.warm_up().await.unwrap();
    let (key, redis_key) = fresh(&plain);
    let (fp, other_fp) = (Fingerprint::from_bytes([3; 32]), Fingerprint::from_bytes([4; 32]));
    let (token, fence, attempt) = ("a".repeat(32), 4_503_599_627_370_497_u64, 7_u32);
    let (lease, fence_len, attempt_len) = (layout::LEASE.len(), layout::FENCE.len(), layout::ATTEMPT.len());
    let times = "0".repeat(layout::CREATED.len() + layout::UPDATED.len());
    let record = format!(
        "A{}{token}{:0lease$}{fence:0fence_len$}{attempt:0attempt_len$}0{times}{}",
        fp.to_hex(),
        12,
        layout::NO_LABELS
    );
    assert_eq!(record.len(), layout::HEADER_LEN, "a needs-attention record without labels");
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
