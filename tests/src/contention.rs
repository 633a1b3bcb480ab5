//! Contention workloads through the executor, for every shared store: many tasks on one key, and
//! many callers over many keys, each spread over several stores (pools) on the same records.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use futures_util::future::join_all;
use idempotent_core::{Error, RunContext, SharedStore};

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
