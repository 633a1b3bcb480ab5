use idempotent_core::{Error, RunContext, idempotent};

#[derive(Debug)]
struct Receipt;

#[idempotent(step = "refund")]
async fn refund(ctx: &RunContext, order_id: &str) -> Result<Receipt, Error> {
    let _ = order_id;
    Ok(Receipt)
}

fn main() {}
