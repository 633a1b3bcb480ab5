//! The attribute inside `macro_rules!` (parameter names from the macro body and from its caller)
//! and on an `async fn` of a trait impl.

use idempotent_core::{Error, MemoryStore, RunContext, idempotent};

macro_rules! tool {
    ($name:ident, $step:literal, $ttl:expr, $arg:ident, $ret:ty) => {
        #[idempotent(step = $step, ttl = $ttl, key($arg))]
        async fn $name(ctx: &RunContext, $arg: &str, amount: u64) -> $ret {
            Ok(format!("{}:{amount}", $arg))
        }
    };
}

tool!(refund, "refund", 3600, order_id, Result<String, Error>);

trait Tool {
    async fn call(&self, ctx: &RunContext, input: String) -> Result<usize, Error>;
}

struct Length;

impl Tool for Length {
    #[idempotent(step = "length")]
    async fn call(&self, ctx: &RunContext, input: String) -> Result<usize, Error> {
        Ok(input.len())
    }
}

fn main() {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let ctx = RunContext::new(MemoryStore::new(), "run-t");
        assert_eq!(refund(&ctx, "o-1", 5).await.unwrap(), "o-1:5");
        assert!(matches!(refund(&ctx, "o-1", 6).await, Err(Error::Mismatch { .. })));
        assert_eq!(Length.call(&ctx, "four".into()).await.unwrap(), 4);
    });
}
