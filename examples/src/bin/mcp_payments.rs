//! Tools over MCP: an agent loop whose model (a scripted mock) asks for refunds, and an MCP
//! server whose `refund` tool charges a payment provider, reached through a connection that loses
//! replies after the server answered. Each tool call charges once.
//!
//! ```text
//! cargo run -p idempotent-examples --bin mcp_payments   # SQLite file (the embedded default)
//! REDIS_URL=redis://127.0.0.1:6379 cargo run -p idempotent-examples --bin mcp_payments   # Redis
//! DATABASE_URL=postgres://postgres@127.0.0.1/postgres cargo run -p idempotent-examples --bin mcp_payments  # PostgreSQL
//! RUST_LOG=info,idempotent_mcp=debug cargo run -p idempotent-examples --bin mcp_payments  # each retry and replay
//! ```
//!
//! - The server: an rmcp tool router (`#[tool_router]`, `#[tool]`) wrapped in `IdempotentServer`
//!   on the examples' store (`idempotent_examples::store_from_env`), with `require_key(true)`,
//!   served over streamable HTTP (axum) on loopback. The tool gets the call's `Attempt`
//!   (`Extension<Attempt>`) and charges the provider under its downstream key. The provider does
//!   not deduplicate: a second run of the tool for one call would be a second charge.
//! - The connection: a TCP relay carrying one HTTP request per connection. For the tool calls
//!   the script picks, it forwards the request, waits until the server starts answering (the
//!   tool ran and its result is stored), and closes the client's connection without the reply.
//! - The agent: each tool call the model asks for is one `KeyedCall` (a new random key, so that
//!   every run of the program is new), sent by `ToolCaller`, which retries a lost reply under the
//!   same key; the retry gets the stored result, marked replayed.
//!
//! Exits non-zero if any tool call charged other than once.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotent_core::{Attempt, Backoff, SharedStore};
use idempotent_mcp::client::{KeyedCall, ToolCaller};
use idempotent_mcp::{IdempotentServer, meta};
use rmcp::handler::server::router::tool::ToolRouter;
use rmcp::handler::server::tool::Extension;
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::{CallToolRequestParams, CallToolResult, ClientConfig, ServerCapabilities, ServerConfig};
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use rmcp::{ErrorData, ServerHandler, ServiceExt, schemars, tool, tool_handler, tool_router};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

// ---- the payment provider (mock): every charge is money out ----

/// One charge the provider made.
struct Charge {
    id: String,
    order: String,
}

#[derive(Clone, Default)]
struct Provider {
    /// Every charge made.
    charges: Arc<Mutex<Vec<Charge>>>,
}

impl Provider {
    /// Charges `cents` for `order`. Unlike Stripe, it does not deduplicate by `key`: every
    /// request is a new charge, so that a tool that ran twice shows.
    fn charge(&self, key: &str, order: &str, cents: u64) -> String {
        let mut charges = self.charges.lock().unwrap();
        let id = format!("ch_{:03}", charges.len() + 1);
        println!("    provider: {id}: {order} refunded {} (downstream key {}…)", dollars(cents), &key[..8]);
        charges.push(Charge { id: id.clone(), order: order.to_owned() });
        id
    }

    /// The charges made for `order`.
    fn charges_for(&self, order: &str) -> Vec<String> {
        let charges = self.charges.lock().unwrap();
        charges.iter().filter(|c| c.order == order).map(|c| c.id.clone()).collect()
    }

    fn total(&self) -> usize {
        self.charges.lock().unwrap().len()
    }
}

fn dollars(cents: u64) -> String {
    format!("${}.{:02}", cents / 100, cents % 100)
}

// ---- the MCP server: a `refund` tool behind IdempotentServer ----

/// The arguments of `refund`.
#[derive(Debug, serde::Deserialize, schemars::JsonSchema)]
struct Refund {
    /// The order refunded.
    order: String,
    /// The amount, in cents.
    cents: u64,
}

#[derive(Clone)]
struct Payments {
    provider: Provider,
    tool_router: ToolRouter<Self>,
}

#[tool_router]
impl Payments {
    /// Refunds part of an order through the payment provider.
    #[tool]
    async fn refund(
        &self,
        Parameters(refund): Parameters<Refund>,
        Extension(attempt): Extension<Attempt>,
    ) -> Result<CallToolResult, ErrorData> {
        // The same downstream key on every attempt at this call: a provider that deduplicates
        // (Stripe's `Idempotency-Key`) would also refuse a second charge after a crash.
        let charge = self.provider.charge(attempt.downstream_key().as_str(), &refund.order, refund.cents);
        Ok(CallToolResult::structured(json!({ "charge": charge, "order": refund.order, "cents": refund.cents })))
    }
}

#[tool_handler(router = self.tool_router)]
impl ServerHandler for Payments {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
    }
}

/// Serves `server` over streamable HTTP at `http://<addr>/mcp` on a free loopback port,
/// answering each request with one JSON response (no SSE, no sessions).
async fn serve_mcp(server: IdempotentServer<Payments>) -> Result<SocketAddr, BoxError> {
    let config = StreamableHttpServerConfig::default()
        .with_sse_keep_alive(None)
        .with_legacy_session_mode(false)
        .with_json_response(true);
    let service: StreamableHttpService<IdempotentServer<Payments>, LocalSessionManager> =
        StreamableHttpService::new(move || Ok(server.clone()), Default::default(), config);
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let app = axum::Router::new().nest_service("/mcp", service);
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(addr)
}

// ---- the flaky connection: a relay that loses the replies the script picks ----

/// How many replies of the n-th tool call (1-based, by key) the connection loses.
fn replies_lost(call: usize) -> u32 {
    match call {
        1 => 1,
        3 => 2,
        _ => 0,
    }
}

/// What the relay saw of one tool call (one key).
#[derive(Clone, Copy, Default)]
struct Seen {
    /// The n-th key the relay saw.
    call: usize,
    attempts: u32,
    lost: u32,
}

#[derive(Clone, Default)]
struct FlakyLink {
    calls: Arc<Mutex<HashMap<String, Seen>>>,
}

impl FlakyLink {
    /// Relays connections from a free loopback port to `upstream`.
    async fn start(&self, upstream: SocketAddr) -> Result<SocketAddr, BoxError> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let link = self.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let link = link.clone();
                tokio::spawn(async move {
                    if let Err(e) = link.relay(client, upstream).await {
                        tracing::debug!(error = %e, "relay ended");
                    }
                });
            }
        });
        Ok(addr)
    }

    /// What the relay saw of the call under `key`.
    fn seen(&self, key: &str) -> Seen {
        self.calls.lock().unwrap().get(key).copied().unwrap_or_default()
    }

    /// One connection: one HTTP request (head and `Content-Length` body) and its reply.
    async fn relay(&self, mut client: TcpStream, upstream: SocketAddr) -> std::io::Result<()> {
        let mut request = Vec::new();
        let mut buf = vec![0u8; 16 * 1024];
        let head_end = loop {
            if let Some(at) = request.windows(4).position(|w| w == b"\r\n\r\n") {
                break at + 4;
            }
            let n = client.read(&mut buf).await?;
            if n == 0 {
                return Ok(());
            }
            request.extend_from_slice(&buf[..n]);
        };
        let head = String::from_utf8_lossy(&request[..head_end]).to_ascii_lowercase();
        let length = head
            .lines()
            .find_map(|line| line.strip_prefix("content-length:"))
            .and_then(|n| n.trim().parse::<usize>().ok())
            .unwrap_or(0);
        while request.len() < head_end + length {
            let n = client.read(&mut buf).await?;
            if n == 0 {
                return Ok(());
            }
            request.extend_from_slice(&buf[..n]);
        }
        let lose = self.lose(&request[head_end..]);
        let mut server = TcpStream::connect(upstream).await?;
        server.write_all(&request).await?;
        if !lose {
            tokio::io::copy_bidirectional(&mut client, &mut server).await?;
            return Ok(());
        }
        // The first bytes of the reply: the server has answered (the tool ran, its result is
        // stored). The client gets none of it.
        let _ = server.read(&mut buf).await?;
        Ok(())
    }

    /// Counts a `tools/call` attempt by its key, and says whether its reply is lost.
    fn lose(&self, body: &[u8]) -> bool {
        let Ok(message) = serde_json::from_slice::<Value>(body) else { return false };
        if message["method"] != "tools/call" {
            return false;
        }
        let Some(key) = message["params"]["_meta"][meta::KEY].as_str() else { return false };
        let mut calls = self.calls.lock().unwrap();
        let next = calls.len() + 1;
        let seen = calls.entry(key.to_owned()).or_insert(Seen { call: next, ..Seen::default() });
        seen.attempts += 1;
        let lose = seen.attempts <= replies_lost(seen.call);
        if lose {
            seen.lost += 1;
        }
        lose
    }
}

// ---- the model provider (mock): a scripted planner ----

/// What the model answers: a tool call, or the final answer.
enum Turn {
    ToolCall { id: String, name: &'static str, arguments: Value },
    Answer(String),
}

/// The refunds the user asked for: (order, cents).
const PLAN: [(&str, u64); 3] = [("order-A", 1500), ("order-B", 750), ("order-C", 4200)];

/// The "model": one refund per turn, in the plan's order, then the answer.
fn complete(messages: &[Value]) -> Turn {
    let done = messages.iter().filter(|m| m["role"] == "tool").count();
    match PLAN.get(done) {
        Some((order, cents)) => Turn::ToolCall {
            id: format!("call_{}", done + 1),
            name: "refund",
            arguments: json!({ "order": order, "cents": cents }),
        },
        None => Turn::Answer(format!("All {} refunds are done.", PLAN.len())),
    }
}

// ---- the agent ----

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    // rmcp logs every session's start and end at INFO (a session per request here): WARN
    // unless `RUST_LOG` says otherwise.
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,sqlx=warn,rmcp=warn"));
    idempotent_examples::logs().with_env_filter(filter).with_target(false).without_time().init();

    let (store, describe): (SharedStore, String) = idempotent_examples::store_from_env().await?;
    println!("records in {describe}");
    let provider = Provider::default();
    let payments = Payments { provider: provider.clone(), tool_router: Payments::tool_router() };
    let server = IdempotentServer::new(payments, store).require_key(true);
    let mcp = serve_mcp(server).await?;
    let link = FlakyLink::default();
    let relay = link.start(mcp).await?;
    println!("MCP server at http://{mcp}/mcp; the agent reaches it through a relay at {relay} that loses replies\n");

    // One HTTP request per connection, so that the relay sees (and may cut) each one.
    let http = reqwest::Client::builder().pool_max_idle_per_host(0).build()?;
    let config = StreamableHttpClientTransportConfig::with_uri(format!("http://{relay}/mcp"));
    let client = ClientConfig::default().serve(StreamableHttpClientTransport::with_client(http, config)).await?;
    let caller = ToolCaller::new(client.peer().clone())
        .backoff(Backoff::new(Duration::from_millis(50), Duration::from_secs(1)).max_attempts(5))
        .timeout(Duration::from_secs(10));

    let mut messages = vec![
        json!({"role": "system", "content": "You refund orders with the refund tool."}),
        json!({"role": "user", "content": "Refund order-A $15.00, order-B $7.50 and order-C $42.00."}),
    ];
    // (order, the charge its tool call returned)
    let mut answered = Vec::new();
    for _turn in 0..10 {
        let (id, name, arguments) = match complete(&messages) {
            Turn::Answer(text) => {
                println!("\nassistant: {text}");
                break;
            }
            Turn::ToolCall { id, name, arguments } => (id, name, arguments),
        };
        messages.push(json!({"role": "assistant", "tool_calls": [{"id": id, "name": name, "arguments": arguments}]}));
        println!("model: {id} {name} {arguments}");
        // One logical call, one key, sent with every attempt. Not the model's tool-call id: a
        // model planning the call again after an error gives it a new one.
        let args = arguments.as_object().cloned().unwrap_or_default();
        let call = KeyedCall::new(CallToolRequestParams::new(name).with_arguments(args));
        let result = caller.send(&call).await?;
        let seen = link.seen(call.key());
        let output = result.structured_content.clone().unwrap_or_default();
        let charge = output["charge"].as_str().unwrap_or("?").to_owned();
        println!(
            "  {id}: key {}…, {} attempt(s), {} reply(ies) lost, final answer {} → charge {charge}",
            &call.key()[..8],
            seen.attempts,
            seen.lost,
            if meta::is_replayed(&result) { "replayed (the tool did not run again)" } else { "from the tool" },
        );
        answered.push((arguments["order"].as_str().unwrap_or_default().to_owned(), charge));
        messages.push(json!({"role": "tool", "tool_call_id": id, "content": output.to_string()}));
    }
    client.cancel().await?;

    let mut ok = answered.len() == PLAN.len();
    for (order, charge) in &answered {
        let made = provider.charges_for(order);
        ok &= made == [charge.clone()];
        if made.len() != 1 {
            eprintln!("{order}: {} charge(s): {made:?}", made.len());
        }
    }
    println!("=> the provider charged {} time(s) for {} tool call(s).", provider.total(), answered.len());
    ok &= provider.total() == answered.len();
    if !ok {
        eprintln!("a tool call did not charge exactly once");
        std::process::exit(1);
    }
    Ok(())
}
