//! The Redis store, on deadpool-redis, for standalone Redis and Redis Cluster.
//!
//! This file holds [`RedisStore`] and its acquire path; around it, `builder` its settings,
//! `preflight` the start-up check of the server, `conn` connections and transport, `script` the
//! Lua scripts and how they are called (a function library, or `EVALSHA`), `clock` the
//! estimate of the server's clock that fences keys taken by `SET NX`, `arg` the arguments
//! written into commands, and `layout` (with `layout.lua`, the prelude of every script) where
//! each field of a record sits.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
#[cfg(feature = "cluster")]
use deadpool_redis::cluster;
use deadpool_redis::redis::Value;

use self::arg::{Arg, millis};
use self::clock::ServerClock;
use self::conn::{Connections, Pool, Wait, Written};
use self::layout::{
    ATTEMPT, DONE, FENCE, FINGERPRINT, LEASE, MAX_FENCE, NEEDS_ATTENTION, NEW, RECOVERED, RELEASED, RUNNING, STATE,
    TOKEN,
};
use self::script::Scripts;
use super::admin::{Cursor, Deleted, Filter, Page, RecordInfo};
use super::{AcquireOrder, BoxFuture, Store};
use crate::attempt::Attempt;
use crate::error::Error;
use crate::key::{Fingerprint, Key};
use crate::record::{Abandon, Acquire, Grant, KEEP_RESOLVED_RELEASE, Labels, Resolution, Resolved, Token, Transition};

mod admin;
mod arg;
mod builder;
mod clock;
mod conn;
#[doc(hidden)]
pub mod layout;
mod preflight;
mod reads;
pub(crate) mod script;

pub use self::builder::RedisStoreBuilder;
pub use self::preflight::{Preflight, Problem, Risk};

/// The scripts' sources, each behind the layout prelude (`layout.lua`), so that every script
/// reads the record through the same names (`script` makes the library of functions from
/// them), and the library's name. Public only so that the tests crate can run them by hand; not
/// API.
#[doc(hidden)]
pub mod source {
    macro_rules! with_layout {
        ($script:literal) => {
            concat!(include_str!("layout.lua"), include_str!($script))
        };
    }
    /// `layout.lua`, the prelude.
    pub const LAYOUT: &str = include_str!("layout.lua");
    /// `acquire.lua`.
    pub const ACQUIRE: &str = with_layout!("acquire.lua");
    /// `complete.lua`.
    pub const COMPLETE: &str = with_layout!("complete.lua");
    /// `release.lua`.
    pub const RELEASE: &str = with_layout!("release.lua");
    /// `renew.lua`.
    pub const RENEW: &str = with_layout!("renew.lua");
    /// `abandon.lua`.
    pub const ABANDON: &str = with_layout!("abandon.lua");
    /// `resolve.lua`.
    pub const RESOLVE: &str = with_layout!("resolve.lua");
    /// `read.lua`.
    pub const READ: &str = with_layout!("read.lua");
    /// `release_fenced.lua`.
    pub const RELEASE_FENCED: &str = with_layout!("release_fenced.lua");
    /// `delete.lua`.
    pub const DELETE: &str = with_layout!("delete.lua");
    /// Every script.
    pub const ALL: [&str; 9] = [ACQUIRE, COMPLETE, RELEASE, RENEW, ABANDON, RESOLVE, READ, RELEASE_FENCED, DELETE];
    pub use super::script::library_name;
}

/// A [`Store`] on Redis: one string key per operation, one command per transition.
///
/// An acquire is one plain `SET key <record> NX GET PX <ttl>` (Redis 7.0+, Valkey): it takes an
/// absent key, and otherwise returns the record that is there, so a first acquisition and a
/// replay cost Redis no more than a `SET` or a `GET` (a record that needs attention is answered
/// from what that returns too). Only a key found running or released goes on to the `acquire`
/// Lua script, which judges the lease by the server's clock. Complete, release, renew, abandon
/// and resolve are one script each: functions of one library (`FCALL`, the library loaded on
/// first use and again when the server lost it), or by `EVALSHA` where the server refuses
/// functions or [`RedisStoreBuilder::functions`] is off. On a server before
/// Redis 7.0, or with [`RedisStoreBuilder::set_get_acquire`] off, every acquire is the script.
///
/// Commands go out on a few multiplexed connections the store keeps checked out of its deadpool
/// pool (see [`RedisStoreBuilder::pool_size`]); a connection is never held exclusively, so no
/// call waits for an action to finish. Every call is bounded by the command timeout (default
/// 2 s), which covers connecting too; a call that fails or times out returns an error, and the
/// executor then does not run the action. A connection found dead is replaced and the call tried
/// once more: every command is idempotent for its owner token, so a retried call cannot act
/// twice. After an acquire that failed once it may have reached Redis (a timeout, a dropped
/// connection), the store releases the key that acquire may have taken, from a task of its own,
/// at once and once more a command timeout later (a late copy of the acquire then finds its
/// token's released record and changes nothing): without it, a key nobody holds would stay
/// blocked for a lease.
///
/// **Round trips.** A first execution is two commands (`SET … NX GET`, the `complete`
/// function), a replay one; an acquire that finds a running or released record of its payload
/// one more (the `acquire` function), a heartbeat one `renew` per third of the lease. After a run
/// of replays acquire sends a plain `GET` first (the learnt order of `store/acquire_order.rs`):
/// a replay is then that `GET`, which costs Redis less than `SET … NX GET` and sends no record,
/// and a first execution is three commands until first executions in a row switch the order back.
///
/// Records are keyed `{prefix}{64 hex digits of the key}` (prefix `idem:` by default): one key
/// per operation, so Redis Cluster never sees a cross-slot script. Leases are judged by the
/// server: by its clock (`TIME`) in the scripts, and for a record `SET NX` wrote, by the key's
/// TTL. Fences grow with every acquisition of a key;
/// a key taken by `SET NX` gets the server's clock in microseconds as its fence, estimated from
/// this process's monotonic clock and an offset measured with `TIME` in the background every
/// minute (until the first measure lands, acquires take the script path), so a key's fences
/// keep growing even when its record is lost, to within the offset's error: half a round trip,
/// plus a minute's drift between the two clocks (on a cluster, plus the skew between the node
/// that answered `TIME` and the key's node). A record is one string: a fixed-width header
/// (state, fingerprint, owner token, lease, fence, attempt, created and updated times, the
/// labels' lengths), the labels' text, then the stored result once it is done (the layout, and
/// why it is so, is documented in `layout.rs` and `layout.lua`; records of the earlier layout,
/// without labels, are still read);
/// a done record costs the result and its labels plus 190 bytes. [`Store::inspect`] and
/// [`Store::scan`] read records with the `read` script (`scan`: `SCAN … MATCH <prefix>*` on the
/// server, or on each cluster master in turn, never `KEYS`). A record's TTL is its expiry as the
/// record protocol sets it ([retention](crate::record#retention)); a record that needs attention
/// ([`Abandon::NeedsAttention`]) has none: it stays until [resolved](Store::resolve). A key that
/// holds anything else (another type, a string this store did not write) is answered with
/// [`Error::Corrupt`], never a replay or a second run.
///
/// **Replication and failover.** On Redis Cluster the store follows a failover by itself:
/// redirects (`MOVED`, `ASK`) and a refreshed slot map lead it to the new master, dead
/// connections are replaced, and a call made while its shard has no master fails closed within
/// the command timeout (nothing runs). Redis replicates asynchronously, so a failover can lose
/// writes the old master acknowledged: a clean `CLUSTER FAILOVER` loses none (the replica
/// catches up first); a crashed master loses what it had not yet sent to its replica; a master
/// cut off from the cluster keeps taking writes until it learns it was replaced, then drops
/// them. By default, a lost completion means the next call runs the action again, so it runs
/// twice and callers may have seen two results; a lost acquire lets a second worker take the
/// key while the first one still runs. The fence still protects downstream then: the second
/// worker's fence is higher (a new record's fence is at least the server's clock in
/// microseconds, to within the clock skew between the two nodes), so a system that rejects stale
/// fences refuses the first worker's writes, and the store refuses its completion. With
/// [`RedisStoreBuilder::wait_for_replicas`] (one replica per master, `WAIT 1`), callers act
/// only on acquires and completions the replica has acknowledged, so a failover to that replica
/// loses none of them; a write whose `WAIT` fell short is reported (an acquire fails, a
/// completion is possibly unstored), and with more replicas than waited for, the one promoted
/// may still lack a write. On standalone Redis the store keeps the URL it was built with: after
/// a replica is promoted (by hand or by Sentinel) and the old master becomes a replica, every
/// call there fails closed (`READONLY`); build a new store on the new master's URL (on
/// Sentinel's `+switch-master`), or connect through a proxy that follows the master.
/// RELIABILITY.md has the figures.
///
/// At start-up, `store.preflight().await?.ensure()?` fails when the server's settings break
/// the guarantee (see [`RedisStore::preflight`]).
///
/// ```no_run
/// use idempotent_core::RedisStore;
///
/// # fn main() -> Result<(), idempotent_core::Error> {
/// let store = RedisStore::builder("redis://127.0.0.1:6379")
///     .pool_size(32)
///     .command_timeout(std::time::Duration::from_millis(500))
///     .key_prefix("payments:idem:")
///     .build()?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RedisStore {
    inner: Arc<Inner>,
}

/// How the store sends its calls: the builder's settings for it.
#[derive(Debug, Clone, Copy)]
struct Sending {
    /// [`RedisStoreBuilder::set_get_acquire`].
    set_get: bool,
    /// [`RedisStoreBuilder::functions`].
    functions: bool,
    /// [`RedisStoreBuilder::wait_for_replicas`].
    wait: Option<Wait>,
}

impl Sending {
    /// The builder's defaults.
    const DEFAULT: Sending = Sending { set_get: true, functions: true, wait: None };
}

struct Inner {
    conns: Connections,
    prefix: String,
    timeout: Duration,
    scripts: Scripts,
    describe: String,
    /// Whether acquire tries a plain `SET NX GET` first (see [`RedisStoreBuilder::set_get_acquire`]);
    /// turned off for good when the server refuses that form of `SET` (before Redis 7.0).
    set_get: AtomicBool,
    /// Whether acquire sends a plain `GET` first ([`AcquireOrder`]).
    order: AcquireOrder,
    clock: ServerClock,
    /// The `WAIT` behind every write a caller acts on (see
    /// [`RedisStoreBuilder::wait_for_replicas`]); `None`: no waiting.
    wait: Option<Wait>,
    /// Acquire's plain reads: how many are out, and those waiting to go out together.
    reads: reads::Reads,
}

impl RedisStore {
    /// Starts configuring a store on standalone Redis (or a proxy) at `url`.
    pub fn builder(url: impl Into<String>) -> RedisStoreBuilder {
        RedisStoreBuilder::new(vec![url.into()], false)
    }

    /// Starts configuring a store on Redis Cluster, given one or more seed nodes.
    #[cfg(feature = "cluster")]
    pub fn cluster_builder<I, S>(urls: I) -> RedisStoreBuilder
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        RedisStoreBuilder::new(urls.into_iter().map(Into::into).collect(), true)
    }

    /// A store on standalone Redis at `url`, with default settings.
    pub fn connect(url: impl Into<String>) -> Result<RedisStore, Error> {
        Self::builder(url).build()
    }

    /// A store on an existing deadpool pool.
    ///
    /// The store keeps half of the pool's connections (at least one) checked out for its calls —
    /// they are multiplexed, so they serve any number of concurrent calls — and leaves the rest
    /// to the application. Calls are bounded by `timeout`; note that redis-rs connections carry a
    /// response timeout of their own (500 ms by default) unless the pool's manager was built with
    /// `deadpool_redis::Manager::new_with_config`.
    pub fn from_pool(pool: deadpool_redis::Pool, prefix: impl Into<String>, timeout: Duration) -> RedisStore {
        let size = (pool.status().max_size / 2).max(1);
        RedisStore::from_parts(
            Pool::Single(pool),
            prefix.into(),
            timeout,
            "redis (pool)".to_owned(),
            size,
            Sending::DEFAULT,
        )
    }

    /// A store on an existing deadpool cluster pool (half of its connections kept, as in
    /// [`from_pool`](Self::from_pool)).
    #[cfg(feature = "cluster")]
    pub fn from_cluster_pool(pool: cluster::Pool, prefix: impl Into<String>, timeout: Duration) -> RedisStore {
        let size = (pool.status().max_size / 2).max(1);
        RedisStore::from_parts(
            Pool::Cluster(pool),
            prefix.into(),
            timeout,
            "redis cluster (pool)".to_owned(),
            size,
            Sending::DEFAULT,
        )
    }

    /// `size` is how many connections the store keeps checked out of `pool`.
    fn from_parts(
        pool: Pool,
        prefix: String,
        timeout: Duration,
        describe: String,
        size: usize,
        sending: Sending,
    ) -> RedisStore {
        let Sending { set_get, functions, wait } = sending;
        RedisStore {
            inner: Arc::new(Inner {
                conns: Connections::new(pool, size),
                prefix,
                timeout,
                scripts: Scripts::new(functions),
                describe,
                set_get: AtomicBool::new(set_get),
                order: AcquireOrder::default(),
                clock: ServerClock::default(),
                wait,
                reads: reads::Reads::default(),
            }),
        }
    }

    /// The Redis key that holds the record of `key`.
    pub fn redis_key(&self, key: &Key) -> String {
        let mut s = String::with_capacity(self.inner.prefix.len() + 64);
        s.push_str(&self.inner.prefix);
        key.push_hex(&mut s);
        s
    }

    /// The prefix of the store's keys (the state store keys its states under it too).
    pub(crate) fn key_prefix(&self) -> &str {
        &self.inner.prefix
    }

    /// Opens the store's connections, loads its scripts and measures the server's clock, so
    /// that the first calls do not pay for it. Optional: all of it otherwise happens on first
    /// use. Run it at start-up, with [`preflight`](Self::preflight), to fail fast on a wrong URL.
    pub async fn warm_up(&self) -> Result<(), Error> {
        self.open_all(&self.inner.scripts.all()).await?;
        self.sync_clock().await
    }

    /// After an acquire that failed on the way (a timeout, a dropped connection), the server may
    /// still have taken the key for `token`, which nobody will use: the caller got an error and
    /// ran nothing. Left alone, that would keep the key for a whole lease. A task of its own
    /// releases it instead: once at once, and once more a command timeout later, in case the
    /// acquire reached the server only after the first release. Releasing is safe whatever
    /// happened: it acts only on a record this token still holds, and a late acquire with the
    /// same token finds its token's `released` record and changes nothing.
    fn release_orphan(&self, key: Key, token: Token) {
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

    fn corrupt(key: &Key, detail: impl Into<String>) -> Error {
        Error::Corrupt { key: key.short(), detail: detail.into() }
    }

    /// Acquire's work for `token`: one `SET NX GET` (after a `GET` when the store reads first),
    /// then the acquire script only for a record they cannot judge (or for every acquire when the
    /// plain path is off or has no clock).
    async fn take(
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
            let record = Arg::New { fp: &fp, token, threshold: ttl - lease, fence, labels };
            match self.set_get(key, record, ttl).await {
                Ok(Written { reply: Value::Nil, replicas }) => {
                    self.replicated("acquire", replicas)?;
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

    /// With [`RedisStoreBuilder::wait_for_replicas`]: a store failure when the write a caller
    /// would act on reached fewer replicas than asked for (`replicas`, `WAIT`'s answer).
    fn replicated(&self, op: &'static str, replicas: Option<i64>) -> Result<(), Error> {
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
        // A done record (this layout's or an earlier release's): the result after its labels.
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

    /// [`transition`](Self::transition) of a write a caller acts on: a transition made is an
    /// error unless it reached the replicas asked for.
    fn written_transition(&self, op: &'static str, key: &Key, written: Written) -> Result<Transition, Error> {
        let transition = self.transition(key, written.reply)?;
        if transition == Transition::Ok {
            self.replicated(op, written.replicas)?;
        }
        Ok(transition)
    }

    fn transition(&self, key: &Key, value: Value) -> Result<Transition, Error> {
        match value {
            Value::Int(1) => Ok(Transition::Ok),
            Value::Int(0) => Ok(Transition::LeaseLost),
            other => Err(Self::corrupt(key, format!("unexpected script reply {other:?}"))),
        }
    }
}

fn int(v: Option<&Value>) -> Option<i64> {
    match v {
        Some(Value::Int(i)) => Some(*i),
        _ => None,
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
            let res = self.take(key, fingerprint, &token, millis(lease), millis(retention), &labels).await;
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

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("url", &self.inner.describe)
            .field("prefix", &self.inner.prefix)
            .field("timeout", &self.inner.timeout)
            .finish()
    }
}
