//! Past one machine: a Redis Cluster with one replica per master whose masters fail over, cleanly
//! (`CLUSTER FAILOVER`) and by crash (`kill -9`, the replica promoted by the cluster); the
//! opt-in `WAIT` mode ([`RedisStoreBuilder::wait_for_replicas`]); and a standalone master whose
//! replica is promoted by hand, as Sentinel does.
//!
//! The nemesis runs 12 s per mode by default; IDEMPOTENT_FAILOVER_SECS lengthens it. Print the
//! reports with `-- --nocapture`.
//!
//! [`RedisStoreBuilder::wait_for_replicas`]: idempotent_core::RedisStoreBuilder::wait_for_replicas

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use idempotent_core::{Error, OnInFlight, RedisStore, RunContext};
use idempotent_tests::history::{Completion, History, Report};
use idempotent_tests::workload::{Cfg, Probe, call, fastrand_like, probe, random_calls};
use idempotent_tests::{Flavor, RedisCluster, RedisServer, unique};

/// Every store call's bound.
const TIMEOUT: Duration = Duration::from_millis(500);
/// How long the WAIT mode waits for a replica.
const WAIT: Duration = Duration::from_millis(100);

fn cluster_store(cluster: &RedisCluster, wait: bool) -> RedisStore {
    let builder = RedisStore::cluster_builder(cluster.urls()).command_timeout(TIMEOUT);
    let builder = if wait { builder.wait_for_replicas(1, WAIT) } else { builder };
    builder.connect_lazy().unwrap()
}

/// Calls on fresh keys, one after another, until `done` is set; then returns every probe.
async fn probe_until(ctx: &RunContext, hist: &History, prefix: &str, done: &AtomicBool) -> Vec<Probe> {
    let mut probes = Vec::new();
    while !done.load(Ordering::SeqCst) {
        probes.push(probe(ctx, hist, &format!("{prefix}{}", probes.len())).await);
    }
    probes
}

/// Every call during a switch ended within its bounds, and none that failed closed ran.
fn assert_failed_closed(what: &str, probes: &[Probe]) {
    // acquire, complete and the executor's mark each bounded by the command timeout.
    // Acquire, complete and the uncertain mark may each take a whole timeout; a loaded machine
    // adds scheduling on top.
    let bound = TIMEOUT * 4;
    for p in probes {
        assert!(p.elapsed < bound, "{what}: {} took {:?} (bound {bound:?}): {:?}", p.key, p.elapsed, p.outcome);
        if let Completion::Fail(e) = &p.outcome {
            assert!(!p.ran, "{what}: {} ran its action although the call failed closed: {e}", p.key);
        }
    }
}

fn count(probes: &[Probe], pick: fn(&Completion) -> bool) -> usize {
    probes.iter().filter(|p| pick(&p.outcome)).count()
}

/// Runs `f` on the cluster on a blocking thread, while `probe_until` calls on fresh keys.
async fn during<T: Send + 'static>(
    ctx: &RunContext,
    hist: &History,
    prefix: &str,
    mut cluster: RedisCluster,
    f: impl FnOnce(&mut RedisCluster) -> T + Send + 'static,
) -> (RedisCluster, T, Vec<Probe>) {
    let done = Arc::new(AtomicBool::new(false));
    let flag = done.clone();
    let switch = tokio::task::spawn_blocking(move || {
        let out = f(&mut cluster);
        flag.store(true, Ordering::SeqCst);
        (cluster, out)
    });
    let probes = probe_until(ctx, hist, prefix, &done).await;
    let (cluster, out) = switch.await.unwrap();
    (cluster, out, probes)
}

/// The store follows a clean failover and a crash failover on its own (MOVED, refreshed slots,
/// reconnects): calls during the switch fail closed within their bounds, records written before
/// it replay after it, and new keys work once the cluster is healthy again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_follows_clean_and_crash_failovers() {
    follows_failovers(Flavor::Redis).await;
}

/// The same on a Valkey 9 cluster.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_follows_clean_and_crash_failovers_on_valkey() {
    follows_failovers(Flavor::Valkey).await;
}

async fn follows_failovers(flavor: Flavor) {
    let cluster = tokio::task::spawn_blocking(move || RedisCluster::start_with_replicas_flavor(flavor)).await.unwrap();
    let ctx = RunContext::new(cluster_store(&cluster, false), unique("fo"));
    let hist = History::new();
    let mut before = Vec::new();
    for i in 0..30 {
        let p = probe(&ctx, &hist, &format!("before{i}")).await;
        let Completion::Ok(v) = &p.outcome else { panic!("before the failovers: {:?}", p.outcome) };
        before.push((p.key.clone(), v.clone()));
    }
    for m in cluster.masters() {
        cluster.nodes[m].wait_replicated();
    }
    let first = cluster.masters()[0];
    let held = cluster.nodes[first].cmd(&["DBSIZE"]);
    assert!(matches!(held, idempotent_core::redis::Value::Int(n) if n > 0), "no record on node {first}: {held:?}");

    let (cluster, promoted, clean) = during(&ctx, &hist, "clean", cluster, move |c| c.failover_clean(first)).await;
    assert_ne!(promoted, first);
    assert_failed_closed("clean failover", &clean);

    // Crash another shard's master.
    let second = *cluster.masters().iter().find(|&&m| m != promoted).unwrap();
    let (cluster, _, crash) = during(&ctx, &hist, "crash", cluster, move |c| c.failover_crash(second)).await;
    assert_failed_closed("crash failover", &crash);
    // A third of the keys lived on the dead master for a second or more: those calls failed.
    assert!(count(&crash, |o| matches!(o, Completion::Fail(_))) > 0, "no call hit the dead master");
    println!(
        "clean failover: {} calls during the switch, {} ok, {} failed closed; crash failover: {} calls, {} ok, {} failed closed",
        clean.len(),
        count(&clean, |o| matches!(o, Completion::Ok(_))),
        count(&clean, |o| matches!(o, Completion::Fail(_))),
        crash.len(),
        count(&crash, |o| matches!(o, Completion::Ok(_))),
        count(&crash, |o| matches!(o, Completion::Fail(_))),
    );

    // Nothing replicated was lost: every record from before replays, on whichever node has it.
    for (key, value) in &before {
        let p = probe(&ctx, &hist, key).await;
        assert_eq!(p.outcome, Completion::Ok(value.clone()), "{key} after the failovers");
        assert!(!p.ran, "{key} ran again after the failovers");
    }
    // And new keys work on every shard.
    for i in 0..20 {
        let p = probe(&ctx, &hist, &format!("after{i}")).await;
        assert!(matches!(p.outcome, Completion::Ok(_)), "after{i} once the cluster healed: {:?}", p.outcome);
    }
    let mut keys: Vec<String> = clean.iter().chain(&crash).map(|p| p.key.clone()).collect();
    keys.extend(before.into_iter().map(|(key, _)| key));
    keys.extend((0..20).map(|i| format!("after{i}")));
    let report = final_check(&ctx, &hist, &keys).await.unwrap_or_else(|(r, e)| panic!("{r}: {e:?}"));
    assert_eq!(report.duplicates, 0);
    drop(cluster);
}

/// After the faults: every key once more, then the checker (its report, or the violations).
async fn final_check(ctx: &RunContext, hist: &History, keys: &[String]) -> Result<Report, (Report, Vec<String>)> {
    for key in keys {
        call(ctx, hist, key, Cfg::default(), None, true).await;
    }
    hist.check()
}

/// The WAIT mode on a standalone master with one replica: while the replica is stopped, an
/// acquire fails closed (nothing runs, the key it took is released) and a completion is reported
/// as possibly unstored; a replay, which writes nothing, is still answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_mode_fails_closed_when_the_replica_does_not_acknowledge() {
    let master = RedisServer::start();
    let replica = Arc::new(RedisServer::replica_of(&master));
    // Generous, so that a healthy replica on a loaded machine acknowledges in time.
    let timeout = Duration::from_secs(2);
    let store = RedisStore::builder(master.url())
        .command_timeout(timeout)
        .wait_for_replicas(1, Duration::from_millis(500))
        .connect_lazy()
        .unwrap();
    store.warm_up().await.unwrap();
    let ctx = RunContext::new(store.clone(), unique("wait"));
    let step = || ctx.step("effect").on_in_flight(OnInFlight::Reject);

    // Healthy: the record is on the replica as soon as the call returns.
    let first: String = step().run(&"k1", |a| async move { Ok::<_, Error>(format!("v{}", a.fence())) }).await.unwrap();
    let (key, _) = step().key_for(&"k1").unwrap();
    assert_eq!(replica.cmd(&["EXISTS", &store.redis_key(&key)]), idempotent_core::redis::Value::Int(1));

    // The replica stops acknowledging: an acquire fails closed.
    replica.pause();
    let ran = AtomicBool::new(false);
    let started = Instant::now();
    let res: Result<String, Error> = step()
        .run(&"k2", |_| async {
            ran.store(true, Ordering::SeqCst);
            Ok("ran".to_owned())
        })
        .await;
    let elapsed = started.elapsed();
    let err = res.expect_err("an acquire no replica acknowledged must fail");
    assert!(matches!(err, Error::Unavailable { op: "acquire", .. }), "{err}");
    assert!(err.to_string().contains("reached 0 of the 1 replicas"), "{err}");
    assert!(!err.action_may_have_run(), "{err}");
    assert!(!ran.load(Ordering::SeqCst), "the action ran without an acknowledged lease");
    assert!(elapsed < timeout * 3, "took {elapsed:?}");
    // A replay writes nothing: it is answered as read.
    let again: String = step().run(&"k1", |_| async { Ok::<_, Error>("ran again".into()) }).await.unwrap();
    assert_eq!(again, first);
    replica.resume();
    master.wait_replicated();

    // The key the failed acquire took was released (in the background, so the call waits a
    // little for it; a key left taken would hold it for the whole 60 s lease): the next call runs.
    let k2: String = ctx
        .step("effect")
        .on_in_flight(OnInFlight::Wait { timeout: Duration::from_secs(5) })
        .run(&"k2", |_| async { Ok::<_, Error>("k2".into()) })
        .await
        .unwrap();
    assert_eq!(k2, "k2");

    // The replica stops while the action runs: the completion is possibly unstored.
    let r = replica.clone();
    let res: Result<String, Error> = step()
        .run(&"k3", |_| async move {
            r.pause();
            Ok("k3".to_owned())
        })
        .await;
    let err = res.expect_err("a completion no replica acknowledged must fail");
    assert!(matches!(err, Error::Unavailable { op: "complete", .. }), "{err}");
    assert!(err.action_may_have_run(), "{err}");
    replica.resume();
    master.wait_replicated();
    // It did reach the master, which kept it: the next call replays it (possibly unstored means
    // it may be there or not; here it is).
    let replayed: String = step().run(&"k3", |_| async { Ok::<_, Error>("k3 again".into()) }).await.unwrap();
    assert_eq!(replayed, "k3");
}

/// Standalone Redis with a replica promoted by hand (what Sentinel does): the store keeps the
/// URL it was given, so it does not follow. Once the old master is demoted, every write there is
/// refused (`READONLY`) and calls fail closed; a store built on the new master's URL replays the
/// records that were replicated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standalone_store_does_not_follow_a_promoted_replica_and_fails_closed() {
    let old = RedisServer::start();
    let new = RedisServer::replica_of(&old);
    let run = unique("sentinel");
    let ctx = RunContext::new(RedisStore::builder(old.url()).command_timeout(TIMEOUT).connect_lazy().unwrap(), &run);
    let hist = History::new();
    let mut before = Vec::new();
    for i in 0..10 {
        let p = probe(&ctx, &hist, &format!("k{i}")).await;
        let Completion::Ok(v) = &p.outcome else { panic!("before the failover: {:?}", p.outcome) };
        before.push((p.key, v.clone()));
    }
    old.wait_replicated();
    new.promote();
    old.follow(&new);

    // The store still talks to the old master, now a replica: refused, nothing runs.
    for i in 0..5 {
        let p = probe(&ctx, &hist, &format!("new{i}")).await;
        assert!(matches!(&p.outcome, Completion::Fail(e) if e.contains("read only replica")), "{:?}", p.outcome);
        assert!(!p.ran);
        assert!(p.elapsed < TIMEOUT * 3, "took {:?}", p.elapsed);
    }
    // A store on the new master's URL: the records are there, and new keys work.
    let ctx = RunContext::new(RedisStore::builder(new.url()).command_timeout(TIMEOUT).connect_lazy().unwrap(), &run);
    for (key, value) in &before {
        let p = probe(&ctx, &hist, key).await;
        assert_eq!(p.outcome, Completion::Ok(value.clone()), "{key} on the new master");
        assert!(!p.ran);
    }
    let p = probe(&ctx, &hist, "new0").await;
    assert!(matches!(p.outcome, Completion::Ok(_)), "{:?}", p.outcome);
}

/// The failovers a nemesis did, by kind.
struct Failovers {
    clean: usize,
    crash: usize,
    paused: usize,
}

/// Keys the nemesis workers pick from, per second of the run: enough that most calls take a
/// fresh key (a write) rather than replay one, so that failovers land among writes.
const NEMESIS_KEYS_PER_SEC: u64 = 125;

/// Six workers on [`NEMESIS_KEYS_PER_SEC`] keys per second of the run while masters fail over (clean, crash, cut off, in
/// turn; IDEMPOTENT_FAILOVER_KINDS picks some) for IDEMPOTENT_FAILOVER_SECS (12 s by default); then the cluster heals, a final pass
/// and the checker. Returns the report, the violations, and the failovers done.
async fn nemesis(wait: bool, flavor: Flavor) -> (Report, Vec<String>, Failovers) {
    let secs: u64 = std::env::var("IDEMPOTENT_FAILOVER_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(12);
    let cluster = tokio::task::spawn_blocking(move || RedisCluster::start_with_replicas_flavor(flavor)).await.unwrap();
    let ctx = RunContext::new(cluster_store(&cluster, wait), unique("nemesis"));
    let hist = History::new();
    let keys: Vec<String> = (0..NEMESIS_KEYS_PER_SEC * secs).map(|i| format!("k{i}")).collect();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    let workers: Vec<_> = (0..6u64)
        .map(|w| tokio::spawn(random_calls(ctx.clone(), hist.clone(), keys.clone(), deadline, w + 1)))
        .collect();
    // IDEMPOTENT_FAILOVER_KINDS (a list of clean, crash, pause) picks the failovers, to tell
    // what each costs.
    let kinds: Vec<&'static str> = match std::env::var("IDEMPOTENT_FAILOVER_KINDS") {
        Ok(list) => ["clean", "crash", "pause"].into_iter().filter(|k| list.contains(k)).collect(),
        Err(_) => vec!["clean", "crash", "pause"],
    };
    assert!(!kinds.is_empty(), "IDEMPOTENT_FAILOVER_KINDS names none of clean, crash, pause");
    let until = Instant::now() + Duration::from_secs(secs);
    let (cluster, failovers) = tokio::task::spawn_blocking(move || {
        let mut cluster = cluster;
        let mut rng = fastrand_like(7);
        let (mut clean, mut crash, mut paused) = (0, 0, 0);
        while Instant::now() < until {
            // The schedule: a pause, then a failover of a random master: clean, crash, cut off.
            std::thread::sleep(Duration::from_millis(200 + rng() % 400));
            let masters = cluster.masters();
            let m = masters[(rng() % masters.len() as u64) as usize];
            match kinds[(clean + crash + paused) % kinds.len()] {
                "clean" => {
                    cluster.failover_clean(m);
                    clean += 1;
                }
                "crash" => {
                    cluster.failover_crash(m);
                    crash += 1;
                }
                _ => {
                    cluster.failover_pause(m);
                    paused += 1;
                }
            }
        }
        (cluster, Failovers { clean, crash, paused })
    })
    .await
    .unwrap();
    for w in workers {
        w.await.unwrap();
    }
    cluster.wait_healthy();
    // The client may still be catching up with the last switch (a slot map to refresh, a
    // connection to replace): a first pass over every key, each retried until it ends ok,
    // counting the calls that did not.
    let mut settling = 0;
    for key in &keys {
        for _ in 0..10 {
            if matches!(call(&ctx, &hist, key, Cfg::default(), None, false).await, Completion::Ok(_)) {
                break;
            }
            settling += 1;
        }
    }
    let (report, errors) = match final_check(&ctx, &hist, &keys).await {
        Ok(report) => (report, Vec::new()),
        Err(failed) => failed,
    };
    println!(
        "failover nemesis, WAIT {}: {secs} s, {} clean + {} crash + {} cut-off failovers, {settling} calls not ok \
         once healed, {report}",
        if wait { "1" } else { "off" },
        failovers.clean,
        failovers.crash,
        failovers.paused
    );
    assert!(settling < 10, "{settling} calls failed after the cluster healed");
    for e in &errors {
        println!("  {e}");
    }
    assert!(report.ops > 100, "the workers barely ran: {report}");
    drop(cluster);
    (report, errors, failovers)
}

/// Without WAIT a failover may lose what the old master acknowledged but had not yet sent to
/// its replica: the checker counts it. What it may find is a completion lost, so that the key
/// runs again and two results were committed, or a lease lost (a re-execution, fenced); never
/// anything else.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nemesis_failovers_without_wait() {
    let (_, errors, done) = nemesis(false, Flavor::Redis).await;
    assert!(done.clean + done.crash + done.paused > 1, "hardly any failover ran");
    for e in &errors {
        assert!(e.contains("different results were committed"), "a violation a lost write cannot explain: {e}");
    }
}

/// With WAIT 1 on one replica per master, every acquire and completion a caller acted on was
/// on the replica the cluster promotes: no duplicates.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nemesis_failovers_with_wait_have_no_duplicates() {
    wait_has_no_duplicates(Flavor::Redis).await;
}

/// The same on a Valkey 9 cluster.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nemesis_failovers_with_wait_have_no_duplicates_on_valkey() {
    wait_has_no_duplicates(Flavor::Valkey).await;
}

async fn wait_has_no_duplicates(flavor: Flavor) {
    let (report, errors, done) = nemesis(true, flavor).await;
    assert!(done.clean + done.crash + done.paused > 1, "hardly any failover ran");
    assert!(errors.is_empty(), "{report}: {errors:?}");
    assert_eq!(report.duplicates, 0);
}
