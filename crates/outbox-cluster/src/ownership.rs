//! Partition ownership, one round every `rebalance_interval`: the leader writes balanced targets, each
//! instance releases what is targeted elsewhere once nothing of it is in flight (release-before-acquire)
//! and acquires what is targeted at it, free or of a dead owner. Every acquisition and release bumps
//! the partition's epoch; the processor fences every write with the (owner, epoch) it was given.
//!
//! A handover does not wait for tickers: whoever changes a target nudges the instances that must act
//! (the owner that must let go, or the new target of a free partition), a release nudges the
//! partition's new target, and a new instance nudges the leader ([`Outbox::nudge`]). A partition given
//! up is released the moment its last record in flight is completed. The tickers stay the safety net.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use chrono::{DateTime, Utc};
use outbox_core::{Assignment, Epoch, Epochs, InstanceId, Outbox, Partition};
use tokio::sync::watch;
use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::config::ClusterConfig;
use crate::driver::Store;
use crate::error::Result;
use crate::rebalance::{self, Targets};
use crate::stored::{PartitionRow, Taken, View, quiet};

/// The ownership task of one node.
pub(crate) struct Ownership {
    pub(crate) outbox: Outbox,
    pub(crate) store: Store,
    pub(crate) config: ClusterConfig,
    pub(crate) assign: Arc<watch::Sender<Assignment>>,
    /// Partitions with records in flight in the processor.
    pub(crate) busy: watch::Receiver<BTreeSet<Partition>>,
    /// Cancelled when the instance leaves gracefully (after it was marked draining): its rounds then
    /// point its partitions' targets at the others and hand them over one by one, as in a rebalance.
    pub(crate) leaving: CancellationToken,
    /// Whether this instance owns nothing, as of its last round or release.
    pub(crate) holds_none: Arc<watch::Sender<bool>>,
    /// Bumped by the heartbeat to ask for a round (see `Heartbeat::asks_round`).
    pub(crate) asks_round: Arc<AtomicU64>,
    /// Whether this instance leads the cluster (and is not leaving), as of its last round, and only
    /// while its lease is live: the leader runs the purge and reads the backlog gauges.
    pub(crate) leads: watch::Sender<bool>,
}

/// Partitions in a quiet period (taken from a dead owner, or later in the period), each at its epoch
/// with the period's end.
type Quiet = BTreeMap<Partition, (Epoch, Instant)>;

/// What the ownership task carries from one round to the next, for one instance id.
struct Rounds {
    instance: InstanceId,
    /// Partitions taken out of the processor's assignment, to release once none of their records is in
    /// flight: each at its epoch, with the instance it is targeted at.
    giving_up: BTreeMap<Partition, (Epoch, Option<InstanceId>)>,
    /// Partitions in a quiet period, held back from the processor until it ends.
    quiet: Quiet,
    /// Partitions of a release that went unanswered (given up at its time limit, or its answer lost),
    /// each at the epoch it was sent for: it may still commit, and the next owner then takes the
    /// partition as free, with no quiet period of its own (only what is left of one stored). Until a
    /// release of them is answered they stay out of the processor's assignment, even if targeted here
    /// again, and are released again.
    unanswered: Epochs,
    /// When this instance, as the leader, last reaped expired instance rows.
    reaped: Option<Instant>,
    /// Whether a round has run under this id (after its first, a new instance nudges the leader).
    started: bool,
    /// Whether a round has run since the instance began to leave.
    leaving: bool,
    /// When the end of a quiet period last woke the task: periods that ended before are not waited for.
    quiet_seen: Instant,
}

impl Rounds {
    fn new(instance: InstanceId) -> Self {
        Self {
            instance,
            giving_up: BTreeMap::new(),
            quiet: BTreeMap::new(),
            unanswered: Epochs::new(),
            reaped: None,
            started: false,
            leaving: false,
            quiet_seen: Instant::now(),
        }
    }
}

impl Ownership {
    pub(crate) async fn run(self, shutdown: CancellationToken) {
        let mut ticker = tokio::time::interval(self.config.rebalance_interval);
        ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut nudges = self.outbox.nudges();
        let mut busy = self.busy.clone();
        let mut rounds = Rounds::new(self.assign.borrow().instance);
        // Woken by every change of the assignment, to see whether the heartbeat asks for a round.
        let mut changes = self.assign.subscribe();
        let mut answered = self.asks_round.load(Ordering::Acquire);
        loop {
            let asked = self.asks_round.load(Ordering::Acquire) != answered;
            // Each quiet period's end fires once: a period that has ended stays (the next round hands its
            // partition on), but its timer, already past, fired on every pass while the lease was out
            // or rounds failed, a spin.
            let seen = rounds.quiet_seen;
            let quiet_ends = rounds.quiet.values().map(|&(_, until)| until).filter(|&until| until > seen).min();
            let whole_round = tokio::select! {
                () = shutdown.cancelled() => return,
                _ = ticker.tick() => true,
                // A partition's quiet period is over: hand it to the processor now.
                () = sleep_until_opt(quiet_ends) => {
                    rounds.quiet_seen = Instant::now();
                    true
                }
                nudge = nudges.next() => {
                    if !nudge.names(self.assign.borrow().instance) {
                        continue;
                    }
                    debug!(instance = %self.assign.borrow().instance, "nudged: running an ownership round now");
                    true
                }
                // Records of a partition being given up were completed: it may be free to release.
                Ok(()) = busy.changed(), if !rounds.giving_up.is_empty() => false,
                () = self.leaving.cancelled(), if !rounds.leaving => {
                    rounds.leaving = true;
                    true
                }
                () = std::future::ready(()), if asked => true,
                Ok(()) = changes.changed(), if !asked => continue,
            };
            let asks = self.asks_round.load(Ordering::Acquire);
            let whole_round = whole_round || asks != answered;
            answered = asks;
            let current = self.assign.borrow().clone();
            if !current.is_live() {
                // The processor delivers nothing past the lease, and the others may have a leader by now:
                // this instance's housekeeping stops (its gauges go back to 0) until a round says again.
                metrics::gauge!("outbox_owned_partitions", "schema" => self.outbox.schema_label()).set(0.0);
                self.leads.send_replace(false);
                continue;
            }
            if rounds.instance != current.instance {
                rounds = Rounds::new(current.instance);
            }
            let done =
                if whole_round { self.round(&mut rounds).await } else { self.release_drained(&mut rounds).await };
            if let Err(e) = done {
                warn!(instance = %current.instance, error = %e, "ownership round failed");
            }
        }
    }

    /// One round: rebalance (leader only), acquire, publish the assignment (unless the instance
    /// registered again meanwhile: this round's view is then stale), release what was given up and is
    /// no longer in flight.
    async fn round(&self, rounds: &mut Rounds) -> Result<()> {
        let (id, began) = (rounds.instance, Instant::now());
        let View { mut live, partitions: rows } = self.store.view().await?;
        if self.leaving.is_cancelled() && live.contains(&id) {
            // Registered again (declared dead) after the node began to leave: this id leaves too, or the
            // rounds would count it live and hand it partitions it never gives back.
            self.store.drain(id).await?;
            live.retain(|&other| other != id);
        }
        let leader = live.first() == Some(&id);
        self.leads.send_replace(leader && !self.leaving.is_cancelled());
        let targets: Targets = if self.leaving.is_cancelled() {
            // Leaving (no longer counted live): its partitions go to the others without waiting for the
            // leader.
            rebalance_targets(&self.outbox, &self.store, id, &live, &rows).await?
        } else if leader {
            rebalance_targets(&self.outbox, &self.store, id, &live, &rows).await?
        } else {
            rows.iter().filter_map(|r| r.target.map(|t| (r.partition, t))).collect()
        };
        let mine = |p: &Partition| targets.get(p) == Some(&id);

        // What this round read is what this instance owns, with what it takes now (no other instance
        // takes its partitions while its lease is live).
        let mut owned: Epochs = rows.iter().filter(|r| r.owner == Some(id)).map(|r| (r.partition, r.epoch)).collect();
        // When each was last taken from an owner that did not give it up: the processor counts the calls
        // of records scheduled before then before making them.
        let mut taken_over_at: BTreeMap<Partition, DateTime<Utc>> =
            rows.iter().filter_map(|r| Some((r.partition, r.taken_over_at?))).collect();
        self.hold_back_unheard(rounds, &owned, &rows);
        if rows.iter().any(|r| mine(&r.partition) && r.owner != Some(id)) {
            for (taken, quiet) in self.acquire(id).await? {
                owned.insert(taken.partition, taken.epoch);
                if let Some(at) = taken.taken_over_at {
                    taken_over_at.insert(taken.partition, at);
                }
                if let Some(quiet) = quiet {
                    rounds.quiet.insert(taken.partition, (taken.epoch, Instant::now() + quiet));
                }
            }
        }
        rounds.quiet.retain(|p, (epoch, until)| owned.get(p) == Some(epoch) && *until > Instant::now());
        rounds.unanswered.retain(|p, epoch| owned.get(p) == Some(epoch));
        let unanswered = |p: &Partition| rounds.unanswered.contains_key(p);
        let keep: Epochs = owned
            .iter()
            .filter(|(p, _)| mine(p) && !rounds.quiet.contains_key(p) && !unanswered(p))
            .map(|(&p, &e)| (p, e))
            .collect();
        let schema = self.outbox.schema_label();
        metrics::gauge!("outbox_owned_partitions", "schema" => schema.clone()).set(keep.len() as f64);
        metrics::gauge!("outbox_live_instances", "schema" => schema).set(live.len() as f64);
        let taken_over: BTreeMap<Partition, DateTime<Utc>> =
            keep.keys().filter_map(|p| Some((*p, *taken_over_at.get(p)?))).collect();
        self.assign.send_if_modified(|current| {
            let changed = current.instance == id && (current.epochs != keep || current.taken_over != taken_over);
            if changed {
                current.epochs = keep;
                current.taken_over = taken_over;
            }
            changed
        });
        // Out of the assignment now; released below once nothing of them is in flight.
        rounds.giving_up = owned
            .into_iter()
            .filter(|(p, _)| !mine(p) || unanswered(p))
            .map(|(p, epoch)| (p, (epoch, targets.get(&p).copied())))
            .collect();
        self.release_drained(rounds).await?;
        if !rounds.started {
            rounds.started = true;
            // A new instance: the leader need not wait for its own round to give it a share.
            if let Some(&leader) = live.first().filter(|&&leader| leader != id) {
                nudge(&self.outbox, &self.store, id, [leader]).await;
            }
        }
        if leader && !self.leaving.is_cancelled() {
            self.reap(rounds).await;
        }
        metrics::histogram!("outbox_ownership_round_seconds", "schema" => self.outbox.schema_label(), "leader" => leader.to_string())
            .record(began.elapsed().as_secs_f64());
        Ok(())
    }

    /// The leader's housekeeping, once per stale timeout, after the round's own work: forgets the
    /// instances whose lease expired two stale timeouts ago (their partitions moved on long since), or
    /// twice their own heartbeat interval if longer (until then, their quiet periods need it). A
    /// failure only waits for the next time: a row that cannot be deleted (on MySQL, locked by a client
    /// whose host vanished) must not keep the cluster from being rebalanced.
    async fn reap(&self, rounds: &mut Rounds) {
        if rounds.reaped.is_some_and(|at| at.elapsed() < self.config.stale_timeout) {
            return;
        }
        rounds.reaped = Some(Instant::now());
        if let Err(e) = self.store.reap(self.config.stale_timeout * 2).await {
            warn!(instance = %rounds.instance, error = %e, "deleting the rows of instances dead long since failed; trying again after stale_timeout");
        }
    }

    /// Holds back the partitions `owned` that this instance never heard it acquired: an acquisition
    /// whose reply was lost (committed, then the connection dropped). Their previous owner, unknown, may
    /// still be delivering: they wait out the quiet period that acquisition stored, as `rows` show it.
    fn hold_back_unheard(&self, rounds: &mut Rounds, owned: &Epochs, rows: &[PartitionRow]) {
        let held = self.held(rounds);
        for (partition, epoch) in unheard(&held, owned) {
            let Some(quiet) = rows.iter().find(|r| r.partition == partition).and_then(|r| r.quiet) else { continue };
            warn!(partition, %epoch, instance = %rounds.instance, ?quiet,
                "owning a partition whose acquisition was never confirmed; delivering it after its quiet period");
            rounds.quiet.insert(partition, (epoch, Instant::now() + quiet));
        }
    }

    /// What the rounds know this instance owns, each at its epoch: the partitions handed to the
    /// processor, being given up, or quiet.
    fn held(&self, rounds: &Rounds) -> Epochs {
        let assignment = self.assign.borrow();
        let giving_up = rounds.giving_up.iter().map(|(&p, &(e, _))| (p, e));
        let quiet = rounds.quiet.iter().map(|(&p, &(e, _))| (p, e));
        assignment.epochs.iter().map(|(&p, &e)| (p, e)).chain(giving_up).chain(quiet).collect()
    }

    /// Releases the partitions given up that have nothing in flight any more (read after the
    /// assignment without them was sent, so none of their records can be dispatched), and nudges the
    /// instances they go to. One in its quiet period goes too: its next owner waits out the rest.
    async fn release_drained(&self, rounds: &mut Rounds) -> Result<()> {
        let busy = self.busy.borrow().clone();
        let release: Epochs =
            rounds.giving_up.iter().filter(|(p, _)| !busy.contains(p)).map(|(&p, &(epoch, _))| (p, epoch)).collect();
        if !release.is_empty() {
            let released = release_partitions(&self.store, rounds.instance, &release, "rebalance").await;
            let freed = released.inspect_err(|_| rounds.unanswered.extend(&release))?;
            rounds.unanswered.retain(|p, _| !release.contains_key(p));
            let to = freed.iter().filter_map(|p| rounds.giving_up.get(p).and_then(|&(_, to)| to));
            let to: BTreeSet<InstanceId> = to.collect();
            rounds.giving_up.retain(|p, _| !release.contains_key(p));
            rounds.quiet.retain(|p, _| !release.contains_key(p));
            nudge(&self.outbox, &self.store, rounds.instance, to).await;
        }
        // Nothing handed to the processor, held back or being given up.
        let none = rounds.giving_up.is_empty() && rounds.quiet.is_empty() && self.assign.borrow().epochs.is_empty();
        self.holds_none.send_replace(none);
        Ok(())
    }

    /// Acquires the partitions targeted at `me` that are free or whose owner is dead; returns each with
    /// what is left of its quiet period, if it is in one (see [`Store::acquire`]): deliver nothing of it
    /// until then.
    async fn acquire(&self, me: InstanceId) -> Result<Vec<(Taken, Option<Duration>)>> {
        let taken = self.store.acquire(me, self.config.heartbeat_interval).await?;
        let taken: Vec<(Taken, Option<Duration>)> =
            taken.into_iter().map(|t| (t, t.quiet_ms.and_then(quiet))).collect();
        // One line per previous owner (or none: free) and quiet period, not one per partition (256 when
        // one instance takes everything).
        let mut lines: BTreeMap<_, Vec<(Partition, Epoch)>> = BTreeMap::new();
        for (t, quiet) in &taken {
            lines.entry((t.previous, *quiet)).or_default().push((t.partition, t.epoch));
        }
        for ((previous, quiet), partitions) in &lines {
            let (count, listed) = (partitions.len(), at_epochs(partitions.iter().copied()));
            match previous {
                Some(previous) => {
                    info!(instance = %me, %previous, reason = "owner lease expired", ?quiet, count, partitions = %listed,
                        "partitions stolen (partition@epoch); delivering them after the quiet period");
                    metrics::counter!("outbox_partitions_taken_over_total", "schema" => self.outbox.schema_label())
                        .increment(count as u64);
                }
                None => info!(instance = %me, reason = "free", ?quiet, count, partitions = %listed,
                    "partitions acquired (partition@epoch); delivering them after what is left of their quiet period, if any"),
            }
        }
        Ok(taken)
    }
}

/// Partitions with their epochs, in order, as `3@7, 9@2`, for a log line that names many.
fn at_epochs(partitions: impl IntoIterator<Item = (Partition, Epoch)>) -> String {
    let mut partitions: Vec<(Partition, Epoch)> = partitions.into_iter().collect();
    partitions.sort_unstable();
    let listed: Vec<String> = partitions.iter().map(|(p, e)| format!("{p}@{e}")).collect();
    listed.join(", ")
}

async fn sleep_until_opt(deadline: Option<Instant>) {
    match deadline {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Computes the targets from the database's view and writes those that changed; returns them all.
/// Nudges who must act on a change: a live owner, to let go; the new target of a partition that is
/// free or whose owner is dead, to take it (the rest are nudged by their owner's release).
async fn rebalance_targets(
    outbox: &Outbox,
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
        metrics::counter!("outbox_rebalances_total", "schema" => outbox.schema_label()).increment(1);
        info!(instance = %me, live = live.len(), moved = changed.len(), "rebalanced: partition targets changed");
        let acts = changed.iter().filter_map(|&p| {
            let owner = rows.iter().find(|r| r.partition == p).and_then(|r| r.owner).filter(is_live);
            owner.or(targets.get(&p).copied())
        });
        let acts: BTreeSet<InstanceId> = acts.filter(|&id| id != me).collect();
        nudge(outbox, store, me, acts).await;
    }
    Ok(targets)
}

/// Nudges the ownership rounds of `instances`; a nudge that cannot be sent costs only their wait for
/// their next round.
async fn nudge(outbox: &Outbox, store: &Store, me: InstanceId, instances: impl IntoIterator<Item = InstanceId>) {
    let instances: Vec<InstanceId> = instances.into_iter().collect();
    if let Err(e) = outbox.nudge(store.db(), &instances).await {
        warn!(instance = %me, nudged = ?instances, error = %e, "could not nudge instances; they act at their next round");
    }
}

/// Releases `partitions` (at their epochs); logs and returns each one that was still ours.
async fn release_partitions(
    store: &Store,
    me: InstanceId,
    partitions: &Epochs,
    reason: &'static str,
) -> Result<Vec<Partition>> {
    let freed = store.release(me, partitions).await.inspect_err(|e| {
        let partitions: Vec<Partition> = partitions.keys().copied().collect();
        warn!(instance = %me, reason, ?partitions, error = %e,
            "releasing partitions failed or went unanswered; nobody delivers them until a release is answered or this instance's lease ends");
    })?;
    if !freed.is_empty() {
        let listed = at_epochs(freed.iter().filter_map(|&p| Some((p, *partitions.get(&p)?))));
        info!(instance = %me, reason, count = freed.len(), partitions = %listed,
            "partitions released (partition@epoch)");
    }
    Ok(freed)
}

/// A graceful exit: releases the partitions `me` owns and deregisters `me`; returns the partitions
/// moved on, whose next owners [`tell_next_owners`] then speeds up. One still in its quiet period (the
/// exit did not wait for it), or owned by an acquisition the rounds never heard of, goes too: the
/// period is stored with it, and its next owner waits out the rest.
pub(crate) async fn hand_over(store: &Store, me: InstanceId) -> Result<Vec<Partition>> {
    let owned = store.owned(me).await?;
    // Usually empty: the leaving rounds handed everything over already.
    let freed =
        if owned.is_empty() { Vec::new() } else { release_partitions(store, me, &owned, "graceful shutdown").await? };
    store.deregister(me).await?;
    Ok(freed)
}

/// The partitions of `owned` that `held` does not hold at the same epoch: acquired by an acquisition
/// whose reply was lost.
fn unheard<'a>(held: &'a Epochs, owned: &'a Epochs) -> impl Iterator<Item = (Partition, Epoch)> + 'a {
    owned.iter().filter(|(p, epoch)| held.get(p) != Some(*epoch)).map(|(&p, &e)| (p, e))
}

/// After a graceful exit: points the targets at the remaining instances and nudges the new targets of
/// `moved`, so they take them now rather than at their next round. Only a speed-up (the leader writes
/// the targets at its next round anyway), so it comes after the release, and a failure is a warning.
pub(crate) async fn tell_next_owners(outbox: &Outbox, store: &Store, me: InstanceId, moved: &[Partition]) {
    let targets = match leaving_targets(outbox, store, me).await {
        Ok(targets) => targets,
        Err(e) => {
            warn!(instance = %me, error = %e, "could not point the targets elsewhere at stop; the leader's next round will");
            return;
        }
    };
    nudge(outbox, store, me, moved.iter().filter_map(|p| targets.get(p).copied()).collect::<BTreeSet<_>>()).await;
}

/// The targets of the live instances other than `me`, written where they changed.
async fn leaving_targets(outbox: &Outbox, store: &Store, me: InstanceId) -> Result<Targets> {
    let View { mut live, partitions: rows } = store.view().await?;
    // Still counted live if it could not be marked draining: it takes no share all the same.
    live.retain(|&id| id != me);
    if live.is_empty() { Ok(Targets::new()) } else { rebalance_targets(outbox, store, me, &live, &rows).await }
}

#[cfg(all(test, feature = "postgres", feature = "sqlite", feature = "mysql"))]
mod tests {
    use std::time::Duration;

    use outbox_core::Partition;
    use sqlx::PgPool;

    use super::hand_over;
    use crate::driver::tests::{DAY, registered, stores, target};
    use crate::stored::Lease;

    /// An instance stopping in the quiet period of partitions it took from a dead owner releases them
    /// with the rest: the next owner takes them free, and waits out what is left of the period. Before,
    /// they stayed with the stopping instance, its lease ended with the rest of the period declared as
    /// its heartbeat interval, and one the rounds never heard it acquired got a quiet period guessed
    /// from this instance's settings alone.
    #[sqlx::test(migrations = false)]
    async fn partitions_in_a_quiet_period_at_shutdown_go_on_with_the_rest_of_it(pool: PgPool) {
        let partitions: Vec<Partition> = (0..6).collect();
        for store in stores(pool).await {
            let backend = store.db().backend();
            let dead = registered(&store, Lease { heartbeat: Duration::from_secs(30), ..DAY }).await;
            target(&store, 0..5, dead).await;
            assert_eq!(store.acquire(dead, DAY.heartbeat).await.unwrap().len(), 5, "{backend}");
            crate::driver::tests::end_lease(&store, dead).await;
            let me = registered(&store, DAY).await;
            target(&store, partitions.clone(), me).await;
            assert_eq!(store.acquire(me, DAY.heartbeat).await.unwrap().len(), 6, "{backend}");
            let mut moved = hand_over(&store, me).await.unwrap();
            moved.sort();
            assert_eq!(moved, partitions, "{backend}: every partition released, its next owner told");
            assert!(store.instances().await.unwrap().iter().all(|i| i.id != me), "{backend}: deregistered");

            let next = registered(&store, DAY).await;
            target(&store, partitions.clone(), next).await;
            let mut taken = store.acquire(next, DAY.heartbeat).await.unwrap();
            taken.sort_by_key(|t| t.partition);
            let quiet: Vec<(Partition, Option<_>, bool)> =
                taken.iter().map(|t| (t.partition, t.previous, t.quiet_ms.is_some_and(|ms| ms > 50_000))).collect();
            let expected: Vec<_> = (0..5).map(|p| (p, None, true)).chain([(5, None, false)]).collect();
            assert_eq!(quiet, expected, "{backend}: (partition, taken from, the rest of the 60 s period)");
            assert!(taken[5].quiet_ms.is_none(), "{backend}: free, never taken over");
        }
    }
}
