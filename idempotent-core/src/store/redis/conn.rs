//! Connections and transport: the pool, the connections kept checked out of it, the command
//! timeout, script calls (`FCALL` or `EVALSHA`, the script given again where the server lacks
//! it), the `WAIT` pipelined behind a write, and the mapping of driver errors to the crate's.

use std::future::Future;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

#[cfg(feature = "cluster")]
use deadpool_redis::cluster;
use deadpool_redis::redis::{self, Value};

use super::RedisStore;
use super::arg::Arg;
use super::script::Lua;
use crate::error::{BoxError, Error};
use crate::key::Key;
use crate::store::{BoxFuture, Store};

/// Where the store draws its connections from: a deadpool pool, or the sentinels.
#[derive(Clone)]
pub(super) enum Pool {
    Single(deadpool_redis::Pool),
    #[cfg(feature = "cluster")]
    Cluster(cluster::Pool),
    /// No pool: each connection is opened on the master the sentinels name at the time.
    #[cfg(feature = "sentinel")]
    Sentinel(std::sync::Arc<super::sentinel::Sentinel>),
}

/// How many replicas must acknowledge a write, and for how long to wait for them (see
/// [`RedisStoreBuilder::wait_for_replicas`](super::RedisStoreBuilder::wait_for_replicas)).
#[derive(Debug, Clone, Copy)]
pub(super) struct Wait {
    pub(super) replicas: u32,
    pub(super) timeout: Duration,
}

impl Wait {
    /// Refuses settings the store cannot keep within `command_timeout`.
    pub(super) fn check(&self, command_timeout: Duration) -> Result<(), Error> {
        if self.replicas == 0 {
            return Err(Error::Config(
                "wait_for_replicas needs at least 1 replica; to not wait, leave wait_for_replicas out".into(),
            ));
        }
        if self.timeout < Duration::from_millis(1) {
            return Err(Error::Config(format!(
                "wait_for_replicas timeout {:?} must be at least 1 ms (WAIT with 0 would block for ever)",
                self.timeout
            )));
        }
        if self.timeout >= command_timeout {
            return Err(Error::Config(format!(
                "wait_for_replicas timeout {:?} must be below the command timeout {command_timeout:?}: the WAIT \
                 runs inside each call; lower it or raise command_timeout",
                self.timeout
            )));
        }
        Ok(())
    }

    fn cmd(&self) -> redis::Cmd {
        let mut cmd = redis::cmd("WAIT");
        cmd.arg(self.replicas).arg(u64::try_from(self.timeout.as_millis()).unwrap_or(u64::MAX));
        cmd
    }
}

/// The reply to a write, and, when the store waits for replicas, how many acknowledged it.
pub(super) struct Written {
    pub(super) reply: Value,
    /// `WAIT`'s answer; `None` when the store does not wait.
    pub(super) replicas: Option<i64>,
}

/// Which of the connections the store keeps a command goes out on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Lane {
    /// A plain read (acquire's `GET` first, a state load): always the first connection. A `GET`
    /// costs Redis about a microsecond, less than the system calls around it; on one socket, the
    /// reads of many callers share each write, each read of the replies and each pass of
    /// Redis' event loop. At 64 callers this cut Redis' CPU per replay and raised the replay rate
    /// (BENCHMARKS.md, "Measurements behind other decisions").
    /// Under load acquire's reads also go out together, as one `MGET` (`reads.rs`).
    Read,
    /// Everything else: the other connections in turn (the one connection when the store keeps
    /// one). A script call costs Redis several microseconds; on several sockets Redis answers
    /// one connection's calls while the client reads another's replies, and first executions
    /// measured slower on one connection. Kept off the first connection, a write's `WAIT`
    /// (which holds up the commands behind it on its connection) never delays the reads.
    Turn,
}

/// The pool, and the connections the store keeps checked out of it (see [`RedisStore::conn`]).
pub(super) struct Connections {
    pool: Pool,
    slots: Box<[Mutex<Option<Checkout>>]>,
    next: AtomicUsize,
}

impl Connections {
    /// Keeps `size` connections (at least one) checked out of `pool`, opened on first use.
    pub(super) fn new(pool: Pool, size: usize) -> Self {
        let slots = (0..size.max(1)).map(|_| Mutex::new(None)).collect();
        Connections { pool, slots, next: AtomicUsize::new(0) }
    }
}

/// A connection checked out of the pool and kept in a slot.
enum Checkout {
    Single(deadpool_redis::Connection),
    #[cfg(feature = "cluster")]
    Cluster(cluster::Connection),
    #[cfg(feature = "sentinel")]
    Sentinel(redis::aio::MultiplexedConnection),
}

impl Checkout {
    fn handle(&self) -> Conn {
        match self {
            Checkout::Single(c) => Conn::Single((**c).clone()),
            #[cfg(feature = "cluster")]
            Checkout::Cluster(c) => Conn::Cluster((**c).clone()),
            #[cfg(feature = "sentinel")]
            Checkout::Sentinel(c) => Conn::Single(c.clone()),
        }
    }

    /// Takes the connection out of the pool for good, so it is never recycled.
    fn detach(self) {
        match self {
            Checkout::Single(c) => drop(deadpool_redis::Connection::take(c)),
            #[cfg(feature = "cluster")]
            Checkout::Cluster(c) => drop(cluster::Connection::take(c)),
            #[cfg(feature = "sentinel")]
            Checkout::Sentinel(c) => drop(c),
        }
    }
}

/// A clone of a checked-out connection, used for one command.
pub(super) enum Conn {
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

pub(super) use crate::store::lock;

fn is_connection_error(e: &redis::RedisError) -> bool {
    e.is_io_error() || e.is_connection_dropped() || e.is_connection_refusal()
}

/// Whether `e` says the connection leads somewhere it should not, or nowhere: broken (see
/// [`is_connection_error`]), or to a replica (`READONLY`: the master it was opened on was demoted
/// since). Such a connection is replaced; through Sentinel, its replacement goes to the master
/// the sentinels name then. A `READONLY` write changed nothing, so it may be sent again.
fn is_misplaced(e: &redis::RedisError) -> bool {
    is_connection_error(e) || e.code() == Some("READONLY")
}

/// How many times a call is sent again for what the server lacked: an unknown function (the
/// library loaded, or its load refused and the call turned into an `EVALSHA`), then `NOSCRIPT`
/// of that `EVALSHA`, and one more for a flush between them.
const RECOVERIES: usize = 3;

/// A script call (`FCALL` or `EVALSHA`), giving the server what it lacks first when it does not
/// know the script (a restart, a flush, a new cluster node: [`Lua::recover`]). Written here
/// rather than through redis-rs's `Script::invoke_async`, which reloads on `NOSCRIPT` too, so
/// that [`RedisStore::invoke`] can presize the command and write each argument straight into it.
async fn eval(conn: &mut Conn, script: &Lua, cmd: &redis::Cmd) -> redis::RedisResult<Value> {
    match cmd.query_async(conn).await {
        // Boxed, like the pool checkout in `conn`: a rare path kept out of every call's future.
        Err(e) => Box::pin(eval_again(conn, script, cmd, e)).await,
        res => res,
    }
}

async fn eval_again(
    conn: &mut Conn,
    script: &Lua,
    cmd: &redis::Cmd,
    mut err: redis::RedisError,
) -> redis::RedisResult<Value> {
    let mut cmd = cmd.clone();
    for _ in 0..RECOVERIES {
        match script.recover(conn, &cmd, &err).await? {
            Some(again) => cmd = again,
            None => return Err(err),
        }
        match cmd.query_async(conn).await {
            Err(e) => err = e,
            res => return res,
        }
    }
    Err(err)
}

/// `cmd` (a script call, or a plain command) and `wait` in one pipeline, on one connection, so
/// that the `WAIT` covers the write (on a cluster the pipeline goes to the node of `cmd`'s key,
/// and is redirected whole). When the server does not know the script, it is given it and the
/// pipeline is sent again.
async fn exchange_waited(
    conn: &mut Conn,
    script: Option<&Lua>,
    cmd: &redis::Cmd,
    wait: &Wait,
) -> redis::RedisResult<(Value, Value)> {
    // The command sent instead of `cmd` after a recovery (none on the usual path).
    let mut again: Option<redis::Cmd> = None;
    let mut recoveries = 0;
    loop {
        let cmd = again.as_ref().unwrap_or(cmd);
        let mut pipe = redis::Pipeline::with_capacity(2);
        pipe.add_command(cmd.clone()).add_command(wait.cmd());
        let mut replies = redis::aio::ConnectionLike::req_packed_commands(conn, &pipe, 0, 2).await?.into_iter();
        let (Some(reply), Some(acked)) = (replies.next(), replies.next()) else {
            return Err(redis::RedisError::from((redis::ErrorKind::Parse, "a pipeline of two got fewer replies")));
        };
        match (reply.extract_error(), script) {
            (Err(e), Some(script)) if recoveries < RECOVERIES => match Box::pin(script.recover(conn, cmd, &e)).await? {
                Some(next) => {
                    again = Some(next);
                    recoveries += 1;
                }
                None => return Err(e),
            },
            (Err(e), _) => return Err(e),
            (Ok(reply), _) => return Ok((reply, acked.extract_error()?)),
        }
    }
}

/// One node a scan reads: the standalone server, or a cluster master by its address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Node {
    Only,
    #[cfg(feature = "cluster")]
    Master {
        host: String,
        port: u16,
    },
}

impl RedisStore {
    /// Whether the store runs on Redis Cluster.
    pub(super) fn is_cluster(&self) -> bool {
        match self.inner.conns.pool {
            Pool::Single(_) => false,
            #[cfg(feature = "cluster")]
            Pool::Cluster(_) => true,
            #[cfg(feature = "sentinel")]
            Pool::Sentinel(_) => false,
        }
    }

    /// Sends `pipe` (each of its commands answered) to `node`, within the command timeout. A
    /// command's error comes back as its reply ([`Value::ServerError`]), so that one refused
    /// command fails none of the others.
    pub(super) async fn on_node(
        &self,
        op: &'static str,
        node: &Node,
        pipe: &redis::Pipeline,
    ) -> Result<Vec<Value>, Error> {
        let count = pipe.cmd_iter().count();
        self.timed(op, async {
            let conn = self.conn(op, Lane::Turn).await?;
            let res = match (conn, node) {
                (Conn::Single(mut c), _) => {
                    redis::aio::ConnectionLike::req_packed_commands(&mut c, pipe, 0, count).await
                }
                #[cfg(feature = "cluster")]
                (Conn::Cluster(mut c), Node::Master { host, port }) => {
                    let route =
                        redis::cluster_routing::SingleNodeRoutingInfo::ByAddress { host: host.clone(), port: *port };
                    c.route_pipeline(pipe.clone(), 0, count, route).await
                }
                #[cfg(feature = "cluster")]
                (Conn::Cluster(_), Node::Only) => {
                    Err(redis::RedisError::from((redis::ErrorKind::Client, "a cluster scan names its node")))
                }
            };
            self.checked_reply(op, res)
        })
        .await
    }

    /// Sends one command on a pooled connection, within the command timeout.
    pub(super) async fn run(&self, op: &'static str, cmd: redis::Cmd) -> Result<Value, Error> {
        self.timed(op, async {
            let mut conn = self.conn(op, Lane::Turn).await?;
            let res = cmd.query_async(&mut conn).await;
            self.checked_reply(op, res)
        })
        .await
    }

    /// A call of `script` (`FCALL` or `EVALSHA`) on the record of `key`, with `args`.
    pub(super) async fn invoke(
        &self,
        op: &'static str,
        script: &Lua,
        key: &Key,
        args: &[Arg<'_>],
    ) -> Result<Value, Error> {
        let cmd = self.script_call(script, key, args);
        self.exchange(op, key, &cmd, Some(script), None, Lane::Turn).await.map(|w| w.reply)
    }

    /// The call of `script` (`FCALL` or `EVALSHA`: [`Lua::call`]) on the record of `key`,
    /// presized and with each argument written straight into it.
    fn script_call(&self, script: &Lua, key: &Key, args: &[Arg<'_>]) -> redis::Cmd {
        let (command, name) = script.call();
        let len =
            command.len() + name.len() + 1 + self.inner.prefix.len() + 64 + args.iter().map(Arg::len).sum::<usize>();
        let mut cmd = redis::Cmd::with_capacity(4 + args.len(), len);
        cmd.arg(command).arg(name).arg(1).arg(Arg::Key(&self.inner.prefix, key));
        for a in args {
            cmd.arg(a);
        }
        cmd
    }

    /// [`invoke`](Self::invoke) of a write a caller acts on: followed by the `WAIT` of
    /// [`RedisStoreBuilder::wait_for_replicas`](super::RedisStoreBuilder::wait_for_replicas)
    /// when the store waits for replicas.
    pub(super) async fn invoke_written(
        &self,
        op: &'static str,
        script: &Lua,
        key: &Key,
        args: &[Arg<'_>],
    ) -> Result<Written, Error> {
        let cmd = self.script_call(script, key, args);
        self.exchange(op, key, &cmd, Some(script), self.inner.wait.as_ref(), Lane::Turn).await
    }

    /// Sends `cmd`, a plain command that reads `key`, on the connection of [`Lane::Read`],
    /// within the command timeout.
    pub(super) async fn read(&self, op: &'static str, key: &Key, cmd: &redis::Cmd) -> Result<Value, Error> {
        self.exchange(op, key, cmd, None, None, Lane::Read).await.map(|w| w.reply)
    }

    /// A plain command that writes `key`, a write a caller acts on: on a connection of
    /// [`Lane::Turn`], followed by the `WAIT` when the store waits for replicas.
    pub(super) async fn send_written(&self, op: &'static str, key: &Key, cmd: &redis::Cmd) -> Result<Written, Error> {
        self.exchange(op, key, cmd, None, self.inner.wait.as_ref(), Lane::Turn).await
    }

    /// Sends `cmd` on a connection of `lane`, and `wait` behind it in the same pipeline when
    /// given.
    async fn exchange(
        &self,
        op: &'static str,
        key: &Key,
        cmd: &redis::Cmd,
        script: Option<&Lua>,
        wait: Option<&Wait>,
        lane: Lane,
    ) -> Result<Written, Error> {
        // Boxed so that the futures of every store call stay small: they are moved into their
        // own boxes and into the timeout, and a large state machine would be copied each time.
        let work: BoxFuture<'_, Result<Written, Error>> = Box::pin(async {
            let mut retried = false;
            loop {
                let mut conn = self.conn(op, lane).await?;
                let res = match (wait, script) {
                    (Some(wait), _) => {
                        exchange_waited(&mut conn, script, cmd, wait).await.and_then(|(reply, acked)| match acked {
                            Value::Int(n) => Ok(Written { reply, replicas: Some(n) }),
                            other => Err(redis::RedisError::from((
                                redis::ErrorKind::Parse,
                                "unexpected WAIT reply",
                                format!("{other:?}"),
                            ))),
                        })
                    }
                    (None, Some(script)) => {
                        eval(&mut conn, script, cmd).await.map(|reply| Written { reply, replicas: None })
                    }
                    (None, None) => cmd.query_async(&mut conn).await.map(|reply| Written { reply, replicas: None }),
                };
                match res {
                    // The connection was found dead (a restart or a network blip since its last
                    // use), or on a demoted master. Every command is idempotent for its owner
                    // token, so one more try on a fresh connection is safe even if the first
                    // request did reach the server.
                    Err(e) if !retried && is_misplaced(&e) => {
                        self.discard_all();
                        tracing::debug!(op, error = %e, "idempotent.redis: retrying on a fresh connection");
                        retried = true;
                    }
                    res => return self.checked_reply(op, res),
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

    /// For the state store (`crate::state`): `cmd` on the one Redis key it names, through the
    /// store's connections, command timeout, retry on a dead connection and error mapping;
    /// `script` is given to the server again when it lacks it (`NOSCRIPT`). A `written` call is
    /// followed by the store's `WAIT`, and fails when too few replicas acknowledged it. `key`
    /// names the state in errors.
    pub(crate) async fn state_call(
        &self,
        op: &'static str,
        key: &Key,
        cmd: &redis::Cmd,
        script: Option<&Lua>,
        written: bool,
    ) -> Result<Value, Error> {
        let wait = if written { self.inner.wait.as_ref() } else { None };
        // A load (a plain read) goes with the store's other reads.
        let lane = if written || script.is_some() { Lane::Turn } else { Lane::Read };
        let reply = self.exchange(op, key, cmd, script, wait, lane).await?;
        self.replicated(op, reply.replicas)?;
        Ok(reply.reply)
    }

    /// Opens every connection the store keeps and loads `scripts` (see
    /// [`warm_up`](RedisStore::warm_up)).
    pub(super) async fn open_all(&self, scripts: &[&Lua]) -> Result<(), Error> {
        let conns = &self.inner.conns;
        for slot in 0..conns.slots.len() {
            if lock(&conns.slots[slot]).is_none() {
                self.timed("warm_up", self.fill(slot, "warm_up")).await?;
            }
        }
        let mut library_loaded = false;
        for script in scripts {
            library_loaded = self
                .timed("warm_up", async {
                    let mut conn = self.conn("warm_up", Lane::Turn).await?;
                    let res = script.load(&mut conn, library_loaded).await;
                    self.checked_reply("warm_up", res)
                })
                .await?;
        }
        Ok(())
    }

    /// Bounds `work` (connection wait included) by the command timeout. A call cut short may
    /// have left its connection mid-reply, so that connection is not used again.
    async fn timed<T>(&self, op: &'static str, work: impl Future<Output = Result<T, Error>>) -> Result<T, Error> {
        match tokio::time::timeout(self.inner.timeout, work).await {
            Ok(res) => res,
            Err(_) => {
                self.discard_all();
                Err(self.timeout_error(op))
            }
        }
    }

    /// A multiplexed connection for one command.
    ///
    /// deadpool recycles a connection on every checkout with an `UNWATCH` + `PING` round trip,
    /// which would add a round trip to every call. The connections are multiplexed (many
    /// commands in flight on one socket, each awaited on its own), so instead of checking one
    /// out per call the store keeps a few checked out in slots and sends each call on a clone of
    /// one; nothing is held exclusively while an action runs. When a connection fails, every
    /// slot is emptied and its connection taken out of the pool; the next calls refill the
    /// slots from the pool. Which slot: see [`Lane`].
    async fn conn(&self, op: &'static str, lane: Lane) -> Result<Conn, Error> {
        let conns = &self.inner.conns;
        let slot = match lane {
            Lane::Read => 0,
            Lane::Turn => match conns.slots.len() {
                1 => 0,
                n => 1 + conns.next.fetch_add(1, Ordering::Relaxed) % (n - 1),
            },
        };
        if let Some(kept) = lock(&conns.slots[slot]).as_ref() {
            return Ok(kept.handle());
        }
        // Boxed: the pool's checkout is a large state machine, and only this rare path needs it.
        // Inline, it would grow every store call's future, and each call would pay for an
        // allocation that size (see BENCHMARKS.md).
        Box::pin(self.fill(slot, op)).await
    }

    /// Fills an empty slot from the pool and returns a handle to its connection.
    async fn fill(&self, slot: usize, op: &'static str) -> Result<Conn, Error> {
        let conns = &self.inner.conns;
        let checkout = match &conns.pool {
            Pool::Single(p) => Checkout::Single(p.get().await.map_err(|e| self.pool_error(op, e))?),
            #[cfg(feature = "cluster")]
            Pool::Cluster(p) => Checkout::Cluster(p.get().await.map_err(|e| self.pool_error(op, e))?),
            #[cfg(feature = "sentinel")]
            Pool::Sentinel(sentinel) => {
                let mut asking = sentinel.lock().await;
                // Filled by the refill this one waited for.
                if let Some(filled) = lock(&conns.slots[slot]).as_ref() {
                    return Ok(filled.handle());
                }
                Checkout::Sentinel(asking.connect().await.map_err(|e| self.checked_error(op, e))?)
            }
        };
        let mut slot = lock(&conns.slots[slot]);
        if let Some(filled) = slot.as_ref() {
            // Another call filled the slot while we waited: use its connection and give ours
            // back to the pool.
            return Ok(filled.handle());
        }
        let conn = checkout.handle();
        *slot = Some(checkout);
        Ok(conn)
    }

    /// The driver's reply as the store's; a broken or misplaced connection empties every slot.
    fn checked_reply<T>(&self, op: &'static str, res: redis::RedisResult<T>) -> Result<T, Error> {
        res.map_err(|e| self.checked_error(op, e))
    }

    fn checked_error(&self, op: &'static str, e: redis::RedisError) -> Error {
        if is_misplaced(&e) || e.is_timeout() {
            // Whatever broke this connection (a restart, a network blip, a failover) most likely
            // broke its siblings too: replace them all rather than fail one call per slot.
            self.discard_all();
        }
        self.redis_error(op, e)
    }

    fn discard_all(&self) {
        for slot in self.inner.conns.slots.iter() {
            if let Some(kept) = lock(slot).take() {
                kept.detach();
            }
        }
    }

    fn pool_error(&self, op: &'static str, e: deadpool_redis::PoolError) -> Error {
        match &e {
            deadpool_redis::PoolError::Timeout(_) => {
                return self.timeout_error(op);
            }
            deadpool_redis::PoolError::Backend(b) if b.is_timeout() => {
                return self.timeout_error(op);
            }
            _ => {}
        }
        let reason = match &e {
            deadpool_redis::PoolError::Backend(b) => b.to_string(),
            other => other.to_string(),
        };
        Error::Unavailable { store: self.describe(), op, reason, source: Some(Box::new(e) as BoxError) }
    }

    /// `op` did not answer within the command timeout.
    pub(super) fn timeout_error(&self, op: &'static str) -> Error {
        Error::Timeout { store: self.describe(), op, after: self.inner.timeout }
    }

    fn redis_error(&self, op: &'static str, e: redis::RedisError) -> Error {
        if e.is_timeout() {
            return self.timeout_error(op);
        }
        Error::Unavailable { store: self.describe(), op, reason: e.to_string(), source: Some(Box::new(e)) }
    }
}
