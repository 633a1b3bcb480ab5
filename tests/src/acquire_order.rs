//! How the order a store's acquire learns (a write first, or a read first after a run of
//! replays) shows in the statements a caller's steps cost, for the stores that count them.

use idempotent_core::{Error, RunContext};

/// With `ctx`'s store trained on replays (read first), the next first executions of step
/// `step` cost `read_first` statements (the read, then the write and the complete); 16 first
/// executions in a row switch it back (from any state), after which one costs `write_first`.
/// `statements` reads the store's count.
pub async fn first_executions_switch_back_to_the_write(
    ctx: &RunContext,
    step: &'static str,
    statements: impl Fn() -> u64,
    (read_first, write_first): (u64, u64),
) {
    let before = statements();
    let n: u32 = ctx.step(step).run(&2, |_| async { Ok::<_, Error>(10) }).await.unwrap();
    assert_eq!((n, statements() - before), (10, read_first), "read first: the read, the write, the complete");
    for i in 3..19u32 {
        ctx.step(step).run(&i, |_| async move { Ok::<_, Error>(i) }).await.unwrap();
    }
    let before = statements();
    ctx.step(step).run(&100, |_| async { Ok::<_, Error>(100) }).await.unwrap();
    assert_eq!(statements() - before, write_first, "write first again after first executions in a row");
}
