//! A history of calls and side effects, and a checker of the exactly-once guarantee over it.
//!
//! Workers record every call (invoke → ok(result) / fail / indeterminate) and every execution of
//! the side effect (start with its fence, end with the value it produced) in an effect ledger kept
//! outside the store. Each execution produces a unique value, so a result names the execution that
//! made it. After the faults heal, a final pass calls every key once more; [`History::check`] then
//! asserts, per key:
//!
//! 1. exactly one execution is *committed*: every `ok` any caller saw, and the final result, are
//!    the value of one and the same execution (so at most one committed effect, and every `ok`
//!    equals the committed result);
//! 2. no caller saw `ok` for an execution that is not the committed one;
//! 3. two executions that overlapped in time did so only because the earlier one lost its lease:
//!    the later one holds a higher fence and the earlier one is not committed;
//! 4. the final pass ended `ok` for every key (nothing stuck after the faults healed).
//!
//! Executions that ran but did not commit (a reply to `complete` was lost, a holder outlived its
//! lease) are allowed and counted as re-executions: they are the indeterminate cases fencing
//! exists for.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use idempotent_core::Error;

/// How a call ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Completion {
    /// The call returned this result.
    Ok(String),
    /// The call failed and the side effect did not run in it.
    Fail(String),
    /// The call failed and the side effect may have run (or the call was cancelled).
    Indeterminate(String),
}

impl Completion {
    /// Classifies a step call's result.
    pub fn of(res: &Result<String, Error>) -> Completion {
        match res {
            Ok(v) => Completion::Ok(v.clone()),
            Err(e) if e.action_may_have_run() => Completion::Indeterminate(e.to_string()),
            Err(e) => Completion::Fail(e.to_string()),
        }
    }
}

#[derive(Debug, Clone)]
struct Op {
    key: String,
    outcome: Option<Completion>,
    final_pass: bool,
}

#[derive(Debug, Clone)]
struct Execution {
    key: String,
    fence: u64,
    value: String,
    started: Instant,
    ended: Option<Instant>,
}

#[derive(Debug, Default)]
struct Inner {
    ops: Vec<Op>,
    executions: Vec<Execution>,
}

/// A shared, append-only record of calls and side-effect executions.
#[derive(Debug, Clone, Default)]
pub struct History {
    inner: Arc<Mutex<Inner>>,
}

/// An id for a call, returned by [`History::invoke`].
#[derive(Debug, Clone, Copy)]
pub struct OpId(usize);

impl OpId {
    /// The id as a number (to pass it to a server, e.g. in a header).
    pub fn index(self) -> usize {
        self.0
    }

    /// The id from [`index`](Self::index).
    pub fn from_index(index: usize) -> OpId {
        OpId(index)
    }
}

/// An id for a side-effect execution, returned by [`History::effect_start`].
#[derive(Debug, Clone, Copy)]
pub struct ExecId(usize);

/// What the checker counted.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Report {
    /// Keys seen.
    pub keys: usize,
    /// Calls recorded (the final pass included).
    pub ops: usize,
    /// Calls that returned a result.
    pub ok: usize,
    /// Calls that failed without running the effect.
    pub fail: usize,
    /// Calls whose effect may have run although they failed.
    pub indeterminate: usize,
    /// Side-effect executions.
    pub executions: usize,
    /// Executions beyond the first per key (none of them committed).
    pub re_executions: usize,
    /// Keys with more than one committed execution, or an `ok` of a non-committed one. Must be 0.
    pub duplicates: usize,
    /// Executions whose value is not the committed one: effects that happened but that the
    /// record does not know of (allowed by [`History::check`]; not by
    /// [`History::check_exactly_once`], for steps whose verifier finds every effect).
    pub lost_effects: usize,
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "keys={} ops={} ok={} fail={} indeterminate={} executions={} re_executions={} duplicates={} lost_effects={}",
            self.keys,
            self.ops,
            self.ok,
            self.fail,
            self.indeterminate,
            self.executions,
            self.re_executions,
            self.duplicates,
            self.lost_effects
        )
    }
}

impl History {
    /// A new, empty history.
    pub fn new() -> History {
        History::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records the start of a call on `key`.
    pub fn invoke(&self, key: &str) -> OpId {
        self.invoke_inner(key, false)
    }

    /// Records the start of a call of the final pass (after the faults healed).
    pub fn invoke_final(&self, key: &str) -> OpId {
        self.invoke_inner(key, true)
    }

    fn invoke_inner(&self, key: &str, final_pass: bool) -> OpId {
        let mut h = self.lock();
        h.ops.push(Op { key: key.to_owned(), outcome: None, final_pass });
        OpId(h.ops.len() - 1)
    }

    /// Records how a call ended.
    pub fn complete(&self, op: OpId, outcome: Completion) {
        self.lock().ops[op.0].outcome = Some(outcome);
    }

    /// Records that the side effect started inside call `op`, holding `fence`; returns the value
    /// this execution will produce (unique across the history).
    pub fn effect_start(&self, op: OpId, fence: u64) -> (ExecId, String) {
        let mut h = self.lock();
        let key = h.ops[op.0].key.clone();
        let id = h.executions.len();
        let value = format!("{key}#exec{id}");
        h.executions.push(Execution { key, fence, value: value.clone(), started: Instant::now(), ended: None });
        (ExecId(id), value)
    }

    /// The value of the side effect's execution for `key`, if one started: what a verifier that
    /// asks the effect ledger finds.
    pub fn effect_of(&self, key: &str) -> Option<String> {
        self.lock().executions.iter().find(|e| e.key == key).map(|e| e.value.clone())
    }

    /// [`check`](Self::check), and also: every execution is the committed one (no key ran its
    /// effect twice, no effect is unknown to the record). What a step whose verifier finds every
    /// effect in the ledger must achieve whatever kills its workers.
    pub fn check_exactly_once(&self) -> Result<Report, (Report, Vec<String>)> {
        let (report, mut errors) = match self.check() {
            Ok(report) => (report, Vec::new()),
            Err((report, errors)) => (report, errors),
        };
        if report.re_executions > 0 {
            errors.push(format!("{} effects ran again although the verifier could find them", report.re_executions));
        }
        if report.lost_effects > 0 {
            errors.push(format!("{} effects happened that no record knows of", report.lost_effects));
        }
        if errors.is_empty() { Ok(report) } else { Err((report, errors)) }
    }

    /// Records that the side effect finished.
    pub fn effect_end(&self, exec: ExecId) {
        self.lock().executions[exec.0].ended = Some(Instant::now());
    }

    /// Every call that did not end `ok`: (key, outcome), for failure messages.
    pub fn failures(&self) -> Vec<(String, Completion)> {
        let h = self.lock();
        h.ops
            .iter()
            .filter_map(|o| match &o.outcome {
                Some(Completion::Ok(_)) => None,
                Some(other) => Some((o.key.clone(), other.clone())),
                None => Some((o.key.clone(), Completion::Indeterminate("never completed".into()))),
            })
            .collect()
    }

    /// Checks the guarantee (see the module docs); `Err` lists every violation found.
    pub fn check(&self) -> Result<Report, (Report, Vec<String>)> {
        let h = self.lock();
        let mut errors = Vec::new();
        let mut report = Report { ops: h.ops.len(), executions: h.executions.len(), ..Report::default() };
        let keys: BTreeSet<&str> = h.ops.iter().map(|o| o.key.as_str()).collect();
        report.keys = keys.len();
        for op in &h.ops {
            match &op.outcome {
                Some(Completion::Ok(_)) => report.ok += 1,
                Some(Completion::Fail(_)) => report.fail += 1,
                Some(Completion::Indeterminate(_)) | None => report.indeterminate += 1,
            }
        }
        let by_value: BTreeMap<&str, &Execution> = h.executions.iter().map(|e| (e.value.as_str(), e)).collect();
        for key in keys {
            let ops: Vec<&Op> = h.ops.iter().filter(|o| o.key == key).collect();
            let execs: Vec<&Execution> = h.executions.iter().filter(|e| e.key == key).collect();
            report.re_executions += execs.len().saturating_sub(1);
            let mut committed: BTreeSet<&str> = BTreeSet::new();
            for op in &ops {
                if let Some(Completion::Ok(v)) = &op.outcome {
                    if !by_value.contains_key(v.as_str()) {
                        errors.push(format!("{key}: a caller saw {v:?}, which no execution produced"));
                    }
                    committed.insert(v.as_str());
                }
            }
            let finals: Vec<&Op> = ops.iter().copied().filter(|o| o.final_pass).collect();
            if finals.is_empty() || !finals.iter().all(|o| matches!(o.outcome, Some(Completion::Ok(_)))) {
                errors.push(format!(
                    "{key}: the final pass did not end ok: {:?}",
                    finals.iter().map(|o| &o.outcome).collect::<Vec<_>>()
                ));
            }
            report.lost_effects += execs.iter().filter(|e| !committed.contains(e.value.as_str())).count();
            if committed.len() > 1 {
                report.duplicates += 1;
                errors.push(format!("{key}: {} different results were committed: {committed:?}", committed.len()));
            }
            // Overlapping executions: the later must be fenced above the earlier, which must not
            // be the committed one.
            for (i, a) in execs.iter().enumerate() {
                for b in &execs[i + 1..] {
                    let (first, second) = if a.started <= b.started { (a, b) } else { (b, a) };
                    let overlapped = first.ended.is_none_or(|end| end > second.started);
                    if !overlapped {
                        continue;
                    }
                    if second.fence <= first.fence {
                        errors.push(format!(
                            "{key}: executions {} and {} overlapped without a higher fence ({} then {})",
                            first.value, second.value, first.fence, second.fence
                        ));
                    }
                    if committed.contains(first.value.as_str()) && committed.contains(second.value.as_str()) {
                        errors.push(format!(
                            "{key}: overlapping executions {} and {} both committed",
                            first.value, second.value
                        ));
                    }
                    // A store that fences correctly refuses the earlier holder's completion.
                    if committed.contains(first.value.as_str()) && second.fence > first.fence {
                        errors.push(format!(
                            "{key}: execution {} committed although a later attempt (fence {}) had taken over while it ran",
                            first.value, second.fence
                        ));
                    }
                }
            }
        }
        if errors.is_empty() { Ok(report) } else { Err((report, errors)) }
    }
}
