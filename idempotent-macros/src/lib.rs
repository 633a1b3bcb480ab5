//! `#[idempotent(step = "...")]`: every call of an `async fn` becomes an idempotent step of
//! [`idempotent_core`](https://docs.rs/idempotent-core).
//!
//! Use it through `idempotent_core::idempotent` (the core crate's default `macros` feature), so
//! that one dependency is enough. See [`macro@idempotent`] for the options.

#![deny(unreachable_pub)]
#![warn(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

use proc_macro::TokenStream;
use quote::ToTokens;

mod attr;
mod expand;
mod params;

/// The README's example is compiled and run as a doc test.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctest;

/// Makes every call of an `async fn` an idempotent step: the body runs at most once per
/// operation, and every later call (a retry, a duplicate) gets the first call's result.
///
/// ```
/// use idempotent_core::{idempotent, MemoryStore, RunContext};
///
/// #[idempotent(step = "issue_refund", retention = 86400)]
/// async fn issue_refund(ctx: &RunContext, order_id: &str, amount_cents: u64) -> Result<String, idempotent_core::Error> {
///     // Charge the payment provider here: this runs once per (run, order_id, amount_cents).
///     Ok(format!("re_{order_id}_{amount_cents}"))
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), idempotent_core::Error> {
/// let ctx = RunContext::new(MemoryStore::new(), "order-7");
/// let first = issue_refund(&ctx, "order-7", 1500).await?;
/// let retry = issue_refund(&ctx, "order-7", 1500).await?; // replayed, the body did not run
/// assert_eq!(first, retry);
/// # Ok(()) }
/// ```
///
/// # What the function needs
///
/// - It is an `async fn`: a free function, or a method taking `&self`, `&mut self` or `self`.
///   Its signature does not change, so callers don't either.
/// - It returns `Result<T, E>` (or an alias whose name ends in `Result`) where
///   `T: Serialize + DeserializeOwned` is the stored outcome and
///   `E: From<idempotent_core::Error>` carries the executor's own failures (store unreachable,
///   payload mismatch, another attempt in flight, ...).
/// - It has a **run context**: a parameter of type `RunContext` or `&RunContext` (found by its
///   type), the parameter named with `ctx = name`, or a field of the receiver named with
///   `ctx = self.ctx`. Its store holds the records and its run id (and tenant) is part of every
///   key; every retry of a run must use the same run id.
/// - Every other parameter is the **payload**, by name: `self` (see
///   [below](#self-is-not-part-of-the-key)), the context (and any other `RunContext`
///   parameter), the `transaction` parameter and the parameters listed in `skip(..)` are left
///   out. A destructured parameter (`Parameters(args): Parameters<RefundArgs>`,
///   `(x, y): (i32, i32)`, `Point { x, .. }: Point`) contributes the names its pattern binds,
///   each by its name (which `key(..)`, `skip(..)` and `ctx = name` can list); what the pattern
///   leaves out (`_`, `..`) is not part of the payload, and a pattern that binds no name is an
///   error. Payload parameters are serialized to canonical JSON and hashed into the key, so they
///   must implement `serde::Serialize`; forgetting to skip a client or a connection is a compile
///   error at that parameter. Their types must be concrete:
///   a generic or `impl Trait` parameter must be skipped, since its serialized form would depend
///   on the caller. (Generic parameters of an enclosing `impl` block are not visible to the
///   macro; they are accepted when they implement `Serialize`.)
///
/// # `self` is not part of the key
///
/// **Two receivers called with the same arguments share one key.** The macro leaves `self` out
/// of the payload (it is usually a client or a service, not data), so `alice.deposit(&ctx, 100)`
/// and `bob.deposit(&ctx, 100)` in the same run are one operation: the second call replays the
/// first one's result and its body never runs. When the receiver matters, pass what identifies
/// it as an argument (an `account_id`), which is then part of the payload (and can be named in
/// `key(..)`). Methods of different types already differ when their `step` names (or
/// `version`s) do.
///
/// ```
/// use idempotent_core::{idempotent, Error, MemoryStore, RunContext};
///
/// struct Account { id: String }
///
/// impl Account {
///     // Wrong: `self` is not in the payload, so every account shares the key of `amount`.
///     #[idempotent(step = "deposit")]
///     async fn deposit(&self, ctx: &RunContext, amount: u64) -> Result<String, Error> {
///         Ok(format!("{} +{amount}", self.id))
///     }
///
///     // Right: the account id is an argument, so it is part of the key.
///     #[idempotent(step = "deposit_to")]
///     async fn deposit_to(&self, ctx: &RunContext, account_id: &str, amount: u64) -> Result<String, Error> {
///         Ok(format!("{account_id} +{amount}"))
///     }
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Error> {
/// let ctx = RunContext::new(MemoryStore::new(), "payday");
/// let (alice, bob) = (Account { id: "alice".into() }, Account { id: "bob".into() });
/// assert_eq!(alice.deposit(&ctx, 100).await?, "alice +100");
/// assert_eq!(bob.deposit(&ctx, 100).await?, "alice +100"); // alice's result: bob's body never ran
/// assert_eq!(alice.deposit_to(&ctx, &alice.id, 100).await?, "alice +100");
/// assert_eq!(bob.deposit_to(&ctx, &bob.id, 100).await?, "bob +100");
/// # Ok(()) }
/// ```
///
/// # Options
///
/// | option | meaning | default |
/// |---|---|---|
/// | `step = "name"` | the step name, part of every key (required) | — |
/// | `retention = 86400` | seconds the result is kept and replayed (at most 10 years). `ttl = 86400` is its older name and means the same | the context's default (24 h) |
/// | `lease = 60` | seconds one attempt holds the key without renewing (renewed while the body runs; at most a day) | the context's default (60 s) |
/// | `key(a, b)` | key the operation on these parameters only; the rest of the payload is still fingerprinted | the whole payload |
/// | `skip(a, b)` | leave these parameters out of the payload | none |
/// | `version = 2` | part of the key: bumping it makes every operation of the step run afresh | 0 |
/// | `on_in_flight = "wait"` or `"reject"` | while another attempt runs: `"wait"` polls the store for up to 30 s and returns the other attempt's result once it is stored; it takes over (runs the body) only if the other attempt's lease runs out, or it frees the key, within those 30 s, and otherwise fails with `Error::InFlight`. `"reject"` fails with `Error::InFlight` at once | the context's default (wait) |
/// | `store_errors` | store and replay `Err` outcomes too (`E: Serialize + DeserializeOwned`); without it an `Err` frees the key so a retry runs the body again | off |
/// | `ctx = name` | the parameter that holds the `RunContext` (when its type is not spelled `RunContext`, e.g. an `Arc<RunContext>`), or a name bound inside a parameter's pattern (`Extension(ctx): Extension<RunContext>`), or rig's `&mut ToolContext` parameter (see [below](#with-rmcps-tool-and-rigs-rig_tool)) | the plain parameter typed `RunContext` |
/// | `ctx = self.ctx` | the field of the receiver that holds it (`self.ctx`, `self.inner.ctx`, `self.0`), of any type that derefs to `RunContext` (`RunContext`, `Arc<RunContext>`) | the parameter typed `RunContext` |
/// | `transaction = tx` | run the body in a transaction of the store's database that also stores the result (see [below](#transaction--tx-writes-that-commit-with-the-record)): `tx` names a parameter of type `&mut sqlx::SqliteTransaction<'_>` or `&mut sqlx::PgTransaction<'_>` (or `&mut sqlx::Transaction<'_, DB>`), which leaves the signature; callers do not pass it | no transaction |
/// | `verify = path` | an `async fn(Attempt) -> Result<Verdict<T>, E>` called instead of the body when the previous attempt's outcome is uncertain (see [below](#verify--path-when-the-previous-attempt-may-have-run)) | none |
/// | `on_recovered = "run"` or `"needs_attention"` | without a verifier, what an uncertain previous attempt leads to: run the body again, or run nothing and leave the record for a person (`Error::NeedsAttention`) | `"run"` |
/// | `crate = "path"` | where `idempotent_core` is, when the dependency is renamed | `::idempotent_core` |
///
/// Every misuse (a sync fn, a missing `step`, an option given twice or empty, an unknown option,
/// a `retention` or `lease` that is not a positive integer, `skip`/`key` naming a parameter that
/// does not exist, a `ctx` that is neither a parameter nor a field of `self`, no context, a return
/// type that is not a `Result`, a generic parameter in the payload, a pattern that binds no name,
/// a `transaction` that names no plain parameter or one that is not a `&mut` transaction,
/// `transaction` with `store_errors`) is a compile error at the offending token.
///
/// The upper bounds of `retention` and `lease` are the executor's, the same for every way of
/// running a step: one above them compiles, and each call fails with `Error::Config` (naming the
/// bound) before it touches the store or runs the body.
///
/// ## `key(..)`: identity from some arguments, the rest fingerprinted
///
/// A retry that changes another argument under the same identity is refused with
/// `Error::Mismatch` instead of replaying a result that was computed for other arguments.
///
/// ```
/// use idempotent_core::{idempotent, Error, MemoryStore, RunContext};
///
/// #[idempotent(step = "charge", key(order_id))]
/// async fn charge(ctx: &RunContext, order_id: String, amount_cents: u64) -> Result<u64, Error> {
///     Ok(amount_cents)
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let ctx = RunContext::new(MemoryStore::new(), "run-1");
/// assert_eq!(charge(&ctx, "o-1".into(), 1500).await.unwrap(), 1500);
/// let changed = charge(&ctx, "o-1".into(), 9900).await;
/// assert!(matches!(changed, Err(Error::Mismatch { .. })));
/// # }
/// ```
///
/// ## `skip(..)`, methods, `version`, `retention` and `lease`
///
/// ```
/// use idempotent_core::{idempotent, Error, MemoryStore, RunContext};
/// use std::sync::atomic::{AtomicU32, Ordering};
///
/// struct Mailer { sent: AtomicU32 }
///
/// impl Mailer {
///     // `self` is never part of the payload; `trace_id` is skipped so it does not change the key.
///     #[idempotent(step = "send_email", version = 2, retention = 3600, lease = 30, skip(trace_id))]
///     async fn send(&self, ctx: &RunContext, to: &str, trace_id: u128) -> Result<u32, Error> {
///         let _ = trace_id;
///         Ok(self.sent.fetch_add(1, Ordering::SeqCst) + 1)
///     }
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Error> {
/// let mailer = Mailer { sent: AtomicU32::new(0) };
/// let ctx = RunContext::new(MemoryStore::new(), "signup-42");
/// assert_eq!(mailer.send(&ctx, "ada@example.com", 1).await?, 1);
/// assert_eq!(mailer.send(&ctx, "ada@example.com", 2).await?, 1); // replayed
/// assert_eq!(mailer.sent.load(Ordering::SeqCst), 1);
/// # Ok(()) }
/// ```
///
/// ## `store_errors`: permanent failures are replayed too
///
/// ```
/// use idempotent_core::{idempotent, MemoryStore, RunContext};
/// use serde::{Deserialize, Serialize};
///
/// #[derive(Debug, PartialEq, Serialize, Deserialize)]
/// enum RefundError {
///     Declined(String),
///     Idempotency(String),
/// }
///
/// impl From<idempotent_core::Error> for RefundError {
///     fn from(e: idempotent_core::Error) -> Self {
///         RefundError::Idempotency(e.to_string())
///     }
/// }
///
/// #[idempotent(step = "refund", store_errors)]
/// async fn refund(ctx: &RunContext, card: &str) -> Result<String, RefundError> {
///     Err(RefundError::Declined(format!("card {card} is closed")))
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let ctx = RunContext::new(MemoryStore::new(), "run-9");
/// let first = refund(&ctx, "4242").await;
/// assert_eq!(refund(&ctx, "4242").await, first); // the decline is replayed, not retried
/// # }
/// ```
///
/// ## `on_in_flight`, `ctx = name` and `crate = "path"`
///
/// ```
/// use std::sync::Arc;
/// use idempotent_core::{idempotent, Error, MemoryStore, RunContext};
///
/// // A duplicate that arrives while the first call still runs fails at once with
/// // `Error::InFlight` (which carries a retry-after) instead of waiting for the result.
/// #[idempotent(step = "create_ticket", on_in_flight = "reject", ctx = run, crate = "::idempotent_core")]
/// async fn create_ticket(run: Arc<RunContext>, title: String) -> Result<String, Error> {
///     Ok(format!("T-{}", title.len()))
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Error> {
/// let run = Arc::new(RunContext::new(MemoryStore::new(), "run-3"));
/// assert_eq!(create_ticket(run.clone(), "disk full".into()).await?, "T-9");
/// # Ok(()) }
/// ```
///
/// ## `ctx = self.ctx`: the receiver holds the context
///
/// A service built for one run keeps its context in a field; the field is not part of the payload
/// (nothing of `self` is).
///
/// ```
/// use std::sync::Arc;
/// use idempotent_core::{idempotent, Error, MemoryStore, RunContext};
///
/// struct Payments { ctx: Arc<RunContext> }
///
/// impl Payments {
///     #[idempotent(step = "capture", ctx = self.ctx)]
///     async fn capture(&self, order_id: &str) -> Result<String, Error> {
///         Ok(format!("cap_{order_id}"))
///     }
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Error> {
/// let payments = Payments { ctx: Arc::new(RunContext::new(MemoryStore::new(), "run-4")) };
/// assert_eq!(payments.capture("o-1").await?, "cap_o-1");
/// # Ok(()) }
/// ```
///
/// ## `transaction = tx`: writes that commit with the record
///
/// With `transaction = tx`, the body runs inside a transaction that the step begins on its
/// store's database, and the step's result is written in that same transaction
/// (`Step::run_in_transaction`): the body's writes through `tx` and the `done` record commit
/// together, or neither does, so **the database effect happens exactly once**, even when the
/// process dies mid-body. The parameter `tx` is removed from the generated function: callers
/// pass the other arguments only, and the body sees the step's transaction under that name
/// (`&mut **tx` is the connection to execute on). Its type is `&mut sqlx::SqliteTransaction<'_>`,
/// `&mut sqlx::PgTransaction<'_>` or `&mut sqlx::Transaction<'_, DB>` (always `'_`): it names the
/// database, and the context's store must be that database's SQL store (a `SqliteStore` for
/// SQLite, a `PostgresStore` for PostgreSQL), or each call fails with `Error::Config`.
///
/// An `Err` from the body rolls the transaction back and frees the key, so a retry runs the
/// body again on a database without the failed attempt's writes (`store_errors` does not
/// combine with `transaction`). What the body does outside `tx` (an HTTP call, an email) is not
/// covered: it can run again on a retry after a crash or a failed commit; pass the attempt's
/// fence (`current_attempt()`) to such systems as their idempotency key. On SQLite the
/// transaction holds the file's write lock until it commits: keep the body short. On PostgreSQL
/// it holds a connection of the store's pool (the heartbeat renews the lease from another one
/// while the body runs), and the store's `statement_timeout` applies to the body's statements;
/// `Step::run_in_transaction` says more for each store.
///
/// ```
/// use idempotent_core::sqlx::{self, SqliteTransaction};
/// use idempotent_core::{idempotent, Error, RunContext, SqliteStore};
///
/// #[idempotent(step = "create_invoice", transaction = tx)]
/// async fn create_invoice(ctx: &RunContext, tx: &mut SqliteTransaction<'_>, order_id: &str, cents: i64) -> Result<i64, Error> {
///     let done = sqlx::query("INSERT INTO invoices (order_id, cents) VALUES (?1, ?2)")
///         .bind(order_id)
///         .bind(cents)
///         .execute(&mut **tx)
///         .await?; // a sqlx::Error is the body's own error, Error::Action
///     Ok(done.last_insert_rowid())
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Error> {
/// # let path = std::env::temp_dir().join(format!("idempotent-macro-doc-tx-{}.db", std::process::id()));
/// let store = SqliteStore::connect(&path).await?;
/// sqlx::query("CREATE TABLE IF NOT EXISTS invoices (order_id TEXT, cents INTEGER)")
///     .execute(store.pool())
///     .await?;
/// let ctx = RunContext::new(store.clone(), "order-7");
/// let id = create_invoice(&ctx, "order-7", 1500).await?; // no transaction to pass
/// assert_eq!(create_invoice(&ctx, "order-7", 1500).await?, id); // replayed, nothing inserted
/// let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM invoices").fetch_one(store.pool()).await?;
/// assert_eq!(rows, 1);
/// # store.close().await;
/// # for suffix in ["", "-wal", "-shm"] { let _ = std::fs::remove_file(format!("{}{suffix}", path.display())); }
/// # Ok(()) }
/// ```
///
/// ## `verify = path`: when the previous attempt may have run
///
/// An attempt is *recovered* when the one before it ended without an outcome the store could
/// keep: its worker died mid-body, or storing its result failed. Its side effect may have
/// happened. With `verify = find_charge`, the step calls `find_charge(attempt)` instead of the
/// body then, to ask the downstream system: `Verdict::Done(result)` stores that result without
/// running the body, `Verdict::NotDone` runs the body, `Verdict::Unknown` runs nothing and leaves
/// the record for a person (every call gets `Error::NeedsAttention` until it is resolved with
/// `Step::resolve_done` or `Step::resolve_not_done`). Send the attempt's `downstream_key()` with
/// the side effect (a provider's `Idempotency-Key`) and look it up by the same key. A fresh
/// attempt never calls the verifier.
///
/// ```
/// use idempotent_core::{current_attempt, idempotent, Attempt, Error, MemoryStore, RunContext, Verdict};
///
/// /// Asks the provider for a charge under the operation's downstream key.
/// async fn find_charge(attempt: Attempt) -> Result<Verdict<String>, Error> {
///     let _key = attempt.downstream_key();
///     Ok(Verdict::NotDone) // the provider has no charge under that key
/// }
///
/// #[idempotent(step = "charge", verify = find_charge)]
/// async fn charge(ctx: &RunContext, order_id: &str, amount: u64) -> Result<String, Error> {
///     let key = current_attempt().expect("inside a step").downstream_key();
///     // Send `key` as the provider's Idempotency-Key.
///     Ok(format!("ch_{}", &key.as_str()[..8]))
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Error> {
/// let ctx = RunContext::new(MemoryStore::new(), "order-7");
/// assert!(charge(&ctx, "order-7", 1500).await?.starts_with("ch_"));
/// # Ok(()) }
/// ```
///
/// `verify` does not combine with `transaction`: there, the record commits with the body's
/// writes, so a recovered attempt knows that they did not commit.
///
/// # Reaching the `Attempt` from the body
///
/// While the body runs, [`idempotent_core::current_attempt()`](https://docs.rs/idempotent-core)
/// returns its `Attempt`: the fencing token to hand to downstream systems that can reject a
/// stale writer, the attempt number, whether a previous attempt's lease ran out without an
/// outcome (`recovered`), and whether this attempt's lease was lost (`lease_lost`, `lost()`). It
/// returns `None` outside a step, and when the store was unreachable and the context's defaults
/// chose to fail open.
///
/// ```
/// use idempotent_core::{current_attempt, idempotent, Error, MemoryStore, RunContext};
///
/// #[idempotent(step = "write_row")]
/// async fn write_row(ctx: &RunContext, row: u32) -> Result<u64, Error> {
///     let attempt = current_attempt().expect("the body runs inside a step");
///     if attempt.recovered() {
///         // A previous attempt may have written the row: check before writing again.
///     }
///     Ok(attempt.fence()) // e.g. `UPDATE ... WHERE fence < $fence`
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Error> {
/// let ctx = RunContext::new(MemoryStore::new(), "run-5");
/// assert!(write_row(&ctx, 1).await? > 0);
/// # Ok(()) }
/// ```
///
/// # With rmcp's `#[tool]` and rig's `#[rig_tool]`
///
/// **rmcp**: write `#[idempotent(..)]` **above** `#[tool]`, on a `&self` method of a
/// `#[tool_router]` impl. `#[idempotent]` then expands first and leaves the `async fn`'s
/// signature, its doc comments (the tool's description when `#[tool]` has none) and its other
/// attributes, `#[tool]` included, in place and in order; `#[tool]` then boxes the future, which
/// is `Send` when the server type is `Send + Sync` and the arguments are `Send`. (Below
/// `#[tool]`, it would see the boxed future instead of an `async fn`: a compile error says to
/// move it.) `#[tool_router]` finds the tool as it would without `#[idempotent]`.
///
/// - The context: `Extension(ctx): Extension<RunContext>` with `ctx = ctx` (the server inserts
///   a `RunContext` into each request's extensions), or a field of the server with
///   `ctx = self.ctx`.
/// - The payload: the names the extractors' patterns bind, `args` in
///   `Parameters(args): Parameters<RefundArgs>` (so `RefundArgs: Serialize` as well as
///   `Deserialize + JsonSchema`), or the fields of `Parameters(RefundArgs { order_id, cents })`,
///   which `key(order_id)` can then key on.
/// - The error type: `rmcp::ErrorData`, which converts from `idempotent_core::Error` with
///   idempotent-core's `rmcp` feature. A mismatch becomes `-32602 Invalid params`.
/// - The outcome: `String`, `CallToolResult` or any other `Serialize + DeserializeOwned` type;
///   `Json<T>` (neither) is stored as its `T` and wrapped again on return, so `T` must be
///   `Serialize + DeserializeOwned` (and a `verify` function returns `Verdict<T>`).
///
/// ```
/// use idempotent_core::{idempotent, MemoryStore, RunContext};
/// use rmcp::handler::server::{tool::Extension, wrapper::Parameters};
/// use rmcp::{tool, tool_router, ErrorData};
///
/// #[derive(serde::Serialize, serde::Deserialize, rmcp::schemars::JsonSchema)]
/// #[schemars(crate = "rmcp::schemars")]
/// struct RefundArgs { order_id: String, cents: u64 }
///
/// struct Payments;
///
/// #[tool_router]
/// impl Payments {
///     /// Refunds an order once, however often the call is retried.
///     #[idempotent(step = "refund", ctx = ctx)]
///     #[tool]
///     async fn refund(
///         &self,
///         Parameters(args): Parameters<RefundArgs>,
///         Extension(ctx): Extension<RunContext>,
///     ) -> Result<String, ErrorData> {
///         Ok(format!("re_{}_{}", args.order_id, args.cents))
///     }
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), ErrorData> {
/// let tools = Payments::tool_router().list_all();
/// assert_eq!(tools[0].description.as_deref(), Some("Refunds an order once, however often the call is retried."));
/// let ctx = RunContext::new(MemoryStore::new(), "mcp-request-1");
/// let args = || Parameters(RefundArgs { order_id: "o-7".into(), cents: 1500 });
/// let first = Payments.refund(args(), Extension(ctx.clone())).await?;
/// assert_eq!(Payments.refund(args(), Extension(ctx)).await?, first); // replayed
/// # Ok(()) }
/// ```
///
/// **rig**: `#[idempotent(..)]` goes above or below `#[rig_tool]`; neither changes the signature
/// the other reads. rig calls the function with its `&mut ToolContext` and the model's
/// arguments, so the context is the `RunContext` the host attached to that `ToolContext` as a
/// scope, `ToolContext::default().with_scope(Arc::new(run_context))` (an `Arc<RunContext>`
/// exactly), and `ctx = tool_ctx` names the `ToolContext` parameter (a parameter whose type's
/// last segment is `ToolContext`; the call fails with `Error::Config` before anything runs
/// when no such scope is attached). The model's arguments are the payload; the error type is
/// any `E: From<idempotent_core::Error>` that rig accepts (`std::error::Error + Send + Sync`),
/// `idempotent_core::Error` itself included.
///
/// ```
/// use std::sync::Arc;
/// use idempotent_core::{idempotent, Error, MemoryStore, RunContext};
/// use rig_core::tool::{Tool, ToolContext};
///
/// /// Refunds an order.
/// #[idempotent(step = "refund", ctx = tool_ctx)]
/// #[rig_core::rig_tool]
/// async fn refund(tool_ctx: &mut rig_core::tool::ToolContext, order_id: String, cents: u64) -> Result<String, Error> {
///     Ok(format!("re_{order_id}_{cents}"))
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Error> {
/// let run = RunContext::new(MemoryStore::new(), "agent-turn-3");
/// let mut tool_ctx = ToolContext::default().with_scope(Arc::new(run));
/// let args = || RefundParameters { order_id: "o-7".into(), cents: 1500 };
/// let first = Refund.call(&mut tool_ctx, args()).await?;
/// assert_eq!(Refund.call(&mut tool_ctx, args()).await?, first); // replayed
/// # Ok(()) }
/// ```
///
/// # How it expands
///
/// The body becomes the step's action, wrapped in an `async move` block whose type is the
/// declared return type (so type errors in the body point at your signature). The generated code
/// clones the context, serializes each payload argument to canonical JSON, and calls
/// `Step::run` (or `run_storing_errors`) with the payload's digest; with `transaction = tx` it
/// calls `Step::run_in_transaction` with an async closure whose first parameter is `tx`, typed
/// as written. With a `Json<T>` outcome the action maps the body's `Ok(Json(t))` to `Ok(t)` and
/// the function maps the step's `Ok(t)` back to `Ok(Json(t))`, with the `Json` path as written. It names only `idempotent_core::__private` items, and `idempotent_core::Error` for
/// a `ToolContext` without a `RunContext` scope (or those under `crate = "path"`).
#[proc_macro_attribute]
pub fn idempotent(args: TokenStream, item: TokenStream) -> TokenStream {
    let original = proc_macro2::TokenStream::from(item.clone());
    let args = match syn::parse::<attr::Args>(args) {
        Ok(args) => args,
        Err(e) => return with_original(e, original),
    };
    let func = match syn::parse::<syn::ItemFn>(item) {
        Ok(func) => func,
        Err(_) => {
            let e = syn::Error::new_spanned(
                &original,
                "`#[idempotent]` goes on an `async fn` with a body (a free function or a method)",
            );
            return with_original(e, original);
        }
    };
    match expand::expand(args, func) {
        Ok(tokens) => tokens.into(),
        Err(e) => with_original(e, original),
    }
}

/// The error, and the item unchanged, so that a misused attribute does not also make every
/// caller fail to find the function. The context parameter is typically used only by the
/// expansion, so unused-variable warnings on the unexpanded item would be noise.
fn with_original(error: syn::Error, original: proc_macro2::TokenStream) -> TokenStream {
    let mut out = error.to_compile_error();
    quote::quote!(#[allow(unused_variables)]).to_tokens(&mut out);
    original.to_tokens(&mut out);
    out.into()
}
