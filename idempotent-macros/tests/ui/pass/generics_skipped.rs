//! Generic and `impl Trait` parameters are fine once skipped; lifetimes and result aliases work.

use std::fmt::Display;

use idempotent_core::{Error, MemoryStore, RunContext, idempotent};

type ToolResult<T> = Result<T, Error>;

#[idempotent(step = "notify", skip(sink, label))]
async fn notify<'a, S, const N: usize>(
    ctx: &'a RunContext,
    sink: S,
    label: impl Display,
    to: &'a str,
    codes: [u8; 2],
) -> ToolResult<String>
where
    S: FnOnce(&str) -> usize,
{
    Ok(format!("{label}:{to}:{}:{}:{N}", sink(to), codes.len()))
}

fn main() {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let ctx = RunContext::new(MemoryStore::new(), "run-g");
        let out = notify::<_, 7>(&ctx, |s: &str| s.len(), "hi", "ada", [1, 2]).await.unwrap();
        assert_eq!(out, "hi:ada:3:2:7");
        // `label` is skipped: a different label replays the first result.
        let replay = notify::<_, 7>(&ctx, |_: &str| 0, 42, "ada", [1, 2]).await.unwrap();
        assert_eq!(replay, out);
    });
}
