use idempotent_core::{Error, RunContext, idempotent};

#[idempotent(step = "refund", skip(order_id), key(order_id))]
async fn refund(ctx: &RunContext, order_id: &str, amount: u64) -> Result<String, Error> {
    Ok(format!("{order_id}{amount}"))
}

fn main() {}
