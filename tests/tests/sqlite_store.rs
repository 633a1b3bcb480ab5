//! `SqliteStore` beyond the conformance suite and the scenarios both SQL stores share
//! (`sql_store.rs`): contention between stores and processes on one file, durability across a
//! reopen, purging, a locked or unopenable file, statements per call and the write lock, and the
//! tests SQLite names its own way that call the shared scenarios.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use bytes::Bytes;
use idempotent_core::record::{Acquire, Transition};
use idempotent_core::{Error, Key, RunContext, SqliteStore, Store};
use idempotent_tests::acquire_order;
use idempotent_tests::matrix::{self, Database, Kind};
use idempotent_tests::sql::{SqlDb, SqliteBackend, wait_for_state};
use idempotent_tests::sql_store::{
    FP, KEEP, LEASE, fifty_replays_are_one_statement_each, first_execution_is_two_statements,
    garbage_rows_are_corrupt_errors_not_replays, key, pre_release_versions_are_refused, two_stores_race_to_resolve,
};
use sqlx::{Connection, SqliteConnection};
use tempfile::TempDir;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};

fn wide_key(n: u32) -> Key {
    let mut k = [7; 32];
    k[..4].copy_from_slice(&n.to_le_bytes());
    Key::from_bytes(k)
}

/// A plain sqlx connection on the file, outside any store.
async fn raw(path: &Path) -> SqliteConnection {
    SqliteConnection::connect(&format!("sqlite://{}?mode=rwc", path.display())).await.unwrap()
}

async fn count_rows(path: &Path, table: &str) -> i64 {
    let mut conn = raw(path).await;
    let sql = format!("SELECT count(*) FROM {table}");
    let n = sqlx::query_scalar(sqlx::AssertSqlSafe(sql)).fetch_one(&mut conn).await.unwrap();
    conn.close().await.unwrap();
    n
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_stores_on_one_file_acquire_each_key_exactly_once() {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("race.db");
    let stores = [
        SqliteStore::builder(&path).max_connections(4).connect().await.unwrap(),
        SqliteStore::builder(&path).max_connections(4).connect().await.unwrap(),
    ];
    let mut tasks = Vec::new();
    for task in 0..16usize {
        let store = stores[task % 2].clone();
        tasks.push(tokio::spawn(async move {
            let mut acquired = Vec::new();
            // 200 acquires in all: task t tries calls t, t + 16, …, each on key (call % 50).
            for call in (task..200).step_by(16) {
                let k = (call % 50) as u8;
                match store.acquire(&key(k), &FP, LEASE, KEEP).await.unwrap() {
                    Acquire::Acquired(_) => acquired.push(k),
                    Acquire::InFlight { .. } => {}
                    other => panic!("key {k}: {other:?}"),
                }
            }
            acquired
        }));
    }
    let mut per_key: HashMap<u8, u32> = HashMap::new();
    for t in tasks {
        for k in t.await.unwrap() {
            *per_key.entry(k).or_default() += 1;
        }
    }
    assert_eq!(per_key.len(), 50, "every key was acquired: {per_key:?}");
    assert!(per_key.values().all(|&n| n == 1), "a key was acquired twice: {per_key:?}");
    assert_eq!(count_rows(&path, "idempotent_records").await, 50);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_process_sees_in_flight_keys_and_replays_done_ones() {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("processes.db");
    let store = SqliteStore::connect(&path).await.unwrap();
    for n in [1, 2, 3] {
        assert!(matches!(store.acquire(&key(n), &FP, LEASE, KEEP).await.unwrap(), Acquire::Acquired(_)));
    }
    let Acquire::Acquired(done) = store.acquire(&key(4), &FP, LEASE, KEEP).await.unwrap() else { panic!() };
    assert_eq!(store.complete(&key(4), &done.token, Bytes::from_static(b"four"), KEEP).await.unwrap(), Transition::Ok);

    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_sqlite_child"))
        .arg(&path)
        .args(["1", "2", "3", "4", "5"])
        .output()
        .await
        .unwrap();
    assert!(out.status.success(), "child failed: {}", String::from_utf8_lossy(&out.stderr));
    let lines: Vec<String> = String::from_utf8(out.stdout).unwrap().lines().map(str::to_owned).collect();
    assert_eq!(lines, ["inflight", "inflight", "inflight", "replay:four", "acquired"]);
    // The child's lease on key 5 outlives the child: this process sees it in flight.
    assert!(matches!(store.acquire(&key(5), &FP, LEASE, KEEP).await.unwrap(), Acquire::InFlight { .. }));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_executor_runs_an_action_once_across_a_reopen() {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("durable.db");
    let runs = Arc::new(AtomicU32::new(0));
    for _reopen in 0..2 {
        let store = SqliteStore::connect(&path).await.unwrap();
        let ctx = RunContext::new(store.clone(), "order-7");
        let runs = runs.clone();
        let id: String = ctx
            .step("charge")
            .run(&("order-7", 1500), |attempt| async move {
                runs.fetch_add(1, Ordering::SeqCst);
                Ok::<_, Error>(format!("ch_{}", attempt.number()))
            })
            .await
            .unwrap();
        assert_eq!(id, "ch_1");
        store.close().await;
        drop(ctx);
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the second open replayed the stored result");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_records_are_purged_in_bounded_batches() {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("purge.db");
    let store = SqliteStore::connect(&path).await.unwrap();
    for n in 0..700u32 {
        let Acquire::Acquired(g) = store.acquire(&wide_key(n), &FP, LEASE, KEEP).await.unwrap() else { panic!() };
        if n % 2 == 0 {
            store.complete(&wide_key(n), &g.token, Bytes::from_static(b"r"), KEEP).await.unwrap();
        }
    }
    let Acquire::Acquired(live) = store.acquire(&key(0), &FP, LEASE, KEEP).await.unwrap() else { panic!() };
    // Every record but the live one expires at once, by hand: however long the loop above took,
    // the background purge it ran found nothing expired.
    let mut conn = raw(&path).await;
    sqlx::query("UPDATE idempotent_records SET expires_at = 0, lease_until = 0 WHERE key != ?1")
        .bind(&key(0).as_bytes()[..])
        .execute(&mut conn)
        .await
        .unwrap();
    conn.close().await.unwrap();
    let mut rows = count_rows(&path, "idempotent_records").await;
    assert!(rows > 256, "{rows} rows: the background purge ran before they expired?");
    let mut batches = 0;
    loop {
        let deleted = store.purge().await.unwrap();
        assert!(deleted <= 256, "a batch deleted {deleted} rows");
        let now = count_rows(&path, "idempotent_records").await;
        assert_eq!(now, rows - deleted as i64, "purge said {deleted}");
        rows = now;
        if deleted > 0 {
            batches += 1;
        } else if rows == 1 {
            break;
        }
        assert!(batches < 100, "the purge does not end");
    }
    assert!(batches >= 2, "{batches} batches");
    // The live record stays, and is still owned.
    assert!(matches!(store.acquire(&key(0), &FP, LEASE, KEEP).await.unwrap(), Acquire::InFlight { .. }));
    assert_eq!(store.complete(&key(0), &live.token, Bytes::new(), KEEP).await.unwrap(), Transition::Ok);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_execution_is_two_statements_a_replay_one_and_replays_in_a_row_take_no_write_lock() {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("count.db");
    let store = SqliteStore::connect(&path).await.unwrap();
    let ctx = RunContext::new(store.clone(), "run-1");
    first_execution_is_two_statements(&ctx, &store).await;

    let wal = dir.path().join("count.db-wal");
    let wal_size = std::fs::metadata(&wal).unwrap().len();
    fifty_replays_are_one_statement_each(&ctx, &store).await;
    assert_eq!(std::fs::metadata(&wal).unwrap().len(), wal_size, "replays wrote to the WAL");

    // After replays in a row acquire reads first, which takes no write lock: a replay answers
    // while another connection holds the file's write lock (the upsert would wait for it).
    let mut writer = raw(&path).await;
    sqlx::raw_sql("BEGIN IMMEDIATE").execute(&mut writer).await.unwrap();
    let replay = ctx.step("count").run(&1, |_| async { Ok::<_, Error>(9) });
    let n: u32 =
        tokio::time::timeout(Duration::from_secs(20), replay).await.expect("the replay waited for the lock").unwrap();
    assert_eq!(n, 7);
    sqlx::raw_sql("COMMIT").execute(&mut writer).await.unwrap();

    // A first execution after them: the read finds nothing, then the upsert and the complete.
    acquire_order::first_executions_switch_back_to_the_write(&ctx, "count", || store.statements(), (3, 2)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unopenable_or_locked_file_fails_closed_naming_the_path() {
    let dir = TempDir::new().unwrap();
    let missing = dir.path().join("no-such-dir").join("x.db");
    let err = SqliteStore::connect(&missing).await.unwrap_err();
    assert!(err.is_store_failure(), "{err:?}");
    assert!(matches!(err, Error::Unavailable { op: "open", .. }), "{err:?}");
    assert!(err.to_string().contains(&missing.display().to_string()), "{err}");

    let path = dir.path().join("locked.db");
    let store = SqliteStore::builder(&path).busy_timeout(Duration::from_millis(200)).connect().await.unwrap();
    let mut holder = raw(&path).await;
    sqlx::raw_sql("BEGIN EXCLUSIVE").execute(&mut holder).await.unwrap();
    let started = std::time::Instant::now();
    let err = store.acquire(&key(1), &FP, LEASE, KEEP).await.unwrap_err();
    assert!(matches!(err, Error::Timeout { op: "acquire", .. }), "{err:?}");
    assert!(err.is_store_failure() && err.to_string().contains(&path.display().to_string()), "{err}");
    assert!(started.elapsed() >= Duration::from_millis(150), "it waited for the lock: {:?}", started.elapsed());
    sqlx::raw_sql("ROLLBACK").execute(&mut holder).await.unwrap();
    assert!(matches!(store.acquire(&key(1), &FP, LEASE, KEEP).await.unwrap(), Acquire::Acquired(_)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_acquire_gives_back_the_key_it_took() {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("dropped.db");
    let store = SqliteStore::connect(&path).await.unwrap();
    // The write lock is held elsewhere, so the acquire's statement waits in SQLite's busy
    // handler when its caller gives up.
    let mut holder = raw(&path).await;
    sqlx::raw_sql("BEGIN EXCLUSIVE").execute(&mut holder).await.unwrap();
    let gave_up = tokio::time::timeout(Duration::from_millis(100), store.acquire(&key(1), &FP, LEASE, KEEP)).await;
    assert!(gave_up.is_err(), "the acquire answered while the file was locked: {gave_up:?}");
    sqlx::raw_sql("ROLLBACK").execute(&mut holder).await.unwrap();
    // The statement goes on and takes the key; then the key is released, not held for the lease
    // (the bound is far above the two commits it waits for, for a disk slow to sync).
    wait_for_state::<SqliteBackend>(&mut holder, &key(1), "released", Duration::from_secs(30)).await;
    let Acquire::Acquired(next) = store.acquire(&key(1), &FP, LEASE, KEEP).await.unwrap() else { panic!("not free") };
    assert_eq!((next.attempt.number(), next.attempt.recovered()), (2, false));
}

/// A done row without a result is a corrupt error (the scenario both stores share).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_garbage_row_is_a_corrupt_error_not_a_replay() {
    matrix::run(Kind::Sqlite, garbage_rows_are_corrupt_errors_not_replays::<SqliteBackend>).await;
}

/// Two OS processes × 32 tasks on one file, every task calling the step for each of 1000 keys
/// (enough writes that each store's batches run back to back for longer than it holds the lock
/// before it lets another process's writes in):
/// each key's action runs once in all (counted in a ledger both processes append to), and every
/// call in both processes returns that one execution's result.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_processes_of_32_tasks_run_each_action_once() {
    const KEYS: usize = 1000;
    let dir = TempDir::new().unwrap();
    let (db, ledger) = (dir.path().join("multi.db"), dir.path().join("ledger"));
    // The schema exists before the race (as after a deploy); creating it concurrently is covered
    // by the child-process test above.
    SqliteStore::connect(&db).await.unwrap().close().await;
    let spawn = || {
        tokio::process::Command::new(env!("CARGO_BIN_EXE_step_worker"))
            .arg(format!("sqlite://{}", db.display()))
            .arg(&ledger)
            .args(["32", &KEYS.to_string()])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let (mut a, mut b) = (spawn(), spawn());
    // Each opens its store and says so; then both start at once (a store's first executions
    // take less time than a process takes to start).
    let mut outs = Vec::new();
    for child in [&mut a, &mut b] {
        let mut out = tokio::io::BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        out.read_line(&mut line).await.unwrap();
        assert_eq!(line, "ready\n", "a worker did not start");
        outs.push(out);
    }
    for child in [&mut a, &mut b] {
        child.stdin.take().unwrap().write_all(b"go\n").await.unwrap();
    }
    let mut results: HashMap<String, Vec<String>> = HashMap::new();
    for (child, mut stdout) in [a, b].into_iter().zip(outs) {
        let mut rest = Vec::new();
        stdout.read_to_end(&mut rest).await.unwrap();
        let mut out = child.wait_with_output().await.unwrap();
        out.stdout = rest;
        assert!(out.status.success(), "a worker failed: {}", String::from_utf8_lossy(&out.stderr));
        for line in String::from_utf8(out.stdout).unwrap().lines() {
            let (key, result) = line.split_once('=').unwrap();
            results.entry(key.to_owned()).or_default().push(result.to_owned());
        }
    }
    let ledger = std::fs::read_to_string(&ledger).unwrap();
    let mut runs: HashMap<&str, u32> = HashMap::new();
    for line in ledger.lines() {
        *runs.entry(line.split(' ').next().unwrap()).or_default() += 1;
    }
    assert_eq!(runs.len(), KEYS, "some keys' actions never ran");
    let twice: Vec<_> = runs.iter().filter(|(_, n)| **n != 1).collect();
    assert!(twice.is_empty(), "actions ran more than once: {twice:?}");
    assert_eq!(results.len(), KEYS);
    for (key, seen) in &results {
        assert_eq!(seen.len(), 64, "key {key}: one call per task of each process");
        assert!(seen.iter().all(|r| r == &seen[0]), "key {key}: calls saw different results: {seen:?}");
    }
    let pids: std::collections::HashSet<&str> = ledger.lines().map(|l| l.split(' ').nth(1).unwrap()).collect();
    assert_eq!(pids.len(), 2, "both processes ran actions (they raced): {pids:?}");
}

/// Two stores (two pools) on one file resolve the same records at once, one as done and one as
/// not done: one wins each, and the record is as it said.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_stores_racing_to_resolve_a_record_have_one_winner() {
    matrix::run(Kind::Sqlite, two_stores_race_to_resolve::<SqliteBackend>).await;
}

/// The table of schema version 1, as idempotent-core 0.1 created it.
const V1_TABLE: &str = "CREATE TABLE idempotent_records (
    key BLOB PRIMARY KEY NOT NULL CHECK (length(key) = 32),
    fingerprint BLOB NOT NULL,
    state TEXT NOT NULL CHECK (state IN ('running', 'released', 'done')),
    token TEXT NOT NULL,
    fence INTEGER NOT NULL,
    attempt INTEGER NOT NULL,
    recovered INTEGER NOT NULL,
    lease_until INTEGER NOT NULL,
    expires_at INTEGER NOT NULL,
    result BLOB
);
CREATE TABLE idempotent_schema (name TEXT PRIMARY KEY NOT NULL, version INTEGER NOT NULL);
INSERT INTO idempotent_schema VALUES ('idempotent_records', 1)";

/// The table of schema version 2, as idempotent-core created it before labels and times.
const V2_TABLE: &str = "CREATE TABLE idempotent_records (
    key BLOB PRIMARY KEY NOT NULL CHECK (length(key) = 32),
    fingerprint BLOB NOT NULL,
    state TEXT NOT NULL CHECK (state IN ('running', 'released', 'done', 'needs_attention')),
    token TEXT NOT NULL,
    fence INTEGER NOT NULL,
    attempt INTEGER NOT NULL,
    recovered INTEGER NOT NULL,
    lease_until INTEGER NOT NULL,
    expires_at INTEGER NOT NULL,
    result BLOB
);
CREATE TABLE idempotent_schema (name TEXT PRIMARY KEY NOT NULL, version INTEGER NOT NULL);
INSERT INTO idempotent_schema VALUES ('idempotent_records', 2)";

/// The pre-release schema versions 1 and 2 were never published: a table marked with either is
/// refused with a clear error and left as it is, its records untouched. A table of the current
/// version changed by hand is refused too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_of_a_pre_release_version_or_changed_by_hand_is_refused_and_left_alone() {
    let database = Database::<SqliteBackend>::start().await;
    pre_release_versions_are_refused(&database, [(1, V1_TABLE), (2, V2_TABLE)]).await;

    // The current version, changed by hand: refused, and not altered.
    let mut conn = database.connect().await;
    let drop = "DROP TABLE idempotent_records;\nDROP TABLE idempotent_schema";
    SqliteBackend::exec(&mut conn, drop).await.unwrap();
    database.open().await.close().await;
    sqlx::raw_sql("ALTER TABLE idempotent_records DROP COLUMN updated_at").execute(&mut conn).await.unwrap();
    let err = SqliteBackend::open(&database.url).await.unwrap_err();
    assert!(matches!(&err, Error::Config(m) if m.contains("version 3") && m.contains("changed by hand")), "{err:?}");
}
