//! Where each field of a Redis record sits, for the Rust side: the same layout as `layout.lua`,
//! the prelude of every script, which documents each field. Here positions are 0-based byte
//! ranges (`X_FROM - 1 .. X_TO` in the Lua names); a test below checks that the two agree.
//!
//! Public only so that the tests crate can write records by hand; not API.

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
/// State of a done record (the result follows the token).
pub const DONE: u8 = b'D';
/// The payload's fingerprint, in hex.
pub const FINGERPRINT: Range<usize> = 1..65;
/// The owner token of the last acquisition.
pub const TOKEN: Range<usize> = 65..97;
/// Running, released and needs-attention records: the lease deadline (`R`) or threshold TTL (`N`), in digits.
pub const LEASE: Range<usize> = 97..112;
/// Running, released and needs-attention records: the fence, in digits.
pub const FENCE: Range<usize> = 112..132;
/// Running, released and needs-attention records: the attempt number, in digits.
pub const ATTEMPT: Range<usize> = 132..142;
/// Running records: `1` when the previous lease ran out, else `0`; released records: `1` when
/// the attempt that released it was uncertain (the next one is recovered), else `0`.
pub const RECOVERED: usize = 142;
/// The length of a running (`R`, `N`), released (`X`) or needs-attention (`A`) record.
pub const RUNNING_LEN: usize = 143;
/// Done records: the encoded result.
pub const RESULT: RangeFrom<usize> = 97..;
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
/// The length of `acquire`'s one argument.
pub const ACQUIRE_ARG_LEN: usize = 126;

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    const LUA: &str = include_str!("layout.lua");

    /// The prelude's `local NAME, NAME = value, value` lines, by name (strings unquoted).
    fn lua_constants() -> BTreeMap<String, String> {
        let mut constants = BTreeMap::new();
        for line in LUA.lines().filter_map(|l| l.strip_prefix("local ")) {
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
        position("RESULT_FROM", RESULT.start);
        let ranges = [
            ("FINGERPRINT", FINGERPRINT),
            ("TOKEN", TOKEN),
            ("LEASE", LEASE),
            ("FENCE", FENCE),
            ("ATTEMPT", ATTEMPT),
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
        assert_eq!(take("RUNNING_LEN"), RUNNING_LEN.to_string());
        assert_eq!(take("ACQUIRE_ARG_LEN"), ACQUIRE_ARG_LEN.to_string());
        assert_eq!(take("MAX_FENCE"), MAX_FENCE.to_string());
        assert_eq!(take("LEASE_FORMAT"), format!("%0{}.0f", LEASE.len()));
        assert_eq!(
            take("RUNNING_TAIL_FORMAT"),
            format!("%0{}.0f%0{}.0f%0{}.0f%d", LEASE.len(), FENCE.len(), ATTEMPT.len())
        );
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
        assert_eq!((RECOVERED + 1, RESULT.start), (RUNNING_LEN, TOKEN.end));
        assert_eq!(
            (ARG_FINGERPRINT.end, ARG_TOKEN.end, ARG_LEASE.end),
            (ARG_TOKEN.start, ARG_LEASE.start, ARG_RETENTION.start)
        );
        assert_eq!(ARG_RETENTION.end, ACQUIRE_ARG_LEN);
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
