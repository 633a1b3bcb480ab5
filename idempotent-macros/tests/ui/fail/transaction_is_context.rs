use idempotent_core::{Error, RunContext, idempotent};

#[idempotent(step = "create_invoice", ctx = run, transaction = run)]
async fn create_invoice(run: &RunContext, order_id: &str) -> Result<String, Error> {
    Ok(order_id.to_owned())
}

fn main() {}
