//! What the server says of itself: `INFO cpu` and `INFO commandstats`.

use std::collections::BTreeMap;
use std::time::Duration;

use idempotent_core::redis::Value;
use idempotent_tests::RedisServer;

/// The text of `INFO <section>`.
pub(crate) fn info(server: &RedisServer, section: &str) -> String {
    match server.cmd(&["INFO", section]) {
        Value::BulkString(b) => String::from_utf8_lossy(&b).into_owned(),
        Value::VerbatimString { text, .. } => text,
        other => panic!("unexpected INFO reply {other:?}"),
    }
}

/// The server's CPU time so far (`used_cpu_user + used_cpu_sys`).
pub(crate) fn server_cpu(server: &RedisServer) -> Duration {
    let info = info(server, "cpu");
    let field = |name: &str| info.lines().find_map(|l| l.strip_prefix(name)?.trim().parse::<f64>().ok()).unwrap_or(0.0);
    Duration::from_secs_f64(field("used_cpu_user:") + field("used_cpu_sys:"))
}

/// The share of `name`'s calls that clients sent, from the `MONITOR` pass (at concurrency 1). A
/// command that pass did not see at all was sent by clients only under load (the store's `MGET`
/// of reads that went out together), never by a script, which runs its commands at any load.
pub(crate) fn sent_share(share: &BTreeMap<String, f64>, name: &str) -> f64 {
    share.get(name).copied().unwrap_or(1.0)
}

/// `INFO commandstats`: command → (calls, usec), the stats commands themselves left out.
pub(crate) fn command_stats(server: &RedisServer) -> BTreeMap<String, (u64, u64)> {
    let mut stats = BTreeMap::new();
    for line in info(server, "commandstats").lines() {
        let Some((name, fields)) = line.strip_prefix("cmdstat_").and_then(|r| r.split_once(':')) else {
            continue;
        };
        if name == "config|resetstat" || name == "info" {
            continue;
        }
        let field = |f: &str| fields.split(',').find_map(|kv| kv.strip_prefix(f)?.parse::<u64>().ok()).unwrap_or(0);
        stats.insert(name.to_owned(), (field("calls="), field("usec=")));
    }
    stats
}
