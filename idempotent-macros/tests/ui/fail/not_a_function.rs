use idempotent_core::idempotent;

#[idempotent(step = "refund")]
struct Refund;

fn main() {}
