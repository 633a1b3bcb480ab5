//! A process that dies inside a step's transaction, for `tests/tests/transaction.rs`.
//!
//! `sqlite_txn_child <path> <lease ms>` opens the store at `<path>` and runs the step
//! `create_invoice` of the run `crash-run` (payload `"order-1"`, the given lease) with
//! `run_in_transaction`: the action inserts `("order-1", <fence>)` into the table `invoices`
//! (which must exist), prints `inserted <fence>` and waits forever, so that the test can kill
//! the process between the business insert and the commit.

use std::io::Write;
use std::time::Duration;

use idempotent_core::{Error, RunContext, SqliteStore};

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let mut args = std::env::args().skip(1);
    let path = args.next().expect("usage: sqlite_txn_child <path> <lease ms>");
    let lease_ms: u64 = args.next().expect("a lease in ms").parse().expect("a lease in ms");
    let store = SqliteStore::open(&path).await.expect("open the store");
    let ctx = RunContext::new(store, "crash-run");
    let result: Result<u64, Error> = ctx
        .step("create_invoice")
        .lease(Duration::from_millis(lease_ms))
        .run_in_transaction(&"order-1", async |tx: &mut sqlx::SqliteTransaction<'_>, attempt| {
            sqlx::query("INSERT INTO invoices (order_id, fence) VALUES ('order-1', ?1)")
                .bind(attempt.fence() as i64)
                .execute(&mut **tx)
                .await
                .expect("insert the invoice");
            println!("inserted {}", attempt.fence());
            std::io::stdout().flush().expect("flush stdout");
            std::future::pending::<()>().await;
            Ok(attempt.fence())
        })
        .await;
    panic!("the step was to hang until killed, but returned {result:?}");
}
