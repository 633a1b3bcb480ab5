//! The exactly-once checker over the tower layer: real HTTP requests to an axum server whose
//! `IdempotencyLayer` talks to Redis through the fault proxy.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::{Extension, State};
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use idempotent_core::RedisStore;
use idempotent_tests::history::{Completion, History, OpId};
use idempotent_tests::proxy::{Fault, FaultProxy};
use idempotent_tests::{RedisOptions, RedisServer};
use idempotent_tower::server::IDEMPOTENT_STORED;
use idempotent_tower::{Attempt, IdempotencyLayer};

type HttpClient = Client<HttpConnector, Full<bytes::Bytes>>;

/// The side effect: recorded in the history under the caller's op id, with the request's fence.
async fn effect(
    State(hist): State<History>,
    Extension(lease): Extension<Attempt>,
    headers: HeaderMap,
    body: String,
) -> (StatusCode, String) {
    let op: usize = headers["x-op"].to_str().unwrap().parse().unwrap();
    let (exec, value) = hist.effect_start(OpId::from_index(op), lease.fence());
    // Some requests take a while, so leases and faults overlap them.
    if body.ends_with('7') {
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    hist.effect_end(exec);
    (StatusCode::CREATED, value)
}

/// One HTTP call for `key`, classified as the client sees it.
async fn call(client: &HttpClient, url: &str, hist: &History, key: &str, final_pass: bool) -> Completion {
    let op = if final_pass { hist.invoke_final(key) } else { hist.invoke(key) };
    let req = http::Request::post(url)
        .header("idempotency-key", key)
        .header("x-op", op.index().to_string())
        .body(Full::from(format!("order {key}")))
        .unwrap();
    let outcome = match tokio::time::timeout(Duration::from_secs(5), client.request(req)).await {
        Err(_) => Completion::Indeterminate("client timeout".into()),
        Ok(Err(e)) => Completion::Indeterminate(format!("transport: {e}")),
        Ok(Ok(res)) => {
            let status = res.status();
            let not_stored = res.headers().get(IDEMPOTENT_STORED).is_some();
            let body = res.into_body().collect().await.map(|b| b.to_bytes());
            match (status.as_u16(), body) {
                (_, Err(e)) => Completion::Indeterminate(format!("body: {e}")),
                (200..=299, Ok(_)) if not_stored => Completion::Indeterminate("ran, not stored".into()),
                (200..=299, Ok(b)) => Completion::Ok(String::from_utf8_lossy(&b).into_owned()),
                // Refusals: the handler was not called.
                (400 | 409 | 413 | 422 | 503, Ok(_)) => Completion::Fail(status.to_string()),
                (_, Ok(b)) => Completion::Indeterminate(format!("{status}: {}", String::from_utf8_lossy(&b))),
            }
        }
    };
    hist.complete(op, outcome.clone());
    outcome
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_layer_under_store_faults_commits_each_request_once() {
    let secs: u64 = std::env::var("IDEMPOTENT_HTTP_NEMESIS_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(20);
    let server = RedisServer::start_with(RedisOptions { aof: true, ..Default::default() });
    let proxy = Arc::new(FaultProxy::start(([127, 0, 0, 1], server.port()).into()).await);
    let store = RedisStore::builder(proxy.url())
        .pool_size(2)
        .command_timeout(Duration::from_millis(400))
        .connect_lazy()
        .unwrap();
    let hist = History::new();
    let app = Router::new()
        .route("/refunds", post(effect))
        .with_state(hist.clone())
        .layer(IdempotencyLayer::new(store).lease(Duration::from_millis(600)));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/refunds", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let client: HttpClient = Client::builder(TokioExecutor::new()).build_http();

    // Workers alternate between new keys and retries of recent ones, so first executions keep
    // happening while the faults come and go.
    let all_keys = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    let mut workers = Vec::new();
    for w in 0..8u64 {
        let (client, url, hist, all_keys) = (client.clone(), url.clone(), hist.clone(), all_keys.clone());
        workers.push(tokio::spawn(async move {
            let mut x = (w + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
            let mut recent: Vec<String> = Vec::new();
            let mut n = 0;
            while tokio::time::Instant::now() < deadline {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let key = if recent.is_empty() || x % 2 == 0 {
                    n += 1;
                    let key = format!("w{w}-order-{n}");
                    all_keys.lock().unwrap().push(key.clone());
                    recent.push(key.clone());
                    if recent.len() > 8 {
                        recent.remove(0);
                    }
                    key
                } else {
                    recent[(x as usize / 2) % recent.len()].clone()
                };
                call(&client, &url, &hist, &key, false).await;
            }
        }));
    }
    let mut faults = 0;
    let mut x: u64 = 0x2545_F491_4F6C_DD1D;
    while tokio::time::Instant::now() < deadline {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let fault = match x % 5 {
            0 => Fault::Latency { min: Duration::from_millis(5), max: Duration::from_millis(150) },
            1 => Fault::Reset,
            2 => Fault::DropReplies,
            3 => Fault::Blackhole,
            _ => Fault::Pass,
        };
        proxy.set(fault);
        faults += 1;
        tokio::time::sleep(Duration::from_millis(100 + x % 400)).await;
        proxy.set(Fault::Pass);
        tokio::time::sleep(Duration::from_millis(100 + x % 300)).await;
    }
    for w in workers {
        w.await.unwrap();
    }
    proxy.set(Fault::Pass);

    // Final retry pass: every key until it answers 2xx (in-flight keys wait out their lease).
    let keys = all_keys.lock().unwrap().clone();
    let mut passes = Vec::new();
    for chunk in keys.chunks(keys.len().div_ceil(8).max(1)) {
        let (client, url, hist, chunk) = (client.clone(), url.clone(), hist.clone(), chunk.to_vec());
        passes.push(tokio::spawn(async move {
            for key in &chunk {
                let mut done = false;
                for _ in 0..100 {
                    if matches!(call(&client, &url, &hist, key, false).await, Completion::Ok(_)) {
                        done = matches!(call(&client, &url, &hist, key, true).await, Completion::Ok(_));
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                assert!(done, "{key} never answered 2xx after the faults healed");
            }
        }));
    }
    for p in passes {
        p.await.unwrap();
    }
    let report = match hist.check() {
        Ok(report) => report,
        Err((report, errors)) => panic!("the checker found violations ({report}):\n{}", errors.join("\n")),
    };
    println!("http nemesis: {secs} s, {faults} faults injected, {report}");
    assert_eq!(report.duplicates, 0);
    assert!(report.ok > 100, "the workers barely ran: {report}");
}
