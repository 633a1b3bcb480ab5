//! Hedged `POST`s under the key layer against a server with a slow tail: p50/p99 with and
//! without hedging, hedges sent, and effects per logical request (must be exactly 1).
//!
//! ```text
//! cargo run --release -p idempotent-benches --bin hedge_bench [-- --requests 2000 --concurrency 8 --tail-ms 200 --tail-pct 5]
//! ```
//!
//! The server is axum with `IdempotencyLayer` (`MemoryStore`, `OnInFlight::Wait`) on 127.0.0.1.
//! Each request that arrives is slow with probability `--tail-pct` (seeded, per arrival, so a
//! hedge is slow or fast on its own draw), in one of two places:
//!
//! - `front`: before the idempotency layer (a queue, a slow connection, a paused worker). The
//!   hedge can overtake the slow copy: it takes the key and runs the effect, and the slow copy
//!   replays it when it arrives.
//! - `handler`: inside the handler, which holds the key meanwhile. A hedge can only wait for it.
//!
//! The client is hyper's pooled client under `IdempotencyKeyLayer`, either direct (the
//! baseline) or through tower's `Hedge` (`HedgeLayer`: p90 of the last full 1 s period, after 20
//! data points; 1.2 s of warm-up requests are not timed) behind a `Buffer`, so that the workers share one latency histogram. `--concurrency`
//! workers send `--requests` logical requests in total, one after another each. The ratio column
//! is hedged p99 ÷ baseline p99 in the same run. Exits non-zero if any logical request had other
//! than exactly one effect.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::{Request as AxumRequest, State};
use axum::middleware::{Next, from_fn_with_state};
use axum::response::Response as AxumResponse;
use axum::routing::post;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use idempotent_benches::arg;
use idempotent_core::{MemoryStore, OnInFlight};
use idempotent_tower::IdempotencyKeyLayer;
use idempotent_tower::client::hedge::{HedgeLayer, HedgePolicy};
use idempotent_tower::server::IdempotencyLayer;
use tokio::net::TcpListener;
use tower::buffer::Buffer;
use tower::util::BoxCloneSyncService;
use tower::{BoxError, ServiceBuilder, ServiceExt};

type HttpService = BoxCloneSyncService<Request<Full<Bytes>>, Response<Incoming>, BoxError>;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Place {
    Front,
    Handler,
}

#[derive(Clone)]
struct Server {
    place: Place,
    tail_pct: u32,
    tail: Duration,
    rng: Arc<Mutex<fastrand::Rng>>,
    /// order → effects (refunds made).
    effects: Arc<Mutex<HashMap<u64, u32>>>,
    arrivals: Arc<AtomicU64>,
}

impl Server {
    fn slow(&self) -> bool {
        self.rng.lock().unwrap().u32(0..100) < self.tail_pct
    }
}

async fn front(State(server): State<Server>, request: AxumRequest, next: Next) -> AxumResponse {
    server.arrivals.fetch_add(1, Ordering::Relaxed);
    if server.place == Place::Front && server.slow() {
        tokio::time::sleep(server.tail).await;
    }
    // In a task of its own, as many servers run a request: a copy whose client went away (the
    // hedge took the other answer) still runs, and is counted.
    tokio::spawn(next.run(request)).await.unwrap()
}

async fn refund(State(server): State<Server>, body: Bytes) -> (axum::http::StatusCode, String) {
    if server.place == Place::Handler && server.slow() {
        tokio::time::sleep(server.tail).await;
    }
    let order: u64 = std::str::from_utf8(&body).unwrap().trim().parse().unwrap();
    *server.effects.lock().unwrap().entry(order).or_insert(0) += 1;
    (axum::http::StatusCode::CREATED, format!("{{\"refund\":\"re_{order}\"}}"))
}

async fn start_server(server: Server) -> SocketAddr {
    let app = Router::new()
        .route("/refunds", post(refund))
        .with_state(server.clone())
        .layer(
            IdempotencyLayer::new(MemoryStore::new())
                .on_in_flight(OnInFlight::Wait { timeout: Duration::from_secs(10) }),
        )
        .layer(from_fn_with_state(server, front));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

struct Row {
    latencies: Vec<Duration>,
    hedges: u64,
    arrivals: u64,
    /// Logical requests sent, warm-up included.
    sent: u64,
    wrong_effects: usize,
}

/// Longer than the hedge's period, so that its histogram has a full period to read.
const WARM_UP: Duration = Duration::from_millis(1200);
const PERIOD: Duration = Duration::from_secs(1);

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1]
}

fn ms(d: Duration) -> String {
    format!("{:.2}", d.as_secs_f64() * 1000.0)
}

async fn run(
    place: Place,
    hedged: bool,
    requests: u64,
    concurrency: u64,
    tail_pct: u32,
    tail: Duration,
    seed: u64,
) -> Row {
    let server = Server {
        place,
        tail_pct,
        tail,
        rng: Arc::new(Mutex::new(fastrand::Rng::with_seed(seed))),
        effects: Arc::default(),
        arrivals: Arc::default(),
    };
    let addr = start_server(server.clone()).await;
    let http = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let policy = HedgePolicy::new();
    let client: HttpService = if hedged {
        let hedge = HedgeLayer::new().percentile(0.9).min_data_points(20).period(PERIOD).policy(policy.clone());
        let stack = ServiceBuilder::new().layer(IdempotencyKeyLayer::new()).layer(hedge).service(http);
        BoxCloneSyncService::new(Buffer::new(stack, 1024))
    } else {
        BoxCloneSyncService::new(
            ServiceBuilder::new().layer(IdempotencyKeyLayer::new()).service(http).map_err(BoxError::from),
        )
    };

    // tower's hedge reads the latencies of the last *full* period: nothing is hedged in the first
    // one. Requests of the warm-up period count for the effects, not for the latencies.
    let warm_until = Instant::now() + WARM_UP;
    let (next, measured, sent) =
        (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let mut workers = Vec::new();
    for _ in 0..concurrency {
        let (client, next, measured, sent) = (client.clone(), next.clone(), measured.clone(), sent.clone());
        workers.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            loop {
                let measuring = Instant::now() >= warm_until;
                if measuring && measured.fetch_add(1, Ordering::Relaxed) >= requests {
                    return latencies;
                }
                let order = next.fetch_add(1, Ordering::Relaxed);
                let request =
                    Request::post(format!("http://{addr}/refunds")).body(Full::from(order.to_string())).unwrap();
                let started = Instant::now();
                let response = client.clone().oneshot(request).await.expect("a response");
                assert!(response.status().is_success(), "order {order}: {}", response.status());
                response.into_body().collect().await.unwrap();
                if measuring {
                    latencies.push(started.elapsed());
                }
                sent.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    let mut latencies = Vec::new();
    for worker in workers {
        latencies.extend(worker.await.unwrap());
    }
    // Let copies whose client went away finish (each is at most one tail long).
    tokio::time::sleep(tail * 2).await;
    latencies.sort();
    let sent = sent.load(Ordering::Relaxed);
    let effects = server.effects.lock().unwrap();
    let wrong_effects = (0..sent).filter(|order| effects.get(order).copied() != Some(1)).count()
        + effects.len().saturating_sub(sent as usize);
    Row { latencies, hedges: policy.hedges(), arrivals: server.arrivals.load(Ordering::Relaxed), sent, wrong_effects }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let requests: u64 = arg("--requests", 2000);
    let concurrency: u64 = arg("--concurrency", 8);
    let tail_ms: u64 = arg("--tail-ms", 200);
    let tail_pct: u32 = arg("--tail-pct", 5);
    let tail = Duration::from_millis(tail_ms);
    println!(
        "hedge_bench: {requests} POSTs with keys, {concurrency} workers, {tail_pct}% of arrivals +{tail_ms} ms; \
         hedge after p90 of the last 1 s period (min 20 data points), {WARM_UP:?} warm-up; server OnInFlight::Wait"
    );
    println!(
        "{:<9} {:<9} {:>8} {:>8} {:>9} {:>10} {:>9} {:>9} {:>13} {:>13}",
        "tail",
        "client",
        "p50 ms",
        "p99 ms",
        "p99.9 ms",
        "p99 ratio",
        "requests",
        "hedges",
        "arrivals/req",
        "effects != 1"
    );
    let mut failed = false;
    for (place, name) in [(Place::Front, "front"), (Place::Handler, "handler")] {
        let mut baseline_p99 = None;
        for hedged in [false, true] {
            let row = run(place, hedged, requests, concurrency, tail_pct, tail, 7).await;
            let p99 = percentile(&row.latencies, 0.99);
            let base = *baseline_p99.get_or_insert(p99);
            println!(
                "{:<9} {:<9} {:>8} {:>8} {:>9} {:>10.2} {:>9} {:>9} {:>13.3} {:>13}",
                name,
                if hedged { "hedged" } else { "baseline" },
                ms(percentile(&row.latencies, 0.50)),
                ms(p99),
                ms(percentile(&row.latencies, 0.999)),
                p99.as_secs_f64() / base.as_secs_f64(),
                row.sent,
                row.hedges,
                row.arrivals as f64 / row.sent as f64,
                row.wrong_effects,
            );
            failed |= row.wrong_effects > 0;
        }
    }
    if failed {
        eprintln!("some logical request did not have exactly one effect");
        std::process::exit(1);
    }
}
