//! Operator commands: `status`, `failed list|requeue|skip`, `purge`, `migrate`.

use std::collections::BTreeMap;
use std::time::Duration;

use clap::Subcommand;
use outbox_core::operator::{BacklogTotals, FailedFilter};
use outbox_core::{Epoch, InstanceId};
use uuid::Uuid;

use crate::{Context, Failure};

/// `failed` subcommands.
#[derive(Subcommand, Debug)]
pub enum FailedCommand {
    /// Lists FAILED records (without payloads).
    List {
        /// Only this key.
        #[arg(long)]
        key: Option<String>,
        /// Only this partition.
        #[arg(long)]
        partition: Option<u8>,
        /// At most this many.
        #[arg(long, default_value_t = 100)]
        limit: i64,
    },
    /// Requeues a FAILED record (or all of a key) with a fresh retry budget.
    Requeue {
        /// The record id.
        #[arg(required_unless_present_any = ["key", "all"])]
        id: Option<Uuid>,
        /// Every FAILED record of this key instead.
        #[arg(long, conflicts_with_all = ["id", "all"])]
        key: Option<String>,
        /// Every FAILED record (after an outage that failed many).
        #[arg(long, conflicts_with = "id")]
        all: bool,
    },
    /// Marks a FAILED record handled without delivering it; its key's next record proceeds.
    Skip {
        /// The record id.
        id: Uuid,
    },
}

pub async fn migrate(ctx: &Context) -> Result<(), Failure> {
    ctx.outbox.migrate(&ctx.db).await?;
    crate::orders::create_tables(&ctx.db).await?;
    crate::consume::create_tables(&ctx.db).await?;
    println!("migrated: outbox schema {:?} and the demo tables are up to date", ctx.config.outbox.schema);
    Ok(())
}

pub async fn status(ctx: &Context) -> Result<(), Failure> {
    let cluster = outbox_cluster::status(&ctx.db, &ctx.outbox).await?;
    let stats = ctx.outbox.stats(&ctx.db).await?;
    println!("instances");
    let mut names: BTreeMap<InstanceId, String> = BTreeMap::new();
    for i in &cluster.instances {
        names.insert(i.id, i.name.clone());
        let age = Duration::from_millis(u64::try_from(i.heartbeat_age_ms).unwrap_or(0));
        println!(
            "  {:<16} {}  {:<5} last heartbeat {:>6.1?} ago  {:>3} partitions",
            i.name,
            i.id,
            if i.live { "live" } else { "stale" },
            age,
            i.partitions
        );
    }
    if cluster.instances.is_empty() {
        println!("  (none)");
    }
    println!("partitions per owner (epochs)");
    let mut by_owner: BTreeMap<String, Vec<(u8, Epoch, Option<Duration>)>> = BTreeMap::new();
    for p in &cluster.partitions {
        let owner =
            p.owner.map_or("(free)".to_string(), |id| names.get(&id).cloned().unwrap_or_else(|| id.to_string()));
        by_owner.entry(owner).or_default().push((p.partition, p.epoch, p.quiet));
    }
    for (owner, parts) in &by_owner {
        let (lo, hi) = parts.iter().fold((i64::MAX, i64::MIN), |(lo, hi), &(_, e, _)| (lo.min(e.0), hi.max(e.0)));
        let first: Vec<String> = parts.iter().take(8).map(|(p, ..)| p.to_string()).collect();
        let more = if parts.len() > 8 { ", …" } else { "" };
        // Taken from an owner whose lease ran out: delivered by nobody until the period ends.
        let quiet: Vec<Duration> = parts.iter().filter_map(|&(.., quiet)| quiet).collect();
        let quiet = match quiet.iter().max() {
            Some(longest) => format!("  {} quiet, for up to {longest:.1?} more", quiet.len()),
            None => String::new(),
        };
        println!(
            "  {owner:<16} {:>3} partitions  epochs {lo}..={hi}  [{}{more}]{quiet}",
            parts.len(),
            first.join(", ")
        );
    }
    let BacklogTotals { pending, scheduled, failed, oldest_pending: oldest } = BacklogTotals::of(&stats);
    println!("backlog");
    println!(
        "  pending {pending}  scheduled for later {scheduled}  FAILED {failed}  oldest pending {}",
        oldest.map_or("-".into(), |d| format!("{d:.1?}"))
    );
    let mut busiest: Vec<_> = stats.iter().filter(|s| s.pending > 0).collect();
    busiest.sort_by_key(|s| std::cmp::Reverse(s.pending));
    for s in busiest.iter().take(5) {
        println!("  partition {:>3}: {} pending", s.partition, s.pending);
    }
    Ok(())
}

pub async fn failed(ctx: &Context, command: FailedCommand) -> Result<(), Failure> {
    match command {
        FailedCommand::List { key, partition, limit } => {
            let filter = FailedFilter { key, partition, limit: Some(limit), ..FailedFilter::default() };
            let failed = ctx.outbox.failed(&ctx.db, &filter).await?;
            for f in &failed {
                println!(
                    "{}  key {:?}  seq {}  partition {}  {}  attempts {}  failed {}  {}",
                    f.id,
                    f.key,
                    f.seq,
                    f.partition,
                    f.event_type,
                    f.attempts,
                    f.failed_at.format("%Y-%m-%dT%H:%M:%SZ"),
                    f.last_error.as_deref().unwrap_or("")
                );
            }
            println!("{} FAILED records", failed.len());
        }
        FailedCommand::Requeue { id: Some(id), .. } => {
            ctx.outbox.requeue(&ctx.db, id).await?;
            println!("requeued {id}");
        }
        FailedCommand::Requeue { all: true, .. } => {
            let n = ctx.outbox.requeue_all(&ctx.db).await?;
            println!("requeued {n} FAILED records");
        }
        FailedCommand::Requeue { key: Some(key), .. } => {
            let n = ctx.outbox.requeue_key(&ctx.db, &key).await?;
            println!("requeued {n} records of key {key:?}");
        }
        FailedCommand::Requeue { .. } => return Err(Failure("give a record id, --key or --all".into())),
        FailedCommand::Skip { id } => {
            ctx.outbox.skip(&ctx.db, id).await?;
            println!("skipped {id}");
        }
    }
    Ok(())
}

pub async fn purge(ctx: &Context, older_than: Duration) -> Result<(), Failure> {
    let n = ctx.outbox.purge_completed(&ctx.db, older_than, ctx.config.outbox.purge_batch_size).await?;
    println!("purged {n} completed records older than {}", humantime::format_duration(older_than));
    let keys = ctx.outbox.prune_keys(&ctx.db, ctx.config.outbox.purge_batch_size).await?;
    println!("pruned {keys} lock rows of keys with no record left");
    // The consumer's record of the messages it applied (each key's last sequence, which orders its
    // events, is kept): a message is redelivered within seconds (the consumer's ack_wait), not hours.
    let inbox = ctx.outbox.inbox().purge(&ctx.db, older_than, ctx.config.outbox.purge_batch_size).await?;
    println!("purged {inbox} inbox rows of messages consumed more than {} ago", humantime::format_duration(older_than));
    Ok(())
}
