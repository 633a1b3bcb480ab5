//! A process that dies inside a step's transaction, for the scenario
//! `a_process_killed_before_its_commit` (`idempotent_tests::transaction`) on either database.
//!
//! `txn_child <store-url> <lease ms>` opens the store at `<store-url>` (`sqlite://<path>` for a
//! `SqliteStore` on that file, `postgres://…` for a `PostgresStore`) and runs the step
//! `create_invoice` of the run `crash-run` (payload `"order-1"`, the given lease) with
//! `run_in_transaction`: the action inserts `("order-1", <fence>)` into the table `invoices`
//! (which must exist), prints `inserted <fence>` and waits forever, so that the test can kill
//! the process between the business insert and the commit.

use std::io::Write;
use std::time::Duration;

use idempotent_core::{Error, RunContext};
use idempotent_tests::sql::{PostgresBackend, SqlDb, SqliteBackend};
use sqlx::Transaction;

const USAGE: &str = "usage: txn_child <sqlite://path | postgres://user@host:port/db> <lease ms>";

/// The step on the store of `url`, written once for both databases.
async fn run<B: SqlDb>(url: &str, lease: Duration) -> Result<u64, Error> {
    let store = B::open(url).await.expect("open the store");
    let ctx = RunContext::new(store, "crash-run");
    ctx.step("create_invoice")
        .lease(lease)
        .run_in_transaction(&"order-1", async |tx: &mut Transaction<'_, B::Db>, attempt| {
            B::insert(tx, "order-1", attempt.fence()).await.expect("insert the invoice");
            // Tells the test the fence of the insert, then waits to be killed.
            println!("inserted {}", attempt.fence());
            std::io::stdout().flush().expect("flush stdout");
            std::future::pending::<()>().await;
            Ok(attempt.fence())
        })
        .await
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let mut args = std::env::args().skip(1);
    let url = args.next().expect(USAGE);
    let lease_ms: u64 = args.next().expect(USAGE).parse().expect(USAGE);
    let lease = Duration::from_millis(lease_ms);
    let result = if url.starts_with("sqlite://") {
        run::<SqliteBackend>(&url, lease).await
    } else if url.starts_with("postgres://") {
        run::<PostgresBackend>(&url, lease).await
    } else {
        panic!("{USAGE}; got {url:?}");
    };
    panic!("the step was to hang until killed, but returned {result:?}");
}
