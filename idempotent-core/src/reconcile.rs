//! Recovery without a caller: a [`Reconciler`] finds records stuck without an outcome and
//! settles them with the steps' verifiers, ahead of the next retry.
//!
//! A record is [stuck](RecordState::Stuck) when an attempt that may have run its action ended
//! without storing an outcome: its worker died and its lease ran out, or storing the outcome
//! failed. The next call of that operation is [`recovered`](crate::Attempt::recovered) and
//! verifies before it acts (see [`crate::verify`]); but a pipeline that is never retried (a job
//! whose trigger was lost, an agent run that was abandoned) leaves the record stuck, and the
//! customer's question ("was I charged?") unanswered. A reconciler, run by a service beside its
//! workers, asks instead:
//!
//! 1. it [scans](crate::Store::scan) the store for stuck records, a bounded page per
//!    [pass](Reconciler::pass), going on from where the last pass stopped;
//! 2. for each whose step has a verifier registered by name, it takes the record's lease as any
//!    attempt would (so two reconcilers, on one host or several, never act on one record, and a
//!    caller retrying meanwhile waits or is refused as with any attempt in flight), and asks the
//!    verifier, with the attempt's [`downstream_key`](crate::Attempt::downstream_key);
//! 3. it settles the record as the [`Verdict`] says: [`Done`](Verdict::Done) stores what was
//!    found as the outcome (replayed from then on), [`NotDone`](Verdict::NotDone) releases the
//!    key cleanly (the next call runs the action, not recovered), [`Unknown`](Verdict::Unknown)
//!    leaves it [needing attention](crate::Error::NeedsAttention); a verifier that fails or
//!    times out leaves it stuck for the next pass (or call);
//! 4. records of steps without a verifier are reported ([`Settled::NoVerifier`]), not touched.
//!
//! ```
//! use std::time::Duration;
//! use idempotent_core::reconcile::{Reconciler, Settled};
//! use idempotent_core::record::Abandon;
//! use idempotent_core::{MemoryStore, RunContext, SharedStore, Verdict};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), idempotent_core::Error> {
//! let store: SharedStore = std::sync::Arc::new(MemoryStore::new());
//! // A worker charged, then died before storing the outcome (simulated: the attempt is
//! // abandoned as uncertain, as a failed store call leaves it).
//! let ctx = RunContext::new(store.clone(), "order-7");
//! let step = ctx.step("charge");
//! let (key, fingerprint) = step.key_for(&1500)?;
//! # let labels = idempotent_core::record::Labels::step("charge").run("order-7");
//! # let idempotent_core::record::Acquire::Acquired(grant) =
//! #     store.acquire_labeled(&key, &fingerprint, Duration::from_secs(60), Duration::from_secs(60), labels).await?
//! #     else { unreachable!() };
//! # store.abandon(&key, &grant.token, Abandon::Uncertain).await?;
//!
//! let reconciler = Reconciler::new(store.clone()).verifier("charge", |attempt| async move {
//!     // Ask the provider for a charge under `attempt.downstream_key()`.
//!     let _ask_for = attempt.downstream_key();
//!     Ok::<_, idempotent_core::Error>(Verdict::Done("ch_found".to_owned()))
//! });
//! let pass = reconciler.pass().await?;
//! assert_eq!(pass.settled[0].1, Settled::Done);
//!
//! // The retry replays what the verifier found; the charge is not sent again.
//! let receipt: String = ctx.step("charge").run(&1500, |_| async { Ok::<_, idempotent_core::Error>("ch_new".to_owned()) }).await?;
//! assert_eq!(receipt, "ch_found");
//! # Ok(()) }
//! ```
//!
//! [`run`](Reconciler::run) repeats passes: at once while the scan has more pages, then every
//! `period`. Each pass examines at most [`batch`](Reconciler::batch) records and verifies them
//! one after another, each verifier bounded by [`verify_timeout`](Reconciler::verify_timeout).

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Serialize;

use crate::attempt::Attempt;
use crate::error::{BoxError, Error};
use crate::key::Key;
use crate::lease::{self, DEFAULT_LEASE, DEFAULT_RETENTION, End, OnInFlight, Taken, Terms};
use crate::record::{Labels, Transition, encode_ok};
use crate::store::{BoxFuture, Cursor, Filter, RecordInfo, RecordState, SharedStore};
use crate::verify::{self, DEFAULT_VERIFY_TIMEOUT, Decision, OnRecovered, Stopped, Verdict};

/// A verifier with its result encoded as the executor stores outcomes.
type ErasedVerifier = Arc<dyn Fn(Attempt) -> BoxFuture<'static, Result<Verdict<bytes::Bytes>, BoxError>> + Send + Sync>;

/// How many records a pass examines by default.
pub const DEFAULT_BATCH: usize = 100;

/// Settles stuck records with verifiers registered by step name (see the [module](self)).
///
/// Cheap to share: run one per service, or several on several hosts.
pub struct Reconciler {
    store: SharedStore,
    verifiers: HashMap<String, ErasedVerifier>,
    filter: Filter,
    batch: usize,
    terms: Terms,
    verify_timeout: Duration,
    cursor: Mutex<Cursor>,
}

impl fmt::Debug for Reconciler {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut steps: Vec<_> = self.verifiers.keys().collect();
        steps.sort();
        f.debug_struct("Reconciler")
            .field("store", &self.store.describe())
            .field("steps", &steps)
            .field("filter", &self.filter)
            .field("batch", &self.batch)
            .finish_non_exhaustive()
    }
}

/// What a pass did with one stuck record.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Settled {
    /// The verifier found the effect: its result is stored as the outcome.
    Done,
    /// The verifier found no effect: the key is released, and the next call runs the action.
    NotDone,
    /// The verifier could not tell: the record needs attention.
    NeedsAttention,
    /// The verifier failed or timed out (the message says which): the record stays stuck.
    VerifyFailed(String),
    /// No verifier is registered for the record's step: reported, not touched.
    NoVerifier,
    /// Another attempt (a caller, or another reconciler) settled or holds the record since the
    /// scan listed it: nothing done.
    Busy,
    /// A store call failed (the message says which): the record is as the store left it, stuck
    /// at worst.
    StoreError(String),
}

/// What one [`pass`](Reconciler::pass) did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Pass {
    /// Each stuck record the pass examined, with its step and what became of it.
    pub settled: Vec<(RecordInfo, Settled)>,
    /// Whether the scan reached the end of the store (the next pass starts again from the
    /// beginning).
    pub wrapped: bool,
}

impl Pass {
    /// How many records ended as `outcome`.
    pub fn count(&self, outcome: &Settled) -> usize {
        self.settled.iter().filter(|(_, s)| s == outcome).count()
    }

    /// The keys of the records that ended as `outcome`.
    pub fn keys(&self, outcome: &Settled) -> Vec<Key> {
        self.settled.iter().filter(|(_, s)| s == outcome).map(|(r, _)| r.key).collect()
    }
}

impl Reconciler {
    /// A reconciler over `store`, with no verifiers yet.
    pub fn new(store: SharedStore) -> Self {
        Reconciler {
            store,
            verifiers: HashMap::new(),
            filter: Filter::all(),
            batch: DEFAULT_BATCH,
            terms: Terms::default().lease(DEFAULT_LEASE).retention(DEFAULT_RETENTION).on_in_flight(OnInFlight::Reject),
            verify_timeout: DEFAULT_VERIFY_TIMEOUT,
            cursor: Mutex::new(Cursor::start()),
        }
    }

    /// Registers the verifier of the step named `step`: called with each stuck record's
    /// attempt, as [`Step::verify`](crate::Step::verify)'s verifier is (the same function can
    /// serve both). A `Done` result is stored as that step's outcome would be.
    pub fn verifier<V, VFut, T, E>(mut self, step: impl Into<String>, verify: V) -> Self
    where
        V: Fn(Attempt) -> VFut + Send + Sync + 'static,
        VFut: Future<Output = Result<Verdict<T>, E>> + Send + 'static,
        T: Serialize,
        E: Into<BoxError>,
    {
        let erased: ErasedVerifier = Arc::new(move |attempt| {
            let answer = verify(attempt);
            Box::pin(async move {
                match answer.await.map_err(Into::into)? {
                    Verdict::Done(value) => Ok(Verdict::Done(encode_ok(&value)?)),
                    Verdict::NotDone => Ok(Verdict::NotDone),
                    Verdict::Unknown => Ok(Verdict::Unknown),
                }
            })
        });
        self.verifiers.insert(step.into(), erased);
        self
    }

    /// Looks only at records that also pass `filter` (a tenant, a step, an idle time); its
    /// state is ignored: a reconciler looks at stuck records only.
    pub fn filter(mut self, filter: Filter) -> Self {
        self.filter = filter;
        self
    }

    /// How many records a pass examines at most (default [`DEFAULT_BATCH`]).
    pub fn batch(mut self, batch: usize) -> Self {
        self.batch = batch.max(1);
        self
    }

    /// The lease the reconciler holds while a verifier runs (default [`DEFAULT_LEASE`];
    /// renewed as a step's is).
    pub fn lease(mut self, lease: Duration) -> Self {
        self.terms = self.terms.lease(lease);
        self
    }

    /// How long an outcome a verifier found is kept (default [`DEFAULT_RETENTION`]): use the
    /// steps' retention.
    pub fn retention(mut self, retention: Duration) -> Self {
        self.terms = self.terms.retention(retention);
        self
    }

    /// The bound on each verifier's answer (default [`DEFAULT_VERIFY_TIMEOUT`]).
    pub fn verify_timeout(mut self, timeout: Duration) -> Self {
        self.verify_timeout = timeout;
        self
    }

    /// One bounded pass: the next page of stuck records, each settled as its verifier says.
    ///
    /// Errors are the scan's (the store is unreachable, or the terms are out of bounds); what
    /// happened to each record is in the [`Pass`].
    pub async fn pass(&self) -> Result<Pass, Error> {
        self.terms.check()?;
        let cursor = crate::store::lock(&self.cursor).clone();
        let mut filter = self.filter.clone();
        filter.state = Some(RecordState::Stuck);
        let page = self.store.scan(&filter, &cursor, self.batch).await?;
        let wrapped = page.next.is_none();
        *crate::store::lock(&self.cursor) = page.next.unwrap_or_default();
        let mut settled = Vec::with_capacity(page.records.len());
        for record in page.records {
            let outcome = self.settle(&record).await;
            tracing::info!(step = %record.step, key = %record.key.short(), outcome = ?outcome, "idempotent.reconciled");
            settled.push((record, outcome));
        }
        Ok(Pass { settled, wrapped })
    }

    /// Runs passes until the future is dropped: the next at once while the scan has more pages,
    /// else after `period`. A pass that fails is logged (`idempotent.store_error`) and retried
    /// after `period`.
    pub async fn run(&self, period: Duration) {
        loop {
            match self.pass().await {
                Ok(pass) if !pass.wrapped => continue,
                Ok(_) => {}
                Err(error) => {
                    tracing::warn!(store = %self.store.describe(), %error, "idempotent.store_error: a reconciler pass failed")
                }
            }
            tokio::time::sleep(period).await;
        }
    }

    async fn settle(&self, record: &RecordInfo) -> Settled {
        let Some(verify) = self.verifiers.get(&record.step) else {
            return Settled::NoVerifier;
        };
        let labels = Labels { step: &record.step, run: record.run.as_deref(), tenant: record.tenant.as_deref() };
        let mut lease = match lease::acquire(&self.store, &record.key, &record.fingerprint, &self.terms, labels).await {
            Ok(Taken::Lease(lease)) => lease,
            Ok(_) => return Settled::Busy,
            Err(e) => return Settled::StoreError(e.to_string()),
        };
        if !lease.attempt().recovered() {
            // Released cleanly between the scan and now: nothing to verify, and nothing ran.
            return end(&lease, End::Release, Settled::Busy).await;
        }
        let verifier = Some(|attempt| verify(attempt));
        let decision = verify::decide(&mut lease, &record.step, verifier, OnRecovered::Run, self.verify_timeout).await;
        if lease.is_lost() {
            return Settled::Busy;
        }
        match decision {
            Decision::Found(outcome) => end(&lease, End::Complete(outcome), Settled::Done).await,
            Decision::Run => end(&lease, End::Release, Settled::NotDone).await,
            Decision::Stop(mark, Stopped::NeedsAttention) => {
                end(&lease, End::Abandon(mark), Settled::NeedsAttention).await
            }
            Decision::Stop(_, Stopped::LeaseLost) => Settled::Busy,
            Decision::Stop(mark, Stopped::Failed(e)) => {
                end(&lease, End::Abandon(mark), Settled::VerifyFailed(e.to_string())).await
            }
            Decision::Stop(mark, Stopped::TimedOut(after)) => {
                let message = format!("the verifier did not answer within {after:?}");
                end(&lease, End::Abandon(mark), Settled::VerifyFailed(message)).await
            }
        }
    }
}

/// Ends `lease` as `how` says and answers `then`, or what went wrong.
async fn end(lease: &lease::Lease, how: End, then: Settled) -> Settled {
    match lease.end(how).await {
        Ok(Transition::Ok) => then,
        Ok(Transition::LeaseLost) => Settled::Busy,
        Err(e) => Settled::StoreError(e.to_string()),
    }
}
