//! The layer's configuration, shared by every clone of the service: what the builder on
//! [`IdempotencyLayer`](super::IdempotencyLayer) sets and the service, the identity and the
//! outcome read.

use std::sync::Arc;
use std::time::Duration;

use http::{HeaderName, Method};
use idempotent_core::{FailMode, OnRecovered, SharedStore, Terms};

use super::policy::StorePolicy;

/// The default key header, `Idempotency-Key`: the one the client layer and the retry policies use.
pub use crate::IDEMPOTENCY_KEY as DEFAULT_KEY_HEADER;
/// The default cap on a request body read for fingerprinting: 2 MiB (axum's default body limit).
pub const DEFAULT_MAX_REQUEST_BODY: usize = 2 * 1024 * 1024;
/// The default cap on a response body that is stored: 1 MiB.
pub const DEFAULT_MAX_STORED_RESPONSE: usize = 1024 * 1024;
/// The `Retry-After` sent with 503 when the store is unreachable.
pub const STORE_DOWN_RETRY_AFTER: Duration = Duration::from_secs(1);

type TenantFn = dyn Fn(&http::request::Parts) -> Option<String> + Send + Sync;
type ReplayFn = dyn Fn(&mut http::response::Parts) + Send + Sync;

/// Everything the service needs, shared by every clone of it.
#[derive(Clone)]
pub(crate) struct Config {
    pub(crate) store: SharedStore,
    pub(crate) header: HeaderName,
    pub(crate) methods: Vec<Method>,
    pub(crate) require_key: bool,
    pub(crate) tenant: Option<Arc<TenantFn>>,
    pub(crate) scope: String,
    pub(crate) max_request_body: usize,
    pub(crate) max_stored_response: usize,
    /// Lease, retention and what a duplicate in flight does; the heartbeat is always on.
    pub(crate) terms: Terms,
    pub(crate) fail_mode: FailMode,
    /// What a request whose previous attempt's outcome is uncertain does.
    pub(crate) on_recovered: OnRecovered,
    pub(crate) policy: Arc<dyn StorePolicy>,
    /// Run on every replayed response before it is sent.
    pub(crate) on_replay: Option<Arc<ReplayFn>>,
}
