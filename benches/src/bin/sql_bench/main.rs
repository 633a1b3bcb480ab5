//! The SQL stores through the executor, next to the floor their database sets through the same
//! driver and pool settings, and next to a peer crate's store, in one run.
//!
//! ```text
//! cargo run --release -p idempotent-benches --bin sql_bench [-- --seconds 2 --rounds 3 --records 10000,1000000]
//! ```
//!
//! For the database under test (SQLite by default; PostgreSQL instead with `--postgres <url>`, on
//! tables of the bench's own there: see [`PostgresTarget`]), at concurrency 1 and 64, from one
//! process and one runtime:
//!
//! - first execution (a fresh payload) and replay (a payload already done) through
//!   `RunContext::step(..).run(..)` with a trivial action on our store, and the store's
//!   `acquire` + `complete` without the executor (diagnostic rows, as are the next three);
//! - on PostgreSQL, acquire's row read alone by a `SELECT` on our table (what a replay costs
//!   without the acquire statement's upsert; `SqliteStore::acquire` reads first already, so its
//!   replay row is that read), a no-op upsert `RETURNING` on the floor's table (a write statement
//!   that changes nothing), and on SQLite the first-execution floor with its writes queued on one
//!   lock of the process instead of in SQLite's busy handler;
//! - the floor, on a table made from our store's (its definition, under another name: the same
//!   columns, constraints and indexes), through the same driver (sqlx) with the
//!   store's connection and pool settings (for SQLite: WAL, `synchronous = FULL`, 8 connections,
//!   5 s busy timeout, no ping before a statement), each statement in autocommit and by primary
//!   key: for a first execution `INSERT … ON CONFLICT DO NOTHING` + `UPDATE … WHERE key = ?`, for
//!   a replay `SELECT … WHERE key = ?`;
//! - the peer, `agent-effects` 0.2.0 with its SQLite store (`agent-effects-sqlite`, opened with the
//!   settings of its own `SqliteStore::open`), on the same payload with a trivial action; its
//!   logical keys are 32 random hex characters, as ours are random hashes;
//! - what one call costs the database, in a counting pass of [`COUNT_CALLS`] calls of each row at
//!   concurrency 1 after the timed rounds: statements (ours: `SqliteStore::statements()`; floor and
//!   peer: the statements sqlx logs, which leave out `BEGIN`/`COMMIT`), write transactions
//!   committed (an SQLite commit hook on every connection of the floor's and the peer's pools; our
//!   store's pool is its own), rows written (an update hook, likewise), and WAL bytes appended
//!   (`PRAGMA wal_checkpoint` frame counts before and after, with a read snapshot held so that the
//!   WAL cannot restart in between; the same for all three);
//! - bytes per stored record (`dbstat` of the records' table and its indexes, and the file's
//!   size, after a `TRUNCATE` checkpoint);
//! - first executions per second with `--records` records already stored (default 10 000 and
//!   1 000 000), on fresh files prefilled with one `INSERT … SELECT` of realistic done rows each
//!   (random keys and fingerprints, a 32-character token, the stored result the executor writes;
//!   the peer's rows are copies of one of its real done effects with its audit events).
//!
//! Rows are interleaved round by round (every row once, then every row again …) so that noise
//! from other processes lands on all rows alike; calls/s is the median of the rounds, p50/p99 are
//! over all rounds' calls together.
//!
//! Options: `--seconds` per row and round (2), `--rounds` (3), `--concurrency` (`1,64`),
//! `--workers` (tokio worker threads, the cores), `--only <part of a row name>`, `--records` (a
//! list; `none` skips that part), `--dir` (where the database files go; default a new directory
//! under the system's temp dir, removed at the end), `--no-peer`.

use std::collections::BTreeMap;
use std::future::Future;
use std::hint::black_box;
use std::path::{Path as FsPath, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use agent_effects::{EffectFailure, EffectOutcome, EffectStore};
use bytes::Bytes;
use idempotent_benches::{
    Refund, RefundResult, Rounds, RunOptions, Sample, arg, closed_loop, flag, fmt_rate, process_cpu,
};
use idempotent_core::record::{Acquire, Transition};
use idempotent_core::{
    DEFAULT_LEASE, DEFAULT_RETENTION, Error, Fingerprint, Key, PostgresStore, RunContext, SharedStore, SqliteStore,
};
use sqlx::postgres::{PgPool, PgPoolOptions};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{AssertSqlSafe, Row, SqlSafeStr, SqlStr};
use tracing::subscriber::Interest;
use tracing::{Metadata, Subscriber};
use tracing_subscriber::layer::{Context, SubscriberExt};

#[macro_use]
mod floor;
mod env;
mod postgres;
mod sqlite;
mod target;

pub(crate) use env::*;
pub(crate) use floor::*;
pub(crate) use postgres::*;
pub(crate) use sqlite::*;
pub(crate) use target::*;

/// Payloads made done before the timed rounds, which the replay rows cycle through.
const REPLAY_KEYS: u64 = 1024;
/// Calls of each row in the counting pass.
const COUNT_CALLS: u64 = 200;
/// The `SqliteStore` builder's defaults, which the store under test is opened with and the floor's
/// pool copies.
const MAX_CONNECTIONS: u32 = 8;
const BUSY_TIMEOUT: Duration = Duration::from_secs(5);

/// Counts, through `tracing`, the statements sqlx logs (target `sqlx::query`, one event per
/// statement executed through its query API: not the `BEGIN`/`COMMIT` of its transactions).
/// Off except in the counting pass: building the event costs more than the statement's lookup.
struct SqlxStatements;

static COUNTING: AtomicBool = AtomicBool::new(false);
static SQLX_STATEMENTS: AtomicU64 = AtomicU64::new(0);

impl<S: Subscriber> tracing_subscriber::Layer<S> for SqlxStatements {
    fn register_callsite(&self, meta: &'static Metadata<'static>) -> Interest {
        if meta.target() == "sqlx::query" { Interest::sometimes() } else { Interest::never() }
    }

    fn enabled(&self, meta: &Metadata<'_>, _: Context<'_, S>) -> bool {
        meta.target() == "sqlx::query" && COUNTING.load(Ordering::Relaxed)
    }

    fn on_event(&self, _: &tracing::Event<'_>, _: Context<'_, S>) {
        SQLX_STATEMENTS.fetch_add(1, Ordering::Relaxed);
    }
}

/// What one call of a row cost the database, from the counting pass.
#[derive(Debug, Clone, Copy)]
struct Counted {
    /// Ours: `statements()`; floor and peer: the statements sqlx logged.
    statements: f64,
    /// The statements sqlx logged (a cross-check of ours).
    sqlx: f64,
    commits: Option<f64>,
    rows: Option<f64>,
    wal_bytes: f64,
}

async fn count_pass<T: Target>(env: &Arc<Env<T>>, path: Path) -> Counted {
    let side = path.side();
    let probe = env.target.probe(side).await;
    let (ours0, sqlx0) = (env.target.statements(), SQLX_STATEMENTS.load(Ordering::Relaxed));
    COUNTING.store(true, Ordering::Relaxed);
    for i in 0..COUNT_CALLS {
        env.call(path, 0, i).await;
    }
    COUNTING.store(false, Ordering::Relaxed);
    let (ours1, sqlx1) = (env.target.statements(), SQLX_STATEMENTS.load(Ordering::Relaxed));
    let written = env.target.probe_end(side, probe).await;
    let n = COUNT_CALLS as f64;
    let sqlx = (sqlx1 - sqlx0) as f64 / n;
    Counted {
        statements: if path.through_store() { (ours1 - ours0) as f64 / n } else { sqlx },
        sqlx,
        commits: written.commits.map(|c| c as f64 / n),
        rows: written.rows.map(|r| r as f64 / n),
        wal_bytes: written.wal_bytes as f64 / n,
    }
}

struct TimedRow {
    rounds: Rounds,
    cpu: Duration,
}

fn show(r: Option<f64>, digits: usize) -> String {
    r.map(|r| format!("{r:.digits$}")).unwrap_or_else(|| "—".to_owned())
}

fn print_storage(storage: &[(Side, Storage)]) {
    println!(
        "| store | records | file bytes / record | pages (tables + indexes) bytes / record | of which payload | b-trees |"
    );
    println!("|---|--:|--:|--:|--:|---|");
    for (side, s) in storage {
        let per = |b: u64| b as f64 / s.records.max(1) as f64;
        let payload: u64 = s.btrees.iter().map(|b| b.2).sum();
        let list: Vec<String> = s.btrees.iter().map(|(name, pages, _)| format!("{name} {:.0}", per(*pages))).collect();
        println!(
            "| {} | {} | {:.0} | {:.0} | {:.0} | {} |",
            side.label(),
            fmt_rate(s.records as f64),
            per(s.file_bytes),
            per(s.page_bytes()),
            per(payload),
            list.join(", ")
        );
    }
    println!();
}

/// The timed rows, the counting pass and the storage of one target; then first executions at
/// each record count on a fresh instance from `fresh`.
async fn bench<T: Target, F, Fut>(opts: &Opts, target: T, fresh: F)
where
    F: FnOnce() -> Fut,
    Fut: Future<Output = T>,
{
    let describe = target.describe().await;
    let has_peer = target.peer().is_some();
    let setup = Instant::now();
    let env = Arc::new(Env::new(target, true).await);
    eprintln!("setup: {REPLAY_KEYS} done records per store in {:.1} s", setup.elapsed().as_secs_f64());

    let paths: Vec<Path> = Path::ALL
        .iter()
        .copied()
        // `--only` keeps the floor of each row it picks, so that the ratio is there.
        .filter(|p| {
            Path::ALL.iter().any(|q| q.label().contains(opts.only.as_str()) && (q == p || q.floor() == Some(*p)))
        })
        .filter(|p| has_peer || !p.is_peer())
        .filter(|p| T::SINGLE_WRITER || *p != Path::FloorFirstGated)
        .filter(|p| T::READ_FIRST || *p != Path::ReadFirstReplay)
        .collect();
    let mut table: BTreeMap<(usize, Path), TimedRow> = BTreeMap::new();
    let started = Instant::now();
    for round in 0..opts.rounds {
        for &concurrency in &opts.concurrencies {
            for &path in &paths {
                run(&env, path, concurrency, opts.warmup).await;
                let cpu0 = process_cpu();
                let sample = run(&env, path, concurrency, opts.duration).await;
                let cpu = process_cpu().saturating_sub(cpu0);
                eprintln!(
                    "round {}/{} c={concurrency:<3} {:<48} {:>9} calls/s",
                    round + 1,
                    opts.rounds,
                    path.label(),
                    fmt_rate(sample.rate())
                );
                let row = table
                    .entry((concurrency, path))
                    .or_insert_with(|| TimedRow { rounds: Rounds::default(), cpu: Duration::ZERO });
                row.cpu += cpu;
                row.rounds.push(sample);
            }
        }
    }
    let mut counted = BTreeMap::new();
    for &path in &paths {
        counted.insert(path, count_pass(&env, path).await);
    }

    println!(
        "\nsql_bench: {describe}; tokio {} workers, {} rounds × {} s per row (interleaved), {:.0} s\n",
        opts.workers,
        opts.rounds,
        opts.duration.as_secs_f64(),
        started.elapsed().as_secs_f64()
    );
    let rate = |c: usize, p: Path| table.get(&(c, p)).map(|row| row.rounds.median_rate());
    let ratio = |c: usize, p: Path| match (rate(c, p), p.floor().and_then(|f| rate(c, f))) {
        (Some(o), Some(f)) => Some(o / f),
        _ => None,
    };
    for &concurrency in &opts.concurrencies {
        println!("concurrency {concurrency}\n");
        println!(
            "| path | calls/s (median) | min–max of rounds | p50 µs | p99 µs | ÷ floor | statements/call \
             | write commits/call | rows written/call | WAL bytes/call | CPU µs/call |"
        );
        println!("|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|");
        for ((_, path), row) in table.range((concurrency, Path::OursFirst)..=(concurrency, Path::PeerReplay)) {
            let (lo, hi) = row.rounds.rate_range();
            let c = counted.get(path);
            println!(
                "| {} | {} | {}–{} | {:.0} | {:.0} | {} | {} | {} | {} | {} | {:.1} |",
                path.label(),
                fmt_rate(row.rounds.median_rate()),
                fmt_rate(lo),
                fmt_rate(hi),
                row.rounds.quantile_us(0.50),
                row.rounds.quantile_us(0.99),
                show(ratio(concurrency, *path), 2),
                show(c.map(|c| c.statements), 2),
                show(c.and_then(|c| c.commits), 2),
                show(c.and_then(|c| c.rows), 2),
                show(c.map(|c| c.wal_bytes), 0),
                row.cpu.as_secs_f64() * 1e6 / row.rounds.calls() as f64,
            );
        }
        println!();
    }
    println!("Counting pass ({COUNT_CALLS} calls per row, concurrency 1): statements sqlx logged per call");
    for (path, c) in &counted {
        println!("- {}: {:.2}", path.label(), c.sqlx);
    }
    let c = *opts.concurrencies.last().unwrap();
    println!("\nTargets (ours ÷ floor ≥ 0.8):");
    for &concurrency in &opts.concurrencies {
        for path in [Path::OursFirst, Path::OursReplay] {
            let r = ratio(concurrency, path);
            let verdict = match r {
                Some(r) if r >= 0.8 => "met",
                Some(_) => "MISSED",
                None => "not measured",
            };
            println!("- c={concurrency} {}: {}× ({verdict})", path.label(), show(r, 2));
        }
    }
    if has_peer {
        println!("\nPeer ÷ ours (c={c}):");
        for (ours, peer) in [(Path::OursFirst, Path::PeerFirst), (Path::OursReplay, Path::PeerReplay)] {
            if let (Some(o), Some(p)) = (rate(c, ours), rate(c, peer)) {
                println!("- {}: {:.2}", peer.label(), p / o);
            }
        }
    }
    println!("\nStorage after the rows above:\n");
    let mut storage = Vec::new();
    for side in Side::ALL {
        if side != Side::Peer || has_peer {
            storage.push((side, env.target.storage(side).await));
        }
    }
    print_storage(&storage);
    drop(env);

    if opts.records.is_empty() {
        return;
    }
    let env = Arc::new(Env::new(fresh().await, false).await);
    let first: Vec<Path> =
        [Path::OursFirst, Path::FloorFirst, Path::PeerFirst].into_iter().filter(|p| has_peer || !p.is_peer()).collect();
    println!(
        "First executions by records already stored (fresh files, prefilled; {} rounds × {} s per row, interleaved):\n",
        opts.rounds,
        opts.duration.as_secs_f64()
    );
    println!(
        "| records | prefill s | concurrency | ours calls/s | floor calls/s | ours ÷ floor | peer calls/s | peer ÷ floor |"
    );
    println!("|--:|--:|--:|--:|--:|--:|--:|--:|");
    let mut storage = Vec::new();
    for &records in &opts.records {
        let t0 = Instant::now();
        if has_peer {
            // The peer's prefill copies one of its own done effects: make one.
            env.call(Path::PeerFirst, 0, 0).await;
        }
        for &side in &[Side::Ours, Side::Floor, Side::Peer][..if has_peer { 3 } else { 2 }] {
            let t = Instant::now();
            let added = env.target.prefill(side, records, &env.stored).await;
            eprintln!(
                "prefill {}: {} rows in {:.1} s",
                side.label(),
                fmt_rate(added as f64),
                t.elapsed().as_secs_f64()
            );
        }
        let prefill = t0.elapsed();
        let mut rates: BTreeMap<(usize, Path), Rounds> = BTreeMap::new();
        for round in 0..opts.rounds {
            for &concurrency in &opts.concurrencies {
                for &path in &first {
                    run(&env, path, concurrency, opts.warmup).await;
                    let s = run(&env, path, concurrency, opts.duration).await;
                    eprintln!(
                        "{records} records, round {}/{} c={concurrency:<3} {:<48} {:>9} calls/s",
                        round + 1,
                        opts.rounds,
                        path.label(),
                        fmt_rate(s.rate())
                    );
                    rates.entry((concurrency, path)).or_default().push(s);
                }
            }
        }
        for &concurrency in &opts.concurrencies {
            let rate = |p: Path| rates.get(&(concurrency, p)).map(Rounds::median_rate);
            let (ours, floor, peer) = (rate(Path::OursFirst), rate(Path::FloorFirst), rate(Path::PeerFirst));
            let per_floor = |r: Option<f64>| show(r.zip(floor).map(|(r, f)| r / f), 2);
            let fmt = |r: Option<f64>| r.map(fmt_rate).unwrap_or_else(|| "—".into());
            println!(
                "| {} | {:.1} | {concurrency} | {} | {} | {} | {} | {} |",
                fmt_rate(records as f64),
                prefill.as_secs_f64(),
                fmt(ours),
                fmt(floor),
                per_floor(ours),
                fmt(peer),
                per_floor(peer),
            );
        }
        for side in Side::ALL {
            if side != Side::Peer || has_peer {
                storage.push((side, env.target.storage(side).await));
            }
        }
    }
    println!("\nStorage at each record count:\n");
    print_storage(&storage);
}

struct Opts {
    duration: Duration,
    warmup: Duration,
    rounds: usize,
    workers: usize,
    concurrencies: Vec<usize>,
    only: String,
    records: Vec<u64>,
}

fn main() {
    let run_opts = RunOptions::from_args();
    let rt = run_opts.runtime();
    let opts = Opts {
        duration: Duration::from_secs_f64(arg("--seconds", 2.0)),
        warmup: run_opts.warmup(),
        rounds: run_opts.rounds,
        workers: run_opts.workers,
        concurrencies: run_opts.concurrencies,
        only: run_opts.only,
        records: match arg("--records", "10000,1000000".to_owned()).as_str() {
            "none" | "" => Vec::new(),
            list => list
                .split(',')
                .map(|n| n.trim().replace('_', "").parse().expect("--records takes a list like 10000,1000000, or none"))
                .collect(),
        },
    };
    let postgres = arg("--postgres", String::new());
    tracing::subscriber::set_global_default(tracing_subscriber::registry().with(SqlxStatements)).unwrap();
    let peer = !flag("--no-peer");
    if !postgres.is_empty() {
        // The PostgreSQL rows alone, on the bench's own tables there (dropped before and after).
        rt.block_on(async {
            let target = PostgresTarget::open(&postgres, peer).await;
            bench(&opts, target, || PostgresTarget::open(&postgres, peer)).await;
            let admin = PgPoolOptions::new().max_connections(1).connect(&postgres).await.unwrap();
            PostgresTarget::drop_tables(&admin).await;
        });
        return;
    }

    let dir = arg("--dir", String::new());
    let temp = dir.is_empty().then(|| tempfile::Builder::new().prefix("sql_bench-").tempdir().unwrap());
    let dir = temp.as_ref().map_or_else(|| PathBuf::from(&dir), |t| t.path().to_owned());
    rt.block_on(async {
        let target = SqliteTarget::open(&dir.join("main"), peer).await;
        let records_dir = dir.join("records");
        bench(&opts, target, || SqliteTarget::open(&records_dir, peer)).await;
    });
}
