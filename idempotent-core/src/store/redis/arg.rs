//! The arguments the store sends, each written straight into the command's buffer (no `String`
//! per argument), and the milliseconds the scripts take.

use std::time::Duration;

use deadpool_redis::redis;

use super::layout::{
    ACQUIRE_ARG_MIN_LEN, ARG_FINGERPRINT, ARG_LABELS, ARG_LEASE, ARG_RETENTION, ARG_TOKEN, ATTEMPT, CREATED, DONE,
    FENCE, FINGERPRINT, HEADER_LEN, LEASE, MAX_LABEL_LEN, NEW, RECOVERED, RUN_LEN, RUN_SET, STATE, STEP_LEN,
    TENANT_LEN, TENANT_SET, TOKEN, UPDATED,
};
use crate::error::Error;
use crate::key::Key;
use crate::record::{Labels, Token};

/// Refuses labels a record cannot hold (each at most [`MAX_LABEL_LEN`] bytes).
pub(super) fn check_labels(labels: &Labels<'_>) -> Result<(), Error> {
    let named = [("step name", Some(labels.step)), ("run id", labels.run), ("tenant", labels.tenant)];
    for (what, label) in named {
        if let Some(label) = label.filter(|l| l.len() > MAX_LABEL_LEN) {
            return Err(Error::Config(format!(
                "the {what} is {} bytes; a Redis record holds labels of at most {MAX_LABEL_LEN} bytes each: \
                 shorten it",
                label.len()
            )));
        }
    }
    Ok(())
}

/// The labels' text, in bytes.
fn text_len(labels: &Labels<'_>) -> usize {
    labels.step.len() + labels.run.map_or(0, str::len) + labels.tenant.map_or(0, str::len)
}

/// Writes `n` in decimal into the whole of `field`, zero-padded. The callers' numbers fit their
/// fields: `millis` bounds the durations, [`MAX_FENCE`](super::layout::MAX_FENCE) the fences.
fn put_digits(field: &mut [u8], mut n: u64) {
    for digit in field.iter_mut().rev() {
        *digit = b'0' + (n % 10) as u8;
        n /= 10;
    }
    debug_assert_eq!(n, 0, "a number wider than its field");
}

/// The labels section's head as a record holds it (lengths, then flags); the text follows.
fn labels_head(labels: &Labels<'_>) -> [u8; LABELS_HEAD_LEN] {
    let at = |i: usize| i - STEP_LEN.start;
    let mut head = [0; LABELS_HEAD_LEN];
    put_digits(&mut head[at(STEP_LEN.start)..at(STEP_LEN.end)], labels.step.len() as u64);
    put_digits(&mut head[at(RUN_LEN.start)..at(RUN_LEN.end)], labels.run.map_or(0, str::len) as u64);
    put_digits(&mut head[at(TENANT_LEN.start)..at(TENANT_LEN.end)], labels.tenant.map_or(0, str::len) as u64);
    head[at(RUN_SET)] = if labels.run.is_some() { b'1' } else { b'0' };
    head[at(TENANT_SET)] = if labels.tenant.is_some() { b'1' } else { b'0' };
    head
}

/// The labels section's head: the fixed-width part of a record from [`STEP_LEN`] on.
const LABELS_HEAD_LEN: usize = HEADER_LEN - STEP_LEN.start;

/// Writes `fixed` (an argument's fixed-width part, ending with its labels' head), then the
/// labels' text: four writes into the command's buffer.
fn write_with_labels(w: &mut impl std::io::Write, fixed: &[u8], labels: &Labels<'_>) -> std::io::Result<()> {
    w.write_all(fixed)?;
    w.write_all(labels.step.as_bytes())?;
    w.write_all(labels.run.unwrap_or("").as_bytes())?;
    w.write_all(labels.tenant.unwrap_or("").as_bytes())
}

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
    /// A time for a record (milliseconds of the server's clock, as many digits as the record's
    /// times hold), or nothing: the script then reads the server's clock.
    Time(Option<u64>),
    /// The record's Redis key: the store's prefix, then the key in hex (as `redis_key`).
    Key(&'a str, &'a Key),
    /// `acquire`'s one argument: fingerprint, token, lease and retention in digits, then the
    /// labels (`ARG_*` in the layout). The labels were checked ([`check_labels`]).
    Acquire {
        fp: &'a [u8; 64],
        token: &'a Token,
        lease: u64,
        retention: u64,
        labels: &'a Labels<'a>,
    },
    /// A new running record, as `SET NX` writes it (state `N` in the layout), created at the
    /// estimate of the server's clock its fence is (in milliseconds).
    New {
        fp: &'a [u8; 64],
        token: &'a Token,
        /// The TTL at or below which the lease has passed.
        threshold: u64,
        fence: u64,
        labels: &'a Labels<'a>,
    },
    /// The done record a completion writes over `running` (the record the holder wrote), as the
    /// `complete` script builds it: state `C`, the fingerprint to the creation time kept, the
    /// update time, the labels, then the result.
    Done {
        running: &'a [u8],
        updated: u64,
        result: &'a [u8],
    },
}

impl Arg<'_> {
    /// At most how many bytes the argument takes.
    pub(super) fn len(&self) -> usize {
        match self {
            Arg::Bytes(b) => b.len(),
            Arg::Millis(_) => 20,
            Arg::Time(_) => UPDATED.len(),
            Arg::Key(prefix, _) => prefix.len() + 64,
            Arg::Acquire { labels, .. } => ACQUIRE_ARG_MIN_LEN + text_len(labels),
            Arg::New { labels, .. } => HEADER_LEN + text_len(labels),
            Arg::Done { running, result, .. } => running.len() + result.len(),
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
            Arg::Millis(ms) => {
                out.write_arg(itoa::Buffer::new().format(*ms).as_bytes());
                Ok(())
            }
            Arg::Time(None) => {
                out.write_arg(b"");
                Ok(())
            }
            Arg::Time(Some(ms)) => {
                let mut time = [0; UPDATED.end - UPDATED.start];
                put_digits(&mut time, *ms);
                out.write_arg(&time);
                Ok(())
            }
            Arg::Key(prefix, key) => {
                let mut w = out.writer_for_next_arg();
                w.write_all(prefix.as_bytes()).and_then(|()| w.write_all(&crate::key::hex_array(key.as_bytes())))
            }
            // `millis` keeps both within their digits.
            Arg::Acquire { fp, token, lease, retention, labels } => {
                let mut fixed = [0; ACQUIRE_ARG_MIN_LEN];
                fixed[ARG_FINGERPRINT].copy_from_slice(&fp[..]);
                fixed[ARG_TOKEN].copy_from_slice(token.as_str().as_bytes());
                put_digits(&mut fixed[ARG_LEASE], *lease);
                put_digits(&mut fixed[ARG_RETENTION], *retention);
                fixed[ARG_LABELS].copy_from_slice(&labels_head(labels));
                write_with_labels(&mut out.writer_for_next_arg(), &fixed, labels)
            }
            Arg::New { fp, token, threshold, fence, labels } => write_with_labels(
                &mut out.writer_for_next_arg(),
                &new_fixed(fp, token, *threshold, *fence, labels),
                labels,
            ),
            Arg::Done { running, updated, result } => {
                let mut w = out.writer_for_next_arg();
                let mut time = [0; UPDATED.end - UPDATED.start];
                put_digits(&mut time, *updated);
                w.write_all(&[DONE])
                    .and_then(|()| w.write_all(&running[FINGERPRINT.start..CREATED.end]))
                    .and_then(|()| w.write_all(&time))
                    .and_then(|()| w.write_all(&running[STEP_LEN.start..]))
                    .and_then(|()| w.write_all(result))
            }
        };
    }
}

/// A new running record's fixed-width part, as `SET NX` writes it (state `N`): fences are
/// microseconds of the clock, far below 10^20; attempt 1, not recovered; created and updated at
/// the fence's estimate of the server's clock.
fn new_fixed(fp: &[u8; 64], token: &Token, threshold: u64, fence: u64, labels: &Labels<'_>) -> [u8; HEADER_LEN] {
    let mut fixed = [0; HEADER_LEN];
    fixed[STATE] = NEW;
    fixed[FINGERPRINT].copy_from_slice(&fp[..]);
    fixed[TOKEN].copy_from_slice(token.as_str().as_bytes());
    put_digits(&mut fixed[LEASE], threshold);
    put_digits(&mut fixed[FENCE], fence);
    put_digits(&mut fixed[ATTEMPT], 1);
    fixed[RECOVERED] = b'0';
    put_digits(&mut fixed[CREATED], fence / 1000);
    put_digits(&mut fixed[UPDATED], fence / 1000);
    fixed[STEP_LEN.start..].copy_from_slice(&labels_head(labels));
    fixed
}

impl Arg<'_> {
    /// The bytes of an [`Arg::New`] record, to send and keep (see `native.rs`).
    pub(super) fn new_record(fp: &[u8; 64], token: &Token, threshold: u64, fence: u64, labels: &Labels<'_>) -> Vec<u8> {
        let mut record = Vec::with_capacity(HEADER_LEN + text_len(labels));
        // Writing into a `Vec` cannot fail.
        let _ = write_with_labels(&mut record, &new_fixed(fp, token, threshold, fence, labels), labels);
        record
    }
}

#[cfg(test)]
mod tests {
    use super::super::layout;
    use super::*;

    fn written(arg: Arg<'_>) -> Vec<u8> {
        let mut args = redis::ToRedisArgs::to_redis_args(&arg);
        assert_eq!(args.len(), 1);
        args.pop().unwrap()
    }

    #[test]
    fn records_and_arguments_are_laid_out_as_the_scripts_read_them() {
        let (fp, token) = ([b'f'; 64], Token::unique());
        let labels = Labels::step("charge").run("run-1").tenant(Some("acme"));
        let new = written(Arg::New { fp: &fp, token: &token, threshold: 7, fence: 1 << 52, labels: &labels });
        assert_eq!(new.len(), Arg::New { fp: &fp, token: &token, threshold: 7, fence: 1, labels: &labels }.len());
        assert_eq!((new[STATE], &new[FINGERPRINT], &new[TOKEN]), (NEW, &fp[..], token.as_str().as_bytes()));
        let field = |range: std::ops::Range<usize>| std::str::from_utf8(&new[range]).unwrap().parse::<u64>().unwrap();
        assert_eq!((field(LEASE), field(FENCE), field(ATTEMPT), new[RECOVERED]), (7, 1 << 52, 1, b'0'));
        assert_eq!((field(CREATED), field(UPDATED)), ((1 << 52) / 1000, (1 << 52) / 1000));
        assert!(layout::running_shape(&new));
        let read = layout::labels(&new).unwrap();
        assert_eq!((read.step, read.run, read.tenant), (&b"charge"[..], Some(&b"run-1"[..]), Some(&b"acme"[..])));
        assert_eq!(Arg::new_record(&fp, &token, 7, 1 << 52, &labels), new, "kept as sent");
        let done = written(Arg::Done { running: &new, updated: 1_700_000_000_123, result: b"re_1" });
        assert_eq!(done.len(), Arg::Done { running: &new, updated: 0, result: b"re_1" }.len());
        assert_eq!((done[STATE], &done[FINGERPRINT.start..CREATED.end]), (DONE, &new[FINGERPRINT.start..CREATED.end]));
        assert_eq!(&done[UPDATED], b"001700000000123");
        let result = layout::result_start(&done).expect("a done record");
        assert_eq!(&done[result..], b"re_1");
        assert_eq!(layout::labels(&done).unwrap().step, &b"charge"[..]);

        let none = Labels::default();
        let acquire =
            written(Arg::Acquire { fp: &fp, token: &token, lease: 5, retention: millis(Duration::MAX), labels: &none });
        assert_eq!(acquire.len(), ACQUIRE_ARG_MIN_LEN);
        assert_eq!(&acquire[ARG_LABELS], layout::NO_LABELS.as_bytes());
        let field =
            |range: std::ops::Range<usize>| std::str::from_utf8(&acquire[range]).unwrap().parse::<u64>().unwrap();
        assert_eq!((field(ARG_LEASE), field(ARG_RETENTION)), (5, millis(Duration::MAX)));
        assert_eq!(written(Arg::Time(Some(1_700_000_000_123))), b"001700000000123");
        assert_eq!(written(Arg::Time(None)), b"");
        assert_eq!(written(Arg::Millis(86_400_000)), b"86400000");
        let long = "x".repeat(MAX_LABEL_LEN + 1);
        let err = check_labels(&Labels::step("s").tenant(Some(&long))).unwrap_err().to_string();
        assert!(err.contains("tenant") && err.contains("99999"), "{err}");
    }
}
