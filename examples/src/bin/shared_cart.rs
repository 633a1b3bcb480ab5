//! A shared cart over HTTP with optimistic concurrency: `GET /cart` answers the items with the
//! state's version as `ETag`; `PUT /cart` must carry `If-Match` (428 without it) naming the
//! current version (412 otherwise, with the current `ETag`), and its `Idempotency-Key` names the
//! commit, so that a retried `PUT` whose reply was lost is recognised instead of refused. Two
//! clients add items at once: each reads, appends its item, writes with `If-Match`, and on 412
//! reads again and re-applies. Every item ends in the cart exactly once.
//!
//! ```text
//! cargo run -p idempotent-examples --bin shared_cart   # SQLite file (the embedded default)
//! REDIS_URL=redis://127.0.0.1:6379 cargo run -p idempotent-examples --bin shared_cart   # Redis
//! DATABASE_URL=postgres://postgres@127.0.0.1/postgres cargo run -p idempotent-examples --bin shared_cart  # PostgreSQL
//! ```
//!
//! The cart is kept in the examples' database (`idempotent_examples::stores_from_env`), under a
//! scope of its own per run, so every run starts from an empty cart.
//!
//! Exits non-zero if an item is missing or doubled.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use axum::http::{StatusCode, header};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use idempotent_core::state::{Scope, State};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    idempotent_examples::logs().init();
    let stores = idempotent_examples::stores_from_env().await?;
    let scope = Scope::new(idempotent_examples::fresh_id("cart")).tenant("shop");
    println!("cart state in {}; cart {}", stores.describe, scope.name());
    let cart: Arc<idempotent_examples::cart::Cart> = Arc::new(State::new(stores.state, scope));
    let app = idempotent_examples::cart::router(cart);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move { axum::serve(listener, app).await });
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let url = format!("http://{addr}/cart");

    // Without If-Match: 428, saying what to do.
    let req = http::Request::put(&url).header("content-type", "application/json").body(Full::from("[]"))?;
    let res = client.request(req).await?;
    println!(
        "PUT without If-Match: {} {}",
        res.status(),
        String::from_utf8_lossy(&res.into_body().collect().await?.to_bytes())
    );

    let refused = Arc::new(AtomicU32::new(0));
    let per_client = 20;
    // Both clients are spawned before either is awaited, so that they run at once.
    let clients: Vec<_> = (0..2)
        .map(|c| {
            let (client, url, refused) = (client.clone(), url.clone(), refused.clone());
            tokio::spawn(async move {
                for i in 0..per_client {
                    let item = format!("client {c}: item {i}");
                    loop {
                        let res = client.request(http::Request::get(&url).body(Full::default())?).await?;
                        let tag = res.headers()[header::ETAG].clone();
                        let mut items: Vec<String> =
                            serde_json::from_slice(&res.into_body().collect().await?.to_bytes())?;
                        items.push(item.clone());
                        // The other client's write may land meanwhile: then this one is refused.
                        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
                        let req = http::Request::put(&url)
                            .header("content-type", "application/json")
                            .header(header::IF_MATCH, tag)
                            .header("idempotency-key", format!("add {item}"))
                            .body(Full::from(serde_json::to_vec(&items)?))?;
                        let res = client.request(req).await?;
                        match res.status() {
                            StatusCode::OK => break,
                            StatusCode::PRECONDITION_FAILED => {
                                refused.fetch_add(1, Ordering::Relaxed);
                            }
                            other => return Err(format!("PUT answered {other}").into()),
                        }
                    }
                }
                Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
            })
        })
        .collect();
    for c in clients {
        c.await??;
    }
    let res = client.request(http::Request::get(&url).body(Full::default())?).await?;
    let tag = res.headers()[header::ETAG].to_str()?.to_owned();
    let items: Vec<String> = serde_json::from_slice(&res.into_body().collect().await?.to_bytes())?;
    let mut sorted = items.clone();
    sorted.sort();
    sorted.dedup();
    println!(
        "cart at ETag {tag}: {} items ({} distinct), {} writes refused with 412 and re-applied",
        items.len(),
        sorted.len(),
        refused.load(Ordering::Relaxed)
    );
    if items.len() != 2 * per_client || sorted.len() != items.len() {
        eprintln!("an item is missing or doubled");
        std::process::exit(1);
    }
    Ok(())
}
