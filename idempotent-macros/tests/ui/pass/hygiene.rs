//! Parameters named like the expansion's own locals are the user's: the expansion's locals are
//! mixed-site hygienic, so they neither shadow the parameters nor are visible to the body.

use idempotent_core::{Error, MemoryStore, RunContext, idempotent};

#[idempotent(step = "hygiene", key(__idempotent_payload))]
async fn shadowed(
    __idempotent_ctx: &RunContext,
    __idempotent_payload: u32,
    __idempotent_step: String,
    __idempotent_identity: u8,
) -> Result<String, Error> {
    Ok(format!("{__idempotent_payload} {__idempotent_step} {__idempotent_identity}"))
}

#[idempotent(step = "fake_return")]
async fn fake_return(ctx: &RunContext, __idempotent_fake_return: u64, __idempotent_id: u64) -> Result<u64, Error> {
    Ok(__idempotent_fake_return + __idempotent_id)
}

#[idempotent(step = "ctx_named", ctx = __idempotent_step)]
async fn ctx_named(__idempotent_step: &RunContext, n: u32) -> Result<u32, Error> {
    Ok(n)
}

fn main() {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let ctx = RunContext::new(MemoryStore::new(), "run-h");
        // The payload is the user's `__idempotent_payload`, not the expansion's builder.
        assert_eq!(shadowed(&ctx, 1, "a".into(), 2).await.unwrap(), "1 a 2");
        assert_eq!(shadowed(&ctx, 2, "b".into(), 3).await.unwrap(), "2 b 3");
        // key(__idempotent_payload): the same key with other arguments is a mismatch.
        assert!(matches!(shadowed(&ctx, 1, "c".into(), 2).await, Err(Error::Mismatch { .. })));
        assert_eq!(shadowed(&ctx, 1, "a".into(), 2).await.unwrap(), "1 a 2");
        assert_eq!(fake_return(&ctx, 40, 2).await.unwrap(), 42);
        assert_eq!(ctx_named(&ctx, 7).await.unwrap(), 7);
    });
}
