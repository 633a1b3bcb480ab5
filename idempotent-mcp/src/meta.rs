//! The names this crate uses in MCP's `_meta` objects, and reading and writing them.
//!
//! MCP reserves `_meta` names whose prefix's second label is `modelcontextprotocol` or `mcp`
//! (`io.modelcontextprotocol/…`, `dev.mcp/…`); the names here carry the project's own
//! reverse-DNS prefix, `dev.idempotent/`.

use rmcp::model::{CallToolResult, MetaObject, RequestMetaObject};
use serde_json::Value;

/// The `_meta` name of a `tools/call`'s idempotency key: a string of 1 to 255 characters, none of
/// them a control character, the same for every retry of one logical tool call and new for every
/// other call (a UUID does).
///
/// ```json
/// {"method": "tools/call", "params": {"name": "refund", "arguments": {"order": "o-7"},
///   "_meta": {"dev.idempotent/key": "5b0e7c1e-8d7f-4c51-9d52-3f0c1f1c2a9e"}}}
/// ```
pub const KEY: &str = "dev.idempotent/key";

/// The `_meta` name set to `true` on a `CallToolResult` that is the stored result of an earlier
/// call with the same key: the tool did not run for this call.
pub const REPLAYED: &str = "dev.idempotent/replayed";

/// The `_meta` name set to `false` on a `CallToolResult` that the tool produced and the store did
/// not take (the store failed, or the call outlived its lease and another attempt took the key
/// over): the tool ran, and a retry under the same key may run it again.
pub const STORED: &str = "dev.idempotent/stored";

/// The longest key, in characters.
pub const MAX_KEY_CHARS: usize = 255;

/// Why a call's key cannot be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum BadKey {
    NotAString,
    Empty,
    TooLong(usize),
    ControlCharacter,
}

impl std::fmt::Display for BadKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BadKey::NotAString => write!(f, "`_meta.{KEY}` must be a string"),
            BadKey::Empty => write!(f, "`_meta.{KEY}` is empty"),
            BadKey::TooLong(n) => write!(f, "`_meta.{KEY}` has {n} characters, more than {MAX_KEY_CHARS}"),
            BadKey::ControlCharacter => write!(f, "`_meta.{KEY}` contains a control character"),
        }
    }
}

/// The call's key, when its `_meta` has one.
pub(crate) fn key(meta: &RequestMetaObject) -> Result<Option<&str>, BadKey> {
    let Some(value) = meta.get(KEY) else { return Ok(None) };
    let Value::String(key) = value else { return Err(BadKey::NotAString) };
    check(key)?;
    Ok(Some(key))
}

/// Whether `key` may be a call's key: 1 to [`MAX_KEY_CHARS`] characters, none a control character.
pub(crate) fn check(key: &str) -> Result<(), BadKey> {
    if key.is_empty() {
        return Err(BadKey::Empty);
    }
    let chars = key.chars().count();
    if chars > MAX_KEY_CHARS {
        return Err(BadKey::TooLong(chars));
    }
    if key.chars().any(char::is_control) {
        return Err(BadKey::ControlCharacter);
    }
    Ok(())
}

/// Sets `name` to `value` in the result's `_meta`, keeping what the tool put there.
pub(crate) fn mark(result: &mut CallToolResult, name: &str, value: bool) {
    result.meta.get_or_insert_with(MetaObject::default).insert(name.to_owned(), Value::Bool(value));
}

/// Whether `result` is a replay: the stored result of an earlier call with the same key, sent
/// without running the tool ([`REPLAYED`] is `true`).
pub fn is_replayed(result: &CallToolResult) -> bool {
    flag(result, REPLAYED) == Some(true)
}

/// Whether the server ran the tool but did not store `result` ([`STORED`] is `false`): a retry
/// under the same key may run the tool again.
pub fn is_unstored(result: &CallToolResult) -> bool {
    flag(result, STORED) == Some(false)
}

fn flag(result: &CallToolResult, name: &str) -> Option<bool> {
    result.meta.as_ref()?.get(name)?.as_bool()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn meta(value: Value) -> RequestMetaObject {
        let mut meta = RequestMetaObject::default();
        meta.insert(KEY.to_owned(), value);
        meta
    }

    #[test]
    fn a_key_is_a_short_printable_string() {
        assert_eq!(key(&RequestMetaObject::default()), Ok(None));
        assert_eq!(key(&meta(json!("k-1"))), Ok(Some("k-1")));
        assert_eq!(key(&meta(json!("é".repeat(255)))), Ok(Some("é".repeat(255).as_str())));
        assert_eq!(key(&meta(json!(7))), Err(BadKey::NotAString));
        assert_eq!(key(&meta(json!(""))), Err(BadKey::Empty));
        assert_eq!(key(&meta(json!("x".repeat(256)))), Err(BadKey::TooLong(256)));
        assert_eq!(key(&meta(json!("a\nb"))), Err(BadKey::ControlCharacter));
    }

    #[test]
    fn marks_keep_the_tools_own_meta() {
        let mut result = CallToolResult::success(vec![]);
        let mut own = MetaObject::default();
        own.insert("example.com/trace".into(), json!("t1"));
        result.meta = Some(own);
        mark(&mut result, REPLAYED, true);
        assert!(is_replayed(&result));
        assert_eq!(result.meta.as_ref().unwrap().get("example.com/trace"), Some(&json!("t1")));
        assert!(!is_unstored(&result));
        mark(&mut result, STORED, false);
        assert!(is_unstored(&result));
    }
}
