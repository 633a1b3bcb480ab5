//! The record protocol: what a store answers to each transition.
//!
//! A record moves `absent → running → done` (or `running → released → running …`):
//!
//! | call | from | to | answer |
//! |---|---|---|---|
//! | acquire | absent / `released` / `running` with lease passed | `running`, new owner token, fence grows | [`Acquire::Acquired`] with a [`Grant`] |
//! | acquire | `running`, lease live | — | [`Acquire::InFlight`] |
//! | acquire | `done` | — | [`Acquire::Replay`] |
//! | acquire, fingerprint differs | any stored | — | [`Acquire::Mismatch`] |
//! | complete | `running` with our token | `done`, kept for the retention | [`Transition`] |
//! | release | `running` with our token | `released` (fence kept) | [`Transition`] |
//! | renew | `running` with our token | lease moved | [`Transition`] |
//! | abandon [`Abandon::Uncertain`] | `running` with our token | `released`, marked uncertain: the next acquisition is `recovered` | [`Transition`] |
//! | abandon [`Abandon::NeedsAttention`] | `running` with our token | `needs_attention`, kept until resolved | [`Transition`] |
//! | acquire | `needs_attention` | — | [`Acquire::NeedsAttention`] |
//! | resolve [`Resolution::Done`] | `needs_attention` | `done`, kept for the retention | [`Resolved`] |
//! | resolve [`Resolution::NotDone`] | `needs_attention` | `released` (the next attempt runs, not `recovered`) | [`Resolved`] |
//!
//! An attempt whose outcome is uncertain (its action may have run, but nothing says whether)
//! leaves the record so that the next one knows: `recovered` after an uncertain release or a
//! lease that ran out, and `needs_attention` when no attempt can find out by itself. A
//! `needs_attention` record does not expire (it is not purged either): it waits for a person, or
//! a verifier, to [resolve](crate::store::Store::resolve) it.
//!
//! Stores judge time by their own clock (Redis: `TIME`), never the caller's.
//!
//! # Retention
//!
//! A record is kept until its expiry, then forgotten: the key is absent again (the next call runs
//! as attempt 1, though its fence still grows past the old ones). Every store sets the expiry
//! the same way, by its clock at the transition:
//!
//! | call | expiry afterwards |
//! |---|---|
//! | acquire with `lease` and `retention` | `max(lease, retention)` from now (also for a record taken over: a released one, or one whose lease passed) |
//! | renew with `lease` | the later of the expiry and the new lease's end (`lease` from now): a renewal never shortens it |
//! | complete with `retention` | exactly `retention` from now, whether that is sooner or later than before (a repeat changes nothing) |
//! | release, abandon [`Abandon::Uncertain`], [`release_fenced`](crate::store::Store::release_fenced) | unchanged |
//! | abandon [`Abandon::NeedsAttention`] | none: the record waits, unpurged, until it is resolved |
//! | resolve [`Resolution::Done`] | its `retention` from now |
//! | resolve [`Resolution::NotDone`] | [`KEEP_RESOLVED_RELEASE`] from now |
//! | [`delete`](crate::store::Store::delete) | now (the record is absent at once) |
//!
//! So an outcome is replayed for exactly the retention it was stored with (the step's retention),
//! and a running or released record stays bound to its payload for at least the retention it was
//! acquired with, and never expires under a live lease. [`RecordInfo::expires`] reads the expiry;
//! the conformance suite (`tests/src/conformance/retention.rs`) holds every store to this table.
//!
//! [`RecordInfo::expires`]: crate::store::RecordInfo::expires

use std::fmt;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;

use crate::attempt::Attempt;

/// The owner token of one acquisition: only its holder can complete, release or renew.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Token([u8; 32]);

impl Token {
    /// A fresh token, distinct from every other token of every process.
    ///
    /// 64 random bits drawn once per process, then a 64-bit counter: unique without a system call
    /// per token (an owner token must be unique, not secret — whoever can read the store can
    /// read the tokens too). A process that forks after making tokens must not acquire from
    /// both sides of the fork: the child would repeat the parent's tokens.
    pub fn unique() -> Token {
        static PREFIX: OnceLock<u64> = OnceLock::new();
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let prefix = *PREFIX.get_or_init(|| {
            // A v4 UUID has 122 random bits; folding its halves this way leaves all 64 random
            // (the version and variant bits land on random ones).
            let (hi, lo) = uuid::Uuid::new_v4().as_u64_pair();
            hi ^ lo.rotate_left(32)
        });
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        // 32 hex characters, kept inline: a token costs no allocation.
        let mut text = [0; 32];
        crate::key::encode_hex(&prefix.to_be_bytes(), &mut text[..16]);
        crate::key::encode_hex(&n.to_be_bytes(), &mut text[16..]);
        Token(text)
    }

    /// The token's text: 32 lowercase hex characters.
    pub fn as_str(&self) -> &str {
        // Always ASCII hex (see `unique`), so never the fallback.
        std::str::from_utf8(&self.0).unwrap_or_default()
    }
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The end is the per-token counter (the start is the same for every token of a process).
        let text = self.as_str();
        write!(f, "Token(…{})", &text[text.len().saturating_sub(6)..])
    }
}

/// What a successful acquisition hands the caller: the owner token, and the attempt it runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    /// Proves ownership to complete, release and renew.
    pub token: Token,
    /// The attempt: its fence (grows with every acquisition of the key, even across the record's
    /// loss), its number (1 for the first acquisition, then one more for each) and whether a
    /// previous attempt's lease ran out without an outcome.
    pub attempt: Attempt,
}

/// What an acquisition says about the operation it takes, so that an operator (and the
/// [reconciler](crate::reconcile)) can find its record: the step name, the run id and the tenant.
///
/// Stored in the record by every store, and read back by
/// [`Store::inspect`](crate::store::Store::inspect) and [`Store::scan`](crate::store::Store::scan).
/// Never the payload (the key and fingerprint are hashes of it). The executor gives the step, run
/// and tenant of each call; the HTTP layer its scope as the step and the tenant, never the
/// client's key.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct Labels<'a> {
    /// The step name (the HTTP layer: its scope).
    pub step: &'a str,
    /// The run id.
    pub run: Option<&'a str>,
    /// The tenant.
    pub tenant: Option<&'a str>,
}

impl<'a> Labels<'a> {
    /// The labels of a step `step`, with no run or tenant.
    pub fn step(step: &'a str) -> Self {
        Labels { step, run: None, tenant: None }
    }

    /// Sets the run id.
    pub fn run(mut self, run: &'a str) -> Self {
        self.run = Some(run);
        self
    }

    /// Sets the tenant (or clears it with `None`).
    pub fn tenant(mut self, tenant: Option<&'a str>) -> Self {
        self.tenant = tenant;
        self
    }
}

/// The answer to an acquire.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Acquire {
    /// The caller now owns the key and should run the action.
    Acquired(Grant),
    /// The operation is done; here is its stored result.
    Replay(Bytes),
    /// Another caller holds a live lease.
    InFlight {
        /// Time until that lease runs out.
        retry_after: Duration,
    },
    /// The key is stored with another payload fingerprint.
    Mismatch,
    /// A previous attempt could not tell whether the action ran, and the record waits to be
    /// resolved: nothing may run.
    NeedsAttention {
        /// The attempt that left the record so.
        attempt: u32,
        /// That attempt's fence.
        fence: u64,
    },
}

/// How an attempt that ends without an outcome leaves the record ([`Store::abandon`]).
///
/// [`Store::abandon`]: crate::store::Store::abandon
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Abandon {
    /// The action may have run: release the key, and hand the next attempt a
    /// [`recovered`](crate::Attempt::recovered) grant, as a lease that ran out would (but at once).
    Uncertain,
    /// Nobody can tell whether the action ran: every acquisition answers
    /// [`Acquire::NeedsAttention`] until the record is [resolved](crate::store::Store::resolve).
    NeedsAttention,
}

/// How a `needs_attention` record is settled ([`Store::resolve`]).
///
/// [`Store::resolve`]: crate::store::Store::resolve
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Resolution {
    /// The action did run: store `outcome` (encoded as the executor stores outcomes: see
    /// [`encode_ok`]) for `retention`, and replay it from now on.
    Done {
        /// The encoded outcome.
        outcome: Bytes,
        /// How long it is kept.
        retention: Duration,
    },
    /// The action did not run: release the key (the fence is kept), so that the next call runs
    /// it as a fresh, not recovered, attempt.
    NotDone,
}

/// How long a record resolved as [`Resolution::NotDone`] is kept: one day. The record only
/// carries the attempt count on (a fence grows without it).
pub const KEEP_RESOLVED_RELEASE: Duration = Duration::from_secs(24 * 60 * 60);

/// The answer to a resolve.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Resolved {
    /// The record needed attention and is now settled as asked.
    Ok,
    /// The record does not need attention (it is absent, running, released or done, possibly
    /// because someone resolved it first): nothing changed.
    Unchanged,
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
/// Opens the attempt that produced a stored outcome: `a`, its number in decimal, `:`, then the
/// tagged outcome.
const TAG_ATTEMPT: u8 = b'a';

/// Encodes `value` as the executor stores a successful outcome (its JSON, tagged), for
/// [`Resolution::Done`]. No attempt produced it: [`read_outcome`] gives it no attempt number.
pub fn encode_ok<T: serde::Serialize + ?Sized>(value: &T) -> Result<Bytes, serde_json::Error> {
    let mut buf = vec![TAG_OK];
    serde_json::to_writer(&mut buf, value)?;
    Ok(Bytes::from(buf))
}

/// The executor's stored outcome of `attempt`: `a<attempt>:` and the tag, then the JSON that
/// `json` writes.
pub(crate) fn encode_outcome(
    attempt: u32,
    ok: bool,
    json: impl FnOnce(&mut Vec<u8>) -> Result<(), serde_json::Error>,
) -> Result<Bytes, serde_json::Error> {
    let mut digits = itoa::Buffer::new();
    let digits = digits.format(attempt).as_bytes();
    // Room for the prefix and the shortest JSON: a small value then grows as it did when the
    // outcome had a one-byte prefix (8, 16, 32 … bytes), so the allocation count stays the same.
    let mut buf = Vec::with_capacity(8);
    buf.push(TAG_ATTEMPT);
    buf.extend_from_slice(digits);
    buf.push(b':');
    buf.push(if ok { TAG_OK } else { TAG_ERR });
    json(&mut buf)?;
    Ok(Bytes::from(buf))
}

/// A stored outcome of the executor, read by [`read_outcome`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct StoredOutcome<'a> {
    /// The attempt that produced it (its [`Attempt::number`]); `None` for an outcome settled
    /// by a resolve ([`encode_ok`]: no attempt produced it), or stored by a version of this crate
    /// that did not record it.
    pub attempt: Option<u32>,
    /// Whether it is a result (`true`) or a stored error (`false`).
    pub ok: bool,
    /// The result's or the error's JSON.
    pub json: &'a [u8],
}

/// Reads a stored outcome the executor wrote: `a<attempt>:` (optional), then `o` and a result's
/// JSON, or `e` and a stored error's. `None` when the bytes are not one (an outcome the HTTP
/// layer stored, or garbage).
pub fn read_outcome(bytes: &[u8]) -> Option<StoredOutcome<'_>> {
    let (attempt, rest) = match bytes.split_first() {
        Some((&TAG_ATTEMPT, rest)) => {
            let end = rest.iter().position(|&b| b == b':')?;
            let digits = std::str::from_utf8(&rest[..end]).ok()?;
            if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            (Some(digits.parse::<u32>().ok()?), &rest[end + 1..])
        }
        _ => (None, bytes),
    };
    match rest.split_first() {
        Some((&TAG_OK, json)) => Some(StoredOutcome { attempt, ok: true, json }),
        Some((&TAG_ERR, json)) => Some(StoredOutcome { attempt, ok: false, json }),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::{StoredOutcome, Token, encode_ok, encode_outcome, read_outcome};

    #[test]
    fn stored_outcomes_carry_their_attempt_and_old_ones_still_read() {
        let new = encode_outcome(7, true, |buf| serde_json::to_writer(buf, &"re_1")).unwrap();
        assert_eq!(&new[..], b"a7:o\"re_1\"");
        assert_eq!(read_outcome(&new), Some(StoredOutcome { attempt: Some(7), ok: true, json: b"\"re_1\"" }));
        let err = encode_outcome(u32::MAX, false, |buf| {
            buf.extend_from_slice(b"{}");
            Ok(())
        })
        .unwrap();
        assert_eq!(read_outcome(&err), Some(StoredOutcome { attempt: Some(u32::MAX), ok: false, json: b"{}" }));
        // As stored before the attempt was recorded, and as a resolve stores it.
        for old in [&b"o\"re_1\""[..], &encode_ok("re_1").unwrap()] {
            assert_eq!(read_outcome(old), Some(StoredOutcome { attempt: None, ok: true, json: b"\"re_1\"" }));
        }
        assert_eq!(read_outcome(b"e{}"), Some(StoredOutcome { attempt: None, ok: false, json: b"{}" }));
        for bad in [&b""[..], b"x{}", b"a:o1", b"a7o1", b"a-1:o1", b"a99999999999:o1", b"a7:", b"a7:x1", b"IDRS\x01"] {
            assert_eq!(read_outcome(bad), None, "{:?}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn tokens_are_unique_across_threads() {
        let threads: Vec<_> =
            (0..4).map(|_| std::thread::spawn(|| (0..10_000).map(|_| Token::unique()).collect::<Vec<_>>())).collect();
        let mut seen = HashSet::new();
        for t in threads {
            for token in t.join().unwrap() {
                assert_eq!(token.as_str().len(), 32);
                assert!(token.as_str().bytes().all(|b| b.is_ascii_hexdigit()));
                assert!(seen.insert(token), "a token was handed out twice");
            }
        }
        assert_eq!(seen.len(), 40_000);
    }
}
