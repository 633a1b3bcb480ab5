use idempotent_core::{Error, RunContext, idempotent};

struct App {
    ctx: RunContext,
}

#[idempotent(step = "refund", ctx = app.ctx)]
async fn refund(app: &App, order_id: &str) -> Result<String, Error> {
    Ok(order_id.to_owned())
}

fn main() {}
