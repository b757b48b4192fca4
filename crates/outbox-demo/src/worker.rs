//! `worker`: one clustered instance delivering to JetStream, until SIGTERM or SIGINT, then a graceful
//! handover. Optionally serves Prometheus metrics.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::time::Duration;

use clap::Args;
use metrics_exporter_prometheus::PrometheusBuilder;
use outbox_cluster::{ClusterConfig, Node};
use tokio::signal::unix::{SignalKind, signal};
use tracing::warn;

use crate::{Context, Failure};

/// `worker` options.
#[derive(Args, Debug, Clone)]
pub struct WorkerArgs {
    /// Instance name shown by `status` (default: the host name, or pid-N).
    #[arg(long, env = "OUTBOX_WORKER_NAME")]
    pub name: Option<String>,
    /// Serve Prometheus metrics on this address (e.g. 127.0.0.1:9187).
    #[arg(long, env = "OUTBOX_METRICS_ADDR")]
    pub metrics_addr: Option<SocketAddr>,
    /// Serve the operator's page on this address (alone: 127.0.0.1:9188). Requeue and skip need a
    /// token from `[admin] tokens` in the config file or OUTBOX_ADMIN_TOKEN; without one it is read-only.
    #[arg(long, env = "OUTBOX_ADMIN_ADDR", num_args = 0..=1, default_missing_value = "127.0.0.1:9188")]
    pub admin_addr: Option<SocketAddr>,
}

/// Starts a node delivering to the configured target (JetStream, making sure the stream exists, or the
/// local sink).
pub async fn start_node(ctx: &Context, cluster: ClusterConfig) -> Result<Node, Failure> {
    let handlers = crate::sink::handlers(ctx).await?;
    Ok(Node::start(ctx.outbox.clone(), &ctx.db, handlers, cluster).await?)
}

pub async fn run(ctx: &Context, args: WorkerArgs) -> Result<(), Failure> {
    if let Some(addr) = args.metrics_addr {
        PrometheusBuilder::new()
            .with_http_listener(addr)
            .install()
            .map_err(|e| Failure(format!("cannot serve metrics on {addr}: {e}")))?;
        tokio::spawn(backlog_gauges(ctx.outbox.clone(), ctx.db.clone()));
    }
    let mut cluster = ctx.config.cluster.clone();
    if let Some(name) = args.name {
        cluster.name = name;
    }
    let name = cluster.name.clone();
    if let Some(addr) = args.admin_addr {
        let bound = crate::admin::serve(ctx, addr).await?;
        eprintln!("operator page: {}", crate::admin::url(bound));
    }
    let node = start_node(ctx, cluster).await?;
    eprintln!("worker {name} ({}) running; SIGTERM or Ctrl-C hands its partitions over", node.id());
    let mut term = signal(SignalKind::terminate()).map_err(|e| Failure(e.to_string()))?;
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
        // A fault stopped the node: exit with its error, to be restarted.
        () = node.faulted() => {}
    }
    eprintln!("worker {name} stopping: finishing in-flight events, releasing partitions");
    node.shutdown().await?;
    eprintln!("worker {name} stopped");
    Ok(())
}

/// Pending and scheduled-for-later records per partition, FAILED records and the oldest pending age,
/// every 5 s.
async fn backlog_gauges(outbox: outbox_core::Outbox, db: outbox_core::Db) {
    let mut reported: BTreeSet<u8> = BTreeSet::new();
    let mut ticker = tokio::time::interval(Duration::from_secs(5));
    loop {
        ticker.tick().await;
        let stats = match outbox.stats(&db).await {
            Ok(stats) => stats,
            Err(e) => {
                warn!(error = %e, "reading backlog for metrics failed");
                continue;
            }
        };
        let now: BTreeSet<u8> = stats.iter().map(|s| s.partition).collect();
        for gone in reported.difference(&now) {
            metrics::gauge!("outbox_pending_records", "partition" => gone.to_string()).set(0.0);
            metrics::gauge!("outbox_scheduled_records", "partition" => gone.to_string()).set(0.0);
        }
        for s in &stats {
            metrics::gauge!("outbox_pending_records", "partition" => s.partition.to_string()).set(s.pending as f64);
            metrics::gauge!("outbox_scheduled_records", "partition" => s.partition.to_string()).set(s.scheduled as f64);
        }
        let totals = outbox_core::operator::BacklogTotals::of(&stats);
        metrics::gauge!("outbox_failed_records").set(totals.failed as f64);
        let oldest = totals.oldest_pending.unwrap_or_default();
        metrics::gauge!("outbox_oldest_pending_seconds").set(oldest.as_secs_f64());
        reported = now;
    }
}
