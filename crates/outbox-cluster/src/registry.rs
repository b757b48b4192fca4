//! Instance registry: register, heartbeat (lease renewal by database time), deregister.
//!
//! An instance's row holds its lease (`expires_at`), until which it counts as live, and its heartbeat
//! interval. A heartbeat renews the lease only while it has not expired: an expired lease means the
//! instance was declared dead (others may take its partitions), and it must fence itself and register
//! again under a new id.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use outbox_core::{Assignment, Deadline, Epochs, InstanceId};
use tokio::sync::watch;
use tokio::time::MissedTickBehavior;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::config::ClusterConfig;
use crate::driver::{HeartbeatConnection, Store};
use crate::error::Result;
use crate::stored::Lease;

/// The first pause before a failed renewal goes out again; it doubles up to the heartbeat interval.
const RENEW_AGAIN_AFTER: Duration = Duration::from_millis(50);

/// What each registration or renewal asks for.
fn lease(config: &ClusterConfig) -> Lease {
    Lease { live: config.lease(), heartbeat: config.heartbeat_interval }
}

/// Registers instance `id`; returns the assignment it starts with: no partitions, and the lease's
/// deadline counted from before the registration was sent.
pub(crate) async fn register(store: &Store, config: &ClusterConfig, id: InstanceId) -> Result<Assignment> {
    let sent = Deadline::now();
    let remaining = store.register(id, &config.name, lease(config)).await?;
    Ok(Assignment { lease: Some(sent.after(remaining)), ..Assignment::new(id, Epochs::new()) })
}

/// The heartbeat task: renews the lease every `heartbeat_interval` and moves the processor's deadline.
pub(crate) struct Heartbeat {
    pub(crate) store: Store,
    pub(crate) config: ClusterConfig,
    pub(crate) assign: Arc<watch::Sender<Assignment>>,
    /// The processor's delivered count, reported with each renewal.
    pub(crate) delivered: Arc<AtomicU64>,
    /// Bumped to ask the ownership task for a round: the lease was renewed after it had lapsed, or the
    /// instance registered again under a new id. Either way the others may have taken it for dead
    /// meanwhile (one that joined became the leader and pointed every target at itself), and a round
    /// asked for while it was lapsed was used up.
    pub(crate) asks_round: Arc<AtomicU64>,
}

impl Heartbeat {
    /// Renews the lease every `heartbeat_interval` over a connection of its own, so it never queues
    /// behind deliveries or a busy shared pool; reconnects when the connection is lost. The deadline a
    /// renewal yields is counted from before it was sent, so a late answer costs nothing.
    pub(crate) async fn run(self, shutdown: CancellationToken) {
        let mut ticker = tokio::time::interval(self.config.heartbeat_interval);
        ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut conn = HeartbeatConnection::default();
        // Each instance id reports what was delivered since it registered: an id registered again
        // starts from the processor's count at that moment, not from the process's total.
        let mut counted_from = 0;
        // The id the next registration after a declared death goes under, kept until one succeeds.
        let mut next_id = None;
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                _ = ticker.tick() => {}
            }
            let id = self.assign.borrow().instance;
            let sent = Deadline::now();
            let delivered = self.delivered.load(Ordering::Relaxed).saturating_sub(counted_from);
            let renewal =
                tokio::time::timeout(self.config.lease(), self.renew(&mut conn, id, delivered, &shutdown)).await;
            // Stopped meanwhile (the node released and deregistered, or its stop was given up): no
            // renewal or new registration of an instance nothing runs.
            if shutdown.is_cancelled() {
                return;
            }
            match renewal {
                Ok(Ok(Some(remaining))) => {
                    metrics::histogram!("outbox_heartbeat_seconds", "schema" => self.store.schema_label())
                        .record(sent.instant().elapsed().as_secs_f64());
                    self.extend_lease(id, sent.after(remaining));
                }
                Ok(Ok(None)) => {
                    if self.declared_dead(id, &mut next_id, &shutdown).await {
                        counted_from = self.delivered.load(Ordering::Relaxed);
                    }
                }
                Ok(Err(e)) => {
                    metrics::counter!("outbox_heartbeat_failures_total", "schema" => self.store.schema_label())
                        .increment(1);
                    warn!(instance = %id, error = %e, "heartbeat failed; reconnecting");
                    conn = HeartbeatConnection::default();
                }
                Err(_) => {
                    metrics::counter!("outbox_heartbeat_failures_total", "schema" => self.store.schema_label())
                        .increment(1);
                    warn!(instance = %id, "heartbeat timed out; reconnecting");
                    conn = HeartbeatConnection::default();
                }
            }
        }
    }

    /// Renews on `conn`, and again on a new connection after a failure (a connection reset by a
    /// pooler's restart or a failover fails at once), while the lease has time left: at the shortest
    /// stale timeout the lease ends one interval after the renewal is sent, so waiting for the next
    /// heartbeat let one reset cost the lease.
    async fn renew(
        &self,
        conn: &mut HeartbeatConnection,
        id: InstanceId,
        delivered: u64,
        shutdown: &CancellationToken,
    ) -> Result<Option<Duration>> {
        let mut pause = RENEW_AGAIN_AFTER;
        loop {
            match self.renew_once(conn, id, delivered).await {
                Err(e) if self.lease_left() > pause && !shutdown.is_cancelled() => {
                    metrics::counter!("outbox_heartbeat_failures_total", "schema" => self.store.schema_label())
                        .increment(1);
                    warn!(instance = %id, error = %e, ?pause, "heartbeat failed; renewing again on a new connection");
                    *conn = HeartbeatConnection::default();
                    tokio::select! {
                        () = shutdown.cancelled() => return Err(e),
                        () = tokio::time::sleep(pause) => {}
                    }
                    pause = (pause * 2).min(self.config.heartbeat_interval);
                }
                answer => return answer,
            }
        }
    }

    /// What is left of the lease the processor goes by.
    fn lease_left(&self) -> Duration {
        let lease = self.assign.borrow().lease;
        lease.map_or(Duration::ZERO, |d| d.instant().saturating_duration_since(tokio::time::Instant::now()))
    }

    /// One renewal on `conn`. If it has not answered within a heartbeat interval, or half the time the
    /// lease has left if that is sooner (a connection left half-open by a failover or a dropped NAT
    /// entry never will), the same renewal goes out again on a new connection beside it, and the first
    /// renewal to succeed counts (if one fails, the other is waited for up to half the lease left):
    /// waiting for the first alone let the lease end, while giving it up would lose a slow but live
    /// renewal its place (on SQLite, its turn at the file). The connection that answered is kept. At
    /// the shortest stale timeout the lease ends one interval after the renewal is sent, so one sent
    /// again after an interval came too late every time.
    async fn renew_once(
        &self,
        conn: &mut HeartbeatConnection,
        id: InstanceId,
        delivered: u64,
    ) -> Result<Option<Duration>> {
        let lease = self.config.lease();
        let again_after = self.config.heartbeat_interval.min(self.lease_left() / 2);
        let mut spare = HeartbeatConnection::default();
        let (answer, spare_answered) = {
            let first = conn.renew(&self.store, id, lease, delivered);
            tokio::pin!(first);
            match tokio::time::timeout(again_after, &mut first).await {
                Ok(answer) => (answer, false),
                Err(_) => {
                    warn!(instance = %id, waited = ?again_after, "heartbeat not answered; renewing on a new connection too");
                    let second = spare.renew(&self.store, id, lease, delivered);
                    tokio::pin!(second);
                    let other_within = self.lease_left() / 2;
                    tokio::select! {
                        answer = &mut first => match answer {
                            Ok(answer) => (Ok(answer), false),
                            Err(e) => (tokio::time::timeout(other_within, second).await.unwrap_or(Err(e)), true),
                        },
                        answer = &mut second => match answer {
                            Ok(answer) => (Ok(answer), true),
                            Err(e) => (tokio::time::timeout(other_within, first).await.unwrap_or(Err(e)), false),
                        },
                    }
                }
            }
        };
        if spare_answered {
            *conn = spare;
        }
        answer
    }

    /// The lease of `id` was renewed: the processor may go on until `until`.
    fn extend_lease(&self, id: InstanceId, until: Deadline) {
        self.assign.send_if_modified(|current| {
            let ran_out = lease_extended(current, id, until);
            if ran_out {
                self.asks_round.fetch_add(1, Ordering::Release);
            }
            ran_out
        });
    }

    /// The lease of `id` had expired: others may take (or have taken) its partitions. Fence at once,
    /// then register again under a new id, with no partitions; `true` once registered again. A failed
    /// registration may have been written all the same (only its answer lost), so the retry at the next
    /// heartbeat goes under the same new id, `next_id`: a fresh one each time would leave a row the
    /// rebalancer counts as live, whose share of the partitions nobody takes until its lease ends. For
    /// the same reason a registration that lands after the node was stopped is taken back at once.
    async fn declared_dead(
        &self,
        id: InstanceId,
        next_id: &mut Option<InstanceId>,
        shutdown: &CancellationToken,
    ) -> bool {
        // Not a second death when a registration that failed is retried.
        let found_now = next_id.is_none();
        let fenced = self.assign.send_if_modified(|current| {
            if current.instance != id {
                return false;
            }
            current.epochs.clear();
            current.taken_over.clear();
            current.lease = Some(Deadline::now());
            true
        });
        if fenced && found_now {
            metrics::counter!("outbox_leases_expired_total", "schema" => self.store.schema_label()).increment(1);
            warn!(instance = %id, "lease expired: the instance was declared dead; processing stopped, running handler calls cancelled");
        }
        let next = *next_id.get_or_insert_with(InstanceId::new);
        let registered = register(&self.store, &self.config, next).await;
        if shutdown.is_cancelled() {
            // The stop deregistered the id it knew while this one was on its way (written even if its
            // answer was lost).
            match self.store.deregister(next).await {
                Ok(()) => info!(instance = %next, previous = %id, "the node stopped during a registration: taken back"),
                Err(e) => warn!(instance = %next, previous = %id, error = %e,
                    "the node stopped during a registration, and taking it back failed; it goes when its lease runs out"),
            }
            return false;
        }
        match registered {
            Ok(fresh) => {
                *next_id = None;
                let new = fresh.instance;
                self.asks_round.fetch_add(1, Ordering::Release);
                self.assign.send_modify(|current| *current = fresh);
                info!(instance = %new, previous = %id, name = %self.config.name, "instance registered again under a new id");
                true
            }
            Err(e) => {
                warn!(instance = %id, error = %e, "registering again failed; retrying at the next heartbeat");
                false
            }
        }
    }
}

/// Moves `current`'s lease to `until` if it is `id`'s and ends sooner; whether the processor must be told:
/// only when the old lease had run out, for a processor stopped at that deadline waits for word (or
/// its next poll, `listen_poll_interval` away while it listens). Only the deadline moves otherwise, not
/// worth waking it for at every renewal.
fn lease_extended(current: &mut Assignment, id: InstanceId, until: Deadline) -> bool {
    if current.instance != id || current.lease.is_some_and(|d| d.instant() >= until.instant()) {
        return false;
    }
    let ran_out = !current.is_live();
    current.lease = Some(until);
    ran_out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_lease_renewed_after_it_ran_out_wakes_the_processor_and_one_renewed_in_time_does_not() {
        let id = InstanceId::new();
        let second = Duration::from_secs(1);
        let mut current =
            Assignment { lease: Some(Deadline::now().after(second)), ..Assignment::new(id, Epochs::new()) };
        assert!(!lease_extended(&mut current, id, Deadline::now().after(2 * second)), "renewed in time");
        assert_eq!(current.lease.map(|d| d.instant()), Some(Deadline::now().after(2 * second).instant()));
        assert!(!lease_extended(&mut current, id, Deadline::now().after(second)), "an older answer moves nothing");
        assert!(!lease_extended(&mut current, InstanceId::new(), Deadline::now().after(3 * second)), "another id");
        tokio::time::advance(3 * second).await;
        assert!(!current.is_live());
        assert!(lease_extended(&mut current, id, Deadline::now().after(second)), "renewed after it ran out");
        assert!(current.is_live());
    }
}
