//! `run`: the whole story in one process, printed as it happens. Orders are placed while three workers
//! share the 256 partitions; a fourth joins, one leaves gracefully, one crashes; the partition map,
//! backlog, throughput and a running per-order check are printed every second; a verification of the
//! stream against the database ends it.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Args;
use outbox_cluster::{ClusterConfig, Node};
use outbox_core::InstanceId;
use uuid::Uuid;

use crate::orders::{self, OrderEvent, ProduceArgs};
use crate::sink::Sink;
use crate::{Context, Failure, operator, verify, worker};

/// `run` options.
#[derive(Args, Debug, Clone)]
pub struct RunArgs {
    /// Orders to place.
    #[arg(long, default_value_t = 300)]
    pub orders: u32,
    /// Events per order.
    #[arg(long, default_value_t = 3)]
    pub events_per_order: u32,
    /// Producer transactions per second.
    #[arg(long, default_value_t = 100.0)]
    pub rate: f64,
    /// Seconds between the story's steps (join, graceful leave, crash).
    #[arg(long, default_value_t = 3)]
    pub step_secs: u64,
    /// Serve the operator's page here while the story plays (a free port if this one is taken).
    #[arg(long, default_value_t = outbox_cluster::admin::DEFAULT_ADDR)]
    pub admin_addr: SocketAddr,
}

impl Default for RunArgs {
    fn default() -> Self {
        Self {
            orders: 300,
            events_per_order: 3,
            rate: 100.0,
            step_secs: 3,
            admin_addr: outbox_cluster::admin::DEFAULT_ADDR,
        }
    }
}

/// Fast tunables so a crash is taken over within about a second of the story.
fn story_cluster(name: &str) -> ClusterConfig {
    ClusterConfig {
        name: name.into(),
        heartbeat_interval: Duration::from_millis(200),
        stale_timeout: Duration::from_secs(1),
        rebalance_interval: Duration::from_millis(300),
    }
}

/// Running check of the stream: each order's events must first appear in sequence.
#[derive(Default)]
struct Checker {
    next_seq: u64,
    seen: BTreeSet<Uuid>,
    last: BTreeMap<String, u32>,
    violations: usize,
    duplicates: usize,
}

impl Checker {
    fn feed(&mut self, events: &[OrderEvent]) {
        for e in events {
            if !self.seen.insert(e.event_id) {
                self.duplicates += 1;
                continue;
            }
            let last = self.last.entry(e.key.clone()).or_insert(0);
            if e.seq != *last + 1 {
                self.violations += 1;
            }
            *last = (*last).max(e.seq);
        }
    }
}

pub async fn run(ctx: &Context, args: RunArgs) -> Result<ExitCode, Failure> {
    operator::migrate(ctx).await?;
    let table = |name| ctx.outbox.table(&ctx.db, name);
    let (records, completed) = (table("records"), table("completed"));
    let reset = format!(
        "DELETE FROM demo_orders; DELETE FROM demo_order_events; DELETE FROM demo_read_model; DELETE FROM {records};
         DELETE FROM {completed}"
    );
    ctx.db.execute_script(sqlx::AssertSqlSafe(reset)).await?;
    let mut stream = Sink::open(ctx, true).await?;
    // A fresh story: the verification compares this run's stream with this run's orders.
    stream.purge().await?;
    let start_seq = stream.last_seq().await? + 1;
    let target = match &ctx.target {
        crate::sink::Target::JetStream => format!("NATS JetStream stream {:?}", ctx.config.nats.stream.name),
        crate::sink::Target::Local(path) => format!("the local sink {} (set NATS_URL for JetStream)", path.display()),
    };
    println!(
        "== outbox demo: {} orders × {} events, workers joining, leaving and crashing ==",
        args.orders, args.events_per_order
    );
    println!("   database: {}; events go to {target}", ctx.db.backend());
    let page = match crate::admin::serve(ctx, args.admin_addr).await {
        Ok(bound) => bound,
        Err(_) => crate::admin::serve(ctx, SocketAddr::new(args.admin_addr.ip(), 0)).await?,
    };
    println!(
        "   operator page: {} (partitions, backlog, FAILED records; while the story plays)",
        crate::admin::url(page)
    );

    let mut nodes: BTreeMap<String, Node> = BTreeMap::new();
    for name in ["w1", "w2", "w3"] {
        nodes.insert(name.into(), worker::start_node(ctx, story_cluster(name)).await?);
        println!("  {name} joins");
    }
    let produce = ProduceArgs {
        orders: args.orders,
        events_per_order: args.events_per_order,
        rate: args.rate,
        rollback_fraction: 0.1,
        concurrency: 4,
    };
    let mut producer = {
        let (outbox, db) = (ctx.outbox.clone(), ctx.db.clone());
        Some(tokio::spawn(async move { orders::produce(&outbox, &db, &produce).await }))
    };
    let mut produced = orders::Produced::default();

    let started = Instant::now();
    let step = Duration::from_secs(args.step_secs.max(1));
    let mut story =
        vec![("w4 joins", 1), ("w2 leaves gracefully", 2), ("w3 crashes (no handover: its lease must expire)", 3)];
    story.reverse();
    let mut checker = Checker { next_seq: start_seq, ..Checker::default() };
    let mut ticker = tokio::time::interval(Duration::from_secs(1));
    let mut delivered_before = 0;
    loop {
        ticker.tick().await;
        if let Some(&(what, at)) = story.last()
            && started.elapsed() >= step * at
        {
            story.pop();
            println!("  {what}");
            match at {
                1 => {
                    nodes.insert("w4".into(), worker::start_node(ctx, story_cluster("w4")).await?);
                }
                2 => {
                    if let Some(node) = nodes.remove("w2") {
                        node.shutdown().await?;
                    }
                }
                _ => {
                    if let Some(node) = nodes.remove("w3") {
                        node.kill();
                    }
                }
            }
        }
        let last_seq = stream.last_seq().await?;
        if last_seq >= checker.next_seq {
            let events = stream.read_range(checker.next_seq, last_seq).await?;
            checker.feed(&events);
            checker.next_seq = last_seq + 1;
        }
        // Before the backlog is read: a backlog read before the producer's last commit would end the story
        // with that commit undelivered.
        if let Some(task) = producer.take_if(|task| task.is_finished()) {
            produced = task.await.map_err(|e| Failure(e.to_string()))??;
            println!(
                "  producer done: {} events committed, {} transactions rolled back",
                produced.committed, produced.rolled_back
            );
        }
        let delivered = checker.seen.len();
        let pending = outbox_core::operator::BacklogTotals::of(&ctx.outbox.stats(&ctx.db).await?).pending;
        let map = partition_map(ctx).await?;
        println!(
            "t={:>3}s  {map:<40} pending {pending:>5}  delivered {delivered:>6} (+{}/s)  order violations {}  duplicates {}",
            started.elapsed().as_secs(),
            delivered - delivered_before,
            checker.violations,
            checker.duplicates
        );
        delivered_before = delivered;
        if producer.is_none() && story.is_empty() && pending == 0 {
            break;
        }
        if started.elapsed() > Duration::from_secs(300) {
            return Err(Failure("the story did not finish within 5 minutes; see `outbox-demo status`".into()));
        }
    }
    for (_, node) in std::mem::take(&mut nodes) {
        node.shutdown().await?;
    }
    println!();
    println!("== verification (stream vs database) ==");
    println!("transactions rolled back on purpose  {}", produced.rolled_back);
    let report = verify::verify(ctx).await?;
    report.print();
    Ok(if report.ok() { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

/// "w1:86 w3:85 w4:85" from the database's ownership.
async fn partition_map(ctx: &Context) -> Result<String, Failure> {
    let status = outbox_cluster::status(&ctx.db, &ctx.outbox).await?;
    let names: BTreeMap<InstanceId, &str> = status.instances.iter().map(|i| (i.id, i.name.as_str())).collect();
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    for p in &status.partitions {
        let owner = p.owner.and_then(|o| names.get(&o).copied()).unwrap_or("free");
        *counts.entry(owner).or_default() += 1;
    }
    Ok(counts.iter().map(|(n, c)| format!("{n}:{c}")).collect::<Vec<_>>().join(" "))
}
