//! The store's writes to the file: one at a time from this process, on a connection of their
//! own, and together under load (group commit).
//!
//! SQLite lets one connection write at a time, and every write transaction syncs the WAL once
//! (`synchronous = FULL`). So the store's writes do not race for the lock on the pool's
//! connections. A write that finds none of the store's out goes at once, in autocommit, as it
//! always did; the writes that arrive while one is out wait in the store, and when it ends they
//! go out together, in one `BEGIN IMMEDIATE` transaction, synced once for all of them (at most
//! [`MAX_BATCH`]). One caller pays nothing for the queue; many share a sync.
//!
//! Nothing changes about what a write does. Each is the same atomic statement, judged on the row
//! as it is under the write lock, with the database's clock read inside it; in a batch, each sees
//! the writes before it, as it would have had it run after them. Every write of a batch is
//! answered once the batch committed, never before. A statement of a batch that fails rolls the
//! batch back, and its writes go out again one at a time in autocommit, so that a failure
//! answers its own write only. A `BEGIN` or `COMMIT` that fails answers every write of its
//! batch with its error: nothing was committed (the file is local; no reply is lost).
//!
//! The writes go out on one connection the store opens for them, with the pool's options but no
//! busy timeout of SQLite's: SQLite's busy handler sleeps 1, 2, 5, 10 … up to 100 ms between
//! looks at a lock another process holds, and would rarely find it free between the batches of
//! a busy process. Instead, a write that finds the lock taken looks again every [`POLL`], up to
//! the store's timeout (the busy timeout). And after [`HOLD`] of batches back to back, the store
//! lets the lock go for [`PAUSE`] before its next one, so that another process's store, looking
//! every [`POLL`], takes it within about [`HOLD`] however busy this one is (the pause costs at
//! most 3 ms in 23 of write time, and only while the store writes without a break). The
//! application's own transactions on the pool (a step's that commits with its record, a
//! migration), the purge and the versioned state's commits keep SQLite's busy handler, and find
//! the lock free at more of their looks for the pauses; reads never wait here.
//!
//! Every write is bounded by the store's timeout from when it was made, waiting in the queue
//! included: one whose time ran out before its batch began is answered [`Error::Timeout`] and
//! does not go out. A batch runs in a task of its own, so that a caller that gives up never
//! strands the others; a write that waits goes out even if its caller gave up (as a statement
//! sent would have run). A caller that gives up while its own write is out closes the
//! connection (the next write opens another), so that no statement of a dropped future is left
//! on it. `close` waits for the write out, answers those waiting with the pool's closed error,
//! and closes the connection; no write goes out after it.
//!
//! Only a file in WAL mode is written this way (the store's own pool always is; an application's
//! pool may not be). In the rollback journal a commit needs every reader gone, which a batch
//! would wait on for all its writes, and an in-memory database is not reachable from a second
//! connection: there each write runs on the pool, in autocommit, as before.

use std::borrow::Borrow;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqlx::sqlite::{SqliteConnection, SqlitePool, SqliteRow, SqliteSynchronous};
use sqlx::{ConnectOptions, Executor, SqlStr, Sqlite};
use tokio::sync::{Notify, oneshot};
use tokio::time::Instant;

use super::{SqliteBackend, SqliteStore};
use crate::error::Error;
use crate::store::lock;
use crate::store::sql::Backend;
use crate::store::sql::backend::{Effect, Failed};
use crate::store::sql::driver::{Driver, Value};

/// The most writes one transaction carries; the rest wait for the next.
const MAX_BATCH: usize = 64;

/// How long the store writes batch after batch before it lets the lock go for [`PAUSE`].
const HOLD: Duration = Duration::from_millis(20);

/// How long the lock is let go, after [`HOLD`] of writing, for other processes' writes.
const PAUSE: Duration = Duration::from_millis(3);

/// How often a write looks again at a lock another connection holds.
pub(super) const POLL: Duration = Duration::from_millis(1);

/// What a write answers: the statement's first row, or how many rows it changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Want {
    Row,
    Count,
}

/// A write's answer: its first row, when [`Want::Row`] asked for it, and how many rows it
/// changed (under `Want::Row`, how many it returned).
#[derive(Debug)]
pub(super) struct Written {
    pub(super) row: Option<SqliteRow>,
    pub(super) changed: u64,
}

/// The store's writes: whether they go out together (a file in WAL mode), whether one is out,
/// the connection they go out on, and the ones waiting to go out together.
#[derive(Debug, Default)]
pub struct Writes {
    grouped: AtomicBool,
    queue: Mutex<Queue>,
    /// Told when no write is out any more (`close` waits for it).
    idle: Notify,
}

#[derive(Debug, Default)]
struct Queue {
    /// A write (or a batch) is out.
    out: bool,
    /// Since when writes have gone out one after another without a break (or a pause).
    since: Option<Instant>,
    /// The writes' connection, while none is out (opened by the first write).
    conn: Option<SqliteConnection>,
    waiting: Vec<Waiter>,
}

/// A write waiting, its values its own.
#[derive(Debug)]
struct Waiter {
    op: &'static str,
    /// The store's timeout from when the write was made.
    deadline: Instant,
    sql: SqlStr,
    args: Vec<Value<'static>>,
    want: Want,
    reply: oneshot::Sender<Result<Written, Error>>,
}

/// The write out (a caller's own, or a batch) and the connection it took, until this is
/// dropped: then, however it ended (answered, failed, cancelled, its task dropped unrun), the
/// connection goes back (unless the write dropped it) and the writes that waited meanwhile go
/// out. Holds the store by reference for a caller's own write, owned for a batch's task.
struct Out<S: Borrow<SqliteStore>> {
    store: S,
    conn: Option<SqliteConnection>,
}

impl<S: Borrow<SqliteStore>> Drop for Out<S> {
    fn drop(&mut self) {
        let store = self.store.borrow();
        let writes = &store.inner.writes;
        let mut queue = lock(&writes.queue);
        let closed = store.inner.pool.is_closed();
        // Not kept for a store closed meanwhile.
        if let Some(conn) = self.conn.take().filter(|_| !closed) {
            queue.conn = Some(conn);
        }
        if queue.waiting.is_empty() {
            queue.out = false;
            queue.since = None;
            drop(queue);
            writes.idle.notify_waiters();
            return;
        }
        let rt = tokio::runtime::Handle::try_current();
        if closed || rt.is_err() {
            // A closed store, or dropped outside a runtime (one shutting down): nothing goes
            // out, and the waiters hear why.
            queue.out = false;
            queue.since = None;
            let waiting = std::mem::take(&mut queue.waiting);
            drop(queue);
            writes.idle.notify_waiters();
            for waiter in waiting {
                let error =
                    if closed { store.error(waiter.op, sqlx::Error::PoolClosed) } else { store.unsent(waiter.op) };
                let _ = waiter.reply.send(Err(error));
            }
            return;
        }
        let Ok(rt) = rt else { return };
        let take = queue.waiting.len().min(MAX_BATCH);
        let batch: Vec<Waiter> = queue.waiting.drain(..take).collect();
        let now = Instant::now();
        let pause = queue.since.is_some_and(|since| now.duration_since(since) >= HOLD);
        if pause {
            queue.since = Some(now + PAUSE);
        }
        // Out from here, with the connection: a task dropped before it runs still gives it back
        // and lets the next batch go.
        let out = Out { store: store.clone(), conn: queue.conn.take() };
        drop(queue);
        rt.spawn(async move {
            let mut out = out;
            if pause {
                tokio::time::sleep(PAUSE).await;
            }
            commit(&mut out, batch).await;
        });
    }
}

impl<S: Borrow<SqliteStore>> Out<S> {
    /// The writes' connection: the one this holds, or a new one (with no busy timeout of
    /// SQLite's: [`locked`] waits instead; and `synchronous = FULL`).
    async fn conn(&mut self) -> Result<SqliteConnection, sqlx::Error> {
        if let Some(conn) = self.conn.take() {
            return Ok(conn);
        }
        let pool = &self.store.borrow().inner.pool;
        if pool.is_closed() {
            return Err(sqlx::Error::PoolClosed);
        }
        let options = pool.connect_options();
        // FULL whatever the options say: the pool was checked to sync every commit, but perhaps
        // by its `after_connect` hook, which this connection does not run (in WAL mode, EXTRA
        // syncs no more than FULL).
        let options = options.as_ref().clone().busy_timeout(Duration::ZERO).synchronous(SqliteSynchronous::Full);
        options.connect().await
    }
}

/// Whether `e` says the lock was taken (`SQLITE_BUSY`, `SQLITE_LOCKED`).
pub(super) fn is_busy(e: &sqlx::Error) -> bool {
    e.as_database_error().is_some_and(SqliteBackend::is_timeout)
}

/// One write on `conn`, answered as `want` asks.
async fn run(
    conn: &mut SqliteConnection,
    sql: &SqlStr,
    args: impl IntoIterator<Item = Value<'_>>,
    want: Want,
) -> Result<Written, sqlx::Error> {
    let q = Sqlite::query(sql, args);
    Ok(match want {
        // Stepped to its end (not stopped at the first row), so that an error of the statement's
        // own commit is the answer, not dropped with the statement.
        Want::Row => {
            let rows = q.fetch_all(conn).await?;
            Written { changed: rows.len() as u64, row: rows.into_iter().next() }
        }
        Want::Count => Written { row: None, changed: q.execute(conn).await?.rows_affected() },
    })
}

/// Whether an attempt that failed with `e` is made again, after [`POLL`]: SQLite answered that
/// the lock is taken (the attempt did nothing), and `deadline` is further than that.
fn busy_again(e: &sqlx::Error, deadline: Instant) -> bool {
    is_busy(e) && Instant::now() + POLL < deadline
}

/// `attempt()`, made again while [`busy_again`] says so.
pub(super) async fn while_busy<T, F, Fut>(deadline: Instant, mut attempt: F) -> Result<T, sqlx::Error>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, sqlx::Error>>,
{
    loop {
        match attempt().await {
            Err(e) if busy_again(&e, deadline) => tokio::time::sleep(POLL).await,
            answer => return answer,
        }
    }
}

/// `statement` (a write, or `BEGIN IMMEDIATE`) on `conn`, made again while [`busy_again`] says so
/// (the loop of [`while_busy`], which cannot lend `conn` to each attempt's future).
async fn locked<'a>(
    conn: &mut SqliteConnection,
    deadline: Instant,
    sql: &SqlStr,
    args: &'a [Value<'a>],
    want: Want,
) -> Result<Written, sqlx::Error> {
    loop {
        match run(conn, sql, args.iter().map(Value::borrowed), want).await {
            Err(e) if busy_again(&e, deadline) => tokio::time::sleep(POLL).await,
            answer => return answer,
        }
    }
}

/// One write on a connection of `pool`, as each went out before (a file not in WAL mode).
async fn run_on_pool<'a>(
    pool: &SqlitePool,
    sql: &'a SqlStr,
    args: impl IntoIterator<Item = Value<'a>>,
    want: Want,
) -> Result<Written, sqlx::Error> {
    let mut conn = pool.acquire().await?;
    run(&mut conn, sql, args, want).await
}

/// The writes of `batch`, in one transaction (alone in autocommit when it is one), on `out`'s
/// connection.
async fn commit(out: &mut Out<SqliteStore>, batch: Vec<Waiter>) {
    let store = out.store.clone();
    if store.inner.pool.is_closed() {
        return answer_all(&store, batch, sqlx::Error::PoolClosed);
    }
    // Those whose time ran out while they waited do not go out.
    let now = Instant::now();
    let (batch, late): (Vec<Waiter>, Vec<Waiter>) = batch.into_iter().partition(|w| w.deadline > now);
    for waiter in late {
        let _ = waiter.reply.send(Err(store.timed_out(waiter.op)));
    }
    let Some(first) = batch.iter().map(|w| w.deadline).min() else { return };
    let mut conn = match out.conn().await {
        Ok(conn) => conn,
        Err(e) => return answer_all(&store, batch, e),
    };
    if batch.len() == 1 {
        one_by_one(&store, &mut conn, batch).await;
        out.conn = Some(conn);
        return;
    }
    let begin = crate::store::sql::statements::sql("BEGIN IMMEDIATE".to_owned());
    if let Err(e) = locked(&mut conn, first, &begin, &[], Want::Count).await {
        out.conn = Some(conn);
        return answer_all(&store, batch, e);
    }
    let mut written = Vec::with_capacity(batch.len());
    for waiter in &batch {
        match run(&mut conn, &waiter.sql, waiter.args.iter().map(Value::borrowed), waiter.want).await {
            Ok(answer) => written.push(answer),
            Err(e) => {
                tracing::debug!(op = waiter.op, error = %e, "idempotent.sqlite: a write of a batch failed; the batch goes out again one write at a time");
                // A connection that cannot roll back is closed, which rolls back.
                if conn.execute("ROLLBACK").await.is_err() {
                    drop(conn);
                    conn = match out.conn().await {
                        Ok(conn) => conn,
                        Err(e) => return answer_all(&store, batch, e),
                    };
                }
                one_by_one(&store, &mut conn, batch).await;
                out.conn = Some(conn);
                return;
            }
        }
    }
    match conn.execute("COMMIT").await {
        Ok(_) => {
            out.conn = Some(conn);
            for (waiter, answer) in batch.into_iter().zip(written) {
                let _ = waiter.reply.send(Ok(answer));
            }
        }
        // Closed, which rolls back what is left of the transaction.
        Err(e) => answer_all(&store, batch, e),
    }
}

/// Each write of `batch` on its own, in autocommit.
async fn one_by_one(store: &SqliteStore, conn: &mut SqliteConnection, batch: Vec<Waiter>) {
    for waiter in batch {
        let answer = if waiter.deadline > Instant::now() {
            locked(conn, waiter.deadline, &waiter.sql, &waiter.args, waiter.want)
                .await
                .map_err(|e| store.error(waiter.op, e))
        } else {
            Err(store.timed_out(waiter.op))
        };
        let _ = waiter.reply.send(answer);
    }
}

/// Every write of `batch` answered by the error `e` of its connection, `BEGIN` or `COMMIT`.
fn answer_all(store: &SqliteStore, batch: Vec<Waiter>, e: sqlx::Error) {
    let e = Arc::new(e);
    for waiter in batch {
        let _ = waiter.reply.send(Err(store.error(waiter.op, e.clone())));
    }
}

impl SqliteStore {
    /// Runs the write `sql` with `args`: at once when none of the store's writes is out, or
    /// else with the others that arrive meanwhile, in one transaction (see the
    /// [module documentation](self)).
    pub(super) async fn write<'a>(
        &self,
        op: &'static str,
        sql: &'a SqlStr,
        args: impl IntoIterator<Item = Value<'a>>,
        want: Want,
    ) -> Result<Written, Failed> {
        if !self.inner.writes.grouped.load(Ordering::Relaxed) {
            let answer = run_on_pool(&self.inner.pool, sql, args, want).await;
            return answer.map_err(|e| Failed::not_sent(self.error(op, e)));
        }
        let deadline = Instant::now() + self.inner.timeout;
        let args: Vec<Value<'a>> = args.into_iter().collect();
        let waiting = {
            let mut queue = lock(&self.inner.writes.queue);
            // Under the lock: `close` waits for the write out, so none begins after it.
            if self.inner.pool.is_closed() {
                return Err(Failed::not_sent(self.error(op, sqlx::Error::PoolClosed)));
            }
            if queue.out {
                let (reply, waiting) = oneshot::channel();
                let args = args.into_iter().map(Value::into_owned).collect();
                queue.waiting.push(Waiter { op, deadline, sql: sql.clone(), args, want, reply });
                Err(waiting)
            } else {
                queue.out = true;
                queue.since = Some(Instant::now());
                Ok((queue.conn.take(), args))
            }
        };
        match waiting {
            Ok((conn, args)) => {
                let mut out = Out { store: self, conn };
                let mut conn = out.conn().await.map_err(|e| Failed::not_sent(self.error(op, e)))?;
                // Dropped here with the future if the caller gives up: closed, not reused.
                let answer = locked(&mut conn, deadline, sql, &args, want).await;
                out.conn = Some(conn);
                drop(out);
                answer.map_err(|e| Failed::not_sent(self.error(op, e)))
            }
            Err(waiting) => match waiting.await {
                Ok(answer) => answer.map_err(Failed::not_sent),
                // Its batch's task was dropped (its runtime shut down): the write may have run.
                Err(_) => Err(Failed { error: self.unsent(op), effect: Effect::Unknown }),
            },
        }
    }

    /// Waits for the write out, then closes the writes' connection (the pool is closed
    /// already: no write begins after it, and those waiting were answered).
    pub(super) async fn close_writes(&self) {
        let writes = &self.inner.writes;
        let conn = loop {
            let idle = writes.idle.notified();
            tokio::pin!(idle);
            idle.as_mut().enable();
            {
                let mut queue = lock(&writes.queue);
                if !queue.out {
                    break queue.conn.take();
                }
            }
            idle.await;
        };
        if let Some(conn) = conn {
            let _ = sqlx::Connection::close(conn).await;
        }
    }

    /// Whether the file is in WAL mode, where the store's writes go out together; elsewhere each
    /// runs on the pool (see the [module documentation](self)). Read once, when the store opens.
    pub(super) async fn choose_writes(&self) -> Result<(), Error> {
        // Looked at again while the file is busy: a store opening beside others on a new file
        // can find it so at once (SQLite's busy handler does not wait for every lock).
        let deadline = Instant::now() + self.inner.timeout;
        let mode: String =
            while_busy(deadline, || sqlx::query_scalar("PRAGMA journal_mode").fetch_one(&self.inner.pool))
                .await
                .map_err(|e| self.error("open", e))?;
        self.inner.writes.grouped.store(mode.eq_ignore_ascii_case("wal"), Ordering::Relaxed);
        Ok(())
    }

    /// What a waiting write hears when its batch could not run to its end.
    fn unsent(&self, op: &'static str) -> Error {
        Error::Unavailable {
            store: self.inner.describe.clone(),
            op,
            reason: "the write's batch did not run to its end: its runtime shut down".into(),
            source: None,
        }
    }
}
