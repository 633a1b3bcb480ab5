//! What the transactional-step tests share whatever the database (`tests/tests/transaction.rs`
//! on SQLite, `tests/tests/transaction_postgres.rs` on PostgreSQL): the action's error types
//! and the child process killed inside its transaction (`src/bin/txn_child.rs`).

use idempotent_core::Error;
use tokio::io::AsyncBufReadExt;

/// A database error of the test's own statements, as the action's error.
pub fn db(e: sqlx::Error) -> Error {
    Error::Config(format!("test database: {e}"))
}

/// An action's own error type, with the idempotency errors wrapped (as an application's would).
#[derive(Debug)]
pub enum InvoiceError {
    /// The business failure the action returns.
    Declined,
    /// A failure of the step itself.
    Idempotency(#[allow(dead_code, reason = "shown by Debug when a test fails")] Error),
}

impl From<Error> for InvoiceError {
    fn from(e: Error) -> Self {
        InvoiceError::Idempotency(e)
    }
}

/// Runs `txn_child <url> <lease_ms>` (pass `env!("CARGO_BIN_EXE_txn_child")` as `exe`), waits
/// until it has inserted its invoice inside the step's transaction, SIGKILLs it there (before
/// the commit), and returns the fence it inserted under.
pub async fn kill_child_before_commit(exe: &str, url: &str, lease_ms: u64) -> u64 {
    let mut child = tokio::process::Command::new(exe)
        .arg(url)
        .arg(lease_ms.to_string())
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("{exe} did not start: {e}"));
    let mut lines = tokio::io::BufReader::new(child.stdout.take().expect("piped stdout")).lines();
    let line = lines.next_line().await.unwrap().expect("the child printed its insert");
    let fence: u64 = line.strip_prefix("inserted ").expect(&line).parse().unwrap();
    // SIGKILL: between the business insert and the commit.
    child.start_kill().unwrap();
    let status = child.wait().await.unwrap();
    assert!(!status.success(), "the child was killed, yet exited with {status}");
    fence
}
