use idempotent_core::{Error, RunContext, idempotent};

struct HttpClient;

#[idempotent(step = "refund")]
async fn refund(ctx: &RunContext, http: &HttpClient, order_id: &str) -> Result<String, Error> {
    let _ = http;
    Ok(order_id.to_owned())
}

fn main() {}
