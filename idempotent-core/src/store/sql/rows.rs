//! Reading what the statements return: acquire's row ([`Found`]) and how it is judged, an admin
//! select's row ([`RecordInfo`]), and the labels an acquisition writes.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;

use crate::attempt::Attempt;
use crate::error::Error;
use crate::key::{Fingerprint, Key};
use crate::record::{Acquire, Grant, Labels, Token};
use crate::store::admin::{Cursor, Deleted, MAX_PAGE, Page, RecordInfo, RecordState};

/// The row an acquire statement returns, read out of the driver's row type.
pub struct Found {
    pub(crate) token: String,
    pub(crate) fingerprint: Vec<u8>,
    pub(crate) state: String,
    pub(crate) fence: i64,
    pub(crate) attempt: i64,
    /// Whether the attempt this row grants is recovered: set while running when the
    /// acquisition took over a lease that ran out, and on a released row when its release was
    /// uncertain (so the next acquisition is recovered). One meaning, read through both: "the
    /// next attempt on this row must treat the effect as possibly done".
    pub(crate) recovered: bool,
    /// µs until the lease deadline (meaningful for a running record of another attempt).
    pub(crate) left_us: i64,
    pub(crate) result: Option<Vec<u8>>,
}

impl Found {
    /// Whether a live row that another attempt's acquisition left decides an acquire with
    /// `fingerprint` by itself, with no write: another payload's (mismatch), done (replay),
    /// needing attention, or running on a lease that has not run out (in flight). Otherwise (a
    /// released row, or a lease that ran out) the key is free, and only the atomic upsert may
    /// take it.
    pub(crate) fn decides(&self, fingerprint: &Fingerprint) -> bool {
        self.fingerprint != fingerprint.as_bytes()
            || matches!(self.state.as_str(), "done" | "needs_attention")
            || (self.state == "running" && self.left_us > 0)
    }

    /// Tells the outcome of an acquire by `token` with `fingerprint` from the row it returned:
    /// ours, the key was taken; another's, the row says replay, in flight, needs attention or
    /// mismatch.
    pub(crate) fn judge(self, key: &Key, fingerprint: &Fingerprint, token: &Token) -> Result<Acquire, Error> {
        let corrupt = |detail: String| Error::Corrupt { key: key.short().to_string(), detail };
        let fence = || u64::try_from(self.fence).map_err(|_| corrupt(format!("negative fence {}", self.fence)));
        let attempt =
            || u32::try_from(self.attempt).map_err(|_| corrupt(format!("attempt {} out of range", self.attempt)));
        if self.token == token.as_str() {
            let (fence, attempt) = (fence()?, attempt()?);
            return Ok(Acquire::Acquired(Grant {
                token: token.clone(),
                attempt: Attempt::new(*key, fence, attempt, self.recovered),
            }));
        }
        if self.fingerprint != fingerprint.as_bytes() {
            return Ok(Acquire::Mismatch);
        }
        match self.state.as_str() {
            "done" => {
                let result = self.result.ok_or_else(|| corrupt("a done record without a result".to_owned()))?;
                Ok(Acquire::Replay(Bytes::from(result)))
            }
            "running" => {
                Ok(Acquire::InFlight { retry_after: Duration::from_micros(self.left_us.max(0).unsigned_abs()) })
            }
            "needs_attention" => Ok(Acquire::NeedsAttention { attempt: attempt()?, fence: fence()? }),
            other => Err(corrupt(format!("the record is {other:?} and another attempt's, yet was not taken"))),
        }
    }
}

/// Reads acquire's row out of the driver's row type; `recovered` reads column 5 (an integer on
/// SQLite, a boolean on PostgreSQL).
pub(crate) fn found_of<R: sqlx::Row>(
    key: &Key,
    row: &R,
    recovered: impl FnOnce(&R) -> Result<bool, sqlx::Error>,
) -> Result<Found, Error>
where
    usize: sqlx::ColumnIndex<R>,
    for<'r> Vec<u8>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    let get_err = |e: sqlx::Error| Error::Corrupt {
        key: key.short().to_string(),
        detail: format!("a column has the wrong type: {e}"),
    };
    Ok(Found {
        token: row.try_get(0).map_err(get_err)?,
        fingerprint: row.try_get(1).map_err(get_err)?,
        state: row.try_get(2).map_err(get_err)?,
        fence: row.try_get(3).map_err(get_err)?,
        attempt: row.try_get(4).map_err(get_err)?,
        recovered: recovered(row).map_err(get_err)?,
        left_us: row.try_get(6).map_err(get_err)?,
        result: row.try_get(7).map_err(get_err)?,
    })
}

/// A record as the admin statements return it, read out of the driver's row type (the columns
/// of [`AdminSql`]'s select, in order).
struct Info {
    key: Vec<u8>,
    fingerprint: Vec<u8>,
    state: String,
    step: String,
    run: Option<String>,
    tenant: Option<String>,
    attempt: i64,
    fence: i64,
    created_us: i64,
    updated_us: i64,
    lease_until_us: Option<i64>,
    expires_us: Option<i64>,
    result_bytes: Option<i64>,
}

/// Reads a row of an admin select into a [`RecordInfo`], or answers [`Error::Corrupt`].
pub(crate) fn read_record<R: sqlx::Row>(row: &R) -> Result<RecordInfo, Error>
where
    usize: sqlx::ColumnIndex<R>,
    for<'r> Vec<u8>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    let read = || -> Result<Info, sqlx::Error> {
        Ok(Info {
            key: row.try_get(0)?,
            fingerprint: row.try_get(1)?,
            state: row.try_get(2)?,
            step: row.try_get(3)?,
            run: row.try_get(4)?,
            tenant: row.try_get(5)?,
            attempt: row.try_get(6)?,
            fence: row.try_get(7)?,
            created_us: row.try_get(8)?,
            updated_us: row.try_get(9)?,
            lease_until_us: row.try_get(10)?,
            expires_us: row.try_get(11)?,
            result_bytes: row.try_get(12)?,
        })
    };
    let info = read().map_err(|e| {
        let key = row.try_get::<Vec<u8>, _>(0).ok().and_then(|k| <[u8; 32]>::try_from(k).ok());
        Error::Corrupt {
            key: key.map_or_else(|| "?".to_owned(), |k| Key::from_bytes(k).short().to_string()),
            detail: format!("a column has the wrong type: {e}"),
        }
    })?;
    info.into_info()
}

/// The page of a scan that asked for `limit` records and got `records`: a full page goes on
/// after its last key, a shorter one is the end.
pub(crate) fn page(records: Vec<RecordInfo>, limit: usize) -> Page {
    let next =
        (records.len() >= limit.clamp(1, MAX_PAGE)).then(|| records.last().map(|r| Cursor::from_text(r.key.to_hex())));
    Page::new(records, next.flatten())
}

/// The answer of `delete` from what its statement returned: no row, the key was absent; else
/// whether a live lease kept the row.
pub(crate) fn deleted(kept: Option<bool>) -> Deleted {
    match kept {
        None => Deleted::Absent,
        Some(true) => Deleted::Running,
        Some(false) => Deleted::Ok,
    }
}

/// An acquisition's [`Labels`], owned: an acquire's work may go on after its caller dropped it.
pub(crate) struct OwnedLabels {
    pub(crate) step: String,
    pub(crate) run: Option<String>,
    pub(crate) tenant: Option<String>,
}

impl From<Labels<'_>> for OwnedLabels {
    fn from(labels: Labels<'_>) -> Self {
        OwnedLabels {
            step: labels.step.to_owned(),
            run: labels.run.map(str::to_owned),
            tenant: labels.tenant.map(str::to_owned),
        }
    }
}

impl Info {
    /// The [`RecordInfo`] the row describes, or [`Error::Corrupt`] for values no store writes.
    fn into_info(self) -> Result<RecordInfo, Error> {
        let bytes32 = |v: &[u8]| <[u8; 32]>::try_from(v).ok();
        let key = bytes32(&self.key).map(Key::from_bytes).ok_or_else(|| Error::Corrupt {
            key: "?".to_owned(),
            detail: format!("a key of {} bytes", self.key.len()),
        })?;
        let corrupt = |detail: String| Error::Corrupt { key: key.short().to_string(), detail };
        let fingerprint = bytes32(&self.fingerprint)
            .map(Fingerprint::from_bytes)
            .ok_or_else(|| corrupt(format!("a fingerprint of {} bytes", self.fingerprint.len())))?;
        let state = self.state.parse::<RecordState>().map_err(corrupt)?;
        let attempt =
            u32::try_from(self.attempt).map_err(|_| corrupt(format!("attempt {} out of range", self.attempt)))?;
        let fence = u64::try_from(self.fence).map_err(|_| corrupt(format!("negative fence {}", self.fence)))?;
        let result_bytes = self
            .result_bytes
            .map(|n| usize::try_from(n).map_err(|_| corrupt(format!("a result of {n} bytes"))))
            .transpose()?;
        Ok(RecordInfo {
            key,
            fingerprint,
            state,
            step: self.step,
            run: self.run,
            tenant: self.tenant,
            attempt,
            fence,
            created: wall(self.created_us),
            updated: wall(self.updated_us),
            lease_until: self.lease_until_us.map(wall),
            expires: self.expires_us.map(wall),
            result_bytes,
        })
    }
}

/// µs since the Unix epoch as a wall-clock time (before the epoch reads as the epoch).
fn wall(us: i64) -> SystemTime {
    UNIX_EPOCH + Duration::from_micros(us.max(0).unsigned_abs())
}
