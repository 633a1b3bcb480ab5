//! The Redis store, on deadpool-redis, for standalone Redis, Redis Cluster and Redis Sentinel.
//!
//! This file holds [`RedisStore`] and how it is made; around it, `acquire` its acquire path,
//! `store` the [`Store`](super::Store) implementation (the transitions and the admin writes),
//! `admin` and `reads` the reads of records (`inspect` and `scan`; acquire's plain reads,
//! batched), `builder` its settings, `preflight` the start-up check of the server, `conn`
//! connections and transport, `script` the Lua scripts and how they are called (a function
//! library, or `EVALSHA`), `sentinel` how a store through Sentinel finds its master, `clock`
//! the estimate of the server's clock that fences keys taken by `SET NX`, `native` the plain
//! completion where the server compares and sets (`SET … IFEQ`), `arg` the arguments written
//! into commands, `redact` URLs without their passwords, and `layout` (with `layout.lua`, the
//! prelude of every script) where each field of a record sits.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

#[cfg(feature = "cluster")]
use deadpool_redis::cluster;

use self::clock::ServerClock;
use self::conn::{Connections, Pool, Wait};
use self::script::Scripts;
use super::AcquireOrder;
use crate::error::Error;
use crate::key::Key;

mod acquire;
mod admin;
mod arg;
mod builder;
mod clock;
mod conn;
#[doc(hidden)]
pub mod layout;
mod native;
mod preflight;
mod reads;
mod redact;
pub(crate) mod script;
#[cfg(feature = "sentinel")]
pub(crate) mod sentinel;
mod store;

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

/// A [`Store`](super::Store) on Redis: one string key per operation, one command per transition.
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
/// why it is so, is documented in `layout.rs` and `layout.lua`);
/// a done record costs the result and its labels plus 190 bytes.
/// [`Store::inspect`](super::Store::inspect) and [`Store::scan`](super::Store::scan) read
/// records with the `read` script (`scan`: `SCAN … MATCH <prefix>*` on the
/// server, or on each cluster master in turn, never `KEYS`). A record's TTL is its expiry as the
/// record protocol sets it ([retention](crate::record#retention)); a record that needs attention
/// ([`Abandon::NeedsAttention`](crate::record::Abandon::NeedsAttention)) has none: it stays
/// until [resolved](super::Store::resolve). A key that
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
/// call there fails closed (`READONLY`); build a new store on the new master's URL, connect
/// through a proxy that follows the master, or let the store ask Sentinel.
///
/// **Redis Sentinel** (feature `sentinel`, [`RedisStore::sentinel_builder`]): every connection
/// the store opens asks the sentinels for the master (and checks its `ROLE`), so it follows a
/// failover as far as its connections do. A connection that broke (the master died, or a
/// sentinel demoted it and closed its clients' connections) or that answers `READONLY` (the
/// master was demoted by hand) is replaced by one to the master the sentinels name then, and
/// the call is sent once more; while they name none (between a crash and the promotion), calls
/// fail closed within the command timeout. What Sentinel gives is that discovery: it is not
/// consensus, and it fences nothing. A crash loses what the master had not sent to its replica,
/// as on a cluster. And an old master that is still alive (`SENTINEL FAILOVER`, a partition)
/// keeps taking writes until a sentinel demotes it, which Sentinel does only a few of its
/// periods after the switch; the store's connections to it still work, so its calls go there
/// meanwhile and every write of that window is lost at the demotion (thousands in the measure
/// of RELIABILITY.md). With [`RedisStoreBuilder::wait_for_replicas`] those writes fail
/// instead (the old master has lost its replica), and a crash failover to the one replica loses
/// no acknowledged acquire or completion; the server's own `min-replicas-to-write` bounds the
/// window for every client. RELIABILITY.md has the figures.
///
/// At start-up, `store.preflight().await?.ensure()?` fails when the server's settings break
/// the guarantee (see [`RedisStore::preflight`]).
///
/// ```no_run
/// use idempotent_core::RedisStore;
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), idempotent_core::Error> {
/// let store = RedisStore::builder("redis://127.0.0.1:6379")
///     .pool_size(32)
///     .command_timeout(std::time::Duration::from_millis(500))
///     .key_prefix("payments:idem:")
///     .connect()
///     .await?;
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
    /// [`RedisStoreBuilder::native_compare_and_set`].
    native: bool,
}

impl Sending {
    /// The builder's defaults.
    const DEFAULT: Sending = Sending { set_get: true, functions: true, wait: None, native: true };
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
    /// Completions by `SET … IFEQ` where the server has it (`native.rs`).
    native: native::Native,
}

impl RedisStore {
    /// Connects to standalone Redis (or a proxy) at `url` with the default settings: see
    /// [`RedisStoreBuilder::connect`], and [`RedisStore::builder`] for the settings.
    pub async fn connect(url: impl Into<String>) -> Result<RedisStore, Error> {
        Self::builder(url).connect().await
    }

    /// A store on standalone Redis at `url` with the default settings, connecting on first use
    /// (see [`RedisStoreBuilder::connect_lazy`]).
    pub fn connect_lazy(url: impl Into<String>) -> Result<RedisStore, Error> {
        Self::builder(url).connect_lazy()
    }

    /// A store on a deadpool pool of the application's, with the default settings; connects as
    /// [`RedisStoreBuilder::connect`] does. See [`builder_with_pool`](Self::builder_with_pool).
    pub async fn from_pool(pool: deadpool_redis::Pool) -> Result<RedisStore, Error> {
        Self::builder_with_pool(pool).connect().await
    }

    /// Starts configuring a store on standalone Redis (or a proxy) at `url`.
    pub fn builder(url: impl Into<String>) -> RedisStoreBuilder {
        RedisStoreBuilder::on_url(url.into())
    }

    /// Starts configuring a store on a deadpool pool of the application's.
    ///
    /// The store keeps some of the pool's connections checked out for its calls (half of them,
    /// at least one, unless [`pool_size`](RedisStoreBuilder::pool_size) says otherwise) — they
    /// are multiplexed, so they serve any number of concurrent calls — and leaves the rest to
    /// the application. Calls are bounded by the builder's
    /// [`command_timeout`](RedisStoreBuilder::command_timeout); note that redis-rs connections
    /// carry a response timeout of their own (500 ms by default) unless the pool's manager was
    /// built with `deadpool_redis::Manager::new_with_config`.
    pub fn builder_with_pool(pool: deadpool_redis::Pool) -> RedisStoreBuilder {
        RedisStoreBuilder::on_pool(pool)
    }

    /// Starts configuring a store on Redis Cluster, given one or more seed nodes.
    #[cfg(feature = "cluster")]
    pub fn cluster_builder<I, S>(urls: I) -> RedisStoreBuilder
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        RedisStoreBuilder::on_cluster(urls.into_iter().map(Into::into).collect())
    }

    /// Starts configuring a store on the master that the sentinels at `sentinel_urls` (each
    /// `redis://host:port`, with the sentinel's own credentials if it needs any) monitor as
    /// `master_name`, finished by [`connect`](RedisStoreBuilder::connect) or
    /// [`connect_lazy`](RedisStoreBuilder::connect_lazy).
    ///
    /// Every connection the store opens asks the sentinels for the master first (redis-rs
    /// checks with `ROLE` that it is one), so after a failover the store's new connections go to
    /// the promoted replica: a connection that broke (the master died, or a sentinel demoted it
    /// and closed its clients' connections), or that the old master answers `READONLY` on (it
    /// was demoted by hand), is replaced by one to whichever master the sentinels name then.
    /// While they name none (the master is down and no replica promoted yet), calls fail closed
    /// within the command timeout: nothing runs. A connection to an old master that is still
    /// alive and not yet demoted keeps working, and its writes are lost at the demotion. What a
    /// failover can lose, and what [`wait_for_replicas`](RedisStoreBuilder::wait_for_replicas)
    /// keeps: see "Replication and failover" in [`RedisStore`]'s docs.
    ///
    /// The master is reached over plain TCP without credentials, on database 0.
    ///
    /// ```no_run
    /// use idempotent_core::RedisStore;
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), idempotent_core::Error> {
    /// let store = RedisStore::sentinel_builder(
    ///     ["redis://sentinel-1:26379", "redis://sentinel-2:26379", "redis://sentinel-3:26379"],
    ///     "mymaster",
    /// )
    /// .command_timeout(std::time::Duration::from_millis(500))
    /// .wait_for_replicas(1, std::time::Duration::from_millis(100))
    /// .connect()
    /// .await?;
    /// # Ok(()) }
    /// ```
    ///
    /// No sentinel URL, an invalid one, or an empty master name is an [`Error::Config`] of
    /// `connect`/`connect_lazy`.
    #[cfg(feature = "sentinel")]
    pub fn sentinel_builder<I, S>(sentinel_urls: I, master_name: impl Into<String>) -> RedisStoreBuilder
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        RedisStoreBuilder::on_sentinel(sentinel_urls.into_iter().map(Into::into).collect(), master_name.into())
    }

    /// Starts configuring a store on a deadpool cluster pool of the application's (its
    /// connections shared as in [`builder_with_pool`](Self::builder_with_pool)).
    #[cfg(feature = "cluster")]
    pub fn cluster_builder_with_pool(pool: cluster::Pool) -> RedisStoreBuilder {
        RedisStoreBuilder::on_cluster_pool(pool)
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
        let Sending { set_get, functions, wait, native } = sending;
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
                native: native::Native::new(native),
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

    /// Opens the store's connections, loads its scripts, measures the server's clock and finds
    /// out whether the server compares and sets
    /// ([`native_compare_and_set`](RedisStoreBuilder::native_compare_and_set)), so that the first
    /// calls do not pay for it. Optional: all of it otherwise happens on first use
    /// ([`RedisStoreBuilder::connect`] runs it). Run it at start-up, with
    /// [`preflight`](Self::preflight), to fail fast on a wrong URL.
    pub async fn warm_up(&self) -> Result<(), Error> {
        self.open_all(&self.inner.scripts.all()).await?;
        self.sync_clock().await
    }

    fn corrupt(key: &Key, detail: impl Into<String>) -> Error {
        Error::Corrupt { key: key.short().to_string(), detail: detail.into() }
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
