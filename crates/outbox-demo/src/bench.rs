//! `bench`: throughput, latency and cost against the local PostgreSQL and NATS JetStream (file storage),
//! with two yardsticks measured in the same run: raw pipelined JetStream publishing, and an idealised
//! relay (select 500 pending rows, publish them pipelined, delete them by id; no ordering, no fencing).
//!
//! Everything runs in its own schema (`outbox_bench`) and stream (`OUTBOX_BENCH`), so it never touches
//! the demo's data. The `sqlite` scenarios run the outbox on a SQLite file in a temporary directory (the
//! same JetStream stream). Prints a table and one JSON line per scenario.

use std::collections::HashMap;
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Args;
use futures::future::try_join_all;
use outbox_cluster::{ClusterConfig, Node};
use outbox_core::{
    Completion, Config, Db, Handler, HandlerError, Handlers, NewRecord, Outbox, Record, Route, handler_fn,
};
use outbox_nats::{JetStreamHandler, NatsConfig, StreamSettings};
use rand::RngExt;
use serde_json::json;
use sqlx::PgPool;
use sqlx::sqlite::{SqlitePoolOptions, SqliteSynchronous};
use uuid::Uuid;

use crate::{Context, Failure};

const SCHEMA: &str = "outbox_bench";
const STREAM: &str = "OUTBOX_BENCH";
const PAYLOAD_BYTES: usize = 256;

/// `bench` options.
#[derive(Args, Debug, Clone)]
pub struct BenchArgs {
    /// Small sizes and short durations: a smoke test (CI), not figures to quote.
    #[arg(long)]
    pub quick: bool,
    /// Run only these scenarios (the yardsticks always run, for the ratios): drain, processes, failing,
    /// steady, idle.
    #[arg(long, value_delimiter = ',', value_enum)]
    pub only: Vec<Scenario>,
    /// Rounds to run; medians are reported (default 3, or 1 with --quick). The machine is shared and
    /// single runs swing by tens of percent.
    #[arg(long)]
    pub rounds: Option<usize>,
}

/// A scenario `--only` can select.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scenario {
    /// Drain a preloaded backlog with one in-process instance (completion keep, then delete).
    Drain,
    /// Drain with four worker processes.
    Processes,
    /// Drain with 1 % of keys failing twice.
    Failing,
    /// Steady offered load, commit-to-ack latency.
    Steady,
    /// An idle instance's cost to PostgreSQL.
    Idle,
    /// The outbox on a SQLite file: drain (to a no-op handler and to JetStream), steady latency.
    Sqlite,
}

#[derive(Clone, Copy)]
struct Sizes {
    keys: usize,
    per_key: usize,
    steady_rate: u64,
    steady_secs: u64,
    idle_secs: u64,
}

impl Sizes {
    fn of(quick: bool) -> Sizes {
        if quick {
            Sizes { keys: 100, per_key: 10, steady_rate: 200, steady_secs: 3, idle_secs: 3 }
        } else {
            Sizes { keys: 1000, per_key: 50, steady_rate: 1000, steady_secs: 30, idle_secs: 10 }
        }
    }

    fn records(&self) -> usize {
        self.keys * self.per_key
    }
}

/// One scenario's result.
struct Row {
    scenario: &'static str,
    value: f64,
    unit: &'static str,
    extra: serde_json::Value,
}

struct Bench {
    /// PostgreSQL: the yardsticks, the scenarios that read its statistics or start worker processes.
    pool: PgPool,
    /// Where the in-process outbox scenarios (drain, failing, steady) run: `pool`, or a SQLite file.
    db: Db,
    outbox: Outbox,
    nats: NatsConfig,
    database_url: String,
    sizes: Sizes,
}

pub async fn run(ctx: &Context, args: BenchArgs, database_url: &str) -> Result<ExitCode, Failure> {
    let outbox_core::Db::Postgres(pool) = &ctx.db else {
        return Err(Failure(
            "bench measures PostgreSQL and NATS JetStream: set DATABASE_URL=postgres://… and NATS_URL (./scripts/bench.sh does)"
                .into(),
        ));
    };
    let outbox = Outbox::new(Config {
        schema: SCHEMA.into(),
        completion: ctx.config.outbox.completion,
        ..ctx.config.outbox.clone()
    })?;
    outbox.migrate(pool).await?;
    let nats = NatsConfig {
        subject: "bench.{event_type}".into(),
        stream: StreamSettings { name: STREAM.into(), subjects: vec!["bench.>".into()], ..StreamSettings::default() },
        ..ctx.config.nats.clone()
    };
    let bench = Bench {
        pool: pool.clone(),
        db: ctx.db.clone(),
        outbox,
        nats,
        database_url: database_url.into(),
        sizes: Sizes::of(args.quick),
    };
    let rounds = args.rounds.unwrap_or(if args.quick { 1 } else { 3 }).max(1);
    // Every round measures the yardsticks and the scenarios anew; a ratio compares figures of the same
    // round. `by_scenario[i]` holds scenario i's row and relay ratio from every round.
    let mut by_scenario: Vec<Vec<(Row, f64)>> = Vec::new();
    for _ in 0..rounds {
        let rows = bench.round(&args).await?;
        let relay = rows.iter().find(|r| r.scenario == "yardstick_idealised_relay").map_or(f64::NAN, |r| r.value);
        by_scenario.resize_with(rows.len(), Vec::new);
        for (list, row) in by_scenario.iter_mut().zip(rows) {
            let ratio = row.value / relay;
            list.push((row, ratio));
        }
    }

    // Reported per scenario: the round with the median value (its extra figures too) and the median
    // of the ratios (the upper middle one for an even number of rounds).
    println!("{:<36} {:>14} {:<16} {:>10}   ({rounds} rounds: medians)", "scenario", "value", "unit", "vs relay");
    let mut lines = Vec::new();
    for list in &by_scenario {
        let values: Vec<f64> = list.iter().map(|(row, _)| row.value).collect();
        let ratio = median(list.iter().map(|(_, ratio)| *ratio).collect());
        let middle = median(values.clone());
        let Some((row, _)) = list.iter().find(|(row, _)| row.value.total_cmp(&middle).is_eq()) else { continue };
        let shown = if row.unit == "records/s" { format!("{ratio:.2}x") } else { "-".into() };
        println!("{:<36} {:>14.1} {:<16} {:>10}", row.scenario, row.value, row.unit, shown);
        let mut line = json!({"scenario": row.scenario, "value": row.value, "unit": row.unit, "quick": args.quick,
            "rounds": values});
        if row.unit == "records/s" {
            line["relay_ratio"] = json!(ratio);
        }
        if let (Some(line), Some(extra)) = (line.as_object_mut(), row.extra.as_object()) {
            line.extend(extra.clone());
        }
        lines.push(line);
    }
    // The JSON lines after the table, one per scenario, for comparing runs.
    for line in lines {
        println!("{line}");
    }
    Ok(ExitCode::SUCCESS)
}

/// Where a drain delivers.
#[derive(Clone, Copy)]
enum Target {
    /// The bench stream; done when every record is acked and completed.
    JetStream,
    /// A handler that does nothing: the outbox alone.
    Nothing,
}

/// The middle value (the upper middle one of an even count).
fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(f64::NAN)
}

fn payload() -> Vec<u8> {
    vec![b'x'; PAYLOAD_BYTES]
}

impl Bench {
    /// One round: the yardsticks, then the selected scenarios.
    async fn round(&self, args: &BenchArgs) -> Result<Vec<Row>, Failure> {
        let mut rows = vec![self.raw_publish().await?, self.ordered_publish(256).await?, self.idealised_relay().await?];
        let wanted = |scenario| args.only.is_empty() || args.only.contains(&scenario);
        if wanted(Scenario::Drain) {
            rows.push(self.drain_in_process(&self.outbox, "drain_1_instance", Target::JetStream).await?);
            // The same with `completion = "delete"`: no copy into `completed`, as in the relay.
            let deleting = Outbox::new(Config { completion: Completion::Delete, ..self.outbox.config().clone() })?;
            rows.push(self.drain_in_process(&deleting, "drain_1_instance_completion_delete", Target::JetStream).await?);
        }
        if wanted(Scenario::Processes) {
            rows.push(self.drain_processes(4).await?);
        }
        if wanted(Scenario::Failing) {
            rows.push(self.failing_keys().await?);
        }
        if wanted(Scenario::Steady) {
            rows.push(self.steady("steady_commit_to_ack_p50").await?);
        }
        if wanted(Scenario::Idle) {
            rows.push(self.idle().await?);
        }
        if wanted(Scenario::Sqlite) {
            rows.extend(self.on_sqlite().await?);
        }
        Ok(rows)
    }

    /// The in-process scenarios again with the outbox on a fresh SQLite file (WAL, `db::sqlite_options`:
    /// `synchronous = FULL`), then the no-op drain and the steady latency with `synchronous = NORMAL`,
    /// for what durability costs.
    async fn on_sqlite(&self) -> Result<Vec<Row>, Failure> {
        let mut rows = Vec::new();
        for synchronous in [SqliteSynchronous::Full, SqliteSynchronous::Normal] {
            let dir = tempfile::tempdir().map_err(|e| Failure(format!("bench: no temporary directory: {e}")))?;
            let url = format!("sqlite://{}", dir.path().join("bench.db").display());
            let options = outbox_core::db::sqlite_options(&url)?.synchronous(synchronous);
            let db = Db::Sqlite(SqlitePoolOptions::new().max_connections(8).connect_with(options).await?);
            self.outbox.migrate(&db).await?;
            let bench = Bench {
                pool: self.pool.clone(),
                db,
                outbox: self.outbox.clone(),
                nats: self.nats.clone(),
                database_url: self.database_url.clone(),
                sizes: self.sizes,
            };
            if synchronous == SqliteSynchronous::Full {
                rows.push(
                    bench
                        .drain_in_process(&bench.outbox, "sqlite_drain_1_instance_no_op_handler", Target::Nothing)
                        .await?,
                );
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

    /// A table of the bench outbox on `db`: `outbox_bench.records` or `outbox_bench_records`.
    fn table(&self, name: &str) -> String {
        match self.db {
            Db::Postgres(_) => format!("{SCHEMA}.{name}"),
            Db::Sqlite(_) => format!("{SCHEMA}_{name}"),
        }
    }

    /// Empties the outbox tables on `db` and the bench stream.
    async fn reset(&self) -> Result<async_nats::Client, Failure> {
        let tables = ["records", "completed", "instances"].map(|t| self.table(t));
        let unowned = format!("UPDATE {} SET owner = NULL, target_owner = NULL", self.table("partitions"));
        match &self.db {
            Db::Postgres(pool) => {
                // PostgreSQL also keeps lock rows of keys with records pending (SQLite needs none).
                let reset = format!("TRUNCATE {}, {}; {unowned}", tables.join(", "), self.table("keys"));
                sqlx::raw_sql(sqlx::AssertSqlSafe(reset)).execute(pool).await?;
            }
            Db::Sqlite(pool) => {
                let reset = tables.map(|t| format!("DELETE FROM {t};")).join(" ");
                sqlx::raw_sql(sqlx::AssertSqlSafe(format!("{reset} {unowned}"))).execute(pool).await?;
            }
        }
        let client = outbox_nats::connect(&self.nats).await?;
        outbox_nats::ensure_stream(&client, &self.nats.stream).await?;
        let js = async_nats::jetstream::new(client.clone());
        let stream = js.get_stream(STREAM).await.map_err(|e| Failure(e.to_string()))?;
        stream.purge().await.map_err(|e| Failure(e.to_string()))?;
        Ok(client)
    }

    /// keys × per_key records, 256-byte payloads, scheduled in transactions of 1,000.
    async fn preload(&self) -> Result<usize, Failure> {
        let mut records = Vec::with_capacity(self.sizes.records());
        for _ in 0..self.sizes.per_key {
            for k in 0..self.sizes.keys {
                records.push(NewRecord::new(format!("key-{k}"), "bench", payload()));
            }
        }
        // On a pool of its own, closed at the end: a backend's table statistics reach
        // pg_stat_user_tables for sure only when it exits, and `rows_written` must not see the
        // preload's arrive late.
        let db = self.separate_db().await?;
        for chunk in records.chunks(1000) {
            let mut tx = db.begin().await?;
            self.outbox.schedule_batch(&mut tx, chunk).await?;
            tx.commit().await?;
        }
        db.close().await;
        Ok(records.len())
    }

    async fn pending(&self) -> Result<i64, Failure> {
        let sql =
            sqlx::AssertSqlSafe(format!("SELECT count(*) FROM {} WHERE failed_at IS NULL", self.table("records")));
        Ok(match &self.db {
            Db::Postgres(pool) => sqlx::query_scalar(sql).fetch_one(pool).await?,
            Db::Sqlite(pool) => sqlx::query_scalar(sql).fetch_one(pool).await?,
        })
    }

    /// Waits until the bench stream holds `expected` messages. Cheap to poll (a NATS request), unlike
    /// counting pending records, which reads the table and would take CPU from the drain it measures.
    async fn wait_published(&self, expected: usize) -> Result<(), Failure> {
        let js = async_nats::jetstream::new(outbox_nats::connect(&self.nats).await?);
        let mut stream = js.get_stream(STREAM).await.map_err(|e| Failure(e.to_string()))?;
        let deadline = Instant::now() + Duration::from_secs(600);
        while stream.info().await.map_err(|e| Failure(e.to_string()))?.state.messages < expected as u64 {
            if Instant::now() > deadline {
                return Err(Failure("bench: records were not published within 10 minutes".into()));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Ok(())
    }

    /// Waits until every record is acked (in the stream) and completed (gone from `records`).
    async fn wait_delivered(&self, expected: usize) -> Result<(), Failure> {
        self.wait_published(expected).await?;
        self.wait_drained().await
    }

    async fn wait_drained(&self) -> Result<(), Failure> {
        let deadline = Instant::now() + Duration::from_secs(600);
        while self.pending().await? > 0 {
            if Instant::now() > deadline {
                return Err(Failure("bench: backlog did not drain within 10 minutes".into()));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(())
    }

    fn cluster(name: &str) -> ClusterConfig {
        ClusterConfig { name: name.into(), ..ClusterConfig::default() }
    }

    async fn node(&self, handlers: Handlers) -> Result<Node, Failure> {
        Ok(Node::start(self.outbox.clone(), &self.db, handlers, Self::cluster("bench")).await?)
    }

    async fn jetstream(&self) -> Result<JetStreamHandler, Failure> {
        let client = outbox_nats::connect(&self.nats).await?;
        Ok(JetStreamHandler::new(client, &self.nats)?)
    }

    /// A small pool with the bench pool's connection options.
    async fn separate_pool(&self) -> Result<PgPool, Failure> {
        let options = self.pool.connect_options().as_ref().clone();
        Ok(sqlx::postgres::PgPoolOptions::new().max_connections(8).connect_with(options).await?)
    }

    /// A small pool on `db` of its own, with `db`'s connection options.
    async fn separate_db(&self) -> Result<Db, Failure> {
        Ok(match &self.db {
            Db::Postgres(_) => Db::Postgres(self.separate_pool().await?),
            Db::Sqlite(pool) => {
                let options = pool.connect_options().as_ref().clone();
                Db::Sqlite(sqlx::sqlite::SqlitePoolOptions::new().max_connections(8).connect_with(options).await?)
            }
        })
    }

    /// Rows inserted, updated and deleted in the bench schema so far, as counted by the statistics
    /// of backends that have exited (callers close the pools that wrote first).
    async fn rows_written(&self) -> Result<i64, Failure> {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let n: Option<i64> = sqlx::query_scalar(
            "SELECT sum(n_tup_ins + n_tup_upd + n_tup_del)::bigint FROM pg_stat_user_tables WHERE schemaname = $1",
        )
        .bind(SCHEMA)
        .fetch_one(&self.pool)
        .await?;
        Ok(n.unwrap_or(0))
    }

    /// Yardstick 1: JetStream alone, pipelined (up to 1,000 acks outstanding).
    async fn raw_publish(&self) -> Result<Row, Failure> {
        let client = self.reset().await?;
        let js = async_nats::jetstream::new(client);
        let n = self.sizes.records();
        let started = Instant::now();
        for chunk in (0..n).collect::<Vec<_>>().chunks(1000) {
            let mut acks = Vec::with_capacity(chunk.len());
            for i in chunk {
                let message = async_nats::jetstream::message::PublishMessage::build()
                    .payload(payload().into())
                    .message_id(format!("raw-{i}"));
                acks.push(js.send_publish("bench.raw", message).await.map_err(|e| Failure(e.to_string()))?);
            }
            try_join_all(acks.into_iter().map(|ack| ack.into_future())).await.map_err(|e| Failure(e.to_string()))?;
        }
        let rate = n as f64 / started.elapsed().as_secs_f64();
        Ok(Row {
            scenario: "yardstick_jetstream_publish",
            value: rate,
            unit: "records/s",
            extra: json!({"records": n}),
        })
    }

    /// What strict per-key order costs JetStream alone: `keys` keys at once, each publishing its next
    /// message only after the previous one's ack (no database at all).
    async fn ordered_publish(&self, keys: usize) -> Result<Row, Failure> {
        let client = self.reset().await?;
        let js = async_nats::jetstream::new(client);
        let n = self.sizes.records();
        let per_key = n.div_ceil(keys);
        let started = Instant::now();
        let tasks = (0..keys).map(|k| {
            let js = js.clone();
            async move {
                for i in 0..per_key {
                    let message = async_nats::jetstream::message::PublishMessage::build()
                        .payload(payload().into())
                        .message_id(format!("ordered-{k}-{i}"));
                    let ack = js.send_publish("bench.ordered", message).await.map_err(|e| Failure(e.to_string()))?;
                    ack.await.map_err(|e| Failure(e.to_string()))?;
                }
                Ok::<(), Failure>(())
            }
        });
        try_join_all(tasks).await?;
        let rate = (per_key * keys) as f64 / started.elapsed().as_secs_f64();
        Ok(Row {
            scenario: "yardstick_ordered_publish",
            value: rate,
            unit: "records/s",
            extra: json!({"records": per_key * keys, "keys_at_once": keys}),
        })
    }

    /// Yardstick 2: the idealised relay.
    async fn idealised_relay(&self) -> Result<Row, Failure> {
        let client = self.reset().await?;
        let n = self.preload().await?;
        let js = async_nats::jetstream::new(client);
        let select = format!("SELECT id, payload FROM {SCHEMA}.records ORDER BY id LIMIT 500");
        let delete = format!("DELETE FROM {SCHEMA}.records WHERE id = ANY($1)");
        // A pool of its own, closed at the end, so its statistics cannot land in a later scenario's count.
        let pool = self.separate_pool().await?;
        let started = Instant::now();
        loop {
            let rows: Vec<(Uuid, Vec<u8>)> =
                sqlx::query_as(sqlx::AssertSqlSafe(select.clone())).fetch_all(&pool).await?;
            if rows.is_empty() {
                break;
            }
            let mut acks = Vec::with_capacity(rows.len());
            for (id, body) in &rows {
                let message = async_nats::jetstream::message::PublishMessage::build()
                    .payload(body.clone().into())
                    .message_id(id.to_string());
                acks.push(js.send_publish("bench.relay", message).await.map_err(|e| Failure(e.to_string()))?);
            }
            try_join_all(acks.into_iter().map(|ack| ack.into_future())).await.map_err(|e| Failure(e.to_string()))?;
            let ids: Vec<Uuid> = rows.iter().map(|(id, _)| *id).collect();
            sqlx::query(sqlx::AssertSqlSafe(delete.clone())).bind(&ids).execute(&pool).await?;
        }
        let rate = n as f64 / started.elapsed().as_secs_f64();
        pool.close().await;
        Ok(Row { scenario: "yardstick_idealised_relay", value: rate, unit: "records/s", extra: json!({"records": n}) })
    }

    /// The outbox, one in-process instance, draining a preloaded backlog (`outbox` decides the
    /// completion mode). On PostgreSQL also the rows it wrote per record.
    async fn drain_in_process(&self, outbox: &Outbox, scenario: &'static str, target: Target) -> Result<Row, Failure> {
        self.reset().await?;
        let n = self.preload().await?;
        let on_postgres = matches!(self.db, Db::Postgres(_));
        let before = if on_postgres { self.rows_written().await? } else { 0 };
        let route = match target {
            Target::JetStream => Route::new(self.jetstream().await?),
            Target::Nothing => Route::new(handler_fn(|_| async { Ok(()) })),
        };
        let handlers = Handlers::new().default_route(route);
        let db = self.separate_db().await?;
        let started = Instant::now();
        let node = Node::start(outbox.clone(), &db, handlers, Self::cluster("bench")).await?;
        match target {
            Target::JetStream => self.wait_delivered(n).await?,
            Target::Nothing => self.wait_drained().await?,
        }
        let elapsed = started.elapsed();
        node.shutdown().await?;
        db.close().await;
        let rate = n as f64 / elapsed.as_secs_f64();
        let mut extra = json!({"records": n, "secs": elapsed.as_secs_f64()});
        if on_postgres {
            let written = self.rows_written().await? - before;
            extra["pg_rows_written_per_record"] = json!(written as f64 / n as f64);
        }
        Ok(Row { scenario, value: rate, unit: "records/s", extra })
    }

    /// The outbox as `count` separate `outbox-demo worker` processes; also their peak RSS.
    /// The backlog is preloaded held back (not due), the workers start and settle (every partition owned,
    /// `count` owners, no handover pending), and only then is the backlog released and the clock
    /// started: process start and the initial rebalance are not measured.
    async fn drain_processes(&self, count: usize) -> Result<Row, Failure> {
        self.reset().await?;
        let n = self.preload().await?;
        let hold = format!("UPDATE {SCHEMA}.records SET next_attempt_at = 'infinity'");
        sqlx::query(sqlx::AssertSqlSafe(hold)).execute(&self.pool).await?;
        sqlx::query(sqlx::AssertSqlSafe(format!("VACUUM {SCHEMA}.records"))).execute(&self.pool).await?;
        let exe = std::env::current_exe().map_err(|e| Failure(e.to_string()))?;
        let config = std::env::temp_dir().join(format!("outbox-bench-{}.toml", std::process::id()));
        let toml = format!(
            "[outbox]\nschema = \"{SCHEMA}\"\n[nats]\nservers = {:?}\nsubject = \"bench.{{event_type}}\"\n[nats.stream]\nname = \"{STREAM}\"\nsubjects = [\"bench.>\"]\n",
            self.nats.servers
        );
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
        let settled = self.wait_settled(count).await;
        let started = Instant::now();
        let drained = match settled {
            Ok(()) => {
                let release = format!("UPDATE {SCHEMA}.records SET next_attempt_at = NULL");
                match sqlx::query(sqlx::AssertSqlSafe(release)).execute(&self.pool).await {
                    Ok(_) => self.wait_delivered(n).await,
                    Err(e) => Err(e.into()),
                }
            }
            Err(e) => Err(e),
        };
        let elapsed = started.elapsed();
        let peak_rss_kib = workers.iter().filter_map(|w| peak_rss_kib(w.id())).max().unwrap_or(0);
        // Stopped whatever happened, so no worker outlives the bench.
        for worker in &mut workers {
            let _ = Command::new("kill").args(["-TERM", &worker.id().to_string()]).status();
            let _ = worker.wait();
        }
        let _ = std::fs::remove_file(&config);
        drained?;
        let rate = n as f64 / elapsed.as_secs_f64();
        Ok(Row {
            scenario: "drain_4_processes",
            value: rate,
            unit: "records/s",
            extra: json!({"records": n, "processes": count, "secs": elapsed.as_secs_f64(), "worker_peak_rss_mib": peak_rss_kib as f64 / 1024.0, "includes_process_start": false}),
        })
    }

    /// Waits until `count` instances own all 256 partitions with no handover pending.
    async fn wait_settled(&self, count: usize) -> Result<(), Failure> {
        let query = format!(
            "SELECT count(DISTINCT owner), count(*) FILTER (WHERE owner IS NULL OR target_owner IS DISTINCT FROM owner)
             FROM {SCHEMA}.partitions"
        );
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let (owners, unsettled): (i64, i64) =
                sqlx::query_as(sqlx::AssertSqlSafe(query.clone())).fetch_one(&self.pool).await?;
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

    /// Drain with 1 % of keys failing twice before succeeding; throughput of the healthy keys.
    async fn failing_keys(&self) -> Result<Row, Failure> {
        self.reset().await?;
        let n = self.preload().await?;
        let failing: std::collections::HashSet<String> =
            (0..self.sizes.keys).filter(|k| k % 100 == 0).map(|k| format!("key-{k}")).collect();
        let healthy = n - failing.len() * self.sizes.per_key;
        let jetstream = self.jetstream().await?;
        let done = Arc::new(std::sync::atomic::AtomicUsize::new(0));
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
                    d.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                Ok(())
            }
        });
        let started = Instant::now();
        let node = self.node(Handlers::new().default_route(Route::new(handler))).await?;
        while done.load(std::sync::atomic::Ordering::Relaxed) < healthy {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
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
    async fn steady(&self, scenario: &'static str) -> Result<Row, Failure> {
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
        let tasks = (0..producers).map(|p| {
            let (outbox, db, committed) = (self.outbox.clone(), self.db.clone(), committed.clone());
            tokio::spawn(async move {
                let mut ticker = tokio::time::interval(Duration::from_secs_f64(producers as f64 / rate as f64));
                let end = Instant::now() + Duration::from_secs(secs);
                while Instant::now() < end {
                    ticker.tick().await;
                    let key = format!("steady-{}", rand::rng().random_range(0..1000));
                    let mut tx = db.begin().await?;
                    let scheduled = outbox.schedule(&mut tx, NewRecord::new(key, "bench", payload())).await?;
                    tx.commit().await?;
                    if let Ok(mut committed) = committed.lock() {
                        committed.insert(scheduled.id, Instant::now());
                    }
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
        let percentile = |list: &[f64], p: f64| {
            list.get(((list.len() as f64 * p) as usize).min(list.len().saturating_sub(1))).copied().unwrap_or(0.0)
        };
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

    /// Transactions per second an idle instance costs PostgreSQL.
    async fn idle(&self) -> Result<Row, Failure> {
        self.reset().await?;
        let node = self.node(Handlers::new().default_route(Route::new(self.jetstream().await?))).await?;
        tokio::time::sleep(Duration::from_secs(2)).await;
        let xacts = || async {
            let n: i64 = sqlx::query_scalar(
                "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = current_database()",
            )
            .fetch_one(&self.pool)
            .await?;
            Ok::<i64, Failure>(n)
        };
        let before = xacts().await?;
        tokio::time::sleep(Duration::from_secs(self.sizes.idle_secs)).await;
        let per_s = (xacts().await? - before - 1) as f64 / self.sizes.idle_secs as f64;
        node.shutdown().await?;
        Ok(Row {
            scenario: "idle_instance",
            value: per_s,
            unit: "transactions/s",
            extra: json!({"secs": self.sizes.idle_secs}),
        })
    }
}

/// Peak resident set (VmHWM) of a process, from /proc.
fn peak_rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}
