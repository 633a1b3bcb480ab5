//! What names one logical update ([`CommitToken`]), and the tokens a store keeps per scope to
//! recognise a commit it already applied.

use std::fmt;

use sha2::{Digest, Sha256};

use crate::key::field;

use super::scope::Scope;

/// How many commit tokens a store keeps per scope, with the version each produced: a commit
/// retried after a lost reply is recognised while fewer than this many other commits have
/// landed since (see the [module documentation](super)).
pub const COMMIT_HISTORY: u64 = 128;

/// How many commit tokens `RedisStore` keeps per scope: a hash field per token and one per slot,
/// dropped in O(1) per commit, so a longer history costs memory only (about 90 bytes a token).
pub const REDIS_COMMIT_HISTORY: u64 = 1024;

/// What names one logical update, so that the store applies it once however often its commit is
/// retried: 16 bytes.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct CommitToken([u8; 16]);

impl CommitToken {
    /// A token from its bytes.
    pub const fn from_bytes(bytes: [u8; 16]) -> CommitToken {
        CommitToken(bytes)
    }

    /// A token derived from an id of the caller's (a request id, a message id): the same id
    /// gives the same token.
    pub fn derive(id: &str) -> CommitToken {
        let mut h = Sha256::new();
        field(&mut h, b"idempotent/state-commit/explicit");
        field(&mut h, id.as_bytes());
        Self::truncated(h)
    }

    /// A fresh random token.
    pub fn random() -> CommitToken {
        CommitToken(*uuid::Uuid::new_v4().as_bytes())
    }

    /// The token of the next update of `scope` in the current step's action (see the
    /// [module documentation](super)), or a random one outside a step.
    pub fn for_update(scope: &Scope) -> CommitToken {
        Self::for_update_derived(scope).0
    }

    /// [`for_update`](Self::for_update), and whether the token is derived (a retry of the
    /// step gets it again) rather than random.
    pub(crate) fn for_update_derived(scope: &Scope) -> (CommitToken, bool) {
        match crate::attempt::current_attempt() {
            Some(attempt) => (Self::of_attempt(&attempt, scope), true),
            None => (Self::random(), false),
        }
    }

    /// The token of the next update of `scope` by `attempt`'s action.
    pub fn of_attempt(attempt: &crate::Attempt, scope: &Scope) -> CommitToken {
        let n = attempt.next_state_commit();
        let mut h = Sha256::new();
        field(&mut h, b"idempotent/state-commit/step");
        h.update(attempt.key().as_bytes());
        h.update(scope.digest());
        h.update(n.to_be_bytes());
        Self::truncated(h)
    }

    fn truncated(h: Sha256) -> CommitToken {
        let digest: [u8; 32] = h.finalize().into();
        let mut out = [0u8; 16];
        out.copy_from_slice(&digest[..16]);
        CommitToken(out)
    }

    /// Its bytes.
    pub fn as_bytes(&self) -> &[u8; 16] {
        &self.0
    }

    /// Its 32 hex digits.
    pub fn to_hex(&self) -> String {
        let mut s = String::with_capacity(32);
        crate::key::push_hex(&mut s, &self.0);
        s
    }
}

impl fmt::Debug for CommitToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CommitToken({})", self.to_hex())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scopes_differ_by_tenant_and_tokens_by_attempt_order() {
        assert_ne!(Scope::new("a").digest(), Scope::new("a").tenant("t").digest());
        assert_ne!(Scope::new("a").tenant("t").digest(), Scope::new("a").tenant("u").digest());
        assert_eq!(Scope::new("a").tenant("t").to_string(), "t/a");
        let key = crate::Key::from_bytes([7; 32]);
        let (a, b) = (crate::Attempt::new(key, 1, 1, false), crate::Attempt::new(key, 2, 2, true));
        let s = Scope::new("s");
        let (a0, a1) = (CommitToken::of_attempt(&a, &s), CommitToken::of_attempt(&a, &s));
        assert_ne!(a0, a1, "two updates of one action get two tokens");
        assert_eq!(CommitToken::of_attempt(&b, &s), a0, "a later attempt's first update has the first's token");
        assert_eq!(CommitToken::of_attempt(&b.clone(), &s), a1, "clones share the count");
        assert_eq!(CommitToken::derive("x"), CommitToken::derive("x"));
        assert_ne!(CommitToken::random(), CommitToken::random());
    }
}
