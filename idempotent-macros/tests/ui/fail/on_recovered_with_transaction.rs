use idempotent_core::{Error, RunContext, idempotent};

/// Stands in for `sqlx::Transaction`: the macro reads the type's name only.
struct Transaction<'c>(&'c ());

#[idempotent(step = "create_invoice", on_recovered = "needs_attention", transaction = tx)]
async fn create_invoice(ctx: &RunContext, tx: &mut Transaction<'_>, order_id: &str) -> Result<String, Error> {
    let _ = tx.0;
    Ok(order_id.to_owned())
}

fn main() {}
