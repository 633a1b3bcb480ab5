//! The headline demo: a refund workflow that is retried after a transient gateway error, and a
//! payment provider that is charged exactly once.
//!
//! ```text
//! cargo run -p idempotent-examples --bin refund_demo  # SQLite file (the embedded default); run it twice
//! REDIS_URL=redis://127.0.0.1:6379 cargo run -p idempotent-examples --bin refund_demo   # Redis
//! DATABASE_URL=postgres://postgres@127.0.0.1/postgres cargo run -p idempotent-examples --bin refund_demo  # PostgreSQL
//! RUN_ID=refund-job-7 cargo run -p idempotent-examples --bin refund_demo   # a run id of your own
//! ```
//!
//! The worker runs the workflow `refund order-1042`: step 1 asks the payment provider for a
//! refund, step 2 reports the result through an API gateway. The gateway answers 502 three times
//! *after* the provider already refunded, so the worker retries the whole workflow. Run once
//! without protection, then with `idempotent`, and compare what the provider did.
//!
//! Then the hardest case: a worker (a process of its own) is killed after the provider refunded
//! and before the outcome was stored. The refund went out under the step's downstream key
//! (`Attempt::downstream_key`, sent as the provider's `Idempotency-Key`); the next worker's
//! attempt is `recovered`, so the step's verifier asks the provider for a refund under that key,
//! finds it, and stores it as the outcome instead of refunding again.
//!
//! The run id names the job: `RUN_ID`, else `refund-job-order-1042` on a SQLite file (the
//! default), so that a second run finds the first run's outcomes in the file and replays them
//! (the provider is not called again), else (Redis, PostgreSQL: possibly shared servers) a new
//! id per run. The provider's ledgers of the protected parts are files in the temporary
//! directory, one per store and run id, kept across runs like the records.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use idempotent_core::store::RecordState;
use idempotent_core::{Attempt, Error, RunContext, SharedStore, Verdict};
use serde::{Deserialize, Serialize};

/// A simulated payment provider: every refund it makes is a line in its ledger file, so that
/// several processes see one provider. Like Stripe, it deduplicates by the request's
/// `Idempotency-Key`: a second refund under a key it has seen returns the first refund and
/// moves no money.
struct PaymentProvider {
    ledger: PathBuf,
    /// Refund requests this process sent to the provider.
    calls: AtomicU32,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
struct Refund {
    id: String,
    order: String,
    amount_cents: u64,
}

/// One line of the provider's ledger.
#[derive(Serialize, Deserialize)]
struct Entry {
    idempotency_key: Option<String>,
    refund: Refund,
}

impl PaymentProvider {
    /// A provider with an empty ledger at `ledger`.
    fn new(ledger: PathBuf) -> PaymentProvider {
        let _ = std::fs::remove_file(&ledger);
        PaymentProvider::open(ledger)
    }

    /// A provider with the ledger at `ledger`, as earlier runs left it.
    fn open(ledger: PathBuf) -> PaymentProvider {
        PaymentProvider { ledger, calls: AtomicU32::new(0) }
    }

    /// Refund requests this process sent.
    fn calls(&self) -> u32 {
        self.calls.load(Ordering::SeqCst)
    }

    fn entries(&self) -> Vec<Entry> {
        let text = std::fs::read_to_string(&self.ledger).unwrap_or_default();
        text.lines().filter_map(|line| serde_json::from_str(line).ok()).collect()
    }

    /// Refunds `amount_cents` on `order`, once per `idempotency_key` (every call without one is a
    /// new refund).
    async fn refund(&self, idempotency_key: Option<&str>, order: &str, amount_cents: u64) -> Refund {
        self.calls.fetch_add(1, Ordering::SeqCst);
        if let Some(found) = idempotency_key.and_then(|key| self.find(key)) {
            return found;
        }
        let refund = Refund { id: format!("re_{:04}", self.refunds() + 1), order: order.to_owned(), amount_cents };
        let entry = Entry { idempotency_key: idempotency_key.map(str::to_owned), refund: refund.clone() };
        let mut file =
            std::fs::OpenOptions::new().create(true).append(true).open(&self.ledger).expect("open the ledger");
        writeln!(file, "{}", serde_json::to_string(&entry).expect("encode")).expect("write the ledger");
        file.sync_data().expect("flush the ledger");
        refund
    }

    /// The refund made under `idempotency_key`, if any (Stripe: list by idempotency key, or
    /// replay the request).
    fn find(&self, idempotency_key: &str) -> Option<Refund> {
        self.entries().into_iter().find(|e| e.idempotency_key.as_deref() == Some(idempotency_key)).map(|e| e.refund)
    }

    /// How many refunds the provider made: how much money went out.
    fn refunds(&self) -> usize {
        self.entries().len()
    }
}

/// An API gateway that fails the first `failures` calls with a 502.
struct Gateway {
    failures: AtomicU32,
}

impl Gateway {
    async fn report(&self, refund: &Refund) -> Result<(), String> {
        if self.failures.load(Ordering::SeqCst) > 0 {
            self.failures.fetch_sub(1, Ordering::SeqCst);
            return Err(format!("502 Bad Gateway while reporting {}", refund.id));
        }
        Ok(())
    }
}

#[derive(Debug)]
enum WorkflowError {
    Transient(String),
    Store(Error),
}

impl From<Error> for WorkflowError {
    fn from(e: Error) -> Self {
        WorkflowError::Store(e)
    }
}

const ORDER: &str = "order-1042";
const AMOUNT: u64 = 12_900;
const RETRIES: u32 = 3;

/// One run of the workflow. `ctx` is `None` for the unprotected run.
async fn workflow(
    ctx: Option<&RunContext>,
    provider: &PaymentProvider,
    gateway: &Gateway,
) -> Result<Refund, WorkflowError> {
    let refund = match ctx {
        Some(ctx) => {
            ctx.step("issue_refund")
                .run(&(ORDER, AMOUNT), |attempt| async move {
                    println!("    provider: refunding {ORDER} ({AMOUNT} cents), fence {}", attempt.fence());
                    let key = attempt.downstream_key();
                    Ok::<_, WorkflowError>(provider.refund(Some(key.as_str()), ORDER, AMOUNT).await)
                })
                .await?
        }
        None => {
            println!("    provider: refunding {ORDER} ({AMOUNT} cents)");
            provider.refund(None, ORDER, AMOUNT).await
        }
    };
    gateway.report(&refund).await.map_err(WorkflowError::Transient)?;
    Ok(refund)
}

/// Runs the workflow with up to `RETRIES` retries, as a job worker would.
async fn worker(ctx: Option<&RunContext>, provider: &PaymentProvider) -> Vec<String> {
    let gateway = Gateway { failures: AtomicU32::new(RETRIES) };
    let mut seen = Vec::new();
    for attempt in 1..=RETRIES + 1 {
        match workflow(ctx, provider, &gateway).await {
            Ok(refund) => {
                println!("  attempt {attempt}: ok, refund {} for {}", refund.id, refund.order);
                seen.push(refund.id);
                break;
            }
            Err(WorkflowError::Transient(e)) => {
                println!("  attempt {attempt}: {e} -> retrying");
            }
            Err(WorkflowError::Store(e)) => {
                println!("  attempt {attempt}: store error: {e}");
                break;
            }
        }
    }
    seen
}

/// The step a crashing worker runs: refund under the attempt's downstream key, say so, then
/// hang (the demo kills it there, before the outcome is stored).
async fn refund_then_hang(run_id: &str, ledger: PathBuf) -> Result<(), Box<dyn std::error::Error>> {
    let (store, _) = idempotent_examples::store_from_env().await?;
    let ctx = RunContext::new(store, run_id);
    let provider = PaymentProvider::open(ledger);
    let _: Refund = ctx
        .step("issue_refund")
        .lease(CRASH_LEASE)
        .run(&(ORDER, AMOUNT), |attempt| async move {
            let key = attempt.downstream_key();
            let refund = provider.refund(Some(key.as_str()), ORDER, AMOUNT).await;
            println!("{} {key}", refund.id);
            std::io::stdout().flush()?;
            std::future::pending::<()>().await;
            Ok::<_, Box<dyn std::error::Error>>(refund)
        })
        .await?;
    Ok(())
}

/// How long the crashing worker's lease is: the retry waits it out.
const CRASH_LEASE: Duration = Duration::from_secs(1);

/// Part 3: a worker (another process) is killed after the provider refunded and before the
/// outcome was stored; the next worker verifies with the provider instead of refunding again.
/// Returns the refunds in the provider's ledger and whether this process only replayed.
async fn killed_worker(
    store: SharedStore,
    run_id: &str,
    ledger: &Path,
) -> Result<(usize, bool), Box<dyn std::error::Error>> {
    let provider = PaymentProvider::open(ledger.to_owned());
    let ctx = RunContext::new(store, run_id);
    match ctx.step("issue_refund").inspect(&(ORDER, AMOUNT)).await? {
        None => {
            let mut child = std::process::Command::new(std::env::current_exe()?)
                .args(["--refund-then-hang", run_id])
                .arg(ledger)
                .stdout(std::process::Stdio::piped())
                .spawn()?;
            let mut line = String::new();
            std::io::BufRead::read_line(&mut std::io::BufReader::new(child.stdout.take().expect("piped")), &mut line)?;
            let (refund_id, key) = line.trim().split_once(' ').ok_or_else(|| format!("the worker said {line:?}"))?;
            child.kill()?; // SIGKILL: after the refund, before the outcome is stored
            child.wait()?;
            println!(
                "  worker 1 (pid {}): provider refunded {refund_id} under Idempotency-Key {}…; killed before storing it",
                child.id(),
                &key[..12]
            );
        }
        Some(earlier) if earlier.state == RecordState::Done => {
            println!(
                "  an earlier run of {run_id} finished this job (attempt {}): its outcome is stored",
                earlier.attempt
            );
        }
        Some(earlier) => {
            println!(
                "  an earlier run of {run_id} left the job {:?} at attempt {} (a worker died): worker 2 takes over",
                earlier.state, earlier.attempt
            );
        }
    }

    let provider = &provider;
    let verified = AtomicU32::new(0);
    let verified = &verified;
    let refund: Refund = ctx
        .step("issue_refund")
        // Asked instead of refunding when the previous attempt's outcome is unknown.
        .verify(|attempt: Attempt| async move {
            verified.fetch_add(1, Ordering::SeqCst);
            let key = attempt.downstream_key();
            let found = provider.find(key.as_str());
            println!(
                "  worker 2: attempt {} is recovered (worker 1 died holding the key); asked the provider for {}…: {}",
                attempt.number(),
                &key.as_str()[..12],
                found.as_ref().map_or("nothing".to_owned(), |r| format!("found {}", r.id))
            );
            Ok::<_, Error>(found.map_or(Verdict::NotDone, Verdict::Done))
        })
        .run(&(ORDER, AMOUNT), |attempt| async move {
            let key = attempt.downstream_key();
            Ok::<_, Error>(provider.refund(Some(key.as_str()), ORDER, AMOUNT).await)
        })
        .await?;
    let refunds = provider.refunds();
    let replayed = provider.calls() == 0 && verified.load(Ordering::SeqCst) == 0;
    if replayed {
        println!("  worker 2: replayed {} from the store; neither the provider nor the verifier was asked", refund.id);
        if refunds == 0 {
            println!(
                "  => replayed: no refund in this run (the provider's ledger {} was deleted since the earlier run).",
                ledger.display()
            );
        } else {
            println!("  => replayed: the provider refunded {refunds} time(s) in all, none in this run.");
        }
    } else {
        println!("  worker 2: stored {} as the outcome without refunding again", refund.id);
        println!("  => the provider refunded {refunds} time(s).");
    }
    Ok((refunds, replayed))
}

/// The provider's ledgers of the protected parts, kept across runs like the records.
fn ledger_dir() -> PathBuf {
    std::env::temp_dir().join("idempotent-refund-demo")
}

/// The ledger of `run_id` on `store`: one per store (its kind and a hash of where it is) and run
/// id, so that the same run id on another database starts from an empty ledger too.
fn ledger_of(store: &SharedStore, run_id: &str) -> PathBuf {
    // FNV-1a: stable across runs and builds.
    let hash = store
        .describe()
        .bytes()
        .fold(0xcbf2_9ce4_8422_2325_u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
    let run: String = run_id.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' { c } else { '_' }).collect();
    ledger_dir().join(format!("{}-{hash:016x}-{run}.jsonl", store.kind()))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    if let [_, flag, run_id, ledger] = &args[..]
        && flag == "--refund-then-hang"
    {
        // The parent reads this worker's first line of stdout: its logs go to stderr.
        idempotent_examples::logs()
            .with_writer(std::io::stderr)
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .init();
        return refund_then_hang(run_id, PathBuf::from(ledger)).await;
    }
    idempotent_examples::logs().init();
    let (store, describe) = idempotent_examples::store_from_env().await?;
    // The run id names this logical job; every retry of the job, and every later run of the
    // program on the same SQLite file, uses the same one. On a server (Redis, PostgreSQL), which
    // others may share, each run is a job of its own unless RUN_ID names one.
    let (run_id, fresh) = match std::env::var("RUN_ID").ok().filter(|id| !id.is_empty()) {
        Some(id) => (id, false),
        None if store.kind() == "sqlite" => (format!("refund-job-{ORDER}"), false),
        None => (idempotent_examples::fresh_id(&format!("refund-job-{ORDER}")), true),
    };
    println!("Records in {describe}; run {run_id}");
    let scratch = ledger_dir().join(format!("naive-{}", std::process::id()));
    std::fs::create_dir_all(&scratch)?;

    println!("Refund workflow for {ORDER}; the gateway fails {RETRIES} times after the refund is issued.\n");

    println!("Without idempotent:");
    let naive = PaymentProvider::new(scratch.join("naive.jsonl"));
    worker(None, &naive).await;
    let naive_refunds = naive.refunds();
    println!("  => the provider refunded {naive_refunds} times. The customer got {naive_refunds}x the money.\n");
    std::fs::remove_dir_all(&scratch)?;

    println!("With idempotent:");
    let ctx = RunContext::new(store.clone(), &run_id);
    let ledger = ledger_of(&store, &run_id);
    let provider = PaymentProvider::open(ledger.clone());
    let ids = worker(Some(&ctx), &provider).await;

    // A worker that restarts (a new process: a new connection to the same database) and runs
    // the job again gets the same refund too.
    drop(ctx);
    let (restarted_store, _) = idempotent_examples::store_from_env().await?;
    let restarted = RunContext::new(restarted_store, &run_id);
    let again: Refund = restarted
        .step("issue_refund")
        .run(&(ORDER, AMOUNT), |_| async { Ok::<_, Error>(provider.refund(None, ORDER, AMOUNT).await) })
        .await?;
    println!("  a restarted worker asks again: refund {} (replayed, provider not called)", again.id);

    let refunds = provider.refunds();
    let replayed = provider.calls() == 0;
    match (replayed, refunds) {
        (true, 0) => println!(
            "  => replayed: an earlier run of {run_id} refunded {}; the provider was not called in this run \
             (its ledger {} was deleted since; the records were not).",
            again.id,
            ledger.display()
        ),
        (true, _) => println!(
            "  => replayed: an earlier run of {run_id} refunded; the provider was not called in this run and refunded {refunds} time(s) in all; every attempt returned refund {}.",
            again.id
        ),
        (false, _) => {
            println!("  => the provider refunded {refunds} time(s); every attempt returned refund {}.", again.id)
        }
    }
    // A replay calls the provider no time; an execution leaves one refund in its ledger.
    if (if replayed { refunds > 1 } else { refunds != 1 }) || ids.last() != Some(&again.id) {
        return Err(format!("expected exactly one refund, saw {refunds}").into());
    }

    println!("\nA worker killed after the provider refunded, before the outcome was stored:");
    let crash_run = format!("{run_id}-crash");
    let crash_ledger = ledger_of(&store, &crash_run);
    let (refunds, replayed) = killed_worker(store, &crash_run, &crash_ledger).await?;
    if fresh {
        // A run id no later run uses: its ledgers would only pile up.
        let _ = std::fs::remove_file(&ledger);
        let _ = std::fs::remove_file(&crash_ledger);
    }
    if if replayed { refunds > 1 } else { refunds != 1 } {
        return Err(format!("expected exactly one refund after the crash, saw {refunds}").into());
    }
    Ok(())
}
