//! Steps that commit with their record (`Step::run_in_transaction`, `#[idempotent(transaction =
//! ..)]`): the scenarios written once in `idempotent_tests::transaction`, on SQLite
//! (`sqlite::…`) and PostgreSQL (`postgres::…`), each on an empty database of its own; then the
//! SQLite-only ones, on files in temporary directories. The PostgreSQL-only ones are in
//! `transaction_postgres.rs`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;

use idempotent_core::sqlx::SqliteTransaction;
use idempotent_core::sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
use idempotent_core::{Error, RunContext, SqliteStore};
use idempotent_tests::matrix::{self, Database, Kind};
use idempotent_tests::sql::{SqlDb, SqliteBackend};
use idempotent_tests::transaction::*;
use tokio::sync::{Notify, Semaphore};

idempotent_tests::on_every_store!(
    sql: business_rows_and_the_done_record_commit_together_and_replay,
    an_action_error_rolls_back_its_writes_and_frees_the_key,
    a_database_error_in_the_step_is_the_actions_own,
    a_failed_commit_rolls_back_and_frees_the_key,
    concurrent_duplicates_insert_one_row,
    concurrent_duplicates_on_two_pools_insert_one_row,
    a_cancelled_call_rolls_back_and_the_retry_runs_at_once,
    a_process_killed_before_its_commit_leaves_nothing_and_the_retry_recovers,
    the_call_is_send_and_can_be_spawned,
    the_macro_commits_the_body_with_the_record_and_replays,
    a_step_whose_record_needs_attention_is_refused_and_its_action_not_called,
    a_store_of_another_kind_is_a_config_error,
    failing_open_runs_the_action_in_a_transaction_of_its_own,
    an_http_response_the_layer_could_not_store_is_rebuilt_without_writing_twice,
);

/// The scenario, with the child process of this test binary.
async fn a_process_killed_before_its_commit_leaves_nothing_and_the_retry_recovers<B: SqlDb>(database: Database<B>) {
    a_process_killed_before_its_commit(database, env!("CARGO_BIN_EXE_txn_child")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrapper_around_a_sqlite_store_is_a_config_error() {
    matrix::run(Kind::Sqlite, a_wrapper_around_the_store_is_a_config_error::<SqliteBackend>).await;
}

/// Holds the connection a pool hands out after `pass` more hand-outs, until released: lets a
/// test stop a step between its acquire and its `BEGIN IMMEDIATE`.
struct Gate {
    pass: AtomicU32,
    armed: AtomicBool,
    holding: Notify,
    open: Semaphore,
}

/// SQLite's transaction holds the file's write lock from its `BEGIN IMMEDIATE`, so the loser is
/// stopped before it (PostgreSQL's counterpart holds the loser's transaction open instead).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_taken_over_before_the_commit_rolls_the_loser_back() {
    let database = Database::<SqliteBackend>::start().await;
    let winner_store = setup(&database).await;

    // The loser's store is on a pool of one connection whose hand-outs the gate can hold.
    let gate = Arc::new(Gate {
        pass: AtomicU32::new(0),
        armed: AtomicBool::new(false),
        holding: Notify::new(),
        open: Semaphore::new(0),
    });
    let hook = gate.clone();
    let pool = SqlitePoolOptions::new()
        .max_connections(1)
        .before_acquire(move |_conn, _meta| {
            let gate = hook.clone();
            Box::pin(async move {
                if gate.armed.load(Ordering::SeqCst) && gate.pass.fetch_sub(1, Ordering::SeqCst) == 0 {
                    gate.armed.store(false, Ordering::SeqCst);
                    gate.holding.notify_one();
                    gate.open.acquire().await.unwrap().forget();
                }
                Ok(true)
            })
        })
        .connect_with(
            SqliteConnectOptions::new()
                .filename(database.dir.path().join(matrix::SQLITE_FILE))
                .journal_mode(SqliteJournalMode::Wal),
        )
        .await
        .unwrap();
    let loser_store = SqliteStore::from_pool(pool).await.unwrap();

    // The loser's acquire (its upsert, as a new store writes first) goes out on the store's
    // writes' connection, not a hand-out of the pool; its `begin`, the first hand-out, is held at
    // the gate.
    gate.pass.store(0, Ordering::SeqCst);
    gate.armed.store(true, Ordering::SeqCst);
    let loser_ctx = RunContext::new(loser_store.clone(), "order-9");
    let loser = tokio::spawn(async move {
        loser_ctx
            .step("create_invoice")
            .lease(Duration::from_millis(200))
            .heartbeat(false)
            .run_in_transaction(&"order-9", async |tx: &mut SqliteTransaction<'_>, attempt| {
                SqliteBackend::insert(tx, "loser", attempt.fence()).await?;
                Ok::<_, Error>(attempt.fence())
            })
            .await
    });
    gate.holding.notified().await;
    assert_eq!(record_state(&winner_store).await.as_deref(), Some("running"), "the loser holds the key");

    // Another attempt waits for the loser's lease to run out, takes the key over and commits.
    let winner_fence = take_over_and_commit(winner_store.clone()).await;

    gate.open.add_permits(1);
    assert_the_loser_rolled_back(&winner_store, loser.await.unwrap(), winner_fence).await;
}
