use idempotent_core::{Error, RunContext, idempotent};

#[idempotent(step = "move_to")]
async fn move_to(ctx: &RunContext, (x, y): (i32, i32)) -> Result<i32, Error> {
    Ok(x + y)
}

fn main() {}
