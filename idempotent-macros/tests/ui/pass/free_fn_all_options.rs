//! Every option on a free function; the body runs once and the replay returns its result.

use std::sync::atomic::{AtomicU32, Ordering};

use idempotent_core::{Error, MemoryStore, RunContext, idempotent};
use serde::{Deserialize, Serialize};

static RUNS: AtomicU32 = AtomicU32::new(0);

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Refund {
    id: String,
    amount_cents: u64,
}

#[derive(Debug, PartialEq, Serialize, Deserialize)]
enum RefundError {
    Declined,
    Idempotency(String),
}

impl From<Error> for RefundError {
    fn from(e: Error) -> Self {
        RefundError::Idempotency(e.to_string())
    }
}

struct Http;

/// Doc comments and other attributes stay on the function.
#[idempotent(
    step = "issue_refund",
    retention = 86_400,
    lease = 30,
    key(order_id),
    skip(http),
    version = 3,
    on_in_flight = "wait",
    store_errors,
    ctx = ctx,
    crate = "::idempotent_core",
)]
#[allow(clippy::too_many_arguments)]
pub async fn issue_refund(
    ctx: &RunContext,
    http: &Http,
    order_id: &str,
    mut amount_cents: u64,
) -> Result<Refund, RefundError> {
    #![allow(unused_mut)]
    let _ = http;
    RUNS.fetch_add(1, Ordering::SeqCst);
    amount_cents += 0;
    if amount_cents == 0 {
        return Err(RefundError::Declined);
    }
    let fence = idempotent_core::current_attempt().expect("inside the step").fence();
    assert!(fence > 0);
    Ok(Refund { id: format!("re_{order_id}"), amount_cents })
}

#[idempotent(step = "owned")]
async fn owned_context(ctx: RunContext, r#type: String) -> Result<String, Error> {
    // The body may use the context (and its parameters) by value.
    let run = ctx.run_id().to_owned();
    Ok(format!("{run}:{type}", type = r#type))
}

fn main() {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let ctx = RunContext::new(MemoryStore::new(), "run-1");
        let first = issue_refund(&ctx, &Http, "o-1", 1500).await.unwrap();
        let again = issue_refund(&ctx, &Http, "o-1", 1500).await.unwrap();
        assert_eq!(first, again);
        assert_eq!(RUNS.load(Ordering::SeqCst), 1);
        assert_eq!(owned_context(ctx.clone(), "a".into()).await.unwrap(), "run-1:a");
    });
}
