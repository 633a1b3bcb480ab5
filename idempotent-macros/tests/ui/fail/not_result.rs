use idempotent_core::{RunContext, idempotent};

#[idempotent(step = "refund")]
async fn refund(ctx: &RunContext, order_id: &str) -> Option<String> {
    Some(order_id.to_owned())
}

fn main() {}
