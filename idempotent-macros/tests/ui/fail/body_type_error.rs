use idempotent_core::{Error, RunContext, idempotent};

#[idempotent(step = "refund")]
async fn refund(ctx: &RunContext, order_id: &str) -> Result<String, Error> {
    Ok(order_id.len())
}

fn main() {}
