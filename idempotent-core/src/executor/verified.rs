//! A step with a verifier: [`Step::verify`] turns a [`Step`] into a [`Verified`] one.

use std::future::Future;

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::{Provenance, Step};
use crate::attempt::Attempt;
use crate::error::Error;
use crate::verify::Verdict;

/// A step with a verifier ([`Step::verify`]): run it as a [`Step`].
#[must_use = "a step does nothing until `run` is awaited"]
pub struct Verified<'c, V> {
    pub(super) step: Step<'c>,
    pub(super) verifier: V,
}

impl<V> std::fmt::Debug for Verified<'_, V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Verified").field("step", &self.step).finish_non_exhaustive()
    }
}

impl<V> Verified<'_, V> {
    /// [`Step::run`], calling the verifier instead of the action when the previous attempt's
    /// outcome is uncertain.
    pub async fn run<P, T, E, VFut, F, Fut>(self, payload: &P, action: F) -> Result<T, E>
    where
        P: Serialize + ?Sized,
        T: Serialize + DeserializeOwned,
        E: From<Error>,
        V: FnOnce(Attempt) -> VFut,
        VFut: Future<Output = Result<Verdict<T>, E>>,
        F: FnOnce(Attempt) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        self.step.execute(payload, Some(self.verifier), action, |_: &E| None, |_| Err(())).await.map(|(value, _)| value)
    }

    /// [`Step::run_traced`], calling the verifier instead of the action when the previous
    /// attempt's outcome is uncertain (a result the verifier found is
    /// [`Provenance::Executed`] by this call's attempt).
    pub async fn run_traced<P, T, E, VFut, F, Fut>(self, payload: &P, action: F) -> Result<(T, Provenance), E>
    where
        P: Serialize + ?Sized,
        T: Serialize + DeserializeOwned,
        E: From<Error>,
        V: FnOnce(Attempt) -> VFut,
        VFut: Future<Output = Result<Verdict<T>, E>>,
        F: FnOnce(Attempt) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        self.step.execute(payload, Some(self.verifier), action, |_: &E| None, |_| Err(())).await
    }

    /// [`Step::run_storing_errors`], calling the verifier instead of the action when the
    /// previous attempt's outcome is uncertain.
    pub async fn run_storing_errors<P, T, E, VFut, F, Fut>(self, payload: &P, action: F) -> Result<T, E>
    where
        P: Serialize + ?Sized,
        T: Serialize + DeserializeOwned,
        E: From<Error> + Serialize + DeserializeOwned,
        V: FnOnce(Attempt) -> VFut,
        VFut: Future<Output = Result<Verdict<T>, E>>,
        F: FnOnce(Attempt) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        self.step
            .execute(
                payload,
                Some(self.verifier),
                action,
                |e: &E| Some(serde_json::to_vec(e)),
                |bytes| serde_json::from_slice::<E>(bytes).map_err(|_| ()),
            )
            .await
            .map(|(value, _)| value)
    }
}
