//! An axum payments service whose `POST /refunds` is made idempotent by `IdempotencyLayer`.
//!
//! ```text
//! cargo run -p idempotent-examples --bin axum_payments  # SQLite file (the embedded default), port 3000
//! REDIS_URL=redis://127.0.0.1:6379 cargo run -p idempotent-examples --bin axum_payments # Redis
//! DATABASE_URL=postgres://postgres@127.0.0.1/postgres cargo run -p idempotent-examples --bin axum_payments  # PostgreSQL
//! cargo run -p idempotent-examples --bin axum_payments -- demo  # start on a free port, run the client sequence below, exit
//! ```
//!
//! The client sequence (the `demo` argument runs the same one in process):
//!
//! ```text
//! # 1. A refund: the provider is called, 201 Created.
//! curl -si localhost:3000/refunds -H 'authorization: Bearer acct_1' -H 'content-type: application/json' \
//!      -H 'idempotency-key: "refund-o7-1"' -d '{"order_id":"o-7","amount_cents":1500}'
//! # 2. The client's retry (same key, same body, any key order): the same 201 and body, plus
//! #    `idempotent-replayed: true`. The provider is not called again.
//! curl -si localhost:3000/refunds -H 'authorization: Bearer acct_1' -H 'content-type: application/json' \
//!      -H 'idempotency-key: "refund-o7-1"' -d '{ "amount_cents": 1500, "order_id": "o-7" }'
//! # 3. The same key with another amount: 422, an application/problem+json saying what to do.
//! curl -si localhost:3000/refunds -H 'authorization: Bearer acct_1' -H 'content-type: application/json' \
//!      -H 'idempotency-key: "refund-o7-1"' -d '{"order_id":"o-7","amount_cents":9999}'
//! # 4. Another account using the same key is another operation: a new refund.
//! curl -si localhost:3000/refunds -H 'authorization: Bearer acct_2' -H 'content-type: application/json' \
//!      -H 'idempotency-key: "refund-o7-1"' -d '{"order_id":"o-7","amount_cents":1500}'
//! # 5. No key: 400 (this service requires one).
//! curl -si localhost:3000/refunds -H 'authorization: Bearer acct_1' -H 'content-type: application/json' \
//!      -d '{"order_id":"o-8","amount_cents":100}'
//! # How many refunds the provider issued: 2.
//! curl -s localhost:3000/provider
//! # The layer's metrics, in the Prometheus text format: one call executed and one replayed for
//! # acct_1's key, a mismatch, acct_2's executed call (the labels name the step and the store,
//! # never a key or an account).
//! curl -s localhost:3000/metrics
//! ```
//!
//! With Redis, stop and restart the service between steps 1 and 2: the retry is still a replay.
//! `RUST_LOG=idempotent_tower=debug` shows the layer's events (acquired, stored, replayed, ...).

use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use idempotent_examples::payments::{Provider, app};
use metrics_exporter_prometheus::PrometheusBuilder;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    idempotent_examples::logs().init();
    let demo = std::env::args().nth(1).as_deref() == Some("demo");
    let (store, describe) = idempotent_examples::store_from_env().await?;
    let bind = if demo { "127.0.0.1:0".to_owned() } else { std::env::var("ADDR").unwrap_or("127.0.0.1:3000".into()) };
    let listener = tokio::net::TcpListener::bind(&bind).await?;
    let addr = listener.local_addr()?;
    println!("payments service on http://{addr}, records in {describe}");
    // The process's recorder: everything the layer records shows at `/metrics`.
    let metrics = PrometheusBuilder::new().install_recorder()?;
    idempotent_core::metrics::describe();
    let server = axum::serve(listener, app(store, Arc::new(Provider::default()), metrics));
    if !demo {
        server.await?;
        return Ok(());
    }
    tokio::spawn(async move { server.await });
    run_demo(addr).await
}

/// The client sequence from the module docs.
async fn run_demo(addr: SocketAddr) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    // A fresh key per run, so that a demo against a shared Redis never replays an older run.
    let key = format!("\"refund-o7-{}\"", std::process::id());
    let steps: [(&str, &str, Option<&str>, &str); 5] = [
        ("1. refund", "acct_1", Some(&key), r#"{"order_id":"o-7","amount_cents":1500}"#),
        ("2. retry (same key, keys reordered)", "acct_1", Some(&key), r#"{ "amount_cents": 1500, "order_id": "o-7" }"#),
        ("3. same key, other amount", "acct_1", Some(&key), r#"{"order_id":"o-7","amount_cents":9999}"#),
        ("4. same key, other account", "acct_2", Some(&key), r#"{"order_id":"o-7","amount_cents":1500}"#),
        ("5. no key", "acct_1", None, r#"{"order_id":"o-8","amount_cents":100}"#),
    ];
    for (title, account, key, body) in steps {
        let mut req = http::Request::post(format!("http://{addr}/refunds"))
            .header("authorization", format!("Bearer {account}"))
            .header("content-type", "application/json");
        if let Some(key) = key {
            req = req.header("idempotency-key", key);
        }
        let res = client.request(req.body(Full::new(Bytes::from(body)))?).await?;
        let status = res.status();
        let replayed = res.headers().get("idempotent-replayed").is_some();
        let body = res.into_body().collect().await?.to_bytes();
        println!(
            "{title}: {status}{}\n   {}",
            if replayed { " (idempotent-replayed: true)" } else { "" },
            String::from_utf8_lossy(&body)
        );
    }
    let res = client.request(http::Request::get(format!("http://{addr}/provider")).body(Full::default())?).await?;
    println!("provider: {}", String::from_utf8_lossy(&res.into_body().collect().await?.to_bytes()));
    let res = client.request(http::Request::get(format!("http://{addr}/metrics")).body(Full::default())?).await?;
    let text = String::from_utf8(res.into_body().collect().await?.to_bytes().to_vec())?;
    println!("metrics (the calls counter):");
    for line in text.lines().filter(|l| l.starts_with(idempotent_core::metrics::CALLS)) {
        println!("   {line}");
    }
    Ok(())
}
