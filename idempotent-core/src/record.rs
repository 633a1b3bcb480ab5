//! The record protocol: what a store answers to each transition.
//!
//! A record moves `absent → running → done` (or `running → released → running …`):
//!
//! | call | from | to | answer |
//! |---|---|---|---|
//! | acquire | absent / `released` / `running` with lease passed | `running`, new owner token, fence grows | [`Acquire::Acquired`] |
//! | acquire | `running`, lease live | — | [`Acquire::InFlight`] |
//! | acquire | `done` | — | [`Acquire::Replay`] |
//! | acquire, fingerprint differs | any stored | — | [`Acquire::Mismatch`] |
//! | complete | `running` with our token | `done`, retention TTL | [`Transition`] |
//! | release | `running` with our token | `released` (fence kept) | [`Transition`] |
//! | renew | `running` with our token | lease moved | [`Transition`] |
//!
//! Stores judge time by their own clock (Redis: `TIME`), never the caller's.

use std::fmt;
use std::time::Duration;

use bytes::Bytes;

/// The owner token of one acquisition: only its holder can complete, release or renew.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Token(String);

impl Token {
    /// A fresh random token (128 bits).
    pub fn random() -> Token {
        Token(uuid::Uuid::new_v4().simple().to_string())
    }

    /// The token's text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Token({}…)", &self.0[..self.0.len().min(6)])
    }
}

/// What a successful acquisition hands the caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    /// Proves ownership to complete, release and renew.
    pub token: Token,
    /// The fencing token: grows with every acquisition of the key, even across the record's loss.
    pub fence: u64,
    /// 1 for the first attempt, then one more for every acquisition.
    pub attempt: u32,
    /// A previous attempt's lease ran out without an outcome (it crashed, hung or was cancelled).
    pub recovered: bool,
}

/// The answer to an acquire.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Acquire {
    /// The caller now owns the key and should run the action.
    Acquired(Lease),
    /// The operation is done; here is its stored result.
    Replay(Bytes),
    /// Another caller holds a live lease.
    InFlight {
        /// Time until that lease runs out.
        retry_after: Duration,
    },
    /// The key is stored with another payload fingerprint.
    Mismatch,
}

/// The answer to complete, release and renew.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transition {
    /// The transition happened.
    Ok,
    /// The caller no longer owns the key (its lease passed and another attempt took over, or the
    /// record is gone).
    LeaseLost,
}

/// Stored outcomes are tagged so a stored error replays as an error.
pub(crate) const TAG_OK: u8 = b'o';
pub(crate) const TAG_ERR: u8 = b'e';
