//! A process that dies inside a step's transaction, for `tests/tests/transaction.rs` and
//! `tests/tests/transaction_postgres.rs`.
//!
//! `txn_child <store-url> <lease ms>` opens the store at `<store-url>` (`sqlite://<path>` for a
//! `SqliteStore` on that file, `postgres://…` for a `PostgresStore`) and runs the step
//! `create_invoice` of the run `crash-run` (payload `"order-1"`, the given lease) with
//! `run_in_transaction`: the action inserts `("order-1", <fence>)` into the table `invoices`
//! (which must exist), prints `inserted <fence>` and waits forever, so that the test can kill
//! the process between the business insert and the commit.

use std::io::Write;
use std::time::Duration;

use idempotent_core::{Error, PostgresStore, RunContext, SqliteStore};

const USAGE: &str = "usage: txn_child <sqlite://path | postgres://user@host:port/db> <lease ms>";

/// Tells the test the fence of the insert, then waits to be killed.
async fn inserted(fence: u64) {
    println!("inserted {fence}");
    std::io::stdout().flush().expect("flush stdout");
    std::future::pending::<()>().await;
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let mut args = std::env::args().skip(1);
    let url = args.next().expect(USAGE);
    let lease_ms: u64 = args.next().expect(USAGE).parse().expect(USAGE);
    let lease = Duration::from_millis(lease_ms);
    let result: Result<u64, Error> = if let Some(path) = url.strip_prefix("sqlite://") {
        let store = SqliteStore::open(path).await.expect("open the SQLite store");
        let ctx = RunContext::new(store, "crash-run");
        ctx.step("create_invoice")
            .lease(lease)
            .run_in_transaction(&"order-1", async |tx: &mut sqlx::SqliteTransaction<'_>, attempt| {
                sqlx::query("INSERT INTO invoices (order_id, fence) VALUES ('order-1', ?1)")
                    .bind(attempt.fence() as i64)
                    .execute(&mut **tx)
                    .await
                    .expect("insert the invoice");
                inserted(attempt.fence()).await;
                Ok(attempt.fence())
            })
            .await
    } else if url.starts_with("postgres://") {
        let store = PostgresStore::connect(url).await.expect("connect the PostgreSQL store");
        let ctx = RunContext::new(store, "crash-run");
        ctx.step("create_invoice")
            .lease(lease)
            .run_in_transaction(&"order-1", async |tx: &mut sqlx::PgTransaction<'_>, attempt| {
                sqlx::query("INSERT INTO invoices (order_id, fence) VALUES ('order-1', $1)")
                    .bind(attempt.fence() as i64)
                    .execute(&mut **tx)
                    .await
                    .expect("insert the invoice");
                inserted(attempt.fence()).await;
                Ok(attempt.fence())
            })
            .await
    } else {
        panic!("{USAGE}; got {url:?}");
    };
    panic!("the step was to hang until killed, but returned {result:?}");
}
