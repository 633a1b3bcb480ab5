//! The state protocol on [`RedisStore`]: one hash per scope, one Lua script per commit.
//!
//! A state lives under `{prefix}state:{scope digest in hex}` (the store's key prefix): a hash of
//! its version `v`, its value `d`, and its last [`REDIS_COMMIT_HISTORY`] commit tokens (`t:<token>` →
//! the version it produced, `s:<version mod history>` → the token, so that each commit drops the
//! oldest in O(1)); `commit.lua` documents the fields. One key per scope, so a commit never
//! crosses slots on Redis Cluster. A load is one `HMGET`; a commit one `EVALSHA` of
//! `commit.lua`, through the store's connections, command timeout and error mapping, followed by
//! its `WAIT` when the store waits for replicas. States have no TTL: they stay until deleted.

use std::sync::LazyLock;

use bytes::Bytes;
use deadpool_redis::redis::{self, Value};

use super::{Commit, CommitToken, Loaded, REDIS_COMMIT_HISTORY, Scope, StateStore, Version};
use crate::error::Error;
use crate::key::Key;
use crate::store::redis::script::Lua;
use crate::store::{BoxFuture, RedisStore, Store};

/// `commit.lua`.
static COMMIT: LazyLock<Lua> = LazyLock::new(|| Lua::script_only(include_str!("commit.lua")));

impl RedisStore {
    /// The Redis key that holds the state of `scope`.
    pub fn state_key(&self, scope: &Scope) -> String {
        let mut s = String::with_capacity(self.key_prefix().len() + 6 + 64);
        s.push_str(self.key_prefix());
        s.push_str("state:");
        crate::key::push_hex(&mut s, scope.digest());
        s
    }

    fn state_corrupt(scope: &Scope, detail: String) -> Error {
        Error::Corrupt {
            key: Key::from_bytes(*scope.digest()).short().to_string(),
            detail: format!("state {scope}: {detail}"),
        }
    }
}

fn version_of(scope: &Scope, v: &Value) -> Result<Version, Error> {
    let n = match v {
        Value::Int(n) => *n,
        Value::BulkString(b) => std::str::from_utf8(b).ok().and_then(|s| s.parse().ok()).unwrap_or(-1),
        Value::Nil => 0,
        other => return Err(RedisStore::state_corrupt(scope, format!("unexpected version {other:?}"))),
    };
    u64::try_from(n).map(Version::new).map_err(|_| RedisStore::state_corrupt(scope, format!("malformed version {v:?}")))
}

fn value_of(v: Value) -> Option<Bytes> {
    match v {
        Value::BulkString(b) => Some(Bytes::from(b)),
        _ => None,
    }
}

impl StateStore for RedisStore {
    fn load<'a>(&'a self, scope: &'a Scope) -> BoxFuture<'a, Result<Loaded<Bytes>, Error>> {
        Box::pin(async move {
            let mut cmd = redis::cmd("HMGET");
            cmd.arg(self.state_key(scope)).arg("v").arg("d");
            let key = Key::from_bytes(*scope.digest());
            let reply = self.state_call("state load", &key, &cmd, None, false).await?;
            let Value::Array(items) = reply else {
                return Err(Self::state_corrupt(scope, format!("unexpected HMGET reply {reply:?}")));
            };
            let mut items = items.into_iter();
            let (Some(v), Some(d)) = (items.next(), items.next()) else {
                return Err(Self::state_corrupt(scope, "HMGET answered fewer than two fields".into()));
            };
            let version = version_of(scope, &v)?;
            let value = value_of(d);
            if version.is_absent() != value.is_none() {
                return Err(Self::state_corrupt(scope, "the hash has a version without a value or back".into()));
            }
            Ok(Loaded { value, version })
        })
    }

    fn commit<'a>(
        &'a self,
        scope: &'a Scope,
        expected: Version,
        value: Bytes,
        token: &'a CommitToken,
    ) -> BoxFuture<'a, Result<Commit<Bytes>, Error>> {
        Box::pin(async move {
            let script = &*COMMIT;
            let mut cmd = redis::Cmd::with_capacity(8, 200 + value.len());
            cmd.arg("EVALSHA").arg(script.hash()).arg(1).arg(self.state_key(scope));
            cmd.arg(expected.get()).arg(token.to_hex()).arg(&value[..]).arg(REDIS_COMMIT_HISTORY);
            let key = Key::from_bytes(*scope.digest());
            let reply = self.state_call("state commit", &key, &cmd, Some(script), true).await?;
            let Value::Array(items) = reply else {
                return Err(Self::state_corrupt(scope, format!("unexpected commit reply {reply:?}")));
            };
            let mut items = items.into_iter();
            let (Some(Value::Int(code)), Some(v)) = (items.next(), items.next()) else {
                return Err(Self::state_corrupt(scope, "malformed commit reply".into()));
            };
            let version = version_of(scope, &v)?;
            match code {
                1 => Ok(Commit::Committed { version, replayed: false }),
                2 => Ok(Commit::Committed { version, replayed: true }),
                0 => Ok(Commit::Conflict { current: Loaded { value: items.next().and_then(value_of), version } }),
                other => Err(Self::state_corrupt(scope, format!("unexpected commit code {other}"))),
            }
        })
    }

    fn describe(&self) -> String {
        Store::describe(self)
    }

    fn commit_history(&self) -> u64 {
        REDIS_COMMIT_HISTORY
    }
}
