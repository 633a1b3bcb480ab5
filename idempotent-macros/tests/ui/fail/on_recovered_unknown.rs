use idempotent_core::{Error, RunContext, idempotent};

#[idempotent(step = "charge", on_recovered = "retry")]
async fn charge(ctx: &RunContext, order_id: &str) -> Result<String, Error> {
    Ok(order_id.to_owned())
}

fn main() {}
