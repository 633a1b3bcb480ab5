//! Finding a record's key from what an operator knows: the key itself or the start of it (as
//! `list` prints it), the step call the executor derives it from, or the client's
//! `Idempotency-Key` the HTTP layer derives it from.

use idempotent_core::{Fingerprint, Key, KeyScope};

use crate::args::Which;
use crate::exit::Failure;

/// The fewest hex digits taken as the start of a key (`list` prints 12).
pub(crate) const MIN_PREFIX: usize = 4;

/// What `which` names: a key, or the start of one, which only the store's records can complete.
pub(crate) enum Named {
    /// The whole key.
    Key(Key),
    /// The first hex digits of a key (lowercase, fewer than 64).
    Prefix(String),
}

/// What `which` names.
pub(crate) fn named(which: &Which) -> Result<Named, Failure> {
    if let Some(text) = &which.key {
        if let Some(key) = Key::from_hex(text) {
            return Ok(Named::Key(key));
        }
        let hex = text.len() < 64 && text.bytes().all(|b| b.is_ascii_hexdigit());
        if hex && text.len() >= MIN_PREFIX {
            return Ok(Named::Prefix(text.to_ascii_lowercase()));
        }
        return Err(Failure::usage(format!(
            "`{text}` is not a record key: give the key as `list` prints it (its first 12 hex digits, or at least \
             {MIN_PREFIX}), all 64 hex digits (`list --json`), or --run/--step/--args, or --http-key"
        )));
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
        return Ok(Named::Key(Key::from_identity_hash(&scope, &identity)));
    }
    if let Some(client_key) = &which.http_key {
        return Ok(Named::Key(Key::from_client_key(which.tenant.as_deref(), &which.scope, client_key)));
    }
    Err(Failure::usage(
        "say which record: its KEY (as `list` prints it, or all 64 hex digits), or --run, --step and --args (and --tenant, --version) as the step was called, or --http-key (and --scope, --tenant) as the HTTP layer saw it",
    ))
}
