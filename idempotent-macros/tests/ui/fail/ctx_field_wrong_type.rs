use idempotent_core::{Error, idempotent};

struct Service {
    name: String,
}

impl Service {
    #[idempotent(step = "refund", ctx = self.name)]
    async fn refund(&self, order_id: &str) -> Result<String, Error> {
        Ok(order_id.to_owned())
    }
}

fn main() {}
