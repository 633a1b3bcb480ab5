use idempotent_core::{RunContext, idempotent};

#[derive(Debug)]
struct RefundError;

#[idempotent(step = "refund")]
async fn refund(ctx: &RunContext, order_id: &str) -> Result<String, RefundError> {
    Ok(order_id.to_owned())
}

fn main() {}
