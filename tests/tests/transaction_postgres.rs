//! Steps that commit with their record (`Step::run_in_transaction`, `#[idempotent(transaction =
//! ..)]`) on PostgreSQL, each test on a throwaway server of its own: the business rows and the
//! `done` record commit together or not at all, whatever fails, whoever races (on one pool or
//! two), and wherever the process dies. The SQLite counterpart is `transaction.rs`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use idempotent_core::sqlx::{self, PgConnection, PgTransaction};
use idempotent_core::{Error, IntoSharedStore, OnInFlight, PostgresStore, RunContext, idempotent};
use idempotent_tests::PgServer;
use idempotent_tests::txn::{InvoiceError, db, kill_child_before_commit};
use tokio::sync::{Notify, oneshot};

/// The database clock in µs, as the store's `lease_until` counts it.
const NOW_US: &str = "(extract(epoch FROM clock_timestamp()) * 1000000)::bigint";

/// A server, and a store on it with the business table `invoices (id, order_id, fence)`.
async fn setup() -> (PgServer, PostgresStore) {
    let server = PgServer::start();
    let store = PostgresStore::connect(server.url()).await.unwrap();
    sqlx::raw_sql("CREATE TABLE invoices (id bigserial PRIMARY KEY, order_id text NOT NULL, fence bigint NOT NULL)")
        .execute(store.pool())
        .await
        .unwrap();
    (server, store)
}

async fn invoices(store: &PostgresStore) -> Vec<(String, i64)> {
    sqlx::query_as("SELECT order_id, fence FROM invoices ORDER BY id").fetch_all(store.pool()).await.unwrap()
}

/// The committed state of the one record in the store's table, if there is one.
async fn record_state(store: &PostgresStore) -> Option<String> {
    sqlx::query_scalar("SELECT state FROM idempotent_records").fetch_optional(store.pool()).await.unwrap()
}

async fn insert(tx: &mut PgTransaction<'_>, order_id: &str, fence: u64) -> Result<(), Error> {
    sqlx::query("INSERT INTO invoices (order_id, fence) VALUES ($1, $2)")
        .bind(order_id)
        .bind(fence as i64)
        .execute(&mut **tx)
        .await
        .map_err(db)?;
    Ok(())
}

/// Polls `count` (a `SELECT count(*) …`) on `conn` until it is at least `want`: another task
/// or process gets there.
async fn wait_for(conn: &mut PgConnection, count: &str, want: i64) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let n: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(count.to_owned())).fetch_one(&mut *conn).await.unwrap();
        if n >= want {
            return;
        }
        assert!(Instant::now() < deadline, "`{count}` stayed {n}, below {want}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn business_rows_and_the_done_record_commit_together_and_replay() {
    let (_server, store) = setup().await;
    // Through a shared handle: the executor finds the PostgresStore behind the `Arc<dyn Store>`.
    let ctx = RunContext::new(store.clone().into_shared(), "order-7");
    let runs = AtomicU32::new(0);
    let before = store.statements();
    for _call in 0..3 {
        let fence: u64 = ctx
            .step("create_invoice")
            .run_in_transaction(&("order-7", 1500), async |tx: &mut PgTransaction<'_>, attempt| {
                runs.fetch_add(1, Ordering::SeqCst);
                assert_eq!(idempotent_core::current_attempt().as_ref(), Some(&attempt));
                // The transaction is on the store's pool: its statement_timeout (the store's
                // timeout, 5 s by default) applies to the action's statements too.
                let timeout: String =
                    sqlx::query_scalar("SHOW statement_timeout").fetch_one(&mut **tx).await.map_err(db)?;
                assert_eq!(timeout, "5s");
                insert(tx, "order-7", attempt.fence()).await?;
                Ok::<_, Error>(attempt.fence())
            })
            .await
            .unwrap();
        assert_eq!(invoices(&store).await, [("order-7".to_owned(), fence as i64)]);
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the later calls replayed");
    assert_eq!(record_state(&store).await.as_deref(), Some("done"));
    // Acquire and complete (in the transaction) for the first call, one acquire for each replay.
    assert_eq!(store.statements() - before, 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_action_error_rolls_back_its_writes_and_frees_the_key() {
    let (_server, store) = setup().await;
    let ctx = RunContext::new(store.clone(), "order-8");
    let step = || ctx.step("create_invoice");
    let failed: Result<u64, InvoiceError> = step()
        .run_in_transaction(&"order-8", async |tx: &mut PgTransaction<'_>, attempt| {
            insert(tx, "order-8", attempt.fence()).await?;
            Err(InvoiceError::Declined)
        })
        .await;
    assert!(matches!(failed, Err(InvoiceError::Declined)), "{failed:?}");
    assert_eq!(invoices(&store).await, []);
    assert_eq!(record_state(&store).await.as_deref(), Some("released"));

    let fence = step()
        .run_in_transaction(&"order-8", async |tx: &mut PgTransaction<'_>, attempt| {
            assert_eq!(attempt.number(), 2);
            assert!(!attempt.recovered(), "the first attempt released the key");
            insert(tx, "order-8", attempt.fence()).await?;
            Ok::<_, InvoiceError>(attempt.fence())
        })
        .await
        .unwrap();
    assert_eq!(invoices(&store).await, [("order-8".to_owned(), fence as i64)]);
    assert_eq!(record_state(&store).await.as_deref(), Some("done"));
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
                    insert(tx, "loser", attempt.fence()).await?;
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
    let winner_store = PostgresStore::connect(server.url()).await.unwrap();
    let winner_fence = RunContext::new(winner_store, "order-9")
        .step("create_invoice")
        .on_in_flight(OnInFlight::Wait { timeout: Duration::from_secs(30) })
        .run_in_transaction(&"order-9", async |tx: &mut PgTransaction<'_>, attempt| {
            assert!(attempt.recovered(), "the loser's lease ran out without an outcome");
            insert(tx, "winner", attempt.fence()).await?;
            Ok::<_, Error>(attempt.fence())
        })
        .await
        .unwrap();

    go_on.send(()).unwrap();
    let lost = loser.await.unwrap();
    let Err(Error::LeaseLost { fence, .. }) = lost else { panic!("the loser stored its outcome: {lost:?}") };
    assert!(fence < winner_fence, "the winner's fence {winner_fence} is above the loser's {fence}");
    assert_eq!(invoices(&store).await, [("winner".to_owned(), winner_fence as i64)]);
    assert_eq!(record_state(&store).await.as_deref(), Some("done"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_commit_rolls_back_and_frees_the_key() {
    let (_server, store) = setup().await;
    sqlx::raw_sql(
        "CREATE TABLE customers (id bigint PRIMARY KEY);\n\
         CREATE TABLE orders (id text NOT NULL, customer bigint NOT NULL\n\
           REFERENCES customers(id) DEFERRABLE INITIALLY DEFERRED)",
    )
    .execute(store.pool())
    .await
    .unwrap();
    let ctx = RunContext::new(store.clone(), "order-10");
    let place = || {
        ctx.step("place_order").run_in_transaction(&"order-10", async |tx: &mut PgTransaction<'_>, attempt| {
            // Customer 42 does not exist: the deferred foreign key fails the commit, not this insert.
            sqlx::query("INSERT INTO orders (id, customer) VALUES ('order-10', 42)")
                .execute(&mut **tx)
                .await
                .map_err(db)?;
            Ok::<_, Error>(attempt.number())
        })
    };
    let failed = place().await;
    let Err(e @ Error::Unavailable { op: "commit", .. }) = failed else { panic!("{failed:?}") };
    assert!(e.to_string().contains("violates foreign key constraint"), "{e}");
    assert!(e.to_string().contains("the key was released"), "{e}");
    let orders = || sqlx::query_scalar::<_, i64>("SELECT count(*) FROM orders").fetch_one(store.pool());
    assert_eq!(orders().await.unwrap(), 0);
    assert_eq!(record_state(&store).await.as_deref(), Some("released"));

    sqlx::query("INSERT INTO customers (id) VALUES (42)").execute(store.pool()).await.unwrap();
    assert_eq!(place().await.unwrap(), 2, "the retry ran as the second attempt");
    assert_eq!(orders().await.unwrap(), 1);
    assert_eq!(record_state(&store).await.as_deref(), Some("done"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_duplicates_on_two_pools_insert_one_row() {
    let (server, store) = setup().await;
    let other = PostgresStore::connect(server.url()).await.unwrap();
    let runs = Arc::new(AtomicU32::new(0));
    let mut calls = Vec::new();
    for i in 0..32 {
        let ctx = RunContext::new(if i % 2 == 0 { store.clone() } else { other.clone() }, "order-11");
        let runs = runs.clone();
        calls.push(tokio::spawn(async move {
            ctx.step("create_invoice")
                .run_in_transaction(&"order-11", async |tx: &mut PgTransaction<'_>, attempt| {
                    runs.fetch_add(1, Ordering::SeqCst);
                    insert(tx, "order-11", attempt.fence()).await?;
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
    assert_eq!(invoices(&store).await, [("order-11".to_owned(), fences[0] as i64)]);
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
                insert(tx, "order-18", attempt.fence()).await?;
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
                    insert(tx, "order-18", attempt.fence()).await?;
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
                    insert(tx, "order-19", attempt.fence()).await?;
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
            insert(tx, run, attempt.fence()).await?;
            Ok::<_, Error>(attempt.fence())
        })
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_call_rolls_back_and_the_retry_runs_at_once() {
    let (server, store) = setup().await;
    let ctx = RunContext::new(store.clone(), "order-12");
    let inserted = Notify::new();
    let call =
        ctx.step("create_invoice").run_in_transaction(&"order-12", async |tx: &mut PgTransaction<'_>, attempt| {
            insert(tx, "order-12", attempt.fence()).await?;
            inserted.notify_one();
            std::future::pending::<()>().await;
            Ok::<_, Error>(attempt.fence())
        });
    tokio::select! {
        out = call => panic!("the action never returns, yet the call ended with {out:?}"),
        () = inserted.notified() => {}
    }
    // The call was dropped mid-action: its transaction rolled back, and a task of its own
    // releases the key.
    assert_eq!(invoices(&store).await, []);
    let mut probe = server.connection().await;
    wait_for(&mut probe, "SELECT count(*) FROM idempotent_records WHERE state = 'released'", 1).await;

    let fence = ctx
        .step("create_invoice")
        .run_in_transaction(&"order-12", async |tx: &mut PgTransaction<'_>, attempt| {
            assert_eq!(attempt.number(), 2);
            assert!(!attempt.recovered(), "the cancelled call released the key");
            insert(tx, "order-12", attempt.fence()).await?;
            Ok::<_, Error>(attempt.fence())
        })
        .await
        .unwrap();
    assert_eq!(invoices(&store).await, [("order-12".to_owned(), fence as i64)]);
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
            insert(tx, "order-21", attempt.fence()).await?;
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_killed_before_its_commit_leaves_nothing_and_the_retry_recovers() {
    let (server, store) = setup().await;
    let child_fence = kill_child_before_commit(env!("CARGO_BIN_EXE_txn_child"), &server.url(), 300).await;
    assert_eq!(invoices(&store).await, []);
    assert_eq!(record_state(&store).await.as_deref(), Some("running"), "no done record: the key is the dead child's");

    let ctx = RunContext::new(store.clone(), "crash-run");
    let fence = ctx
        .step("create_invoice")
        .run_in_transaction(&"order-1", async |tx: &mut PgTransaction<'_>, attempt| {
            assert!(attempt.recovered(), "the child's lease ran out without an outcome");
            insert(tx, "order-1", attempt.fence()).await?;
            Ok::<_, Error>(attempt.fence())
        })
        .await
        .unwrap();
    assert!(fence > child_fence);
    assert_eq!(invoices(&store).await, [("order-1".to_owned(), fence as i64)]);
    assert_eq!(record_state(&store).await.as_deref(), Some("done"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_call_is_send_and_can_be_spawned() {
    let (_server, store) = setup().await;
    let ctx = RunContext::new(store.clone(), "order-14");
    let call = tokio::spawn(async move {
        ctx.step("create_invoice")
            .run_in_transaction(&"order-14".to_owned(), async |tx: &mut PgTransaction<'_>, attempt| {
                insert(tx, "order-14", attempt.fence()).await?;
                tokio::task::yield_now().await;
                Ok::<_, Error>(attempt.fence())
            })
            .await
    });
    let fence = call.await.unwrap().unwrap();
    assert_eq!(invoices(&store).await, [("order-14".to_owned(), fence as i64)]);
}

#[idempotent(step = "create_invoice", transaction = tx)]
async fn create_invoice(ctx: &RunContext, tx: &mut PgTransaction<'_>, order_id: &str) -> Result<u64, Error> {
    let fence = idempotent_core::current_attempt().expect("inside a step").fence();
    insert(tx, order_id, fence).await?;
    Ok(fence)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_macro_commits_the_body_with_the_record_and_replays() {
    let (_server, store) = setup().await;
    let ctx = RunContext::new(store.clone(), "order-15");
    let first = create_invoice(&ctx, "order-15").await.unwrap();
    let again = create_invoice(&ctx, "order-15").await.unwrap();
    assert_eq!(first, again);
    assert_eq!(invoices(&store).await, [("order-15".to_owned(), first as i64)]);
    let spawned = tokio::spawn(async move { create_invoice(&ctx, "order-16").await }).await.unwrap().unwrap();
    assert!(spawned > 0);
    assert_eq!(invoices(&store).await.len(), 2);
}

/// A step whose record needs attention is refused before its transaction begins: the action is
/// not called and nothing is written; resolved as not done, the next call runs it. A completion
/// in a transaction by an attempt that was marked (uncertain, or needing attention) is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_whose_record_needs_attention_is_refused_and_its_action_not_called() {
    use idempotent_core::record::{Abandon, Acquire, Resolved, Transition};
    use idempotent_core::store::TransactionalStore;
    use idempotent_core::{Key, Store};
    let (lease, keep) = (Duration::from_secs(10), Duration::from_secs(60));
    let (_server, store) = setup().await;
    let ctx = RunContext::new(store.clone(), "order-9");
    let payload = ("order-9", 900);
    let (key, fp) = ctx.step("create_invoice").key_for(&payload).unwrap();
    let Acquire::Acquired(first) = store.acquire(&key, &fp, lease, keep).await.unwrap() else { panic!("taken") };
    assert_eq!(store.abandon(&key, &first.token, Abandon::NeedsAttention).await.unwrap(), Transition::Ok);
    let runs = AtomicU32::new(0);
    let call = || {
        ctx.step("create_invoice").run_in_transaction(&payload, async |tx: &mut PgTransaction<'_>, attempt| {
            runs.fetch_add(1, Ordering::SeqCst);
            insert(tx, "order-9", attempt.fence()).await?;
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
    assert_eq!(record_state(&store).await, Some("needs_attention".to_owned()));
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
            insert(tx, "order-31", attempt.fence()).await?;
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
