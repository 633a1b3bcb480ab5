use idempotent_core::{Error, RunContext, idempotent};

struct Parameters<T>(T);

// A destructured parameter is payload by the names it binds; this one binds none.
#[idempotent(step = "move_to")]
async fn move_to(ctx: &RunContext, Parameters(_): Parameters<(i32, i32)>) -> Result<i32, Error> {
    Ok(0)
}

fn main() {}
