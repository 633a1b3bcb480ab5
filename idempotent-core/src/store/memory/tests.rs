//! `MemoryStore`'s own unit tests (the conformance suite runs on it in the tests crate).

use super::*;

fn key(i: u8) -> Key {
    Key::from_bytes([i; 32])
}

const FP: Fingerprint = Fingerprint::from_bytes([1; 32]);
const SEC: Duration = Duration::from_secs(1);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capacity_is_exact_under_concurrent_inserts() {
    let store = MemoryStore::with_capacity(10);
    let mut tasks = Vec::new();
    for i in 0..64u8 {
        let store = store.clone();
        tasks.push(tokio::spawn(async move { store.acquire(&key(i), &FP, SEC, SEC).await }));
    }
    let mut acquired = 0;
    for t in tasks {
        match t.await.unwrap() {
            Ok(Acquire::Acquired(_)) => acquired += 1,
            Err(Error::Full { .. }) => {}
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(acquired, 10);
    assert_eq!(store.len(), 10);
}

#[tokio::test(start_paused = true)]
async fn huge_durations_saturate_instead_of_panicking() {
    let store = MemoryStore::new();
    let Acquire::Acquired(lease) = store.acquire(&key(1), &FP, Duration::MAX, Duration::MAX).await.unwrap() else {
        panic!("not acquired")
    };
    assert_eq!(store.renew(&key(1), &lease.token, Duration::MAX).await.unwrap(), Transition::Ok);
    assert_eq!(store.complete(&key(1), &lease.token, Bytes::new(), Duration::MAX).await.unwrap(), Transition::Ok);
}

/// A key in shard 0, told apart by `n`.
fn shard0_key(n: u32) -> Key {
    let mut k = [0; 32];
    k[1..5].copy_from_slice(&n.to_le_bytes());
    Key::from_bytes(k)
}

#[tokio::test(start_paused = true)]
async fn writes_sweep_expired_records_so_they_stay_bounded() {
    let store = MemoryStore::new();
    let ms = Duration::from_millis(1);
    for i in 0u32..100_000 {
        let mut k = [0; 32];
        k[..4].copy_from_slice(&i.to_le_bytes());
        assert!(matches!(store.acquire(&Key::from_bytes(k), &FP, ms, ms).await.unwrap(), Acquire::Acquired(_)));
        if i % 100 == 99 {
            tokio::time::advance(ms).await;
        }
    }
    // About 100 records are live at any time; each shard sweeps after at most 1 024 writes.
    assert!(store.len() <= SHARDS * (SWEEP_EVERY + 100), "{} records held", store.len());
}

#[tokio::test(start_paused = true)]
async fn a_shortened_retention_is_swept_too() {
    let store = MemoryStore::new();
    let hour = Duration::from_secs(3600);
    let Acquire::Acquired(lease) = store.acquire(&shard0_key(0), &FP, hour, hour).await.unwrap() else {
        panic!("not acquired")
    };
    // Completing with a retention shorter than the lease moves the record's expiry closer.
    let ms = Duration::from_millis(1);
    assert_eq!(store.complete(&shard0_key(0), &lease.token, Bytes::new(), ms).await.unwrap(), Transition::Ok);
    tokio::time::advance(2 * ms).await;
    for n in 1..=SWEEP_EVERY as u32 {
        store.acquire(&shard0_key(n), &FP, hour, hour).await.unwrap();
    }
    assert_eq!(store.len(), SWEEP_EVERY, "the expired record was swept by the shard's writes");
    assert!(matches!(store.acquire(&shard0_key(0), &FP, hour, hour).await.unwrap(), Acquire::Acquired(_)));
}

#[tokio::test(start_paused = true)]
async fn expired_records_are_swept_and_capacity_holds() {
    let store = MemoryStore::with_capacity(2);
    for i in 0..2 {
        assert!(matches!(store.acquire(&key(i), &FP, SEC, SEC).await.unwrap(), Acquire::Acquired(_)));
    }
    let err = store.acquire(&key(9), &FP, SEC, SEC).await.unwrap_err();
    assert!(matches!(err, Error::Full { capacity: 2, .. }), "{err}");
    tokio::time::advance(2 * SEC).await;
    assert!(matches!(store.acquire(&key(9), &FP, SEC, SEC).await.unwrap(), Acquire::Acquired(_)));
    assert_eq!(store.len(), 1);
    store.sweep();
    assert_eq!(store.len(), 1);
    tokio::time::advance(2 * SEC).await;
    store.sweep();
    assert!(store.is_empty());
}
