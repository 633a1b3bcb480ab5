//! `IdempotencyLayer` in front of an axum handler, against the bare handler and against handlers
//! that make the same Redis round trips themselves, driven over loopback from the same process.
//!
//! ```text
//! cargo run --release -p idempotent-benches --bin http_bench [-- --secs 1 --rounds 3 --concurrency 1,64]
//! cargo run --release -p idempotent-benches --bin http_bench -- --rss
//! ```
//!
//! The load generator is a Rust client in this binary: `--concurrency` HTTP/1.1 connections
//! (hyper's client connection over `TcpStream`, `TCP_NODELAY` on both sides), each sending one
//! request after another with a ~200-byte JSON body until the row's time is up. Every server is
//! the same axum app served by `axum::serve` on 127.0.0.1; the handler reads the body and answers
//! 201 with a small JSON document. Rows:
//!
//! - bare axum: the handler alone (the baseline for the layer on `MemoryStore`);
//! - the layer on `MemoryStore` and on `RedisStore`: first request (a new `Idempotency-Key`
//!   every request: acquire, handler, store the response) and replay (each connection repeats
//!   its own key, stored during warm-up: one acquire, the handler not called);
//! - floors for Redis: the handler making one raw round trip itself (`GET`, the floor of the
//!   replay path) or two (`SET NX` + `SET`, the floor of the first-request path), through the
//!   same client setup as the store (deadpool, `pool` multiplexed connections, round-robin).
//!
//! Rows are interleaved round by round, as in `redis_bench`; requests/s is the median of the
//! rounds, p50/p99 are over all rounds' requests.
//!
//! `--rss` instead measures peak memory (`VmHWM`): requests with 1 MiB bodies through the layer
//! (under its 2 MiB default cap), then bodies of 8 MiB (over it: 413), with and without a
//! `Content-Length`, reporting the peak after each phase.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use axum::serve::ListenerExt;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Frame;
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use idempotent_benches::{
    REDIS_TIMEOUT, RawRedis, Refund, RunOptions, Sample, arg, flag, interleaved, peak_rss_kib, rss_kib,
};
use idempotent_core::redis::{self, Value};
use idempotent_core::{MemoryStore, RedisStore};
use idempotent_tests::RedisServer;
use idempotent_tower::IdempotencyLayer;
use tokio::net::{TcpListener, TcpStream};

/// Keys of the two-round-trip floor: a new one per request.
static FLOOR_SEQ: AtomicU64 = AtomicU64::new(0);
const RESPONSE: &str = r#"{"refund_id":"re_3PqX7yLkd82Hf0Zs1mN4","status":"succeeded"}"#;

async fn handler(body: Bytes) -> (StatusCode, [(&'static str, &'static str); 1], &'static str) {
    std::hint::black_box(&body);
    (StatusCode::CREATED, [("content-type", "application/json")], RESPONSE)
}

/// The handler, after one raw Redis round trip: what a hand-written idempotency check costs at
/// the least (look the key up; here the value is always found).
async fn one_round_trip(State(raw): State<Arc<RawRedis>>, body: Bytes) -> (StatusCode, Vec<u8>) {
    std::hint::black_box(&body);
    let v: Value = redis::cmd("GET").arg("floor:response").query_async(&mut raw.conn()).await.expect("GET");
    let Value::BulkString(stored) = v else { panic!("floor:response missing") };
    (StatusCode::CREATED, stored)
}

/// The handler between two raw Redis round trips: claim a key, run, store the response.
async fn two_round_trips(State(raw): State<Arc<RawRedis>>, body: Bytes) -> (StatusCode, &'static str) {
    let key = format!("floor:http:{}", FLOOR_SEQ.fetch_add(1, Ordering::Relaxed));
    std::hint::black_box(&body);
    raw.set_nx_then_set(&key, &[b'c'; 120], RESPONSE.as_bytes()).await;
    (StatusCode::CREATED, RESPONSE)
}

async fn serve(app: Router) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

async fn connect<B>(addr: SocketAddr) -> SendRequest<B>
where
    B: hyper::body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let stream = TcpStream::connect(addr).await.expect("connect to the bench server");
    stream.set_nodelay(true).unwrap();
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.unwrap();
    tokio::spawn(async move {
        let _ = conn.await;
    });
    sender
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Keys {
    /// A new key every request.
    Unique,
    /// Each connection repeats one key of its own.
    PerConnection,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Row {
    Bare,
    MemoryFirst,
    MemoryReplay,
    RedisFirst,
    RedisReplay,
    FloorOne,
    FloorTwo,
}

impl Row {
    const ALL: [Row; 7] = [
        Row::Bare,
        Row::MemoryFirst,
        Row::MemoryReplay,
        Row::RedisFirst,
        Row::RedisReplay,
        Row::FloorOne,
        Row::FloorTwo,
    ];

    fn label(self) -> &'static str {
        match self {
            Row::Bare => "bare axum handler (no layer)",
            Row::MemoryFirst => "layer + MemoryStore, first request",
            Row::MemoryReplay => "layer + MemoryStore, replay",
            Row::RedisFirst => "layer + RedisStore, first request",
            Row::RedisReplay => "layer + RedisStore, replay",
            Row::FloorOne => "floor: handler + 1 raw Redis round trip (GET)",
            Row::FloorTwo => "floor: handler + 2 raw Redis round trips (SET NX + SET)",
        }
    }

    fn keys(self) -> Keys {
        match self {
            Row::MemoryReplay | Row::RedisReplay => Keys::PerConnection,
            _ => Keys::Unique,
        }
    }

    /// The row this one is divided by, and the target ratio if the issue sets one.
    fn baseline(self) -> Option<(Row, Option<f64>)> {
        match self {
            Row::MemoryFirst | Row::MemoryReplay => Some((Row::Bare, Some(0.85))),
            Row::RedisReplay => Some((Row::FloorOne, Some(0.8))),
            Row::RedisFirst => Some((Row::FloorTwo, None)),
            _ => None,
        }
    }
}

static KEY_SEQ: AtomicU64 = AtomicU64::new(0);

/// `concurrency` connections, each sending requests back to back for `duration`.
async fn load(
    addr: SocketAddr,
    concurrency: usize,
    duration: Duration,
    keys: Keys,
    body: Bytes,
    expect: StatusCode,
) -> Sample {
    let mut senders = Vec::with_capacity(concurrency);
    for _ in 0..concurrency {
        senders.push(connect::<Full<Bytes>>(addr).await);
    }
    let start = Instant::now();
    let deadline = start + duration;
    let tasks: Vec<_> = senders
        .into_iter()
        .enumerate()
        .map(|(task, mut sender)| {
            let body = body.clone();
            tokio::spawn(async move {
                let mut latencies = Vec::with_capacity(16 * 1024);
                loop {
                    let t0 = Instant::now();
                    if t0 >= deadline {
                        break;
                    }
                    let key = match keys {
                        Keys::Unique => format!("k-{}", KEY_SEQ.fetch_add(1, Ordering::Relaxed)),
                        Keys::PerConnection => format!("replay-{task}"),
                    };
                    let req = hyper::Request::post("/refunds")
                        .header("host", "bench")
                        .header("content-type", "application/json")
                        .header("idempotency-key", key)
                        .body(Full::new(body.clone()))
                        .unwrap();
                    sender.ready().await.expect("connection closed");
                    let resp = sender.send_request(req).await.expect("request failed");
                    let status = resp.status();
                    let bytes = resp.into_body().collect().await.expect("response body").to_bytes();
                    assert_eq!(status, expect, "unexpected response: {}", String::from_utf8_lossy(&bytes));
                    latencies.push(t0.elapsed().as_nanos() as u64);
                }
                latencies
            })
        })
        .collect();
    let mut sample = Sample::default();
    for t in tasks {
        sample.latencies_ns.append(&mut t.await.expect("a load task panicked"));
    }
    sample.elapsed = start.elapsed();
    sample.calls = sample.latencies_ns.len() as u64;
    sample
}

struct Servers {
    bare: SocketAddr,
    memory: SocketAddr,
    redis: SocketAddr,
    floor_one: SocketAddr,
    floor_two: SocketAddr,
}

impl Servers {
    fn addr(&self, row: Row) -> SocketAddr {
        match row {
            Row::Bare => self.bare,
            Row::MemoryFirst | Row::MemoryReplay => self.memory,
            Row::RedisFirst | Row::RedisReplay => self.redis,
            Row::FloorOne => self.floor_one,
            Row::FloorTwo => self.floor_two,
        }
    }
}

fn app() -> Router {
    Router::new().route("/refunds", post(handler))
}

fn main() {
    if flag("--rss") {
        return rss();
    }
    println!("{}", idempotent_benches::metrics_setup());
    let opts = RunOptions::from_args();
    let (duration, warmup, rt) = (opts.duration(), opts.warmup(), opts.runtime());
    let RunOptions { secs, rounds, pool, workers, concurrencies, only } = opts;

    let server = RedisServer::start();
    let body = Bytes::from(serde_json::to_vec(&Refund::new(7)).unwrap());
    let servers = rt.block_on(async {
        let store =
            RedisStore::builder(server.url()).pool_size(pool).command_timeout(REDIS_TIMEOUT).connect_lazy().unwrap();
        store.warm_up().await.expect("warm up the store");
        let raw = Arc::new(RawRedis::connect(&server.url(), pool).await);
        let _: () = redis::cmd("SET").arg("floor:response").arg(RESPONSE).query_async(&mut raw.conn()).await.unwrap();
        Servers {
            bare: serve(app()).await,
            memory: serve(app().layer(IdempotencyLayer::new(MemoryStore::new()))).await,
            redis: serve(app().layer(IdempotencyLayer::new(store))).await,
            floor_one: serve(Router::new().route("/refunds", post(one_round_trip)).with_state(raw.clone())).await,
            floor_two: serve(Router::new().route("/refunds", post(two_round_trips)).with_state(raw)).await,
        }
    });

    let rows: Vec<(usize, Row, &str)> = Row::ALL
        .iter()
        .copied()
        .enumerate()
        .filter(|(_, r)| r.label().contains(&only))
        .map(|(idx, r)| (idx, r, r.label()))
        .collect();
    let started = Instant::now();
    let table = interleaved(rounds, &concurrencies, &rows, "req/s", |concurrency, row, measured| {
        let time = if measured { duration } else { warmup };
        rt.block_on(load(servers.addr(row), concurrency, time, row.keys(), body.clone(), StatusCode::CREATED))
    });

    println!(
        "\nhttp_bench: axum on 127.0.0.1, HTTP/1.1 keep-alive, {}-byte JSON request body, redis-server on loopback \
         (RedisStore pool_size {pool}), tokio {workers} workers shared by client and servers, {rounds} rounds × {secs} s \
         per row (interleaved), {:.0} s total\n",
        body.len(),
        started.elapsed().as_secs_f64()
    );
    let rate = |c: usize, row: Row| {
        let idx = Row::ALL.iter().position(|&r| r == row).unwrap();
        table.get(&(c, idx)).map(|m| m.rounds.median_rate())
    };
    let mut verdicts = Vec::new();
    for &concurrency in &concurrencies {
        println!("concurrency {concurrency} (connections)\n");
        println!(
            "| row | requests/s (median) | min–max of rounds | p50 µs | p99 µs | process CPU µs/request | ÷ baseline |"
        );
        println!("|---|--:|--:|--:|--:|--:|--:|");
        for m in table.range((concurrency, 0)..(concurrency + 1, 0)).map(|(_, m)| m) {
            let ratio = m.row.baseline().and_then(|(base, target)| {
                let r = rate(concurrency, m.row)? / rate(concurrency, base)?;
                if let Some(t) = target {
                    verdicts.push(format!(
                        "- c={concurrency} {}: {r:.2}× {} (target ≥ {t}: {})",
                        m.row.label(),
                        base.label(),
                        if r >= t { "met" } else { "MISSED" }
                    ));
                }
                Some(format!("{r:.2} (÷ {})", short(base)))
            });
            println!("| {} | {} | {} |", m.row.label(), m.cells(), ratio.unwrap_or_default());
        }
        println!();
    }
    println!("Targets:");
    for v in verdicts {
        println!("{v}");
    }
}

fn short(row: Row) -> &'static str {
    match row {
        Row::Bare => "bare",
        Row::FloorOne => "1 round trip",
        Row::FloorTwo => "2 round trips",
        _ => "?",
    }
}

/// Peak RSS with 1 MiB bodies under the cap, then 8 MiB bodies over it.
fn rss() {
    let concurrency: usize = arg("--concurrency", 16);
    let requests: usize = arg("--requests", 2000);
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    let addr = rt.block_on(serve(app().layer(IdempotencyLayer::new(MemoryStore::new()))));
    let mib = |kib: Option<u64>| kib.unwrap_or(0) as f64 / 1024.0;
    println!(
        "http_bench --rss: layer (default caps: request body 2 MiB, stored response 1 MiB) on MemoryStore, \
         {concurrency} connections\n"
    );
    println!("| phase | requests | responses | peak RSS (VmHWM) | RSS after |");
    println!("|---|--:|---|--:|--:|");
    println!("| start (server up, nothing sent) | 0 | | {:.1} MiB | {:.1} MiB |", mib(peak_rss_kib()), mib(rss_kib()));
    for (label, size, chunked, expect, n) in [
        ("1 MiB bodies (octet-stream, Content-Length), unique keys", 1 << 20, false, StatusCode::CREATED, requests),
        (
            "8 MiB bodies with Content-Length (refused before reading)",
            8 << 20,
            false,
            StatusCode::PAYLOAD_TOO_LARGE,
            requests / 4,
        ),
        (
            "8 MiB chunked bodies, no length (cap enforced while reading)",
            8 << 20,
            true,
            StatusCode::PAYLOAD_TOO_LARGE,
            requests / 4,
        ),
        (
            "32 MiB chunked bodies, no length (no growth with body size)",
            32 << 20,
            true,
            StatusCode::PAYLOAD_TOO_LARGE,
            requests / 8,
        ),
    ] {
        let (ok, errors) = rt.block_on(send_n(addr, concurrency, n, size, chunked, expect));
        println!(
            "| {label} | {n} | {ok} × {} {} | {:.1} MiB | {:.1} MiB |",
            expect.as_u16(),
            if errors > 0 { format!("+ {errors} connection resets") } else { String::new() },
            mib(peak_rss_kib()),
            mib(rss_kib())
        );
    }
}

const CHUNK: &[u8] = &[b'x'; 64 * 1024];

/// Sends `n` requests with bodies of `size` bytes over `concurrency` connections (a new
/// connection after a reset: a server may close the connection after refusing an oversized body
/// it did not read). A `chunked` body has no `Content-Length`, so the server cannot refuse it up
/// front.
async fn send_n(
    addr: SocketAddr,
    concurrency: usize,
    n: usize,
    size: usize,
    chunked: bool,
    expect: StatusCode,
) -> (usize, usize) {
    let chunk = Bytes::from_static(CHUNK);
    let next = Arc::new(AtomicUsize::new(0));
    let tasks: Vec<_> = (0..concurrency)
        .map(|_| {
            let (next, chunk) = (next.clone(), chunk.clone());
            tokio::spawn(async move {
                let (mut ok, mut errors) = (0, 0);
                let mut sender = connect::<BoxBody<Bytes, Infallible>>(addr).await;
                while next.fetch_add(1, Ordering::Relaxed) < n {
                    // The same 64 KiB chunk over and over: the client holds no large buffer, so
                    // the peak RSS is the server's.
                    let chunk = chunk.clone();
                    let frames = (0..size / CHUNK.len()).map(move |_| Ok::<_, Infallible>(Frame::data(chunk.clone())));
                    let mut req = hyper::Request::post("/refunds")
                        .header("host", "bench")
                        .header("content-type", "application/octet-stream")
                        .header("idempotency-key", format!("big-{}", KEY_SEQ.fetch_add(1, Ordering::Relaxed)));
                    if !chunked {
                        req = req.header("content-length", size);
                    }
                    let req = req.body(StreamBody::new(futures_util::stream::iter(frames)).boxed()).unwrap();
                    let sent = match sender.ready().await {
                        Ok(()) => sender.send_request(req).await,
                        Err(e) => Err(e),
                    };
                    match sent {
                        Ok(resp) => {
                            let status = resp.status();
                            let _ = resp.into_body().collect().await;
                            assert_eq!(status, expect);
                            ok += 1;
                        }
                        Err(_) => {
                            errors += 1;
                            sender = connect(addr).await;
                        }
                    }
                }
                (ok, errors)
            })
        })
        .collect();
    let mut total = (0, 0);
    for t in tasks {
        let (ok, errors) = t.await.unwrap();
        total.0 += ok;
        total.1 += errors;
    }
    total
}
