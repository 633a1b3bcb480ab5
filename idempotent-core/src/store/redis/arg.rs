//! The arguments the store sends, each written straight into the command's buffer (no `String`
//! per argument), and the milliseconds the scripts take.

use std::time::Duration;

use deadpool_redis::redis;

use super::layout::{ACQUIRE_ARG_LEN, ARG_LEASE, ARG_RETENTION, ATTEMPT, FENCE, LEASE, NEW, RUNNING_LEN};
use crate::key::Key;
use crate::record::Token;

/// Milliseconds as the scripts take them: at least 1, at most ten years, so that Lua's number
/// formatting never turns them into exponent notation (and they fit the records' 15 digits).
pub(super) fn millis(d: Duration) -> u64 {
    const TEN_YEARS_MS: u128 = 10 * 365 * 24 * 60 * 60 * 1000;
    d.as_millis().clamp(1, TEN_YEARS_MS) as u64
}

/// A command argument.
pub(super) enum Arg<'a> {
    Bytes(&'a [u8]),
    /// Milliseconds, in decimal.
    Millis(u64),
    /// The record's Redis key: the store's prefix, then the key in hex (as `redis_key`).
    Key(&'a str, &'a Key),
    /// `acquire`'s one argument: fingerprint, token, then lease and retention in digits
    /// (`ARG_*` in the layout).
    Acquire {
        fp: &'a [u8; 64],
        token: &'a Token,
        lease: u64,
        retention: u64,
    },
    /// A new running record, as `SET NX` writes it (state `N` in the layout).
    New {
        fp: &'a [u8; 64],
        token: &'a Token,
        /// The TTL at or below which the lease has passed.
        threshold: u64,
        fence: u64,
    },
}

impl Arg<'_> {
    /// At most how many bytes the argument takes.
    pub(super) fn len(&self) -> usize {
        match self {
            Arg::Bytes(b) => b.len(),
            Arg::Millis(_) => 20,
            Arg::Key(prefix, _) => prefix.len() + 64,
            Arg::Acquire { .. } => ACQUIRE_ARG_LEN,
            Arg::New { .. } => RUNNING_LEN,
        }
    }
}

impl redis::ToRedisArgs for Arg<'_> {
    fn write_redis_args<W: ?Sized + redis::RedisWrite>(&self, out: &mut W) {
        use std::io::Write as _;
        // Writes into the command's `Vec<u8>`, which cannot fail.
        let _ = match self {
            Arg::Bytes(b) => {
                out.write_arg(b);
                Ok(())
            }
            Arg::Millis(ms) => write!(out.writer_for_next_arg(), "{ms}"),
            Arg::Key(prefix, key) => {
                let mut w = out.writer_for_next_arg();
                w.write_all(prefix.as_bytes()).and_then(|()| w.write_all(&crate::key::hex_array(key.as_bytes())))
            }
            // `millis` keeps both within their digits.
            Arg::Acquire { fp, token, lease, retention } => {
                let mut w = out.writer_for_next_arg();
                w.write_all(&fp[..]).and_then(|()| w.write_all(token.as_str().as_bytes())).and_then(|()| {
                    let (lease_len, retention_len) = (ARG_LEASE.len(), ARG_RETENTION.len());
                    write!(w, "{lease:0lease_len$}{retention:0retention_len$}")
                })
            }
            // Fences are microseconds of the clock, far below 10^20; attempt 1, not recovered.
            Arg::New { fp, token, threshold, fence } => {
                let mut w = out.writer_for_next_arg();
                w.write_all(&[NEW])
                    .and_then(|()| w.write_all(&fp[..]))
                    .and_then(|()| w.write_all(token.as_str().as_bytes()))
                    .and_then(|()| {
                        let (lease, fence_len, attempt) = (LEASE.len(), FENCE.len(), ATTEMPT.len());
                        write!(w, "{threshold:0lease$}{fence:0fence_len$}{:0attempt$}0", 1)
                    })
            }
        };
    }
}

#[cfg(test)]
mod tests {
    use super::super::layout::{FINGERPRINT, RECOVERED, STATE, TOKEN};
    use super::*;

    fn written(arg: Arg<'_>) -> Vec<u8> {
        let mut args = redis::ToRedisArgs::to_redis_args(&arg);
        assert_eq!(args.len(), 1);
        args.pop().unwrap()
    }

    #[test]
    fn records_and_arguments_are_laid_out_as_the_scripts_read_them() {
        let (fp, token) = ([b'f'; 64], Token::unique());
        let new = written(Arg::New { fp: &fp, token: &token, threshold: 7, fence: 1 << 52 });
        assert_eq!(new.len(), RUNNING_LEN);
        assert_eq!((new[STATE], &new[FINGERPRINT], &new[TOKEN]), (NEW, &fp[..], token.as_str().as_bytes()));
        let field = |range: std::ops::Range<usize>| std::str::from_utf8(&new[range]).unwrap().parse::<u64>().unwrap();
        assert_eq!((field(LEASE), field(FENCE), field(ATTEMPT), new[RECOVERED]), (7, 1 << 52, 1, b'0'));

        let acquire = written(Arg::Acquire { fp: &fp, token: &token, lease: 5, retention: millis(Duration::MAX) });
        assert_eq!(acquire.len(), ACQUIRE_ARG_LEN);
        let field =
            |range: std::ops::Range<usize>| std::str::from_utf8(&acquire[range]).unwrap().parse::<u64>().unwrap();
        assert_eq!((field(ARG_LEASE), field(ARG_RETENTION)), (5, millis(Duration::MAX)));
    }
}
