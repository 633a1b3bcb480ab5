use idempotent_core::{Error, RunContext, idempotent};

#[idempotent(step = "create_invoice", transaction = tx)]
async fn create_invoice(ctx: &RunContext, tx: u32, order_id: &str) -> Result<String, Error> {
    Ok(format!("{order_id}{tx}"))
}

fn main() {}
