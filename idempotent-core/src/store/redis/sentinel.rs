//! Redis Sentinel: where the store finds its master ([`Sentinel`]), and the
//! `redis+sentinel://` URL form of `store::connect`.
//!
//! No deadpool pool here: the store keeps its few connections in slots of its own (`conn.rs`)
//! and opens one only when a slot is empty (at first use, or after a connection failed). Each
//! opening asks the sentinels anew, so that a connection opened after a failover goes to the new
//! master, and none waits idle in a pool, pointed at a master that is gone. (deadpool-redis's
//! own sentinel pool would also open its connections with the driver's 500 ms response timeout,
//! which would cut calls short of the store's command timeout.)

use std::time::Duration;

use deadpool_redis::redis::aio::MultiplexedConnection;
use deadpool_redis::redis::sentinel::{SentinelClient, SentinelServerType};
use deadpool_redis::redis::{self, AsyncConnectionConfig};

use crate::error::Error;

/// The port a sentinel listens on when its URL names none.
const DEFAULT_PORT: u16 = 26379;

/// The sentinels of one master name, asked for its address on every connection the store opens.
pub(super) struct Sentinel {
    /// redis-rs's client needs `&mut` to ask (it caches its connections to the sentinels); the
    /// lock also makes concurrent refills of the store's slots wait for one another, so that a
    /// refill finds the slot filled by the one before instead of opening a connection more.
    client: tokio::sync::Mutex<SentinelClient>,
    config: AsyncConnectionConfig,
}

impl Sentinel {
    /// The sentinels at `urls`, watching `master`; connections to the master get `timeout` to
    /// connect and no response timeout of the driver's (the store's command timeout bounds them).
    pub(super) fn new(urls: &[String], master: &str, timeout: Duration) -> Result<Sentinel, Error> {
        if urls.is_empty() {
            return Err(Error::Config("no Redis Sentinel URL given: name at least one sentinel".into()));
        }
        if master.trim().is_empty() {
            return Err(Error::Config(
                "empty Redis Sentinel master name: give the name the sentinels monitor (`sentinel monitor <name> …`)"
                    .into(),
            ));
        }
        let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
        let client = SentinelClient::build(urls.clone(), String::from(master), None, SentinelServerType::Master)
            .map_err(|e| {
                Error::Config(format!(
                    "cannot use Redis Sentinel URLs {}: {e} (expected redis://host:port for each sentinel)",
                    urls_redacted(&urls)
                ))
            })?;
        let config = AsyncConnectionConfig::new().set_response_timeout(None).set_connection_timeout(Some(timeout));
        Ok(Sentinel { client: tokio::sync::Mutex::new(client), config })
    }

    /// Waits for the refills before this one to finish (see [`Sentinel::client`]); then
    /// [`Asking::connect`] connects to the master.
    pub(super) async fn lock(&self) -> Asking<'_> {
        Asking { client: self.client.lock().await, config: &self.config }
    }
}

/// The sentinels, held for one connection's opening.
pub(super) struct Asking<'a> {
    client: tokio::sync::MutexGuard<'a, SentinelClient>,
    config: &'a AsyncConnectionConfig,
}

impl Asking<'_> {
    /// Asks the sentinels for the master and connects to it. redis-rs takes the first master a
    /// sentinel names that this sentinel does not flag down and that answers `ROLE` as a master; when none
    /// does (the master is down and no replica promoted yet, or the one named was demoted), this
    /// fails, and so does the call.
    pub(super) async fn connect(&mut self) -> redis::RedisResult<MultiplexedConnection> {
        self.client.get_async_connection_with_config(self.config).await
    }
}

fn urls_redacted(urls: &[&str]) -> String {
    urls.iter().map(|u| super::redact::redact(u)).collect::<Vec<_>>().join(",")
}

/// `redis+sentinel://host1:port1,host2:port2/mymaster`: the sentinels' `redis://` URLs (port
/// 26379 when none is given) and the master's name. Credentials are refused in this form (it
/// could not say whose they are, the sentinels' or the master's).
pub(crate) fn parse_url(url: &str) -> Result<(Vec<String>, String), Error> {
    let bad = |why: &str| {
        Error::Config(format!(
            "cannot use {:?}: {why} (expected redis+sentinel://host1:port1,host2:port2/master-name)",
            super::redact::redact(url)
        ))
    };
    let rest = url.strip_prefix("redis+sentinel://").ok_or_else(|| bad("not a redis+sentinel:// URL"))?;
    let (hosts, master) = rest.split_once('/').ok_or_else(|| bad("no master name after the sentinels"))?;
    if hosts.contains('@') {
        return Err(bad("credentials are not supported in this form; use RedisStore::sentinel_builder"));
    }
    if master.is_empty() || master.contains(['/', '?', '#']) {
        return Err(bad("the path must be the master name alone"));
    }
    let mut sentinels = Vec::new();
    for host in hosts.split(',').map(str::trim).filter(|h| !h.is_empty()) {
        let has_port = host.rsplit_once(':').is_some_and(|(h, p)| !h.ends_with(':') && p.parse::<u16>().is_ok());
        sentinels.push(if has_port { format!("redis://{host}") } else { format!("redis://{host}:{DEFAULT_PORT}") });
    }
    if sentinels.is_empty() {
        return Err(bad("no sentinel named"));
    }
    Ok((sentinels, master.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sentinel_urls_parse() {
        let (urls, master) = parse_url("redis+sentinel://a:26380, b ,127.0.0.1:5000/mymaster").unwrap();
        assert_eq!(urls, ["redis://a:26380", "redis://b:26379", "redis://127.0.0.1:5000"]);
        assert_eq!(master, "mymaster");
        for bad in [
            "redis+sentinel://a:1",
            "redis+sentinel://a:1/",
            "redis+sentinel:///m",
            "redis+sentinel://u:pw@a:1/m",
            "redis+sentinel://a:1/m/0",
            "redis://a:1/m",
        ] {
            let err = parse_url(bad).expect_err(bad);
            assert!(matches!(&err, Error::Config(msg) if !msg.contains("pw")), "{bad}: {err}");
        }
    }

    #[test]
    fn bad_sentinel_settings_are_config_errors() {
        let err = |urls: &[&str], master: &str| {
            let urls: Vec<String> = urls.iter().map(|u| u.to_string()).collect();
            match Sentinel::new(&urls, master, Duration::from_secs(1)) {
                Err(Error::Config(msg)) => msg,
                Err(other) => panic!("expected a config error, got {other}"),
                Ok(_) => panic!("{urls:?} / {master:?} was accepted"),
            }
        };
        assert!(err(&[], "mymaster").contains("no Redis Sentinel URL"));
        assert!(err(&["redis://127.0.0.1:26379"], " ").contains("empty Redis Sentinel master name"));
        assert!(err(&["not a url"], "mymaster").contains("cannot use Redis Sentinel URLs"));
    }
}
