//! Reading and administering records: what an operator (or the
//! [reconciler](crate::reconcile)) sees of a record, and how records are listed.
//!
//! A record says which operation it belongs to through its [`Labels`] (step, run id, tenant),
//! written by every acquisition, and how far that operation got ([`RecordState`]), with its
//! attempt, fence, times and result size. It never says what the payload or the result is, nor a
//! client's raw `Idempotency-Key` (the key is a hash of those).
//!
//! [`Store::scan`](super::Store::scan) lists records a page at a time, in an order of the
//! store's choosing, from a [`Cursor`]; each call does a bounded amount of work. A record
//! written while a scan goes on may or may not be listed; one that exists for the whole scan is
//! listed once (Redis may list it twice, after a rehash: callers that act on records must
//! tolerate that, as every store transition does).
//!
//! [`Labels`]: crate::record::Labels

use std::time::{Duration, SystemTime};

use crate::key::{Fingerprint, Key};

/// How far a record's operation got, as an operator sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum RecordState {
    /// An attempt holds a live lease.
    Running,
    /// No outcome and nobody holds it, after an attempt that may have run the action: its lease
    /// ran out, or it ended uncertain ([`Abandon::Uncertain`](crate::record::Abandon)). The next
    /// acquisition is [`recovered`](crate::Attempt::recovered); a
    /// [reconciler](crate::reconcile::Reconciler) resolves such records ahead of it.
    Stuck,
    /// Given up without an outcome by an attempt that did not run the action (or resolved as not
    /// done): the next acquisition runs afresh.
    Released,
    /// Waits for a person or a verifier to [resolve](super::Store::resolve) it; nothing runs.
    NeedsAttention,
    /// The outcome is stored and replayed.
    Done,
}

impl RecordState {
    /// Every state, in order.
    pub const ALL: [RecordState; 5] = [
        RecordState::Running,
        RecordState::Stuck,
        RecordState::Released,
        RecordState::NeedsAttention,
        RecordState::Done,
    ];

    /// The state's name, as the operator tool prints and parses it: `running`, `stuck`,
    /// `released`, `needs_attention`, `done`.
    pub fn as_str(self) -> &'static str {
        match self {
            RecordState::Running => "running",
            RecordState::Stuck => "stuck",
            RecordState::Released => "released",
            RecordState::NeedsAttention => "needs_attention",
            RecordState::Done => "done",
        }
    }
}

impl std::fmt::Display for RecordState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for RecordState {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        RecordState::ALL.into_iter().find(|state| state.as_str() == s).ok_or_else(|| {
            let names: Vec<_> = RecordState::ALL.iter().map(|s| s.as_str()).collect();
            format!("unknown record state `{s}`: expected one of {}", names.join(", "))
        })
    }
}

/// One record as a store holds it, without its payload or result.
///
/// Times are the store's clock (Redis: `TIME`; SQL: the database's), read as wall-clock times.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RecordInfo {
    /// The record's key.
    pub key: Key,
    /// The payload's fingerprint (a hash): what an acquisition of the key must present.
    pub fingerprint: Fingerprint,
    /// How far the operation got.
    pub state: RecordState,
    /// The step name ([`Labels::step`](crate::record::Labels)); empty when the acquisition gave
    /// none.
    pub step: String,
    /// The run id, if the acquisition gave one.
    pub run: Option<String>,
    /// The tenant, if the acquisition gave one.
    pub tenant: Option<String>,
    /// The number of the last attempt (1 for the first acquisition).
    pub attempt: u32,
    /// The last attempt's fence.
    pub fence: u64,
    /// When the record's current life began (its first acquisition since it was last absent).
    pub created: SystemTime,
    /// When the record last changed state.
    pub updated: SystemTime,
    /// Running and stuck records: when the last attempt's lease runs (or ran) out.
    pub lease_until: Option<SystemTime>,
    /// When the store forgets the record; `None` for a record that needs attention, which is
    /// kept until resolved.
    pub expires: Option<SystemTime>,
    /// Done records: the size of the stored outcome, in bytes.
    pub result_bytes: Option<usize>,
}

/// Which records a [`scan`](super::Store::scan) lists: every condition given must hold.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Filter {
    /// Only records in this state.
    pub state: Option<RecordState>,
    /// Only records of this step.
    pub step: Option<String>,
    /// Only records of this run id.
    pub run: Option<String>,
    /// Only records of this tenant.
    pub tenant: Option<String>,
    /// Only records that have not changed state for at least this long.
    pub idle_for: Option<Duration>,
}

impl Filter {
    /// Every record.
    pub fn all() -> Self {
        Filter::default()
    }

    /// Only records in `state`.
    pub fn state(mut self, state: RecordState) -> Self {
        self.state = Some(state);
        self
    }

    /// Only records of `step`.
    pub fn step(mut self, step: impl Into<String>) -> Self {
        self.step = Some(step.into());
        self
    }

    /// Only records of the run `run`.
    pub fn run(mut self, run: impl Into<String>) -> Self {
        self.run = Some(run.into());
        self
    }

    /// Only records of `tenant`.
    pub fn tenant(mut self, tenant: impl Into<String>) -> Self {
        self.tenant = Some(tenant.into());
        self
    }

    /// Only records that have not changed state for at least `idle`.
    pub fn idle_for(mut self, idle: Duration) -> Self {
        self.idle_for = Some(idle);
        self
    }

    /// Whether `record`, read at `now` on the store's clock, passes the filter.
    ///
    /// Stores that cannot filter on the server use this on what they read.
    pub fn matches(&self, record: &RecordInfo, now: SystemTime) -> bool {
        self.state.is_none_or(|s| s == record.state)
            && self.step.as_deref().is_none_or(|s| s == record.step)
            && self.run.as_deref().is_none_or(|r| Some(r) == record.run.as_deref())
            && self.tenant.as_deref().is_none_or(|t| Some(t) == record.tenant.as_deref())
            && self.idle_for.is_none_or(|idle| now.duration_since(record.updated).is_ok_and(|d| d >= idle))
    }
}

/// Where a [`scan`](super::Store::scan) goes on: [`Cursor::start`] for the first page, then
/// the [`Page::next`] of the last one. Opaque: its text means something only to the store that
/// made it (it can be printed and parsed back, so an operator tool can page across calls).
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Cursor(String);

impl Cursor {
    /// The start of a scan.
    pub fn start() -> Self {
        Cursor(String::new())
    }

    /// A cursor from its text ([`as_str`](Self::as_str)), as a store made it.
    pub fn from_text(text: impl Into<String>) -> Self {
        Cursor(text.into())
    }

    /// The cursor's text (empty at the start).
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether this is the start of a scan.
    pub fn is_start(&self) -> bool {
        self.0.is_empty()
    }
}

/// One page of a [`scan`](super::Store::scan).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Page {
    /// The records of this page that pass the filter (possibly none, even when more follow).
    pub records: Vec<RecordInfo>,
    /// Where the scan goes on; `None` when it is over.
    pub next: Option<Cursor>,
}

impl Page {
    /// A page of `records`, going on at `next`.
    pub fn new(records: Vec<RecordInfo>, next: Option<Cursor>) -> Self {
        Page { records, next }
    }
}

/// The answer to [`Store::delete`](super::Store::delete).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Deleted {
    /// The record is gone.
    Ok,
    /// There was no record.
    Absent,
    /// An attempt holds a live lease on it: nothing changed (release it first, by its fence).
    Running,
}

/// The largest page a [`scan`](super::Store::scan) returns; larger limits are lowered to it.
pub const MAX_PAGE: usize = 1000;

/// What [`delete_all`] removed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Purged {
    /// Records removed.
    pub removed: usize,
    /// Records left alone because an attempt held a live lease on them.
    pub running: usize,
    /// Records listed that were gone by the time they were deleted.
    pub gone: usize,
}

/// Removes every record that passes `filter` (a run's records, a step's, those idle for an
/// age), a page at a time, each by [`Store::delete`](super::Store::delete): records under a
/// live lease are left alone and counted.
///
/// Removing a done record makes its next call run the operation again: narrow the filter to
/// what is meant (a run that is over, a step version that is retired).
pub async fn delete_all(store: &dyn super::Store, filter: &Filter) -> Result<Purged, crate::Error> {
    let mut purged = Purged::default();
    let mut cursor = Cursor::start();
    loop {
        let page = store.scan(filter, &cursor, MAX_PAGE).await?;
        for record in &page.records {
            match store.delete(&record.key).await? {
                Deleted::Ok => purged.removed += 1,
                Deleted::Running => purged.running += 1,
                Deleted::Absent => purged.gone += 1,
            }
        }
        match page.next {
            Some(next) => cursor = next,
            None => return Ok(purged),
        }
    }
}
