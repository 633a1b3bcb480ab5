//! Which request a store's acquire sends first, learnt from the answers of its recent acquires.
//!
//! An acquire can start in two ways, each cheapest for one kind of answer:
//!
//! - **write first**: the one atomic request that takes the key and returns what is there
//!   whatever happened (SQL: the upsert `RETURNING` the row; Redis: `SET … NX GET`). A first
//!   execution is that request and the complete (2); a replay is that request alone (1), but
//!   pays for a write that writes nothing: on SQLite it takes the file's one write lock, so
//!   replays queue behind each other; on PostgreSQL the `INSERT … ON CONFLICT` node is set up
//!   for a row it does not insert; on Redis `SET NX GET` costs the server more than a `GET` and
//!   sends the whole new record (BENCHMARKS.md has the figures).
//! - **read first**: a plain read of the live record (SQL `SELECT`, Redis `GET`), then the write
//!   only when the record does not decide the answer. A replay is one pure read, as cheap as the
//!   database's own; a first execution is 3 requests (read, write, complete).
//!
//! A saturating counter, like a branch predictor's, picks between them: every answer the
//! existing record decided (replay, in flight, mismatch, needs attention) moves it up by one,
//! every key taken down by one, and acquires read first while it is in its upper half. It starts
//! at the bottom (write first), so a store whose calls are mostly first executions sends 2
//! requests for each, and one serving a burst of retries switches to reads after
//! [`AcquireOrder::HALF`] replays in a row; a wrong guess costs one request more (a first
//! execution after replays) or the write's cost (a replay after first executions), never a
//! wrong answer: both ways judge the same record by the same rules, and only the atomic write
//! takes a key.

use std::sync::atomic::{AtomicU8, Ordering};

use crate::record::Acquire;

/// The learnt order of a store's acquires (see the [module documentation](self)).
#[derive(Debug, Default)]
pub(crate) struct AcquireOrder(AtomicU8);

impl AcquireOrder {
    /// Consecutive answers of one kind that switch the order from the other end of the counter.
    pub(crate) const HALF: u8 = 8;
    /// The counter's top: `2 × HALF − 1`.
    const TOP: u8 = 2 * Self::HALF - 1;

    /// Whether the next acquire reads first.
    pub(crate) fn read_first(&self) -> bool {
        self.0.load(Ordering::Relaxed) >= Self::HALF
    }

    /// Learns from an acquire's answer: a key taken moves the counter down, any answer the
    /// existing record decided (replay, in flight, mismatch, needs attention) up.
    pub(crate) fn learn(&self, answer: &Acquire) {
        self.record(!matches!(answer, Acquire::Acquired(_)));
    }

    /// Moves the counter by one: up when `decided`, down otherwise.
    fn record(&self, decided: bool) {
        let step = |n: u8| if decided { (n < Self::TOP).then(|| n + 1) } else { n.checked_sub(1) };
        // Saturated: nothing to write, so a steady workload leaves the cache line shared.
        let _ = self.0.fetch_update(Ordering::Relaxed, Ordering::Relaxed, step);
    }
}

#[cfg(test)]
mod tests {
    use super::AcquireOrder;

    #[test]
    fn acquire_order_switches_after_half_a_counter_of_one_answer_and_saturates() {
        let order = AcquireOrder::default();
        assert!(!order.read_first(), "a new store runs the upsert first");
        for n in 1..AcquireOrder::HALF {
            order.record(true);
            assert!(!order.read_first(), "switched after {n} replays");
        }
        order.record(true);
        assert!(order.read_first(), "reads first after {} replays in a row", AcquireOrder::HALF);
        // Saturated at the top: many more replays, then as many first executions as switch back.
        for _ in 0..100 {
            order.record(true);
        }
        for _ in 0..AcquireOrder::HALF {
            assert!(order.read_first());
            order.record(false);
        }
        assert!(!order.read_first(), "upsert first again after {} keys taken", AcquireOrder::HALF);
        // And saturated at the bottom.
        for _ in 0..100 {
            order.record(false);
        }
        order.record(true);
        assert!(!order.read_first());
    }
}
