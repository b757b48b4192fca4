//! A clustered node: registry heartbeats, partition ownership and the processor, started and stopped
//! together.
//!
//! Tasks (each `run(…, CancellationToken)`):
//! - **heartbeat**: renews the lease every `heartbeat_interval`, on its own task so it never waits behind
//!   deliveries; if no renewal succeeded for longer than the self-fence deadline, it empties the
//!   assignment so the processor stops (self-fencing; safety still comes from the epoch);
//! - **ownership**: every `rebalance_interval`, the leader (the live instance with the smallest id)
//!   computes the balanced targets ([`rebalance`](crate::rebalance)) and writes those that changed; each
//!   instance then stops fetching the partitions targeted elsewhere, releases them once none of their
//!   records is in flight (release-before-acquire), and acquires the partitions targeted at it that are
//!   free or whose owner is dead;
//! - **processor** and **purge** from `outbox-core`.
//!
//! Graceful shutdown: mark the instance draining, stop fetching, finish and complete in-flight records,
//! write targets without it, release every partition (epoch + 1) and deregister, so the others take the
//! partitions at their next round instead of after the stale timeout.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use outbox_core::{Assignment, Db, Epochs, Handlers, Outbox, Partition, Processor};
use sqlx::{Connection, PgConnection};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{info, warn};
use uuid::Uuid;

use crate::config::ClusterConfig;
use crate::registry;
use crate::sql::Sql;
use crate::{Error, Result, ownership};

/// A running node. Dropping it without [`Node::shutdown`] stops nothing; call `shutdown` (or
/// [`Node::kill`] in tests) to end it.
pub struct Node {
    id: Uuid,
    pool: Db,
    sql: Arc<Sql>,
    assignment: watch::Receiver<Assignment>,
    stop_processor: CancellationToken,
    stop_background: CancellationToken,
    background: TaskTracker,
    processor: JoinHandle<outbox_core::Result<()>>,
}

impl Node {
    /// Validates `config`, registers the instance and starts its tasks.
    pub async fn start(outbox: Outbox, db: impl Into<Db>, handlers: Handlers, config: ClusterConfig) -> Result<Node> {
        config.validate()?;
        let pool = db.into();
        let id = Uuid::now_v7();
        let sql = Arc::new(Sql::new(&outbox));
        registry::register(&pool, &sql, id, &config.name, config.stale_timeout)
            .await
            .map_err(|e| not_migrated(&outbox, e))?;
        info!(instance = %id, name = %config.name, "instance registered");

        // Registration just renewed the lease: the processor may work until the self-fence deadline.
        let lease_until = Instant::now() + self_fence_after(&config);
        let (assign_tx, assignment) =
            watch::channel(Assignment { epochs: Epochs::new(), valid_until: Some(lease_until) });
        let assign_tx = Arc::new(assign_tx);
        let (beat_tx, beat_rx) = watch::channel(Instant::now());
        let stop_processor = CancellationToken::new();
        let stop_background = CancellationToken::new();
        let background = TaskTracker::new();

        let processor = Processor::new(outbox.clone(), pool.clone(), handlers, id, assignment.clone());
        let busy = processor.busy_partitions();
        let processor = tokio::spawn(processor.run(stop_processor.clone()));
        let ctx = Ctx { id, pool: pool.clone(), sql: sql.clone(), config, assign: assign_tx };
        background.spawn(ctx.clone().heartbeat(beat_tx, stop_background.clone()));
        background.spawn(ctx.ownership(beat_rx, busy, stop_background.clone()));
        background.spawn(outbox.clone().run_purge(pool.clone(), stop_background.clone()));
        background.close();
        Ok(Node { id, pool, sql, assignment, stop_processor, stop_background, background, processor })
    }

    /// This instance's id.
    pub fn id(&self) -> Uuid {
        self.id
    }

    /// The partitions (and epochs) currently handed to the processor.
    pub fn assignment(&self) -> watch::Receiver<Assignment> {
        self.assignment.clone()
    }

    /// Graceful stop: finish and complete in-flight records (bounded by the outbox `shutdown_timeout`),
    /// release all partitions, deregister.
    pub async fn shutdown(self) -> Result<()> {
        ownership::drain(&self.pool, &self.sql, self.id).await?;
        self.stop_processor.cancel();
        let processed = self.processor.await.map_err(|e| Error::Task(e.to_string()))?;
        self.stop_background.cancel();
        self.background.wait().await;
        // Point the targets at the remaining instances now, so they acquire at their next round.
        let live = ownership::live(&self.pool, &self.sql).await?;
        if !live.is_empty() {
            let rows = ownership::partitions(&self.pool, &self.sql).await?;
            ownership::rebalance(&self.pool, &self.sql, self.id, &live, &rows).await?;
        }
        let owned = ownership::owned(&self.pool, &self.sql, self.id).await?;
        ownership::release(&self.pool, &self.sql, self.id, &owned, "graceful shutdown").await?;
        registry::deregister(&self.pool, &self.sql, self.id).await?;
        info!(instance = %self.id, "instance stopped and deregistered");
        processed.map_err(Error::Core)
    }

    /// Stops every task at once without completing, releasing or deregistering: what a crash looks like
    /// to the rest of the cluster (for tests and demos).
    pub fn kill(self) {
        self.processor.abort();
        self.stop_background.cancel();
    }
}

fn not_migrated(outbox: &Outbox, e: Error) -> Error {
    match e {
        Error::Database(e) if outbox_core::is_not_migrated(&e) => {
            Error::Core(outbox_core::Error::NotMigrated { schema: outbox.config().schema.clone() })
        }
        other => other,
    }
}

/// Deadline after the last successful heartbeat's *send* time: one heartbeat before the lease can
/// expire, so the instance stops before anyone may take its partitions.
fn self_fence_after(config: &ClusterConfig) -> Duration {
    config.stale_timeout.saturating_sub(config.heartbeat_interval)
}

#[derive(Clone)]
struct Ctx {
    id: Uuid,
    pool: Db,
    sql: Arc<Sql>,
    config: ClusterConfig,
    assign: Arc<watch::Sender<Assignment>>,
}

impl Ctx {
    fn self_fence_after(&self) -> Duration {
        self_fence_after(&self.config)
    }

    /// Renews the lease every `heartbeat_interval` over a connection of its own, so it never queues
    /// behind deliveries or a busy shared pool; reconnects when the connection is lost.
    async fn heartbeat(self, beat: watch::Sender<Instant>, shutdown: CancellationToken) {
        let mut ticker = tokio::time::interval(self.config.heartbeat_interval);
        ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut conn: Option<PgConnection> = None;
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                _ = ticker.tick() => {}
            }
            let sent = Instant::now();
            let renewed = tokio::time::timeout(self.config.heartbeat_interval, self.renew(&mut conn)).await;
            match renewed {
                Ok(Ok(true)) => {
                    beat.send_replace(sent);
                    self.extend_lease(sent);
                }
                Ok(Ok(false)) => {
                    warn!(instance = %self.id, "instance was declared dead by the cluster; re-registering");
                    self.fence("instance was declared dead");
                    match registry::register(
                        &self.pool,
                        &self.sql,
                        self.id,
                        &self.config.name,
                        self.config.stale_timeout,
                    )
                    .await
                    {
                        Ok(()) => {
                            beat.send_replace(sent);
                            self.extend_lease(sent);
                        }
                        Err(e) => warn!(instance = %self.id, error = %e, "re-registration failed"),
                    }
                }
                Ok(Err(e)) => {
                    warn!(instance = %self.id, error = %e, "heartbeat failed; reconnecting");
                    conn = None;
                }
                Err(_) => {
                    warn!(instance = %self.id, "heartbeat timed out; reconnecting");
                    conn = None;
                }
            }
            if beat.borrow().elapsed() > self.self_fence_after() {
                self.fence("no successful heartbeat within the lease");
            }
        }
    }

    /// PostgreSQL: on the heartbeat's own connection. SQLite: through the pool (statements run in
    /// process; the wait that matters there is the write lock, which a connection of its own would
    /// not avoid).
    async fn renew(&self, conn: &mut Option<PgConnection>) -> Result<bool> {
        let pool = match &self.pool {
            Db::Postgres(pool) => pool,
            Db::Sqlite(pool) => {
                return crate::sqlite::heartbeat(pool, &self.sql.sqlite, self.id, self.config.stale_timeout).await;
            }
        };
        let conn = match conn {
            Some(conn) => conn,
            None => conn.insert(PgConnection::connect_with(&pool.connect_options()).await?),
        };
        registry::heartbeat(conn, &self.sql, self.id, self.config.stale_timeout).await
    }

    /// The lease was renewed at `sent` (or later): the processor may go on until the new deadline.
    fn extend_lease(&self, sent: Instant) {
        let until = sent + self.self_fence_after();
        self.assign.send_if_modified(|current| {
            let later = current.valid_until.is_none_or(|d| d < until);
            if later {
                current.valid_until = Some(until);
            }
            // Only the deadline moved: no need to wake the processor.
            false
        });
    }

    fn fence(&self, reason: &str) {
        self.assign.send_if_modified(|current| {
            if current.epochs.is_empty() {
                return false;
            }
            warn!(instance = %self.id, partitions = current.epochs.len(), reason, "self-fencing: processing stopped");
            current.epochs.clear();
            true
        });
    }

    async fn ownership(
        self,
        beat: watch::Receiver<Instant>,
        busy: watch::Receiver<BTreeSet<Partition>>,
        shutdown: CancellationToken,
    ) {
        let mut ticker = tokio::time::interval(self.config.rebalance_interval);
        ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
        // Partitions taken away from the processor in an earlier round, waiting to be released.
        let mut giving_up = BTreeSet::new();
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                _ = ticker.tick() => {}
            }
            if beat.borrow().elapsed() > self.self_fence_after() {
                continue;
            }
            if let Err(e) = self.round(&busy, &mut giving_up).await {
                warn!(instance = %self.id, error = %e, "ownership round failed");
            }
        }
    }

    /// One ownership round: rebalance (leader only), release, acquire, publish the assignment.
    async fn round(
        &self,
        busy: &watch::Receiver<BTreeSet<Partition>>,
        giving_up: &mut BTreeSet<Partition>,
    ) -> Result<()> {
        let live = ownership::live(&self.pool, &self.sql).await?;
        let rows = ownership::partitions(&self.pool, &self.sql).await?;
        let targets: BTreeMap<Partition, Uuid> = if live.first() == Some(&self.id) {
            // Housekeeping for the cluster: forget instances dead for longer than a lease.
            registry::reap(&self.pool, &self.sql, self.config.stale_timeout).await?;
            ownership::rebalance(&self.pool, &self.sql, self.id, &live, &rows).await?
        } else {
            rows.iter().filter_map(|r| r.target.map(|t| (r.partition, t))).collect()
        };
        let mine = |p: &Partition| targets.get(p) == Some(&self.id);

        // Release what the processor stopped fetching in an earlier round and has nothing in flight.
        // Waiting one round closes the gap between a dispatch and its appearance in `busy`.
        let owned: Epochs = rows.iter().filter(|r| r.owner == Some(self.id)).map(|r| (r.partition, r.epoch)).collect();
        let in_flight = busy.borrow().clone();
        let release: Epochs = owned
            .iter()
            .filter(|(p, _)| giving_up.contains(p) && !mine(p) && !in_flight.contains(p))
            .map(|(&p, &e)| (p, e))
            .collect();
        if !release.is_empty() {
            ownership::release(&self.pool, &self.sql, self.id, &release, "rebalance").await?;
        }
        if rows.iter().any(|r| mine(&r.partition) && r.owner != Some(self.id)) {
            ownership::acquire(&self.pool, &self.sql, self.id).await?;
        }

        let owned = ownership::owned(&self.pool, &self.sql, self.id).await?;
        *giving_up = owned.keys().copied().filter(|p| !mine(p)).collect();
        let keep: Epochs = owned.into_iter().filter(|(p, _)| mine(p)).collect();
        metrics::gauge!("outbox_owned_partitions").set(keep.len() as f64);
        metrics::gauge!("outbox_live_instances").set(live.len() as f64);
        self.assign.send_if_modified(|current| {
            let changed = current.epochs != keep;
            current.epochs = keep;
            changed
        });
        Ok(())
    }
}
