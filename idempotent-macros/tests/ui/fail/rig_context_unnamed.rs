use idempotent_core::{Error, idempotent};

// rig's `ToolContext` holds the `RunContext` as a scope; `ctx = tool_ctx` says to take it there.
#[idempotent(step = "refund")]
async fn refund(tool_ctx: &mut rig_core::tool::ToolContext, order_id: String) -> Result<String, Error> {
    Ok(order_id)
}

fn main() {}
