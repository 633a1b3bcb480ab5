//! The SQL rows: the executor on `SqliteStore` (a file in the temporary directory) and on
//! `PostgresStore` (a throwaway server the tests' harness spawns), next to sqlx's own floor on
//! the same database: one `SELECT` of a stored row for a replay, an `INSERT` and an `UPDATE` of a
//! fresh row for a first execution.

use std::hint::black_box;

use idempotent_benches::Refund;
use idempotent_core::{PostgresStore, RunContext, SqliteStore};
use idempotent_tests::PgServer;

use super::{first, fresh_payloads, per_call, replay, row};

/// The SQL rows, in the order [`sql_rows`] prints them.
pub(crate) const SQL_ROWS: [&str; 8] = [
    "floor: sqlx `SELECT` of one row (SQLite)",
    "SqliteStore, executor, replay",
    "floor: sqlx `INSERT` + `UPDATE` (SQLite)",
    "SqliteStore, executor, first execution",
    "floor: sqlx `SELECT` of one row (PostgreSQL)",
    "PostgresStore, executor, replay",
    "floor: sqlx `INSERT` + `UPDATE` (PostgreSQL)",
    "PostgresStore, executor, first execution",
];

const FLOOR_TABLE: &str = "CREATE TABLE IF NOT EXISTS alloc_floor (key BYTEA PRIMARY KEY, v BYTEA)";
const FLOOR_SELECT: &str = "SELECT v FROM alloc_floor WHERE key = $1";
const FLOOR_INSERT: &str = "INSERT INTO alloc_floor (key, v) VALUES ($1, NULL)";
const FLOOR_UPDATE: &str = "UPDATE alloc_floor SET v = $2 WHERE key = $1";

/// A key of the floor's table.
fn floor_key(i: u64) -> Vec<u8> {
    i.to_be_bytes().to_vec()
}

/// The four rows of one database: the same statements on either pool type.
macro_rules! rows {
    ($calls:expr, $want:expr, $store:expr, $pool:expr, [$select:expr, $replay:expr, $write:expr, $first:expr]) => {{
        let (calls, pool) = ($calls, &$pool);
        let store = $store;
        let ctx = RunContext::new(store.clone(), "alloc-run");
        // Statements per call of ours: the store's own count over a row's calls (and as many
        // warm-up calls, which take the same path).
        let statements = |before: u64| (store.statements() - before) as f64 / (2 * calls) as f64;
        // Replays cycle through 1000 stored rows, ours and the floor's.
        let stored: Vec<Refund> = (0..1000).map(Refund::new).collect();
        for (i, payload) in stored.iter().enumerate() {
            first(&ctx, "replayed_refund", payload).await;
            sqlx::query(FLOOR_INSERT).bind(floor_key(i as u64)).execute(pool).await.unwrap();
            sqlx::query(FLOOR_UPDATE).bind(floor_key(i as u64)).bind(&b"stored"[..]).execute(pool).await.unwrap();
        }
        let mut floor_read = None;
        if $want($select) {
            let floor = per_call(calls, |i| async move {
                let row: (Option<Vec<u8>>,) =
                    sqlx::query_as(FLOOR_SELECT).bind(floor_key(i % 1000)).fetch_one(pool).await.unwrap();
                black_box(row);
            })
            .await;
            row($select, floor, None);
            floor_read = Some(floor);
        }
        if $want($replay) {
            let before = store.statements();
            let ours = per_call(calls, |i| replay(&ctx, "replayed_refund", &stored[(i % 1000) as usize])).await;
            row(&format!("{} ({:.1} statements per call)", $replay, statements(before)), ours, floor_read);
        }
        let mut floor_write = None;
        if $want($write) {
            let floor = per_call(calls, |i| async move {
                let key = floor_key(1_000_000 + i);
                sqlx::query(FLOOR_INSERT).bind(&key).execute(pool).await.unwrap();
                sqlx::query(FLOOR_UPDATE).bind(&key).bind(&b"stored"[..]).execute(pool).await.unwrap();
            })
            .await;
            row($write, floor, None);
            floor_write = Some(floor);
        }
        if $want($first) {
            let fresh = fresh_payloads(calls);
            let before = store.statements();
            let ours = per_call(calls, |i| first(&ctx, "issue_refund", &fresh[i as usize])).await;
            row(&format!("{} ({:.1} statements per call)", $first, statements(before)), ours, floor_write);
        }
    }};
}

/// SQLite and PostgreSQL rows (`calls` per row; the SQL stores commit each first execution, so
/// fewer calls than the in-memory rows need).
pub(crate) async fn sql_rows(calls: u64, want: &impl Fn(&str) -> bool) {
    let [s_select, s_replay, s_write, s_first, p_select, p_replay, p_write, p_first] = SQL_ROWS;
    if [s_select, s_replay, s_write, s_first].iter().any(|name| want(name)) {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let store = SqliteStore::connect(dir.path().join("alloc.db")).await.expect("open the SQLite store");
        let pool = store.pool().clone();
        sqlx::query(FLOOR_TABLE).execute(&pool).await.unwrap();
        rows!(calls, want, store, pool, [s_select, s_replay, s_write, s_first]);
    }
    if [p_select, p_replay, p_write, p_first].iter().any(|name| want(name)) {
        let server = PgServer::start();
        let store = PostgresStore::connect(server.url()).await.expect("connect to the PostgreSQL store");
        let pool = store.pool().clone();
        sqlx::query(FLOOR_TABLE).execute(&pool).await.unwrap();
        rows!(calls, want, store, pool, [p_select, p_replay, p_write, p_first]);
    }
}
