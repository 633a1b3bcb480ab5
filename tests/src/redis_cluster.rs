//! A throwaway Redis Cluster of [`RedisServer`] nodes.

use std::collections::BTreeSet;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use idempotent_core::redis;

use crate::{require_binary, wait_until};

use crate::redis_server::text;
use crate::{Flavor, RedisOptions, RedisServer};

/// A Redis Cluster made with `redis-cli --cluster create`: three masters, with no replicas
/// ([`start`](Self::start)) or one replica each ([`start_with_replicas`](Self::start_with_replicas)),
/// whose masters can be failed over cleanly or by a crash.
#[derive(Debug)]
pub struct RedisCluster {
    /// The nodes, in creation order (roles change with failovers: see [`masters`](Self::masters)).
    pub nodes: Vec<RedisServer>,
}

/// How long a replicated cluster's nodes wait before they deem a silent node failed
/// (`cluster-node-timeout`): a crash failover takes about twice this.
pub const CLUSTER_NODE_TIMEOUT: Duration = Duration::from_millis(1000);

impl RedisCluster {
    /// Starts three cluster nodes, assigns the slots and waits until every node reports
    /// `cluster_state:ok`.
    pub fn start() -> RedisCluster {
        Self::start_flavor(Flavor::Redis)
    }

    /// [`start`](Self::start), with nodes of `flavor`.
    pub fn start_flavor(flavor: Flavor) -> RedisCluster {
        Self::create(3, 0, RedisOptions { cluster: true, flavor, ..Default::default() })
    }

    /// Starts six cluster nodes, three masters with one replica each (`--cluster-replicas 1`),
    /// and waits until the cluster is ok and every replica has caught up with its master.
    /// Nodes deem a silent node failed after [`CLUSTER_NODE_TIMEOUT`].
    pub fn start_with_replicas() -> RedisCluster {
        Self::start_with_replicas_flavor(Flavor::Redis)
    }

    /// [`start_with_replicas`](Self::start_with_replicas), with nodes of `flavor`.
    pub fn start_with_replicas_flavor(flavor: Flavor) -> RedisCluster {
        let ms = CLUSTER_NODE_TIMEOUT.as_millis().to_string();
        // A full copy to a new or restarted replica starts at once, not after the default 5 s.
        let extra = vec![("cluster-node-timeout".into(), ms), ("repl-diskless-sync-delay".into(), "0".into())];
        let options = RedisOptions { cluster: true, extra, flavor, ..Default::default() };
        let cluster = Self::create(6, 1, options);
        cluster.wait_healthy();
        for m in cluster.masters() {
            cluster.nodes[m].wait_replicated();
        }
        cluster
    }

    fn create(count: usize, replicas: usize, options: RedisOptions) -> RedisCluster {
        let nodes: Vec<RedisServer> = (0..count).map(|_| RedisServer::start_with(options.clone())).collect();
        let cli = require_binary("redis-cli");
        let addrs: Vec<String> = nodes.iter().map(|n| format!("127.0.0.1:{}", n.port())).collect();
        let out = Command::new(cli)
            .arg("--cluster")
            .arg("create")
            .args(&addrs)
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .expect("run redis-cli --cluster create");
        assert!(
            out.status.success(),
            "redis-cli --cluster create failed: {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let deadline = Instant::now() + Duration::from_secs(20);
        for node in &nodes {
            loop {
                let info: String = redis::cmd("CLUSTER").arg("INFO").query(&mut node.connection()).unwrap();
                if info.contains("cluster_state:ok") {
                    break;
                }
                assert!(Instant::now() < deadline, "cluster did not reach state ok:\n{info}\n{}", node.log());
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        RedisCluster { nodes }
    }

    /// The nodes' `redis://` URLs.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    /// How many keys each node holds (`DBSIZE`), in the order of [`nodes`](Self::nodes).
    pub fn keys_per_node(&self) -> Vec<i64> {
        self.nodes
            .iter()
            .map(|n| match n.cmd(&["DBSIZE"]) {
                idempotent_core::redis::Value::Int(k) => k,
                other => panic!("DBSIZE answered {other:?}"),
            })
            .collect()
    }

    /// The indices in [`nodes`](Self::nodes) of the running nodes that are masters now.
    pub fn masters(&self) -> Vec<usize> {
        (0..self.nodes.len()).filter(|&i| self.nodes[i].is_running() && self.nodes[i].role() == "master").collect()
    }

    /// The index of the node that replicates master `master`.
    pub fn replica_of(&self, master: usize) -> usize {
        let mut ports = Vec::new();
        wait_until(
            Duration::from_secs(20),
            || format!("a replica connected to node {master}"),
            || {
                ports = self.nodes[master].replica_ports();
                !ports.is_empty()
            },
        );
        self.nodes.iter().position(|n| n.port() == ports[0]).expect("the replica is one of the cluster's nodes")
    }

    /// A clean failover of master `master`: `CLUSTER FAILOVER` on its replica, which waits for
    /// the replica to catch up, then swaps the roles. Waits until the cluster is healthy again
    /// and returns the index of the new master.
    pub fn failover_clean(&self, master: usize) -> usize {
        let replica = self.replica_of(master);
        self.nodes[replica].cmd(&["CLUSTER", "FAILOVER"]);
        wait_until(
            Duration::from_secs(20),
            || format!("node {replica} to take over from node {master}"),
            || self.nodes[replica].role() == "master" && self.nodes[master].role() == "slave",
        );
        self.wait_healthy();
        replica
    }

    /// A crash failover of master `master`: `kill -9` (what it acknowledged but had not sent
    /// to its replica is lost), then the cluster deems it failed and promotes its replica; once
    /// that happened the old master is started again (empty, no persistence), rejoins as the new
    /// master's replica and copies its data. Waits until the cluster is healthy again and
    /// returns the index of the new master.
    pub fn failover_crash(&mut self, master: usize) -> usize {
        let replica = self.replica_of(master);
        self.nodes[master].kill();
        wait_until(
            Duration::from_secs(30),
            || format!("the cluster to promote node {replica} after node {master} crashed"),
            || self.nodes[replica].role() == "master",
        );
        self.nodes[master].spawn();
        wait_until(
            Duration::from_secs(30),
            || format!("node {master} to rejoin as a replica of node {replica}"),
            || {
                self.nodes[master].role() == "slave"
                    && self.nodes[master].info("replication").contains("master_link_status:up")
            },
        );
        self.wait_healthy();
        replica
    }

    /// A failover of master `master` cut off from the cluster: `SIGSTOP` (as a long pause or a
    /// partition would), the cluster promotes its replica, then `SIGCONT`. Resumed, the old
    /// master still believes it owns its slots until the gossip it missed reaches it, and may
    /// take writes from clients meanwhile, which it then drops to copy the new master's data:
    /// the classic way Redis Cluster loses acknowledged writes. Waits until the cluster is
    /// healthy again and returns the index of the new master.
    pub fn failover_pause(&mut self, master: usize) -> usize {
        let replica = self.replica_of(master);
        self.nodes[master].pause();
        wait_until(
            Duration::from_secs(30),
            || format!("the cluster to promote node {replica} while node {master} is paused"),
            || self.nodes[replica].role() == "master",
        );
        self.nodes[master].resume();
        wait_until(
            Duration::from_secs(30),
            || format!("node {master} to turn into a replica of node {replica}"),
            || {
                self.nodes[master].role() == "slave"
                    && self.nodes[master].info("replication").contains("master_link_status:up")
            },
        );
        self.wait_healthy();
        replica
    }

    /// Waits until every running node reports `cluster_state:ok`, every master has a replica
    /// whose link is up, and every node's `CLUSTER NODES` names the same masters.
    pub fn wait_healthy(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let Err(why) = self.health() else { return };
            assert!(Instant::now() < deadline, "the cluster did not heal within 30 s: {why}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn health(&self) -> Result<(), String> {
        let masters: BTreeSet<u16> = self.masters().into_iter().map(|i| self.nodes[i].port()).collect();
        let replicated = self.nodes.len() > 3;
        for node in self.nodes.iter().filter(|n| n.is_running()) {
            let info = text(&node.try_cmd(&["CLUSTER", "INFO"])?);
            if !info.contains("cluster_state:ok") {
                return Err(format!("node {} reports {info}", node.port()));
            }
            let view = text(&node.try_cmd(&["CLUSTER", "NODES"])?);
            // `<id> <ip:port@bus> <flags> <master> …`; flags like `myself,master` or `slave`.
            let seen: BTreeSet<u16> = view
                .lines()
                .filter_map(|l| {
                    let mut f = l.split(' ');
                    let addr = f.nth(1)?;
                    let flags = f.next()?;
                    (flags.split(',').any(|x| x == "master") && !flags.contains("fail"))
                        .then(|| addr.split(['@', ':']).nth(1)?.parse().ok())
                        .flatten()
                })
                .collect();
            if seen != masters {
                return Err(format!("node {} sees masters {seen:?}, ROLE says {masters:?}", node.port()));
            }
            if replicated && node.role() == "slave" && !node.info("replication").contains("master_link_status:up") {
                return Err(format!("replica {} has no link to its master", node.port()));
            }
        }
        if replicated && let Some(m) = self.masters().into_iter().find(|&m| self.nodes[m].replica_ports().is_empty()) {
            return Err(format!("master {} has no replica", self.nodes[m].port()));
        }
        Ok(())
    }
}
