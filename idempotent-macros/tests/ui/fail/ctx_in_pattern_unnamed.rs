use idempotent_core::{Error, RunContext, idempotent};

struct Extension<T>(T);

// The context is found by its type only in a plain parameter: name the binding with `ctx = run`.
#[idempotent(step = "refund")]
async fn refund(Extension(run): Extension<RunContext>, order_id: String) -> Result<String, Error> {
    Ok(order_id)
}

fn main() {}
