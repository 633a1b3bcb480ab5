//! The server `IdempotencyLayer` in front of a real tonic server on loopback (HTTP/2), driven by a
//! tonic client and by a raw hyper HTTP/2 client, on `MemoryStore` and on a spawned Redis.
//!
//! The service is written by hand with `tonic::server::Grpc` and prost's `Message` derive, as
//! generated code would be, so nothing needs `protoc`.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use futures_util::future::BoxFuture;
use http::uri::PathAndQuery;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use idempotent_core::{RedisStore, RunContext, SharedStore};
use idempotent_tests::RedisServer;
use idempotent_tower::server::{IdempotencyLayer, Unprotected};
use prost::Message;
use tokio::sync::{Notify, Semaphore};
use tonic::transport::{Channel, Endpoint, Server};
use tonic::{Code, Status};
use tonic_prost::ProstCodec;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

idempotent_tests::on_every_store!(
    a_retried_call_gets_the_first_reply,
    replay_is_byte_identical_with_trailers,
    sixty_four_concurrent_calls_run_the_handler_once,
    another_message_under_the_same_key_is_failed_precondition,
    missing_and_invalid_keys_are_invalid_argument,
    oversized_messages_are_resource_exhausted,
    transient_statuses_release_the_key,
    final_error_statuses_are_replayed,
    tenants_never_share_a_record,
    grpc_web_is_stored_and_replayed_as_http,
    nested_steps_run_under_the_calls_identity,
);

// ---------------------------------------------------------------------------------------------
// The service

/// `payments.Payments/Refund` request. `behaviour` steers the handler: "" replies OK, "gate"
/// waits for the test, "nested" runs a step in the call's `RunContext` (and fails with
/// UNAVAILABLE after it on the handler's first call), any other value is the name of the status
/// code to fail with.
#[derive(Clone, PartialEq, Message)]
struct RefundRequest {
    #[prost(string, tag = "1")]
    order_id: String,
    #[prost(int64, tag = "2")]
    amount_cents: i64,
    #[prost(string, tag = "3")]
    behaviour: String,
}

#[derive(Clone, PartialEq, Message)]
struct RefundReply {
    #[prost(string, tag = "1")]
    refund_id: String,
    #[prost(uint64, tag = "2")]
    call: u64,
}

const REFUND: &str = "/payments.Payments/Refund";

#[derive(Clone)]
struct Ledger {
    calls: Arc<AtomicUsize>,
    /// Runs of the "nested" step's action.
    steps: Arc<AtomicUsize>,
    entered: Arc<Notify>,
    gate: Arc<Semaphore>,
}

impl Ledger {
    fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }
}

#[derive(Clone)]
struct Payments {
    ledger: Ledger,
}

impl tonic::server::NamedService for Payments {
    const NAME: &'static str = "payments.Payments";
}

impl<B> tower::Service<http::Request<B>> for Payments
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let ledger = self.ledger.clone();
        Box::pin(async move {
            if req.uri().path() == REFUND {
                let mut grpc = tonic::server::Grpc::new(ProstCodec::<RefundReply, RefundRequest>::default());
                Ok(grpc.unary(Refund(ledger), req).await)
            } else {
                Ok(Status::unimplemented("no such method").into_http())
            }
        })
    }
}

struct Refund(Ledger);

impl tonic::server::UnaryService<RefundRequest> for Refund {
    type Response = RefundReply;
    type Future = BoxFuture<'static, Result<tonic::Response<RefundReply>, Status>>;

    fn call(&mut self, req: tonic::Request<RefundRequest>) -> Self::Future {
        let ledger = self.0.clone();
        Box::pin(async move {
            let call = ledger.calls.fetch_add(1, Ordering::SeqCst) as u64 + 1;
            let ctx = req.extensions().get::<RunContext>().cloned();
            let unprotected = req.extensions().get::<Unprotected>().copied();
            let msg = req.into_inner();
            let code = match msg.behaviour.as_str() {
                "" => None,
                "nested" => {
                    let Some(ctx) = ctx else {
                        let refund_id = format!("unprotected: {unprotected:?}");
                        return Ok(tonic::Response::new(RefundReply { refund_id, call }));
                    };
                    let steps = ledger.steps.clone();
                    let tenant = ctx.tenant_name().unwrap_or("-").to_owned();
                    let refund_id: String = ctx
                        .step("refund")
                        .run(&msg.order_id, |_| async move {
                            let n = steps.fetch_add(1, Ordering::SeqCst) + 1;
                            Ok::<_, idempotent_core::Error>(format!("step {n} for {tenant}"))
                        })
                        .await
                        .map_err(|e| Status::unavailable(e.to_string()))?;
                    if call == 1 {
                        return Err(Status::unavailable("the handler failed after its step; retry"));
                    }
                    return Ok(tonic::Response::new(RefundReply { refund_id, call }));
                }
                "gate" => {
                    ledger.entered.notify_one();
                    ledger.gate.acquire().await.unwrap().forget();
                    None
                }
                "unavailable" => Some(Code::Unavailable),
                "aborted" => Some(Code::Aborted),
                "resource_exhausted" => Some(Code::ResourceExhausted),
                "deadline_exceeded" => Some(Code::DeadlineExceeded),
                "internal" => Some(Code::Internal),
                "not_found" => Some(Code::NotFound),
                "invalid_argument" => Some(Code::InvalidArgument),
                "already_exists" => Some(Code::AlreadyExists),
                other => panic!("unknown behaviour {other}"),
            };
            match code {
                Some(code) => Err(Status::new(code, format!("handler call {call}: {code:?} ✗"))),
                None => {
                    let mut res =
                        tonic::Response::new(RefundReply { refund_id: format!("re_{}_{call}", msg.order_id), call });
                    res.metadata_mut().insert("x-refund-call", call.to_string().parse().unwrap());
                    Ok(res)
                }
            }
        })
    }
}

struct App {
    addr: SocketAddr,
    ledger: Ledger,
    channel: Channel,
}

impl App {
    async fn start(store: &SharedStore, configure: impl FnOnce(IdempotencyLayer) -> IdempotencyLayer) -> App {
        let ledger = Ledger {
            calls: Arc::default(),
            steps: Arc::default(),
            entered: Arc::default(),
            gate: Arc::new(Semaphore::new(0)),
        };
        let layer = configure(
            IdempotencyLayer::new(store.clone())
                .tenant(|parts| parts.headers.get("x-tenant").and_then(|v| v.to_str().ok()).map(str::to_owned)),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = Server::builder()
            .layer(layer)
            .add_service(Payments { ledger: ledger.clone() })
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener));
        tokio::spawn(async move { server.await.unwrap() });
        let channel = Endpoint::from_shared(format!("http://{addr}")).unwrap().connect().await.unwrap();
        App { addr, ledger, channel }
    }

    async fn refund(&self, key: Option<&str>, msg: RefundRequest) -> Result<tonic::Response<RefundReply>, Status> {
        self.refund_with(msg, |md| {
            if let Some(key) = key {
                md.insert("idempotency-key", key.parse().unwrap());
            }
        })
        .await
    }

    async fn refund_with(
        &self,
        msg: RefundRequest,
        metadata: impl FnOnce(&mut tonic::metadata::MetadataMap),
    ) -> Result<tonic::Response<RefundReply>, Status> {
        let mut client = tonic::client::Grpc::new(self.channel.clone());
        client.ready().await.unwrap();
        let mut req = tonic::Request::new(msg);
        metadata(req.metadata_mut());
        client.unary(req, PathAndQuery::from_static(REFUND), ProstCodec::default()).await
    }
}

fn order(id: &str, amount: i64) -> RefundRequest {
    RefundRequest { order_id: id.to_owned(), amount_cents: amount, behaviour: String::new() }
}

fn behaving(id: &str, behaviour: &str) -> RefundRequest {
    RefundRequest { order_id: id.to_owned(), amount_cents: 100, behaviour: behaviour.to_owned() }
}

fn replayed(md: &tonic::metadata::MetadataMap) -> bool {
    md.get("idempotent-replayed").is_some_and(|v| v == "true")
}

#[track_caller]
fn refused(result: Result<tonic::Response<RefundReply>, Status>, code: Code) -> Status {
    let status = result.expect_err("the call should have been refused");
    assert_eq!(status.code(), code, "{status:?}");
    assert!(status.message().len() > 30, "the message should say what to do: {status:?}");
    status
}

// ---------------------------------------------------------------------------------------------
// Scenarios

async fn a_retried_call_gets_the_first_reply(store: SharedStore) {
    let app = App::start(&store, |l| l).await;
    let first = app.refund(Some("g-1"), order("o-1", 1500)).await.unwrap();
    let second = app.refund(Some("g-1"), order("o-1", 1500)).await.unwrap();
    assert_eq!(app.ledger.calls(), 1);
    assert!(!replayed(first.metadata()));
    assert!(replayed(second.metadata()));
    assert_eq!(second.metadata().get("x-refund-call").unwrap(), "1");
    assert_eq!(first.get_ref(), second.get_ref());
    assert_eq!(second.get_ref().refund_id, "re_o-1_1");
}

async fn replay_is_byte_identical_with_trailers(store: SharedStore) {
    let app = App::start(&store, |l| l).await;
    let h2: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).http2_only(true).build_http();
    let message = order("o-raw", 700).encode_to_vec();
    let mut framed = BytesMut::new();
    framed.put_u8(0);
    framed.put_u32(message.len() as u32);
    framed.put_slice(&message);
    let framed = framed.freeze();
    let call = || async {
        let req = http::Request::post(format!("http://{}{REFUND}", app.addr))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .header("idempotency-key", "\"raw-grpc\"")
            .body(Full::new(framed.clone()))
            .unwrap();
        let res = h2.request(req).await.unwrap();
        let (parts, body) = res.into_parts();
        let collected = body.collect().await.unwrap();
        (parts, collected.trailers().cloned(), collected.to_bytes())
    };
    let (first_parts, first_trailers, first_body) = call().await;
    let (second_parts, second_trailers, second_body) = call().await;
    assert_eq!(app.ledger.calls(), 1);
    assert_eq!(second_parts.status, first_parts.status);
    assert_eq!(second_body, first_body, "the replayed message differs");
    let decoded = RefundReply::decode(&second_body[5..]).unwrap();
    assert_eq!(decoded.refund_id, "re_o-raw_1");
    let trailers = second_trailers.expect("replayed trailers");
    assert_eq!(Some(&trailers), first_trailers.as_ref());
    assert_eq!(trailers["grpc-status"], "0");
    assert_eq!(second_parts.headers["idempotent-replayed"], "true");
    assert_eq!(second_parts.headers["content-type"], first_parts.headers["content-type"]);
    assert_eq!(second_parts.headers["x-refund-call"], "1");
}

/// gRPC-Web sends its trailers as the last frame of the body (flag 0x80), so the response has
/// no `grpc-status` header or trailer: the layer treats it as the HTTP POST it is, and stores
/// the 200 with its in-body trailers.
async fn grpc_web_is_stored_and_replayed_as_http(store: SharedStore) {
    use tower::{Layer, ServiceExt};
    let calls = Arc::new(AtomicUsize::new(0));
    let web = tower::service_fn({
        let calls = calls.clone();
        move |_req: http::Request<_>| {
            let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
            let message = RefundReply { refund_id: format!("re_web_{n}"), call: n as u64 }.encode_to_vec();
            let trailer = b"grpc-status:0\r\ngrpc-message:\r\n";
            let mut body = BytesMut::new();
            body.put_u8(0);
            body.put_u32(message.len() as u32);
            body.put_slice(&message);
            body.put_u8(0x80);
            body.put_u32(trailer.len() as u32);
            body.put_slice(trailer);
            let res = http::Response::builder()
                .header("content-type", "application/grpc-web+proto")
                .body(Full::new(body.freeze()))
                .unwrap();
            std::future::ready(Ok::<_, Infallible>(res))
        }
    });
    let svc = IdempotencyLayer::new(store).layer(web);
    let message = order("o-web", 900).encode_to_vec();
    let mut framed = BytesMut::new();
    framed.put_u8(0);
    framed.put_u32(message.len() as u32);
    framed.put_slice(&message);
    let framed = framed.freeze();
    let call = |key: Option<&str>, body: Bytes| {
        let mut req = http::Request::post(REFUND).header("content-type", "application/grpc-web+proto");
        if let Some(key) = key {
            req = req.header("idempotency-key", key);
        }
        let svc = svc.clone();
        async move {
            let res = svc.oneshot(req.body(Full::new(body)).unwrap()).await.unwrap();
            let (parts, body) = res.into_parts();
            let collected = body.collect().await.unwrap();
            assert!(collected.trailers().is_none(), "gRPC-Web has no HTTP trailers");
            (parts, collected.to_bytes())
        }
    };
    let (first, first_body) = call(Some("web-1"), framed.clone()).await;
    let (second, second_body) = call(Some("web-1"), framed.clone()).await;
    assert_eq!(calls.load(Ordering::SeqCst), 1, "the gRPC-Web call ran twice: its response was not stored");
    assert_eq!(first.status, 200);
    assert!(first.headers.get("idempotent-replayed").is_none());
    assert_eq!(second.headers["idempotent-replayed"], "true");
    assert_eq!(second.headers["content-type"], "application/grpc-web+proto");
    assert_eq!(second_body, first_body, "the replay differs from the first response");
    assert!(second_body.ends_with(b"grpc-status:0\r\ngrpc-message:\r\n"), "in-body trailers replayed");
    // Another message under the key: an HTTP refusal (422), not a gRPC status.
    let other = order("o-web", 901).encode_to_vec();
    let mut framed = BytesMut::new();
    framed.put_u8(0);
    framed.put_u32(other.len() as u32);
    framed.put_slice(&other);
    let (refused, _) = call(Some("web-1"), framed.freeze()).await;
    assert_eq!(refused.status, 422);
    assert_eq!(refused.headers["content-type"], "application/problem+json");
    assert!(refused.headers.get("grpc-status").is_none());
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

async fn sixty_four_concurrent_calls_run_the_handler_once(store: SharedStore) {
    let app = Arc::new(App::start(&store, |l| l).await);
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    for _ in 0..64 {
        let (app, tx) = (app.clone(), tx.clone());
        tokio::spawn(async move { tx.send(app.refund(Some("busy"), behaving("o-9", "gate")).await).unwrap() });
    }
    let mut next = async || tokio::time::timeout(Duration::from_secs(20), rx.recv()).await.expect("a reply").unwrap();
    for _ in 0..63 {
        let status = refused(next().await, Code::Aborted);
        let pushback: u64 = status.metadata().get("grpc-retry-pushback-ms").unwrap().to_str().unwrap().parse().unwrap();
        assert!((1..=1000).contains(&pushback), "{pushback}");
    }
    assert_eq!(app.ledger.calls(), 1);
    app.ledger.gate.add_permits(1);
    let leader = next().await.unwrap();
    assert!(!replayed(leader.metadata()));
    let again = app.refund(Some("busy"), behaving("o-9", "gate")).await.unwrap();
    assert!(replayed(again.metadata()));
    assert_eq!(again.get_ref(), leader.get_ref());
    assert_eq!(app.ledger.calls(), 1);
}

async fn another_message_under_the_same_key_is_failed_precondition(store: SharedStore) {
    let app = App::start(&store, |l| l).await;
    app.refund(Some("fp"), order("o-1", 100)).await.unwrap();
    refused(app.refund(Some("fp"), order("o-1", 200)).await, Code::FailedPrecondition);
    refused(app.refund(Some("fp"), order("o-2", 100)).await, Code::FailedPrecondition);
    assert!(replayed(app.refund(Some("fp"), order("o-1", 100)).await.unwrap().metadata()));
    assert_eq!(app.ledger.calls(), 1);
}

async fn missing_and_invalid_keys_are_invalid_argument(store: SharedStore) {
    let app = App::start(&store, |l| l).await;
    // Without a key the call passes through unprotected.
    app.refund(None, order("o-1", 1)).await.unwrap();
    app.refund(None, order("o-1", 1)).await.unwrap();
    assert_eq!(app.ledger.calls(), 2);

    let strict = App::start(&store, |l| l.require_key(true)).await;
    let status = refused(strict.refund(None, order("o-1", 1)).await, Code::InvalidArgument);
    assert!(status.message().contains("idempotency-key"), "{status:?}");
    let long = "k".repeat(256);
    for bad in ["", "\"\"", long.as_str(), "\"open"] {
        refused(strict.refund(Some(bad), order("o-1", 1)).await, Code::InvalidArgument);
    }
    let twice = strict
        .refund_with(order("o-1", 1), |md| {
            md.append("idempotency-key", "a".parse().unwrap());
            md.append("idempotency-key", "b".parse().unwrap());
        })
        .await;
    refused(twice, Code::InvalidArgument);
    assert_eq!(strict.ledger.calls(), 0);
    strict.refund(Some("\"fine\""), order("o-1", 1)).await.unwrap();
    assert!(replayed(strict.refund(Some("fine"), order("o-1", 1)).await.unwrap().metadata()));
    assert_eq!(strict.ledger.calls(), 1);
}

async fn oversized_messages_are_resource_exhausted(store: SharedStore) {
    let app = App::start(&store, |l| l.max_request_body(64)).await;
    refused(app.refund(Some("big"), order(&"x".repeat(100), 1)).await, Code::ResourceExhausted);
    assert_eq!(app.ledger.calls(), 0);
    app.refund(Some("big"), order("small", 1)).await.unwrap();
    assert_eq!(app.ledger.calls(), 1);
}

async fn transient_statuses_release_the_key(store: SharedStore) {
    let app = App::start(&store, |l| l).await;
    let cases = [
        ("unavailable", Code::Unavailable),
        ("aborted", Code::Aborted),
        ("resource_exhausted", Code::ResourceExhausted),
        ("deadline_exceeded", Code::DeadlineExceeded),
        ("internal", Code::Internal),
    ];
    for (behaviour, code) in cases {
        let key = format!("transient-{behaviour}");
        let before = app.ledger.calls();
        let first = app.refund(Some(&key), behaving("o", behaviour)).await.unwrap_err();
        let second = app.refund(Some(&key), behaving("o", behaviour)).await.unwrap_err();
        assert_eq!((first.code(), second.code()), (code, code));
        assert!(!replayed(second.metadata()));
        assert_eq!(app.ledger.calls(), before + 2, "{behaviour}: the retry did not run the handler");
    }
}

async fn final_error_statuses_are_replayed(store: SharedStore) {
    let app = App::start(&store, |l| l).await;
    for (behaviour, code) in [
        ("not_found", Code::NotFound),
        ("invalid_argument", Code::InvalidArgument),
        ("already_exists", Code::AlreadyExists),
    ] {
        let key = format!("final-{behaviour}");
        let before = app.ledger.calls();
        let first = app.refund(Some(&key), behaving("o", behaviour)).await.unwrap_err();
        let second = app.refund(Some(&key), behaving("o", behaviour)).await.unwrap_err();
        assert_eq!((first.code(), second.code()), (code, code));
        assert_eq!(second.message(), first.message(), "the stored grpc-message is replayed verbatim");
        assert!(first.message().ends_with('✗'));
        assert!(replayed(second.metadata()));
        assert_eq!(app.ledger.calls(), before + 1);
    }
}

async fn tenants_never_share_a_record(store: SharedStore) {
    let app = App::start(&store, |l| l).await;
    let call = |tenant: &'static str| {
        app.refund_with(order("o-1", 5), move |md| {
            md.insert("idempotency-key", "shared".parse().unwrap());
            md.insert("x-tenant", tenant.parse().unwrap());
        })
    };
    let a = call("acme").await.unwrap();
    let b = call("globex").await.unwrap();
    assert!(!replayed(b.metadata()));
    assert_eq!((a.get_ref().call, b.get_ref().call), (1, 2));
    assert_eq!(call("acme").await.unwrap().get_ref(), a.get_ref());
    assert_eq!(call("globex").await.unwrap().get_ref(), b.get_ref());
    assert_eq!(app.ledger.calls(), 2);
}

async fn nested_steps_run_under_the_calls_identity(store: SharedStore) {
    let app = App::start(&store, |l| l).await;
    let call = |tenant: &'static str| {
        app.refund_with(behaving("o-1", "nested"), move |md| {
            md.insert("idempotency-key", "shared".parse().unwrap());
            md.insert("x-tenant", tenant.parse().unwrap());
        })
    };
    // The handler's first call runs its step and then fails: the key is released.
    refused(call("acme").await, Code::Unavailable);
    // The retry runs the handler again, and the step replays: one run of its action.
    let acme = call("acme").await.unwrap();
    assert_eq!(acme.get_ref().refund_id, "step 1 for acme");
    // Another tenant's equal key is another call, and its step another run.
    let globex = call("globex").await.unwrap();
    assert!(!replayed(globex.metadata()));
    assert_eq!(globex.get_ref().refund_id, "step 2 for globex");
    assert_eq!(call("acme").await.unwrap().get_ref(), acme.get_ref());
    assert_eq!(app.ledger.steps.load(Ordering::SeqCst), 2);
    // A call without a key runs unprotected, and the handler can tell.
    let bare = app.refund(None, behaving("o-2", "nested")).await.unwrap();
    assert_eq!(bare.get_ref().refund_id, "unprotected: Some(NoKey)");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_unreachable_store_is_unavailable() {
    let mut server = RedisServer::start();
    let store: SharedStore =
        Arc::new(RedisStore::builder(server.url()).command_timeout(Duration::from_millis(500)).connect_lazy().unwrap());
    let app = App::start(&store, |l| l).await;
    app.refund(Some("before"), order("o-1", 1)).await.unwrap();
    server.kill();
    let status = refused(app.refund(Some("during"), order("o-1", 1)).await, Code::Unavailable);
    assert!(status.metadata().get("grpc-retry-pushback-ms").is_some());
    assert_eq!(app.ledger.calls(), 1, "the handler ran although the store was down");
    // Calls without a key do not touch the store.
    app.refund(None, order("o-1", 1)).await.unwrap();
}
