//! Steps that commit with their record on PostgreSQL, where they do what only PostgreSQL can:
//! another pool's attempt takes the key over while the loser's transaction is still open, a
//! duplicate arrives during a held COMMIT, the heartbeat renews the lease while the transaction
//! is open, a call is cancelled during its COMMIT, and a pool of one connection. Each of those
//! runs a throwaway server of its own (they watch `pg_stat_activity` and hold advisory locks).
//! The scenarios both databases share are in `transaction.rs`; the wrapper check, shared too, is
//! here under PostgreSQL's name.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use idempotent_core::sqlx::{self, PgConnection, PgTransaction};
use idempotent_core::{Error, OnInFlight, PostgresStore, RunContext};
use idempotent_tests::PgServer;
use idempotent_tests::matrix::{self, Kind};
use idempotent_tests::sql::{PostgresBackend, SqlDb, wait_for_count};
use idempotent_tests::transaction::{
    a_wrapper_around_the_store_is_a_config_error, assert_the_loser_rolled_back, create_invoices, invoices,
    record_state, take_over_and_commit,
};
use tokio::sync::{Notify, oneshot};

/// The database clock in µs, as the store's `lease_until` counts it.
const NOW_US: &str = PostgresBackend::CLOCK_US;

/// A server, and a store on it with the business table `invoices (id, order_id, fence)`.
async fn setup() -> (PgServer, PostgresStore) {
    let server = PgServer::start();
    let store = PostgresStore::connect(server.url()).await.unwrap();
    create_invoices(&store).await;
    (server, store)
}

/// Polls `count` (a `SELECT count(*) …`) on `conn` until it is at least `want`: another task
/// or process gets there.
async fn wait_for(conn: &mut PgConnection, count: &str, want: i64) {
    wait_for_count::<PostgresBackend>(conn, count, want).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrapper_around_a_postgres_store_is_a_config_error() {
    matrix::run(Kind::Postgres, a_wrapper_around_the_store_is_a_config_error::<PostgresBackend>).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_taken_over_before_the_commit_rolls_the_loser_back() {
    let (server, store) = setup().await;
    // The loser: a short lease, no heartbeat, and its action held open after its insert.
    let inserted = Arc::new(Notify::new());
    let (go_on, held) = oneshot::channel::<()>();
    let loser = tokio::spawn({
        let ctx = RunContext::new(store.clone(), "order-9");
        let inserted = inserted.clone();
        async move {
            ctx.step("create_invoice")
                .lease(Duration::from_millis(200))
                .heartbeat(false)
                .run_in_transaction(&"order-9", async |tx: &mut PgTransaction<'_>, attempt| {
                    PostgresBackend::insert(tx, "loser", attempt.fence()).await?;
                    inserted.notify_one();
                    held.await.expect("the test lets the loser go on");
                    Ok::<_, Error>(attempt.fence())
                })
                .await
        }
    });
    inserted.notified().await;
    assert_eq!(record_state(&store).await.as_deref(), Some("running"), "the loser holds the key");

    // Another process (another pool) waits for the loser's lease to run out, takes the key
    // over and commits, while the loser's transaction is still open.
    let winner_fence = take_over_and_commit(PostgresStore::connect(server.url()).await.unwrap()).await;

    go_on.send(()).unwrap();
    assert_the_loser_rolled_back(&store, loser.await.unwrap(), winner_fence).await;
}

/// Makes every COMMIT of a transaction that inserted into `invoices` wait (in a deferred
/// trigger) until the test lets go of advisory lock 7 on the connection returned:
/// `SELECT pg_advisory_unlock(7)`.
async fn hold_commits(server: &PgServer) -> PgConnection {
    let mut gate = server.connection().await;
    sqlx::raw_sql(
        "CREATE FUNCTION hold_commit() RETURNS trigger LANGUAGE plpgsql AS\n\
           $$ BEGIN PERFORM pg_advisory_xact_lock_shared(7); RETURN NULL; END $$;\n\
         CREATE CONSTRAINT TRIGGER hold_commit AFTER INSERT ON invoices DEFERRABLE INITIALLY DEFERRED\n\
           FOR EACH ROW EXECUTE FUNCTION hold_commit();\n\
         SELECT pg_advisory_lock(7)",
    )
    .execute(&mut gate)
    .await
    .unwrap();
    gate
}

/// Counts the backends waiting in a held COMMIT.
const HELD_COMMITS: &str =
    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND wait_event = 'advisory'";

/// A duplicate of `order-18` on `store`, counting its runs in `runs`.
fn duplicate(
    store: PostgresStore,
    on_in_flight: OnInFlight,
    runs: Arc<AtomicU32>,
) -> tokio::task::JoinHandle<Result<u64, Error>> {
    tokio::spawn(async move {
        RunContext::new(store, "order-18")
            .step("create_invoice")
            .on_in_flight(on_in_flight)
            .run_in_transaction(&"order-18", async |tx: &mut PgTransaction<'_>, attempt| {
                runs.fetch_add(1, Ordering::SeqCst);
                PostgresBackend::insert(tx, "order-18", attempt.fence()).await?;
                Ok::<_, Error>(attempt.fence())
            })
            .await
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_during_the_commit_waits_for_it_and_replays() {
    let (server, store) = setup().await;
    // The winner's COMMIT (after its `complete_in`) is held.
    let mut gate = hold_commits(&server).await;
    let runs = Arc::new(AtomicU32::new(0));
    let winner = tokio::spawn({
        let ctx = RunContext::new(store.clone(), "order-18");
        let runs = runs.clone();
        async move {
            ctx.step("create_invoice")
                .lease(Duration::from_millis(300))
                .run_in_transaction(&"order-18", async |tx: &mut PgTransaction<'_>, attempt| {
                    runs.fetch_add(1, Ordering::SeqCst);
                    PostgresBackend::insert(tx, "order-18", attempt.fence()).await?;
                    Ok::<_, Error>(attempt.fence())
                })
                .await
        }
    });
    let mut probe = server.connection().await;
    wait_for(&mut probe, HELD_COMMITS, 1).await;
    // The winner is in its COMMIT: nothing of it is visible yet, and the record's row is locked.
    assert_eq!(record_state(&store).await.as_deref(), Some("running"));
    assert_eq!(invoices(&store).await, []);
    let locked = sqlx::query("SELECT 1 FROM idempotent_records FOR UPDATE NOWAIT").execute(&mut probe).await;
    assert!(
        matches!(&locked, Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("55P03")),
        "the record's row is locked from complete_in until the commit: {locked:?}"
    );

    // From another pool: a duplicate while the lease holds sees the operation in flight and
    // waits for its outcome.
    let other = PostgresStore::connect(server.url()).await.unwrap();
    let early = duplicate(other.clone(), OnInFlight::Wait { timeout: Duration::from_secs(30) }, runs.clone());
    // The lease runs out while the COMMIT waits (the heartbeat ended with the action) ...
    let ran_out = format!("SELECT count(*) FROM idempotent_records WHERE lease_until <= {NOW_US}");
    wait_for(&mut probe, &ran_out, 1).await;
    // ... so a duplicate now finds the key free in its snapshot, and its take-over waits for the
    // row lock: it neither answers "in flight" (it may not) nor takes the key.
    let late = duplicate(other.clone(), OnInFlight::Reject, runs.clone());
    wait_for(
        &mut probe,
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND wait_event <> 'advisory'",
        1,
    )
    .await;
    assert!(!late.is_finished(), "the late duplicate waits for the commit");

    sqlx::query("SELECT pg_advisory_unlock(7)").execute(&mut gate).await.unwrap();
    let fence = winner.await.unwrap().expect("the winner committed, its lease having run out after complete_in");
    assert_eq!(early.await.unwrap().unwrap(), fence, "the early duplicate replayed");
    assert_eq!(late.await.unwrap().unwrap(), fence, "the late duplicate replayed");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(invoices(&store).await, [("order-18".to_owned(), fence as i64)]);
    assert_eq!(record_state(&store).await.as_deref(), Some("done"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_heartbeat_renews_the_lease_while_the_transaction_is_open() {
    let (server, store) = setup().await;
    let inserted = Arc::new(Notify::new());
    let (go_on, held) = oneshot::channel::<()>();
    let call = tokio::spawn({
        let ctx = RunContext::new(store.clone(), "order-19");
        let inserted = inserted.clone();
        async move {
            ctx.step("create_invoice")
                .lease(Duration::from_millis(300))
                .run_in_transaction(&"order-19", async |tx: &mut PgTransaction<'_>, attempt| {
                    PostgresBackend::insert(tx, "order-19", attempt.fence()).await?;
                    inserted.notify_one();
                    held.await.expect("the test lets the action go on");
                    assert!(!attempt.lease_lost(), "the heartbeat kept the lease");
                    Ok::<_, Error>(attempt.fence())
                })
                .await
        }
    });
    inserted.notified().await;
    let mut probe = server.connection().await;
    let first: i64 =
        sqlx::query_scalar("SELECT lease_until FROM idempotent_records").fetch_one(&mut probe).await.unwrap();
    // Well past the first lease, the key is still held: renewed from other connections of the
    // pool while the action's transaction holds one.
    let past = format!(
        "SELECT count(*) FROM idempotent_records WHERE {NOW_US} > {first} + 600000 AND lease_until > {NOW_US} AND \
         state = 'running'"
    );
    wait_for(&mut probe, &past, 1).await;
    let other = PostgresStore::connect(server.url()).await.unwrap();
    let runs = Arc::new(AtomicU32::new(0));
    let rejected = duplicate_of(other, "order-19", runs.clone()).await;
    assert!(matches!(rejected, Err(Error::InFlight { .. })), "{rejected:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 0);

    go_on.send(()).unwrap();
    let fence = call.await.unwrap().unwrap();
    assert_eq!(invoices(&store).await, [("order-19".to_owned(), fence as i64)]);
    assert_eq!(record_state(&store).await.as_deref(), Some("done"));
}

/// A duplicate of `run` that answers at once when the key is in flight.
async fn duplicate_of(store: PostgresStore, run: &str, runs: Arc<AtomicU32>) -> Result<u64, Error> {
    RunContext::new(store, run)
        .step("create_invoice")
        .on_in_flight(OnInFlight::Reject)
        .run_in_transaction(&run, async |tx: &mut PgTransaction<'_>, attempt| {
            runs.fetch_add(1, Ordering::SeqCst);
            PostgresBackend::insert(tx, run, attempt.fence()).await?;
            Ok::<_, Error>(attempt.fence())
        })
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_cancelled_during_its_commit_leaves_one_outcome_and_the_retry_agrees() {
    let (server, store) = setup().await;
    let mut gate = hold_commits(&server).await;
    let ctx = RunContext::new(store.clone(), "order-21");
    let runs = AtomicU32::new(0);
    let step = || {
        ctx.step("create_invoice").run_in_transaction(&"order-21", async |tx: &mut PgTransaction<'_>, attempt| {
            runs.fetch_add(1, Ordering::SeqCst);
            PostgresBackend::insert(tx, "order-21", attempt.fence()).await?;
            Ok::<_, Error>(attempt.fence())
        })
    };
    let mut probe = server.connection().await;
    tokio::select! {
        out = step() => panic!("the commit is held, yet the call ended with {out:?}"),
        () = wait_for(&mut probe, HELD_COMMITS, 1) => {}
    }
    // Dropped with its COMMIT sent: a release is on its way (it waits for the record's row).
    sqlx::query("SELECT pg_advisory_unlock(7)").execute(&mut gate).await.unwrap();
    sqlx::raw_sql("DROP TRIGGER hold_commit ON invoices").execute(&mut gate).await.unwrap();
    // The server had the COMMIT and finishes it without the client: the invoice and the done
    // record are committed, the late release changes nothing, and the retry replays.
    let fence = step().await.unwrap();
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the retry replayed the dropped call's committed outcome");
    assert_eq!(invoices(&store).await, [("order-21".to_owned(), fence as i64)]);
    assert_eq!(record_state(&store).await.as_deref(), Some("done"));
}

/// A pool of one connection: the transaction holds it, so the step does not try to renew from it
/// (a renewal would wait for the transaction and time out); a step shorter than its lease commits
/// with its record as usual, and the pool is free again afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_one_connection_pool_runs_a_step_in_a_transaction_without_renewing() {
    use idempotent_core::TransactionalStore;
    let (server, wide) = setup().await;
    assert!(wide.renews_during_transaction(), "the default pool has connections to spare");
    let store = PostgresStore::builder(server.url()).max_connections(1).connect().await.unwrap();
    assert!(!store.renews_during_transaction(), "a one-connection pool cannot renew while a transaction holds it");
    let ctx = RunContext::new(store.clone(), "order-31");
    let fence = ctx
        .step("create_invoice")
        .lease(Duration::from_secs(30))
        .run_in_transaction(&"order-31", async |tx: &mut PgTransaction<'_>, attempt| {
            PostgresBackend::insert(tx, "order-31", attempt.fence()).await?;
            Ok::<_, Error>(attempt.fence())
        })
        .await
        .unwrap();
    assert_eq!(invoices(&wide).await, [("order-31".to_owned(), fence as i64)]);
    let again: u64 = ctx
        .step("create_invoice")
        .run_in_transaction(&"order-31", async |_: &mut PgTransaction<'_>, _| -> Result<u64, Error> {
            unreachable!("replayed")
        })
        .await
        .unwrap();
    assert_eq!(again, fence);
}
