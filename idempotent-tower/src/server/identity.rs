//! What a covered request's handler gets from the layer: the request's identity, so that
//! everything the handler does runs under it.
//!
//! For a request that runs under its key, the layer puts two values in the request's extensions
//! and one in scope for the handler's whole future:
//!
//! - a [`RunContext`] keyed on (tenant, [scope](super::IdempotencyLayer::scope), client key), on
//!   the layer's store: the handler's steps ([`RunContext::step`]) derive their keys from it, so
//!   two tenants sending the same `Idempotency-Key` never share a step's record, and a retry of
//!   the request finds the steps of its first attempt. For a step whose writes commit with its
//!   record on another store (the handler's own database),
//!   [`RunContext::store`] keeps the identity.
//! - the request's [`Attempt`](idempotent_core::Attempt): its fence, its
//!   [`downstream_key`](idempotent_core::Attempt::downstream_key), whether it recovers from an
//!   attempt that ran out, whether its lease was lost.
//! - the same attempt as [`current_attempt`](idempotent_core::current_attempt) while the
//!   handler's future runs: its state commits
//!   ([`State::update`](idempotent_core::state::State::update)) derive their tokens from the
//!   request's key, so a request retried after a lost response replays them instead of applying
//!   them again (while the scope's commit history still holds their tokens: see the bound in
//!   [`idempotent_core::state`]).
//!
//! A covered request that runs without protection carries [`Unprotected`] saying why.

use idempotent_core::{Key, RunContext};

use super::config::Config;

/// Why a request that the layer covers runs without protection: found in its extensions (in
/// axum, `Option<Extension<Unprotected>>`; in tonic, `request.extensions().get::<Unprotected>()`).
///
/// Requests the layer does not cover (a method outside
/// [`methods`](super::IdempotencyLayer::methods)), and requests an outer layer already took the
/// key for, carry nothing of this layer's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Unprotected {
    /// The request carried no key, and the layer lets such requests through
    /// ([`require_key(false)`](super::IdempotencyLayer::require_key), the default): it has no
    /// [`RunContext`] and no `Attempt`. A retry of it runs again.
    NoKey,
    /// The store was unreachable and the layer fails open
    /// ([`fail_mode(FailMode::Open)`](super::IdempotencyLayer::fail_mode)): the request still
    /// carries its [`RunContext`], and an `Attempt` that
    /// [`is_unprotected`](idempotent_core::Attempt::is_unprotected) (fence 0), but no record
    /// guards it, and its response is not stored.
    StoreUnavailable,
}

/// The run context of the request keyed `key` (the layer's record key, a hash of tenant, scope
/// and client key): its run id names the request's record rather than the client's key, which
/// is never stored or logged.
pub(crate) fn run_context(config: &Config, key: &Key, tenant: Option<&str>) -> RunContext {
    let ctx = RunContext::new(config.store.clone(), format!("{}/{}", config.scope, key.to_hex()));
    match tenant {
        Some(tenant) => ctx.tenant(tenant),
        None => ctx,
    }
}
