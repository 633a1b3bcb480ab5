//! The refund operation of `axum_payments` as a gRPC service on tonic, made idempotent by the
//! same `IdempotencyLayer` (`Server::builder().layer(...)`).
//!
//! ```text
//! cargo run -p idempotent-examples --bin tonic_payments  # SQLite file (the embedded default), port 50051
//! REDIS_URL=redis://127.0.0.1:6379 cargo run -p idempotent-examples --bin tonic_payments # Redis
//! DATABASE_URL=postgres://postgres@127.0.0.1/postgres cargo run -p idempotent-examples --bin tonic_payments  # PostgreSQL
//! cargo run -p idempotent-examples --bin tonic_payments -- client [KEY]  # the client sequence against a running server
//! cargo run -p idempotent-examples --bin tonic_payments -- demo          # server on a free port + client sequence, then exit
//! ```
//!
//! The client sequence sends `payments.Payments/Refund` with `idempotency-key` metadata:
//!
//! 1. `{order_id: "o-7", amount_cents: 1500}` → OK, `re_0001`; the provider is called.
//! 2. the same call again (a retry) → the same reply, with `idempotent-replayed: true` in the
//!    response metadata; the provider is not called.
//! 3. the same key with `amount_cents: 9999` → FAILED_PRECONDITION, saying the key was used for
//!    another request.
//! 4. a call without a key → INVALID_ARGUMENT (this server requires one).
//!
//! Run `client` twice with the same KEY: the second run gets only replays. With Redis, restart
//! the server in between: still replays. The service is written as tonic's generated code would
//! be (`tonic::server::Grpc` with prost messages), so the example needs no `protoc`; the schema is
//!
//! ```text
//! service Payments { rpc Refund(RefundRequest) returns (RefundReply); }
//! message RefundRequest { string order_id = 1; int64 amount_cents = 2; }
//! message RefundReply   { string refund_id = 1; string order_id = 2; int64 amount_cents = 3; }
//! ```

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::task::{Context, Poll};

use bytes::Bytes;
use http::uri::PathAndQuery;
use idempotent_core::SharedStore;
use idempotent_tower::IdempotencyLayer;
use tonic::transport::{Endpoint, Server};
use tonic::{Code, Status};
use tonic_prost::ProstCodec;

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type BoxFuture<T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send>>;

const REFUND: &str = "/payments.Payments/Refund";

#[derive(Clone, PartialEq, prost::Message)]
struct RefundRequest {
    #[prost(string, tag = "1")]
    order_id: String,
    #[prost(int64, tag = "2")]
    amount_cents: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
struct RefundReply {
    #[prost(string, tag = "1")]
    refund_id: String,
    #[prost(string, tag = "2")]
    order_id: String,
    #[prost(int64, tag = "3")]
    amount_cents: i64,
}

/// A stand-in for the payment provider: every call is a real refund.
#[derive(Default)]
struct Provider {
    refunds: AtomicU32,
}

/// `payments.Payments`, written the way tonic's generated server code is.
#[derive(Clone)]
struct Payments {
    provider: Arc<Provider>,
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
    type Future = BoxFuture<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let provider = self.provider.clone();
        Box::pin(async move {
            if req.uri().path() != REFUND {
                return Ok(Status::unimplemented(format!("no method {}", req.uri().path())).into_http());
            }
            let mut grpc = tonic::server::Grpc::new(ProstCodec::<RefundReply, RefundRequest>::default());
            Ok(grpc.unary(Refund(provider), req).await)
        })
    }
}

struct Refund(Arc<Provider>);

impl tonic::server::UnaryService<RefundRequest> for Refund {
    type Response = RefundReply;
    type Future = BoxFuture<Result<tonic::Response<RefundReply>, Status>>;

    fn call(&mut self, req: tonic::Request<RefundRequest>) -> Self::Future {
        let provider = self.0.clone();
        Box::pin(async move {
            let req = req.into_inner();
            if req.amount_cents <= 0 {
                // A final error: stored and replayed like a success.
                return Err(Status::invalid_argument("amount_cents must be positive"));
            }
            let n = provider.refunds.fetch_add(1, Ordering::SeqCst) + 1;
            Ok(tonic::Response::new(RefundReply {
                refund_id: format!("re_{n:04}"),
                order_id: req.order_id,
                amount_cents: req.amount_cents,
            }))
        })
    }
}

async fn serve(listener: tokio::net::TcpListener, store: SharedStore) -> Result<(), tonic::transport::Error> {
    Server::builder()
        .layer(IdempotencyLayer::new(store).require_key(true).scope("payments-grpc"))
        .add_service(Payments { provider: Arc::new(Provider::default()) })
        .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener))
        .await
}

/// The client sequence from the module docs.
async fn client(addr: SocketAddr, key: &str) -> Result<(), BoxError> {
    let channel = Endpoint::from_shared(format!("http://{addr}"))?.connect().await?;
    let call = |key: Option<&str>, amount_cents: i64| {
        let channel = channel.clone();
        let key = key.map(str::to_owned);
        async move {
            let mut grpc = tonic::client::Grpc::new(channel);
            grpc.ready().await?;
            let mut req = tonic::Request::new(RefundRequest { order_id: "o-7".into(), amount_cents });
            if let Some(key) = key {
                req.metadata_mut().insert("idempotency-key", key.parse()?);
            }
            let res: Result<tonic::Response<RefundReply>, Status> =
                grpc.unary(req, PathAndQuery::from_static(REFUND), ProstCodec::default()).await;
            Ok::<_, BoxError>(res)
        }
    };
    let show = |title: &str, res: Result<tonic::Response<RefundReply>, Status>| match res {
        Ok(res) => {
            let replayed = res.metadata().get("idempotent-replayed").is_some();
            let r = res.into_inner();
            println!(
                "{title}: OK {} for {} ({} cents){}",
                r.refund_id,
                r.order_id,
                r.amount_cents,
                if replayed { " (idempotent-replayed: true)" } else { "" }
            );
        }
        Err(status) => println!("{title}: {:?}: {}", status.code(), status.message()),
    };
    show("1. refund", call(Some(key), 1500).await?);
    show("2. retry", call(Some(key), 1500).await?);
    let mismatch = call(Some(key), 9999).await?;
    assert!(matches!(&mismatch, Err(s) if s.code() == Code::FailedPrecondition));
    show("3. same key, other amount", mismatch);
    show("4. no key", call(None, 1500).await?);
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    idempotent_examples::logs().init();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let addr_env = std::env::var("ADDR").unwrap_or("127.0.0.1:50051".into());
    match args.first().map(String::as_str) {
        Some("client") => {
            let key = args.get(1).cloned().unwrap_or_else(|| format!("refund-o7-{}", std::process::id()));
            client(addr_env.parse()?, &key).await
        }
        Some("demo") => {
            let (store, describe) = idempotent_examples::store_from_env().await?;
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
            let addr = listener.local_addr()?;
            println!("gRPC payments service on {addr}, records in {describe}");
            tokio::spawn(serve(listener, store));
            client(addr, &format!("refund-o7-{}", std::process::id())).await
        }
        None => {
            let (store, describe) = idempotent_examples::store_from_env().await?;
            let listener = tokio::net::TcpListener::bind(&addr_env).await?;
            println!("gRPC payments service on {}, records in {describe}", listener.local_addr()?);
            serve(listener, store).await?;
            Ok(())
        }
        Some(other) => Err(format!("unknown argument {other:?}; use `client [KEY]` or `demo`").into()),
    }
}
