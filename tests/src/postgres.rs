//! Throwaway PostgreSQL servers: `initdb` once per machine into a template (copied for each
//! server), then `postgres` on a free loopback port with its socket, data and log in a temporary
//! directory of its own, killed when dropped. Never the machine's own server on 5432.
//!
//! The binaries are looked up on `PATH`, then in the newest `/usr/lib/postgresql/*/bin` (where
//! Debian's `postgresql` package puts them). When they are missing, starting a server panics with
//! how to install them: a PostgreSQL test never passes by skipping. `initdb` and `postgres`
//! refuse to run as root, so when the tests run as root the server runs as the user `postgres`
//! (which the Debian package creates), through `setpriv`. [`PgServer::start_tls`] starts one with
//! TLS on, its certificates made by [`pg_tls`](crate::pg_tls).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::pg_tls::TlsFiles;

const INSTALL_HINT: &str = "The PostgreSQL tests need the server binaries (initdb, postgres), found \
     neither on PATH nor in /usr/lib/postgresql/*/bin: install them with `sudo apt-get install -y postgresql` \
     (Debian/Ubuntu), `sudo dnf install postgresql-server` (Fedora) or `brew install postgresql` (macOS), then run \
     the tests again";

/// The server binaries and who runs them.
#[derive(Debug)]
struct Install {
    initdb: PathBuf,
    postgres: PathBuf,
    /// `(uid, gid)` to run as, when this process is root.
    run_as: Option<(u32, u32)>,
}

fn install() -> &'static Install {
    static INSTALL: OnceLock<Install> = OnceLock::new();
    INSTALL.get_or_init(|| {
        let dir = find_bin_dir().unwrap_or_else(|| panic!("{INSTALL_HINT}"));
        let run_as = (id(&["-u"]) == 0).then(|| {
            let (Some(uid), Some(gid)) = (try_id(&["-u", "postgres"]), try_id(&["-g", "postgres"])) else {
                panic!(
                    "the tests run as root, and initdb/postgres refuse to run as root: they run as the user \
                     `postgres`, which does not exist. Create it (`apt-get install -y postgresql` does, or `useradd \
                     --system postgres`), or run the tests as another user"
                )
            };
            Command::new("setpriv").arg("--version").output().unwrap_or_else(|e| {
                panic!(
                    "the tests run as root and start postgres as the user `postgres` with setpriv (util-linux), \
                     which did not run: {e}"
                )
            });
            (uid, gid)
        });
        Install { initdb: dir.join("initdb"), postgres: dir.join("postgres"), run_as }
    })
}

/// The directory holding `initdb` and `postgres`: the first on `PATH` that has both, else the
/// newest `/usr/lib/postgresql/<version>/bin`.
fn find_bin_dir() -> Option<PathBuf> {
    let has_both = |d: &Path| d.join("initdb").is_file() && d.join("postgres").is_file();
    let path = std::env::var_os("PATH").unwrap_or_default();
    if let Some(dir) = std::env::split_paths(&path).find(|d| has_both(d)) {
        return Some(dir);
    }
    let mut versions: Vec<(Vec<u32>, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let version = name.split('.').map(|p| p.parse::<u32>().ok()).collect::<Option<Vec<u32>>>()?;
            let bin = e.path().join("bin");
            has_both(&bin).then_some((version, bin))
        })
        .collect();
    versions.sort();
    versions.pop().map(|(_, bin)| bin)
}

fn try_id(args: &[&str]) -> Option<u32> {
    let out = Command::new("id").args(args).output().ok()?;
    if !out.status.success() {
        return None;
    }
    String::from_utf8_lossy(&out.stdout).trim().parse().ok()
}

fn id(args: &[&str]) -> u32 {
    try_id(args).unwrap_or_else(|| panic!("`id {}` failed", args.join(" ")))
}

/// A command that runs `program` as the server's user.
pub(crate) fn as_server_user(program: &Path) -> Command {
    match install().run_as {
        Some((uid, gid)) => {
            let mut cmd = Command::new("setpriv");
            cmd.arg(format!("--reuid={uid}")).arg(format!("--regid={gid}")).arg("--init-groups").arg("--").arg(program);
            cmd
        }
        None => Command::new(program),
    }
}

/// Makes `path` the server user's (when running as root).
pub(crate) fn hand_over(path: &Path) {
    if let Some((uid, gid)) = install().run_as {
        let status = Command::new("chown").arg("-R").arg(format!("{uid}:{gid}")).arg(path).status().expect("run chown");
        assert!(status.success(), "chown -R {uid}:{gid} {} failed", path.display());
    }
}

fn run(mut cmd: Command, what: &str) {
    let out = cmd.stdin(Stdio::null()).output().unwrap_or_else(|e| panic!("{what} did not start: {e}\n{INSTALL_HINT}"));
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A data directory made by `initdb`, shared by the tests of every process on the machine
/// (initdb takes a second or two; a copy takes a few ms). Made in a directory of its own and
/// renamed into place, so that it is whole whenever it exists.
fn template() -> &'static Path {
    static TEMPLATE: OnceLock<PathBuf> = OnceLock::new();
    TEMPLATE.get_or_init(|| {
        let install = install();
        let out = Command::new(&install.initdb).arg("--version").output().expect("run initdb --version");
        let version = String::from_utf8_lossy(&out.stdout).trim().replace(|c: char| !c.is_ascii_alphanumeric(), "_");
        let owner = install.run_as.map_or_else(|| id(&["-u"]), |(uid, _)| uid);
        let name = format!("idempotent-pg-template-{version}-{owner}-v1");
        let done = std::env::temp_dir().join(&name);
        if done.join("data").join("PG_VERSION").is_file() {
            return done;
        }
        let building = std::env::temp_dir().join(format!("{name}.{}-{}", std::process::id(), crate::unique("t")));
        std::fs::create_dir(&building).expect("create the template directory");
        hand_over(&building);
        let mut initdb = as_server_user(&install.initdb);
        initdb.current_dir(&building).arg("-D").arg(building.join("data")).args([
            "-A",
            "trust",
            "-U",
            "postgres",
            "-E",
            "UTF8",
            "--locale=C",
            "--no-sync",
        ]);
        run(initdb, "initdb");
        if std::fs::rename(&building, &done).is_err() {
            // Another process finished first: use its template.
            let _ = std::fs::remove_dir_all(&building);
            assert!(done.join("data").join("PG_VERSION").is_file(), "no template at {}", done.display());
        }
        done
    })
}

/// A `postgres` server process owned by a test.
#[derive(Debug)]
pub struct PgServer {
    child: Option<Child>,
    port: u16,
    dir: tempfile::TempDir,
    tls: Option<TlsFiles>,
}

impl PgServer {
    /// Starts a server on a copy of the template data directory and waits until it accepts
    /// connections.
    pub fn start() -> PgServer {
        Self::start_with(false)
    }

    /// [`start`](Self::start), with TLS on (`ssl = on`; plain connections are still accepted):
    /// its certificate, signed by the CA of [`tls`](Self::tls), names `localhost` and 127.0.0.1.
    /// It also listens on 127.0.0.2, an address of this host the certificate does not name.
    pub fn start_tls() -> PgServer {
        Self::start_with(true)
    }

    fn start_with(tls: bool) -> PgServer {
        let dir = tempfile::Builder::new().prefix("idem-pg-").tempdir().expect("create a temp dir");
        let tls = tls.then(|| crate::pg_tls::make(dir.path()));
        // The key file too: postgres reads it as its own user, and refuses it unless 0600.
        hand_over(dir.path());
        let mut copy = as_server_user(Path::new("cp"));
        copy.arg("-a").arg(template().join("data")).arg(dir.path().join("data"));
        run(copy, "copying the template data directory");
        let port = loop {
            let p = crate::free_port(false);
            if p != 5432 {
                break p;
            }
        };
        let mut server = PgServer { child: None, port, dir, tls };
        server.spawn();
        server
    }

    fn spawn(&mut self) {
        let log = std::fs::OpenOptions::new().create(true).append(true).open(self.log_path()).expect("open the log");
        let mut cmd = as_server_user(&install().postgres);
        cmd.current_dir(self.dir.path())
            .arg("-D")
            .arg(self.dir.path().join("data"))
            .arg("-p")
            .arg(self.port.to_string())
            .arg("-k")
            .arg(self.dir.path())
            .args(["-c", "fsync=on", "-c", "synchronous_commit=on"])
            .args(["-c", "max_connections=200", "-c", "shared_buffers=16MB", "-c", "logging_collector=off"])
            // Dynamic shared memory as files in the data directory, which goes with the server's
            // temporary directory: POSIX segments (the default) stay in /dev/shm after a server
            // killed with SIGKILL, hundreds per test run.
            .args(["-c", "dynamic_shared_memory_type=mmap"]);
        match &self.tls {
            Some(tls) => {
                cmd.args(["-c", "listen_addresses=127.0.0.1,127.0.0.2", "-c", "ssl=on"])
                    .arg("-c")
                    .arg(format!("ssl_cert_file={}", tls.cert.display()))
                    .arg("-c")
                    .arg(format!("ssl_key_file={}", tls.key.display()));
            }
            None => {
                cmd.args(["-c", "listen_addresses=127.0.0.1"]);
            }
        }
        cmd.stdin(Stdio::null()).stdout(log.try_clone().expect("clone the log handle")).stderr(log);
        self.child = Some(cmd.spawn().unwrap_or_else(|e| panic!("postgres did not start: {e}\n{INSTALL_HINT}")));
        self.wait_ready();
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("postgres.log")
    }

    /// The server's log so far (printed when a test gives up on the server).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    fn wait_ready(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(child) = self.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                panic!("postgres on port {} exited with {status}; its log:\n{}", self.port, self.log());
            }
            if accepts_connections(self.port) {
                return;
            }
            if Instant::now() > deadline {
                panic!(
                    "postgres on port {} did not accept a connection within 30 s; its log:\n{}",
                    self.port,
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The certificates of a server started with [`start_tls`](Self::start_tls).
    pub fn tls(&self) -> &TlsFiles {
        self.tls.as_ref().expect("the server was started with PgServer::start_tls")
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Its URL: user `postgres` (trust authentication), database `postgres`, over TCP.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// A plain sqlx connection, outside any store, for set-up and assertions.
    pub async fn connection(&self) -> sqlx::PgConnection {
        use sqlx::Connection;
        sqlx::PgConnection::connect(&self.url()).await.unwrap_or_else(|e| {
            panic!("cannot connect to postgres on port {}: {e}; its log:\n{}", self.port, self.log())
        })
    }

    /// The postmaster's pid.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("server is running").id()
    }

    /// The postmaster and its children (backends, checkpointer, writers …), postmaster first.
    fn processes(&self) -> Vec<u32> {
        let Some(child) = self.child.as_ref() else { return Vec::new() };
        let pid = child.id();
        let mut all = vec![pid];
        all.extend(children_of(pid));
        all
    }

    /// `kill -9` of the postmaster and every backend at once, as in a crash of the machine's
    /// database: nothing is shut down cleanly. Returns once they are all gone.
    pub fn kill9(&mut self) {
        let pids = self.processes();
        let Some(mut child) = self.child.take() else { return };
        signal(&pids, "KILL");
        // A stopped process dies of SIGKILL too; CONT is for kernels that wait.
        signal(&pids, "CONT");
        let _ = child.wait();
        let deadline = Instant::now() + Duration::from_secs(10);
        for pid in &pids[1..] {
            while is_alive(*pid) {
                assert!(Instant::now() < deadline, "backend {pid} outlived SIGKILL");
                std::thread::sleep(Duration::from_millis(5));
            }
        }
    }

    /// Starts the server again on the same data directory and port (after [`kill9`](Self::kill9),
    /// it recovers from its WAL first), and waits until it accepts connections.
    pub fn restart(&mut self) {
        self.kill9();
        self.spawn();
    }

    /// `SIGSTOP` to the postmaster and every backend: the server stops answering (connections
    /// and new connects hang) but keeps its sockets open.
    pub fn pause(&self) {
        signal(&self.processes(), "STOP");
    }

    /// `SIGCONT`: resumes a paused server.
    pub fn resume(&self) {
        signal(&self.processes(), "CONT");
    }
}

impl Drop for PgServer {
    fn drop(&mut self) {
        self.kill9();
    }
}

fn signal(pids: &[u32], sig: &str) {
    if pids.is_empty() {
        return;
    }
    // `unsafe_code` is forbidden in the workspace, so signals go through the `kill` command. A
    // backend may have exited since it was listed: kill's status is not checked.
    let _ = Command::new("kill")
        .arg(format!("-{sig}"))
        .args(pids.iter().map(u32::to_string))
        .stderr(Stdio::null())
        .status();
}

/// The pids whose parent is `parent`, read from `/proc`.
fn children_of(parent: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| stat(*pid).is_some_and(|(_, ppid)| ppid == parent))
        .collect()
}

/// The state letter and parent pid of a process, from `/proc/<pid>/stat`.
fn stat(pid: u32) -> Option<(char, u32)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // `pid (comm) state ppid …`; comm may hold spaces and parentheses.
    let rest = &text[text.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.chars().next()?;
    let ppid = fields.next()?.parse().ok()?;
    Some((state, ppid))
}

/// Alive: neither gone nor a zombie (a zombie holds no shared memory nor sockets).
fn is_alive(pid: u32) -> bool {
    stat(pid).is_some_and(|(state, _)| !matches!(state, 'Z' | 'X'))
}

/// Whether a server on `port` completes a startup handshake (trust authentication) up to
/// ReadyForQuery; while starting up or recovering it answers an error instead.
pub(crate) fn accepts_connections(port: u16) -> bool {
    let Ok(mut s) = TcpStream::connect_timeout(&([127, 0, 0, 1], port).into(), Duration::from_millis(200)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(1000)));
    let mut body = Vec::new();
    body.extend_from_slice(&196_608u32.to_be_bytes()); // protocol 3.0
    for part in ["user", "postgres", "database", "postgres", ""] {
        body.extend_from_slice(part.as_bytes());
        body.push(0);
    }
    let mut msg = ((body.len() + 4) as u32).to_be_bytes().to_vec();
    msg.extend_from_slice(&body);
    if s.write_all(&msg).is_err() {
        return false;
    }
    loop {
        let mut head = [0u8; 5];
        if s.read_exact(&mut head).is_err() {
            return false;
        }
        let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize;
        let mut rest = vec![0u8; len.saturating_sub(4)];
        if s.read_exact(&mut rest).is_err() {
            return false;
        }
        match head[0] {
            b'Z' => {
                let _ = s.write_all(&[b'X', 0, 0, 0, 4]);
                return true;
            }
            // AuthenticationOk, ParameterStatus, BackendKeyData, NoticeResponse.
            b'R' if rest.starts_with(&[0, 0, 0, 0]) => {}
            b'S' | b'K' | b'N' => {}
            _ => return false,
        }
    }
}
