//! The start-up check of the server settings the guarantee depends on.

use std::fmt;

use deadpool_redis::redis::{self, Value};

use super::RedisStore;
use crate::error::Error;
use crate::store::Store;

/// A server setting that can break the exactly-once guarantee, as
/// [`RedisStore::preflight`] checks it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Risk {
    /// `maxmemory-policy` is not `noeviction`: under memory pressure Redis may evict a record
    /// and its operation would run again. Every record has a TTL, so the `volatile-*` policies
    /// evict records too.
    Eviction,
    /// Neither AOF (`appendonly no`) nor RDB snapshots (`save ""`): a restart forgets every
    /// record, and completed operations would run again.
    NoPersistence,
    /// The store waits for more replicas than are connected
    /// ([`RedisStoreBuilder::wait_for_replicas`](super::RedisStoreBuilder::wait_for_replicas)):
    /// every acquire fails closed until enough are back. Read from `INFO replication`.
    TooFewReplicas,
}

impl Risk {
    /// The settings this risk is read from, as `CONFIG GET` names them.
    fn settings(self) -> &'static str {
        match self {
            Risk::Eviction => "maxmemory-policy",
            Risk::NoPersistence => "appendonly and save",
            Risk::TooFewReplicas => "connected_slaves",
        }
    }

    /// How to make the server safe, live and across restarts.
    fn fix(self) -> &'static str {
        match self {
            Risk::Eviction => {
                "run `CONFIG SET maxmemory-policy noeviction` and put `maxmemory-policy noeviction` in redis.conf"
            }
            Risk::NoPersistence => {
                "run `CONFIG SET appendonly yes` and put `appendonly yes` (ideally with `appendfsync always`) \
                 in redis.conf, or enable RDB snapshots (`save 60 1000` in redis.conf)"
            }
            Risk::TooFewReplicas => {
                "start or reconnect replicas (`REPLICAOF` on each), or wait for as many replicas as the \
                 master keeps (`wait_for_replicas`)"
            }
        }
    }

    /// What a safe server has, said when the setting could not be read.
    fn safe(self) -> &'static str {
        match self {
            Risk::Eviction => "maxmemory-policy is noeviction",
            Risk::NoPersistence => "AOF or RDB snapshots are on",
            Risk::TooFewReplicas => "the master has as many replicas connected as the store waits for",
        }
    }
}

impl fmt::Display for Risk {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Risk::Eviction => "eviction",
            Risk::NoPersistence => "no persistence",
            Risk::TooFewReplicas => "too few replicas",
        })
    }
}

/// A setting [`RedisStore::preflight`] found to break the guarantee.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Problem {
    /// What the setting risks.
    pub risk: Risk,
    /// The value read (`volatile-lru`; `appendonly no, save ""`).
    pub value: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.risk {
            Risk::Eviction => write!(
                f,
                "maxmemory-policy is {}: under memory pressure Redis may evict a record and its operation \
                 would run again",
                self.value
            )?,
            Risk::NoPersistence => write!(
                f,
                "persistence is off ({}): a restart forgets every record and completed operations would \
                 run again",
                self.value
            )?,
            Risk::TooFewReplicas => write!(
                f,
                "the store waits for more replicas than are connected ({}): every acquire fails closed until \
                 enough are back",
                self.value
            )?,
        }
        write!(f, "; to fix it, {}", self.risk.fix())
    }
}

/// What [`RedisStore::preflight`] found, and which of its risks the application accepts.
///
/// [`ensure`](Self::ensure) turns the report into an error unless the server is safe: each
/// [`Risk`] it found (in [`problems`](Self::problems)), or could not rule out (in
/// [`unchecked`](Self::unchecked)), fails it unless accepted with
/// [`accept_risk`](Self::accept_risk).
///
/// ```no_run
/// use idempotent_core::{RedisStore, Risk};
///
/// # async fn start() -> Result<(), idempotent_core::Error> {
/// let store = RedisStore::connect("redis://127.0.0.1:6379").await?;
/// // Fails, saying what to change, when Redis may evict records or persists nothing.
/// store.preflight().await?.ensure()?;
///
/// // A deployment that accepts losing records on a restart says so.
/// store.preflight().await?.accept_risk(Risk::NoPersistence).ensure()?;
/// # Ok(()) }
/// ```
///
/// A setting that could not be read fails `ensure` too. Managed services usually refuse
/// `CONFIG`, and some default to an evicting `maxmemory-policy` (ElastiCache's default
/// parameter group has `volatile-lru`): a check that passed on what it cannot see would pass
/// exactly where the default is unsafe. Check the setting in the provider's console, then
/// accept the risk in code, where a reader sees that it was checked by hand.
#[must_use = "a preflight report fails nothing by itself: call `.ensure()?` on it"]
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Preflight {
    /// Settings that break the exactly-once guarantee.
    pub problems: Vec<Problem>,
    /// Risks that could not be ruled out, because their settings could not be read (`CONFIG`
    /// disabled or not permitted, as on managed Redis).
    pub unchecked: Vec<Risk>,
    /// The replicas connected to the master (`connected_slaves` of `INFO replication`; on a
    /// cluster, the fewest of any master); `None` when `INFO` could not be read.
    pub replicas: Option<u32>,
    /// Whether the store's connections use TLS (a `rediss://` URL; one ending in `#insecure`
    /// encrypts without checking the server's certificate); `None` for a store on the
    /// application's pool, whose URL the store does not know.
    pub tls: Option<bool>,
    accepted: Vec<Risk>,
    store: String,
}

impl Preflight {
    /// Accepts `risk`: [`ensure`](Self::ensure) no longer fails when the server has it, or when
    /// its settings could not be read. `ensure` still logs an accepted risk it meets, as a
    /// warning.
    pub fn accept_risk(mut self, risk: Risk) -> Self {
        if !self.accepted.contains(&risk) {
            self.accepted.push(risk);
        }
        self
    }

    /// Whether [`ensure`](Self::ensure) passes: every risk found or left unchecked is accepted.
    pub fn is_ok(&self) -> bool {
        self.refused().next().is_none()
    }

    /// `Ok` if the server is safe, but for accepted risks; otherwise [`Error::UnsafeStore`]
    /// names each setting, its value, and how to fix it or accept it.
    ///
    /// It borrows the report and returns nothing, so that `store.preflight().await?.ensure()?`
    /// leaves no unused report behind, and a report kept in a variable can still be logged.
    pub fn ensure(&self) -> Result<(), Error> {
        let mut detail = String::new();
        for (i, refused) in self.refused().enumerate() {
            use fmt::Write as _;
            let _ = match refused {
                Refused::Found(problem) => write!(
                    detail,
                    "{}{problem}; or accept the risk with `.accept_risk(Risk::{:?})`",
                    if i == 0 { "" } else { ". " },
                    problem.risk
                ),
                Refused::Unchecked(risk) => write!(
                    detail,
                    "{}{} could not be read (CONFIG GET refused, as on managed Redis): check in the \
                     provider's settings that {}, then accept the risk with `.accept_risk(Risk::{risk:?})`",
                    if i == 0 { "" } else { ". " },
                    risk.settings(),
                    risk.safe()
                ),
            };
        }
        if !detail.is_empty() {
            return Err(Error::UnsafeStore { store: self.store.clone(), detail });
        }
        let met = self.problems.iter().map(|p| p.risk).chain(self.unchecked.iter().copied());
        for risk in met {
            tracing::warn!(store = %self.store, %risk, "idempotent.redis: running with an accepted risk to the exactly-once guarantee");
        }
        Ok(())
    }

    /// The risks found or left unchecked that are not accepted.
    fn refused(&self) -> impl Iterator<Item = Refused<'_>> {
        let found = self.problems.iter().filter(|p| !self.accepted.contains(&p.risk)).map(Refused::Found);
        let unchecked = self.unchecked.iter().filter(|r| !self.accepted.contains(r)).map(|r| Refused::Unchecked(*r));
        found.chain(unchecked)
    }
}

enum Refused<'a> {
    Found(&'a Problem),
    Unchecked(Risk),
}

impl fmt::Display for Preflight {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.problems.is_empty() && self.unchecked.is_empty() {
            return f.write_str("Redis settings keep the guarantee");
        }
        let accepted = |risk: Risk| if self.accepted.contains(&risk) { " (accepted)" } else { "" };
        for p in &self.problems {
            writeln!(f, "problem{}: {p}", accepted(p.risk))?;
        }
        for &risk in &self.unchecked {
            writeln!(f, "unchecked{}: {} (CONFIG GET refused)", accepted(risk), risk.settings())?;
        }
        Ok(())
    }
}

impl RedisStore {
    /// Checks the server settings the guarantee depends on; call it at start-up, as
    /// `store.preflight().await?.ensure()?`.
    ///
    /// Reports `maxmemory-policy` other than `noeviction` ([`Risk::Eviction`]), a server
    /// that persists nothing ([`Risk::NoPersistence`]), and, for a store that waits for replicas,
    /// fewer replicas connected than it waits for ([`Risk::TooFewReplicas`]). Also says how many
    /// replicas are connected and whether the store uses TLS ([`Preflight::replicas`],
    /// [`Preflight::tls`]). The `Err` of this call is only a failure
    /// to reach the server: the findings are in the [`Preflight`], which fails nothing until
    /// [`Preflight::ensure`] is called. On a cluster, the node that answers `CONFIG GET` is
    /// checked for eviction and persistence, and every master for its replicas.
    pub async fn preflight(&self) -> Result<Preflight, Error> {
        let describe = self.describe();
        let tls = if describe.starts_with("redis (pool)") || describe.starts_with("redis cluster (pool)") {
            None
        } else {
            Some(describe.starts_with("rediss:"))
        };
        let mut report = Preflight {
            problems: Vec::new(),
            unchecked: Vec::new(),
            replicas: None,
            tls,
            accepted: Vec::new(),
            store: describe,
        };
        let policy = self.config_get("maxmemory-policy").await?;
        match policy {
            Some(policy) if policy == "noeviction" => {}
            Some(policy) => report.problems.push(Problem { risk: Risk::Eviction, value: policy }),
            None => report.unchecked.push(Risk::Eviction),
        }
        let aof = self.config_get("appendonly").await?;
        let save = self.config_get("save").await?;
        match (aof.as_deref(), save.as_deref()) {
            (Some("no"), Some("")) => {
                report.problems.push(Problem { risk: Risk::NoPersistence, value: "appendonly no, save \"\"".into() })
            }
            (None, _) | (_, None) => report.unchecked.push(Risk::NoPersistence),
            _ => {}
        }
        report.replicas = self.connected_replicas().await?;
        if let Some(wait) = &self.inner.wait {
            match report.replicas {
                Some(connected) if connected >= wait.replicas => {}
                Some(connected) => report.problems.push(Problem {
                    risk: Risk::TooFewReplicas,
                    value: format!("waits for {}, {connected} connected", wait.replicas),
                }),
                None => report.unchecked.push(Risk::TooFewReplicas),
            }
        }
        Ok(report)
    }

    /// `connected_slaves` of `INFO replication`: on a cluster, where every master answers, the
    /// fewest of any master; `None` when `INFO` is refused.
    async fn connected_replicas(&self) -> Result<Option<u32>, Error> {
        let mut cmd = redis::cmd("INFO");
        cmd.arg("replication");
        let count = |info: &str| -> Option<u32> {
            info.lines().find_map(|line| line.trim().strip_prefix("connected_slaves:")?.parse().ok())
        };
        match self.run("preflight", cmd).await {
            Ok(Value::Map(nodes)) => {
                let counts: Option<Vec<u32>> = nodes.iter().map(|(_, info)| count(&text(info)?)).collect();
                Ok(counts.and_then(|counts| counts.into_iter().min()))
            }
            Ok(value) => Ok(text(&value).and_then(|info| count(&info))),
            Err(Error::Unavailable { reason, source, .. }) if refused(&reason, source.as_deref()) => Ok(None),
            Err(e) => Err(e),
        }
    }

    async fn config_get(&self, name: &str) -> Result<Option<String>, Error> {
        let mut cmd = redis::cmd("CONFIG");
        cmd.arg("GET").arg(name);
        let value = self.run("preflight", cmd).await;
        match value {
            Ok(Value::Array(items)) | Ok(Value::Set(items)) => Ok(items.get(1).and_then(text)),
            Ok(Value::Map(pairs)) => Ok(pairs.first().and_then(|(_, v)| text(v))),
            Ok(_) => Ok(None),
            Err(Error::Unavailable { reason, source, .. }) if refused(&reason, source.as_deref()) => Ok(None),
            Err(e) => Err(e),
        }
    }
}

/// Whether the server refused `CONFIG`: renamed away (an unknown command) or not permitted to
/// this user (an ACL `NOPERM`, which the driver spells its own way).
fn refused(reason: &str, source: Option<&(dyn std::error::Error + Send + Sync + 'static)>) -> bool {
    let no_perm = source
        .and_then(|e| e.downcast_ref::<redis::RedisError>())
        .is_some_and(|e| e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoPerm));
    no_perm || reason.contains("unknown command") || reason.contains("NOPERM")
}

fn text(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        Value::SimpleString(s) => Some(s.clone()),
        Value::VerbatimString { text, .. } => Some(text.clone()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(problems: Vec<Problem>, unchecked: Vec<Risk>) -> Preflight {
        Preflight {
            problems,
            unchecked,
            replicas: Some(0),
            tls: Some(false),
            accepted: Vec::new(),
            store: "redis://h".into(),
        }
    }

    #[test]
    fn ensure_names_the_setting_its_value_and_the_fix() {
        let evicts = report(vec![Problem { risk: Risk::Eviction, value: "allkeys-lru".into() }], vec![]);
        let err = evicts.ensure().unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, Error::UnsafeStore { .. }), "{err}");
        for part in ["redis://h", "maxmemory-policy is allkeys-lru", "CONFIG SET maxmemory-policy noeviction"] {
            assert!(msg.contains(part), "{part:?} missing from: {msg}");
        }
        assert!(evicts.accept_risk(Risk::Eviction).ensure().is_ok());
    }

    #[test]
    fn an_unchecked_setting_fails_until_its_risk_is_accepted() {
        let blind = report(vec![], vec![Risk::Eviction, Risk::NoPersistence]);
        assert!(!blind.is_ok());
        let msg = blind.clone().accept_risk(Risk::Eviction).ensure().unwrap_err().to_string();
        assert!(msg.contains("appendonly and save could not be read") && !msg.contains("maxmemory"), "{msg}");
        let both = blind.accept_risk(Risk::Eviction).accept_risk(Risk::NoPersistence);
        assert!(both.is_ok());
        assert!(both.ensure().is_ok());
    }

    #[test]
    fn a_safe_server_passes() {
        let safe = report(vec![], vec![]);
        assert!(safe.is_ok());
        safe.ensure().unwrap();
    }
}
