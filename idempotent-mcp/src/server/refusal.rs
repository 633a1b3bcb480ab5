//! The JSON-RPC errors a protected `tools/call` is answered with when the tool is not run.
//!
//! Each is rmcp's [`ErrorData`] with the `data` fields of `idempotent_core`'s conversion from
//! [`Error`] (`kind`, `retryable`, `actionMayHaveRun`, `retryAfterMs`), so that a client tells
//! them apart without reading the message, and the message says what happened and what to do.

use std::time::Duration;

use idempotent_core::{DownstreamKey, Error, Key, ShortKey};
use rmcp::ErrorData;
use rmcp::model::ErrorCode;
use serde_json::{Value, json};

use crate::meta::{BadKey, KEY};

/// Why a protected call was answered without running its tool.
#[derive(Debug)]
pub(crate) enum Refusal {
    /// No key in `_meta`, and the server requires one.
    MissingKey { tool: String },
    /// The key in `_meta` cannot be used.
    InvalidKey { tool: String, why: BadKey },
    /// The key was first used with another tool or other arguments.
    Mismatch { tool: String, key: ShortKey },
    /// Another call with the key is running.
    InFlight { tool: String, key: ShortKey, retry_after: Duration },
    /// A previous attempt's outcome is uncertain; nothing runs until the record is resolved.
    NeedsAttention { tool: String, key: Key, attempt: u32, fence: u64 },
    /// The store failed (fail closed), holds a record this crate cannot read, or the terms are
    /// out of bounds.
    Store(Error),
}

impl From<Refusal> for ErrorData {
    fn from(refusal: Refusal) -> ErrorData {
        match refusal {
            Refusal::MissingKey { tool } => invalid(
                "missingKey",
                format!(
                    "tools/call `{tool}`: this server runs a tool with side effects only under an \
                     idempotency key, and the call has none; the tool was not run. Send a key in \
                     `_meta.{KEY}`, the same for every retry of this call (idempotent_mcp's \
                     ToolCaller does)"
                ),
            ),
            Refusal::InvalidKey { tool, why } => invalid(
                "invalidKey",
                format!(
                    "tools/call `{tool}`: {why}; the tool was not run. Send a string of 1 to 255 printable characters"
                ),
            ),
            Refusal::Mismatch { tool, key } => invalid(
                "mismatch",
                format!(
                    "tools/call `{tool}` (key {key}): this key was first used for a call with other \
                     arguments or to another tool; the tool was not run. A retry must send the same \
                     tool name and arguments as the first call; a new call needs a new key"
                ),
            ),
            Refusal::InFlight { tool, key, retry_after } => {
                // The hint is capped as the HTTP layer's `Retry-After` is.
                let retry_after = retry_after.min(idempotent_core::IN_FLIGHT_HINT);
                ErrorData::from(Error::InFlight {
                    step: format!("tools/call {tool}"),
                    key: key.to_string(),
                    retry_after,
                })
            }
            Refusal::NeedsAttention { tool, key, attempt, fence } => ErrorData::from(Error::NeedsAttention {
                step: format!("tools/call {tool}"),
                key: key.short().to_string(),
                attempt,
                fence,
                downstream_key: DownstreamKey::of(&key).as_str().to_owned(),
                record_key: key.to_hex(),
            }),
            Refusal::Store(error) => ErrorData::from(error),
        }
    }
}

/// `-32602 Invalid params` that a retry of the same call meets again.
fn invalid(kind: &str, message: String) -> ErrorData {
    let data: Value = json!({ "kind": kind, "retryable": false, "actionMayHaveRun": false });
    ErrorData::new(ErrorCode::INVALID_PARAMS, message, Some(data))
}
