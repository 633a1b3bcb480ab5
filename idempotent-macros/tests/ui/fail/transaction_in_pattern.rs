use idempotent_core::sqlx::SqliteTransaction;
use idempotent_core::{Error, RunContext, idempotent};

struct Tx<'a, 'b>(&'a mut SqliteTransaction<'b>);

#[idempotent(step = "insert", transaction = tx)]
async fn insert(ctx: &RunContext, Tx(tx): Tx<'_, '_>, order_id: &str) -> Result<i64, Error> {
    let _ = tx;
    Ok(1)
}

fn main() {}
