//! The demo's subcommands, run as the real binary against this test's own database and its own
//! nats-server.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use outbox_tests::nats::NatsServer;
use outbox_tests::process::Process;
use sqlx::PgPool;

struct Env {
    database_url: String,
    nats: NatsServer,
    /// Where workers write their logs, shown when a test fails.
    logs: tempfile::TempDir,
}

impl Env {
    async fn new(pool: &PgPool) -> Env {
        let db: String = sqlx::query_scalar("SELECT current_database()").fetch_one(pool).await.unwrap();
        let base = std::env::var("DATABASE_URL").unwrap();
        let (server, _) = base.rsplit_once('/').unwrap();
        Env { database_url: format!("{server}/{db}"), nats: NatsServer::start(), logs: tempfile::tempdir().unwrap() }
    }

    /// On a fresh MariaDB database of the test server (`MYSQL_URL`); also that database.
    async fn mariadb() -> (Env, outbox_core::Db) {
        let db = outbox_core::driver::mysql::test_database().await;
        let (name,): (String,) = db.fetch_one("SELECT DATABASE()", &[]).await.unwrap();
        let server = std::env::var("MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306".into());
        let env = Env {
            database_url: format!("{server}/{name}"),
            nats: NatsServer::start(),
            logs: tempfile::tempdir().unwrap(),
        };
        (env, db)
    }

    fn command(&self, args: &[&str]) -> Command {
        let mut command = Command::new(env!("CARGO_BIN_EXE_outbox-demo"));
        command
            .args(args)
            .env("DATABASE_URL", &self.database_url)
            .env("NATS_URL", self.nats.url())
            .env_remove("OUTBOX_CONFIG");
        command
    }

    fn run(&self, args: &[&str]) -> Output {
        self.command(args).output().unwrap()
    }

    /// Runs and expects success; returns stdout.
    fn ok(&self, args: &[&str]) -> String {
        let out = self.run(args);
        let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "{args:?} failed: {stdout}\n{stderr}");
        stdout.into_owned()
    }

    /// A worker process logging to `<name>.log` in the logs directory.
    fn worker(&self, name: &str, extra: &[&str]) -> Process {
        let mut args = vec!["worker", "--name", name];
        args.extend_from_slice(extra);
        let log = std::fs::File::create(self.logs.path().join(format!("{name}.log"))).unwrap();
        Process(self.command(&args).env("RUST_LOG", WORKER_LOG).stdout(Stdio::null()).stderr(log).spawn().unwrap())
    }
}

const WORKER_LOG: &str = "info,sqlx=warn";

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

async fn wait_for<F, Fut>(what: &str, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + Duration::from_secs(60);
    while !condition().await {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until the `workers` (name, process; logging to `<name>.log` in `logs`) own partitions between
/// them. If one exits, or they do not come to share within a minute, fails with who owns and is meant to
/// own the partitions, and the workers' exit statuses and logs.
async fn wait_for_sharing(
    db: &outbox_core::Db,
    sql: &BackendSql,
    logs: &std::path::Path,
    workers: &mut [(&str, &mut Process)],
) {
    let deadline = Instant::now() + Duration::from_secs(60);
    let failure = loop {
        let exited = workers.iter_mut().any(|(_, w)| matches!(w.0.try_wait(), Ok(Some(_))));
        if exited {
            break "a worker exited";
        }
        if db.fetch_one::<(i64,)>(sql.owners, &[]).await.unwrap().0 == workers.len() as i64 {
            return;
        }
        if Instant::now() > deadline {
            break "the workers did not come to share the partitions in 60 s";
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let owners: Vec<(Option<uuid::Uuid>, Option<uuid::Uuid>, i64)> = db.fetch_all(sql.ownership, &[]).await.unwrap();
    let report: Vec<String> = workers
        .iter_mut()
        .map(|(name, w)| {
            let log = std::fs::read_to_string(logs.join(format!("{name}.log"))).unwrap_or_default();
            format!("{name} ({:?}):\n{log}", w.0.try_wait())
        })
        .collect();
    panic!("{failure}: (owner, target, partitions) {owners:?}\n{}", report.join("\n"));
}

fn terminate(mut worker: Process) {
    let status = Command::new("kill").args(["-TERM", &worker.0.id().to_string()]).status().unwrap();
    assert!(status.success());
    let exit = worker.0.wait().unwrap();
    assert!(exit.success(), "worker exited with {exit}");
}

/// The multi-process flow of the README: migrate, two workers (`w1` started with `w1_args`), produce,
/// verify, status; returns the running workers.
async fn two_workers_produce_verify_and_status(
    env: &Env,
    db: &outbox_core::Db,
    sql: &BackendSql,
    w1_args: &[&str],
) -> (Process, Process) {
    let count = |query: &'static str| async move { db.fetch_one::<(i64,)>(query, &[]).await.unwrap().0 };
    let out = env.run(&["status"]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("run `outbox-demo migrate` first"), "{}", stderr(&out));

    assert!(env.ok(&["migrate"]).contains("migrated"));
    env.ok(&["migrate"]);
    let (mut w1, mut w2) = (env.worker("w1", w1_args), env.worker("w2", &[]));
    wait_for_sharing(db, sql, env.logs.path(), &mut [("w1", &mut w1), ("w2", &mut w2)]).await;

    let produced = env.ok(&["produce", "--orders", "60", "--events-per-order", "4", "--rollback-fraction", "0.2"]);
    assert!(produced.contains("produced 240 events for 60 orders"), "{produced}");
    assert_eq!(count("SELECT count(*) FROM demo_order_events").await, 240);
    wait_for("backlog drained", || async { count(sql.count_records).await == 0 }).await;

    let verified = env.ok(&["verify"]);
    assert!(verified.contains("committed events   240") && verified.contains("stream messages    240"), "{verified}");
    assert!(verified.contains("OK: nothing lost"), "{verified}");

    let status = env.ok(&["status"]);
    assert!(status.contains("w1") && status.contains("w2") && status.contains("128 partitions"), "{status}");
    assert!(status.contains("pending 0  scheduled for later 0  FAILED 0"), "{status}");
    (w1, w2)
}

/// Graceful stops, which deregister.
async fn stop_both(db: &outbox_core::Db, sql: &BackendSql, (w1, w2): (Process, Process)) {
    terminate(w1);
    terminate(w2);
    let (instances,): (i64,) = db.fetch_one(sql.count_instances, &[]).await.unwrap();
    assert_eq!(instances, 0, "graceful stops deregister");
}

/// The README's flow on PostgreSQL, and the first worker's metrics.
#[sqlx::test(migrations = false)]
async fn migrate_two_workers_produce_verify_and_status(pool: PgPool) {
    let (env, db) = (Env::new(&pool).await, outbox_core::Db::from(&pool));
    let metrics_addr = format!("127.0.0.1:{}", outbox_tests::nats::free_port());
    let workers = two_workers_produce_verify_and_status(&env, &db, &POSTGRES, &["--metrics-addr", &metrics_addr]).await;
    let metrics = http_get(&metrics_addr, "/metrics").await;
    for name in [
        "outbox_records_completed_total",
        "outbox_delivery_latency_seconds",
        "outbox_owned_partitions",
        "outbox_live_instances",
        "outbox_wakeups_listening{schema=\"outbox\"} 1",
    ] {
        assert!(metrics.contains(name), "{name} missing from metrics:\n{metrics}");
    }
    stop_both(&db, &POSTGRES, workers).await;
}

async fn http_get(addr: &str, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(mut stream) = tokio::net::TcpStream::connect(addr).await {
            stream.write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes()).await.unwrap();
            let mut body = String::new();
            stream.read_to_string(&mut body).await.unwrap();
            return body;
        }
        assert!(Instant::now() < deadline, "metrics endpoint {addr} not reachable");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `consume` keeps the read model through the inbox: killed (SIGKILL) while it applies events, and
/// started again, it ends with every order's status exactly as in the orders table, and verify says so.
#[sqlx::test(migrations = false)]
async fn a_consumer_killed_mid_batch_keeps_the_read_model_exact(pool: PgPool) {
    let env = Env::new(&pool).await;
    env.ok(&["migrate"]);
    let w = env.worker("w", &[]);
    let count = |sql: &'static str| {
        let pool = pool.clone();
        async move { sqlx::query_scalar::<_, i64>(sql).fetch_one(&pool).await.unwrap() }
    };
    let consumer = |name: &str| {
        let log = std::fs::File::create(env.logs.path().join(format!("{name}.log"))).unwrap();
        Process(
            env.command(&["consume"]).env("RUST_LOG", WORKER_LOG).stdout(Stdio::null()).stderr(log).spawn().unwrap(),
        )
    };
    let mut first = consumer("c1");
    env.ok(&["produce", "--orders", "300", "--events-per-order", "3", "--rollback-fraction", "0.1"]);
    wait_for("some events applied", || async { count("SELECT count(*) FROM outbox.inbox").await >= 50 }).await;
    first.0.kill().unwrap();
    first.0.wait().unwrap();
    let applied = count("SELECT count(*) FROM outbox.inbox").await;
    assert!(applied < 900, "killed after {applied} of 900 events: not mid-way");

    let second = consumer("c2");
    wait_for("every event applied", || async { count("SELECT count(*) FROM outbox.inbox").await == 900 }).await;
    terminate(second);
    terminate(w);
    let report = env.ok(&["verify"]);
    assert!(report.contains("read model                 0 orders differ"), "{report}");
    assert!(report.contains("OK: nothing lost"), "{report}");
    let logs = std::fs::read_to_string(env.logs.path().join("c2.log")).unwrap();
    assert!(logs.contains("consumer stopped"), "{logs}");
}

/// `verify` exits non-zero and names what is wrong: a leaked (rolled-back) event, a duplicate, a gap;
/// a message deleted from the stream is read past.
#[sqlx::test(migrations = false)]
async fn verify_reports_ghosts_duplicates_and_missing_events(pool: PgPool) {
    let env = Env::new(&pool).await;
    env.ok(&["migrate"]);
    env.ok(&["produce", "--orders", "3", "--events-per-order", "2", "--rollback-fraction", "0"]);
    let w = env.worker("w", &[]);
    wait_for("drained", || async {
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox.records").fetch_one(&pool).await.unwrap();
        n == 0
    })
    .await;
    terminate(w);
    assert!(env.ok(&["verify"]).contains("OK"));

    let client = async_nats::connect(env.nats.url()).await.unwrap();
    let js = async_nats::jetstream::new(client);
    let (order, seq): (String, i32) =
        sqlx::query_as("SELECT order_id, seq FROM demo_order_events ORDER BY order_id, seq LIMIT 1")
            .fetch_one(&pool)
            .await
            .unwrap();
    let ghost = serde_json::json!({"event_id": uuid::Uuid::now_v7(), "key": order, "seq": 3, "step": "refunded"});
    js.publish("outbox.order.refunded", ghost.to_string().into()).await.unwrap().await.unwrap();
    sqlx::query("INSERT INTO demo_order_events (event_id, order_id, seq, step) VALUES ($1, $2, 9, 'lost')")
        .bind(uuid::Uuid::now_v7())
        .bind(&order)
        .execute(&pool)
        .await
        .unwrap();
    let _ = seq;
    // A message deleted from the stream leaves a gap that verify reads past (it stopped there with
    // "no message found").
    let stream = js.get_stream("OUTBOX").await.unwrap();
    let junk = js.publish("outbox.order.junk", "junk".into()).await.unwrap().await.unwrap();
    assert!(stream.delete_message(junk.sequence).await.unwrap());
    // A copy of a committed event published again outside the outbox (no message id to dedupe on).
    let first = stream.get_raw_message(1).await.unwrap();
    js.publish(first.subject.to_string(), first.payload.clone()).await.unwrap().await.unwrap();
    let out = env.run(&["verify"]);
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "{report}");
    assert!(report.contains("missing                    1 events in 1 orders"), "{report}");
    assert!(report.contains("rolled back but published  1 events in 1 orders"), "{report}");
    assert!(report.contains("duplicated                 1 events in 1 orders"), "{report}");
    assert!(report.contains("FAILED"), "{report}");
}

/// The statements the tests read and change the outbox with, per backend.
struct BackendSql {
    /// Distinct owners of partitions.
    owners: &'static str,
    /// (owner, target owner, partitions) groups.
    ownership: &'static str,
    count_records: &'static str,
    count_instances: &'static str,
    /// Makes each key's first record FAILED.
    fail_first: &'static str,
    /// (id, key) of the FAILED records, by key.
    failed: &'static str,
    count_failed: &'static str,
    count_skipped: &'static str,
    /// Makes the skipped records' completion 3 hours old.
    age_skipped: &'static str,
    /// Makes the inbox row of message "old" 3 hours old.
    age_inbox: &'static str,
    count_inbox: &'static str,
}

const POSTGRES: BackendSql = BackendSql {
    owners: "SELECT count(DISTINCT owner) FROM outbox.partitions WHERE owner IS NOT NULL",
    ownership: "SELECT owner, target_owner, count(*) FROM outbox.partitions GROUP BY owner, target_owner",
    count_records: "SELECT count(*) FROM outbox.records",
    count_instances: "SELECT count(*) FROM outbox.instances",
    fail_first: "UPDATE outbox.records SET failed_at = now(), attempts = 3, last_error = 'permanent: broker said no'
        WHERE (key, seq) IN (SELECT key, min(seq) FROM outbox.records GROUP BY key)",
    failed: "SELECT id, key FROM outbox.records WHERE failed_at IS NOT NULL ORDER BY key",
    count_failed: "SELECT count(*) FROM outbox.records WHERE failed_at IS NOT NULL",
    count_skipped: "SELECT count(*) FROM outbox.completed WHERE outcome = 'skipped'",
    age_skipped: "UPDATE outbox.completed SET completed_at = now() - interval '3 hours' WHERE outcome = 'skipped'",
    age_inbox: "UPDATE outbox.inbox SET accepted_at = now() - interval '3 hours' WHERE message_id = 'old'",
    count_inbox: "SELECT count(*) FROM outbox.inbox",
};

const MYSQL: BackendSql = BackendSql {
    owners: "SELECT count(DISTINCT owner) FROM outbox_partitions WHERE owner IS NOT NULL",
    ownership: "SELECT owner, target_owner, count(*) FROM outbox_partitions GROUP BY owner, target_owner",
    count_records: "SELECT count(*) FROM outbox_records",
    count_instances: "SELECT count(*) FROM outbox_instances",
    fail_first: "UPDATE outbox_records r JOIN (SELECT `key`, MIN(seq) AS seq FROM outbox_records GROUP BY `key`) h
        ON r.`key` = h.`key` AND r.seq = h.seq
        SET r.failed_at = UTC_TIMESTAMP(6), r.attempts = 3, r.last_error = 'permanent: broker said no'",
    failed: "SELECT id, `key` FROM outbox_records WHERE failed_at IS NOT NULL ORDER BY `key`",
    count_failed: "SELECT count(*) FROM outbox_records WHERE failed_at IS NOT NULL",
    count_skipped: "SELECT count(*) FROM outbox_completed WHERE outcome = 'skipped'",
    age_skipped: "UPDATE outbox_completed SET completed_at = UTC_TIMESTAMP(6) - INTERVAL 3 HOUR WHERE outcome = 'skipped'",
    age_inbox: "UPDATE outbox_inbox SET accepted_at = UTC_TIMESTAMP(6) - INTERVAL 3 HOUR WHERE message_id = 'old'",
    count_inbox: "SELECT count(*) FROM outbox_inbox",
};

/// SQLite names the tables as MySQL does, and its test reads only the plain counts, which are alike.
const SQLITE: &BackendSql = &MYSQL;

/// `failed list|requeue|skip` and `purge` act on the database as an operator expects (no worker runs).
async fn failed_records_can_be_listed_requeued_and_skipped_and_purged(
    env: &Env,
    db: &outbox_core::Db,
    sql: &BackendSql,
) {
    let count = |query: &'static str| async move { db.fetch_one::<(i64,)>(query, &[]).await.unwrap().0 };
    env.ok(&["produce", "--orders", "2", "--events-per-order", "2", "--rollback-fraction", "0"]);
    assert_eq!(db.execute(sql.fail_first, &[]).await.unwrap(), 2);
    let listed = env.ok(&["failed", "list"]);
    assert!(listed.contains("2 FAILED records") && listed.contains("broker said no"), "{listed}");
    let ids: Vec<(uuid::Uuid, String)> = db.fetch_all(sql.failed, &[]).await.unwrap();
    let by_key = env.ok(&["failed", "list", "--key", &ids[0].1]);
    assert!(by_key.contains("1 FAILED records"), "{by_key}");

    assert!(env.ok(&["failed", "requeue", &ids[0].0.to_string()]).contains("requeued"));
    assert_eq!(count(sql.count_failed).await, 1);
    db.execute(sql.fail_first, &[]).await.unwrap();
    assert_eq!(count(sql.count_failed).await, 2, "both FAILED again");
    let all = env.ok(&["failed", "requeue", "--all"]);
    assert!(all.contains("requeued 2 FAILED records"), "{all}");
    assert_eq!(count(sql.count_failed).await, 0);
    db.execute(sql.fail_first, &[]).await.unwrap();
    assert!(env.ok(&["failed", "requeue", &ids[0].0.to_string()]).contains("requeued"));
    assert!(env.ok(&["failed", "skip", &ids[1].0.to_string()]).contains("skipped"));
    let out = env.run(&["failed", "skip", &ids[1].0.to_string()]);
    assert!(!out.status.success() && stderr(&out).contains("not found in state FAILED"), "{}", stderr(&out));
    assert_eq!(count(sql.count_failed).await, 0);
    assert_eq!(count(sql.count_skipped).await, 1);

    db.execute(sql.age_skipped, &[]).await.unwrap();
    // The consumer's inbox: a message applied 3 hours ago and one just now.
    let inbox = outbox_core::Outbox::new(outbox_core::Config::default()).unwrap().inbox();
    let mut tx = db.begin().await.unwrap();
    for message in ["old", "new"] {
        assert!(inbox.accept(&mut tx, "demo-read-model", message).await.unwrap());
    }
    tx.commit().await.unwrap();
    db.execute(sql.age_inbox, &[]).await.unwrap();
    let purged = env.ok(&["purge", "--older-than", "2h"]);
    assert!(purged.contains("purged 1 completed records"), "{purged}");
    assert!(purged.contains("purged 1 inbox rows"), "{purged}");
    assert_eq!(count(sql.count_inbox).await, 1, "the message applied just now is kept");
}

#[sqlx::test(migrations = false)]
async fn failed_records_can_be_listed_requeued_and_skipped_and_purge_deletes_old_completions(pool: PgPool) {
    let env = Env::new(&pool).await;
    env.ok(&["migrate"]);
    failed_records_can_be_listed_requeued_and_skipped_and_purged(&env, &outbox_core::Db::from(&pool), &POSTGRES).await;
}

/// A newcomer's mistakes get one clear line, not a backtrace.
#[sqlx::test(migrations = false)]
async fn bad_config_and_unreachable_services_are_one_line_errors(pool: PgPool) {
    let env = Env::new(&pool).await;
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "[outbox]\npoll_interval = \"soon\"\n").unwrap();
    let out = env.run(&["--config", bad.to_str().unwrap(), "status"]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).starts_with("error: bad configuration in") && stderr(&out).contains("poll_interval"),
        "{}",
        stderr(&out)
    );
    std::fs::write(&bad, "[cluster]\nheartbeat_interval = \"5s\"\nstale_timeout = \"6s\"\n").unwrap();
    let out = env.run(&["--config", bad.to_str().unwrap(), "status"]);
    assert!(stderr(&out).contains("stale_timeout"), "{}", stderr(&out));
    // Thirty retries: 102.3 s of delays doubling up to the minute's cap, twenty more of a minute each,
    // and 31 publish timeouts of 5 s. The stream's 20 minutes hold each delay, not the whole span.
    std::fs::write(&bad, "[outbox.retry]\nmax_retries = 30\n[nats]\n").unwrap();
    let out = env.run(&["--config", bad.to_str().unwrap(), "status"]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("nats.stream.duplicate_window (20m) must be longer than the retries' span")
            && stderr(&out).contains("(24m 17s 300ms)"),
        "{}",
        stderr(&out)
    );
    let out = env.command(&["status"]).env("OUTBOX_ADMIN_TOKEN", "guessable").output().unwrap();
    assert!(!out.status.success());
    assert!(stderr(&out).contains("admin.tokens.OUTBOX_ADMIN_TOKEN: shorter than 16"), "{}", stderr(&out));
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let out = env.run(&["worker", "--admin-addr", &addr]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains(&format!("cannot serve the operator page on {addr}")), "{}", stderr(&out));

    let out = env
        .command(&["status"])
        .env("DATABASE_URL", format!("postgres://root@127.0.0.1:{}/x", outbox_tests::nats::free_port()))
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(stderr(&out).contains("cannot connect to PostgreSQL database \"x\" at 127.0.0.1:"), "{}", stderr(&out));
    assert_eq!(stderr(&out).lines().count(), 1, "{}", stderr(&out));

    env.ok(&["migrate"]);
    for rate in ["NaN", "-1", "1e10", "1e-300"] {
        let out = env.run(&["produce", "--orders", "1", &format!("--rate={rate}")]);
        assert!(!out.status.success(), "--rate {rate}");
        assert!(stderr(&out).starts_with("error: --rate must be 0"), "--rate {rate}: {}", stderr(&out));
        assert_eq!(stderr(&out).lines().count(), 1, "--rate {rate}: {}", stderr(&out));
    }
    // A HOSTNAME set but empty (some container runtimes): the instance is named by its process id.
    let out = env.command(&["status"]).env("HOSTNAME", "").output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let out = env
        .command(&["verify"])
        .env("NATS_URL", format!("nats://127.0.0.1:{}", outbox_tests::nats::free_port()))
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(stderr(&out).contains("cannot connect to NATS at nats://127.0.0.1:"), "{}", stderr(&out));
    assert!(stderr(&out).contains("start nats-server"), "{}", stderr(&out));
    // A server that wants credentials the URL lacks: the refusal, not advice to start a server.
    let guarded =
        outbox_tests::nats::NatsServer::start_with("authorization { users: [ { user: \"app\", password: \"pw\" } ] }");
    let out = env.command(&["verify"]).env("NATS_URL", guarded.url()).output().unwrap();
    assert!(!out.status.success());
    assert!(stderr(&out).contains("authorization violation"), "{}", stderr(&out));
    assert!(!stderr(&out).contains("start nats-server"), "{}", stderr(&out));
}

/// `run`, the default, tells the story and ends with a clean verification.
#[sqlx::test(migrations = false)]
async fn run_tells_the_story_and_verifies_it(pool: PgPool) {
    tells_the_story(&Env::new(&pool).await);
}

/// `DATABASE_URL=mysql://…/demo outbox-demo` verifies clean as well.
#[tokio::test]
async fn on_mariadb_run_tells_the_story_and_verifies_it() {
    tells_the_story(&Env::mariadb().await.0);
}

fn tells_the_story(env: &Env) {
    let out = env.run(&["run", "--orders", "40", "--rate", "200", "--step-secs", "1"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", stderr(&out));
    for line in ["w4 joins", "w2 leaves gracefully", "w3 crashes", "committed events   120", "OK: nothing lost"] {
        assert!(stdout.contains(line), "missing {line:?} in:\n{stdout}");
    }
}

/// The demo with nothing configured, in a directory of its own: SQLite file, local sink, no servers.
fn embedded(dir: &std::path::Path, args: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_outbox-demo"));
    command.args(args).current_dir(dir);
    for var in ["DATABASE_URL", "NATS_URL", "OUTBOX_CONFIG", "OUTBOX_DEMO_SINK", "OUTBOX_WORKER_NAME"] {
        command.env_remove(var);
    }
    command
}

fn embedded_ok(dir: &std::path::Path, args: &[&str]) -> String {
    let out = embedded(dir, args).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{args:?} failed: {stdout}\n{}", stderr(&out));
    stdout
}

/// The README's first command, `cargo run -p outbox-demo`, exactly: no arguments, no environment. It
/// keeps the outbox in a SQLite file and delivers to a local sink, and ends with a clean verification.
#[tokio::test]
async fn with_nothing_configured_the_story_runs_on_sqlite_and_a_local_sink() {
    let dir = tempfile::tempdir().unwrap();
    let stdout = embedded_ok(dir.path(), &[]);
    for line in [
        "database: sqlite",
        "the local sink outbox-demo-sink.db",
        "w4 joins",
        "w2 leaves gracefully",
        "w3 crashes",
        "committed events   900",
        "OK: nothing lost",
    ] {
        assert!(stdout.contains(line), "missing {line:?} in:\n{stdout}");
    }
    assert!(dir.path().join("outbox-demo.db").exists() && dir.path().join("outbox-demo-sink.db").exists());
}

/// Instances of one SQLite file in separate processes on one host form one cluster, as on PostgreSQL.
#[tokio::test]
async fn sqlite_workers_in_separate_processes_share_the_partitions() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path();
    embedded_ok(path, &["migrate"]);
    // Each worker logs to a file in the directory, shown if the cluster does not form.
    let spawn = |name: &str| {
        let log = std::fs::File::create(path.join(format!("{name}.log"))).unwrap();
        let mut command = embedded(path, &["worker", "--name", name]);
        Process(command.env("RUST_LOG", WORKER_LOG).stdout(Stdio::null()).stderr(log).spawn().unwrap())
    };
    let (mut w1, mut w2) = (spawn("w1"), spawn("w2"));
    let url = format!("sqlite://{}", path.join("outbox-demo.db").display());
    let db = outbox_core::Db::connect(&url).await.unwrap();
    wait_for_sharing(&db, SQLITE, path, &mut [("w1", &mut w1), ("w2", &mut w2)]).await;
    let produced = embedded_ok(path, &["produce", "--orders", "60", "--events-per-order", "4"]);
    assert!(produced.contains("produced 240 events for 60 orders"), "{produced}");
    wait_for("backlog drained", || async {
        let (n,): (i64,) = db.fetch_one(SQLITE.count_records, &[]).await.unwrap();
        n == 0
    })
    .await;
    let verified = embedded_ok(path, &["verify"]);
    assert!(verified.contains("committed events   240") && verified.contains("stream messages    240"), "{verified}");
    assert!(verified.contains("OK: nothing lost"), "{verified}");
    let status = embedded_ok(path, &["status"]);
    assert!(status.contains("w1") && status.contains("w2") && status.contains("128 partitions"), "{status}");
    terminate(w1);
    terminate(w2);
    let (instances,): (i64,) = db.fetch_one(SQLITE.count_instances, &[]).await.unwrap();
    assert_eq!(instances, 0, "graceful stops deregister");
}

/// The multi-process flow and the operator's commands on MariaDB: migrate, two workers, produce, verify,
/// status, then `failed list|requeue|skip` and `purge`.
#[tokio::test]
async fn on_mariadb_every_subcommand_works() {
    let (env, db) = Env::mariadb().await;
    let workers = two_workers_produce_verify_and_status(&env, &db, &MYSQL, &[]).await;
    stop_both(&db, &MYSQL, workers).await;
    failed_records_can_be_listed_requeued_and_skipped_and_purged(&env, &db, &MYSQL).await;
}
