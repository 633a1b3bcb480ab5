use idempotent_core::{Error, RunContext, idempotent};

#[idempotent(step = "refund", key(order))]
async fn refund(ctx: &RunContext, order_id: &str, amount: u64) -> Result<String, Error> {
    Ok(format!("{order_id}{amount}"))
}

fn main() {}
