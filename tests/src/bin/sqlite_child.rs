//! A second OS process on a SQLite store's file, for `tests/tests/sqlite_store.rs`.
//!
//! `sqlite_child <path> <n>...` opens the store at `<path>`, acquires the key `[n; 32]` (fingerprint
//! `[1; 32]`, a 10 s lease) for each `n`, and prints one line per key: `acquired`, `inflight`,
//! `replay:<result as UTF-8>` or `mismatch`. It never completes nor releases what it took.

use std::time::Duration;

use idempotent_core::record::Acquire;
use idempotent_core::{Fingerprint, Key, SqliteStore, Store};

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let mut args = std::env::args().skip(1);
    let path = args.next().expect("usage: sqlite_child <path> <n>...");
    let store = SqliteStore::connect(&path).await.expect("open the store");
    for n in args {
        let n: u8 = n.parse().expect("a key byte");
        let answer = store
            .acquire(
                &Key::from_bytes([n; 32]),
                &Fingerprint::from_bytes([1; 32]),
                Duration::from_secs(10),
                Duration::from_secs(60),
            )
            .await
            .expect("acquire");
        match answer {
            Acquire::Acquired(_) => println!("acquired"),
            Acquire::InFlight { .. } => println!("inflight"),
            Acquire::Replay(bytes) => println!("replay:{}", String::from_utf8_lossy(&bytes)),
            Acquire::Mismatch => println!("mismatch"),
            other => println!("unexpected:{other:?}"),
        }
    }
    store.close().await;
}
