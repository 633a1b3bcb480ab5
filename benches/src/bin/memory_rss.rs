//! Peak resident memory of a `MemoryStore` holding one million completed operations.
//!
//! ```text
//! cargo run --release -p idempotent-benches --bin memory_rss [-- --keys 1000000]
//! ```
//!
//! Runs `--keys` first executions through the executor (default retention, so every record is
//! kept), then prints the process's peak RSS (`VmHWM`) before and after and the cost per record.
//! Run it on its own: the peak is per process. Then replays as many of the records, in an order
//! scattered over the whole store (so each is cold in the CPU's caches), and prints the rate of
//! both: what a store of this size costs per call when it grows, and when a retry finds an old
//! record.

use std::time::Instant;

use idempotent_benches::{Refund, RefundResult, arg, peak_rss_kib, rss_kib};
use idempotent_core::{Error, MemoryStore, RunContext};

fn main() {
    let keys: u64 = arg("--keys", 1_000_000);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let store = MemoryStore::new();
    let ctx = RunContext::new(store.clone(), "rss-run");
    // Borrowed with a sequence number per call, as in the other benches: the rates below are
    // the store's and the executor's work, not the building of a payload.
    let payload = Refund::new(0);
    let before = peak_rss_kib().unwrap_or(0);
    let started = Instant::now();
    rt.block_on(async {
        for seq in 0..keys {
            let _: RefundResult = ctx
                .step("issue_refund")
                .run(&payload.with_seq(seq), |_| async { Ok::<_, Error>(RefundResult::sample()) })
                .await
                .unwrap();
        }
    });
    let elapsed = started.elapsed();
    let peak = peak_rss_kib().unwrap_or(0);
    let now = rss_kib().unwrap_or(0);
    let stored = serde_json::to_vec(&RefundResult::sample()).unwrap().len() + 1;
    println!(
        "memory_rss: {} records in MemoryStore ({} B result each) in {:.1} s ({:.0} first executions/s, one task)",
        store.len(),
        stored,
        elapsed.as_secs_f64(),
        keys as f64 / elapsed.as_secs_f64()
    );
    println!("| measure | value |\n|---|--:|");
    println!("| peak RSS before (VmHWM) | {:.1} MiB |", before as f64 / 1024.0);
    println!("| peak RSS after (VmHWM) | {:.1} MiB |", peak as f64 / 1024.0);
    println!("| RSS now (VmRSS) | {:.1} MiB |", now as f64 / 1024.0);
    println!("| peak growth per record | {:.0} B |", (peak - before) as f64 * 1024.0 / keys.max(1) as f64);

    // Replays, scattered: consecutive calls land far apart in the store.
    let started = Instant::now();
    let ran = rt.block_on(async {
        let mut ran = 0u64;
        for i in 0..keys {
            let seq = i.wrapping_mul(2_654_435_761) % keys.max(1);
            let _: RefundResult = ctx
                .step("issue_refund")
                .run(&payload.with_seq(seq), |_| async {
                    ran += 1;
                    Ok::<_, Error>(RefundResult::sample())
                })
                .await
                .unwrap();
        }
        ran
    });
    let replayed = started.elapsed();
    assert_eq!(ran, 0, "every call should have been a replay");
    println!("| first executions/s while the store grows (one task) | {:.0} |", keys as f64 / elapsed.as_secs_f64());
    println!("| replays/s of scattered (cold) records (one task) | {:.0} |", keys as f64 / replayed.as_secs_f64());
}
