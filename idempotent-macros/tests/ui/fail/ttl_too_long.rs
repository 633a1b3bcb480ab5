use idempotent_core::{Error, RunContext, idempotent};

#[idempotent(step = "refund", ttl = 315360001)]
async fn refund(ctx: &RunContext, order_id: &str) -> Result<String, Error> {
    Ok(order_id.to_owned())
}

fn main() {}
