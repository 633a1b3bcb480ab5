//! `IdempotentServer` (idempotent-mcp) in front of an rmcp tool, against the same tool served
//! bare, on one transport: streamable HTTP over loopback, client and server in this process.
//!
//! ```text
//! cargo run --release -p idempotent-benches --bin mcp_bench [-- --secs 1 --rounds 3 --concurrency 1,64 --clients 8]
//! cargo run --release -p idempotent-benches --bin mcp_bench -- --only 'floor|MemoryStore, replay'  # some rows
//! cargo run --release -p idempotent-benches --bin mcp_bench -- --fresh-connections  # rmcp's default client
//! ```
//!
//! **The transport.** Streamable HTTP is what deployed MCP servers are reached by, and each
//! `tools/call` on it is one HTTP request: rmcp's server (stateless, plain JSON replies, as the
//! tests' endpoint serves it) behind `axum::serve` on 127.0.0.1, rmcp's own client transport on
//! a reqwest client with its default pool (HTTP/1.1 keep-alive, one connection per request in
//! flight). So a row's cost is that of a call as a deployment pays it, and the protection's share
//! of it is what the ratio shows. rmcp's default client (`from_config`) keeps no idle connection,
//! so that every call opens and closes a TCP connection: a dearer floor, which would flatter the
//! ratios; `--fresh-connections` measures with it. The other
//! option, an in-process `tokio::io::duplex`, has no HTTP and one JSON-RPC stream per client; it
//! would show the protection against rmcp's dispatch alone, a floor no deployment has
//! (`alloc_count`'s MCP rows count allocations on both, for that comparison).
//!
//! **The server.** One axum server, one listener, three paths with the same service
//! configuration: `/bare` serves the `Refunds` handler (`idempotent_benches::mcp`: one tool that
//! parses two arguments and answers a small structured result), `/memory` and `/sqlite` serve
//! `IdempotentServer::new(Refunds, store)` on a `MemoryStore` and on a `SqliteStore` (a file in a
//! temporary directory, the store's embedded defaults: WAL, `synchronous = FULL`). Each request
//! is served by a clone of the handler, made once (the stateless service's factory clones it).
//!
//! **The callers.** `--concurrency` callers (`1,64`), each calling `refund` back to back until
//! the row's time is up, spread round-robin over `--clients` rmcp clients per path (default 8;
//! at concurrency 1 one client): rmcp's HTTP client sends its requests in flight together from
//! one worker task, so 64 callers on a single client would measure that task. Rows:
//!
//! - floor: the bare tool, keyless calls (the same arguments, no `_meta`);
//! - control: the bare tool, called with a new key in `_meta` every call (what carrying the key
//!   costs client and server, without the protection; no target);
//! - `MemoryStore` / `SqliteStore`, first execution: a new `dev.idempotent/key` every call
//!   (acquire, the tool, store its result);
//! - `MemoryStore` / `SqliteStore`, replay: each caller repeats its own key, stored in the row's
//!   warm-up (acquire finds the result; the tool does not run). Every measured reply is checked:
//!   replayed (`_meta["dev.idempotent/replayed"]`) in a replay row, not in the others.
//!
//! Rows are interleaved round by round (every row once, then every row again), each after a
//! 200 ms warm-up; calls/s is the median of the rounds, p50/p99 are over all rounds' calls. CPU
//! per call is the whole process's (client, server, SQLite's threads) over the measured runs. The
//! load average (`/proc/loadavg`) is printed at the start and the end.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use idempotent_benches::mcp::{Refunds, http_client, http_service, refund_call, serve};
use idempotent_benches::{Measured, RunOptions, arg, closed_loop, flag, interleaved, wanted};
use idempotent_core::{MemoryStore, SqliteStore};
use idempotent_mcp::{IdempotentServer, meta};
use rmcp::Peer;
use rmcp::model::ClientConfig;
use rmcp::service::{RoleClient, RunningService};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Row {
    Bare,
    BareKeyed,
    MemoryFirst,
    MemoryReplay,
    SqliteFirst,
    SqliteReplay,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Keys {
    /// No key.
    None,
    /// A new key every call.
    Unique,
    /// Each caller repeats one key of its own.
    PerCaller,
}

impl Row {
    const ALL: [Row; 6] =
        [Row::Bare, Row::BareKeyed, Row::MemoryFirst, Row::MemoryReplay, Row::SqliteFirst, Row::SqliteReplay];

    fn label(self) -> &'static str {
        match self {
            Row::Bare => "floor: bare rmcp tool (no protection, no key)",
            Row::BareKeyed => "control: bare rmcp tool, a new key in `_meta`",
            Row::MemoryFirst => "IdempotentServer + MemoryStore, first execution",
            Row::MemoryReplay => "IdempotentServer + MemoryStore, replay",
            Row::SqliteFirst => "IdempotentServer + SqliteStore, first execution",
            Row::SqliteReplay => "IdempotentServer + SqliteStore, replay",
        }
    }

    fn keys(self) -> Keys {
        match self {
            Row::Bare => Keys::None,
            Row::BareKeyed | Row::MemoryFirst | Row::SqliteFirst => Keys::Unique,
            Row::MemoryReplay | Row::SqliteReplay => Keys::PerCaller,
        }
    }

    fn path(self) -> usize {
        match self {
            Row::Bare | Row::BareKeyed => 0,
            Row::MemoryFirst | Row::MemoryReplay => 1,
            Row::SqliteFirst | Row::SqliteReplay => 2,
        }
    }

    /// The issue's target, as a share of the floor's calls/s.
    fn target(self) -> Option<f64> {
        match self {
            Row::Bare | Row::BareKeyed => None,
            Row::MemoryFirst | Row::MemoryReplay => Some(0.85),
            Row::SqliteFirst | Row::SqliteReplay => Some(0.8),
        }
    }
}

const PATHS: [&str; 3] = ["/bare", "/memory", "/sqlite"];

static KEY_SEQ: AtomicU64 = AtomicU64::new(0);

/// `concurrency` callers on `peers` (caller `t` on peer `t % len`), calling `refund` back to
/// back for `duration`; when `check`, every reply must be a replay exactly when the row replays.
async fn load(
    peers: &[Peer<RoleClient>],
    concurrency: usize,
    duration: Duration,
    row: Row,
    check: bool,
) -> idempotent_benches::Sample {
    let peers: Arc<Vec<Peer<RoleClient>>> = Arc::new(peers.to_vec());
    let keys = row.keys();
    closed_loop(concurrency, duration, move |task, _| {
        let peer = peers[task % peers.len()].clone();
        async move {
            let key = match keys {
                Keys::None => None,
                Keys::Unique => Some(format!("k-{}", KEY_SEQ.fetch_add(1, Ordering::Relaxed))),
                Keys::PerCaller => Some(format!("replay-{task}")),
            };
            let result = peer.call_tool(refund_call(key)).await.expect("tools/call");
            assert_ne!(result.is_error, Some(true), "the tool failed: {result:?}");
            if check {
                assert_eq!(meta::is_replayed(&result), keys == Keys::PerCaller, "{row:?}: {result:?}");
            }
        }
    })
    .await
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg").map_or_else(|_| "?".into(), |l| l.trim().to_owned())
}

fn main() {
    let opts = RunOptions::from_args();
    let clients: usize = arg("--clients", 8usize).max(1);
    let keep_alive = !flag("--fresh-connections");
    let (duration, warmup, rt) = (opts.duration(), opts.warmup(), opts.runtime());
    let RunOptions { secs, rounds, workers, concurrencies, only, .. } = opts;
    let load_start = loadavg();

    let dir = tempfile::tempdir().expect("a temporary directory");
    let db = dir.path().join("mcp-records.db");
    let max_clients = concurrencies.iter().map(|&c| c.min(clients)).max().unwrap_or(1).max(1);
    let running = rt.block_on(async {
        let sqlite = SqliteStore::connect(&db).await.expect("open the SQLite store");
        let router = axum::Router::new()
            .nest_service(PATHS[0], http_service(Refunds::default()))
            .nest_service(PATHS[1], http_service(IdempotentServer::new(Refunds::default(), MemoryStore::new())))
            .nest_service(PATHS[2], http_service(IdempotentServer::new(Refunds::default(), sqlite)));
        let addr = serve(router).await;
        let mut running: Vec<Vec<RunningService<RoleClient, ClientConfig>>> = Vec::new();
        for path in PATHS {
            let mut per_path = Vec::new();
            for _ in 0..max_clients {
                per_path.push(http_client(format!("http://{addr}{path}"), keep_alive).await);
            }
            running.push(per_path);
        }
        running
    });
    let peers: Vec<Vec<Peer<RoleClient>>> =
        running.iter().map(|path| path.iter().map(|c| c.peer().clone()).collect()).collect();

    let rows: Vec<(usize, Row, &str)> = Row::ALL
        .iter()
        .copied()
        .enumerate()
        .filter(|(_, r)| wanted(&only, r.label()))
        .map(|(idx, r)| (idx, r, r.label()))
        .collect();
    let started = Instant::now();
    let table = interleaved(rounds, &concurrencies, &rows, "calls/s", |concurrency, row, measured| {
        let peers = &peers[row.path()][..concurrency.min(clients)];
        rt.block_on(load(peers, concurrency, if measured { duration } else { warmup }, row, measured))
    });

    println!(
        "\nmcp_bench: rmcp {} streamable HTTP (stateless, JSON replies) on 127.0.0.1{{/bare,/memory,/sqlite}}, rmcp's \
         client transport on reqwest ({}), up to {clients} clients per path, tokio {workers} workers shared by clients and server, \
         {rounds} rounds × {secs} s per row (interleaved), {:.0} s total; SQLite file in {}\n\
         load average at start: {load_start}; at end: {}\n",
        RMCP_VERSION,
        if keep_alive { "keep-alive" } else { "rmcp's default client: a new connection per call" },
        started.elapsed().as_secs_f64(),
        dir.path().display(),
        loadavg()
    );
    let rate = |c: usize, row: Row| {
        let idx = Row::ALL.iter().position(|&r| r == row).unwrap();
        table.get(&(c, idx)).map(|m| m.rounds.median_rate())
    };
    let mut verdicts = Vec::new();
    for &concurrency in &concurrencies {
        println!("concurrency {concurrency} (callers, on {} client(s) per path)\n", concurrency.min(clients));
        println!("| row | calls/s (median) | min–max of rounds | p50 µs | p99 µs | process CPU µs/call | ÷ floor |");
        println!("|---|--:|--:|--:|--:|--:|--:|");
        let floor_cpu = table.get(&(concurrency, 0)).map(Measured::cpu_per_call_us);
        for m in table.range((concurrency, 0)..(concurrency + 1, 0)).map(|(_, m)| m) {
            let ratio = (m.row != Row::Bare).then_some(()).and_then(|()| {
                let r = rate(concurrency, m.row)? / rate(concurrency, Row::Bare)?;
                let Some(target) = m.row.target() else { return Some(format!("{r:.2}")) };
                verdicts.push(format!(
                    "- c={concurrency} {}: {r:.2}× the floor (target ≥ {target}: {}); CPU {:.1} µs/call against \
                     the floor's {:.1}",
                    m.row.label(),
                    if r >= target { "met" } else { "MISSED" },
                    m.cpu_per_call_us(),
                    floor_cpu.unwrap_or(f64::NAN)
                ));
                Some(format!("{r:.2}"))
            });
            println!("| {} | {} | {} |", m.row.label(), m.cells(), ratio.unwrap_or_default());
        }
        println!();
    }
    println!("Targets (the floor's calls/s × 0.85 on MemoryStore, × 0.8 on SqliteStore):");
    for v in verdicts {
        println!("{v}");
    }
    drop(running);
}

/// The rmcp version the workspace pins (for the header).
const RMCP_VERSION: &str = "3.11";
