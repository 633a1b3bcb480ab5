//! The SQL stores beyond the conformance suite, written once for SQLite and PostgreSQL:
//! contention between pools, schema checks, corrupt rows, statements per call, and records
//! that need attention (never purged, resolved once).
//!
//! The scenarios named like tests (generic over the backend, on an empty [`Database`]) run on
//! both databases from `tests/tests/sql_store.rs` (`on_every_store!(sql: …)`). The other
//! functions are parts of tests that `sqlite_store.rs` and `postgres_store.rs` keep under each
//! database's own name, or with steps only that database can take.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::future::join_all;
use idempotent_core::record::{Abandon, Acquire, Grant, Resolution, Resolved, Transition};
use idempotent_core::store::sql::SqlStore;
use idempotent_core::{Error, Fingerprint, Key, RunContext, SharedStore, Store};

use crate::contention;
use crate::matrix::Database;
use crate::sql::{SqlDb, wait_for_count, wait_for_state};

/// The fingerprint of every record of these tests.
pub const FP: Fingerprint = Fingerprint::from_bytes([1; 32]);
/// The lease of an acquisition.
pub const LEASE: Duration = Duration::from_secs(10);
/// The retention of an acquisition and a completion.
pub const KEEP: Duration = Duration::from_secs(60);

/// The key whose 32 bytes are `n`.
pub fn key(n: u8) -> Key {
    Key::from_bytes([n; 32])
}

/// Acquires `key` on `store` with `lease`, which must take it.
pub async fn acquired(store: &impl Store, key: &Key, lease: Duration) -> Grant {
    match store.acquire(key, &FP, lease, KEEP).await.expect("acquire") {
        Acquire::Acquired(g) => g,
        other => panic!("expected Acquired, got {other:?}"),
    }
}

/// Scenario: four stores (four pools) opened at once on a new database race to create the
/// table; then 64 tasks on them at one key run the action once.
pub async fn one_key_under_64_tasks_on_4_pools_runs_the_action_once<B: SqlDb>(database: Database<B>) {
    let opened = join_all((0..4).map(|_| B::open_pool(&database.url, 4))).await;
    let stores: Vec<SqlStore<B>> = opened.into_iter().collect::<Result<_, _>>().unwrap();
    let mut conn = database.connect().await;
    assert_eq!(B::count(&mut conn, "SELECT count(*) FROM idempotent_schema").await, 1);
    let shared: Vec<SharedStore> = stores.into_iter().map(|s| Arc::new(s) as SharedStore).collect();
    contention::one_key_runs_once(&shared, 64).await;
    assert_eq!(B::count(&mut conn, "SELECT count(*) FROM idempotent_records").await, 1);
}

/// Scenario: 200 keys by 8 callers on 2 stores (2 pools): 200 actions, each once, all done.
pub async fn two_hundred_keys_by_eight_callers_run_200_actions<B: SqlDb>(database: Database<B>) {
    let mut shared: Vec<SharedStore> = Vec::new();
    for _ in 0..2 {
        shared.push(Arc::new(B::open_pool(&database.url, 4).await.unwrap()));
    }
    contention::every_key_runs_once(&shared, 200, 8).await;
    let mut conn = database.connect().await;
    assert_eq!(B::count(&mut conn, "SELECT count(*) FROM idempotent_records").await, 200);
    assert_eq!(B::count(&mut conn, "SELECT count(*) FROM idempotent_records WHERE state = 'done'").await, 200);
}

/// Scenario: a record that needs attention outlives the lease and retention it was acquired
/// with: the purge deletes an expired neighbour in the same batch, and keeps it; it is resolved
/// later.
pub async fn purge_never_removes_a_record_that_needs_attention<B: SqlDb>(database: Database<B>) {
    let store = database.open().await;
    let short = Duration::from_millis(300);
    let Acquire::Acquired(marked) = store.acquire(&key(1), &FP, short, short).await.unwrap() else { panic!() };
    let Acquire::Acquired(_) = store.acquire(&key(2), &FP, short, short).await.unwrap() else { panic!() };
    assert_eq!(store.abandon(&key(1), &marked.token, Abandon::NeedsAttention).await.unwrap(), Transition::Ok);
    // Key 2, acquired after key 1 with the same lease and retention, has expired: so has what
    // key 1 was acquired with.
    let mut conn = database.connect().await;
    let expired = format!("SELECT count(*) FROM idempotent_records WHERE expires_at <= {}", B::CLOCK_US);
    wait_for_count::<B>(&mut conn, &expired, 1).await;
    assert_eq!(store.purge().await.unwrap(), 1, "the expired neighbour");
    let left = B::records(&mut conn).await;
    assert_eq!(left, [(key(1).as_bytes().to_vec(), "needs_attention".to_owned(), 1)]);
    // A whole new pass finds nothing to delete either.
    for _ in 0..2 {
        assert_eq!(store.purge().await.unwrap(), 0);
    }
    let waiting = Acquire::NeedsAttention { attempt: 1, fence: marked.attempt.fence() };
    assert_eq!(store.acquire(&key(1), &FP, LEASE, KEEP).await.unwrap(), waiting);
    let done = Resolution::Done { outcome: Bytes::from_static(b"checked"), retention: KEEP };
    assert_eq!(store.resolve(&key(1), done).await.unwrap(), Resolved::Ok);
    assert_eq!(
        store.acquire(&key(1), &FP, LEASE, KEEP).await.unwrap(),
        Acquire::Replay(Bytes::from_static(b"checked"))
    );
}

/// Scenario: a table of the records' name that this crate did not create is refused, saying
/// what to do, and not altered; another table works, and is refused once marked with a newer
/// version or changed by hand.
pub async fn an_incompatible_table_is_refused_and_left_alone<B: SqlDb>(database: Database<B>) {
    let mut conn = database.connect().await;
    B::exec(&mut conn, "CREATE TABLE idempotent_records (id integer PRIMARY KEY, body text)").await.unwrap();
    let err = B::open(&database.url).await.unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, Error::Config(_)), "{err:?}");
    assert!(msg.contains("idempotent_records") && msg.contains("not created by idempotent-core"), "{msg}");
    assert!(msg.contains(B::TABLE_SETTER), "says what to do: {msg}");
    assert_eq!(B::column_names(&mut conn, "idempotent_records").await, ["id", "body"], "the table was altered");

    // Another table works; marked with a newer version, or changed by hand, it is refused.
    let store = B::open_table(&database.url, "records").await.unwrap();
    store.close().await;
    B::exec(&mut conn, "UPDATE idempotent_schema SET version = 4 WHERE name = 'records'").await.unwrap();
    let err = B::open_table(&database.url, "records").await.unwrap_err();
    assert!(matches!(&err, Error::Config(m) if m.contains("version 4")), "{err:?}");
    let (change, says) = B::CHANGED_BY_HAND;
    let changed = format!("UPDATE idempotent_schema SET version = 3 WHERE name = 'records';\n{change}");
    B::exec(&mut conn, &changed).await.unwrap();
    let err = B::open_table(&database.url, "records").await.unwrap_err();
    assert!(matches!(&err, Error::Config(m) if m.contains("changed by hand") && m.contains(says)), "{err:?}");
}

/// Scenario: a table name that is not an identifier (or is the schema registry's) is refused
/// before anything is created or dropped; a valid unusual name is quoted everywhere.
pub async fn a_table_name_that_is_not_an_identifier_is_refused<B: SqlDb>(database: Database<B>) {
    let mut conn = database.connect().await;
    B::exec(&mut conn, "CREATE TABLE y (a integer)").await.unwrap();
    for bad in ["x; DROP TABLE y", "y\"; DROP TABLE y; --", "2x", "idempotent_schema"] {
        let err = B::open_table(&database.url, bad).await.unwrap_err();
        assert!(matches!(&err, Error::Config(m) if m.contains(&format!("{bad:?}"))), "{err:?}");
    }
    assert_eq!(B::strings(&mut conn, B::TABLES).await, ["y"], "nothing was created or dropped");
    // A valid unusual name is quoted everywhere.
    let store = B::open_table(&database.url, "Select").await.unwrap();
    let g = acquired(&store, &key(1), LEASE).await;
    assert_eq!(store.complete(&key(1), &g.token, Bytes::from_static(b"q"), KEEP).await.unwrap(), Transition::Ok);
    assert_eq!(B::count(&mut conn, "SELECT count(*) FROM \"Select\"").await, 1);
}

/// A done row without a result, written by hand, is a corrupt error, not a replay (nor a store
/// failure); a released row whose attempt number is out of range fails the acquire that takes
/// it, which gives the key back.
pub async fn garbage_rows_are_corrupt_errors_not_replays<B: SqlDb>(database: Database<B>) {
    let store = database.open().await;
    let mut conn = database.connect().await;
    // A done row without a result, written by hand, under a live expiry.
    let garbage = "INSERT INTO idempotent_records VALUES ($1, $2, 'done', 'someone', 1, 1, false, 0, \
                   9000000000000000, NULL, '', NULL, NULL, 0, 0)";
    B::execute_bytes(&mut conn, garbage, &[key(9).as_bytes(), FP.as_bytes()]).await;
    let err = store.acquire(&key(9), &FP, LEASE, KEEP).await.unwrap_err();
    assert!(matches!(&err, Error::Corrupt { detail, .. } if detail.contains("without a result")), "{err:?}");
    assert!(!err.is_store_failure());
    assert!(err.to_string().contains("corrupt") && err.to_string().contains("was not replayed"), "{err}");

    // A released row whose attempt number is out of range: the acquire that takes it cannot
    // report the attempt, fails, and gives the key back.
    let grant = acquired(&store, &key(8), LEASE).await;
    store.release(&key(8), &grant.token).await.unwrap();
    let out_of_range = "UPDATE idempotent_records SET attempt = 1099511627776 WHERE key = $1";
    B::execute_bytes(&mut conn, out_of_range, &[key(8).as_bytes()]).await;
    let err = store.acquire(&key(8), &FP, LEASE, KEEP).await.unwrap_err();
    assert!(matches!(&err, Error::Corrupt { detail, .. } if detail.contains("out of range")), "{err:?}");
    let attempt = wait_for_state::<B>(&mut conn, &key(8), "released", Duration::from_secs(5)).await;
    assert_eq!(attempt, 1_099_511_627_777);
}

/// Two stores (two pools) on the database resolve the same records at once, one as done and
/// one as not done: one wins each, and the record is as it said.
pub async fn two_stores_race_to_resolve<B: SqlDb>(database: Database<B>) {
    let a: SharedStore = Arc::new(database.open().await);
    let b: SharedStore = Arc::new(database.open().await);
    contention::resolve_races_have_one_winner(&a, &b, 32).await;
}

/// The pre-release schema versions 1 and 2 were never published: a table marked with either
/// (`tables`: each version, and the DDL of its table and registration) is refused with a clear
/// error and left as it is, its records untouched.
pub async fn pre_release_versions_are_refused<B: SqlDb>(database: &Database<B>, tables: [(i64, &str); 2]) {
    let mut conn = database.connect().await;
    for (n, ddl) in tables {
        let drop = "DROP TABLE IF EXISTS idempotent_records;\nDROP TABLE IF EXISTS idempotent_schema";
        B::exec(&mut conn, drop).await.unwrap();
        B::exec(&mut conn, ddl).await.unwrap();
        let old = "INSERT INTO idempotent_records VALUES ($1, $2, 'done', 'old-token', 5, 2, false, 0, \
                   9000000000000000, $3)";
        B::execute_bytes(&mut conn, old, &[key(1).as_bytes(), FP.as_bytes(), b"old"]).await;
        let err = B::open(&database.url).await.unwrap_err();
        assert!(
            matches!(&err, Error::Config(m) if m.contains(&format!("version {n}")) && m.contains("reads version 3 only")
                && m.contains(B::TABLE_SETTER)),
            "{err:?}"
        );
        let version = B::count(&mut conn, "SELECT CAST(version AS bigint) FROM idempotent_schema").await;
        assert_eq!(version, n, "the table was upgraded");
        let columns = B::column_names(&mut conn, "idempotent_records").await;
        assert_eq!(columns.len(), 10, "the table was altered: {columns:?}");
        assert_eq!(B::count(&mut conn, "SELECT count(*) FROM idempotent_records").await, 1);
    }
}

/// The first execution of the step `count` on `ctx` (on a new `store`) is two statements:
/// acquire's upsert, then the complete.
pub async fn first_execution_is_two_statements<B: SqlDb>(ctx: &RunContext, store: &SqlStore<B>) {
    let before = store.statements();
    let n: u32 = ctx.step("count").run(&1, |_| async { Ok::<_, Error>(7) }).await.unwrap();
    // A new store runs acquire's upsert first: it takes the key and answers in one statement.
    assert_eq!((n, store.statements() - before), (7, 2), "first execution: acquire's upsert, complete");
}

/// 50 replays of the step of [`first_execution_is_two_statements`]: one statement each (the
/// first ones acquire's upsert, which finds the row done and writes nothing; the later ones its
/// read).
pub async fn fifty_replays_are_one_statement_each<B: SqlDb>(ctx: &RunContext, store: &SqlStore<B>) {
    for _ in 0..50 {
        let before = store.statements();
        let n: u32 = ctx.step("count").run(&1, |_| async { Ok::<_, Error>(8) }).await.unwrap();
        assert_eq!((n, store.statements() - before), (7, 1), "a replay is one statement: the acquire alone");
    }
}
