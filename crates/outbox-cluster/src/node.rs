//! A clustered node: registry heartbeats, partition ownership and the processor, started and stopped
//! together.
//!
//! Tasks (each `run(…, CancellationToken)`):
//! - **heartbeat**: renews the lease every `heartbeat_interval`, on its own task so it never waits behind
//!   deliveries. Each renewal sets the processor's deadline from the lease's remaining time as the
//!   database answered it, counted from before the renewal was sent; without a renewal the deadline
//!   passes and the processor stops delivering on its own (self-fencing). A renewal that finds the lease
//!   expired means the instance was declared dead: it fences at once (the processor cancels its running
//!   handler calls) and registers again under a new instance id, starting with no partitions;
//! - **ownership**: every `rebalance_interval`, the leader (the live instance with the smallest id)
//!   computes the balanced targets ([`rebalance`](crate::rebalance)) and writes those that changed; each
//!   instance then stops fetching the partitions targeted elsewhere, releases them once none of their
//!   records is in flight (release-before-acquire), and acquires the partitions targeted at it that are
//!   free or whose owner's lease has expired; the latter it hands to the processor only after a quiet
//!   period of two heartbeat intervals (the previous owner's, or its own if longer);
//! - **processor** and **purge** from `outbox-core`.
//!
//! Graceful shutdown: mark the instance draining, stop fetching, finish and complete in-flight records,
//! write targets without it, release every partition (epoch + 1) and deregister, so the others take the
//! partitions at their next round instead of after the stale timeout.
//!
//! # Exclusive delivery, and what it rests on
//! An instance's lease lasts `stale_timeout` minus two heartbeat intervals after each renewal
//! ([`ClusterConfig::lease`]), by database time; the processor's deadline is the lease's remaining time
//! as the database answered it, counted from before the renewal was sent, so it passes no later than
//! the lease. At the deadline the processor starts no handler call and cancels those running. Another
//! instance may take the partitions once the lease has expired, and then waits a quiet period of two
//! heartbeat intervals before delivering them: the time the old owner needs to find, at its next
//! heartbeat, that its lease expired, should it have ended early (a database clock step, an operator's
//! edit) while its own deadline had not passed; it fences itself at once. So after a crash the
//! partitions are delivered again `stale_timeout` (plus up to one rebalance interval) after the last
//! heartbeat, and a live owner has stopped before anyone else delivers them. This rests on the
//! heartbeats getting through within their interval and on the clocks' rates, not on their readings.
//!
//! A process that is stopped (SIGSTOP, a debugger) resumes past its deadline and starts no new call,
//! but a handler call it was running goes on until the processor notices (its next turn of the loop)
//! and cancels it. A suspended virtual machine stops the monotonic clock too: the processor also checks
//! the wall clock, so if the host corrects it on resume nothing new starts; if not, calls may start for
//! up to one heartbeat interval after the resume, until the heartbeat finds the lease expired. Every
//! fetch is fenced by the database (the partition's owner and epoch, and a live lease by database
//! time), and every write too, so none of this can lose, reorder or corrupt records: it decides only
//! whether a handler call could overlap another instance's.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use outbox_core::{Assignment, Db, Deadline, Epochs, Handlers, Outbox, Partition, Processor};
use sqlx::{Connection, PgConnection, SqliteConnection};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{info, warn};
use uuid::Uuid;

use crate::config::ClusterConfig;
use crate::registry::{self, Lease};
use crate::sql::Sql;
use crate::{Error, Result, ownership};

/// A running node. Dropping it without [`Node::shutdown`] stops nothing; call `shutdown` (or
/// [`Node::kill`] in tests) to end it.
pub struct Node {
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
        let sql = Arc::new(Sql::new(&outbox));
        let id = Uuid::now_v7();
        let sent = Deadline::now();
        let remaining = registry::register(&pool, &sql, id, &config.name, lease(&config))
            .await
            .map_err(|e| not_migrated(&outbox, e))?;
        info!(instance = %id, name = %config.name, "instance registered");

        let (assign_tx, assignment) =
            watch::channel(Assignment { instance: id, epochs: Epochs::new(), lease: Some(sent.after(remaining)) });
        let stop_processor = CancellationToken::new();
        let stop_background = CancellationToken::new();
        let background = TaskTracker::new();

        let processor = Processor::new(outbox.clone(), pool.clone(), handlers, assignment.clone());
        let busy = processor.busy_partitions();
        let processor = tokio::spawn(processor.run(stop_processor.clone()));
        let ctx = Ctx { pool: pool.clone(), sql: sql.clone(), config, assign: Arc::new(assign_tx) };
        background.spawn(ctx.clone().heartbeat(stop_background.clone()));
        background.spawn(ctx.ownership(busy, stop_background.clone()));
        background.spawn(outbox.clone().run_purge(pool.clone(), stop_background.clone()));
        background.close();
        Ok(Node { pool, sql, assignment, stop_processor, stop_background, background, processor })
    }

    /// This instance's id (a new one after the instance was declared dead and registered again).
    pub fn id(&self) -> Uuid {
        self.assignment.borrow().instance
    }

    /// The instance id, partitions (and epochs) and lease deadline currently handed to the processor.
    pub fn assignment(&self) -> watch::Receiver<Assignment> {
        self.assignment.clone()
    }

    /// Graceful stop: finish and complete in-flight records (bounded by the outbox `shutdown_timeout`),
    /// release all partitions, deregister. Every task is stopped whatever a step returns; the first error
    /// is returned.
    pub async fn shutdown(self) -> Result<()> {
        let drained = ownership::drain(&self.pool, &self.sql, self.id()).await;
        if let Err(e) = &drained {
            warn!(instance = %self.id(), error = %e, "could not mark the instance draining; stopping anyway");
        }
        self.stop_processor.cancel();
        let processed = self.processor.await.map_err(|e| Error::Task(e.to_string())).and_then(|r| Ok(r?));
        self.stop_background.cancel();
        self.background.wait().await;
        let id = self.assignment.borrow().instance;
        let handed_over = hand_over(&self.pool, &self.sql, id).await;
        if handed_over.is_ok() {
            info!(instance = %id, "instance stopped and deregistered");
        }
        drained.and(processed).and(handed_over)
    }

    /// Stops every task at once without completing, releasing or deregistering: what a crash looks like
    /// to the rest of the cluster (for tests and demos).
    pub fn kill(self) {
        self.processor.abort();
        self.stop_background.cancel();
    }
}

/// Points the targets at the remaining instances (so they acquire at their next round), releases the
/// partitions `id` owns and deregisters it.
async fn hand_over(pool: &Db, sql: &Sql, id: Uuid) -> Result<()> {
    let live = ownership::live(pool, sql).await?;
    if !live.is_empty() {
        let rows = ownership::partitions(pool, sql).await?;
        ownership::rebalance(pool, sql, id, &live, &rows).await?;
    }
    let owned = ownership::owned(pool, sql, id).await?;
    ownership::release(pool, sql, id, &owned, "graceful shutdown").await?;
    registry::deregister(pool, sql, id).await
}

fn not_migrated(outbox: &Outbox, e: Error) -> Error {
    match e {
        Error::Database(e) if outbox_core::is_not_migrated(&e) => {
            Error::Core(outbox_core::Error::NotMigrated { schema: outbox.config().schema.clone() })
        }
        other => other,
    }
}

/// The heartbeat's own database connection (of the node's backend), opened on first use.
#[derive(Default)]
struct OwnConnection {
    postgres: Option<PgConnection>,
    sqlite: Option<SqliteConnection>,
}

/// What each registration or renewal asks for.
fn lease(config: &ClusterConfig) -> Lease {
    Lease { live: config.lease(), heartbeat: config.heartbeat_interval }
}

/// What the ownership task carries from one round to the next, for one instance id.
struct Rounds {
    instance: Uuid,
    /// Partitions taken away from the processor in an earlier round, waiting to be released.
    giving_up: BTreeSet<Partition>,
    /// Partitions taken from a dead owner, held back from the processor until its quiet period ends:
    /// (epoch, end).
    quiet: BTreeMap<Partition, (i64, Instant)>,
}

impl Rounds {
    fn new(instance: Uuid) -> Self {
        Self { instance, giving_up: BTreeSet::new(), quiet: BTreeMap::new() }
    }
}

async fn sleep_until_opt(deadline: Option<Instant>) {
    match deadline {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

#[derive(Clone)]
struct Ctx {
    pool: Db,
    sql: Arc<Sql>,
    config: ClusterConfig,
    assign: Arc<watch::Sender<Assignment>>,
}

impl Ctx {
    /// The instance id the processor works under.
    fn instance(&self) -> Uuid {
        self.assign.borrow().instance
    }

    /// Renews the lease every `heartbeat_interval` over a connection of its own, so it never queues
    /// behind deliveries or a busy shared pool; reconnects when the connection is lost. A slow renewal
    /// is waited for up to the lease's length (later ticks wait meanwhile): the deadline it yields is
    /// counted from before it was sent, so lateness costs nothing, while abandoning it after one
    /// interval (SQLite writers queue for the write lock across processes) let leases expire under load.
    async fn heartbeat(self, shutdown: CancellationToken) {
        let mut ticker = tokio::time::interval(self.config.heartbeat_interval);
        ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut conn = OwnConnection::default();
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                _ = ticker.tick() => {}
            }
            let id = self.instance();
            let sent = Deadline::now();
            match tokio::time::timeout(self.config.lease(), self.renew(&mut conn, id)).await {
                Ok(Ok(Some(remaining))) => self.extend_lease(id, sent.after(remaining)),
                Ok(Ok(None)) => self.declared_dead(id).await,
                Ok(Err(e)) => {
                    warn!(instance = %id, error = %e, "heartbeat failed; reconnecting");
                    conn = OwnConnection::default();
                }
                Err(_) => {
                    warn!(instance = %id, "heartbeat timed out; reconnecting");
                    conn = OwnConnection::default();
                }
            }
        }
    }

    /// On the heartbeat's own connection (opened on first use), so it never waits for a pooled
    /// connection behind deliveries or the application's use of the pool. On SQLite it still takes this
    /// process's turn at the file and then the write lock, which writers in other processes may hold.
    async fn renew(&self, own: &mut OwnConnection, id: Uuid) -> Result<Option<std::time::Duration>> {
        let lease = lease(&self.config);
        match &self.pool {
            Db::Postgres(pool) => {
                let conn = match own.postgres.take() {
                    Some(conn) => conn,
                    None => PgConnection::connect_with(&pool.connect_options()).await?,
                };
                registry::heartbeat(own.postgres.insert(conn), &self.sql, id, lease).await
            }
            Db::Sqlite(pool) => {
                let conn = match own.sqlite.take() {
                    Some(conn) => conn,
                    None => SqliteConnection::connect_with(&pool.connect_options()).await?,
                };
                let conn = own.sqlite.insert(conn);
                let remaining = crate::sqlite::heartbeat(pool, conn, &self.sql.sqlite, id, lease).await?;
                Ok(remaining.map(|ms| std::time::Duration::from_millis(u64::try_from(ms).unwrap_or(0))))
            }
        }
    }

    /// The lease of `id` was renewed: the processor may go on until `until`. Only the deadline moves, so
    /// the processor is not woken (one that stopped at the old deadline resumes at its next poll).
    fn extend_lease(&self, id: Uuid, until: Deadline) {
        self.assign.send_if_modified(|current| {
            if current.instance == id && current.lease.is_none_or(|d| d.instant() < until.instant()) {
                current.lease = Some(until);
            }
            false
        });
    }

    /// The lease of `id` had expired: others may take (or have taken) its partitions. Fence at once,
    /// then register again under a new id, with no partitions.
    async fn declared_dead(&self, id: Uuid) {
        let fenced = self.assign.send_if_modified(|current| {
            if current.instance != id {
                return false;
            }
            current.epochs.clear();
            current.lease = Some(Deadline::now());
            true
        });
        if fenced {
            warn!(instance = %id, "lease expired: the instance was declared dead; processing stopped, running handler calls cancelled");
        }
        let new = Uuid::now_v7();
        let sent = Deadline::now();
        match registry::register(&self.pool, &self.sql, new, &self.config.name, lease(&self.config)).await {
            Ok(remaining) => {
                self.assign.send_modify(|current| {
                    *current = Assignment { instance: new, epochs: Epochs::new(), lease: Some(sent.after(remaining)) };
                });
                info!(instance = %new, previous = %id, name = %self.config.name, "instance registered again under a new id");
            }
            Err(e) => warn!(instance = %id, error = %e, "registering again failed; retrying at the next heartbeat"),
        }
    }

    async fn ownership(self, busy: watch::Receiver<BTreeSet<Partition>>, shutdown: CancellationToken) {
        let mut ticker = tokio::time::interval(self.config.rebalance_interval);
        ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut rounds = Rounds::new(self.instance());
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
            if let Err(e) = self.round(&busy, &mut rounds).await {
                warn!(instance = %current.instance, error = %e, "ownership round failed");
            }
        }
    }

    /// One ownership round: rebalance (leader only), release, acquire, publish the assignment (unless
    /// the instance registered again meanwhile: this round's view is then stale).
    async fn round(&self, busy: &watch::Receiver<BTreeSet<Partition>>, rounds: &mut Rounds) -> Result<()> {
        let id = rounds.instance;
        let live = ownership::live(&self.pool, &self.sql).await?;
        let rows = ownership::partitions(&self.pool, &self.sql).await?;
        let targets: BTreeMap<Partition, Uuid> = if live.first() == Some(&id) {
            // Housekeeping for the cluster: forget instances whose lease expired two stale timeouts ago
            // (their partitions have moved on long since).
            registry::reap(&self.pool, &self.sql, self.config.stale_timeout * 2).await?;
            ownership::rebalance(&self.pool, &self.sql, id, &live, &rows).await?
        } else {
            rows.iter().filter_map(|r| r.target.map(|t| (r.partition, t))).collect()
        };
        let mine = |p: &Partition| targets.get(p) == Some(&id);

        // Release what the processor stopped fetching in an earlier round and has nothing in flight.
        // Waiting one round closes the gap between a dispatch and its appearance in `busy`.
        let owned: Epochs = rows.iter().filter(|r| r.owner == Some(id)).map(|r| (r.partition, r.epoch)).collect();
        let in_flight = busy.borrow().clone();
        let release: Epochs = owned
            .iter()
            .filter(|(p, _)| rounds.giving_up.contains(p) && !mine(p) && !in_flight.contains(p))
            .map(|(&p, &e)| (p, e))
            .collect();
        if !release.is_empty() {
            ownership::release(&self.pool, &self.sql, id, &release, "rebalance").await?;
        }
        if rows.iter().any(|r| mine(&r.partition) && r.owner != Some(id)) {
            let acquired = ownership::acquire(&self.pool, &self.sql, id, self.config.heartbeat_interval).await?;
            for a in acquired {
                if let Some(quiet) = a.quiet {
                    rounds.quiet.insert(a.partition, (a.epoch, Instant::now() + quiet));
                }
            }
        }

        let owned = ownership::owned(&self.pool, &self.sql, id).await?;
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
}
