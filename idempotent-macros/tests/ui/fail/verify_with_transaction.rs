use idempotent_core::{Attempt, Error, RunContext, Verdict, idempotent};

/// Stands in for `sqlx::Transaction`: the macro reads the type's name only.
struct Transaction<'c>(&'c ());

async fn find_invoice(_attempt: Attempt) -> Result<Verdict<String>, Error> {
    Ok(Verdict::NotDone)
}

#[idempotent(step = "create_invoice", transaction = tx, verify = find_invoice)]
async fn create_invoice(ctx: &RunContext, tx: &mut Transaction<'_>, order_id: &str) -> Result<String, Error> {
    let _ = tx.0;
    Ok(order_id.to_owned())
}

fn main() {}
