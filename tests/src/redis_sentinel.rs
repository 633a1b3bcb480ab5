//! A throwaway Redis Sentinel setup ([`RedisSentinel`]): a master, its replica, and three
//! sentinels watching them, whose failovers a test can cause and wait for.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use idempotent_core::redis;

use crate::redis_server::text;
use crate::{INSTALL_HINT, RedisServer, free_port, require_binary, wait_until};

/// The name the sentinels monitor the master by.
pub const MASTER_NAME: &str = "mymaster";

/// How long a sentinel waits before it deems a silent master down (`down-after-milliseconds`).
pub const DOWN_AFTER: Duration = Duration::from_millis(1000);

/// Sentinel's `failover-timeout`: a sentinel starts no new failover of the master within twice
/// this of its last one, so it paces the harness' rounds.
const FAILOVER_TIMEOUT: Duration = Duration::from_millis(1500);

/// A master and a replica ([`RedisServer::start`], [`RedisServer::replica_of`]), and three
/// sentinels (`redis-server sentinel.conf --sentinel`, quorum 2), each on a free port in a
/// temporary directory of its own; everything is killed on drop.
#[derive(Debug)]
pub struct RedisSentinel {
    /// The two data nodes, in creation order; which one is the master changes with failovers
    /// (see [`master`](Self::master)).
    pub nodes: Vec<RedisServer>,
    sentinels: Vec<SentinelProcess>,
}

#[derive(Debug)]
struct SentinelProcess {
    child: Child,
    port: u16,
    dir: tempfile::TempDir,
}

impl SentinelProcess {
    fn start(master_port: u16) -> SentinelProcess {
        let dir = tempfile::Builder::new().prefix("idem-sentinel-").tempdir().expect("create a temp dir");
        let port = free_port(false);
        let conf = dir.path().join("sentinel.conf");
        let quorum = 2;
        std::fs::write(
            &conf,
            format!(
                "port {port}\nbind 127.0.0.1\nprotected-mode no\ndaemonize no\ndir {dir}\nlogfile {dir}/sentinel.log\n\
                 sentinel monitor {MASTER_NAME} 127.0.0.1 {master_port} {quorum}\n\
                 sentinel down-after-milliseconds {MASTER_NAME} {down}\n\
                 sentinel failover-timeout {MASTER_NAME} {failover}\n",
                dir = dir.path().display(),
                down = DOWN_AFTER.as_millis(),
                failover = FAILOVER_TIMEOUT.as_millis(),
            ),
        )
        .expect("write sentinel.conf");
        let child = Command::new(require_binary("redis-server"))
            .arg(&conf)
            .arg("--sentinel")
            .current_dir(dir.path())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("{INSTALL_HINT}: {e}"));
        let sentinel = SentinelProcess { child, port, dir };
        wait_until(Duration::from_secs(10), || sentinel.describe("to answer PING"), || sentinel.cmd(&["PING"]).is_ok());
        // Sentinel's periods (Redis 7.0+): the defaults (`INFO` to each node every 10 s, hellos
        // every 2 s) would make the harness wait seconds for what the sentinels learn by them:
        // each other, a rejoined replica, its link.
        let periods = ["info-period", "250", "publish-period", "250", "ping-period", "200", "ask-period", "250"];
        let debug = [&["SENTINEL", "DEBUG"][..], &periods[..]].concat();
        sentinel
            .cmd(&debug)
            .unwrap_or_else(|e| panic!("{}", sentinel.describe(&format!("refused SENTINEL DEBUG: {e}"))));
        sentinel
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    fn cmd(&self, args: &[&str]) -> Result<redis::Value, String> {
        crate::redis_server::try_cmd_at(&self.url(), args)
    }

    /// `SENTINEL MASTER`/`REPLICAS` entries as field maps.
    fn entries(&self, args: &[&str]) -> Vec<Vec<(String, String)>> {
        let fields = |v: &redis::Value| match v {
            redis::Value::Array(kv) => kv.chunks(2).map(|p| (text(&p[0]), text(&p[1]))).collect(),
            redis::Value::Map(kv) => kv.iter().map(|(k, v)| (text(k), text(v))).collect(),
            other => panic!("unexpected SENTINEL entry {other:?}"),
        };
        match self.cmd(args) {
            Ok(redis::Value::Array(items)) if items.iter().all(|i| matches!(i, redis::Value::Array(_))) => {
                items.iter().map(fields).collect()
            }
            Ok(one @ (redis::Value::Array(_) | redis::Value::Map(_))) => vec![fields(&one)],
            _ => Vec::new(),
        }
    }

    fn master_port(&self) -> Option<u16> {
        match self.cmd(&["SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER_NAME]) {
            Ok(redis::Value::Array(addr)) if addr.len() == 2 => text(&addr[1]).parse().ok(),
            _ => None,
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("sentinel.log")).unwrap_or_default()
    }

    fn describe(&self, what: &str) -> String {
        format!("sentinel on port {} {what}; its log:\n{}", self.port, self.log())
    }
}

impl Drop for SentinelProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn field<'a>(entry: &'a [(String, String)], name: &str) -> Option<&'a str> {
    entry.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
}

impl RedisSentinel {
    /// Starts the master, its replica (caught up) and three sentinels, and waits until every
    /// sentinel knows the other two and sees the replica up: a failover can happen from then on.
    pub fn start() -> RedisSentinel {
        let master = RedisServer::start();
        let replica = RedisServer::replica_of(&master);
        let sentinels = (0..3).map(|_| SentinelProcess::start(master.port())).collect();
        let setup = RedisSentinel { nodes: vec![master, replica], sentinels };
        setup.wait_ready();
        setup
    }

    /// The sentinels' `redis://` URLs.
    pub fn urls(&self) -> Vec<String> {
        self.sentinels.iter().map(SentinelProcess::url).collect()
    }

    /// The port of the master, as the sentinels name it (`SENTINEL GET-MASTER-ADDR-BY-NAME`);
    /// panics when they disagree or none answers.
    pub fn master_port(&self) -> u16 {
        let ports: Vec<Option<u16>> = self.sentinels.iter().map(SentinelProcess::master_port).collect();
        match ports[..] {
            [Some(p), ..] if ports.iter().all(|q| *q == Some(p)) => p,
            _ => panic!("the sentinels name masters {ports:?}"),
        }
    }

    /// The index in [`nodes`](Self::nodes) of the master the sentinels name.
    pub fn master(&self) -> usize {
        let port = self.master_port();
        self.nodes.iter().position(|n| n.port() == port).expect("the master is one of the nodes")
    }

    /// Kills the master (`kill -9`: what it had not sent to its replica is lost), waits until
    /// the sentinels have promoted the replica ([`wait_for_failover`](Self::wait_for_failover)),
    /// then starts the old master again (empty: no persistence) as the new master's replica and
    /// waits until the sentinels see it as one, ready for the next failover. Returns the index
    /// of the new master.
    pub fn failover_crash(&mut self) -> usize {
        let (old, new) = self.kill_master();
        self.nodes[old].restart();
        self.rejoin(old, new);
        new
    }

    /// Kills the master and waits for the promotion, leaving the old master down; returns the
    /// indices of the old and the new master. [`rejoin`](Self::rejoin) brings it back.
    pub fn kill_master(&mut self) -> (usize, usize) {
        let old = self.master();
        self.nodes[old].kill();
        let port = self.wait_for_failover(self.nodes[old].port());
        let new = self.nodes.iter().position(|n| n.port() == port).expect("the new master is one of the nodes");
        (old, new)
    }

    /// Makes node `old` (running: see [`RedisServer::restart`]) a replica of node `new`, and waits
    /// until the new master streams to it (a write it acknowledged to `WAIT`) and every sentinel
    /// lists it as a replica that is up. Unlike [`RedisServer::follow`] this does not wait for
    /// the offsets to meet, which they never do while clients write.
    pub fn rejoin(&self, old: usize, new: usize) {
        self.rejoin_quietly(old, new);
        self.wait_ready();
    }

    /// [`rejoin`](Self::rejoin) without waiting for the sentinels.
    fn rejoin_quietly(&self, old: usize, new: usize) {
        let (replica, master) = (&self.nodes[old], &self.nodes[new]);
        master.cmd(&["CONFIG", "SET", "repl-diskless-sync-delay", "0"]);
        replica.cmd(&["REPLICAOF", "127.0.0.1", &master.port().to_string()]);
        let mut conn = master.connection();
        let probe = format!("harness:replication-check:{}", replica.port());
        wait_until(
            Duration::from_secs(20),
            || format!("{} streaming to replica {}", master.port(), replica.port()),
            || {
                let _: () = redis::cmd("SET").arg(&probe).arg(1).query(&mut conn).unwrap();
                let acked: i64 = redis::cmd("WAIT").arg(1).arg(100).query(&mut conn).unwrap();
                acked >= 1
            },
        );
        let _: () = redis::cmd("DEL").arg(&probe).query(&mut conn).unwrap();
    }

    /// `SENTINEL FAILOVER` (a failover with the master alive, as for maintenance): waits until the
    /// sentinels name the replica, and the old master has turned into its replica, and returns
    /// the indices of the old and the new master.
    pub fn failover_forced(&self) -> (usize, usize) {
        let old = self.master();
        self.sentinels[0].cmd(&["SENTINEL", "FAILOVER", MASTER_NAME]).expect("SENTINEL FAILOVER");
        let port = self.wait_for_failover(self.nodes[old].port());
        let new = self.nodes.iter().position(|n| n.port() == port).expect("the new master is one of the nodes");
        self.wait_ready();
        (old, new)
    }

    /// The switch done by hand, behind the sentinels' back, as an operator might: the replica
    /// promoted (`REPLICAOF NO ONE`), the master demoted (`REPLICAOF`; its clients stay
    /// connected, which a sentinel's own demotion would have killed), then every sentinel told to
    /// monitor the new master instead (`SENTINEL REMOVE`, `MONITOR`). Returns the indices of the
    /// old and the new master.
    pub fn switch_by_hand(&self) -> (usize, usize) {
        let old = self.master();
        let new = 1 - old;
        self.nodes[old].wait_replicated();
        self.nodes[new].promote();
        self.rejoin_quietly(old, new);
        let port = self.nodes[new].port().to_string();
        let (down, failover) = (DOWN_AFTER.as_millis().to_string(), FAILOVER_TIMEOUT.as_millis().to_string());
        for s in &self.sentinels {
            let _ = s.cmd(&["SENTINEL", "REMOVE", MASTER_NAME]);
            s.cmd(&["SENTINEL", "MONITOR", MASTER_NAME, "127.0.0.1", &port, "2"]).expect("SENTINEL MONITOR");
            s.cmd(&["SENTINEL", "SET", MASTER_NAME, "down-after-milliseconds", &down, "failover-timeout", &failover])
                .expect("SENTINEL SET");
        }
        self.wait_ready();
        (old, new)
    }

    /// Waits until every sentinel names a master other than the one on `old_port`, the same
    /// one, and that node says it is a master (`ROLE`); returns its port. Panics with the
    /// sentinels' logs after 30 s.
    pub fn wait_for_failover(&self, old_port: u16) -> u16 {
        let mut port = old_port;
        wait_until(
            Duration::from_secs(30),
            || format!("a failover from port {old_port}; the sentinels' logs:\n{}", self.logs()),
            || {
                let ports: Vec<Option<u16>> = self.sentinels.iter().map(SentinelProcess::master_port).collect();
                match ports[..] {
                    [Some(p), ..] if p != old_port && ports.iter().all(|q| *q == Some(p)) => port = p,
                    _ => return false,
                }
                self.nodes.iter().any(|n| n.port() == port && n.role() == "master")
            },
        );
        port
    }

    /// Waits until every sentinel knows the two others, names the same master, and lists the
    /// other node as its replica, up and linked.
    fn wait_ready(&self) {
        wait_until(
            Duration::from_secs(30),
            || format!("the sentinels to agree and see the replica; their logs:\n{}", self.logs()),
            || {
                let Some(port) = self.sentinels[0].master_port() else { return false };
                self.sentinels.iter().all(|s| {
                    let master = s.entries(&["SENTINEL", "MASTER", MASTER_NAME]);
                    let replicas = s.entries(&["SENTINEL", "REPLICAS", MASTER_NAME]);
                    s.master_port() == Some(port)
                        && master.first().and_then(|m| field(m, "num-other-sentinels")) == Some("2")
                        && master.first().and_then(|m| field(m, "flags")) == Some("master")
                        && replicas.iter().any(|r| {
                            field(r, "port").and_then(|p| p.parse::<u16>().ok()) != Some(port)
                                && field(r, "flags") == Some("slave")
                                && field(r, "master-link-status") == Some("ok")
                                && field(r, "master-port").and_then(|p| p.parse::<u16>().ok()) == Some(port)
                        })
                })
            },
        );
    }

    /// Every sentinel's log (printed when a wait gives up).
    pub fn logs(&self) -> String {
        self.sentinels.iter().map(|s| format!("--- sentinel {} ---\n{}", s.port, s.log())).collect()
    }
}
