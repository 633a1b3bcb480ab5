//! The uncertain outcome, staged: a worker charges a customer and dies before its outcome is
//! stored. Shared by `tests/tests/uncertain.rs` and the worker `src/bin/effect_child.rs`.

use std::future::Future;
use std::time::Duration;

use idempotent_core::{Attempt, Error, RunContext, SharedStore, Verdict};
use tokio::io::AsyncBufReadExt;

use crate::ledger::Ledger;
pub use crate::matrix::Backend;

/// The run the staged charge belongs to.
pub const RUN: &str = "kill-run";
/// Its step.
pub const STEP: &str = "charge";
/// Its payload: an order and an amount in cents.
pub const PAYLOAD: (&str, u64) = ("order-7", 1500);

/// Runs the staged step on `store`: the action charges the ledger under the attempt's downstream
/// key, calls `charged` with that key and the fence, and then never ends (so that whoever runs
/// it can kill it there).
pub async fn charge_then_hang(store: SharedStore, ledger: Ledger, lease: Duration, charged: impl FnOnce(String, u64)) {
    let ctx = RunContext::new(store, RUN);
    let result: Result<String, Error> = ctx
        .step(STEP)
        .lease(lease)
        .run(&PAYLOAD, |attempt| async move {
            let key = attempt.downstream_key();
            ledger.charge(key.as_str(), PAYLOAD.1);
            charged(key.to_string(), attempt.fence());
            std::future::pending::<()>().await;
            unreachable!("pending never ends")
        })
        .await;
    panic!("the step was to hang until killed, but returned {result:?}");
}

/// Where the worker runs: another process on the store at a URL (killed with SIGKILL), or a
/// task on this process's store (aborted: for the in-memory store, which no other process can
/// reach).
pub enum Worker<'a> {
    /// `effect_child` (pass `env!("CARGO_BIN_EXE_effect_child")`) on the store at the URL.
    Process {
        /// The child's executable.
        exe: &'a str,
        /// The store's URL.
        url: &'a str,
    },
    /// A task on this store.
    Task(SharedStore),
}

/// Runs the staged step in `worker`, waits until it has charged, kills it there, and returns the
/// downstream key and fence it charged under.
pub async fn crash_after_charge(worker: Worker<'_>, ledger: &Ledger, lease: Duration) -> (String, u64) {
    let line = match worker {
        Worker::Process { exe, url } => {
            let mut child = tokio::process::Command::new(exe)
                .arg(url)
                .arg(ledger.path())
                .arg(lease.as_millis().to_string())
                .stdout(std::process::Stdio::piped())
                .kill_on_drop(true)
                .spawn()
                .unwrap_or_else(|e| panic!("{exe} did not start: {e}"));
            let mut lines = tokio::io::BufReader::new(child.stdout.take().expect("piped stdout")).lines();
            let line = lines.next_line().await.unwrap().expect("the child printed its charge");
            // SIGKILL: between the charge and the complete.
            child.start_kill().unwrap();
            let status = child.wait().await.unwrap();
            assert!(!status.success(), "the child was killed, yet exited with {status}");
            line
        }
        Worker::Task(store) => {
            let (tx, rx) = tokio::sync::oneshot::channel();
            let task = tokio::spawn(charge_then_hang(store, ledger.clone(), lease, move |key, fence| {
                let _ = tx.send(format!("charged {key} {fence}"));
            }));
            let line = rx.await.expect("the task charged");
            task.abort();
            assert!(task.await.unwrap_err().is_cancelled());
            line
        }
    };
    let mut parts = line.strip_prefix("charged ").unwrap_or_else(|| panic!("{line}")).split(' ');
    let key = parts.next().unwrap().to_owned();
    let fence = parts.next().unwrap().parse().unwrap();
    (key, fence)
}

/// What [`ledger_verifier`] returns: its answer, to come.
pub type Verifying = std::pin::Pin<Box<dyn Future<Output = Result<Verdict<String>, Error>> + Send>>;

/// A verifier that asks the ledger for a charge under the attempt's downstream key: found, the
/// charge's id is the outcome; not found, the action runs.
pub fn ledger_verifier(ledger: &Ledger) -> impl FnOnce(Attempt) -> Verifying + use<> {
    let ledger = ledger.clone();
    move |attempt: Attempt| {
        Box::pin(async move {
            Ok(match ledger.find(attempt.downstream_key().as_str()) {
                Some(charge) => Verdict::Done(charge.id),
                None => Verdict::NotDone,
            })
        })
    }
}

/// The uncertain outcome on a store of the [matrix](crate::matrix).
impl Backend {
    /// A ledger in the test's directory.
    pub fn ledger(&self) -> Ledger {
        Ledger::at(self.dir.path().join("ledger"))
    }

    /// The worker for this backend: the process `exe` (`effect_child`: pass
    /// `env!("CARGO_BIN_EXE_effect_child")`) on its URL, or a task on its store.
    pub fn worker<'a>(&'a self, exe: &'a str) -> Worker<'a> {
        match &self.url {
            Some(url) => Worker::Process { exe, url },
            None => Worker::Task(self.store.clone()),
        }
    }

    /// The staged run on the store.
    pub fn ctx(&self) -> RunContext {
        RunContext::new(self.store.clone(), RUN)
    }
}
