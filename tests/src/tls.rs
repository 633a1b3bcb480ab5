//! TLS material for throwaway servers, made with the `openssl` command: a certificate authority
//! and a server certificate it signed, valid for the name `localhost` only (not for `127.0.0.1`),
//! so that a test can connect with full verification (`localhost`), with the wrong name
//! (`127.0.0.1`) or against another authority ([`Authority::new`] again).

use std::path::{Path, PathBuf};
use std::process::Command;

/// The name the server certificates are valid for.
pub const SERVER_NAME: &str = "localhost";

/// A certificate authority in a directory: `<name>.pem` (its certificate) and `<name>.key`.
#[derive(Debug, Clone)]
pub struct Authority {
    cert: PathBuf,
    key: PathBuf,
}

impl Authority {
    /// A new authority named `name`, its files in `dir`.
    pub fn new(dir: &Path, name: &str) -> Authority {
        let (cert, key) = (dir.join(format!("{name}.pem")), dir.join(format!("{name}.key")));
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
                "-subj",
            ],
            &[&format!("/CN={name}"), "-keyout", path(&key), "-out", path(&cert)],
        );
        Authority { cert, key }
    }

    /// The authority's certificate (PEM): what a client trusts.
    pub fn cert(&self) -> &Path {
        &self.cert
    }

    /// The certificate's PEM text.
    pub fn pem(&self) -> Vec<u8> {
        std::fs::read(&self.cert).expect("read the authority's certificate")
    }

    /// Signs a server certificate for [`SERVER_NAME`] only; writes `<name>.pem` and `<name>.key`
    /// in `dir` and returns their paths (certificate, key).
    pub fn server_cert(&self, dir: &Path, name: &str) -> (PathBuf, PathBuf) {
        self.server_cert_for(dir, name, &format!("DNS:{SERVER_NAME}"))
    }

    /// Signs a server certificate for the names `alt_names` lists (`subjectAltName`, as
    /// `DNS:localhost,IP:127.0.0.1`), as [`server_cert`](Self::server_cert) does.
    pub fn server_cert_for(&self, dir: &Path, name: &str, alt_names: &str) -> (PathBuf, PathBuf) {
        let (cert, key, csr, ext) = (
            dir.join(format!("{name}.pem")),
            dir.join(format!("{name}.key")),
            dir.join(format!("{name}.csr")),
            dir.join(format!("{name}.ext")),
        );
        openssl(
            dir,
            &["req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-subj"],
            &[&format!("/CN={SERVER_NAME}"), "-keyout", path(&key), "-out", path(&csr)],
        );
        std::fs::write(
            &ext,
            format!("subjectAltName={alt_names}\nextendedKeyUsage=serverAuth\nbasicConstraints=CA:FALSE\n"),
        )
        .expect("write the extensions file");
        openssl(
            dir,
            &["x509", "-req", "-days", "1", "-CAcreateserial"],
            &[
                "-in",
                path(&csr),
                "-CA",
                path(&self.cert),
                "-CAkey",
                path(&self.key),
                "-extfile",
                path(&ext),
                "-out",
                path(&cert),
            ],
        );
        (cert, key)
    }
}

fn path(p: &Path) -> &str {
    p.to_str().expect("a UTF-8 temp path")
}

fn openssl(dir: &Path, args: &[&str], more: &[&str]) {
    let out = Command::new("openssl")
        .current_dir(dir)
        .args(args)
        .args(more)
        .output()
        .unwrap_or_else(|e| panic!("the TLS tests need the openssl command (apt-get install -y openssl): {e}"));
    assert!(out.status.success(), "openssl {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
}
