//! Certificates of a test's own, made with the `openssl` command (installed with PostgreSQL): a CA and a
//! server certificate it signed for `127.0.0.1` and `localhost`, in a directory the server may read.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::path::PathBuf;
use std::process::{Command, Stdio};

pub struct Certificates {
    dir: tempfile::TempDir,
}

impl Certificates {
    /// A new CA and a server certificate. As root the files are given to `postgres`, whom a
    /// [`PgCluster`](crate::postgres::PgCluster) runs as: PostgreSQL reads a key only its owner may read.
    pub fn new() -> Certificates {
        let dir = tempfile::Builder::new().prefix("outbox-tls-").tempdir().unwrap();
        let at = |name: &str| dir.path().join(name).display().to_string();
        std::fs::write(
            at("server.ext"),
            "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\n\
             extendedKeyUsage=serverAuth\nsubjectAltName=IP:127.0.0.1,DNS:localhost\n",
        )
        .unwrap();
        let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"];
        let (ca, ca_key, key, csr) = (at("ca.pem"), at("ca.key"), at("server.key"), at("server.csr"));
        openssl(
            &[&["req", "-x509"][..], &ec, &["-keyout", &ca_key, "-out", &ca, "-subj", "/CN=outbox test CA"]].concat(),
        );
        openssl(&[&["req"][..], &ec, &["-keyout", &key, "-out", &csr, "-subj", "/CN=localhost"]].concat());
        let ext = at("server.ext");
        openssl(&[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            &ca,
            "-CAkey",
            &ca_key,
            "-CAcreateserial",
            "-extfile",
            &ext,
            "-out",
            &at("server.pem"),
        ]);
        if crate::postgres::is_root() {
            let status = Command::new("chown").args(["-R", "postgres:", &at("")]).status().unwrap();
            assert!(status.success(), "chown of {} to postgres failed", dir.path().display());
        }
        let status = Command::new("chmod").args(["0600", &at("server.key")]).status().unwrap();
        assert!(status.success());
        Certificates { dir }
    }

    /// The CA's certificate, for a client that should trust the server.
    pub fn ca(&self) -> PathBuf {
        self.dir.path().join("ca.pem")
    }

    /// The server's settings for a [`PgCluster`](crate::postgres::PgCluster): TLS on, with this certificate.
    pub fn postgres_settings(&self) -> Vec<(&'static str, String)> {
        let at = |name: &str| self.dir.path().join(name).display().to_string();
        vec![("ssl", "on".into()), ("ssl_cert_file", at("server.pem")), ("ssl_key_file", at("server.key"))]
    }
}

impl Default for Certificates {
    fn default() -> Self {
        Self::new()
    }
}

fn openssl(args: &[&str]) {
    let output = Command::new("openssl")
        .args(args)
        .args(["-days", "2"])
        .stdin(Stdio::null())
        .output()
        .expect("openssl (package openssl, which PostgreSQL's packages install)");
    assert!(output.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&output.stderr));
}
