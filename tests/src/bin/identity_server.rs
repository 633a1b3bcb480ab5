//! The service of `idempotent_tests::identity` in a process of its own, for
//! `tests/tests/tower_identity.rs` to kill in the middle of a request and start again.
//!
//! `identity_server <store-url> <ledger-file> <lease ms>` serves on a free loopback port and
//! prints `listening <address>`; a request sent with `x-hang` prints what it did (`charged …`,
//! `committed …`) and never ends, so that the test can SIGKILL the process there.

use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use idempotent_core::MemoryStore;
use idempotent_tests::identity::{Shop, app, open};
use idempotent_tests::ledger::Ledger;

const USAGE: &str = "usage: identity_server <store-url> <ledger-file> <lease ms>";

fn say(line: String) {
    let mut out = std::io::stdout();
    writeln!(out, "{line}").and_then(|()| out.flush()).expect("write to stdout");
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let mut args = std::env::args().skip(1);
    let url = args.next().expect(USAGE);
    let ledger = Ledger::at(args.next().expect(USAGE));
    let lease = Duration::from_millis(args.next().expect(USAGE).parse().expect(USAGE));
    let (store, states, database) = open(Some(&url), Arc::new(MemoryStore::new())).await;
    let mut shop = Shop::new(states, ledger, database);
    shop.hang = Some(Arc::new(say));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind a loopback port");
    say(format!("listening {}", listener.local_addr().expect("the bound address")));
    axum::serve(listener, app(store, shop, lease)).await.expect("serve");
}
