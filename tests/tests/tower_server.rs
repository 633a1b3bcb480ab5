//! The server `IdempotencyLayer` behind real axum servers on loopback, over HTTP/1.1 (hyper client
//! and raw sockets) and HTTP/2 (h2c), on every store.
//!
//! Every scenario is an `async fn(SharedStore)`; `on_every_store!` runs it once per store as
//! `memory::<name>`, `sqlite::<name>`, `postgres::<name>` and `redis::<name>`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body as AxumBody;
use axum::extract::{Extension, Path, Query, State};
use axum::routing::post;
use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, Response, StatusCode};
use http_body::Frame;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use idempotent_core::{Error, FailMode, OnInFlight, RedisStore, SharedStore, Store};
use idempotent_tests::{HookedStore, RedisServer, free_port};
use idempotent_tower::Attempt;
use idempotent_tower::server::{IdempotencyLayer, Unprotected};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{Notify, Semaphore};
use tower::{Layer, ServiceExt};

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type ClientBody = BoxBody<Bytes, BoxError>;

idempotent_tests::on_every_store!(
    replay_is_byte_identical_over_http1,
    replay_keeps_trailers_over_http2,
    sixty_four_concurrent_requests_run_the_handler_once,
    sixty_four_waiting_requests_all_get_the_first_response,
    tenants_never_share_a_record,
    another_request_under_the_same_key_is_422,
    missing_key_passes_through_or_is_400_when_required,
    malformed_keys_are_400,
    bodies_over_the_cap_are_413_with_or_without_content_length,
    a_body_that_fails_mid_stream_is_400,
    retryable_outcomes_release_the_key_and_final_ones_are_replayed,
    responses_over_the_store_cap_are_sent_but_not_stored,
    methods_and_header_name_are_configurable,
    the_heartbeat_keeps_a_long_request_in_flight,
    a_corrupt_record_is_500_and_never_replayed,
    a_response_body_that_fails_releases_the_key,
    a_waiting_duplicate_gives_up_with_409,
    a_request_dropped_while_its_body_is_read_still_stores_the_response,
    a_request_dropped_while_complete_is_in_flight_still_stores_the_response,
    a_request_dropped_while_release_is_in_flight_still_frees_the_key,
    a_lease_whose_renewals_keep_failing_still_stores_when_no_one_took_over,
    absurd_lease_and_retention_are_refused,
    a_key_that_needs_attention_is_409_and_runs_nothing_until_resolved,
    the_handler_sees_one_downstream_key_per_idempotency_key,
    a_layer_that_never_reruns_blindly_stops_a_recovered_request_for_an_operator,
    the_replay_hook_changes_replayed_responses_only,
);

// ---------------------------------------------------------------------------------------------
// The application under test

/// What the handlers did, and a gate that holds `/gated` open until the test lets it finish.
#[derive(Clone)]
struct Effects {
    calls: Arc<AtomicUsize>,
    entered: Arc<Notify>,
    gate: Arc<Semaphore>,
}

impl Effects {
    fn new() -> Self {
        Effects { calls: Arc::default(), entered: Arc::default(), gate: Arc::new(Semaphore::new(0)) }
    }

    fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }

    fn call(&self) -> usize {
        self.calls.fetch_add(1, Ordering::SeqCst) + 1
    }
}

async fn refund(
    State(l): State<Effects>,
    lease: Option<Extension<Attempt>>,
    unprotected: Option<Extension<Unprotected>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response<AxumBody> {
    let n = l.call();
    let tenant = headers.get("x-tenant").and_then(|v| v.to_str().ok()).unwrap_or("-").to_owned();
    // The fence of the lease this request runs under (0 when the layer failed open, "none"
    // without a key).
    let fence = lease.as_ref().map_or_else(|| "none".to_owned(), |Extension(l)| l.fence().to_string());
    let downstream = lease.map_or_else(|| "none".to_owned(), |Extension(l)| l.downstream_key().to_string());
    let mut res = Response::builder();
    if let Some(Extension(why)) = unprotected {
        res = res.header("x-unprotected", format!("{why:?}"));
    }
    res.status(StatusCode::CREATED)
        .header("x-fence", fence)
        .header("x-downstream-key", downstream)
        .header("set-cookie", "session=abc; Path=/; HttpOnly")
        .header("set-cookie", format!("refund=re_{n}; Path=/"))
        .header("x-refund", format!("re_{n}"))
        .header("content-type", "application/json")
        .body(AxumBody::from(format!(r#"{{"refund":"re_{n}","tenant":"{tenant}","bytes":{}}}"#, body.len())))
        .unwrap()
}

async fn status(
    State(l): State<Effects>,
    Path(code): Path<u16>,
    lease: Option<Extension<Attempt>>,
) -> Response<AxumBody> {
    let n = l.call();
    let downstream = lease.map_or_else(|| "none".to_owned(), |Extension(l)| l.downstream_key().to_string());
    Response::builder()
        .status(code)
        .header("x-downstream-key", downstream)
        .body(AxumBody::from(format!("status {code}, call {n}")))
        .unwrap()
}

#[derive(serde::Deserialize)]
struct Size {
    bytes: usize,
}

async fn big(State(l): State<Effects>, Query(size): Query<Size>) -> Response<AxumBody> {
    let n = l.call();
    let mut body = format!("call {n};").into_bytes();
    body.resize(size.bytes, b'x');
    // Streamed in 512-byte chunks, with no length announced.
    let chunks: Vec<Result<Frame<Bytes>, BoxError>> =
        body.chunks(512).map(|c| Ok(Frame::data(Bytes::copy_from_slice(c)))).collect();
    Response::new(AxumBody::new(StreamBody::new(futures_util::stream::iter(chunks))))
}

async fn gated(State(l): State<Effects>) -> Response<AxumBody> {
    let n = l.call();
    l.entered.notify_one();
    l.gate.acquire().await.unwrap().forget();
    Response::builder().status(StatusCode::CREATED).body(AxumBody::from(format!("gated re_{n}"))).unwrap()
}

async fn trailers(State(l): State<Effects>) -> Response<AxumBody> {
    let n = l.call();
    let mut t = HeaderMap::new();
    t.insert("x-checksum", HeaderValue::from_str(&format!("sum-{n}")).unwrap());
    t.append("x-multi", HeaderValue::from_static("one"));
    t.append("x-multi", HeaderValue::from_static("two"));
    let frames: Vec<Result<Frame<Bytes>, BoxError>> = vec![
        Ok(Frame::data(Bytes::from(format!("streamed {n} ")))),
        Ok(Frame::data(Bytes::from_static(b"\x00\xffbinary"))),
        Ok(Frame::trailers(t)),
    ];
    Response::new(AxumBody::new(StreamBody::new(futures_util::stream::iter(frames))))
}

async fn failing(State(l): State<Effects>) -> Response<AxumBody> {
    let n = l.call();
    let frames: Vec<Result<Frame<Bytes>, BoxError>> =
        vec![Ok(Frame::data(Bytes::from(format!("partial {n}")))), Err("the database went away".into())];
    Response::new(AxumBody::new(StreamBody::new(futures_util::stream::iter(frames))))
}

/// Answers at once; the body yields only once the gate opens.
async fn slow_body(State(l): State<Effects>) -> Response<AxumBody> {
    let n = l.call();
    let body = futures_util::stream::once(async move {
        l.entered.notify_one();
        l.gate.acquire().await.unwrap().forget();
        Ok::<_, BoxError>(Frame::data(Bytes::from(format!("slow re_{n}"))))
    });
    Response::builder().status(StatusCode::CREATED).body(AxumBody::new(StreamBody::new(body))).unwrap()
}

fn routes(effects: &Effects) -> Router {
    Router::new()
        .route("/refunds", post(refund).patch(refund).get(refund).put(refund))
        .route("/status/{code}", post(status))
        .route("/big", post(big))
        .route("/gated", post(gated))
        .route("/trailers", post(trailers))
        .route("/failing", post(failing))
        .route("/slow-body", post(slow_body))
        .with_state(effects.clone())
}

fn tenant_from_header(parts: &http::request::Parts) -> Option<String> {
    parts.headers.get("x-tenant").and_then(|v| v.to_str().ok()).map(str::to_owned)
}

/// A running server and a client for it.
struct App {
    addr: SocketAddr,
    effects: Effects,
    h1: Client<HttpConnector, ClientBody>,
    h2: Client<HttpConnector, ClientBody>,
}

impl App {
    async fn start(store: &SharedStore, configure: impl FnOnce(IdempotencyLayer) -> IdempotencyLayer) -> App {
        let effects = Effects::new();
        let layer = configure(IdempotencyLayer::new(store.clone()).tenant(tenant_from_header));
        Self::serve(routes(&effects).layer(layer), effects).await
    }

    async fn serve(router: Router, effects: Effects) -> App {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
        let h1 = Client::builder(TokioExecutor::new()).build_http();
        let h2 = Client::builder(TokioExecutor::new()).http2_only(true).build_http();
        App { addr, effects, h1, h2 }
    }

    fn req(&self, method: &str, path: &str) -> http::request::Builder {
        Request::builder()
            .method(method)
            .uri(format!("http://{}{path}", self.addr))
            .header("content-type", "application/json")
    }

    fn post(&self, path: &str, key: &str) -> http::request::Builder {
        self.req("POST", path).header("idempotency-key", key)
    }

    async fn h1(&self, req: http::request::Builder, body: impl Into<Bytes>) -> Reply {
        Reply::read(self.h1.request(req.body(full(body)).unwrap()).await.unwrap()).await
    }

    async fn h2(&self, req: http::request::Builder, body: impl Into<Bytes>) -> Reply {
        Reply::read(self.h2.request(req.body(full(body)).unwrap()).await.unwrap()).await
    }

    /// Sends raw bytes on a fresh connection and reads until the server closes it.
    async fn raw(&self, request: &[u8]) -> Vec<u8> {
        let mut s = tokio::net::TcpStream::connect(self.addr).await.unwrap();
        s.write_all(request).await.unwrap();
        let mut out = Vec::new();
        s.read_to_end(&mut out).await.unwrap();
        out
    }
}

fn full(body: impl Into<Bytes>) -> ClientBody {
    Full::new(body.into()).map_err(|never| match never {}).boxed()
}

#[derive(Debug)]
struct Reply {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
    trailers: Option<HeaderMap>,
}

impl Reply {
    async fn read(res: Response<hyper::body::Incoming>) -> Reply {
        let (parts, body) = res.into_parts();
        let collected = body.collect().await.unwrap();
        let trailers = collected.trailers().cloned();
        Reply { status: parts.status, headers: parts.headers, body: collected.to_bytes(), trailers }
    }

    fn replayed(&self) -> bool {
        match self.headers.get("idempotent-replayed") {
            None => false,
            Some(v) if v == "true" => true,
            Some(v) => panic!("Idempotent-Replayed: {v:?}"),
        }
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// Asserts an RFC 9457 problem with `status` and the given type suffix, and returns it.
    #[track_caller]
    fn problem(&self, status: u16, kind: &str) -> serde_json::Value {
        assert_eq!(self.status.as_u16(), status, "body: {}", self.text());
        assert_eq!(self.headers["content-type"], "application/problem+json");
        let doc: serde_json::Value = serde_json::from_slice(&self.body).unwrap();
        assert_eq!(doc["status"], status);
        assert_eq!(doc["type"], format!("tag:idempotent-tower,2025:{kind}"));
        assert!(doc["title"].as_str().is_some_and(|t| !t.is_empty()));
        assert!(doc["detail"].as_str().is_some_and(|d| d.len() > 40), "{doc}");
        doc
    }
}

/// A raw HTTP/1.1 POST that closes the connection after the response.
fn raw_post(path: &str, key: &str, body: &str) -> Vec<u8> {
    format!(
        "POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\nIdempotency-Key: {key}\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// The response's bytes without the header lines named in `drop` (case-insensitive).
fn without_headers(raw: &[u8], drop: &[&str]) -> Vec<u8> {
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n").expect("a complete response head") + 4;
    let (head, body) = raw.split_at(split);
    let head = String::from_utf8(head.to_vec()).unwrap();
    let mut out = String::new();
    for line in head.split_inclusive("\r\n") {
        let name = line.split(':').next().unwrap_or("").to_ascii_lowercase();
        if !drop.contains(&name.as_str()) {
            out.push_str(line);
        }
    }
    let mut out = out.into_bytes();
    out.extend_from_slice(body);
    out
}

// ---------------------------------------------------------------------------------------------
// Scenarios

async fn replay_is_byte_identical_over_http1(store: SharedStore) {
    let app = App::start(&store, |l| l).await;
    let request = raw_post("/refunds", "\"raw-1\"", r#"{"order":"o-1","amount":1500}"#);
    let first = app.raw(&request).await;
    let second = app.raw(&request).await;
    assert_eq!(app.effects.calls(), 1);

    let first_text = String::from_utf8_lossy(&first);
    assert!(first_text.starts_with("HTTP/1.1 201 Created\r\n"), "{first_text}");
    assert_eq!(first_text.matches("set-cookie: ").count(), 2, "{first_text}");
    assert!(!first_text.contains("idempotent-replayed"));
    // The handler ran under a lease and saw its fence.
    let fence = first_text.split("\r\nx-fence: ").nth(1).and_then(|rest| rest.split("\r\n").next());
    assert!(fence.is_some_and(|f| f.parse::<u64>().is_ok_and(|f| f > 0)), "{first_text}");
    let second_text = String::from_utf8_lossy(&second);
    assert!(second_text.contains("\r\nidempotent-replayed: true\r\n"), "{second_text}");

    // Apart from the date and the replay marker, the replay is the first response, byte for byte.
    assert_eq!(
        String::from_utf8_lossy(&without_headers(&second, &["date", "idempotent-replayed"])),
        String::from_utf8_lossy(&without_headers(&first, &["date"])),
    );

    // The bare form of the same key names the same record.
    let bare = app.raw(&raw_post("/refunds", "raw-1", r#"{"order":"o-1","amount":1500}"#)).await;
    assert_eq!(without_headers(&bare, &["date", "idempotent-replayed"]), without_headers(&first, &["date"]));
    assert_eq!(app.effects.calls(), 1);
}

async fn replay_keeps_trailers_over_http2(store: SharedStore) {
    let app = App::start(&store, |l| l).await;
    let first = app.h2(app.post("/trailers", "t-1"), "{}").await;
    let second = app.h2(app.post("/trailers", "t-1"), "{}").await;
    assert_eq!(app.effects.calls(), 1);
    assert_eq!(first.status, StatusCode::OK);
    assert!(!first.replayed());
    assert!(second.replayed());
    assert_eq!(first.body, Bytes::from_static(b"streamed 1 \x00\xffbinary"));
    assert_eq!(second.body, first.body);
    let trailers = second.trailers.as_ref().expect("replayed trailers");
    assert_eq!(trailers, first.trailers.as_ref().unwrap());
    assert_eq!(trailers["x-checksum"], "sum-1");
    assert_eq!(trailers.get_all("x-multi").iter().collect::<Vec<_>>(), ["one", "two"]);
}

async fn sixty_four_concurrent_requests_run_the_handler_once(store: SharedStore) {
    let app = Arc::new(App::start(&store, |l| l).await);
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    for i in 0..64 {
        let (app, tx) = (app.clone(), tx.clone());
        tokio::spawn(async move {
            // Half over HTTP/1.1 connections, half multiplexed on one HTTP/2 connection.
            let reply = if i % 2 == 0 {
                app.h1(app.post("/gated", "same-key"), "{}").await
            } else {
                app.h2(app.post("/gated", "same-key"), "{}").await
            };
            tx.send(reply).unwrap();
        });
    }
    // The handler that got the key is held at the gate, so the other 63 are answered first.
    let mut next = async || tokio::time::timeout(Duration::from_secs(20), rx.recv()).await.expect("a reply").unwrap();
    for _ in 0..63 {
        let reply = next().await;
        reply.problem(409, "key-in-use");
        let retry_after: u64 = reply.headers["retry-after"].to_str().unwrap().parse().unwrap();
        assert!((1..=60).contains(&retry_after));
    }
    assert_eq!(app.effects.calls(), 1);
    app.effects.gate.add_permits(1);
    let leader = next().await;
    assert_eq!(leader.status, StatusCode::CREATED);
    assert_eq!(leader.text(), "gated re_1");
    assert!(!leader.replayed());

    let again = app.h2(app.post("/gated", "same-key"), "{}").await;
    assert!(again.replayed());
    assert_eq!(again.body, leader.body);
    assert_eq!(app.effects.calls(), 1);
}

async fn sixty_four_waiting_requests_all_get_the_first_response(store: SharedStore) {
    let app =
        Arc::new(App::start(&store, |l| l.on_in_flight(OnInFlight::Wait { timeout: Duration::from_secs(20) })).await);
    let mut tasks = Vec::new();
    for i in 0..64 {
        let app = app.clone();
        tasks.push(tokio::spawn(async move {
            if i % 2 == 0 {
                app.h1(app.post("/gated", "wait-key"), "{}").await
            } else {
                app.h2(app.post("/gated", "wait-key"), "{}").await
            }
        }));
    }
    app.effects.entered.notified().await;
    app.effects.gate.add_permits(1);
    let mut fresh = 0;
    for t in tasks {
        let reply = tokio::time::timeout(Duration::from_secs(30), t).await.expect("a reply").unwrap();
        assert_eq!(reply.status, StatusCode::CREATED, "{}", reply.text());
        assert_eq!(reply.text(), "gated re_1");
        fresh += usize::from(!reply.replayed());
    }
    assert_eq!(fresh, 1);
    assert_eq!(app.effects.calls(), 1);
}

async fn tenants_never_share_a_record(store: SharedStore) {
    let app = App::start(&store, |l| l).await;
    let body = r#"{"order":"o-1","amount":1500}"#;
    let a1 = app.h1(app.post("/refunds", "shared").header("x-tenant", "acme"), body).await;
    let b1 = app.h1(app.post("/refunds", "shared").header("x-tenant", "globex"), body).await;
    assert_eq!((a1.status, b1.status), (StatusCode::CREATED, StatusCode::CREATED));
    assert!(!b1.replayed(), "tenant globex got tenant acme's response");
    assert_eq!(a1.headers["x-refund"], "re_1");
    assert_eq!(b1.headers["x-refund"], "re_2");

    let a2 = app.h2(app.post("/refunds", "shared").header("x-tenant", "acme"), body).await;
    let b2 = app.h2(app.post("/refunds", "shared").header("x-tenant", "globex"), body).await;
    assert!(a2.replayed() && b2.replayed());
    assert_eq!(a2.body, a1.body);
    assert_eq!(b2.body, b1.body);

    // Another tenant's payload under the same key is not a mismatch: it is another record.
    let c = app.h1(app.post("/refunds", "shared").header("x-tenant", "initech"), r#"{"other":true}"#).await;
    assert_eq!(c.status, StatusCode::CREATED);
    // Nor is a request without a tenant.
    let anonymous = app.h1(app.post("/refunds", "shared"), body).await;
    assert_eq!(anonymous.status, StatusCode::CREATED);
    assert!(!anonymous.replayed());
    assert_eq!(app.effects.calls(), 4);
}

async fn another_request_under_the_same_key_is_422(store: SharedStore) {
    let app = App::start(&store, |l| l).await;
    let first = app.h1(app.post("/refunds", "m-1"), r#"{"order":"o-1","amount":100}"#).await;
    assert_eq!(first.status, StatusCode::CREATED);

    // Key order and whitespace are not a different request.
    let same = app.h1(app.post("/refunds", "m-1"), "{ \"amount\" : 100,\n  \"order\": \"o-1\" }").await;
    assert!(same.replayed());
    assert_eq!(same.body, first.body);

    let other_body = app.h1(app.post("/refunds", "m-1"), r#"{"order":"o-1","amount":200}"#).await;
    other_body.problem(422, "key-reused");
    let other_query = app.h2(app.post("/refunds?dry_run=1", "m-1"), r#"{"order":"o-1","amount":100}"#).await;
    other_query.problem(422, "key-reused");
    let other_method =
        app.h1(app.req("PATCH", "/refunds").header("idempotency-key", "m-1"), r#"{"order":"o-1","amount":100}"#).await;
    other_method.problem(422, "key-reused");
    let other_path = app.h1(app.post("/status/201", "m-1"), r#"{"order":"o-1","amount":100}"#).await;
    other_path.problem(422, "key-reused");
    assert_eq!(app.effects.calls(), 1);
}

async fn the_replay_hook_changes_replayed_responses_only(store: SharedStore) {
    let hooked = Arc::new(AtomicUsize::new(0));
    let counted = hooked.clone();
    let app = App::start(&store, move |l| {
        l.on_replay(move |parts: &mut http::response::Parts| {
            counted.fetch_add(1, Ordering::SeqCst);
            assert_eq!(parts.headers["idempotent-replayed"], "true", "the hook sees the marked replay");
            parts.headers.insert("x-replay-note", HeaderValue::from_static("from the hook"));
            // A stored header the hook replaces, and one it removes.
            parts.headers.insert("content-type", HeaderValue::from_static("application/vnd.replay+json"));
            parts.headers.remove("x-refund");
        })
    })
    .await;
    let body = r#"{"order":"o-1","amount":100}"#;
    let first = app.h1(app.post("/refunds", "hook-1"), body).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(!first.headers.contains_key("x-replay-note"), "the first response is not a replay");
    assert!(first.headers.contains_key("x-refund"), "{:?}", first.headers);
    let refused = app.h1(app.post("/refunds", "hook-1"), r#"{"order":"o-1","amount":200}"#).await;
    refused.problem(422, "key-reused");
    assert!(!refused.headers.contains_key("x-replay-note"), "a refusal is not a replay");
    assert_eq!(hooked.load(Ordering::SeqCst), 0);

    for n in 1..=2 {
        let reply = match n {
            1 => app.h1(app.post("/refunds", "hook-1"), body).await,
            _ => app.h2(app.post("/refunds", "hook-1"), body).await,
        };
        assert!(reply.replayed());
        assert_eq!(reply.headers["x-replay-note"], "from the hook");
        assert_eq!(reply.headers["content-type"], "application/vnd.replay+json");
        assert!(!reply.headers.contains_key("x-refund"));
        assert_eq!((reply.status, &reply.body), (first.status, &first.body), "status and body are the stored ones");
        assert_eq!(hooked.load(Ordering::SeqCst), n);
    }
    assert_eq!(app.effects.calls(), 1);
}

async fn missing_key_passes_through_or_is_400_when_required(store: SharedStore) {
    let app = App::start(&store, |l| l).await;
    for _ in 0..2 {
        let reply = app.h1(app.req("POST", "/refunds"), "{}").await;
        assert_eq!(reply.status, StatusCode::CREATED);
        // The handler can tell: no attempt, and why it runs unprotected.
        assert_eq!(
            (&reply.headers["x-fence"], &reply.headers["x-unprotected"]),
            (&"none".parse().unwrap(), &"NoKey".parse().unwrap())
        );
    }
    assert_eq!(app.effects.calls(), 2, "without a key, requests pass through unprotected");
    // A method the layer does not cover carries nothing of the layer's.
    let get = app.h1(app.req("GET", "/refunds"), "").await;
    assert!(get.headers.get("x-unprotected").is_none(), "{:?}", get.headers);

    let strict = App::start(&store, |l| l.require_key(true)).await;
    strict.h1(strict.req("POST", "/refunds"), "{}").await.problem(400, "key-missing");
    strict.h2(strict.req("PATCH", "/refunds"), "{}").await.problem(400, "key-missing");
    // Methods the layer does not cover never need a key.
    assert_eq!(strict.h1(strict.req("GET", "/refunds"), "").await.status, StatusCode::CREATED);
    assert_eq!(strict.effects.calls(), 1);

    // Required on one route only, by layering that route.
    let effects = Effects::new();
    let router = Router::new()
        .route("/strict", post(refund).layer(IdempotencyLayer::new(store.clone()).require_key(true)))
        .route("/lenient", post(refund))
        .with_state(effects.clone())
        .layer(IdempotencyLayer::new(store.clone()));
    let routed = App::serve(router, effects).await;
    routed.h1(routed.req("POST", "/strict"), "{}").await.problem(400, "key-missing");
    assert_eq!(routed.h1(routed.req("POST", "/lenient"), "{}").await.status, StatusCode::CREATED);
    assert_eq!(routed.effects.calls(), 1);
    // With a key, the outer layer handles the request and the route's layer stands aside.
    assert_eq!(routed.h1(routed.post("/strict", "nested"), "{}").await.status, StatusCode::CREATED);
    assert!(routed.h1(routed.post("/strict", "nested"), "{}").await.replayed());
    assert_eq!(routed.effects.calls(), 2);
}

async fn malformed_keys_are_400(store: SharedStore) {
    let app = App::start(&store, |l| l).await;
    let long = "k".repeat(256);
    let quoted_long = format!("\"{long}\"");
    // Empty, empty string, 256 characters (both forms), non-ASCII, malformed, a list, whitespace
    // only, and a control character (tab: the one a header value may carry).
    let cases: [&[u8]; 10] = [
        b"",
        b"\"\"",
        long.as_bytes(),
        quoted_long.as_bytes(),
        b"caf\xc3\xa9",
        b"\"unterminated",
        b"\"a\", \"b\"",
        b"   ",
        b"a\tb",
        b"\"a\tb\"",
    ];
    for key in cases {
        let req = app.req("POST", "/refunds").header("idempotency-key", HeaderValue::from_bytes(key).unwrap());
        let doc = app.h1(req, "{}").await.problem(400, "key-invalid");
        assert!(doc["detail"].as_str().unwrap().contains("idempotency-key"), "{doc}");
    }
    let twice = app.req("POST", "/refunds").header("idempotency-key", "one").header("idempotency-key", "one");
    let doc = app.h1(twice, "{}").await.problem(400, "key-invalid");
    assert!(doc["detail"].as_str().unwrap().contains("more than once"), "{doc}");
    let twice_h2 = app.req("POST", "/refunds").header("idempotency-key", "a").header("idempotency-key", "b");
    app.h2(twice_h2, "{}").await.problem(400, "key-invalid");
    assert_eq!(app.effects.calls(), 0);

    // The longest key allowed works, in both forms.
    let longest = "k".repeat(255);
    assert_eq!(app.h1(app.post("/refunds", &longest), "{}").await.status, StatusCode::CREATED);
    assert!(app.h1(app.post("/refunds", &format!("\"{longest}\"")), "{}").await.replayed());
    assert_eq!(app.effects.calls(), 1);
}

async fn bodies_over_the_cap_are_413_with_or_without_content_length(store: SharedStore) {
    let app = App::start(&store, |l| l.max_request_body(1024)).await;
    // Announced by Content-Length.
    app.h1(app.post("/refunds", "big-1"), vec![b'x'; 2048]).await.problem(413, "body-too-large");
    // Chunked, with no Content-Length: caught while reading.
    let chunked = || {
        let chunks: Vec<Result<Frame<Bytes>, BoxError>> =
            (0..3).map(|_| Ok(Frame::data(Bytes::from(vec![b'y'; 600])))).collect();
        StreamBody::new(futures_util::stream::iter(chunks)).boxed()
    };
    let req = app.post("/refunds", "big-2").body(chunked()).unwrap();
    assert!(req.headers().get("content-length").is_none());
    Reply::read(app.h1.request(req).await.unwrap()).await.problem(413, "body-too-large");
    let req = app.post("/refunds", "big-3").body(chunked()).unwrap();
    Reply::read(app.h2.request(req).await.unwrap()).await.problem(413, "body-too-large");
    assert_eq!(app.effects.calls(), 0);

    // Exactly at the cap is fine, and the handler sees the whole body.
    let ok = app.h1(app.post("/refunds", "big-4"), vec![b'z'; 1024]).await;
    assert_eq!(ok.status, StatusCode::CREATED);
    assert!(ok.text().contains("\"bytes\":1024"), "{}", ok.text());
    // A refused key was never taken: the same key works once the body is small enough.
    assert_eq!(app.h1(app.post("/refunds", "big-1"), "{}").await.status, StatusCode::CREATED);
    assert_eq!(app.effects.calls(), 2);
}

async fn a_body_that_fails_mid_stream_is_400(store: SharedStore) {
    let app = App::start(&store, |l| l).await;
    // A chunked body whose second chunk size is not hex: hyper's body stream fails there.
    let request = b"POST /refunds HTTP/1.1\r\nHost: test\r\nIdempotency-Key: broken-1\r\n\
                    Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n5\r\nhello\r\nzz\r\n";
    let raw = app.raw(request).await;
    let text = String::from_utf8_lossy(&raw);
    assert!(text.starts_with("HTTP/1.1 400 Bad Request\r\n"), "{text}");
    assert!(text.contains("tag:idempotent-tower,2025:body-unreadable"), "{text}");
    assert_eq!(app.effects.calls(), 0);
    // The key was never taken.
    assert_eq!(app.h1(app.post("/refunds", "broken-1"), "{}").await.status, StatusCode::CREATED);
}

async fn retryable_outcomes_release_the_key_and_final_ones_are_replayed(store: SharedStore) {
    let app = App::start(&store, |l| l).await;
    for code in [500u16, 502, 503, 408, 409, 425, 429] {
        let key = format!("release-{code}");
        let first = app.h1(app.post(&format!("/status/{code}"), &key), "{}").await;
        let before = app.effects.calls();
        let second = app.h2(app.post(&format!("/status/{code}"), &key), "{}").await;
        assert_eq!((first.status.as_u16(), second.status.as_u16()), (code, code));
        assert!(!second.replayed(), "{code} was stored");
        assert_eq!(app.effects.calls(), before + 1, "{code}: the retry did not run the handler");
    }
    for code in [200u16, 202, 400, 404, 422] {
        let key = format!("store-{code}");
        let first = app.h1(app.post(&format!("/status/{code}"), &key), "{}").await;
        let before = app.effects.calls();
        let second = app.h2(app.post(&format!("/status/{code}"), &key), "{}").await;
        assert_eq!(second.status.as_u16(), code);
        assert!(second.replayed(), "{code} was not stored");
        assert_eq!(second.body, first.body);
        assert_eq!(app.effects.calls(), before);
    }
}

async fn responses_over_the_store_cap_are_sent_but_not_stored(store: SharedStore) {
    let app = App::start(&store, |l| l.max_stored_response(1024)).await;
    let first = app.h1(app.post("/big?bytes=4096", "big-response"), "{}").await;
    assert_eq!(first.status, StatusCode::OK);
    assert_eq!(first.body.len(), 4096, "the client gets the whole response");
    assert!(first.body.starts_with(b"call 1;") && first.body[7..].iter().all(|&b| b == b'x'));
    let second = app.h2(app.post("/big?bytes=4096", "big-response"), "{}").await;
    assert!(!second.replayed());
    assert!(second.body.starts_with(b"call 2;"));
    assert_eq!(second.body.len(), 4096);
    // At the cap it is stored.
    let small = app.h1(app.post("/big?bytes=1024", "small-response"), "{}").await;
    let replay = app.h1(app.post("/big?bytes=1024", "small-response"), "{}").await;
    assert!(replay.replayed());
    assert_eq!(replay.body, small.body);
    assert_eq!(app.effects.calls(), 3);
}

async fn methods_and_header_name_are_configurable(store: SharedStore) {
    let app = App::start(&store, |l| l).await;
    // GET is not covered by default: the key is ignored.
    for _ in 0..2 {
        let r = app.h1(app.req("GET", "/refunds").header("idempotency-key", "get-1"), "").await;
        assert!(!r.replayed());
    }
    // PATCH is.
    app.h1(app.req("PATCH", "/refunds").header("idempotency-key", "patch-1"), "{}").await;
    assert!(app.h1(app.req("PATCH", "/refunds").header("idempotency-key", "patch-1"), "{}").await.replayed());
    assert_eq!(app.effects.calls(), 3);

    let put_only = App::start(&store, |l| l.methods([Method::PUT]).scope("put-only")).await;
    for _ in 0..2 {
        assert!(!put_only.h1(put_only.post("/refunds", "m-1"), "{}").await.replayed());
    }
    put_only.h1(put_only.req("PUT", "/refunds").header("idempotency-key", "m-1"), "{}").await;
    assert!(put_only.h1(put_only.req("PUT", "/refunds").header("idempotency-key", "m-1"), "{}").await.replayed());
    assert_eq!(put_only.effects.calls(), 3);

    let custom = App::start(&store, |l| {
        l.header_name(HeaderName::from_static("x-request-key")).scope("custom").require_key(true)
    })
    .await;
    custom.h1(custom.post("/refunds", "c-1"), "{}").await.problem(400, "key-missing");
    let first = custom.h1(custom.req("POST", "/refunds").header("x-request-key", "c-1"), "{}").await;
    let second = custom.h1(custom.req("POST", "/refunds").header("x-request-key", "c-1"), "{}").await;
    assert!(!first.replayed() && second.replayed());
    assert_eq!(custom.effects.calls(), 1);
}

async fn the_heartbeat_keeps_a_long_request_in_flight(store: SharedStore) {
    // 1 s: a 300 ms lease was lost to scheduling on a loaded two-core machine (renewals every
    // 100 ms that ran late), on every store alike.
    let lease = Duration::from_secs(1);
    let app = Arc::new(App::start(&store, |l| l.lease(lease)).await);
    let leader = {
        let app = app.clone();
        tokio::spawn(async move { app.h1(app.post("/gated", "slow"), "{}").await })
    };
    app.effects.entered.notified().await;
    // Time passing is the point here: outlive the lease several times over.
    tokio::time::sleep(lease * 3).await;
    // Without renewals the duplicate would take the key and block at the gate too.
    let duplicate = tokio::time::timeout(Duration::from_secs(10), app.h2(app.post("/gated", "slow"), "{}"))
        .await
        .expect("the duplicate ran the handler: the lease ran out while the first request was running");
    duplicate.problem(409, "key-in-use");
    assert_eq!(app.effects.calls(), 1, "the lease ran out while the handler was running");
    app.effects.gate.add_permits(1);
    let first = leader.await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED);
    let replay = app.h2(app.post("/gated", "slow"), "{}").await;
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
}

async fn a_response_body_that_fails_releases_the_key(store: SharedStore) {
    let app = App::start(&store, |l| l).await;
    for n in 1..=2 {
        let req = app.post("/failing", "fails").body(full("{}")).unwrap();
        // The stream is reset, before or after the head depending on timing: never a clean reply.
        match app.h2.request(req).await {
            Err(e) => assert!(format!("{e:?}").contains("Reset"), "{e:?}"),
            Ok(res) => {
                assert!(res.headers().get("idempotent-replayed").is_none());
                assert!(res.into_body().collect().await.is_err(), "the body error reaches the client");
            }
        }
        assert_eq!(app.effects.calls(), n, "a failed response must not be stored");
    }
}

async fn a_waiting_duplicate_gives_up_with_409(store: SharedStore) {
    let app = Arc::new(
        App::start(&store, |l| l.on_in_flight(OnInFlight::Wait { timeout: Duration::from_millis(300) })).await,
    );
    let leader = {
        let app = app.clone();
        tokio::spawn(async move { app.h1(app.post("/gated", "patient"), "{}").await })
    };
    app.effects.entered.notified().await;
    let started = std::time::Instant::now();
    app.h2(app.post("/gated", "patient"), "{}").await.problem(409, "key-in-use");
    assert!(started.elapsed() >= Duration::from_millis(300), "gave up before the timeout");
    app.effects.gate.add_permits(1);
    assert_eq!(leader.await.unwrap().status, StatusCode::CREATED);
    assert!(app.h2(app.post("/gated", "patient"), "{}").await.replayed());
    assert_eq!(app.effects.calls(), 1);
}

/// An in-process request to `path` under `key` (no connection: the test drops the future
/// itself, as hyper does when the client goes away).
fn in_process(path: &str, key: &str) -> Request<AxumBody> {
    Request::post(path)
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(AxumBody::from("{}"))
        .unwrap()
}

async fn a_request_dropped_while_its_body_is_read_still_stores_the_response(store: SharedStore) {
    let effects = Effects::new();
    // A retry that waits for the first response; it gives up (409) long before a lease of 60 s
    // would free a key left `running`.
    let layer = IdempotencyLayer::new(store).on_in_flight(OnInFlight::Wait { timeout: Duration::from_secs(3) });
    let app = routes(&effects).layer(layer);
    tokio::select! {
        res = app.clone().oneshot(in_process("/slow-body", "dropped")) => {
            panic!("the response came before its body could be read: {:?}", res.map(|r| r.status()))
        }
        // The handler has answered and the layer is reading the body: drop the request.
        () = effects.entered.notified() => {}
    }
    effects.gate.add_permits(1);
    let retry = app.oneshot(in_process("/slow-body", "dropped")).await.unwrap();
    assert_eq!(retry.status(), StatusCode::CREATED, "the response was never stored");
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    assert_eq!(retry.into_body().collect().await.unwrap().to_bytes(), "slow re_1");
    assert_eq!(effects.calls(), 1, "the retry ran the handler again");
}

async fn a_layer_that_never_reruns_blindly_stops_a_recovered_request_for_an_operator(store: SharedStore) {
    use idempotent_core::OnRecovered;
    use idempotent_core::record::{Resolution, Resolved};
    let effects = Effects::new();
    let layer = IdempotencyLayer::new(store.clone())
        .lease(Duration::from_millis(300))
        .on_in_flight(OnInFlight::Wait { timeout: Duration::from_secs(5) })
        .on_recovered(OnRecovered::NeedsAttention);
    let app = routes(&effects).layer(layer);
    // The first request dies inside its handler (the server dropped it): its lease runs out.
    tokio::select! {
        res = app.clone().oneshot(in_process("/gated", "rec-1")) => panic!("the gated handler answered: {res:?}"),
        () = effects.entered.notified() => {}
    }
    for _ in 0..2 {
        let res = app.clone().oneshot(in_process("/gated", "rec-1")).await.unwrap();
        assert_eq!(res.status(), StatusCode::CONFLICT);
        let doc: serde_json::Value =
            serde_json::from_slice(&res.into_body().collect().await.unwrap().to_bytes()).unwrap();
        assert_eq!(doc["type"], "tag:idempotent-tower,2025:needs-attention", "{doc}");
    }
    assert_eq!(effects.calls(), 1, "the handler did not run again");
    // The operator checks, finds nothing happened, and resolves the key's record as not done.
    let key = idempotent_core::Key::from_client_key(None, "http", "rec-1");
    assert_eq!(store.resolve(&key, Resolution::NotDone).await.unwrap(), Resolved::Ok);
    effects.gate.add_permits(1);
    let res = app.oneshot(in_process("/gated", "rec-1")).await.unwrap();
    assert_eq!(res.status(), StatusCode::CREATED);
    assert_eq!(effects.calls(), 2);
}

/// What a [`slow_complete`] or [`slow_release`] store shares with the test.
struct SlowComplete {
    entered: Notify,
    gate: Semaphore,
}

impl SlowComplete {
    /// Says the call started, then waits for the test to open the gate.
    async fn hold(&self) {
        self.entered.notify_one();
        self.gate.acquire().await.unwrap().forget();
    }
}

/// A store whose `release` waits at a gate after saying it started.
fn slow_release(store: SharedStore) -> Arc<HookedStore<SlowComplete>> {
    let state = SlowComplete { entered: Notify::new(), gate: Semaphore::new(0) };
    let slow = HookedStore::with_state(store, state).describe_as(|inner| format!("slow-release {inner}"));
    Arc::new(slow.on_release(|call| {
        Box::pin(async move {
            call.store.state().hold().await;
            call.forward().await
        })
    }))
}

/// A store whose `complete` waits at a gate after saying it started.
fn slow_complete(store: SharedStore) -> Arc<HookedStore<SlowComplete>> {
    let state = SlowComplete { entered: Notify::new(), gate: Semaphore::new(0) };
    let slow = HookedStore::with_state(store, state).describe_as(|inner| format!("slow-complete {inner}"));
    Arc::new(slow.on_complete(|call| {
        Box::pin(async move {
            call.store.state().hold().await;
            call.forward().await
        })
    }))
}

/// The service fails (a tower error, not a response), and the client goes away while the layer
/// gives the key up: the key is still freed, so the retry runs the service again instead of
/// waiting out the lease.
async fn a_request_dropped_while_release_is_in_flight_still_frees_the_key(store: SharedStore) {
    let slow = slow_release(store);
    let shared: SharedStore = slow.clone();
    let calls = Arc::new(AtomicUsize::new(0));
    let failing = tower::service_fn({
        let calls = calls.clone();
        move |_: Request<idempotent_tower::server::RequestBody<AxumBody>>| {
            calls.fetch_add(1, Ordering::SeqCst);
            async { Err::<Response<Full<Bytes>>, BoxError>("the upstream failed".into()) }
        }
    });
    let layer = IdempotencyLayer::new(shared).on_in_flight(OnInFlight::Wait { timeout: Duration::from_secs(3) });
    let svc = tower::Layer::layer(&layer, failing);
    tokio::select! {
        res = svc.clone().oneshot(in_process("/refunds", "dropped-error")) => {
            panic!("the call ended before the key was released: {:?}", res.map(|r| r.status()))
        }
        () = slow.state().entered.notified() => {}
    }
    slow.state().gate.add_permits(2);
    let retry = svc.oneshot(in_process("/refunds", "dropped-error")).await;
    assert!(retry.is_err(), "the retry should reach the failing service, got {:?}", retry.map(|r| r.status()));
    assert_eq!(calls.load(Ordering::SeqCst), 2, "the key stayed held: the retry did not reach the service");
}

async fn a_request_dropped_while_complete_is_in_flight_still_stores_the_response(store: SharedStore) {
    let slow = slow_complete(store);
    let effects = Effects::new();
    let shared: SharedStore = slow.clone();
    let layer = IdempotencyLayer::new(shared).on_in_flight(OnInFlight::Wait { timeout: Duration::from_secs(3) });
    let app = routes(&effects).layer(layer);
    tokio::select! {
        res = app.clone().oneshot(in_process("/refunds", "dropped")) => {
            panic!("the response came before it was stored: {:?}", res.map(|r| r.status()))
        }
        () = slow.state().entered.notified() => {}
    }
    slow.state().gate.add_permits(1);
    let retry = app.oneshot(in_process("/refunds", "dropped")).await.unwrap();
    assert_eq!(retry.status(), StatusCode::CREATED, "the response was never stored");
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    assert_eq!(retry.headers()["x-refund"], "re_1");
    assert_eq!(effects.calls(), 1, "the retry ran the handler again");
}

/// A store that cannot renew: every renewal fails as if the store were out of reach, or, with
/// `hang`, never answers.
fn renew_fails(store: SharedStore, hang: bool) -> SharedStore {
    let failing = HookedStore::new(store).describe_as(|inner| format!("renew-fails {inner}")).on_renew(move |call| {
        if hang {
            return Box::pin(std::future::pending());
        }
        Box::pin(std::future::ready(Err(Error::Unavailable {
            store: call.store.describe(),
            op: "renew",
            reason: "connection refused (injected)".into(),
            source: None,
        })))
    });
    Arc::new(failing)
}

async fn a_lease_whose_renewals_keep_failing_still_stores_when_no_one_took_over(store: SharedStore) {
    let lease = Duration::from_millis(300);
    let failing = renew_fails(store, false);
    let app = Arc::new(App::start(&failing, |l| l.lease(lease)).await);
    let leader = {
        let app = app.clone();
        tokio::spawn(async move { app.h1(app.post("/gated", "unrenewed"), "{}").await })
    };
    app.effects.entered.notified().await;
    // Time passing is the point: outlive the lease with every renewal failing.
    tokio::time::sleep(lease * 4).await;
    app.effects.gate.add_permits(1);
    let first = leader.await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(first.text(), "gated re_1", "the client gets the response");
    // No other attempt took the key while the lease was out of reach: the store still knows
    // this request as its owner and takes the response, so a retry replays it instead of
    // running the request a second time.
    assert!(first.headers.get("idempotent-stored").is_none(), "the store took the response");
    let retry = app.h2(app.post("/gated", "unrenewed"), "{}").await;
    assert!(retry.replayed());
    assert_eq!(retry.text(), "gated re_1");
    assert_eq!(app.effects.calls(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_renewal_that_never_answers_loses_the_lease_when_it_runs_out() {
    let lease = Duration::from_secs(30);
    let store = renew_fails(Arc::new(idempotent_core::MemoryStore::new()), true);
    let effects = Effects::new();
    let lost = Arc::new(tokio::sync::Notify::new());
    let app = routes(&effects).layer(IdempotencyLayer::new(store).lease(lease));
    let watcher = {
        let lost = lost.clone();
        tower::service_fn(move |req: Request<idempotent_tower::server::RequestBody<AxumBody>>| {
            // The handler's attempt is told when the lease runs out, not when (if ever) the
            // hung renewal answers.
            let attempt = req.extensions().get::<Attempt>().cloned().expect("the layer hands the handler its attempt");
            let lost = lost.clone();
            async move {
                attempt.lost().await;
                lost.notify_one();
                Ok::<_, std::convert::Infallible>(Response::new(Full::new(Bytes::from(
                    attempt.lease_lost().to_string(),
                ))))
            }
        })
    };
    let watched = IdempotencyLayer::new(renew_fails(Arc::new(idempotent_core::MemoryStore::new()), true))
        .lease(lease)
        .layer(watcher);
    let watching = tokio::spawn(watched.oneshot(in_process("/watch", "hung")));
    let leader = tokio::spawn(app.clone().oneshot(in_process("/gated", "hung")));
    effects.entered.notified().await;
    // The first renewal (at a third of the lease) hangs; the lease must still count as lost
    // once it has run out.
    tokio::time::sleep(lease + Duration::from_secs(1)).await;
    lost.notified().await;
    let watched = watching.await.unwrap().unwrap();
    assert_eq!(watched.into_body().collect().await.unwrap().to_bytes(), "true");
    effects.gate.add_permits(1);
    let first = leader.await.unwrap().unwrap();
    assert_eq!(first.status(), StatusCode::CREATED);
    // No other attempt took the key: the store still takes the response.
    assert!(first.headers().get("idempotent-stored").is_none());
    let retry = app.oneshot(in_process("/gated", "hung")).await.unwrap();
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    assert_eq!(effects.calls(), 1);
}

async fn absurd_lease_and_retention_are_refused(store: SharedStore) {
    for d in [Duration::ZERO, Duration::MAX] {
        let app = App::start(&store, |l| l.lease(d).retention(d).scope(format!("{d:?}"))).await;
        for _ in 0..2 {
            let reply = app.h1(app.post("/refunds", "absurd"), "{}").await;
            reply.problem(500, "misconfigured");
            assert!(reply.text().contains("out of range"), "{d:?}: {}", reply.text());
        }
        assert_eq!(app.effects.calls(), 0, "{d:?}: a misconfigured layer ran the handler");
    }
}

/// A store that writes garbage in place of every result: the record a buggy or foreign writer
/// would leave behind. Everything else goes to the real store.
fn corrupting(store: SharedStore) -> SharedStore {
    let corrupting =
        HookedStore::new(store).describe_as(|inner| format!("corrupting {inner}")).on_complete(|mut call| {
            call.result = Bytes::from_static(b"IDRS\x01\x00\xc8\xff\xff\xff\xffnot a response");
            call.forward()
        });
    Arc::new(corrupting)
}

async fn a_corrupt_record_is_500_and_never_replayed(store: SharedStore) {
    let corrupting = corrupting(store);
    let app = App::start(&corrupting, |l| l).await;
    assert_eq!(app.h1(app.post("/refunds", "c-1"), "{}").await.status, StatusCode::CREATED);
    for _ in 0..2 {
        let reply = app.h2(app.post("/refunds", "c-1"), "{}").await;
        reply.problem(500, "record-corrupt");
        assert!(!reply.replayed());
    }
    assert_eq!(app.effects.calls(), 1, "a corrupt record must not run the handler again");
}

/// A store whose first `complete` marks the record as needing attention instead (what an attempt
/// that could not tell whether its effect happened leaves behind), remembering the key.
fn marking(store: SharedStore) -> Arc<HookedStore<std::sync::Mutex<Option<idempotent_core::Key>>>> {
    let marking = HookedStore::with_state(store, std::sync::Mutex::new(None)).on_complete(|call| {
        Box::pin(async move {
            let mut marked = call.store.state().lock().unwrap().replace(*call.key);
            if marked.take().is_some() {
                return call.forward().await;
            }
            call.store.inner().abandon(call.key, call.token, idempotent_core::record::Abandon::NeedsAttention).await
        })
    });
    Arc::new(marking)
}

async fn a_key_that_needs_attention_is_409_and_runs_nothing_until_resolved(store: SharedStore) {
    let marking = marking(store);
    let shared: SharedStore = marking.clone();
    let app = App::start(&shared, |l| l).await;
    // The first request ran the handler; its outcome was left needing attention.
    app.h1(app.post("/refunds", "na-1"), "{}").await;
    assert_eq!(app.effects.calls(), 1);
    for _ in 0..3 {
        let reply = app.h2(app.post("/refunds", "na-1"), "{}").await;
        let doc = reply.problem(409, "needs-attention");
        assert!(reply.headers.get("retry-after").is_none(), "a retry cannot cure it: no Retry-After");
        assert!(doc["detail"].as_str().unwrap().contains("do not retry"), "{doc}");
        assert!(!reply.replayed());
    }
    assert_eq!(app.effects.calls(), 1, "nothing ran while the key needs attention");
    // An operator finds that the refund did not happen, and resolves the record as not done.
    let key = marking.state().lock().unwrap().expect("the marked key");
    let resolved = shared.resolve(&key, idempotent_core::record::Resolution::NotDone).await.unwrap();
    assert_eq!(resolved, idempotent_core::record::Resolved::Ok);
    let reply = app.h1(app.post("/refunds", "na-1"), "{}").await;
    assert_eq!(reply.status, StatusCode::CREATED);
    assert_eq!(app.effects.calls(), 2, "the next request ran the handler");
    let again = app.h1(app.post("/refunds", "na-1"), "{}").await;
    assert!(again.replayed() && again.body == reply.body);
}

async fn the_handler_sees_one_downstream_key_per_idempotency_key(store: SharedStore) {
    let app = App::start(&store, |l| l).await;
    let downstream = |reply: &Reply| reply.headers["x-downstream-key"].to_str().unwrap().to_owned();
    let first = app.h1(app.post("/refunds", "dk-1"), "{}").await;
    let other = app.h1(app.post("/refunds", "dk-2"), "{}").await;
    let (a, b) = (downstream(&first), downstream(&other));
    assert_eq!(a.len(), 64);
    assert_ne!(a, b, "another Idempotency-Key, another downstream key");
    assert!(!a.contains("dk-1"), "the client's key does not show through");
    // The same key from another tenant is another operation.
    let tenant = app.h1(app.post("/refunds", "dk-1").header("x-tenant", "acme"), "{}").await;
    assert_ne!(downstream(&tenant), a);
    // A released attempt and the next one share it: a 503 from the handler frees the key, and
    // the retry runs the handler again under the same downstream key.
    let one = app.h1(app.post("/status/503", "dk-3"), "{}").await;
    let two = app.h2(app.post("/status/503", "dk-3"), "{}").await;
    assert_eq!((one.status, two.status), (StatusCode::SERVICE_UNAVAILABLE, StatusCode::SERVICE_UNAVAILABLE));
    assert!(!two.replayed(), "the handler ran again");
    assert_eq!(downstream(&one), downstream(&two));
    assert_ne!(downstream(&one), a);
}

// ---------------------------------------------------------------------------------------------
// Store failures (Redis only: a memory store cannot be unreachable)

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_unreachable_store_is_503_and_the_handler_is_not_called() {
    let mut server = RedisServer::start();
    let store: SharedStore =
        Arc::new(RedisStore::builder(server.url()).command_timeout(Duration::from_millis(500)).build().unwrap());
    let app = App::start(&store, |l| l).await;
    assert_eq!(app.h1(app.post("/refunds", "before"), "{}").await.status, StatusCode::CREATED);
    server.kill();
    let reply = app.h1(app.post("/refunds", "during"), "{}").await;
    let doc = reply.problem(503, "store-unavailable");
    assert_eq!(reply.headers["retry-after"], "1");
    assert!(doc["detail"].as_str().unwrap().contains("not processed"));
    assert_eq!(app.effects.calls(), 1, "the handler ran although the store was down");
    // Requests the layer does not cover are unaffected.
    assert_eq!(app.h1(app.req("GET", "/refunds"), "").await.status, StatusCode::CREATED);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fail_open_calls_the_handler_when_the_store_is_unreachable() {
    // Nothing listens on this port.
    let url = format!("redis://127.0.0.1:{}", free_port(false));
    let store: SharedStore =
        Arc::new(RedisStore::builder(url).command_timeout(Duration::from_millis(500)).build().unwrap());
    let closed = App::start(&store, |l| l).await;
    closed.h2(closed.post("/refunds", "k"), "{}").await.problem(503, "store-unavailable");
    assert_eq!(closed.effects.calls(), 0);
    let open = App::start(&store, |l| l.fail_mode(FailMode::Open)).await;
    for n in 1..=2 {
        let reply = open.h2(open.post("/refunds", "k"), "{}").await;
        assert_eq!(reply.status, StatusCode::CREATED);
        assert!(!reply.replayed());
        assert_eq!(open.effects.calls(), n);
        // Unprotected: the handler is told it holds no lease (an unprotected attempt, fence 0).
        assert_eq!(reply.headers["x-fence"], "0");
        assert_eq!(reply.headers["x-unprotected"], "StoreUnavailable");
    }
    // A layer inside one that failed open stands aside too, rather than refusing the request
    // the outer layer let through (this one fails closed).
    let effects = Effects::new();
    let router = Router::new()
        .route("/refunds", post(refund).layer(IdempotencyLayer::new(store.clone())))
        .with_state(effects.clone())
        .layer(IdempotencyLayer::new(store).fail_mode(FailMode::Open));
    let nested = App::serve(router, effects).await;
    let reply = nested.h1(nested.post("/refunds", "k"), "{}").await;
    assert_eq!((reply.status, &reply.headers["x-fence"]), (StatusCode::CREATED, &"0".parse().unwrap()));
    assert_eq!(nested.effects.calls(), 1);
}
