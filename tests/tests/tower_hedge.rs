//! Hedged requests (`idempotent_tower::client::hedge`) against an axum server behind
//! `IdempotencyLayer`, on loopback: the hedge's copy carries the first copy's key, the server
//! runs the effect once, and both copies get its response.
//!
//! A recorder in front of the layer logs every arrival (with its key) and every response (was it
//! a replay?), and holds chosen arrivals back; the tests wait on its counters, never on a clock.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::{Request as AxumRequest, State};
use axum::middleware::{Next, from_fn_with_state};
use axum::response::Response as AxumResponse;
use axum::routing::{get, post};
use bytes::Bytes;
use http::header::CONTENT_TYPE;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use idempotent_core::{MemoryStore, OnInFlight};
use idempotent_tower::IdempotencyKeyLayer;
use idempotent_tower::client::hedge::HedgeLayer;
use idempotent_tower::server::{IDEMPOTENT_REPLAYED, IdempotencyLayer};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tower::{BoxError, Service, ServiceBuilder, ServiceExt};

type HttpClient = Client<HttpConnector, Full<Bytes>>;

fn http_client() -> HttpClient {
    Client::builder(TokioExecutor::new()).build_http()
}

/// What the server saw, and the counters the tests wait on.
#[derive(Clone)]
struct Recorder {
    /// The key of every request that reached the server, in order.
    arrivals: Arc<Mutex<Vec<Option<String>>>>,
    /// The status of every response, and whether it was a replay.
    responses: Arc<Mutex<Vec<(StatusCode, bool)>>>,
    arrived: watch::Sender<usize>,
    answered: watch::Sender<usize>,
    /// Set by the test once the client has its answer; held requests go on then.
    released: watch::Sender<bool>,
    /// Refunds made (the effect), counted by the handler.
    effects: Arc<Mutex<u32>>,
}

impl Recorder {
    fn new() -> Recorder {
        Recorder {
            arrivals: Arc::default(),
            responses: Arc::default(),
            arrived: watch::channel(0).0,
            answered: watch::channel(0).0,
            released: watch::channel(false).0,
            effects: Arc::default(),
        }
    }

    async fn arrivals_reach(&self, n: usize) {
        let mut rx = self.arrived.subscribe();
        tokio::time::timeout(Duration::from_secs(10), rx.wait_for(|seen| *seen >= n))
            .await
            .unwrap_or_else(|_| panic!("{n} arrivals within 10 s: {:?}", self.arrivals.lock().unwrap()))
            .unwrap();
    }

    async fn answers_reach(&self, n: usize) {
        let mut rx = self.answered.subscribe();
        tokio::time::timeout(Duration::from_secs(10), rx.wait_for(|seen| *seen >= n))
            .await
            .unwrap_or_else(|_| panic!("{n} answers within 10 s: {:?}", self.responses.lock().unwrap()))
            .unwrap();
    }

    fn release(&self) {
        self.released.send_replace(true);
    }

    async fn until_released(&self) {
        let mut rx = self.released.subscribe();
        tokio::time::timeout(Duration::from_secs(10), rx.wait_for(|released| *released))
            .await
            .expect("the test released held requests within 10 s")
            .unwrap();
    }

    fn effects(&self) -> u32 {
        *self.effects.lock().unwrap()
    }
}

/// In front of the idempotency layer: records arrivals and answers; holds the first copy of a
/// request marked `x-stall-first` until the test releases it (a slow connection, a queue: the
/// first copy is late before it reaches the layer).
///
/// The request is handled in a task of its own, as many servers do: a copy whose client went
/// away (the hedge took the other answer) still runs to its end, so that every copy is
/// accounted for.
async fn record(State(recorder): State<Recorder>, request: AxumRequest, next: Next) -> AxumResponse {
    let key = request.headers().get("idempotency-key").map(|k| k.to_str().unwrap().to_owned());
    let stall = request.headers().contains_key("x-stall-first");
    let arrival = {
        let mut arrivals = recorder.arrivals.lock().unwrap();
        arrivals.push(key);
        arrivals.len()
    };
    recorder.arrived.send_replace(arrival);
    let handled = tokio::spawn(async move {
        if stall && arrival == 1 {
            recorder.until_released().await;
        }
        let response = next.run(request).await;
        let replayed = response.headers().get(IDEMPOTENT_REPLAYED).is_some_and(|v| v == "true");
        let answers = {
            let mut responses = recorder.responses.lock().unwrap();
            responses.push((response.status(), replayed));
            responses.len()
        };
        recorder.answered.send_replace(answers);
        response
    });
    handled.await.unwrap()
}

/// The refund. A body `{"hold": "hedge"}` holds it until a second copy has arrived (a slow
/// handler, holding the key); `{"hold": "release"}` until the test releases it; `{"hold": "ms"}`
/// makes it take 50 ms (a slow request, ample time for a hedge sent at once).
async fn refund(State(recorder): State<Recorder>, body: String) -> (StatusCode, String) {
    let request: serde_json::Value = serde_json::from_str(&body).unwrap();
    match request["hold"].as_str() {
        Some("hedge") => recorder.arrivals_reach(2).await,
        Some("release") => recorder.until_released().await,
        Some("ms") => tokio::time::sleep(Duration::from_millis(50)).await,
        _ => {}
    }
    let n = {
        let mut effects = recorder.effects.lock().unwrap();
        *effects += 1;
        *effects
    };
    (StatusCode::CREATED, format!("{{\"refund\":\"re_{n}\"}}"))
}

/// A read that holds until its hedge has arrived: the third arrival of the one test that reads
/// it (a `POST`, then this `GET` and its copy), whichever copy is counted first.
async fn balance(State(recorder): State<Recorder>) -> &'static str {
    recorder.arrivals_reach(3).await;
    "42"
}

async fn start_server(on_in_flight: OnInFlight) -> (SocketAddr, Recorder) {
    let recorder = Recorder::new();
    let app = Router::new()
        .route("/refunds", post(refund))
        .route("/balance", get(balance))
        .with_state(recorder.clone())
        .layer(IdempotencyLayer::new(MemoryStore::new()).on_in_flight(on_in_flight))
        .layer(from_fn_with_state(recorder.clone(), record));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (addr, recorder)
}

fn wait() -> OnInFlight {
    OnInFlight::Wait { timeout: Duration::from_secs(10) }
}

/// Hedges every request at once: no latency data needed, so the tests do not depend on how
/// fast loopback is. (In production: the defaults, p95 after 100 data points.)
fn hedge_now() -> HedgeLayer<Full<Bytes>> {
    HedgeLayer::new().min_data_points(0)
}

fn refund_request(to: SocketAddr, body: &str) -> Request<Full<Bytes>> {
    Request::post(format!("http://{to}/refunds"))
        .header(CONTENT_TYPE, "application/json")
        .body(Full::from(body.to_owned()))
        .unwrap()
}

/// One request through `client` (tower's `Hedge` is not `Clone`: one service, called in turn).
async fn send<S>(client: &mut S, request: Request<Full<Bytes>>) -> (StatusCode, bool, String)
where
    S: Service<Request<Full<Bytes>>, Response = Response<Incoming>, Error = BoxError>,
{
    let response = client.ready().await.unwrap().call(request).await.unwrap();
    let status = response.status();
    let replayed = response.headers().get(IDEMPOTENT_REPLAYED).is_some_and(|v| v == "true");
    let body = String::from_utf8(response.into_body().collect().await.unwrap().to_bytes().to_vec()).unwrap();
    (status, replayed, body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hedge_of_a_slow_handler_waits_for_it_and_returns_its_response() {
    let (server, recorder) = start_server(wait()).await;
    let hedge = hedge_now();
    let policy = hedge.shared_policy().clone();
    let mut client = ServiceBuilder::new().layer(IdempotencyKeyLayer::new()).layer(hedge).service(http_client());

    let (status, _, body) = send(&mut client, refund_request(server, r#"{"hold":"hedge"}"#)).await;
    recorder.answers_reach(2).await;

    assert_eq!((status, body.as_str()), (StatusCode::CREATED, r#"{"refund":"re_1"}"#));
    assert_eq!(policy.hedges(), 1);
    let arrivals = recorder.arrivals.lock().unwrap().clone();
    assert_eq!(arrivals.len(), 2, "the request and its hedge");
    assert!(arrivals[0].is_some() && arrivals[0] == arrivals[1], "one key, twice: {arrivals:?}");
    let mut responses = recorder.responses.lock().unwrap().clone();
    responses.sort_by_key(|(_, replayed)| *replayed);
    assert_eq!(responses, [(StatusCode::CREATED, false), (StatusCode::CREATED, true)], "one ran, the other replayed");
    assert_eq!(recorder.effects(), 1, "refunded once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hedge_that_overtakes_a_late_first_copy_runs_the_effect_and_the_late_copy_replays_it() {
    let (server, recorder) = start_server(wait()).await;
    let mut client = ServiceBuilder::new().layer(IdempotencyKeyLayer::new()).layer(hedge_now()).service(http_client());
    let mut request = refund_request(server, "{}");
    request.headers_mut().insert("x-stall-first", "1".parse().unwrap());

    let (status, replayed, body) = send(&mut client, request).await;

    // The caller has the other copy's answer while the first to arrive is still held back.
    assert_eq!((status, replayed, body.as_str()), (StatusCode::CREATED, false, r#"{"refund":"re_1"}"#));
    assert_eq!(recorder.effects(), 1);
    recorder.release();
    recorder.answers_reach(2).await;
    let responses = recorder.responses.lock().unwrap().clone();
    assert_eq!(responses, [(StatusCode::CREATED, false), (StatusCode::CREATED, true)], "the late copy was a replay");
    let arrivals = recorder.arrivals.lock().unwrap().clone();
    assert!(arrivals.len() == 2 && arrivals[0].is_some() && arrivals[0] == arrivals[1], "{arrivals:?}");
    assert_eq!(recorder.effects(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_post_without_a_key_is_never_hedged_and_a_get_is() {
    let (server, recorder) = start_server(wait()).await;
    let hedge = hedge_now();
    let policy = hedge.shared_policy().clone();
    // No key layer at all: the POST goes out without a key.
    let mut client = ServiceBuilder::new().layer(hedge).service(http_client());

    let (status, _, _) = send(&mut client, refund_request(server, r#"{"hold":"ms"}"#)).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(policy.hedges(), 0, "the policy refused to copy a POST without a key");
    assert_eq!(recorder.arrivals.lock().unwrap().len(), 1);

    let balance = Request::get(format!("http://{server}/balance")).body(Full::default()).unwrap();
    let (status, _, body) = send(&mut client, balance).await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, "42"));
    assert_eq!(policy.hedges(), 1, "the GET was hedged without a key");
    assert_eq!(recorder.arrivals.lock().unwrap().len(), 3);
    assert_eq!(recorder.effects(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hedge_outside_the_key_layer_sees_no_key_and_hedges_nothing() {
    let (server, recorder) = start_server(wait()).await;
    let hedge = hedge_now();
    let policy = hedge.shared_policy().clone();
    let mut client = ServiceBuilder::new().layer(hedge).layer(IdempotencyKeyLayer::new()).service(http_client());

    let (status, _, _) = send(&mut client, refund_request(server, r#"{"hold":"ms"}"#)).await;

    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(policy.hedges(), 0);
    let arrivals = recorder.arrivals.lock().unwrap().clone();
    assert!(arrivals.len() == 1 && arrivals[0].is_some(), "one copy, keyed below the hedge: {arrivals:?}");
    assert_eq!(recorder.effects(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn against_a_server_that_rejects_in_flight_keys_the_caller_gets_the_hedges_409() {
    let (server, recorder) = start_server(OnInFlight::Reject).await;
    let mut client = ServiceBuilder::new().layer(IdempotencyKeyLayer::new()).layer(hedge_now()).service(http_client());

    // The copy that took the key holds it until the test releases it.
    let (status, _, _) = send(&mut client, refund_request(server, r#"{"hold":"release"}"#)).await;

    // Why hedging needs `OnInFlight::Wait`: the other copy's refusal is the first answer, and
    // the hedge returns it while the refund is still being made.
    assert_eq!(status, StatusCode::CONFLICT);
    recorder.release();
    recorder.answers_reach(2).await;
    let mut responses = recorder.responses.lock().unwrap().clone();
    responses.sort();
    assert_eq!(responses, [(StatusCode::CREATED, false), (StatusCode::CONFLICT, false)]);
    assert_eq!(recorder.effects(), 1, "the refund itself still ran once");
}
