//! `PostgresStore` beyond the conformance suite and the scenarios both SQL stores share
//! (`sql_store.rs`): leases that run out, a database killed or paused mid-run, an acquire racing
//! another write, statements per call and row versions, HOT updates, purging, connections held,
//! the application's pool, a step's writes committed with its record, and the tests PostgreSQL
//! names its own way that call the shared scenarios. Each test of its own runs a throwaway
//! server (they kill, pause, or watch `pg_stat_activity`).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use idempotent_core::record::{Acquire, Transition};
use idempotent_core::store::TransactionalStore;
use idempotent_core::{Error, Key, PostgresStore, RunContext, Store};
use idempotent_tests::matrix::{self, Database, Kind};
use idempotent_tests::sql::{PostgresBackend, SqlDb, wait_for_state};
use idempotent_tests::sql_store::{
    FP, KEEP, LEASE, acquired, fifty_replays_are_one_statement_each, first_execution_is_two_statements, key,
    pre_release_versions_are_refused, two_stores_race_to_resolve,
};
use idempotent_tests::{PgServer, acquire_order};
use sqlx::PgConnection;

/// The call timeout of the failure tests, and how much later than it a call may fail.
const TIMEOUT: Duration = Duration::from_millis(500);
const MARGIN: Duration = Duration::from_millis(400);

async fn count(conn: &mut PgConnection, sql: &str) -> i64 {
    PostgresBackend::count(conn, sql).await
}

async fn state_of(conn: &mut PgConnection, key: &Key) -> Option<(String, i64)> {
    PostgresBackend::state_of(conn, key).await
}

/// The row's version (ctid, xmin) and locker (xmax).
async fn row_version(conn: &mut PgConnection, key: &Key) -> (String, String, String) {
    sqlx::query_as("SELECT ctid::text, xmin::text, xmax::text FROM idempotent_records WHERE key = $1")
        .bind(&key.as_bytes()[..])
        .fetch_one(conn)
        .await
        .unwrap()
}

fn assert_fails_closed<T: std::fmt::Debug>(what: &str, started: Instant, res: Result<T, Error>) {
    let elapsed = started.elapsed();
    let err = res.expect_err(what);
    assert!(err.is_store_failure(), "{what}: {err:?}");
    assert!(elapsed < TIMEOUT + MARGIN, "{what} took {elapsed:?}, the timeout is {TIMEOUT:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_that_runs_out_loses_the_key_and_fences_keep_growing() {
    let server = PgServer::start();
    let store = PostgresStore::connect(server.url()).await.unwrap();
    let k = key(3);
    let short = Duration::from_millis(100);
    let mut previous = acquired(&store, &k, short).await;
    let mut fences = vec![previous.attempt.fence()];
    for round in 2..=4u32 {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let next = acquired(&store, &k, short).await;
        assert_eq!((next.attempt.number(), next.attempt.recovered()), (round, true));
        assert_eq!(
            store.complete(&k, &previous.token, Bytes::from_static(b"stale"), KEEP).await.unwrap(),
            Transition::LeaseLost
        );
        assert_eq!(store.renew(&k, &previous.token, LEASE).await.unwrap(), Transition::LeaseLost);
        fences.push(next.attempt.fence());
        previous = next;
    }
    // Retention runs out and the purge deletes the row: the fence still grows.
    store.complete(&k, &previous.token, Bytes::from_static(b"r"), short).await.unwrap();
    tokio::time::sleep(Duration::from_millis(250)).await;
    assert!(store.purge().await.unwrap() >= 1);
    let mut conn = server.connection().await;
    assert_eq!(state_of(&mut conn, &k).await, None, "the purge left the row");
    let fresh = acquired(&store, &k, LEASE).await;
    assert_eq!(fresh.attempt.number(), 1, "the record was forgotten");
    fences.push(fresh.attempt.fence());
    assert!(fences.windows(2).all(|w| w[0] < w[1]), "fences did not grow: {fences:?}");

    // Through the executor: an action that outlives its lease (no heartbeat) cannot store its
    // result; the attempt that took over can, with a higher fence.
    let ctx = RunContext::new(store.clone(), "slow-1");
    let slow = {
        let ctx = ctx.clone();
        tokio::spawn(async move {
            ctx.step("slow")
                .lease(Duration::from_millis(150))
                .heartbeat(false)
                .run(&(), |attempt| async move {
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    Ok::<_, Error>(attempt.fence())
                })
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let winner: u64 = ctx
        .step("slow")
        .lease(LEASE)
        .run(&(), |attempt| async move {
            assert!(attempt.recovered());
            Ok::<_, Error>(attempt.fence())
        })
        .await
        .unwrap();
    match slow.await.unwrap() {
        Err(Error::LeaseLost { fence, .. }) => assert!(fence < winner, "fence {fence} vs the winner's {winner}"),
        other => panic!("the slow attempt should have lost its lease: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_database_fails_calls_closed_within_the_timeout_and_works_after_restart() {
    let mut server = PgServer::start();
    let store = PostgresStore::builder(server.url()).timeout(TIMEOUT).connect().await.unwrap();
    let done = acquired(&store, &key(1), LEASE).await;
    store.complete(&key(1), &done.token, Bytes::from_static(b"before"), KEEP).await.unwrap();
    let held = acquired(&store, &key(2), LEASE).await;

    server.kill9();
    let t = Instant::now();
    assert_fails_closed("acquire", t, store.acquire(&key(3), &FP, LEASE, KEEP).await);
    let t = Instant::now();
    assert_fails_closed("renew", t, store.renew(&key(2), &held.token, LEASE).await);
    let t = Instant::now();
    assert_fails_closed("complete", t, store.complete(&key(2), &held.token, Bytes::new(), KEEP).await);
    let ran = Arc::new(AtomicUsize::new(0));
    let ctx = RunContext::new(store.clone(), "outage");
    let t = Instant::now();
    let r = ctx
        .step("charge")
        .run(&(), |_| {
            let ran = ran.clone();
            async move {
                ran.fetch_add(1, Ordering::SeqCst);
                Ok::<_, Error>(1u8)
            }
        })
        .await;
    assert_fails_closed("a step", t, r);
    assert_eq!(ran.load(Ordering::SeqCst), 0, "the action ran although the store was down");

    server.restart();
    // Committed records survived the crash; calls work again at once.
    assert_eq!(store.acquire(&key(1), &FP, LEASE, KEEP).await.unwrap(), Acquire::Replay(Bytes::from_static(b"before")));
    assert!(matches!(store.acquire(&key(2), &FP, LEASE, KEEP).await.unwrap(), Acquire::InFlight { .. }));
    assert_eq!(store.complete(&key(2), &held.token, Bytes::from_static(b"after"), KEEP).await.unwrap(), Transition::Ok);
    let n: u8 = ctx.step("charge").run(&(), |_| async { Ok::<_, Error>(7) }).await.unwrap();
    assert_eq!(n, 7);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_database_fails_calls_within_the_timeout_and_works_after_it_resumes() {
    let server = PgServer::start();
    // One connection, on which the acquire statement is prepared before the pause: the paused
    // acquire is then sent whole (a first use would wait for the server to parse it first).
    let store = PostgresStore::builder(server.url()).timeout(TIMEOUT).max_connections(1).connect().await.unwrap();
    let mut conn = server.connection().await;
    let held = acquired(&store, &key(2), LEASE).await;
    // sqlx pings a connection as it goes back to the pool: wait for that before pausing.
    while store.pool().num_idle() != 1 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }

    server.pause();
    let t = Instant::now();
    let sent = store.statements();
    let err = store.acquire(&key(1), &FP, Duration::from_secs(60), KEEP).await.unwrap_err();
    assert!(matches!(err, Error::Timeout { op: "acquire", .. }), "{err:?}");
    assert_eq!(store.statements() - sent, 1, "the acquire was not sent: no connection in time");
    assert!(t.elapsed() >= TIMEOUT - Duration::from_millis(50) && t.elapsed() < TIMEOUT + MARGIN, "{:?}", t.elapsed());
    let t = Instant::now();
    assert_fails_closed("renew", t, store.renew(&key(2), &held.token, LEASE).await);
    let t = Instant::now();
    assert_fails_closed("release", t, store.release(&key(2), &held.token).await);
    // Opening a store is bounded too: the TCP connect succeeds, the handshake hangs.
    let t = Instant::now();
    let opened = PostgresStore::builder(server.url()).timeout(TIMEOUT).connect().await;
    assert!(matches!(&opened, Err(Error::Timeout { op: "open", .. })), "{opened:?}");
    assert!(t.elapsed() < TIMEOUT + MARGIN, "{:?}", t.elapsed());

    server.resume();
    assert!(matches!(store.acquire(&key(3), &FP, LEASE, KEEP).await.unwrap(), Acquire::Acquired(_)));
    // The acquire that timed out reached the server when it resumed and took key 1 (for a
    // minute): the store gives it back, so that a retry need not wait out that lease.
    let attempt = wait_for_state::<PostgresBackend>(&mut conn, &key(1), "released", Duration::from_secs(10)).await;
    assert_eq!(attempt, 1);
    let next = acquired(&store, &key(1), LEASE).await;
    assert_eq!((next.attempt.number(), next.attempt.recovered()), (2, false));
}

/// Waits until `n` backends wait for a lock.
async fn wait_for_lock_waiters(conn: &mut PgConnection, n: i64) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while count(conn, "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'").await != n {
        assert!(Instant::now() < deadline, "no acquire came to wait for the lock");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// The acquire's read and its upsert see different rows when another transaction writes the key
/// in between: the statement then answers nothing and runs again, on the newer row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_racing_another_write_reads_again_and_answers_from_the_newer_row() {
    let server = PgServer::start();
    let store = PostgresStore::connect(server.url()).await.unwrap();
    let mut conn = server.connection().await;
    let mut other = server.connection().await;

    // Absent when the acquire reads it; inserted (running, a live lease) by another transaction
    // that commits while the acquire's insert waits for it.
    sqlx::raw_sql("BEGIN").execute(&mut other).await.unwrap();
    let far = "9000000000000000";
    let insert = format!(
        "INSERT INTO idempotent_records VALUES ($1, $2, 'running', 'other', 1, 1, false, {far}, {far}, NULL, '', NULL, NULL, 0, 0)"
    );
    sqlx::query(sqlx::AssertSqlSafe(insert))
        .bind(&key(1).as_bytes()[..])
        .bind(&FP.as_bytes()[..])
        .execute(&mut other)
        .await
        .unwrap();
    let before = store.statements();
    let racing = {
        let store = store.clone();
        tokio::spawn(async move { store.acquire(&key(1), &FP, LEASE, KEEP).await })
    };
    wait_for_lock_waiters(&mut conn, 1).await;
    sqlx::raw_sql("COMMIT").execute(&mut other).await.unwrap();
    assert!(matches!(racing.await.unwrap().unwrap(), Acquire::InFlight { .. }));
    assert_eq!(store.statements() - before, 2, "the acquire ran once more");

    // Released (free) when the acquire reads it; done by another attempt that commits while the
    // acquire's upsert waits for the row lock.
    let g = acquired(&store, &key(2), LEASE).await;
    store.release(&key(2), &g.token).await.unwrap();
    sqlx::raw_sql("BEGIN").execute(&mut other).await.unwrap();
    sqlx::query("UPDATE idempotent_records SET state = 'done', token = 'other', result = '\\x6f6b' WHERE key = $1")
        .bind(&key(2).as_bytes()[..])
        .execute(&mut other)
        .await
        .unwrap();
    let before = store.statements();
    let racing = {
        let store = store.clone();
        tokio::spawn(async move { store.acquire(&key(2), &FP, LEASE, KEEP).await })
    };
    wait_for_lock_waiters(&mut conn, 1).await;
    sqlx::raw_sql("COMMIT").execute(&mut other).await.unwrap();
    assert_eq!(racing.await.unwrap().unwrap(), Acquire::Replay(Bytes::from_static(b"ok")));
    assert_eq!(store.statements() - before, 2, "the acquire ran once more");
}

/// Garbage rows are corrupt errors (the scenario both stores share).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_rows_are_corrupt_errors_not_replays() {
    matrix::run(
        Kind::Postgres,
        idempotent_tests::sql_store::garbage_rows_are_corrupt_errors_not_replays::<PostgresBackend>,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_execution_is_two_statements_and_a_replay_one_that_writes_nothing_read_first_or_not() {
    let server = PgServer::start();
    let store = PostgresStore::connect(server.url()).await.unwrap();
    let ctx = RunContext::new(store.clone(), "run-1");
    first_execution_is_two_statements(&ctx, &store).await;

    let (k, _) = ctx.step("count").key_for(&1).unwrap();
    let mut conn = server.connection().await;
    let row = row_version(&mut conn, &k).await;
    assert_eq!(row.2, "0", "the completed row is locked: {row:?}");
    fifty_replays_are_one_statement_each(&ctx, &store).await;
    // No new row version (ctid, xmin) and no row lock (xmax): the replays only read, whether
    // acquire ran its upsert first (the first replays) or its read (the later ones).
    assert_eq!(row_version(&mut conn, &k).await, row, "replays wrote the row");

    // A first execution after them: the read finds nothing, then the upsert and the complete.
    acquire_order::first_executions_switch_back_to_the_write(&ctx, "count", || store.statements(), (3, 2)).await;
}

/// Acquire keeps a record `max(lease, retention)`, and a completion the retention from then
/// (`idempotent_core::record`, "Retention"), so complete moves `expires_at`, an indexed column:
/// its update is not HOT (a new entry in each index). A completion with another retention than
/// the acquisition's is kept for that retention from now.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_moves_the_expiry_so_it_is_not_a_hot_update() {
    let server = PgServer::start();
    let store = PostgresStore::connect(server.url()).await.unwrap();
    let mut conn = server.connection().await;
    let times = async |conn: &mut PgConnection, k: &Key| -> (i64, i64) {
        sqlx::query_as("SELECT expires_at, updated_at FROM idempotent_records WHERE key = $1")
            .bind(&k.as_bytes()[..])
            .fetch_one(conn)
            .await
            .unwrap()
    };
    let k = key(40);
    let grant = acquired(&store, &k, LEASE).await;
    let (expires, updated) = times(&mut conn, &k).await;
    assert_eq!(expires - updated, LEASE.max(KEEP).as_micros() as i64, "acquire keeps max(lease, retention)");

    // In one transaction of the store's, so that its own statistics show how the row was updated.
    let mut tx = store.begin().await.unwrap();
    let done = store.complete_in(&mut tx, &k, &grant.token, Bytes::from_static(b"ok"), KEEP).await.unwrap();
    assert_eq!(done, Transition::Ok);
    let (updated_rows, hot): (i64, i64) = sqlx::query_as(
        "SELECT pg_stat_get_xact_tuples_updated('idempotent_records'::regclass), \
         pg_stat_get_xact_tuples_hot_updated('idempotent_records'::regclass)",
    )
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();
    assert_eq!((updated_rows, hot), (1, 0), "the completion moved expires_at: not a HOT update");
    let (expires, updated) = times(&mut conn, &k).await;
    assert_eq!(expires - updated, KEEP.as_micros() as i64, "kept the retention from the completion");

    // Another retention at completion than at acquisition: that retention, from now.
    let k = key(41);
    let grant = acquired(&store, &k, LEASE).await;
    let short = Duration::from_secs(1);
    store.complete(&k, &grant.token, Bytes::from_static(b"ok"), short).await.unwrap();
    let (expires, updated) = times(&mut conn, &k).await;
    assert_eq!(expires - updated, short.as_micros() as i64, "kept the 1 s retention from the completion");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_records_are_purged_in_bounded_batches() {
    let server = PgServer::start();
    let store = PostgresStore::connect(server.url()).await.unwrap();
    let live = acquired(&store, &key(0), LEASE).await;
    let mut conn = server.connection().await;
    // 700 expired rows, written by hand (acquisitions would purge in the background).
    let expired = "INSERT INTO idempotent_records SELECT decode(lpad(to_hex(n), 64, '0'), 'hex'), $1, 'done', \
                   't', n, 1, false, 0, 1000, '\\x00', '', NULL, NULL, 0, 0 FROM generate_series($2::int, $3::int) n";
    sqlx::query(sqlx::AssertSqlSafe(expired)).bind(&[2u8; 32][..]).bind(1).bind(700).execute(&mut conn).await.unwrap();
    // One expired row is locked by a transaction: the purge skips it rather than wait.
    let mut locker = server.connection().await;
    sqlx::raw_sql("BEGIN; SELECT 1 FROM idempotent_records WHERE fence = 5 FOR UPDATE")
        .execute(&mut locker)
        .await
        .unwrap();
    let mut rows = count(&mut conn, "SELECT count(*) FROM idempotent_records").await;
    assert_eq!(rows, 701);
    let mut batches = Vec::new();
    loop {
        let deleted = store.purge().await.unwrap();
        assert!(deleted <= 256, "a batch deleted {deleted} rows");
        let now = count(&mut conn, "SELECT count(*) FROM idempotent_records").await;
        assert_eq!(now, rows - deleted as i64, "purge said {deleted}");
        rows = now;
        if deleted == 0 {
            break;
        }
        batches.push(deleted);
        assert!(batches.len() < 10, "the purge does not end");
    }
    assert_eq!(batches, [256, 256, 187]);
    assert_eq!(rows, 2, "the live row and the locked one stay");
    sqlx::raw_sql("ROLLBACK").execute(&mut locker).await.unwrap();
    assert_eq!(store.purge().await.unwrap(), 1);
    // The live record stays, and is still owned.
    assert!(matches!(store.acquire(&key(0), &FP, LEASE, KEEP).await.unwrap(), Acquire::InFlight { .. }));
    assert_eq!(store.complete(&key(0), &live.token, Bytes::new(), KEEP).await.unwrap(), Transition::Ok);

    // Acquisitions purge on their own: one batch every 64.
    sqlx::query(sqlx::AssertSqlSafe(expired)).bind(&[2u8; 32][..]).bind(1).bind(100).execute(&mut conn).await.unwrap();
    for n in 0..64u8 {
        acquired(&store, &Key::from_bytes([n; 32].map(|b| b ^ 0xA5)), LEASE).await;
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while count(&mut conn, "SELECT count(*) FROM idempotent_records WHERE expires_at = 1000").await > 0 {
        assert!(Instant::now() < deadline, "no purge ran in the background");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_holds_no_connection_while_its_action_runs() {
    let server = PgServer::start();
    let store = PostgresStore::builder(server.url()).max_connections(1).connect().await.unwrap();
    let ctx = RunContext::new(store.clone(), "one-conn");
    let (started_tx, started_rx) = tokio::sync::oneshot::channel::<()>();
    let (go_tx, go_rx) = tokio::sync::oneshot::channel::<()>();
    let blocked = {
        let ctx = ctx.clone();
        tokio::spawn(async move {
            ctx.step("blocked")
                .run(&(), |_| async move {
                    started_tx.send(()).unwrap();
                    go_rx.await.unwrap();
                    Ok::<_, Error>("a".to_owned())
                })
                .await
        })
    };
    started_rx.await.unwrap();
    // With the pool's one connection, another key's step runs to the end meanwhile.
    let other = tokio::time::timeout(
        Duration::from_secs(3),
        ctx.step("other").run(&(), |_| async { Ok::<_, Error>("b".to_owned()) }),
    )
    .await
    .expect("the other step waited for the blocked one's connection");
    assert_eq!(other.unwrap(), "b");
    go_tx.send(()).unwrap();
    assert_eq!(blocked.await.unwrap().unwrap(), "a");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_acquire_gives_back_the_key_it_took() {
    let server = PgServer::start();
    let store = PostgresStore::connect(server.url()).await.unwrap();
    let first = acquired(&store, &key(1), LEASE).await;
    store.release(&key(1), &first.token).await.unwrap();
    // The row is locked elsewhere, so the acquire's upsert waits for it when its caller gives up.
    let mut holder = server.connection().await;
    sqlx::query("BEGIN").execute(&mut holder).await.unwrap();
    sqlx::query("SELECT 1 FROM idempotent_records WHERE key = $1 FOR UPDATE")
        .bind(&key(1).as_bytes()[..])
        .execute(&mut holder)
        .await
        .unwrap();
    let gave_up = tokio::time::timeout(Duration::from_millis(100), store.acquire(&key(1), &FP, LEASE, KEEP)).await;
    assert!(gave_up.is_err(), "the acquire answered while the row was locked: {gave_up:?}");
    sqlx::query("ROLLBACK").execute(&mut holder).await.unwrap();
    // The statement goes on and takes the key (attempt 2); then the key is released, not held.
    let mut conn = server.connection().await;
    let deadline = Instant::now() + Duration::from_secs(5);
    while state_of(&mut conn, &key(1)).await != Some(("released".to_owned(), 2)) {
        assert!(Instant::now() < deadline, "the key stayed {:?}", state_of(&mut conn, &key(1)).await);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let next = acquired(&store, &key(1), LEASE).await;
    assert_eq!((next.attempt.number(), next.attempt.recovered()), (3, false));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_on_the_application_pool_shares_it_and_never_shows_the_password() {
    let server = PgServer::start();
    // Trust authentication ignores the password; it must still never be shown.
    let url = format!("postgres://postgres:s3cret@127.0.0.1:{}/postgres", server.port());
    let pool = sqlx::postgres::PgPoolOptions::new().max_connections(3).connect(&url).await.unwrap();
    let store = PostgresStore::from_pool(pool.clone()).await.unwrap();
    assert_eq!(store.describe(), format!("postgres://postgres@127.0.0.1:{}/postgres", server.port()));
    assert!(store.pool().connect_options().get_port() == server.port());
    let ctx = RunContext::new(store.clone(), "shared");
    let n: u32 = ctx.step("s").run(&(), |_| async { Ok::<_, Error>(3) }).await.unwrap();
    assert_eq!(n, 3);
    // The application's own queries run on the same pool.
    let rows: i64 =
        sqlx::query_scalar("SELECT count(*) FROM idempotent_records").fetch_one(store.pool()).await.unwrap();
    assert_eq!(rows, 1);
    assert!(pool.size() <= 3);

    // Nothing listens on this port: the open fails closed within its timeout, naming the
    // database without the password.
    let closed = idempotent_tests::free_port(false);
    let t = Instant::now();
    let err = PostgresStore::builder(format!("postgres://app:s3cret@127.0.0.1:{closed}/db"))
        .timeout(TIMEOUT)
        .connect()
        .await
        .unwrap_err();
    assert!(t.elapsed() < TIMEOUT + MARGIN, "{:?}", t.elapsed());
    assert!(matches!(err, Error::Timeout { op: "open", .. } | Error::Unavailable { op: "open", .. }), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains(&format!("postgres://app@127.0.0.1:{closed}/db")) && !msg.contains("s3cret"), "{msg}");
    let err = PostgresStore::connect("postgres://app:s3cret@127.0.0.1:notaport/db").await.unwrap_err();
    assert!(
        matches!(&err, Error::Config(m) if m.contains("invalid PostgreSQL URL") && !m.contains("s3cret")),
        "{err:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_commits_or_rolls_back_with_the_transaction_that_holds_it() {
    let server = PgServer::start();
    let store = PostgresStore::connect(server.url()).await.unwrap();
    assert!(store.renews_during_transaction());
    let mut conn = server.connection().await;
    sqlx::raw_sql("CREATE TABLE ledger (entry text)").execute(&mut conn).await.unwrap();

    for (n, commit) in [(1u8, true), (2, false)] {
        let grant = acquired(&store, &key(n), LEASE).await;
        let mut tx = store.begin().await.unwrap();
        sqlx::query("INSERT INTO ledger VALUES ($1)").bind(format!("entry-{n}")).execute(&mut *tx).await.unwrap();
        // The lease is renewed from another connection while the step's writes run.
        assert_eq!(store.renew(&key(n), &grant.token, LEASE).await.unwrap(), Transition::Ok);
        let before = store.statements();
        let done = store.complete_in(&mut tx, &key(n), &grant.token, Bytes::from_static(b"paid"), KEEP).await;
        assert_eq!((done.unwrap(), store.statements() - before), (Transition::Ok, 1));
        if commit {
            tx.commit().await.unwrap();
            assert_eq!(
                store.acquire(&key(n), &FP, LEASE, KEEP).await.unwrap(),
                Acquire::Replay(Bytes::from_static(b"paid"))
            );
        } else {
            tx.rollback().await.unwrap();
            // Neither the write nor the completion happened: the attempt still holds the key.
            assert!(matches!(store.acquire(&key(n), &FP, LEASE, KEEP).await.unwrap(), Acquire::InFlight { .. }));
            assert_eq!(store.release(&key(n), &grant.token).await.unwrap(), Transition::Ok);
        }
    }
    let entries: Vec<String> = sqlx::query_scalar("SELECT entry FROM ledger").fetch_all(&mut conn).await.unwrap();
    assert_eq!(entries, ["entry-1"]);
    // A token that does not hold the key completes nothing, in a transaction too.
    let other = acquired(&store, &key(3), LEASE).await;
    let mut tx = store.begin().await.unwrap();
    let done = store.complete_in(&mut tx, &key(2), &other.token, Bytes::new(), KEEP).await.unwrap();
    assert_eq!(done, Transition::LeaseLost);
    tx.rollback().await.unwrap();
}

/// Two stores (two pools) resolve the same records at once, one as done and one as not done:
/// one wins each, and the record is as it said.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_pools_racing_to_resolve_a_record_have_one_winner() {
    matrix::run(Kind::Postgres, two_stores_race_to_resolve::<PostgresBackend>).await;
}

/// The table of schema version 1, as idempotent-core 0.1 created it.
const V1_TABLE: &str = "CREATE TABLE idempotent_records (
    key bytea PRIMARY KEY NOT NULL CHECK (length(key) = 32),
    fingerprint bytea NOT NULL,
    state text NOT NULL CHECK (state IN ('running', 'released', 'done')),
    token text NOT NULL,
    fence bigint NOT NULL,
    attempt bigint NOT NULL,
    recovered boolean NOT NULL,
    lease_until bigint NOT NULL,
    expires_at bigint NOT NULL,
    result bytea
);
CREATE INDEX idempotent_records_expires_at ON idempotent_records (expires_at);
CREATE TABLE idempotent_schema (name text PRIMARY KEY NOT NULL, version integer NOT NULL);
INSERT INTO idempotent_schema VALUES ('idempotent_records', 1)";

/// The table of schema version 2, as idempotent-core created it before labels and times.
const V2_TABLE: &str = "CREATE TABLE idempotent_records (
    key bytea PRIMARY KEY NOT NULL CHECK (length(key) = 32),
    fingerprint bytea NOT NULL,
    state text NOT NULL CONSTRAINT idempotent_records_state_check
        CHECK (state IN ('running', 'released', 'done', 'needs_attention')),
    token text NOT NULL,
    fence bigint NOT NULL,
    attempt bigint NOT NULL,
    recovered boolean NOT NULL,
    lease_until bigint NOT NULL,
    expires_at bigint NOT NULL,
    result bytea
);
CREATE INDEX idempotent_records_expires_at ON idempotent_records (expires_at);
CREATE TABLE idempotent_schema (name text PRIMARY KEY NOT NULL, version integer NOT NULL);
INSERT INTO idempotent_schema VALUES ('idempotent_records', 2)";

/// The pre-release schema versions 1 and 2 were never published: a table marked with either is
/// refused with a clear error and left as it is, its records untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_of_a_pre_release_version_is_refused_and_left_alone() {
    let database = Database::<PostgresBackend>::start().await;
    pre_release_versions_are_refused(&database, [(1, V1_TABLE), (2, V2_TABLE)]).await;
}
