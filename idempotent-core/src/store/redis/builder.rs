//! [`RedisStoreBuilder`]: the store's settings, and the URLs it connects to.

use std::fmt;
use std::time::Duration;

#[cfg(feature = "cluster")]
use deadpool_redis::cluster;
use deadpool_redis::{Runtime, redis};

use super::conn::{Pool, Wait};
use super::redact::redact;
use super::{RedisStore, Sending};
use crate::error::Error;

const DEFAULT_PREFIX: &str = "idem:";
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(2);
const DEFAULT_POOL_SIZE: usize = 4;

/// Where a [`RedisStore`] gets its connections.
#[derive(Clone)]
enum Target {
    /// Standalone Redis (or a proxy) at the first URL.
    Url(String),
    /// The Redis Cluster these seed nodes belong to.
    #[cfg(feature = "cluster")]
    Cluster(Vec<String>),
    /// The master that the sentinels at these URLs know by this name.
    #[cfg(feature = "sentinel")]
    Sentinel { urls: Vec<String>, master: String },
    /// The application's own pool.
    Pool(deadpool_redis::Pool),
    /// The application's own cluster pool.
    #[cfg(feature = "cluster")]
    ClusterPool(cluster::Pool),
}

/// Configures a [`RedisStore`]; made by [`RedisStore::builder`] or
/// [`RedisStore::builder_with_pool`] (with the `cluster` feature, also
/// `RedisStore::cluster_builder` and `RedisStore::cluster_builder_with_pool`; with `sentinel`,
/// `RedisStore::sentinel_builder`), and finished, as
/// sqlx's pools are, by [`connect`](Self::connect) (async: connects, and fails on a server it
/// cannot reach) or [`connect_lazy`](Self::connect_lazy) (connects on first use).
#[derive(Clone)]
pub struct RedisStoreBuilder {
    target: Target,
    /// `None`: 4 on a URL, half the pool's size (at least 1) on the application's pool.
    pool_size: Option<usize>,
    timeout: Duration,
    prefix: String,
    set_get: bool,
    functions: bool,
    wait: Option<Wait>,
    native: bool,
    /// [`tls_root_certificate`](Self::tls_root_certificate): PEM.
    #[cfg(any(feature = "tls-rustls", feature = "tls-native-tls"))]
    tls_root: Option<Vec<u8>>,
}

impl fmt::Debug for RedisStoreBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStoreBuilder")
            .field("target", &self.describe())
            .field("pool_size", &self.pool_size)
            .field("timeout", &self.timeout)
            .field("prefix", &self.prefix)
            .field("set_get", &self.set_get)
            .field("functions", &self.functions)
            .field("wait", &self.wait)
            .field("native", &self.native)
            .finish()
    }
}

impl RedisStoreBuilder {
    /// Default settings, for `target`.
    fn new(target: Target) -> Self {
        RedisStoreBuilder {
            target,
            pool_size: None,
            timeout: DEFAULT_TIMEOUT,
            prefix: DEFAULT_PREFIX.to_owned(),
            set_get: Sending::DEFAULT.set_get,
            functions: Sending::DEFAULT.functions,
            wait: Sending::DEFAULT.wait,
            native: Sending::DEFAULT.native,
            #[cfg(any(feature = "tls-rustls", feature = "tls-native-tls"))]
            tls_root: None,
        }
    }

    /// Standalone Redis (or a proxy) at `url`.
    pub(super) fn on_url(url: String) -> Self {
        Self::new(Target::Url(url))
    }

    /// The Redis Cluster seeded by `urls`.
    #[cfg(feature = "cluster")]
    pub(super) fn on_cluster(urls: Vec<String>) -> Self {
        Self::new(Target::Cluster(urls))
    }

    /// The master the sentinels at `urls` know as `master`.
    #[cfg(feature = "sentinel")]
    pub(super) fn on_sentinel(urls: Vec<String>, master: String) -> Self {
        Self::new(Target::Sentinel { urls, master })
    }

    /// The application's pool.
    pub(super) fn on_pool(pool: deadpool_redis::Pool) -> Self {
        Self::new(Target::Pool(pool))
    }

    /// The application's cluster pool.
    #[cfg(feature = "cluster")]
    pub(super) fn on_cluster_pool(pool: cluster::Pool) -> Self {
        Self::new(Target::ClusterPool(pool))
    }

    /// How many connections the store keeps checked out for its calls (default 4; the pool may
    /// hold up to twice as many while a failed one is being replaced). On the application's pool
    /// ([`RedisStore::builder_with_pool`]) the default is half of the pool's size (at least 1),
    /// leaving the rest to the application; the pool's own size is never changed. Connections are
    /// multiplexed: each carries many concurrent calls, so a few serve hundreds of callers.
    ///
    /// Plain reads (acquire's `GET` first, a state load) always go out on the first connection,
    /// where many callers' reads share each socket write; script calls and writes take the
    /// others in turn (with one connection, it carries everything). So the size matters for
    /// first executions and other writes. Under load (16 or more reads in flight) acquire's
    /// reads go out together, as one `MGET` per round trip, whatever the size.
    ///
    /// Tuning: more connections spread the client's work over more of its threads, fewer put
    /// more commands in each socket write and each pass of Redis' event loop. With 64 callers on
    /// two cores shared with Redis, 4 connections made more first executions than 1
    /// (BENCHMARKS.md, "Measurements behind other decisions"). A cluster, or callers spread over
    /// many cores, may want more. Measure your own with `redis_bench --pool <n>`.
    pub fn pool_size(mut self, size: usize) -> Self {
        self.pool_size = Some(size);
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
    /// acquisition and a replay cost Redis one plain command rather than a script, which costs
    /// the server several times as much (see BENCHMARKS.md); only a key found running or
    /// released goes on to the `acquire` script, which judges the lease by the server's clock.
    /// It needs Redis 7.0 or Valkey; on an older server the store notices the refusal and uses
    /// the script alone from then on. Off, every acquire is the script.
    pub fn set_get_acquire(mut self, on: bool) -> Self {
        self.set_get = on;
        self
    }

    /// Whether the store calls its Lua scripts as the functions of one library (`FUNCTION
    /// LOAD`, `FCALL`), loaded on first use (default on), rather than by `EVALSHA`.
    ///
    /// Every script reads records through the same prelude of constants and helpers; in a library
    /// that prelude runs once, at load, instead of on every call, which saves Redis part of every
    /// script call (see BENCHMARKS.md). The library is named `idempotent_<digest>`
    /// after its text, so versions of this crate sharing a server each call their own; an old
    /// version's library can be removed with `FUNCTION DELETE`. Functions need Redis 7.0 or
    /// Valkey, and an ACL that allows `FCALL` and `FUNCTION LOAD`; on a server that refuses them
    /// the store notices and sends `EVALSHA` from then on. Off, every script goes by `EVALSHA`.
    pub fn functions(mut self, on: bool) -> Self {
        self.functions = on;
        self
    }

    /// Whether a completion is one plain `SET key <done record> IFEQ <running record> PX
    /// <retention>` where the server has compare-and-set (Valkey 8.1 and later, Redis 8.4 and
    /// later), rather than the `complete` script (default on).
    ///
    /// It applies to a first execution: the running record its `SET NX GET` wrote is kept, under
    /// the acquisition's token, until its completion, which then costs the server one `SET`
    /// instead of a script call. The key must still hold that record byte for byte; anything
    /// else (a takeover, a renewal, a repeat after a lost reply) goes to the script, as does a
    /// completion while the store has no fresh estimate of the server's clock. The store asks the server whether it takes the form once,
    /// with its first measure of the server's clock; a server that refuses it (Redis 7.0) is sent
    /// scripts. Off, every completion is the script.
    pub fn native_compare_and_set(mut self, on: bool) -> Self {
        self.native = on;
        self
    }

    /// Waits, after every write a caller acts on, until `replicas` replicas of the key's master
    /// have acknowledged it, for at most `timeout` (default off).
    ///
    /// Replication in Redis is asynchronous: a master acknowledges a write before its replicas
    /// have it, and a failover (a replica promoted after the master crashed or was cut off) can
    /// lose it. With this on, the store sends `WAIT replicas timeout` behind each acquire,
    /// complete, renew, abandon and resolve, pipelined with the write on the same connection (on a
    /// cluster, to the key's master, as the write), so it costs no extra round trip but the
    /// replicas' acknowledgement. A write that fewer replicas acknowledged in time is a store
    /// failure: an acquire fails closed (nothing runs, and the key it took is released); a
    /// complete answers [`Error::Unavailable`] with `op: "complete"`, which the executor
    /// reports as [`action_may_have_run`](Error::action_may_have_run), as for a lost reply; an
    /// abandon or resolve answers the same error for its op. Answers that wrote nothing (a
    /// replay, a key in flight, a payload mismatch) are given as read.
    ///
    /// What it buys, and what it does not (measured in RELIABILITY.md): with one replica per
    /// master, an acknowledged acquire or completion survives a failover to that replica. It is
    /// not a consensus write: a master that acknowledged a write to `replicas` replicas can still
    /// fail over to another replica that did not get it (more replicas than `replicas`), and a
    /// shard with fewer than `replicas` replicas connected refuses every acquire until one is
    /// back. While a replica lags, the `WAIT`s queue on the connections the store writes on (all
    /// but the first, where its reads go; the only one with `pool_size(1)`): the server answers
    /// a connection's commands in order, so keep `timeout` well below the command timeout; it
    /// must be below it, and at least 1 ms.
    ///
    /// A transition repeated after a lost reply (on another connection, by the same token) writes
    /// its record again unchanged, so that its `WAIT` covers it too. Renewals are waited for as
    /// well (one short of replicas is a failed renewal: the heartbeat tries again, and a lease
    /// that no acknowledged renewal reached within its length is lost). Not waited for: replays
    /// (a done record is read from the master, which may answer before the completer's `WAIT`
    /// has).
    pub fn wait_for_replicas(mut self, replicas: u32, timeout: Duration) -> Self {
        self.wait = Some(Wait { replicas, timeout });
        self
    }

    /// Trusts the certificate authority `pem` (one or more PEM certificates) for a `rediss://`
    /// URL, instead of the platform's root certificates: for a server whose certificate a
    /// private authority signed. The server's name in the URL must match its certificate (a
    /// name the certificate is not for is refused), unless the URL ends in `#insecure`, which
    /// verifies nothing.
    ///
    /// With the `tls-rustls` feature the platform's roots are those `rustls-native-certs` finds
    /// (the system store; `SSL_CERT_FILE` and `SSL_CERT_DIR` name others); with
    /// `tls-native-tls`, the system's TLS library's. For a store on one URL only: on a cluster,
    /// through Sentinel or on the application's pool, [`connect_lazy`](Self::connect_lazy)
    /// refuses it.
    ///
    /// ```no_run
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let ca = std::fs::read("/etc/idempotent/redis-ca.pem")?;
    /// let store = idempotent_core::RedisStore::builder("rediss://redis.internal:6380")
    ///     .tls_root_certificate(ca)
    ///     .connect()
    ///     .await?;
    /// # let _ = store; Ok(()) }
    /// ```
    #[cfg(any(feature = "tls-rustls", feature = "tls-native-tls"))]
    pub fn tls_root_certificate(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.tls_root = Some(pem.into());
        self
    }

    /// Makes the store and connects: opens the connections it keeps, loads its scripts and reads
    /// the server's clock ([`RedisStore::warm_up`]), so that a wrong URL, a server that is down
    /// or an ACL that refuses the store fails here, not on the first call.
    ///
    /// Fails with [`Error::Config`] for invalid settings or URL, and with
    /// [`Error::Unavailable`] or [`Error::Timeout`] when the server cannot be reached within the
    /// command timeout.
    pub async fn connect(self) -> Result<RedisStore, Error> {
        let store = self.connect_lazy()?;
        store.warm_up().await?;
        Ok(store)
    }

    /// Makes the store without connecting: connections are opened, and scripts loaded, on first
    /// use (as sqlx's `connect_lazy`). A server that is down is then an error of the first
    /// call, not of this one.
    ///
    /// Fails with [`Error::Config`] for invalid settings or URL.
    pub fn connect_lazy(self) -> Result<RedisStore, Error> {
        #[cfg(any(feature = "tls-rustls", feature = "tls-native-tls"))]
        if self.tls_root.is_some() && !matches!(self.target, Target::Url(_)) {
            return Err(Error::Config(
                "tls_root_certificate is for a store on one Redis URL; a cluster's or Sentinel's TLS trusts the \
                 platform's root certificates (with tls-rustls, add the authority to SSL_CERT_FILE), and an \
                 application's pool its own settings"
                    .into(),
            ));
        }
        if self.pool_size == Some(0) {
            return Err(Error::Config("pool_size must be at least 1".into()));
        }
        if self.timeout.is_zero() {
            return Err(Error::Config("command_timeout must be above zero".into()));
        }
        let sending = self.sending();
        if let Some(wait) = &self.wait {
            wait.check(self.timeout)?;
        }
        let describe = self.describe();
        let config_err = |e: &dyn fmt::Display| {
            Error::Config(format!(
                "cannot use Redis URL {describe}: {e} (expected redis://[user:password@]host:port[/db] \
                 or rediss:// for TLS)"
            ))
        };
        let pool_size = self.pool_size.unwrap_or(DEFAULT_POOL_SIZE);
        let pool_config = deadpool_redis::PoolConfig {
            // Headroom for a slot being refilled while its old connection is still returning.
            max_size: pool_size * 2,
            timeouts: deadpool_redis::Timeouts {
                wait: Some(self.timeout),
                create: Some(self.timeout),
                recycle: Some(self.timeout),
            },
            ..Default::default()
        };
        // On the application's pool, half of it unless told.
        let share = |max_size: usize| self.pool_size.unwrap_or((max_size / 2).max(1));
        let (pool, size) = match &self.target {
            Target::Url(url) => {
                // The driver's own response timeout (500 ms by default) would cut calls short of
                // the command timeout the user chose; ours bounds every call instead.
                let conn_config = redis::AsyncConnectionConfig::new()
                    .set_response_timeout(None)
                    .set_connection_timeout(Some(self.timeout));
                let manager = deadpool_redis::Manager::new_with_config(self.connection_info(url)?, conn_config)
                    .map_err(|e| config_err(&e))?;
                let pool = deadpool_redis::Pool::builder(manager)
                    .config(pool_config)
                    .runtime(Runtime::Tokio1)
                    .build()
                    .map_err(|e| config_err(&e))?;
                (Pool::Single(pool), pool_size)
            }
            #[cfg(feature = "cluster")]
            Target::Cluster(urls) => {
                if urls.is_empty() {
                    return Err(Error::Config("no Redis Cluster node URL given".into()));
                }
                #[cfg(feature = "tls-rustls")]
                if urls.iter().any(|url| url.starts_with("rediss:")) {
                    install_rustls_provider();
                }
                let mut cfg = cluster::Config::from_urls(urls.clone());
                cfg.pool = Some(pool_config);
                (Pool::Cluster(cfg.create_pool(Some(Runtime::Tokio1)).map_err(|e| config_err(&e))?), pool_size)
            }
            #[cfg(feature = "sentinel")]
            Target::Sentinel { urls, master } => {
                let sentinel = super::sentinel::Sentinel::new(urls, master, self.timeout)?;
                (Pool::Sentinel(std::sync::Arc::new(sentinel)), pool_size)
            }
            Target::Pool(pool) => (Pool::Single(pool.clone()), share(pool.status().max_size)),
            #[cfg(feature = "cluster")]
            Target::ClusterPool(pool) => (Pool::Cluster(pool.clone()), share(pool.status().max_size)),
        };
        Ok(RedisStore::from_parts(pool, self.prefix, self.timeout, describe, size, sending))
    }

    /// Where a standalone store connects: `url`, with the authority to trust when one was given.
    fn connection_info(&self, url: &str) -> Result<redis::ConnectionInfo, Error> {
        use redis::IntoConnectionInfo;
        let bad_url = |e: &dyn fmt::Display| {
            Error::Config(format!(
                "cannot use Redis URL {}: {e} (expected redis://[user:password@]host:port[/db] or rediss:// for TLS)",
                redact(url)
            ))
        };
        let info = url.into_connection_info().map_err(|e| bad_url(&e))?;
        if matches!(info.addr(), redis::ConnectionAddr::TcpTls { .. }) {
            #[cfg(feature = "tls-rustls")]
            install_rustls_provider();
        }
        #[cfg(any(feature = "tls-rustls", feature = "tls-native-tls"))]
        if let Some(pem) = &self.tls_root {
            if !matches!(info.addr(), redis::ConnectionAddr::TcpTls { .. }) {
                return Err(Error::Config(format!(
                    "tls_root_certificate was given for {}, which is not a TLS URL: use rediss://",
                    redact(url)
                )));
            }
            let certs = redis::TlsCertificates { client_tls: None, root_cert: Some(pem.clone()) };
            let client = redis::Client::build_with_tls(info, certs).map_err(|e| {
                Error::Config(format!("the certificate authority given to tls_root_certificate is not usable PEM: {e}"))
            })?;
            return Ok(client.get_connection_info().clone());
        }
        Ok(info)
    }

    /// How logs and errors name the target: its URLs without passwords.
    fn describe(&self) -> String {
        match &self.target {
            Target::Url(url) => redact(url),
            #[cfg(feature = "cluster")]
            Target::Cluster(urls) => urls.iter().map(|u| redact(u)).collect::<Vec<_>>().join(","),
            #[cfg(feature = "sentinel")]
            Target::Sentinel { urls, master } => format!(
                "redis+sentinel://{}/{master}",
                urls.iter().map(|u| redact(u).replacen("redis://", "", 1)).collect::<Vec<_>>().join(",")
            ),
            Target::Pool(_) => "redis (pool)".to_owned(),
            #[cfg(feature = "cluster")]
            Target::ClusterPool(_) => "redis cluster (pool)".to_owned(),
        }
    }

    fn sending(&self) -> Sending {
        Sending { set_get: self.set_get, functions: self.functions, wait: self.wait, native: self.native }
    }
}

/// Makes rustls' ring provider the process default, unless the application installed one: rustls
/// refuses to pick one itself when a build has two (ring here, aws-lc-rs from another crate).
#[cfg(feature = "tls-rustls")]
fn install_rustls_provider() {
    if rustls::crypto::CryptoProvider::get_default().is_none() {
        // Another thread may have installed one meanwhile: either is fine.
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_config_is_an_error() {
        assert!(matches!(RedisStore::builder("redis://h").pool_size(0).connect_lazy(), Err(Error::Config(_))));
        assert!(matches!(RedisStore::builder("not a url").connect_lazy(), Err(Error::Config(_))));
        #[cfg(feature = "sentinel")]
        {
            let none: [&str; 0] = [];
            assert!(matches!(RedisStore::sentinel_builder(none, "m").connect_lazy(), Err(Error::Config(_))));
            let empty = RedisStore::sentinel_builder(["redis://h:26379"], "").connect_lazy();
            assert!(matches!(empty, Err(Error::Config(_))));
            let ok = RedisStore::sentinel_builder(["redis://u:pw@h:26379", "redis://h2"], "m").connect_lazy().unwrap();
            assert!(format!("{ok:?}").contains("redis+sentinel://u:***@h:26379,h2/m"), "{ok:?}");
        }
    }

    #[test]
    fn bad_wait_settings_are_an_error() {
        let ms = Duration::from_millis;
        let err = |b: RedisStoreBuilder| match b.connect_lazy() {
            Err(Error::Config(msg)) => msg,
            other => panic!("expected a config error, got {other:?}"),
        };
        let b = || RedisStore::builder("redis://h").command_timeout(ms(500));
        assert!(err(b().wait_for_replicas(0, ms(50))).contains("at least 1 replica"));
        assert!(err(b().wait_for_replicas(1, Duration::ZERO)).contains("at least 1 ms"));
        assert!(err(b().wait_for_replicas(1, ms(500))).contains("below the command timeout"));
        assert!(b().wait_for_replicas(1, ms(100)).connect_lazy().is_ok());
    }
}
