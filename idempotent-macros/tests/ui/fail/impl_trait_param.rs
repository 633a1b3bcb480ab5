use idempotent_core::{Error, RunContext, idempotent};

#[idempotent(step = "refund")]
async fn refund(ctx: &RunContext, order_id: impl serde::Serialize + Send) -> Result<u32, Error> {
    let _ = order_id;
    Ok(1)
}

fn main() {}
