//! The headline demo: a refund workflow that is retried after a transient gateway error, and a
//! payment provider that is charged exactly once.
//!
//! ```text
//! cargo run -p idempotent-examples --bin refund_demo  # SQLite file (the embedded default)
//! REDIS_URL=redis://127.0.0.1:6379 cargo run -p idempotent-examples --bin refund_demo   # Redis
//! DATABASE_URL=postgres://postgres@127.0.0.1/postgres cargo run -p idempotent-examples --bin refund_demo  # PostgreSQL
//! ```
//!
//! The worker runs the workflow `refund order-1042`: step 1 asks the payment provider for a
//! refund, step 2 reports the result through an API gateway. The gateway answers 502 three times
//! *after* the provider already refunded, so the worker retries the whole workflow. Run once
//! without protection, then with `idempotent`, and compare what the provider did.

use std::sync::atomic::{AtomicU32, Ordering};

use idempotent_core::{Error, RunContext};
use serde::{Deserialize, Serialize};

/// A simulated payment provider: every call it receives is a real refund.
#[derive(Default)]
struct PaymentProvider {
    refunds: AtomicU32,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
struct Refund {
    id: String,
    order: String,
    amount_cents: u64,
}

impl PaymentProvider {
    async fn refund(&self, order: &str, amount_cents: u64) -> Refund {
        let n = self.refunds.fetch_add(1, Ordering::SeqCst) + 1;
        Refund { id: format!("re_{n:04}"), order: order.to_owned(), amount_cents }
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
                    Ok::<_, WorkflowError>(provider.refund(ORDER, AMOUNT).await)
                })
                .await?
        }
        None => {
            println!("    provider: refunding {ORDER} ({AMOUNT} cents)");
            provider.refund(ORDER, AMOUNT).await
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

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt().with_env_filter(std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into())).init();
    let (store, describe) = idempotent_examples::store_from_env().await?;

    println!("Refund workflow for {ORDER}; the gateway fails {RETRIES} times after the refund is issued.\n");

    println!("Without idempotent:");
    let naive = PaymentProvider::default();
    worker(None, &naive).await;
    let naive_refunds = naive.refunds.load(Ordering::SeqCst);
    println!("  => the provider refunded {naive_refunds} times. The customer got {naive_refunds}x the money.\n");

    println!("With idempotent ({describe}):");
    // The run id names this logical job; every retry of the job uses the same one. A fresh id per
    // demo run keeps runs against a shared database independent.
    let run_id = format!("refund-job-{ORDER}-{}", std::process::id());
    let ctx = RunContext::new(store, &run_id);
    let provider = PaymentProvider::default();
    let ids = worker(Some(&ctx), &provider).await;

    // A worker that restarts (a new process: a new connection to the same database) and runs
    // the job again gets the same refund too.
    drop(ctx);
    let (store, _) = idempotent_examples::store_from_env().await?;
    let restarted = RunContext::new(store, &run_id);
    let again: Refund = restarted
        .step("issue_refund")
        .run(&(ORDER, AMOUNT), |_| async { Ok::<_, Error>(provider.refund(ORDER, AMOUNT).await) })
        .await?;
    println!("  a restarted worker asks again: refund {} (replayed, provider not called)", again.id);

    let refunds = provider.refunds.load(Ordering::SeqCst);
    println!("  => the provider refunded {refunds} time(s); every attempt returned refund {}.", again.id);
    if refunds != 1 || ids.last() != Some(&again.id) {
        return Err(format!("expected exactly one refund, saw {refunds}").into());
    }
    Ok(())
}
