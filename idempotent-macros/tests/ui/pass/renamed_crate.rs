//! `crate = "path"` for a renamed dependency.

use idempotent_core as idem;

#[idem::idempotent(step = "renamed", crate = "idem")]
async fn renamed(ctx: &idem::RunContext, n: u32) -> Result<u32, idem::Error> {
    Ok(n * 2)
}

fn main() {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let ctx = idem::RunContext::new(idem::MemoryStore::new(), "run-r");
    assert_eq!(rt.block_on(renamed(&ctx, 21)).unwrap(), 42);
}
