//! An MCP tool server process SIGKILLed in the middle of a tool call and started again, over
//! streamable HTTP (on SQLite and on Redis) and over stdio: the client's retry, under the same
//! key, makes one charge in all and sees that it recovered the call.
//!
//! Killed before its charge, the call had no effect, and the retry charges. Killed after it, the
//! charge was made and nothing recorded it: the retry's charge step is recovered, and its
//! verifier finds the charge at the provider by the step's downstream key, so it is not made
//! again.

use std::process::Stdio;
use std::time::Duration;

use idempotent_mcp::client::{KeyedCall, ToolCaller};
use idempotent_mcp::meta;
use idempotent_tests::RedisServer;
use idempotent_tests::ledger::Ledger;
use idempotent_tests::mcp::{http_client, refund};
use rmcp::model::{CallToolResult, ClientConfig, RequestMetaObject};
use rmcp::service::{RoleClient, RunningService};
use rmcp::transport::TokioChildProcess;
use rmcp::{ServiceError, ServiceExt};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, ChildStderr, Command};

const MCP_CHILD: &str = env!("CARGO_BIN_EXE_mcp_child");
/// The lease the servers take calls on: the retry waits it out.
const LEASE_MS: &str = "1500";

#[derive(Clone, Copy, Debug)]
enum Kill {
    BeforeCharge,
    AfterCharge,
}

impl Kill {
    fn stall(self) -> &'static str {
        match self {
            Kill::BeforeCharge => "before",
            Kill::AfterCharge => "after",
        }
    }

    /// What the server writes to stderr once the call got that far.
    fn signal(self) -> &'static str {
        match self {
            Kill::BeforeCharge => "running ",
            Kill::AfterCharge => "charged ",
        }
    }
}

/// Waits for the line starting with `prefix` on the child's stderr.
async fn wait_for(stderr: &mut BufReader<ChildStderr>, prefix: &str) -> String {
    let read = async {
        let mut line = String::new();
        loop {
            line.clear();
            let n = stderr.read_line(&mut line).await.expect("read the server's stderr");
            assert!(n > 0, "the server exited before writing {prefix:?}");
            if line.starts_with(prefix) {
                return line.trim().to_owned();
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(30), read).await.unwrap_or_else(|_| panic!("no {prefix:?} within 30 s"))
}

/// Sends `call` once, without retrying.
async fn send_once(
    client: &RunningService<RoleClient, ClientConfig>,
    call: &KeyedCall,
) -> Result<CallToolResult, ServiceError> {
    let mut params = call.params().clone();
    let mut meta = RequestMetaObject::default();
    meta.insert(meta::KEY.to_owned(), serde_json::json!(call.key()));
    params.meta = Some(meta);
    client.peer().call_tool(params).await
}

/// What every restart test checks of the retry's result and the provider's ledger.
fn one_charge_and_recovered(result: &CallToolResult, ledger: &Ledger) {
    let summary = result.structured_content.as_ref().expect("a structured result");
    assert_eq!(summary["recovered"], true, "the retry recovered the killed call: {summary}");
    let charges = ledger.charges();
    assert_eq!(charges.len(), 1, "one charge in all: {charges:?}");
    assert_eq!(summary["charge"], charges[0].id.as_str());
    assert_eq!(charges[0].amount, 4200);
}

fn http_child(store_url: &str, ledger: &Ledger, stall: &str) -> Child {
    Command::new(MCP_CHILD)
        .args([store_url, ledger.path().to_str().unwrap(), stall, "http", LEASE_MS])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("start mcp_child")
}

async fn listening(child: &mut Child) -> std::net::SocketAddr {
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    stdout.read_line(&mut line).await.expect("read mcp_child's stdout");
    line.trim().strip_prefix("listening ").unwrap_or_else(|| panic!("unexpected: {line:?}")).parse().unwrap()
}

async fn killed_over_http(store_url: &str, kill: Kill) {
    let dir = tempfile::tempdir().unwrap();
    let ledger = Ledger::at(dir.path().join("ledger"));
    let mut first = http_child(store_url, &ledger, kill.stall());
    let addr = listening(&mut first).await;
    let mut stderr = BufReader::new(first.stderr.take().unwrap());
    let client = http_client(addr, &[]).await;
    let call = KeyedCall::new(refund("o-kill", 4200));
    let pending = tokio::spawn({
        let call = call.clone();
        async move { send_once(&client, &call).await }
    });
    wait_for(&mut stderr, kill.signal()).await;
    first.kill().await.expect("SIGKILL the server");
    assert!(pending.await.unwrap().is_err(), "the killed server answered");
    assert_eq!(ledger.charges().len(), usize::from(matches!(kill, Kill::AfterCharge)));

    let mut second = http_child(store_url, &ledger, "no");
    let addr = listening(&mut second).await;
    let client = http_client(addr, &[]).await;
    let caller = ToolCaller::new(client.peer().clone()).timeout(Duration::from_secs(20));
    let result = caller.send(&call).await.expect("the retry gets a result");
    one_charge_and_recovered(&result, &ledger);
    // A second retry replays it.
    let again = caller.send(&call).await.unwrap();
    assert!(meta::is_replayed(&again));
    assert_eq!(ledger.charges().len(), 1);
}

fn sqlite_url(dir: &tempfile::TempDir) -> String {
    format!("sqlite://{}", dir.path().join("records.db").display())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_server_killed_before_its_charge_on_sqlite_charges_once_on_the_retry() {
    let dir = tempfile::tempdir().unwrap();
    killed_over_http(&sqlite_url(&dir), Kill::BeforeCharge).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_server_killed_after_its_charge_on_sqlite_is_verified_not_charged_again() {
    let dir = tempfile::tempdir().unwrap();
    killed_over_http(&sqlite_url(&dir), Kill::AfterCharge).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_server_killed_before_its_charge_on_redis_charges_once_on_the_retry() {
    let redis = RedisServer::start();
    killed_over_http(&redis.url(), Kill::BeforeCharge).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_server_killed_after_its_charge_on_redis_is_verified_not_charged_again() {
    let redis = RedisServer::start();
    killed_over_http(&redis.url(), Kill::AfterCharge).await;
}

/// The same over stdio: the client starts the server as its child process, as an MCP host does.
async fn killed_over_stdio(kill: Kill) {
    let dir = tempfile::tempdir().unwrap();
    let store_url = sqlite_url(&dir);
    let ledger = Ledger::at(dir.path().join("ledger"));
    let stdio_child = |stall: &str| {
        let mut command = Command::new(MCP_CHILD);
        command.args([&store_url, ledger.path().to_str().unwrap(), stall, "stdio", LEASE_MS]);
        TokioChildProcess::builder(command).stderr(Stdio::piped()).spawn().expect("start mcp_child over stdio")
    };
    let (transport, stderr) = stdio_child(kill.stall());
    let pid = transport.id().expect("the child's pid");
    let mut stderr = BufReader::new(stderr.expect("the child's stderr"));
    let client = ClientConfig::default().serve(transport).await.expect("initialize over stdio");
    let call = KeyedCall::new(refund("o-kill", 4200));
    let pending = tokio::spawn({
        let call = call.clone();
        async move { send_once(&client, &call).await }
    });
    wait_for(&mut stderr, kill.signal()).await;
    idempotent_tests::signal(pid as i32, "KILL");
    assert!(pending.await.unwrap().is_err(), "the killed server answered");

    let (transport, _stderr) = stdio_child("no");
    let client = ClientConfig::default().serve(transport).await.expect("initialize over stdio");
    let caller = ToolCaller::new(client.peer().clone()).timeout(Duration::from_secs(20));
    let result = caller.send(&call).await.expect("the retry gets a result");
    one_charge_and_recovered(&result, &ledger);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stdio_server_killed_before_its_charge_charges_once_on_the_retry() {
    killed_over_stdio(Kill::BeforeCharge).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stdio_server_killed_after_its_charge_is_verified_not_charged_again() {
    killed_over_stdio(Kill::AfterCharge).await;
}
