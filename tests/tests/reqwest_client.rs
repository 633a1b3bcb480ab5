//! `idempotent_tower::reqwest` against the workspace's own axum server behind `IdempotencyLayer`,
//! on loopback: `IdempotencyKeyMiddleware` → `RetryMiddleware` → reqwest → a proxy that loses
//! replies after the server processed the request → the server.
//!
//! Every refund is recorded in a ledger outside the idempotency store, with the key it ran
//! under; the tests check the ledger, not the client's view.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http::StatusCode;
use idempotent_core::{Key, KeyScope, MemoryStore, RedisStore, SharedStore};
use idempotent_tests::RedisServer;
use idempotent_tests::proxy::{Fault, FaultProxy, LossyProxy};
use idempotent_tests::refund_server::{
    Answer, assert_each_order_refunded_once, lose_first_replies, start_refund_server,
};
use idempotent_tower::reqwest::reqwest_middleware::{self, ClientWithMiddleware, Middleware, Next};
use idempotent_tower::reqwest::{IdempotencyKeyMiddleware, OperationKey, RetryMiddleware, reqwest};
use idempotent_tower::retry::{Backoff, HttpRetryPolicy, TpsBudget};
use idempotent_tower::server::IDEMPOTENT_REPLAYED;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

const REQUESTS: u32 = 100;

/// How many replies the proxy loses for logical request `n`: about one per request on average,
/// every request answered within the policy's attempts.
fn drops_for(n: u32) -> u32 {
    n % 3
}

fn expected_losses() -> usize {
    (0..REQUESTS).map(|n| drops_for(n) as usize).sum()
}

/// Fast backoff, room for every injected loss, and a budget sized for it (the default budget
/// would rightly stop retrying when a third of all replies are lost).
fn policy() -> HttpRetryPolicy {
    HttpRetryPolicy::new()
        .backoff(Backoff::new(Duration::from_millis(5), Duration::from_millis(50)).max_attempts(6))
        .budget(TpsBudget::new(Duration::from_secs(10), 100, 1.0))
}

/// One connection per request, so that a lost reply never poisons a pooled connection and the
/// proxy sees one request per connection.
fn reqwest_client() -> reqwest::Client {
    reqwest::Client::builder().pool_max_idle_per_host(0).build().unwrap()
}

fn right_order(retry: RetryMiddleware) -> ClientWithMiddleware {
    reqwest_middleware::ClientBuilder::new(reqwest_client()).with(IdempotencyKeyMiddleware::new()).with(retry).build()
}

// ---------------------------------------------------------------------------------------------
// The server: refunds behind IdempotencyLayer

fn refund_request(client: &ClientWithMiddleware, to: SocketAddr, order: u32) -> reqwest_middleware::RequestBuilder {
    client
        .post(format!("http://{to}/refunds"))
        .header("content-type", "application/json")
        .header("x-logical-request", order)
        .body(format!("{{\"order\":{order}}}"))
}

async fn read(response: reqwest::Response) -> Answer {
    let status = response.status();
    let replayed = response.headers().get(IDEMPOTENT_REPLAYED).is_some_and(|v| v == "true");
    Answer { status, replayed, body: response.text().await.unwrap() }
}

/// Sends logical requests `0..REQUESTS` through `client`, 16 at a time.
async fn send_all(client: ClientWithMiddleware, to: SocketAddr) -> HashMap<u32, Result<Answer, String>> {
    let limit = Arc::new(Semaphore::new(16));
    let mut tasks = JoinSet::new();
    for order in 0..REQUESTS {
        let (client, limit) = (client.clone(), limit.clone());
        tasks.spawn(async move {
            let _permit = limit.acquire_owned().await.unwrap();
            let answer = match refund_request(&client, to, order).send().await {
                Ok(response) => Ok(read(response).await),
                Err(error) => Err(format!("{error:#}")),
            };
            (order, answer)
        });
    }
    tasks.join_all().await.into_iter().collect()
}

// ---------------------------------------------------------------------------------------------
// Right order: one refund per logical request, one key across its attempts

async fn key_before_retry_refunds_each_order_once(store: SharedStore) {
    let (server, refunds) = start_refund_server(store).await;
    let proxy = LossyProxy::start(server, lose_first_replies(drops_for)).await;

    let answers = send_all(right_order(RetryMiddleware::new(policy())), proxy.addr()).await;

    assert_eq!(proxy.lost(), expected_losses(), "the proxy lost the replies it was told to");
    assert_each_order_refunded_once(&answers, &refunds, REQUESTS, drops_for);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_key_middleware_before_retry_refunds_each_order_once_despite_lost_replies() {
    key_before_retry_refunds_each_order_once(Arc::new(MemoryStore::new())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_key_middleware_before_retry_refunds_each_order_once_despite_lost_replies() {
    let redis = RedisServer::start();
    key_before_retry_refunds_each_order_once(Arc::new(RedisStore::connect_lazy(redis.url()).unwrap())).await;
    drop(redis);
}

/// Records the key of every attempt that reaches the network, below the retry middleware.
#[derive(Clone, Default)]
struct SeenKeys(Arc<Mutex<Vec<Option<String>>>>);

impl SeenKeys {
    fn middleware(&self) -> SeenKeys {
        self.clone()
    }

    fn get(&self) -> Vec<Option<String>> {
        self.0.lock().unwrap().clone()
    }
}

/// What `#[async_trait]` makes `Middleware::handle` return.
type Handled<'a> = std::pin::Pin<Box<dyn Future<Output = reqwest_middleware::Result<reqwest::Response>> + Send + 'a>>;

impl Middleware for SeenKeys {
    fn handle<'a, 'b, 'c, 'd>(
        &'a self,
        request: reqwest::Request,
        extensions: &'b mut http::Extensions,
        next: Next<'c>,
    ) -> Handled<'d>
    where
        'a: 'd,
        'b: 'd,
        'c: 'd,
        Self: 'd,
    {
        let key = request.headers().get("idempotency-key").map(|k| k.to_str().unwrap().to_owned());
        self.0.lock().unwrap().push(key);
        next.run(request, extensions)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_attempt_of_a_logical_request_carries_the_first_attempts_key() {
    let (server, refunds) = start_refund_server(Arc::new(MemoryStore::new())).await;
    let proxy = LossyProxy::start(server, lose_first_replies(drops_for)).await;
    let seen = SeenKeys::default();
    let client = reqwest_middleware::ClientBuilder::new(reqwest_client())
        .with(IdempotencyKeyMiddleware::new())
        .with(RetryMiddleware::new(policy()))
        .with(seen.middleware())
        .build();

    // Order 2 loses two replies: three attempts.
    let answer = read(refund_request(&client, proxy.addr(), 2).send().await.unwrap()).await;

    assert_eq!((answer.status, answer.replayed), (StatusCode::CREATED, true));
    let keys = seen.get();
    assert_eq!(keys.len(), 3, "three attempts: {keys:?}");
    assert!(keys[0].as_deref().is_some_and(|k| k.starts_with('"')), "a random UUID key: {keys:?}");
    assert!(keys.iter().all(|k| k == &keys[0]), "one key across the attempts: {keys:?}");
    assert_eq!(refunds.keys(2), HashSet::from([keys[0].clone().unwrap()]));
    assert_eq!(refunds.effects(2), 1);
}

// ---------------------------------------------------------------------------------------------
// Wrong order: the key middleware after the retry middleware

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_middleware_after_retry_never_retries_a_post_and_never_repeats_it() {
    let (server, refunds) = start_refund_server(Arc::new(MemoryStore::new())).await;
    let proxy = LossyProxy::start(server, lose_first_replies(drops_for)).await;
    let client = reqwest_middleware::ClientBuilder::new(reqwest_client())
        .with(RetryMiddleware::new(policy()))
        .with(IdempotencyKeyMiddleware::new())
        .build();

    let answers = send_all(client, proxy.addr()).await;

    // The retry middleware sees each POST before it has a key: never retried. The lost replies
    // surface as errors, and nothing runs twice.
    for order in 0..REQUESTS {
        assert_eq!(answers[&order].is_err(), drops_for(order) > 0, "order {order}: {:?}", answers[&order]);
        assert_eq!(refunds.effects(order), 1, "order {order}");
    }
    assert_eq!(proxy.lost(), (0..REQUESTS).filter(|n| drops_for(*n) > 0).count(), "one attempt per request");
}

/// Retries every error of every request, as hand-written retry middleware often does.
struct RetryErrors(u32);

impl Middleware for RetryErrors {
    fn handle<'a, 'b, 'c, 'd>(
        &'a self,
        request: reqwest::Request,
        extensions: &'b mut http::Extensions,
        next: Next<'c>,
    ) -> Handled<'d>
    where
        'a: 'd,
        'b: 'd,
        'c: 'd,
        Self: 'd,
    {
        Box::pin(async move {
            let mut left = self.0;
            loop {
                let copy = request.try_clone().unwrap();
                match next.clone().run(copy, extensions).await {
                    Err(_) if left > 0 => left -= 1,
                    result => return result,
                }
            }
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_naive_retry_before_the_key_middleware_sends_a_new_key_per_attempt_and_repeats_refunds() {
    let (server, refunds) = start_refund_server(Arc::new(MemoryStore::new())).await;
    let proxy = LossyProxy::start(server, lose_first_replies(drops_for)).await;
    let client = reqwest_middleware::ClientBuilder::new(reqwest_client())
        .with(RetryErrors(5))
        .with(IdempotencyKeyMiddleware::new())
        .build();

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

// ---------------------------------------------------------------------------------------------
// Derived keys, 409 in flight, 429 with Retry-After, the budget

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_that_gives_up_and_resends_with_its_operation_key_gets_the_first_refund() {
    let (server, refunds) = start_refund_server(Arc::new(MemoryStore::new())).await;
    let proxy = FaultProxy::start(server).await;
    let client = right_order(RetryMiddleware::new(
        policy().backoff(Backoff::new(Duration::from_millis(5), Duration::from_millis(20)).max_attempts(4)),
    ));
    let key = OperationKey::new(&Key::derive(&KeyScope::new("run-7", "refund"), &7).unwrap());

    // Every reply is lost: the client gives up after its 4 attempts.
    proxy.set(Fault::DropReplies);
    let error = refund_request(&client, proxy.addr(), 7).with_extension(key.clone()).send().await.unwrap_err();
    assert_eq!(proxy.forwarded_replies(), 0, "no reply reached the client: {error}");
    assert_eq!(refunds.effects(7), 1, "the first attempt refunded; the other three were replays");

    // The worker restarts and sends the same logical request with the same derived key.
    proxy.set(Fault::Pass);
    let answer = read(refund_request(&client, proxy.addr(), 7).with_extension(key.clone()).send().await.unwrap()).await;
    assert_eq!((answer.status, answer.replayed), (StatusCode::CREATED, true));
    assert_eq!(answer.body, "{\"refund\":\"re_7_1\"}");
    assert_eq!(refunds.keys(7), HashSet::from([key.header_value().to_str().unwrap().to_owned()]));
    assert_eq!(refunds.effects(7), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_concurrent_duplicate_is_refused_with_409_then_retried_into_the_first_response() {
    let (server, refunds) = start_refund_server(Arc::new(MemoryStore::new())).await;
    let client = right_order(RetryMiddleware::new(policy()));
    // A double click: the same logical request, with the caller's key, sent twice at once. The
    // handler holds the first until the server has refused the second with 409.
    let request = || {
        client
            .post(format!("http://{server}/refunds"))
            .header("content-type", "application/json")
            .header("idempotency-key", "\"double-click-1\"")
            .body("{\"order\":42,\"wait_for_duplicate\":true}")
            .send()
    };
    let (a, b) = tokio::join!(request(), request());
    let (a, b) = (read(a.unwrap()).await, read(b.unwrap()).await);

    assert_eq!((a.status, b.status), (StatusCode::CREATED, StatusCode::CREATED));
    assert_eq!(a.body, "{\"refund\":\"re_42_1\"}");
    assert_eq!(a.body, b.body);
    assert!(a.replayed != b.replayed, "one ran, the other got the stored response: {a:?} {b:?}");
    assert_eq!(refunds.keys(42), HashSet::from(["\"double-click-1\"".to_owned()]), "the caller's key is kept");
    assert_eq!(refunds.effects(42), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_429_with_retry_after_is_retried_after_the_wait_it_asks_for() {
    let (server, refunds) = start_refund_server(Arc::new(MemoryStore::new())).await;
    refunds.overloaded.store(1, Ordering::SeqCst);
    let client = right_order(RetryMiddleware::new(policy()));

    let started = Instant::now();
    let answer = read(refund_request(&client, server, 5).send().await.unwrap()).await;

    // The backoff alone would have waited at most 5 ms; `Retry-After: 1` asks for a second.
    assert!(started.elapsed() >= Duration::from_secs(1), "waited {:?}", started.elapsed());
    assert_eq!((answer.status, answer.replayed), (StatusCode::CREATED, true));
    assert_eq!(refunds.effects(5), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_retry_budget_stops_the_retries() {
    let (server, refunds) = start_refund_server(Arc::new(MemoryStore::new())).await;
    refunds.overloaded.store(1, Ordering::SeqCst);
    let seen = SeenKeys::default();
    let client = reqwest_middleware::ClientBuilder::new(reqwest_client())
        .with(IdempotencyKeyMiddleware::new())
        .with(RetryMiddleware::new(policy().budget(TpsBudget::new(Duration::from_secs(1), 0, 0.0))))
        .with(seen.middleware())
        .build();

    let answer = read(refund_request(&client, server, 9).send().await.unwrap()).await;

    assert_eq!(answer.status, StatusCode::TOO_MANY_REQUESTS, "no budget for a retry: the 429 is returned");
    assert_eq!(seen.get().len(), 1);
    assert_eq!(refunds.effects(9), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_post_sent_without_the_key_middleware_is_never_retried() {
    let (server, refunds) = start_refund_server(Arc::new(MemoryStore::new())).await;
    refunds.overloaded.store(1, Ordering::SeqCst);
    let seen = SeenKeys::default();
    let client = reqwest_middleware::ClientBuilder::new(reqwest_client())
        .with(RetryMiddleware::new(policy()))
        .with(seen.middleware())
        .build();

    let answer = read(refund_request(&client, server, 3).send().await.unwrap()).await;

    assert_eq!(answer.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(seen.get(), vec![None], "one attempt, without a key");
    assert_eq!(refunds.effects(3), 1);
}
