//! What each command does, on an open store: it reads and changes records only through the
//! `Store` trait, as the library does.

use std::collections::BTreeMap;

use idempotent_core::reconcile::{Reconciler, Settled};
use idempotent_core::record::{Resolution, Resolved, encode_ok};
use idempotent_core::store::{Cursor, Filter, MAX_PAGE, RecordInfo, RecordState, delete_all};
use idempotent_core::{Key, SharedStore};
use serde_json::{Value, json};

use crate::args::{List, Purge, Release, Resolve, Select, Which};
use crate::duration::short;
use crate::exit::{Code, Failure};
use crate::render::{count, record_detail, record_json, record_table, table};
use crate::which::{self, Named};

/// What a command prints, for people and for scripts, and how it exits.
pub(crate) struct Report {
    pub(crate) text: String,
    pub(crate) json: Value,
    pub(crate) code: Code,
}

impl Report {
    fn ok(text: String, json: Value) -> Self {
        Report { text, json, code: Code::Ok }
    }

    fn dry_run(plan: String, json: Value) -> Self {
        let text = format!("{plan}Nothing changed: run again with --yes to make the change.\n");
        Report { text, json: json!({ "dry_run": true, "plan": json }), code: Code::DryRun }
    }
}

fn filter(select: &Select) -> Filter {
    let mut filter = Filter::all();
    filter.state = select.state;
    filter.step.clone_from(&select.step);
    filter.run.clone_from(&select.run);
    filter.tenant.clone_from(&select.tenant);
    filter.idle_for = select.older_than;
    filter
}

/// Every record that passes `filter`, each once, in key order, that `keep` keeps.
async fn every_where(
    store: &SharedStore,
    filter: &Filter,
    keep: impl Fn(&RecordInfo) -> bool,
) -> Result<Vec<RecordInfo>, Failure> {
    let mut found = BTreeMap::new();
    let mut cursor = Cursor::start();
    loop {
        let page = store.scan(filter, &cursor, MAX_PAGE).await?;
        // Redis may list a record twice (after a rehash): keyed, each is kept once.
        found.extend(page.records.into_iter().filter(&keep).map(|r| (r.key, r)));
        match page.next {
            Some(next) => cursor = next,
            None => return Ok(found.into_values().collect()),
        }
    }
}

/// Every record that passes `filter`, each once.
async fn every(store: &SharedStore, filter: &Filter) -> Result<Vec<RecordInfo>, Failure> {
    every_where(store, filter, |_| true).await
}

/// The key `which` names; the start of a key is completed from the store's records (a scan of
/// them all), and must be the start of exactly one.
async fn key(store: &SharedStore, which: &Which) -> Result<Key, Failure> {
    let prefix = match which::named(which)? {
        Named::Key(key) => return Ok(key),
        Named::Prefix(prefix) => prefix,
    };
    let matching = every_where(store, &Filter::all(), |r| r.key.to_hex().starts_with(&prefix)).await?;
    match matching.as_slice() {
        [] => Err(Failure::new(
            Code::NotFound,
            format!(
                "no record's key starts with {prefix}: it is absent, expired or was purged (`list` shows the records there are)"
            ),
        )),
        [one] => Ok(one.key),
        many => {
            const SHOWN: usize = 5;
            let mut shown: Vec<String> = many
                .iter()
                .take(SHOWN)
                .map(|r| format!("{} ({}, step `{}`)", r.key.to_hex(), r.state, r.step))
                .collect();
            if many.len() > SHOWN {
                shown.push(format!("and {} more", many.len() - SHOWN));
            }
            Err(Failure::usage(format!(
                "{prefix} is the start of {} records' keys: {}; give more of the key (`list --json` prints all 64 hex digits)",
                many.len(),
                shown.join(", ")
            )))
        }
    }
}

async fn existing(store: &SharedStore, key: &Key) -> Result<RecordInfo, Failure> {
    store.inspect(key).await?.ok_or_else(|| {
        Failure::new(
            Code::NotFound,
            format!(
                "no record under key {}: it is absent, expired or was purged (the next call runs the operation as a new one)",
                key.to_hex()
            ),
        )
    })
}

pub(crate) async fn inspect(store: &SharedStore, which: &Which) -> Result<Report, Failure> {
    let record = existing(store, &key(store, which).await?).await?;
    Ok(Report::ok(record_detail(&record), record_json(&record)))
}

pub(crate) async fn list(store: &SharedStore, args: &List) -> Result<Report, Failure> {
    let filter = filter(&args.select);
    let limit = args.limit.max(1);
    let mut cursor = args.cursor.clone().map_or_else(Cursor::start, Cursor::from_text);
    let mut records = Vec::new();
    let next = loop {
        let page = store.scan(&filter, &cursor, (limit - records.len()).min(MAX_PAGE)).await?;
        records.extend(page.records);
        match page.next {
            Some(next) if records.len() < limit => cursor = next,
            next => break next,
        }
    };
    let mut text = record_table(&records);
    if let Some(next) = &next {
        text.push_str(&format!("more: --cursor {}\n", next.as_str()));
    }
    let json = json!({
        "records": records.iter().map(record_json).collect::<Vec<_>>(),
        "next_cursor": next.as_ref().map(Cursor::as_str),
    });
    Ok(Report::ok(text, json))
}

pub(crate) async fn release(store: &SharedStore, args: &Release) -> Result<Report, Failure> {
    let key = key(store, &args.which).await?;
    let record = existing(store, &key).await?;
    let holds = matches!(record.state, RecordState::Running | RecordState::Stuck) && record.lease_until.is_some();
    if !holds {
        return Err(Failure::refused(format!(
            "record {} is {} and no attempt holds it: there is no lease to release",
            key.short(),
            record.state
        )));
    }
    if record.fence != args.fence {
        return Err(Failure::refused(format!(
            "record {} is held at fence {}, not {}: another attempt took it over since; inspect it again",
            key.short(),
            record.fence,
            args.fence
        )));
    }
    let plan = format!(
        "Would release record {} (step `{}`, attempt {}, fence {}, {}): the attempt holding it can no longer store an outcome, and the next call is recovered (it verifies, or runs the action again).\n",
        key.short(),
        record.step,
        record.attempt,
        record.fence,
        record.state
    );
    if !args.yes {
        return Ok(Report::dry_run(plan, json!({ "release": record_json(&record) })));
    }
    match store.release_fenced(&key, args.fence).await? {
        Resolved::Unchanged => Err(Failure::refused(format!(
            "record {} changed since it was read (another attempt took or ended it): nothing released; inspect it again",
            key.short()
        ))),
        _ => {
            let after = existing(store, &key).await?;
            Ok(Report::ok(
                format!("Released record {} at fence {}; the next call is recovered.\n", key.short(), args.fence),
                json!({ "released": record_json(&after) }),
            ))
        }
    }
}

pub(crate) async fn resolve(store: &SharedStore, args: &Resolve) -> Result<Report, Failure> {
    let key = key(store, &args.which).await?;
    let record = existing(store, &key).await?;
    if record.state != RecordState::NeedsAttention {
        return Err(Failure::refused(format!(
            "record {} is {}, not needs_attention: only a record waiting for a person is resolved",
            key.short(),
            record.state
        )));
    }
    let (resolution, what) = match &args.done {
        Some(text) => {
            let value: Value = serde_json::from_str(text).map_err(|e| {
                Failure::usage(format!("--done is not JSON ({e}): give the step's result as JSON, e.g. '\"re_123\"'"))
            })?;
            let outcome = encode_ok(&value).map_err(|e| Failure::usage(format!("--done cannot be stored: {e}")))?;
            let what = format!("done with the result {value}, kept for {}", short(args.retention));
            (Resolution::Done { outcome, retention: args.retention }, what)
        }
        None => (Resolution::NotDone, "not done: the next call runs the action".to_owned()),
    };
    let plan = format!(
        "Would resolve record {} (step `{}`, left by attempt {} at fence {}) as {what}.\n",
        key.short(),
        record.step,
        record.attempt,
        record.fence
    );
    if !args.yes {
        return Ok(Report::dry_run(plan, json!({ "resolve": record_json(&record), "as": what })));
    }
    match store.resolve(&key, resolution).await? {
        Resolved::Unchanged => Err(Failure::refused(format!(
            "record {} no longer needs attention (resolved by someone else?)",
            key.short()
        ))),
        _ => {
            let after = existing(store, &key).await?;
            Ok(Report::ok(
                format!("Resolved record {} as {what}.\n", key.short()),
                json!({ "resolved": record_json(&after) }),
            ))
        }
    }
}

pub(crate) async fn purge(store: &SharedStore, args: &Purge) -> Result<Report, Failure> {
    let select = &args.select;
    if select.run.is_none() && select.step.is_none() && select.older_than.is_none() {
        return Err(Failure::usage(
            "purge needs --run, --step or --older-than (and may narrow them with --state, --tenant)",
        ));
    }
    let filter = filter(select);
    if !args.yes {
        // Only the plan reads the records first; the purge itself scans as it deletes.
        let records = every(store, &filter).await?;
        let running = records.iter().filter(|r| r.state == RecordState::Running).count();
        let mut by_state: BTreeMap<&str, usize> = BTreeMap::new();
        for r in &records {
            *by_state.entry(r.state.as_str()).or_default() += 1;
        }
        let counts: Vec<String> = by_state.iter().map(|(s, n)| format!("{n} {s}")).collect();
        let plan = format!(
            "Would remove {} ({}); {} left alone. A removed done record runs again on its next call.\n",
            count(records.len() - running, "record"),
            if counts.is_empty() { "none match".to_owned() } else { counts.join(", ") },
            count(running, "running record"),
        );
        return Ok(Report::dry_run(
            plan,
            json!({ "would_remove": records.len() - running, "running": running, "by_state": by_state }),
        ));
    }
    let purged = delete_all(store.as_ref(), &filter).await?;
    let (removed, left_running, gone) = (purged.removed, purged.running, purged.gone);
    let text = format!(
        "Removed {}; {} left alone{}.\n",
        count(removed, "record"),
        count(left_running, "running record"),
        if gone > 0 { format!(", {gone} already gone") } else { String::new() }
    );
    Ok(Report::ok(text, json!({ "removed": removed, "running": left_running, "already_gone": gone })))
}

pub(crate) async fn stats(store: &SharedStore, select: &Select) -> Result<Report, Failure> {
    let records = every(store, &filter(select)).await?;
    let mut by_step: BTreeMap<&str, BTreeMap<&str, usize>> = BTreeMap::new();
    for r in &records {
        *by_step.entry(r.step.as_str()).or_default().entry(r.state.as_str()).or_default() += 1;
    }
    let mut header = vec!["STEP"];
    header.extend(RecordState::ALL.iter().map(|s| s.as_str()));
    header.push("total");
    let mut rows: Vec<Vec<String>> = by_step
        .iter()
        .map(|(step, counts)| {
            let mut row = vec![if step.is_empty() { "(none)".to_owned() } else { (*step).to_owned() }];
            row.extend(RecordState::ALL.iter().map(|s| counts.get(s.as_str()).copied().unwrap_or(0).to_string()));
            row.push(counts.values().sum::<usize>().to_string());
            row
        })
        .collect();
    let mut total = vec!["total".to_owned()];
    total.extend(RecordState::ALL.iter().map(|s| records.iter().filter(|r| r.state == *s).count().to_string()));
    total.push(records.len().to_string());
    rows.push(total);
    Ok(Report::ok(table(&header, &rows), json!({ "steps": by_step, "total": records.len() })))
}

pub(crate) async fn reconcile(store: &SharedStore, select: &Select) -> Result<Report, Failure> {
    // No verifiers here (they are the service's code): every stuck record is reported.
    let reconciler = Reconciler::new(store.clone()).filter(filter(select)).batch(MAX_PAGE);
    let mut stuck = Vec::new();
    loop {
        let pass = reconciler.pass().await?;
        stuck.extend(pass.settled.into_iter().filter(|(_, s)| *s == Settled::NoVerifier).map(|(r, _)| r));
        if pass.wrapped {
            break;
        }
    }
    stuck.sort_by_key(|r| r.key);
    stuck.dedup_by_key(|r| r.key);
    let mut text = record_table(&stuck);
    text.push_str(&format!(
        "{}. Run a Reconciler with a verifier for each step in the service, or check each downstream and `release` (the next call is recovered) or `purge` it.\n",
        count(stuck.len(), "stuck record")
    ));
    Ok(Report::ok(text, json!({ "stuck": stuck.iter().map(record_json).collect::<Vec<_>>() })))
}
