//! The longest `ttl` (10 years) and `lease` (1 day) are accepted and reach the store.

use idempotent_core::{Error, MemoryStore, RunContext, idempotent};

#[idempotent(step = "longest", ttl = 315_360_000, lease = 86_400)]
async fn longest(ctx: &RunContext, n: u32) -> Result<u32, Error> {
    Ok(n)
}

fn main() {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let ctx = RunContext::new(MemoryStore::new(), "run-l");
        assert_eq!(longest(&ctx, 1).await.unwrap(), 1);
        assert_eq!(longest(&ctx, 1).await.unwrap(), 1);
    });
}
