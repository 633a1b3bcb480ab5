//! Parallel sub-agents sharing one state: four branches of an agent run each investigate 25
//! leads as steps, and every step appends its finding to the run's findings (a
//! `State<Vec<String>>`, an append reducer) over a flaky transport that loses 20% of the
//! replies to commits after they went in. Each lost reply fails the step; the branch retries it,
//! and the retried step's update commits under the same token, so the store answers "already
//! applied" instead of appending again. Every finding ends in the state exactly once.
//!
//! ```text
//! cargo run -p idempotent-examples --bin agent_findings   # SQLite file (the embedded default)
//! REDIS_URL=redis://127.0.0.1:6379 cargo run -p idempotent-examples --bin agent_findings   # Redis
//! DATABASE_URL=postgres://postgres@127.0.0.1/postgres cargo run -p idempotent-examples --bin agent_findings  # PostgreSQL
//! ```
//!
//! The steps' records and the findings are kept in the examples' database
//! (`idempotent_examples::stores_from_env`), under a run id of their own per run.
//!
//! Exits non-zero if a finding is missing or doubled.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use bytes::Bytes;
use idempotent_core::state::{Commit, CommitToken, Loaded, Scope, SharedStateStore, State, StateStore, Version};
use idempotent_core::store::BoxFuture;
use idempotent_core::{Error, RunContext};

/// A transport to the state store that loses the reply to one commit in five after the commit
/// went in.
struct Flaky {
    inner: SharedStateStore,
    commits: AtomicU32,
    lost: AtomicU32,
}

impl StateStore for Flaky {
    fn load<'a>(&'a self, scope: &'a Scope) -> BoxFuture<'a, Result<Loaded<Bytes>, Error>> {
        self.inner.load(scope)
    }

    fn commit<'a>(
        &'a self,
        scope: &'a Scope,
        expected: Version,
        value: Bytes,
        token: &'a CommitToken,
    ) -> BoxFuture<'a, Result<Commit<Bytes>, Error>> {
        Box::pin(async move {
            let answer = self.inner.commit(scope, expected, value, token).await?;
            if self.commits.fetch_add(1, Ordering::Relaxed) % 5 == 4 {
                self.lost.fetch_add(1, Ordering::Relaxed);
                return Err(Error::Unavailable {
                    store: "flaky".into(),
                    op: "state commit",
                    reason: "the reply was lost".into(),
                    source: None,
                });
            }
            Ok(answer)
        })
    }

    fn describe(&self) -> String {
        format!("flaky {}", self.inner.describe())
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    idempotent_examples::logs().init();
    let stores = idempotent_examples::stores_from_env().await?;
    let run_id = idempotent_examples::fresh_id("run");
    println!("records and findings in {}; run {run_id}; 1 in 5 commit replies lost on the way back", stores.describe);
    let flaky = Arc::new(Flaky { inner: stores.state, commits: AtomicU32::new(0), lost: AtomicU32::new(0) });
    let records = stores.records;
    let scope = Scope::new(format!("{run_id}/findings"));
    // One update at a time per task, no retries inside the update: a lost reply fails the step.
    let policy = idempotent_core::UpdatePolicy::default().attempts(1);
    let retried = Arc::new(AtomicU32::new(0));
    let branches = (0..4).map(|b| {
        let ctx = RunContext::new(records.clone(), &run_id);
        let findings: State<Vec<String>> =
            State::new(flaky.clone() as Arc<dyn StateStore>, scope.clone()).policy(policy);
        let retried = retried.clone();
        tokio::spawn(async move {
            for lead in 0..25 {
                loop {
                    let res = ctx
                        .step("investigate")
                        .run(&(b, lead), |_| async {
                            let finding = format!("branch {b}: lead {lead}");
                            findings.modify(|all| all.push(finding.clone())).await.map(|u| u.replayed)
                        })
                        .await;
                    match res {
                        Ok(_) => break,
                        Err(e) if e.is_transient() => {
                            retried.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => return Err(e),
                    }
                }
            }
            Ok(())
        })
    });
    for b in branches.collect::<Vec<_>>() {
        b.await??;
    }
    let findings: State<Vec<String>> = State::new(flaky.clone() as Arc<dyn StateStore>, scope);
    let loaded = findings.load().await?;
    let all = loaded.value.unwrap_or_default();
    let mut counts = BTreeMap::new();
    for f in &all {
        *counts.entry(f.as_str()).or_insert(0u32) += 1;
    }
    let doubled = counts.values().filter(|&&n| n > 1).count();
    println!(
        "{} findings ({} distinct, {doubled} doubled) at version {}; {} commit replies lost, {} steps retried",
        all.len(),
        counts.len(),
        loaded.version,
        flaky.lost.load(Ordering::Relaxed),
        retried.load(Ordering::Relaxed)
    );
    if counts.len() != 100 || doubled > 0 {
        eprintln!("a finding is missing or doubled");
        std::process::exit(1);
    }
    Ok(())
}
