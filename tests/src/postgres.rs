//! A PostgreSQL cluster of a test's own: `initdb` in a temporary directory, a free loopback port, the
//! settings the test needs (say, `max_connections` for hundreds of instances), stopped when dropped.
//! The machine's PostgreSQL binaries are used (`/usr/lib/postgresql/<version>/bin`, the newest); as root,
//! the server runs as the `postgres` user, since PostgreSQL refuses to run as root.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::nats::free_port;

pub struct PgCluster {
    pub port: u16,
    dir: tempfile::TempDir,
    bin: PathBuf,
    /// Whether the server's commands run as `postgres` (this process is root).
    as_postgres: bool,
}

/// The newest installed server's binaries.
fn bin() -> PathBuf {
    let mut versions: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .expect("PostgreSQL's server binaries are not installed (/usr/lib/postgresql)")
        .filter_map(|e| e.ok().map(|e| e.path().join("bin")))
        .filter(|p| p.join("initdb").exists())
        .collect();
    versions.sort_by_key(|p| p.parent().and_then(|v| v.file_name()?.to_str()?.parse::<u32>().ok()));
    versions.pop().expect("no initdb under /usr/lib/postgresql/*/bin")
}

/// Whether this process runs as root (a server it starts then runs as `postgres`).
pub(crate) fn is_root() -> bool {
    Command::new("id").arg("-u").output().is_ok_and(|o| o.stdout.starts_with(b"0\n"))
}

/// Runs a server binary, as `postgres` if asked.
fn run(bin: &Path, as_postgres: bool, program: &str, args: &[&str]) {
    let program = bin.join(program);
    let mut command = if as_postgres {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(&program);
        c
    } else {
        Command::new(&program)
    };
    let status = command.args(args).stdout(Stdio::null()).status().unwrap();
    assert!(status.success(), "{} {args:?} failed: {status}", program.display());
}

impl PgCluster {
    /// Starts a new cluster with `settings` (`name=value`) on top of trust authentication.
    pub fn start(settings: &[(&str, &str)]) -> PgCluster {
        let (bin, as_postgres) = (bin(), is_root());
        let dir = tempfile::Builder::new().prefix("outbox-pg-").tempdir().unwrap();
        if as_postgres {
            let status = Command::new("chown").args(["postgres:", &dir.path().display().to_string()]).status().unwrap();
            assert!(status.success(), "chown of {} to postgres failed", dir.path().display());
        }
        let data = dir.path().join("data").display().to_string();
        run(&bin, as_postgres, "initdb", &["-D", &data, "-A", "trust", "-U", "postgres", "--no-sync"]);
        let port = free_port();
        let mut options = format!("-p {port} -k {} -c listen_addresses=127.0.0.1", dir.path().display());
        for (name, value) in settings {
            options.push_str(&format!(" -c {name}={value}"));
        }
        let log = dir.path().join("server.log").display().to_string();
        run(&bin, as_postgres, "pg_ctl", &["-D", &data, "-l", &log, "-o", &options, "-w", "start"]);
        PgCluster { port, dir, bin, as_postgres }
    }

    /// A URL for `database` (create it first, e.g. with [`PgCluster::create_database`]).
    pub fn url(&self, database: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{database}", self.port)
    }

    pub async fn create_database(&self, name: &str) {
        let admin = sqlx::PgPool::connect(&self.url("postgres")).await.unwrap();
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}"))).execute(&admin).await.unwrap();
        admin.close().await;
    }
}

impl Drop for PgCluster {
    fn drop(&mut self) {
        let data = self.dir.path().join("data").display().to_string();
        run(&self.bin, self.as_postgres, "pg_ctl", &["-D", &data, "-m", "immediate", "-w", "stop"]);
    }
}
