use idempotent_core::{Error, RunContext, idempotent};

#[idempotent(step = "refund")]
async fn refund<T: serde::Serialize>(ctx: &RunContext, order: Vec<T>) -> Result<usize, Error> {
    Ok(order.len())
}

fn main() {}
