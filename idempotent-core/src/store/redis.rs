//! The Redis store, on deadpool-redis, for standalone Redis and Redis Cluster.

use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, AtomicUsize, Ordering as AtomicOrdering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use deadpool_redis::Runtime;
#[cfg(feature = "cluster")]
use deadpool_redis::cluster;
use deadpool_redis::redis::{self, Script, Value};

use super::{BoxFuture, Store};
use crate::attempt::Attempt;
use crate::error::{BoxError, Error};
use crate::key::{Fingerprint, Key};
use crate::record::{Acquire, Grant, Token, Transition};

const DEFAULT_PREFIX: &str = "idem:";
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(2);
const DEFAULT_POOL_SIZE: usize = 4;
/// How often the store measures the server's clock again (see [`Inner::clock_offset_us`]).
const CLOCK_RESYNC_US: u64 = 60_000_000;
/// A measure older than this is not used: acquires take the script path until a new one lands.
const CLOCK_STALE_US: u64 = 3 * CLOCK_RESYNC_US;
/// Fences stay below 2^53, where Lua's doubles count exactly.
const MAX_FENCE: u64 = 1 << 53;

struct Scripts {
    acquire: Script,
    complete: Script,
    release: Script,
    renew: Script,
}

impl Scripts {
    fn new() -> Self {
        Scripts {
            acquire: Script::new(include_str!("acquire.lua")),
            complete: Script::new(include_str!("complete.lua")),
            release: Script::new(include_str!("release.lua")),
            renew: Script::new(include_str!("renew.lua")),
        }
    }
}

#[derive(Clone)]
enum Pool {
    Single(deadpool_redis::Pool),
    #[cfg(feature = "cluster")]
    Cluster(cluster::Pool),
}

/// A [`Store`] on Redis: one string key per operation, one command per transition.
///
/// An acquire is one plain `SET key <record> NX GET PX <ttl>` (Redis 7.0+, Valkey): it takes an
/// absent key, and otherwise returns the record that is there, so a first acquisition and a
/// replay cost Redis no more than a `SET` or a `GET`. Only a key found running or released goes
/// on to the `acquire` Lua script, which judges the lease by the server's clock. Complete,
/// release and renew are one script each (`EVALSHA`, reloaded on `NOSCRIPT`). On a server before
/// Redis 7.0, or with [`RedisStoreBuilder::set_get_acquire`] off, every acquire is the script.
///
/// Commands go out on a few multiplexed connections the store keeps checked out of its deadpool
/// pool (see [`RedisStoreBuilder::pool_size`]); a connection is never held exclusively, so no
/// call waits for an action to finish. Every call is bounded by the command timeout (default
/// 2 s), which covers connecting too; a call that fails or times out returns an error, and the
/// executor then does not run the action. A connection found dead is replaced and the call tried
/// once more: every command is idempotent for its owner token, so a retried call cannot act
/// twice.
///
/// Records are keyed `{prefix}{hex digest}`: one key per operation, so Redis Cluster never sees a
/// cross-slot script. Leases are judged by the server: by its clock (`TIME`) in the scripts, and
/// for a record `SET NX` wrote, by the key's TTL. Fences grow with every acquisition of a key;
/// a key taken by `SET NX` gets the server's clock in microseconds as its fence, estimated from
/// this process's monotonic clock and an offset measured with `TIME` in the background every
/// minute (until the first measure lands, acquires take the script path), so a key's fences
/// keep growing even when its record is lost, to within the offset's error: half a round trip,
/// plus a minute's drift between the two clocks (on a cluster, plus the skew between the node
/// that answered `TIME` and the key's node). A record is one string: state, fingerprint and owner
/// token, then the lease, fence and attempt while the operation runs, or the stored result once
/// it is done (the layout is documented in `acquire.lua`); a done record costs the result plus
/// 97 bytes. (Development builds before this layout kept a hash per record; this store answers
/// [`Error::Corrupt`] for such a record, never a replay or a second run, until it expires.)
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

struct Inner {
    pool: Pool,
    /// Connections checked out of the pool and kept (see [`RedisStore::conn`]).
    slots: Box<[Mutex<Option<Held>>]>,
    next: AtomicUsize,
    prefix: String,
    timeout: Duration,
    scripts: Scripts,
    describe: String,
    /// Whether acquire tries a plain `SET NX GET` first (see [`RedisStoreBuilder::set_get_acquire`]);
    /// turned off for good when the server refuses that form of `SET` (before Redis 7.0).
    set_get: AtomicBool,
    /// The server's clock minus this process's monotonic clock ([`monotonic_us`]), in
    /// microseconds, measured with `TIME` in the background (first when an acquire finds it
    /// missing, then every minute): the fence of a key taken by `SET NX` (which cannot read the
    /// server's clock) is the monotonic clock plus this offset. The host's wall clock is never
    /// used, so a step of it changes nothing.
    clock_offset_us: AtomicI64,
    /// When the offset was last measured, on the monotonic clock (0: never). Until there is a
    /// measure, and when the last one is stale, acquires take the script path.
    clock_synced_us: AtomicU64,
    /// A measure is under way.
    clock_syncing: AtomicBool,
}

/// Configures a [`RedisStore`]; made by [`RedisStore::builder`] (or, with the `cluster` feature,
/// `RedisStore::cluster_builder`).
#[derive(Debug, Clone)]
pub struct RedisStoreBuilder {
    urls: Vec<String>,
    #[cfg(feature = "cluster")]
    cluster: bool,
    pool_size: usize,
    timeout: Duration,
    prefix: String,
    set_get: bool,
}

impl RedisStoreBuilder {
    /// How many connections the store keeps checked out for its calls (default 4; the pool may
    /// hold up to twice as many while a failed one is being replaced). Connections are
    /// multiplexed: each carries many concurrent calls, so a few serve hundreds of callers.
    pub fn pool_size(mut self, size: usize) -> Self {
        self.pool_size = size;
        self
    }

    /// The bound on every store call, including the wait for a pooled connection (default 2 s).
    pub fn command_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The prefix of every record's key (default `idem:`).
    pub fn key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// Whether an acquire first sends one plain `SET key <record> NX GET PX <ttl>` (default on).
    ///
    /// That command takes an absent key and returns whatever record is there, so a first
    /// acquisition and a replay cost Redis one plain command rather than a script (a script
    /// call costs the server about five times a `GET`); only a key found running or released
    /// goes on to the `acquire` script, which judges the lease by the server's clock. It needs
    /// Redis 7.0 or Valkey; on an older server the store notices the refusal and uses the
    /// script alone from then on. Off, every acquire is the script.
    pub fn set_get_acquire(mut self, on: bool) -> Self {
        self.set_get = on;
        self
    }

    /// Builds the store. Connections are opened lazily, on first use.
    pub fn build(self) -> Result<RedisStore, Error> {
        if self.urls.is_empty() {
            return Err(Error::Config("no Redis URL given".into()));
        }
        if self.pool_size == 0 {
            return Err(Error::Config("pool_size must be at least 1".into()));
        }
        if self.timeout.is_zero() {
            return Err(Error::Config("command_timeout must be above zero".into()));
        }
        let describe = self.urls.iter().map(|u| redact(u)).collect::<Vec<_>>().join(",");
        let config_err = |e: &dyn fmt::Display| {
            Error::Config(format!(
                "cannot use Redis URL {describe}: {e} (expected redis://[user:password@]host:port[/db] \
                 or rediss:// for TLS)"
            ))
        };
        let pool_config = deadpool_redis::PoolConfig {
            // Headroom for a slot being refilled while its old connection is still returning.
            max_size: self.pool_size * 2,
            timeouts: deadpool_redis::Timeouts {
                wait: Some(self.timeout),
                create: Some(self.timeout),
                recycle: Some(self.timeout),
            },
            ..Default::default()
        };
        #[cfg(feature = "cluster")]
        if self.cluster {
            let mut cfg = cluster::Config::from_urls(self.urls.clone());
            cfg.pool = Some(pool_config);
            let pool = Pool::Cluster(cfg.create_pool(Some(Runtime::Tokio1)).map_err(|e| config_err(&e))?);
            return Ok(RedisStore::from_parts(pool, self.prefix, self.timeout, describe, self.pool_size, self.set_get));
        }
        // The driver's own response timeout (500 ms by default) would cut calls short of the
        // command timeout the user chose; ours bounds every call instead.
        let conn_config =
            redis::AsyncConnectionConfig::new().set_response_timeout(None).set_connection_timeout(Some(self.timeout));
        let manager =
            deadpool_redis::Manager::new_with_config(self.urls[0].as_str(), conn_config).map_err(|e| config_err(&e))?;
        let pool = deadpool_redis::Pool::builder(manager)
            .config(pool_config)
            .runtime(Runtime::Tokio1)
            .build()
            .map_err(|e| config_err(&e))?;
        let pool = Pool::Single(pool);
        Ok(RedisStore::from_parts(pool, self.prefix, self.timeout, describe, self.pool_size, self.set_get))
    }
}

/// Hides the password of a `redis://user:password@host` URL.
fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            let creds = &url[scheme + 3..at];
            let user = creds.split(':').next().unwrap_or("");
            format!(
                "{}://{}{}",
                &url[..scheme],
                if user.is_empty() { String::new() } else { format!("{user}:***") },
                &url[at..]
            )
        }
        _ => url.to_owned(),
    }
}

/// What [`RedisStore::preflight`] found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Preflight {
    /// Settings that break the exactly-once guarantee, each with what to do.
    pub problems: Vec<String>,
    /// Settings that could not be read (for example `CONFIG` is disabled on managed Redis).
    pub unchecked: Vec<String>,
}

impl Preflight {
    /// Whether nothing that breaks the guarantee was found.
    pub fn is_ok(&self) -> bool {
        self.problems.is_empty()
    }
}

impl fmt::Display for Preflight {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.problems.is_empty() && self.unchecked.is_empty() {
            return f.write_str("Redis settings keep the guarantee");
        }
        for p in &self.problems {
            writeln!(f, "problem: {p}")?;
        }
        for u in &self.unchecked {
            writeln!(f, "unchecked: {u}")?;
        }
        Ok(())
    }
}

impl RedisStore {
    /// Starts configuring a store on standalone Redis (or a proxy) at `url`.
    pub fn builder(url: impl Into<String>) -> RedisStoreBuilder {
        RedisStoreBuilder {
            urls: vec![url.into()],
            #[cfg(feature = "cluster")]
            cluster: false,
            pool_size: DEFAULT_POOL_SIZE,
            timeout: DEFAULT_TIMEOUT,
            prefix: DEFAULT_PREFIX.to_owned(),
            set_get: true,
        }
    }

    /// Starts configuring a store on Redis Cluster, given one or more seed nodes.
    #[cfg(feature = "cluster")]
    pub fn cluster_builder<I, S>(urls: I) -> RedisStoreBuilder
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        RedisStoreBuilder { urls: urls.into_iter().map(Into::into).collect(), cluster: true, ..Self::builder("") }
    }

    /// A store on standalone Redis at `url`, with default settings.
    pub fn connect(url: &str) -> Result<RedisStore, Error> {
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
        RedisStore::from_parts(Pool::Single(pool), prefix.into(), timeout, "redis (pool)".to_owned(), size, true)
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
            true,
        )
    }

    fn from_parts(
        pool: Pool,
        prefix: String,
        timeout: Duration,
        describe: String,
        size: usize,
        set_get: bool,
    ) -> RedisStore {
        let slots = (0..size.max(1)).map(|_| Mutex::new(None)).collect();
        // `size` is how many connections the store keeps checked out of `pool`.
        RedisStore {
            inner: Arc::new(Inner {
                pool,
                slots,
                next: AtomicUsize::new(0),
                prefix,
                timeout,
                scripts: Scripts::new(),
                describe,
                set_get: AtomicBool::new(set_get),
                clock_offset_us: AtomicI64::new(0),
                clock_synced_us: AtomicU64::new(0),
                clock_syncing: AtomicBool::new(false),
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

    /// Checks the server settings the guarantee depends on; call it at start-up.
    ///
    /// Reports `maxmemory-policy` other than `noeviction` (Redis may evict a record and the
    /// operation would run again) and a server that persists nothing (a restart forgets every
    /// record). On a cluster, the node that answers is checked.
    pub async fn preflight(&self) -> Result<Preflight, Error> {
        let mut report = Preflight::default();
        let policy = self.config_get("maxmemory-policy").await?;
        match policy.as_deref() {
            Some("noeviction") => {}
            Some(other) => report.problems.push(format!(
                "maxmemory-policy is {other}: under memory pressure Redis may evict a record and its \
                 operation would run again; set `maxmemory-policy noeviction`"
            )),
            None => report.unchecked.push("maxmemory-policy (CONFIG GET refused)".into()),
        }
        let aof = self.config_get("appendonly").await?;
        let save = self.config_get("save").await?;
        match (aof.as_deref(), save.as_deref()) {
            (Some("no"), Some("")) => report.problems.push(
                "persistence is off (appendonly no, save \"\"): a restart forgets every record and \
                 completed operations would run again; enable AOF (`appendonly yes`, ideally \
                 `appendfsync always`) or RDB snapshots"
                    .into(),
            ),
            (None, _) | (_, None) => report.unchecked.push("persistence (CONFIG GET refused)".into()),
            _ => {}
        }
        Ok(report)
    }

    async fn config_get(&self, name: &str) -> Result<Option<String>, Error> {
        let mut cmd = redis::cmd("CONFIG");
        cmd.arg("GET").arg(name);
        let value = self.run("preflight", cmd).await;
        match value {
            Ok(Value::Array(items)) | Ok(Value::Set(items)) => Ok(items.get(1).and_then(text)),
            Ok(Value::Map(pairs)) => Ok(pairs.first().and_then(|(_, v)| text(v))),
            Ok(_) => Ok(None),
            Err(Error::Unavailable { reason, .. })
                if reason.contains("unknown command") || reason.contains("NOPERM") =>
            {
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// Sends one command on a pooled connection, within the command timeout.
    async fn run(&self, op: &'static str, cmd: redis::Cmd) -> Result<Value, Error> {
        self.timed(op, async {
            let mut conn = self.conn(op).await?;
            let res = cmd.query_async(&mut conn).await;
            self.settle(op, res)
        })
        .await
    }

    async fn invoke(&self, op: &'static str, script: &Script, key: &Key, args: &[Arg<'_>]) -> Result<Value, Error> {
        let hash = script.get_hash();
        let len = 7 + hash.len() + 1 + self.inner.prefix.len() + 64 + args.iter().map(Arg::len).sum::<usize>();
        let mut cmd = redis::Cmd::with_capacity(4 + args.len(), len);
        cmd.arg("EVALSHA").arg(hash).arg(1).arg(Arg::Key(&self.inner.prefix, key));
        for a in args {
            cmd.arg(a);
        }
        self.send(op, key, &cmd, Some(script)).await
    }

    /// `SET key <new record> NX GET PX <ttl>`: takes an absent key, and returns the record that
    /// is there otherwise (see `acquire.lua` for the layout).
    async fn set_get(&self, key: &Key, record: Arg<'_>, ttl_ms: u64) -> Result<Value, Error> {
        let len = 3 + self.inner.prefix.len() + 64 + record.len() + 2 + 3 + 2 + 20;
        let mut cmd = redis::Cmd::with_capacity(7, len);
        cmd.arg("SET").arg(Arg::Key(&self.inner.prefix, key)).arg(record).arg("NX").arg("GET").arg("PX");
        cmd.arg(Arg::Millis(ttl_ms));
        self.send("acquire", key, &cmd, None).await
    }

    /// Sends `cmd` (an `EVALSHA` of `script`, or a plain command) on a pooled connection, within
    /// the command timeout.
    async fn send(
        &self,
        op: &'static str,
        key: &Key,
        cmd: &redis::Cmd,
        script: Option<&Script>,
    ) -> Result<Value, Error> {
        // Boxed so that the futures of every store call stay small: they are moved into their
        // own boxes and into the timeout, and a large state machine would be copied each time.
        let work: BoxFuture<'_, Result<Value, Error>> = Box::pin(async {
            let mut retried = false;
            loop {
                let mut conn = self.conn(op).await?;
                let res = match script {
                    Some(script) => eval(&mut conn, script, cmd).await,
                    None => cmd.query_async(&mut conn).await,
                };
                match res {
                    // The connection was found dead (a restart or a network blip since its last
                    // use). Every command is idempotent for its owner token, so one more try on
                    // a fresh connection is safe even if the first request did reach the server.
                    Err(e) if !retried && is_connection_error(&e) => {
                        self.discard_all();
                        tracing::debug!(op, error = %e, "idempotent.redis: retrying on a fresh connection");
                        retried = true;
                    }
                    res => return self.settle(op, res),
                }
            }
        });
        self.timed(op, work).await.map_err(|e| match e {
            // A script refused what it found under the key, or the key holds another type.
            Error::Unavailable { reason, .. }
                if reason.contains("IDEMPOTENT_CORRUPT") || reason.contains("WRONGTYPE") =>
            {
                Self::corrupt(key, reason)
            }
            other => other,
        })
    }

    /// The fence of a key taken by `SET NX`: the server's clock in microseconds, estimated from
    /// the monotonic clock and the last measured offset. `None` while there is no fresh measure
    /// (one is then started in the background): the caller takes the script path, where the
    /// server reads its own clock.
    fn estimated_server_micros(&self) -> Option<u64> {
        let now = monotonic_us();
        let synced = self.inner.clock_synced_us.load(AtomicOrdering::Acquire);
        if synced == 0 || now.saturating_sub(synced) > CLOCK_RESYNC_US {
            self.start_clock_sync();
        }
        if synced == 0 || now.saturating_sub(synced) > CLOCK_STALE_US {
            return None;
        }
        let offset = self.inner.clock_offset_us.load(AtomicOrdering::Acquire);
        let fence = (now as i64).checked_add(offset)?;
        u64::try_from(fence).ok().filter(|f| (1..MAX_FENCE).contains(f))
    }

    /// Measures the server's clock in a task of its own, unless a measure is under way.
    fn start_clock_sync(&self) {
        if self.inner.clock_syncing.swap(true, AtomicOrdering::AcqRel) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            self.inner.clock_syncing.store(false, AtomicOrdering::Release);
            return;
        };
        let store = self.clone();
        runtime.spawn(async move {
            // A failure was logged; the script path serves meanwhile.
            let _ = store.sync_clock().await;
            store.inner.clock_syncing.store(false, AtomicOrdering::Release);
        });
    }

    /// Measures the server's clock against the monotonic clock with `TIME`, to within half a
    /// round trip (the quickest of three). On failure the last measure stays (acquires take
    /// the script path once it is stale, or while there is none) and a later acquire tries again.
    async fn sync_clock(&self) -> Result<(), Error> {
        // (round trip, offset) of the quickest sample.
        let mut best: Option<(u64, i64)> = None;
        for _ in 0..3 {
            let before = monotonic_us();
            let reply = self.run("clock", redis::cmd("TIME")).await;
            let after = monotonic_us();
            let Some(server) = server_micros(&reply) else {
                if best.is_some() {
                    break;
                }
                let e = reply.err().unwrap_or_else(|| Error::Unavailable {
                    store: self.describe(),
                    op: "clock",
                    reason: "unexpected TIME reply".into(),
                    source: None,
                });
                tracing::debug!(error = %e, "idempotent.redis: could not read the server's clock; acquires use the script until it can");
                return Err(e);
            };
            let rtt = after - before;
            if best.is_none_or(|(best_rtt, _)| rtt < best_rtt) {
                best = Some((rtt, server - ((before + after) / 2) as i64));
            }
        }
        if let Some((_, offset)) = best {
            self.inner.clock_offset_us.store(offset, AtomicOrdering::Release);
            self.inner.clock_synced_us.store(monotonic_us(), AtomicOrdering::Release);
        }
        Ok(())
    }

    /// Opens the store's connections, loads its scripts and measures the server's clock, so
    /// that the first calls do not pay for it. Optional: all of it otherwise happens on first
    /// use. Run it at start-up, with [`preflight`](Self::preflight), to fail fast on a wrong URL.
    pub async fn warm_up(&self) -> Result<(), Error> {
        for slot in 0..self.inner.slots.len() {
            if lock(&self.inner.slots[slot]).is_none() {
                self.timed("warm_up", self.fill(slot, "warm_up")).await?;
            }
        }
        let scripts = &self.inner.scripts;
        for script in [&scripts.acquire, &scripts.complete, &scripts.release, &scripts.renew] {
            self.timed("warm_up", async {
                let mut conn = self.conn("warm_up").await?;
                let res = script.load_async(&mut conn).await.map(|_| Value::Nil);
                self.settle("warm_up", res)
            })
            .await?;
        }
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
                match store.release(&key, &token).await {
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

    /// Bounds `work` (connection wait included) by the command timeout. A call cut short may
    /// have left its connection mid-reply, so that connection is not used again.
    async fn timed<T>(&self, op: &'static str, work: impl Future<Output = Result<T, Error>>) -> Result<T, Error> {
        match tokio::time::timeout(self.inner.timeout, work).await {
            Ok(res) => res,
            Err(_) => {
                self.discard_all();
                Err(Error::Timeout { store: self.describe(), op, after: self.inner.timeout })
            }
        }
    }

    /// A multiplexed connection for one command.
    ///
    /// deadpool recycles a connection on every checkout with an `UNWATCH` + `PING` round trip,
    /// which would double the cost of every call. The connections are multiplexed (many commands
    /// in flight on one socket, each awaited on its own), so instead of checking one out per call
    /// the store keeps a few checked out in slots and sends each call on a clone of one; nothing
    /// is held exclusively while an action runs. When a connection fails, every slot is emptied and
    /// its connection taken out of the pool; the next calls refill the slots from the pool.
    async fn conn(&self, op: &'static str) -> Result<Conn, Error> {
        let slot = self.inner.next.fetch_add(1, AtomicOrdering::Relaxed) % self.inner.slots.len();
        if let Some(held) = lock(&self.inner.slots[slot]).as_ref() {
            return Ok(held.handle());
        }
        // Boxed: the pool's checkout is a large state machine, and only this rare path needs it.
        // Inline, it would grow every store call's future (to ~7 KiB), and each call would pay
        // for an allocation that size.
        Box::pin(self.fill(slot, op)).await
    }

    /// Fills an empty slot from the pool and returns a handle to its connection.
    async fn fill(&self, slot: usize, op: &'static str) -> Result<Conn, Error> {
        let held = match &self.inner.pool {
            Pool::Single(p) => Held::Single(p.get().await.map_err(|e| self.pool_error(op, e))?),
            #[cfg(feature = "cluster")]
            Pool::Cluster(p) => Held::Cluster(p.get().await.map_err(|e| self.pool_error(op, e))?),
        };
        let mut slot = lock(&self.inner.slots[slot]);
        if let Some(filled) = slot.as_ref() {
            // Another call filled the slot while we waited: use its connection and give ours
            // back to the pool.
            return Ok(filled.handle());
        }
        let conn = held.handle();
        *slot = Some(held);
        Ok(conn)
    }

    fn settle(&self, op: &'static str, res: redis::RedisResult<Value>) -> Result<Value, Error> {
        res.map_err(|e| {
            if is_connection_error(&e) || e.is_timeout() {
                // Whatever broke this connection (a restart, a network blip) most likely broke
                // its siblings too: replace them all rather than fail one call per slot.
                self.discard_all();
            }
            self.redis_error(op, e)
        })
    }

    fn discard_all(&self) {
        for slot in self.inner.slots.iter() {
            if let Some(held) = lock(slot).take() {
                held.detach();
            }
        }
    }

    fn pool_error(&self, op: &'static str, e: deadpool_redis::PoolError) -> Error {
        match &e {
            deadpool_redis::PoolError::Timeout(_) => {
                return Error::Timeout { store: self.describe(), op, after: self.inner.timeout };
            }
            deadpool_redis::PoolError::Backend(b) if b.is_timeout() => {
                return Error::Timeout { store: self.describe(), op, after: self.inner.timeout };
            }
            _ => {}
        }
        let reason = match &e {
            deadpool_redis::PoolError::Backend(b) => b.to_string(),
            other => other.to_string(),
        };
        Error::Unavailable { store: self.describe(), op, reason, source: Some(Box::new(e) as BoxError) }
    }

    fn redis_error(&self, op: &'static str, e: redis::RedisError) -> Error {
        if e.is_timeout() {
            return Error::Timeout { store: self.describe(), op, after: self.inner.timeout };
        }
        Error::Unavailable { store: self.describe(), op, reason: e.to_string(), source: Some(Box::new(e)) }
    }

    fn corrupt(key: &Key, detail: impl Into<String>) -> Error {
        Error::Corrupt { key: key.short(), detail: detail.into() }
    }

    /// Acquire's work for `token`: one `SET NX GET`, then the acquire script only for a record
    /// it cannot judge (or for every acquire when the plain path is off or has no clock).
    async fn take(
        &self,
        key: &Key,
        fingerprint: &Fingerprint,
        token: &Token,
        lease: u64,
        retention: u64,
    ) -> Result<Acquire, Error> {
        let fp = crate::key::hex_array(fingerprint.as_bytes());
        let ttl = lease.max(retention);
        if self.inner.set_get.load(AtomicOrdering::Relaxed)
            && let Some(fence) = self.estimated_server_micros()
        {
            let record = Arg::New { fp: &fp, token, threshold: ttl - lease, fence };
            match self.set_get(key, record, ttl).await {
                Ok(Value::Nil) => {
                    return Ok(Acquire::Acquired(Grant {
                        token: token.clone(),
                        attempt: Attempt::new(fence, 1, false),
                    }));
                }
                Ok(Value::BulkString(record)) => {
                    if let Some(answer) = self.read_record(key, record, &fp, token)? {
                        return Ok(answer);
                    }
                    // Running or released under this payload: the script judges the lease.
                }
                Ok(other) => {
                    // Something between us and Redis answered oddly: the key may be taken.
                    self.release_orphan(*key, token.clone());
                    return Err(Self::corrupt(key, format!("unexpected SET reply {other:?}")));
                }
                Err(Error::Unavailable { reason, .. }) if reason.contains("syntax error") => {
                    // Before Redis 7.0, SET takes NX or GET but not both: nothing was written.
                    self.inner.set_get.store(false, AtomicOrdering::Relaxed);
                    tracing::warn!(store = %self.inner.describe, "idempotent.redis: the server refuses SET NX GET (Redis before 7.0?); every acquire runs the acquire script from now on");
                }
                Err(e) => return Err(e),
            }
        }
        let args = [Arg::Acquire { fp: &fp, token, lease, retention }];
        let items = match self.invoke("acquire", &self.inner.scripts.acquire, key, &args).await? {
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
                let attempt = Attempt::new(fence, u32::try_from(attempt).unwrap_or(u32::MAX), recovered == 1);
                Ok(Acquire::Acquired(Grant { token: token.clone(), attempt }))
            }
            (Some(3), 2) => {
                let ms = int(items.get(1)).unwrap_or(0).max(0) as u64;
                Ok(Acquire::InFlight { retry_after: Duration::from_millis(ms) })
            }
            (Some(4), 1) => Ok(Acquire::Mismatch),
            _ => Err(Self::corrupt(key, format!("unexpected acquire reply {items:?}"))),
        }
    }

    /// What a record read by acquire answers (layout in acquire.lua): a done record replays or
    /// mismatches; a running or released one under another payload mismatches, and one this
    /// very token took (a retry after a lost reply) is acquired as recorded. `None`: another
    /// owner's running or released record under this payload, for the acquire script to judge.
    fn read_record(&self, key: &Key, record: Vec<u8>, fp: &[u8; 64], token: &Token) -> Result<Option<Acquire>, Error> {
        let not_a_record = || Self::corrupt(key, "the key holds a string that is not a record");
        if record.len() < 97 {
            return Err(not_a_record());
        }
        match record[0] {
            b'D' if record[1..65] == fp[..] => Ok(Some(Acquire::Replay(Bytes::from(record).slice(97..)))),
            b'D' => Ok(Some(Acquire::Mismatch)),
            b'R' | b'N' | b'X' if record.len() == RUNNING_LEN => {
                let digits = |range: std::ops::Range<usize>| {
                    let field = &record[range];
                    if !field.iter().all(u8::is_ascii_digit) {
                        return None;
                    }
                    std::str::from_utf8(field).ok()?.parse::<u64>().ok()
                };
                let (Some(_), Some(fence), Some(attempt)) = (digits(97..112), digits(112..132), digits(132..142))
                else {
                    return Err(Self::corrupt(key, "the record has a malformed number"));
                };
                if fence >= MAX_FENCE {
                    return Err(Self::corrupt(key, "the record has a fence beyond 2^53"));
                }
                if record[65..97] == *token.as_str().as_bytes() && record[0] != b'X' {
                    let attempt = Attempt::new(fence, u32::try_from(attempt).unwrap_or(u32::MAX), record[142] == b'1');
                    return Ok(Some(Acquire::Acquired(Grant { token: token.clone(), attempt })));
                }
                if record[1..65] != fp[..] {
                    return Ok(Some(Acquire::Mismatch));
                }
                Ok(None)
            }
            _ => Err(not_a_record()),
        }
    }

    fn transition(&self, key: &Key, value: Value) -> Result<Transition, Error> {
        match value {
            Value::Int(1) => Ok(Transition::Ok),
            Value::Int(0) => Ok(Transition::LeaseLost),
            other => Err(Self::corrupt(key, format!("unexpected script reply {other:?}"))),
        }
    }
}

/// `EVALSHA`, loading the script first when the server does not know it (a restart, a
/// `SCRIPT FLUSH`, a new cluster node).
async fn eval(conn: &mut Conn, script: &Script, cmd: &redis::Cmd) -> redis::RedisResult<Value> {
    match cmd.query_async(conn).await {
        Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
            // Boxed, like the pool checkout in `conn`: a rare path kept out of every call's future.
            Box::pin(async {
                script.load_async(conn).await?;
                cmd.query_async(conn).await
            })
            .await
        }
        res => res,
    }
}

fn is_connection_error(e: &redis::RedisError) -> bool {
    e.is_io_error() || e.is_connection_dropped() || e.is_connection_refusal()
}

/// Microseconds on this process's monotonic clock (from its first reading; never 0 after it).
fn monotonic_us() -> u64 {
    static BASE: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    let base = *BASE.get_or_init(std::time::Instant::now);
    base.elapsed().as_micros() as u64 + 1
}

/// The server's clock in microseconds, from a `TIME` reply.
fn server_micros(reply: &Result<Value, Error>) -> Option<i64> {
    let Ok(Value::Array(parts)) = reply else { return None };
    let num = |v: &Value| match v {
        Value::BulkString(b) => std::str::from_utf8(b).ok()?.parse::<i64>().ok(),
        Value::Int(i) => Some(*i),
        _ => None,
    };
    match parts.as_slice() {
        [secs, micros] => Some(num(secs)?.checked_mul(1_000_000)?.checked_add(num(micros)?)?),
        _ => None,
    }
}

fn text(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    }
}

fn int(v: Option<&Value>) -> Option<i64> {
    match v {
        Some(Value::Int(i)) => Some(*i),
        _ => None,
    }
}

/// A connection checked out of the pool and kept in a slot.
enum Held {
    Single(deadpool_redis::Connection),
    #[cfg(feature = "cluster")]
    Cluster(cluster::Connection),
}

impl Held {
    fn handle(&self) -> Conn {
        match self {
            Held::Single(c) => Conn::Single((**c).clone()),
            #[cfg(feature = "cluster")]
            Held::Cluster(c) => Conn::Cluster((**c).clone()),
        }
    }

    /// Takes the connection out of the pool for good, so it is never recycled.
    fn detach(self) {
        match self {
            Held::Single(c) => drop(deadpool_redis::Connection::take(c)),
            #[cfg(feature = "cluster")]
            Held::Cluster(c) => drop(cluster::Connection::take(c)),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A clone of a held connection, used for one command.
enum Conn {
    Single(redis::aio::MultiplexedConnection),
    #[cfg(feature = "cluster")]
    Cluster(redis::cluster_async::ClusterConnection),
}

impl redis::aio::ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a redis::Cmd) -> redis::RedisFuture<'a, Value> {
        match self {
            Conn::Single(c) => c.req_packed_command(cmd),
            #[cfg(feature = "cluster")]
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Single(c) => c.req_packed_commands(cmd, offset, count),
            #[cfg(feature = "cluster")]
            Conn::Cluster(c) => c.req_packed_commands(cmd, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c) => c.get_db(),
            #[cfg(feature = "cluster")]
            Conn::Cluster(c) => c.get_db(),
        }
    }
}

/// The length of a running (`R`, `N`) or released (`X`) record.
const RUNNING_LEN: usize = 143;

/// Milliseconds as the scripts take them: at least 1, at most ten years, so that Lua's number
/// formatting never turns them into exponent notation.
fn millis(d: Duration) -> u64 {
    const TEN_YEARS_MS: u128 = 10 * 365 * 24 * 60 * 60 * 1000;
    d.as_millis().clamp(1, TEN_YEARS_MS) as u64
}

/// A script argument, written straight into the command's buffer (no `String` per argument).
enum Arg<'a> {
    Bytes(&'a [u8]),
    /// Milliseconds, in decimal.
    Millis(u64),
    /// The record's Redis key: the store's prefix, then the key in hex (as `redis_key`).
    Key(&'a str, &'a Key),
    /// `acquire`'s one argument: fingerprint, token, then lease and retention in 15 digits.
    Acquire {
        fp: &'a [u8; 64],
        token: &'a Token,
        lease: u64,
        retention: u64,
    },
    /// A new running record, as `SET NX` writes it (the `N` layout in acquire.lua).
    New {
        fp: &'a [u8; 64],
        token: &'a Token,
        /// The TTL at or below which the lease has passed.
        threshold: u64,
        fence: u64,
    },
}

impl Arg<'_> {
    /// At most how many bytes the argument takes.
    fn len(&self) -> usize {
        match self {
            Arg::Bytes(b) => b.len(),
            Arg::Millis(_) => 20,
            Arg::Key(prefix, _) => prefix.len() + 64,
            Arg::Acquire { .. } => 126,
            Arg::New { .. } => RUNNING_LEN,
        }
    }
}

impl redis::ToRedisArgs for Arg<'_> {
    fn write_redis_args<W: ?Sized + redis::RedisWrite>(&self, out: &mut W) {
        use std::io::Write as _;
        // Writes into the command's `Vec<u8>`, which cannot fail.
        let _ = match self {
            Arg::Bytes(b) => {
                out.write_arg(b);
                Ok(())
            }
            Arg::Millis(ms) => write!(out.writer_for_next_arg(), "{ms}"),
            Arg::Key(prefix, key) => {
                let mut w = out.writer_for_next_arg();
                w.write_all(prefix.as_bytes()).and_then(|()| w.write_all(&crate::key::hex_array(key.as_bytes())))
            }
            // `millis` keeps both below 10^15.
            Arg::Acquire { fp, token, lease, retention } => {
                let mut w = out.writer_for_next_arg();
                w.write_all(&fp[..])
                    .and_then(|()| w.write_all(token.as_str().as_bytes()))
                    .and_then(|()| write!(w, "{lease:015}{retention:015}"))
            }
            // Fences are microseconds of the clock, far below 10^20; attempt 1, not recovered.
            Arg::New { fp, token, threshold, fence } => {
                let mut w = out.writer_for_next_arg();
                w.write_all(b"N")
                    .and_then(|()| w.write_all(&fp[..]))
                    .and_then(|()| w.write_all(token.as_str().as_bytes()))
                    .and_then(|()| write!(w, "{threshold:015}{fence:020}00000000010"))
            }
        };
    }
}

impl Store for RedisStore {
    fn acquire<'a>(
        &'a self,
        key: &'a Key,
        fingerprint: &'a Fingerprint,
        lease: Duration,
        retention: Duration,
    ) -> BoxFuture<'a, Result<Acquire, Error>> {
        Box::pin(async move {
            let token = Token::unique();
            let res = self.take(key, fingerprint, &token, millis(lease), millis(retention)).await;
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
            let args = [Arg::Bytes(token.as_str().as_bytes()), Arg::Bytes(&result), Arg::Millis(millis(retention))];
            let reply = self.invoke("complete", &self.inner.scripts.complete, key, &args).await?;
            self.transition(key, reply)
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
            let reply = self.invoke("renew", &self.inner.scripts.renew, key, &args).await?;
            self.transition(key, reply)
        })
    }

    fn describe(&self) -> String {
        self.inner.describe.clone()
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_redacted() {
        assert_eq!(redact("redis://user:secret@host:6379/0"), "redis://user:***@host:6379/0");
        assert_eq!(redact("rediss://:secret@host"), "rediss://@host");
        assert_eq!(redact("redis://host:6379"), "redis://host:6379");
    }

    #[test]
    fn bad_config_is_an_error() {
        assert!(matches!(RedisStore::builder("redis://h").pool_size(0).build(), Err(Error::Config(_))));
        assert!(matches!(RedisStore::builder("not a url").build(), Err(Error::Config(_))));
    }
}
