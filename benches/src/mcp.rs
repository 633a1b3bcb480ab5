//! The MCP tool server of `mcp_bench` and of `alloc_count`'s MCP rows: one trivial tool, the
//! transports the benches serve it on, and the call they send it.
//!
//! `refund` parses its two arguments and answers a small structured result, without a side
//! effect: what a call costs beyond it is rmcp's (the floor) or the protection's.

use std::net::SocketAddr;

use axum::serve::ListenerExt;
use rmcp::handler::server::router::tool::ToolRouter;
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::{
    CallToolRequestParams, CallToolResult, ClientConfig, RequestMetaObject, ServerCapabilities, ServerConfig,
};
use rmcp::service::{RoleClient, RunningService};
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::transport::streamable_http_server::StreamableHttpService;
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::{ErrorData, ServerHandler, ServiceExt, tool, tool_handler, tool_router};
use serde_json::{Value, json};

pub use idempotent_tests::mcp::Refund;

/// The bench's MCP server: one tool, `refund`.
#[derive(Clone)]
pub struct Refunds {
    tool_router: ToolRouter<Self>,
}

impl Default for Refunds {
    fn default() -> Self {
        Refunds { tool_router: Self::tool_router() }
    }
}

#[tool_router]
impl Refunds {
    /// Refunds part of an order (here: answers as the provider would, doing nothing).
    #[tool]
    async fn refund(&self, Parameters(refund): Parameters<Refund>) -> Result<CallToolResult, ErrorData> {
        Ok(CallToolResult::structured(json!({
            "refund_id": "re_3PqX7yLkd82Hf0Zs1mN4",
            "order": refund.order,
            "cents": refund.cents,
            "status": "succeeded",
        })))
    }
}

#[tool_handler(router = self.tool_router)]
impl ServerHandler for Refunds {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
    }
}

/// The bench's `tools/call`: `refund` of 1 500 cents on one order, under `key` in `_meta`
/// ([`idempotent_mcp::meta::KEY`]) when given.
pub fn refund_call(key: Option<String>) -> CallToolRequestParams {
    let Value::Object(arguments) = json!({ "order": "ord_7Hq2mXK9pLzV4rT1", "cents": 1500 }) else {
        unreachable!("an object")
    };
    let mut params = CallToolRequestParams::new("refund").with_arguments(arguments);
    if let Some(key) = key {
        let mut meta = RequestMetaObject::default();
        meta.insert(idempotent_mcp::meta::KEY.to_owned(), Value::String(key));
        params.meta = Some(meta);
    }
    params
}

/// `handler` as a streamable HTTP service, as the tests' endpoint serves it: stateless (no
/// session: each request is served by a clone of `handler`) and answering with plain JSON (no
/// SSE), so that every call is one HTTP request and one response.
pub fn http_service<S>(handler: S) -> StreamableHttpService<S, LocalSessionManager>
where
    S: ServerHandler + Clone + Send + Sync + 'static,
{
    StreamableHttpService::new(move || Ok(handler.clone()), Default::default(), idempotent_tests::mcp::http_config())
}

/// Serves `router` on a free loopback port (`TCP_NODELAY` on), until the process ends.
pub async fn serve(router: axum::Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("local address");
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    tokio::spawn(async move { axum::serve(listener, router).await.expect("serve") });
    addr
}

/// An rmcp client of the streamable HTTP endpoint at `uri`, on a reqwest client of its own.
///
/// `keep_alive`: a reqwest client with its default pool, so that a connection carries one
/// request after another. Otherwise rmcp's default client (`from_config`), which keeps no idle
/// connection (`pool_max_idle_per_host(0)`, against a delayed-ACK stall when an SSE body was not
/// read to its end): every call then opens and closes a TCP connection.
pub async fn http_client(uri: String, keep_alive: bool) -> RunningService<RoleClient, ClientConfig> {
    let config = StreamableHttpClientTransportConfig::with_uri(uri);
    let transport = if keep_alive {
        StreamableHttpClientTransport::with_client(reqwest::Client::new(), config)
    } else {
        StreamableHttpClientTransport::from_config(config)
    };
    ClientConfig::default().serve(transport).await.expect("the MCP client connects")
}

/// `handler` served on one end of an in-process pipe (`tokio::io::duplex`), and an rmcp client
/// on the other.
pub async fn duplex_client<S: ServerHandler>(handler: S) -> RunningService<RoleClient, ClientConfig> {
    let (server_io, client_io) = tokio::io::duplex(64 * 1024);
    tokio::spawn(async move { handler.serve(server_io).await.expect("serve").waiting().await });
    ClientConfig::default().serve(client_io).await.expect("the MCP client connects")
}
