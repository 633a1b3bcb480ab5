//! Contention workloads through the executor, for every shared store: many tasks on one key, and
//! many callers over many keys, each spread over several stores (pools) on the same records; and
//! two stores racing to resolve the same records that need attention.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use futures_util::future::join_all;
use idempotent_core::record::{Abandon, Acquire, Resolution, Resolved, Transition};
use idempotent_core::{Error, Fingerprint, Key, RunContext, SharedStore};
use tokio::sync::Barrier;

/// `tasks` tasks, task `t` on `stores[t % n]`, call one step with one payload at once; the
/// action (which takes 50 ms) must run once and every caller get its result. Answers the
/// fence every caller saw.
pub async fn one_key_runs_once(stores: &[SharedStore], tasks: usize) -> u64 {
    let runs = Arc::new(AtomicUsize::new(0));
    let handles: Vec<_> = (0..tasks)
        .map(|t| {
            let ctx = RunContext::new(stores[t % stores.len()].clone(), "race-1");
            let runs = runs.clone();
            tokio::spawn(async move {
                ctx.step("charge")
                    .run(&"once", |attempt| async move {
                        runs.fetch_add(1, Ordering::SeqCst);
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        Ok::<_, Error>(attempt.fence())
                    })
                    .await
                    .unwrap()
            })
        })
        .collect();
    let fences: Vec<u64> = join_all(handles).await.into_iter().map(Result::unwrap).collect();
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the action ran more than once");
    assert!(fences.iter().all(|f| *f == fences[0]), "callers saw different outcomes: {fences:?}");
    fences[0]
}

/// `callers` callers, caller `c` on `stores[c % n]`, each walk all `keys` keys from its own
/// starting point; every key's action must run exactly once, and every call return its result.
pub async fn every_key_runs_once(stores: &[SharedStore], keys: usize, callers: usize) {
    let runs: Arc<Vec<AtomicUsize>> = Arc::new((0..keys).map(|_| AtomicUsize::new(0)).collect());
    let handles: Vec<_> = (0..callers)
        .map(|caller| {
            let ctx = RunContext::new(stores[caller % stores.len()].clone(), "batch-1");
            let runs = runs.clone();
            tokio::spawn(async move {
                for i in (0..keys).map(|i| (i + caller * keys / callers) % keys) {
                    let runs = runs.clone();
                    let got: usize = ctx
                        .step("item")
                        .run(&i, |_| async move {
                            runs[i].fetch_add(1, Ordering::SeqCst);
                            Ok::<_, Error>(i * 10)
                        })
                        .await
                        .unwrap();
                    assert_eq!(got, i * 10);
                }
            })
        })
        .collect();
    for h in join_all(handles).await {
        h.unwrap();
    }
    let per_key: Vec<usize> = runs.iter().map(|r| r.load(Ordering::SeqCst)).collect();
    assert!(per_key.iter().all(|&n| n == 1), "a key ran other than once: {per_key:?}");
}

/// For each of `keys` keys, `a` takes the key and marks it needing attention; then `a` resolves it
/// as done (outcome `by-a`) while `b` resolves it as not done, both released by one barrier.
/// Exactly one of them must be answered [`Resolved::Ok`], and the record must then be as the
/// winner said: replayed with `by-a`, or taken afresh (attempt 2, not recovered).
pub async fn resolve_races_have_one_winner(a: &SharedStore, b: &SharedStore, keys: u32) {
    let fp = Fingerprint::from_bytes([3; 32]);
    let (lease, keep) = (Duration::from_secs(10), Duration::from_secs(60));
    let mut wins = [0u32; 2];
    for n in 0..keys {
        let mut bytes = [0x5e; 32];
        bytes[..4].copy_from_slice(&n.to_le_bytes());
        let key = Key::from_bytes(bytes);
        let Acquire::Acquired(grant) = a.acquire(&key, &fp, lease, keep).await.unwrap() else {
            panic!("key {n}: not acquired")
        };
        assert_eq!(a.abandon(&key, &grant.token, Abandon::NeedsAttention).await.unwrap(), Transition::Ok);
        let barrier = Arc::new(Barrier::new(2));
        let racer = |store: &SharedStore, resolution: Resolution| {
            let (store, barrier) = (store.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                store.resolve(&key, resolution).await.unwrap()
            })
        };
        let done = Resolution::Done { outcome: Bytes::from_static(b"by-a"), retention: keep };
        let (by_a, by_b) = (racer(a, done), racer(b, Resolution::NotDone));
        let answers = [by_a.await.unwrap(), by_b.await.unwrap()];
        let winners: Vec<usize> = (0..2).filter(|&i| answers[i] == Resolved::Ok).collect();
        assert_eq!(winners.len(), 1, "key {n}: resolves answered {answers:?}");
        assert!(answers.contains(&Resolved::Unchanged), "key {n}: {answers:?}");
        wins[winners[0]] += 1;
        match (winners[0], b.acquire(&key, &fp, lease, keep).await.unwrap()) {
            (0, Acquire::Replay(r)) => assert_eq!(r, Bytes::from_static(b"by-a"), "key {n}"),
            (1, Acquire::Acquired(next)) => {
                assert_eq!((next.attempt.number(), next.attempt.recovered()), (2, false), "key {n}");
                assert!(next.attempt.fence() > grant.attempt.fence(), "key {n}: the fence must grow");
            }
            (w, other) => panic!("key {n}: resolved by store {w}, then acquire answered {other:?}"),
        }
    }
    tracing::debug!(?wins, "resolve races won by a, by b");
}
