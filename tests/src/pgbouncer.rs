//! A throwaway PgBouncer in front of a [`PgServer`]: `pool_mode = transaction` on a free
//! loopback port, trust authentication (the user `postgres`, as the server has it), its
//! configuration and log in a temporary directory of its own, killed when dropped. Every
//! database name is passed through to the server (`* = …`), so that a test can make a database
//! of its own.
//!
//! `pgbouncer` is looked up on `PATH`, then as `/usr/sbin/pgbouncer` (Debian's package). When
//! it is missing, starting one panics with how to install it: a test never passes by skipping.
//! PgBouncer refuses to run as root, so as root it runs as the user `postgres`, like the
//! server.

use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use crate::PgServer;
use crate::postgres::{accepts_connections, as_server_user, hand_over};

const INSTALL_HINT: &str = "The PgBouncer tests need `pgbouncer`, found neither on PATH nor as \
     /usr/sbin/pgbouncer: install it with `sudo apt-get install -y pgbouncer` (Debian/Ubuntu), `sudo dnf install \
     pgbouncer` (Fedora) or `brew install pgbouncer` (macOS), then run the tests again";

/// Server connections PgBouncer keeps per database and user: few, so that the clients of a test
/// share them, and a transaction may land on any of them.
pub const POOL_SIZE: u32 = 3;

fn binary() -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|d| d.join("pgbouncer"))
        .chain([PathBuf::from("/usr/sbin/pgbouncer")])
        .find(|p| p.is_file())
        .unwrap_or_else(|| panic!("{INSTALL_HINT}"))
}

/// A `pgbouncer` process owned by a test, in front of a server it does not own.
#[derive(Debug)]
pub struct PgBouncer {
    child: Child,
    port: u16,
    dir: tempfile::TempDir,
}

impl PgBouncer {
    /// Starts PgBouncer in front of `server` and waits until a client gets through it to the
    /// server.
    pub fn start(server: &PgServer) -> PgBouncer {
        let dir = tempfile::Builder::new().prefix("idem-pgbouncer-").tempdir().expect("create a temp dir");
        let port = loop {
            let p = crate::free_port(false);
            if p != 5432 && p != 6432 {
                break p;
            }
        };
        let d = dir.path().display();
        let config = format!(
            "[databases]\n\
             * = host=127.0.0.1 port={server}\n\
             [pgbouncer]\n\
             listen_addr = 127.0.0.1\n\
             listen_port = {port}\n\
             unix_socket_dir =\n\
             auth_type = trust\n\
             auth_file = {d}/userlist.txt\n\
             pool_mode = transaction\n\
             default_pool_size = {POOL_SIZE}\n\
             max_client_conn = 500\n\
             logfile = {d}/pgbouncer.log\n\
             pidfile = {d}/pgbouncer.pid\n",
            server = server.port(),
        );
        std::fs::write(dir.path().join("pgbouncer.ini"), config).expect("write pgbouncer.ini");
        std::fs::write(dir.path().join("userlist.txt"), "\"postgres\" \"\"\n").expect("write userlist.txt");
        hand_over(dir.path());
        let mut cmd = as_server_user(&binary());
        cmd.arg(dir.path().join("pgbouncer.ini")).stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null());
        let child = cmd.spawn().unwrap_or_else(|e| panic!("pgbouncer did not start: {e}\n{INSTALL_HINT}"));
        let mut bouncer = PgBouncer { child, port, dir };
        bouncer.wait_ready();
        bouncer
    }

    fn wait_ready(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("pgbouncer on port {} exited with {status}; its log:\n{}", self.port, self.log());
            }
            if accepts_connections(self.port) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "pgbouncer on port {} let no client through within 30 s; its log:\n{}",
                self.port,
                self.log()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Its log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("pgbouncer.log")).unwrap_or_default()
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The URL of `database` through it: user `postgres`, over TCP.
    pub fn url(&self, database: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{database}", self.port)
    }

    /// Its directory (configuration and log).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
