use idempotent_core::{RunContext, idempotent};
use rmcp::handler::server::tool::Extension;
use rmcp::{ErrorData, tool};

struct Server;

impl Server {
    // `#[tool]` turns the `async fn` into one returning a boxed future before `#[idempotent]`
    // sees it: `#[idempotent]` goes above `#[tool]`.
    #[tool(description = "Refunds an order.")]
    #[idempotent(step = "refund", ctx = ctx)]
    async fn refund(&self, Extension(ctx): Extension<RunContext>) -> Result<String, ErrorData> {
        Ok("re_1".into())
    }
}

fn main() {}
