use idempotent_core::{Error, RunContext, idempotent};

struct Service {
    ctx: RunContext,
}

impl Service {
    #[idempotent(step = "refund", ctx = &self.ctx)]
    async fn refund(&self, order_id: &str) -> Result<String, Error> {
        Ok(order_id.to_owned())
    }
}

fn main() {}
