//! The error an MCP tool returns: [`Error`] as rmcp's [`ErrorData`] (feature `rmcp`).

use rmcp::ErrorData;
use rmcp::model::ErrorCode;
use serde_json::{Map, Value, json};

use super::Error;

/// An `#[idempotent]` tool on an rmcp server returns `Result<T, rmcp::ErrorData>`: the executor's
/// own failures become a JSON-RPC error whose message is the [`Error`]'s, and whose `data` tells
/// a client what to do without parsing the message:
///
/// | field | value |
/// |---|---|
/// | `kind` | the variant in lower camel case: `"mismatch"`, `"inFlight"`, `"unavailable"`, ... |
/// | `retryable` | [`Error::is_transient`]: calling again, unchanged, may succeed |
/// | `actionMayHaveRun` | [`Error::action_may_have_run`] |
/// | `retryAfterMs` | [`Error::retry_after`], when there is one |
///
/// A payload the key cannot be made from and a key used with other arguments are
/// `-32602 Invalid params`; everything else is `-32603 Internal error`.
///
/// ```
/// let busy = idempotent_core::Error::InFlight {
///     step: "refund".into(),
///     key: "3fa1c2".into(),
///     retry_after: std::time::Duration::from_millis(1500),
/// };
/// let error = rmcp::ErrorData::from(busy);
/// let data = error.data.unwrap();
/// assert_eq!(data["kind"], "inFlight");
/// assert_eq!(data["retryable"], true);
/// assert_eq!(data["retryAfterMs"], 1500);
/// ```
impl From<Error> for ErrorData {
    fn from(error: Error) -> ErrorData {
        let code = match error {
            Error::Payload { .. } | Error::Mismatch { .. } => ErrorCode::INVALID_PARAMS,
            _ => ErrorCode::INTERNAL_ERROR,
        };
        let mut data = Map::new();
        data.insert("kind".into(), Value::from(kind(&error)));
        data.insert("retryable".into(), Value::from(error.is_transient()));
        data.insert("actionMayHaveRun".into(), Value::from(error.action_may_have_run()));
        if let Some(after) = error.retry_after() {
            data.insert("retryAfterMs".into(), json!(u64::try_from(after.as_millis()).unwrap_or(u64::MAX)));
        }
        ErrorData::new(code, error.to_string(), Some(Value::Object(data)))
    }
}

/// The variant's name in lower camel case, as JSON-RPC clients spell fields.
fn kind(error: &Error) -> &'static str {
    match error {
        Error::Payload { .. } => "payload",
        Error::Mismatch { .. } => "mismatch",
        Error::InFlight { .. } => "inFlight",
        Error::LeaseLost { .. } => "leaseLost",
        Error::NeedsAttention { .. } => "needsAttention",
        Error::VerifyTimeout { .. } => "verifyTimeout",
        Error::Unavailable { .. } => "unavailable",
        Error::Timeout { .. } => "timeout",
        Error::Corrupt { .. } => "corrupt",
        Error::Encode { .. } => "encode",
        Error::Decode { .. } => "decode",
        Error::Full { .. } => "full",
        Error::ResultTooLarge { .. } => "resultTooLarge",
        Error::UnsafeStore { .. } => "unsafeStore",
        Error::Contention { .. } => "contention",
        Error::Reducer { .. } => "reducer",
        Error::StateValue { .. } => "stateValue",
        Error::StateUncertain { .. } => "stateUncertain",
        Error::CommitUnanswered { .. } => "commitUnanswered",
        Error::Config(_) => "config",
        Error::Action(_) => "action",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mismatch_is_invalid_params_and_not_retryable() {
        let e = ErrorData::from(Error::Mismatch { step: "refund".into(), key: "ab12".into() });
        assert_eq!(e.code, ErrorCode::INVALID_PARAMS);
        assert!(e.message.contains("different payload"), "{}", e.message);
        let data = e.data.unwrap();
        assert_eq!(data["kind"], "mismatch");
        assert_eq!(data["retryable"], false);
        assert!(data.get("retryAfterMs").is_none());
    }

    #[test]
    fn a_store_failure_is_internal_and_retryable() {
        let e = ErrorData::from(Error::Unavailable {
            store: "memory".into(),
            op: "acquire",
            reason: "down".into(),
            source: None,
        });
        assert_eq!(e.code, ErrorCode::INTERNAL_ERROR);
        let data = e.data.unwrap();
        assert_eq!(data["kind"], "unavailable");
        assert_eq!(data["retryable"], true);
        assert_eq!(data["actionMayHaveRun"], false);
    }
}
