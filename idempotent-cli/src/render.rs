//! How records are printed: aligned tables for people, JSON for scripts.

use std::time::{SystemTime, UNIX_EPOCH};

use idempotent_core::store::RecordInfo;
use serde_json::{Value, json};

use crate::duration::short;

/// A record as JSON: every field, times as milliseconds since the Unix epoch.
pub(crate) fn record_json(r: &RecordInfo) -> Value {
    json!({
        "key": r.key.to_hex(),
        "state": r.state.as_str(),
        "step": r.step,
        "run": r.run,
        "tenant": r.tenant,
        "attempt": r.attempt,
        "fence": r.fence,
        "created_ms": millis(r.created),
        "updated_ms": millis(r.updated),
        "lease_until_ms": r.lease_until.map(millis),
        "expires_ms": r.expires.map(millis),
        "result_bytes": r.result_bytes,
    })
}

fn millis(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// How long ago `t` was (or `in …` for a time to come).
fn ago(t: SystemTime, now: SystemTime) -> String {
    match now.duration_since(t) {
        Ok(d) => format!("{} ago", short(d)),
        Err(e) => format!("in {}", short(e.duration())),
    }
}

/// One record, a field per line.
pub(crate) fn record_detail(r: &RecordInfo) -> String {
    let now = SystemTime::now();
    let mut lines = vec![
        ("key", r.key.to_hex()),
        ("state", r.state.to_string()),
        ("step", r.step.clone()),
        ("run", r.run.clone().unwrap_or_else(|| "-".into())),
        ("tenant", r.tenant.clone().unwrap_or_else(|| "-".into())),
        ("attempt", r.attempt.to_string()),
        ("fence", r.fence.to_string()),
        ("created", ago(r.created, now)),
        ("updated", ago(r.updated, now)),
    ];
    if let Some(lease) = r.lease_until {
        lines.push(("lease until", ago(lease, now)));
    }
    lines.push(("expires", r.expires.map_or_else(|| "never (until resolved)".into(), |t| ago(t, now))));
    if let Some(n) = r.result_bytes {
        lines.push(("result", format!("{n} bytes")));
    }
    let width = lines.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    lines.iter().map(|(k, v)| format!("{k:<width$}  {v}\n")).collect()
}

/// Records as a table, one per row.
pub(crate) fn record_table(records: &[RecordInfo]) -> String {
    let now = SystemTime::now();
    let header = ["KEY", "STATE", "STEP", "RUN", "TENANT", "ATTEMPT", "FENCE", "UPDATED", "EXPIRES"];
    let rows: Vec<Vec<String>> = records
        .iter()
        .map(|r| {
            vec![
                r.key.short().to_string(),
                r.state.to_string(),
                r.step.clone(),
                r.run.clone().unwrap_or_else(|| "-".into()),
                r.tenant.clone().unwrap_or_else(|| "-".into()),
                r.attempt.to_string(),
                r.fence.to_string(),
                ago(r.updated, now),
                r.expires.map_or_else(|| "never".into(), |t| ago(t, now)),
            ]
        })
        .collect();
    table(&header, &rows)
}

/// Aligned columns under a header.
pub(crate) fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: &mut dyn Iterator<Item = &str>| {
        let text: Vec<String> = cells.zip(&widths).map(|(c, w)| format!("{c:<w$}")).collect();
        format!("{}\n", text.join("  ").trim_end())
    };
    let mut out = line(&mut header.iter().copied());
    for row in rows {
        out.push_str(&line(&mut row.iter().map(String::as_str)));
    }
    out
}

/// `n` and `noun`, plural unless `n` is 1: `1 record`, `0 records`, `3 running records`.
pub(crate) fn count(n: usize, noun: &str) -> String {
    if n == 1 { format!("1 {noun}") } else { format!("{n} {noun}s") }
}
