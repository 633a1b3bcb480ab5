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

/// A plain sqlx connection on the file, outside any store.
async fn raw(path: &Path) -> SqliteConnection {
    SqliteBackend::connect(&format!("sqlite://{}", path.display())).await
}

/// Lets every task spawned so far on this current-thread runtime run until it waits: each
/// write is then out, or waiting in the store's queue.
async fn let_spawned_tasks_run() {
    for _ in 0..8 {
        tokio::task::yield_now().await;
    }
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
    let path = dir.path().join("batch.db");
    let store = SqliteStore::connect(&path).await.unwrap();
    let mut holder = raw(&path).await;
    let trigger = format!(
        "CREATE TRIGGER refuse BEFORE INSERT ON idempotent_records WHEN NEW.step = '{POISON}' \
         BEGIN SELECT RAISE(ABORT, 'refused by the test''s trigger'); END"
    );
    sqlx::raw_sql(sqlx::AssertSqlSafe(trigger)).execute(&mut holder).await.unwrap();
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
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM idempotent_records").fetch_one(&mut holder).await.unwrap();
    assert_eq!(rows, 31, "every write but the refused one, once");
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
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("locked.db");
    let store = SqliteStore::builder(&path).busy_timeout(Duration::from_millis(300)).connect().await.unwrap();
    let mut holder = raw(&path).await;
    sqlx::raw_sql("BEGIN IMMEDIATE").execute(&mut holder).await.unwrap();
    let mut calls = Vec::new();
    for n in 0..8u8 {
        let store = store.clone();
        calls.push(tokio::spawn(async move { store.acquire(&key(n), &FP, LEASE, KEEP).await }));
    }
    for (n, call) in calls.into_iter().enumerate() {
        let err = call.await.unwrap().unwrap_err();
        assert!(matches!(err, Error::Timeout { op: "acquire", .. }), "write {n}: {err:?}");
    }
    sqlx::raw_sql("ROLLBACK").execute(&mut holder).await.unwrap();
    assert!(matches!(store.acquire(&key(0), &FP, LEASE, KEEP).await.unwrap(), Acquire::Acquired(_)));
}

/// A closed store's writes fail at once (its writes' connection is closed with its pool), and
/// the file is left whole for the next store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_store_refuses_writes_and_the_next_store_reads_what_it_wrote() {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("closed.db");
    let store = SqliteStore::connect(&path).await.unwrap();
    let Acquire::Acquired(grant) = store.acquire(&key(1), &FP, LEASE, KEEP).await.unwrap() else { panic!("not free") };
    assert_eq!(
        store.complete(&key(1), &grant.token, bytes::Bytes::from_static(b"7"), KEEP).await.unwrap(),
        Transition::Ok
    );
    store.close().await;
    let err = store.acquire(&key(2), &FP, LEASE, KEEP).await.unwrap_err();
    assert!(err.is_store_failure(), "{err:?}");
    let again = SqliteStore::connect(&path).await.unwrap();
    assert!(matches!(again.acquire(&key(1), &FP, LEASE, KEEP).await.unwrap(), Acquire::Replay(b) if &b[..] == b"7"));
}
