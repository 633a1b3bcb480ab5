//! A worker process for the multi-process tests: runs one step over many keys from many tasks
//! and appends a line to a ledger file each time the step's action runs.
//!
//! `step_worker <store> <ledger> <tasks> <keys>`: `<store>` is `sqlite://<path>`; each of
//! `<tasks>` tasks calls the step `effect` of run `multi` for every key `0..<keys>`, starting at
//! its own offset, so the tasks of all processes race on every key. An execution appends
//! `<key> <pid>\n` to `<ledger>` (one `write` on a file opened for appending, so lines of
//! concurrent processes never interleave). Prints `<key>=<result>` for every call, and exits
//! non-zero on any error. Once its store is open it prints `ready` and waits for a line on its
//! standard input before the tasks start, so that a test starts its processes' races together.

use std::io::Write;
use std::sync::Arc;

use idempotent_core::{Error, RunContext, SharedStore, SqliteStore};

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [store, ledger, tasks, keys] = &args[..] else {
        return Err("usage: step_worker <sqlite://path> <ledger> <tasks> <keys>".into());
    };
    let store: SharedStore = match store.strip_prefix("sqlite://") {
        Some(path) => Arc::new(SqliteStore::builder(path).max_connections(8).connect().await?),
        None => return Err(format!("unknown store {store:?}").into()),
    };
    let (tasks, keys): (u64, u64) = (tasks.parse()?, keys.parse()?);
    // Opening the store takes a process longer than the race: both start on the test's word.
    println!("ready");
    std::io::stdout().flush()?;
    std::io::stdin().read_line(&mut String::new())?;
    let ledger = Arc::new(std::fs::OpenOptions::new().create(true).append(true).open(ledger)?);
    let ctx = RunContext::new(store, "multi");
    let pid = std::process::id();
    let mut handles = Vec::new();
    for task in 0..tasks {
        let (ctx, ledger) = (ctx.clone(), ledger.clone());
        handles.push(tokio::spawn(async move {
            let mut seen = Vec::new();
            for i in 0..keys {
                let key = (i + task * 7) % keys;
                let ledger = ledger.clone();
                let result: String = ctx
                    .step("effect")
                    .run(&key, |attempt| async move {
                        (&*ledger)
                            .write_all(format!("{key} {pid}\n").as_bytes())
                            .map_err(|e| Error::Config(e.to_string()))?;
                        Ok::<_, Error>(format!("{pid}/{}", attempt.fence()))
                    })
                    .await?;
                seen.push((key, result));
            }
            Ok::<_, Error>(seen)
        }));
    }
    let mut out = std::io::stdout().lock();
    for h in handles {
        for (key, result) in h.await?? {
            writeln!(out, "{key}={result}")?;
        }
    }
    Ok(())
}
