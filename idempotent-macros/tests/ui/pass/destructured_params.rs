//! Destructured parameters: the names a pattern binds are the payload, by name, and can be
//! listed in `key(..)` and `skip(..)`; the context can be a name bound inside a pattern
//! (`ctx = run`); what a pattern leaves out (`..`, `_`) is not part of the payload.

use std::sync::atomic::{AtomicU32, Ordering};

use idempotent_core::{Error, MemoryStore, RunContext, idempotent};

static RUNS: AtomicU32 = AtomicU32::new(0);

/// An extractor, as web and MCP frameworks have them.
struct Extension<T>(T);

struct Wrapper<T>(T);

struct Point {
    x: i32,
    y: i32,
}

#[idempotent(step = "move_to")]
async fn move_to(ctx: &RunContext, (x, y): (i32, i32)) -> Result<i32, Error> {
    RUNS.fetch_add(1, Ordering::SeqCst);
    Ok(x + y)
}

#[idempotent(step = "place", ctx = run, key(x), skip(note))]
async fn place(
    Extension(run): Extension<RunContext>,
    Wrapper(Point { x, y: height }): Wrapper<Point>,
    &mut label: &mut u8,
    (note, _): (String, u64),
) -> Result<String, Error> {
    RUNS.fetch_add(1, Ordering::SeqCst);
    Ok(format!("{x}:{height}:{label}:{note}"))
}

#[idempotent(step = "shift")]
async fn shift(ctx: &RunContext, Point { x, .. }: Point) -> Result<i32, Error> {
    RUNS.fetch_add(1, Ordering::SeqCst);
    Ok(x)
}

fn main() {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let ctx = RunContext::new(MemoryStore::new(), "run-d");
        assert_eq!(move_to(&ctx, (1, 2)).await.unwrap(), 3);
        assert_eq!(move_to(&ctx, (1, 2)).await.unwrap(), 3);
        assert_eq!(RUNS.load(Ordering::SeqCst), 1);
        assert_eq!(move_to(&ctx, (2, 1)).await.unwrap(), 3);
        assert_eq!(RUNS.load(Ordering::SeqCst), 2, "`x` and `y` are both in the payload");

        let point = |y| Wrapper(Point { x: 1, y });
        let done = place(Extension(ctx.clone()), point(2), &mut 7, ("a".into(), 0)).await.unwrap();
        assert_eq!(done, "1:2:7:a");
        // `note` is skipped and the `_` is not bound: the same operation, replayed.
        let again = place(Extension(ctx.clone()), point(2), &mut 7, ("b".into(), 9)).await.unwrap();
        assert_eq!(again, done);
        assert_eq!(RUNS.load(Ordering::SeqCst), 3);
        // Keyed on `x`: another `height` under the same `x` is refused.
        let changed = place(Extension(ctx.clone()), point(5), &mut 7, ("a".into(), 0)).await;
        assert!(matches!(changed, Err(Error::Mismatch { .. })));

        assert_eq!(shift(&ctx, Point { x: 4, y: 0 }).await.unwrap(), 4);
        // `..` leaves `y` out of the payload (the body cannot see it): replayed.
        assert_eq!(shift(&ctx, Point { x: 4, y: 1 }).await.unwrap(), 4);
        assert_eq!(RUNS.load(Ordering::SeqCst), 4);
    });
}
