//! `MemoryStore` through the executor: first execution and replay, against floors.
//!
//! - `floor: HashMap` is a `Mutex<HashMap>` doing the same map work (first execution: insert a
//!   running entry, then overwrite it with the result; replay: one lookup and a clone).
//! - `floor: serde_json+sha256+HashMap` adds what any idempotent wrapper must also do: serialize
//!   and hash the payload for the key, encode the result (first execution) or decode it (replay).
//!   This is the honest floor for the executor rows.
//! - `store only` calls `MemoryStore` directly with a precomputed key, to split store cost from
//!   executor cost; `part:` rows time single ingredients.
//!
//! First executions use a unique payload every iteration. So that the map does not grow to
//! millions of records over a criterion run (which would measure cache misses, not the code),
//! those rows use a 1 ms retention and the store's own sweep drops old records; the floor map is
//! cleared at a similar size.

// `criterion_group!` generates an undocumented `pub fn`.
#![allow(missing_docs)]

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use criterion::{Criterion, black_box, criterion_group, criterion_main};
use idempotent_benches::{Refund, RefundResult};
use idempotent_core::record::{Acquire, Token};
use idempotent_core::{Error, Fingerprint, Key, KeyScope, MemoryStore, RunContext, Store};
use sha2::{Digest, Sha256};

const REPLAY_KEYS: u64 = 1024;
const FLOOR_MAP_LIMIT: usize = 32 * 1024;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

fn replay_ran_the_action() -> Result<RefundResult, Error> {
    panic!("a replay ran the action")
}

fn floor_key(payload: &Refund) -> [u8; 32] {
    Sha256::digest(serde_json::to_vec(payload).unwrap()).into()
}

fn first_execution(c: &mut Criterion) {
    let rt = runtime();
    let mut g = c.benchmark_group("memory_store/first_execution");
    let seq = AtomicU64::new(0);
    let next = || seq.fetch_add(1, Ordering::Relaxed);

    for heartbeat in [true, false] {
        let ctx = RunContext::new(MemoryStore::new(), "run-bench");
        let name = if heartbeat { "ours: executor (heartbeat on, default)" } else { "ours: executor (heartbeat off)" };
        g.bench_function(name, |b| {
            b.to_async(&rt).iter(|| {
                let payload = Refund::new(next());
                let ctx = &ctx;
                async move {
                    let r: RefundResult = ctx
                        .step("issue_refund")
                        .retention(Duration::from_millis(1))
                        .heartbeat(heartbeat)
                        .run(&payload, |_| async { Ok::<_, Error>(RefundResult::sample()) })
                        .await
                        .unwrap();
                    black_box(r)
                }
            })
        });
    }

    let store = MemoryStore::new();
    let fp = Fingerprint::from_bytes([7; 32]);
    let result = Bytes::from(serde_json::to_vec(&RefundResult::sample()).unwrap());
    g.bench_function("store only: acquire + complete", |b| {
        b.to_async(&rt).iter(|| {
            let mut k = [0u8; 32];
            k[..8].copy_from_slice(&next().to_le_bytes());
            k[8] = 1;
            let (store, result) = (&store, result.clone());
            async move {
                let key = Key::from_bytes(k);
                let Acquire::Acquired(lease) =
                    store.acquire(&key, &fp, Duration::from_secs(60), Duration::from_millis(1)).await.unwrap()
                else {
                    panic!("not acquired")
                };
                black_box(store.complete(&key, &lease.token, result, Duration::from_millis(1)).await.unwrap())
            }
        })
    });

    g.bench_function("part: Token::unique (process prefix + counter)", |b| b.iter(|| black_box(Token::unique())));
    g.bench_function(
        "part: tokio::spawn + await (what settling the outcome in a task cost; now awaited inline)",
        |b| b.to_async(&rt).iter(|| async { black_box(tokio::spawn(async { 1u8 }).await.unwrap()) }),
    );

    let map: Mutex<HashMap<[u8; 32], Bytes>> = Mutex::new(HashMap::new());
    g.bench_function("floor: serde_json+sha256+HashMap", |b| {
        b.iter(|| {
            let payload = Refund::new(next());
            let key = floor_key(&payload);
            {
                let mut m = map.lock().unwrap();
                if m.len() >= FLOOR_MAP_LIMIT {
                    m.clear();
                }
                m.insert(key, Bytes::new());
            }
            let value = black_box(RefundResult::sample());
            let encoded = Bytes::from(serde_json::to_vec(&value).unwrap());
            map.lock().unwrap().insert(key, encoded);
            black_box(value)
        })
    });
    let map: Mutex<HashMap<[u8; 32], Bytes>> = Mutex::new(HashMap::new());
    g.bench_function("part: HashMap only (no key derivation, no result encoding)", |b| {
        b.iter(|| {
            let mut key = [0u8; 32];
            key[..8].copy_from_slice(&next().to_le_bytes());
            {
                let mut m = map.lock().unwrap();
                if m.len() >= FLOOR_MAP_LIMIT {
                    m.clear();
                }
                m.insert(key, Bytes::new());
            }
            map.lock().unwrap().insert(key, result.clone());
        })
    });
    g.finish();
}

fn replay(c: &mut Criterion) {
    let rt = runtime();
    let mut g = c.benchmark_group("memory_store/replay");

    let ctx = RunContext::new(MemoryStore::new(), "run-bench");
    let payloads: Vec<Refund> = (0..REPLAY_KEYS).map(Refund::new).collect();
    rt.block_on(async {
        for p in &payloads {
            let _: RefundResult =
                ctx.step("issue_refund").run(p, |_| async { Ok::<_, Error>(RefundResult::sample()) }).await.unwrap();
        }
    });
    let mut i = 0usize;
    g.bench_function("ours: executor", |b| {
        b.to_async(&rt).iter(|| {
            i = (i + 1) % payloads.len();
            let (ctx, payload) = (&ctx, &payloads[i]);
            async move {
                let r: RefundResult =
                    ctx.step("issue_refund").run(payload, |_| async { replay_ran_the_action() }).await.unwrap();
                black_box(r)
            }
        })
    });

    let store = ctx.shared_store().clone();
    let scope = KeyScope::new("run-bench", "issue_refund");
    let keys: Vec<(Key, Fingerprint)> = payloads
        .iter()
        .map(|p| {
            let fp = Fingerprint::of(p).unwrap();
            (Key::from_identity_hash(&scope, &fp), fp)
        })
        .collect();
    let mut i = 0usize;
    g.bench_function("store only: acquire", |b| {
        b.to_async(&rt).iter(|| {
            i = (i + 1) % keys.len();
            let (store, (key, fp)) = (&store, &keys[i]);
            async move {
                let a = store.acquire(key, fp, Duration::from_secs(60), Duration::from_secs(86400)).await.unwrap();
                assert!(matches!(a, Acquire::Replay(_)));
                black_box(a)
            }
        })
    });

    let encoded = Bytes::from(serde_json::to_vec(&RefundResult::sample()).unwrap());
    let map: Mutex<HashMap<[u8; 32], Bytes>> =
        Mutex::new(payloads.iter().map(|p| (floor_key(p), encoded.clone())).collect());
    let mut i = 0usize;
    g.bench_function("floor: serde_json+sha256+HashMap", |b| {
        b.iter(|| {
            i = (i + 1) % payloads.len();
            let key = floor_key(black_box(&payloads[i]));
            let bytes = map.lock().unwrap().get(&key).cloned().unwrap();
            black_box(serde_json::from_slice::<RefundResult>(&bytes).unwrap())
        })
    });
    let raw_keys: Vec<[u8; 32]> = payloads.iter().map(floor_key).collect();
    let mut i = 0usize;
    g.bench_function("part: HashMap only (no key derivation, no result encoding)", |b| {
        b.iter(|| {
            i = (i + 1) % raw_keys.len();
            black_box(map.lock().unwrap().get(&raw_keys[i]).cloned().unwrap())
        })
    });
    g.finish();
}

criterion_group!(benches, first_execution, replay);
criterion_main!(benches);
