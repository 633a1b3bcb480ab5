//! The client stacks of `idempotent-tower` against real servers on loopback.
//!
//! 1. In process: `Retry` → (replies lost here) → `IdempotencyLayer` → a payment service that
//!    calls a real HTTP payment provider, which fails transiently.
//! 2. Remote: `IdempotencyKeyLayer` → `Retry` → hyper's client → a proxy that drops replies after
//!    the server processed the request → an axum server with `IdempotencyLayer`. And the same
//!    stack in the wrong order (`Retry` outside the key layer), which repeats refunds.
//!
//! Every side effect is recorded in a ledger outside the idempotency store; the tests check the
//! ledger, not the client's view.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::routing::post;
use bytes::Bytes;
use http::header::CONTENT_TYPE;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use idempotent_core::{Key, KeyScope, MemoryStore, RedisStore, SharedStore};
use idempotent_tests::RedisServer;
use idempotent_tests::proxy::{Fault, FaultProxy, LossyProxy};
use idempotent_tests::refund_server::{
    Answer, assert_each_order_refunded_once, lose_first_replies, start_refund_server,
};
use idempotent_tower::retry::{Backoff, HttpRetryPolicy};
use idempotent_tower::server::{IDEMPOTENT_REPLAYED, IdempotencyLayer, RequestBody, ResponseBody};
use idempotent_tower::{IdempotencyKey, IdempotencyKeyLayer};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tower::retry::budget::TpsBudget;
use tower::retry::{Policy, Retry, RetryLayer};
use tower::{Service, ServiceBuilder, ServiceExt, service_fn};

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type HttpClient = Client<HttpConnector, Full<Bytes>>;
type BoxFuture<T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send>>;

const REQUESTS: u32 = 100;

/// How many replies the proxy drops for logical request `n` (0, 1 or 2): about one reply lost
/// per request on average, every request eventually answered within 5 attempts.
fn drops_for(n: u32) -> u32 {
    n % 3
}

/// A client that opens a connection per request, so that the proxy sees one request per
/// connection and a dropped reply never poisons a pooled connection.
fn http_client() -> HttpClient {
    Client::builder(TokioExecutor::new()).pool_max_idle_per_host(0).build_http()
}

/// Fast backoff, room for every injected failure, and a budget sized for the injected loss:
/// the default budget (20% of requests) would rightly stop retrying when a third of all replies
/// are lost, which is the point of a budget but not of these tests.
fn policy() -> HttpRetryPolicy {
    HttpRetryPolicy::new()
        .backoff(Backoff::new(Duration::from_millis(5), Duration::from_millis(50)).max_attempts(6))
        .budget(TpsBudget::new(Duration::from_secs(10), 100, 1.0))
}

// ---------------------------------------------------------------------------------------------
// Stack 2's server: refunds behind the server IdempotencyLayer

fn refund_request(to: SocketAddr, order: u32) -> Request<Full<Bytes>> {
    Request::post(format!("http://{to}/refunds"))
        .header(CONTENT_TYPE, "application/json")
        .header("x-logical-request", order)
        .body(Full::from(format!("{{\"order\":{order}}}")))
        .unwrap()
}

/// Sends logical requests `0..REQUESTS` through `client`, 16 at a time.
async fn send_all<S>(client: S, to: SocketAddr) -> HashMap<u32, Result<Answer, String>>
where
    S: Service<Request<Full<Bytes>>, Response = Response<Incoming>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: std::fmt::Display,
{
    let limit = Arc::new(Semaphore::new(16));
    let mut tasks = JoinSet::new();
    for order in 0..REQUESTS {
        let (client, limit) = (client.clone(), limit.clone());
        tasks.spawn(async move {
            let _permit = limit.acquire_owned().await.unwrap();
            let answer = match client.oneshot(refund_request(to, order)).await.map_err(|e| e.to_string()) {
                Ok(response) => Ok(read(response).await),
                Err(error) => Err(error),
            };
            (order, answer)
        });
    }
    tasks.join_all().await.into_iter().collect()
}

async fn read(response: Response<Incoming>) -> Answer {
    let status = response.status();
    let replayed = response.headers().get(IDEMPOTENT_REPLAYED).is_some_and(|v| v == "true");
    let body = String::from_utf8(response.into_body().collect().await.unwrap().to_bytes().to_vec()).unwrap();
    Answer { status, replayed, body }
}

fn expected_losses() -> usize {
    (0..REQUESTS).map(|n| drops_for(n) as usize).sum()
}

// ---------------------------------------------------------------------------------------------
// Stack 2, right order: one refund per logical request

async fn key_layer_outside_retry_refunds_each_order_once(store: SharedStore) {
    let (server, refunds) = start_refund_server(store).await;
    let proxy = LossyProxy::start(server, lose_first_replies(drops_for)).await;
    let client =
        ServiceBuilder::new().layer(IdempotencyKeyLayer::new()).layer(RetryLayer::new(policy())).service(http_client());

    let answers = send_all(client, proxy.addr()).await;

    assert_eq!(proxy.lost(), expected_losses(), "the proxy lost the replies it was told to");
    assert_each_order_refunded_once(&answers, &refunds, REQUESTS, drops_for);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_key_layer_outside_retry_refunds_each_order_once_despite_lost_replies() {
    key_layer_outside_retry_refunds_each_order_once(Arc::new(MemoryStore::new())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_key_layer_outside_retry_refunds_each_order_once_despite_lost_replies() {
    let redis = RedisServer::start();
    key_layer_outside_retry_refunds_each_order_once(Arc::new(RedisStore::connect_lazy(redis.url()).unwrap())).await;
    drop(redis);
}

// ---------------------------------------------------------------------------------------------
// Stack 2, wrong order: a new key per attempt

/// Retries every transport error, of every request, as hand-written policies often do.
#[derive(Clone)]
struct RetryErrors(u32);

impl<E> Policy<Request<Full<Bytes>>, Response<Incoming>, E> for RetryErrors {
    type Future = std::future::Ready<()>;

    fn retry(
        &mut self,
        _: &mut Request<Full<Bytes>>,
        result: &mut Result<Response<Incoming>, E>,
    ) -> Option<Self::Future> {
        (result.is_err() && self.0 > 0).then(|| {
            self.0 -= 1;
            std::future::ready(())
        })
    }

    fn clone_request(&mut self, request: &Request<Full<Bytes>>) -> Option<Request<Full<Bytes>>> {
        Some(request.clone())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_layer_inside_retry_sends_a_new_key_per_attempt_and_repeats_refunds() {
    let (server, refunds) = start_refund_server(Arc::new(MemoryStore::new())).await;
    let proxy = LossyProxy::start(server, lose_first_replies(drops_for)).await;
    let client: Retry<RetryErrors, IdempotencyKey<HttpClient>> = ServiceBuilder::new()
        .layer(RetryLayer::new(RetryErrors(5)))
        .layer(IdempotencyKeyLayer::new())
        .service(http_client());

    let answers = send_all(client, proxy.addr()).await;

    assert_eq!(proxy.lost(), expected_losses());
    for order in 0..REQUESTS {
        let attempts = drops_for(order) as usize + 1;
        let answer = answers[&order].as_ref().unwrap_or_else(|e| panic!("order {order} failed: {e}"));
        assert_eq!(answer.status, StatusCode::CREATED);
        assert!(!answer.replayed, "order {order}: every attempt was a new request to the server");
        assert_eq!(refunds.keys(order).len(), attempts, "order {order}: one key per attempt");
        assert_eq!(refunds.effects(order), attempts, "order {order}: refunded once per attempt");
    }
    assert_eq!(refunds.total(), REQUESTS as usize + expected_losses(), "duplicate refunds");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_layer_inside_retry_with_the_http_policy_fails_instead_of_repeating() {
    let (server, refunds) = start_refund_server(Arc::new(MemoryStore::new())).await;
    let proxy = LossyProxy::start(server, lose_first_replies(drops_for)).await;
    let client =
        ServiceBuilder::new().layer(RetryLayer::new(policy())).layer(IdempotencyKeyLayer::new()).service(http_client());

    let answers = send_all(client, proxy.addr()).await;

    // The policy sees the request before the key is stamped: a POST without a key, never
    // retried. The lost replies surface as errors, and nothing runs twice.
    for order in 0..REQUESTS {
        assert_eq!(answers[&order].is_err(), drops_for(order) > 0, "order {order}: {:?}", answers[&order]);
        assert_eq!(refunds.effects(order), 1, "order {order}");
    }
    assert_eq!(proxy.lost(), (0..REQUESTS).filter(|n| drops_for(*n) > 0).count());
}

// ---------------------------------------------------------------------------------------------
// Stack 2 through FaultProxy, and the 409 of a concurrent duplicate

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_that_gives_up_and_resends_with_its_derived_key_gets_the_first_refund() {
    let (server, refunds) = start_refund_server(Arc::new(MemoryStore::new())).await;
    let proxy = FaultProxy::start(server).await;
    let client = ServiceBuilder::new()
        .layer(IdempotencyKeyLayer::new().generator(|request: &Request<Full<Bytes>>| {
            let order: u32 = request.headers()["x-logical-request"].to_str().unwrap().parse().unwrap();
            let key = Key::derive(&KeyScope::new("run-7", "refund"), &order).unwrap();
            http::HeaderValue::from_str(&key.to_hex()).unwrap()
        }))
        .layer(RetryLayer::new(policy().backoff(Backoff::new(Duration::from_millis(5), Duration::from_millis(20)))))
        .service(http_client());

    // Every reply is lost: the client gives up after its 4 attempts.
    proxy.set(Fault::DropReplies);
    let error = client.clone().oneshot(refund_request(proxy.addr(), 7)).await.unwrap_err();
    assert_eq!(proxy.forwarded_replies(), 0, "no reply reached the client: {error}");
    assert_eq!(refunds.effects(7), 1, "the first attempt refunded; the other three were replays");

    // The worker restarts and sends the same logical request; its key is derived, so it is the same.
    proxy.set(Fault::Pass);
    let answer = read(client.oneshot(refund_request(proxy.addr(), 7)).await.unwrap()).await;
    assert_eq!(answer.status, StatusCode::CREATED);
    assert!(answer.replayed);
    assert_eq!(answer.body, "{\"refund\":\"re_7_1\"}");
    assert_eq!(refunds.effects(7), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_concurrent_duplicate_is_refused_with_409_then_retried_into_the_first_response() {
    let (server, refunds) = start_refund_server(Arc::new(MemoryStore::new())).await;
    let client =
        ServiceBuilder::new().layer(IdempotencyKeyLayer::new()).layer(RetryLayer::new(policy())).service(http_client());
    // A double click: the same logical request, with the caller's key, sent twice at once. The
    // handler holds the first until the server has refused the second with 409.
    let request = || {
        Request::post(format!("http://{server}/refunds"))
            .header(CONTENT_TYPE, "application/json")
            .header("idempotency-key", "\"double-click-1\"")
            .body(Full::from("{\"order\":42,\"wait_for_duplicate\":true}"))
            .unwrap()
    };
    let (a, b) = tokio::join!(client.clone().oneshot(request()), client.clone().oneshot(request()));
    let (a, b) = (read(a.unwrap()).await, read(b.unwrap()).await);

    assert_eq!((a.status, b.status), (StatusCode::CREATED, StatusCode::CREATED));
    assert_eq!(a.body, "{\"refund\":\"re_42_1\"}");
    assert_eq!(a.body, b.body);
    assert!(a.replayed != b.replayed, "one ran, the other got the stored response: {a:?} {b:?}");
    assert_eq!(refunds.effects(42), 1);
}

// ---------------------------------------------------------------------------------------------
// Stack 1: Retry → IdempotencyLayer → payments, in process, over a real payment provider

/// The payment provider: charges once per call that does not fail; fails the first
/// `drops_for(n)` calls for order `n` with 503, before charging.
#[derive(Clone, Default)]
struct Provider {
    calls: Arc<Mutex<HashMap<u32, u32>>>,
    charges: Arc<Mutex<HashMap<u32, u32>>>,
}

async fn charge(State(provider): State<Provider>, body: String) -> (StatusCode, String) {
    let order = serde_json::from_str::<serde_json::Value>(&body).unwrap()["order"].as_u64().unwrap() as u32;
    let call = {
        let mut calls = provider.calls.lock().unwrap();
        let call = calls.entry(order).or_insert(0);
        *call += 1;
        *call
    };
    if call <= drops_for(order) {
        return (StatusCode::SERVICE_UNAVAILABLE, "{\"error\":\"try again\"}".into());
    }
    let mut charges = provider.charges.lock().unwrap();
    let n = charges.entry(order).or_insert(0);
    *n += 1;
    (StatusCode::CREATED, format!("{{\"charge\":\"ch_{order}_{n}\"}}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_outside_the_server_layer_charges_each_payment_once() {
    let provider = Provider::default();
    let app = Router::new().route("/charges", post(charge)).with_state(provider.clone());
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let provider_url = format!("http://{}/charges", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });

    // The side-effecting service: calls the provider, passes its answer on.
    let http = http_client();
    let payments = service_fn(move |request: Request<RequestBody<Full<Bytes>>>| {
        let (http, url) = (http.clone(), provider_url.clone());
        let call: BoxFuture<Result<Response<Full<Bytes>>, BoxError>> = Box::pin(async move {
            let body = request.into_body().collect().await?.to_bytes();
            let order = serde_json::from_slice::<serde_json::Value>(&body)?["order"].to_string();
            let answer = http.request(Request::post(url).body(Full::new(body)).unwrap()).await?;
            let status = answer.status();
            let bytes = answer.into_body().collect().await?.to_bytes();
            Ok(Response::builder().status(status).header("x-order", order).body(Full::new(bytes)).unwrap())
        });
        call
    });

    // Between Retry and the idempotency layer, the first successful reply of every even order is
    // lost after the payment was made and stored.
    let lost = Arc::new(Mutex::new(HashSet::new()));
    let lose = {
        let lost = lost.clone();
        move |result: Result<Response<ResponseBody<Full<Bytes>>>, BoxError>| -> Result<Response<ResponseBody<Full<Bytes>>>, BoxError> {
            if let Ok(response) = &result
                && response.status().is_success()
            {
                let order: u32 = response.headers()["x-order"].to_str().unwrap().parse().unwrap();
                if order.is_multiple_of(2) && lost.lock().unwrap().insert(order) {
                    return Err("the reply was lost".into());
                }
            }
            result
        }
    };
    let store = MemoryStore::new();
    let stack = ServiceBuilder::new()
        .layer(RetryLayer::new(policy()))
        .map_result(lose)
        .layer(IdempotencyLayer::new(store))
        .service(payments);

    let mut tasks = JoinSet::new();
    for order in 0..REQUESTS {
        // The worker's key: derived from its run, step and payload, as a restarted worker would.
        let key = Key::derive(&KeyScope::new("run-e2e", "charge"), &order).unwrap().to_hex();
        let request = Request::post("http://payments.internal/charge")
            .header("idempotency-key", key)
            .header(CONTENT_TYPE, "application/json")
            .body(Full::from(format!("{{\"order\":{order}}}")))
            .unwrap();
        // Boxed here, where the compiler can see that the call is `Send` (inside `spawn` it trips
        // over the error type's erased lifetime).
        let call: BoxFuture<Result<Response<ResponseBody<Full<Bytes>>>, BoxError>> =
            Box::pin(stack.clone().oneshot(request));
        tasks.spawn(async move {
            let response = call.await.unwrap_or_else(|e| panic!("order {order}: {e}"));
            let status = response.status();
            let replayed = response.headers().get(IDEMPOTENT_REPLAYED).is_some();
            let body = response.into_body().collect().await.unwrap().to_bytes();
            (order, status, replayed, body)
        });
    }
    let results = tasks.join_all().await;

    assert_eq!(results.len(), REQUESTS as usize);
    for (order, status, replayed, body) in results {
        assert_eq!(status, StatusCode::CREATED, "order {order}");
        assert_eq!(body, format!("{{\"charge\":\"ch_{order}_1\"}}"), "order {order}");
        assert_eq!(replayed, order.is_multiple_of(2), "order {order}: the retry after the lost reply is a replay");
        assert_eq!(provider.charges.lock().unwrap()[&order], 1, "order {order} charged exactly once");
        assert_eq!(
            provider.calls.lock().unwrap()[&order],
            drops_for(order) + 1,
            "order {order}: transient failures retried, the replay did not call the provider"
        );
    }
    assert_eq!(lost.lock().unwrap().len(), REQUESTS as usize / 2, "replies were lost");
}
