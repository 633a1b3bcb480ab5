//! The application under test: axum handlers that count what they did (`Effects`) and hold
//! `/gated` and `/slow-body` at a gate, the server they run in behind an `IdempotencyLayer` with a
//! hyper client for HTTP/1.1 and one for HTTP/2 (`App`), what a reply held (`Reply`), and raw and
//! in-process requests.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::Router;
use axum::body::Body as AxumBody;
use axum::extract::{Extension, Path, Query, State};
use axum::routing::post;
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Request, Response, StatusCode};
use http_body::Frame;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use idempotent_core::SharedStore;
use idempotent_tower::Attempt;
use idempotent_tower::server::{IdempotencyLayer, Unprotected};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{Notify, Semaphore};

pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;
pub(crate) type ClientBody = BoxBody<Bytes, BoxError>;

/// What the handlers did, and a gate that holds `/gated` open until the test lets it finish.
#[derive(Clone)]
pub(crate) struct Effects {
    pub(crate) calls: Arc<AtomicUsize>,
    pub(crate) entered: Arc<Notify>,
    pub(crate) gate: Arc<Semaphore>,
}

impl Effects {
    pub(crate) fn new() -> Self {
        Effects { calls: Arc::default(), entered: Arc::default(), gate: Arc::new(Semaphore::new(0)) }
    }

    pub(crate) fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }

    fn call(&self) -> usize {
        self.calls.fetch_add(1, Ordering::SeqCst) + 1
    }
}

pub(crate) async fn refund(
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

pub(crate) fn routes(effects: &Effects) -> Router {
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
pub(crate) struct App {
    addr: SocketAddr,
    pub(crate) effects: Effects,
    pub(crate) h1: Client<HttpConnector, ClientBody>,
    pub(crate) h2: Client<HttpConnector, ClientBody>,
}

impl App {
    pub(crate) async fn start(
        store: &SharedStore,
        configure: impl FnOnce(IdempotencyLayer) -> IdempotencyLayer,
    ) -> App {
        let effects = Effects::new();
        let layer = configure(IdempotencyLayer::new(store.clone()).tenant(tenant_from_header));
        Self::serve(routes(&effects).layer(layer), effects).await
    }

    pub(crate) async fn serve(router: Router, effects: Effects) -> App {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
        let h1 = Client::builder(TokioExecutor::new()).build_http();
        let h2 = Client::builder(TokioExecutor::new()).http2_only(true).build_http();
        App { addr, effects, h1, h2 }
    }

    pub(crate) fn req(&self, method: &str, path: &str) -> http::request::Builder {
        Request::builder()
            .method(method)
            .uri(format!("http://{}{path}", self.addr))
            .header("content-type", "application/json")
    }

    pub(crate) fn post(&self, path: &str, key: &str) -> http::request::Builder {
        self.req("POST", path).header("idempotency-key", key)
    }

    pub(crate) async fn h1(&self, req: http::request::Builder, body: impl Into<Bytes>) -> Reply {
        Reply::read(self.h1.request(req.body(full(body)).unwrap()).await.unwrap()).await
    }

    pub(crate) async fn h2(&self, req: http::request::Builder, body: impl Into<Bytes>) -> Reply {
        Reply::read(self.h2.request(req.body(full(body)).unwrap()).await.unwrap()).await
    }

    /// Sends raw bytes on a fresh connection and reads until the server closes it.
    pub(crate) async fn raw(&self, request: &[u8]) -> Vec<u8> {
        let mut s = tokio::net::TcpStream::connect(self.addr).await.unwrap();
        s.write_all(request).await.unwrap();
        let mut out = Vec::new();
        s.read_to_end(&mut out).await.unwrap();
        out
    }
}

pub(crate) fn full(body: impl Into<Bytes>) -> ClientBody {
    Full::new(body.into()).map_err(|never| match never {}).boxed()
}

#[derive(Debug)]
pub(crate) struct Reply {
    pub(crate) status: StatusCode,
    pub(crate) headers: HeaderMap,
    pub(crate) body: Bytes,
    pub(crate) trailers: Option<HeaderMap>,
}

impl Reply {
    pub(crate) async fn read(res: Response<hyper::body::Incoming>) -> Reply {
        let (parts, body) = res.into_parts();
        let collected = body.collect().await.unwrap();
        let trailers = collected.trailers().cloned();
        Reply { status: parts.status, headers: parts.headers, body: collected.to_bytes(), trailers }
    }

    pub(crate) fn replayed(&self) -> bool {
        match self.headers.get("idempotent-replayed") {
            None => false,
            Some(v) if v == "true" => true,
            Some(v) => panic!("Idempotent-Replayed: {v:?}"),
        }
    }

    pub(crate) fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// Asserts an RFC 9457 problem with `status` and the given type suffix, and returns it.
    #[track_caller]
    pub(crate) fn problem(&self, status: u16, kind: &str) -> serde_json::Value {
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
pub(crate) fn raw_post(path: &str, key: &str, body: &str) -> Vec<u8> {
    format!(
        "POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\nIdempotency-Key: {key}\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// The response's bytes without the header lines named in `drop` (case-insensitive).
pub(crate) fn without_headers(raw: &[u8], drop: &[&str]) -> Vec<u8> {
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

/// An in-process request to `path` under `key` (no connection: the test drops the future
/// itself, as hyper does when the client goes away).
pub(crate) fn in_process(path: &str, key: &str) -> Request<AxumBody> {
    Request::post(path)
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(AxumBody::from("{}"))
        .unwrap()
}
