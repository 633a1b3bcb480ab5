//! The store conformance suite: every [`Store`](idempotent_core::Store) must pass it, on its own clock.
//!
//! [`run_all`] runs each check on fresh random keys, so one store can take the whole suite. The
//! lease checks wait for real time to pass (the store's clock decides when a lease is over; for
//! Redis that is the server's `TIME`, which no test can pause), with leases of a few hundred ms.

use std::time::Duration;

use bytes::Bytes;
use idempotent_core::record::{Abandon, Acquire, Grant, Resolution, Resolved, Transition};
use idempotent_core::{Fingerprint, Key, SharedStore};

mod admin;
mod retention;

pub use admin::run_admin;
pub use retention::run_retention;

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
    an_uncertain_release_makes_the_next_attempt_recovered(&store).await;
    needs_attention_refuses_every_call_until_resolved_done(&store).await;
    resolved_not_done_runs_afresh(&store).await;
    resolve_leaves_every_other_state_alone(&store).await;
    needs_attention_outlives_the_retention(&store).await;
    run_retention(&store).await;
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
        // Marked by the first store, judged and resolved by the second; uncertain likewise.
        let key = fresh_key();
        let held = acquired(first, &key, &fp(1), LEASE).await;
        assert_eq!(first.abandon(&key, &held.token, Abandon::NeedsAttention).await.unwrap(), Transition::Ok);
        let waiting = Acquire::NeedsAttention { attempt: 1, fence: held.attempt.fence() };
        assert_eq!(second.acquire(&key, &fp(1), LEASE, KEEP).await.unwrap(), waiting);
        assert_eq!(second.resolve(&key, Resolution::NotDone).await.unwrap(), Resolved::Ok);
        let next = acquired(first, &key, &fp(1), LEASE).await;
        assert_eq!((next.attempt.number(), next.attempt.recovered()), (2, false));
        assert_eq!(first.abandon(&key, &next.token, Abandon::Uncertain).await.unwrap(), Transition::Ok);
        let last = acquired(second, &key, &fp(1), LEASE).await;
        assert_eq!((last.attempt.number(), last.attempt.recovered()), (3, true));
    }
}

/// abandon(Uncertain) → released, and the next attempt is recovered at once (no lease to wait
/// out); the mark is idempotent for its token, and a late complete after it is refused.
pub async fn an_uncertain_release_makes_the_next_attempt_recovered(store: &SharedStore) {
    let key = fresh_key();
    let first = acquired(store, &key, &fp(1), LEASE).await;
    let other = acquired(store, &fresh_key(), &fp(1), LEASE).await;
    assert_eq!(
        store.abandon(&key, &other.token, Abandon::Uncertain).await.unwrap(),
        Transition::LeaseLost,
        "foreign token"
    );
    assert_eq!(store.abandon(&key, &first.token, Abandon::Uncertain).await.unwrap(), Transition::Ok);
    assert_eq!(store.abandon(&key, &first.token, Abandon::Uncertain).await.unwrap(), Transition::Ok, "a retried mark");
    assert_eq!(
        store.complete(&key, &first.token, Bytes::from_static(b"late"), KEEP).await.unwrap(),
        Transition::LeaseLost,
        "a complete that lands after the mark"
    );
    assert_eq!(store.acquire(&key, &fp(2), LEASE, KEEP).await.unwrap(), Acquire::Mismatch, "uncertain, other payload");
    let second = acquired(store, &key, &fp(1), LEASE).await;
    assert_eq!(
        (second.attempt.number(), second.attempt.recovered()),
        (2, true),
        "recovered after an uncertain release"
    );
    assert!(second.attempt.fence() > first.attempt.fence());
    assert_eq!(
        store.abandon(&key, &first.token, Abandon::Uncertain).await.unwrap(),
        Transition::LeaseLost,
        "the old token"
    );
    // A clean release after it: the attempt after that is not recovered.
    assert_eq!(store.release(&key, &second.token).await.unwrap(), Transition::Ok);
    let third = acquired(store, &key, &fp(1), LEASE).await;
    assert_eq!((third.attempt.number(), third.attempt.recovered()), (3, false));
    // Marking a done record changes nothing.
    store.complete(&key, &third.token, Bytes::from_static(b"r"), KEEP).await.unwrap();
    assert_eq!(store.abandon(&key, &third.token, Abandon::Uncertain).await.unwrap(), Transition::LeaseLost);
    assert_eq!(store.acquire(&key, &fp(1), LEASE, KEEP).await.unwrap(), Acquire::Replay(Bytes::from_static(b"r")));
}

/// abandon(NeedsAttention) → every acquire answers NeedsAttention with the attempt and fence that
/// left it (another payload: Mismatch), the old token can do nothing more, and resolve(Done)
/// stores the given outcome for every later call. A second resolve changes nothing.
pub async fn needs_attention_refuses_every_call_until_resolved_done(store: &SharedStore) {
    let key = fresh_key();
    let first = acquired(store, &key, &fp(1), LEASE).await;
    assert_eq!(store.abandon(&key, &first.token, Abandon::NeedsAttention).await.unwrap(), Transition::Ok);
    assert_eq!(
        store.abandon(&key, &first.token, Abandon::NeedsAttention).await.unwrap(),
        Transition::Ok,
        "a retried mark"
    );
    let expected = Acquire::NeedsAttention { attempt: 1, fence: first.attempt.fence() };
    for _ in 0..3 {
        assert_eq!(store.acquire(&key, &fp(1), LEASE, KEEP).await.unwrap(), expected);
    }
    assert_eq!(store.acquire(&key, &fp(2), LEASE, KEEP).await.unwrap(), Acquire::Mismatch);
    assert_eq!(
        store.complete(&key, &first.token, Bytes::from_static(b"late"), KEEP).await.unwrap(),
        Transition::LeaseLost
    );
    assert_eq!(store.release(&key, &first.token).await.unwrap(), Transition::LeaseLost);
    assert_eq!(store.renew(&key, &first.token, LEASE).await.unwrap(), Transition::LeaseLost);
    assert_eq!(store.abandon(&key, &first.token, Abandon::Uncertain).await.unwrap(), Transition::LeaseLost);
    assert_eq!(store.acquire(&key, &fp(1), LEASE, KEEP).await.unwrap(), expected, "nothing above changed it");
    let done = Resolution::Done { outcome: Bytes::from_static(b"found"), retention: KEEP };
    assert_eq!(store.resolve(&key, done.clone()).await.unwrap(), Resolved::Ok);
    assert_eq!(store.resolve(&key, done).await.unwrap(), Resolved::Unchanged, "resolved already");
    assert_eq!(store.resolve(&key, Resolution::NotDone).await.unwrap(), Resolved::Unchanged);
    for _ in 0..3 {
        assert_eq!(
            store.acquire(&key, &fp(1), LEASE, KEEP).await.unwrap(),
            Acquire::Replay(Bytes::from_static(b"found"))
        );
    }
}

/// resolve(NotDone) releases the key: the next attempt runs afresh (not recovered), with the
/// next number and a higher fence.
pub async fn resolved_not_done_runs_afresh(store: &SharedStore) {
    let key = fresh_key();
    let first = acquired(store, &key, &fp(1), LEASE).await;
    assert_eq!(store.abandon(&key, &first.token, Abandon::NeedsAttention).await.unwrap(), Transition::Ok);
    assert_eq!(store.resolve(&key, Resolution::NotDone).await.unwrap(), Resolved::Ok);
    let second = acquired(store, &key, &fp(1), LEASE).await;
    assert_eq!((second.attempt.number(), second.attempt.recovered()), (2, false));
    assert!(second.attempt.fence() > first.attempt.fence());
    assert_eq!(store.complete(&key, &second.token, Bytes::from_static(b"ran"), KEEP).await.unwrap(), Transition::Ok);
    assert_eq!(store.acquire(&key, &fp(1), LEASE, KEEP).await.unwrap(), Acquire::Replay(Bytes::from_static(b"ran")));
}

/// resolve on a record that does not need attention (absent, running, released, done) answers
/// Unchanged and leaves it as it was.
pub async fn resolve_leaves_every_other_state_alone(store: &SharedStore) {
    let done = || Resolution::Done { outcome: Bytes::from_static(b"forced"), retention: KEEP };
    let absent = fresh_key();
    assert_eq!(store.resolve(&absent, done()).await.unwrap(), Resolved::Unchanged);
    assert_eq!(acquired(store, &absent, &fp(1), LEASE).await.attempt.number(), 1, "still absent");

    let key = fresh_key();
    let running = acquired(store, &key, &fp(1), LEASE).await;
    assert_eq!(store.resolve(&key, done()).await.unwrap(), Resolved::Unchanged);
    assert_eq!(store.resolve(&key, Resolution::NotDone).await.unwrap(), Resolved::Unchanged);
    assert!(
        matches!(store.acquire(&key, &fp(1), LEASE, KEEP).await.unwrap(), Acquire::InFlight { .. }),
        "still running"
    );
    assert_eq!(store.renew(&key, &running.token, LEASE).await.unwrap(), Transition::Ok, "still the holder's");

    assert_eq!(store.release(&key, &running.token).await.unwrap(), Transition::Ok);
    assert_eq!(store.resolve(&key, done()).await.unwrap(), Resolved::Unchanged);
    let again = acquired(store, &key, &fp(1), LEASE).await;
    assert_eq!((again.attempt.number(), again.attempt.recovered()), (2, false), "still released");

    store.complete(&key, &again.token, Bytes::from_static(b"real"), KEEP).await.unwrap();
    assert_eq!(store.resolve(&key, done()).await.unwrap(), Resolved::Unchanged);
    assert_eq!(store.resolve(&key, Resolution::NotDone).await.unwrap(), Resolved::Unchanged);
    assert_eq!(store.acquire(&key, &fp(1), LEASE, KEEP).await.unwrap(), Acquire::Replay(Bytes::from_static(b"real")));
}

/// A record that needs attention is not forgotten when the retention it was acquired with passes.
pub async fn needs_attention_outlives_the_retention(store: &SharedStore) {
    let key = fresh_key();
    let short = Duration::from_millis(200);
    let first = match store.acquire(&key, &fp(1), short, short).await.unwrap() {
        Acquire::Acquired(l) => l,
        other => panic!("expected Acquired, got {other:?}"),
    };
    assert_eq!(store.abandon(&key, &first.token, Abandon::NeedsAttention).await.unwrap(), Transition::Ok);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        store.acquire(&key, &fp(1), LEASE, KEEP).await.unwrap(),
        Acquire::NeedsAttention { attempt: 1, fence: first.attempt.fence() },
        "still waiting for a person after lease and retention passed"
    );
}
