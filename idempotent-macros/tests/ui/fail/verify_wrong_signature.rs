use idempotent_core::{Error, RunContext, idempotent};

/// Answers a bool, not a `Verdict`.
async fn find_charge(_attempt: idempotent_core::Attempt) -> Result<bool, Error> {
    Ok(true)
}

#[idempotent(step = "charge", verify = find_charge)]
async fn charge(ctx: &RunContext, order_id: &str) -> Result<String, Error> {
    Ok(order_id.to_owned())
}

fn main() {}
