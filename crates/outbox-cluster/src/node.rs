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
//!   instance then stops fetching the partitions targeted elsewhere, releases them the moment none of
//!   their records is in flight (release-before-acquire), and acquires the partitions targeted at it
//!   that are free or whose owner's lease has expired; the latter it hands to the processor only after a
//!   quiet period of two heartbeat intervals (the previous owner's, or its own if longer), whose end is
//!   kept with the partition, so that whoever holds it next waits out the rest too. Each step nudges
//!   the instances that must take the next one, so a handover does not wait for their rounds;
//! - **processor**, **purge** and **backlog gauges** from `outbox-core`; the purge and the gauges run
//!   on the leader only (each works on the whole database).
//!
//! Graceful shutdown: mark the instance draining; its ownership task writes targets without it and
//! hands each partition over as in a rebalance (stop fetching it, release it once its records in
//! flight are completed, nudge its new target); then stop, release whatever is left and deregister. So
//! the others take the partitions at once instead of after the stale timeout.
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

use std::panic::AssertUnwindSafe;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, OnceLock};

use futures::FutureExt;
use metrics::SharedString;
use outbox_core::{Assignment, Db, Handlers, InstanceId, Outbox, Processor};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{error, info, warn};

use crate::config::ClusterConfig;
use crate::driver::Store;
use crate::error::{Error, Result};
use crate::ownership::{self, Ownership};
use crate::registry::{self, Heartbeat};

/// A running node. Dropping it without [`Node::shutdown`] stops nothing; call `shutdown` (or
/// [`Node::kill`] in tests) to end it.
pub struct Node {
    outbox: Outbox,
    store: Store,
    assignment: watch::Receiver<Assignment>,
    leaving: CancellationToken,
    holds_none: watch::Receiver<bool>,
    /// Cancelled when a task ended unasked (see [`Watched`]), whose fault is kept in `fault`.
    failed: CancellationToken,
    fault: Arc<OnceLock<String>>,
    stop_processor: CancellationToken,
    stop_background: CancellationToken,
    background: TaskTracker,
    processor: JoinHandle<Result<()>>,
}

impl Node {
    /// Validates `config`, registers the instance (on a connection that passes
    /// [`Db::check_worker_session`]) and starts its tasks. A registration that fails is
    /// taken back (within `query_timeout` more), so a start that an application tries again leaves no
    /// instance behind that nothing runs.
    pub async fn start(outbox: Outbox, db: impl Into<Db>, handlers: Handlers, config: ClusterConfig) -> Result<Node> {
        config.validate()?;
        let store = Store::new(db.into(), &outbox, outbox.config().query_timeout.min(config.lease() / 2));
        let shortest = store.shortest_lease();
        if config.lease() < shortest {
            warn!(
                lease = ?config.lease(),
                ?shortest,
                "the lease (stale_timeout less two heartbeat intervals) is shorter than this database keeps safe: \
                 an instance whose host vanishes mid-round can hold back others' renewals past their leases"
            );
        }
        let id = InstanceId::new();
        let first = match registry::register(&store, &config, id).await {
            Ok(first) => first,
            // Refused before anything was written; on such a session a take-back would itself stay
            // uncommitted, holding its locks on a pooled connection.
            Err(e @ Error::Core(outbox_core::Error::UnsuitableSession(_))) => return Err(e),
            Err(e) => {
                // The row may be written with its answer lost: left there, it is a live instance that
                // nothing runs, which the leader hands partitions to until its lease runs out.
                if let Err(again) = store.deregister(id).await {
                    warn!(instance = %id, error = %again, "registration failed, and so did taking its row back; it goes when the lease runs out");
                }
                return Err(e.not_migrated(&outbox));
            }
        };
        info!(instance = %first.instance, name = %config.name, "instance registered");

        let (assign, assignment) = watch::channel(first);
        let assign = Arc::new(assign);
        // Cancelled by a task that ends unasked: every task stops.
        let failed = CancellationToken::new();
        let fault = Arc::new(OnceLock::new());
        let stop_processor = failed.child_token();
        let stop_background = failed.child_token();
        let background = TaskTracker::new();
        let watched = |task, stop: &CancellationToken| Watched {
            task,
            assignment: assignment.clone(),
            stop: stop.clone(),
            failed: failed.clone(),
            fault: fault.clone(),
            schema: outbox.schema_label(),
        };

        let processor = Processor::new(outbox.clone(), store.db().clone(), handlers, assignment.clone());
        let busy = processor.busy_partitions();
        let delivered = processor.delivered();
        let run = processor.run(stop_processor.clone());
        let processor = tokio::spawn(watched("processor", &stop_processor).run(async { Ok(run.await?) }));
        let asks_round = Arc::new(AtomicU64::new(0));
        let heartbeat = Heartbeat {
            store: store.clone(),
            config: config.clone(),
            assign: assign.clone(),
            delivered,
            asks_round: asks_round.clone(),
        };
        let run = heartbeat.run(stop_background.clone());
        background.spawn(watched("heartbeat", &stop_background).run(ended(run)));
        let leaving = CancellationToken::new();
        let holds_none = Arc::new(watch::Sender::new(false));
        // The leader runs the cluster's housekeeping: the purge and the backlog gauges.
        let leads = watch::Sender::new(false);
        let (purge_leads, gauges_leads) = (leads.subscribe(), leads.subscribe());
        let ownership = Ownership {
            outbox: outbox.clone(),
            store: store.clone(),
            config,
            assign,
            busy,
            leaving: leaving.clone(),
            holds_none: holds_none.clone(),
            asks_round,
            leads,
        };
        let run = ownership.run(stop_background.clone());
        background.spawn(watched("ownership", &stop_background).run(ended(run)));
        let run = outbox.clone().run_purge(store.db().clone(), purge_leads, stop_background.clone());
        background.spawn(watched("purge", &stop_background).run(ended(run)));
        let run = outbox.clone().run_backlog_gauges(store.db().clone(), gauges_leads, stop_background.clone());
        background.spawn(watched("backlog gauges", &stop_background).run(ended(run)));
        background.close();
        Ok(Node {
            outbox,
            store,
            assignment,
            leaving,
            holds_none: holds_none.subscribe(),
            failed,
            fault,
            stop_processor,
            stop_background,
            background,
            processor,
        })
    }

    /// This instance's id (a new one after the instance was declared dead and registered again).
    pub fn id(&self) -> InstanceId {
        self.assignment.borrow().instance
    }

    /// The instance id, partitions (and epochs) and lease deadline currently handed to the processor.
    pub fn assignment(&self) -> watch::Receiver<Assignment> {
        self.assignment.clone()
    }

    /// Graceful stop: hand each partition over as soon as its records in flight are completed, then
    /// stop, release whatever is left and deregister. It ends within the outbox `shutdown_timeout`, and
    /// `query_timeout` more for the last release and deregistration, whatever the database does: set
    /// the service's grace period to their sum. A handler call that blocks its thread is the exception:
    /// it cannot be cancelled, and the stop waits for it (see `Processor::run`). What it could not hand over in that time moves on when
    /// the lease runs out, as after a crash. A partition taken from a dead owner and still in its quiet
    /// period is released too: its next owner waits out the rest of the period.
    /// Every task is stopped whatever a step returns, and waited for within the same budget, so that
    /// the process may exit once it returns (a registration still under way past the budget, on a
    /// database that slow, is taken back when it lands if the process lives on); the first error is
    /// returned, and each is logged.
    /// Pointing the targets at the others once deregistered only speeds their next round up: its
    /// failure is a warning.
    ///
    /// Given up part way (its future dropped: a caller's time limit, a `select!`), it stops every task
    /// at once, as [`Node::kill`] does, and the partitions move on when the lease runs out.
    pub fn shutdown(self) -> impl Future<Output = Result<()>> + Send {
        // Armed before the first poll: a stop dropped before it ever ran stops the tasks too.
        let given_up = GivenUp(Some((self.id(), self.processor.abort_handle(), self.stop_background.clone())));
        self.stop(given_up)
    }

    async fn stop(mut self, given_up: GivenUp) -> Result<()> {
        let id = self.id();
        let (timeout, last) = (self.outbox.config().shutdown_timeout, self.outbox.config().query_timeout);
        // One deadline for the steps up to the last release: each waiting its own limit made the stop
        // outlast a grace period set to `shutdown_timeout` when the database was slow.
        let stop_by = tokio::time::Instant::now() + timeout;
        // The processor stops fetching now and finishes what is in flight within `shutdown_timeout`
        // from here, its stop's own deadline; leaving, the instance is assigned nothing more.
        self.stop_processor.cancel();
        let drained = if self.failed.is_cancelled() {
            // Its tasks are stopped: there is no handover to wait for, only what is left to release.
            Ok(())
        } else {
            let drain = tokio::time::timeout_at(stop_by, self.store.drain(id)).await;
            drain.unwrap_or(Err(Error::Core(outbox_core::Error::ShutdownTimeout(timeout))))
        };
        match &drained {
            Ok(()) => {
                // The ownership task points the targets elsewhere and releases partition by partition,
                // as the processor completes each one's records.
                self.leaving.cancel();
                let handed_over = async {
                    tokio::select! {
                        _ = self.holds_none.wait_for(|&none| none) => {}
                        // No ownership task is left to hand anything over.
                        () = self.failed.cancelled() => {}
                    }
                };
                if tokio::time::timeout_at(stop_by, handed_over).await.is_err() {
                    warn!(instance = %id, ?timeout, "partitions not all handed over in time; releasing the rest at stop");
                }
            }
            Err(e) => warn!(instance = %id, error = %e, "could not mark the instance draining; stopping anyway"),
        }
        // Its own deadline bounds it, and it returns only once the calls it gave up are dropped, before
        // anything is released.
        let processed = (&mut self.processor).await.map_err(|e| Error::Task(e.to_string())).and_then(|r| r);
        self.stop_background.cancel();
        let (outbox, store, background) = (&self.outbox, &self.store, &self.background);
        let assignment = &self.assignment;
        let release = async {
            // A round or renewal under way ends first, so that nothing is acquired behind the release,
            // but within half the budget: the release needs the rest more (what a round under way
            // acquires meanwhile stays with the instance, and moves on as from a dead one).
            let _ = tokio::time::timeout(last / 2, background.wait()).await;
            let id = assignment.borrow().instance;
            ownership::hand_over(store, id).await
        };
        let released_by = tokio::time::Instant::now() + last;
        let handed_over = tokio::time::timeout_at(released_by, release)
            .await
            .unwrap_or(Err(Error::Core(outbox_core::Error::QueryTimeout { work: "releasing at stop", after: last })));
        metrics::gauge!("outbox_owned_partitions", "schema" => self.outbox.schema_label()).set(0.0);
        let id = self.id();
        let handed_over = match handed_over {
            Ok(moved) => {
                info!(instance = %id, "instance stopped and deregistered");
                // In what is left of the same budget; past it, the leader's next round does the same.
                let told = ownership::tell_next_owners(outbox, store, id, &moved);
                if tokio::time::timeout_at(released_by, told).await.is_err() {
                    warn!(instance = %id, "pointing the targets elsewhere at stop ran out of time; the leader's next round will");
                }
                Ok(())
            }
            Err(e) => {
                warn!(instance = %id, error = %e,
                    "could not release the partitions left or deregister; they move on when the lease runs out");
                Err(e)
            }
        };
        // A task still under way (a registration under a new id, which the heartbeat takes back once it
        // lands) is waited for, within the budget.
        if tokio::time::timeout_at(released_by, background.wait()).await.is_err() {
            warn!(instance = %id, "a heartbeat or round still under way when the stop ended");
        }
        let fault = self.fault.get().map_or(Ok(()), |fault| Err(Error::Task(fault.clone())));
        given_up.finished();
        drained.and(processed).and(handed_over).and(fault)
    }

    /// Completes if one of the node's tasks ends on a fault (see [`Node::shutdown`]): the node has
    /// stopped delivering and heartbeating, and its partitions go on once its lease runs out. A service
    /// should then call `shutdown` (which returns the fault) and start a new node, or exit to be
    /// restarted.
    pub fn faulted(&self) -> impl Future<Output = ()> + Send + 'static {
        self.failed.clone().cancelled_owned()
    }

    /// Stops every task at once without completing, releasing or deregistering: what a crash looks like
    /// to the rest of the cluster (for tests and demos).
    pub fn kill(self) {
        self.processor.abort();
        self.stop_background.cancel();
    }
}

/// Stops a node's tasks if its `shutdown` is dropped before it finishes: its heartbeat and ownership
/// rounds otherwise ran on for the life of the process, a live instance that the leader gave a share
/// nobody delivered (its processor stopped at the first step).
struct GivenUp(Option<(InstanceId, tokio::task::AbortHandle, CancellationToken)>);

impl GivenUp {
    fn finished(mut self) {
        self.0 = None;
    }
}

impl Drop for GivenUp {
    fn drop(&mut self) {
        if let Some((instance, processor, background)) = self.0.take() {
            warn!(%instance, "shutdown given up part way: every task stopped at once; the partitions move on when the lease runs out");
            processor.abort();
            background.cancel();
        }
    }
}

/// One of a node's tasks. None ends before it is asked to stop, save by a fault (a panic in the library's
/// own code, or one a dependency raised). A node missing a task cannot go on as a member, so the first
/// to end unasked stops every other one, the heartbeat included, and says why: the lease runs out and
/// the partitions go on as from a crashed instance, instead of staying with an instance that no longer
/// delivers them (or, without the ownership task, never hands them over).
struct Watched {
    task: &'static str,
    assignment: watch::Receiver<Assignment>,
    /// What asks this task to stop.
    stop: CancellationToken,
    failed: CancellationToken,
    fault: Arc<OnceLock<String>>,
    /// The `schema` label of the node's metrics.
    schema: SharedString,
}

impl Watched {
    async fn run(self, task: impl Future<Output = Result<()>>) -> Result<()> {
        let ended = AssertUnwindSafe(task).catch_unwind().await.unwrap_or_else(|panic| {
            let message = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            Err(Error::Task(format!("the {} task panicked: {message}", self.task)))
        });
        if !self.stop.is_cancelled() {
            let instance = self.assignment.borrow().instance;
            let error =
                ended.as_ref().err().map_or_else(|| format!("the {} task ended", self.task), ToString::to_string);
            error!(%instance, task = self.task, %error,
                "a node task ended unasked: stopping the node, whose partitions go on once its lease runs out");
            self.fault.get_or_init(|| format!("instance {instance}: {error}"));
            metrics::gauge!("outbox_owned_partitions", "schema" => self.schema.clone()).set(0.0);
            self.failed.cancel();
        }
        ended
    }
}

/// A background task, which ends with nothing to say.
async fn ended(task: impl Future<Output = ()>) -> Result<()> {
    task.await;
    Ok(())
}
