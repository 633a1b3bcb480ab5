//! Tower layers that make HTTP and gRPC requests idempotent by their `Idempotency-Key`.
