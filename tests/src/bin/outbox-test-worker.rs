//! A clustered outbox worker for the fault tests: joins the cluster, logs every handler call
//! (instance, record, key, seq, partition, epoch, and the call's wall-clock start and end in
//! microseconds) to the file `CALL_LOG` if set ([`outbox_tests::calls`]), and on SIGTERM stops
//! gracefully.
//!
//! Environment: `DATABASE_URL` (`postgres://…`, or `sqlite://path` for a SQLite file shared with the
//! test and the other workers), `WORKER_NAME`, and optional `HEARTBEAT`, `STALE`, `REBALANCE`, `POLL`
//! (humantime durations), `MAX_RETRIES` (retries at 50 ms intervals; the default policy without it),
//! and `ABORT_EVENT`: an event type whose handler ends the process with `std::process::abort` (as a
//! panic under `panic = "abort"` would). A test that wants to terminate a worker's PostgreSQL connections starts it
//! with `PGAPPNAME`, which names them. With `SPAN_LOG` set, the worker traces through OpenTelemetry
//! (an in-memory exporter) and, once stopped, writes every span it ended to that file
//! ([`outbox_tests::spans`]).

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use outbox_cluster::{ClusterConfig, Node};
use outbox_core::{Config, Db, HandlerError, Handlers, Outbox, RetryPolicy, Route, handler_fn};
use outbox_tests::calls::{Call, CallLog, Ongoing};
use rand::RngExt;
use tokio::signal::unix::{SignalKind, signal};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

fn duration(var: &str, default: Duration) -> Result<Duration, String> {
    match std::env::var(var) {
        Ok(text) => humantime::parse_duration(&text).map_err(|e| format!("{var}={text}: {e}")),
        Err(_) => Ok(default),
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let spans = std::env::var("SPAN_LOG").ok().map(|path| (path, outbox_tests::spans::Recorder::new()));
    tracing_subscriber::registry()
        .with(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info,sqlx=warn".into()))
        .with(tracing_subscriber::fmt::layer().with_writer(std::io::stderr).with_ansi(false))
        .with(spans.as_ref().map(|(_, recorder)| recorder.layer()))
        .init();
    let name = std::env::var("WORKER_NAME")?;
    let url = std::env::var("DATABASE_URL")?;
    let db = Db::connect(&url).await?;
    let mut config = Config { poll_interval: duration("POLL", Duration::from_millis(50))?, ..Config::default() };
    if let Ok(retries) = std::env::var("MAX_RETRIES") {
        config.retry = RetryPolicy::fixed(Duration::from_millis(50), retries.parse()?);
    }
    let outbox = Outbox::new(config)?;
    let abort = std::env::var("ABORT_EVENT").ok();
    let cluster = ClusterConfig {
        name: name.clone(),
        heartbeat_interval: duration("HEARTBEAT", Duration::from_millis(200))?,
        stale_timeout: duration("STALE", Duration::from_secs(1))?,
        rebalance_interval: duration("REBALANCE", Duration::from_millis(200))?,
    };

    let log = match std::env::var("CALL_LOG") {
        Ok(path) => Some(Arc::new(CallLog::create(Path::new(&path))?)),
        Err(_) => None,
    };
    let instance = name.clone();
    let handler = handler_fn(move |r| {
        let (log, instance) = (log.clone(), instance.clone());
        if abort.as_deref() == Some(r.event_type.as_str()) {
            eprintln!("record {} (key {}): ABORT_EVENT {}, ending the process", r.id, r.key, r.event_type);
            std::process::abort();
        }
        async move {
            // Two awaits, as a handler that connects and then sends a request: a call spans several
            // polls, so a paused or fenced instance is caught in the middle of one.
            let (connect, request) = (rand::rng().random_range(2..12), rand::rng().random_range(0..8));
            // Logged when dropped unfinished too: a call a zombie starts and its lease's end then
            // cancels has begun all the same, and must not overlap another call of its key.
            let call = log.map(|log| {
                let call = Call {
                    instance,
                    record_id: r.id,
                    key: r.key.clone(),
                    seq: r.seq,
                    partition: r.partition,
                    epoch: r.epoch,
                    started_us: 0,
                    ended_us: 0,
                    finished: false,
                };
                Ongoing::start(log, call)
            });
            tokio::time::sleep(Duration::from_millis(connect)).await;
            tokio::time::sleep(Duration::from_millis(request)).await;
            if let Some(call) = call {
                call.finish().map_err(HandlerError::retryable)?;
            }
            Ok(())
        }
    });
    let node = Node::start(outbox, db, Handlers::new().default_route(Route::new(handler)), cluster).await?;
    let (mut term, mut int) = (signal(SignalKind::terminate())?, signal(SignalKind::interrupt())?);
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    node.shutdown().await?;
    if let Some((path, recorder)) = spans {
        recorder.write(Path::new(&path))?;
    }
    Ok(())
}
