//! A retrying HTTP client that refunds exactly once although the network loses replies.
//!
//! ```text
//! cargo run -p idempotent-examples --bin retrying_client   # SQLite file (the embedded default)
//! REDIS_URL=redis://127.0.0.1:6379 cargo run -p idempotent-examples --bin retrying_client   # Redis
//! DATABASE_URL=postgres://postgres@127.0.0.1/postgres cargo run -p idempotent-examples --bin retrying_client  # PostgreSQL
//! RUST_LOG=idempotent_tower=debug cargo run -p idempotent-examples --bin retrying_client   # every retry
//! ```
//!
//! Everything runs in this process, on loopback:
//!
//! ```text
//! client: IdempotencyKeyLayer ─► RetryLayer(HttpRetryPolicy) ─► hyper client
//!            │ one key per refund   │ retries lost replies with that key
//!            ▼                      ▼
//! flaky proxy: forwards each request, but loses the server's first reply for each key
//!            ▼
//! server: axum + IdempotencyLayer ─► POST /refunds (the side effect: a refund)
//! ```
//!
//! The server processes every refund on its first attempt, and the proxy throws that reply
//! away. The client sees a dropped connection, retries with the same `Idempotency-Key`, and the
//! server replays the stored response (`Idempotent-Replayed: true`) instead of refunding again.
//! The server's layer keeps its records in the examples' database
//! (`idempotent_examples::store_from_env`); each refund request gets a new random key.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::routing::post;
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use idempotent_core::SharedStore;
use idempotent_tower::retry::{Backoff, HttpRetryPolicy};
use idempotent_tower::{IdempotencyKeyLayer, IdempotencyLayer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tower::retry::RetryLayer;
use tower::{ServiceBuilder, ServiceExt};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The refund handler: every call is a real refund.
async fn refund(State(refunds): State<Arc<AtomicU32>>, body: String) -> (StatusCode, String) {
    let n = refunds.fetch_add(1, Ordering::SeqCst) + 1;
    (StatusCode::CREATED, format!("{{\"refund\":\"re_{n:04}\",\"for\":{body}}}"))
}

async fn start_server(store: SharedStore, refunds: Arc<AtomicU32>) -> std::io::Result<SocketAddr> {
    let app = Router::new().route("/refunds", post(refund)).with_state(refunds).layer(IdempotencyLayer::new(store));
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(addr)
}

/// A TCP proxy (one request per connection) that loses the first reply for each
/// `Idempotency-Key` it sees, after the server has processed the request.
async fn start_flaky_proxy(upstream: SocketAddr) -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let seen = Arc::new(Mutex::new(HashSet::new()));
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let seen = seen.clone();
            tokio::spawn(async move {
                if let Err(e) = relay(client, upstream, &seen).await {
                    eprintln!("proxy: {e}");
                }
            });
        }
    });
    Ok(addr)
}

async fn relay(mut client: TcpStream, upstream: SocketAddr, seen: &Mutex<HashSet<String>>) -> std::io::Result<()> {
    let mut head = Vec::new();
    let mut buf = vec![0u8; 16 * 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = client.read(&mut buf).await?;
        if n == 0 {
            return Ok(());
        }
        head.extend_from_slice(&buf[..n]);
    }
    let key = String::from_utf8_lossy(&head)
        .lines()
        .find_map(|line| line.to_ascii_lowercase().strip_prefix("idempotency-key:").map(|k| k.trim().to_owned()));
    let lose_reply = key.is_some_and(|key| seen.lock().unwrap().insert(key));

    let mut server = TcpStream::connect(upstream).await?;
    server.write_all(&head).await?;
    if !lose_reply {
        tokio::io::copy_bidirectional(&mut client, &mut server).await?;
        return Ok(());
    }
    let (mut client_read, client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let rest_of_request = tokio::spawn(async move { tokio::io::copy(&mut client_read, &mut server_write).await });
    // The server's reply starts: the refund has been made. Hang up on the client instead.
    let started = server_read.read(&mut buf).await? > 0;
    rest_of_request.abort();
    if !started {
        return Ok(());
    }
    drop(client_write);
    println!("proxy:  lost the server's reply to the first attempt");
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    idempotent_examples::logs().init();
    let (store, describe) = idempotent_examples::store_from_env().await?;
    println!("server: records in {describe}");

    let refunds = Arc::new(AtomicU32::new(0));
    let server = start_server(store, refunds.clone()).await?;
    let proxy = start_flaky_proxy(server).await?;

    // The client stack. The key layer is OUTSIDE the retry layer: it stamps the key once, and
    // tower's Retry resends that same request (key included) on each attempt.
    let http = Client::builder(TokioExecutor::new()).pool_max_idle_per_host(0).build_http::<Full<Bytes>>();
    let client = ServiceBuilder::new()
        .layer(IdempotencyKeyLayer::new())
        .layer(RetryLayer::new(
            HttpRetryPolicy::new()
                .backoff(Backoff::new(Duration::from_millis(50), Duration::from_secs(1)).max_attempts(4)),
        ))
        .service(http);

    for order in ["order-1042", "order-1043"] {
        println!("client: POST /refunds for {order}");
        let request = Request::post(format!("http://{proxy}/refunds"))
            .header("content-type", "application/json")
            .body(Full::from(format!("{{\"order\":\"{order}\",\"amount_cents\":1500}}")))?;
        let response = client.clone().oneshot(request).await?;
        let status = response.status();
        let replayed = response.headers().get("idempotent-replayed").is_some();
        let body = response.into_body().collect().await?.to_bytes();
        println!(
            "client: {status}{} {}",
            if replayed { " (Idempotent-Replayed: the stored response)" } else { "" },
            String::from_utf8_lossy(&body)
        );
    }

    let made = refunds.load(Ordering::SeqCst);
    println!("server: {made} refunds made for 2 refund requests, each of which lost a reply");
    assert_eq!(made, 2, "each refund is processed exactly once");
    Ok(())
}
