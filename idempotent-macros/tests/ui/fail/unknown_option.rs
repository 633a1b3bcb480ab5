use idempotent_core::{Error, RunContext, idempotent};

#[idempotent(step = "refund", timeout = 60)]
async fn refund(ctx: &RunContext, order_id: &str) -> Result<String, Error> {
    Ok(order_id.to_owned())
}

fn main() {}
