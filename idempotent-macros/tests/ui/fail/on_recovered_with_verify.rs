use idempotent_core::{Attempt, Error, RunContext, Verdict, idempotent};

async fn find_charge(_attempt: Attempt) -> Result<Verdict<String>, Error> {
    Ok(Verdict::NotDone)
}

#[idempotent(step = "charge", verify = find_charge, on_recovered = "needs_attention")]
async fn charge(ctx: &RunContext, order_id: &str) -> Result<String, Error> {
    Ok(order_id.to_owned())
}

fn main() {}
