//! `SqliteStore`'s writes under load: those that arrive while one is out go out together in one
//! transaction (group commit), each answered on its own; a statement of a batch that fails
//! answers its own write only; writes wait for a lock another connection holds, and fail
//! together with `Error::Timeout` when it is held past the busy timeout.

use std::path::Path;
use std::time::Duration;

use idempotent_core::record::{Acquire, Labels, Transition};
use idempotent_core::{Error, SqliteStore, Store};
use idempotent_tests::sql::{SqlDb, SqliteBackend};
use idempotent_tests::sql_store::{FP, KEEP, LEASE, key};
use sqlx::SqliteConnection;
use tempfile::TempDir;
use tokio::task::JoinHandle;

/// A plain sqlx connection on the file, outside any store.
async fn raw(path: &Path) -> SqliteConnection {
    SqliteBackend::connect(&format!("sqlite://{}", path.display())).await
}

/// A store on a new file `name` in `dir`, and a plain connection on the file beside it.
async fn store_and_holder(dir: &TempDir, name: &str) -> (SqliteStore, SqliteConnection) {
    let path = dir.path().join(name);
    let store = SqliteStore::connect(&path).await.unwrap();
    let holder = raw(&path).await;
    (store, holder)
}

/// Lets every task spawned so far on this current-thread runtime run until it waits: each
/// write is then out, or waiting in the store's queue.
async fn let_spawned_tasks_run() {
    for _ in 0..8 {
        tokio::task::yield_now().await;
    }
}

/// An acquire of each key of `keys`, each in a task of its own.
fn spawn_acquires(store: &SqliteStore, keys: std::ops::Range<u8>) -> Vec<JoinHandle<Result<Acquire, Error>>> {
    keys.map(|n| {
        let store = store.clone();
        tokio::spawn(async move { store.acquire(&key(n), &FP, LEASE, KEEP).await })
    })
    .collect()
}

/// Takes key `n` (it must be free) and completes it with `result`.
async fn take_and_complete(store: &SqliteStore, n: u8, result: &'static [u8]) {
    let Acquire::Acquired(grant) = store.acquire(&key(n), &FP, LEASE, KEEP).await.unwrap() else { panic!("not free") };
    let done = store.complete(&key(n), &grant.token, bytes::Bytes::from_static(result), KEEP).await;
    assert_eq!(done.unwrap(), Transition::Ok);
}

/// The records in the file.
async fn records(conn: &mut SqliteConnection) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM idempotent_records").fetch_one(conn).await.unwrap()
}

/// The step label of the writes the trigger below refuses.
const POISON: &str = "poison";

/// 32 acquires of new keys wait behind a lock held elsewhere, so that all but the first go out
/// as one batch; one of them (step `poison`) is refused by a trigger. The batch is rolled back
/// and sent again one write at a time: that one write fails with the trigger's message, every
/// other is taken, and each row is written once.
#[tokio::test(flavor = "current_thread")]
async fn a_failing_write_of_a_batch_answers_its_own_caller_only() {
    let dir = TempDir::new().unwrap();
    let (store, mut holder) = store_and_holder(&dir, "batch.db").await;
    let trigger = format!(
        "CREATE TRIGGER refuse BEFORE INSERT ON idempotent_records WHEN NEW.step = '{POISON}' \
         BEGIN SELECT RAISE(ABORT, 'refused by the test''s trigger'); END"
    );
    sqlx::raw_sql(sqlx::AssertSqlSafe(trigger)).execute(&mut holder).await.unwrap();
    // Every row the store writes, counted: a write that ran twice would be counted twice.
    sqlx::raw_sql(
        "CREATE TABLE written (key BLOB NOT NULL);
         CREATE TRIGGER count_inserts AFTER INSERT ON idempotent_records BEGIN INSERT INTO written VALUES (NEW.key); END;
         CREATE TRIGGER count_updates AFTER UPDATE ON idempotent_records BEGIN INSERT INTO written VALUES (NEW.key); END;",
    )
    .execute(&mut holder)
    .await
    .unwrap();
    sqlx::raw_sql("BEGIN IMMEDIATE").execute(&mut holder).await.unwrap();

    let mut calls = Vec::new();
    for n in 0..32u8 {
        let store = store.clone();
        calls.push(tokio::spawn(async move {
            let step = if n == 7 { POISON } else { "charge" };
            store.acquire_labeled(&key(n), &FP, LEASE, KEEP, Labels::step(step)).await
        }));
    }
    let_spawned_tasks_run().await;
    sqlx::raw_sql("ROLLBACK").execute(&mut holder).await.unwrap();

    for (n, call) in calls.into_iter().enumerate() {
        let answer = call.await.unwrap();
        if n == 7 {
            let err = answer.unwrap_err();
            assert!(err.to_string().contains("refused by the test's trigger"), "write {n}: {err}");
        } else {
            assert!(matches!(answer, Ok(Acquire::Acquired(_))), "write {n}: {answer:?}");
        }
    }
    assert_eq!(records(&mut holder).await, 31, "every write but the refused one");
    let (writes, keys): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(DISTINCT key) FROM written").fetch_one(&mut holder).await.unwrap();
    assert_eq!((writes, keys), (31, 31), "each write took effect once (the rolled-back batch's not at all)");
}

/// The frames a passive checkpoint finds in the WAL (and copies into the file).
async fn wal_frames(conn: &mut SqliteConnection) -> i64 {
    let (_busy, log, _done): (i64, i64, i64) =
        sqlx::query_as("PRAGMA wal_checkpoint(PASSIVE)").fetch_one(&mut *conn).await.unwrap();
    log
}

/// 32 acquires that wait behind a lock held elsewhere go out as the first, alone, and one batch
/// of the other 31: the WAL gains the pages of two commits, not of 32.
#[tokio::test(flavor = "current_thread")]
async fn writes_that_wait_together_share_one_commit() {
    let dir = TempDir::new().unwrap();
    let (store, mut holder) = store_and_holder(&dir, "shared.db").await;
    sqlx::raw_sql("PRAGMA wal_checkpoint(TRUNCATE)").execute(&mut holder).await.unwrap();
    assert_eq!(wal_frames(&mut holder).await, 0);
    sqlx::raw_sql("BEGIN IMMEDIATE").execute(&mut holder).await.unwrap();
    let calls = spawn_acquires(&store, 0..32);
    let_spawned_tasks_run().await;
    sqlx::raw_sql("ROLLBACK").execute(&mut holder).await.unwrap();
    for (n, call) in calls.into_iter().enumerate() {
        assert!(matches!(call.await.unwrap(), Ok(Acquire::Acquired(_))), "write {n}");
    }
    // Each commit appends the pages it changed (the table's leaf and the key index's, a few
    // more as they split): two commits append a handful, 32 commits at least 64.
    let frames = wal_frames(&mut holder).await;
    assert!(frames < 16, "{frames} WAL frames for 32 acquires: they did not share a commit");
}

/// Acquires and completes of 64 callers at once, on keys each taken by two of them: every key is
/// taken once, each winner's complete is acknowledged, and the loser of each key is told the
/// key is in flight or done — the answers of writes that went out together are each their own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_that_go_out_together_are_each_judged_on_the_row_as_the_ones_before_left_it() {
    let dir = TempDir::new().unwrap();
    let store = SqliteStore::connect(dir.path().join("pairs.db")).await.unwrap();
    let mut calls = Vec::new();
    for caller in 0..64u8 {
        let store = store.clone();
        calls.push(tokio::spawn(async move {
            let k = key(caller / 2);
            match store.acquire(&k, &FP, LEASE, KEEP).await.unwrap() {
                Acquire::Acquired(grant) => {
                    let done = store.complete(&k, &grant.token, bytes::Bytes::from_static(b"ok"), KEEP).await;
                    assert_eq!(done.unwrap(), Transition::Ok, "caller {caller}: its own complete");
                    true
                }
                Acquire::InFlight { .. } | Acquire::Replay(_) => false,
                other => panic!("caller {caller}: {other:?}"),
            }
        }));
    }
    let mut taken = [0u32; 32];
    for (caller, call) in calls.into_iter().enumerate() {
        if call.await.unwrap() {
            taken[caller / 2] += 1;
        }
    }
    assert!(taken.iter().all(|&n| n == 1), "each key taken by one caller of two: {taken:?}");
}

/// Writes wait for a lock another connection holds; held past the busy timeout, every one of
/// them, the first out and those waiting behind it, fails with `Error::Timeout`, and the store
/// writes again once the lock is let go.
#[tokio::test(flavor = "current_thread")]
async fn writes_behind_a_lock_held_past_the_busy_timeout_all_time_out() {
    const TIMEOUT: Duration = Duration::from_secs(1);
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("locked.db");
    let store = SqliteStore::builder(&path).busy_timeout(TIMEOUT).connect().await.unwrap();
    let mut holder = raw(&path).await;
    sqlx::raw_sql("BEGIN IMMEDIATE").execute(&mut holder).await.unwrap();
    let started = std::time::Instant::now();
    let calls = spawn_acquires(&store, 0..8);
    for (n, call) in calls.into_iter().enumerate() {
        let err = call.await.unwrap().unwrap_err();
        assert!(matches!(err, Error::Timeout { op: "acquire", .. }), "write {n}: {err:?}");
    }
    // Bounded by the timeout from when each write was made, waiting in the store included (a
    // batch that waited its own timeout again after the first write's would take twice as long).
    let waited = started.elapsed();
    assert!(waited < TIMEOUT * 8 / 5, "the writes waited {waited:?} with a timeout of {TIMEOUT:?}");
    sqlx::raw_sql("ROLLBACK").execute(&mut holder).await.unwrap();
    assert!(matches!(store.acquire(&key(0), &FP, LEASE, KEEP).await.unwrap(), Acquire::Acquired(_)));
}

/// `close` waits for the write out and answers those waiting: nothing is written after it
/// returns, and the writes it stopped fail as store failures.
#[tokio::test(flavor = "current_thread")]
async fn close_waits_for_the_write_out_and_stops_those_waiting() {
    let dir = TempDir::new().unwrap();
    let (store, mut holder) = store_and_holder(&dir, "closing.db").await;
    sqlx::raw_sql("BEGIN IMMEDIATE").execute(&mut holder).await.unwrap();
    let calls = spawn_acquires(&store, 0..10);
    let_spawned_tasks_run().await;
    let closing = tokio::spawn({
        let store = store.clone();
        async move { store.close().await }
    });
    let_spawned_tasks_run().await;
    assert!(!closing.is_finished(), "close returned while a write was out");
    sqlx::raw_sql("ROLLBACK").execute(&mut holder).await.unwrap();
    closing.await.unwrap();
    assert_eq!(records(&mut holder).await, 1, "close returned before the write out was committed");
    let answers: Vec<_> = futures_util::future::join_all(calls).await.into_iter().map(Result::unwrap).collect();
    let taken = answers.iter().filter(|a| matches!(a, Ok(Acquire::Acquired(_)))).count();
    assert_eq!(taken, 1, "the write out when close began, and only it: {answers:?}");
    assert!(answers.iter().filter(|a| a.is_err()).all(|a| a.as_ref().unwrap_err().is_store_failure()), "{answers:?}");
    assert_eq!(records(&mut holder).await, 1, "nothing was written after close returned");
}

/// A closed store's writes fail at once (its writes' connection is closed with its pool), and
/// the file is left whole for the next store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_store_refuses_writes_and_the_next_store_reads_what_it_wrote() {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("closed.db");
    let store = SqliteStore::connect(&path).await.unwrap();
    take_and_complete(&store, 1, b"7").await;
    store.close().await;
    let err = store.acquire(&key(2), &FP, LEASE, KEEP).await.unwrap_err();
    assert!(err.is_store_failure(), "{err:?}");
    let again = SqliteStore::connect(&path).await.unwrap();
    assert!(matches!(again.acquire(&key(1), &FP, LEASE, KEEP).await.unwrap(), Acquire::Replay(b) if &b[..] == b"7"));
}

/// On an application's pool whose file is not in WAL mode, each write runs on the pool as it
/// always did, and a write whose commit could not take the file (a reader holds it past the busy
/// timeout, in the rollback journal) is an error, never a key taken without its row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_the_rollback_journal_a_write_that_cannot_commit_is_an_error_not_a_taken_key() {
    use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("journal.db");
    let options = SqliteConnectOptions::new()
        .filename(&path)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Delete)
        .busy_timeout(Duration::from_millis(300));
    let pool = SqlitePoolOptions::new().max_connections(2).connect_with(options).await.unwrap();
    let store = SqliteStore::from_pool(pool).await.unwrap();
    let mut reader = raw(&path).await;
    sqlx::raw_sql("BEGIN; SELECT count(*) FROM idempotent_records;").execute(&mut reader).await.unwrap();
    let err = store.acquire(&key(1), &FP, LEASE, KEEP).await.unwrap_err();
    assert!(matches!(err, Error::Timeout { op: "acquire", .. }), "{err:?}");
    sqlx::raw_sql("COMMIT").execute(&mut reader).await.unwrap();
    take_and_complete(&store, 1, b"1").await;
    assert!(matches!(store.acquire(&key(1), &FP, LEASE, KEEP).await.unwrap(), Acquire::Replay(_)));
}

/// On an application's in-memory database (one connection: nothing else reaches it), the
/// writes run on the pool and the store works as on a file.
#[tokio::test(flavor = "current_thread")]
async fn on_an_in_memory_pool_the_writes_run_on_the_pool() {
    // A private in-memory database: another connection would open a database of its own.
    let options = sqlx::sqlite::SqliteConnectOptions::new().in_memory(true);
    let pool = sqlx::sqlite::SqlitePoolOptions::new().max_connections(1).connect_with(options).await.unwrap();
    let store = SqliteStore::from_pool(pool).await.unwrap();
    take_and_complete(&store, 3, b"3").await;
    assert!(matches!(store.acquire(&key(3), &FP, LEASE, KEEP).await.unwrap(), Acquire::Replay(b) if &b[..] == b"3"));
}
