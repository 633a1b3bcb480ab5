//! [`ToolCaller`]: `tools/call` from an rmcp client, keyed once per logical call and retried
//! under that key.
//!
//! A client that retries a `tools/call` whose reply it did not get (a timeout, a dropped
//! connection, a proxy's 502) cannot tell whether the tool ran. Under one stable key in the
//! call's `_meta` ([`meta::KEY`]), a server protected by
//! [`IdempotentServer`](crate::IdempotentServer) runs the tool once and answers every retry with
//! the first call's result, so the retry is safe. `ToolCaller` makes the key (a random UUID) and
//! sends it with every attempt.
//!
//! # What is retried
//!
//! - a request that timed out ([`timeout`](ToolCaller::timeout), 30 s by default) or could not be
//!   sent or answered (`ServiceError::Timeout`, `ServiceError::TransportSend`);
//! - a JSON-RPC error whose `data` says `retryable: true` (another call with the key is running,
//!   the server's store is unreachable).
//!
//! Nothing else is: a tool's result (with `isError` or not), an error that a retry would meet
//! again (`retryable: false`, or no such field), a closed connection (the peer is gone; retry
//! the same [`KeyedCall`] on a new connection with [`ToolCaller::send`]).
//!
//! # How long it waits
//!
//! As the HTTP retry policies of `idempotent-tower` do: a full-jitter exponential
//! [`Backoff`] (100 ms doubling to 10 s, 4 attempts by default). When the server's error carries
//! `retryAfterMs`, it waits that long plus a small jitter ([`Backoff::hint_jitter`]), and gives up
//! when the server asks for more than [`max_retry_after`](ToolCaller::max_retry_after). A retry
//! budget (tower's [`TpsBudget`], shared by clones of the caller) keeps retries to a fraction of
//! recent calls, so a client facing an outage stops adding to it.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotent_core::Backoff;
use rmcp::model::{
    CallToolRequest, CallToolRequestParams, CallToolResult, ClientRequest, RequestMetaObject, ServerResult,
};
use rmcp::service::{PeerRequestOptions, RoleClient, ServiceError};
use rmcp::{ErrorData, Peer};
use serde_json::Value;
pub use tower::retry::budget::{Budget, TpsBudget};

use crate::meta::{self, KEY};

/// One logical tool call: its parameters and the key that every attempt at it sends.
///
/// Keep it (or its [`key`](Self::key)) to retry the call on another connection after the first
/// one closed: the server then answers with the first attempt's result.
#[derive(Debug, Clone)]
pub struct KeyedCall {
    params: CallToolRequestParams,
    key: String,
}

impl KeyedCall {
    /// The call `params`, under a new random key (a UUID v4).
    pub fn new(params: CallToolRequestParams) -> Self {
        KeyedCall { params, key: uuid::Uuid::new_v4().to_string() }
    }

    /// The call `params` under `key`, the same for every retry of one logical call: 1 to 255
    /// characters, none of them a control character (an error says which rule it breaks).
    pub fn with_key(params: CallToolRequestParams, key: impl Into<String>) -> Result<Self, ErrorData> {
        let key = key.into();
        match meta::check(&key) {
            Ok(()) => Ok(KeyedCall { params, key }),
            Err(why) => Err(ErrorData::invalid_params(format!("{why}; the call was not sent"), None)),
        }
    }

    /// The key.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The call's parameters (without the key).
    pub fn params(&self) -> &CallToolRequestParams {
        &self.params
    }

    /// The `_meta` of every attempt: the key.
    fn meta(&self) -> RequestMetaObject {
        let mut meta = RequestMetaObject::default();
        meta.insert(KEY.to_owned(), Value::String(self.key.clone()));
        meta
    }
}

/// Calls tools on one rmcp peer, each call under its own key, retrying as the [module
/// docs](self) say.
///
/// ```no_run
/// # async fn example(peer: rmcp::Peer<rmcp::RoleClient>) -> Result<(), rmcp::ServiceError> {
/// use rmcp::model::CallToolRequestParams;
/// use idempotent_mcp::client::ToolCaller;
///
/// let caller = ToolCaller::new(peer);
/// let args = serde_json::json!({ "order": "o-7", "cents": 1500 });
/// let params = CallToolRequestParams::new("refund").with_arguments(args.as_object().unwrap().clone());
/// let result = caller.call(params).await?; // retried under one key until it gets an answer
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct ToolCaller {
    peer: Peer<RoleClient>,
    backoff: Backoff,
    timeout: Duration,
    max_retry_after: Duration,
    budget: Arc<dyn Budget + Send + Sync>,
    rng: Arc<Mutex<fastrand::Rng>>,
}

impl std::fmt::Debug for ToolCaller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ToolCaller")
            .field("backoff", &self.backoff)
            .field("timeout", &self.timeout)
            .field("max_retry_after", &self.max_retry_after)
            .finish_non_exhaustive()
    }
}

impl ToolCaller {
    /// A caller on `peer`: [`Backoff::default`], a 30 s timeout per attempt, server waits up to
    /// 60 s honoured, [`TpsBudget::default`].
    pub fn new(peer: Peer<RoleClient>) -> Self {
        ToolCaller {
            peer,
            backoff: Backoff::default(),
            timeout: Duration::from_secs(30),
            max_retry_after: Duration::from_secs(60),
            budget: Arc::new(TpsBudget::default()),
            rng: Arc::new(Mutex::new(fastrand::Rng::new())),
        }
    }

    /// The backoff between attempts, and the number of attempts.
    pub fn backoff(mut self, backoff: Backoff) -> Self {
        self.backoff = backoff;
        self
    }

    /// How long one attempt waits for its answer before it counts as lost and is retried.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The longest wait asked for by the server (`retryAfterMs`) that is honoured; a longer one
    /// ends the retries with the server's error.
    pub fn max_retry_after(mut self, max: Duration) -> Self {
        self.max_retry_after = max;
        self
    }

    /// The retry budget shared by every clone of this caller.
    pub fn budget<B: Budget + Send + Sync + 'static>(mut self, budget: B) -> Self {
        self.budget = Arc::new(budget);
        self
    }

    /// Seeds the jitter, for tests that want the same delays every run.
    pub fn jitter_seed(mut self, seed: u64) -> Self {
        self.rng = Arc::new(Mutex::new(fastrand::Rng::with_seed(seed)));
        self
    }

    /// Calls the tool under a new key, retrying under it.
    pub async fn call(&self, params: CallToolRequestParams) -> Result<CallToolResult, ServiceError> {
        self.send(&KeyedCall::new(params)).await
    }

    /// Calls the tool under `call`'s key, retrying under it: the way to go on with a call after
    /// its connection closed, on a caller of a new connection.
    pub async fn send(&self, call: &KeyedCall) -> Result<CallToolResult, ServiceError> {
        self.budget.deposit();
        let mut retries = 0u32;
        loop {
            let error = match self.attempt(call).await {
                Ok(result) => return Ok(result),
                Err(error) => error,
            };
            let Some(hint) = retryable(&error) else {
                return Err(error);
            };
            let attempt = retries + 1;
            let short = short(call.key());
            if attempt >= self.backoff.attempts() {
                tracing::warn!(attempt, key = %short, %error, "idempotent.give_up: attempts exhausted");
                return Err(error);
            }
            if let Some(wait) = hint
                && wait > self.max_retry_after
            {
                tracing::warn!(attempt, key = %short, wait_ms = wait.as_millis() as u64, "idempotent.give_up: the server asked to wait longer than max_retry_after");
                return Err(error);
            }
            if !self.budget.withdraw() {
                tracing::warn!(attempt, key = %short, "idempotent.give_up: retry budget exhausted");
                return Err(error);
            }
            let delay = {
                let mut rng = self.rng.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
                match hint {
                    Some(wait) => wait.saturating_add(Backoff::hint_jitter(wait, rng.u64(..))),
                    None => self.backoff.delay(retries, rng.u64(..)),
                }
            };
            tracing::debug!(attempt = attempt + 1, key = %short, delay_ms = delay.as_millis() as u64, %error, "idempotent.retry");
            tokio::time::sleep(delay).await;
            retries += 1;
        }
    }

    /// One attempt: the request with the key in its `_meta`, answered within the timeout.
    async fn attempt(&self, call: &KeyedCall) -> Result<CallToolResult, ServiceError> {
        let request = ClientRequest::CallToolRequest(CallToolRequest::new(call.params.clone()));
        let mut options = PeerRequestOptions::no_options();
        options.timeout = Some(self.timeout);
        options.meta = Some(call.meta());
        let handle = self.peer.send_request_with_option(request, options).await?;
        match handle.await_response().await? {
            ServerResult::CallToolResult(result) => Ok(result),
            _ => Err(ServiceError::UnexpectedResponse),
        }
    }
}

/// `Some(wait the server asked for)` when the error may pass on a retry under the same key.
fn retryable(error: &ServiceError) -> Option<Option<Duration>> {
    match error {
        ServiceError::Timeout { .. } | ServiceError::TransportSend(_) => Some(None),
        ServiceError::McpError(ErrorData { data: Some(data), .. }) if data["retryable"] == Value::Bool(true) => {
            Some(data["retryAfterMs"].as_u64().map(Duration::from_millis))
        }
        _ => None,
    }
}

/// The key as logged: its first 12 characters at most (a UUID's are random, not secret).
fn short(key: &str) -> &str {
    key.char_indices().nth(12).map_or(key, |(at, _)| &key[..at])
}
