//! Finding a record's key from what an operator knows: the key itself, the step call the
//! executor derives it from, or the client's `Idempotency-Key` the HTTP layer derives it from.

use idempotent_core::{Fingerprint, Key, KeyScope};

use crate::args::Which;
use crate::exit::Failure;

/// The key `which` names.
pub(crate) fn key(which: &Which) -> Result<Key, Failure> {
    if let Some(text) = &which.key {
        return Key::from_hex(text).ok_or_else(|| {
            Failure::usage(format!(
                "`{text}` is not a record key: give the 64 hex digits `list --json` prints, or --run/--step/--args, or --http-key"
            ))
        });
    }
    if let (Some(run), Some(step), Some(args)) = (&which.run, &which.step, &which.args) {
        let identity: serde_json::Value = serde_json::from_str(args).map_err(|e| {
            Failure::usage(format!(
                "--args is not JSON ({e}): give the step's arguments as JSON, e.g. '[\"order-7\",1500]'"
            ))
        })?;
        let mut scope = KeyScope::new(run.as_str(), step.as_str()).version(which.version);
        if let Some(tenant) = &which.tenant {
            scope = scope.tenant(tenant.as_str());
        }
        let identity =
            Fingerprint::of(&identity).map_err(|e| Failure::usage(format!("--args cannot be hashed: {e}")))?;
        return Ok(Key::from_identity_hash(&scope, &identity));
    }
    if let Some(client_key) = &which.http_key {
        return Ok(Key::from_client_key(which.tenant.as_deref(), &which.scope, client_key));
    }
    Err(Failure::usage(
        "say which record: its KEY (64 hex digits), or --run, --step and --args (and --tenant, --version) as the step was called, or --http-key (and --scope, --tenant) as the HTTP layer saw it",
    ))
}
