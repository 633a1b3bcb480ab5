//! Retrying plain async calls with `backon`: an `#[idempotent]` tool that a duplicate delivery
//! finds still running (`Error::InFlight`), and a model-provider call that gets a 502 and a 429
//! with `Retry-After`. Each retry is logged through `tracing` before the sleep, as tenacity's
//! `before_sleep` does; the delays are the workspace's full-jitter `Backoff`.
//!
//! ```text
//! cargo run -p idempotent-examples --bin backon_retry   # SQLite file (the embedded default)
//! REDIS_URL=redis://127.0.0.1:6379 cargo run -p idempotent-examples --bin backon_retry   # Redis
//! DATABASE_URL=postgres://postgres@127.0.0.1/postgres cargo run -p idempotent-examples --bin backon_retry  # PostgreSQL
//! ```
//!
//! The tool's records are kept in the examples' database (`idempotent_examples::store_from_env`),
//! under a run id that is new on every run of the program.
//!
//! Exits non-zero if the card was charged other than once.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use axum::Router;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::post;
use backon::Retryable;
use idempotent_core::{Backoff, Error, RunContext, idempotent};
use idempotent_tower::reqwest::reqwest;
use serde::{Deserialize, Serialize};
use tokio::sync::Notify;

/// The workspace's full-jitter backoff as the iterator of delays `backon` takes: one draw from
/// `0..=min(cap, base × 2^retry)` per retry, `attempts - 1` retries.
fn full_jitter(backoff: Backoff) -> impl Iterator<Item = Duration> + Send + Sync + Unpin {
    (0..backoff.attempts().saturating_sub(1)).map(move |retry| backoff.delay(retry, fastrand::u64(..)))
}

// ---- an #[idempotent] tool ----

#[derive(Default)]
struct Card {
    charges: AtomicU32,
    /// Told when a charge runs (its call holds the key's lease).
    charging: Notify,
    /// Holds the first charge until the duplicate has been refused once.
    duplicate_refused: Notify,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Receipt {
    charge_id: String,
}

#[idempotent(step = "charge", retention = 3600, on_in_flight = "reject", skip(card))]
async fn charge(ctx: &RunContext, card: &Card, order: &str, cents: u64) -> Result<Receipt, Error> {
    let n = card.charges.fetch_add(1, Ordering::SeqCst) + 1;
    card.charging.notify_one();
    card.duplicate_refused.notified().await;
    Ok(Receipt { charge_id: format!("ch_{order}_{cents}_{n}") })
}

// ---- a model provider call ----

#[derive(Debug)]
enum ModelError {
    Status { status: reqwest::StatusCode, retry_after: Option<Duration> },
    Transport(reqwest::Error),
}

impl std::fmt::Display for ModelError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ModelError::Status { status, .. } => write!(f, "model provider answered {status}"),
            ModelError::Transport(e) => write!(f, "model provider unreachable: {e}"),
        }
    }
}

impl std::error::Error for ModelError {}

impl ModelError {
    /// The statuses and errors a retry may fix (the same table as `idempotent_tower::retry`).
    fn is_transient(&self) -> bool {
        match self {
            ModelError::Status { status, .. } => matches!(status.as_u16(), 408 | 425 | 429 | 500 | 502 | 503 | 504),
            ModelError::Transport(e) => !e.is_builder(),
        }
    }
}

/// One model call. `key` is the same on every retry of it: a `POST` retried after a timeout may
/// have been processed, and the provider deduplicates by the key (as OpenAI-style APIs that take
/// an `Idempotency-Key` do); without one, a retry after the request was sent could be served twice.
async fn complete(client: &reqwest::Client, url: &str, key: &http::HeaderValue) -> Result<String, ModelError> {
    let response = client
        .post(url)
        .header(idempotent_tower::IDEMPOTENCY_KEY, key.clone())
        .body(r#"{"messages":[{"role":"user","content":"hi"}]}"#)
        .send()
        .await
        .map_err(ModelError::Transport)?;
    if !response.status().is_success() {
        let retry_after =
            response.headers().get("retry-after").and_then(|v| v.to_str().ok()?.parse().ok()).map(Duration::from_secs);
        return Err(ModelError::Status { status: response.status(), retry_after });
    }
    response.text().await.map_err(ModelError::Transport)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    idempotent_examples::logs().with_target(false).without_time().init();
    let (store, describe) = idempotent_examples::store_from_env().await?;
    let run_id = idempotent_examples::fresh_id("order-flow-42");
    println!("records in {describe}; run {run_id}");
    let backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(2)).max_attempts(6);

    // 1. The tool. A redelivered message runs the same tool call while the first still runs:
    //    the store refuses the duplicate (InFlight, transient), backon retries it, and once the
    //    first is done the retry replays its receipt.
    let ctx = RunContext::new(store, &run_id);
    let card = Card::default();
    let first = charge(&ctx, &card, "order-7", 1500);
    let duplicate = async {
        // Delivered again once the first call runs its charge (it holds the key's lease then,
        // whichever call a store happens to serve first).
        card.charging.notified().await;
        (|| charge(&ctx, &card, "order-7", 1500))
            .retry(full_jitter(backoff))
            .when(|e: &Error| e.is_transient())
            .notify(|e: &Error, delay: Duration| {
                tracing::info!(delay_ms = delay.as_millis() as u64, "retrying the charge tool: {e}");
                card.duplicate_refused.notify_one();
            })
            .await
    };
    let (first, duplicate) = tokio::join!(first, duplicate);
    let (first, duplicate) = (first?, duplicate?);
    println!("tool:  first call → {}, duplicate → {}", first.charge_id, duplicate.charge_id);

    // 2. The model provider: 502, then 429 with Retry-After: 1, then the completion.
    let calls = Arc::new(AtomicU32::new(0));
    let app = Router::new().route(
        "/v1/chat/completions",
        post({
            let calls = calls.clone();
            move || async move {
                match calls.fetch_add(1, Ordering::SeqCst) {
                    0 => StatusCode::BAD_GATEWAY.into_response(),
                    1 => (StatusCode::TOO_MANY_REQUESTS, [("retry-after", "1")]).into_response(),
                    _ => r#"{"choices":[{"message":{"role":"assistant","content":"hello"}}]}"#.into_response(),
                }
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}/v1/chat/completions", listener.local_addr()?);
    tokio::spawn(async move { axum::serve(listener, app).await });
    let client = reqwest::Client::new();
    // One key for the logical call, kept across its retries.
    let key = idempotent_tower::client::UuidV4Key::header_value();
    let completion = (|| complete(&client, &url, &key))
        .retry(full_jitter(backoff))
        .when(ModelError::is_transient)
        // A server-requested wait replaces the backoff's delay (when the backoff has one left).
        .adjust(|e, delay| match e {
            ModelError::Status { retry_after: Some(wait), .. } => delay.map(|_| *wait),
            _ => delay,
        })
        .notify(|e, delay| tracing::info!(delay_ms = delay.as_millis() as u64, "retrying the model call: {e}"))
        .await?;
    println!("model: {completion} after {} calls", calls.load(Ordering::SeqCst));

    let charges = card.charges.load(Ordering::SeqCst);
    println!("card charged {charges} time(s)");
    if charges != 1 || first.charge_id != duplicate.charge_id {
        eprintln!("the card was charged {charges} times");
        std::process::exit(1);
    }
    Ok(())
}
