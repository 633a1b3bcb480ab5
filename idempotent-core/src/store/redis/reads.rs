//! Acquire's plain reads of records (its `GET` first), sent together under load.
//!
//! A `GET` costs Redis about a microsecond of command time, and as much again to read the request
//! and write the reply; an `MGET` of many keys costs a fraction of that per key, and the client
//! sends and parses one request instead of many. So once [`BUSY`] reads are in flight and
//! [`IN_FLIGHT`] requests are out, a read does not go out on its own: it waits, with the others
//! that arrive meanwhile, and they go out together as one `MGET` when a request out comes back.
//! Below that every read goes out at once, as a `GET`: while the server keeps up, a wait would
//! only add a round trip. Under load a read waits at most for one request out.
//!
//! Nothing changes about what a read sees: a caller's read joins the queue after every write it
//! awaited was answered, and the `MGET` that carries it goes out later still, on the connection
//! of every other read ([`Lane::Read`](super::conn::Lane)), so it reads those writes as a `GET`
//! would. Only standalone stores batch: on a cluster the keys of one `MGET` would have to share a
//! hash slot.
//!
//! A batch is sent by a task of its own, so that a caller that gives up (a timeout, a dropped
//! future) never strands the others; a caller that gives up while it waits only loses its place.
//! A read that has waited half the store's command timeout goes out alone (its batch is late, or
//! the caller of a read out stopped polling it), and every wait is bounded by the timeout, like
//! the read itself.

use std::borrow::Borrow;
use std::sync::Mutex;

use deadpool_redis::redis::{self, Value};
use tokio::sync::oneshot;
use tokio::time::Instant;

use super::RedisStore;
use super::arg::Arg;
use super::conn::lock;
use crate::error::Error;
use crate::key::Key;

/// Reads in flight (keys out and waiting) below which every read goes out at once: while the
/// server keeps up, a wait would only add its round trip.
const BUSY: usize = 16;

/// Requests out at once (`GET`s and `MGET`s) beyond which, once [`BUSY`], reads wait to go out
/// together.
const IN_FLIGHT: usize = 2;

/// The most keys one `MGET` carries; the rest wait for the next.
const MAX_BATCH: usize = 128;

/// The reads of one store: how many are out, and the ones waiting to go out together.
#[derive(Debug, Default)]
pub(super) struct Reads(Mutex<Queue>);

#[derive(Debug, Default)]
struct Queue {
    /// Requests out (`GET`s and `MGET`s).
    out: usize,
    /// Keys they carry.
    keys_out: usize,
    waiting: Vec<Waiter>,
}

impl Queue {
    /// Whether a read (one more than those waiting) may go out now: while fewer than
    /// [`IN_FLIGHT`] requests are out, or the reads out and waiting are too few for a batch to
    /// pay for its wait.
    fn may_send(&self) -> bool {
        self.out < IN_FLIGHT || self.keys_out + self.waiting.len() < BUSY
    }

    /// Counts a request of `keys` keys out.
    fn send(&mut self, keys: usize) {
        self.out += 1;
        self.keys_out += keys;
    }
}

#[derive(Debug)]
struct Waiter {
    key: Key,
    reply: oneshot::Sender<Result<Value, Error>>,
}

/// A read out (a `GET` or an `MGET` of `keys` keys), counted until this is dropped: then,
/// however the read ended (answered, failed, cancelled, its task dropped unrun), the reads that
/// waited meanwhile go out. Holds the store by reference for a caller's own read, owned for a
/// batch's task.
struct Out<S: Borrow<RedisStore>> {
    store: S,
    keys: usize,
}

impl<S: Borrow<RedisStore>> Drop for Out<S> {
    fn drop(&mut self) {
        let store = self.store.borrow();
        let mut queue = lock(&store.inner.reads.0);
        queue.out -= 1;
        queue.keys_out -= self.keys;
        if queue.waiting.is_empty() || !queue.may_send() {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            // Dropped outside a runtime (one shutting down): nothing can be sent, and the
            // waiters hear so.
            let waiting = std::mem::take(&mut queue.waiting);
            drop(queue);
            for waiter in waiting {
                let _ = waiter.reply.send(Err(store.unsent()));
            }
            return;
        };
        let take = queue.waiting.len().min(MAX_BATCH);
        let batch: Vec<Waiter> = queue.waiting.drain(..take).collect();
        queue.send(batch.len());
        drop(queue);
        // Counted from here: a task dropped before it runs still gives its count back.
        let out = Out { store: store.clone(), keys: batch.len() };
        rt.spawn(async move {
            send_batch(&out.store, batch).await;
            drop(out);
        });
    }
}

/// The read of the records under `keys`: a `GET` of one, an `MGET` of more.
fn read_cmd<'a>(prefix: &str, keys: impl ExactSizeIterator<Item = &'a Key>) -> redis::Cmd {
    let n = keys.len();
    let mut cmd = redis::Cmd::with_capacity(1 + n, 5 + n * (prefix.len() + 64));
    cmd.arg(if n == 1 { "GET" } else { "MGET" });
    for key in keys {
        cmd.arg(Arg::Key(prefix, key));
    }
    cmd
}

/// The record of each waiter, by one `MGET` (a `GET` when there is one).
async fn send_batch(store: &RedisStore, batch: Vec<Waiter>) {
    let cmd = read_cmd(&store.inner.prefix, batch.iter().map(|w| &w.key));
    match store.read("acquire", &batch[0].key, &cmd).await {
        Ok(Value::Array(values)) if values.len() == batch.len() => {
            for (waiter, value) in batch.into_iter().zip(values) {
                let _ = waiter.reply.send(Ok(value));
            }
        }
        Ok(value) if batch.len() == 1 => {
            let _ = batch.into_iter().next().map(|w| w.reply.send(Ok(value)));
        }
        Ok(other) => {
            let reason = format!("unexpected MGET reply to {} keys: {other:?}", batch.len());
            for waiter in batch {
                let _ = waiter.reply.send(Err(store.unavailable(reason.clone())));
            }
        }
        Err(e) => {
            for waiter in batch {
                let _ = waiter.reply.send(Err(copy(store, &e)));
            }
        }
    }
}

/// The same error again, for each waiter of a batch (without the driver's error as a source).
fn copy(store: &RedisStore, e: &Error) -> Error {
    match e {
        Error::Timeout { store, op, after } => Error::Timeout { store: store.clone(), op, after: *after },
        Error::Unavailable { store, op, reason, .. } => {
            Error::Unavailable { store: store.clone(), op, reason: reason.clone(), source: None }
        }
        Error::Corrupt { key, detail } => Error::Corrupt { key: key.clone(), detail: detail.clone() },
        other => store.unavailable(other.to_string()),
    }
}

impl RedisStore {
    /// The record under `key` (its bytes, or `Nil`): read at once, or under load together with
    /// the reads that arrive meanwhile (see the [module documentation](self)).
    pub(super) async fn read_record_bytes(&self, key: &Key) -> Result<Value, Error> {
        if self.is_cluster() {
            return self.read_alone(key).await;
        }
        let waiting = {
            let mut queue = lock(&self.inner.reads.0);
            if queue.may_send() {
                queue.send(1);
                None
            } else {
                let (reply, waiting) = oneshot::channel();
                queue.waiting.push(Waiter { key: *key, reply });
                Some(waiting)
            }
        };
        // Each way in a future of its own: this future is part of every acquire's boxed one,
        // which this keeps within glibc's per-thread cache (see BENCHMARKS.md).
        match waiting {
            None => {
                let out = Out { store: self, keys: 1 };
                let value = self.read_alone(key).await;
                drop(out);
                value
            }
            Some(waiting) => self.wait_for_batch(key, waiting).await,
        }
    }

    /// The record under `key`, read on its own (a `GET`).
    async fn read_alone(&self, key: &Key) -> Result<Value, Error> {
        self.read("acquire", key, &read_cmd(&self.inner.prefix, std::iter::once(key))).await
    }

    /// The record under `key` from the batch `waiting` is answered by, within half the command
    /// timeout, or else read alone (its batch is late, or was never sent): a read out whose
    /// caller stopped polling holds no one up for longer. One timer while it waits; a read alone
    /// brings its own.
    async fn wait_for_batch(
        &self,
        key: &Key,
        waiting: oneshot::Receiver<Result<Value, Error>>,
    ) -> Result<Value, Error> {
        // Durations, not deadlines: tokio's `timeout` takes a timeout too long to add to the
        // clock as none at all.
        let (start, timeout) = (Instant::now(), self.inner.timeout);
        if let Ok(Ok(value)) = tokio::time::timeout(timeout / 2, waiting).await {
            return value;
        }
        // Bounded like the read itself, from the start of the wait, but without discarding the
        // connections: a waiter's wait is not a sign that they broke. Boxed: only a late batch
        // needs it, and inline it would grow every read's future.
        let rest = timeout.saturating_sub(start.elapsed());
        Box::pin(tokio::time::timeout(rest, self.read_alone(key)))
            .await
            .unwrap_or_else(|_| Err(self.timeout_error("acquire")))
    }

    /// What a waiter hears when its batch could not be sent.
    fn unsent(&self) -> Error {
        self.unavailable("the read could not be sent: no runtime to send it on".into())
    }

    fn unavailable(&self, reason: String) -> Error {
        Error::Unavailable { store: self.inner.describe.clone(), op: "acquire", reason, source: None }
    }
}

#[cfg(test)]
mod tests {
    use super::{BUSY, IN_FLIGHT, Queue};

    #[test]
    fn reads_go_out_at_once_until_enough_are_in_flight_and_requests_are_out() {
        // Below BUSY reads in flight, every read goes out at once, however many requests are out.
        let mut queue = Queue::default();
        for n in 0..BUSY {
            assert!(queue.may_send(), "read {n} waited with {n} in flight");
            queue.send(1);
        }
        assert!(!queue.may_send(), "{BUSY} reads in flight on {BUSY} requests: the next waits");
        // Fewer than IN_FLIGHT requests out: a read (or the batch that waited) goes out whatever
        // the load.
        let mut queue = Queue { out: IN_FLIGHT - 1, keys_out: 4 * BUSY, waiting: Vec::new() };
        assert!(queue.may_send());
        queue.send(BUSY);
        assert!(!queue.may_send(), "{IN_FLIGHT} requests out and {} reads in flight", 5 * BUSY);
    }
}
