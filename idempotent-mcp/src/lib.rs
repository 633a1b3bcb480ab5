//! Exactly-once MCP tool calls on [rmcp](https://docs.rs/rmcp): a `tools/call` retried after its
//! reply was lost gets the first call's result instead of running the tool again.
//!
//! MCP gives a tool server no protection of its own: a JSON-RPC request id is unique only among
//! the requests in flight, `idempotentHint` is a hint, and a host that retries a call whose reply
//! it lost runs the tool twice. [`IdempotentServer`] wraps a server's handler and runs each
//! keyed `tools/call` once, on any store of `idempotent-core` (memory, SQLite, PostgreSQL,
//! Redis); [`client::ToolCaller`] sends one key with every attempt at a call.
//!
//! ```
//! use std::sync::Arc;
//! use std::sync::atomic::{AtomicU32, Ordering};
//!
//! use idempotent_core::{Attempt, MemoryStore};
//! use idempotent_mcp::client::{KeyedCall, ToolCaller};
//! use idempotent_mcp::{IdempotentServer, meta};
//! use rmcp::handler::server::router::tool::ToolRouter;
//! use rmcp::handler::server::tool::Extension;
//! use rmcp::handler::server::wrapper::Parameters;
//! use rmcp::model::{CallToolRequestParams, CallToolResult, ClientConfig, ContentBlock, ServerCapabilities, ServerConfig};
//! use rmcp::{ErrorData, ServerHandler, ServiceExt, schemars, tool, tool_handler, tool_router};
//!
//! #[derive(serde::Deserialize, schemars::JsonSchema)]
//! struct Refund {
//!     order: String,
//!     cents: u64,
//! }
//!
//! #[derive(Clone)]
//! struct Payments {
//!     refunds: Arc<AtomicU32>,
//!     tool_router: ToolRouter<Self>,
//! }
//!
//! #[tool_router]
//! impl Payments {
//!     /// Refunds part of an order.
//!     #[tool]
//!     async fn refund(
//!         &self,
//!         Parameters(refund): Parameters<Refund>,
//!         Extension(attempt): Extension<Attempt>,
//!     ) -> Result<CallToolResult, ErrorData> {
//!         // The payment provider deduplicates by `attempt.downstream_key()`, too.
//!         let n = self.refunds.fetch_add(1, Ordering::SeqCst) + 1;
//!         let id = format!("re_{}_{}_{n}", refund.order, refund.cents);
//!         Ok(CallToolResult::success(vec![ContentBlock::text(id)]))
//!     }
//! }
//!
//! #[tool_handler(router = self.tool_router)]
//! impl ServerHandler for Payments {
//!     fn get_info(&self) -> ServerConfig {
//!         ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
//!     }
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let refunds = Arc::new(AtomicU32::new(0));
//! let payments = Payments { refunds: refunds.clone(), tool_router: Payments::tool_router() };
//! let server = IdempotentServer::new(payments, MemoryStore::new()).require_key(true);
//!
//! // Any rmcp transport: stdio, streamable HTTP, or (here) an in-process pipe.
//! let (server_io, client_io) = tokio::io::duplex(64 * 1024);
//! tokio::spawn(async move { server.serve(server_io).await.expect("serve").waiting().await });
//! let client = ClientConfig::default().serve(client_io).await?;
//!
//! let caller = ToolCaller::new(client.peer().clone());
//! let args = serde_json::json!({ "order": "o-7", "cents": 1500 });
//! let call = KeyedCall::new(CallToolRequestParams::new("refund").with_arguments(args.as_object().unwrap().clone()));
//! let first = caller.send(&call).await?;
//! let retry = caller.send(&call).await?; // as after a lost reply: the same key
//! assert!(meta::is_replayed(&retry));
//! assert_eq!(first.content, retry.content);
//! assert_eq!(refunds.load(Ordering::SeqCst), 1);
//! # Ok(()) }
//! ```
//!
//! See [`server`] for what a protected call does and which tools are
//! protected, [`client`] for what is retried, and [`meta`] for the names in `_meta`.
#![deny(unreachable_pub)]
#![warn(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod client;
pub mod meta;
pub mod server;

pub use server::{DEFAULT_SCOPE, IdempotentServer, Unprotected};

/// The README's example is compiled and run as a doc test.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctest;
