//! Steps that commit with their record (`Step::run_in_transaction`, `#[idempotent(transaction =
//! ..)]`), written once for SQLite and PostgreSQL: the business rows and the `done` record commit
//! together or not at all, whatever fails, whoever races, and wherever the process dies.
//!
//! Each scenario is generic over the backend ([`SqlDb`]) and takes an empty [`Database`];
//! `tests/tests/transaction.rs` runs them on both (`on_every_store!(sql: …)`), and keeps the
//! SQLite-only ones; `tests/tests/transaction_postgres.rs` has the PostgreSQL-only ones, which
//! use what this module exports too: the business table and its reads, the action's error
//! type, and the child process killed inside its transaction (`src/bin/txn_child.rs`).

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, to_bytes};
use axum::extract::{Extension, State};
use axum::http::{Request, StatusCode};
use axum::routing::post;
use idempotent_core::store::sql::SqlStore;
use idempotent_core::{Error, FailMode, IntoSharedStore, MemoryStore, OnInFlight, RunContext, Step, idempotent};
use idempotent_tower::server::{IDEMPOTENT_STORED, IdempotencyLayer};
use sqlx::Transaction;
use tokio::io::AsyncBufReadExt;
use tokio::sync::Notify;
use tower::ServiceExt;

use crate::HookedStore;
use crate::matrix::{Database, Kind};
use crate::sql::{SqlDb, db, pooled, wait_for_count};

/// An action's own error type, with the idempotency errors wrapped (as an application's would).
#[derive(Debug)]
pub enum InvoiceError {
    /// The business failure the action returns.
    Declined,
    /// A failure of the step itself.
    Idempotency(#[allow(dead_code, reason = "shown by Debug when a test fails")] Error),
}

impl From<Error> for InvoiceError {
    fn from(e: Error) -> Self {
        InvoiceError::Idempotency(e)
    }
}

/// Creates the business table `invoices (id, order_id, fence)` next to `store`'s records.
pub async fn create_invoices<B: SqlDb>(store: &SqlStore<B>) {
    B::exec(&mut *pooled(store).await, B::CREATE_INVOICES).await.expect("create the invoices' table");
}

/// A store on the database, with the business table.
pub async fn setup<B: SqlDb>(database: &Database<B>) -> SqlStore<B> {
    let store = database.open().await;
    create_invoices(&store).await;
    store
}

/// The invoices, in insertion order.
pub async fn invoices<B: SqlDb>(store: &SqlStore<B>) -> Vec<(String, i64)> {
    B::invoices(&mut *pooled(store).await).await
}

/// The committed state of the one record in the store's table, if there is one.
pub async fn record_state<B: SqlDb>(store: &SqlStore<B>) -> Option<String> {
    B::record_state(&mut *pooled(store).await).await
}

/// Another attempt at `order-9` on `store` (another store than the one that holds the key)
/// waits for the holder's lease to run out, takes the key over and commits; answers its fence.
pub async fn take_over_and_commit<B: SqlDb>(store: SqlStore<B>) -> u64 {
    RunContext::new(store, "order-9")
        .step("create_invoice")
        .on_in_flight(OnInFlight::Wait { timeout: Duration::from_secs(30) })
        .run_in_transaction(&"order-9", async |tx: &mut Transaction<'_, B::Db>, attempt| {
            assert!(attempt.recovered(), "the loser's lease ran out without an outcome");
            B::insert(tx, "winner", attempt.fence()).await?;
            Ok::<_, Error>(attempt.fence())
        })
        .await
        .unwrap()
}

/// The loser of a take-over (its call answered `lost`) stored nothing and its insert was rolled
/// back; the winner's invoice and `done` record are committed.
pub async fn assert_the_loser_rolled_back<B: SqlDb>(store: &SqlStore<B>, lost: Result<u64, Error>, winner_fence: u64) {
    let Err(Error::LeaseLost { fence, .. }) = lost else { panic!("the loser stored its outcome: {lost:?}") };
    assert!(fence < winner_fence, "the winner's fence {winner_fence} is above the loser's {fence}");
    assert_eq!(invoices(store).await, [("winner".to_owned(), winner_fence as i64)]);
    assert_eq!(record_state(store).await.as_deref(), Some("done"));
}

/// Runs `txn_child <url> <lease_ms>` (pass `env!("CARGO_BIN_EXE_txn_child")` as `exe`), waits
/// until it has inserted its invoice inside the step's transaction, SIGKILLs it there (before
/// the commit), and returns the fence it inserted under.
pub async fn kill_child_before_commit(exe: &str, url: &str, lease_ms: u64) -> u64 {
    let mut child = tokio::process::Command::new(exe)
        .arg(url)
        .arg(lease_ms.to_string())
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("{exe} did not start: {e}"));
    let mut lines = tokio::io::BufReader::new(child.stdout.take().expect("piped stdout")).lines();
    let line = lines.next_line().await.unwrap().expect("the child printed its insert");
    let fence: u64 = line.strip_prefix("inserted ").expect(&line).parse().unwrap();
    // SIGKILL: between the business insert and the commit.
    child.start_kill().unwrap();
    let status = child.wait().await.unwrap();
    assert!(!status.success(), "the child was killed, yet exited with {status}");
    fence
}

/// The retry of `step` on the payload `order_id` after a first attempt that released the key
/// (`released`: how), with the action's error type `E`: it runs at once, as attempt 2, not
/// recovered, and inserts the invoice; answers its fence.
async fn the_retry_runs_as_attempt_2<B: SqlDb, E: From<Error> + std::fmt::Debug>(
    step: Step<'_>,
    order_id: &str,
    released: &str,
) -> u64 {
    step.run_in_transaction(&order_id, async |tx: &mut Transaction<'_, B::Db>, attempt| {
        assert_eq!(attempt.number(), 2);
        assert!(!attempt.recovered(), "{released}");
        B::insert(tx, order_id, attempt.fence()).await?;
        Ok::<_, E>(attempt.fence())
    })
    .await
    .unwrap()
}

/// Scenario: three calls of one step, through a shared handle; one run, one invoice, replays.
pub async fn business_rows_and_the_done_record_commit_together_and_replay<B: SqlDb>(database: Database<B>) {
    let store = setup(&database).await;
    // Through a shared handle: the executor finds the store behind the `Arc<dyn Store>`.
    let ctx = RunContext::new(store.clone().into_shared(), "order-7");
    let runs = AtomicU32::new(0);
    let before = store.statements();
    for _call in 0..3 {
        let fence: u64 = ctx
            .step("create_invoice")
            .run_in_transaction(&("order-7", 1500), async |tx: &mut Transaction<'_, B::Db>, attempt| {
                runs.fetch_add(1, Ordering::SeqCst);
                assert_eq!(idempotent_core::current_attempt().as_ref(), Some(&attempt));
                if B::MATRIX == Kind::Postgres {
                    // The transaction is on the store's pool: its statement_timeout (the store's
                    // timeout, 5 s by default) applies to the action's statements too.
                    assert_eq!(B::strings(&mut **tx, "SHOW statement_timeout").await, ["5s"]);
                }
                B::insert(tx, "order-7", attempt.fence()).await?;
                Ok::<_, Error>(attempt.fence())
            })
            .await
            .unwrap();
        assert_eq!(invoices(&store).await, [("order-7".to_owned(), fence as i64)]);
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the later calls replayed");
    assert_eq!(record_state(&store).await.as_deref(), Some("done"));
    // Acquire and complete (in the transaction) for the first call, one acquire for each replay.
    assert_eq!((before, store.statements()), (0, 4));
}

/// Scenario: an action's error rolls its insert back and releases the key; the retry commits.
pub async fn an_action_error_rolls_back_its_writes_and_frees_the_key<B: SqlDb>(database: Database<B>) {
    let store = setup(&database).await;
    let ctx = RunContext::new(store.clone(), "order-8");
    let step = || ctx.step("create_invoice");
    let failed: Result<u64, InvoiceError> = step()
        .run_in_transaction(&"order-8", async |tx: &mut Transaction<'_, B::Db>, attempt| {
            B::insert(tx, "order-8", attempt.fence()).await?;
            Err(InvoiceError::Declined)
        })
        .await;
    assert!(matches!(failed, Err(InvoiceError::Declined)), "{failed:?}");
    assert_eq!(invoices(&store).await, []);
    assert_eq!(record_state(&store).await.as_deref(), Some("released"));

    let fence =
        the_retry_runs_as_attempt_2::<B, InvoiceError>(step(), "order-8", "the first attempt released the key").await;
    assert_eq!(invoices(&store).await, [("order-8".to_owned(), fence as i64)]);
    assert_eq!(record_state(&store).await.as_deref(), Some("done"));
}

/// Scenario: `?` on a database error inside the step makes it the action's own error
/// (`Error::Action`, the `sqlx::Error` its source): the step's insert rolls back, the key is
/// released, and the retry commits.
pub async fn a_database_error_in_the_step_is_the_actions_own<B: SqlDb>(database: Database<B>) {
    let store = setup(&database).await;
    let ctx = RunContext::new(store.clone(), "order-12");
    let step = || ctx.step("create_invoice");
    let failed: Result<u64, Error> = step()
        .run_in_transaction(&"order-12", async |tx: &mut Transaction<'_, B::Db>, attempt| {
            B::insert(tx, "order-12", attempt.fence()).await?;
            B::exec(&mut **tx, "INSERT INTO no_such_table VALUES (1)").await?;
            Ok(attempt.fence())
        })
        .await;
    let error = failed.expect_err("an insert into a missing table fails");
    assert!(matches!(error, Error::Action(_)), "{error:?}");
    assert!(error.action_may_have_run() && !error.is_transient(), "{error}");
    let source = std::error::Error::source(&error).expect("the database's error");
    assert!(source.downcast_ref::<sqlx::Error>().is_some(), "{source:?}");
    assert_eq!(invoices(&store).await, []);
    assert_eq!(record_state(&store).await.as_deref(), Some("released"));

    let fence = the_retry_runs_as_attempt_2::<B, Error>(step(), "order-12", "the first attempt released the key").await;
    assert_eq!(invoices(&store).await, [("order-12".to_owned(), fence as i64)]);
}

/// Scenario: a deferred foreign key fails the commit; the key is released, and the retry (once
/// the customer exists) commits as the second attempt.
pub async fn a_failed_commit_rolls_back_and_frees_the_key<B: SqlDb>(database: Database<B>) {
    let store = setup(&database).await;
    let tables = "CREATE TABLE customers (id bigint PRIMARY KEY);\n\
                  CREATE TABLE orders (id text NOT NULL, customer bigint NOT NULL\n\
                    REFERENCES customers(id) DEFERRABLE INITIALLY DEFERRED)";
    B::exec(&mut *pooled(&store).await, tables).await.unwrap();
    let ctx = RunContext::new(store.clone(), "order-10");
    let place = || {
        ctx.step("place_order").run_in_transaction(&"order-10", async |tx: &mut Transaction<'_, B::Db>, attempt| {
            // Customer 42 does not exist: the deferred foreign key fails the commit, not this insert.
            B::exec(&mut **tx, "INSERT INTO orders (id, customer) VALUES ('order-10', 42)").await.map_err(db)?;
            Ok::<_, Error>(attempt.number())
        })
    };
    let failed = place().await;
    let Err(e @ Error::Unavailable { op: "commit", .. }) = failed else { panic!("{failed:?}") };
    assert!(e.to_string().contains(B::FOREIGN_KEY_VIOLATION), "{e}");
    assert!(e.to_string().contains("the key was released"), "{e}");
    let orders = async || B::count(&mut *pooled(&store).await, "SELECT count(*) FROM orders").await;
    assert_eq!(orders().await, 0);
    assert_eq!(record_state(&store).await.as_deref(), Some("released"));

    B::exec(&mut *pooled(&store).await, "INSERT INTO customers (id) VALUES (42)").await.unwrap();
    assert_eq!(place().await.unwrap(), 2, "the retry ran as the second attempt");
    assert_eq!(orders().await, 1);
    assert_eq!(record_state(&store).await.as_deref(), Some("done"));
}

/// `tasks` duplicates at once, task `t` on `stores[t % n]`: one run, one invoice, one fence.
async fn duplicates_insert_one_row<B: SqlDb>(stores: &[SqlStore<B>], tasks: usize) {
    let runs = Arc::new(AtomicU32::new(0));
    let mut calls = Vec::new();
    for i in 0..tasks {
        let ctx = RunContext::new(stores[i % stores.len()].clone(), "order-11");
        let runs = runs.clone();
        calls.push(tokio::spawn(async move {
            ctx.step("create_invoice")
                .run_in_transaction(&"order-11", async |tx: &mut Transaction<'_, B::Db>, attempt| {
                    runs.fetch_add(1, Ordering::SeqCst);
                    B::insert(tx, "order-11", attempt.fence()).await?;
                    Ok::<_, Error>(attempt.fence())
                })
                .await
        }));
    }
    let mut fences = Vec::new();
    for call in calls {
        fences.push(call.await.unwrap().unwrap());
    }
    assert!(fences.iter().all(|&f| f == fences[0]), "every caller got the first result: {fences:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(invoices(&stores[0]).await, [("order-11".to_owned(), fences[0] as i64)]);
}

/// Scenario: 16 duplicates at once on one store.
pub async fn concurrent_duplicates_insert_one_row<B: SqlDb>(database: Database<B>) {
    duplicates_insert_one_row(&[setup(&database).await], 16).await;
}

/// Scenario: 32 duplicates at once on two stores (two pools).
pub async fn concurrent_duplicates_on_two_pools_insert_one_row<B: SqlDb>(database: Database<B>) {
    let store = setup(&database).await;
    duplicates_insert_one_row(&[store, database.open().await], 32).await;
}

/// Scenario: a call dropped in its action rolls back, and the retry runs at once as attempt 2.
pub async fn a_cancelled_call_rolls_back_and_the_retry_runs_at_once<B: SqlDb>(database: Database<B>) {
    let store = setup(&database).await;
    let ctx = RunContext::new(store.clone(), "order-12");
    let inserted = Notify::new();
    let call =
        ctx.step("create_invoice").run_in_transaction(&"order-12", async |tx: &mut Transaction<'_, B::Db>, attempt| {
            B::insert(tx, "order-12", attempt.fence()).await?;
            inserted.notify_one();
            std::future::pending::<()>().await;
            Ok::<_, Error>(attempt.fence())
        });
    tokio::select! {
        out = call => panic!("the action never returns, yet the call ended with {out:?}"),
        () = inserted.notified() => {}
    }
    // The call was dropped mid-action: its transaction rolled back.
    assert_eq!(invoices(&store).await, []);
    if B::MATRIX == Kind::Postgres {
        // A task of its own releases the key.
        let released = "SELECT count(*) FROM idempotent_records WHERE state = 'released'";
        wait_for_count::<B>(&mut database.connect().await, released, 1).await;
    }

    let step = ctx.step("create_invoice");
    let fence = the_retry_runs_as_attempt_2::<B, Error>(step, "order-12", "the cancelled call released the key").await;
    assert_eq!(invoices(&store).await, [("order-12".to_owned(), fence as i64)]);
}

/// Scenario (`exe` is `txn_child`): a process killed between its insert and its commit leaves
/// no invoice and a running record; the retry recovers the key with a higher fence.
pub async fn a_process_killed_before_its_commit<B: SqlDb>(database: Database<B>, exe: &str) {
    let store = setup(&database).await;
    let child_fence = kill_child_before_commit(exe, &database.url, 300).await;
    assert_eq!(invoices(&store).await, []);
    assert_eq!(record_state(&store).await.as_deref(), Some("running"), "no done record: the key is the dead child's");

    let ctx = RunContext::new(store.clone(), "crash-run");
    let fence = ctx
        .step("create_invoice")
        .run_in_transaction(&"order-1", async |tx: &mut Transaction<'_, B::Db>, attempt| {
            assert!(attempt.recovered(), "the child's lease ran out without an outcome");
            B::insert(tx, "order-1", attempt.fence()).await?;
            Ok::<_, Error>(attempt.fence())
        })
        .await
        .unwrap();
    assert!(fence > child_fence);
    assert_eq!(invoices(&store).await, [("order-1".to_owned(), fence as i64)]);
    assert_eq!(record_state(&store).await.as_deref(), Some("done"));
}

/// Scenario: the call is `Send`, and runs in a spawned task.
pub async fn the_call_is_send_and_can_be_spawned<B: SqlDb>(database: Database<B>) {
    let store = setup(&database).await;
    let ctx = RunContext::new(store.clone(), "order-14");
    let call = tokio::spawn(async move {
        ctx.step("create_invoice")
            .run_in_transaction(&"order-14".to_owned(), async |tx: &mut Transaction<'_, B::Db>, attempt| {
                B::insert(tx, "order-14", attempt.fence()).await?;
                tokio::task::yield_now().await;
                Ok::<_, Error>(attempt.fence())
            })
            .await
    });
    let fence = call.await.unwrap().unwrap();
    assert_eq!(invoices(&store).await, [("order-14".to_owned(), fence as i64)]);
}

#[idempotent(step = "create_invoice", transaction = tx)]
async fn create_invoice<B: SqlDb>(
    ctx: &RunContext,
    tx: &mut Transaction<'_, B::Db>,
    order_id: &str,
) -> Result<u64, Error> {
    let fence = idempotent_core::current_attempt().expect("inside a step").fence();
    B::insert(tx, order_id, fence).await?;
    Ok(fence)
}

/// Scenario: `#[idempotent(transaction = tx)]` commits its body with the record, and replays.
pub async fn the_macro_commits_the_body_with_the_record_and_replays<B: SqlDb>(database: Database<B>) {
    let store = setup(&database).await;
    let ctx = RunContext::new(store.clone(), "order-15");
    let first = create_invoice::<B>(&ctx, "order-15").await.unwrap();
    let again = create_invoice::<B>(&ctx, "order-15").await.unwrap();
    assert_eq!(first, again);
    assert_eq!(invoices(&store).await, [("order-15".to_owned(), first as i64)]);
    // The generated function's future is Send too.
    let spawned = tokio::spawn(async move { create_invoice::<B>(&ctx, "order-16").await }).await.unwrap().unwrap();
    assert!(spawned > 0);
    assert_eq!(invoices(&store).await.len(), 2);
}

/// Scenario: a step whose record needs attention is refused before its transaction begins: the
/// action is not called and nothing is written; resolved as not done, the next call runs it. A
/// completion in a transaction by an attempt that was marked (uncertain, or needing attention)
/// is refused.
pub async fn a_step_whose_record_needs_attention_is_refused_and_its_action_not_called<B: SqlDb>(database: Database<B>) {
    use idempotent_core::record::{Abandon, Acquire, Resolved, Transition};
    use idempotent_core::store::TransactionalStore;
    use idempotent_core::{Key, Store};
    let (lease, keep) = (Duration::from_secs(10), Duration::from_secs(60));
    let store = setup(&database).await;
    let ctx = RunContext::new(store.clone(), "order-9");
    let payload = ("order-9", 900);
    let (key, fp) = ctx.step("create_invoice").key_for(&payload).unwrap();
    let Acquire::Acquired(first) = store.acquire(&key, &fp, lease, keep).await.unwrap() else { panic!("taken") };
    assert_eq!(store.abandon(&key, &first.token, Abandon::NeedsAttention).await.unwrap(), Transition::Ok);
    let runs = AtomicU32::new(0);
    let call = || {
        ctx.step("create_invoice").run_in_transaction(&payload, async |tx: &mut Transaction<'_, B::Db>, attempt| {
            runs.fetch_add(1, Ordering::SeqCst);
            B::insert(tx, "order-9", attempt.fence()).await?;
            Ok::<_, Error>(attempt.fence())
        })
    };
    let err = call().await.unwrap_err();
    assert!(
        matches!(err, Error::NeedsAttention { attempt: 1, fence, .. } if fence == first.attempt.fence()),
        "{err:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 0, "the action was called");
    assert_eq!(invoices(&store).await, []);
    assert_eq!(record_state(&store).await.as_deref(), Some("needs_attention"));
    assert_eq!(ctx.step("create_invoice").resolve_not_done(&payload).await.unwrap(), Resolved::Ok);
    let fence = call().await.unwrap();
    assert!(fence > first.attempt.fence());
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(invoices(&store).await, [("order-9".to_owned(), fence as i64)]);

    for (n, mark) in [Abandon::Uncertain, Abandon::NeedsAttention].into_iter().enumerate() {
        let key = Key::from_bytes([n as u8 + 1; 32]);
        let Acquire::Acquired(grant) = store.acquire(&key, &fp, lease, keep).await.unwrap() else { panic!("taken") };
        assert_eq!(store.abandon(&key, &grant.token, mark).await.unwrap(), Transition::Ok);
        let mut tx = store.begin().await.unwrap();
        let late = bytes::Bytes::from_static(b"late");
        assert_eq!(store.complete_in(&mut tx, &key, &grant.token, late, keep).await.unwrap(), Transition::LeaseLost);
        tx.commit().await.unwrap();
        match (mark, store.acquire(&key, &fp, lease, keep).await.unwrap()) {
            (Abandon::Uncertain, Acquire::Acquired(next)) => assert!(next.attempt.recovered(), "{mark:?}"),
            (Abandon::NeedsAttention, Acquire::NeedsAttention { attempt: 1, .. }) => {}
            (mark, other) => panic!("{mark:?}: then acquire answered {other:?}"),
        }
    }
}

/// Scenario: a transaction of this database with a run context on another kind of store is a
/// configuration error naming both, and the action is not called.
pub async fn a_store_of_another_kind_is_a_config_error<B: SqlDb>(_: Database<B>) {
    let ctx = RunContext::new(MemoryStore::new(), "order-13");
    let runs = AtomicU32::new(0);
    let out = ctx
        .step("create_invoice")
        .run_in_transaction(&"order-13", async |_tx: &mut Transaction<'_, B::Db>, _| {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok::<_, Error>(0)
        })
        .await;
    let Err(Error::Config(message)) = out else { panic!("{out:?}") };
    assert!(message.contains("step `create_invoice`"), "{message}");
    assert!(message.contains(&format!("needs the run context's store to be a {}", B::STORE_NAME)), "{message}");
    assert!(message.contains("but it is memory"), "{message}");
    assert_eq!(runs.load(Ordering::SeqCst), 0);
}

/// A run context on a wrapper around the database's store is a configuration error (the store
/// itself is needed), and nothing is written.
pub async fn a_wrapper_around_the_store_is_a_config_error<B: SqlDb>(database: Database<B>) {
    let store = setup(&database).await;
    let wrapped = HookedStore::new(store.clone().into_shared()).describe_as(|inner| format!("hooked {inner}"));
    let ctx = RunContext::new(wrapped, "order-13");
    let out = ctx
        .step("create_invoice")
        .run_in_transaction(&"order-13", async |tx: &mut Transaction<'_, B::Db>, attempt| {
            B::insert(tx, "order-13", attempt.fence()).await?;
            Ok::<_, Error>(0)
        })
        .await;
    let Err(Error::Config(message)) = out else { panic!("{out:?}") };
    assert!(message.contains(&format!("but it is hooked {}", B::SCHEME)), "{message}");
    assert!(message.contains("not a wrapper around it"), "{message}");
    assert_eq!(invoices(&store).await, []);
}

/// Scenario: with the records' table gone, `FailMode::Closed` refuses the step and
/// `FailMode::Open` runs the action unprotected, in a transaction of its own.
pub async fn failing_open_runs_the_action_in_a_transaction_of_its_own<B: SqlDb>(database: Database<B>) {
    let store = setup(&database).await;
    // The records' table is gone: every acquire fails (a store failure), while the database
    // still takes the action's writes.
    B::exec(&mut *pooled(&store).await, "DROP TABLE idempotent_records").await.unwrap();
    let ctx = RunContext::new(store.clone(), "order-17");
    let call = |mode| {
        ctx.step("create_invoice").fail_mode(mode).run_in_transaction(
            &"order-17",
            async |tx: &mut Transaction<'_, B::Db>, attempt| {
                assert!(attempt.is_unprotected());
                B::insert(tx, "order-17", attempt.fence()).await?;
                Ok::<_, Error>(attempt.fence())
            },
        )
    };
    let closed = call(FailMode::Closed).await;
    assert!(matches!(closed, Err(Error::Unavailable { op: "acquire", .. })), "{closed:?}");
    assert_eq!(invoices(&store).await, []);
    assert_eq!(call(FailMode::Open).await.unwrap(), 0, "the unprotected attempt's fence is 0");
    assert_eq!(invoices(&store).await, [("order-17".to_owned(), 0)]);
}

/// A handler whose database write is a step in the request's run context, as the layer's docs
/// say (on the database's store: the layer's is a wrapper around it).
async fn create_invoice_handler<B: SqlDb>(
    State((db, runs)): State<(SqlStore<B>, Arc<AtomicU32>)>,
    Extension(ctx): Extension<RunContext>,
    order: String,
) -> (StatusCode, String) {
    runs.fetch_add(1, Ordering::SeqCst);
    let invoice = ctx
        .store(db.clone())
        .step("create_invoice")
        .run_in_transaction(&order, async |tx: &mut Transaction<'_, B::Db>, attempt| {
            B::insert(tx, &order, attempt.fence()).await?;
            Ok::<_, Error>(attempt.fence())
        })
        .await;
    match invoice {
        Ok(fence) => (StatusCode::CREATED, format!("invoice {fence}")),
        Err(e) => (StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
    }
}

/// Scenario: the layer fails to store a response whose handler committed its step; the retry
/// runs the handler again, whose step replays the invoice instead of inserting a second one.
pub async fn an_http_response_the_layer_could_not_store_is_rebuilt_without_writing_twice<B: SqlDb>(
    database: Database<B>,
) {
    let store = setup(&database).await;
    // The layer's store (on the same database) fails to store the first response, as if the
    // server had died between the handler's commit and the layer's `complete`.
    let layer_store = HookedStore::with_state(store.clone().into_shared(), AtomicU32::new(1)).on_complete(|call| {
        Box::pin(async move {
            if call.store.state().swap(0, Ordering::SeqCst) == 1 {
                return Err(Error::Unavailable {
                    store: "test".into(),
                    op: "complete",
                    reason: "injected".into(),
                    source: None,
                });
            }
            call.forward().await
        })
    });
    let runs = Arc::new(AtomicU32::new(0));
    let app = Router::new()
        .route("/invoices", post(create_invoice_handler::<B>))
        .with_state((store.clone(), runs.clone()))
        .layer(
            IdempotencyLayer::new(layer_store)
                .lease(Duration::from_millis(300))
                .on_in_flight(OnInFlight::Wait { timeout: Duration::from_secs(30) }),
        );
    let request = |key: &'static str| {
        Request::post("/invoices").header("idempotency-key", key).body(Body::from("order-20")).unwrap()
    };
    let body = |res: axum::response::Response| async move {
        String::from_utf8(to_bytes(res.into_body(), 1 << 20).await.unwrap().to_vec()).unwrap()
    };

    let first = app.clone().oneshot(request("\"k-20\"")).await.unwrap();
    assert_eq!(first.status(), 201);
    assert_eq!(first.headers()[IDEMPOTENT_STORED], "false");
    let first = body(first).await;

    // The same key, bare: once the layer's lease has run out, the handler runs again, and its
    // step replays the invoice instead of inserting a second one.
    let retry = app.clone().oneshot(request("k-20")).await.unwrap();
    assert_eq!(retry.status(), 201);
    assert!(!retry.headers().contains_key(IDEMPOTENT_STORED), "the rebuilt response was stored");
    assert_eq!(body(retry).await, first);
    assert_eq!(runs.load(Ordering::SeqCst), 2);

    let replayed = app.clone().oneshot(request("k-20")).await.unwrap();
    assert_eq!(replayed.headers()["idempotent-replayed"], "true");
    assert_eq!(body(replayed).await, first);
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    let fence: i64 = first.strip_prefix("invoice ").unwrap().parse().unwrap();
    assert_eq!(invoices(&store).await, [("order-20".to_owned(), fence)]);
}
