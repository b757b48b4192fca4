//! The processor: delivers the records of the partitions this instance holds.
//!
//! One loop per instance keeps three things going at once, never waiting on each other:
//! - **fetch** (`fetch.rs`): one round trip reads the head record of up to `batch_size` keys (one per key,
//!   keys in flight excluded, blocked keys passed over) from the held partitions, fenced by the
//!   instance's (owner, epoch) and its live lease;
//! - **deliver** (`deliver.rs`): each key's run (its head and up to `key_lookahead - 1` records after it)
//!   goes to its handler in its own task, one record after another, each finished before the next
//!   starts, up to `concurrency` keys at once; a key is fetched again only after its run is completed
//!   in the database, so a slow key holds only its own slot (a crash before that completion redelivers
//!   the run: at least once);
//! - **complete** (`complete.rs`): outcomes are written in batches, each statement fenced by (owner, epoch)
//!   per partition: a worker that lost a partition changes nothing.
//!
//! Which partitions it holds, under which instance id and epoch, and until when its lease lets it
//! deliver, comes from an [`Assignment`] watch channel fed by the ownership layer (`outbox-cluster`).
//! When a partition leaves the assignment the processor stops fetching it at once and its runs stop
//! before their next record; [`Processor::busy_partitions`] tells when its in-flight records are done,
//! so the partition can be released (release-before-acquire).
//!
//! # What is exclusive
//! A handler call starts only while the assignment grants the record's partition at its epoch and the
//! lease has not run out, and the records it delivers were fetched while the database still showed this
//! instance as the partition's owner at that epoch with a live lease. When the lease runs out, or a
//! completion finds the partition's epoch moved on, the calls still running for it are cancelled (their
//! futures dropped at their next `.await`; their records are delivered again). So no handler call for a
//! partition starts, or keeps running, once another instance may have taken it, with one exception no
//! library can prevent: a call already running in a process that was stopped (SIGSTOP, a frozen VM)
//! goes on when the process resumes, until the processor notices the lease ran out and cancels it.

mod complete;
mod deliver;
mod fetch;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use sqlx::PgPool;
use tokio::sync::watch;
use tokio::task::{Id as TaskId, JoinSet};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, error, info, instrument, warn};
use uuid::Uuid;

pub(crate) use complete::Written;
pub use deliver::MAX_ERROR_BYTES;
pub(crate) use deliver::{Outcome, Verdict};
pub(crate) use fetch::{FetchedRow, Request};

use self::complete::{Flushed, complete};
use self::deliver::{Context, deliver_run};
use self::fetch::{Cursors, Fetched, Found, fetch_runs};
use crate::Outbox;
use crate::config::Config;
use crate::db::Db;
use crate::error::{Error, Result};
use crate::handler::Handlers;
use crate::partition::Partition;

/// Partitions with the epoch held for each.
pub type Epochs = BTreeMap<Partition, i64>;

/// A point in time on two clocks: the monotonic clock, which no clock step moves, and the wall clock,
/// which (unlike the monotonic clock) goes on while a virtual machine is suspended. It has passed once
/// either clock says so, so a lease deadline cannot outlive a suspension whose host corrects its wall
/// clock on resume.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deadline {
    at: Instant,
    wall: SystemTime,
}

impl Deadline {
    /// Now.
    pub fn now() -> Self {
        Self { at: Instant::now(), wall: SystemTime::now() }
    }

    /// `duration` after this one.
    pub fn after(self, duration: Duration) -> Self {
        Self { at: self.at + duration, wall: self.wall + duration }
    }

    /// Whether it has passed, by either clock.
    pub fn passed(&self) -> bool {
        Instant::now() >= self.at || SystemTime::now() >= self.wall
    }

    /// The monotonic instant (for timers).
    pub fn instant(&self) -> Instant {
        self.at
    }
}

/// What the processor may process: the instance whose lease holds the partitions, the partitions with
/// their epochs, and the lease's deadline, after which it must neither fetch nor start a handler call
/// and cancels the calls running (the lease may have expired, e.g. while the process was paused).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Assignment {
    /// The instance id registered in the instances table: every fetch and completion is fenced by it
    /// (its lease must be live, and it must own the partitions).
    pub instance: Uuid,
    /// Partitions and epochs.
    pub epochs: Epochs,
    /// The lease's deadline; `None`: no deadline (the database's lease still fences every fetch).
    pub lease: Option<Deadline>,
}

impl Assignment {
    /// An assignment without deadline.
    pub fn new(instance: Uuid, epochs: Epochs) -> Self {
        Self { instance, epochs, lease: None }
    }

    /// Whether the lease lets the processor fetch and deliver.
    pub fn is_live(&self) -> bool {
        self.lease.is_none_or(|deadline| !deadline.passed())
    }

    /// Whether a handler call for `partition` may start under `instance` at `epoch`.
    pub fn grants(&self, instance: Uuid, partition: Partition, epoch: i64) -> bool {
        self.instance == instance && self.is_live() && self.epochs.get(&partition) == Some(&epoch)
    }
}

/// Delivers the records of the assigned partitions. See the [module docs](self).
pub struct Processor {
    outbox: Outbox,
    db: Db,
    handlers: Arc<Handlers>,
    assignment: watch::Receiver<Assignment>,
    busy: watch::Sender<BTreeSet<Partition>>,
}

impl Processor {
    /// A processor delivering through `handlers` what `assignment` holds.
    pub fn new(outbox: Outbox, db: impl Into<Db>, handlers: Handlers, assignment: watch::Receiver<Assignment>) -> Self {
        Self { outbox, db: db.into(), handlers: Arc::new(handlers), assignment, busy: watch::Sender::default() }
    }

    /// Partitions with records in flight (delivering or awaiting completion). A partition that left the
    /// assignment can be released once it is absent here.
    pub fn busy_partitions(&self) -> watch::Receiver<BTreeSet<Partition>> {
        self.busy.subscribe()
    }

    /// Runs until `shutdown`, then stops fetching, lets in-flight deliveries finish, completes them and
    /// returns. Gives up after `shutdown_timeout` with [`Error::ShutdownTimeout`]; what was not completed
    /// is delivered again later (at least once).
    ///
    /// # Cancel safety
    /// Dropping the future abandons in-flight deliveries without completing them; they are redelivered.
    #[instrument(skip_all, fields(instance = %self.assignment.borrow().instance))]
    pub async fn run(mut self, shutdown: CancellationToken) -> Result<()> {
        let config = self.outbox.config().clone();
        let context = Arc::new(Context {
            handlers: self.handlers.clone(),
            config: config.clone(),
            assignment: self.assignment.clone(),
            shutdown: shutdown.clone(),
        });
        let mut state = State::new(config);
        loop {
            let current = self.assignment.borrow().clone();
            if !current.is_live() {
                state.cancels.lease_ran_out(state.in_flight.len());
            }
            state.start_fetch(&self.outbox, &self.db, &current);
            state.start_flush(&self.outbox, &self.db);
            if state.stop_deadline.is_some() && state.is_idle() {
                info!("processor stopped: in-flight records completed");
                return Ok(());
            }
            let lease_deadline = current.lease.filter(|_| current.is_live()).map(|d| d.instant());

            tokio::select! {
                () = shutdown.cancelled(), if state.stop_deadline.is_none() => {
                    info!(in_flight = state.in_flight.len(), "processor stopping: no new fetches, finishing in-flight records");
                    state.stop_deadline = Some(Instant::now() + state.config.shutdown_timeout);
                    state.fetch = None;
                }
                () = sleep_until_opt(state.stop_deadline) => {
                    warn!(in_flight = state.in_flight.len(), "graceful stop timed out; unfinished records will be redelivered");
                    state.deliveries.abort_all();
                    return Err(Error::ShutdownTimeout(state.config.shutdown_timeout));
                }
                Some(joined) = state.deliveries.join_next_with_id() => {
                    state.on_joined(joined);
                    self.publish_busy(&state.in_flight);
                }
                (request, fetched) = poll_opt(&mut state.fetch) => {
                    state.fetch = None;
                    state.on_fetched(&request, fetched, &self.assignment.borrow(), &context);
                    self.publish_busy(&state.in_flight);
                }
                flushed = poll_opt(&mut state.flush) => {
                    state.flush = None;
                    state.on_flushed(flushed);
                    self.publish_busy(&state.in_flight);
                }
                () = tokio::time::sleep_until(state.flush_not_before), if !state.outcomes.is_empty() && state.flush.is_none() => {}
                () = sleep_until_opt(state.next_due) => { state.next_due = None; state.want_fetch = true; }
                () = tokio::time::sleep_until(state.next_poll), if state.fetch.is_none() => state.poll_due(),
                () = sleep_until_opt(lease_deadline) => {}
                changed = self.assignment.changed(), if state.assignment_open => {
                    if changed.is_err() {
                        // The ownership layer is gone, so ownership can no longer be confirmed: stop as
                        // if asked to (in-flight records are still completed under their epochs).
                        warn!("assignment source closed; stopping");
                        state.assignment_open = false;
                        shutdown.cancel();
                    }
                    state.on_assignment(&self.assignment.borrow());
                }
            }
        }
    }

    fn publish_busy(&self, in_flight: &HashMap<String, Partition>) {
        let busy: BTreeSet<Partition> = in_flight.values().copied().collect();
        self.busy.send_if_modified(|current| {
            let changed = *current != busy;
            *current = busy;
            changed
        });
    }
}

type Pending<T> = Option<Pin<Box<dyn Future<Output = T> + Send>>>;

/// The processor loop's state; each `on_*` method handles one kind of event.
struct State {
    config: Config,
    /// Keys dispatched and not yet completed in the database, with their partition.
    in_flight: HashMap<String, Partition>,
    deliveries: JoinSet<(String, Vec<Outcome>)>,
    /// The key of each delivery task, to release it if the task ends without an answer.
    tasks: HashMap<TaskId, String>,
    /// Outcomes waiting for the next flush.
    outcomes: Vec<Outcome>,
    fetch: Pending<(Request, Result<Found>)>,
    flush: Pending<Flushed>,
    flush_backoff: Duration,
    flush_not_before: Instant,
    /// Partitions whose completion was fenced out under this (instance, epoch): not fetched again until
    /// the assignment holds them under another.
    fenced: BTreeMap<Partition, (Uuid, i64)>,
    cancels: Cancels,
    cursors: Cursors,
    /// Records fetched after each head: only with stop-on-first-failure, where a key's records go
    /// strictly one after another anyway.
    followers: usize,
    want_fetch: bool,
    next_due: Option<Instant>,
    next_poll: Instant,
    last_found: Option<Instant>,
    rotation: usize,
    stop_deadline: Option<Instant>,
    assignment_open: bool,
}

impl State {
    fn new(config: Config) -> Self {
        let followers = if config.stop_on_first_failure { config.key_lookahead - 1 } else { 0 };
        Self {
            next_poll: Instant::now() + config.poll_interval,
            config,
            in_flight: HashMap::new(),
            deliveries: JoinSet::new(),
            tasks: HashMap::new(),
            outcomes: Vec::new(),
            fetch: None,
            flush: None,
            flush_backoff: FLUSH_RETRY_MIN,
            flush_not_before: Instant::now(),
            fenced: BTreeMap::new(),
            cancels: Cancels::default(),
            cursors: Cursors::default(),
            followers,
            want_fetch: true,
            next_due: None,
            last_found: None,
            rotation: 0,
            stop_deadline: None,
            assignment_open: true,
        }
    }

    /// Nothing in flight, being fetched or being written.
    fn is_idle(&self) -> bool {
        self.in_flight.is_empty() && self.fetch.is_none() && self.flush.is_none()
    }

    fn start_fetch(&mut self, outbox: &Outbox, db: &Db, current: &Assignment) {
        let room = self.config.concurrency.saturating_sub(self.in_flight.len());
        if self.stop_deadline.is_some() || !self.want_fetch || self.fetch.is_some() || room == 0 || !current.is_live() {
            return;
        }
        self.want_fetch = false;
        let held = current.epochs.iter().filter(|&(p, &e)| self.fenced.get(p) != Some(&(current.instance, e)));
        let partitions: Vec<(Partition, i64, Option<String>)> =
            rotate(held.map(|(&p, &e)| (p, e, self.cursors.of(p))).collect(), &mut self.rotation);
        if partitions.is_empty() {
            return;
        }
        let request = Request {
            instance: current.instance,
            partitions,
            exclude: self.in_flight.keys().cloned().collect(),
            limit: self.config.batch_size.min(room),
            followers: self.followers,
        };
        let (outbox, db) = (outbox.clone(), db.clone());
        self.fetch = Some(Box::pin(async move {
            let found = fetch_runs(&outbox, &db, &request).await;
            (request, found)
        }));
    }

    fn start_flush(&mut self, outbox: &Outbox, db: &Db) {
        if self.flush.is_some() || self.outcomes.is_empty() || Instant::now() < self.flush_not_before {
            return;
        }
        let batch = std::mem::take(&mut self.outcomes);
        let (outbox, db) = (outbox.clone(), db.clone());
        self.flush = Some(Box::pin(async move { complete(&outbox, &db, batch).await }));
    }

    fn on_fetched(&mut self, request: &Request, found: Result<Found>, current: &Assignment, context: &Arc<Context>) {
        let found = match found {
            Ok(found) => found,
            Err(e) => {
                warn!(error = %e, instance = %request.instance, "fetch failed; retrying at the next poll");
                return;
            }
        };
        // A full batch may have left more; and a completion that landed while this fetch ran has
        // already asked for another (its keys' next records may not have been visible to this fetch):
        // keep that request.
        self.want_fetch |= found.runs.len() == request.limit;
        if !found.runs.is_empty() {
            self.last_found = Some(Instant::now());
        }
        // A fetch that just ran is as good as a poll: the next poll is one interval after it.
        self.next_poll = Instant::now() + self.poll_interval();
        self.cursors.advance(&found.last_served);
        for run in found.runs {
            let Some(head) = run.first() else { continue };
            let (partition, epoch) = (head.record.partition, head.record.epoch);
            // The assignment may have changed, or the lease run out, while the fetch ran.
            if !current.grants(request.instance, partition, epoch) {
                continue;
            }
            let key = head.record.key.clone();
            self.in_flight.insert(key.clone(), partition);
            let fenced = self.cancels.token(partition, request.instance, epoch);
            let task = self.deliveries.spawn(deliver_run(context.clone(), run, fenced).in_current_span());
            self.tasks.insert(task.id(), key);
        }
    }

    fn on_joined(&mut self, joined: std::result::Result<(TaskId, (String, Vec<Outcome>)), tokio::task::JoinError>) {
        match joined {
            Ok((task, (key, outcomes))) => {
                self.tasks.remove(&task);
                if outcomes.is_empty() {
                    self.in_flight.remove(&key);
                } else {
                    self.outcomes.extend(outcomes);
                }
            }
            Err(e) => {
                // Deliveries catch their handlers' panics; this is a bug in the processor or an abort.
                let key = self.tasks.remove(&e.id()).unwrap_or_default();
                error!(error = %e, key, "delivery task ended without an outcome; its records will be delivered again");
                self.in_flight.remove(&key);
            }
        }
    }

    fn on_flushed(&mut self, flushed: Flushed) {
        let Flushed { settled, written, retry } = flushed;
        for outcome in settled {
            self.in_flight.remove(&outcome.key);
            let grant = (outcome.partition, outcome.instance, outcome.epoch);
            if written.ids.contains(&outcome.id) {
                record_metrics(&outcome);
                if let Verdict::Retry { delay, .. } = outcome.verdict {
                    let due = Instant::now() + delay;
                    self.next_due = Some(self.next_due.map_or(due, |d| d.min(due)));
                }
            } else if written.held.contains(&grant) {
                debug!(record = %outcome.id, key = %outcome.key, partition = outcome.partition,
                    "outcome already settled (an earlier attempt committed, or the record was removed or requeued)");
            } else if self.fenced.insert(outcome.partition, (outcome.instance, outcome.epoch))
                != Some((outcome.instance, outcome.epoch))
            {
                warn!(partition = outcome.partition, instance = %outcome.instance, epoch = outcome.epoch,
                    record = %outcome.id, key = %outcome.key,
                    "fenced out: the partition has a new owner or epoch; stopped processing it");
                self.cancels.cancel(grant);
            }
        }
        if let Some((batch, e)) = retry {
            warn!(error = %e, records = batch.len(), retry_in = ?self.flush_backoff, "completion failed; retrying");
            self.outcomes.extend(batch);
            self.flush_not_before = Instant::now() + self.flush_backoff;
            self.flush_backoff = (self.flush_backoff * 2).min(FLUSH_RETRY_MAX);
        } else {
            self.flush_backoff = FLUSH_RETRY_MIN;
        }
        self.want_fetch = true;
    }

    fn on_assignment(&mut self, current: &Assignment) {
        self.fenced.retain(|p, held| current.epochs.get(p) == Some(&held.1) && current.instance == held.0);
        // Calls of partitions that left the assignment finish (a graceful handover); only their
        // cancellation handles are forgotten.
        self.cancels
            .grants
            .retain(|(p, instance, epoch), _| current.instance == *instance && current.epochs.get(p) == Some(epoch));
        self.cursors.retain(|p| current.epochs.contains_key(&p));
        self.want_fetch = true;
    }

    fn poll_due(&mut self) {
        self.want_fetch = true;
        self.next_poll = Instant::now() + self.poll_interval();
    }

    /// Adaptive polling: every `active_poll_interval` while fetches keep finding records (low latency
    /// under load), every `poll_interval` once a whole [`ACTIVE_WINDOW`] found nothing (cheap when idle).
    fn poll_interval(&self) -> Duration {
        let active = self.last_found.is_some_and(|at| at.elapsed() < ACTIVE_WINDOW);
        if active { self.config.active_poll_interval } else { self.config.poll_interval }
    }
}

/// Cancellation of running handler calls: one token per (partition, instance, epoch) that runs are
/// delivering under, all children of the lease's token.
#[derive(Debug, Default)]
struct Cancels {
    lease: CancellationToken,
    grants: HashMap<(Partition, Uuid, i64), CancellationToken>,
}

impl Cancels {
    /// The token a run under this grant watches.
    fn token(&mut self, partition: Partition, instance: Uuid, epoch: i64) -> CancellationToken {
        if self.lease.is_cancelled() {
            self.lease = CancellationToken::new();
            self.grants.clear();
        }
        let lease = &self.lease;
        self.grants.entry((partition, instance, epoch)).or_insert_with(|| lease.child_token()).clone()
    }

    /// The lease ran out: cancels every running call (once).
    fn lease_ran_out(&mut self, in_flight: usize) {
        if !self.lease.is_cancelled() {
            if in_flight > 0 {
                warn!(in_flight, "lease ran out: no new deliveries, running handler calls cancelled");
            }
            self.lease.cancel();
            self.grants.clear();
        }
    }

    /// The partition moved on under this grant: cancels its running calls.
    fn cancel(&mut self, grant: (Partition, Uuid, i64)) {
        if let Some(token) = self.grants.remove(&grant) {
            token.cancel();
        }
    }
}

/// Emits the outcome's metrics once it is written (see the README's metrics table).
fn record_metrics(outcome: &Outcome) {
    match outcome.verdict {
        Verdict::Delivered | Verdict::Fallback => {
            let how = if matches!(outcome.verdict, Verdict::Fallback) { "fallback" } else { "delivered" };
            metrics::counter!("outbox_records_completed_total", "outcome" => how).increment(1);
            // Scheduling transaction start (database clock) to completion (host clock).
            let latency = (chrono::Utc::now() - outcome.created_at).to_std().unwrap_or_default();
            metrics::histogram!("outbox_delivery_latency_seconds").record(latency.as_secs_f64());
        }
        Verdict::Retry { .. } => metrics::counter!("outbox_records_retried_total").increment(1),
        Verdict::Failed { .. } => metrics::counter!("outbox_records_failed_total").increment(1),
    }
}

/// How long after the last fetch that found records the processor keeps polling at the active rate.
const ACTIVE_WINDOW: Duration = Duration::from_secs(1);

const FLUSH_RETRY_MIN: Duration = Duration::from_millis(100);
const FLUSH_RETRY_MAX: Duration = Duration::from_secs(5);

/// Starts the partition list at a different place each fetch, so no partition is always served last.
fn rotate<T>(mut list: Vec<T>, rotation: &mut usize) -> Vec<T> {
    if !list.is_empty() {
        *rotation = (*rotation + 1) % list.len();
        list.rotate_left(*rotation);
    }
    list
}

async fn poll_opt<T>(pending: &mut Pending<T>) -> T {
    match pending {
        Some(future) => future.await,
        None => std::future::pending().await,
    }
}

async fn sleep_until_opt(deadline: Option<Instant>) {
    match deadline {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Starts a transaction for the processor's statements, with JIT compilation off. The planner prices
/// the fetch's loose index scan far above `jit_above_cost`, so with JIT on (PostgreSQL's default) every
/// fetch would be compiled first, at many times the query's own cost. `BEGIN` and `SET LOCAL` travel in
/// one round trip; nothing outlives the transaction, so pooled connections are left as they were.
///
/// Cancel-safe: the `BEGIN` runs on a task of its own. sqlx 0.9's Postgres `begin` is not: a future
/// dropped while `BEGIN` is in flight returns its connection to the pool inside a transaction nobody
/// tracks (transact-rs/sqlx#4393), and the next borrower's statements then hold their row locks
/// forever. Dropped here, the task still finishes and its `Transaction` rolls back properly.
async fn begin(outbox: &Outbox, pool: &PgPool) -> Result<sqlx::Transaction<'static, sqlx::Postgres>> {
    let pool = pool.clone();
    let begun = tokio::spawn(async move { pool.begin_with("BEGIN; SET LOCAL jit = off").await });
    // The task is never aborted; it can only end without an answer if it panicked inside sqlx.
    begun.await.unwrap_or(Err(sqlx::Error::WorkerCrashed)).map_err(|e| outbox.db_error(e))
}
#[cfg(test)]
pub(crate) mod tests {
    use sqlx::PgPool;

    use crate::{Config, NewRecord, Outbox};

    /// The processor's statements run with JIT off, and the pooled connection gets its setting back.
    #[sqlx::test(migrations = false)]
    async fn processor_transactions_run_without_jit(pool: PgPool) {
        let outbox = Outbox::new(Config::default()).unwrap();
        let mut tx = super::begin(&outbox, &pool).await.unwrap();
        let inside: String = sqlx::query_scalar("SHOW jit").fetch_one(&mut *tx).await.unwrap();
        tx.commit().await.unwrap();
        assert_eq!(inside, "off");
        let after: String = sqlx::query_scalar("SHOW jit").fetch_one(&pool).await.unwrap();
        let default: String =
            sqlx::query_scalar("SELECT reset_val FROM pg_settings WHERE name = 'jit'").fetch_one(&pool).await.unwrap();
        assert_eq!(after, default);
    }

    /// A fetch or flush dropped at any point, even while its `BEGIN` is in flight, leaves no transaction
    /// open on the pooled connection (sqlx's own `begin` does: transact-rs/sqlx#4393).
    #[sqlx::test(migrations = false)]
    async fn a_dropped_begin_leaves_no_transaction_open(pool: PgPool) {
        let options = pool.connect_options().as_ref().clone();
        let single = sqlx::postgres::PgPoolOptions::new().max_connections(1).connect_with(options).await.unwrap();
        let outbox = Outbox::new(Config::default()).unwrap();
        // Sweep the drop point across the BEGIN round trip (tens of microseconds on loopback).
        for step in 0..300_u64 {
            let dropped =
                tokio::time::timeout(std::time::Duration::from_micros(step * 2), super::begin(&outbox, &single));
            if let Ok(tx) = dropped.await {
                drop(tx.unwrap());
            }
            // The task of a dropped `begin` finishes and rolls back before the connection idles in the pool.
            let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(&single).await.unwrap();
            let mut state = String::new();
            for _ in 0..100 {
                state = sqlx::query_scalar("SELECT state FROM pg_stat_activity WHERE pid = $1")
                    .bind(pid)
                    .fetch_one(&pool)
                    .await
                    .unwrap();
                if state != "active" {
                    break;
                }
                tokio::time::sleep(std::time::Duration::from_millis(1)).await;
            }
            assert_eq!(state, "idle", "connection state after dropping begin at {} µs", step * 2);
        }
    }

    /// A key's run stops before the record that would take its payloads past `key_lookahead_bytes`;
    /// a head larger than the budget still comes, alone. On both backends.
    #[sqlx::test(migrations = false)]
    async fn lookahead_stops_at_the_byte_budget(pool: PgPool) {
        lookahead_stops_at_the_byte_budget_on(pool.into()).await;
        let sqlite = crate::db::sqlite_memory().await;
        lookahead_stops_at_the_byte_budget_on(sqlite.into()).await;
    }

    async fn lookahead_stops_at_the_byte_budget_on(db: crate::Db) {
        let outbox = Outbox::new(Config { key_lookahead_bytes: 64 * 1024, ..Config::default() }).unwrap();
        outbox.migrate(&db).await.unwrap();
        let mut records = Vec::new();
        for _ in 0..5 {
            records.push(NewRecord::new("large", "t", vec![0_u8; 30 * 1024]));
            records.push(NewRecord::new("small", "t", vec![0_u8; 10]));
        }
        records.push(NewRecord::new("huge", "t", vec![0_u8; 100 * 1024]));
        records.push(NewRecord::new("huge", "t", vec![0_u8; 10]));
        match &db {
            crate::Db::Postgres(pool) => {
                let mut tx = pool.begin().await.unwrap();
                outbox.schedule_batch(&mut tx, &records).await.unwrap();
                tx.commit().await.unwrap();
            }
            crate::Db::Sqlite(pool) => {
                let mut tx = pool.begin().await.unwrap();
                outbox.schedule_batch(&mut tx, &records).await.unwrap();
                tx.commit().await.unwrap();
            }
        }

        let instance = hold_all(&db).await;
        let request = super::Request {
            instance,
            partitions: crate::partition::all_partitions().map(|p| (p, 1, None)).collect(),
            exclude: vec![],
            limit: 10,
            followers: 7,
        };
        let found = super::fetch_runs(&outbox, &db, &request).await.unwrap();
        let mut lengths: Vec<(String, usize)> =
            found.runs.iter().map(|run| (run[0].record.key.clone(), run.len())).collect();
        lengths.sort();
        let expected = [("huge".to_string(), 1), ("large".to_string(), 2), ("small".to_string(), 5)];
        assert_eq!(lengths, expected);
        for run in &found.runs {
            assert!(run.windows(2).all(|w| w[1].record.seq > w[0].record.seq), "a run is in order: {run:?}");
        }
    }

    /// Registers an instance with a lease a day long and gives it every partition at epoch 1.
    pub(crate) async fn hold_all(db: &crate::Db) -> uuid::Uuid {
        let all: Vec<i16> = (0..256).collect();
        hold(db, &all, 1).await
    }

    /// Registers an instance with a lease a day long and gives it `partitions` at `epoch`.
    pub(crate) async fn hold(db: &crate::Db, partitions: &[i16], epoch: i64) -> uuid::Uuid {
        let me = uuid::Uuid::now_v7();
        let (register, own) = match db {
            crate::Db::Postgres(_) => (
                "INSERT INTO outbox.instances (id, name, expires_at) VALUES ($1, 'test', now() + interval '1 day')",
                "UPDATE outbox.partitions SET owner = $1, epoch = $2 WHERE partition = ANY($3)",
            ),
            crate::Db::Sqlite(_) => (
                "INSERT INTO outbox_instances (id, name, expires_at) VALUES ($1, 'test', 4611686018427387903)",
                "UPDATE outbox_partitions SET owner = $1, epoch = $2 WHERE partition IN (SELECT value FROM json_each($3))",
            ),
        };
        match db {
            crate::Db::Postgres(pool) => {
                sqlx::query(register).bind(me).execute(pool).await.unwrap();
                sqlx::query(own).bind(me).bind(epoch).bind(partitions).execute(pool).await.unwrap();
            }
            crate::Db::Sqlite(pool) => {
                let json = format!("{partitions:?}");
                sqlx::query(register).bind(me).execute(pool).await.unwrap();
                sqlx::query(own).bind(me).bind(epoch).bind(json).execute(pool).await.unwrap();
            }
        }
        me
    }
}
