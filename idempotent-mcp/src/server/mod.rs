//! [`IdempotentServer`]: exactly-once `tools/call` for a whole rmcp server.
//!
//! # What a protected call does
//!
//! The wrapper sits where the HTTP layer of `idempotent-tower` sits for a router: in front of
//! the server's handler, around every `tools/call`.
//!
//! - **The first call with a key runs the tool once.** Its `CallToolResult` is stored under the
//!   key, and the call gets it as the tool made it.
//! - **A retry with the same key gets the stored result**, with `_meta["dev.idempotent/replayed"]`
//!   set to `true` ([`meta::REPLAYED`](crate::meta::REPLAYED)); the tool does not run.
//! - **The same key with another tool or other arguments** is a JSON-RPC error, `-32602`, whose
//!   message says so; the tool does not run.
//! - **A call whose key is running** waits for that call's result (the default,
//!   [`OnInFlight::Wait`]) or, with [`on_in_flight(OnInFlight::Reject)`](IdempotentServer::on_in_flight),
//!   gets an error whose `data` says `retryable: true` and `retryAfterMs`.
//! - **A store that cannot be reached fails the call closed**: a `-32603` error with
//!   `retryable: true`, and the tool does not run. With
//!   [`fail_mode(FailMode::Open)`](IdempotentServer::fail_mode) the tool runs unprotected instead.
//!
//! Every refusal is an rmcp [`ErrorData`](rmcp::ErrorData) whose `data` carries `kind`
//! (`missingKey`, `invalidKey`, `mismatch`, `inFlight`, `unavailable`, ...), `retryable` and
//! `actionMayHaveRun`.
//!
//! # Where the key comes from
//!
//! - **From the call's `_meta`**, under [`meta::KEY`](crate::meta::KEY)
//!   (`"dev.idempotent/key"`), chosen by the client for one logical tool call and sent again with
//!   every retry of it. [`ToolCaller`](crate::client::ToolCaller) does that for rmcp clients.
//! - **Derived from the call**, for a tool that opts in with
//!   [`derive_key_for`](IdempotentServer::derive_key_for): a hash of the principal
//!   ([`tenant`](IdempotentServer::tenant)), the tool's name and the canonical JSON of its
//!   arguments. Two calls with the same arguments from one principal are then one operation for
//!   the [retention](IdempotentServer::retention): right for a tool whose arguments name the
//!   operation (`refund(order_id)`), wrong for one that may rightly run twice with the same
//!   arguments (`send_message("hello")`). A key in `_meta` takes precedence.
//!
//! **Never from the JSON-RPC request id or an LLM's tool-call id.** A JSON-RPC id is only unique
//! among the requests in flight on one connection: a client numbers its requests from 1 again
//! after reconnecting, and a host that retries sends a new id. An LLM's tool-call id changes when
//! the model plans the call again after an error, and some providers send none. Neither names the
//! operation, so neither can tell a retry from a new call.
//!
//! A call without a key runs unprotected, carrying [`Unprotected::NoKey`], unless the server
//! [requires a key](IdempotentServer::require_key): then it is refused (`missingKey`), as the
//! HTTP layer's `require_key(true)` refuses a request without `Idempotency-Key`.
//!
//! # Which tools are protected
//!
//! Every tool, except:
//! - tools whose annotations say `readOnlyHint: true`: they change nothing, so they pass through
//!   untouched, with or without a key;
//! - tools named in [`unprotected`](IdempotentServer::unprotected).
//!
//! A tool that is protected for every call (its key is derived, or the server requires keys) is
//! listed by `tools/list` with `idempotentHint: true`: a client may retry it freely.
//!
//! # What is stored
//!
//! - A `CallToolResult` is stored, including one with `isError: true` (the tool ran and reported
//!   a failure, such as a declined card: a retry gets the same answer). With
//!   [`store_tool_errors(false)`](IdempotentServer::store_tool_errors), such results are not
//!   stored and the key is given up, so that a retry runs the tool again.
//! - A JSON-RPC error from the tool (`Err(ErrorData)`) is not stored: the key is given up and a
//!   retry runs the tool again. A tool that failed after its side effect should return its
//!   result with `isError: true` instead.
//! - A tool that asks for input (`InputRequiredResult`) or answers with a task is not stored
//!   either: the call is not finished, and the key is given up.
//! - A tool that panics stores nothing and gives nothing up: the key stays taken until its lease
//!   runs out, and the next call with the key then runs as a
//!   [`recovered`](idempotent_core::Attempt::recovered) attempt, or is refused with
//!   `needsAttention` under [`on_recovered(OnRecovered::NeedsAttention)`](IdempotentServer::on_recovered).
//! - A result the store does not take (the store failed after the tool ran, or the call
//!   outlived its lease and another call took the key over), or one larger than
//!   [`max_result_bytes`](IdempotentServer::max_result_bytes), reaches the caller with
//!   `_meta["dev.idempotent/stored"]: false` ([`meta::STORED`](crate::meta::STORED)); a retry
//!   may run the tool again.
//!
//! # What the tool gets
//!
//! A protected call's tool finds in its request context's extensions (rmcp's
//! [`Extension`](rmcp::handler::server::tool::Extension) extractor):
//! - the call's [`Attempt`](idempotent_core::Attempt): its fence, whether it recovers from an
//!   attempt that ran out, whether its lease was lost, and the
//!   [`downstream_key`](idempotent_core::Attempt::downstream_key) to hand a payment provider;
//! - a [`RunContext`](idempotent_core::RunContext) keyed on the call (tenant, scope and key) on
//!   the server's store, so that the tool's own steps run once per call and a retry finds them;
//!   its steps take the server's [lease](IdempotentServer::lease),
//!   [retention](IdempotentServer::retention) and [fail mode](IdempotentServer::fail_mode)
//!   unless they set their own;
//! - the attempt is also [`current_attempt`](idempotent_core::current_attempt) for the tool's
//!   whole future, so that its state updates derive their tokens from the call's key.
//!
//! An unprotected call carries [`Unprotected`] saying why. It has no `Attempt` and, unless the
//! store was down under [`FailMode::Open`], no `RunContext`: rmcp's `Extension<Attempt>`
//! extractor refuses such a call (`-32602`, "missing extension") before the tool runs. A tool
//! that also serves unprotected calls (a read-only tool, a keyless call without
//! [`require_key`](IdempotentServer::require_key), a tool named
//! [`unprotected`](IdempotentServer::unprotected)) takes rmcp's
//! [`Extensions`](rmcp::model::Extensions) instead and looks the attempt up.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use idempotent_core::{
    DEFAULT_MAX_RESULT_BYTES, FailMode, IntoSharedStore, OnInFlight, OnRecovered, SharedStore, Terms,
};
use rmcp::service::RequestContext;
use rmcp::{RoleServer, ServerHandler};

mod call;
mod handler;
mod refusal;

type TenantFn = dyn Fn(&RequestContext<RoleServer>) -> Option<String> + Send + Sync;

/// The default [`scope`](IdempotentServer::scope): `"mcp"`.
pub const DEFAULT_SCOPE: &str = "mcp";

/// Why a call to a protected tool runs without protection: found in the tool's request
/// context's extensions (`Extension<Unprotected>`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Unprotected {
    /// The call carried no key and the tool derives none, and the server lets such calls
    /// through ([`require_key(false)`](IdempotentServer::require_key), the default). A retry of
    /// it runs again.
    NoKey,
    /// The store was unreachable and the server fails open
    /// ([`fail_mode(FailMode::Open)`](IdempotentServer::fail_mode)): the call carries its
    /// `RunContext` and an attempt that
    /// [`is_unprotected`](idempotent_core::Attempt::is_unprotected), but nothing records it.
    StoreUnavailable,
}

/// The configuration every clone of one [`IdempotentServer`] shares.
#[derive(Clone)]
pub(crate) struct Config {
    pub(crate) store: SharedStore,
    pub(crate) scope: String,
    pub(crate) require_key: bool,
    pub(crate) derived: HashSet<String>,
    pub(crate) unprotected: HashSet<String>,
    pub(crate) tenant: Option<Arc<TenantFn>>,
    pub(crate) terms: Terms,
    pub(crate) fail_mode: FailMode,
    pub(crate) on_recovered: OnRecovered,
    pub(crate) store_tool_errors: bool,
    pub(crate) max_result_bytes: usize,
}

/// An rmcp server whose `tools/call` runs each keyed call once: see the [module
/// docs](self) for what a call does.
///
/// Serve it as the handler itself would be served: `IdempotentServer` is an rmcp
/// [`ServerHandler`], so `serve`, `serve_server` and the streamable HTTP service take it. Every
/// request but `tools/call` (and the `idempotentHint`s of `tools/list`) goes to the handler
/// unchanged.
///
/// ```
/// use idempotent_core::{MemoryStore, OnInFlight};
/// use idempotent_mcp::IdempotentServer;
/// # #[derive(Clone)] struct Payments;
/// # impl rmcp::ServerHandler for Payments {}
///
/// let server = IdempotentServer::new(Payments, MemoryStore::new())
///     .require_key(true)
///     .derive_key_for("refund_order")
///     .on_in_flight(OnInFlight::Reject);
/// ```
pub struct IdempotentServer<S> {
    inner: S,
    config: Arc<Config>,
}

impl<S: Clone> Clone for IdempotentServer<S> {
    fn clone(&self) -> Self {
        IdempotentServer { inner: self.inner.clone(), config: self.config.clone() }
    }
}

impl<S> std::fmt::Debug for IdempotentServer<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotentServer")
            .field("store", &self.config.store.describe())
            .field("scope", &self.config.scope)
            .field("require_key", &self.config.require_key)
            .finish_non_exhaustive()
    }
}

impl<S: ServerHandler> IdempotentServer<S> {
    /// Protects `inner`'s tools with records in `store`: keys optional, a duplicate in flight
    /// waits ([`OnInFlight::default`]), the store's failure fails the call closed, results kept
    /// for [`DEFAULT_RETENTION`](idempotent_core::DEFAULT_RETENTION).
    pub fn new(inner: S, store: impl IntoSharedStore) -> Self {
        let config = Config {
            store: store.into_shared(),
            scope: DEFAULT_SCOPE.to_owned(),
            require_key: false,
            derived: HashSet::new(),
            unprotected: HashSet::new(),
            tenant: None,
            terms: Terms::default(),
            fail_mode: FailMode::default(),
            on_recovered: OnRecovered::default(),
            store_tool_errors: true,
            max_result_bytes: DEFAULT_MAX_RESULT_BYTES,
        };
        IdempotentServer { inner, config: Arc::new(config) }
    }

    /// The handler.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    fn config(&mut self) -> &mut Config {
        Arc::make_mut(&mut self.config)
    }

    /// Whether a call to a protected tool without a key (in `_meta`, or derived) is refused
    /// (`true`: a `-32602` error, `kind: "missingKey"`) or runs unprotected (`false`, the
    /// default: its tool gets [`Unprotected::NoKey`], and a retry of it runs again).
    pub fn require_key(mut self, require: bool) -> Self {
        self.config().require_key = require;
        self
    }

    /// Lets `tool` derive the key of a call that sends none: from the principal, the tool's name
    /// and its canonical arguments (see [the module docs](self#where-the-key-comes-from)).
    pub fn derive_key_for(mut self, tool: impl Into<String>) -> Self {
        self.config().derived.insert(tool.into());
        self
    }

    /// Lets every call to `tool` through untouched, as a read-only tool's are.
    pub fn unprotected(mut self, tool: impl Into<String>) -> Self {
        self.config().unprotected.insert(tool.into());
        self
    }

    /// Names the principal of a call, from its request context: every key is kept per principal,
    /// so two principals sending the same key never share a result, and a derived key is the
    /// principal's own.
    ///
    /// Over streamable HTTP, rmcp puts the request's `http::request::Parts` in the context's
    /// extensions; an authentication layer in front of the MCP service puts its principal in the
    /// `Parts`' extensions, and the closure reads it from there. Over stdio there is one client,
    /// and no tenant is needed.
    pub fn tenant<F>(mut self, tenant: F) -> Self
    where
        F: Fn(&RequestContext<RoleServer>) -> Option<String> + Send + Sync + 'static,
    {
        self.config().tenant = Some(Arc::new(tenant));
        self
    }

    /// The scope of the records, part of every key (default [`DEFAULT_SCOPE`]): two servers
    /// sharing a store keep apart when their scopes differ.
    pub fn scope(mut self, scope: impl Into<String>) -> Self {
        self.config().scope = scope.into();
        self
    }

    /// How long a call holds its key without renewing it (default
    /// [`DEFAULT_LEASE`](idempotent_core::DEFAULT_LEASE)), within
    /// [`MIN_LEASE`](idempotent_core::MIN_LEASE) ..= [`MAX_LEASE`](idempotent_core::MAX_LEASE):
    /// out of bounds, every protected call is refused (`-32603`, `kind: "config"`).
    ///
    /// It is renewed every third of it while the tool runs, so it bounds how long a key stays
    /// taken by a call that no longer runs (its server crashed, its tool panicked): a retry in
    /// that window waits or is refused as [`on_in_flight`](Self::on_in_flight) says, and the
    /// first retry after it runs the tool as a
    /// [`recovered`](idempotent_core::Attempt::recovered) attempt.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.config().terms.lease = lease;
        self
    }

    /// How long a result is kept and replayed (default
    /// [`DEFAULT_RETENTION`](idempotent_core::DEFAULT_RETENTION)), within
    /// [`MIN_RETENTION`](idempotent_core::MIN_RETENTION) ..=
    /// [`MAX_RETENTION`](idempotent_core::MAX_RETENTION): out of bounds, calls are refused as for
    /// [`lease`](Self::lease).
    pub fn retention(mut self, retention: Duration) -> Self {
        self.config().terms.retention = retention;
        self
    }

    /// What a call does while another call with its key runs: wait for that call's result (the
    /// default, [`OnInFlight::Wait`] for up to 30 s) or be refused at once with a retryable error
    /// ([`OnInFlight::Reject`]).
    pub fn on_in_flight(mut self, policy: OnInFlight) -> Self {
        self.config().terms.on_in_flight = policy;
        self
    }

    /// What a call does when the store cannot be reached: fail (the default,
    /// [`FailMode::Closed`]) or run the tool unprotected ([`FailMode::Open`]).
    pub fn fail_mode(mut self, mode: FailMode) -> Self {
        self.config().fail_mode = mode;
        self
    }

    /// What a call does when the previous call with its key ran out of its lease without a
    /// result: run the tool again (the default) or refuse (`needsAttention`) until an operator
    /// resolves the record.
    pub fn on_recovered(mut self, policy: OnRecovered) -> Self {
        self.config().on_recovered = policy;
        self
    }

    /// The largest result that is stored, as JSON (default
    /// [`DEFAULT_MAX_RESULT_BYTES`], the executor's
    /// cap): a larger one reaches the caller marked `_meta["dev.idempotent/stored"]: false`, and
    /// the key is given up, so that a retry runs the tool again.
    pub fn max_result_bytes(mut self, max: usize) -> Self {
        self.config().max_result_bytes = max;
        self
    }

    /// Whether a tool's result with `isError: true` is stored and replayed (`true`, the
    /// default) or the key is given up so that a retry runs the tool again (`false`).
    pub fn store_tool_errors(mut self, store: bool) -> Self {
        self.config().store_tool_errors = store;
        self
    }
}
