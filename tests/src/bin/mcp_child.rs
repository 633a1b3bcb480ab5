//! An MCP tool server in a process of its own, for `tests/tests/mcp_restart.rs`: the payments
//! server of `idempotent_tests::mcp` behind an `IdempotentServer`, killed mid-tool and restarted.
//!
//! `mcp_child <store-url> <ledger-file> <stall> <transport> <lease ms>` opens the store at
//! `<store-url>` (`idempotent_core::store::connect`), requires keys, and serves over `http`
//! (streamable HTTP on a free loopback port, printing `listening <address>` on stdout) or `stdio`.
//! `<stall>` is `no`, `before` (the refund hangs before charging, after writing `running
//! <fence>` to stderr) or `after` (it charges, writes `charged <fence>` and hangs).

use std::io::Write;
use std::time::Duration;

use idempotent_mcp::IdempotentServer;
use idempotent_tests::ledger::Ledger;
use idempotent_tests::mcp::{HttpEndpoint, Payments, Stall};
use rmcp::ServiceExt;

const USAGE: &str = "usage: mcp_child <store-url> <ledger-file> <no|before|after> <http|stdio> <lease ms>";

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let mut args = std::env::args().skip(1);
    let url = args.next().expect(USAGE);
    let ledger = Ledger::at(args.next().expect(USAGE));
    let stall = match args.next().expect(USAGE).as_str() {
        "no" => Stall::No,
        "before" => Stall::BeforeCharge,
        "after" => Stall::AfterCharge,
        _ => panic!("{USAGE}"),
    };
    let transport = args.next().expect(USAGE);
    let lease = Duration::from_millis(args.next().expect(USAGE).parse().expect(USAGE));
    let store = idempotent_core::store::connect(&url).await.expect("open the store");
    let payments = Payments::new(ledger).stall(stall);
    let server = move || IdempotentServer::new(payments.clone(), store.clone()).require_key(true).lease(lease);
    match transport.as_str() {
        "http" => {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
            let addr = listener.local_addr().expect("address");
            let _endpoint = HttpEndpoint::serve(listener, server).await;
            println!("listening {addr}");
            std::io::stdout().flush().expect("flush stdout");
            std::future::pending::<()>().await;
        }
        "stdio" => {
            let running = server().serve(rmcp::transport::stdio()).await.expect("serve over stdio");
            let _ = running.waiting().await;
        }
        _ => panic!("{USAGE}"),
    }
}
