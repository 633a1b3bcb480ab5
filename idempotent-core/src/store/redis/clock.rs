//! The server's clock, estimated on this side: the fence of a key taken by `SET NX`.
//!
//! `SET NX` cannot read the server's clock, yet a key's fences must keep growing even when its
//! record is lost, as the acquire script's fences do (they are never below the server's clock in
//! microseconds). So the store estimates that clock: this process's monotonic clock plus an
//! offset measured with `TIME` in the background (first when an acquire finds it missing, then
//! every minute), to within half a round trip, plus a minute's drift between the two clocks (on
//! a cluster, plus the skew between the node that answered `TIME` and the key's node). The
//! host's wall clock is never used, so a step of it changes nothing. Until the first measure
//! lands, and when the last one is stale, acquires take the script path, where the server reads
//! its own clock.

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};

use deadpool_redis::redis::{self, Value};

use super::RedisStore;
use super::layout::MAX_FENCE;
use crate::error::Error;
use crate::store::Store;

/// How often the store measures the server's clock again.
const RESYNC_US: u64 = 60_000_000;
/// A measure older than this is not used: acquires take the script path until a new one lands.
const STALE_US: u64 = 3 * RESYNC_US;

/// The measured offset between the server's clock and this process's monotonic clock.
#[derive(Default)]
pub(super) struct ServerClock {
    /// The server's clock minus [`monotonic_us`], in microseconds.
    offset_us: AtomicI64,
    /// When the offset was last measured, on the monotonic clock (0: never).
    synced_us: AtomicU64,
    /// A measure is under way.
    syncing: AtomicBool,
}

impl RedisStore {
    /// The fence of a key taken by `SET NX`: the server's clock in microseconds, estimated from
    /// the monotonic clock and the last measured offset. `None` while there is no fresh measure
    /// (one is then started in the background): the caller takes the script path.
    pub(super) fn estimated_server_micros(&self) -> Option<u64> {
        let synced = self.inner.clock.synced_us.load(Ordering::Acquire);
        if synced == 0 || monotonic_us().saturating_sub(synced) > RESYNC_US {
            self.start_clock_sync();
        }
        self.known_server_micros()
    }

    /// The same estimate while there is a fresh measure, without starting one: for a time a
    /// script can read for itself when there is none (`complete`'s update time), so that a store
    /// whose acquires never need the estimate never measures the clock.
    pub(super) fn known_server_micros(&self) -> Option<u64> {
        let clock = &self.inner.clock;
        let now = monotonic_us();
        let synced = clock.synced_us.load(Ordering::Acquire);
        if synced == 0 || now.saturating_sub(synced) > STALE_US {
            return None;
        }
        let offset = clock.offset_us.load(Ordering::Acquire);
        let fence = (now as i64).checked_add(offset)?;
        u64::try_from(fence).ok().filter(|f| (1..MAX_FENCE).contains(f))
    }

    /// Measures the server's clock in a task of its own, unless a measure is under way.
    fn start_clock_sync(&self) {
        let syncing = &self.inner.clock.syncing;
        if syncing.swap(true, Ordering::AcqRel) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            syncing.store(false, Ordering::Release);
            return;
        };
        let store = self.clone();
        runtime.spawn(async move {
            // A failure was logged; the script path serves meanwhile.
            let _ = store.sync_clock().await;
            store.inner.clock.syncing.store(false, Ordering::Release);
        });
    }

    /// Measures the server's clock against the monotonic clock with `TIME`, to within half a
    /// round trip (the quickest of three). On failure the last measure stays (acquires take
    /// the script path once it is stale, or while there is none) and a later acquire tries again.
    /// Before the first measure, it also finds out whether the server compares and sets
    /// (`native.rs`): the `SET NX` path, which needs the clock, is the one that keeps records.
    pub(super) async fn sync_clock(&self) -> Result<(), Error> {
        if self.inner.native.needs_probe() {
            self.probe_compare_and_set().await?;
        }
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
            let clock = &self.inner.clock;
            clock.offset_us.store(offset, Ordering::Release);
            clock.synced_us.store(monotonic_us(), Ordering::Release);
        }
        Ok(())
    }
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
