//! `worker`: one clustered instance delivering to JetStream, until SIGTERM or SIGINT, then a graceful
//! handover. Optionally serves Prometheus metrics.

use std::net::SocketAddr;

use clap::Args;
use metrics_exporter_prometheus::PrometheusBuilder;
use outbox_cluster::{ClusterConfig, Node};
use tokio::signal::unix::{SignalKind, signal};

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
