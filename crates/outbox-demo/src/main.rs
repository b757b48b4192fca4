//! `outbox-demo`: an order service whose events flow through the outbox to NATS JetStream (or, without
//! `NATS_URL`, to a local sink file), with its workers, a load generator, a verifier and the operator
//! commands. Without `DATABASE_URL` it keeps everything in a SQLite file, so it runs with nothing
//! installed.
//!
//! Subcommands: `run` (the default: the whole story live in one process), `worker`, `produce`,
//! `consume`, `verify`, `status`, `failed list|requeue|skip`, `purge`, `migrate`. See `--help`.

mod admin;
#[cfg(feature = "postgres")]
mod bench;
mod config;
mod consume;
mod live;
mod operator;
mod orders;
mod sink;
mod verify;
mod worker;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use outbox_core::{ConnectOptions, Db, Outbox};

use crate::config::DemoConfig;

/// The database when no `DATABASE_URL` is given: a SQLite file in the current directory.
const DEFAULT_DATABASE_URL: &str = "sqlite://outbox-demo.db";

#[derive(Parser)]
#[command(name = "outbox-demo", version, about = "Orders whose events flow through the outbox to NATS JetStream")]
struct Cli {
    #[command(flatten)]
    global: Global,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Args)]
struct Global {
    /// TOML file with `outbox`, `cluster` and `nats` sections.
    #[arg(long, env = "OUTBOX_CONFIG", global = true)]
    config: Option<PathBuf>,
    /// Database URL: `postgres://…`, or `sqlite://path` (default: sqlite://outbox-demo.db).
    #[arg(long, env = "DATABASE_URL", global = true, default_value = DEFAULT_DATABASE_URL, hide_default_value = true)]
    database_url: String,
    /// NATS server URL(s), comma-separated: deliver to JetStream (overrides the file's `nats.servers`).
    /// Without it and without a `[nats]` section in the config file, events go to a local sink file.
    #[arg(long, env = "NATS_URL", global = true)]
    nats_url: Option<String>,
    /// The local sink (a SQLite file) used when no NATS is configured.
    #[arg(long, env = "OUTBOX_DEMO_SINK", global = true, default_value = sink::DEFAULT_PATH)]
    sink: PathBuf,
    /// Log format.
    #[arg(long, env = "OUTBOX_LOG_FORMAT", global = true, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// The whole story live: orders placed, workers joining, leaving and crashing, a verification.
    Run(live::RunArgs),
    /// One clustered worker, until SIGTERM or SIGINT (then a graceful handover).
    Worker(worker::WorkerArgs),
    /// The load generator: orders, each with a sequence of events in separate transactions.
    Produce(orders::ProduceArgs),
    /// Another service's read model (order → last status) kept from the stream through the inbox, each
    /// event applied once, until SIGTERM or SIGINT (NATS only).
    Consume,
    /// Reads the stream and the database back; reports missing, duplicated, out-of-order and ghost events,
    /// and orders whose status in the read model (if `consume` kept one) differs.
    Verify,
    /// Instances, partitions per instance, backlog, oldest pending age, FAILED count.
    Status,
    /// FAILED records: list, requeue, skip.
    #[command(subcommand)]
    Failed(operator::FailedCommand),
    /// Deletes completed records and the consumer's inbox rows older than a retention.
    Purge {
        /// Keep completed records and inbox rows younger than this.
        #[arg(long, default_value = "1h", value_parser = humantime::parse_duration)]
        older_than: Duration,
    },
    /// Applies the outbox schema and the demo's tables.
    Migrate,
    /// Throughput, latency and cost, with yardsticks measured in the same run (build with --release).
    #[cfg(feature = "postgres")]
    Bench(bench::BenchArgs),
}

/// An error for a person: one line saying what is wrong and what to do.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct Failure(String);

impl From<outbox_core::Error> for Failure {
    fn from(e: outbox_core::Error) -> Self {
        match e {
            outbox_core::Error::NotMigrated { schema, missing } => Failure(format!(
                "the outbox schema {schema:?} is missing or not migrated ({missing}): run `outbox-demo migrate` first"
            )),
            e @ outbox_core::Error::Connect { .. } => {
                Failure(format!("{e}: check that it runs and DATABASE_URL, or run ./scripts/demo.sh"))
            }
            e if e.is_not_migrated() => Failure(format!("{e}: run `outbox-demo migrate` first")),
            other => Failure(other.to_string()),
        }
    }
}

impl From<outbox_cluster::Error> for Failure {
    fn from(e: outbox_cluster::Error) -> Self {
        match e {
            outbox_cluster::Error::Core(core) => core.into(),
            other => Failure(other.to_string()),
        }
    }
}

impl From<outbox_nats::Error> for Failure {
    fn from(e: outbox_nats::Error) -> Self {
        // The advice only where the broker was out of reach: refused credentials or TLS say why themselves.
        Failure(match e {
            e @ outbox_nats::Error::Connect { .. } if e.is_transient() => {
                format!("{e}; start nats-server with JetStream (-js), or run ./scripts/demo.sh")
            }
            other => other.to_string(),
        })
    }
}

/// What every command needs: the configuration, the database, the outbox and the delivery target.
struct Context {
    config: DemoConfig,
    db: Db,
    outbox: Outbox,
    target: sink::Target,
}

impl Context {
    async fn connect(global: &Global) -> Result<Context, Failure> {
        let config = DemoConfig::load(global.config.as_deref(), global.nats_url.as_deref()).map_err(Failure)?;
        // Fails within seconds when the database is down, rather than waiting for it to come up.
        let options = ConnectOptions { max_connections: 16, acquire_timeout: Duration::from_secs(5) };
        let db = Db::connect_with(&global.database_url, &options).await?;
        let outbox = Outbox::new(config.outbox.clone())?;
        let target = if config.use_nats { sink::Target::JetStream } else { sink::Target::Local(global.sink.clone()) };
        Ok(Context { config, db, outbox, target })
    }
}

/// jemalloc, as a service embedding the outbox would choose its allocator: with glibc's, a fifth of the
/// worker's CPU went to malloc and free and to waits for the arenas' locks (a task frees on one runtime
/// thread what it allocated on the other). BENCHMARKS.md has the figures of both.
#[cfg(not(target_env = "msvc"))]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into());
    let logs = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    match cli.global.log_format {
        LogFormat::Text => logs.init(),
        LogFormat::Json => logs.json().init(),
    }
    match dispatch(cli).await {
        Ok(code) => code,
        Err(Failure(message)) => {
            eprintln!("error: {message}");
            ExitCode::FAILURE
        }
    }
}

async fn dispatch(cli: Cli) -> Result<ExitCode, Failure> {
    let ctx = Context::connect(&cli.global).await?;
    match cli.command.unwrap_or(Command::Run(live::RunArgs::default())) {
        Command::Run(args) => live::run(&ctx, args).await,
        Command::Worker(args) => worker::run(&ctx, args).await.map(|()| ExitCode::SUCCESS),
        Command::Produce(args) => orders::produce_command(&ctx, args).await.map(|()| ExitCode::SUCCESS),
        Command::Consume => consume::run(&ctx).await.map(|()| ExitCode::SUCCESS),
        Command::Verify => verify::command(&ctx).await,
        Command::Status => operator::status(&ctx).await.map(|()| ExitCode::SUCCESS),
        Command::Failed(command) => operator::failed(&ctx, command).await.map(|()| ExitCode::SUCCESS),
        Command::Purge { older_than } => operator::purge(&ctx, older_than).await.map(|()| ExitCode::SUCCESS),
        Command::Migrate => operator::migrate(&ctx).await.map(|()| ExitCode::SUCCESS),
        #[cfg(feature = "postgres")]
        Command::Bench(args) => bench::run(&ctx, args, &cli.global.database_url).await,
    }
}
