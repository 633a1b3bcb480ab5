//! The MCP tool server the MCP tests (`tests/tests/mcp*.rs`) and the `mcp_child` binary serve,
//! and the ways to reach it: a payments server whose `refund` tool charges a provider (a
//! [`Ledger`] file that deduplicates by key, as Stripe does), behind an
//! [`IdempotentServer`](idempotent_mcp::IdempotentServer), over streamable HTTP (axum) or
//! stdio.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotent_core::verify::Verdict;
use idempotent_core::{Attempt, RunContext};
use rmcp::handler::server::router::tool::ToolRouter;
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::{
    CallToolRequestParams, CallToolResult, ClientConfig, ContentBlock, Extensions, ServerCapabilities, ServerConfig,
};
use rmcp::service::{RoleClient, RunningService};
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use rmcp::{ErrorData, ServerHandler, ServiceExt, schemars, tool, tool_handler, tool_router};
use serde_json::{Value, json};

use crate::ledger::Ledger;

/// What the `refund` tool does besides charging.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Stall {
    /// Nothing: charge and answer.
    #[default]
    No,
    /// Write `running <fence>` to stderr and hang before charging (a process killed there made
    /// no effect).
    BeforeCharge,
    /// Charge, write `charged <fence>` to stderr and hang (a process killed there made the
    /// effect and stored no result).
    AfterCharge,
}

/// The arguments of `refund`.
#[derive(Debug, serde::Deserialize, schemars::JsonSchema)]
pub struct Refund {
    /// The order refunded.
    pub order: String,
    /// The amount, in cents.
    pub cents: u64,
}

/// The arguments of the other tools.
#[derive(Debug, serde::Deserialize, schemars::JsonSchema)]
pub struct Order {
    /// The order.
    pub order: String,
}

/// The payments server.
#[derive(Clone)]
pub struct Payments {
    ledger: Ledger,
    stall: Stall,
    /// Hold every `refund` until a permit is added (tests of concurrent duplicates).
    gate: Option<Arc<tokio::sync::Semaphore>>,
    /// Notified when a `refund` starts (before the gate).
    started: Arc<tokio::sync::Notify>,
    runs: Arc<Mutex<HashMap<(String, String), u32>>>,
    /// The attempt every `refund` ran under, in order.
    attempts: Arc<Mutex<Vec<Attempt>>>,
    tool_router: ToolRouter<Self>,
}

impl Payments {
    /// A server charging `ledger`.
    pub fn new(ledger: Ledger) -> Payments {
        Payments {
            ledger,
            stall: Stall::No,
            gate: None,
            started: Arc::default(),
            runs: Arc::default(),
            attempts: Arc::default(),
            tool_router: Self::tool_router(),
        }
    }

    /// Stalls every `refund` as `stall` says.
    pub fn stall(mut self, stall: Stall) -> Payments {
        self.stall = stall;
        self
    }

    /// Holds every `refund` until `gate` gives it a permit.
    pub fn gate(mut self, gate: Arc<tokio::sync::Semaphore>) -> Payments {
        self.gate = Some(gate);
        self
    }

    /// Notified when a `refund` starts running (before it waits at the gate).
    pub fn started(&self) -> Arc<tokio::sync::Notify> {
        self.started.clone()
    }

    /// How many times `tool` ran for `order`.
    pub fn runs(&self, tool: &str, order: &str) -> u32 {
        self.runs.lock().unwrap().get(&(tool.to_owned(), order.to_owned())).copied().unwrap_or(0)
    }

    /// The attempts `refund` ran under (protected calls only).
    pub fn attempts(&self) -> Vec<Attempt> {
        self.attempts.lock().unwrap().clone()
    }

    fn ran(&self, tool: &str, order: &str) -> u32 {
        let mut runs = self.runs.lock().unwrap();
        let n = runs.entry((tool.to_owned(), order.to_owned())).or_default();
        *n += 1;
        *n
    }
}

#[tool_router]
impl Payments {
    /// Refunds part of an order through the payment provider.
    #[tool]
    async fn refund(
        &self,
        Parameters(refund): Parameters<Refund>,
        extensions: Extensions,
    ) -> Result<CallToolResult, ErrorData> {
        self.ran("refund", &refund.order);
        self.started.notify_one();
        if let Some(gate) = &self.gate {
            gate.acquire().await.expect("gate open").forget();
        }
        let attempt = extensions.get::<Attempt>().cloned();
        let fence = attempt.as_ref().map_or(0, Attempt::fence);
        let recovered = attempt.as_ref().is_some_and(Attempt::recovered);
        if let Some(attempt) = &attempt {
            self.attempts.lock().unwrap().push(attempt.clone());
        }
        if self.stall == Stall::BeforeCharge {
            eprintln!("running {fence}");
            std::future::pending::<()>().await;
        }
        let charge = match extensions.get::<RunContext>() {
            // The charge is a step of the call: a call recovered after a crash asks the provider,
            // by the step's downstream key, whether the charge was made.
            Some(ctx) => {
                let ledger = self.ledger.clone();
                let verify_ledger = self.ledger.clone();
                let stall = self.stall;
                ctx.step("charge")
                    .verify(move |attempt: Attempt| async move {
                        let found = verify_ledger.find(attempt.downstream_key().as_str());
                        Ok::<_, idempotent_core::Error>(
                            found.map_or(Verdict::NotDone, |charge| Verdict::Done(charge.id)),
                        )
                    })
                    .run(&(&refund.order, refund.cents), move |attempt: Attempt| async move {
                        let id = ledger.charge(attempt.downstream_key().as_str(), refund.cents);
                        if stall == Stall::AfterCharge {
                            eprintln!("charged {fence}");
                            std::future::pending::<()>().await;
                        }
                        Ok::<_, idempotent_core::Error>(id)
                    })
                    .await?
            }
            None => self.ledger.charge(&uuid::Uuid::new_v4().to_string(), refund.cents),
        };
        let summary = json!({ "charge": charge, "order": refund.order, "fence": fence, "recovered": recovered });
        Ok(CallToolResult::structured(summary))
    }

    /// How many refunds an order got (reads only).
    #[tool(annotations(read_only_hint = true))]
    async fn balance(&self, Parameters(order): Parameters<Order>) -> Result<CallToolResult, ErrorData> {
        let reads = self.ran("balance", &order.order);
        let refunds = self.runs("refund", &order.order);
        Ok(CallToolResult::structured(json!({ "refunds": refunds, "reads": reads })))
    }

    /// Tries to charge a card the provider declines: a tool error (`isError: true`).
    #[tool]
    async fn decline(&self, Parameters(order): Parameters<Order>) -> Result<CallToolResult, ErrorData> {
        let n = self.ran("decline", &order.order);
        Ok(CallToolResult::error(vec![ContentBlock::text(format!("card declined (run {n})"))]))
    }

    /// Panics on its first run for an order, and answers after that.
    #[tool]
    async fn crash(
        &self,
        Parameters(order): Parameters<Order>,
        extensions: Extensions,
    ) -> Result<CallToolResult, ErrorData> {
        let n = self.ran("crash", &order.order);
        assert!(n > 1, "crash: the first run for {} panics", order.order);
        let recovered = extensions.get::<Attempt>().is_some_and(Attempt::recovered);
        Ok(CallToolResult::structured(json!({ "run": n, "recovered": recovered })))
    }

    /// Reaches a provider that answers 502: a JSON-RPC error.
    #[tool]
    async fn explode(&self, Parameters(order): Parameters<Order>) -> Result<CallToolResult, ErrorData> {
        let n = self.ran("explode", &order.order);
        Err(ErrorData::internal_error(format!("provider answered 502 (run {n})"), None))
    }
}

#[tool_handler(router = self.tool_router)]
impl ServerHandler for Payments {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().enable_resources().build())
    }

    /// One resource, so that a test can tell the handler's answer from the default (none).
    async fn list_resources(
        &self,
        _request: Option<rmcp::model::PaginatedRequestParams>,
        _context: rmcp::service::RequestContext<rmcp::RoleServer>,
    ) -> Result<rmcp::model::ListResourcesResult, ErrorData> {
        let ledger = rmcp::model::Resource::new("ledger://charges", "charges");
        Ok(rmcp::model::ListResourcesResult::with_all_items(vec![ledger]))
    }
}

/// `refund`'s arguments.
pub fn refund(order: &str, cents: u64) -> CallToolRequestParams {
    call("refund", json!({ "order": order, "cents": cents }))
}

/// A call of `tool` with `arguments` (a JSON object).
pub fn call(tool: &'static str, arguments: Value) -> CallToolRequestParams {
    let Value::Object(arguments) = arguments else { panic!("arguments must be an object") };
    CallToolRequestParams::new(tool).with_arguments(arguments)
}

/// The streamable HTTP server configuration the tests and benches serve with: stateless (no
/// session) and answering with plain JSON (no SSE), so that every call is one HTTP request and
/// one response.
pub fn http_config() -> StreamableHttpServerConfig {
    let mut config = StreamableHttpServerConfig::default().with_sse_keep_alive(None);
    config.legacy_session_mode = false;
    config.json_response = true;
    config
}

/// A streamable HTTP MCP endpoint at `/mcp` on a free loopback port, serving what `make`
/// makes (once per session); stops when dropped.
pub struct HttpEndpoint {
    addr: SocketAddr,
    stop: tokio_util::sync::CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl HttpEndpoint {
    /// Serves `make()` on `listener`, configured by [`http_config`].
    pub async fn serve<S, F>(listener: tokio::net::TcpListener, make: F) -> HttpEndpoint
    where
        S: ServerHandler,
        F: Fn() -> S + Send + Sync + 'static,
    {
        let addr = listener.local_addr().expect("local address");
        let stop = tokio_util::sync::CancellationToken::new();
        let mut config = http_config();
        config.cancellation_token = stop.child_token();
        let service: StreamableHttpService<S, LocalSessionManager> =
            StreamableHttpService::new(move || Ok(make()), Default::default(), config);
        let router = axum::Router::new().nest_service("/mcp", service);
        let ct = stop.clone();
        let task = tokio::spawn(async move {
            let _ =
                axum::serve(listener, router).with_graceful_shutdown(async move { ct.cancelled_owned().await }).await;
        });
        HttpEndpoint { addr, stop, task }
    }

    /// Serves `make()` on a free loopback port.
    pub async fn start<S, F>(make: F) -> HttpEndpoint
    where
        S: ServerHandler,
        F: Fn() -> S + Send + Sync + 'static,
    {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        HttpEndpoint::serve(listener, make).await
    }

    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for HttpEndpoint {
    fn drop(&mut self) {
        self.stop.cancel();
        self.task.abort();
    }
}

/// An MCP client of the endpoint at `http://<addr>/mcp`, sending `headers` with every request.
pub async fn http_client(addr: SocketAddr, headers: &[(&str, &str)]) -> RunningService<RoleClient, ClientConfig> {
    let mut config = StreamableHttpClientTransportConfig::with_uri(format!("http://{addr}/mcp"));
    let mut custom = HashMap::new();
    for (name, value) in headers {
        custom.insert(
            http::HeaderName::from_bytes(name.as_bytes()).expect("header name"),
            http::HeaderValue::from_str(value).expect("header value"),
        );
    }
    config = config.custom_headers(custom);
    let transport = StreamableHttpClientTransport::from_config(config);
    tokio::time::timeout(Duration::from_secs(10), ClientConfig::default().serve(transport))
        .await
        .expect("the MCP client connects within 10 s")
        .expect("the MCP client connects")
}
