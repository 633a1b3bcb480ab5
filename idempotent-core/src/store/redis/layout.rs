//! Where each field of a Redis record sits, for the Rust side: the same layout as `layout.lua`,
//! the prelude of every script, which documents each field. Here positions are 0-based byte ranges (`X_FROM - 1 .. X_TO`
//! in the Lua names); a test below checks that the two agree. The functions read a record's
//! variable part (labels, result) in place, without allocating.
//!
//! Public only so that the tests crate can write records by hand; not API.
//!
//! # The key and the record
//!
//! One Redis key per operation: the store's prefix (`idem:` by default), then the operation's
//! [`Key`](crate::Key) as 64 lowercase hex digits, so that no command ever spans two keys and
//! Redis Cluster never sees a cross-slot one. The record is one string: [`HEADER_LEN`] bytes of
//! fixed-width fields, the labels' text, then, once done, the result; a done record costs its
//! result and labels plus 190 bytes.
//!
//! The numbers are fixed-width decimal digits rather than binary, so that `renew` rewrites the
//! lease deadline (and the update time) with one `SETRANGE` each, and so that every number can be
//! checked for corruption: digits only ([`digits`]; Lua's `tonumber` would also take signs, `nan`
//! or `0x..`), fences below [`MAX_FENCE`], where Lua's doubles count exactly. Binary fields
//! measured a little cheaper per script call and could not be checked (BENCHMARKS.md,
//! "Measurements behind other decisions").
//!
//! # Times
//!
//! `created` and `updated` are milliseconds of the server's clock. A record `SET NX` wrote
//! ([`NEW`]) has no server time to hand: its times are the client's estimate of the server's
//! clock, the fence in milliseconds (`clock.rs`; off by the estimate's error, well under a
//! second). `complete` stamps the done record's update time with the same estimate, sent as its
//! fourth argument and never before the record's last change, because `TIME` inside the script
//! cost Redis about a quarter of the function's time (BENCHMARKS.md); the script reads `TIME`
//! itself when the client has no fresh estimate (a store whose acquires never take the `SET NX`
//! path never measures the clock).
//!
//! This is the only layout the store reads: nothing is published yet, so no deployment holds
//! records of an earlier one. A key holding anything else is [`Corrupt`](crate::Error::Corrupt).

use std::ops::{Range, RangeFrom};

/// The state byte.
pub const STATE: usize = 0;
/// State of a running record written by the acquire script.
pub const RUNNING: u8 = b'R';
/// State of a running record written by `SET NX` (its lease is judged by its TTL).
pub const NEW: u8 = b'N';
/// State of a released record (the fence is kept; the recovered byte says whether the attempt
/// that released it was uncertain).
pub const RELEASED: u8 = b'X';
/// State of a record that needs attention (laid out as a running record, kept without a TTL).
pub const NEEDS_ATTENTION: u8 = b'A';
/// State of a done record (the result follows the labels).
pub const DONE: u8 = b'C';
/// The payload's fingerprint, in hex.
pub const FINGERPRINT: Range<usize> = 1..65;
/// The owner token of the last acquisition.
pub const TOKEN: Range<usize> = 65..97;
/// The lease deadline (`R`) or threshold TTL (`N`), in digits.
pub const LEASE: Range<usize> = 97..112;
/// The last attempt's fence, in digits.
pub const FENCE: Range<usize> = 112..132;
/// The last attempt's number, in digits.
pub const ATTEMPT: Range<usize> = 132..142;
/// Running records: `1` when the previous lease ran out, else `0`; released records: `1` when
/// the attempt that released it was uncertain (the next one is recovered), else `0`.
pub const RECOVERED: usize = 142;
/// When the record's current life began, ms of server time, in digits (0: unknown).
pub const CREATED: Range<usize> = 143..158;
/// When the record last changed, ms of server time, in digits.
pub const UPDATED: Range<usize> = 158..173;
/// The step name's length, in digits.
pub const STEP_LEN: Range<usize> = 173..178;
/// The run id's length, in digits.
pub const RUN_LEN: Range<usize> = 178..183;
/// The tenant's length, in digits.
pub const TENANT_LEN: Range<usize> = 183..188;
/// `1` when a run id is given, else `0`.
pub const RUN_SET: usize = 188;
/// `1` when a tenant is given, else `0`.
pub const TENANT_SET: usize = 189;
/// The fixed-width fields of every record; the labels' text follows, then a done record's
/// result.
pub const HEADER_LEN: usize = 190;
/// The labels section of a record without labels.
pub const NO_LABELS: &str = "00000000000000000";
/// The longest label (step, run id or tenant) a record holds, in bytes.
pub const MAX_LABEL_LEN: usize = 99_999;
/// Fences stay below 2^53, where Lua's doubles count exactly.
pub const MAX_FENCE: u64 = 1 << 53;

/// `acquire`'s one argument: the payload's fingerprint.
pub const ARG_FINGERPRINT: Range<usize> = 0..64;
/// `acquire`'s one argument: the new owner token.
pub const ARG_TOKEN: Range<usize> = 64..96;
/// `acquire`'s one argument: the lease in milliseconds, in digits.
pub const ARG_LEASE: Range<usize> = 96..111;
/// `acquire`'s one argument: the retention in milliseconds, in digits.
pub const ARG_RETENTION: Range<usize> = 111..126;
/// `acquire`'s one argument: the labels section, as a record holds it from [`STEP_LEN`] on.
pub const ARG_LABELS: RangeFrom<usize> = 126..;
/// The length of `acquire`'s one argument without the labels' text.
pub const ACQUIRE_ARG_MIN_LEN: usize = 143;

/// The labels of a record, read in place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Labels<'a> {
    /// The step name.
    pub step: &'a [u8],
    /// The run id, if given.
    pub run: Option<&'a [u8]>,
    /// The tenant, if given.
    pub tenant: Option<&'a [u8]>,
}

/// A decimal field of digits only (Lua's `tonumber` would also take signs, `nan`, `0x..`).
pub fn digits(field: &[u8]) -> Option<u64> {
    if field.is_empty() || field.len() > 20 || !field.iter().all(u8::is_ascii_digit) {
        return None;
    }
    field.iter().try_fold(0u64, |n, d| n.checked_mul(10)?.checked_add(u64::from(d - b'0')))
}

/// Where the labels' text of a record in this layout (at least [`HEADER_LEN`] bytes) ends, or
/// `None` when its lengths or flags are malformed or the text runs past the end.
pub fn labels_end(record: &[u8]) -> Option<usize> {
    let lens = [STEP_LEN, RUN_LEN, TENANT_LEN].map(|r| record.get(r).and_then(digits));
    let flags = [RUN_SET, TENANT_SET].map(|at| record.get(at).copied());
    if flags.iter().any(|f| !matches!(f, Some(b'0' | b'1'))) {
        return None;
    }
    let end = lens.into_iter().try_fold(HEADER_LEN, |end, len| end.checked_add(usize::try_from(len?).ok()?))?;
    (end <= record.len()).then_some(end)
}

/// The labels of a record in this layout (see [`labels_end`]).
pub fn labels(record: &[u8]) -> Option<Labels<'_>> {
    let end = labels_end(record)?;
    let len = |r: Range<usize>| digits(&record[r]).map(|n| n as usize);
    let (step_len, run_len) = (len(STEP_LEN)?, len(RUN_LEN)?);
    let step = &record[HEADER_LEN..HEADER_LEN + step_len];
    let run_at = HEADER_LEN + step_len;
    let run = (record[RUN_SET] == b'1').then(|| &record[run_at..run_at + run_len]);
    let tenant = (record[TENANT_SET] == b'1').then(|| &record[run_at + run_len..end]);
    Some(Labels { step, run, tenant })
}

/// Where a done record's result starts: after its labels; `None` when the record is not a done
/// record.
pub fn result_start(record: &[u8]) -> Option<usize> {
    match record.first() {
        Some(&DONE) if record.len() >= HEADER_LEN => labels_end(record),
        _ => None,
    }
}

/// Whether a running, new, released or needs-attention record has the length of one: the
/// header and its labels, nothing after.
pub fn running_shape(record: &[u8]) -> bool {
    record.len() >= HEADER_LEN && labels_end(record) == Some(record.len())
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    const LUA: &str = include_str!("layout.lua");

    /// The prelude's `local NAME, NAME = value, value` lines, by name (strings unquoted).
    fn lua_constants() -> BTreeMap<String, String> {
        let mut constants = BTreeMap::new();
        // Function bodies are indented, and `local function` lines name no constant.
        for line in LUA.lines().filter_map(|l| l.strip_prefix("local ")).filter(|l| !l.starts_with("function ")) {
            let line = line.split(" --").next().unwrap();
            let (names, values) = line.split_once(" = ").expect("a prelude line is `local names = values`");
            let names: Vec<_> = names.split(", ").collect();
            let values: Vec<_> = values.split(", ").collect();
            assert_eq!(names.len(), values.len(), "{line}");
            for (name, value) in names.into_iter().zip(values) {
                let value = value.trim().trim_matches('\'');
                assert!(constants.insert(name.to_owned(), value.to_owned()).is_none(), "{name} twice");
            }
        }
        constants
    }

    #[test]
    fn the_lua_prelude_and_the_rust_ranges_agree() {
        let mut lua = lua_constants();
        let mut take = |name: &str| lua.remove(name).unwrap_or_else(|| panic!("layout.lua has no {name}"));
        let mut position = |name: &str, at: usize| {
            assert_eq!(take(name), (at + 1).to_string(), "{name}");
        };
        position("STATE", STATE);
        position("RECOVERED", RECOVERED);
        position("RUN_SET", RUN_SET);
        position("TENANT_SET", TENANT_SET);
        position("ARG_LABELS_FROM", ARG_LABELS.start);
        let ranges = [
            ("FINGERPRINT", FINGERPRINT),
            ("TOKEN", TOKEN),
            ("LEASE", LEASE),
            ("FENCE", FENCE),
            ("ATTEMPT", ATTEMPT),
            ("CREATED", CREATED),
            ("UPDATED", UPDATED),
            ("STEP_LEN", STEP_LEN),
            ("RUN_LEN", RUN_LEN),
            ("TENANT_LEN", TENANT_LEN),
            ("ARG_FINGERPRINT", ARG_FINGERPRINT),
            ("ARG_TOKEN", ARG_TOKEN),
            ("ARG_LEASE", ARG_LEASE),
            ("ARG_RETENTION", ARG_RETENTION),
        ];
        for (name, range) in ranges {
            assert_eq!(take(&format!("{name}_FROM")), (range.start + 1).to_string(), "{name}");
            assert_eq!(take(&format!("{name}_TO")), range.end.to_string(), "{name}");
        }
        let states = [
            ("RUNNING", RUNNING),
            ("NEW", NEW),
            ("RELEASED", RELEASED),
            ("NEEDS_ATTENTION", NEEDS_ATTENTION),
            ("DONE", DONE),
        ];
        for (name, state) in states {
            assert_eq!(take(name), char::from(state).to_string(), "{name}");
        }
        assert_eq!(take("HEADER_LEN"), HEADER_LEN.to_string());
        assert_eq!(take("ACQUIRE_ARG_MIN_LEN"), ACQUIRE_ARG_MIN_LEN.to_string());
        assert_eq!(take("MAX_FENCE"), MAX_FENCE.to_string());
        assert_eq!(take("LEASE_FORMAT"), format!("%0{}.0f", LEASE.len()));
        assert_eq!(
            take("RUNNING_TAIL_FORMAT"),
            format!("%0{}.0f%0{}.0f%0{}.0f%d", LEASE.len(), FENCE.len(), ATTEMPT.len())
        );
        assert_eq!(take("TIME_FORMAT"), format!("%0{}.0f", CREATED.len()));
        let length = format!("({})", "%d".repeat(STEP_LEN.len()));
        assert_eq!((RUN_LEN.len(), TENANT_LEN.len()), (STEP_LEN.len(), STEP_LEN.len()));
        assert_eq!(take("LABELS_HEAD"), format!("^{}[01][01]", length.repeat(3)));
        assert!(lua.is_empty(), "layout.lua names what layout.rs does not: {lua:?}");
    }

    #[test]
    fn every_script_starts_with_the_prelude() {
        use super::super::source;
        for script in source::ALL {
            assert!(script.starts_with(LUA) && script.len() > LUA.len());
        }
    }

    /// The fields follow each other without gaps, and the lengths add up.
    #[test]
    fn the_fields_tile_the_record() {
        assert_eq!((STATE + 1, FINGERPRINT.end, TOKEN.end), (FINGERPRINT.start, TOKEN.start, LEASE.start));
        assert_eq!((LEASE.end, FENCE.end, ATTEMPT.end), (FENCE.start, ATTEMPT.start, RECOVERED));
        assert_eq!((RECOVERED + 1, CREATED.end, UPDATED.end), (CREATED.start, UPDATED.start, STEP_LEN.start));
        assert_eq!((STEP_LEN.end, RUN_LEN.end, TENANT_LEN.end), (RUN_LEN.start, TENANT_LEN.start, RUN_SET));
        assert_eq!((RUN_SET + 1, TENANT_SET + 1), (TENANT_SET, HEADER_LEN));
        assert_eq!(NO_LABELS.len(), HEADER_LEN - STEP_LEN.start);
        assert_eq!(MAX_LABEL_LEN.to_string().len(), STEP_LEN.len());
        assert_eq!((STEP_LEN.len(), RUN_LEN.len()), (TENANT_LEN.len(), TENANT_LEN.len()));
        assert_eq!(
            (ARG_FINGERPRINT.end, ARG_TOKEN.end, ARG_LEASE.end),
            (ARG_TOKEN.start, ARG_LEASE.start, ARG_RETENTION.start)
        );
        assert_eq!((ARG_RETENTION.end, ACQUIRE_ARG_MIN_LEN), (ARG_LABELS.start, ARG_LABELS.start + NO_LABELS.len()));
        assert_eq!((FINGERPRINT.len(), TOKEN.len()), (ARG_FINGERPRINT.len(), ARG_TOKEN.len()));
        assert!(MAX_FENCE.to_string().len() <= FENCE.len());
    }

    /// Every state has its own letter.
    #[test]
    fn the_states_are_distinct() {
        let states = [RUNNING, NEW, RELEASED, NEEDS_ATTENTION, DONE];
        let distinct: std::collections::BTreeSet<_> = states.iter().collect();
        assert_eq!(distinct.len(), states.len());
    }
}

#[cfg(test)]
mod read_tests {
    use super::*;

    /// A record's labels section, as the store writes it.
    fn record(state: u8, labels: (&str, Option<&str>, Option<&str>), tail: &[u8]) -> Vec<u8> {
        let (step, run, tenant) = labels;
        let mut rec = vec![b'0'; STEP_LEN.start];
        rec[STATE] = state;
        let run_len = run.map_or(0, str::len);
        let tenant_len = tenant.map_or(0, str::len);
        rec.extend(format!("{:05}{run_len:05}{tenant_len:05}", step.len()).bytes());
        rec.extend([if run.is_some() { b'1' } else { b'0' }, if tenant.is_some() { b'1' } else { b'0' }]);
        rec.extend(step.bytes().chain(run.unwrap_or("").bytes()).chain(tenant.unwrap_or("").bytes()));
        rec.extend(tail);
        rec
    }

    #[test]
    fn labels_and_results_are_found_in_place() {
        let done = record(DONE, ("charge", Some(""), Some("acme")), b"result");
        let read = labels(&done).unwrap();
        assert_eq!((read.step, read.run, read.tenant), (&b"charge"[..], Some(&b""[..]), Some(&b"acme"[..])));
        assert_eq!(&done[result_start(&done).unwrap()..], b"result");
        let running = record(RUNNING, ("", None, None), b"");
        assert_eq!(running.len(), HEADER_LEN);
        assert!(running_shape(&running));
        assert_eq!(labels(&running).unwrap(), Labels { step: b"", run: None, tenant: None });
        assert!(!running_shape(&record(RUNNING, ("s", None, None), b"extra")));
        // The header alone, without its labels, is no record.
        assert!(!running_shape(&running[..HEADER_LEN - 1]));
    }

    #[test]
    fn malformed_labels_are_refused() {
        let mut rec = record(DONE, ("step", None, None), b"");
        rec[RUN_SET] = b'2';
        assert_eq!(labels_end(&rec), None);
        let mut rec = record(RUNNING, ("step", None, None), b"");
        rec[STEP_LEN.start] = b'9';
        assert_eq!(labels_end(&rec), None, "the text runs past the end");
        rec[STEP_LEN.start] = b'x';
        assert_eq!(labels_end(&rec), None);
        assert_eq!(digits(b"+1"), None);
        assert_eq!(digits(b"007"), Some(7));
    }
}
