//! Acquire's path on Redis: its plain read first (after a run of replays), the `SET … NX GET`
//! that takes an absent key, the `acquire` script for a record those cannot judge, how a record
//! read on the way answers, and the release of a key a failed acquire may have taken. The
//! commands and their costs are in [`RedisStore`]'s docs.

use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use deadpool_redis::redis::Value;

use super::RedisStore;
use super::arg::Arg;
use super::conn::Written;
use super::layout::{
    self, ATTEMPT, FENCE, FINGERPRINT, LEASE, MAX_FENCE, NEEDS_ATTENTION, NEW, RECOVERED, RELEASED, RUNNING, STATE,
    TOKEN,
};
use super::native::Kept;
use crate::attempt::Attempt;
use crate::error::Error;
use crate::key::{Fingerprint, Key};
use crate::record::{Acquire, Grant, Labels, Token, Transition};

impl RedisStore {
    /// After an acquire that failed on the way (a timeout, a dropped connection), the server may
    /// still have taken the key for `token`, which nobody will use: the caller got an error and
    /// ran nothing. Left alone, that would keep the key for a whole lease. A task of its own
    /// releases it instead: once at once, and once more a command timeout later, in case the
    /// acquire reached the server only after the first release. Releasing is safe whatever
    /// happened: it acts only on a record this token still holds, and a late acquire with the
    /// same token finds its token's `released` record and changes nothing.
    pub(super) fn release_orphan(&self, key: Key, token: Token) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else { return };
        let store = self.clone();
        runtime.spawn(async move {
            for attempt in 0..2 {
                if attempt > 0 {
                    tokio::time::sleep(store.inner.timeout).await;
                }
                let args = [Arg::Bytes(token.as_str().as_bytes()), Arg::Bytes(b"1")];
                let released = match store.invoke("release", &store.inner.scripts.release, &key, &args).await {
                    Ok(reply) => store.transition(&key, reply),
                    Err(e) => Err(e),
                };
                match released {
                    Ok(Transition::Ok) => {
                        tracing::debug!(key = %key.short(), "idempotent.redis: released the key a failed acquire may have taken");
                        return;
                    }
                    // Not taken by this token (yet): look again once a late acquire would have
                    // landed.
                    Ok(Transition::LeaseLost) => {}
                    Err(e) => tracing::debug!(key = %key.short(), error = %e, "idempotent.redis: could not release after a failed acquire; the lease runs out on its own"),
                }
            }
        });
    }

    /// Acquire's work for `token`: one `SET NX GET` (after a `GET` when the store reads first),
    /// then the acquire script only for a record they cannot judge (or for every acquire when the
    /// plain path is off or has no clock).
    pub(super) async fn acquire_for(
        &self,
        key: &Key,
        fingerprint: &Fingerprint,
        token: &Token,
        lease: u64,
        retention: u64,
        labels: &Labels<'_>,
    ) -> Result<Acquire, Error> {
        let fp = crate::key::hex_array(fingerprint.as_bytes());
        let ttl = lease.max(retention);
        // After a run of replays, a plain `GET` first: a done record (or another payload's, or one
        // that needs attention) is the answer, for less than `SET NX GET` costs the server. A
        // record it cannot judge (a lease under this payload) goes to the script; no record, to
        // the `SET NX GET`. Under load the `GET` goes out with others' as one `MGET` (`reads.rs`).
        let mut absent = true;
        if self.inner.order.read_first() {
            match self.read_record_bytes(key).await? {
                Value::Nil => {}
                Value::BulkString(record) => match self.read_record(key, record, &fp, token)? {
                    Some(answer) => return Ok(answer),
                    None => absent = false,
                },
                other => return Err(Self::corrupt(key, format!("unexpected GET reply {other:?}"))),
            }
        }
        if absent
            && self.inner.set_get.load(Ordering::Relaxed)
            && let Some(fence) = self.estimated_server_micros()
        {
            let threshold = ttl - lease;
            // Kept for a plain completion where the server compares and sets (`native.rs`).
            let kept = self.inner.native.is_on().then(|| Arg::new_record(&fp, token, threshold, fence, labels));
            let record = match &kept {
                Some(bytes) => Arg::Bytes(bytes),
                None => Arg::New { fp: &fp, token, threshold, fence, labels },
            };
            match self.set_get(key, record, ttl).await {
                Ok(Written { reply: Value::Nil, replicas }) => {
                    self.replicated("acquire", replicas)?;
                    if let Some(record) = kept {
                        self.inner.native.keep(token, Kept { record });
                    }
                    return Ok(Acquire::Acquired(Grant {
                        token: token.clone(),
                        attempt: Attempt::new(*key, fence, 1, false),
                    }));
                }
                Ok(Written { reply: Value::BulkString(record), .. }) => {
                    match self.read_record(key, record, &fp, token)? {
                        // This token's own record (a retry after a lost reply): the SET wrote
                        // nothing, so its WAIT covers only this connection's earlier writes.
                        // With WAIT on, the script writes the record again, and its WAIT counts.
                        Some(Acquire::Acquired(_)) if self.inner.wait.is_some() => {}
                        Some(answer) => return Ok(answer),
                        // Running or released under this payload: the script judges the lease.
                        None => {}
                    }
                }
                Ok(Written { reply: other, .. }) => {
                    // Something between us and Redis answered oddly: the key may be taken.
                    self.release_orphan(*key, token.clone());
                    return Err(Self::corrupt(key, format!("unexpected SET reply {other:?}")));
                }
                Err(Error::Unavailable { reason, .. }) if reason.contains("syntax error") => {
                    // Before Redis 7.0, SET takes NX or GET but not both: nothing was written.
                    self.inner.set_get.store(false, Ordering::Relaxed);
                    tracing::warn!(store = %self.inner.describe, "idempotent.redis: the server refuses SET NX GET (Redis before 7.0?); every acquire runs the acquire script from now on");
                }
                Err(e) => return Err(e),
            }
        }
        let args = [Arg::Acquire { fp: &fp, token, lease, retention, labels }];
        let Written { reply, replicas } =
            self.invoke_written("acquire", &self.inner.scripts.acquire, key, &args).await?;
        let items = match reply {
            // A done record, whole.
            Value::BulkString(record) => {
                return match self.read_record(key, record, &fp, token)? {
                    Some(answer) => Ok(answer),
                    None => Err(Self::corrupt(key, "the acquire script returned a record that is not done")),
                };
            }
            Value::Array(items) => items,
            other => return Err(Self::corrupt(key, format!("unexpected acquire reply {other:?}"))),
        };
        match (int(items.first()), items.len()) {
            (Some(1), 4) => {
                let (Some(fence), Some(attempt), Some(recovered)) =
                    (int(items.get(1)), int(items.get(2)), int(items.get(3)))
                else {
                    return Err(Self::corrupt(key, "malformed acquire reply"));
                };
                let fence = u64::try_from(fence).map_err(|_| Self::corrupt(key, "negative fence"))?;
                let attempt = Attempt::new(*key, fence, u32::try_from(attempt).unwrap_or(u32::MAX), recovered == 1);
                self.replicated("acquire", replicas)?;
                Ok(Acquire::Acquired(Grant { token: token.clone(), attempt }))
            }
            (Some(3), 2) => {
                let ms = int(items.get(1)).unwrap_or(0).max(0) as u64;
                Ok(Acquire::InFlight { retry_after: Duration::from_millis(ms) })
            }
            (Some(4), 1) => Ok(Acquire::Mismatch),
            (Some(5), 3) => {
                let (Some(attempt), Some(fence)) = (int(items.get(1)), int(items.get(2))) else {
                    return Err(Self::corrupt(key, "malformed acquire reply"));
                };
                let fence = u64::try_from(fence).map_err(|_| Self::corrupt(key, "negative fence"))?;
                Ok(Acquire::NeedsAttention { attempt: u32::try_from(attempt).unwrap_or(u32::MAX), fence })
            }
            _ => Err(Self::corrupt(key, format!("unexpected acquire reply {items:?}"))),
        }
    }

    /// `SET key <new record> NX GET PX <ttl>`: takes an absent key, and returns the record that
    /// is there otherwise.
    async fn set_get(&self, key: &Key, record: Arg<'_>, ttl_ms: u64) -> Result<Written, Error> {
        let len = 3 + self.inner.prefix.len() + 64 + record.len() + 2 + 3 + 2 + 20;
        let mut cmd = deadpool_redis::redis::Cmd::with_capacity(7, len);
        cmd.arg("SET").arg(Arg::Key(&self.inner.prefix, key)).arg(record).arg("NX").arg("GET").arg("PX");
        cmd.arg(Arg::Millis(ttl_ms));
        self.send_written("acquire", key, &cmd).await
    }

    /// What a record read by acquire answers: a done record replays or mismatches, and so does
    /// one that needs attention (its attempt and fence); a running or released one under another
    /// payload mismatches, and one this very token took (a retry after a lost reply) is acquired
    /// as recorded. `None`: another owner's running or released record under this payload, for
    /// the acquire script to judge.
    fn read_record(&self, key: &Key, record: Vec<u8>, fp: &[u8; 64], token: &Token) -> Result<Option<Acquire>, Error> {
        let not_a_record = || Self::corrupt(key, "the key holds a string that is not a record");
        if record.len() < TOKEN.end {
            return Err(not_a_record());
        }
        // A done record: the result after its labels.
        if let Some(result) = layout::result_start(&record) {
            if record[FINGERPRINT] != fp[..] {
                return Ok(Some(Acquire::Mismatch));
            }
            return Ok(Some(Acquire::Replay(Bytes::from(record).slice(result..))));
        }
        match record[STATE] {
            RUNNING | NEW | RELEASED | NEEDS_ATTENTION if layout::running_shape(&record) => {
                let digits = |range: std::ops::Range<usize>| layout::digits(&record[range]);
                let (Some(_), Some(fence), Some(attempt)) = (digits(LEASE), digits(FENCE), digits(ATTEMPT)) else {
                    return Err(Self::corrupt(key, "the record has a malformed number"));
                };
                if fence >= MAX_FENCE {
                    return Err(Self::corrupt(key, "the record has a fence beyond 2^53"));
                }
                let attempt = u32::try_from(attempt).unwrap_or(u32::MAX);
                if record[STATE] == NEEDS_ATTENTION {
                    // Whoever asks, this token included: nothing runs until it is resolved.
                    return Ok(Some(if record[FINGERPRINT] == fp[..] {
                        Acquire::NeedsAttention { attempt, fence }
                    } else {
                        Acquire::Mismatch
                    }));
                }
                if record[TOKEN] == *token.as_str().as_bytes() && record[STATE] != RELEASED {
                    let recovered = record[RECOVERED] == b'1';
                    let attempt = Attempt::new(*key, fence, attempt, recovered);
                    return Ok(Some(Acquire::Acquired(Grant { token: token.clone(), attempt })));
                }
                if record[FINGERPRINT] != fp[..] {
                    return Ok(Some(Acquire::Mismatch));
                }
                Ok(None)
            }
            _ => Err(not_a_record()),
        }
    }
}

fn int(v: Option<&Value>) -> Option<i64> {
    match v {
        Some(Value::Int(i)) => Some(*i),
        _ => None,
    }
}
