//! The preflight: settings that break the guarantee (eviction, no persistence, too few replicas)
//! are reported and fail `ensure` with the fix, unless their risk is accepted; settings it may not
//! read are unchecked.

use idempotent_core::{Error, Risk};
use idempotent_tests::{RedisOptions, RedisServer};

use crate::{store, store_at};

/// The preflight flags eviction policies and missing persistence, and passes a safe server;
/// `ensure` turns each finding into an error that names the setting and its fix, unless its
/// risk is accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preflight_reports_settings_that_break_the_guarantee() {
    let server = RedisServer::start();
    let s = store(&server);
    let report = s.preflight().await.unwrap();
    assert!(!report.is_ok());
    assert!(report.problems.iter().any(|p| p.to_string().contains("persistence is off")), "{report}");
    let err = report.ensure().unwrap_err();
    assert!(matches!(err, Error::UnsafeStore { .. }), "{err}");
    assert!(err.to_string().contains("CONFIG SET appendonly yes"), "{err}");
    s.preflight().await.unwrap().accept_risk(Risk::NoPersistence).ensure().unwrap();

    // Eviction on: ensure fails and names the setting, its value and the fix.
    server.cmd(&["CONFIG", "SET", "maxmemory-policy", "volatile-lru"]);
    let report = s.preflight().await.unwrap();
    assert!(report.problems.iter().any(|p| p.to_string().contains("maxmemory-policy is volatile-lru")), "{report}");
    let err = report.accept_risk(Risk::NoPersistence).ensure().unwrap_err().to_string();
    for part in ["maxmemory-policy is volatile-lru", "CONFIG SET maxmemory-policy noeviction", "Risk::Eviction"] {
        assert!(err.contains(part), "{part:?} missing from: {err}");
    }
    assert!(!err.contains("appendonly"), "an accepted risk failed ensure: {err}");
    // Accepted: it passes.
    let accepted = s.preflight().await.unwrap().accept_risk(Risk::NoPersistence).accept_risk(Risk::Eviction);
    assert!(accepted.ensure().is_ok());
    // Fixed as the messages say: it passes with nothing accepted.
    server.cmd(&["CONFIG", "SET", "maxmemory-policy", "noeviction"]);
    server.cmd(&["CONFIG", "SET", "appendonly", "yes"]);
    s.preflight().await.unwrap().ensure().unwrap();

    let safe = RedisServer::start_with(RedisOptions { aof: true, ..Default::default() });
    let report = store(&safe).preflight().await.unwrap();
    assert!(report.is_ok(), "{report}");
    report.ensure().unwrap();
}

/// Settings the store may not read (`CONFIG` refused, as on managed Redis) are unchecked, and
/// fail `ensure` until their risks are accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preflight_without_config_fails_until_the_risks_are_accepted() {
    let server = RedisServer::start_with(RedisOptions { aof: true, ..Default::default() });
    server.cmd(&["ACL", "SETUSER", "app", "on", ">s3cret", "~*", "+@all", "-config"]);
    let s = store_at(format!("redis://app:s3cret@127.0.0.1:{}", server.port()));
    let report = s.preflight().await.unwrap();
    assert_eq!((report.problems.len(), &report.unchecked[..]), (0, &[Risk::Eviction, Risk::NoPersistence][..]));
    let err = report.ensure().unwrap_err().to_string();
    assert!(err.contains("maxmemory-policy could not be read") && err.contains("Risk::Eviction"), "{err}");
    assert!(report.accept_risk(Risk::Eviction).accept_risk(Risk::NoPersistence).ensure().is_ok());
}

/// A store that waits for replicas fails the preflight while fewer are connected than it waits
/// for, and passes once they are; the report counts the replicas and says whether TLS is on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preflight_counts_the_replicas_a_waiting_store_needs() {
    let master = RedisServer::start_with(RedisOptions { aof: true, ..Default::default() });
    let waits = idempotent_core::RedisStore::builder(master.url())
        .command_timeout(std::time::Duration::from_secs(2))
        .wait_for_replicas(1, std::time::Duration::from_millis(500))
        .connect_lazy()
        .unwrap();
    let report = waits.preflight().await.unwrap();
    assert_eq!((report.replicas, report.tls), (Some(0), Some(false)), "{report}");
    let err = report.ensure().unwrap_err().to_string();
    assert!(err.contains("waits for 1, 0 connected") && err.contains("Risk::TooFewReplicas"), "{err}");
    // A store that does not wait is not concerned.
    store(&master).preflight().await.unwrap().ensure().unwrap();

    let _replica = RedisServer::replica_of(&master);
    master.wait_replicated();
    let report = waits.preflight().await.unwrap();
    assert_eq!(report.replicas, Some(1), "{report}");
    report.ensure().unwrap();
}

/// On a cluster every master answers `INFO replication`: the preflight counts the fewest
/// replicas of any master (none here), and a store that waits for one fails it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preflight_counts_the_replicas_of_every_cluster_master() {
    let cluster = tokio::task::spawn_blocking(idempotent_tests::RedisCluster::start).await.unwrap();
    let waits = idempotent_core::RedisStore::cluster_builder(cluster.urls())
        .command_timeout(std::time::Duration::from_secs(2))
        .wait_for_replicas(1, std::time::Duration::from_millis(500))
        .connect_lazy()
        .unwrap();
    let report = waits.preflight().await.unwrap();
    assert_eq!(report.replicas, Some(0), "{report}");
    let err = report.accept_risk(Risk::NoPersistence).ensure().unwrap_err().to_string();
    assert!(err.contains("waits for 1, 0 connected"), "{err}");
}
