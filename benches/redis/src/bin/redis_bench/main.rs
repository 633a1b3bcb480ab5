//! `RedisStore` through the executor against the floor Redis itself sets, in one run.
//!
//! ```text
//! cargo run --release --manifest-path benches/redis/Cargo.toml --bin redis_bench [-- --secs 1 --rounds 3 --pool 4 --wait --valkey]
//! ```
//!
//! Spawns its own `redis-server` (through the test harness), then measures at concurrency 1 and
//! 64, from one process and one runtime:
//!
//! - first execution and replay through `RunContext::step(..).run(..)` on a `RedisStore` (of
//!   `--pool` connections, and again on a store of one), and first execution on a store that
//!   calls its scripts by `EVALSHA` (functions off);
//! - the floor, through the same redis client and connection setup as the store (`pool` multiplexed
//!   connections checked out of a deadpool pool built with the store's settings, one picked
//!   round-robin per command, where the store sends its plain reads on its first): for a replay
//!   one raw round trip (`GET`, and `EVALSHA` of a trivial `GET` script), for a first execution two (`SET NX` + `SET`, and two `EVALSHA` of a trivial
//!   `SET` script); and the raw floors again on one multiplexed connection, which at 64 callers
//!   is often the faster (more commands per socket write and per pass of Redis' event loop):
//!   every ratio is taken against the better of the two raw floors of its run. The floors send
//!   one command per call, as a hand-written client would; the store, under load, sends
//!   acquire's reads together as one `MGET` (its `reads.rs`), which `INFO commandstats` shows;
//! - control rows: the pooled `GET` and `SET NX` + `SET` floors measured again as rows of their
//!   own, so that each run prints how far two measures of the same work differ in it (the
//!   "Noise" lines): a ratio between two rows of the run is readable only where it stands
//!   further from 1 than that;
//! - with `--wait` (a replica started with `REPLICAOF`, attached to the server for the whole run):
//!   first execution and replay on a second store built with `wait_for_replicas(1, 100 ms)`, and
//!   the floor with `WAIT 1 100` pipelined behind each of its two `SET`s;
//! - the peer: the `idempotent` crate 0.3.0's `ValkeyStore` (its one multiplexed connection, as
//!   its constructor makes it), driven as its docs show (claim, run, complete; or the stored
//!   response), on the same payloads, results and rotation of replay keys;
//! - the commands each call sent, counted by `MONITOR` in a short pass of each row at
//!   concurrency 1 after the timed rounds (`INFO commandstats` counts a script's commands as if a
//!   client had sent them, and cannot tell our acquire's `SET` from the `SET` inside the complete
//!   script), and the
//!   time Redis spent executing them, from `INFO commandstats` of the timed rounds (a command's
//!   time counted in the share clients sent, so a script's inner commands are not counted twice).
//!
//! Rows are interleaved round by round (every row once, then every row again …, each round
//! starting one row later) so that noise from other processes on the machine, and what one row
//! leaves Redis to do, lands on all rows alike; calls/s is the median of the rounds, p50/p99 are
//! over all rounds' calls together.

use std::collections::BTreeMap;
use std::hint::black_box;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use idempotent_benches::{
    REDIS_TIMEOUT, RawRedis, Refund, RefundResult, Rounds, RunOptions, Sample, closed_loop, fmt_rate, process_cpu,
};
use idempotent_core::record::{Acquire, Transition};
use idempotent_core::redis::{self, Script, Value};
use idempotent_core::{DEFAULT_LEASE, DEFAULT_RETENTION, Error, Fingerprint, Key, RedisStore, RunContext, Store};
use idempotent_peer::store::valkey::ValkeyStore;
use idempotent_tests::{Flavor, Monitored, RedisServer};
use path::Path;
use peer::Peer;
use server_stats::{command_stats, info, sent_share, server_cpu};

mod path;
mod peer;
mod server_stats;

/// Keys pre-filled for the replay rows.
const REPLAY_KEYS: u64 = 4096;

struct Env {
    ctx: RunContext,
    /// On a store that calls its scripts by `EVALSHA` (`RedisStoreBuilder::functions(false)`).
    ctx_evalsha: RunContext,
    /// On a store of one connection (`RedisStoreBuilder::pool_size(1)`).
    ctx_one: RunContext,
    /// On a store that waits for one replica (`--wait`).
    ctx_wait: Option<RunContext>,
    /// The payload the rows through the executor borrow (with a sequence number of their own).
    payload: Refund,
    store: RedisStore,
    /// The keys of the replay rows' payloads, for the rows that call the store directly.
    replay_keys: Vec<(Key, Fingerprint)>,
    /// The keys the replay floors read, built once like the replay rows' payloads.
    floor_keys: Vec<String>,
    raw: RawRedis,
    /// The raw floors' client on one multiplexed connection.
    raw_one: RawRedis,
    seq: AtomicU64,
    set_script: Script,
    get_script: Script,
    /// What the first round trip of a first execution writes (about what acquire writes).
    claim: Vec<u8>,
    /// The stored result, as the executor stores it.
    stored: Vec<u8>,
    peer: Peer,
}

fn replay_index(task: usize, i: u64) -> u64 {
    (task as u64 * 7919 + i) % REPLAY_KEYS
}

async fn run(env: &Arc<Env>, path: Path, concurrency: usize, duration: Duration) -> Sample {
    let env = env.clone();
    closed_loop(concurrency, duration, move |task, i| {
        let env = env.clone();
        async move {
            match path {
                Path::OursFirst { heartbeat } => {
                    let payload = env.payload.with_seq(env.seq.fetch_add(1, Ordering::Relaxed));
                    let r: RefundResult = env
                        .ctx
                        .step("issue_refund")
                        .heartbeat(heartbeat)
                        .run(&payload, |_| async { Ok::<_, Error>(RefundResult::sample()) })
                        .await
                        .expect("first execution");
                    black_box(r);
                }
                Path::OursFirstEvalsha | Path::OursFirstOne => {
                    let payload = env.payload.with_seq(env.seq.fetch_add(1, Ordering::Relaxed));
                    let ctx = if path == Path::OursFirstOne { &env.ctx_one } else { &env.ctx_evalsha };
                    let r: RefundResult = ctx
                        .step("issue_refund")
                        .run(&payload, |_| async { Ok::<_, Error>(RefundResult::sample()) })
                        .await
                        .expect("first execution");
                    black_box(r);
                }
                Path::OursFirstWait => {
                    let payload = env.payload.with_seq(env.seq.fetch_add(1, Ordering::Relaxed));
                    let r: RefundResult = env
                        .ctx_wait
                        .as_ref()
                        .expect("--wait")
                        .step("issue_refund")
                        .run(&payload, |_| async { Ok::<_, Error>(RefundResult::sample()) })
                        .await
                        .expect("first execution");
                    black_box(r);
                }
                Path::OursReplayWait => {
                    let payload = env.payload.with_seq(replay_index(task, i));
                    let r: RefundResult = env
                        .ctx_wait
                        .as_ref()
                        .expect("--wait")
                        .step("replayed_refund")
                        .run(&payload, |_| async { Err::<RefundResult, _>(Error::Config("replay ran".into())) })
                        .await
                        .expect("replay");
                    black_box(r);
                }
                Path::FloorSetSetWait => {
                    let key = format!("floor:first:{}", env.seq.fetch_add(1, Ordering::Relaxed));
                    for (value, nx, ttl) in [(&env.claim, true, 60_000), (&env.stored, false, 86_400_000)] {
                        let mut set = redis::cmd("SET");
                        set.arg(&key).arg(value.as_slice());
                        if nx {
                            set.arg("NX");
                        }
                        set.arg("PX").arg(ttl);
                        let (_, acked): (Value, i64) = redis::pipe()
                            .add_command(set)
                            .add_command(redis::cmd("WAIT").arg(1).arg(100).to_owned())
                            .query_async(&mut env.raw.conn())
                            .await
                            .expect("SET + WAIT");
                        assert_eq!(acked, 1, "the replica did not acknowledge");
                    }
                }
                Path::OursReplay | Path::OursReplayOne => {
                    let payload = env.payload.with_seq(replay_index(task, i));
                    let ctx = if path == Path::OursReplay { &env.ctx } else { &env.ctx_one };
                    let r: RefundResult = ctx
                        .step("replayed_refund")
                        .run(&payload, |_| async { Err::<RefundResult, _>(Error::Config("replay ran".into())) })
                        .await
                        .expect("replay");
                    black_box(r);
                }
                Path::StoreFirst => {
                    let mut k = [0xa5; 32];
                    k[..8].copy_from_slice(&env.seq.fetch_add(1, Ordering::Relaxed).to_le_bytes());
                    let key = Key::from_bytes(k);
                    let fp = Fingerprint::from_bytes([7; 32]);
                    let Acquire::Acquired(lease) =
                        env.store.acquire(&key, &fp, DEFAULT_LEASE, DEFAULT_RETENTION).await.expect("acquire")
                    else {
                        panic!("a fresh key was not acquired")
                    };
                    let stored = Bytes::copy_from_slice(&env.stored);
                    let t = env.store.complete(&key, &lease.token, stored, DEFAULT_RETENTION).await.expect("complete");
                    assert_eq!(t, Transition::Ok);
                }
                Path::StoreReplay => {
                    let (key, fp) = &env.replay_keys[replay_index(task, i) as usize];
                    let a = env.store.acquire(key, fp, DEFAULT_LEASE, DEFAULT_RETENTION).await.expect("acquire");
                    assert!(matches!(a, Acquire::Replay(_)));
                }
                Path::FloorSetSet | Path::FloorSetSetOne | Path::FloorSetSetAgain => {
                    let key = format!("floor:first:{}", env.seq.fetch_add(1, Ordering::Relaxed));
                    let raw = if path == Path::FloorSetSetOne { &env.raw_one } else { &env.raw };
                    raw.set_nx_then_set(&key, &env.claim, &env.stored).await;
                }
                Path::FloorEvalEval => {
                    let key = format!("floor:first:{}", env.seq.fetch_add(1, Ordering::Relaxed));
                    let v: Value = env
                        .set_script
                        .key(&key)
                        .arg(&env.claim)
                        .arg(60_000)
                        .invoke_async(&mut env.raw.conn())
                        .await
                        .expect("EVALSHA");
                    black_box(v);
                    let v: Value = env
                        .set_script
                        .key(&key)
                        .arg(&env.stored)
                        .arg(86_400_000)
                        .invoke_async(&mut env.raw.conn())
                        .await
                        .expect("EVALSHA");
                    black_box(v);
                }
                Path::PeerFirst => {
                    let payload = env.payload.with_seq(env.seq.fetch_add(1, Ordering::Relaxed));
                    black_box(env.peer.run("issue_refund", &payload, RefundResult::sample).await);
                }
                Path::PeerReplay => {
                    let payload = env.payload.with_seq(replay_index(task, i));
                    let replay = || panic!("peer: a replay ran its action");
                    black_box(env.peer.run("replayed_refund", &payload, replay).await);
                }
                Path::FloorGet | Path::FloorGetOne | Path::FloorGetAgain => {
                    let raw = if path == Path::FloorGetOne { &env.raw_one } else { &env.raw };
                    let v: Value = redis::cmd("GET")
                        .arg(&env.floor_keys[replay_index(task, i) as usize])
                        .query_async(&mut raw.conn())
                        .await
                        .expect("GET");
                    assert!(matches!(v, Value::BulkString(_)));
                }
                Path::FloorEvalGet => {
                    let v: Value = env
                        .get_script
                        .key(&env.floor_keys[replay_index(task, i) as usize])
                        .invoke_async(&mut env.raw.conn())
                        .await
                        .expect("EVALSHA");
                    assert!(matches!(v, Value::BulkString(_)));
                }
            }
        }
    })
    .await
}

/// Counts, with `MONITOR`, the commands one call of `path` sends (and those its scripts run),
/// over a short pass at concurrency 1: (calls made, monitored commands).
fn monitor_pass(rt: &tokio::runtime::Runtime, env: &Arc<Env>, server: &RedisServer, path: Path) -> (u64, Monitored) {
    let monitor = server.monitor();
    let sample = rt.block_on(run(env, path, 1, Duration::from_millis(200)));
    (sample.calls, monitor.finish())
}

struct Row {
    path: Path,
    rounds: Rounds,
    /// `INFO commandstats` over the timed rounds: command → (calls, usec).
    stats: BTreeMap<String, (u64, u64)>,
    /// Redis process CPU (`INFO cpu`), which adds connection handling and reply writing.
    server_cpu: Duration,
    /// This process's CPU.
    client_cpu: Duration,
}

fn main() {
    let opts = RunOptions::from_args();
    let (duration, warmup, rt) = (opts.duration(), opts.warmup(), opts.runtime());
    let RunOptions { secs, rounds, pool, workers, concurrencies, only } = opts;

    let wait = idempotent_benches::flag("--wait");
    // `--valkey`: valkey-server 9 (SET … IFEQ: completions are plain commands) instead of Redis.
    let valkey = idempotent_benches::flag("--valkey");
    let flavor = if valkey { Flavor::Valkey } else { Flavor::Redis };
    let server = RedisServer::start_flavor(flavor);
    // Attached for the whole run, so that every row runs against a master with a replica.
    let replica = wait.then(|| {
        let replica = RedisServer::start_flavor(flavor);
        replica.follow(&server);
        replica
    });
    let store =
        RedisStore::builder(server.url()).pool_size(pool).command_timeout(REDIS_TIMEOUT).connect_lazy().unwrap();
    let store_evalsha = RedisStore::builder(server.url())
        .pool_size(pool)
        .command_timeout(REDIS_TIMEOUT)
        .functions(false)
        .connect_lazy()
        .unwrap();
    let store_one =
        RedisStore::builder(server.url()).pool_size(1).command_timeout(REDIS_TIMEOUT).connect_lazy().unwrap();
    let store_wait = wait.then(|| {
        RedisStore::builder(server.url())
            .pool_size(pool)
            .command_timeout(REDIS_TIMEOUT)
            .wait_for_replicas(1, Duration::from_millis(100))
            .connect_lazy()
            .unwrap()
    });
    let env = rt.block_on(async {
        store.warm_up().await.expect("warm up the store");
        store_evalsha.warm_up().await.expect("warm up the EVALSHA store");
        store_one.warm_up().await.expect("warm up the one-connection store");
        if let Some(s) = &store_wait {
            s.warm_up().await.expect("warm up the waiting store");
        }
        let raw = RawRedis::connect(&server.url(), pool).await;
        let raw_one = RawRedis::connect(&server.url(), 1).await;
        let peer_client = redis::Client::open(server.url()).expect("the peer's client");
        let peer = Peer { store: ValkeyStore::with_prefix(peer_client, Some("peer")).await.expect("the peer's store") };
        let ctx = RunContext::new(store.clone(), "bench-run");
        let replay_keys =
            (0..REPLAY_KEYS).map(|n| ctx.step("replayed_refund").key_for(&Refund::new(n)).unwrap()).collect();
        let mut stored = vec![b'o'];
        serde_json::to_writer(&mut stored, &RefundResult::sample()).unwrap();
        let env = Arc::new(Env {
            ctx,
            ctx_evalsha: RunContext::new(store_evalsha, "bench-run"),
            ctx_one: RunContext::new(store_one, "bench-run"),
            ctx_wait: store_wait.map(|s| RunContext::new(s, "bench-run")),
            payload: Refund::new(0),
            store,
            replay_keys,
            floor_keys: (0..REPLAY_KEYS).map(|n| format!("floor:replay:{n}")).collect(),
            raw,
            raw_one,
            seq: AtomicU64::new(0),
            set_script: Script::new("return redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])"),
            get_script: Script::new("return redis.call('GET', KEYS[1])"),
            claim: vec![b'c'; 120],
            stored,
            peer,
        });
        for n in 0..REPLAY_KEYS {
            let r: RefundResult = env
                .ctx
                .step("replayed_refund")
                // The borrowed view: the same key as `Refund::new(n)` (the store-only replay row,
                // keyed by those, asserts that it finds these records).
                .run(&env.payload.with_seq(n), |_| async { Ok::<_, Error>(RefundResult::sample()) })
                .await
                .unwrap();
            black_box(r);
            let payload = env.payload.with_seq(n);
            black_box(env.peer.run("replayed_refund", &payload, RefundResult::sample).await);
            let _: () = redis::cmd("SET")
                .arg(&env.floor_keys[n as usize])
                .arg(&env.stored)
                .query_async(&mut env.raw.conn())
                .await
                .unwrap();
        }
        env
    });

    let paths: Vec<(usize, Path)> = Path::ALL
        .iter()
        .copied()
        .enumerate()
        .filter(|(_, p)| idempotent_benches::wanted(&only, p.label()) && (wait || !p.waits()))
        .collect();
    let mut table: BTreeMap<(usize, usize), Row> = BTreeMap::new();
    let started = Instant::now();
    for round in 0..rounds {
        for &concurrency in &concurrencies {
            // Each round starts one row later, so that no row always follows the same one (the
            // first-execution rows leave Redis new keys to rehash, which the next row pays for).
            for &(idx, path) in paths.iter().cycle().skip(round % paths.len().max(1)).take(paths.len()) {
                rt.block_on(run(&env, path, concurrency, warmup));
                server.reset_stats();
                let (client0, server0) = (process_cpu(), server_cpu(&server));
                let sample = rt.block_on(run(&env, path, concurrency, duration));
                let (client1, server1) = (process_cpu(), server_cpu(&server));
                let stats = command_stats(&server);
                eprintln!(
                    "round {}/{rounds} c={concurrency:<3} {:<48} {:>9} calls/s",
                    round + 1,
                    path.label(),
                    fmt_rate(sample.rate()),
                );
                let row = table.entry((concurrency, idx)).or_insert_with(|| Row {
                    path,
                    rounds: Rounds::default(),
                    stats: BTreeMap::new(),
                    server_cpu: Duration::ZERO,
                    client_cpu: Duration::ZERO,
                });
                for (name, (calls, usec)) in stats {
                    let total = row.stats.entry(name).or_default();
                    total.0 += calls;
                    total.1 += usec;
                }
                row.server_cpu += server1.saturating_sub(server0);
                row.client_cpu += client1.saturating_sub(client0);
                row.rounds.push(sample);
            }
        }
    }

    // Commands per call, by MONITOR, once per path.
    let mut monitored: BTreeMap<usize, (u64, Monitored)> = BTreeMap::new();
    for &(idx, path) in &paths {
        monitored.insert(idx, monitor_pass(&rt, &env, &server, path));
    }
    // Per path: client commands per call, their names, and the share of each command's calls
    // that clients sent (the rest ran inside scripts, whose time EVALSHA already counts).
    let commands = |idx: usize| {
        let (calls, seen) = &monitored[&idx];
        let mut names: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
        for n in &seen.client {
            names.entry(n).or_default().0 += 1;
        }
        for n in &seen.script {
            names.entry(n).or_default().1 += 1;
        }
        let per_call = seen.client.len() as f64 / (*calls).max(1) as f64;
        // "name=per call" for the commands `pick` counts.
        let list = |pick: fn(&(u64, u64)) -> u64| {
            names
                .iter()
                .filter(|(_, n)| pick(n) > 0)
                .map(|(name, n)| format!("{name}={:.2}", pick(n) as f64 / (*calls).max(1) as f64))
                .collect::<Vec<_>>()
                .join(" ")
        };
        let (listed, inner) = (list(|n| n.0), list(|n| n.1));
        let share: BTreeMap<String, f64> =
            names.iter().map(|(n, (c, s))| (n.to_string(), *c as f64 / (c + s).max(1) as f64)).collect();
        (per_call, listed, inner, share)
    };

    let server_info = info(&server, "server");
    let field = |name: &str| server_info.lines().find_map(|l| l.strip_prefix(name).map(str::to_owned));
    // Valkey also says `redis_version:7.2.4`: its own version first.
    let version = field("valkey_version:")
        .map(|v| format!("valkey-server {v}"))
        .or_else(|| field("redis_version:").map(|v| format!("redis-server {v}")))
        .unwrap_or_default();
    println!(
        "\nredis_bench: {version} on loopback, RedisStore pool_size {pool}, tokio {workers} workers, \
         {rounds} rounds × {secs} s per row (interleaved), {:.0} s total\n",
        started.elapsed().as_secs_f64()
    );
    let row_of = |c: usize, p: Path| table.get(&(c, Path::ALL.iter().position(|&q| q == p).unwrap()));
    let rate = |c: usize, p: Path| row_of(c, p).map(|row| row.rounds.median_rate());
    let ratio = |c: usize, ours: Path, floor: Path| match (rate(c, ours), rate(c, floor)) {
        (Some(o), Some(f)) => Some(o / f),
        _ => None,
    };
    let show = |r: Option<f64>| r.map(|r| format!("{r:.2}")).unwrap_or_default();
    let p99 = |c: usize, p: Path| row_of(c, p).map(|row| row.rounds.quantile_us(0.99));
    // The raw floor a row is held to: the faster of the pooled one and the one on one connection,
    // in this run; and the floor of `EVALSHA`s of trivial scripts.
    let floors = |c: usize, p: Path| {
        let (raw, one, eval) = match p {
            Path::OursFirst { .. }
            | Path::OursFirstOne
            | Path::OursFirstEvalsha
            | Path::OursFirstWait
            | Path::FloorSetSetWait
            | Path::PeerFirst
            | Path::StoreFirst => (Path::FloorSetSet, Path::FloorSetSetOne, Path::FloorEvalEval),
            Path::OursReplay | Path::OursReplayOne | Path::StoreReplay | Path::OursReplayWait | Path::PeerReplay => {
                (Path::FloorGet, Path::FloorGetOne, Path::FloorEvalGet)
            }
            _ => return None,
        };
        let better = match (rate(c, raw), rate(c, one)) {
            (Some(a), Some(b)) if b > a => one,
            (Some(_), _) => raw,
            (None, _) => one,
        };
        Some((better, eval))
    };
    for &concurrency in &concurrencies {
        println!("concurrency {concurrency}\n");
        println!(
            "| path | calls/s (median) | min–max of rounds | p50 µs | p99 µs | client cmds/call \
             | ÷ better raw floor | p99 ÷ its p99 | ÷ EVALSHA floor | client CPU µs/call | redis CPU µs/call | redis cmd µs/call |"
        );
        println!("|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|");
        for ((c, idx), row) in table.range((concurrency, 0)..(concurrency + 1, 0)) {
            debug_assert_eq!(*c, concurrency);
            let (per_call, _, _, share) = commands(*idx);
            let server_usec: f64 =
                row.stats.iter().map(|(name, (_, usec))| *usec as f64 * sent_share(&share, name)).sum();
            let (lo, hi) = row.rounds.rate_range();
            let calls = row.rounds.calls() as f64;
            let (raw, tail, eval) = match floors(concurrency, row.path) {
                Some((raw, eval)) => (
                    ratio(concurrency, row.path, raw),
                    p99(concurrency, raw).map(|f| row.rounds.quantile_us(0.99) / f),
                    ratio(concurrency, row.path, eval),
                ),
                None => (None, None, None),
            };
            println!(
                "| {} | {} | {}–{} | {:.0} | {:.0} | {:.3} | {} | {} | {} | {:.1} | {:.1} | {:.1} |",
                row.path.label(),
                fmt_rate(row.rounds.median_rate()),
                fmt_rate(lo),
                fmt_rate(hi),
                row.rounds.quantile_us(0.50),
                row.rounds.quantile_us(0.99),
                per_call,
                show(raw),
                show(tail),
                show(eval),
                row.client_cpu.as_secs_f64() * 1e6 / calls,
                row.server_cpu.as_secs_f64() * 1e6 / calls,
                server_usec / calls,
            );
        }
        println!();
    }
    println!("Commands per call seen by MONITOR (sent by the client; run inside scripts):\n");
    for &(idx, path) in &paths {
        let (_, listed, inner, _) = commands(idx);
        println!("- {}: {listed}; inside scripts: {}", path.label(), if inner.is_empty() { "none" } else { &inner });
    }
    // A script call's time includes the commands it ran, so the commands clients sent add up.
    println!("\nRedis command time per call, by command clients sent (µs, `INFO commandstats` of the timed rounds):\n");
    for ((c, idx), row) in &table {
        let (_, _, _, share) = commands(*idx);
        let calls = row.rounds.calls() as f64;
        let by: Vec<String> = row
            .stats
            .iter()
            .filter_map(|(name, (_, usec))| {
                let sent = sent_share(&share, name);
                (sent > 0.0).then(|| format!("{name}={:.2}", *usec as f64 * sent / calls))
            })
            .collect();
        println!("- c={c} {}: {}", row.path.label(), by.join(" "));
    }

    if wait {
        println!("\nWAIT 1 (a replica on loopback), against the same run's rows:\n");
        for &c in &concurrencies {
            println!(
                "- concurrency {c}: first execution {}× the default's calls/s, {}× the floor with WAIT; replay {}× the default's",
                show(ratio(c, Path::OursFirstWait, Path::OursFirst { heartbeat: true })),
                show(ratio(c, Path::OursFirstWait, Path::FloorSetSetWait)),
                show(ratio(c, Path::OursReplayWait, Path::OursReplay)),
            );
        }
    }
    drop(replica);

    // The same work measured as two rows: a ratio between rows of this run is readable only
    // where it stands further from 1 than these.
    println!("\nNoise: the same floor measured as two rows of this run (second ÷ first; each round's ratio):\n");
    for &c in &concurrencies {
        for (floor, again) in [(Path::FloorSetSet, Path::FloorSetSetAgain), (Path::FloorGet, Path::FloorGetAgain)] {
            let (Some(first), Some(second)) = (row_of(c, floor), row_of(c, again)) else { continue };
            let rounds: Vec<String> = first
                .rounds
                .samples
                .iter()
                .zip(&second.rounds.samples)
                .map(|(a, b)| format!("{:.2}", b.rate() / a.rate()))
                .collect();
            println!("- c={c} {}: {} ({})", floor.label(), show(ratio(c, again, floor)), rounds.join(", "));
        }
    }

    // The targets, each against the better raw floor of this run (medians of the rounds): issue
    // #39's on Valkey (native completion), issue #21's on Redis. Next to each rate ratio, the
    // same ratio by CPU per call (the floor's client + server CPU ÷ ours), which the machine's
    // noise moves less, and on Valkey the server's CPU per first execution against the floor's.
    println!("\nTargets ({}):", if valkey { "issue #39, Valkey" } else { "issue #21, Redis" });
    let verdict = |ok: Option<bool>| match ok {
        Some(true) => "met",
        Some(false) => "MISSED",
        None => "not measured",
    };
    let per_call = |c: usize, p: Path, cpu: fn(&Row) -> Duration| {
        row_of(c, p).map(|row| cpu(row).as_secs_f64() * 1e6 / row.rounds.calls() as f64)
    };
    let both = |row: &Row| row.client_cpu + row.server_cpu;
    let first = Path::OursFirst { heartbeat: true };
    for &c in &concurrencies {
        let (min, tail) = match (c, valkey) {
            (1, _) => ((0.85, 0.95), None),
            (_, true) => ((0.75, 0.85), Some(1.5)),
            (_, false) => ((0.7, 0.7), Some(1.5)),
        };
        for (label, ours, peer, min) in
            [("first execution", first, Path::PeerFirst, min.0), ("replay", Path::OursReplay, Path::PeerReplay, min.1)]
        {
            let Some((floor, _)) = floors(c, ours) else { continue };
            let r = ratio(c, ours, floor);
            let t = p99(c, ours).zip(p99(c, floor)).map(|(o, f)| o / f);
            let vs_peer = ratio(c, ours, peer);
            let tail_part = tail.map_or(String::new(), |max| {
                format!("; p99 {}× the floor's, target ≤ {max} ({})", show(t), verdict(t.map(|t| t <= max)))
            });
            let by_cpu = per_call(c, floor, both).zip(per_call(c, ours, both)).map(|(f, o)| f / o);
            let server = (valkey && c > 1 && ours == first)
                .then(|| per_call(c, ours, |row| row.server_cpu).zip(per_call(c, floor, |row| row.server_cpu)))
                .flatten()
                .map_or(String::new(), |(o, f)| {
                    let s = o / f;
                    format!("; server CPU {s:.2}× the floor's, target ≤ 1.3 ({})", verdict(Some(s <= 1.3)))
                });
            println!(
                "- c={c} {label}: {}× {} (target ≥ {min}: {}; by CPU per call {}: {}){tail_part}{server}; {}× the peer ({})",
                show(r),
                floor.label(),
                verdict(r.map(|r| r >= min)),
                show(by_cpu),
                verdict(by_cpu.map(|r| r >= min)),
                show(vs_peer),
                verdict(vs_peer.map(|r| r > 1.0)),
            );
        }
    }
}
