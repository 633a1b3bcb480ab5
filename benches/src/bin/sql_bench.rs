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

/// Payloads made done before the timed rounds, which the replay rows cycle through.
const REPLAY_KEYS: u64 = 1024;
/// Calls of each row in the counting pass.
const COUNT_CALLS: u64 = 200;
/// The `SqliteStore` builder's defaults, which the store under test is opened with and the floor's
/// pool copies.
const MAX_CONNECTIONS: u32 = 8;
const BUSY_TIMEOUT: Duration = Duration::from_secs(5);
/// The columns the bench writes in a record's row, ours and the floor's alike: those of our
/// store's table (schema version 3: `store/sqlite.rs`, `store/postgres.rs`), in its order. The
/// floor's table itself is made from our store's (see [`SqliteTarget::open`] and
/// [`PostgresTarget::open`]), so its columns, types, constraints and indexes follow the store's.
const RECORD_COLUMNS: &str = "key, fingerprint, state, token, fence, attempt, recovered, lease_until, expires_at, \
                              result, step, run_id, tenant, created_at, updated_at";
/// The token, lease and retention of the floor's rows.
const FLOOR_TOKEN: &str = "0123456789abcdef0123456789abcdef";
const LEASE_US: i64 = 60_000_000;
const KEEP_US: i64 = 86_400_000_000;

/// The floor's statements on a table of our columns, in SQL both databases read (`$n`
/// placeholders, `false` for a boolean), with the table's name in them.
struct FloorSql {
    /// A first execution's claim: `INSERT … ON CONFLICT (key) DO NOTHING` of a running row.
    claim: SqlStr,
    /// A first execution's outcome: `UPDATE … WHERE key = $1`, as our complete writes it.
    done: SqlStr,
    /// The replay floor: `SELECT … WHERE key = $1`.
    select: SqlStr,
    /// A diagnostic: an upsert that changes nothing and returns the row.
    upsert: SqlStr,
}

impl FloorSql {
    fn new(table: &str) -> FloorSql {
        let sql = |s: String| AssertSqlSafe(s).into_sql_str();
        FloorSql {
            claim: sql(format!(
                "INSERT INTO {table} ({RECORD_COLUMNS}) VALUES ($1, $2, 'running', $3, $4, 1, false, $5, $6, NULL, \
                 'floor', NULL, NULL, $4, $4) ON CONFLICT (key) DO NOTHING"
            )),
            done: sql(format!(
                "UPDATE {table} SET state = 'done', result = $2, expires_at = $3, updated_at = $4 WHERE key = $1"
            )),
            select: sql(format!("SELECT fingerprint, state, result FROM {table} WHERE key = $1")),
            upsert: sql(format!(
                "INSERT INTO {table} ({RECORD_COLUMNS}) VALUES ($1, $2, 'running', $3, 0, 1, false, 0, 0, NULL, '', \
                 NULL, NULL, 0, 0) ON CONFLICT (key) DO UPDATE SET state = {table}.state RETURNING fingerprint, \
                 state, result"
            )),
        }
    }
}

/// What the prefill statements say differently in the two databases.
struct Dialect {
    /// 32 random bytes, and 32 random hex characters.
    random_bytes: &'static str,
    random_hex: &'static str,
    /// A numbered peer effect id from `c.n`.
    peer_id: &'static str,
    /// How a write transaction begins.
    begin: &'static str,
    /// Rows `c(n)` for n in `from..=to` (SQL expressions): what goes before the `INSERT`, and its
    /// `FROM` item.
    series: fn(&str, &str) -> (String, String),
}

const SQLITE: Dialect = Dialect {
    random_bytes: "randomblob(32)",
    random_hex: "lower(hex(randomblob(16)))",
    peer_id: "printf('00000000-0000-7000-8000-%012x', c.n)",
    begin: "BEGIN IMMEDIATE",
    series: |from, to| {
        (format!("WITH RECURSIVE c(n) AS (SELECT {from} UNION ALL SELECT n + 1 FROM c WHERE n < {to})\n"), "c".into())
    },
};

const POSTGRES: Dialect = Dialect {
    random_bytes: "decode(md5(random()::text) || md5(random()::text), 'hex')",
    random_hex: "md5(random()::text)",
    peer_id: "('00000000-0000-7000-8000-' || lpad(to_hex(c.n), 12, '0'))::uuid",
    begin: "BEGIN",
    series: |from, to| (String::new(), format!("generate_series({from}::bigint, {to}::bigint) AS c(n)")),
};

impl Dialect {
    /// Prefills `table` (ours or the floor's) with `$1` realistic done rows of schema version 3
    /// (random key, fingerprint and token, the stored result; fence and times `$2`, lease `$3`,
    /// expiry `$4`, result `$5`), in one statement.
    fn prefill_records(&self, table: &str) -> String {
        let (with, from) = (self.series)("1", "$1");
        let rb = self.random_bytes;
        format!(
            "{with}INSERT INTO {table} ({RECORD_COLUMNS})\n\
             SELECT {rb}, {rb}, 'done', {hex}, $2, 1, false, $3, $4, $5, 'prefill', NULL, NULL, $2, $2 FROM {from}",
            hex = self.random_hex,
        )
    }

    /// Copies the peer's row `$3` of `table` (by `template_col`) as effects numbered `$1..=$2`,
    /// with new ids and logical keys.
    fn prefill_peer(&self, table: &str, cols: &[String], template_col: &str) -> String {
        let (with, from) = (self.series)("$1", "$2");
        let exprs: Vec<String> = cols
            .iter()
            .map(|c| match c.as_str() {
                "id" | "effect_id" => self.peer_id.to_owned(),
                "logical_key" => self.random_hex.to_owned(),
                other => format!("t.\"{other}\""),
            })
            .collect();
        let cols: Vec<String> = cols.iter().map(|c| format!("\"{c}\"")).collect();
        format!(
            "{with}INSERT INTO {table} ({}) SELECT {} FROM {from}, {table} t WHERE t.{template_col} = $3",
            cols.join(", "),
            exprs.join(", ")
        )
    }
}

/// A first execution on the floor: the claim, then the outcome, on `$pool`, each under the
/// mutex `$gate` (an `Option`) if given. A macro rather than a function generic over sqlx's
/// `Database`, whose bounds for each bound type would outweigh the body; the same for the next.
macro_rules! floor_first {
    ($sql:expr, $pool:expr, $key:expr, $stored:expr, $gate:expr) => {{
        let (sql, key, now): (&FloorSql, &[u8; 32], i64) = ($sql, $key, now_us());
        let held = match $gate {
            Some(g) => Some(g.lock().await),
            None => None,
        };
        let claimed = sqlx::query(sql.claim.clone())
            .bind(&key[..])
            .bind(&[7u8; 32][..])
            .bind(FLOOR_TOKEN)
            .bind(now)
            .bind(now + LEASE_US)
            .bind(now + KEEP_US)
            .execute($pool)
            .await
            .expect("floor INSERT");
        assert_eq!(claimed.rows_affected(), 1, "a fresh floor key was taken");
        drop(held);
        let held = match $gate {
            Some(g) => Some(g.lock().await),
            None => None,
        };
        let done = sqlx::query(sql.done.clone())
            .bind(&key[..])
            .bind($stored)
            .bind(now + KEEP_US)
            .bind(now)
            .execute($pool)
            .await
            .expect("floor UPDATE");
        drop(held);
        assert_eq!(done.rows_affected(), 1);
    }};
}

/// The replay floor (`select`) or the no-op upsert (`upsert`) on `$pool`: the done row of `$key`.
macro_rules! floor_read {
    (select, $sql:expr, $pool:expr, $key:expr) => {
        floor_read!(@row sqlx::query($sql.select.clone()).bind(&$key[..]), $pool, "floor SELECT")
    };
    (upsert, $sql:expr, $pool:expr, $key:expr) => {
        floor_read!(@row sqlx::query($sql.upsert.clone()).bind(&$key[..]).bind(&[7u8; 32][..]).bind(FLOOR_TOKEN),
            $pool, "floor upsert")
    };
    (@row $query:expr, $pool:expr, $what:literal) => {{
        let row = $query.fetch_one($pool).await.expect($what);
        let result: Option<Vec<u8>> = row.get(2);
        black_box((row.get::<&[u8], _>(0), row.get::<&str, _>(1)));
        assert!(result.is_some(), "the floor's replay row is done");
    }};
}

/// Prefills `$table` on `$pool` with `$add` done rows ([`Dialect::prefill_records`]).
macro_rules! prefill_records {
    ($dialect:expr, $pool:expr, $table:expr, $add:expr, $stored:expr) => {{
        let now = now_us();
        sqlx::query(AssertSqlSafe($dialect.prefill_records($table)))
            .bind($add as i64)
            .bind(now)
            .bind(now + LEASE_US)
            .bind(now + KEEP_US)
            .bind($stored)
            .execute($pool)
            .await
            .expect("prefill");
    }};
}

/// Prefills the peer's `effects` and `effect_events` on `$pool` (in one transaction) with `$add`
/// copies of its effect `$template` numbered from `$from`; `$columns` lists the columns of
/// `$table` and `$schema` is what goes before a table's name.
macro_rules! prefill_peer {
    ($dialect:expr, $pool:expr, $schema:expr, $template:expr, $from:expr, $add:expr, |$t:ident| $columns:expr) => {{
        let mut tx = $pool.begin_with($dialect.begin).await.unwrap();
        for (table, template_col) in [("effects", "id"), ("effect_events", "effect_id")] {
            let $t = table;
            let cols: Vec<String> = $columns.await;
            let sql = $dialect.prefill_peer(&format!("{}{table}", $schema), &cols, template_col);
            sqlx::query(AssertSqlSafe(sql))
                .bind($from as i64)
                .bind(($from + $add - 1) as i64)
                .bind(&$template)
                .execute(&mut *tx)
                .await
                .expect("prefill the peer");
        }
        tx.commit().await.unwrap();
    }};
}
/// The records table of our store (the builder's default name).
const OUR_TABLE: &str = "idempotent_records";

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Path {
    OursFirst,
    StoreFirst,
    FloorFirst,
    FloorFirstGated,
    PeerFirst,
    OursReplay,
    StoreReplay,
    ReadFirstReplay,
    FloorReplay,
    FloorUpsert,
    PeerReplay,
}

impl Path {
    const ALL: [Path; 11] = [
        Path::OursFirst,
        Path::StoreFirst,
        Path::FloorFirst,
        Path::FloorFirstGated,
        Path::PeerFirst,
        Path::OursReplay,
        Path::StoreReplay,
        Path::ReadFirstReplay,
        Path::FloorReplay,
        Path::FloorUpsert,
        Path::PeerReplay,
    ];

    fn label(self) -> &'static str {
        match self {
            Path::OursFirst => "first execution (ours)",
            Path::StoreFirst => "diag: store acquire + complete, no executor",
            Path::FloorFirst => "floor: INSERT ON CONFLICT DO NOTHING + UPDATE",
            Path::FloorFirstGated => "diag: floor, writes behind one in-process lock",
            Path::PeerFirst => "peer: agent-effects first execution",
            Path::OursReplay => "replay (ours)",
            Path::StoreReplay => "diag: store acquire (replay), no executor",
            Path::ReadFirstReplay => "diag: read-only replay: acquire's row, read alone",
            Path::FloorReplay => "floor: SELECT by key",
            Path::FloorUpsert => "diag: floor no-op upsert RETURNING by key",
            Path::PeerReplay => "peer: agent-effects replay",
        }
    }

    /// The floor this path is compared with.
    fn floor(self) -> Option<Path> {
        match self {
            Path::OursFirst | Path::StoreFirst | Path::FloorFirstGated | Path::PeerFirst => Some(Path::FloorFirst),
            Path::OursReplay | Path::StoreReplay | Path::ReadFirstReplay | Path::FloorUpsert | Path::PeerReplay => {
                Some(Path::FloorReplay)
            }
            Path::FloorFirst | Path::FloorReplay => None,
        }
    }

    /// Whose database file (or tables) the path writes to.
    fn side(self) -> Side {
        match self {
            Path::OursFirst | Path::StoreFirst | Path::OursReplay | Path::StoreReplay | Path::ReadFirstReplay => {
                Side::Ours
            }
            Path::FloorFirst | Path::FloorFirstGated | Path::FloorReplay | Path::FloorUpsert => Side::Floor,
            Path::PeerFirst | Path::PeerReplay => Side::Peer,
        }
    }

    /// Whether our store's `statements()` counts this path's statements.
    fn through_store(self) -> bool {
        matches!(self, Path::OursFirst | Path::StoreFirst | Path::OursReplay | Path::StoreReplay)
    }

    fn is_peer(self) -> bool {
        self.side() == Side::Peer
    }
}

/// The three stores a database holds in a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Side {
    Ours,
    Floor,
    Peer,
}

impl Side {
    const ALL: [Side; 3] = [Side::Ours, Side::Floor, Side::Peer];

    fn label(self) -> &'static str {
        match self {
            Side::Ours => "ours",
            Side::Floor => "floor",
            Side::Peer => "peer (agent-effects)",
        }
    }
}

/// What a side's calls wrote during a probe.
#[derive(Debug, Clone, Copy, Default)]
struct Written {
    /// Write transactions committed, where the pool is the bench's own (floor and peer).
    commits: Option<u64>,
    /// Rows inserted, updated or deleted, likewise.
    rows: Option<u64>,
    /// Bytes appended to the write-ahead log.
    wal_bytes: u64,
}

/// What a side's records take on disk.
#[derive(Debug, Clone, Default)]
struct Storage {
    /// Records (rows of the side's main table).
    records: u64,
    /// The database file's size (after a checkpoint into it).
    file_bytes: u64,
    /// Per b-tree (table or index): name, bytes of pages, bytes of payload.
    btrees: Vec<(String, u64, u64)>,
}

impl Storage {
    fn page_bytes(&self) -> u64 {
        self.btrees.iter().map(|b| b.1).sum()
    }
}

/// A database under test: our store on it, the raw floor through the same driver and pool
/// settings, and the peer crate's store on it.
///
/// Two implementations: [`SqliteTarget`] and [`PostgresTarget`].
trait Target: Send + Sync + 'static {
    /// The peer's store on this database.
    type PeerStore: EffectStore;
    /// What a probe holds between its two readings.
    type Probe: Send;
    /// Whether the database has one write lock for the whole file (SQLite), which the gated floor
    /// row queues for in the process.
    const SINGLE_WRITER: bool;
    /// Whether [`read_first_replay`](Target::read_first_replay) is written (it is not where our
    /// store's acquire reads first already).
    const READ_FIRST: bool;

    /// The database, its version and its settings, for the report.
    fn describe(&self) -> impl Future<Output = String> + Send;
    /// Our store.
    fn store(&self) -> SharedStore;
    /// Statements our store ran so far.
    fn statements(&self) -> u64;
    /// The peer's runtime on its store, unless `--no-peer`.
    fn peer(&self) -> Option<&agent_effects::Runtime<Self::PeerStore>>;
    /// The first-execution floor for a fresh `key`: claim the key, then store the outcome.
    fn floor_first(&self, key: &[u8; 32], stored: &[u8]) -> impl Future<Output = ()> + Send;
    /// A diagnostic next to the first-execution floor: the same statements, each taking one lock of
    /// this process first, so that the pool's connections queue for the database's write lock
    /// in the process instead of in SQLite's busy handler (which sleeps 1, 2, 5, 10 … ms between
    /// tries). `None` where the database has no such single write lock.
    fn floor_first_gated(&self, key: &[u8; 32], stored: &[u8]) -> Option<impl Future<Output = ()> + Send>;
    /// The replay floor: read a done row by key.
    fn floor_replay(&self, key: &[u8; 32]) -> impl Future<Output = ()> + Send;
    /// A diagnostic next to the replay floor: what our acquire's replay would cost as a read
    /// statement alone (`SELECT` of acquire's row by key on our store's table, through the
    /// store's pool, answered as acquire answers a done record). `None` where acquire's replay is
    /// that read already (SQLite).
    fn read_first_replay(&self, key: &Key, fp: &Fingerprint) -> Option<impl Future<Output = ()> + Send>;
    /// A diagnostic next to the replay floor: an upsert of a done row that changes nothing and
    /// returns it (a write statement: on SQLite, the file's write lock).
    fn floor_upsert(&self, key: &[u8; 32]) -> impl Future<Output = ()> + Send;
    /// Writes realistic done rows straight into a side's tables, in one statement, until it holds
    /// `total` records; returns how many it wrote.
    fn prefill(&self, side: Side, total: u64, stored: &[u8]) -> impl Future<Output = u64> + Send;
    /// Starts measuring what a side writes.
    fn probe(&self, side: Side) -> impl Future<Output = Self::Probe> + Send;
    /// What the side wrote since `probe`.
    fn probe_end(&self, side: Side, probe: Self::Probe) -> impl Future<Output = Written> + Send;
    /// What the side's records take on disk now.
    fn storage(&self, side: Side) -> impl Future<Output = Storage> + Send;
}

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

/// Commits and row changes on every connection of a pool (SQLite commit and update hooks).
#[derive(Default)]
struct Hooks {
    commits: AtomicU64,
    rows: AtomicU64,
}

impl Hooks {
    fn read(&self) -> (u64, u64) {
        (self.commits.load(Ordering::Relaxed), self.rows.load(Ordering::Relaxed))
    }
}

/// Adds the hooks to each connection the pool opens.
fn with_hooks(options: SqlitePoolOptions, hooks: &Arc<Hooks>) -> SqlitePoolOptions {
    let hooks = hooks.clone();
    options.after_connect(move |conn, _| {
        let hooks = hooks.clone();
        Box::pin(async move {
            let mut handle = conn.lock_handle().await?;
            let commits = hooks.clone();
            handle.set_commit_hook(move || {
                commits.commits.fetch_add(1, Ordering::Relaxed);
                true
            });
            handle.set_update_hook(move |_| {
                hooks.rows.fetch_add(1, Ordering::Relaxed);
            });
            Ok(())
        })
    })
}

/// A pool with the connection and pool settings `SqliteStoreBuilder::open` uses (sqlite.rs), and
/// the hooks: the floor's.
async fn store_like_pool(path: &FsPath, hooks: &Arc<Hooks>) -> SqlitePool {
    with_hooks(
        SqlitePoolOptions::new()
            .max_connections(MAX_CONNECTIONS)
            .min_connections(0)
            .acquire_timeout(BUSY_TIMEOUT)
            .test_before_acquire(false),
        hooks,
    )
    .connect_with(
        SqliteConnectOptions::new()
            .filename(path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Full)
            .busy_timeout(BUSY_TIMEOUT),
    )
    .await
    .unwrap_or_else(|e| panic!("open {}: {e}", path.display()))
}

fn now_us() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_micros() as i64
}

/// SQLite: one directory, one file per side.
struct SqliteTarget {
    dir: PathBuf,
    ours: SqliteStore,
    floor: SqlitePool,
    floor_hooks: Arc<Hooks>,
    floor_sql: FloorSql,
    peer: Option<(agent_effects::Runtime<agent_effects_sqlite::SqliteStore>, Arc<Hooks>)>,
    /// Per side, a pool of two connections of the bench's own on that file: prefill, probes,
    /// storage (one connection holds a read snapshot while the other checkpoints).
    admin: [SqlitePool; 3],
    /// Peer effects prefilled so far (their ids are numbered).
    peer_prefilled: AtomicU64,
    /// The in-process lock of the gated floor row.
    write_gate: tokio::sync::Mutex<()>,
}

impl SqliteTarget {
    async fn open(dir: &FsPath, peer: bool) -> SqliteTarget {
        std::fs::create_dir_all(dir).unwrap();
        let file = |side: Side| dir.join(format!("{}.sqlite", ["ours", "floor", "peer"][side as usize]));
        let ours = SqliteStore::builder(file(Side::Ours))
            .max_connections(MAX_CONNECTIONS)
            .busy_timeout(BUSY_TIMEOUT)
            .open()
            .await
            .expect("open the SqliteStore under test");

        let floor_hooks = Arc::new(Hooks::default());
        let floor = store_like_pool(&file(Side::Floor), &floor_hooks).await;
        // The floor's table is ours as the store created it, under another name.
        let create: String = sqlx::query_scalar("SELECT sql FROM sqlite_schema WHERE type = 'table' AND name = ?1")
            .bind(OUR_TABLE)
            .fetch_one(ours.pool())
            .await
            .expect("read our table's definition");
        let create = create.replacen(&format!("\"{OUR_TABLE}\""), "floor_records", 1);
        assert!(create.contains("floor_records"), "our table's definition names it: {create}");
        sqlx::raw_sql(AssertSqlSafe(create)).execute(&floor).await.expect("create the floor's table");

        // The peer: the settings of `agent_effects_sqlite::SqliteStore::open` (its lib.rs), with the
        // hooks added through `from_pool`, which runs its migrations.
        let peer = if peer {
            let hooks = Arc::new(Hooks::default());
            let pool = with_hooks(SqlitePoolOptions::new().max_connections(8), &hooks)
                .connect_with(
                    SqliteConnectOptions::new()
                        .filename(file(Side::Peer))
                        .create_if_missing(true)
                        .journal_mode(SqliteJournalMode::Wal)
                        .synchronous(SqliteSynchronous::Full)
                        .busy_timeout(Duration::from_secs(5))
                        .foreign_keys(true),
                )
                .await
                .expect("open the peer's file");
            let store = agent_effects_sqlite::SqliteStore::from_pool(pool).await.expect("migrate the peer's store");
            Some((agent_effects::Runtime::new(store), hooks))
        } else {
            None
        };

        let admin = |side: Side| {
            SqlitePoolOptions::new().max_connections(2).connect_with(
                SqliteConnectOptions::new()
                    .filename(file(side))
                    .create_if_missing(true)
                    .journal_mode(SqliteJournalMode::Wal)
                    .busy_timeout(BUSY_TIMEOUT)
                    // Prefill inserts keys in random order: keep the whole index in memory.
                    .pragma("cache_size", "-2097152"),
            )
        };
        let admin =
            [admin(Side::Ours).await.unwrap(), admin(Side::Floor).await.unwrap(), admin(Side::Peer).await.unwrap()];
        SqliteTarget {
            dir: dir.to_owned(),
            ours,
            floor,
            floor_hooks,
            floor_sql: FloorSql::new("floor_records"),
            peer,
            admin,
            peer_prefilled: AtomicU64::new(0),
            write_gate: tokio::sync::Mutex::new(()),
        }
    }

    fn admin(&self, side: Side) -> &SqlitePool {
        &self.admin[side as usize]
    }

    fn hooks(&self, side: Side) -> Option<&Hooks> {
        match side {
            Side::Ours => None,
            Side::Floor => Some(&self.floor_hooks),
            Side::Peer => self.peer.as_ref().map(|(_, h)| &**h),
        }
    }

    /// The side's main table and the tables its records also write.
    fn tables(side: Side) -> &'static [&'static str] {
        match side {
            Side::Ours => &[OUR_TABLE],
            Side::Floor => &["floor_records"],
            Side::Peer => &["effects", "effect_events", "late_observations"],
        }
    }

    async fn count(&self, side: Side) -> u64 {
        let sql = format!("SELECT count(*) FROM \"{}\"", Self::tables(side)[0]);
        let n: i64 = sqlx::query_scalar(AssertSqlSafe(sql)).fetch_one(self.admin(side)).await.unwrap();
        n as u64
    }

    /// Frames in the side's WAL now (`PRAGMA wal_checkpoint`'s second column), after a passive
    /// checkpoint.
    async fn wal_frames(&self, side: Side) -> i64 {
        let row = sqlx::query("PRAGMA wal_checkpoint(PASSIVE)").fetch_one(self.admin(side)).await.unwrap();
        row.get::<i64, _>(1)
    }

    async fn checkpoint_truncate(&self, side: Side) {
        let row = sqlx::query("PRAGMA wal_checkpoint(TRUNCATE)").fetch_one(self.admin(side)).await.unwrap();
        assert_eq!(row.get::<i64, _>(0), 0, "the TRUNCATE checkpoint of {} was blocked", side.label());
    }

    async fn columns(&self, side: Side, table: &str) -> Vec<String> {
        sqlx::query_scalar("SELECT name FROM pragma_table_info(?1) ORDER BY cid")
            .bind(table)
            .fetch_all(self.admin(side))
            .await
            .unwrap()
    }
}

/// A read snapshot held on the side's file (so that the WAL is appended to, never restarted), and
/// the readings at its start.
struct SqliteProbe {
    snapshot: sqlx::Transaction<'static, sqlx::Sqlite>,
    frames: i64,
    hooks: Option<(u64, u64)>,
}

impl Target for SqliteTarget {
    type PeerStore = agent_effects_sqlite::SqliteStore;
    type Probe = SqliteProbe;
    const SINGLE_WRITER: bool = true;
    const READ_FIRST: bool = false;

    async fn describe(&self) -> String {
        let version: String =
            sqlx::query_scalar("SELECT sqlite_version()").fetch_one(self.admin(Side::Ours)).await.unwrap();
        format!(
            "SQLite {version} (sqlx, bundled), files in {}; ours and floor: WAL, synchronous FULL, \
             {MAX_CONNECTIONS} connections, busy timeout {}s",
            self.dir.display(),
            BUSY_TIMEOUT.as_secs()
        )
    }

    fn store(&self) -> SharedStore {
        Arc::new(self.ours.clone())
    }

    fn statements(&self) -> u64 {
        self.ours.statements()
    }

    fn peer(&self) -> Option<&agent_effects::Runtime<Self::PeerStore>> {
        self.peer.as_ref().map(|(r, _)| r)
    }

    async fn floor_first(&self, key: &[u8; 32], stored: &[u8]) {
        floor_first!(&self.floor_sql, &self.floor, key, stored, None::<&tokio::sync::Mutex<()>>)
    }

    fn floor_first_gated(&self, key: &[u8; 32], stored: &[u8]) -> Option<impl Future<Output = ()> + Send> {
        Some(async move { floor_first!(&self.floor_sql, &self.floor, key, stored, Some(&self.write_gate)) })
    }

    async fn floor_replay(&self, key: &[u8; 32]) {
        floor_read!(select, self.floor_sql, &self.floor, key)
    }

    fn read_first_replay(&self, _: &Key, _: &Fingerprint) -> Option<impl Future<Output = ()> + Send> {
        // `SqliteStore::acquire` reads first: its replay is that read.
        None::<std::future::Ready<()>>
    }

    async fn floor_upsert(&self, key: &[u8; 32]) {
        floor_read!(upsert, self.floor_sql, &self.floor, key)
    }

    async fn prefill(&self, side: Side, total: u64, stored: &[u8]) -> u64 {
        let have = self.count(side).await;
        if have >= total {
            return 0;
        }
        let add = total - have;
        let admin = self.admin(side);
        match side {
            Side::Ours | Side::Floor => prefill_records!(SQLITE, admin, Self::tables(side)[0], add, stored),
            Side::Peer => {
                // Copies of one real done effect (and its audit events) under new ids and keys.
                // Ids are numbered UUIDs below the runtime's v7 ones, in order, as time-ordered
                // ids are inserted.
                let template: String =
                    sqlx::query_scalar("SELECT id FROM effects WHERE status = 'committed' ORDER BY id DESC LIMIT 1")
                        .fetch_one(admin)
                        .await
                        .expect("a committed peer effect to copy");
                let from = self.peer_prefilled.fetch_add(add, Ordering::Relaxed) + 1;
                prefill_peer!(SQLITE, admin, "", template, from, add, |table| self.columns(side, table));
            }
        }
        // Into the database file, so that the timed rows do not pay for copying the prefill.
        self.checkpoint_truncate(side).await;
        add
    }

    async fn probe(&self, side: Side) -> SqliteProbe {
        let admin = self.admin(side);
        self.checkpoint_truncate(side).await;
        // A frame in the WAL that no checkpoint has copied yet, so that the snapshot below reads
        // through the WAL (read mark > 0): a writer cannot restart the WAL under it.
        sqlx::raw_sql("CREATE TABLE IF NOT EXISTS bench_probe (n INTEGER); INSERT INTO bench_probe VALUES (1)")
            .execute(admin)
            .await
            .unwrap();
        let mut snapshot = admin.begin().await.unwrap();
        let _: i64 = sqlx::query_scalar("SELECT count(*) FROM bench_probe").fetch_one(&mut *snapshot).await.unwrap();
        let frames = self.wal_frames(side).await;
        SqliteProbe { snapshot, frames, hooks: self.hooks(side).map(Hooks::read) }
    }

    async fn probe_end(&self, side: Side, probe: SqliteProbe) -> Written {
        let frames = self.wal_frames(side).await - probe.frames;
        probe.snapshot.rollback().await.unwrap();
        let page: i64 = sqlx::query_scalar("PRAGMA page_size").fetch_one(self.admin(side)).await.unwrap();
        let hooks = self.hooks(side).map(Hooks::read).zip(probe.hooks);
        Written {
            commits: hooks.map(|((c1, _), (c0, _))| c1 - c0),
            rows: hooks.map(|((_, r1), (_, r0))| r1 - r0),
            // A WAL frame is a 24-byte header and a page.
            wal_bytes: frames.max(0) as u64 * (page as u64 + 24),
        }
    }

    async fn storage(&self, side: Side) -> Storage {
        self.checkpoint_truncate(side).await;
        let admin = self.admin(side);
        let tables = Self::tables(side);
        let mut btrees = Vec::new();
        for table in tables {
            let names: Vec<String> = sqlx::query_scalar("SELECT name FROM sqlite_schema WHERE tbl_name = ?1")
                .bind(*table)
                .fetch_all(admin)
                .await
                .unwrap();
            for name in names {
                let row = sqlx::query("SELECT pgsize, payload FROM dbstat(?1, 1) WHERE name = ?2")
                    .bind("main")
                    .bind(&name)
                    .fetch_optional(admin)
                    .await
                    .unwrap();
                if let Some(row) = row {
                    btrees.push((name, row.get::<i64, _>(0) as u64, row.get::<i64, _>(1) as u64));
                }
            }
        }
        let file = self.dir.join(format!("{}.sqlite", ["ours", "floor", "peer"][side as usize]));
        Storage { records: self.count(side).await, file_bytes: std::fs::metadata(file).unwrap().len(), btrees }
    }
}

/// The pool size of our PostgreSQL store, which the floor shares (it is the store's pool) and the
/// peer's pool is given too.
const PG_CONNECTIONS: u32 = 16;
/// Our PostgreSQL store's per-call timeout (the builder's default is 5 s; at c=64 on 16
/// connections a call may wait for a connection behind 48 others on a loaded machine).
const PG_TIMEOUT: Duration = Duration::from_secs(10);
/// Our store's table, the floor's table (both in the connection's `current_schema()`), and the
/// peer's schema: the bench's own names, dropped at the start and at the end of a run.
const PG_OURS: &str = "sql_bench_ours";
const PG_FLOOR: &str = "sql_bench_floor";
const PG_PEER_SCHEMA: &str = "sql_bench_peer";
/// PostgreSQL: our store in table `sql_bench_ours`, the floor in `sql_bench_floor` through the
/// store's own pool (`PostgresStore::pool`), the peer in schema `sql_bench_peer`, all in the
/// database of the URL; dropped before and after a run.
///
/// What a call writes is read from the whole cluster at concurrency 1 (so it includes whatever
/// else runs on the server meanwhile): WAL bytes from `pg_current_wal_insert_lsn()` deltas, and,
/// in the "write commits" column, transaction ids assigned (`pg_snapshot_xmax` of the current
/// snapshot), one per write transaction. `pg_stat_database.xact_commit` is not used: backends
/// flush it to shared memory at most once a second, or after 10 s idle, so a delta right after
/// the pass would miss commits. Rows written are not counted. Storage is `pg_table_size` of each
/// table (heap and TOAST, dead row versions included) and `pg_relation_size` of each index, and
/// `pg_column_size` of the rows as payload.
struct PostgresTarget {
    ours: PostgresStore,
    peer: Option<agent_effects::Runtime<agent_effects_postgres::PostgresStore>>,
    /// Two connections of the bench's own: prefill, probes, storage, cleanup.
    admin: PgPool,
    /// Peer effects prefilled so far (their ids are numbered).
    peer_prefilled: AtomicU64,
    floor_sql: FloorSql,
    /// acquire's row of a key on our table, read alone (the read-only replay row).
    read_ours: SqlStr,
}

/// The cluster's WAL insert position and next transaction id at the start of a probe.
struct PgProbe {
    lsn: String,
    next_xid: i64,
}

impl PostgresTarget {
    async fn open(url: &str, peer: bool) -> PostgresTarget {
        let admin = PgPoolOptions::new()
            .max_connections(2)
            .connect(url)
            .await
            .unwrap_or_else(|e| panic!("sql_bench: cannot connect to {url}: {e}; start the server or fix the URL"));
        Self::drop_tables(&admin).await;
        let ours = PostgresStore::builder(url)
            .table(PG_OURS)
            .max_connections(PG_CONNECTIONS)
            .timeout(PG_TIMEOUT)
            .connect()
            .await
            .expect("open the PostgresStore under test");
        // The floor's table is ours as the store created it: columns, defaults, constraints,
        // indexes, and its storage parameters (`fillfactor`), which `LIKE` does not copy.
        let options: Option<Vec<String>> =
            sqlx::query_scalar("SELECT reloptions FROM pg_class WHERE oid = to_regclass($1)")
                .bind(PG_OURS)
                .fetch_one(ours.pool())
                .await
                .expect("read our table's storage parameters");
        let with = options.map(|o| format!(" WITH ({})", o.join(", "))).unwrap_or_default();
        let create = format!("CREATE TABLE \"{PG_FLOOR}\" (LIKE \"{PG_OURS}\" INCLUDING ALL){with}");
        sqlx::raw_sql(AssertSqlSafe(create)).execute(ours.pool()).await.expect("create the floor's table");
        let peer = if peer {
            // `PostgresOptions::connect`: its own pool (of `PG_CONNECTIONS`), its migrations, in a
            // schema of the bench's.
            let store = agent_effects_postgres::PostgresOptions::new()
                .schema(PG_PEER_SCHEMA)
                .max_connections(PG_CONNECTIONS)
                .connect(url)
                .await
                .expect("open the peer's store");
            Some(agent_effects::Runtime::new(store))
        } else {
            None
        };
        let read_ours = AssertSqlSafe(format!(
            "SELECT token, fingerprint, state, fence, attempt, recovered, lease_until - {now} AS left_us, result \
             FROM \"{PG_OURS}\" WHERE key = $1 AND expires_at > {now}",
            now = "(extract(epoch FROM statement_timestamp()) * 1000000)::bigint"
        ))
        .into_sql_str();
        PostgresTarget {
            ours,
            peer,
            admin,
            peer_prefilled: AtomicU64::new(0),
            floor_sql: FloorSql::new(PG_FLOOR),
            read_ours,
        }
    }

    /// Drops the bench's tables and schema, and our table's line in `idempotent_schema` (and that
    /// table, if nothing else is in it).
    async fn drop_tables(admin: &PgPool) {
        let sql = format!(
            "DROP TABLE IF EXISTS \"{PG_OURS}\", \"{PG_FLOOR}\";\n\
             DROP SCHEMA IF EXISTS \"{PG_PEER_SCHEMA}\" CASCADE;\n\
             DO $$ BEGIN\n\
               IF to_regclass('idempotent_schema') IS NOT NULL THEN\n\
                 DELETE FROM idempotent_schema WHERE name = '{PG_OURS}';\n\
                 IF NOT EXISTS (SELECT 1 FROM idempotent_schema) THEN DROP TABLE idempotent_schema; END IF;\n\
               END IF;\n\
             END $$"
        );
        sqlx::raw_sql(AssertSqlSafe(sql)).execute(admin).await.expect("drop the bench's tables");
    }

    /// The side's tables, schema-qualified where needed, main table first.
    fn tables(side: Side) -> &'static [&'static str] {
        match side {
            Side::Ours => &[PG_OURS],
            Side::Floor => &[PG_FLOOR],
            Side::Peer => {
                &["sql_bench_peer.effects", "sql_bench_peer.effect_events", "sql_bench_peer.late_observations"]
            }
        }
    }

    async fn count(&self, side: Side) -> u64 {
        let sql = format!("SELECT count(*) FROM {}", Self::tables(side)[0]);
        let n: i64 = sqlx::query_scalar(AssertSqlSafe(sql)).fetch_one(&self.admin).await.unwrap();
        n as u64
    }

    async fn columns(&self, table: &str) -> Vec<String> {
        sqlx::query_scalar(
            "SELECT column_name::text FROM information_schema.columns WHERE table_schema = $1 AND table_name = $2 \
             ORDER BY ordinal_position",
        )
        .bind(PG_PEER_SCHEMA)
        .bind(table)
        .fetch_all(&self.admin)
        .await
        .unwrap()
    }
}

impl Target for PostgresTarget {
    type PeerStore = agent_effects_postgres::PostgresStore;
    type Probe = PgProbe;
    const SINGLE_WRITER: bool = false;
    const READ_FIRST: bool = true;

    async fn describe(&self) -> String {
        let row = sqlx::query(
            "SELECT current_setting('server_version'), current_setting('fsync'), \
             current_setting('synchronous_commit'), inet_server_port()",
        )
        .fetch_one(&self.admin)
        .await
        .unwrap();
        let (version, fsync, sync): (String, String, String) = (row.get(0), row.get(1), row.get(2));
        let port: Option<i32> = row.get(3);
        format!(
            "PostgreSQL {version} on port {}, fsync {fsync}, synchronous_commit {sync}; ours and floor: one pool \
             of {PG_CONNECTIONS} connections (the store's), peer: its own pool of {PG_CONNECTIONS}",
            port.unwrap_or(0)
        )
    }

    fn store(&self) -> SharedStore {
        Arc::new(self.ours.clone())
    }

    fn statements(&self) -> u64 {
        self.ours.statements()
    }

    fn peer(&self) -> Option<&agent_effects::Runtime<Self::PeerStore>> {
        self.peer.as_ref()
    }

    async fn floor_first(&self, key: &[u8; 32], stored: &[u8]) {
        floor_first!(&self.floor_sql, self.ours.pool(), key, stored, None::<&tokio::sync::Mutex<()>>)
    }

    fn floor_first_gated(&self, _: &[u8; 32], _: &[u8]) -> Option<impl Future<Output = ()> + Send> {
        None::<std::future::Ready<()>>
    }

    async fn floor_replay(&self, key: &[u8; 32]) {
        floor_read!(select, self.floor_sql, self.ours.pool(), key)
    }

    fn read_first_replay(&self, key: &Key, fp: &Fingerprint) -> Option<impl Future<Output = ()> + Send> {
        let (key, fp) = (*key, *fp);
        Some(async move {
            let row = sqlx::query(self.read_ours.clone())
                .bind(&key.as_bytes()[..])
                .fetch_optional(self.ours.pool())
                .await
                .expect("read-only SELECT of our record")
                .expect("a replay record is there");
            let (token, fingerprint, state): (String, Vec<u8>, String) = (row.get(0), row.get(1), row.get(2));
            let (fence, attempt, recovered, left): (i64, i64, bool, i64) =
                (row.get(3), row.get(4), row.get(5), row.get(6));
            assert!(state == "done" && fingerprint == fp.as_bytes(), "the record is done and ours");
            let result: Option<Vec<u8>> = row.get(7);
            black_box((token, fence, attempt, recovered, left));
            black_box(Acquire::Replay(Bytes::from(result.expect("a done record has a result"))));
        })
    }

    async fn floor_upsert(&self, key: &[u8; 32]) {
        floor_read!(upsert, self.floor_sql, self.ours.pool(), key)
    }

    async fn prefill(&self, side: Side, total: u64, stored: &[u8]) -> u64 {
        let have = self.count(side).await;
        if have >= total {
            return 0;
        }
        let add = total - have;
        match side {
            Side::Ours | Side::Floor => {
                prefill_records!(POSTGRES, &self.admin, Self::tables(side)[0], add, stored)
            }
            Side::Peer => {
                // Copies of one real done effect (and its audit events) under new ids and keys:
                // numbered UUIDs below the runtime's v7 ones, in order.
                let template: sqlx::types::Uuid = sqlx::query_scalar(
                    "SELECT id FROM sql_bench_peer.effects WHERE status = 'committed' ORDER BY id DESC LIMIT 1",
                )
                .fetch_one(&self.admin)
                .await
                .expect("a committed peer effect to copy");
                let from = self.peer_prefilled.fetch_add(add, Ordering::Relaxed) + 1;
                let schema = format!("{PG_PEER_SCHEMA}.");
                prefill_peer!(POSTGRES, self.admin, schema, template, from, add, |table| self.columns(table));
            }
        }
        for table in Self::tables(side) {
            sqlx::raw_sql(AssertSqlSafe(format!("VACUUM ANALYZE {table}"))).execute(&self.admin).await.unwrap();
        }
        add
    }

    async fn probe(&self, _: Side) -> PgProbe {
        let row = sqlx::query(
            "SELECT pg_current_wal_insert_lsn()::text, pg_snapshot_xmax(pg_current_snapshot())::text::bigint",
        )
        .fetch_one(&self.admin)
        .await
        .unwrap();
        PgProbe { lsn: row.get(0), next_xid: row.get(1) }
    }

    async fn probe_end(&self, _: Side, probe: PgProbe) -> Written {
        let row = sqlx::query(
            "SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), $1::pg_lsn)::bigint, \
             pg_snapshot_xmax(pg_current_snapshot())::text::bigint",
        )
        .bind(&probe.lsn)
        .fetch_one(&self.admin)
        .await
        .unwrap();
        let (wal, next_xid): (i64, i64) = (row.get(0), row.get(1));
        Written {
            // Transaction ids assigned: one per write transaction (a read-only one gets none).
            commits: Some((next_xid - probe.next_xid).max(0) as u64),
            rows: None,
            wal_bytes: wal.max(0) as u64,
        }
    }

    async fn storage(&self, side: Side) -> Storage {
        let mut btrees = Vec::new();
        let mut file_bytes = 0;
        for table in Self::tables(side) {
            let row = sqlx::query(AssertSqlSafe(format!(
                "SELECT pg_table_size('{table}'), pg_total_relation_size('{table}'), \
                 (SELECT coalesce(sum(pg_column_size(t.*)), 0)::bigint FROM {table} t)"
            )))
            .fetch_one(&self.admin)
            .await
            .unwrap();
            let (size, total, payload): (i64, i64, i64) = (row.get(0), row.get(1), row.get(2));
            file_bytes += total as u64;
            btrees.push((table.to_string(), size as u64, payload as u64));
            let indexes = sqlx::query(
                "SELECT indexrelid::regclass::text, pg_relation_size(indexrelid) FROM pg_index \
                 WHERE indrelid = $1::regclass ORDER BY 1",
            )
            .bind(*table)
            .fetch_all(&self.admin)
            .await
            .unwrap();
            for ix in indexes {
                btrees.push((ix.get(0), ix.get::<i64, _>(1) as u64, 0));
            }
        }
        Storage { records: self.count(side).await, file_bytes, btrees }
    }
}

/// One target with what its rows share.
struct Env<T: Target> {
    target: T,
    store: SharedStore,
    ctx: RunContext,
    /// The payload the rows borrow (with a sequence number of their own).
    payload: Refund,
    seq: AtomicU64,
    /// The keys of the replay payloads, for the diagnostic rows that call the store directly.
    replay_keys: Vec<(Key, Fingerprint)>,
    floor_keys: Vec<[u8; 32]>,
    peer_keys: Vec<String>,
    /// The stored result, as the executor stores it.
    stored: Vec<u8>,
}

fn random_key() -> [u8; 32] {
    let mut k = [0; 32];
    k[..16].copy_from_slice(&fastrand::u128(..).to_le_bytes());
    k[16..].copy_from_slice(&fastrand::u128(..).to_le_bytes());
    k
}

fn replay_index(task: usize, i: u64) -> u64 {
    (task as u64 * 7919 + i) % REPLAY_KEYS
}

impl<T: Target> Env<T> {
    /// The environment, with the replay rows' records made done through each side (when `replay`).
    async fn new(target: T, replay: bool) -> Env<T> {
        let store = target.store();
        let mut stored = vec![b'o'];
        serde_json::to_writer(&mut stored, &RefundResult::sample()).unwrap();
        let n = if replay { REPLAY_KEYS } else { 0 };
        let env = Env {
            ctx: RunContext::new(store.clone(), "bench-run"),
            store,
            payload: Refund::new(0),
            seq: AtomicU64::new(1 << 40),
            replay_keys: Vec::new(),
            floor_keys: (0..n).map(|_| random_key()).collect(),
            peer_keys: (0..n).map(|_| format!("{:032x}", fastrand::u128(..))).collect(),
            stored,
            target,
        };
        let replay_keys = (0..n).map(|i| env.ctx.step("replayed_refund").key_for(&Refund::new(i)).unwrap()).collect();
        let env = Env { replay_keys, ..env };
        for i in 0..n {
            let r: RefundResult = env
                .ctx
                .step("replayed_refund")
                // The borrowed view: the same key as `Refund::new(i)` (the diagnostic replay row,
                // keyed by those, asserts that it finds these records).
                .run(&env.payload.with_seq(i), |_| async { Ok::<_, Error>(RefundResult::sample()) })
                .await
                .unwrap();
            black_box(r);
            env.target.floor_first(&env.floor_keys[i as usize], &env.stored).await;
            if let Some(peer) = env.target.peer() {
                let out = peer
                    .effect("replayed_refund", &env.peer_keys[i as usize])
                    .remote_idempotency(true)
                    .input(&env.payload.with_seq(i))
                    .run(|_| async { Ok::<_, EffectFailure>(RefundResult::sample()) })
                    .await
                    .expect("peer first execution");
                assert!(matches!(out, EffectOutcome::Committed(_)), "peer: {out:?}");
            }
        }
        env
    }

    async fn call(&self, path: Path, task: usize, i: u64) {
        match path {
            Path::OursFirst => {
                let payload = self.payload.with_seq(self.seq.fetch_add(1, Ordering::Relaxed));
                let r: RefundResult = self
                    .ctx
                    .step("issue_refund")
                    .run(&payload, |_| async { Ok::<_, Error>(RefundResult::sample()) })
                    .await
                    .expect("first execution");
                black_box(r);
            }
            Path::StoreFirst => {
                let key = Key::from_bytes(random_key());
                let fp = Fingerprint::from_bytes([7; 32]);
                let Acquire::Acquired(lease) =
                    self.store.acquire(&key, &fp, DEFAULT_LEASE, DEFAULT_RETENTION).await.expect("acquire")
                else {
                    panic!("a fresh key was not acquired")
                };
                let stored = Bytes::copy_from_slice(&self.stored);
                let t = self.store.complete(&key, &lease.token, stored, DEFAULT_RETENTION).await.expect("complete");
                assert_eq!(t, Transition::Ok);
            }
            Path::FloorFirst => self.target.floor_first(&random_key(), &self.stored).await,
            Path::FloorFirstGated => {
                let key = random_key();
                self.target
                    .floor_first_gated(&key, &self.stored)
                    .expect("gated rows run only where there is a gate")
                    .await
            }
            Path::PeerFirst => {
                let peer = self.target.peer().expect("peer rows run only with a peer");
                let payload = self.payload.with_seq(self.seq.fetch_add(1, Ordering::Relaxed));
                let out = peer
                    .effect("issue_refund", format!("{:032x}", fastrand::u128(..)))
                    .remote_idempotency(true)
                    .input(&payload)
                    .run(|_| async { Ok::<_, EffectFailure>(RefundResult::sample()) })
                    .await
                    .expect("peer first execution");
                assert!(matches!(out, EffectOutcome::Committed(_)), "peer: {out:?}");
            }
            Path::OursReplay => {
                let payload = self.payload.with_seq(replay_index(task, i));
                let r: RefundResult = self
                    .ctx
                    .step("replayed_refund")
                    .run(&payload, |_| async { Err::<RefundResult, _>(Error::Config("replay ran".into())) })
                    .await
                    .expect("replay");
                black_box(r);
            }
            Path::StoreReplay => {
                let (key, fp) = &self.replay_keys[replay_index(task, i) as usize];
                let a = self.store.acquire(key, fp, DEFAULT_LEASE, DEFAULT_RETENTION).await.expect("acquire");
                assert!(matches!(a, Acquire::Replay(_)));
            }
            Path::ReadFirstReplay => {
                let (key, fp) = &self.replay_keys[replay_index(task, i) as usize];
                self.target.read_first_replay(key, fp).expect("the read-first row runs only where written").await
            }
            Path::FloorReplay => self.target.floor_replay(&self.floor_keys[replay_index(task, i) as usize]).await,
            Path::FloorUpsert => self.target.floor_upsert(&self.floor_keys[replay_index(task, i) as usize]).await,
            Path::PeerReplay => {
                let peer = self.target.peer().expect("peer rows run only with a peer");
                let n = replay_index(task, i);
                let out = peer
                    .effect("replayed_refund", &self.peer_keys[n as usize])
                    .remote_idempotency(true)
                    .input(&self.payload.with_seq(n))
                    .run(|_| async { Err::<RefundResult, _>(EffectFailure::permanent("replay ran")) })
                    .await
                    .expect("peer replay");
                assert!(matches!(out, EffectOutcome::Committed(_)), "peer replay: {out:?}");
            }
        }
    }
}

async fn run<T: Target>(env: &Arc<Env<T>>, path: Path, concurrency: usize, duration: Duration) -> Sample {
    let env = env.clone();
    closed_loop(concurrency, duration, move |task, i| {
        let env = env.clone();
        async move { env.call(path, task, i).await }
    })
    .await
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
