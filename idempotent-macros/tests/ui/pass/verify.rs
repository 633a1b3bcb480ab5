//! `verify = path` and `on_recovered`: the verifier runs instead of the body only for a
//! recovered attempt, so a fresh call runs the body and replays it.

use idempotent_core::{Attempt, Error, MemoryStore, RunContext, Verdict, idempotent};

async fn find_charge(attempt: Attempt) -> Result<Verdict<String>, Error> {
    Ok(Verdict::Done(format!("found {}", attempt.downstream_key())))
}

#[idempotent(step = "charge", verify = crate::find_charge, lease = 30)]
async fn charge(ctx: &RunContext, order_id: &str, amount: u64) -> Result<String, Error> {
    Ok(format!("ch_{order_id}_{amount}"))
}

#[idempotent(step = "refund", on_recovered = "needs_attention")]
async fn refund(ctx: &RunContext, order_id: &str) -> Result<String, Error> {
    Ok(format!("re_{order_id}"))
}

#[idempotent(step = "notify", on_recovered = "run")]
async fn notify(ctx: &RunContext, order_id: &str) -> Result<String, Error> {
    Ok(format!("sent_{order_id}"))
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let ctx = RunContext::new(MemoryStore::new(), "run");
    assert_eq!(charge(&ctx, "o-1", 5).await.unwrap(), "ch_o-1_5");
    assert_eq!(charge(&ctx, "o-1", 5).await.unwrap(), "ch_o-1_5");
    assert_eq!(refund(&ctx, "o-1").await.unwrap(), "re_o-1");
    assert_eq!(notify(&ctx, "o-1").await.unwrap(), "sent_o-1");
}
