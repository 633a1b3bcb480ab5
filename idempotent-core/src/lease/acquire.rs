//! Taking the key: [`acquire`] and what it found ([`Taken`]).

use std::time::Duration;

use bytes::Bytes;
use tokio::time::Instant;

use super::{Lease, OnInFlight, Terms};
use crate::backoff::Backoff;
use crate::error::Error;
use crate::key::{Fingerprint, Key};
use crate::metrics::{CallEnd, Op, Timer};
use crate::record::{Acquire, Labels};
use crate::store::{SharedStore, Store};

/// How waits for an attempt in flight are spaced: 10 ms, doubling up to 500 ms, never past the
/// holder's own lease deadline.
const IN_FLIGHT_POLL: Backoff = Backoff::new(Duration::from_millis(10), Duration::from_millis(500));

/// What [`acquire`] found.
#[derive(Debug)]
#[non_exhaustive]
pub enum Taken {
    /// The key is this caller's: run the work under the lease.
    Lease(Lease),
    /// The operation is done; here is its stored outcome.
    Replay(Bytes),
    /// Another attempt holds a live lease (and the terms say not to wait, or the wait ran out).
    InFlight {
        /// Until that attempt's lease runs out, at the latest.
        retry_after: Duration,
    },
    /// The key is stored with another fingerprint.
    Mismatch,
    /// A previous attempt could not tell whether the work ran, and the record waits to be
    /// resolved ([`Store::resolve`](crate::store::Store::resolve)): nothing may run.
    NeedsAttention {
        /// The attempt that left the record so.
        attempt: u32,
        /// That attempt's fence.
        fence: u64,
    },
}

/// Takes the key in `store`, waiting for an attempt in flight as `terms.on_in_flight` says.
///
/// Errors are [`Error::Config`] for terms out of bounds ([`Terms::check`]), the store's
/// ([`Error::is_store_failure`] for an unreachable store) or a record that cannot be read
/// ([`Error::Corrupt`]); nothing ran and, on a store failure, the store itself frees whatever
/// its acquire may have taken.
pub async fn acquire(
    store: &SharedStore,
    key: &Key,
    fingerprint: &Fingerprint,
    terms: &Terms,
    labels: Labels<'_>,
) -> Result<Taken, Error> {
    terms.check()?;
    // The wait counts from the first acquire's own clock read, and a lease from the acquire that
    // took it: the store started counting no earlier.
    let mut started = None;
    let mut polls = 0;
    loop {
        let sent = Instant::now();
        let started = *started.get_or_insert(sent);
        let timer = Timer::start();
        let answer = store.acquire_labeled(key, fingerprint, terms.lease, terms.retention, labels).await;
        timer.store_call(&**store, Op::Acquire);
        match answer? {
            Acquire::Acquired(grant) => return Ok(Taken::Lease(Lease::new(store.clone(), *key, grant, terms, sent))),
            Acquire::Replay(bytes) => return Ok(Taken::Replay(bytes)),
            Acquire::Mismatch => return Ok(Taken::Mismatch),
            Acquire::NeedsAttention { attempt, fence } => {
                tracing::warn!(key = %key.short(), attempt, fence, "idempotent.needs_attention: the operation waits to be resolved; nothing runs");
                return Ok(Taken::NeedsAttention { attempt, fence });
            }
            Acquire::InFlight { retry_after } => {
                let OnInFlight::Wait { timeout } = terms.on_in_flight else {
                    tracing::debug!(key = %key.short(), ?retry_after, "idempotent.in_flight: rejected");
                    return Ok(Taken::InFlight { retry_after });
                };
                let waited = started.elapsed();
                if waited >= timeout {
                    tracing::debug!(key = %key.short(), ?waited, "idempotent.in_flight: gave up waiting");
                    return Ok(Taken::InFlight { retry_after });
                }
                tracing::trace!(key = %key.short(), ?retry_after, "idempotent.in_flight: waiting");
                let nap = IN_FLIGHT_POLL.ceiling(polls).min(retry_after.max(Duration::from_millis(1)));
                polls = polls.saturating_add(1);
                // Boxed: a timer is most of this future's size, and only waiting calls need one.
                Box::pin(tokio::time::sleep(nap.min(timeout - waited))).await;
            }
        }
    }
}

/// How a call whose acquire answered `taken` ended, if that ends the call (`None`: the call
/// holds the lease and goes on). `fail_open`: whether a store failure runs the work unprotected.
pub fn call_end(taken: &Result<Taken, Error>, fail_open: bool) -> Option<CallEnd> {
    Some(match taken {
        Ok(Taken::Lease(_)) => return None,
        Ok(Taken::Replay(_)) => CallEnd::Replayed,
        Ok(Taken::InFlight { .. }) => CallEnd::InFlight,
        Ok(Taken::Mismatch) => CallEnd::Mismatch,
        Ok(Taken::NeedsAttention { .. }) => CallEnd::NeedsAttention,
        Err(e) if e.is_store_failure() && fail_open => CallEnd::Unprotected,
        Err(e) if e.is_store_failure() => CallEnd::StoreError,
        Err(_) => CallEnd::Failed,
    })
}

/// Counts the call of `step` on `store` in the [metrics](crate::metrics) if its acquire's
/// answer ends it ([`call_end`]); nothing without the `metrics` feature.
#[doc(hidden)]
#[inline(always)]
pub fn count_acquired(step: &str, store: &dyn Store, taken: &Result<Taken, Error>, fail_open: bool) {
    #[cfg(feature = "metrics")]
    if let Some(end) = call_end(taken, fail_open) {
        crate::metrics::call(step, store, end);
    }
    #[cfg(not(feature = "metrics"))]
    let _ = (step, store, taken, fail_open);
}
