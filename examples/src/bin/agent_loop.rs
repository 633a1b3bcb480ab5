//! An agent loop over HTTP: it asks a model provider (OpenAI-style JSON, served by this program
//! on loopback, with injected 502s, a 429 and a slow reply) what to do, and executes the chosen
//! tool calls through reqwest against a payment service behind `IdempotencyLayer`, whose first
//! reply is lost. Retries, hedges and charges are printed; every tool call charges once.
//!
//! ```text
//! cargo run -p idempotent-examples --bin agent_loop   # SQLite file (the embedded default)
//! REDIS_URL=redis://127.0.0.1:6379 cargo run -p idempotent-examples --bin agent_loop   # Redis
//! DATABASE_URL=postgres://postgres@127.0.0.1/postgres cargo run -p idempotent-examples --bin agent_loop  # PostgreSQL
//! RUST_LOG=info,idempotent_tower::retry=debug,idempotent_tower::client::hedge=debug cargo run -p idempotent-examples --bin agent_loop  # each retry and hedge
//! RUST_LOG=idempotent_tower=debug cargo run -p idempotent-examples --bin agent_loop  # the layers' own events too
//! ```
//!
//! Both services' `IdempotencyLayer`s keep their records in the examples' database
//! (`idempotent_examples::store_from_env`); the run id is new on every run of the program.
//!
//! - Model calls: `IdempotencyKeyLayer` → tower `Retry` (`HttpRetryPolicy`: 502 and 429 with
//!   `Retry-After`) → `Hedge` (`HedgeLayer`: a copy after the p90 latency) → hyper. The provider
//!   sits behind `IdempotencyLayer` with `OnInFlight::Wait`, so a hedge and its original are one
//!   completion. (A real provider that does not dedup by key bills both copies; a completion has
//!   no other effect.)
//! - Tool calls: `IdempotencyKeyMiddleware` → `RetryMiddleware` → reqwest. Each call's key is
//!   derived from the run id and the model's tool-call id (`OperationKey`), so a restarted agent
//!   resending the same call gets the first charge back.
//!
//! Exits non-zero if any tool call charged other than once.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{Request as AxumRequest, State};
use axum::http::StatusCode;
use axum::middleware::{Next, from_fn_with_state};
use axum::response::{IntoResponse, Response as AxumResponse};
use axum::routing::{get, post};
use axum::{Json, Router};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use idempotent_core::{Key, KeyScope, OnInFlight, SharedStore};
use idempotent_tower::client::hedge::{HedgeLayer, HedgePolicy};
use idempotent_tower::reqwest::{IdempotencyKeyMiddleware, OperationKey, RetryMiddleware, reqwest, reqwest_middleware};
use idempotent_tower::retry::{Backoff, HttpRetryPolicy};
use idempotent_tower::{IdempotencyKeyLayer, IdempotencyLayer};
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tower::buffer::Buffer;
use tower::retry::RetryLayer;
use tower::{BoxError, Service, ServiceBuilder, ServiceExt};

// ---- the model provider (mock): a gateway that fails and stalls, then a deterministic model ----

#[derive(Clone, Default)]
struct Provider {
    /// Arrivals at the gateway, 1-based.
    arrivals: Arc<AtomicU32>,
    /// Completions the model computed (a hedge that replays is not one).
    completions: Arc<AtomicU32>,
}

/// The gateway's script, by arrival: which completion requests fail or stall before they reach
/// the model. Warm-up reads (`GET /v1/models`) are not counted.
fn gateway_fault(arrival: u32) -> Option<&'static str> {
    match arrival {
        1 => Some("502"),
        3 => Some("slow"),
        5 => Some("429"),
        _ => None,
    }
}

async fn gateway(State(provider): State<Provider>, request: AxumRequest, next: Next) -> AxumResponse {
    if request.method() != axum::http::Method::POST {
        return next.run(request).await;
    }
    let arrival = provider.arrivals.fetch_add(1, Ordering::SeqCst) + 1;
    match gateway_fault(arrival) {
        Some("502") => return (StatusCode::BAD_GATEWAY, "upstream model server unavailable").into_response(),
        Some("429") => {
            return (StatusCode::TOO_MANY_REQUESTS, [("retry-after", "1")], "rate limited: retry in 1 s")
                .into_response();
        }
        // A request stuck in the provider's queue: its hedge, sent meanwhile, is served first.
        Some(_) => tokio::time::sleep(Duration::from_millis(400)).await,
        None => {}
    }
    // In a task of its own, as servers run requests: the copy whose caller went away finishes.
    tokio::spawn(next.run(request)).await.unwrap()
}

/// The "model": charge order-1, then order-2, then answer.
async fn completions(State(provider): State<Provider>, Json(request): Json<Value>) -> Json<Value> {
    provider.completions.fetch_add(1, Ordering::SeqCst);
    let done = request["messages"].as_array().map_or(0, |m| m.iter().filter(|m| m["role"] == "tool").count());
    let plan = [("call_a1", "order-1", 1500), ("call_b2", "order-2", 2500)];
    let message = match plan.get(done) {
        Some((id, order, cents)) => json!({
            "role": "assistant",
            "content": null,
            "tool_calls": [{"id": id, "type": "function", "function": {
                "name": "charge", "arguments": json!({"order": order, "amount_cents": cents}).to_string()
            }}]
        }),
        None => json!({"role": "assistant", "content": "Both orders are paid."}),
    };
    Json(
        json!({"id": format!("chatcmpl-{done}"), "object": "chat.completion", "choices": [{"index": 0, "message": message}]}),
    )
}

async fn serve(app: Router) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

async fn start_provider(store: SharedStore, provider: Provider) -> SocketAddr {
    let app = Router::new()
        .route("/v1/chat/completions", post(completions))
        .layer(IdempotencyLayer::new(store).on_in_flight(OnInFlight::Wait { timeout: Duration::from_secs(5) }))
        .route("/v1/models", get(|| async { Json(json!({"data": [{"id": "mock-1"}]})) }))
        .with_state(provider.clone())
        .layer(from_fn_with_state(provider, gateway));
    serve(app).await
}

// ---- the payment service: charges behind IdempotencyLayer; its first reply is lost ----

#[derive(Clone, Default)]
struct Payments {
    /// Charges made, by the idempotency key they ran under (one per tool call).
    charges: Arc<Mutex<HashMap<String, u32>>>,
    replies: Arc<AtomicU32>,
}

async fn charge(
    State(payments): State<Payments>,
    headers: axum::http::HeaderMap,
    Json(body): Json<Value>,
) -> (StatusCode, Json<Value>) {
    let key = headers.get("idempotency-key").and_then(|k| k.to_str().ok()).unwrap_or_default().to_owned();
    let n = {
        let mut charges = payments.charges.lock().unwrap();
        let n = charges.entry(key).or_insert(0);
        *n += 1;
        charges.values().sum::<u32>()
    };
    (
        StatusCode::CREATED,
        Json(json!({"charge": format!("ch_{n:03}"), "order": body["order"], "amount_cents": body["amount_cents"]})),
    )
}

/// Replaces the first reply with a 503, after the charge was made and stored (a proxy in front
/// timing out): the client's retry must get the stored charge, not a second one.
async fn lossy_front(State(payments): State<Payments>, request: AxumRequest, next: Next) -> AxumResponse {
    let response = next.run(request).await;
    if payments.replies.fetch_add(1, Ordering::SeqCst) == 0 {
        return (StatusCode::SERVICE_UNAVAILABLE, "upstream timed out").into_response();
    }
    response
}

async fn start_payments(store: SharedStore, payments: Payments) -> SocketAddr {
    let app = Router::new()
        .route("/charges", post(charge))
        .with_state(payments.clone())
        .layer(IdempotencyLayer::new(store).require_key(true))
        .layer(from_fn_with_state(payments, lossy_front));
    serve(app).await
}

// ---- the agent ----

type Body = Full<Bytes>;

async fn post_json<S>(client: &mut S, url: &str, body: &Value) -> Result<(StatusCode, Value), BoxError>
where
    S: Service<http::Request<Body>, Response = http::Response<hyper::body::Incoming>, Error = BoxError>,
{
    let request =
        http::Request::post(url).header("content-type", "application/json").body(Full::from(body.to_string()))?;
    let response = client.ready().await?.call(request).await?;
    let status = response.status();
    let bytes = response.into_body().collect().await?.to_bytes();
    Ok((status, serde_json::from_slice(&bytes).unwrap_or(Value::Null)))
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    idempotent_examples::logs()
        // The client side's retry and hedge events are DEBUG: `RUST_LOG` in the module docs.
        .with_target(false)
        .without_time()
        .init();

    let (store, describe) = idempotent_examples::store_from_env().await?;
    let run_id = idempotent_examples::fresh_id("support-4711/turn-1");
    println!("records of both services in {describe}; run {run_id}");
    let provider = Provider::default();
    let payments = Payments::default();
    let model_url = format!("http://{}/v1/chat/completions", start_provider(store.clone(), provider.clone()).await);
    let models_url = model_url.replace("/chat/completions", "/models");
    let charges_url = format!("http://{}/charges", start_payments(store, payments.clone()).await);

    // The model client: key outside retry, retry outside the hedge (each attempt may be hedged).
    let hedges = HedgePolicy::new();
    let hedge =
        HedgeLayer::new().percentile(0.9).min_data_points(10).period(Duration::from_secs(1)).policy(hedges.clone());
    let http = Client::builder(TokioExecutor::new()).build_http::<Body>();
    let retry =
        HttpRetryPolicy::new().backoff(Backoff::new(Duration::from_millis(50), Duration::from_secs(1)).max_attempts(4));
    let mut model = ServiceBuilder::new()
        .layer(IdempotencyKeyLayer::new())
        .layer(RetryLayer::new(retry))
        .service(Buffer::new(ServiceBuilder::new().layer(hedge).service(http), 16));

    // tower's hedge reads the latencies of the last full period: fill one with cheap reads.
    let warm_up = Instant::now();
    while warm_up.elapsed() < Duration::from_millis(1100) {
        let request = http::Request::get(&models_url).body(Body::default())?;
        model.ready().await?.call(request).await?.into_body().collect().await?;
    }
    println!("warm-up: the hedge knows the provider's latency (p90 of ~1 s of reads)\n");

    // The tool client.
    let tools = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
        .with(IdempotencyKeyMiddleware::new())
        .with(RetryMiddleware::new(
            HttpRetryPolicy::new().backoff(Backoff::new(Duration::from_millis(50), Duration::from_secs(1))),
        ))
        .build();

    let mut messages = vec![
        json!({"role": "system", "content": "You settle unpaid orders with the charge tool."}),
        json!({"role": "user", "content": "Please settle order-1 ($15.00) and order-2 ($25.00)."}),
    ];
    let mut tool_calls = Vec::new();
    for turn in 1..=5 {
        let started = Instant::now();
        let (hedges_before, arrivals_before) = (hedges.hedges(), provider.arrivals.load(Ordering::SeqCst));
        let (status, completion) =
            post_json(&mut model, &model_url, &json!({"model": "mock-1", "messages": messages})).await?;
        let arrivals = provider.arrivals.load(Ordering::SeqCst) - arrivals_before;
        let hedged = hedges.hedges() - hedges_before;
        println!(
            "model call {turn}: {status} in {:>4} ms — {arrivals} request(s) reached the provider; {hedged} hedge(s) sent",
            started.elapsed().as_millis()
        );
        let message = completion["choices"][0]["message"].clone();
        messages.push(message.clone());
        let Some(calls) = message["tool_calls"].as_array() else {
            println!("\nassistant: {}", message["content"].as_str().unwrap_or_default());
            break;
        };
        for call in calls {
            let (id, arguments) =
                (call["id"].as_str().unwrap_or_default(), call["function"]["arguments"].as_str().unwrap_or("{}"));
            let key = Key::derive(&KeyScope::new(run_id.as_str(), "charge"), id)?;
            let response = tools
                .post(&charges_url)
                .header("content-type", "application/json")
                .body(arguments.to_owned())
                .with_extension(OperationKey::new(&key))
                .send()
                .await?;
            let replayed = response.headers().get("idempotent-replayed").is_some_and(|v| v == "true");
            let result = response.text().await?;
            println!(
                "  tool {id}: charge {arguments} → {result}{}",
                if replayed { " (replayed after a lost reply)" } else { "" }
            );
            tool_calls.push(OperationKey::new(&key));
            messages.push(json!({"role": "tool", "tool_call_id": id, "content": result}));
        }
    }

    let charges = payments.charges.lock().unwrap().clone();
    println!(
        "\nmodel: {} completions computed for {} requests that reached the provider ({} hedges sent)",
        provider.completions.load(Ordering::SeqCst),
        provider.arrivals.load(Ordering::SeqCst),
        hedges.hedges()
    );
    let mut ok = tool_calls.len() == 2;
    for key in &tool_calls {
        let n = charges.get(key.header_value().to_str()?).copied().unwrap_or(0);
        println!("charges for tool call {}…: {n}", &key.header_value().to_str()?[1..13]);
        ok &= n == 1;
    }
    ok &= charges.values().sum::<u32>() == 2;
    if !ok {
        eprintln!("a tool call did not charge exactly once: {charges:?}");
        std::process::exit(1);
    }
    println!("every tool call charged exactly once");
    Ok(())
}
