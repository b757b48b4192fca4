//! `bench`: throughput, latency and cost against the local PostgreSQL and NATS JetStream (file storage),
//! with yardsticks measured in the same run ([`yardsticks`]). Everything runs in its own schema
//! (`outbox_bench`) and stream (`OUTBOX_BENCH`), so it never touches the demo's data; the `sqlite`
//! scenarios put the outbox on a SQLite file in a temporary directory, the `mysql` ones on a database
//! `outbox_bench` of the `MYSQL_URL` server. Prints a table and one JSON line
//! per scenario ([`report`]).

mod cpu;
#[cfg(feature = "mysql")]
mod mysql;
mod postgres;
mod producer;
mod report;
mod scenarios;
#[cfg(feature = "sqlite")]
mod sqlite;
mod yardsticks;

use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Args;
use outbox_cluster::{ClusterConfig, Node};
use outbox_core::{Completion, Config, ConnectOptions, Db, Handlers, NewRecord, Outbox, Scheduled};
use outbox_nats::{JetStreamHandler, NatsConfig, StreamSettings};

use self::postgres::Postgres;
use self::report::Row;
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
    /// Run only these scenarios (the yardsticks always run, for the ratios): drain, processes, backlog,
    /// failing, steady, idle, large, producer, sqlite, mysql.
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
    /// A backlog of 1,000,000 records over 100,000 keys, drained by one worker process, beside the
    /// usual backlog drained the same way; the worker's peak RSS.
    Backlog,
    /// Drain with 1 % of keys failing twice.
    Failing,
    /// Steady offered load, commit-to-ack latency.
    Steady,
    /// An idle instance's cost to PostgreSQL.
    Idle,
    /// 64 KiB payloads: the drain to JetStream beside JetStream's raw pipelined publish, in MB/s.
    Large,
    /// `schedule` per record and `schedule_batch` against a plain INSERT, on PostgreSQL and SQLite.
    Producer,
    /// The outbox on a SQLite file: drain (to a no-op handler and to JetStream), steady latency.
    #[cfg(feature = "sqlite")]
    Sqlite,
    /// The outbox on MySQL/MariaDB: drain (to a no-op handler and to JetStream), steady latency.
    #[cfg(feature = "mysql")]
    Mysql,
}

#[derive(Clone, Copy)]
struct Sizes {
    quick: bool,
    keys: usize,
    per_key: usize,
    payload_bytes: usize,
    steady_rate: u64,
    steady_secs: u64,
    idle_secs: u64,
}

impl Sizes {
    fn of(quick: bool) -> Sizes {
        if quick {
            Sizes {
                quick,
                keys: 100,
                per_key: 10,
                payload_bytes: PAYLOAD_BYTES,
                steady_rate: 200,
                steady_secs: 3,
                idle_secs: 3,
            }
        } else {
            let (keys, per_key) = (1000, 50);
            Sizes {
                quick,
                keys,
                per_key,
                payload_bytes: PAYLOAD_BYTES,
                steady_rate: 1000,
                steady_secs: 30,
                idle_secs: 30,
            }
        }
    }

    /// 64 KiB payloads: 2,000 records over 200 keys (125 MiB), or 100 with `quick`.
    fn large(self) -> Sizes {
        let (keys, per_key) = if self.quick { (20, 5) } else { (200, 10) };
        Sizes { keys, per_key, payload_bytes: 64 * 1024, ..self }
    }

    /// 1,000,000 records over 100,000 keys (10,000 over 1,000 with `quick`).
    fn backlog(self) -> Sizes {
        let (keys, per_key) = if self.quick { (1_000, 10) } else { (100_000, 10) };
        Sizes { keys, per_key, ..self }
    }

    fn records(&self) -> usize {
        self.keys * self.per_key
    }
}

#[derive(Clone)]
struct Bench {
    /// PostgreSQL: the yardsticks, the statistics, the scenarios that start worker processes.
    pg: std::sync::Arc<Postgres>,
    /// Where the in-process outbox scenarios (drain, failing, steady) run: PostgreSQL, or a SQLite file.
    db: Db,
    /// Whether `db` is `pg`'s database (so its statistics count the outbox's writes).
    on_postgres: bool,
    outbox: Outbox,
    nats: NatsConfig,
    database_url: String,
    sizes: Sizes,
    cpu: std::sync::Arc<cpu::CpuMeter>,
}

pub async fn run(ctx: &Context, args: BenchArgs, database_url: &str) -> Result<ExitCode, Failure> {
    let pg = Postgres::connect(database_url).await?;
    let outbox = Outbox::new(Config {
        schema: SCHEMA.into(),
        completion: ctx.config.outbox.completion,
        ..ctx.config.outbox.clone()
    })?;
    outbox.migrate(pg.db()).await?;
    let nats = NatsConfig {
        subject: "bench.{event_type}".into(),
        stream: StreamSettings { name: STREAM.into(), subjects: vec!["bench.>".into()], ..StreamSettings::default() },
        ..ctx.config.nats.clone()
    };
    let cpu = cpu::CpuMeter::new(pg.backend_pid().await.ok());
    let bench = Bench {
        cpu: std::sync::Arc::new(cpu),
        db: pg.db(),
        pg: std::sync::Arc::new(pg),
        on_postgres: true,
        outbox,
        nats,
        database_url: database_url.into(),
        sizes: Sizes::of(args.quick),
    };
    let rounds = args.rounds.unwrap_or(if args.quick { 1 } else { 3 }).max(1);
    // Every round measures the yardsticks and the scenarios anew; a ratio compares figures of the same
    // round.
    let mut by_scenario: Vec<Vec<Row>> = Vec::new();
    let mut relays = Vec::new();
    for _ in 0..rounds {
        let rows = bench.round(&args).await?;
        relays.push(rows.iter().find(|r| r.scenario == "yardstick_idealised_relay").map_or(f64::NAN, |r| r.value));
        by_scenario.resize_with(rows.len(), Vec::new);
        for (list, row) in by_scenario.iter_mut().zip(rows) {
            list.push(row);
        }
    }
    report::print(&by_scenario, &relays, args.quick);
    Ok(ExitCode::SUCCESS)
}

impl Bench {
    /// One round: the yardsticks, then the selected scenarios.
    async fn round(&self, args: &BenchArgs) -> Result<Vec<Row>, Failure> {
        let publish = self.raw_publish("yardstick_jetstream_publish").await?;
        let mut rows = vec![publish, self.ordered_publish(256).await?, self.idealised_relay().await?];
        let wanted = |scenario| args.only.is_empty() || args.only.contains(&scenario);
        if wanted(Scenario::Drain) {
            rows.push(self.drain_in_process(&self.outbox, "drain_1_instance", scenarios::Target::JetStream).await?);
            // The same with `completion = "delete"`: no copy into `completed`, as in the relay.
            let deleting = Outbox::new(Config { completion: Completion::Delete, ..self.outbox.config().clone() })?;
            let scenario = "drain_1_instance_completion_delete";
            rows.push(self.drain_in_process(&deleting, scenario, scenarios::Target::JetStream).await?);
        }
        if wanted(Scenario::Processes) {
            rows.push(self.drain_processes(4, "drain_4_processes").await?);
        }
        if wanted(Scenario::Backlog) {
            rows.extend(self.backlog().await?);
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
        if wanted(Scenario::Large) {
            rows.extend(self.large().await?);
        }
        if wanted(Scenario::Producer) {
            self.reset().await?;
            let plain = self.pg.plain_table().await?;
            rows.extend(self.producer(producer::POSTGRES, &plain).await?);
            #[cfg(feature = "sqlite")]
            rows.extend(self.producer_on_sqlite().await?);
        }
        #[cfg(feature = "sqlite")]
        if wanted(Scenario::Sqlite) {
            rows.extend(self.on_sqlite().await?);
        }
        #[cfg(feature = "mysql")]
        if wanted(Scenario::Mysql) {
            rows.extend(self.on_mysql().await?);
        }
        Ok(rows)
    }

    /// A payload of this bench's size.
    fn payload(&self) -> Vec<u8> {
        vec![b'x'; self.sizes.payload_bytes]
    }

    /// This bench with other sizes.
    fn resized(&self, sizes: Sizes) -> Bench {
        Bench { sizes, ..self.clone() }
    }

    /// This bench on another database for the outbox (PostgreSQL still gives the yardsticks). Its CPU
    /// figures leave the database out (`null`): a file is counted with the bench process, and another
    /// server is not one the meter knows.
    #[cfg(any(feature = "sqlite", feature = "mysql"))]
    fn on(&self, db: Db) -> Bench {
        Bench { db, on_postgres: false, cpu: std::sync::Arc::new(cpu::CpuMeter::new(None)), ..self.clone() }
    }

    /// A table of the bench outbox on `db`.
    fn table(&self, name: &str) -> String {
        self.outbox.table(&self.db, name)
    }

    /// Empties the outbox tables on `db` and the bench stream.
    async fn reset(&self) -> Result<async_nats::Client, Failure> {
        if self.on_postgres {
            self.pg.truncate().await?;
        } else {
            let tables = ["records", "completed", "instances"].map(|t| format!("DELETE FROM {};", self.table(t)));
            let unowned = format!("UPDATE {} SET owner = NULL, target_owner = NULL", self.table("partitions"));
            self.db.execute_script(sqlx::AssertSqlSafe(format!("{} {unowned}", tables.join(" ")))).await?;
        }
        let client = outbox_nats::connect(&self.nats).await?;
        outbox_nats::ensure_stream(&client, &self.nats.stream).await?;
        let js = async_nats::jetstream::new(client.clone());
        let stream = js.get_stream(STREAM).await.map_err(|e| Failure(e.to_string()))?;
        stream.purge().await.map_err(|e| Failure(e.to_string()))?;
        Ok(client)
    }

    /// keys × per_key records of the bench's payload size, scheduled in transactions of 1,000.
    async fn preload(&self) -> Result<Vec<Scheduled>, Failure> {
        let mut records = Vec::with_capacity(self.sizes.records());
        for _ in 0..self.sizes.per_key {
            for k in 0..self.sizes.keys {
                records.push(NewRecord::new(format!("key-{k}"), "bench", self.payload()));
            }
        }
        // On a pool of its own, closed at the end: a backend's table statistics reach
        // pg_stat_user_tables for sure only when it exits, and `rows_written` must not see the
        // preload's arrive late.
        let db = self.separate_db().await?;
        let mut scheduled = Vec::with_capacity(records.len());
        for chunk in records.chunks(1000) {
            let mut tx = db.begin().await?;
            scheduled.extend(self.outbox.schedule_batch(&mut tx, chunk).await?);
            tx.commit().await?;
        }
        db.close().await;
        Ok(scheduled)
    }

    async fn pending(&self) -> Result<i64, Failure> {
        let sql = format!("SELECT count(*) FROM {} WHERE failed_at IS NULL", self.table("records"));
        let (pending,): (i64,) = self.db.fetch_one(sqlx::AssertSqlSafe(sql), &[]).await?;
        Ok(pending)
    }

    /// Waits until the bench stream holds `expected` messages. Cheap to poll (a NATS request), unlike
    /// counting pending records, which reads the table and would take CPU from the drain it measures.
    async fn wait_published(&self, expected: usize) -> Result<(), Failure> {
        let js = async_nats::jetstream::new(outbox_nats::connect(&self.nats).await?);
        let stream = js.get_stream(STREAM).await.map_err(|e| Failure(e.to_string()))?;
        wait_until("records were not published", Duration::from_millis(10), || async {
            Ok(stream.get_info().await.map_err(|e| Failure(e.to_string()))?.state.messages >= expected as u64)
        })
        .await
    }

    /// Waits until every record is acked (in the stream) and completed (gone from `records`).
    async fn wait_delivered(&self, expected: usize) -> Result<(), Failure> {
        self.wait_published(expected).await?;
        self.wait_drained().await
    }

    async fn wait_drained(&self) -> Result<(), Failure> {
        wait_until("backlog did not drain", Duration::from_millis(20), || async { Ok(self.pending().await? == 0) })
            .await
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

    /// A small pool on `db` of its own, with `db`'s connection settings.
    async fn separate_db(&self) -> Result<Db, Failure> {
        Ok(self.db.new_pool(&ConnectOptions { max_connections: 8, ..ConnectOptions::default() }).await?)
    }
}

/// Waits until `done`, checking every `every`; a scenario that takes over 10 minutes fails: "bench:
/// {what} within 10 minutes".
async fn wait_until<F, Fut>(what: &str, every: Duration, mut done: F) -> Result<(), Failure>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<bool, Failure>>,
{
    let deadline = Instant::now() + Duration::from_secs(600);
    while !done().await? {
        if Instant::now() > deadline {
            return Err(Failure(format!("bench: {what} within 10 minutes")));
        }
        tokio::time::sleep(every).await;
    }
    Ok(())
}
