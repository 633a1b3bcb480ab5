//! One `tools/call` through the wrapper: which key it runs under, then the lease lifecycle of
//! `idempotent_core::lease` (the one the executor and the HTTP layer drive), then what is stored.

use std::pin::pin;

use bytes::Bytes;
use idempotent_core::lease::{self, End, Taken};
use idempotent_core::record::{Abandon, Labels, Transition};
use idempotent_core::{Attempt, Error, FailMode, Fingerprint, Key, KeyScope, RunContext, ShortKey, StepOptions};
use rmcp::model::{CallToolRequestParams, CallToolResponse, CallToolResult, JsonObject, ListToolsResult};
use rmcp::service::RequestContext;
use rmcp::{ErrorData, RoleServer, ServerHandler};

use super::refusal::Refusal;
use super::{Config, Unprotected};
use crate::meta::{self, REPLAYED, STORED};

/// How the wrapper treats calls to one tool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Protection {
    /// Through untouched: read-only, or named unprotected.
    None,
    /// Under the key in `_meta`.
    Keyed,
    /// Under the key in `_meta`, or one derived from the call.
    Derived,
}

fn protection<S: ServerHandler>(inner: &S, config: &Config, tool: &str) -> Protection {
    if config.unprotected.contains(tool) {
        return Protection::None;
    }
    if config.derived.contains(tool) {
        return Protection::Derived;
    }
    let read_only = inner.get_tool(tool).and_then(|t| t.annotations).and_then(|a| a.read_only_hint);
    if read_only == Some(true) { Protection::None } else { Protection::Keyed }
}

/// `tools/list` as the handler answers it, with `idempotentHint: true` on every tool that is
/// protected for every call (its key derived, or keys required).
pub(super) fn advertise<S: ServerHandler>(inner: &S, config: &Config, mut list: ListToolsResult) -> ListToolsResult {
    for tool in &mut list.tools {
        let always = match protection(inner, config, &tool.name) {
            Protection::None => false,
            Protection::Keyed => config.require_key,
            Protection::Derived => true,
        };
        if always {
            tool.annotations.get_or_insert_with(Default::default).idempotent_hint = Some(true);
        }
    }
    list
}

/// One `tools/call`.
pub(super) async fn handle<S: ServerHandler>(
    inner: &S,
    config: &Config,
    call: CallToolRequestParams,
    mut context: RequestContext<RoleServer>,
) -> Result<CallToolResponse, ErrorData> {
    let tool = call.name.to_string();
    let protection = protection(inner, config, &tool);
    if protection == Protection::None {
        return forward(inner, call, context).await;
    }
    // rmcp moves a request's `_meta` into the context; a request made by hand may keep it in
    // its params.
    let sent = match meta::key(&context.meta) {
        Ok(None) => call.meta.as_ref().map_or(Ok(None), meta::key),
        found => found,
    };
    let client_key = match sent {
        Ok(key) => key.map(str::to_owned),
        Err(why) => return Err(Refusal::InvalidKey { tool, why }.into()),
    };
    let tenant = config.tenant.as_ref().and_then(|name| name(&context));
    let fingerprint = fingerprint(&tool, call.arguments.as_ref())?;
    let key = match client_key {
        Some(client_key) => Key::from_client_key(tenant.as_deref(), &config.scope, &client_key),
        None if protection == Protection::Derived => {
            let mut scope = KeyScope::new(config.scope.clone(), tool.clone());
            if let Some(tenant) = &tenant {
                scope = scope.tenant(tenant.clone());
            }
            Key::from_identity_hash(&scope, &fingerprint)
        }
        None if config.require_key => return Err(Refusal::MissingKey { tool }.into()),
        None => {
            context.extensions.insert(Unprotected::NoKey);
            return forward(inner, call, context).await;
        }
    };
    let short = key.short();
    let labels = Labels::step(&config.scope).tenant(tenant.as_deref());
    let taken = lease::acquire(&config.store, &key, &fingerprint, &config.terms, labels).await;
    let fail_open = config.fail_mode == FailMode::Open;
    lease::count_acquired(&config.scope, &*config.store, &taken, fail_open);
    let mut lease = match taken {
        Ok(Taken::Lease(lease)) if config.on_recovered.stops(lease.attempt()) => {
            let (attempt, fence) = (lease.attempt().number(), lease.attempt().fence());
            tracing::warn!(key = %short, tool, attempt, "idempotent.needs_attention: the previous call's outcome is uncertain and the server does not re-run it blindly");
            let _ = Box::pin(lease.end(End::Abandon(Abandon::NeedsAttention))).await;
            return Err(Refusal::NeedsAttention { tool, key, attempt, fence }.into());
        }
        Ok(Taken::Lease(lease)) => lease,
        Ok(Taken::Replay(bytes)) => return replay(&bytes, &short),
        Ok(Taken::Mismatch) => {
            tracing::info!(key = %short, tool, "idempotent.mismatch: the key was used with another call");
            return Err(Refusal::Mismatch { tool, key: short }.into());
        }
        Ok(Taken::InFlight { retry_after }) => return Err(Refusal::InFlight { tool, key: short, retry_after }.into()),
        Ok(Taken::NeedsAttention { attempt, fence }) => {
            return Err(Refusal::NeedsAttention { tool, key, attempt, fence }.into());
        }
        Ok(other) => {
            tracing::error!(key = %short, answer = ?other, "idempotent.store_error: unknown answer to acquire");
            let detail = format!("unknown answer to acquire: {other:?}");
            return Err(Refusal::Store(Error::Corrupt { key: short.to_string(), detail }).into());
        }
        Err(e) if e.is_store_failure() && fail_open => {
            tracing::warn!(key = %short, tool, error = %e, "idempotent.store_error: failing open, running the tool unprotected");
            let attempt = Attempt::unprotected(key);
            identify(&mut context, config, &key, tenant.as_deref(), attempt.clone());
            context.extensions.insert(Unprotected::StoreUnavailable);
            return attempt.scope(forward(inner, call, context)).await;
        }
        Err(e) => {
            tracing::warn!(key = %short, tool, error = %e, "idempotent.store_error: the call was refused");
            return Err(Refusal::Store(e).into());
        }
    };
    let attempt = lease.attempt().clone();
    identify(&mut context, config, &key, tenant.as_deref(), attempt.clone());
    // The attempt is in scope for the whole of the tool's future, so that what the tool does
    // derives from the call's key.
    let outcome = lease.run(pin!(attempt.scope(forward(inner, call, context)))).await;
    // Whether the result is one to store, and its bytes when it can be stored.
    let (meant, stored) = match &outcome {
        Ok(CallToolResponse::Complete(result)) if config.store_tool_errors || result.is_error != Some(true) => {
            (true, encode(result, config.max_result_bytes, &short, &tool))
        }
        _ => (false, None),
    };
    let wanted = stored.is_some();
    let answer = lease.end(stored.map_or(End::Release, End::Complete)).await;
    idempotent_core::metrics::ended(&config.scope, &*config.store, wanted, &answer);
    match outcome {
        Ok(CallToolResponse::Complete(mut result)) if meant && !(wanted && matches!(answer, Ok(Transition::Ok))) => {
            tracing::warn!(key = %short, tool, answer = ?answer, "idempotent.not_stored: the tool ran and its result was not stored; a retry may run it again");
            meta::mark(&mut result, STORED, false);
            Ok(CallToolResponse::Complete(result))
        }
        other => other,
    }
}

/// The stored form of a result (its JSON), unless it cannot be encoded or is larger than `max`.
fn encode(result: &CallToolResult, max: usize, short: &ShortKey, tool: &str) -> Option<Bytes> {
    match serde_json::to_vec(result) {
        Ok(bytes) if bytes.len() > max => {
            let len = bytes.len();
            tracing::warn!(key = %short, tool, len, max, "idempotent.not_stored: the result is larger than max_result_bytes; giving the key up");
            None
        }
        Ok(bytes) => Some(Bytes::from(bytes)),
        Err(error) => {
            tracing::error!(key = %short, tool, %error, "idempotent.not_stored: the result cannot be encoded; giving the key up");
            None
        }
    }
}

/// The handler's own answer to the call.
async fn forward<S: ServerHandler>(
    inner: &S,
    call: CallToolRequestParams,
    context: RequestContext<RoleServer>,
) -> Result<CallToolResponse, ErrorData> {
    inner.call_tool(call, context).await
}

/// Puts the call's identity in its context: the attempt and a run context keyed on the call,
/// whose steps take the server's lease, retention and fail mode.
fn identify(
    context: &mut RequestContext<RoleServer>,
    config: &Config,
    key: &Key,
    tenant: Option<&str>,
    attempt: Attempt,
) {
    let mut defaults = StepOptions::default();
    defaults.lease = config.terms.lease;
    defaults.retention = config.terms.retention;
    defaults.fail_mode = config.fail_mode;
    let ctx = RunContext::new(config.store.clone(), format!("{}/{}", config.scope, key.to_hex())).defaults(defaults);
    let ctx = match tenant {
        Some(tenant) => ctx.tenant(tenant),
        None => ctx,
    };
    context.extensions.insert(attempt);
    context.extensions.insert(ctx);
}

/// What makes two calls the same: the tool and its arguments (absent arguments are `{}`).
fn fingerprint(tool: &str, arguments: Option<&JsonObject>) -> Result<Fingerprint, ErrorData> {
    let empty = JsonObject::new();
    Fingerprint::of(&(tool, arguments.unwrap_or(&empty)))
        .map_err(|source| Refusal::Store(Error::Payload { step: format!("tools/call {tool}"), source }).into())
}

/// A stored result, as a retry gets it.
fn replay(bytes: &[u8], short: &ShortKey) -> Result<CallToolResponse, ErrorData> {
    match serde_json::from_slice::<CallToolResult>(bytes) {
        Ok(mut result) => {
            tracing::debug!(key = %short, "idempotent.replayed");
            meta::mark(&mut result, REPLAYED, true);
            Ok(CallToolResponse::Complete(result))
        }
        Err(error) => {
            tracing::error!(key = %short, %error, "idempotent.corrupt: the stored result cannot be decoded; it was not replayed");
            let detail = format!("not a stored tool result: {error}");
            Err(Refusal::Store(Error::Corrupt { key: short.to_string(), detail }).into())
        }
    }
}
