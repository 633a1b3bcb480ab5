//! The crate's error type.

use std::time::Duration;

use crate::canonical::CanonicalError;

#[cfg(feature = "rmcp")]
mod rmcp;

/// A boxed error from a store's driver.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Everything that can go wrong in a step call or a store operation.
///
/// Messages say what happened and what to do. [`Error::action_may_have_run`] tells whether the
/// side effect may have happened, which matters when deciding to alert rather than retry.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The payload has no canonical JSON form, so no key can be made; the action was not run.
    #[error("step `{step}`: {source}; the action was not run")]
    Payload {
        /// The step.
        step: String,
        /// Why the payload was refused.
        #[source]
        source: CanonicalError,
    },

    /// The key was used before with a different payload.
    #[error(
        "step `{step}` (key {key}): this operation was first called with a different payload; the \
         action was not run. Use a new run id or step version for a different operation, or retry \
         with the original payload"
    )]
    Mismatch {
        /// The step.
        step: String,
        /// Short hash of the key.
        key: String,
    },

    /// Another caller holds the lease on this key and has not finished.
    #[error(
        "step `{step}` (key {key}): another attempt is still running; the action was not run. \
         Retry with your backoff: a retry gets that attempt's outcome once it finishes (its lease \
         runs out within {} at the latest, and a retry after that runs the action if it left none)",
        whole_ms(*.retry_after)
    )]
    InFlight {
        /// The step.
        step: String,
        /// Short hash of the key.
        key: String,
        /// When the current holder's lease runs out at the latest: a bound on how long the key
        /// can stay taken, not a delay to wait before retrying (the holder usually finishes much
        /// sooner).
        retry_after: Duration,
    },

    /// The lease ran out and another attempt took over, so this attempt's result was not stored.
    #[error(
        "step `{step}` (key {key}): the lease (fence {fence}) was lost before the result could be \
         stored — the action ran for longer than its lease and another attempt may have taken over. \
         Raise the lease, or make the action check `Attempt::lease_lost`; downstream systems can \
         reject this attempt's writes by its fence"
    )]
    LeaseLost {
        /// The step.
        step: String,
        /// Short hash of the key.
        key: String,
        /// The fencing token this attempt held.
        fence: u64,
    },

    /// A previous attempt could not tell whether the action ran (its verifier answered
    /// "unknown", or the step refuses to re-run a recovered attempt blindly), so the operation
    /// waits for a person: nothing was run, and nothing will be until the record is resolved.
    #[error(
        "step `{step}` (key {key}): attempt {attempt} (fence {fence}) could not tell whether the action \
         ran, so the operation needs attention and nothing was run. Check the downstream system for \
         the operation's downstream key {downstream_key}, then resolve the record: as done with the \
         result it had (`Step::resolve_done`) or as not done, so that the next call runs it \
         (`Step::resolve_not_done`)"
    )]
    NeedsAttention {
        /// The step.
        step: String,
        /// Short hash of the key.
        key: String,
        /// The attempt that left the record needing attention.
        attempt: u32,
        /// That attempt's fence.
        fence: u64,
        /// The operation's [`DownstreamKey`](crate::DownstreamKey), to look the effect up by.
        downstream_key: String,
        /// The record's whole key (64 hex digits; a hash, as `key` is), to resolve it by
        /// ([`Store::resolve`](crate::Store::resolve)).
        record_key: String,
    },

    /// A step's verifier did not answer within its timeout; the record was left as it was (the
    /// next call verifies again).
    #[error(
        "step `{step}` (key {key}): the verifier did not answer within {after:?}; nothing was run and \
         the record was left for the next call to verify again. Raise the step's verify_timeout, or \
         make the verifier answer `Verdict::Unknown` when it cannot tell"
    )]
    VerifyTimeout {
        /// The step.
        step: String,
        /// Short hash of the key.
        key: String,
        /// The timeout that passed.
        after: Duration,
    },

    /// The store could not be reached or answered with an error.
    #[error("store {store} failed during {op}: {reason}{}", after_note(op))]
    Unavailable {
        /// Which store (a URL without credentials, or "memory").
        store: String,
        /// The operation: acquire, complete, release or renew; for the SQL stores also open,
        /// migrate and purge, and for steps in a transaction begin, complete_in and commit.
        op: &'static str,
        /// What went wrong.
        reason: String,
        /// The driver's error, when there is one.
        #[source]
        source: Option<BoxError>,
    },

    /// The store did not answer in time.
    #[error("store {store} did not answer {op} within {after:?}{}", after_note(op))]
    Timeout {
        /// Which store.
        store: String,
        /// The operation.
        op: &'static str,
        /// The timeout that passed.
        after: Duration,
    },

    /// A stored record could not be read: it is not one this crate wrote.
    #[error(
        "the record for key {key} is corrupt ({detail}); it was not replayed. Delete the key \
         from the store (it is named by the key's hex digest) after checking who wrote it"
    )]
    Corrupt {
        /// Short hash of the key.
        key: String,
        /// What was wrong.
        detail: String,
    },

    /// The action's result could not be encoded for storage.
    #[error("step `{step}`: the result could not be encoded as JSON ({source}); it was not stored")]
    Encode {
        /// The step.
        step: String,
        /// The serializer's error.
        #[source]
        source: serde_json::Error,
    },

    /// A stored result could not be decoded into the step's result type.
    #[error(
        "step `{step}` (key {key}): the stored result does not decode into the step's result \
         type ({source}); if the type changed, bump the step version"
    )]
    Decode {
        /// The step.
        step: String,
        /// Short hash of the key.
        key: String,
        /// The deserializer's error.
        #[source]
        source: serde_json::Error,
    },

    /// The store is at its configured capacity.
    #[error(
        "store {store} is full ({capacity} records); the action was not run. Raise its capacity or lower the \
         retention, and resolve the records that need attention (they are kept until resolved)"
    )]
    Full {
        /// Which store.
        store: String,
        /// The configured capacity.
        capacity: usize,
    },

    /// The action's encoded result is larger than the step's `max_result_bytes`; it was not
    /// stored and the key was released, marked uncertain: the next attempt is
    /// [`recovered`](crate::Attempt::recovered), and runs the action again unless the step has a
    /// verifier or stops for a person ([`OnRecovered`](crate::OnRecovered)).
    #[error(
        "step `{step}`: the action ran but its result ({size} bytes encoded) is larger than the \
         {max}-byte cap, so it was not stored and a retry will run the action again; return less \
         (store the bulk elsewhere and return a reference) or raise max_result_bytes"
    )]
    ResultTooLarge {
        /// The step.
        step: String,
        /// The encoded size.
        size: usize,
        /// The cap.
        max: usize,
    },

    /// The store's server is set up so that it may lose records (it evicts them, or persists
    /// nothing), and the application did not accept that risk; from a store's preflight check.
    #[error("store {store} may lose records, which breaks the exactly-once guarantee: {detail}")]
    UnsafeStore {
        /// Which store.
        store: String,
        /// Each setting found, its value, and how to fix it or accept the risk.
        detail: String,
    },

    /// A state update ([`State::update`](crate::state::State::update)) did not commit within
    /// its bounds: each time, another writer committed first.
    #[error(
        "state {scope}: the update did not commit after {attempts} attempts in {elapsed:?}: another writer \
         committed first each time, and nothing of this update was committed. Retry later, raise the bounds \
         (UpdatePolicy::attempts, UpdatePolicy::max_elapsed), or split the state so that fewer writers share \
         one scope"
    )]
    Contention {
        /// The state's scope (`tenant/name`).
        scope: String,
        /// How many load, reduce and commit rounds the update made.
        attempts: u32,
        /// How long it tried.
        elapsed: Duration,
    },

    /// A state update's reducer returned an error; nothing was committed.
    #[error("state {scope}: the reducer failed ({source}); nothing was committed and the state is as it was")]
    Reducer {
        /// The state's scope (`tenant/name`).
        scope: String,
        /// The reducer's error.
        #[source]
        source: BoxError,
    },

    /// A state's value could not be encoded, or the stored value does not decode into the
    /// handle's type.
    #[error("state {scope}: {detail}")]
    StateValue {
        /// The state's scope (`tenant/name`).
        scope: String,
        /// What was wrong, and what to do.
        detail: String,
    },

    /// A commit of this update failed on the way (its reply was lost), and so many other commits
    /// have landed since that the store's history of commit tokens no longer tells whether it
    /// was applied; the update stopped rather than risk applying its delta twice.
    #[error(
        "state {scope}: a commit of this update on version {from} may have been applied, but the state is at \
         version {current} now, further than the {history} commit tokens the store keeps, so it cannot tell; \
         nothing more was committed. Check the state and apply the update by hand if it is missing"
    )]
    StateUncertain {
        /// The state's scope (`tenant/name`).
        scope: String,
        /// The version the uncertain commit expected.
        from: u64,
        /// The version found afterwards.
        current: u64,
        /// How many commit tokens the store keeps per scope.
        history: u64,
    },

    /// A state update ([`State::update`](crate::state::State::update) and the methods built on
    /// it) gave up after a commit whose answer never came (the store failed on the way, or the
    /// commit landed and reading the value back failed): the update **may have been applied**.
    ///
    /// Retry it under the same token, which applies it at most once:
    /// `update_with_token(&error.commit_token().unwrap(), reducer)` (or, inside a step or a
    /// request covered by `idempotent-tower`'s layer, run the step or the request again: its
    /// updates derive the same tokens). A retry through `update` or `modify` outside a step
    /// draws a new token, and may apply the update a second time: so this error is
    /// [transient](Error::is_transient) only when the token is one a retry derives again
    /// (`retry_derives_token`).
    #[error(
        "state {scope}: the update's commit got no answer ({source}), so it may have been applied. {}",
        if *retry_derives_token {
            "Retrying the same update (the step, or the request) is safe: it commits under the same token, and \
             applies the update at most once"
        } else {
            "Retry it with update_with_token(&error.commit_token(), ..), which applies it at most once; \
             calling update or modify again outside a step draws a new token and may apply it twice"
        }
    )]
    CommitUnanswered {
        /// The state's scope (`tenant/name`).
        scope: String,
        /// The update's commit token: the one to retry it under.
        token: crate::state::token::CommitToken,
        /// Whether a retry of the same call derives the same token (the update ran inside a
        /// step or a covered request, or its token was given), rather than drawing a new one.
        retry_derives_token: bool,
        /// The store's error.
        #[source]
        source: Box<Error>,
    },

    /// A configuration value was invalid.
    #[error("invalid configuration: {0}")]
    Config(String),

    /// The action's own error, in a step whose error type is this one: a database error inside
    /// [`Step::run_in_transaction`](crate::Step::run_in_transaction) (`?` on a `sqlx::Error`
    /// converts into it, with the `sqlite` or `postgres` feature), or any error an action wraps
    /// with [`Error::action`]. Like every `Err` of an action it is not stored: the key is released
    /// (a transactional step's writes roll back), and the next call runs the action again. It is
    /// not [transient](Self::is_transient) (retrying is the application's decision: look at the
    /// source), and [`action_may_have_run`](Self::action_may_have_run) is true, as the action did.
    ///
    /// As `Error` converts from more than itself, an action whose error type nothing names needs
    /// it written: `Ok::<_, Error>(value)`, as the examples do.
    #[error("the action failed: {0}")]
    Action(#[source] BoxError),
}

impl Error {
    /// The action's own error `source`, as [`Error::Action`].
    pub fn action(source: impl Into<BoxError>) -> Error {
        Error::Action(source.into())
    }
}

/// `?` on a `sqlx::Error` inside an action ([`Step::run_in_transaction`](crate::Step::run_in_transaction))
/// whose error type is [`Error`]: the action's own error, [`Error::Action`].
#[cfg(any(feature = "sqlite", feature = "postgres"))]
impl From<sqlx::Error> for Error {
    fn from(source: sqlx::Error) -> Error {
        Error::Action(Box::new(source))
    }
}

/// A duration as whole milliseconds, rounded up (`60000 ms`), for messages: `Debug` prints
/// nanoseconds (`59.999862455s`).
fn whole_ms(d: Duration) -> String {
    format!("{} ms", d.as_nanos().div_ceil(1_000_000))
}

fn after_note(op: &str) -> &'static str {
    match op {
        "acquire" => "; the action was not run (fail closed). Retry later, or opt into fail-open",
        "complete" => {
            "; the action ran but its result was not stored, so the key stays locked until its lease \
             runs out and a retry may run the action again"
        }
        "begin" => "; the action was not run, and the key was released",
        "complete_in" => {
            "; the action ran, but its transaction was rolled back and the key released, so a retry runs \
             it again on a database without its writes"
        }
        "commit" => {
            "; the key was released: the transaction was rolled back, so a retry runs the action again on \
             a database without its writes (or, if only the reply was lost, it committed together with \
             the step's record, and a retry replays its result)"
        }
        _ => "",
    }
}

impl Error {
    /// The error of a call on `key` whose record needs attention since `attempt` (with `fence`).
    pub(crate) fn needs_attention(step: &str, key: &crate::Key, attempt: u32, fence: u64) -> Error {
        Error::NeedsAttention {
            step: step.to_owned(),
            key: key.short().to_string(),
            attempt,
            fence,
            downstream_key: crate::DownstreamKey::of(key).to_string(),
            record_key: key.to_hex(),
        }
    }

    /// The commit token of a state update that may have been applied
    /// ([`Error::CommitUnanswered`]): retry the update under it with `update_with_token`.
    pub fn commit_token(&self) -> Option<crate::state::token::CommitToken> {
        match self {
            Error::CommitUnanswered { token, .. } => Some(*token),
            _ => None,
        }
    }

    /// How long the error's condition can last at the latest, when the error says: for
    /// [`InFlight`](Self::InFlight), until the holder's lease runs out. A retry policy may wait
    /// less (the holder usually finishes sooner); it should not wait more.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            Error::InFlight { retry_after, .. } => Some(*retry_after),
            _ => None,
        }
    }

    /// Whether the error is about the store rather than the operation (unreachable, slow, full).
    pub fn is_store_failure(&self) -> bool {
        matches!(self, Error::Unavailable { .. } | Error::Timeout { .. } | Error::Full { .. })
    }

    /// Whether the side effect may have happened although the call failed.
    ///
    /// For [`Step::run_in_transaction`](crate::Step::run_in_transaction) this is about the
    /// action having run at all: its database writes were rolled back (a failed `commit` may,
    /// if only its reply was lost, have committed them together with the step's record), but
    /// what it did outside the database happened.
    pub fn action_may_have_run(&self) -> bool {
        matches!(
            self,
            Error::LeaseLost { .. }
                | Error::Encode { .. }
                | Error::ResultTooLarge { .. }
                | Error::Unavailable { op: "complete" | "complete_in" | "commit", .. }
                | Error::Timeout { op: "complete" | "complete_in" | "commit", .. }
                | Error::CommitUnanswered { .. }
                | Error::StateUncertain { .. }
                | Error::Action(_)
        )
    }
}

impl Error {
    /// Whether calling the step again, unchanged, may succeed: the condition passes by itself.
    ///
    /// | variant | transient | a retry of the same call |
    /// |---|---|---|
    /// | `Unavailable`, `Timeout` | yes | reaches the store once it is back |
    /// | `InFlight` | yes | gets the running attempt's outcome once it finishes (back off as usual: [`retry_after`](Self::retry_after) is the longest the key can stay taken, not a delay to wait) |
    /// | `LeaseLost` | yes | replays the outcome of the attempt that took over, or takes the key over itself |
    /// | `VerifyTimeout` | yes | verifies again (the record was left for the next call) |
    /// | `Contention` | yes | loads, reduces and commits again (a step's state update commits under the same token) |
    /// | `CommitUnanswered` | when a retry derives the same token (inside a step or a covered request, or a token given) | replays the commit that may have landed, or applies it once; outside a step, retry with `update_with_token` ([`commit_token`](Self::commit_token)) |
    /// | `NeedsAttention` | no | is refused the same way until a person resolves the record |
    /// | `Payload`, `Mismatch`, `Corrupt`, `Encode`, `Decode`, `ResultTooLarge`, `Full`, `UnsafeStore`, `Config`, `Reducer`, `StateValue`, `StateUncertain` | no | fails the same way: the payload, the stored record, the result or the setup must change first |
    ///
    /// Every retry goes through the key, so a retry of a transient failure never runs a
    /// completed action again. (A transient failure may still have left the action run without
    /// a stored result, see [`action_may_have_run`](Self::action_may_have_run); a later attempt
    /// then runs it again under a higher fence, as after any lost lease.) Variants added later
    /// are not transient unless documented here.
    ///
    /// Transient is not "nothing ran": after `LeaseLost`, or an `Unavailable`/`Timeout` of
    /// `complete`, the action may have run ([`action_may_have_run`](Self::action_may_have_run)),
    /// and a retry of a step without a verifier runs it again (recovered, under a higher fence).
    /// Give steps whose effect must not repeat a verifier ([`Step::verify`](crate::Step::verify))
    /// or [`OnRecovered::NeedsAttention`](crate::OnRecovered::NeedsAttention) before retrying them
    /// on every transient error.
    ///
    /// With `backon`, retrying a step or an `#[idempotent]` tool is one line:
    /// `tool.retry(backoff).when(|e: &Error| e.is_transient())`. A tool whose error type is its
    /// own (it needs `From<idempotent_core::Error>`) delegates:
    ///
    /// ```
    /// #[derive(Debug)]
    /// enum ToolError {
    ///     Store(idempotent_core::Error),
    ///     Declined(String),
    /// }
    ///
    /// impl From<idempotent_core::Error> for ToolError {
    ///     fn from(e: idempotent_core::Error) -> Self {
    ///         ToolError::Store(e)
    ///     }
    /// }
    ///
    /// impl ToolError {
    ///     fn is_transient(&self) -> bool {
    ///         matches!(self, ToolError::Store(e) if e.is_transient())
    ///     }
    /// }
    ///
    /// let busy = idempotent_core::Error::InFlight {
    ///     step: "charge".into(),
    ///     key: "3fa1c2".into(),
    ///     retry_after: std::time::Duration::from_secs(1),
    /// };
    /// assert!(ToolError::from(busy).is_transient());
    /// assert!(!ToolError::Declined("card expired".into()).is_transient());
    /// ```
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            Error::Unavailable { .. }
                | Error::Timeout { .. }
                | Error::InFlight { .. }
                | Error::LeaseLost { .. }
                | Error::VerifyTimeout { .. }
                | Error::Contention { .. }
                | Error::CommitUnanswered { retry_derives_token: true, .. }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The lease left is a bound, not a delay: the message says to back off, and prints the bound
    /// in whole milliseconds rather than `59.999862455s`.
    #[test]
    fn in_flight_says_to_back_off_and_bounds_the_wait() {
        let busy = Error::InFlight {
            step: "charge".into(),
            key: "3fa1c2".into(),
            retry_after: Duration::from_nanos(59_999_862_455),
        };
        let text = busy.to_string();
        assert!(text.contains("Retry with your backoff"), "{text}");
        assert!(text.contains("within 60000 ms at the latest"), "{text}");
        assert!(!text.contains("59.99"), "{text}");
    }
}
