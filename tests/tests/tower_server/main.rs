//! The server `IdempotencyLayer` behind real axum servers on loopback, over HTTP/1.1 (hyper client
//! and raw sockets) and HTTP/2 (h2c), on every store.
//!
//! Every scenario is an `async fn(SharedStore)`; the `on_every_store!` at the top of its module runs
//! it once per store as `<module>::memory::<name>`, `<module>::sqlite::<name>`,
//! `<module>::postgres::<name>` and `<module>::redis::<name>`.
//!
//! - `app`: the application under test (handlers, server, clients, replies), shared by the others.
//! - `replay`: replays (raw bytes, trailers, the replay hook), which outcomes are stored, corrupt records.
//! - `keys`: the idempotency key: missing, malformed, reused, per tenant, configured, downstream.
//! - `in_flight`: duplicates of a request still running, refused (409) or waiting for its response.
//! - `bodies`: request and response bodies over the caps or failing mid-stream.
//! - `leases`: the heartbeat, renewals that fail or hang, lease and retention out of range.
//! - `dropped_requests`: requests dropped mid-way still store their response or free their key.
//! - `needs_attention`: recovered requests and keys that need attention, stopped for an operator.
//! - `store_failures`: an unreachable store, failing closed and failing open (Redis only).

mod app;
mod bodies;
mod dropped_requests;
mod in_flight;
mod keys;
mod leases;
mod needs_attention;
mod replay;
mod store_failures;
