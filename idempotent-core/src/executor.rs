//! Running one step: acquire, run the action at most once, store or replay its result.

use std::borrow::Cow;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::canonical::with_canonical;
use crate::detach::poll_once;
use crate::error::Error;
use crate::key::{Fingerprint, Key, ShortKey};
use crate::record::{Acquire, Lease, TAG_ERR, TAG_OK, Token, Transition};
use crate::store::{IntoSharedStore, SharedStore};

/// Default lease: how long a crashed worker blocks its key.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(60);
/// Default retention: how long a result is replayed.
pub const DEFAULT_TTL: Duration = Duration::from_secs(24 * 60 * 60);
/// Default cap on a stored result: 16 MiB.
pub const DEFAULT_MAX_RESULT_BYTES: usize = 16 << 20;
/// Default bound on waiting for another caller's attempt under [`OnInFlight::Wait`].
pub const DEFAULT_WAIT: Duration = Duration::from_secs(30);

/// What a call does when another attempt at the same operation is still running.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum OnInFlight {
    /// Fail at once with [`Error::InFlight`], which carries a retry-after.
    Reject,
    /// Poll with backoff until the other attempt's result appears (and return it) or its lease
    /// passes (and take over), failing with [`Error::InFlight`] after `timeout`.
    Wait {
        /// The longest the call waits.
        timeout: Duration,
    },
}

impl Default for OnInFlight {
    fn default() -> Self {
        OnInFlight::Wait { timeout: DEFAULT_WAIT }
    }
}

/// What a call does when the store cannot be reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum FailMode {
    /// Do not run the action; return the store error. The safe default.
    #[default]
    Closed,
    /// Run the action without protection and return its result (logged as a warning). Only for
    /// actions where a duplicate costs less than an outage.
    Open,
}

/// The options of a step; every [`RunContext::step`] starts from the context's defaults.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct StepOptions {
    /// Part of the key: bumping it starts every operation of the step afresh.
    pub version: u32,
    /// How long a result is kept and replayed.
    pub ttl: Duration,
    /// How long an attempt holds the key without renewing. Keep it at least three times the
    /// store's command timeout: the heartbeat renews every third of the lease, and a renewal that
    /// takes as long as the timeout must still land inside the lease.
    pub lease: Duration,
    /// Renew the lease while the action runs (every third of the lease).
    pub heartbeat: bool,
    /// The largest encoded result that is stored; a larger one fails with
    /// [`Error::ResultTooLarge`] and the key is released. Huge values stall a Redis server for
    /// every other caller while they are written.
    pub max_result_bytes: usize,
    /// What to do when another attempt is running.
    pub on_in_flight: OnInFlight,
    /// What to do when the store is unreachable.
    pub fail_mode: FailMode,
}

/// The longest lease a step may ask for: one day (the heartbeat renews it for longer actions).
pub const MAX_LEASE: Duration = Duration::from_secs(24 * 60 * 60);
/// The longest retention a step may ask for: ten years.
pub const MAX_TTL: Duration = Duration::from_secs(10 * 365 * 24 * 60 * 60);

impl StepOptions {
    /// Checks that the durations are within what stores can represent.
    pub fn validate(&self) -> Result<(), Error> {
        let ms = Duration::from_millis(1);
        if self.lease < ms || self.lease > MAX_LEASE {
            return Err(Error::Config(format!(
                "lease {:?} is out of range: use between 1 ms and {MAX_LEASE:?} (the heartbeat renews it while \
                 the action runs), and well above the store's command timeout",
                self.lease
            )));
        }
        if self.ttl < ms || self.ttl > MAX_TTL {
            return Err(Error::Config(format!("ttl {:?} is out of range: use between 1 ms and {MAX_TTL:?}", self.ttl)));
        }
        Ok(())
    }
}

impl Default for StepOptions {
    fn default() -> Self {
        StepOptions {
            version: 0,
            ttl: DEFAULT_TTL,
            lease: DEFAULT_LEASE,
            heartbeat: true,
            max_result_bytes: DEFAULT_MAX_RESULT_BYTES,
            on_in_flight: OnInFlight::default(),
            fail_mode: FailMode::Closed,
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
/// let ctx = RunContext::new(MemoryStore::new(), "order-7").with_tenant("acme");
/// let refund: String = ctx
///     .step("refund")
///     .run(&("order-7", 1500), |attempt| async move {
///         Ok::<_, idempotent_core::Error>(format!("re_{}", attempt.fence()))
///     })
///     .await?;
/// // The same call again replays the stored result; the action does not run.
/// let again: String = ctx.step("refund").run(&("order-7", 1500), |_| async { unreachable!() }).await?;
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

    /// Sets the tenant, so two tenants' equal run ids never share a record.
    pub fn with_tenant(mut self, tenant: impl AsRef<str>) -> Self {
        self.tenant = Some(Arc::from(tenant.as_ref()));
        self
    }

    /// Sets the options every step of this context starts from.
    pub fn with_defaults(mut self, defaults: StepOptions) -> Self {
        self.defaults = defaults;
        self
    }

    /// The run id.
    pub fn run_id(&self) -> &str {
        &self.run_id
    }

    /// The tenant, if any.
    pub fn tenant(&self) -> Option<&str> {
        self.tenant.as_deref()
    }

    /// The store handle.
    pub fn store(&self) -> &SharedStore {
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

impl Step<'_> {
    /// Sets the step version (part of the key).
    pub fn version(mut self, version: u32) -> Self {
        self.options.version = version;
        self
    }

    /// Sets how long the result is kept and replayed.
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.options.ttl = ttl;
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
        self.execute(payload, action, |_: &E| None, |_| Err(())).await
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
        self.execute(
            payload,
            action,
            |e: &E| Some(serde_json::to_vec(e)),
            |bytes| serde_json::from_slice::<E>(bytes).map_err(|_| ()),
        )
        .await
    }

    async fn execute<P, T, E, F, Fut>(
        self,
        payload: &P,
        action: F,
        encode_err: impl Fn(&E) -> Option<serde_json::Result<Vec<u8>>>,
        decode_err: impl Fn(&[u8]) -> Result<E, ()>,
    ) -> Result<T, E>
    where
        P: Serialize + ?Sized,
        T: Serialize + DeserializeOwned,
        E: From<Error>,
        F: FnOnce(Attempt) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        self.options.validate()?;
        let (key, fingerprint) = self.key_for(payload)?;
        let step: &str = &self.name;
        let opts = &self.options;
        let short = key.short_key();

        let (lease, acquired_at) = match self.acquire(&key, &fingerprint, short).await {
            Ok(Acquired::Lease(lease, sent)) => (lease, sent),
            Ok(Acquired::Replay(bytes)) => {
                tracing::debug!(step, key = %short, "idempotent.replayed");
                return decode(step, &key, &bytes, decode_err);
            }
            Err(e) if e.is_store_failure() && opts.fail_mode == FailMode::Open => {
                tracing::warn!(step, key = %short, error = %e, "idempotent.store_error: failing open, running the action unprotected");
                return action(Attempt::unprotected()).await;
            }
            Err(e) => return Err(e.into()),
        };
        tracing::debug!(step, key = %short, fence = lease.fence, attempt = lease.attempt, recovered = lease.recovered, "idempotent.acquired");
        if lease.recovered {
            tracing::info!(step, key = %short, fence = lease.fence, attempt = lease.attempt, "idempotent.recovered: a previous attempt's lease ran out without an outcome");
        }

        let signal = Arc::new(LeaseSignal::default());
        let attempt = Attempt {
            fence: lease.fence,
            number: lease.attempt,
            recovered: lease.recovered,
            signal: Some(signal.clone()),
        };
        let action = CURRENT_ATTEMPT.scope(attempt.clone(), action(attempt));
        let result = self.run_with_heartbeat(&key, &lease, acquired_at, &signal, action, short).await;

        let encoded: Option<Vec<u8>> = match &result {
            Ok(value) => {
                let mut buf = vec![TAG_OK];
                match serde_json::to_writer(&mut buf, value) {
                    Ok(()) => Some(buf),
                    Err(source) => {
                        // Nothing to store; free the key so the operation is not stuck for a lease.
                        let _ = self.settle(&key, &lease, None).await;
                        return Err(Error::Encode { step: step.to_owned(), source }.into());
                    }
                }
            }
            Err(e) => match encode_err(e) {
                Some(Ok(json)) => {
                    let mut buf = Vec::with_capacity(json.len() + 1);
                    buf.push(TAG_ERR);
                    buf.extend_from_slice(&json);
                    Some(buf)
                }
                Some(Err(err)) => {
                    tracing::warn!(step, key = %short, error = %err, "idempotent.store_error: the error could not be encoded; releasing the key instead");
                    None
                }
                None => None,
            },
        };

        let encoded = match encoded {
            Some(bytes) if bytes.len() > opts.max_result_bytes => {
                tracing::warn!(step, key = %short, size = bytes.len(), max = opts.max_result_bytes, "idempotent.store_error: result too large to store; releasing the key");
                let _ = self.settle(&key, &lease, None).await;
                return Err(Error::ResultTooLarge {
                    step: step.to_owned(),
                    size: bytes.len(),
                    max: opts.max_result_bytes,
                }
                .into());
            }
            other => other,
        };
        match encoded {
            Some(bytes) => match self.settle(&key, &lease, Some(Bytes::from(bytes))).await {
                Ok(Transition::Ok) => {
                    tracing::debug!(step, key = %short, fence = lease.fence, "idempotent.completed");
                    result
                }
                Ok(Transition::LeaseLost) => {
                    tracing::warn!(step, key = %short, fence = lease.fence, "idempotent.lease_lost: the result was not stored");
                    Err(Error::LeaseLost { step: step.to_owned(), key: short.to_string(), fence: lease.fence }.into())
                }
                Err(e) => {
                    tracing::error!(step, key = %short, error = %e, "idempotent.store_error: the action ran but its result was not stored");
                    Err(e.into())
                }
            },
            None => {
                match self.settle(&key, &lease, None).await {
                    Ok(Transition::Ok) => tracing::debug!(step, key = %short, "idempotent.released"),
                    Ok(Transition::LeaseLost) => {
                        tracing::warn!(step, key = %short, fence = lease.fence, "idempotent.lease_lost: released after losing the lease")
                    }
                    // The lease runs out on its own; the action's error is what the caller needs.
                    Err(e) => {
                        tracing::warn!(step, key = %short, error = %e, "idempotent.store_error: could not release; the key frees itself when the lease runs out")
                    }
                }
                result
            }
        }
    }

    /// Completes (with a result) or releases (without) the key.
    ///
    /// Once the action has finished, dropping the caller's future (a timeout around the step, a
    /// `select!`) must not strand the outcome and leave the key to run again. The store call is
    /// awaited here; if this future is dropped before it finishes, a guard hands the same call
    /// to a task of its own (every transition is idempotent for its owner token, so a call that
    /// had already reached the store is harmless to send again).
    async fn settle(&self, key: &Key, lease: &Lease, result: Option<Bytes>) -> Result<Transition, Error> {
        let (store, token, ttl) = (&self.ctx.store, &lease.token, self.options.ttl);
        let mut guard = SettleOnDrop { store, key, token, ttl, result: Some(result.clone()) };
        let out = match result {
            Some(bytes) => store.complete(key, token, bytes, ttl).await,
            None => store.release(key, token).await,
        };
        guard.result = None;
        out
    }

    async fn acquire(&self, key: &Key, fingerprint: &Fingerprint, short: ShortKey) -> Result<Acquired, Error> {
        let opts = &self.options;
        let step: &str = &self.name;
        let started = Instant::now();
        let mut backoff = Duration::from_millis(10);
        loop {
            let sent = Instant::now();
            let answer = self.ctx.store.acquire(key, fingerprint, opts.lease, opts.ttl).await;
            match answer {
                Ok(Acquire::Acquired(lease)) => return Ok(Acquired::Lease(lease, sent)),
                Ok(Acquire::Replay(bytes)) => return Ok(Acquired::Replay(bytes)),
                Ok(Acquire::Mismatch) => {
                    tracing::warn!(step, key = %short, "idempotent.mismatch: same key, different payload");
                    return Err(Error::Mismatch { step: step.to_owned(), key: short.to_string() });
                }
                Ok(Acquire::InFlight { retry_after }) => {
                    let in_flight = || Error::InFlight { step: step.to_owned(), key: short.to_string(), retry_after };
                    let OnInFlight::Wait { timeout } = opts.on_in_flight else {
                        tracing::debug!(step, key = %short, ?retry_after, "idempotent.in_flight: rejected");
                        return Err(in_flight());
                    };
                    let waited = started.elapsed();
                    if waited >= timeout {
                        tracing::debug!(step, key = %short, ?waited, "idempotent.in_flight: gave up waiting");
                        return Err(in_flight());
                    }
                    tracing::trace!(step, key = %short, ?retry_after, "idempotent.in_flight: waiting");
                    let nap = backoff.min(retry_after.max(Duration::from_millis(1))).min(timeout - waited);
                    tokio::time::sleep(nap).await;
                    backoff = (backoff * 2).min(Duration::from_millis(500));
                }
                Err(e) => {
                    tracing::warn!(step, key = %short, error = %e, "idempotent.store_error");
                    return Err(e);
                }
            }
        }
    }

    /// Drives the action, renewing the lease every third of it. A renewal in progress never delays
    /// the action: both are polled together.
    ///
    /// The lease is known to hold until `lease` after the last successful renewal (or the
    /// acquire) was *sent*. When renewals fail for that long — the store is unreachable from here
    /// while others may reach it — the lease counts as lost and the action is told, even though no
    /// store said so.
    async fn run_with_heartbeat<T, E, Fut>(
        &self,
        key: &Key,
        lease: &Lease,
        acquired_at: Instant,
        signal: &LeaseSignal,
        action: Fut,
        short: ShortKey,
    ) -> Result<T, E>
    where
        Fut: Future<Output = Result<T, E>>,
    {
        let opts = &self.options;
        if !opts.heartbeat {
            return action.await;
        }
        let step: &str = &self.name;
        let period = (opts.lease / 3).max(Duration::from_millis(1));
        tokio::pin!(action);
        // An action that is done at its first poll needs no timer.
        if let Some(res) = poll_once(action.as_mut()).await {
            return res;
        }
        let mut valid_until = acquired_at + opts.lease;
        let mut next = Instant::now() + period;
        loop {
            if let Ok(res) = tokio::time::timeout_at(next.min(valid_until), &mut action).await {
                return res;
            }
            if Instant::now() >= valid_until {
                tracing::warn!(step, key = %short, fence = lease.fence, "idempotent.lease_lost: no renewal reached the store within the lease; another attempt may take over");
                signal.mark_lost();
            }
            if signal.is_lost() {
                return action.await;
            }
            let sent = Instant::now();
            let renew = self.ctx.store.renew(key, &lease.token, opts.lease);
            tokio::select! {
                biased;
                res = &mut action => return res,
                r = renew => match r {
                    Ok(Transition::Ok) => {
                        valid_until = sent + opts.lease;
                        tracing::trace!(step, key = %short, "idempotent.renewed");
                    }
                    Ok(Transition::LeaseLost) => {
                        tracing::warn!(step, key = %short, fence = lease.fence, "idempotent.lease_lost: another attempt took over while this one was running");
                        signal.mark_lost();
                    }
                    // Keep trying until the lease is known to be over.
                    Err(e) => tracing::warn!(step, key = %short, error = %e, "idempotent.store_error: lease renewal failed"),
                },
            }
            next = Instant::now() + period;
        }
    }
}

/// Finishes an interrupted [`Step::settle`] in a task of its own (see there).
///
/// Not [`FinishOnDrop`](crate::detach::FinishOnDrop): that one owns a boxed future, which here
/// would cost a box, a store handle and a token clone on every call, for the rare dropped
/// caller; the guard borrows instead and clones only when it has to spawn (a same-machine A/B of
/// the two measured the executor's first execution 4–9% slower with the box).
struct SettleOnDrop<'a> {
    store: &'a SharedStore,
    key: &'a Key,
    token: &'a Token,
    ttl: Duration,
    /// `Some` while the store call has not finished: the outcome to store (`None` inside: release).
    result: Option<Option<Bytes>>,
}

impl Drop for SettleOnDrop<'_> {
    fn drop(&mut self) {
        let Some(result) = self.result.take() else { return };
        if std::thread::panicking() {
            // The store call itself panicked: repeating it would most likely panic again.
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::warn!(key = %self.key.short(), "idempotent.store_error: dropped while storing the outcome, outside a runtime; the key frees itself when the lease runs out");
            return;
        };
        let (store, key, token, ttl) = (self.store.clone(), *self.key, self.token.clone(), self.ttl);
        let finish = async move {
            let out = match result {
                Some(bytes) => store.complete(&key, &token, bytes, ttl).await,
                None => store.release(&key, &token).await,
            };
            if let Err(e) = out {
                tracing::warn!(key = %key.short(), error = %e, "idempotent.store_error: storing the outcome after the caller went away failed");
            }
        };
        runtime.spawn(tracing::Instrument::in_current_span(finish));
    }
}

enum Acquired {
    /// The lease, and when the acquire that took it was sent (the lease runs from no earlier).
    Lease(Lease, Instant),
    Replay(Bytes),
}

fn decode<T: DeserializeOwned, E: From<Error>>(
    step: &str,
    key: &Key,
    bytes: &[u8],
    decode_err: impl Fn(&[u8]) -> Result<E, ()>,
) -> Result<T, E> {
    let decode_error = |source| Error::Decode { step: step.to_owned(), key: key.short(), source };
    match bytes.split_first() {
        Some((&TAG_OK, json)) => serde_json::from_slice(json).map_err(|e| decode_error(e).into()),
        Some((&TAG_ERR, json)) => match decode_err(json) {
            Ok(e) => Err(e),
            Err(()) => Err(match serde_json::from_slice::<serde_json::Value>(json) {
                Ok(_) => Error::Corrupt { key: key.short(), detail: "a stored error was found, but this call does not store errors; call it with the same store_errors setting, or bump the step version".into() },
                Err(e) => decode_error(e),
            }
            .into()),
        },
        _ => Err(Error::Corrupt { key: key.short(), detail: "stored result has no outcome tag".into() }.into()),
    }
}

tokio::task_local! {
    static CURRENT_ATTEMPT: Attempt;
}

/// The [`Attempt`] of the step action being run by the current task, if any.
///
/// The executor makes the attempt available for the whole action, so code deep inside it (or a
/// function annotated with `#[idempotent]`, whose body has no `Attempt` parameter) can read the
/// fence or check whether the lease was lost.
///
/// ```
/// use idempotent_core::{MemoryStore, RunContext, current_attempt};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), idempotent_core::Error> {
/// assert!(current_attempt().is_none());
/// let ctx = RunContext::new(MemoryStore::new(), "run");
/// let fence: u64 = ctx.step("s").run(&(), |_| async {
///     Ok::<_, idempotent_core::Error>(current_attempt().expect("inside a step").fence())
/// }).await?;
/// assert!(fence > 0);
/// # Ok(()) }
/// ```
pub fn current_attempt() -> Option<Attempt> {
    CURRENT_ATTEMPT.try_with(Attempt::clone).ok()
}

#[derive(Default)]
struct LeaseSignal {
    lost: AtomicBool,
    notify: Notify,
}

impl LeaseSignal {
    fn is_lost(&self) -> bool {
        self.lost.load(Ordering::Acquire)
    }

    fn mark_lost(&self) {
        self.lost.store(true, Ordering::Release);
        self.notify.notify_waiters();
    }
}

/// What the action knows about its attempt.
///
/// Pass [`fence`](Self::fence) to downstream systems that can reject a stale writer (a database
/// row's version, a payment provider's own idempotency key suffix).
#[derive(Clone)]
pub struct Attempt {
    fence: u64,
    number: u32,
    recovered: bool,
    signal: Option<Arc<LeaseSignal>>,
}

impl Attempt {
    fn unprotected() -> Attempt {
        Attempt { fence: 0, number: 1, recovered: false, signal: None }
    }

    /// The fencing token: higher for every later attempt at the same operation.
    pub fn fence(&self) -> u64 {
        self.fence
    }

    /// 1 for the first attempt at this operation, then one more for each.
    pub fn number(&self) -> u32 {
        self.number
    }

    /// Whether a previous attempt's lease ran out without an outcome (it crashed or was cancelled,
    /// and its side effect may or may not have happened).
    pub fn recovered(&self) -> bool {
        self.recovered
    }

    /// Whether the action runs without protection because the store was unreachable and the step
    /// fails open.
    pub fn is_unprotected(&self) -> bool {
        self.signal.is_none()
    }

    /// Whether the lease was lost: another attempt may have taken over, and this one's result will
    /// not be stored. Long actions should check it before each side effect.
    pub fn lease_lost(&self) -> bool {
        self.signal.as_ref().is_some_and(|s| s.is_lost())
    }

    /// Completes when the lease is lost (never, if it is not). Race it against the work with
    /// `tokio::select!` to stop early.
    pub async fn lost(&self) {
        let Some(signal) = &self.signal else {
            return std::future::pending().await;
        };
        loop {
            let notified = signal.notify.notified();
            if signal.is_lost() {
                return;
            }
            notified.await;
        }
    }
}

impl std::fmt::Debug for Attempt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Attempt")
            .field("fence", &self.fence)
            .field("number", &self.number)
            .field("recovered", &self.recovered)
            .field("lease_lost", &self.lease_lost())
            .finish()
    }
}
