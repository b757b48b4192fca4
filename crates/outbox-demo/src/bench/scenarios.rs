//! The outbox measured: draining a backlog in one process and in four, with failing keys, under a
//! steady offered load, idle, and on SQLite.

use std::collections::HashMap;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use outbox_cluster::Node;
use outbox_core::{Config, Handler, HandlerError, Handlers, NewRecord, Outbox, Record, Route, handler_fn};
use rand::RngExt;
use serde_json::json;
use uuid::Uuid;

use super::report::{self, Row, percentile};
use super::{Bench, SCHEMA, Sizes, wait_until};
use crate::Failure;
use crate::config::DemoConfig;

/// Where a drain delivers.
#[derive(Clone, Copy)]
pub(super) enum Target {
    /// The bench stream; done when every record is acked and completed.
    JetStream,
    /// A handler that does nothing: the outbox alone.
    #[cfg(any(feature = "sqlite", feature = "mysql"))]
    Nothing,
}

impl Bench {
    /// The outbox, one in-process instance, draining a preloaded backlog (`outbox` decides the
    /// completion mode). On PostgreSQL also the rows it wrote per record.
    pub(super) async fn drain_in_process(
        &self,
        outbox: &Outbox,
        scenario: &'static str,
        target: Target,
    ) -> Result<Row, Failure> {
        self.reset().await?;
        let n = self.preload().await?.len();
        let before = if self.on_postgres { self.pg.rows_written().await? } else { 0 };
        // Handler calls so far (the no-op target's), watched until every record has had one: counting
        // pending records all along would take from the drain the database's CPU it measures.
        #[cfg(any(feature = "sqlite", feature = "mysql"))]
        let called = Arc::new(AtomicUsize::new(0));
        let route = match target {
            Target::JetStream => Route::new(self.jetstream().await?),
            #[cfg(any(feature = "sqlite", feature = "mysql"))]
            Target::Nothing => {
                let called = called.clone();
                Route::new(handler_fn(move |_| {
                    called.fetch_add(1, Ordering::Relaxed);
                    async { Ok(()) }
                }))
            }
        };
        let handlers = Handlers::new().default_route(route);
        let db = self.separate_db().await?;
        let cpu = self.cpu.sample();
        let started = Instant::now();
        let node = Node::start(outbox.clone(), &db, handlers, Self::cluster("bench")).await?;
        match target {
            Target::JetStream => self.wait_delivered(n).await?,
            #[cfg(any(feature = "sqlite", feature = "mysql"))]
            Target::Nothing => {
                let handled = || async { Ok(called.load(Ordering::Relaxed) >= n) };
                wait_until("records were not handled", Duration::from_millis(1), handled).await?;
                self.wait_drained().await?;
            }
        }
        let elapsed = started.elapsed();
        let mut extra = self.cpu.per_thousand(cpu, n);
        node.shutdown().await?;
        db.close().await;
        let rate = n as f64 / elapsed.as_secs_f64();
        extra["records"] = json!(n);
        extra["secs"] = json!(elapsed.as_secs_f64());
        if self.on_postgres {
            let written = self.pg.rows_written().await? - before;
            extra["pg_rows_written_per_record"] = json!(written as f64 / n as f64);
        }
        Ok(Row { scenario, value: rate, unit: "records/s", extra })
    }

    /// The outbox as `count` separate `outbox-demo worker` processes; also their peak RSS.
    /// The backlog is preloaded and held back, the workers start and settle (every partition owned,
    /// `count` owners, no handover pending), and only then is the backlog released (committed at once)
    /// and the clock started: process start and the initial rebalance are not measured.
    pub(super) async fn drain_processes(&self, count: usize, scenario: &'static str) -> Result<Row, Failure> {
        self.reset().await?;
        let scheduled = self.preload().await?;
        let n = scheduled.len();
        self.pg.hold_backlog().await?;
        let exe = std::env::current_exe().map_err(|e| Failure(e.to_string()))?;
        let config = std::env::temp_dir().join(format!("outbox-bench-{}.toml", std::process::id()));
        let worker = DemoConfig {
            outbox: Config { schema: SCHEMA.into(), ..Config::default() },
            nats: self.nats.clone(),
            ..DemoConfig::default()
        };
        let toml = toml::to_string(&worker).map_err(|e| Failure(format!("bench: worker configuration: {e}")))?;
        std::fs::write(&config, toml).map_err(|e| Failure(e.to_string()))?;
        let mut workers: Vec<Child> = (0..count)
            .map(|i| {
                Command::new(&exe)
                    .args(["worker", "--name", &format!("bench-{i}")])
                    .env("DATABASE_URL", &self.database_url)
                    .env("OUTBOX_CONFIG", &config)
                    .env_remove("NATS_URL")
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .map_err(|e| Failure(format!("cannot start a worker process: {e}")))
            })
            .collect::<Result<_, _>>()?;
        let drained = async {
            self.wait_settled(count).await?;
            self.pg.release_backlog().await?;
            let cpu = self.cpu.sample();
            let started = Instant::now();
            // As the producers of the backlog would have, once it is committed.
            self.outbox.wake(&self.db, &scheduled).await?;
            self.wait_delivered(n).await?;
            Ok::<_, Failure>((started.elapsed(), self.cpu.per_thousand(cpu, n)))
        }
        .await;
        let peak_rss_kib = workers.iter().filter_map(|w| report::peak_rss_kib(w.id())).max().unwrap_or(0);
        // Stopped whatever happened, so no worker outlives the bench.
        for worker in &mut workers {
            let _ = Command::new("kill").args(["-TERM", &worker.id().to_string()]).status();
            let _ = worker.wait();
        }
        let _ = std::fs::remove_file(&config);
        let (elapsed, mut extra) = drained?;
        let rate = n as f64 / elapsed.as_secs_f64();
        extra["records"] = json!(n);
        extra["processes"] = json!(count);
        extra["secs"] = json!(elapsed.as_secs_f64());
        extra["worker_peak_rss_mib"] = json!(peak_rss_kib as f64 / 1024.0);
        extra["includes_process_start"] = json!(false);
        Ok(Row { scenario, value: rate, unit: "records/s", extra })
    }

    /// Waits until `count` instances own all 256 partitions with no handover pending.
    async fn wait_settled(&self, count: usize) -> Result<(), Failure> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let (owners, unsettled) = self.pg.ownership().await?;
            if owners == count as i64 && unsettled == 0 {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(Failure(format!(
                    "bench: {count} workers did not settle within 60 s ({owners} owners, {unsettled} partitions unsettled)"
                )));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// A backlog of 1,000,000 records over 100,000 keys drained by one worker process, beside the
    /// usual 50,000-record backlog and one of 50,000 records in runs as short as the large one's (5,000
    /// keys × 10), drained the same way in the same round; with the worker's peak RSS.
    pub(super) async fn backlog(&self) -> Result<Vec<Row>, Failure> {
        let usual = self.drain_processes(1, "drain_1_process").await?;
        let large = self.sizes.backlog();
        let shape = Sizes { keys: self.sizes.records() / large.per_key, ..large };
        let mut short_runs = self.resized(shape).drain_processes(1, "drain_1_process_short_runs").await?;
        let mut backlog = self.resized(large).drain_processes(1, "drain_1_process_backlog_1m").await?;
        for (row, sizes) in [(&mut short_runs, shape), (&mut backlog, large)] {
            row.extra["keys"] = json!(sizes.keys);
            row.extra["vs_usual_backlog"] = json!(row.value / usual.value);
        }
        backlog.extra["vs_short_runs"] = json!(backlog.value / short_runs.value);
        self.reset().await?;
        Ok(vec![usual, short_runs, backlog])
    }

    /// Drain with 1 % of keys failing twice before succeeding; throughput of the healthy keys.
    pub(super) async fn failing_keys(&self) -> Result<Row, Failure> {
        self.reset().await?;
        let n = self.preload().await?.len();
        let failing: std::collections::HashSet<String> =
            (0..self.sizes.keys).filter(|k| k % 100 == 0).map(|k| format!("key-{k}")).collect();
        let healthy = n - failing.len() * self.sizes.per_key;
        let jetstream = self.jetstream().await?;
        let done = Arc::new(AtomicUsize::new(0));
        let (failing, d) = (Arc::new(failing), done.clone());
        let handler = handler_fn(move |r: Record| {
            let (jetstream, failing, d) = (jetstream.clone(), failing.clone(), d.clone());
            async move {
                let bad = failing.contains(&r.key);
                if bad && r.attempts < 2 {
                    return Err(HandlerError::retryable("bench: failing twice"));
                }
                jetstream.handle(&r).await?;
                if !bad {
                    d.fetch_add(1, Ordering::Relaxed);
                }
                Ok(())
            }
        });
        let started = Instant::now();
        let node = self.node(Handlers::new().default_route(Route::new(handler))).await?;
        let delivered = || async { Ok(done.load(Ordering::Relaxed) >= healthy) };
        wait_until("healthy keys were not delivered", Duration::from_millis(10), delivered).await?;
        let elapsed = started.elapsed();
        self.wait_drained().await?;
        node.shutdown().await?;
        let rate = healthy as f64 / elapsed.as_secs_f64();
        Ok(Row {
            scenario: "failing_keys_healthy",
            value: rate,
            unit: "records/s",
            extra: json!({"healthy_records": healthy}),
        })
    }

    /// Offered load from producer transactions (one record each); latency from commit to JetStream ack.
    /// The producers stand for another instance of the service: an `Outbox` of their own, whose
    /// `wake` after each commit reaches the node only through the database (PostgreSQL's `NOTIFY`;
    /// elsewhere the node finds the records by polling).
    pub(super) async fn steady(&self, scenario: &'static str) -> Result<Row, Failure> {
        self.reset().await?;
        let committed: Arc<Mutex<HashMap<Uuid, Instant>>> = Arc::default();
        // Per record: when the handler was called, and when JetStream acked.
        let acked: Arc<Mutex<HashMap<Uuid, (Instant, Instant)>>> = Arc::default();
        let jetstream = self.jetstream().await?;
        let a = acked.clone();
        let handler = handler_fn(move |r: Record| {
            let (jetstream, a) = (jetstream.clone(), a.clone());
            async move {
                let called = Instant::now();
                jetstream.handle(&r).await?;
                if let Ok(mut acked) = a.lock() {
                    acked.insert(r.id, (called, Instant::now()));
                }
                Ok(())
            }
        });
        let node = self.node(Handlers::new().default_route(Route::new(handler))).await?;
        // Let the node acquire its partitions before offering load.
        tokio::time::sleep(Duration::from_secs(1)).await;
        let (rate, secs) = (self.sizes.steady_rate, self.sizes.steady_secs);
        let producers = 8;
        let elsewhere = Outbox::new(self.outbox.config().clone())?;
        let tasks = (0..producers).map(|p| {
            let (outbox, db, committed, body) = (elsewhere.clone(), self.db.clone(), committed.clone(), self.payload());
            tokio::spawn(async move {
                let mut ticker = tokio::time::interval(Duration::from_secs_f64(producers as f64 / rate as f64));
                let end = Instant::now() + Duration::from_secs(secs);
                while Instant::now() < end {
                    ticker.tick().await;
                    let key = format!("steady-{}", rand::rng().random_range(0..1000));
                    let mut tx = db.begin().await?;
                    let scheduled = outbox.schedule(&mut tx, NewRecord::new(key, "bench", body.clone())).await?;
                    tx.commit().await?;
                    if let Ok(mut committed) = committed.lock() {
                        committed.insert(scheduled.id, Instant::now());
                    }
                    outbox.wake(&db, &[scheduled]).await?;
                }
                let _ = p;
                Ok::<(), Failure>(())
            })
        });
        for task in futures::future::join_all(tasks).await {
            task.map_err(|e| Failure(e.to_string()))??;
        }
        self.wait_drained().await?;
        node.shutdown().await?;
        let (committed, acked) =
            (committed.lock().map_err(|_| Failure("lock".into()))?, acked.lock().map_err(|_| Failure("lock".into()))?);
        let ms = |from: Instant, to: Instant| to.saturating_duration_since(from).as_secs_f64() * 1000.0;
        let mut latencies = Vec::new();
        let mut waits = Vec::new();
        let mut publishes = Vec::new();
        for (id, at) in committed.iter() {
            if let Some(&(called, ack)) = acked.get(id) {
                latencies.push(ms(*at, ack));
                waits.push(ms(*at, called));
                publishes.push(ms(called, ack));
            }
        }
        for list in [&mut latencies, &mut waits, &mut publishes] {
            list.sort_by(f64::total_cmp);
        }
        let pct = |p: f64| percentile(&latencies, p);
        Ok(Row {
            scenario,
            value: pct(0.50),
            unit: "ms",
            extra: json!({"offered_per_s": rate, "secs": secs, "records": latencies.len(), "p95_ms": pct(0.95), "p99_ms": pct(0.99), "max_ms": latencies.last().copied().unwrap_or(0.0),
                "commit_to_handler_p50_ms": percentile(&waits, 0.5), "commit_to_handler_p99_ms": percentile(&waits, 0.99),
                "publish_p50_ms": percentile(&publishes, 0.5), "publish_p99_ms": percentile(&publishes, 0.99)}),
        })
    }

    /// Transactions per second an idle instance costs PostgreSQL. A backend reports its counts to
    /// `pg_stat_database` late (an idle one up to 10 s after its last transaction), so the window opens
    /// only once the node's start and the earlier scenarios' connections have reported theirs.
    pub(super) async fn idle(&self) -> Result<Row, Failure> {
        self.reset().await?;
        let node = self.node(Handlers::new().default_route(Route::new(self.jetstream().await?))).await?;
        let settle = if self.sizes.quick { 2 } else { 12 };
        tokio::time::sleep(Duration::from_secs(settle)).await;
        let before = self.pg.transactions().await?;
        tokio::time::sleep(Duration::from_secs(self.sizes.idle_secs)).await;
        let per_s = (self.pg.transactions().await? - before - 1) as f64 / self.sizes.idle_secs as f64;
        node.shutdown().await?;
        Ok(Row {
            scenario: "idle_instance",
            value: per_s,
            unit: "transactions/s",
            extra: json!({"secs": self.sizes.idle_secs}),
        })
    }

    /// The in-process scenarios again with the outbox on a fresh SQLite file (WAL, `synchronous = FULL`
    /// as the library opens it), then the no-op drain and the steady latency with `synchronous = NORMAL`,
    /// for what durability costs.
    #[cfg(feature = "sqlite")]
    pub(super) async fn on_sqlite(&self) -> Result<Vec<Row>, Failure> {
        use super::sqlite::{self, Durability};
        let mut rows = Vec::new();
        for durability in [Durability::Full, Durability::Normal] {
            let dir = tempfile::tempdir().map_err(|e| Failure(format!("bench: no temporary directory: {e}")))?;
            let db = sqlite::file(&dir.path().join("bench.db"), durability).await?;
            self.outbox.migrate(&db).await?;
            let bench = self.on(db);
            if durability == Durability::Full {
                let drain = "sqlite_drain_1_instance_no_op_handler";
                rows.push(bench.drain_in_process(&bench.outbox, drain, Target::Nothing).await?);
                rows.push(bench.drain_in_process(&bench.outbox, "sqlite_drain_1_instance", Target::JetStream).await?);
                rows.push(bench.steady("sqlite_steady_commit_to_ack_p50").await?);
            } else {
                let drain = "sqlite_synchronous_normal_drain_1_instance_no_op_handler";
                rows.push(bench.drain_in_process(&bench.outbox, drain, Target::Nothing).await?);
                rows.push(bench.steady("sqlite_synchronous_normal_steady_commit_to_ack_p50").await?);
            }
            bench.db.close().await;
        }
        Ok(rows)
    }

    /// The outbox on a fresh MySQL/MariaDB database.
    #[cfg(feature = "mysql")]
    pub(super) async fn on_mysql(&self) -> Result<Vec<Row>, Failure> {
        let db = super::mysql::database().await?;
        self.outbox.migrate(&db).await?;
        let bench = self.on(db);
        let rows = vec![
            bench.drain_in_process(&bench.outbox, "mysql_drain_1_instance_no_op_handler", Target::Nothing).await?,
            bench.drain_in_process(&bench.outbox, "mysql_drain_1_instance", Target::JetStream).await?,
            bench.steady("mysql_steady_commit_to_ack_p50").await?,
        ];
        bench.db.close().await;
        Ok(rows)
    }

    /// 64 KiB payloads: JetStream's raw pipelined publish of them, and one instance draining them to
    /// JetStream, in MB/s (10^6 bytes of payload per second).
    pub(super) async fn large(&self) -> Result<Vec<Row>, Failure> {
        let bench = self.resized(self.sizes.large());
        let mut publish = bench.raw_publish("yardstick_jetstream_publish_64k").await?;
        let mut drain = bench.drain_in_process(&bench.outbox, "drain_1_instance_64k", Target::JetStream).await?;
        let bytes = bench.sizes.payload_bytes as f64;
        for row in [&mut publish, &mut drain] {
            row.extra["records_per_s"] = json!(row.value);
            row.extra["payload_bytes"] = json!(bench.sizes.payload_bytes);
            row.value *= bytes / 1e6;
            row.unit = "MB/s";
        }
        drain.extra["vs_publish"] = json!(drain.value / publish.value);
        Ok(vec![publish, drain])
    }
}
