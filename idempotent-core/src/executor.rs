//! Running one step: acquire, run the action at most once, store or replay its result.

use std::borrow::Cow;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::attempt::Attempt;
use crate::canonical::with_canonical;
use crate::error::Error;
use crate::key::{Fingerprint, Key};
use crate::lease::{DEFAULT_LEASE, DEFAULT_RETENTION, FailMode, OnInFlight, Terms};
use crate::metrics::{Op, Timer};
use crate::record::{Resolution, Resolved};
use crate::store::{IntoSharedStore, RecordInfo, SharedStore};
use crate::verify::{DEFAULT_VERIFY_TIMEOUT, OnRecovered, Verdict};

mod run;
#[cfg(any(feature = "sqlite", feature = "postgres"))]
mod transaction;
mod verified;

pub use verified::Verified;

/// Default cap on a stored result: 16 MiB.
pub const DEFAULT_MAX_RESULT_BYTES: usize = 16 << 20;

/// Where a call's result came from: what [`Step::run_traced`] returns next to it.
///
/// Told by the stored record, not by comparing values: the executor stores the number of the
/// attempt that produced an outcome with it (see [`record::read_outcome`](crate::record::read_outcome)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Provenance {
    /// This call ran the action (or its verifier found the effect) and stored the result.
    Executed {
        /// This call's attempt ([`Attempt::number`]).
        attempt: u32,
    },
    /// The result was stored earlier and replayed: nothing ran.
    Replayed {
        /// The attempt that produced it; `None` for a result settled by
        /// [`Step::resolve_done`] (no attempt produced it), or stored by a version of this crate
        /// that did not record it.
        attempt: Option<u32>,
    },
    /// The store was unreachable and the step fails open: the action ran unprotected, and
    /// nothing was stored.
    Unprotected,
}

impl Provenance {
    /// Whether the result was replayed (nothing ran).
    pub fn is_replayed(&self) -> bool {
        matches!(self, Provenance::Replayed { .. })
    }

    /// The attempt that produced the result, when known.
    pub fn attempt(&self) -> Option<u32> {
        match *self {
            Provenance::Executed { attempt } => Some(attempt),
            Provenance::Replayed { attempt } => attempt,
            Provenance::Unprotected => None,
        }
    }
}

/// The options of a step; every [`RunContext::step`] starts from the context's defaults.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct StepOptions {
    /// Part of the key: bumping it starts every operation of the step afresh.
    pub version: u32,
    /// How long a result is kept and replayed
    /// ([`MIN_RETENTION`](crate::lease::MIN_RETENTION) ..= [`MAX_RETENTION`](crate::lease::MAX_RETENTION)).
    pub retention: Duration,
    /// How long an attempt holds the key without renewing
    /// ([`MIN_LEASE`](crate::lease::MIN_LEASE) ..= [`MAX_LEASE`](crate::lease::MAX_LEASE)). Keep it at least
    /// three times the store's command timeout: the heartbeat renews every third of the lease,
    /// and a renewal that takes as long as the timeout must still land inside the lease.
    pub lease: Duration,
    /// Renew the lease while the action runs (every third of the lease).
    pub heartbeat: bool,
    /// The largest encoded result that is stored; a larger one fails with
    /// [`Error::ResultTooLarge`] and the key is released. Huge values stall a Redis server for
    /// every other caller while they are written.
    pub max_result_bytes: usize,
    /// What to do when another attempt is running (by default, wait up to
    /// [`DEFAULT_WAIT`](crate::lease::DEFAULT_WAIT): see [`OnInFlight`] for why the executor waits and
    /// the HTTP layer does not).
    pub on_in_flight: OnInFlight,
    /// What to do when the store is unreachable.
    pub fail_mode: FailMode,
    /// What a step without a verifier does when the previous attempt's outcome is uncertain (see
    /// [`verify`](crate::verify)).
    pub on_recovered: OnRecovered,
    /// How long a verifier may take to answer ([`Error::VerifyTimeout`] after that).
    pub verify_timeout: Duration,
}

impl StepOptions {
    /// Checks that the durations are within their bounds (see [`Terms::check`]).
    pub fn validate(&self) -> Result<(), Error> {
        self.terms().check()
    }

    /// The lease terms these options give.
    pub fn terms(&self) -> Terms {
        Terms::default()
            .lease(self.lease)
            .retention(self.retention)
            .heartbeat(self.heartbeat)
            .on_in_flight(self.on_in_flight)
    }
}

impl Default for StepOptions {
    fn default() -> Self {
        StepOptions {
            version: 0,
            retention: DEFAULT_RETENTION,
            lease: DEFAULT_LEASE,
            heartbeat: true,
            max_result_bytes: DEFAULT_MAX_RESULT_BYTES,
            on_in_flight: OnInFlight::default(),
            fail_mode: FailMode::Closed,
            on_recovered: OnRecovered::Run,
            verify_timeout: DEFAULT_VERIFY_TIMEOUT,
        }
    }
}

/// The run an action belongs to: a store, a run id and an optional tenant.
///
/// A run id names one logical execution of a pipeline (a job id, a conversation turn, an order).
/// Every retry of the pipeline must use the same run id, so its steps derive the same keys.
/// Cheap to clone.
///
/// ```
/// use idempotent_core::{MemoryStore, RunContext};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), idempotent_core::Error> {
/// let ctx = RunContext::new(MemoryStore::new(), "order-7").tenant("acme");
/// let refund: String = ctx
///     .step("refund")
///     .run(&("order-7", 1500), |attempt| async move {
///         Ok::<_, idempotent_core::Error>(format!("re_{}", attempt.fence()))
///     })
///     .await?;
/// // The same call again replays the stored result; the action does not run.
/// let again: String = ctx
///     .step("refund")
///     .run(&("order-7", 1500), |_| async { Err::<String, _>(idempotent_core::Error::action("ran again")) })
///     .await?;
/// assert_eq!(refund, again);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RunContext {
    store: SharedStore,
    run_id: Arc<str>,
    tenant: Option<Arc<str>>,
    defaults: StepOptions,
}

impl std::fmt::Debug for RunContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunContext")
            .field("store", &self.store.describe())
            .field("run_id", &self.run_id)
            .field("tenant", &self.tenant)
            .finish()
    }
}

impl RunContext {
    /// A context for the run `run_id` on `store` (a store, or a [`SharedStore`] handle).
    pub fn new(store: impl IntoSharedStore, run_id: impl AsRef<str>) -> Self {
        RunContext {
            store: store.into_shared(),
            run_id: Arc::from(run_id.as_ref()),
            tenant: None,
            defaults: StepOptions::default(),
        }
    }

    /// Sets the tenant, so two tenants' equal run ids never share a record (read back with
    /// [`tenant_name`](Self::tenant_name)).
    pub fn tenant(mut self, tenant: impl AsRef<str>) -> Self {
        self.tenant = Some(Arc::from(tenant.as_ref()));
        self
    }

    /// Sets the options every step of this context starts from.
    pub fn defaults(mut self, defaults: StepOptions) -> Self {
        self.defaults = defaults;
        self
    }

    /// The same run (run id, tenant and step defaults) on another store: the keys its steps
    /// derive are the same as on this one.
    ///
    /// For a handler behind `idempotent-tower`'s layer, whose request context is on the layer's
    /// store, to run a step whose record commits with its writes
    /// ([`Step::run_in_transaction`]) on the SQL store of the database it writes to, under the
    /// request's identity.
    pub fn store(mut self, store: impl IntoSharedStore) -> Self {
        self.store = store.into_shared();
        self
    }

    /// The run id.
    pub fn run_id(&self) -> &str {
        &self.run_id
    }

    /// The tenant, if any.
    pub fn tenant_name(&self) -> Option<&str> {
        self.tenant.as_deref()
    }

    /// The handle of the store the context's steps keep their records in.
    pub fn shared_store(&self) -> &SharedStore {
        &self.store
    }

    /// Starts describing a call of the step `name` (a `&str`, borrowed for the call, or a
    /// `String`).
    pub fn step<'c>(&'c self, name: impl Into<Cow<'c, str>>) -> Step<'c> {
        Step { ctx: self, name: name.into(), options: self.defaults.clone(), identity: None }
    }
}

/// One call of a step, configured by its builder methods and executed by [`Step::run`].
#[derive(Debug)]
#[must_use = "a step does nothing until `run` is awaited"]
pub struct Step<'c> {
    ctx: &'c RunContext,
    name: Cow<'c, str>,
    options: StepOptions,
    identity: Option<Result<Fingerprint, crate::canonical::CanonicalError>>,
}

impl<'c> Step<'c> {
    /// Sets the step version (part of the key).
    pub fn version(mut self, version: u32) -> Self {
        self.options.version = version;
        self
    }

    /// Sets how long the result is kept and replayed.
    pub fn retention(mut self, retention: Duration) -> Self {
        self.options.retention = retention;
        self
    }

    /// Sets the lease.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.options.lease = lease;
        self
    }

    /// Turns lease renewal while the action runs on or off.
    pub fn heartbeat(mut self, on: bool) -> Self {
        self.options.heartbeat = on;
        self
    }

    /// Sets the largest encoded result that is stored.
    pub fn max_result_bytes(mut self, max: usize) -> Self {
        self.options.max_result_bytes = max;
        self
    }

    /// Sets what to do when another attempt is running.
    pub fn on_in_flight(mut self, policy: OnInFlight) -> Self {
        self.options.on_in_flight = policy;
        self
    }

    /// Sets what to do when the store is unreachable.
    pub fn fail_mode(mut self, mode: FailMode) -> Self {
        self.options.fail_mode = mode;
        self
    }

    /// Sets what a step without a verifier does when the previous attempt's outcome is
    /// uncertain: run the action again (the default), or wait for a person.
    pub fn on_recovered(mut self, policy: OnRecovered) -> Self {
        self.options.on_recovered = policy;
        self
    }

    /// Sets how long the verifier may take to answer.
    pub fn verify_timeout(mut self, timeout: Duration) -> Self {
        self.options.verify_timeout = timeout;
        self
    }

    /// Gives the step a verifier: called instead of the action when the previous attempt's
    /// outcome is uncertain (its lease ran out, or storing its outcome failed), to ask the
    /// downstream system what happened. See [`verify`](crate::verify) and [`Verdict`].
    ///
    /// The verifier gets the attempt (with its [`downstream_key`](Attempt::downstream_key)), runs
    /// under the lease (renewed as the action's is) and within
    /// [`verify_timeout`](Self::verify_timeout). An `Err` from it, or a timeout, leaves the
    /// record for the next call to verify again, and is returned.
    ///
    /// `verify` turns the step into a [`Verified`] one, which runs as the step does: give it
    /// last, after the other options.
    pub fn verify<V, VFut>(self, verifier: V) -> Verified<'c, V>
    where
        V: FnOnce(Attempt) -> VFut,
    {
        Verified { step: self, verifier }
    }

    /// Settles this operation's record, which [needs attention](Error::NeedsAttention), as done
    /// with `result`: every later call replays it, for the step's retention.
    /// [`Resolved::Unchanged`] (and nothing changed) when the record does not need
    /// attention.
    ///
    /// `T` must be the step's result type (the `T` its `run` returns): the calls after it decode
    /// the stored result as that type, and fail with [`Error::Decode`] otherwise.
    pub async fn resolve_done<P, T>(self, payload: &P, result: &T) -> Result<Resolved, Error>
    where
        P: Serialize + ?Sized,
        T: Serialize + ?Sized,
    {
        self.options.validate()?;
        let (key, _) = self.key_for(payload)?;
        let step = self.name.to_string();
        let outcome =
            crate::record::encode_ok(result).map_err(|source| Error::Encode { step: step.clone(), source })?;
        let max = self.options.max_result_bytes;
        if outcome.len() > max {
            return Err(Error::ResultTooLarge { step, size: outcome.len(), max });
        }
        self.resolve(&key, Resolution::Done { outcome, retention: self.options.retention }).await
    }

    /// Settles this operation's record, which [needs attention](Error::NeedsAttention), as not
    /// done: the next call runs the action, as a fresh attempt.
    pub async fn resolve_not_done<P: Serialize + ?Sized>(self, payload: &P) -> Result<Resolved, Error> {
        let (key, _) = self.key_for(payload)?;
        self.resolve(&key, Resolution::NotDone).await
    }

    async fn resolve(&self, key: &Key, resolution: Resolution) -> Result<Resolved, Error> {
        let timer = Timer::start();
        let answer = self.ctx.store.resolve(key, resolution).await;
        timer.store_call(&*self.ctx.store, Op::Resolve);
        answer
    }

    /// This operation's record as the store holds it (its state, labels, attempt, fence and
    /// times; never its result), or `None` when there is none: for an operator's look, or to
    /// find the key and fence to [release](crate::Store::release_fenced) by.
    pub async fn inspect<P: Serialize + ?Sized>(&self, payload: &P) -> Result<Option<RecordInfo>, Error> {
        let (key, _) = self.key_for(payload)?;
        self.ctx.store.inspect(&key).await
    }

    /// Replaces all options at once.
    pub fn options(mut self, options: StepOptions) -> Self {
        self.options = options;
        self
    }

    /// Keys the operation on `identity` instead of the whole payload.
    ///
    /// The payload passed to [`run`](Self::run) is still fingerprinted: a later call with the same
    /// identity and a different payload fails with [`Error::Mismatch`] instead of replaying.
    pub fn identity<I: Serialize + ?Sized>(mut self, identity: &I) -> Self {
        self.identity = Some(Fingerprint::of(identity));
        self
    }

    /// The key and fingerprint this call would use for `payload`.
    pub fn key_for<P: Serialize + ?Sized>(&self, payload: &P) -> Result<(Key, Fingerprint), Error> {
        let payload_err = |source| Error::Payload { step: self.name.to_string(), source };
        let fingerprint = with_canonical(payload, Fingerprint::of_canonical).map_err(payload_err)?;
        let identity = match &self.identity {
            None => fingerprint,
            Some(Ok(id)) => *id,
            Some(Err(e)) => return Err(payload_err(e.clone())),
        };
        let key =
            Key::operation(self.ctx.tenant.as_deref(), &self.ctx.run_id, &self.name, self.options.version, &identity);
        Ok((key, fingerprint))
    }

    /// Runs the action at most once for this operation and returns its result; every later call
    /// (while the record is retained) returns the stored result without running the action.
    ///
    /// An `Err` from the action releases the key, so a retry runs the action again. Errors of the
    /// protocol itself are converted into `E` through `From<Error>`.
    pub async fn run<P, T, E, F, Fut>(self, payload: &P, action: F) -> Result<T, E>
    where
        P: Serialize + ?Sized,
        T: Serialize + DeserializeOwned,
        E: From<Error>,
        F: FnOnce(Attempt) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let traced = self.execute(payload, no_verifier::<T, E>(), action, |_: &E| None, |_| Err(())).await;
        traced.map(|(value, _)| value)
    }

    /// [`run`](Self::run), also telling where the result came from: run by this call (and by
    /// which attempt), or replayed (and which attempt had produced it), or run unprotected.
    ///
    /// ```
    /// use idempotent_core::{MemoryStore, Provenance, RunContext};
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), idempotent_core::Error> {
    /// let ctx = RunContext::new(MemoryStore::new(), "order-7");
    /// let refund = |_| async { Ok::<_, idempotent_core::Error>("re_1".to_owned()) };
    /// let (id, how) = ctx.step("refund").run_traced(&1500, refund).await?;
    /// assert_eq!((id.as_str(), how), ("re_1", Provenance::Executed { attempt: 1 }));
    /// let (again, how) = ctx.step("refund").run_traced(&1500, refund).await?;
    /// assert_eq!((again.as_str(), how), ("re_1", Provenance::Replayed { attempt: Some(1) }));
    /// # Ok(()) }
    /// ```
    pub async fn run_traced<P, T, E, F, Fut>(self, payload: &P, action: F) -> Result<(T, Provenance), E>
    where
        P: Serialize + ?Sized,
        T: Serialize + DeserializeOwned,
        E: From<Error>,
        F: FnOnce(Attempt) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        self.execute(payload, no_verifier::<T, E>(), action, |_: &E| None, |_| Err(())).await
    }

    /// Like [`run`](Self::run), but an `Err` from the action is stored and replayed too (for
    /// permanent failures such as a declined card, which must not be retried).
    pub async fn run_storing_errors<P, T, E, F, Fut>(self, payload: &P, action: F) -> Result<T, E>
    where
        P: Serialize + ?Sized,
        T: Serialize + DeserializeOwned,
        E: From<Error> + Serialize + DeserializeOwned,
        F: FnOnce(Attempt) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let traced = self
            .execute(
                payload,
                no_verifier::<T, E>(),
                action,
                |e: &E| Some(serde_json::to_vec(e)),
                |bytes| serde_json::from_slice::<E>(bytes).map_err(|_| ()),
            )
            .await;
        traced.map(|(value, _)| value)
    }
}

/// The type of the verifier of a step that has none.
type NoVerifier<T, E> = fn(Attempt) -> std::future::Ready<Result<Verdict<T>, E>>;

/// The verifier of a step that has none, for `execute`.
fn no_verifier<T, E>() -> Option<NoVerifier<T, E>> {
    None
}
