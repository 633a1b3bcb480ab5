//! Versioned shared state (`idempotent_core::state`) on every store, next to a raw floor in the
//! same run.
//!
//! ```text
//! cargo run --release -p idempotent-benches --bin state_bench [-- --seconds 2]
//! ```
//!
//! For memory, Redis (a throwaway `redis-server`), SQLite (a temporary file) and PostgreSQL (a
//! throwaway server), from one process:
//!
//! - uncontended commits per second: one task committing version after version with
//!   `RawState::commit_with_token` (a fresh token each), next to the floor: for Redis a trivial
//!   script doing the same compare-and-set on a hash (`HGET v`, compare, `HSET v d`), for SQL the
//!   same `UPDATE … SET version = version + 1, value = ? WHERE scope = ? AND version = ?` through
//!   the store's pool (our commit is a `SELECT` of the row and its token history, then that
//!   `UPDATE`);
//! - attempts per update (load, reduce, commit rounds) at p50 and p99 under 8-way and 64-way
//!   contention: that many tasks each adding 1 to one counter with `State::update` (default
//!   policy), 50 updates each.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::future::join_all;
use idempotent_core::redis::{self, Script};
use idempotent_core::state::{CommitToken, RawState, Scope, SharedStateStore, State, Version};
use idempotent_core::{MemoryStateStore, PostgresStore, RedisStore, SqliteStore};
use idempotent_tests::{PgServer, RedisServer};

fn seconds() -> Duration {
    let args: Vec<String> = std::env::args().collect();
    let secs = args.iter().position(|a| a == "--seconds").and_then(|i| args.get(i + 1)).and_then(|s| s.parse().ok());
    Duration::from_secs_f64(secs.unwrap_or(2.0))
}

/// Commits per second of our commit, one task, for `window`.
async fn ours(store: &SharedStateStore, window: Duration) -> f64 {
    let raw = RawState::new(store.clone(), Scope::new(format!("bench-{}", uuid())));
    let mut version = Version::ABSENT;
    let value = Bytes::from_static(b"{\"n\":1}");
    let started = Instant::now();
    let mut n = 0u64;
    while started.elapsed() < window {
        match raw.commit_with_token(version, value.clone(), &CommitToken::random()).await.unwrap() {
            idempotent_core::Commit::Committed { version: v, .. } => version = v,
            other => panic!("uncontended commit refused: {other:?}"),
        }
        n += 1;
    }
    n as f64 / started.elapsed().as_secs_f64()
}

fn uuid() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64
}

/// Attempts per update at p50 and p99, `tasks` tasks × `updates` updates on one counter.
async fn attempts(store: &SharedStateStore, tasks: usize, updates: usize) -> (u32, u32, f64) {
    let scope = Scope::new(format!("contended-{}", uuid()));
    let started = Instant::now();
    let all = join_all((0..tasks).map(|_| {
        let state: State<u64> = State::new(store.clone(), scope.clone());
        tokio::spawn(async move {
            let mut seen = Vec::with_capacity(updates);
            for _ in 0..updates {
                let u = state.update(|n| Ok::<_, idempotent_core::Error>(n.unwrap_or(0) + 1)).await.unwrap();
                seen.push(u.attempts);
            }
            seen
        })
    }))
    .await;
    let rate = (tasks * updates) as f64 / started.elapsed().as_secs_f64();
    let mut seen: Vec<u32> = all.into_iter().flat_map(Result::unwrap).collect();
    seen.sort_unstable();
    let at = |q: f64| seen[((seen.len() - 1) as f64 * q).round() as usize];
    let state: State<u64> = State::new(store.clone(), scope);
    assert_eq!(state.load().await.unwrap().value, Some((tasks * updates) as u64), "an update was lost or doubled");
    (at(0.5), at(0.99), rate)
}

const FLOOR_SCRIPT: &str = "local v = tonumber(redis.call('HGET', KEYS[1], 'v') or '0')\n\
    if v ~= tonumber(ARGV[1]) then return 0 end\n\
    redis.call('HSET', KEYS[1], 'v', string.format('%d', v + 1), 'd', ARGV[2])\n\
    return 1";

async fn redis_floor(url: &str, window: Duration) -> f64 {
    let client = redis::Client::open(url).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let script = Script::new(FLOOR_SCRIPT);
    let key = format!("floor:{}", uuid());
    let started = Instant::now();
    let mut n = 0u64;
    while started.elapsed() < window {
        let ok: i64 = script.key(&key).arg(n).arg(&b"{\"n\":1}"[..]).invoke_async(&mut conn).await.unwrap();
        assert_eq!(ok, 1);
        n += 1;
    }
    n as f64 / started.elapsed().as_secs_f64()
}

macro_rules! sql_floor {
    ($name:ident, $pool:ty, $p:literal) => {
        async fn $name(pool: &$pool, window: Duration) -> f64 {
            let t = format!("floor_{}", uuid());
            let create =
                format!("CREATE TABLE {t} (scope BLOB PRIMARY KEY, version BIGINT NOT NULL, value BLOB NOT NULL)")
                    .replace("BLOB", if $p == "$" { "bytea" } else { "BLOB" });
            sqlx::raw_sql(sqlx::AssertSqlSafe(create)).execute(pool).await.unwrap();
            let insert = format!("INSERT INTO {t} (scope, version, value) VALUES ({p}1, 0, {p}2)", p = $p);
            sqlx::query(sqlx::AssertSqlSafe(insert)).bind(&[1u8; 32][..]).bind(&b"{}"[..]).execute(pool).await.unwrap();
            let update = format!(
                "UPDATE {t} SET version = version + 1, value = {p}2 WHERE scope = {p}1 AND version = {p}3",
                p = $p
            );
            let started = Instant::now();
            let mut n = 0i64;
            while started.elapsed() < window {
                let done = sqlx::query(sqlx::AssertSqlSafe(update.clone()))
                    .bind(&[1u8; 32][..])
                    .bind(&b"{\"n\":1}"[..])
                    .bind(n)
                    .execute(pool)
                    .await
                    .unwrap();
                assert_eq!(done.rows_affected(), 1);
                n += 1;
            }
            n as f64 / started.elapsed().as_secs_f64()
        }
    };
}
sql_floor!(sqlite_floor, sqlx::SqlitePool, "?");
sql_floor!(postgres_floor, sqlx::PgPool, "$");

async fn report(name: &str, store: SharedStateStore, floor: Option<f64>, window: Duration) {
    let ours = ours(&store, window).await;
    let (p50_8, p99_8, rate_8) = attempts(&store, 8, 50).await;
    let (p50_64, p99_64, rate_64) = attempts(&store, 64, 50).await;
    let floor = floor.map_or("—".to_owned(), |f| format!("{f:.0} ({:.2}×)", ours / f));
    println!(
        "| {name} | {ours:.0} | {floor} | {p50_8} / {p99_8} ({rate_8:.0}/s) | {p50_64} / {p99_64} ({rate_64:.0}/s) |"
    );
}

#[tokio::main(flavor = "multi_thread")]
async fn main() {
    let window = seconds();
    println!(
        "| store | commits/s, 1 task | raw floor commits/s (ours ÷ floor) | attempts p50 / p99, 8 tasks (updates/s) | attempts p50 / p99, 64 tasks (updates/s) |"
    );
    println!("|---|---|---|---|---|");
    report("memory", Arc::new(MemoryStateStore::new()), None, window).await;

    let server = RedisServer::start();
    let store = RedisStore::connect_lazy(server.url()).unwrap();
    store.warm_up().await.unwrap();
    let floor = redis_floor(&server.url(), window).await;
    report("redis", Arc::new(store), Some(floor), window).await;

    let dir = tempfile::TempDir::new().unwrap();
    let store = SqliteStore::connect(dir.path().join("state.db")).await.unwrap();
    store.migrate_state().await.unwrap();
    let floor = sqlite_floor(store.pool(), window).await;
    report("sqlite", Arc::new(store), Some(floor), window).await;

    let pg = PgServer::start();
    let store = PostgresStore::connect(pg.url()).await.unwrap();
    store.migrate_state().await.unwrap();
    let floor = postgres_floor(store.pool(), window).await;
    report("postgres", Arc::new(store), Some(floor), window).await;
}
