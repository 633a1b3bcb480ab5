//! Certificates for a throwaway PostgreSQL server over TLS ([`PgServer::start_tls`](crate::PgServer::start_tls)),
//! made with the `openssl` command ([`Authority`]): a CA, a server certificate it signs for `localhost` and
//! 127.0.0.1 (and no other name), and a second CA that signs nothing, for the tests that must
//! be refused.

use std::path::{Path, PathBuf};

use crate::tls::Authority;

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

/// Makes the CA, the server's certificate and key (for `localhost` and 127.0.0.1), and the wrong
/// CA in `dir`.
pub fn make(dir: &Path) -> TlsFiles {
    let ca = Authority::new(dir, "ca");
    let wrong_ca = Authority::new(dir, "wrong-ca");
    let (cert, key) = ca.server_cert_for(dir, "server", "DNS:localhost,IP:127.0.0.1");
    // postgres refuses a key file others can read.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).expect("chmod 0600 server.key");
    TlsFiles { ca: ca.cert().to_owned(), wrong_ca: wrong_ca.cert().to_owned(), cert, key }
}
