//! A worker that dies after its side effect and before its outcome is stored, for
//! `tests/tests/uncertain.rs`.
//!
//! `effect_child <store-url> <ledger-file> <lease ms>` opens the store at `<store-url>` (see
//! `idempotent_core::store::connect`) and runs the staged charge of `idempotent_tests::uncertain`
//! with the given lease: it charges the ledger, prints `charged <downstream key> <fence>` and
//! waits forever, so that the test can SIGKILL it between the charge and the complete.

use std::io::Write;
use std::time::Duration;

use idempotent_tests::ledger::Ledger;
use idempotent_tests::uncertain::charge_then_hang;

const USAGE: &str = "usage: effect_child <store-url> <ledger-file> <lease ms>";

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let mut args = std::env::args().skip(1);
    let url = args.next().expect(USAGE);
    let ledger = Ledger::at(args.next().expect(USAGE));
    let lease = Duration::from_millis(args.next().expect(USAGE).parse().expect(USAGE));
    let store = idempotent_core::store::connect(&url).await.expect("open the store");
    charge_then_hang(store, ledger, lease, |key, fence| {
        println!("charged {key} {fence}");
        std::io::stdout().flush().expect("flush stdout");
    })
    .await;
}
