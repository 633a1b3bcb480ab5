//! `PostgresStore` through PgBouncer in transaction pooling mode (`pool_mode = transaction`,
//! few server connections, so that consecutive transactions of one client land on different
//! ones): the conformance suite, the state suite, the SQL stores' scenarios
//! (`sql_store::…`, `transaction::…`, on the matrix's `PgBouncer` databases) and steps in
//! transactions, on stores with `transaction_pooling(true)`; and what goes wrong without it.

use std::sync::Arc;

use idempotent_core::sqlx::PgTransaction;
use idempotent_core::{Error, PostgresStore, RunContext, SharedStore};
use idempotent_tests::sql_store::*;
use idempotent_tests::transaction::*;
use idempotent_tests::{PgBouncer, PgServer, conformance};

idempotent_tests::on_every_store!(@store sql_store PgBouncer [idempotent_tests::sql::PostgresBackend]
    one_key_under_64_tasks_on_4_pools_runs_the_action_once,
    two_hundred_keys_by_eight_callers_run_200_actions,
    purge_never_removes_a_record_that_needs_attention,
    an_incompatible_table_is_refused_and_left_alone,
    a_table_name_that_is_not_an_identifier_is_refused
);

idempotent_tests::on_every_store!(@store transaction PgBouncer [idempotent_tests::sql::PostgresBackend]
    business_rows_and_the_done_record_commit_together_and_replay,
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
    an_http_response_the_layer_could_not_store_is_rebuilt_without_writing_twice
);

/// The scenario, with the child process of this test binary.
async fn a_process_killed_before_its_commit_leaves_nothing_and_the_retry_recovers<B: idempotent_tests::sql::SqlDb>(
    database: idempotent_tests::matrix::Database<B>,
) {
    a_process_killed_before_its_commit(database, env!("CARGO_BIN_EXE_txn_child")).await;
}

/// A server, PgBouncer in front of it, and the URL of a new database through it.
async fn setup(database: &str) -> (PgServer, PgBouncer, String) {
    let server = PgServer::start();
    let mut conn = server.connection().await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {database}"))).execute(&mut conn).await.unwrap();
    let bouncer = PgBouncer::start(&server);
    let url = bouncer.url(database);
    (server, bouncer, url)
}

async fn store(url: &str, bouncer: &PgBouncer) -> PostgresStore {
    PostgresStore::builder(url)
        .transaction_pooling(true)
        .connect()
        .await
        .unwrap_or_else(|e| panic!("{e}; pgbouncer's log:\n{}", bouncer.log()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_store_conforms_through_pgbouncer() {
    let (_server, bouncer, url) = setup("conform").await;
    let store = store(&url, &bouncer).await;
    conformance::run_all(Arc::new(store.clone())).await;
    conformance::run_admin(&(Arc::new(store.clone()) as SharedStore)).await;
    // The URL's own parameter does the same as the setter.
    let other = PostgresStore::connect(format!("{url}?transaction_pooling=true")).await.unwrap();
    conformance::run_mixed(Arc::new(store), Arc::new(other)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn versioned_state_conforms_through_pgbouncer() {
    let (_server, bouncer, url) = setup("state").await;
    idempotent_tests::state::run_all(Arc::new(store(&url, &bouncer).await)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn steps_in_transactions_commit_with_their_records_through_pgbouncer() {
    let (server, bouncer, url) = setup("txn").await;
    let direct = format!("postgres://postgres@127.0.0.1:{}/txn", server.port());
    let mut conn = <sqlx::PgConnection as sqlx::Connection>::connect(&direct).await.unwrap();
    sqlx::raw_sql("CREATE TABLE invoices (order_id text PRIMARY KEY, fence bigint NOT NULL)")
        .execute(&mut conn)
        .await
        .unwrap();
    drop(conn);
    let store = store(&url, &bouncer).await;
    // Many steps at once, two calls each, on more clients than PgBouncer has server connections.
    let mut tasks = Vec::new();
    for i in 0..24 {
        let store = store.clone();
        tasks.push(tokio::spawn(async move {
            let order = format!("order-{}", i % 12);
            let ctx = RunContext::new(store, order.clone());
            ctx.step("invoice")
                .run_in_transaction(&order, async |tx: &mut PgTransaction<'_>, attempt| {
                    sqlx::query("INSERT INTO invoices (order_id, fence) VALUES ($1, $2)")
                        .persistent(false)
                        .bind(&order)
                        .bind(attempt.fence() as i64)
                        .execute(&mut **tx)
                        .await
                        .map_err(|e| Error::Config(e.to_string()))?;
                    Ok::<_, Error>(attempt.fence())
                })
                .await
        }));
    }
    for task in tasks {
        match task.await.unwrap() {
            Ok(_) | Err(Error::InFlight { .. }) => {}
            Err(e) => panic!("{e}; pgbouncer's log:\n{}", bouncer.log()),
        }
    }
    // Straight to the server's database, past PgBouncer.
    let direct = format!("postgres://postgres@127.0.0.1:{}/txn", server.port());
    let mut conn = <sqlx::PgConnection as sqlx::Connection>::connect(&direct).await.unwrap();
    let (invoices, done): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM invoices), (SELECT count(*) FROM idempotent_records WHERE state = 'done')",
    )
    .fetch_one(&mut conn)
    .await
    .unwrap();
    assert_eq!((invoices, done), (12, 12), "each order once, with its record");
}

/// Without the setting, PgBouncer 1.18 refuses sqlx's startup parameters: opening fails at
/// once, saying so and what to set.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn without_transaction_pooling_opening_fails_at_once_saying_what_to_set() {
    let (_server, _bouncer, url) = setup("plain").await;
    let started = std::time::Instant::now();
    let res = PostgresStore::connect(&url).await;
    let Err(Error::Unavailable { op: "open", reason, .. }) = res else { panic!("{res:?}") };
    assert!(started.elapsed() < std::time::Duration::from_secs(2), "{:?}", started.elapsed());
    assert!(reason.contains("unsupported startup parameter"), "{reason}");
    assert!(reason.contains("transaction_pooling(true)"), "{reason}");
}

/// A store on a pool of the application's, whose connect options PgBouncer accepts (no
/// `extra_float_digits`), with the setting: the conformance suite passes through PgBouncer.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_store_on_the_applications_pool_conforms_through_pgbouncer() {
    use std::str::FromStr;
    let (_server, _bouncer, url) = setup("apppool").await;
    let options = sqlx::postgres::PgConnectOptions::from_str(&url).unwrap().extra_float_digits(None);
    let pool = sqlx::postgres::PgPoolOptions::new().max_connections(4).connect_lazy_with(options);
    let store = PostgresStore::builder_with_pool(pool).transaction_pooling(true).connect().await.unwrap();
    conformance::run_all(Arc::new(store)).await;
}
