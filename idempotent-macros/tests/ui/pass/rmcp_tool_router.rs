//! `#[idempotent]` above rmcp's `#[tool]` on `&self` methods of a `#[tool_router]` impl: the
//! router still lists the tools with their doc-comment descriptions, the signatures take rmcp's
//! extractors (`Parameters(args)`, `Extension(ctx)`), the call futures are `Send`, and the error
//! type is `rmcp::ErrorData` (idempotent-core's `rmcp` feature).

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use idempotent_core::{MemoryStore, RunContext, idempotent};
use rmcp::handler::server::tool::Extension;
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::CallToolResult;
use rmcp::{ErrorData, Json, tool, tool_router};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize, rmcp::schemars::JsonSchema)]
#[schemars(crate = "rmcp::schemars")]
struct RefundArgs {
    order_id: String,
    cents: u64,
}

#[derive(Debug, Serialize, Deserialize, rmcp::schemars::JsonSchema)]
#[schemars(crate = "rmcp::schemars")]
struct Receipt {
    refund_id: String,
}

struct Server {
    refunds: AtomicU32,
    ctx: Arc<RunContext>,
}

#[tool_router]
impl Server {
    /// Refunds an order, once per run however often the call is retried.
    #[idempotent(step = "refund", ctx = ctx)]
    #[tool]
    async fn refund(
        &self,
        Parameters(args): Parameters<RefundArgs>,
        Extension(ctx): Extension<RunContext>,
    ) -> Result<String, ErrorData> {
        let n = self.refunds.fetch_add(1, Ordering::SeqCst) + 1;
        Ok(format!("re_{}_{}_{n}", args.order_id, args.cents))
    }

    /// Refunds an order under the server's own run context.
    // The fields a struct pattern binds are the payload, by name: keyed on `order_id`, with
    // `cents` fingerprinted.
    #[idempotent(step = "refund_here", ctx = self.ctx, key(order_id))]
    #[tool(name = "refund_here")]
    async fn refund_with_server_context(
        &self,
        Parameters(RefundArgs { order_id, cents }): Parameters<RefundArgs>,
    ) -> Result<Json<Receipt>, ErrorData> {
        self.refunds.fetch_add(1, Ordering::SeqCst);
        Ok(Json(Receipt { refund_id: format!("re_{order_id}_{cents}") }))
    }

    // `skip(..)` names a binding too.
    #[idempotent(step = "cancel", ctx = run, skip(reason))]
    #[tool(description = "Cancels an order.")]
    async fn cancel(
        &self,
        Parameters(Cancel { order_id, reason }): Parameters<Cancel>,
        Extension(run): Extension<RunContext>,
    ) -> Result<CallToolResult, ErrorData> {
        let _ = reason;
        self.refunds.fetch_add(1, Ordering::SeqCst);
        Ok(CallToolResult::success(vec![rmcp::model::ContentBlock::text(order_id)]))
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, rmcp::schemars::JsonSchema)]
#[schemars(crate = "rmcp::schemars")]
struct Cancel {
    order_id: String,
    reason: String,
}

fn assert_send<T: Send>(_: &T) {}

fn main() {
    let tools = Server::tool_router().list_all();
    let refund = tools.iter().find(|t| t.name == "refund").expect("the router lists `refund`");
    assert_eq!(
        refund.description.as_deref(),
        Some("Refunds an order, once per run however often the call is retried.")
    );
    let here = tools.iter().find(|t| t.name == "refund_here").expect("the router lists `refund_here`");
    assert_eq!(here.description.as_deref(), Some("Refunds an order under the server's own run context."));
    assert!(here.output_schema.is_some(), "`Json<Receipt>` gives an output schema");
    let cancel = tools.iter().find(|t| t.name == "cancel").expect("the router lists `cancel`");
    assert_eq!(cancel.description.as_deref(), Some("Cancels an order."));
    assert_eq!(tools.len(), 3);

    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let run = RunContext::new(MemoryStore::new(), "mcp-run");
        let server = Server { refunds: AtomicU32::new(0), ctx: Arc::new(run.clone()) };
        let args = || RefundArgs { order_id: "o-1".into(), cents: 1500 };

        let call = server.refund(Parameters(args()), Extension(run.clone()));
        assert_send(&call);
        let first = call.await.unwrap();
        let again = server.refund(Parameters(args()), Extension(run.clone())).await.unwrap();
        assert_eq!(first, "re_o-1_1500_1");
        assert_eq!(again, first, "replayed: the body ran once");
        assert_eq!(server.refunds.load(Ordering::SeqCst), 1);

        let call = server.refund_with_server_context(Parameters(args()));
        assert_send(&call);
        assert_eq!(call.await.unwrap().0.refund_id, "re_o-1_1500");
        server.refund_with_server_context(Parameters(args())).await.unwrap();
        assert_eq!(server.refunds.load(Ordering::SeqCst), 2);
        // `key(order_id)`: another amount under the same order is refused, as invalid params.
        let changed = RefundArgs { order_id: "o-1".into(), cents: 9900 };
        let changed = server.refund_with_server_context(Parameters(changed)).await;
        let error = changed.err().expect("a payload mismatch");
        assert_eq!(error.code, rmcp::model::ErrorCode::INVALID_PARAMS);

        let cancel = |reason: &str| Cancel { order_id: "o-1".into(), reason: reason.into() };
        server.cancel(Parameters(cancel("late")), Extension(run.clone())).await.unwrap();
        server.cancel(Parameters(cancel("duplicate")), Extension(run.clone())).await.unwrap();
        assert_eq!(server.refunds.load(Ordering::SeqCst), 3, "`reason` is skipped: one key");
    });
}
