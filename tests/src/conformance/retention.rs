//! The conformance suite's half for how long a record is kept: every store keeps it as the record
//! protocol says (`idempotent_core::record`, section "Retention").
//!
//! Read through [`Store::inspect`](idempotent_core::Store::inspect), against the store's own
//! clock: a record's `updated` time is that clock's reading at its last change, so its `expires`
//! minus its `updated` is how long a transition kept it. No sleep, except one short check that a
//! store forgets a record when it said it would.

use std::time::{Duration, SystemTime};

use bytes::Bytes;
use idempotent_core::record::{Abandon, Acquire, Grant, KEEP_RESOLVED_RELEASE, Resolution, Resolved, Transition};
use idempotent_core::store::RecordInfo;
use idempotent_core::{Key, SharedStore};

use super::{KEEP, LEASE, fp, fresh_key};

/// A retention shorter than [`LEASE`]; the gap to the lease is larger than [`SLACK`].
const SHORT: Duration = Duration::from_secs(3);

/// How far two readings of one store's clock for one transition may be apart. On SQLite and
/// PostgreSQL both are the statement's time, on `MemoryStore` one `Instant`; on Redis the update
/// time of a record that `SET NX` took or that `complete` wrote is this side's estimate of the
/// server's clock (`store/redis/clock.rs`: within a round trip), and times are whole ms.
const SLACK: Duration = Duration::from_secs(1);

/// Runs every retention check against `store`.
pub async fn run_retention(store: &SharedStore) {
    acquire_keeps_the_longer_of_lease_and_retention_and_renew_only_extends(store).await;
    complete_keeps_the_retention_from_the_completion(store).await;
    release_and_abandon_keep_the_expiry_and_resolve_sets_its_own(store).await;
    a_completed_record_is_forgotten_after_its_retention(store).await;
}

async fn take(store: &SharedStore, key: &Key, lease: Duration, retention: Duration) -> Grant {
    match store.acquire(key, &fp(1), lease, retention).await.expect("acquire") {
        Acquire::Acquired(grant) => grant,
        other => panic!("expected Acquired, got {other:?}"),
    }
}

async fn info(store: &SharedStore, key: &Key) -> RecordInfo {
    store.inspect(key).await.expect("inspect").expect("the record exists")
}

/// `a - b`, negative when `a` is before `b`, in ms (for the messages).
fn gap_ms(a: SystemTime, b: SystemTime) -> i128 {
    match a.duration_since(b) {
        Ok(d) => d.as_millis() as i128,
        Err(e) => -(e.duration().as_millis() as i128),
    }
}

fn close(a: SystemTime, b: SystemTime) -> bool {
    gap_ms(a, b).unsigned_abs() <= SLACK.as_millis()
}

/// Asserts that the record was last changed `kept` before it expires.
fn assert_kept(record: &RecordInfo, kept: Duration, what: &str) {
    let expires = record.expires.unwrap_or_else(|| panic!("{what}: the record never expires: {record:?}"));
    assert!(
        close(expires, record.updated + kept),
        "{what}: kept {} ms after its last change, expected {} ms: {record:?}",
        gap_ms(expires, record.updated),
        kept.as_millis()
    );
}

/// Asserts that the record still expires at `expires`.
fn assert_expiry_kept(record: &RecordInfo, expires: SystemTime, what: &str) {
    let now = record.expires.unwrap_or_else(|| panic!("{what}: the record never expires: {record:?}"));
    assert!(close(now, expires), "{what}: the expiry moved by {} ms: {record:?}", gap_ms(now, expires));
}

/// Acquire keeps a record `max(lease, retention)`; a renewal never shortens that, and keeps the
/// record at least until the new lease ends.
async fn acquire_keeps_the_longer_of_lease_and_retention_and_renew_only_extends(store: &SharedStore) {
    let key = fresh_key();
    let holder = take(store, &key, LEASE, KEEP).await;
    let running = info(store, &key).await;
    assert_kept(&running, KEEP, "acquired, the retention longer than the lease");
    let acquired_expiry = running.expires.unwrap();

    // Renewed with a lease that ends before that: the expiry stays.
    assert_eq!(store.renew(&key, &holder.token, LEASE).await.unwrap(), Transition::Ok);
    let renewed = info(store, &key).await;
    assert_expiry_kept(&renewed, acquired_expiry, "renewed within the retention");
    // Renewed past it: kept until the new lease ends, not a retention beyond.
    let long = 2 * KEEP;
    assert_eq!(store.renew(&key, &holder.token, long).await.unwrap(), Transition::Ok);
    let renewed = info(store, &key).await;
    assert_kept(&renewed, long, "renewed past the retention");
    let lease_until = renewed.lease_until.expect("a running record has a lease");
    assert_expiry_kept(&renewed, lease_until, "renewed past the retention: kept until the lease ends");

    // The retention shorter than the lease: the lease.
    let key = fresh_key();
    take(store, &key, LEASE, SHORT).await;
    let running = info(store, &key).await;
    assert_kept(&running, LEASE, "acquired, the retention shorter than the lease");
    assert_expiry_kept(&running, running.lease_until.unwrap(), "acquired, the retention shorter than the lease");
}

/// Complete keeps a record exactly its retention from the completion, sooner or later than it
/// would have expired while running; a repeated complete changes nothing.
async fn complete_keeps_the_retention_from_the_completion(store: &SharedStore) {
    // Acquired and completed with the same retention, within the lease.
    for (lease, retention) in [(LEASE, KEEP), (LEASE, SHORT)] {
        let key = fresh_key();
        let holder = take(store, &key, lease, retention).await;
        let done = Bytes::from_static(b"done");
        assert_eq!(store.complete(&key, &holder.token, done, retention).await.unwrap(), Transition::Ok);
        let record = info(store, &key).await;
        let what = format!("completed within a {lease:?} lease with the {retention:?} retention it was acquired with");
        assert_kept(&record, retention, &what);
        let expires = record.expires.unwrap();
        // A retried complete, even with another retention, leaves it.
        let again = Bytes::from_static(b"again");
        assert_eq!(store.complete(&key, &holder.token, again, 2 * KEEP).await.unwrap(), Transition::Ok);
        assert_expiry_kept(&info(store, &key).await, expires, "a repeated complete");
    }

    // After a renewal past the retention: the retention from the completion, before the lease's end.
    let key = fresh_key();
    let holder = take(store, &key, LEASE, KEEP).await;
    assert_eq!(store.renew(&key, &holder.token, 2 * KEEP).await.unwrap(), Transition::Ok);
    store.complete(&key, &holder.token, Bytes::from_static(b"r"), KEEP).await.unwrap();
    assert_kept(&info(store, &key).await, KEEP, "completed after a renewal past the retention");

    // Another retention at completion than at acquisition: that one.
    let key = fresh_key();
    let holder = take(store, &key, LEASE, SHORT).await;
    store.complete(&key, &holder.token, Bytes::from_static(b"r"), KEEP).await.unwrap();
    assert_kept(&info(store, &key).await, KEEP, "completed with a longer retention than acquired with");
}

/// Release, abandon (uncertain) and `release_fenced` keep the expiry the acquisition set; the
/// next acquisition sets its own; a record that needs attention never expires, and a resolution
/// keeps it for its retention ([`KEEP_RESOLVED_RELEASE`] when not done).
async fn release_and_abandon_keep_the_expiry_and_resolve_sets_its_own(store: &SharedStore) {
    let key = fresh_key();
    let first = take(store, &key, LEASE, KEEP).await;
    let expires = info(store, &key).await.expires.unwrap();
    assert_eq!(store.release(&key, &first.token).await.unwrap(), Transition::Ok);
    assert_expiry_kept(&info(store, &key).await, expires, "released");

    // A new acquisition, with a shorter retention than the last one: its own, shorter expiry.
    let second = take(store, &key, LEASE, SHORT).await;
    assert_kept(&info(store, &key).await, LEASE, "acquired again after a release");
    let expires = info(store, &key).await.expires.unwrap();
    assert_eq!(store.abandon(&key, &second.token, Abandon::Uncertain).await.unwrap(), Transition::Ok);
    assert_expiry_kept(&info(store, &key).await, expires, "abandoned uncertain");

    let third = take(store, &key, LEASE, KEEP).await;
    let expires = info(store, &key).await.expires.unwrap();
    assert_eq!(store.release_fenced(&key, third.attempt.fence()).await.unwrap(), Resolved::Ok);
    assert_expiry_kept(&info(store, &key).await, expires, "released by its fence");

    let fourth = take(store, &key, LEASE, SHORT).await;
    assert_eq!(store.abandon(&key, &fourth.token, Abandon::NeedsAttention).await.unwrap(), Transition::Ok);
    let waiting = info(store, &key).await;
    assert_eq!(waiting.expires, None, "a record that needs attention never expires: {waiting:?}");
    let done = Resolution::Done { outcome: Bytes::from_static(b"checked"), retention: SHORT };
    assert_eq!(store.resolve(&key, done).await.unwrap(), Resolved::Ok);
    assert_kept(&info(store, &key).await, SHORT, "resolved as done");

    let key = fresh_key();
    let first = take(store, &key, LEASE, KEEP).await;
    assert_eq!(store.abandon(&key, &first.token, Abandon::NeedsAttention).await.unwrap(), Transition::Ok);
    assert_eq!(store.resolve(&key, Resolution::NotDone).await.unwrap(), Resolved::Ok);
    assert_kept(&info(store, &key).await, KEEP_RESOLVED_RELEASE, "resolved as not done");
}

/// What the store acts on agrees: a record completed early in a long lease, with the retention it
/// was acquired with, is forgotten once that retention has passed since the completion (the next
/// acquisition is attempt 1), not kept until the lease would have ended.
async fn a_completed_record_is_forgotten_after_its_retention(store: &SharedStore) {
    let key = fresh_key();
    let retention = Duration::from_millis(100);
    let first = take(store, &key, LEASE, retention).await;
    store.complete(&key, &first.token, Bytes::from_static(b"brief"), retention).await.unwrap();
    // Only a lower bound: a late wake-up on a loaded machine finds it forgotten all the same.
    let wait = 3 * retention;
    tokio::time::sleep(wait).await;
    match store.acquire(&key, &fp(1), LEASE, KEEP).await.unwrap() {
        Acquire::Acquired(grant) => assert_eq!(grant.attempt.number(), 1, "the record was forgotten"),
        other => panic!("{wait:?} after completing with a {retention:?} retention, in a {LEASE:?} lease: {other:?}"),
    }
}
