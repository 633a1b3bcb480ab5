use idempotent_core::{Error, RunContext, idempotent};

#[idempotent(step = "refund", ctx = self.ctx)]
async fn refund(ctx: &RunContext, order_id: &str) -> Result<String, Error> {
    Ok(order_id.to_owned())
}

fn main() {}
