//! Certificates for a throwaway PostgreSQL server over TLS ([`PgServer::start_tls`](crate::PgServer::start_tls)),
//! made with the `openssl` command: a CA, a server certificate it signs for `localhost` and
//! 127.0.0.1 (and no other name), and a second CA that signs nothing, for the tests that must
//! be refused.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

const INSTALL_HINT: &str = "The PostgreSQL TLS tests make their certificates with the `openssl` command, which \
     did not run: install it with `sudo apt-get install -y openssl` (Debian/Ubuntu), `sudo dnf install openssl` \
     (Fedora) or `brew install openssl` (macOS), then run the tests again";

/// The files of a server's TLS set-up, in its directory.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    /// The CA that signed the server's certificate (for `sslrootcert`).
    pub ca: PathBuf,
    /// A CA that signed nothing the server shows.
    pub wrong_ca: PathBuf,
    /// The server's certificate (`ssl_cert_file`), for `localhost` and 127.0.0.1.
    pub cert: PathBuf,
    /// Its key (`ssl_key_file`), mode 0600.
    pub key: PathBuf,
}

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .current_dir(dir)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("{INSTALL_HINT} ({e})"));
    assert!(
        out.status.success(),
        "openssl {} failed ({}):\n{}",
        args.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A self-signed CA `name`.crt / `name`.key in `dir` (P-256, one day).
fn ca(dir: &Path, name: &str) {
    let (key, crt, subj) = (format!("{name}.key"), format!("{name}.crt"), format!("/CN=idempotent test {name}"));
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-days",
            "1",
            "-keyout",
            &key,
            "-out",
            &crt,
            "-subj",
            &subj,
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
        ],
    );
}

/// Makes the CA, the server's certificate and key, and the wrong CA in `dir`.
pub fn make(dir: &Path) -> TlsFiles {
    ca(dir, "ca");
    ca(dir, "wrong-ca");
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            "server.key",
            "-out",
            "server.csr",
            "-subj",
            "/CN=localhost",
        ],
    );
    std::fs::write(
        dir.join("server.ext"),
        "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\nbasicConstraints=CA:FALSE\n",
    )
    .expect("write server.ext");
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "1",
            "-out",
            "server.crt",
            "-extfile",
            "server.ext",
        ],
    );
    let key = dir.join("server.key");
    // postgres refuses a key file others can read.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).expect("chmod 0600 server.key");
    TlsFiles { ca: dir.join("ca.crt"), wrong_ca: dir.join("wrong-ca.crt"), cert: dir.join("server.crt"), key }
}
