//! A real nats-server per test: free loopback port, own store directory, stop and restart.
//! Shared by the end-to-end tests here and the demo's command-line tests.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

pub struct NatsServer {
    pub port: u16,
    dir: PathBuf,
    extra: String,
    child: Option<Child>,
}

/// `OUTBOX_NATS_SERVER` picks another binary (e.g. a newer server); else Debian's, else `PATH`'s.
fn binary() -> String {
    if let Ok(path) = std::env::var("OUTBOX_NATS_SERVER") {
        return path;
    }
    ["/usr/sbin/nats-server", "/usr/bin/nats-server", "/usr/local/bin/nats-server"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists())
        .unwrap_or("nats-server")
        .to_string()
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

impl NatsServer {
    /// Starts a JetStream server; `extra` is added to its configuration file (e.g. `max_payload: 2048`).
    pub fn start_with(extra: &str) -> NatsServer {
        let port = free_port();
        let dir = std::env::temp_dir().join(format!("outbox-nats-{port}-{}", uuid::Uuid::now_v7()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut server = NatsServer { port, dir, extra: extra.to_string(), child: None };
        server.spawn();
        server
    }

    pub fn start() -> NatsServer {
        Self::start_with("")
    }

    /// Starts `size` JetStream servers routed to each other as one cluster (a stream of 3 replicas
    /// stays available while one of 3 servers is down).
    pub fn cluster(size: usize) -> Vec<NatsServer> {
        let routes: Vec<u16> = (0..size).map(|_| free_port()).collect();
        let urls = routes.iter().map(|p| format!("nats://127.0.0.1:{p}")).collect::<Vec<_>>().join(", ");
        routes
            .iter()
            .enumerate()
            .map(|(i, route)| {
                Self::start_with(&format!(
                    "server_name: n{i}\ncluster {{ name: outbox, listen: 127.0.0.1:{route}, routes: [{urls}] }}"
                ))
            })
            .collect()
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    fn spawn(&mut self) {
        let config = self.dir.join("server.conf");
        std::fs::write(
            &config,
            format!(
                "listen: 127.0.0.1:{}\njetstream {{ store_dir: {:?} }}\n{}\n",
                self.port,
                self.dir.join("store").display().to_string(),
                self.extra
            ),
        )
        .unwrap();
        let log = std::fs::File::create(self.dir.join("server.log")).unwrap();
        let child = Command::new(binary()).arg("-c").arg(&config).stdout(Stdio::null()).stderr(log).spawn().unwrap();
        self.child = Some(child);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(std::time::Instant::now() < deadline, "nats-server did not start; see {}", self.dir.display());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Sends `signal` (`"STOP"`, `"CONT"`) to the server: a stopped server keeps its connections open and
    /// answers nothing, as a frozen host does.
    pub fn signal(&self, signal: &str) {
        let pid = self.child.as_ref().expect("the server runs").id();
        let status = Command::new("kill").arg(format!("-{signal}")).arg(pid.to_string()).status().unwrap();
        assert!(status.success(), "kill -{signal} {pid}");
    }

    /// Stops and starts again on the same port with the same store.
    pub fn restart(&mut self) {
        self.stop();
        self.spawn();
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
