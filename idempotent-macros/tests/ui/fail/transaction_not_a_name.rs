use idempotent_core::{Error, RunContext, idempotent};

#[idempotent(step = "create_invoice", transaction = self.tx)]
async fn create_invoice(ctx: &RunContext, order_id: &str) -> Result<String, Error> {
    Ok(order_id.to_owned())
}

fn main() {}
