//! Test support for the workspace: throwaway `redis-server` and `valkey-server` processes
//! ([`Flavor`]: standalone, a cluster ([`RedisCluster`]), a master and replica watched by three
//! sentinels ([`RedisSentinel`])), throwaway PostgreSQL servers ([`postgres::PgServer`], over TLS
//! with [`pg_tls`]'s certificates) and PgBouncers in front of them ([`pgbouncer::PgBouncer`]), the
//! store matrix every scenario runs on ([`on_every_store!`], [`matrix`]), the store conformance
//! suite, the scenarios written once for both SQL stores ([`sql`], [`transaction`],
//! [`sql_store`]), and [`hooked::HookedStore`] for stores with one transition changed.
//!
//! Every server listens on a free loopback port in its own temporary directory, keeps its log
//! there, and is killed when dropped. Tests never touch a Redis the machine may already run on
//! 6379. When `redis-server` (or `valkey-server`) is not installed, starting a server panics with
//! how to install it: a Redis or Valkey test never passes by skipping.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

pub mod acquire_order;
pub mod conformance;
pub mod contention;
pub mod history;
pub mod hooked;
pub mod identity;
pub mod ledger;
pub mod matrix;
pub mod mcp;
pub mod pg_tls;
pub mod pgbouncer;
pub mod postgres;
pub mod proxy;
mod redis_cluster;
mod redis_sentinel;
mod redis_server;
pub mod refund_server;
pub mod sql;
pub mod sql_store;
pub mod state;
pub mod tls;
pub mod transaction;
pub mod uncertain;
pub mod workload;

pub use hooked::HookedStore;
pub use pgbouncer::PgBouncer;
pub use postgres::PgServer;
pub use redis_cluster::{CLUSTER_NODE_TIMEOUT, RedisCluster};
pub use redis_sentinel::{DOWN_AFTER, MASTER_NAME, RedisSentinel};
pub use redis_server::{Flavor, Monitor, Monitored, RedisOptions, RedisServer};

pub(crate) const INSTALL_HINT: &str = "redis-server was not found on PATH. The Redis tests need a real server: \
     install it with `sudo apt-get install -y redis-server` (Debian/Ubuntu), `sudo dnf install redis` \
     (Fedora) or `brew install redis` (macOS), then run the tests again";

/// The path of `name` on PATH; panics with how to install Redis when it is missing.
pub(crate) fn require_binary(name: &str) -> PathBuf {
    on_path(name).unwrap_or_else(|| panic!("{INSTALL_HINT} (missing: {name})"))
}

/// The path of `name` on PATH, if it is there.
pub(crate) fn on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path).map(|dir| dir.join(name)).find(|candidate| candidate.is_file())
}

/// A free TCP port on 127.0.0.1 (and, for cluster nodes, with port + 10000 free as well).
pub fn free_port(with_bus: bool) -> u16 {
    for _ in 0..200 {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port");
        let port = l.local_addr().unwrap().port();
        if port == 6379 {
            continue;
        }
        if with_bus {
            if port > 55_000 {
                continue;
            }
            if TcpListener::bind(("127.0.0.1", port + 10_000)).is_err() {
                continue;
            }
        }
        return port;
    }
    panic!("no free port found on 127.0.0.1");
}

/// Polls `done` every 20 ms until it holds; panics, saying `what`, after `timeout`.
pub(crate) fn wait_until(timeout: Duration, what: impl Fn() -> String, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !done() {
        assert!(Instant::now() < deadline, "gave up after {timeout:?} waiting for: {}", what());
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Sends `sig` (a name: `KILL`, `STOP`, `CONT`) to the process `pid`.
pub fn signal(pid: i32, sig: &str) {
    // `unsafe_code` is forbidden in the workspace, so signals go through the `kill` command.
    let status = Command::new("kill").arg(format!("-{sig}")).arg(pid.to_string()).status().expect("run kill");
    assert!(status.success(), "kill -{sig} {pid} failed");
}

/// A unique name for a test's run ids and keys.
pub fn unique(prefix: &str) -> String {
    format!("{prefix}-{}", uuid_like())
}

fn uuid_like() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
    format!("{t:x}-{}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed))
}

/// The workspace README's Rust snippets, compiled and run as doc tests (the one with a server is
/// compiled only).
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
pub struct WorkspaceReadme;
