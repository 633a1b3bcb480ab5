//! How one call of a step runs: take the key, decide what a recovered attempt does
//! ([`verify::decide`]), run the action under the lease, and store, release or replay.

use std::future::Future;
use std::pin::pin;

use bytes::Bytes;
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::{Provenance, Step};
use crate::attempt::{Attempt, CURRENT_ATTEMPT};
use crate::error::Error;
use crate::key::{Fingerprint, Key};
use crate::lease::{self, End, FailMode, Lease, Taken, Terms};
use crate::metrics::{self, CallEnd, Timer};
use crate::record::{Abandon, Labels, Transition};
use crate::verify::{self, Decision, Stopped, Verdict};

impl Step<'_> {
    pub(super) async fn execute<P, T, E, V, VFut, F, Fut>(
        self,
        payload: &P,
        verifier: Option<V>,
        action: F,
        encode_err: impl Fn(&E) -> Option<serde_json::Result<Vec<u8>>>,
        decode_err: impl Fn(&[u8]) -> Result<E, ()>,
    ) -> Result<(T, Provenance), E>
    where
        P: Serialize + ?Sized,
        T: Serialize + DeserializeOwned,
        E: From<Error>,
        V: FnOnce(Attempt) -> VFut,
        VFut: Future<Output = Result<Verdict<T>, E>>,
        F: FnOnce(Attempt) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let (key, fingerprint) = self.key_for(payload).inspect_err(|_| self.count(CallEnd::Failed))?;
        let mut lease = match self.begin(&key, &fingerprint, &self.options.terms(), decode_err).await {
            Begun::Run(lease) => lease,
            Begun::Answered(answer) => return answer,
            Begun::FailOpen => return action(Attempt::unprotected(key)).await.map(|v| (v, Provenance::Unprotected)),
        };

        let attempt = lease.attempt().clone();
        let executed = Provenance::Executed { attempt: attempt.number() };
        let decision =
            verify::decide(&mut lease, &self.name, verifier, self.options.on_recovered, self.options.verify_timeout);
        let result = match decision.await {
            Decision::Run => {
                let timer = Timer::start();
                let action = pin!(CURRENT_ATTEMPT.scope(attempt.clone(), action(attempt)));
                let result = lease.run(action).await;
                timer.action(&self.name, &*self.ctx.store);
                result
            }
            Decision::Found(value) => Ok(value),
            Decision::Stop(mark, why) => {
                let error = match why {
                    Stopped::NeedsAttention => self.needs_attention(lease.attempt()).into(),
                    Stopped::LeaseLost => self.lease_lost(&key, lease.attempt().fence()).into(),
                    Stopped::Failed(e) => e,
                    Stopped::TimedOut(after) => {
                        Error::VerifyTimeout { step: self.name.to_string(), key: key.short().to_string(), after }.into()
                    }
                };
                // Nothing ran: the error is what the caller needs, whether or not the mark
                // reached the store (if not, the lease runs out and the next attempt is
                // recovered, which is the same as an uncertain mark) — unless another attempt
                // took the key over, which may have settled it since.
                let ended = lease.end(End::Abandon(mark)).await;
                let lost = matches!(ended, Ok(Transition::LeaseLost));
                self.count(match mark {
                    _ if lost || (mark == Abandon::Uncertain && lease.is_lost()) => CallEnd::LeaseLost,
                    Abandon::NeedsAttention => CallEnd::NeedsAttention,
                    _ => CallEnd::Failed,
                });
                return match ended {
                    Ok(Transition::LeaseLost) => Err(self.lease_lost(&key, lease.attempt().fence()).into()),
                    _ => Err(error),
                };
            }
        };
        let fence = lease.attempt().fence();

        match self.outcome(&key, lease.attempt().number(), &result, encode_err) {
            Keep::Store(bytes) => {
                let answer = lease.end(End::Complete(bytes)).await;
                metrics::ended(&self.name, &*self.ctx.store, true, &answer);
                match answer {
                    Ok(Transition::Ok) => result.map(|v| (v, executed)),
                    Ok(Transition::LeaseLost) => Err(self.lease_lost(&key, fence).into()),
                    // The action ran; its outcome may not have been stored (the lease has marked
                    // the record uncertain, so that the next attempt is recovered at once).
                    Err(e) => Err(e.into()),
                }
            }
            // The action's error is what the caller needs; a failed release frees itself when
            // the lease runs out (logged by the lease).
            Keep::Release => {
                let _ = lease.release().await;
                self.count(CallEnd::Executed);
                result.map(|v| (v, executed))
            }
            // The action ran but its result cannot be stored: the next attempt is recovered, so
            // that a verifier (or `OnRecovered`) decides whether it runs again.
            Keep::Fail(e) => {
                let _ = lease.end(End::Abandon(Abandon::Uncertain)).await;
                self.count(CallEnd::Failed);
                Err(e.into())
            }
        }
    }

    /// Counts this call's outcome in the [metrics](crate::metrics) (nothing without the feature).
    pub(super) fn count(&self, outcome: CallEnd) {
        metrics::call(&self.name, &*self.ctx.store, outcome);
    }

    pub(super) fn needs_attention(&self, attempt: &Attempt) -> Error {
        Error::needs_attention(&self.name, attempt.key(), attempt.number(), attempt.fence())
    }

    /// Acquires the key as `terms` say, and answers what the store answered without a lease:
    /// a replay (decoded), a mismatch, a key in flight, or a store failure (which fails open
    /// when the step says so).
    pub(super) async fn begin<T, E>(
        &self,
        key: &Key,
        fingerprint: &Fingerprint,
        terms: &Terms,
        decode_err: impl Fn(&[u8]) -> Result<E, ()>,
    ) -> Begun<Result<(T, Provenance), E>>
    where
        T: DeserializeOwned,
        E: From<Error>,
    {
        let step: &str = &self.name;
        let short = key.short();
        let labels = Labels::step(step).run(&self.ctx.run_id).tenant(self.ctx.tenant.as_deref());
        let taken = lease::acquire(&self.ctx.store, key, fingerprint, terms, labels).await;
        lease::count_acquired(step, &*self.ctx.store, &taken, self.options.fail_mode == FailMode::Open);
        let answer = match taken {
            Ok(Taken::Lease(lease)) => return Begun::Run(lease),
            Ok(Taken::Replay(bytes)) => {
                tracing::debug!(step, key = %short, "idempotent.replayed");
                decode(step, key, &bytes, decode_err)
            }
            Ok(Taken::InFlight { retry_after }) => {
                Err(Error::InFlight { step: step.to_owned(), key: short.to_string(), retry_after }.into())
            }
            Ok(Taken::Mismatch) => {
                tracing::warn!(step, key = %short, "idempotent.mismatch: same key, different payload");
                Err(Error::Mismatch { step: step.to_owned(), key: short.to_string() }.into())
            }
            Ok(Taken::NeedsAttention { attempt, fence }) => {
                Err(Error::needs_attention(step, key, attempt, fence).into())
            }
            // Lease or retention out of bounds (`lease::acquire` checks them): nothing was sent.
            Err(e @ Error::Config(_)) => Err(e.into()),
            Err(e) if e.is_store_failure() && self.options.fail_mode == FailMode::Open => {
                tracing::warn!(step, key = %short, error = %e, "idempotent.store_error: failing open, running the action unprotected");
                return Begun::FailOpen;
            }
            Err(e) => {
                tracing::warn!(step, key = %short, error = %e, "idempotent.store_error");
                Err(e.into())
            }
        };
        Begun::Answered(answer)
    }

    /// What to do with the action's result: the bytes to store, or release the key (an `Err`
    /// that is not stored), or release it and fail (a result that cannot be stored).
    pub(super) fn outcome<T: Serialize, E>(
        &self,
        key: &Key,
        attempt: u32,
        result: &Result<T, E>,
        encode_err: impl Fn(&E) -> Option<serde_json::Result<Vec<u8>>>,
    ) -> Keep {
        let step: &str = &self.name;
        let short = key.short();
        let encoded = match result {
            Ok(value) => match crate::record::encode_outcome(attempt, true, |buf| serde_json::to_writer(buf, value)) {
                Ok(bytes) => bytes,
                // Nothing to store; free the key (marked uncertain) so the operation is not stuck
                // for a lease.
                Err(source) => return Keep::Fail(Error::Encode { step: step.to_owned(), source }),
            },
            Err(e) => match encode_err(e) {
                Some(Ok(json)) => match crate::record::encode_outcome(attempt, false, |buf| {
                    buf.extend_from_slice(&json);
                    Ok(())
                }) {
                    Ok(bytes) => bytes,
                    Err(source) => return Keep::Fail(Error::Encode { step: step.to_owned(), source }),
                },
                Some(Err(err)) => {
                    tracing::warn!(step, key = %short, error = %err, "idempotent.store_error: the error could not be encoded; releasing the key instead");
                    return Keep::Release;
                }
                None => return Keep::Release,
            },
        };
        let max = self.options.max_result_bytes;
        if encoded.len() > max {
            tracing::warn!(step, key = %short, size = encoded.len(), max, "idempotent.store_error: result too large to store; releasing the key as uncertain");
            return Keep::Fail(Error::ResultTooLarge { step: step.to_owned(), size: encoded.len(), max });
        }
        Keep::Store(encoded)
    }

    pub(super) fn lease_lost(&self, key: &Key, fence: u64) -> Error {
        Error::LeaseLost { step: self.name.to_string(), key: key.short().to_string(), fence }
    }
}

/// What acquiring the key left a call to do.
#[allow(
    clippy::large_enum_variant,
    reason = "a local of one call, matched at once: boxing the lease would cost an allocation per call"
)]
pub(super) enum Begun<R> {
    /// The key is this call's: run the action under the lease.
    Run(Lease),
    /// The call is answered without running the action: a replay, or a refusal.
    Answered(R),
    /// The store failed and the step fails open: run the action unprotected.
    FailOpen,
}

/// What becomes of an action's result.
pub(super) enum Keep {
    /// Store these bytes as the operation's outcome.
    Store(Bytes),
    /// Release the key and return the result (an `Err` the step does not store).
    Release,
    /// Release the key, marked uncertain, and fail: the action ran, but its result cannot be
    /// stored.
    Fail(Error),
}

fn decode<T: DeserializeOwned, E: From<Error>>(
    step: &str,
    key: &Key,
    bytes: &[u8],
    decode_err: impl Fn(&[u8]) -> Result<E, ()>,
) -> Result<(T, Provenance), E> {
    let decode_error = |source| Error::Decode { step: step.to_owned(), key: key.short().to_string(), source };
    match crate::record::read_outcome(bytes) {
        Some(stored) if stored.ok => match serde_json::from_slice(stored.json) {
            Ok(value) => Ok((value, Provenance::Replayed { attempt: stored.attempt })),
            Err(e) => Err(decode_error(e).into()),
        },
        Some(stored) => match decode_err(stored.json) {
            Ok(e) => Err(e),
            Err(()) => Err(match serde_json::from_slice::<serde_json::Value>(stored.json) {
                Ok(_) => Error::Corrupt { key: key.short().to_string(), detail: "a stored error was found, but this call does not store errors; call it with the same store_errors setting, or bump the step version".into() },
                Err(e) => decode_error(e),
            }
            .into()),
        },
        None => Err(Error::Corrupt { key: key.short().to_string(), detail: "stored result has no outcome tag".into() }.into()),
    }
}
