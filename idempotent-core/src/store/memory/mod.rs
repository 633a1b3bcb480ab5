//! The embedded in-memory store.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::fmt;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use tokio::time::Instant;

use super::admin::{Cursor, Deleted, Filter, MAX_PAGE, Page, RecordInfo, RecordState};
use super::{BoxFuture, Store, lock};
use crate::attempt::Attempt;
use crate::error::Error;
use crate::key::{Fingerprint, Key};
use crate::record::{Abandon, Acquire, Grant, KEEP_RESOLVED_RELEASE, Labels, Resolution, Resolved, Token, Transition};
use crate::state::{Commit, CommitToken, Loaded, MemoryStateStore, Scope, StateStore, Version};

const SHARDS: usize = 32;
/// A shard drops its expired records after this many writes, or after a quarter of its size in
/// writes if that is more (so a sweep, which reads every record of the shard, costs a bounded
/// number of records per write however large the store grows), and only when one of its
/// records has expired.
const SWEEP_EVERY: usize = 1024;

/// An in-process store: the default for one process, and for tests.
///
/// Records live in a sharded hash map and expire as the record protocol says
/// ([retention](crate::record#retention)). Expired records are swept as the store is written to,
/// at a constant cost per write, so memory stays within a constant factor of the live records
/// (plus 1 024 per shard); [`MemoryStore::with_capacity`] also bounds their number (a full store
/// refuses new keys rather than evicting live ones, which would let an operation run twice).
///
/// Time is read from `tokio::time::Instant`, so tests with paused time control lease expiry.
/// Clones share the same records.
///
/// ```
/// use idempotent_core::{MemoryStore, RunContext};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), idempotent_core::Error> {
/// let ctx = RunContext::new(MemoryStore::new(), "run-1");
/// let n: u32 = ctx.step("count").run(&(), |_| async { Ok::<_, idempotent_core::Error>(7) }).await?;
/// assert_eq!(n, 7);
/// # Ok(()) }
/// ```
#[derive(Clone, Default)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

struct Inner {
    shards: Box<[Mutex<Shard>]>,
    /// One counter for the whole store: fences grow per key because they grow everywhere.
    fence: AtomicU64,
    len: AtomicUsize,
    capacity: Option<usize>,
    /// The versioned states kept in this store (see the [`StateStore`] impl).
    states: MemoryStateStore,
}

impl Default for Inner {
    fn default() -> Self {
        Inner {
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            fence: AtomicU64::new(0),
            len: AtomicUsize::new(0),
            capacity: None,
            states: MemoryStateStore::new(),
        }
    }
}

#[derive(Default)]
struct Shard {
    map: HashMap<Key, Record>,
    /// Writes since the last sweep.
    writes: usize,
    /// No record of the shard expires before this (`None`: the shard holds none).
    next_expiry: Option<Instant>,
}

impl Shard {
    /// Notes that a record of this shard now expires at `expires`.
    fn expires_at(&mut self, expires: Instant) {
        self.next_expiry = Some(earliest(self.next_expiry, expires));
    }
}

/// The earlier of `t` (if any) and `u`.
fn earliest(t: Option<Instant>, u: Instant) -> Instant {
    t.map_or(u, |t| t.min(u))
}

struct Record {
    state: State,
    fingerprint: Fingerprint,
    attempt: u32,
    /// The last attempt's fence (kept in every state).
    fence: u64,
    expires: Instant,
    created: Instant,
    updated: Instant,
    labels: StoredLabels,
}

/// A record's [`Labels`], in one allocation: the step, then the run and the tenant, each
/// present or not.
struct StoredLabels {
    text: Box<str>,
    step_end: usize,
    run_end: Option<usize>,
    has_tenant: bool,
}

impl Record {
    fn new(
        state: State,
        fingerprint: &Fingerprint,
        attempt: u32,
        fence: u64,
        expires: Instant,
        now: Instant,
        labels: &Labels<'_>,
    ) -> Self {
        let labels = StoredLabels::new(labels);
        Record { state, fingerprint: *fingerprint, attempt, fence, expires, created: now, updated: now, labels }
    }

    /// The record as an operator sees it, at `now`.
    fn info(&self, key: &Key, now: Instant) -> RecordInfo {
        let (state, lease_until, result_bytes) = match &self.state {
            State::Running { lease_until, .. } if *lease_until > now => {
                (RecordState::Running, Some(*lease_until), None)
            }
            State::Running { lease_until, .. } => (RecordState::Stuck, Some(*lease_until), None),
            State::Released { uncertain: true, .. } => (RecordState::Stuck, None, None),
            State::Released { uncertain: false, .. } => (RecordState::Released, None, None),
            State::NeedsAttention { .. } => (RecordState::NeedsAttention, None, None),
            State::Done { result, .. } => (RecordState::Done, None, Some(result.len())),
        };
        let expires = (state != RecordState::NeedsAttention).then(|| wall(self.expires, now));
        RecordInfo {
            key: *key,
            fingerprint: self.fingerprint,
            state,
            step: self.labels.step().to_owned(),
            run: self.labels.run().map(str::to_owned),
            tenant: self.labels.tenant().map(str::to_owned),
            attempt: self.attempt,
            fence: self.fence,
            created: wall(self.created, now),
            updated: wall(self.updated, now),
            lease_until: lease_until.map(|t| wall(t, now)),
            expires,
            result_bytes,
        }
    }
}

/// The wall-clock time of `t`, read at `now`.
fn wall(t: Instant, now: Instant) -> std::time::SystemTime {
    let wall_now = std::time::SystemTime::now();
    if t >= now {
        wall_now.checked_add(t - now).unwrap_or(wall_now)
    } else {
        wall_now.checked_sub(now - t).unwrap_or(std::time::UNIX_EPOCH)
    }
}

impl StoredLabels {
    fn new(labels: &Labels<'_>) -> Self {
        let mut text = String::with_capacity(
            labels.step.len() + labels.run.map_or(0, str::len) + labels.tenant.map_or(0, str::len),
        );
        text.push_str(labels.step);
        let step_end = text.len();
        let run_end = labels.run.map(|run| {
            text.push_str(run);
            text.len()
        });
        if let Some(tenant) = labels.tenant {
            text.push_str(tenant);
        }
        StoredLabels { text: text.into_boxed_str(), step_end, run_end, has_tenant: labels.tenant.is_some() }
    }

    fn step(&self) -> &str {
        &self.text[..self.step_end]
    }

    fn run(&self) -> Option<&str> {
        self.run_end.map(|end| &self.text[self.step_end..end])
    }

    fn tenant(&self) -> Option<&str> {
        self.has_tenant.then(|| &self.text[self.run_end.unwrap_or(self.step_end)..])
    }
}

enum State {
    Running {
        token: Token,
        lease_until: Instant,
    },
    /// The token that completed is kept so that a retried `complete` is acknowledged.
    Done {
        result: Bytes,
        token: Token,
    },
    /// `uncertain`: the attempt that released it may have run the action (the next attempt is
    /// recovered).
    Released {
        token: Token,
        uncertain: bool,
    },
    /// Kept until resolved (the record's expiry is a century away).
    NeedsAttention {
        token: Token,
    },
}

impl MemoryStore {
    /// An empty store with no capacity limit.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty store holding at most `capacity` records (expired ones are swept first).
    pub fn with_capacity(capacity: usize) -> Self {
        MemoryStore { inner: Arc::new(Inner { capacity: Some(capacity), ..Inner::default() }) }
    }

    /// The number of records held, counting expired ones not yet swept.
    pub fn len(&self) -> usize {
        self.inner.len.load(Ordering::Relaxed)
    }

    /// Whether the store holds no records.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Drops every expired record now.
    pub fn sweep(&self) {
        let now = Instant::now();
        for shard in self.inner.shards.iter() {
            self.sweep_shard(&mut lock(shard), now);
        }
    }

    fn shard(&self, key: &Key) -> MutexGuard<'_, Shard> {
        lock(&self.inner.shards[shard_of(key)])
    }

    /// Counts one more record if the capacity allows it (exactly, across shards).
    fn reserve(&self) -> bool {
        let cap = self.inner.capacity.unwrap_or(usize::MAX);
        self.inner.len.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < cap).then_some(n + 1)).is_ok()
    }

    /// One page of a scan: the records of the shards in order, by key within each shard; the
    /// cursor is the last key listed, in hex (shard order follows from the key). Each call reads
    /// every record of the shards it visits, at most the whole store.
    fn scan_now(&self, filter: &Filter, cursor: &Cursor, limit: usize) -> Result<Page, Error> {
        let after = if cursor.is_start() {
            None
        } else {
            Some(Key::from_hex(cursor.as_str()).ok_or_else(|| {
                Error::Config(format!(
                    "`{}` is not a cursor of a memory store scan (64 hex digits); start the scan again",
                    cursor.as_str()
                ))
            })?)
        };
        let limit = limit.clamp(1, MAX_PAGE);
        let now = Instant::now();
        let wall_now = std::time::SystemTime::now();
        let first = after.map_or(0, |k| shard_of(&k));
        let mut records = Vec::new();
        for idx in first..SHARDS {
            let shard = lock(&self.inner.shards[idx]);
            let mut keys: Vec<&Key> = shard
                .map
                .iter()
                .filter(|(k, r)| r.expires > now && after.is_none_or(|a| idx != shard_of(&a) || **k > a))
                .map(|(k, _)| k)
                .collect();
            keys.sort_unstable();
            for k in keys {
                let info = shard.map[k].info(k, now);
                if filter.matches(&info, wall_now) {
                    records.push(info);
                    if records.len() == limit {
                        let next = Cursor::from_text(k.to_hex());
                        return Ok(Page::new(records, Some(next)));
                    }
                }
            }
        }
        Ok(Page::new(records, None))
    }

    fn sweep_shard(&self, shard: &mut Shard, now: Instant) {
        shard.writes = 0;
        if shard.next_expiry.is_none_or(|t| t > now) {
            return;
        }
        let before = shard.map.len();
        let mut next: Option<Instant> = None;
        shard.map.retain(|_, r| {
            let keep = r.expires > now;
            if keep {
                next = Some(earliest(next, r.expires));
            }
            keep
        });
        shard.next_expiry = next;
        self.inner.len.fetch_sub(before - shard.map.len(), Ordering::Relaxed);
    }

    fn acquire_or_sweep(
        &self,
        key: &Key,
        fp: &Fingerprint,
        lease: Duration,
        retention: Duration,
        labels: &Labels<'_>,
    ) -> Result<Acquire, Error> {
        if let Some(answer) = self.try_acquire(key, fp, lease, retention, labels) {
            return answer;
        }
        // Full: sweep every shard (none locked meanwhile), then look again: another caller may
        // have inserted the key, or the sweep freed room.
        self.sweep();
        self.try_acquire(key, fp, lease, retention, labels).unwrap_or_else(|| {
            let capacity = self.inner.capacity.unwrap_or(usize::MAX);
            Err(Error::Full { store: Store::describe(self), capacity })
        })
    }

    /// Acquire's work under the shard's lock, looking the key up once; `None` when the key is
    /// new and the store is full.
    fn try_acquire(
        &self,
        key: &Key,
        fp: &Fingerprint,
        lease: Duration,
        retention: Duration,
        labels: &Labels<'_>,
    ) -> Option<Result<Acquire, Error>> {
        let now = Instant::now();
        let mut guard = self.shard(key);
        guard.writes += 1;
        if guard.writes >= SWEEP_EVERY.max(guard.map.len() / 4) {
            self.sweep_shard(&mut guard, now);
        }
        let shard = &mut *guard;
        let entry = shard.map.entry(*key);
        let (prev_attempt, recovered) = match &entry {
            Entry::Occupied(o) if o.get().expires > now => {
                let r = o.get();
                if r.fingerprint != *fp {
                    return Some(Ok(Acquire::Mismatch));
                }
                match &r.state {
                    State::Done { result, .. } => return Some(Ok(Acquire::Replay(result.clone()))),
                    State::Running { lease_until, .. } if *lease_until > now => {
                        return Some(Ok(Acquire::InFlight { retry_after: *lease_until - now }));
                    }
                    State::NeedsAttention { .. } => {
                        return Some(Ok(Acquire::NeedsAttention { attempt: r.attempt, fence: r.fence }));
                    }
                    State::Running { .. } => (r.attempt, true),
                    State::Released { uncertain, .. } => (r.attempt, *uncertain),
                }
            }
            // An expired record is replaced; it was counted already.
            Entry::Occupied(_) => (0, false),
            Entry::Vacant(_) if !self.reserve() => return None,
            Entry::Vacant(_) => (0, false),
        };
        let fence = self.inner.fence.fetch_add(1, Ordering::Relaxed) + 1;
        let token = Token::unique();
        let attempt = prev_attempt + 1;
        let expires = later(now, lease.max(retention));
        let state = State::Running { token: token.clone(), lease_until: later(now, lease) };
        match entry {
            // A record that lives on keeps its labels and creation time.
            Entry::Occupied(mut o) if prev_attempt > 0 => {
                let r = o.get_mut();
                (r.state, r.attempt, r.fence, r.expires, r.updated) = (state, attempt, fence, expires, now);
            }
            Entry::Occupied(mut o) => {
                o.insert(Record::new(state, fp, attempt, fence, expires, now, labels));
            }
            Entry::Vacant(v) => {
                v.insert(Record::new(state, fp, attempt, fence, expires, now, labels));
            }
        }
        shard.expires_at(expires);
        Some(Ok(Acquire::Acquired(Grant { token, attempt: Attempt::new(*key, fence, attempt, recovered) })))
    }

    /// Applies `f` to the record if `token` owns it. `already` says whether the record is in the
    /// state the transition leads to, by this token's hand (a retried call is acknowledged).
    fn with_owned(
        &self,
        key: &Key,
        token: &Token,
        already: impl FnOnce(&State) -> bool,
        f: impl FnOnce(&mut Record, Instant),
    ) -> Transition {
        let now = Instant::now();
        let mut shard = self.shard(key);
        match shard.map.get_mut(key) {
            Some(r) if r.expires > now && matches!(&r.state, State::Running { token: t, .. } if t == token) => {
                f(r, now);
                r.updated = now;
                let expires = r.expires;
                shard.expires_at(expires);
                Transition::Ok
            }
            Some(r) if r.expires > now && already(&r.state) => Transition::Ok,
            _ => Transition::LeaseLost,
        }
    }
}

/// The shard that holds `key`.
fn shard_of(key: &Key) -> usize {
    key.as_bytes()[0] as usize % SHARDS
}

/// `now + d`, saturating far in the future instead of panicking on overflow.
fn later(now: Instant, d: Duration) -> Instant {
    now.checked_add(d).unwrap_or_else(|| now + Duration::from_secs(100 * 365 * 24 * 60 * 60))
}

impl Store for MemoryStore {
    fn acquire_labeled<'a>(
        &'a self,
        key: &'a Key,
        fingerprint: &'a Fingerprint,
        lease: Duration,
        retention: Duration,
        labels: Labels<'a>,
    ) -> BoxFuture<'a, Result<Acquire, Error>> {
        let res = self.acquire_or_sweep(key, fingerprint, lease, retention, &labels);
        Box::pin(std::future::ready(res))
    }

    fn complete<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
        result: Bytes,
        retention: Duration,
    ) -> BoxFuture<'a, Result<Transition, Error>> {
        let done_by_us = |s: &State| matches!(s, State::Done { token: t, .. } if t == token);
        let t = self.with_owned(key, token, done_by_us, |r, now| {
            r.state = State::Done { result, token: token.clone() };
            r.expires = later(now, retention);
        });
        Box::pin(std::future::ready(Ok(t)))
    }

    fn release<'a>(&'a self, key: &'a Key, token: &'a Token) -> BoxFuture<'a, Result<Transition, Error>> {
        let released_by_us = |s: &State| matches!(s, State::Released { token: t, uncertain: false } if t == token);
        let t = self.with_owned(key, token, released_by_us, |r, _| {
            r.state = State::Released { token: token.clone(), uncertain: false }
        });
        Box::pin(std::future::ready(Ok(t)))
    }

    fn abandon<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
        mark: Abandon,
    ) -> BoxFuture<'a, Result<Transition, Error>> {
        let t = match mark {
            Abandon::Uncertain => {
                let by_us = |s: &State| matches!(s, State::Released { token: t, uncertain: true } if t == token);
                self.with_owned(key, token, by_us, |r, _| {
                    r.state = State::Released { token: token.clone(), uncertain: true }
                })
            }
            Abandon::NeedsAttention => {
                let by_us = |s: &State| matches!(s, State::NeedsAttention { token: t, .. } if t == token);
                self.with_owned(key, token, by_us, |r, now| {
                    r.state = State::NeedsAttention { token: token.clone() };
                    r.expires = later(now, Duration::MAX);
                })
            }
        };
        Box::pin(std::future::ready(Ok(t)))
    }

    fn resolve<'a>(&'a self, key: &'a Key, resolution: Resolution) -> BoxFuture<'a, Result<Resolved, Error>> {
        let now = Instant::now();
        let mut shard = self.shard(key);
        let answer = match shard.map.get_mut(key) {
            Some(r) if r.expires > now => match &r.state {
                State::NeedsAttention { token, .. } => {
                    let token = token.clone();
                    (r.state, r.expires) = match resolution {
                        Resolution::Done { outcome, retention } => {
                            (State::Done { result: outcome, token }, later(now, retention))
                        }
                        Resolution::NotDone => {
                            (State::Released { token, uncertain: false }, later(now, KEEP_RESOLVED_RELEASE))
                        }
                    };
                    r.updated = now;
                    let expires = r.expires;
                    shard.expires_at(expires);
                    Resolved::Ok
                }
                _ => Resolved::Unchanged,
            },
            _ => Resolved::Unchanged,
        };
        Box::pin(std::future::ready(Ok(answer)))
    }

    fn inspect<'a>(&'a self, key: &'a Key) -> BoxFuture<'a, Result<Option<RecordInfo>, Error>> {
        let now = Instant::now();
        let shard = self.shard(key);
        let info = shard.map.get(key).filter(|r| r.expires > now).map(|r| r.info(key, now));
        Box::pin(std::future::ready(Ok(info)))
    }

    fn scan<'a>(&'a self, filter: &'a Filter, cursor: &'a Cursor, limit: usize) -> BoxFuture<'a, Result<Page, Error>> {
        Box::pin(std::future::ready(self.scan_now(filter, cursor, limit)))
    }

    fn release_fenced<'a>(&'a self, key: &'a Key, fence: u64) -> BoxFuture<'a, Result<Resolved, Error>> {
        let now = Instant::now();
        let mut shard = self.shard(key);
        let answer = match shard.map.get_mut(key) {
            Some(r) if r.expires > now && r.fence == fence => match &r.state {
                State::Running { token, .. } => {
                    r.state = State::Released { token: token.clone(), uncertain: true };
                    r.updated = now;
                    Resolved::Ok
                }
                _ => Resolved::Unchanged,
            },
            _ => Resolved::Unchanged,
        };
        Box::pin(std::future::ready(Ok(answer)))
    }

    fn delete<'a>(&'a self, key: &'a Key) -> BoxFuture<'a, Result<Deleted, Error>> {
        let now = Instant::now();
        let mut shard = self.shard(key);
        let answer = match shard.map.get(key) {
            Some(r) if r.expires <= now => Deleted::Absent,
            Some(Record { state: State::Running { lease_until, .. }, .. }) if *lease_until > now => Deleted::Running,
            Some(_) => {
                shard.map.remove(key);
                self.inner.len.fetch_sub(1, Ordering::Relaxed);
                Deleted::Ok
            }
            None => Deleted::Absent,
        };
        Box::pin(std::future::ready(Ok(answer)))
    }

    fn renew<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
        lease: Duration,
    ) -> BoxFuture<'a, Result<Transition, Error>> {
        let t = self.with_owned(
            key,
            token,
            |_| false,
            |r, now| {
                if let State::Running { lease_until, .. } = &mut r.state {
                    *lease_until = later(now, lease);
                }
                r.expires = r.expires.max(later(now, lease));
            },
        );
        Box::pin(std::future::ready(Ok(t)))
    }

    fn describe(&self) -> String {
        "memory".to_owned()
    }

    fn kind(&self) -> &'static str {
        "memory"
    }
}

impl fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryStore").field("len", &self.len()).field("capacity", &self.inner.capacity).finish()
    }
}

/// A `MemoryStore` keeps versioned states too, as the Redis and SQL stores do, so one handle
/// serves [`RunContext`](crate::RunContext) and [`State`](crate::State): its states live in a
/// [`MemoryStateStore`] of its own, shared by its clones.
impl StateStore for MemoryStore {
    fn load<'a>(&'a self, scope: &'a Scope) -> BoxFuture<'a, Result<Loaded<Bytes>, Error>> {
        self.inner.states.load(scope)
    }

    fn commit<'a>(
        &'a self,
        scope: &'a Scope,
        expected: Version,
        value: Bytes,
        token: &'a CommitToken,
    ) -> BoxFuture<'a, Result<Commit<Bytes>, Error>> {
        self.inner.states.commit(scope, expected, value, token)
    }

    fn describe(&self) -> String {
        Store::describe(self)
    }
}

#[cfg(test)]
mod tests;
