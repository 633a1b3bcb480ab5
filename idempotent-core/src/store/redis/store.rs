//! The [`Store`] implementation of [`RedisStore`]: acquire (its path is in `acquire.rs`), the
//! owner's transitions, resolve and the admin calls (`inspect` and `scan` are in `admin.rs`;
//! `release_fenced` and `delete` are one script each, here), and how a write's reply reads:
//! the transition it made, and whether it reached the replicas asked for.

use std::time::Duration;

use bytes::Bytes;
use deadpool_redis::redis::Value;

use super::RedisStore;
use super::arg::{self, Arg, millis};
use super::conn::Written;
use super::layout::{DONE, NEEDS_ATTENTION, RELEASED};
use crate::error::Error;
use crate::key::{Fingerprint, Key};
use crate::record::{Abandon, Acquire, KEEP_RESOLVED_RELEASE, Labels, Resolution, Resolved, Token, Transition};
use crate::store::admin::{Cursor, Deleted, Filter, Page, RecordInfo};
use crate::store::{BoxFuture, Store};

impl RedisStore {
    /// With [`RedisStoreBuilder::wait_for_replicas`](super::RedisStoreBuilder::wait_for_replicas):
    /// a store failure when the write a caller would act on reached fewer replicas than asked
    /// for (`replicas`, `WAIT`'s answer).
    pub(super) fn replicated(&self, op: &'static str, replicas: Option<i64>) -> Result<(), Error> {
        let (Some(wait), Some(acked)) = (&self.inner.wait, replicas) else { return Ok(()) };
        if acked >= i64::from(wait.replicas) {
            return Ok(());
        }
        Err(Error::Unavailable {
            store: self.describe(),
            op,
            reason: format!(
                "the write reached {acked} of the {} replicas asked for within {:?} (WAIT), so a failover \
                 could lose it; check the replicas (INFO replication) or lower wait_for_replicas",
                wait.replicas, wait.timeout
            ),
            source: None,
        })
    }

    /// [`transition`](Self::transition) of a write a caller acts on: a transition made is an
    /// error unless it reached the replicas asked for.
    pub(super) fn written_transition(
        &self,
        op: &'static str,
        key: &Key,
        written: Written,
    ) -> Result<Transition, Error> {
        let transition = self.transition(key, written.reply)?;
        if transition == Transition::Ok {
            self.replicated(op, written.replicas)?;
        }
        Ok(transition)
    }

    /// What a transition script answered: 1, the transition was made; 0, the token no longer
    /// holds the key.
    pub(super) fn transition(&self, key: &Key, value: Value) -> Result<Transition, Error> {
        match value {
            Value::Int(1) => Ok(Transition::Ok),
            Value::Int(0) => Ok(Transition::LeaseLost),
            other => Err(Self::corrupt(key, format!("unexpected script reply {other:?}"))),
        }
    }
}

impl Store for RedisStore {
    fn acquire_labeled<'a>(
        &'a self,
        key: &'a Key,
        fingerprint: &'a Fingerprint,
        lease: Duration,
        retention: Duration,
        labels: Labels<'a>,
    ) -> BoxFuture<'a, Result<Acquire, Error>> {
        Box::pin(async move {
            arg::check_labels(&labels)?;
            let token = Token::unique();
            let res = self.acquire_for(key, fingerprint, &token, millis(lease), millis(retention), &labels).await;
            if let Ok(answer) = &res {
                self.inner.order.learn(answer);
            }
            if let Err(e) = &res
                && e.is_store_failure()
            {
                self.release_orphan(*key, token);
            }
            res
        })
    }

    fn complete<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
        result: Bytes,
        retention: Duration,
    ) -> BoxFuture<'a, Result<Transition, Error>> {
        Box::pin(async move {
            // Stamped with the estimate of the server's clock, as `SET NX` stamps a new record:
            // a `TIME` inside the script costs Redis more than the rest of the check. Without a
            // fresh estimate the script reads `TIME`.
            let updated = self.known_server_micros().map(|us| us / 1000);
            // Without a fresh estimate of the clock the script reads `TIME` (`native.rs`).
            if let (Some(kept), Some(updated)) = (self.inner.native.take(token), updated)
                && let Some(done) = self.complete_native(key, &kept, &result, updated, retention).await?
            {
                return Ok(done);
            }
            let args = [
                Arg::Bytes(token.as_str().as_bytes()),
                Arg::Bytes(&result),
                Arg::Millis(millis(retention)),
                Arg::Time(updated),
            ];
            let written = self.invoke_written("complete", &self.inner.scripts.complete, key, &args).await?;
            self.written_transition("complete", key, written)
        })
    }

    fn release<'a>(&'a self, key: &'a Key, token: &'a Token) -> BoxFuture<'a, Result<Transition, Error>> {
        Box::pin(async move {
            self.inner.native.forget(token);
            let reply = self
                .invoke("release", &self.inner.scripts.release, key, &[Arg::Bytes(token.as_str().as_bytes())])
                .await?;
            self.transition(key, reply)
        })
    }

    fn renew<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
        lease: Duration,
    ) -> BoxFuture<'a, Result<Transition, Error>> {
        Box::pin(async move {
            // Renewed, the record is no longer the one `SET NX` wrote.
            self.inner.native.forget(token);
            let args = [Arg::Bytes(token.as_str().as_bytes()), Arg::Millis(millis(lease))];
            // Waited for too, when the store waits: a renewal a failover loses would leave the
            // promoted replica's lease shorter than the holder counts it.
            let written = self.invoke_written("renew", &self.inner.scripts.renew, key, &args).await?;
            self.written_transition("renew", key, written)
        })
    }

    fn abandon<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
        mark: Abandon,
    ) -> BoxFuture<'a, Result<Transition, Error>> {
        Box::pin(async move {
            self.inner.native.forget(token);
            // The state the record goes to.
            let to = match mark {
                Abandon::Uncertain => RELEASED,
                Abandon::NeedsAttention => NEEDS_ATTENTION,
            };
            let args = [Arg::Bytes(token.as_str().as_bytes()), Arg::Bytes(&[to])];
            let written = self.invoke_written("abandon", &self.inner.scripts.abandon, key, &args).await?;
            self.written_transition("abandon", key, written)
        })
    }

    fn resolve<'a>(&'a self, key: &'a Key, resolution: Resolution) -> BoxFuture<'a, Result<Resolved, Error>> {
        Box::pin(async move {
            let script = &self.inner.scripts.resolve;
            // The state the record goes to, and its TTL.
            let reply = match &resolution {
                Resolution::Done { outcome, retention } => {
                    let args = [Arg::Bytes(&[DONE]), Arg::Millis(millis(*retention)), Arg::Bytes(outcome)];
                    self.invoke_written("resolve", script, key, &args).await?
                }
                Resolution::NotDone => {
                    let args = [Arg::Bytes(&[RELEASED]), Arg::Millis(millis(KEEP_RESOLVED_RELEASE))];
                    self.invoke_written("resolve", script, key, &args).await?
                }
            };
            match reply.reply {
                Value::Int(1) => {
                    self.replicated("resolve", reply.replicas)?;
                    Ok(Resolved::Ok)
                }
                Value::Int(0) => Ok(Resolved::Unchanged),
                other => Err(Self::corrupt(key, format!("unexpected resolve reply {other:?}"))),
            }
        })
    }

    fn describe(&self) -> String {
        self.inner.describe.clone()
    }

    fn inspect<'a>(&'a self, key: &'a Key) -> BoxFuture<'a, Result<Option<RecordInfo>, Error>> {
        Box::pin(self.inspect_record(key))
    }

    fn scan<'a>(&'a self, filter: &'a Filter, cursor: &'a Cursor, limit: usize) -> BoxFuture<'a, Result<Page, Error>> {
        Box::pin(self.scan_page(filter, cursor, limit))
    }

    fn release_fenced<'a>(&'a self, key: &'a Key, fence: u64) -> BoxFuture<'a, Result<Resolved, Error>> {
        Box::pin(async move {
            let script = &self.inner.scripts.release_fenced;
            let fence = fence.to_string();
            let written = self.invoke_written("release_fenced", script, key, &[Arg::Bytes(fence.as_bytes())]).await?;
            match written.reply {
                Value::Int(1) => {
                    self.replicated("release_fenced", written.replicas)?;
                    Ok(Resolved::Ok)
                }
                Value::Int(0) => Ok(Resolved::Unchanged),
                other => Err(Self::corrupt(key, format!("unexpected release_fenced reply {other:?}"))),
            }
        })
    }

    fn delete<'a>(&'a self, key: &'a Key) -> BoxFuture<'a, Result<Deleted, Error>> {
        Box::pin(async move {
            let written = self.invoke_written("delete", &self.inner.scripts.delete, key, &[]).await?;
            match written.reply {
                Value::Int(1) => {
                    self.replicated("delete", written.replicas)?;
                    Ok(Deleted::Ok)
                }
                Value::Int(0) => Ok(Deleted::Absent),
                Value::Int(2) => Ok(Deleted::Running),
                other => Err(Self::corrupt(key, format!("unexpected delete reply {other:?}"))),
            }
        })
    }

    fn kind(&self) -> &'static str {
        "redis"
    }
}
