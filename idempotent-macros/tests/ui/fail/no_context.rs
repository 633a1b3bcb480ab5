use idempotent_core::{Error, idempotent};

#[idempotent(step = "refund")]
async fn refund(order_id: &str, amount: u64) -> Result<String, Error> {
    Ok(format!("{order_id}{amount}"))
}

fn main() {}
