//! Partition ownership, one round every `rebalance_interval`: the leader writes balanced targets, each
//! instance releases what is targeted elsewhere once nothing of it is in flight (release-before-acquire)
//! and acquires what is targeted at it, free or of a dead owner. Every acquisition and release bumps
//! the partition's epoch; the processor fences every write with the (owner, epoch) it was given.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use outbox_core::{Assignment, Epoch, Epochs, InstanceId, Partition};
use tokio::sync::watch;
use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::config::ClusterConfig;
use crate::driver::Store;
use crate::error::Result;
use crate::rebalance::{self, Targets};
use crate::stored::{PartitionRow, View};

/// The ownership task of one node.
pub(crate) struct Ownership {
    pub(crate) store: Store,
    pub(crate) config: ClusterConfig,
    pub(crate) assign: Arc<watch::Sender<Assignment>>,
    /// Partitions with records in flight in the processor.
    pub(crate) busy: watch::Receiver<BTreeSet<Partition>>,
}

/// What the ownership task carries from one round to the next, for one instance id.
struct Rounds {
    instance: InstanceId,
    /// Partitions taken away from the processor in an earlier round, waiting to be released.
    giving_up: BTreeSet<Partition>,
    /// Partitions taken from a dead owner, held back from the processor until their quiet period ends.
    quiet: BTreeMap<Partition, (Epoch, Instant)>,
    /// When this instance, as the leader, last reaped expired instance rows.
    reaped: Option<Instant>,
}

impl Rounds {
    fn new(instance: InstanceId) -> Self {
        Self { instance, giving_up: BTreeSet::new(), quiet: BTreeMap::new(), reaped: None }
    }
}

impl Ownership {
    pub(crate) async fn run(self, shutdown: CancellationToken) {
        let mut ticker = tokio::time::interval(self.config.rebalance_interval);
        ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut rounds = Rounds::new(self.assign.borrow().instance);
        loop {
            let quiet_ends = rounds.quiet.values().map(|&(_, until)| until).min();
            tokio::select! {
                () = shutdown.cancelled() => return,
                _ = ticker.tick() => {}
                // A stolen partition's quiet period is over: hand it to the processor now.
                () = sleep_until_opt(quiet_ends) => {}
            }
            let current = self.assign.borrow().clone();
            if !current.is_live() {
                continue;
            }
            if rounds.instance != current.instance {
                rounds = Rounds::new(current.instance);
            }
            if let Err(e) = self.round(&mut rounds).await {
                warn!(instance = %current.instance, error = %e, "ownership round failed");
            }
        }
    }

    /// One round: rebalance (leader only), release, acquire, publish the assignment (unless the instance
    /// registered again meanwhile: this round's view is then stale).
    async fn round(&self, rounds: &mut Rounds) -> Result<()> {
        let id = rounds.instance;
        let View { live, partitions: rows } = self.store.view().await?;
        let targets: Targets = if live.first() == Some(&id) {
            // Housekeeping for the cluster, once per stale timeout: forget instances whose lease expired
            // two stale timeouts ago (their partitions have moved on long since).
            if rounds.reaped.is_none_or(|at| at.elapsed() >= self.config.stale_timeout) {
                self.store.reap(self.config.stale_timeout * 2).await?;
                rounds.reaped = Some(Instant::now());
            }
            rebalance_targets(&self.store, id, &live, &rows).await?
        } else {
            rows.iter().filter_map(|r| r.target.map(|t| (r.partition, t))).collect()
        };
        let mine = |p: &Partition| targets.get(p) == Some(&id);

        // Release what the processor stopped fetching in an earlier round and has nothing in flight.
        // Waiting one round closes the gap between a dispatch and its appearance in `busy`.
        let in_flight = self.busy.borrow().clone();
        let release: Epochs = rows
            .iter()
            .filter(|r| r.owner == Some(id))
            .filter(|r| {
                rounds.giving_up.contains(&r.partition) && !mine(&r.partition) && !in_flight.contains(&r.partition)
            })
            .map(|r| (r.partition, r.epoch))
            .collect();
        let mut changed = !release.is_empty();
        if changed {
            release_partitions(&self.store, id, &release, "rebalance").await?;
        }
        if rows.iter().any(|r| mine(&r.partition) && r.owner != Some(id)) {
            for (partition, epoch, quiet) in self.acquire(id).await? {
                changed = true;
                if let Some(quiet) = quiet {
                    rounds.quiet.insert(partition, (epoch, Instant::now() + quiet));
                }
            }
        }

        // What this round read is what this instance owns unless it released or took partitions (no
        // other instance takes them while its lease is live).
        let owned = if changed {
            self.store.owned(id).await?
        } else {
            rows.iter().filter(|r| r.owner == Some(id)).map(|r| (r.partition, r.epoch)).collect()
        };
        rounds.giving_up = owned.keys().copied().filter(|p| !mine(p)).collect();
        rounds.quiet.retain(|p, (epoch, until)| owned.get(p) == Some(epoch) && *until > Instant::now());
        let keep: Epochs = owned.into_iter().filter(|(p, _)| mine(p) && !rounds.quiet.contains_key(p)).collect();
        metrics::gauge!("outbox_owned_partitions").set(keep.len() as f64);
        metrics::gauge!("outbox_live_instances").set(live.len() as f64);
        self.assign.send_if_modified(|current| {
            let changed = current.instance == id && current.epochs != keep;
            if changed {
                current.epochs = keep;
            }
            changed
        });
        Ok(())
    }

    /// Acquires the partitions targeted at `me` that are free or whose owner is dead; returns each with
    /// its new epoch and, if taken from an owner whose lease expired, its quiet period: deliver nothing
    /// of it for the time the previous owner needs to notice and stop (two of its heartbeat intervals,
    /// or of ours if longer or if its row is gone).
    async fn acquire(&self, me: InstanceId) -> Result<Vec<(Partition, Epoch, Option<Duration>)>> {
        let taken = self.store.acquire(me).await?;
        Ok(taken
            .into_iter()
            .map(|t| {
                let (partition, epoch) = (t.partition, t.epoch);
                let quiet = t.previous.map(|previous| {
                    let theirs = Duration::from_millis(
                        t.previous_heartbeat_ms.and_then(|ms| u64::try_from(ms).ok()).unwrap_or(0),
                    );
                    let quiet = 2 * theirs.max(self.config.heartbeat_interval);
                    info!(partition, %epoch, instance = %me, %previous, reason = "owner lease expired", ?quiet,
                        "partition stolen; delivering it after the quiet period");
                    quiet
                });
                if quiet.is_none() {
                    info!(partition, %epoch, instance = %me, reason = "free", "partition acquired");
                }
                (partition, epoch, quiet)
            })
            .collect())
    }
}

async fn sleep_until_opt(deadline: Option<Instant>) {
    match deadline {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Computes the targets from the database's view and writes those that changed; returns them all.
async fn rebalance_targets(
    store: &Store,
    me: InstanceId,
    live: &[InstanceId],
    rows: &[PartitionRow],
) -> Result<Targets> {
    let is_live = |id: &InstanceId| live.contains(id);
    // A partition's present holder: its target if that is live, else its owner if live.
    let current = rows
        .iter()
        .filter_map(|r| r.target.filter(is_live).or(r.owner.filter(is_live)).map(|h| (r.partition, h)))
        .collect();
    let targets = rebalance::assign(live, &current);
    let stored: Targets = rows.iter().filter_map(|r| r.target.map(|t| (r.partition, t))).collect();
    if targets == stored {
        return Ok(targets);
    }
    let changed = store.set_targets(&targets).await?;
    if !changed.is_empty() {
        metrics::counter!("outbox_rebalances_total").increment(1);
        info!(instance = %me, live = live.len(), moved = changed.len(), "rebalanced: partition targets changed");
    }
    Ok(targets)
}

/// Releases `partitions` (at their epochs); logs each one that was still ours.
async fn release_partitions(store: &Store, me: InstanceId, partitions: &Epochs, reason: &'static str) -> Result<()> {
    for partition in store.release(me, partitions).await? {
        info!(partition, instance = %me, reason, "partition released");
    }
    Ok(())
}

/// A graceful exit: points the targets at the remaining instances (so they acquire at their next
/// round), releases the partitions `me` owns and deregisters it.
pub(crate) async fn hand_over(store: &Store, me: InstanceId) -> Result<()> {
    let View { live, partitions: rows } = store.view().await?;
    if !live.is_empty() {
        rebalance_targets(store, me, &live, &rows).await?;
    }
    let owned = store.owned(me).await?;
    release_partitions(store, me, &owned, "graceful shutdown").await?;
    store.deregister(me).await
}
