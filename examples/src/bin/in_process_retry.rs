//! tower's `Retry` around the server `IdempotencyLayer`, in one process: a payment service that
//! fails transiently is retried, and charges the card once.
//!
//! ```text
//! cargo run -p idempotent-examples --bin in_process_retry   # SQLite file (the embedded default)
//! REDIS_URL=redis://127.0.0.1:6379 cargo run -p idempotent-examples --bin in_process_retry   # Redis
//! DATABASE_URL=postgres://postgres@127.0.0.1/postgres cargo run -p idempotent-examples --bin in_process_retry  # PostgreSQL
//! RUST_LOG=idempotent_tower=debug cargo run -p idempotent-examples --bin in_process_retry   # the layer's events
//! ```
//!
//! ```text
//! ServiceBuilder::new()
//!     .layer(RetryLayer::new(policy))           // retries 503s and lost replies ...
//!     .layer(IdempotencyLayer::new(store))      // ... and every retry re-enters this layer,
//!     .service(payments)                        // so the charge runs at most once per key
//! ```
//!
//! The payment service answers 503 twice (the bank is unavailable; nothing is charged), then
//! charges. The idempotency layer releases the key on each 503, so the retries run the charge;
//! once the charge succeeded its response is stored. When the job runner later runs the same job
//! again (a restarted worker), the key — derived from the run id, the step and the payload — is
//! the same, and the stored response is replayed without charging again. The layer keeps its
//! records in the examples' database (`idempotent_examples::store_from_env`); the job's run id is
//! new on every run of the program, so a run never replays an earlier one's charge.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use idempotent_core::{Key, KeyScope};
use idempotent_tower::IdempotencyLayer;
use idempotent_tower::retry::{Backoff, HttpRetryPolicy};
use idempotent_tower::server::RequestBody;
use tower::retry::RetryLayer;
use tower::{ServiceBuilder, ServiceExt, service_fn};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

#[derive(Default)]
struct Bank {
    calls: AtomicU32,
    charges: AtomicU32,
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    idempotent_examples::logs().init();
    let (store, describe) = idempotent_examples::store_from_env().await?;
    let run_id = idempotent_examples::fresh_id("run-7");
    println!("records in {describe}; job run {run_id}");

    let bank = Arc::new(Bank::default());
    // The side-effecting service. The idempotency layer hands it the buffered request body.
    let payments = service_fn({
        let bank = bank.clone();
        move |request: Request<RequestBody<Full<Bytes>>>| {
            let bank = bank.clone();
            async move {
                let payload = request.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
                let call = bank.calls.fetch_add(1, Ordering::SeqCst) + 1;
                if call <= 2 {
                    println!("payments: call {call}: bank unavailable, nothing charged -> 503");
                    return Ok::<_, Infallible>(
                        Response::builder().status(StatusCode::SERVICE_UNAVAILABLE).body(Full::default()).unwrap(),
                    );
                }
                let charge = bank.charges.fetch_add(1, Ordering::SeqCst) + 1;
                println!("payments: call {call}: charged -> 201");
                let body = format!("{{\"charge\":\"ch_{charge:04}\",\"for\":{}}}", String::from_utf8_lossy(&payload));
                Ok(Response::builder().status(StatusCode::CREATED).body(Full::from(body)).unwrap())
            }
        }
    });

    let policy =
        HttpRetryPolicy::new().backoff(Backoff::new(Duration::from_millis(50), Duration::from_secs(1)).max_attempts(5));
    let stack =
        ServiceBuilder::new().layer(RetryLayer::new(policy)).layer(IdempotencyLayer::new(store)).service(payments);

    // The job: charge order-1042 in the run. Its key is derived from what the job is, so every
    // life of the worker sends the same key for it.
    let payload = serde_json::json!({"order": "order-1042", "amount_cents": 1500});
    let key = Key::derive(&KeyScope::new(run_id.as_str(), "charge"), &payload)?;
    let job = || {
        Request::post("http://payments.internal/charges")
            .header("idempotency-key", HeaderValue::from_str(&key.to_hex()).unwrap())
            .header("content-type", "application/json")
            .body(Full::from(payload.to_string()))
            .unwrap()
    };

    for life in ["first run", "after a worker restart"] {
        let response = stack.clone().oneshot(job()).await?;
        let status = response.status();
        let replayed = response.headers().get("idempotent-replayed").is_some();
        let body = response.into_body().collect().await?.to_bytes();
        println!(
            "job ({life}): {status}{} {}",
            if replayed { " (replayed)" } else { "" },
            String::from_utf8_lossy(&body)
        );
    }

    let (calls, charges) = (bank.calls.load(Ordering::SeqCst), bank.charges.load(Ordering::SeqCst));
    println!("bank: {calls} calls, {charges} charge");
    assert_eq!(charges, 1, "the card is charged exactly once");
    assert_eq!(calls, 3, "two transient failures retried, the rerun replayed");
    Ok(())
}
