//! The [`Store`] implementation of [`SqlStore`], once for both databases: acquire (its read,
//! its upsert, what a failed or dropped one leaves to release), the owner's transitions and the
//! admin calls. The statements are in the [module docs](super#statements-per-transition).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use sqlx::SqlStr;
use tokio::time::Instant;

use super::SqlStore;
use super::backend::{Backend, Effect, Failed};
use super::driver::{Driver, Value};
use super::rows::{OwnedLabels, deleted, page};
use super::statements::micros;
use crate::error::Error;
use crate::key::{Fingerprint, Key};
use crate::lease::FinishOnDrop;
use crate::record::{Abandon, Acquire, KEEP_RESOLVED_RELEASE, Labels, Resolution, Resolved, Token, Transition};
use crate::store::admin::{Cursor, Deleted, Filter, Page, RecordInfo};
use crate::store::{BoxFuture, Store};

/// How often acquire runs its upsert when the record keeps changing under it (PostgreSQL: the
/// statement's read and its write saw different rows) or the database rolled it back.
const ACQUIRE_TRIES: u32 = 8;
/// How often the release after a failed acquire is tried before the lease is left to run out.
const ORPHAN_TRIES: u32 = 32;

/// The argument a transition binds after the key and the token.
enum Arg {
    /// complete: the outcome and its retention.
    Result(Bytes, Duration),
    /// renew: the new lease.
    Lease(Duration),
}

/// What the resolve statement writes over a `needs_attention` row: its new state, its result, and
/// how long from now it is kept.
fn resolved_row(resolution: Resolution) -> (&'static str, Option<Bytes>, i64) {
    match resolution {
        Resolution::Done { outcome, retention } => ("done", Some(outcome), micros(retention)),
        Resolution::NotDone => ("released", None, micros(KEEP_RESOLVED_RELEASE)),
    }
}

/// The values an owner's transition binds: key, token, then its [`Arg`].
fn transition_args<'a>(key: &'a Key, token: &'a Token, arg: Option<&'a Arg>) -> impl Iterator<Item = Value<'a>> + Send {
    let head = [Value::Bytes(&key.as_bytes()[..]), Value::Text(token.as_str())];
    let tail = match arg {
        Some(Arg::Result(result, retention)) => [Some(Value::Bytes(&result[..])), Some(Value::Int(micros(*retention)))],
        Some(Arg::Lease(lease)) => [Some(Value::Int(micros(*lease))), None],
        None => [None, None],
    };
    head.into_iter().chain(tail.into_iter().flatten())
}

/// An acquire in flight. Dropped before it answered (a timeout around the step, a caller that
/// went away), it goes on in a task of its own: the statement may already be running on its
/// connection, and only once it has ended can the key it may have taken be released. The work
/// reads `abandoned` to know whether anyone will use what it took.
struct AcquireCall<F: Future + Send + 'static> {
    abandoned: Arc<AtomicBool>,
    work: FinishOnDrop<F>,
}

impl<F: Future + Send + 'static> Future for AcquireCall<F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        Pin::new(&mut self.work).poll(cx)
    }
}

impl<F: Future + Send + 'static> Drop for AcquireCall<F> {
    fn drop(&mut self) {
        // Runs before `work` is dropped (and handed to a task), so that the task sees the flag.
        self.abandoned.store(true, Ordering::Release);
    }
}

impl<B: Backend> SqlStore<B> {
    /// Acquire's work for `token`: the read when the store reads first, then the upsert, run
    /// again while the record changes between its read and its write.
    async fn acquire_for(
        &self,
        key: &Key,
        fp: &Fingerprint,
        token: &Token,
        lease: Duration,
        retention: Duration,
        labels: &OwnedLabels,
    ) -> Result<Acquire, Failed> {
        let inner = &self.inner;
        if inner.order.read_first() {
            // A read takes nothing, so its failure leaves nothing to release.
            let row = B::read_optional(self, "acquire", &inner.sql.acquire_read, [Value::Bytes(&key.as_bytes()[..])])
                .await
                .map_err(|f| Failed::not_sent(f.error))?;
            if let Some(row) = row {
                let found = B::found(key, &row).map_err(Failed::not_sent)?;
                if found.decides(fp) {
                    // Another attempt's row (the token is fresh): never `Acquired`.
                    return found.judge(key, fp, token).map_err(Failed::not_sent);
                }
            }
        }
        for _ in 0..ACQUIRE_TRIES {
            // The values borrow the caller's; a write that waits to go out copies them.
            let args = [
                Value::Bytes(&key.as_bytes()[..]),
                Value::Bytes(&fp.as_bytes()[..]),
                Value::Text(token.as_str()),
                Value::Int(micros(lease)),
                Value::Int(micros(lease.max(retention))),
                Value::Text(labels.step.as_str()),
                Value::OptText(labels.run.as_deref()),
                Value::OptText(labels.tenant.as_deref()),
            ];
            let upsert = B::fetch_optional(self, "acquire", &inner.sql.acquire, args);
            let row = match upsert.await {
                Ok(row) => row,
                // Nothing was committed: run it again on a fresh snapshot.
                Err(Failed { effect: Effect::RolledBack, .. }) => continue,
                Err(failed) => return Err(failed),
            };
            match row {
                // A row of ours that cannot be read was taken all the same.
                Some(row) => {
                    return B::found(key, &row)
                        .and_then(|found| found.judge(key, fp, token))
                        .map_err(|error| Failed { error, effect: Effect::Unknown });
                }
                // Changed between the statement's read and its upsert; nothing was written.
                None => continue,
            }
        }
        Err(Failed::not_sent(Error::Unavailable {
            store: inner.describe.clone(),
            op: "acquire",
            reason: format!("the record changed under each of {ACQUIRE_TRIES} tries"),
            source: None,
        }))
    }

    async fn transition(
        &self,
        op: &'static str,
        sql: &SqlStr,
        key: &Key,
        token: &Token,
        arg: Option<Arg>,
    ) -> Result<Transition, Error> {
        let n = B::execute(self, op, sql, transition_args(key, token, arg.as_ref())).await.map_err(|f| f.error)?;
        Ok(if n == 1 { Transition::Ok } else { Transition::LeaseLost })
    }

    /// The statement of `complete` inside `tx`, not committed
    /// ([`TransactionalStore::complete_in`](super::TransactionalStore::complete_in)).
    pub(super) async fn complete_in(
        &self,
        tx: &mut sqlx::Transaction<'static, B::Db>,
        key: &Key,
        token: &Token,
        result: Bytes,
        retention: Duration,
    ) -> Result<Transition, Error> {
        let arg = Arg::Result(result, retention);
        let args = transition_args(key, token, Some(&arg));
        let n = B::execute_in(self, tx, "complete_in", &self.inner.sql.complete, args).await?;
        Ok(if n == 1 { Transition::Ok } else { Transition::LeaseLost })
    }

    /// After an acquire that failed once its statement was sent, the database may still take
    /// the key for `token` (PostgreSQL: when a paused server resumes, or in a commit whose reply
    /// a crash lost), and nobody will run under it; nor under the key an acquire dropped by its
    /// caller took. A task of its own releases it instead: until the database answers, then
    /// (after a store failure, `store_failure`) once more two timeouts later, once a statement
    /// still under way for the acquire has ended (PostgreSQL's `statement_timeout` is the
    /// timeout).
    fn release_orphan(&self, key: Key, token: Token, store_failure: bool) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else { return };
        let store = self.clone();
        runtime.spawn(async move {
            let timeout = store.inner.timeout;
            let mut answered = false;
            for _ in 0..ORPHAN_TRIES {
                let started = Instant::now();
                match store.transition("release", &store.inner.sql.release_orphan, &key, &token, None).await {
                    Ok(Transition::Ok) => {
                        tracing::debug!(key = %key.short(), store = B::KIND, "idempotent.sql: released the key a failed or dropped acquire took");
                        return;
                    }
                    Ok(Transition::LeaseLost) if answered || !store_failure => return,
                    Ok(Transition::LeaseLost) => {
                        answered = true;
                        tokio::time::sleep(2 * timeout).await;
                    }
                    Err(e) => {
                        if store.inner.pool.is_closed() {
                            return;
                        }
                        tracing::debug!(key = %key.short(), store = B::KIND, error = %e, "idempotent.sql: could not release after a failed or dropped acquire; trying again");
                        tokio::time::sleep_until(started + timeout).await;
                    }
                }
            }
        });
    }

    /// One admin statement that changes a row, answering whether it did.
    async fn resolved(&self, op: &'static str, sql: &SqlStr, args: [Value<'_>; 2]) -> Result<Resolved, Error> {
        let n = B::execute(self, op, sql, args).await.map_err(|f| f.error)?;
        Ok(if n == 1 { Resolved::Ok } else { Resolved::Unchanged })
    }
}

impl<B: Backend> Store for SqlStore<B> {
    fn acquire_labeled<'a>(
        &'a self,
        key: &'a Key,
        fingerprint: &'a Fingerprint,
        lease: Duration,
        retention: Duration,
        labels: Labels<'a>,
    ) -> BoxFuture<'a, Result<Acquire, Error>> {
        let store = self.clone();
        let (key, fingerprint) = (*key, *fingerprint);
        let labels = OwnedLabels::from(labels);
        let abandoned = Arc::new(AtomicBool::new(false));
        let flag = abandoned.clone();
        let work = async move {
            let token = Token::unique();
            match store.acquire_for(&key, &fingerprint, &token, lease, retention, &labels).await {
                Ok(answer) => {
                    store.inner.order.learn(&answer);
                    if let Acquire::Acquired(grant) = &answer {
                        if flag.load(Ordering::Acquire) {
                            // Nobody will run under this grant: give the key back rather than
                            // leave it taken for a whole lease.
                            store.release_orphan(key, grant.token.clone(), false);
                        } else {
                            store.maybe_purge();
                        }
                    }
                    Ok(answer)
                }
                Err(Failed { error, effect }) => {
                    if effect == Effect::Unknown {
                        store.release_orphan(key, token, error.is_store_failure());
                    }
                    Err(error)
                }
            }
        };
        Box::pin(AcquireCall { abandoned, work: FinishOnDrop::new(work) })
    }

    fn complete<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
        result: Bytes,
        retention: Duration,
    ) -> BoxFuture<'a, Result<Transition, Error>> {
        let arg = Some(Arg::Result(result, retention));
        Box::pin(self.transition("complete", &self.inner.sql.complete, key, token, arg))
    }

    fn release<'a>(&'a self, key: &'a Key, token: &'a Token) -> BoxFuture<'a, Result<Transition, Error>> {
        Box::pin(self.transition("release", &self.inner.sql.release, key, token, None))
    }

    fn renew<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
        lease: Duration,
    ) -> BoxFuture<'a, Result<Transition, Error>> {
        Box::pin(self.transition("renew", &self.inner.sql.renew, key, token, Some(Arg::Lease(lease))))
    }

    fn abandon<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
        mark: Abandon,
    ) -> BoxFuture<'a, Result<Transition, Error>> {
        let sql = match mark {
            Abandon::Uncertain => &self.inner.sql.abandon_uncertain,
            Abandon::NeedsAttention => &self.inner.sql.abandon_attention,
        };
        Box::pin(self.transition("abandon", sql, key, token, None))
    }

    fn resolve<'a>(&'a self, key: &'a Key, resolution: Resolution) -> BoxFuture<'a, Result<Resolved, Error>> {
        Box::pin(async move {
            let (state, result, keep_us) = resolved_row(resolution);
            let args = [
                Value::Bytes(&key.as_bytes()[..]),
                Value::Text(state),
                Value::OptBytes(result.as_deref()),
                Value::Int(keep_us),
            ];
            let n = B::execute(self, "resolve", &self.inner.sql.resolve, args).await.map_err(|f| f.error)?;
            Ok(if n == 1 { Resolved::Ok } else { Resolved::Unchanged })
        })
    }

    fn describe(&self) -> String {
        self.inner.describe.clone()
    }

    fn inspect<'a>(&'a self, key: &'a Key) -> BoxFuture<'a, Result<Option<RecordInfo>, Error>> {
        Box::pin(async move {
            let args = [Value::Bytes(&key.as_bytes()[..])];
            let row =
                B::read_optional(self, "inspect", &self.inner.sql.admin.inspect, args).await.map_err(|f| f.error)?;
            row.map(|row| B::Db::record(&row)).transpose()
        })
    }

    fn scan<'a>(&'a self, filter: &'a Filter, cursor: &'a Cursor, limit: usize) -> BoxFuture<'a, Result<Page, Error>> {
        Box::pin(async move {
            let (sql, args) = self.inner.sql.admin.scan(&self.inner.describe, filter, cursor, limit)?;
            let rows = B::fetch_all(self, "scan", &sql, args).await.map_err(|f| f.error)?;
            let records = rows.iter().map(B::Db::record).collect::<Result<Vec<_>, _>>()?;
            Ok(page(records, limit))
        })
    }

    fn release_fenced<'a>(&'a self, key: &'a Key, fence: u64) -> BoxFuture<'a, Result<Resolved, Error>> {
        Box::pin(async move {
            // A fence beyond an i64 is no row's.
            let Ok(fence) = i64::try_from(fence) else { return Ok(Resolved::Unchanged) };
            let args = [Value::Bytes(&key.as_bytes()[..]), Value::Int(fence)];
            self.resolved("release_fenced", &self.inner.sql.admin.release_fenced, args).await
        })
    }

    fn delete<'a>(&'a self, key: &'a Key) -> BoxFuture<'a, Result<Deleted, Error>> {
        Box::pin(async move {
            let args = [Value::Bytes(&key.as_bytes()[..])];
            let row =
                B::fetch_optional(self, "delete", &self.inner.sql.admin.delete, args).await.map_err(|f| f.error)?;
            let kept = match row {
                Some(row) => Some(B::Db::kept(&row).map_err(|e| Error::Corrupt {
                    key: key.short().to_string(),
                    detail: format!("delete answered a column of the wrong type: {e}"),
                })?),
                None => None,
            };
            Ok(deleted(kept))
        })
    }

    fn kind(&self) -> &'static str {
        B::KIND
    }
}
