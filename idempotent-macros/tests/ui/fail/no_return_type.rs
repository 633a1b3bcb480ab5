use idempotent_core::{RunContext, idempotent};

#[idempotent(step = "send_email")]
async fn send_email(ctx: &RunContext, to: &str) {
    let _ = to;
}

fn main() {}
