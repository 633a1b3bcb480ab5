//! `doctor`: a write, read and delete of a probe record, a scan, and what the deployment relies
//! on: Redis' settings, replicas and TLS; PostgreSQL's TLS and whether a pooler is in between.

use std::time::{Duration, Instant};

use idempotent_core::record::{Acquire, Labels};
use idempotent_core::store::{Cursor, Deleted, Filter, RecordState};
use idempotent_core::{Error, Fingerprint, Key, PostgresStore, RedisStore, Risk, SharedStore, sqlx};
use serde_json::json;

use crate::args::Doctor;
use crate::commands::Report;
use crate::exit::{Code, Failure};
use crate::render::count;

/// One thing `doctor` checked: what, whether it passed, what it found, and what to do if not.
/// A note passes, and says what the deployment relies on (TLS, replicas, a pooler).
struct Check {
    name: &'static str,
    ok: bool,
    note: bool,
    found: String,
    fix: Option<String>,
}

impl Check {
    fn passed(name: &'static str, found: impl Into<String>) -> Self {
        Check { name, ok: true, note: false, found: found.into(), fix: None }
    }

    fn noted(name: &'static str, found: impl Into<String>) -> Self {
        Check { name, ok: true, note: true, found: found.into(), fix: None }
    }

    fn failed(name: &'static str, found: impl Into<String>, fix: impl Into<String>) -> Self {
        Check { name, ok: false, note: false, found: found.into(), fix: Some(fix.into()) }
    }
}

/// What an acquisition of the probe key answered instead of granting it.
fn refused_probe(answer: &Acquire) -> &'static str {
    match answer {
        Acquire::Acquired(_) => "the probe key was granted",
        Acquire::Replay(_) => "the probe key already holds a done record",
        Acquire::InFlight { .. } => "another caller holds the probe key (another doctor running at the same moment?)",
        Acquire::Mismatch => "the probe key holds a record of another payload",
        Acquire::NeedsAttention { .. } => "the probe key holds a record that needs attention",
        _ => "the probe key was not granted",
    }
}

const PROBE_STEP: &str = "idempotent-doctor";

/// `doctor`'s answer when it cannot reach the store (`what`: the store and why).
pub(crate) fn unreachable(what: &str) -> Failure {
    Failure::new(
        Code::Store,
        format!(
            "doctor cannot reach {what}, so nothing was checked: check the --store URL (host, port, database, \
             user) and that the server is running"
        ),
    )
}

pub(crate) async fn doctor(store: &SharedStore, args: &Doctor) -> Result<Report, Failure> {
    let mut checks = Vec::new();
    // A write, a read and a delete of a probe record, under a key no operation can have.
    let probe = Key::from_client_key(Some(PROBE_STEP), "doctor", &format!("{}", std::process::id()));
    let started = Instant::now();
    let lease = Duration::from_secs(10);
    let leftover = format!(
        "the probe record (step `{PROBE_STEP}`) may be left behind: once its 10s lease has run out, remove it with \
         `idempotent purge --step {PROBE_STEP} --yes`"
    );
    let fingerprint = Fingerprint::from_bytes([0; 32]);
    match store.acquire_labeled(&probe, &fingerprint, lease, lease, Labels::step(PROBE_STEP)).await {
        Ok(Acquire::Acquired(grant)) => {
            let took = started.elapsed();
            checks.push(Check::passed(
                "write a record",
                format!("took the lease on a probe record (step `{PROBE_STEP}`) in {} ms", took.as_millis()),
            ));
            checks.push(match store.inspect(&probe).await {
                Ok(Some(r)) if r.step == PROBE_STEP && r.state == RecordState::Running => {
                    Check::passed("read it back", format!("the probe record is there, running, attempt {}", r.attempt))
                }
                Ok(Some(r)) => Check::failed(
                    "read it back",
                    format!("the probe record reads back as {} of step `{}`, not as written", r.state, r.step),
                    "something else writes to the store's records (another program on the same table or keys?): give this store a table or database of its own",
                ),
                Ok(None) => Check::failed(
                    "read it back",
                    "the record just written is not there",
                    "the store loses what it writes (another program deleting or evicting records?): check what else uses it",
                ),
                Err(e) => Check::failed("read it back", e.to_string(), "check that the store's user may read its records"),
            });
            let released = store.release(&probe, &grant.token).await;
            checks.push(match (released, store.delete(&probe).await) {
                (_, Ok(Deleted::Ok)) => Check::passed("delete it", "released the probe's lease and deleted the record"),
                (_, Ok(Deleted::Absent)) => Check::failed(
                    "delete it",
                    "the probe record was gone before it was deleted",
                    "the store loses what it writes (another program deleting or evicting records?): check what else uses it",
                ),
                (Err(e), Ok(Deleted::Running)) => Check::failed(
                    "delete it",
                    format!("releasing the probe's lease failed ({e}), so the record was kept"),
                    leftover.clone(),
                ),
                (Ok(_), Ok(Deleted::Running)) => Check::failed(
                    "delete it",
                    "the probe's lease was released, yet the store kept the record as running",
                    leftover.clone(),
                ),
                (_, Ok(_)) => Check::failed("delete it", "the store did not delete the probe record", leftover.clone()),
                (_, Err(e)) => Check::failed("delete it", e.to_string(), leftover.clone()),
            });
        }
        Ok(other) => checks.push(Check::failed("write a record", refused_probe(&other), "run doctor again")),
        // Nothing else can be checked on a store that does not answer: exit 1, as for any
        // command that cannot reach its store.
        Err(Error::Unavailable { reason, .. }) => return Err(unreachable(&format!("{} ({reason})", store.describe()))),
        Err(Error::Timeout { after, .. }) => {
            return Err(unreachable(&format!("{} (no answer within {} ms)", store.describe(), after.as_millis())));
        }
        Err(e) => checks.push(Check::failed(
            "write a record",
            e.to_string(),
            "check the --store URL (host, port, path, user) and that the store's user may write",
        )),
    }
    checks.push(match store.scan(&Filter::all(), &Cursor::start(), 1).await {
        Ok(_) => Check::passed("list records", "the store lists its records (as list, stats, purge and reconcile do)"),
        Err(e) => Check::failed(
            "list records",
            e.to_string(),
            "list, stats, purge and reconcile fail the same way: check that the store's user may read all its records",
        ),
    });
    let any = store.as_ref() as &dyn std::any::Any;
    if let Some(redis) = any.downcast_ref::<RedisStore>() {
        redis_settings(redis, args, &mut checks).await;
    }
    if let Some(postgres) = any.downcast_ref::<PostgresStore>() {
        postgres_deployment(postgres, &mut checks).await;
    }

    let failed = checks.iter().filter(|c| !c.ok).count();
    let mut text = format!("Checked {}:\n", store.describe());
    for check in &checks {
        let mark = match (check.ok, check.note) {
            (false, _) => "FAILED",
            (true, true) => "note",
            (true, false) => "ok",
        };
        text.push_str(&format!("{mark:<6}  {}: {}\n", check.name, check.found));
        if let Some(fix) = &check.fix {
            text.push_str(&format!("        to fix it: {fix}\n"));
        }
    }
    text.push_str(&if failed == 0 {
        format!("All {} passed.\n", count(checks.len(), "check"))
    } else {
        format!(
            "{failed} of {} failed: fix what is marked FAILED, then run doctor again.\n",
            count(checks.len(), "check")
        )
    });
    let json = json!({
        "store": store.describe(),
        "ok": failed == 0,
        "checks": checks
            .iter()
            .map(|c| json!({ "check": c.name, "ok": c.ok, "note": c.note, "found": c.found, "fix": c.fix }))
            .collect::<Vec<_>>(),
    });
    let code = if failed == 0 { Code::Ok } else { Code::Refused };
    Ok(Report { text, json, code })
}

/// The Redis settings the guarantee depends on, one check per risk; then TLS and replicas.
async fn redis_settings(redis: &RedisStore, args: &Doctor, checks: &mut Vec<Check>) {
    let report = match redis.preflight().await {
        Ok(report) => report,
        Err(e) => {
            checks.push(Check::failed(
                "Redis settings",
                format!("could not read them: {e}"),
                "check that the server answers CONFIG GET maxmemory-policy, appendonly and save",
            ));
            return;
        }
    };
    let risks = [
        (
            Risk::Eviction,
            "Redis eviction",
            "maxmemory-policy is noeviction: Redis never evicts a record",
            "maxmemory-policy is noeviction",
        ),
        (
            Risk::NoPersistence,
            "Redis persistence",
            "AOF or RDB snapshots are on: a restart keeps the records",
            "AOF or RDB snapshots are on",
        ),
    ];
    for (risk, name, safe, must) in risks {
        let check = if let Some(problem) = report.problems.iter().find(|p| p.risk == risk) {
            // The library's text ends with "; to fix it, …": the fix goes on a line of its own.
            let text = problem.to_string();
            let (found, fix) = text.split_once("; to fix it, ").unwrap_or((text.as_str(), "see RELIABILITY.md"));
            Check::failed(name, found, fix)
        } else if report.unchecked.contains(&risk) {
            Check::failed(
                name,
                "the server refused CONFIG GET (as managed Redis does), so the setting could not be read",
                format!("check in the provider's settings that {must}"),
            )
        } else {
            Check::passed(name, safe)
        };
        checks.push(check);
    }
    checks.push(match report.tls {
        // `#insecure` (redis-rs's own URL fragment) turns every certificate check off.
        Some(true) if idempotent_core::Store::describe(redis).contains("#insecure") => Check::noted(
            "TLS",
            "connections are encrypted but the server's certificate is not checked (#insecure): drop #insecure \
             and trust its authority (SSL_CERT_FILE)",
        ),
        Some(true) => {
            Check::passed("TLS", "connections are encrypted and the server's certificate verified (rediss://)")
        }
        Some(false) => Check::noted(
            "TLS",
            "connections are not encrypted (redis://): fine on loopback or a private network; use rediss:// elsewhere",
        ),
        None => Check::noted("TLS", "the store is on the application's pool, whose URL says"),
    });
    checks.push(match (report.replicas, args.wait_for_replicas) {
        (Some(connected), Some(wanted)) if connected >= wanted => Check::passed(
            "Redis replicas",
            format!("{} connected, as many as wait_for_replicas({wanted}) needs", count(connected as usize, "replica")),
        ),
        (Some(connected), Some(wanted)) => Check::failed(
            "Redis replicas",
            format!(
                "{} connected, and a store with wait_for_replicas({wanted}) refuses every acquire until {wanted} are",
                count(connected as usize, "replica")
            ),
            "start or reconnect replicas (REPLICAOF on each), or wait for fewer",
        ),
        (None, Some(_)) => Check::failed(
            "Redis replicas",
            "INFO replication could not be read, so the replicas connected could not be counted",
            "check in the provider's settings that the master keeps the replicas the store waits for",
        ),
        (Some(0), None) => Check::noted(
            "Redis replicas",
            "none connected: a crash of this server loses what it had not yet written to disk (see RELIABILITY.md)",
        ),
        (Some(connected), None) => Check::noted(
            "Redis replicas",
            format!(
                "{} connected; a failover can lose writes the replicas had not received unless the store waits \
                 for them (wait_for_replicas; check with doctor --wait-for-replicas N)",
                count(connected as usize, "replica")
            ),
        ),
        (None, None) => {
            Check::noted("Redis replicas", "INFO replication could not be read: the replicas were not counted")
        }
    });
}

/// TLS, and whether a pooler sits between the store and PostgreSQL.
async fn postgres_deployment(store: &PostgresStore, checks: &mut Vec<Check>) {
    let ssl: Result<Option<bool>, _> = sqlx::query_scalar("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
        .fetch_optional(store.pool())
        .await;
    checks.push(match ssl {
        Ok(Some(true)) => Check::passed("TLS", "the connection is encrypted (sslmode)"),
        Ok(_) => Check::noted(
            "TLS",
            "the connection is not encrypted: fine on loopback or a private network; add ?sslmode=verify-full elsewhere",
        ),
        Err(e) => Check::noted("TLS", format!("could not be read ({e})")),
    });
    // The server's own port against the one the URL names: another port means something
    // listens in between (PgBouncer, or another proxy).
    let named = store.pool().connect_options().get_port();
    let port: Result<Option<i32>, _> = sqlx::query_scalar("SELECT inet_server_port()").fetch_one(store.pool()).await;
    checks.push(match port {
        Ok(Some(port)) if port != i32::from(named) => Check::noted(
            "pooler",
            format!(
                "the URL names port {named} and PostgreSQL listens on {port}: a pooler or proxy sits between them; \
                 behind PgBouncer in pool_mode = transaction, the store needs ?transaction_pooling=true in the URL \
                 (PostgresStoreBuilder::transaction_pooling); session pooling needs nothing"
            ),
        ),
        Ok(Some(_)) => Check::passed("pooler", "connected to PostgreSQL itself (no pooler on the way)"),
        Ok(None) => Check::passed("pooler", "connected over a Unix socket (no pooler on the way)"),
        Err(e) => Check::noted("pooler", format!("could not be told ({e})")),
    });
}
