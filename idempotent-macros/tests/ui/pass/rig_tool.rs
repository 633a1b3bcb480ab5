//! `#[idempotent]` with rig's `#[rig_tool]`, in either order. rig calls the function with its
//! `&mut ToolContext` and the model's arguments; `ctx = tool_ctx` takes the `RunContext` the host
//! attached to that context as a scope, and the model's arguments are the payload.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use idempotent_core::{Error, MemoryStore, RunContext, idempotent};
use rig_core::rig_tool;
use rig_core::tool::{Tool, ToolContext};

static REFUNDS: AtomicU32 = AtomicU32::new(0);
static CANCELS: AtomicU32 = AtomicU32::new(0);

/// Refunds an order.
#[idempotent(step = "refund", ctx = tool_ctx)]
#[rig_tool(params(order_id = "The order to refund"))]
async fn refund(tool_ctx: &mut rig_core::tool::ToolContext, order_id: String, cents: u64) -> Result<String, Error> {
    let n = REFUNDS.fetch_add(1, Ordering::SeqCst) + 1;
    Ok(format!("re_{order_id}_{cents}_{n}"))
}

/// Cancels an order.
#[rig_tool]
#[idempotent(step = "cancel", ctx = tool_ctx, skip(reason))]
async fn cancel(
    #[rig(context)] tool_ctx: &mut ToolContext,
    order_id: String,
    reason: Option<String>,
) -> Result<u32, Error> {
    let _ = (order_id, reason);
    Ok(CANCELS.fetch_add(1, Ordering::SeqCst) + 1)
}

fn main() {
    assert_eq!(Refund.description(), "Refunds an order.");
    assert_eq!(Cancel.description(), "Cancels an order.");
    let schema = Refund.parameters();
    assert!(schema["properties"].get("order_id").is_some());
    assert!(schema["properties"].get("cents").is_some());
    assert!(schema["properties"].get("tool_ctx").is_none(), "the context is not the model's");

    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let run = RunContext::new(MemoryStore::new(), "rig-run");
        let mut tool_ctx = ToolContext::default().with_scope(Arc::new(run));
        let args = || RefundParameters { order_id: "o-1".into(), cents: 1500 };
        let first = Refund.call(&mut tool_ctx, args()).await.unwrap();
        let again = REFUND.call(&mut tool_ctx, args()).await.unwrap();
        assert_eq!(first, "re_o-1_1500_1");
        assert_eq!(again, first, "replayed: the body ran once");
        assert_eq!(REFUNDS.load(Ordering::SeqCst), 1);

        let cancel = |reason: &str| CancelParameters { order_id: "o-1".into(), reason: Some(reason.into()) };
        assert_eq!(Cancel.call(&mut tool_ctx, cancel("late")).await.unwrap(), 1);
        assert_eq!(Cancel.call(&mut tool_ctx, cancel("duplicate")).await.unwrap(), 1);
        assert_eq!(CANCELS.load(Ordering::SeqCst), 1, "`reason` is skipped: one key");

        // Without a `RunContext` scope the call fails before the body runs.
        let mut bare = ToolContext::default();
        let error = Refund.call(&mut bare, args()).await.unwrap_err();
        assert!(matches!(error, Error::Config(_)), "{error}");
        assert_eq!(REFUNDS.load(Ordering::SeqCst), 1);
    });
}
