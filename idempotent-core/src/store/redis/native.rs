//! Completions as one plain command where the server compares and sets: `SET key <done record>
//! IFEQ <record the holder wrote> PX <retention>` (Valkey 8.1 and later, Redis 8.4 and later),
//! instead of the `complete` script.
//!
//! **What the holder knows.** A first acquisition writes its running record with `SET NX`
//! (`acquire.rs`): the store built those bytes, and keeps them, with when it sent them, under the
//! acquisition's token. A completion by that token then sends the done record built from them
//! (as the script builds it: state `C`, the fingerprint to the creation time kept, the update
//! time, the labels, the result) on the condition that the key still holds those very bytes.
//! Any other transition of the record changes them: a takeover (a new token, fence and attempt),
//! a renewal, a release, an operator's resolve; the server then sets nothing and answers nil, and
//! the completion goes to the script, which judges what is there (a repeat of this token's own
//! completion after a lost reply answers done; another owner's record answers lease lost). So the
//! owner token, fences, `recovered`, verification, `WAIT` (the command goes out as the script
//! would, with its `WAIT` behind it) and Cluster (one key) hold as on the script path.
//!
//! **Ownership, not deadlines.** As on the script path (DESIGN.md, "The record protocol"), what
//! gates a completion is that the record is still the holder's: a completion that arrives after
//! its lease passed, while nobody has taken the key over, stores the one execution's result on
//! both paths; a takeover rewrites the record, and the comparison then fails.
//!
//! **The update time** is the client's estimate of the server's clock (`clock.rs`), never before
//! the record's last change, as the script has it; without a fresh estimate the completion takes
//! the script, which reads `TIME`.
//!
//! **Detection.** Before the first record is kept, with the first measure of the server's clock
//! (`clock.rs`; [`RedisStore::warm_up`] makes it, else the first acquire starts it in the
//! background): `SET <prefix>ifeq-probe "" IFEQ "-"` sets nothing on a server that has the form
//! and is a syntax error on one that has not (Redis before 8.4), which keeps the scripts for
//! good. Until the answer is in, acquisitions keep nothing and completions take the script, so a
//! first attempt of the plain form never meets a server that refuses it. Never guessed from a
//! version string: Valkey reports `redis_version:7.2.4`.
//!
//! Renewals, releases and abandons stay scripts: a renewal moves the lease by the server's clock
//! and never shortens the record's TTL, which a `SET` cannot read; releases and abandons are the
//! error paths, not the first execution's.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Duration;

use bytes::Bytes;
use deadpool_redis::redis::{self, Value};

use super::RedisStore;
use super::arg::{Arg, millis};
use super::conn::Written;
use super::layout::UPDATED;
use crate::error::Error;
use crate::key::Key;
use crate::record::{Token, Transition};

/// The most acquisitions whose records are kept at once. A full map is emptied (its
/// acquisitions then complete by script, as they may at any time): grants that never end (a
/// `Store` user that drops them) cannot grow it without bound.
const MAX_KEPT: usize = 1 << 16;

/// Whether the server compares and sets: not asked yet.
const UNKNOWN: u8 = 0;
/// It does: acquisitions keep their records.
const ON: u8 = 1;
/// It does not, or the builder turned the plain form off.
const OFF: u8 = 2;

/// The running records this store wrote with `SET NX`, by token, while the server compares and
/// sets.
#[derive(Debug)]
pub(super) struct Native {
    state: AtomicU8,
    kept: Mutex<HashMap<Token, Kept>>,
}

/// A running record as the store wrote it.
#[derive(Debug)]
pub(super) struct Kept {
    /// The record's bytes, as sent.
    pub(super) record: Vec<u8>,
}

impl Native {
    /// `on`: whether to use the plain command where the server has it (the builder's
    /// [`native_compare_and_set`](super::RedisStoreBuilder::native_compare_and_set)).
    pub(super) fn new(on: bool) -> Native {
        Native { state: AtomicU8::new(if on { UNKNOWN } else { OFF }), kept: Mutex::new(HashMap::new()) }
    }

    /// Whether acquisitions keep their records (the server was found to compare and set).
    pub(super) fn is_on(&self) -> bool {
        self.state.load(Ordering::Relaxed) == ON
    }

    /// Whether the server is still to be asked.
    pub(super) fn needs_probe(&self) -> bool {
        self.state.load(Ordering::Relaxed) == UNKNOWN
    }

    /// The server's answer to the probe.
    fn found(&self, has: bool) {
        if has {
            let _ = self.state.compare_exchange(UNKNOWN, ON, Ordering::Relaxed, Ordering::Relaxed);
        } else {
            self.turn_off();
        }
    }

    /// Keeps the record `token`'s acquisition wrote.
    pub(super) fn keep(&self, token: &Token, kept: Kept) {
        let mut map = self.lock();
        if map.len() >= MAX_KEPT {
            tracing::debug!(
                kept = map.len(),
                "idempotent.redis: forgetting the kept records of unfinished acquisitions; they complete by script"
            );
            map.clear();
        }
        map.insert(token.clone(), kept);
    }

    /// The record `token` wrote, if kept (and the plain form is on); it is forgotten either way.
    pub(super) fn take(&self, token: &Token) -> Option<Kept> {
        let kept = self.lock().remove(token)?;
        self.is_on().then_some(kept)
    }

    /// Forgets the record of `token` (renewed, released, abandoned: no longer as written).
    pub(super) fn forget(&self, token: &Token) {
        self.lock().remove(token);
    }

    /// The server refused the form: every completion takes the script from now on.
    pub(super) fn turn_off(&self) {
        self.state.store(OFF, Ordering::Relaxed);
        self.lock().clear();
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Token, Kept>> {
        crate::store::lock(&self.kept)
    }
}

impl RedisStore {
    /// Finds out whether the server takes `SET … IFEQ`: `SET <prefix>ifeq-probe "" IFEQ "-"`,
    /// which sets nothing on a server that has the form (no such key, or not equal) and is a
    /// syntax error on one that has not.
    pub(super) async fn probe_compare_and_set(&self) -> Result<(), Error> {
        let mut cmd = redis::cmd("SET");
        cmd.arg(format!("{}ifeq-probe", self.inner.prefix)).arg("").arg("IFEQ").arg("-");
        match self.run("clock", cmd).await {
            Ok(_) => {
                self.inner.native.found(true);
                Ok(())
            }
            // Any refusal by the server (a syntax error before Valkey 8.1 / Redis 8.4, a proxy's
            // own wording): the scripts. A failure to reach it says nothing, and is reported.
            Err(Error::Unavailable { reason, source, .. }) if refused_by_server(source.as_deref()) => {
                self.inner.native.found(false);
                tracing::debug!(store = %self.inner.describe, %reason, "idempotent.redis: the server refuses SET … IFEQ; completions run the complete script");
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    /// Completes over the record `kept` as one `SET … IFEQ … PX`: `Some(Ok)` when it was set;
    /// `None` when the server set nothing (the record changed: the script judges) or refuses the
    /// form (turned off for good; the script completes). `updated` is the estimate of the
    /// server's clock, in milliseconds.
    pub(super) async fn complete_native(
        &self,
        key: &Key,
        kept: &Kept,
        result: &Bytes,
        updated: u64,
        retention: Duration,
    ) -> Result<Option<Transition>, Error> {
        // Never before the record's last change, as the script has it.
        let last = super::layout::digits(&kept.record[UPDATED]).unwrap_or(0);
        let updated = updated.max(last);
        let done = Arg::Done { running: &kept.record, updated, result };
        let len = 3 + self.inner.prefix.len() + 64 + done.len() + 4 + kept.record.len() + 2 + 20;
        let mut cmd = redis::Cmd::with_capacity(7, len);
        cmd.arg("SET").arg(Arg::Key(&self.inner.prefix, key)).arg(done).arg("IFEQ").arg(&kept.record[..]);
        cmd.arg("PX").arg(Arg::Millis(millis(retention)));
        match self.send_written("complete", key, &cmd).await {
            Ok(Written { reply: Value::Okay, replicas }) => {
                self.replicated("complete", replicas)?;
                Ok(Some(Transition::Ok))
            }
            Ok(Written { reply: Value::Nil, .. }) => Ok(None),
            Ok(Written { reply: other, .. }) => Err(Self::corrupt(key, format!("unexpected SET IFEQ reply {other:?}"))),
            // Found to have the form, then refusing it (a failover to an older server?).
            Err(Error::Unavailable { reason, .. }) if reason.contains("syntax error") => {
                self.inner.native.turn_off();
                tracing::warn!(store = %self.inner.describe, "idempotent.redis: the server refuses SET … IFEQ; completions run the complete script from now on");
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }
}

/// Whether `source` is the server's own error reply (not a connection or a timeout failure).
fn refused_by_server(source: Option<&(dyn std::error::Error + Send + Sync + 'static)>) -> bool {
    source
        .and_then(|e| e.downcast_ref::<redis::RedisError>())
        .is_some_and(|e| !e.is_io_error() && !e.is_timeout() && !e.is_connection_dropped())
}
