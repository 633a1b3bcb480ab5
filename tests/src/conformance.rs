//! The store conformance suite: every [`Store`](idempotent_core::Store) must pass it, on its own clock.
//!
//! [`run_all`] runs each check on fresh random keys, so one store can take the whole suite. The
//! lease checks wait for real time to pass (the store's clock decides when a lease is over; for
//! Redis that is the server's `TIME`, which no test can pause), with leases of a few hundred ms.

use std::time::Duration;

use bytes::Bytes;
use idempotent_core::record::{Acquire, Grant, Transition};
use idempotent_core::{Fingerprint, Key, SharedStore};

const LEASE: Duration = Duration::from_secs(10);
const KEEP: Duration = Duration::from_secs(60);

fn fresh_key() -> Key {
    Key::derive(&idempotent_core::KeyScope::new(crate::unique("conf"), "step"), &()).unwrap()
}

fn fp(n: u8) -> Fingerprint {
    Fingerprint::from_bytes([n; 32])
}

async fn acquired(store: &SharedStore, key: &Key, fingerprint: &Fingerprint, lease: Duration) -> Grant {
    match store.acquire(key, fingerprint, lease, KEEP).await.expect("acquire") {
        Acquire::Acquired(l) => l,
        other => panic!("expected Acquired, got {other:?}"),
    }
}

/// Runs every check against `store`, panicking with the name of the first that fails.
pub async fn run_all(store: SharedStore) {
    first_acquire_then_in_flight(&store).await;
    complete_then_replay(&store).await;
    mismatch_in_every_state(&store).await;
    release_then_reacquire_with_higher_fence(&store).await;
    foreign_tokens_are_refused(&store).await;
    binary_results_round_trip(&store).await;
    lease_expiry_allows_takeover_and_fences_the_old_holder(&store).await;
    renew_keeps_the_lease(&store).await;
    retention_expiry_forgets_but_fences_still_grow(&store).await;
}

/// absent → Acquired(attempt 1); a second acquire sees the live lease.
pub async fn first_acquire_then_in_flight(store: &SharedStore) {
    let key = fresh_key();
    let lease = acquired(store, &key, &fp(1), LEASE).await;
    assert_eq!(lease.attempt.number(), 1, "first attempt is number 1");
    assert!(!lease.attempt.recovered(), "nothing to recover on a fresh key");
    match store.acquire(&key, &fp(1), LEASE, KEEP).await.unwrap() {
        Acquire::InFlight { retry_after } => {
            assert!(
                retry_after <= LEASE && retry_after > LEASE / 2,
                "retry_after {retry_after:?} should be about the lease"
            )
        }
        other => panic!("expected InFlight, got {other:?}"),
    }
}

/// running → done; every later acquire replays the exact bytes.
pub async fn complete_then_replay(store: &SharedStore) {
    let key = fresh_key();
    let lease = acquired(store, &key, &fp(1), LEASE).await;
    let t = store.complete(&key, &lease.token, Bytes::from_static(b"result-1"), KEEP).await.unwrap();
    assert_eq!(t, Transition::Ok);
    for _ in 0..3 {
        assert_eq!(
            store.acquire(&key, &fp(1), LEASE, KEEP).await.unwrap(),
            Acquire::Replay(Bytes::from_static(b"result-1"))
        );
    }
    // A retried complete (its first reply was lost) is acknowledged, and changes nothing.
    let t = store.complete(&key, &lease.token, Bytes::from_static(b"other"), KEEP).await.unwrap();
    assert_eq!(t, Transition::Ok);
    // Another token cannot complete a done record, nor release or renew it.
    let other = acquired(store, &fresh_key(), &fp(1), LEASE).await;
    assert_eq!(
        store.complete(&key, &other.token, Bytes::from_static(b"x"), KEEP).await.unwrap(),
        Transition::LeaseLost
    );
    assert_eq!(store.release(&key, &lease.token).await.unwrap(), Transition::LeaseLost);
    assert_eq!(store.renew(&key, &lease.token, LEASE).await.unwrap(), Transition::LeaseLost);
    assert_eq!(
        store.acquire(&key, &fp(1), LEASE, KEEP).await.unwrap(),
        Acquire::Replay(Bytes::from_static(b"result-1"))
    );
}

/// Another fingerprint under the same key is a mismatch whether the record runs, is done or released.
pub async fn mismatch_in_every_state(store: &SharedStore) {
    let key = fresh_key();
    let lease = acquired(store, &key, &fp(1), LEASE).await;
    assert_eq!(store.acquire(&key, &fp(2), LEASE, KEEP).await.unwrap(), Acquire::Mismatch, "running");
    assert_eq!(store.release(&key, &lease.token).await.unwrap(), Transition::Ok);
    assert_eq!(store.acquire(&key, &fp(2), LEASE, KEEP).await.unwrap(), Acquire::Mismatch, "released");
    let lease = acquired(store, &key, &fp(1), LEASE).await;
    store.complete(&key, &lease.token, Bytes::from_static(b"r"), KEEP).await.unwrap();
    assert_eq!(store.acquire(&key, &fp(2), LEASE, KEEP).await.unwrap(), Acquire::Mismatch, "done");
}

/// released → acquire again: attempt 2, a higher fence, not recovered.
pub async fn release_then_reacquire_with_higher_fence(store: &SharedStore) {
    let key = fresh_key();
    let first = acquired(store, &key, &fp(1), LEASE).await;
    assert_eq!(store.release(&key, &first.token).await.unwrap(), Transition::Ok);
    // A retried release is acknowledged; a complete after it is not.
    assert_eq!(store.release(&key, &first.token).await.unwrap(), Transition::Ok);
    assert_eq!(
        store.complete(&key, &first.token, Bytes::from_static(b"late"), KEEP).await.unwrap(),
        Transition::LeaseLost
    );
    let second = acquired(store, &key, &fp(1), LEASE).await;
    assert_eq!(second.attempt.number(), 2);
    assert!(
        second.attempt.fence() > first.attempt.fence(),
        "fence must grow: {} then {}",
        first.attempt.fence(),
        second.attempt.fence()
    );
    assert!(!second.attempt.recovered(), "a release is not a crash");
    assert_ne!(second.token, first.token);
    // The first token no longer owns anything.
    assert_eq!(store.release(&key, &first.token).await.unwrap(), Transition::LeaseLost);
    assert_eq!(store.renew(&key, &first.token, LEASE).await.unwrap(), Transition::LeaseLost);
}

/// complete, release and renew with a token that does not own the key are refused, and change nothing.
pub async fn foreign_tokens_are_refused(store: &SharedStore) {
    let key = fresh_key();
    let owner = acquired(store, &key, &fp(1), LEASE).await;
    let other = acquired(store, &fresh_key(), &fp(1), LEASE).await;
    assert_eq!(
        store.complete(&key, &other.token, Bytes::from_static(b"x"), KEEP).await.unwrap(),
        Transition::LeaseLost
    );
    assert_eq!(store.release(&key, &other.token).await.unwrap(), Transition::LeaseLost);
    assert_eq!(store.renew(&key, &other.token, LEASE).await.unwrap(), Transition::LeaseLost);
    assert!(matches!(store.acquire(&key, &fp(1), LEASE, KEEP).await.unwrap(), Acquire::InFlight { .. }));
    assert_eq!(store.complete(&key, &owner.token, Bytes::from_static(b"mine"), KEEP).await.unwrap(), Transition::Ok);
    // A key that was never acquired has no owner at all.
    let absent = fresh_key();
    assert_eq!(store.complete(&absent, &owner.token, Bytes::new(), KEEP).await.unwrap(), Transition::LeaseLost);
    assert_eq!(store.renew(&absent, &owner.token, LEASE).await.unwrap(), Transition::LeaseLost);
}

/// Results are opaque bytes: empty, binary and large ones come back exactly.
pub async fn binary_results_round_trip(store: &SharedStore) {
    let big: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
    for payload in [Vec::new(), vec![0, 159, 146, 150, 255, 0], big] {
        let key = fresh_key();
        let lease = acquired(store, &key, &fp(1), LEASE).await;
        store.complete(&key, &lease.token, Bytes::from(payload.clone()), KEEP).await.unwrap();
        assert_eq!(store.acquire(&key, &fp(1), LEASE, KEEP).await.unwrap(), Acquire::Replay(Bytes::from(payload)));
    }
}

/// A holder that outlives its lease loses the key: a new attempt takes over (recovered, higher
/// fence) and the old holder can no longer complete.
pub async fn lease_expiry_allows_takeover_and_fences_the_old_holder(store: &SharedStore) {
    let key = fresh_key();
    let short = Duration::from_millis(150);
    let old = acquired(store, &key, &fp(1), short).await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    let new = acquired(store, &key, &fp(1), LEASE).await;
    assert!(new.attempt.recovered(), "the previous lease ran out without an outcome");
    assert_eq!(new.attempt.number(), 2);
    assert!(new.attempt.fence() > old.attempt.fence());
    assert_eq!(
        store.complete(&key, &old.token, Bytes::from_static(b"stale"), KEEP).await.unwrap(),
        Transition::LeaseLost
    );
    assert_eq!(store.renew(&key, &old.token, LEASE).await.unwrap(), Transition::LeaseLost);
    assert_eq!(store.complete(&key, &new.token, Bytes::from_static(b"fresh"), KEEP).await.unwrap(), Transition::Ok);
    assert_eq!(store.acquire(&key, &fp(1), LEASE, KEEP).await.unwrap(), Acquire::Replay(Bytes::from_static(b"fresh")));
}

/// Renewing moves the deadline: the key stays taken past the original lease.
pub async fn renew_keeps_the_lease(store: &SharedStore) {
    let key = fresh_key();
    let lease = Duration::from_millis(300);
    let holder = acquired(store, &key, &fp(1), lease).await;
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_millis(150)).await;
        assert_eq!(store.renew(&key, &holder.token, lease).await.unwrap(), Transition::Ok);
    }
    // 450 ms after acquiring, well past the original 300 ms lease.
    assert!(matches!(store.acquire(&key, &fp(1), lease, KEEP).await.unwrap(), Acquire::InFlight { .. }));
    assert_eq!(store.complete(&key, &holder.token, Bytes::from_static(b"ok"), KEEP).await.unwrap(), Transition::Ok);
}

/// After the retention passes the record is gone; a new acquisition starts at attempt 1 but its
/// fence is still above every earlier fence of the key.
pub async fn retention_expiry_forgets_but_fences_still_grow(store: &SharedStore) {
    let key = fresh_key();
    let short = Duration::from_millis(200);
    let first = match store.acquire(&key, &fp(1), short, short).await.unwrap() {
        Acquire::Acquired(l) => l,
        other => panic!("expected Acquired, got {other:?}"),
    };
    store.complete(&key, &first.token, Bytes::from_static(b"gone soon"), short).await.unwrap();
    tokio::time::sleep(Duration::from_millis(450)).await;
    let again = acquired(store, &key, &fp(2), LEASE).await;
    assert_eq!(again.attempt.number(), 1, "the record was forgotten");
    assert!(again.attempt.fence() > first.attempt.fence(), "fence went backwards after the record expired");
}

/// Two stores on the same records, each taking keys its own way (for Redis: one by `SET NX GET`,
/// one by the acquire script), hand keys over between them: in-flight, release, lease expiry,
/// renew and replay agree whichever store wrote the record.
pub async fn run_mixed(a: SharedStore, b: SharedStore) {
    for (first, second) in [(&a, &b), (&b, &a)] {
        let key = fresh_key();
        // Taken by the first store, judged expired by the second.
        // A lease long enough for the two checks below on a loaded machine.
        let held = acquired(first, &key, &fp(1), Duration::from_millis(400)).await;
        assert!(matches!(second.acquire(&key, &fp(1), LEASE, KEEP).await.unwrap(), Acquire::InFlight { .. }));
        assert_eq!(second.acquire(&key, &fp(2), LEASE, KEEP).await.unwrap(), Acquire::Mismatch);
        tokio::time::sleep(Duration::from_millis(650)).await;
        let taken = acquired(second, &key, &fp(1), LEASE).await;
        assert_eq!((taken.attempt.number(), taken.attempt.recovered()), (2, true));
        assert!(
            taken.attempt.fence() > held.attempt.fence(),
            "fence must grow: {} then {}",
            held.attempt.fence(),
            taken.attempt.fence()
        );
        assert_eq!(
            first.complete(&key, &held.token, Bytes::from_static(b"stale"), KEEP).await.unwrap(),
            Transition::LeaseLost
        );
        // Renewed and released through the first store.
        assert_eq!(first.renew(&key, &taken.token, LEASE).await.unwrap(), Transition::Ok);
        assert!(matches!(first.acquire(&key, &fp(1), LEASE, KEEP).await.unwrap(), Acquire::InFlight { .. }));
        assert_eq!(first.release(&key, &taken.token).await.unwrap(), Transition::Ok);
        let next = acquired(first, &key, &fp(1), LEASE).await;
        assert_eq!((next.attempt.number(), next.attempt.recovered()), (3, false));
        assert!(next.attempt.fence() > taken.attempt.fence());
        assert_eq!(second.complete(&key, &next.token, Bytes::from_static(b"r"), KEEP).await.unwrap(), Transition::Ok);
        for store in [first, second] {
            assert_eq!(
                store.acquire(&key, &fp(1), LEASE, KEEP).await.unwrap(),
                Acquire::Replay(Bytes::from_static(b"r"))
            );
            assert_eq!(store.acquire(&key, &fp(2), LEASE, KEEP).await.unwrap(), Acquire::Mismatch);
        }
    }
}
