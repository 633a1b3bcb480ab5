//! Reliability of the SQL stores under faults: the workload and checker of `reliability.rs`
//! (`idempotent_tests::workload`, `idempotent_tests::history`) against the database's own faults.
//!
//! SQLite: two stores on one file (as two processes would be), and a nemesis that takes the
//! file's write lock from a third connection for random spans, some longer than the stores'
//! busy timeout, and checkpoints the WAL meanwhile. PostgreSQL: two stores (two pools), and a
//! nemesis that kills the server and restarts it, stops and resumes it, and locks the records
//! table. Print the reports with `-- --nocapture`.

use std::path::Path;
use std::time::Duration;

use idempotent_core::{PostgresStore, RunContext, SqliteStore};
use idempotent_tests::history::History;
use idempotent_tests::workload::{fastrand_like, final_pass_and_check, random_calls};
use idempotent_tests::{PgServer, unique};
use sqlx::{Connection, SqliteConnection};
use tempfile::TempDir;

/// How long a statement waits for the write lock before failing closed.
const BUSY: Duration = Duration::from_millis(400);

/// The nemesis's duration: IDEMPOTENT_NEMESIS_SECS, else `default`.
fn nemesis_secs(default: u64) -> u64 {
    std::env::var("IDEMPOTENT_NEMESIS_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(default)
}

async fn sqlite(path: &Path) -> SqliteStore {
    SqliteStore::builder(path).busy_timeout(BUSY).max_connections(4).connect().await.unwrap()
}

/// 8 workers on 40 keys through two stores on one file, while the nemesis holds the write lock
/// (50 to 900 ms, so past the busy timeout about half the time) and checkpoints the WAL; then a
/// final pass and the checker: no key's effect committed twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_nemesis_lock_contention_with_two_stores_on_one_file() {
    let secs = nemesis_secs(15);
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("nemesis.db");
    let run = unique("rel-sqlite");
    let stores = [sqlite(&path).await, sqlite(&path).await];
    let hist = History::new();
    let keys: Vec<String> = (0..40).map(|i| format!("k{i}")).collect();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    let mut workers = Vec::new();
    for w in 0..8u64 {
        let ctx = RunContext::new(stores[w as usize % 2].clone(), &run);
        workers.push(tokio::spawn(random_calls(ctx, hist.clone(), keys.clone(), deadline, w + 1)));
    }
    let mut locker = SqliteConnection::connect(&format!("sqlite://{}", path.display())).await.unwrap();
    let mut rng = fastrand_like(99);
    let (mut locks, mut checkpoints) = (0u32, 0u32);
    while tokio::time::Instant::now() < deadline {
        if rng().is_multiple_of(3) {
            // Waits for the workers' writes as long as it takes, then truncates the WAL.
            sqlx::raw_sql("PRAGMA wal_checkpoint(TRUNCATE)").execute(&mut locker).await.unwrap();
            checkpoints += 1;
        } else {
            sqlx::raw_sql("BEGIN IMMEDIATE").execute(&mut locker).await.unwrap();
            tokio::time::sleep(Duration::from_millis(50 + rng() % 850)).await;
            sqlx::raw_sql("COMMIT").execute(&mut locker).await.unwrap();
            locks += 1;
        }
        tokio::time::sleep(Duration::from_millis(50 + rng() % 300)).await;
    }
    for w in workers {
        w.await.unwrap();
    }
    let failures = hist.failures();
    let timeouts = failures.iter().filter(|(_, o)| format!("{o:?}").contains("did not answer")).count();
    let direct = RunContext::new(sqlite(&path).await, &run);
    let report = final_pass_and_check(&direct, &hist, &keys).await;
    println!(
        "sqlite nemesis: {secs} s, {locks} write locks held, {checkpoints} checkpoints, {timeouts} calls timed out; {report}"
    );
    assert!(report.ops > 100, "the workers barely ran: {report}");
    assert!(timeouts > 0, "no call ever waited past the busy timeout: the nemesis did not bite ({report})");
}

/// PostgreSQL: 8 workers on 40 keys through two stores (two pools, as two hosts would have),
/// while the nemesis kills the server with SIGKILL and restarts it, stops it (SIGSTOP) past the
/// stores' timeout and resumes it, and locks the records table against writes for spans of 50
/// to 900 ms; then a final pass and the checker: no key's effect committed twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_nemesis_kill_pause_and_lock_contention() {
    let secs = nemesis_secs(20);
    let mut server = PgServer::start();
    let url = server.url();
    let store = || PostgresStore::builder(url.clone()).timeout(BUSY).max_connections(4).connect();
    let stores = [store().await.unwrap(), store().await.unwrap()];
    let run = unique("rel-postgres");
    let hist = History::new();
    let keys: Vec<String> = (0..40).map(|i| format!("k{i}")).collect();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    let mut workers = Vec::new();
    for w in 0..8u64 {
        let ctx = RunContext::new(stores[w as usize % 2].clone(), &run);
        workers.push(tokio::spawn(random_calls(ctx, hist.clone(), keys.clone(), deadline, w + 1)));
    }
    let mut rng = fastrand_like(99);
    let (mut kills, mut pauses, mut locks) = (0u32, 0u32, 0u32);
    while tokio::time::Instant::now() < deadline {
        match rng() % 4 {
            0 => {
                server.kill9();
                tokio::time::sleep(Duration::from_millis(100 + rng() % 400)).await;
                server.restart();
                kills += 1;
            }
            1 => {
                server.pause();
                tokio::time::sleep(Duration::from_millis(200 + rng() % 800)).await;
                server.resume();
                pauses += 1;
            }
            _ => {
                let mut conn = server.connection().await;
                sqlx::raw_sql("BEGIN; LOCK TABLE idempotent_records IN EXCLUSIVE MODE")
                    .execute(&mut conn)
                    .await
                    .unwrap();
                tokio::time::sleep(Duration::from_millis(50 + rng() % 850)).await;
                sqlx::raw_sql("COMMIT").execute(&mut conn).await.unwrap();
                locks += 1;
            }
        }
        tokio::time::sleep(Duration::from_millis(100 + rng() % 300)).await;
    }
    for w in workers {
        w.await.unwrap();
    }
    let failures = hist.failures().len();
    let direct = RunContext::new(store().await.unwrap(), &run);
    let report = final_pass_and_check(&direct, &hist, &keys).await;
    println!(
        "postgres nemesis: {secs} s, {kills} kills, {pauses} pauses, {locks} table locks, {failures} calls failed; {report}"
    );
    assert!(report.ops > 100, "the workers barely ran: {report}");
    assert!(kills > 0 && pauses > 0 && locks > 0, "every fault ran at least once");
    assert!(failures > 0, "no call ever failed: the nemesis did not bite ({report})");
}
