//! Reading records as an operator sees them: `inspect` (the `read` script on one key) and
//! `scan` (`SCAN … MATCH <prefix>* COUNT n` on each node, then the `read` script on what it
//! found, pipelined). `release_fenced` and `delete` are one script each, in `store.rs`.
//!
//! A scan goes through the standalone server, or through the masters of a cluster one after
//! another, ordered by the first slot each serves (`CLUSTER SLOTS`, read again on every page:
//! after a failover the shard's new master goes on from the same `SCAN` position, which Redis
//! does not promise to mean the same there, so a record may then be listed twice or missed).
//! Its cursor says which node, where `SCAN` stands on it, and the keys a `SCAN` found that
//! passed the filter but did not fit in the page (a `SCAN` may answer more keys than asked
//! for, and cannot be resumed in the middle of an answer): `redis:<node>:<scan cursor or
//! end>:<key hex>,<key hex>…`. Each page sends at most [`ROUNDS`] `SCAN`s of `COUNT` the page's
//! limit (at least [`MIN_COUNT`]), and reads what they found.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use deadpool_redis::redis::{self, Value};

use super::RedisStore;
use super::arg::Arg;
use super::conn::Node;
use super::layout::{
    self, ATTEMPT, CREATED, DONE, FENCE, FINGERPRINT, LEASE, NEEDS_ATTENTION, NEW, RECOVERED, RELEASED, RUNNING, STATE,
    UPDATED,
};
use crate::error::Error;
use crate::key::{Fingerprint, Key};
use crate::store::admin::{Cursor, Filter, MAX_PAGE, Page, RecordInfo, RecordState};

/// The most `SCAN`s one page sends.
const ROUNDS: usize = 8;
/// The least `COUNT` a `SCAN` asks for.
const MIN_COUNT: usize = 16;
/// What every cursor of a Redis scan begins with.
const CURSOR_TAG: &str = "redis";

/// Where a scan stands (see the module docs for its text).
#[derive(Debug, PartialEq, Eq)]
struct Position {
    /// The node, in the scan's order.
    node: usize,
    /// The node's `SCAN` cursor; `None` once its `SCAN` is over.
    cursor: Option<u64>,
    /// Keys found on the node that passed the filter but were not listed yet.
    pending: Vec<Key>,
}

impl Position {
    fn start() -> Self {
        Position { node: 0, cursor: Some(0), pending: Vec::new() }
    }

    fn parse(cursor: &Cursor) -> Result<Self, Error> {
        if cursor.is_start() {
            return Ok(Position::start());
        }
        let text = cursor.as_str();
        let bad = || {
            Error::Config(format!(
                "`{text}` is not a cursor of a Redis store scan (redis:<node>:<scan cursor>:<keys>); start the scan \
                 again from Cursor::start()"
            ))
        };
        let mut parts = text.split(':');
        if parts.next() != Some(CURSOR_TAG) {
            return Err(bad());
        }
        let (Some(node), Some(at), Some(keys), None) = (parts.next(), parts.next(), parts.next(), parts.next()) else {
            return Err(bad());
        };
        let node = node.parse().map_err(|_| bad())?;
        let cursor = match at {
            "end" => None,
            at => Some(at.parse().map_err(|_| bad())?),
        };
        let pending = if keys.is_empty() {
            Vec::new()
        } else {
            keys.split(',').map(|k| Key::from_hex(k).ok_or_else(bad)).collect::<Result<_, _>>()?
        };
        Ok(Position { node, cursor, pending })
    }

    fn to_cursor(&self) -> Cursor {
        let at = self.cursor.map_or_else(|| "end".to_owned(), |c| c.to_string());
        let keys: Vec<String> = self.pending.iter().map(Key::to_hex).collect();
        Cursor::from_text(format!("{CURSOR_TAG}:{}:{at}:{}", self.node, keys.join(",")))
    }
}

impl RedisStore {
    /// [`Store::inspect`](crate::Store::inspect): the `read` script on the key.
    pub(super) async fn inspect_record(&self, key: &Key) -> Result<Option<RecordInfo>, Error> {
        let reply = self.invoke("inspect", &self.inner.scripts.read, key, &[]).await?;
        Ok(self.read_reply(key, reply)?.map(|(info, _)| info))
    }

    /// The record a `read` reply holds, and the server's clock it was read at; `None`: no
    /// record.
    fn read_reply(&self, key: &Key, reply: Value) -> Result<Option<(RecordInfo, SystemTime)>, Error> {
        let items = match reply {
            Value::Int(0) => return Ok(None),
            Value::Array(items) => items,
            other => return Err(Self::corrupt(key, format!("unexpected read reply {other:?}"))),
        };
        let parsed = match items.as_slice() {
            [Value::Int(now), Value::Int(pttl), Value::BulkString(head), Value::Int(result_len)] => {
                usize::try_from(*result_len).ok().and_then(|len| record_info(key, head, len, *now, *pttl))
            }
            _ => None,
        };
        match parsed {
            Some(info) => Ok(Some(info)),
            None => Err(Self::corrupt(key, "the key holds a string that is not a record")),
        }
    }

    /// [`Store::scan`](crate::Store::scan): one page (see the module docs).
    pub(super) async fn scan_page(&self, filter: &Filter, cursor: &Cursor, limit: usize) -> Result<Page, Error> {
        let mut pos = Position::parse(cursor)?;
        let limit = limit.clamp(1, MAX_PAGE);
        let nodes = self.scan_nodes().await?;
        if pos.node >= nodes.len() {
            return Err(Error::Config(format!(
                "the scan cursor `{}` names node {}, but the store has {} (a cursor of another store?); start the \
                 scan again from Cursor::start()",
                cursor.as_str(),
                pos.node,
                nodes.len()
            )));
        }
        let mut records = Vec::new();
        let mut rounds = 0;
        loop {
            if !pos.pending.is_empty() {
                let keys = std::mem::take(&mut pos.pending);
                let mut matched = self.read_matching(&nodes[pos.node], &keys, filter).await?;
                let room = limit - records.len();
                if matched.len() > room {
                    pos.pending = matched.split_off(room).into_iter().map(|r| r.key).collect();
                    records.append(&mut matched);
                    return Ok(Page::new(records, Some(pos.to_cursor())));
                }
                records.append(&mut matched);
            }
            if pos.cursor.is_none() {
                if pos.node + 1 == nodes.len() {
                    return Ok(Page::new(records, None));
                }
                pos = Position { node: pos.node + 1, cursor: Some(0), pending: Vec::new() };
            }
            let Some(at) = pos.cursor else { continue };
            if records.len() == limit || rounds == ROUNDS {
                return Ok(Page::new(records, Some(pos.to_cursor())));
            }
            rounds += 1;
            let (next, keys) = self.scan_node(&nodes[pos.node], at, limit.max(MIN_COUNT)).await?;
            pos.cursor = (next != 0).then_some(next);
            pos.pending = keys;
        }
    }

    /// The nodes a scan goes through: the server, or the cluster's masters ordered by the first
    /// slot each serves.
    async fn scan_nodes(&self) -> Result<Vec<Node>, Error> {
        if !self.is_cluster() {
            return Ok(vec![Node::Only]);
        }
        #[cfg(feature = "cluster")]
        {
            let mut cmd = redis::cmd("CLUSTER");
            cmd.arg("SLOTS");
            let reply = self.run("scan", cmd).await?;
            let unexpected = || Error::Unavailable {
                store: crate::store::Store::describe(self),
                op: "scan",
                reason: format!("unexpected CLUSTER SLOTS reply {reply:?}"),
                source: None,
            };
            let Value::Array(ranges) = &reply else { return Err(unexpected()) };
            // (first slot, host, port) of each master.
            let mut masters: Vec<(i64, String, u16)> = Vec::new();
            for range in ranges {
                let Value::Array(range) = range else { return Err(unexpected()) };
                let (Some(Value::Int(first)), Some(Value::Array(master))) = (range.first(), range.get(2)) else {
                    return Err(unexpected());
                };
                let (Some(host), Some(Value::Int(port))) = (master.first().and_then(text), master.get(1)) else {
                    return Err(unexpected());
                };
                let port = u16::try_from(*port).map_err(|_| unexpected())?;
                match masters.iter_mut().find(|(_, h, p)| *h == host && *p == port) {
                    Some(known) => known.0 = known.0.min(*first),
                    None => masters.push((*first, host, port)),
                }
            }
            if masters.is_empty() {
                return Err(unexpected());
            }
            masters.sort();
            Ok(masters.into_iter().map(|(_, host, port)| Node::Master { host, port }).collect())
        }
        #[cfg(not(feature = "cluster"))]
        unreachable!("a store without the cluster feature is never a cluster")
    }

    /// One `SCAN` of `node` from `at`: the next cursor, and the record keys found (keys under
    /// the prefix that are not `{prefix}{64 hex digits}` are left out).
    async fn scan_node(&self, node: &Node, at: u64, count: usize) -> Result<(u64, Vec<Key>), Error> {
        let mut pattern = String::with_capacity(self.inner.prefix.len() + 1);
        for c in self.inner.prefix.chars() {
            if matches!(c, '*' | '?' | '[' | ']' | '\\') {
                pattern.push('\\');
            }
            pattern.push(c);
        }
        pattern.push('*');
        let mut pipe = redis::Pipeline::with_capacity(1);
        pipe.cmd("SCAN").arg(at).arg("MATCH").arg(pattern).arg("COUNT").arg(count);
        let reply = self.on_node("scan", node, &pipe).await?.into_iter().next();
        let unexpected = |reply: &Option<Value>| Error::Unavailable {
            store: crate::store::Store::describe(self),
            op: "scan",
            reason: format!("unexpected SCAN reply {reply:?}"),
            source: None,
        };
        let Some(Value::Array(parts)) = &reply else { return Err(unexpected(&reply)) };
        let (Some(next), Some(Value::Array(found))) = (parts.first().and_then(text), parts.get(1)) else {
            return Err(unexpected(&reply));
        };
        let next = next.parse().map_err(|_| unexpected(&reply))?;
        let keys = found
            .iter()
            .filter_map(|k| match k {
                Value::BulkString(k) => k.strip_prefix(self.inner.prefix.as_bytes()),
                _ => None,
            })
            .filter_map(|hex| Key::from_hex(std::str::from_utf8(hex).ok()?))
            .collect();
        Ok((next, keys))
    }

    /// The records of `keys` (found on `node`) that pass `filter`, in the order of `keys`: the
    /// `read` script on each, pipelined behind one `SCRIPT LOAD` of it. A key whose read the
    /// node refuses (its slot moved away since the `SCAN`) is read again through the slot map;
    /// a key that holds no record of this store is logged and left out.
    async fn read_matching(&self, node: &Node, keys: &[Key], filter: &Filter) -> Result<Vec<RecordInfo>, Error> {
        let script = &self.inner.scripts.read;
        let mut pipe = redis::Pipeline::with_capacity(keys.len() + 1);
        pipe.cmd("SCRIPT").arg("LOAD").arg(super::source::READ);
        for key in keys {
            pipe.cmd("EVALSHA").arg(script.hash()).arg(1).arg(Arg::Key(&self.inner.prefix, key));
        }
        let replies = self.on_node("scan", node, &pipe).await?;
        if replies.len() != keys.len() + 1 {
            return Err(Error::Unavailable {
                store: crate::store::Store::describe(self),
                op: "scan",
                reason: format!("a pipeline of {} got {} replies", keys.len() + 1, replies.len()),
                source: None,
            });
        }
        let mut matched = Vec::new();
        for (key, reply) in keys.iter().zip(replies.into_iter().skip(1)) {
            let reply = match reply {
                Value::ServerError(e) if e.code() == "IDEMPOTENT_CORRUPT" => {
                    Err(Self::corrupt(key, e.details().unwrap_or_default().to_owned()))
                }
                Value::ServerError(_) => self.invoke("scan", script, key, &[]).await,
                reply => Ok(reply),
            };
            match reply.and_then(|reply| self.read_reply(key, reply)) {
                Ok(Some((info, now))) if filter.matches(&info, now) => matched.push(info),
                Ok(_) => {}
                Err(e @ Error::Corrupt { .. }) => {
                    tracing::warn!(key = %key.short(), error = %e, "idempotent.redis: scan left out a key that holds no record");
                }
                Err(e) => return Err(e),
            }
        }
        Ok(matched)
    }
}

/// A string reply's text.
fn text(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    }
}

/// Milliseconds of server time as a wall-clock time.
fn at_ms(ms: i64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(u64::try_from(ms).unwrap_or(0))
}

/// The record `head` (the record without its result, which is `result_len` bytes) read at
/// `now` (server ms) with `pttl`, or `None` when it is malformed.
fn record_info(key: &Key, head: &[u8], result_len: usize, now: i64, pttl: i64) -> Option<(RecordInfo, SystemTime)> {
    let state = *head.get(STATE)?;
    let fingerprint = Fingerprint::from_hex(std::str::from_utf8(head.get(FINGERPRINT)?).ok()?)?;
    let number = |range: std::ops::Range<usize>| head.get(range).and_then(layout::digits);
    let (fence, attempt) = (number(FENCE)?, number(ATTEMPT)?);
    let (created, updated) = (number(CREATED)?, number(UPDATED)?);
    let labels = layout::labels(head)?;
    let text = |b: &[u8]| std::str::from_utf8(b).ok().map(str::to_owned);
    let (state, lease_until, result_bytes) = match state {
        RUNNING => {
            let lease = i64::try_from(number(LEASE)?).ok()?;
            let state = if lease > now { RecordState::Running } else { RecordState::Stuck };
            (state, Some(at_ms(lease)), None)
        }
        NEW => {
            // The lease of a record SET NX wrote is live while its TTL is above the threshold.
            let threshold = i64::try_from(number(LEASE)?).ok()?;
            let left = if pttl >= 0 { pttl - threshold } else { 0 };
            let state = if left > 0 { RecordState::Running } else { RecordState::Stuck };
            (state, Some(at_ms(now + left)), None)
        }
        RELEASED if head.get(RECOVERED) == Some(&b'1') => (RecordState::Stuck, None, None),
        RELEASED => (RecordState::Released, None, None),
        NEEDS_ATTENTION => (RecordState::NeedsAttention, None, None),
        DONE => (RecordState::Done, None, Some(result_len)),
        _ => return None,
    };
    let expires = (state != RecordState::NeedsAttention && pttl >= 0).then(|| at_ms(now + pttl));
    let info = RecordInfo {
        key: *key,
        fingerprint,
        state,
        step: text(labels.step)?,
        run: match labels.run {
            Some(run) => Some(text(run)?),
            None => None,
        },
        tenant: match labels.tenant {
            Some(tenant) => Some(text(tenant)?),
            None => None,
        },
        attempt: u32::try_from(attempt).unwrap_or(u32::MAX),
        fence,
        created: at_ms(i64::try_from(created).ok()?),
        updated: at_ms(i64::try_from(updated).ok()?),
        lease_until,
        expires,
        result_bytes,
    };
    Some((info, at_ms(now)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursors_read_back_as_written() {
        let key = Key::from_bytes([9; 32]);
        for pos in [
            Position::start(),
            Position { node: 2, cursor: None, pending: vec![key, key] },
            Position { node: 0, cursor: Some(123), pending: Vec::new() },
        ] {
            let cursor = pos.to_cursor();
            assert_eq!(Position::parse(&cursor).unwrap(), pos, "{cursor:?}");
        }
        assert_eq!(Position::parse(&Cursor::start()).unwrap(), Position::start());
    }

    #[test]
    fn malformed_cursors_are_clear_errors() {
        for text in ["not a cursor", "redis:x:0:", "redis:0:0", "redis:0:-1:", "redis:0:0:abc", "redis:0:0::"] {
            let err = Position::parse(&Cursor::from_text(text)).unwrap_err();
            assert!(matches!(&err, Error::Config(m) if m.contains("cursor")), "{text}: {err}");
        }
    }
}
