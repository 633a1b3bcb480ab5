//! Shared pieces of the benchmarks: realistic payloads, a closed-loop load driver that records
//! every call's latency, percentile and table helpers, and the process's peak RSS.
//!
//! The benchmarks compare each path of the library with its *floor*: the least work any
//! implementation must do for the same job (serialize and hash the payload; one or two Redis
//! round trips; an axum handler that makes one round trip itself), measured in the same process
//! and run so that machine noise hits both sides alike. See `BENCHMARKS.md` at the repository
//! root for the commands and the figures.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use idempotent_core::deadpool_redis::{self, Runtime};
use idempotent_core::redis::{self, aio::MultiplexedConnection};

use serde::{Deserialize, Serialize};

pub mod mcp;

/// A refund request of about 200 bytes of JSON: the typical small step payload.
///
/// Fields are declared in the order a person would write them, not sorted, so the canonical
/// serializer has to reorder members as it would for real structs.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Refund {
    /// The order being refunded.
    pub order_id: String,
    /// The amount in minor units.
    pub amount_cents: u64,
    /// ISO 4217 currency.
    pub currency: String,
    /// The customer's id.
    pub customer: String,
    /// Why.
    pub reason: String,
    /// A sequence number, so that callers can make every payload unique.
    pub seq: u64,
    /// Free-form tags.
    pub metadata: RefundMeta,
}

/// The nested part of [`Refund`].
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RefundMeta {
    /// Where the request came from.
    pub source: String,
    /// Who asked.
    pub agent: String,
    /// Whether a person approved it.
    pub approved: bool,
}

impl Refund {
    /// A refund with sequence number `seq`.
    pub fn new(seq: u64) -> Refund {
        Refund {
            order_id: "ord_7Hq2mXK9pLzV4rT1".into(),
            amount_cents: 1500,
            currency: "EUR".into(),
            customer: "cus_Nf3kQ8wZ2sYb6Jd0".into(),
            reason: "item arrived damaged".into(),
            seq,
            metadata: RefundMeta { source: "support".into(), agent: "llm/refunds".into(), approved: true },
        }
    }
}

/// A [`Refund`] with its text borrowed and its own sequence number: the same JSON (so the same
/// key) as the owned refund with that `seq`, built without allocating.
///
/// The timed loops use it so that what they measure is the library's work on a payload, not the
/// caller's building of one (seven `String`s per call, which no floor pays either).
#[derive(Debug, Clone, Copy, Serialize)]
pub struct RefundView<'a> {
    /// See [`Refund::order_id`].
    pub order_id: &'a str,
    /// See [`Refund::amount_cents`].
    pub amount_cents: u64,
    /// See [`Refund::currency`].
    pub currency: &'a str,
    /// See [`Refund::customer`].
    pub customer: &'a str,
    /// See [`Refund::reason`].
    pub reason: &'a str,
    /// The sequence number.
    pub seq: u64,
    /// See [`Refund::metadata`].
    pub metadata: &'a RefundMeta,
}

impl Refund {
    /// This refund, borrowed, with sequence number `seq` (see [`RefundView`]).
    pub fn with_seq(&self, seq: u64) -> RefundView<'_> {
        RefundView {
            order_id: &self.order_id,
            amount_cents: self.amount_cents,
            currency: &self.currency,
            customer: &self.customer,
            reason: &self.reason,
            seq,
            metadata: &self.metadata,
        }
    }
}

/// The result a refund step stores and replays (about 60 bytes of JSON).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RefundResult {
    /// The provider's refund id.
    pub refund_id: String,
    /// Its status.
    pub status: String,
}

impl RefundResult {
    /// The result the benchmarks' actions return.
    pub fn sample() -> RefundResult {
        RefundResult { refund_id: "re_3PqX7yLkd82Hf0Zs1mN4".into(), status: "succeeded".into() }
    }
}

/// An LLM tool call of about 4 KiB of JSON: a conversation excerpt with its arguments.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ToolCall {
    /// The tool being called.
    pub tool: String,
    /// The conversation it belongs to.
    pub conversation_id: String,
    /// The turn within the conversation.
    pub turn: u32,
    /// Sampling temperature (a float, so the number formatter is exercised).
    pub temperature: f64,
    /// The token budget.
    pub max_tokens: u32,
    /// The messages so far.
    pub messages: Vec<Message>,
    /// The tool's own arguments.
    pub arguments: ToolArgs,
}

/// One chat message.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Message {
    /// `user`, `assistant` or `tool`.
    pub role: String,
    /// The text.
    pub content: String,
}

/// The arguments of [`ToolCall`].
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ToolArgs {
    /// The recipient.
    pub to: String,
    /// The subject line.
    pub subject: String,
    /// Attachment ids.
    pub attachments: Vec<String>,
}

impl ToolCall {
    /// A tool call of about 4 KiB, with sequence number `turn`.
    pub fn new(turn: u32) -> ToolCall {
        const TEXT: &str = "The customer reports that the parcel arrived two days late and the box was \
                            crushed on one side; the blender inside works but the jug has a hairline \
                            crack near the handle. They would like a replacement jug rather than a refund, \
                            and ask whether \"express\" shipping can be used this time.\n";
        let messages = (0..13)
            .map(|i| Message {
                role: if i % 2 == 0 { "user".into() } else { "assistant".into() },
                content: format!("{i}: {}", &TEXT[..TEXT.len() - (i * 7)]),
            })
            .collect();
        ToolCall {
            tool: "send_email".into(),
            conversation_id: "conv_01HZX3K9Q7M2V8B4N6P0R5T1Y".into(),
            turn,
            temperature: 0.7,
            max_tokens: 1024,
            messages,
            arguments: ToolArgs {
                to: "customer@example.com".into(),
                subject: "Your replacement jug is on its way".into(),
                attachments: vec!["att_1".into(), "att_2".into()],
            },
        }
    }
}

/// What one closed-loop run measured.
#[derive(Debug, Clone, Default)]
pub struct Sample {
    /// Calls completed.
    pub calls: u64,
    /// Wall time from the first call's start to the last call's end.
    pub elapsed: Duration,
    /// Every call's latency in nanoseconds, unsorted.
    pub latencies_ns: Vec<u64>,
}

impl Sample {
    /// Calls per second.
    pub fn rate(&self) -> f64 {
        self.calls as f64 / self.elapsed.as_secs_f64()
    }
}

/// Runs `concurrency` tasks that each call `call(task, i)` back to back until `duration` has
/// passed (a call in progress at the deadline finishes and counts), recording every latency.
///
/// Must run inside a Tokio runtime; the tasks are spawned, so a multi-thread runtime spreads them.
pub async fn closed_loop<F, Fut>(concurrency: usize, duration: Duration, call: F) -> Sample
where
    F: Fn(usize, u64) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let call = Arc::new(call);
    let start = Instant::now();
    let deadline = start + duration;
    let tasks: Vec<_> = (0..concurrency)
        .map(|task| {
            let call = call.clone();
            tokio::spawn(async move {
                let mut latencies = Vec::with_capacity(16 * 1024);
                let mut i = 0;
                loop {
                    let t0 = Instant::now();
                    if t0 >= deadline {
                        break;
                    }
                    call(task, i).await;
                    latencies.push(t0.elapsed().as_nanos() as u64);
                    i += 1;
                }
                latencies
            })
        })
        .collect();
    let mut sample = Sample::default();
    for t in tasks {
        let mut l = t.await.expect("a benchmark task panicked");
        sample.latencies_ns.append(&mut l);
    }
    sample.elapsed = start.elapsed();
    sample.calls = sample.latencies_ns.len() as u64;
    sample
}

/// Several runs of the same measurement (rounds, interleaved with other measurements).
#[derive(Debug, Clone, Default)]
pub struct Rounds {
    /// One sample per round.
    pub samples: Vec<Sample>,
}

impl Rounds {
    /// Adds a round.
    pub fn push(&mut self, s: Sample) {
        self.samples.push(s);
    }

    /// The median of the rounds' calls per second.
    pub fn median_rate(&self) -> f64 {
        let mut r: Vec<f64> = self.samples.iter().map(Sample::rate).collect();
        r.sort_by(f64::total_cmp);
        match r.len() {
            0 => 0.0,
            n if !n.is_multiple_of(2) => r[n / 2],
            n => (r[n / 2 - 1] + r[n / 2]) / 2.0,
        }
    }

    /// The lowest and highest round's calls per second.
    pub fn rate_range(&self) -> (f64, f64) {
        let r = self.samples.iter().map(Sample::rate);
        (r.clone().fold(f64::INFINITY, f64::min), r.fold(0.0, f64::max))
    }

    /// The `q` quantile (0..=1) of all rounds' latencies together, in microseconds.
    pub fn quantile_us(&self, q: f64) -> f64 {
        let mut all: Vec<u64> = self.samples.iter().flat_map(|s| s.latencies_ns.iter().copied()).collect();
        quantile_us(&mut all, q)
    }

    /// Calls in all rounds together.
    pub fn calls(&self) -> u64 {
        self.samples.iter().map(|s| s.calls).sum()
    }
}

/// One row's rounds of an [`interleaved`] run, with the process's CPU time over them.
#[derive(Debug, Clone)]
pub struct Measured<R> {
    /// The row.
    pub row: R,
    /// Its rounds.
    pub rounds: Rounds,
    /// The process's CPU time over its measured calls (warm-ups not counted).
    pub cpu: Duration,
}

impl<R> Measured<R> {
    /// The process's CPU time per call, in microseconds.
    pub fn cpu_per_call_us(&self) -> f64 {
        self.cpu.as_secs_f64() * 1e6 / self.rounds.calls() as f64
    }

    /// The cells every bench table shows for a row, `|`-separated: the median rate, the
    /// rounds' lowest and highest, p50 and p99 (µs), and the CPU time per call (µs).
    pub fn cells(&self) -> String {
        let (lo, hi) = self.rounds.rate_range();
        format!(
            "{} | {}–{} | {:.0} | {:.0} | {:.1}",
            fmt_rate(self.rounds.median_rate()),
            fmt_rate(lo),
            fmt_rate(hi),
            self.rounds.quantile_us(0.50),
            self.rounds.quantile_us(0.99),
            self.cpu_per_call_us()
        )
    }
}

/// Measures `rows` (each with its index in the bench's list of rows, and its label) at every
/// concurrency, round by round: every row once, then every row again, `rounds` times.
/// `measure(concurrency, row, measured)` makes one run of calls and returns its sample: a
/// warm-up (`measured` false) and then the measured run, whose rate is printed to stderr.
/// Answers the rows keyed by (concurrency, index).
pub fn interleaved<R: Copy>(
    rounds: usize,
    concurrencies: &[usize],
    rows: &[(usize, R, &str)],
    unit: &str,
    mut measure: impl FnMut(usize, R, bool) -> Sample,
) -> BTreeMap<(usize, usize), Measured<R>> {
    let mut table = BTreeMap::new();
    for round in 0..rounds {
        for &concurrency in concurrencies {
            for &(idx, row, label) in rows {
                measure(concurrency, row, false);
                let cpu0 = process_cpu();
                let sample = measure(concurrency, row, true);
                let cpu = process_cpu().saturating_sub(cpu0);
                eprintln!(
                    "round {}/{rounds} c={concurrency:<3} {label:<58} {:>9} {unit}",
                    round + 1,
                    fmt_rate(sample.rate())
                );
                let entry = table.entry((concurrency, idx)).or_insert_with(|| Measured {
                    row,
                    rounds: Rounds::default(),
                    cpu: Duration::ZERO,
                });
                entry.rounds.push(sample);
                entry.cpu += cpu;
            }
        }
    }
    table
}

/// The `q` quantile of latencies given in nanoseconds, in microseconds (sorts `ns`).
pub fn quantile_us(ns: &mut [u64], q: f64) -> f64 {
    if ns.is_empty() {
        return f64::NAN;
    }
    ns.sort_unstable();
    let idx = ((ns.len() as f64 - 1.0) * q).round() as usize;
    ns[idx] as f64 / 1000.0
}

/// A number of calls per second, rounded for a table (`12 345`).
pub fn fmt_rate(r: f64) -> String {
    let n = r.round() as u64;
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push('\u{202f}');
        }
        out.push(c);
    }
    out
}

/// The process's peak resident set size (`VmHWM`) in KiB, if `/proc` has it.
pub fn peak_rss_kib() -> Option<u64> {
    proc_status_kib("VmHWM:")
}

/// The process's current resident set size (`VmRSS`) in KiB, if `/proc` has it.
pub fn rss_kib() -> Option<u64> {
    proc_status_kib("VmRSS:")
}

fn proc_status_kib(field: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    line[field.len()..].trim().trim_end_matches("kB").trim().parse().ok()
}

/// CPU time this process's threads have used so far, from `/proc/self/task/*/schedstat`
/// (nanosecond resolution, unlike `/proc/self/stat`'s clock ticks). Threads that already exited
/// are not counted, so take both readings while the same threads are alive.
pub fn process_cpu() -> Duration {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return Duration::ZERO;
    };
    let ns: u64 = tasks
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum();
    Duration::from_nanos(ns)
}

/// The options `redis_bench` and `http_bench` both take: `--secs` per row and round (1),
/// `--rounds` (3), `--pool` connections (4), tokio `--workers` (the cores), `--concurrency` as
/// a list (`1,64`) and `--only` (rows whose name contains it).
pub struct RunOptions {
    /// Seconds each row runs per round.
    pub secs: f64,
    /// Rounds of every row.
    pub rounds: usize,
    /// Multiplexed connections of the store and of the raw floor.
    pub pool: usize,
    /// Tokio worker threads.
    pub workers: usize,
    /// Concurrency levels to run.
    pub concurrencies: Vec<usize>,
    /// Only rows whose name contains this, or one of its `|`-separated parts (see [`wanted`]).
    pub only: String,
}

impl RunOptions {
    /// Reads the options from the command line.
    pub fn from_args() -> RunOptions {
        RunOptions {
            secs: arg("--secs", 1.0),
            rounds: arg("--rounds", 3),
            pool: arg("--pool", 4),
            workers: arg("--workers", std::thread::available_parallelism().map_or(2, |n| n.get())),
            concurrencies: arg("--concurrency", "1,64".to_owned())
                .split(',')
                .map(|c| c.trim().parse().expect("--concurrency takes a list like 1,64"))
                .collect(),
            only: arg("--only", String::new()),
        }
    }

    /// How long each row runs per round.
    pub fn duration(&self) -> Duration {
        Duration::from_secs_f64(self.secs)
    }

    /// The warm-up before each row's measured run.
    pub fn warmup(&self) -> Duration {
        Duration::from_millis(200)
    }

    /// A multi-threaded runtime with `workers` threads.
    pub fn runtime(&self) -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_multi_thread().worker_threads(self.workers).enable_all().build().unwrap()
    }
}

/// Whether a row named `label` is one `--only` asks for: its name contains `only`, or one of
/// `only`'s `|`-separated parts (`--only 'replay|GET'`).
pub fn wanted(only: &str, label: &str) -> bool {
    only.split('|').any(|part| label.contains(part))
}

/// Reads `--name value` from the command line, or `default`.
pub fn arg<T: std::str::FromStr>(name: &str, default: T) -> T {
    let args: Vec<String> = std::env::args().collect();
    args.windows(2)
        .find(|w| w[0] == name)
        .map(|w| w[1].parse().unwrap_or_else(|_| panic!("cannot parse {name} {}", w[1])))
        .unwrap_or(default)
}

/// What the library crates' metrics do in this run, for the benches' first line: off (built
/// without `--features metrics`), on with no recorder (`--no-recorder`), or on with a Prometheus
/// recorder installed for the process (as an application exposing `/metrics` would have).
pub fn metrics_setup() -> &'static str {
    #[cfg(feature = "metrics")]
    {
        if flag("--no-recorder") {
            return "metrics: feature on, no recorder installed";
        }
        let handle =
            metrics_exporter_prometheus::PrometheusBuilder::new().install_recorder().expect("install a recorder");
        // The exporter's upkeep (draining histograms) runs when it renders; keep the handle.
        std::mem::forget(handle);
        "metrics: feature on, Prometheus recorder installed"
    }
    #[cfg(not(feature = "metrics"))]
    "metrics: feature off"
}

/// Whether `--name` is on the command line.
pub fn flag(name: &str) -> bool {
    std::env::args().any(|a| a == name)
}

/// The command timeout `RedisStore` uses by default, which the raw floors' connections are also
/// configured with.
pub const REDIS_TIMEOUT: Duration = Duration::from_secs(2);

/// The store's client setup without the store, for the raw-round-trip floors: the same deadpool
/// pool settings, `size` multiplexed connections checked out and kept, one picked round-robin
/// per command (as `RedisStore` picks for its writes; its plain reads all take its first).
pub struct RawRedis {
    conns: Vec<MultiplexedConnection>,
    _held: Vec<deadpool_redis::Connection>,
    next: AtomicUsize,
}

impl RawRedis {
    /// Connects `size` connections to `url`; panics if the server cannot be reached.
    pub async fn connect(url: &str, size: usize) -> RawRedis {
        let conn_config =
            redis::AsyncConnectionConfig::new().set_response_timeout(None).set_connection_timeout(Some(REDIS_TIMEOUT));
        let manager = deadpool_redis::Manager::new_with_config(url, conn_config).unwrap();
        let pool = deadpool_redis::Pool::builder(manager)
            .config(deadpool_redis::PoolConfig {
                max_size: size * 2,
                timeouts: deadpool_redis::Timeouts {
                    wait: Some(REDIS_TIMEOUT),
                    create: Some(REDIS_TIMEOUT),
                    recycle: Some(REDIS_TIMEOUT),
                },
                ..Default::default()
            })
            .runtime(Runtime::Tokio1)
            .build()
            .unwrap();
        let mut held = Vec::new();
        for _ in 0..size {
            held.push(pool.get().await.expect("connect to the bench redis-server"));
        }
        let conns = held.iter().map(|c| (**c).clone()).collect();
        RawRedis { conns, _held: held, next: AtomicUsize::new(0) }
    }

    /// The next connection, round-robin.
    pub fn conn(&self) -> MultiplexedConnection {
        self.conns[self.next.fetch_add(1, Ordering::Relaxed) % self.conns.len()].clone()
    }

    /// The first-execution floor: two raw round trips, `SET key claim NX PX 60000` (take the
    /// key), then `SET key value PX 86400000` (store the outcome). Panics if Redis fails.
    pub async fn set_nx_then_set(&self, key: &str, claim: &[u8], value: &[u8]) {
        let claimed: redis::Value = redis::cmd("SET")
            .arg(key)
            .arg(claim)
            .arg("NX")
            .arg("PX")
            .arg(60_000)
            .query_async(&mut self.conn())
            .await
            .expect("SET NX");
        std::hint::black_box(claimed);
        let stored: redis::Value = redis::cmd("SET")
            .arg(key)
            .arg(value)
            .arg("PX")
            .arg(86_400_000)
            .query_async(&mut self.conn())
            .await
            .expect("SET");
        std::hint::black_box(stored);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_borrowed_refund_is_the_same_payload() {
        use idempotent_core::canonical::to_canonical_vec;
        let view = to_canonical_vec(&Refund::new(0).with_seq(5)).unwrap();
        assert_eq!(view, to_canonical_vec(&Refund::new(5)).unwrap());
        assert_eq!(
            serde_json::to_vec(&Refund::new(0).with_seq(5)).unwrap(),
            serde_json::to_vec(&Refund::new(5)).unwrap()
        );
    }
}
