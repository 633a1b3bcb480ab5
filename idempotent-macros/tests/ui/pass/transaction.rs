//! `transaction = tx` on free functions and methods, with each way of writing the transaction's
//! type: the parameter leaves the signature, and the body sees the step's transaction.

use idempotent_core::sqlx::{self, Sqlite, SqliteTransaction, Transaction};
use idempotent_core::{Error, RunContext, idempotent};

fn db(e: sqlx::Error) -> Error {
    Error::Config(e.to_string())
}

#[idempotent(step = "create_invoice", transaction = tx)]
async fn create_invoice(ctx: &RunContext, tx: &mut SqliteTransaction<'_>, order_id: &str) -> Result<u64, Error> {
    sqlx::query("INSERT INTO invoices VALUES (?1)").bind(order_id).execute(&mut **tx).await.map_err(db)?;
    Ok(1)
}

// The transaction first, a `mut` binding, the generic spelling, and `key(..)`.
#[idempotent(step = "void_invoice", transaction = conn, key(order_id))]
async fn void_invoice(mut conn: &mut Transaction<'_, Sqlite>, ctx: &RunContext, order_id: String, why: String) -> Result<(), Error> {
    let again: &mut Transaction<'_, Sqlite> = &mut conn;
    sqlx::query("DELETE FROM invoices WHERE id = ?1 AND ?2 <> ''").bind(order_id).bind(why).execute(&mut **again).await.map_err(db)?;
    Ok(())
}

struct Billing {
    ctx: RunContext,
}

impl Billing {
    #[idempotent(step = "bill", ctx = self.ctx, transaction = tx)]
    async fn bill(&self, tx: &mut sqlx::SqliteTransaction<'_>, cents: i64) -> Result<i64, Error> {
        sqlx::query("SELECT ?1").bind(cents).execute(&mut **tx).await.map_err(db)?;
        Ok(cents)
    }
}

fn assert_send<F: std::future::Future + Send>(_: F) {}

fn main() {
    // Callers pass everything but the transaction; the calls are `Send`.
    let ctx = RunContext::new(idempotent_core::MemoryStore::new(), "run");
    assert_send(create_invoice(&ctx, "o-1"));
    assert_send(void_invoice(&ctx, "o-1".to_owned(), "duplicate".to_owned()));
    let billing = Billing { ctx: ctx.clone() };
    assert_send(billing.bill(1500));
}
