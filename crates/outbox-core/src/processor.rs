//! The processor: delivers the records of the partitions this instance owns.
//!
//! One loop per instance keeps three things going at once, never waiting on each other:
//! - **fetch**: one round trip reads the head record of up to `batch_size` keys (one per key, keys in
//!   flight excluded, blocked keys passed over) from the owned partitions;
//! - **deliver**: each key's run (its head and up to `key_lookahead - 1` records after it) goes to its
//!   handler in its own task, one record after another, each finished before the next starts, up to
//!   `concurrency` keys at once; a key is fetched again only after its run is completed in the
//!   database, so a slow key holds only its own slot (a crash before that completion redelivers the
//!   run: at least once);
//! - **complete**: outcomes are written in batches, each statement fenced by (owner, epoch) per
//!   partition: a worker that lost a partition changes nothing.
//!
//! Which partitions it owns, and at which epoch, comes from an [`Assignment`] watch channel fed by the
//! ownership layer (`outbox-cluster`). When a partition leaves the assignment the processor stops
//! fetching it at once; [`Processor::busy_partitions`] tells when its in-flight records are done, so the
//! partition can be released (release-before-acquire).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use sqlx::PgPool;

use crate::db::Db;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, instrument, warn};
use uuid::Uuid;

use crate::Outbox;
use crate::error::{Error, Result};
use crate::handler::{FailureKind, HandlerError, Handlers};
use crate::operator::partition_from_db;
use crate::partition::Partition;
use crate::record::{Headers, Record};
use crate::sql::stmt;

/// Partitions with the epoch held for each.
pub type Epochs = BTreeMap<Partition, i64>;

/// What the processor may process: partitions with their epochs, and a local deadline after which it
/// must not fetch or hand out anything (the ownership layer's lease may have expired meanwhile, e.g.
/// after the process was paused). Safety never depends on the deadline, only on the epochs; the
/// deadline keeps a woken zombie from delivering before it notices.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Assignment {
    /// Partitions and epochs.
    pub epochs: Epochs,
    /// No fetch or dispatch at or after this instant; `None`: no deadline.
    pub valid_until: Option<Instant>,
}

impl Assignment {
    /// An assignment without deadline.
    pub fn new(epochs: Epochs) -> Self {
        Self { epochs, valid_until: None }
    }

    /// The epoch of `partition` if it is assigned and the deadline has not passed.
    pub fn epoch(&self, partition: Partition) -> Option<i64> {
        if self.valid_until.is_some_and(|deadline| Instant::now() >= deadline) {
            return None;
        }
        self.epochs.get(&partition).copied()
    }
}

/// Delivers the records of the assigned partitions. See the [module docs](self).
pub struct Processor {
    outbox: Outbox,
    pool: Db,
    handlers: Arc<Handlers>,
    owner: Uuid,
    assignment: watch::Receiver<Assignment>,
    busy: watch::Sender<BTreeSet<Partition>>,
}

/// What happened to one delivery.
#[derive(Debug)]
pub(crate) enum Verdict {
    Delivered,
    Fallback,
    Retry { delay: Duration, error: String },
    Failed { error: String },
}

#[derive(Debug)]
pub(crate) struct Outcome {
    pub(crate) id: Uuid,
    pub(crate) partition: Partition,
    pub(crate) epoch: i64,
    key: String,
    /// Failed deliveries including this one (unchanged on success).
    pub(crate) attempts: i32,
    created_at: chrono::DateTime<chrono::Utc>,
    pub(crate) verdict: Verdict,
}

/// What one flush wrote.
struct Flushed {
    outcomes: Vec<Outcome>,
    /// Ids the database accepted; the rest were fenced out.
    written: BTreeSet<Uuid>,
}

/// A fetch's limit and its runs (a key's head and the records after it), each with the epoch it was
/// fetched under.
type Fetched = (usize, Result<Vec<(Vec<Record>, i64)>>);

/// A flush hands its outcomes back on error, so nothing is forgotten.
type FlushResult = std::result::Result<Flushed, (Vec<Outcome>, Error)>;

type Pending<T> = Option<Pin<Box<dyn Future<Output = T> + Send>>>;

impl Processor {
    /// A processor delivering through `handlers` for `owner`, processing what `assignment` holds.
    pub fn new(
        outbox: Outbox,
        db: impl Into<Db>,
        handlers: Handlers,
        owner: Uuid,
        assignment: watch::Receiver<Assignment>,
    ) -> Self {
        Self {
            outbox,
            pool: db.into(),
            handlers: Arc::new(handlers),
            owner,
            assignment,
            busy: watch::Sender::default(),
        }
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
    #[instrument(skip_all, fields(instance = %self.owner))]
    pub async fn run(mut self, shutdown: CancellationToken) -> Result<()> {
        let config = self.outbox.config().clone();
        // Adaptive polling: every `active_poll_interval` while fetches keep finding records (low
        // latency under load), every `poll_interval` once a whole ACTIVE_WINDOW found nothing (cheap
        // when idle).
        let mut last_found: Option<Instant> = None;
        let mut next_poll = Instant::now() + config.poll_interval;

        // Keys dispatched and not yet completed in the database, with their partition.
        let mut in_flight: HashMap<String, Partition> = HashMap::new();
        let mut deliveries: JoinSet<(String, Vec<Outcome>)> = JoinSet::new();
        // Records fetched after each head: only with stop-on-first-failure, where a key's records go
        // strictly one after another anyway.
        let followers = if config.stop_on_first_failure { config.key_lookahead - 1 } else { 0 };
        let mut outcomes: Vec<Outcome> = Vec::new();
        let mut fetch: Pending<Fetched> = None;
        let mut flush: Pending<FlushResult> = None;
        let mut flush_backoff = FLUSH_RETRY_MIN;
        let mut flush_not_before = Instant::now();
        // Partitions whose completion was fenced out at this epoch: not fetched again until the
        // assignment gives a new epoch.
        let mut fenced: BTreeMap<Partition, i64> = BTreeMap::new();
        let mut want_fetch = true;
        let mut next_due: Option<Instant> = None;
        let mut rotation = 0usize;
        let mut stop_deadline: Option<Instant> = None;
        let mut assignment_open = true;

        loop {
            let stopping = stop_deadline.is_some();
            if !stopping && want_fetch && fetch.is_none() && in_flight.len() < config.concurrency {
                let assignment = self.assignment.borrow().clone();
                let partitions: Vec<i16> = rotate(
                    assignment
                        .epochs
                        .iter()
                        .filter(|&(&p, e)| fenced.get(&p) != Some(e) && assignment.epoch(p).is_some())
                        .map(|(&p, _)| i16::from(p)),
                    &mut rotation,
                );
                want_fetch = false;
                if !partitions.is_empty() {
                    let limit = config.batch_size.min(config.concurrency - in_flight.len());
                    let exclude: Vec<String> = in_flight.keys().cloned().collect();
                    let (outbox, pool) = (self.outbox.clone(), self.pool.clone());
                    fetch = Some(Box::pin(async move {
                        let fetched = fetch_runs(&outbox, &pool, &partitions, &exclude, limit, followers).await;
                        (limit, fetched.map(|records| with_epochs(records, &assignment)))
                    }));
                }
            }
            if flush.is_none() && !outcomes.is_empty() && Instant::now() >= flush_not_before {
                let batch = std::mem::take(&mut outcomes);
                let (outbox, pool, owner) = (self.outbox.clone(), self.pool.clone(), self.owner);
                flush = Some(Box::pin(async move { complete(&outbox, &pool, owner, batch).await }));
            }
            if stopping && in_flight.is_empty() && fetch.is_none() && flush.is_none() {
                info!("processor stopped: in-flight records completed");
                return Ok(());
            }

            tokio::select! {
                () = shutdown.cancelled(), if !stopping => {
                    info!(in_flight = in_flight.len(), "processor stopping: no new fetches, finishing in-flight records");
                    stop_deadline = Some(Instant::now() + config.shutdown_timeout);
                    fetch = None;
                }
                () = sleep_until_opt(stop_deadline) => {
                    warn!(in_flight = in_flight.len(), "graceful stop timed out; unfinished records will be redelivered");
                    deliveries.abort_all();
                    return Err(Error::ShutdownTimeout(config.shutdown_timeout));
                }
                Some(joined) = deliveries.join_next() => match joined {
                    Ok((_, run)) if !run.is_empty() => outcomes.extend(run),
                    Ok((key, _)) => {
                        in_flight.remove(&key);
                        self.publish_busy(&in_flight);
                    }
                    // Only an abort gets here (panics are caught inside the task); nothing to complete.
                    Err(e) => error!(error = %e, "delivery task ended without an outcome"),
                },
                (limit, fetched) = poll_opt(&mut fetch) => {
                    fetch = None;
                    match fetched {
                        Ok(records) => {
                            // A full batch may have left more; and a completion that landed while this
                            // fetch ran has already asked for another (its keys' next records may not
                            // have been visible to this fetch): keep that request.
                            want_fetch |= records.len() == limit;
                            if !records.is_empty() {
                                last_found = Some(Instant::now());
                            }
                            // A fetch that just ran is as good as a poll: the next poll is one interval
                            // after it (fetches asked for by completions keep a busy processor from
                            // also polling on the clock).
                            let active = last_found.is_some_and(|at| at.elapsed() < ACTIVE_WINDOW);
                            next_poll = Instant::now()
                                + if active { config.active_poll_interval } else { config.poll_interval };
                            let current = self.assignment.borrow().clone();
                            for (mut run, epoch) in records {
                                let Some(head) = run.first() else { continue };
                                // The assignment may have changed, or its deadline passed, while the fetch ran.
                                if current.epoch(head.partition) != Some(epoch) {
                                    continue;
                                }
                                in_flight.insert(head.key.clone(), head.partition);
                                for record in &mut run {
                                    record.epoch = epoch;
                                }
                                let (handlers, config) = (self.handlers.clone(), config.clone());
                                let (assignment, stop) = (self.assignment.clone(), shutdown.clone());
                                deliveries.spawn(deliver_run(handlers, config, run, epoch, assignment, stop));
                            }
                            self.publish_busy(&in_flight);
                        }
                        Err(e) => warn!(error = %e, "fetch failed; retrying at the next poll"),
                    }
                }
                flushed = poll_opt(&mut flush) => {
                    flush = None;
                    match flushed {
                        Ok(Flushed { outcomes: done, written }) => {
                            flush_backoff = FLUSH_RETRY_MIN;
                            for outcome in done {
                                in_flight.remove(&outcome.key);
                                if written.contains(&outcome.id) {
                                    record_metrics(&outcome);
                                }
                                if !written.contains(&outcome.id) {
                                    if fenced.insert(outcome.partition, outcome.epoch) != Some(outcome.epoch) {
                                        warn!(partition = outcome.partition, epoch = outcome.epoch, record = %outcome.id,
                                            key = %outcome.key, "fenced out: partition has a new owner or epoch; stopped processing it");
                                    }
                                } else if let Verdict::Retry { delay, .. } = outcome.verdict {
                                    let due = Instant::now() + delay;
                                    next_due = Some(next_due.map_or(due, |d| d.min(due)));
                                }
                            }
                            self.publish_busy(&in_flight);
                            want_fetch = true;
                        }
                        Err((batch, e)) if e.is_transient() => {
                            warn!(error = %e, records = batch.len(), retry_in = ?flush_backoff, "completion failed; retrying");
                            outcomes.extend(batch);
                            flush_not_before = Instant::now() + flush_backoff;
                            flush_backoff = (flush_backoff * 2).min(FLUSH_RETRY_MAX);
                        }
                        Err((batch, e)) => {
                            // Not worth retrying: leave the records pending; they will be delivered again.
                            error!(error = %e, records = batch.len(), "completion failed; records will be redelivered");
                            for outcome in batch {
                                in_flight.remove(&outcome.key);
                            }
                            self.publish_busy(&in_flight);
                        }
                    }
                }
                () = tokio::time::sleep_until(flush_not_before), if !outcomes.is_empty() && flush.is_none() => {}
                () = sleep_until_opt(next_due) => { next_due = None; want_fetch = true; }
                () = tokio::time::sleep_until(next_poll), if fetch.is_none() => {
                    want_fetch = true;
                    let active = last_found.is_some_and(|at| at.elapsed() < ACTIVE_WINDOW);
                    next_poll = Instant::now() + if active { config.active_poll_interval } else { config.poll_interval };
                }
                changed = self.assignment.changed(), if assignment_open => {
                    if changed.is_err() {
                        // The ownership layer is gone, so ownership can no longer be confirmed: stop as
                        // if asked to (in-flight records are still completed under their epochs).
                        warn!("assignment source closed; stopping");
                        assignment_open = false;
                        shutdown.cancel();
                    }
                    let current = self.assignment.borrow();
                    fenced.retain(|p, e| current.epochs.get(p) == Some(e));
                    want_fetch = true;
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
fn rotate(partitions: impl Iterator<Item = i16>, rotation: &mut usize) -> Vec<i16> {
    let mut list: Vec<i16> = partitions.collect();
    if !list.is_empty() {
        *rotation = (*rotation + 1) % list.len();
        list.rotate_left(*rotation);
    }
    list
}

fn with_epochs(runs: Vec<Vec<Record>>, assignment: &Assignment) -> Vec<(Vec<Record>, i64)> {
    runs.into_iter()
        .filter_map(|run| {
            let epoch = assignment.epochs.get(&run.first()?.partition).copied()?;
            Some((run, epoch))
        })
        .collect()
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

#[instrument(skip_all, fields(partitions = partitions.len(), limit))]
async fn fetch_runs(
    outbox: &Outbox,
    db: &Db,
    partitions: &[i16],
    exclude: &[String],
    limit: usize,
    followers: usize,
) -> Result<Vec<Vec<Record>>> {
    let rows = match db {
        Db::Postgres(pool) => fetch_postgres(outbox, pool, partitions, exclude, limit, followers).await?,
        Db::Sqlite(pool) => {
            let budget = outbox.config().key_lookahead_bytes;
            crate::sqlite::fetch(pool, outbox.sqlite(), partitions, exclude, (limit, followers, budget))
                .await
                .map_err(|e| outbox.not_migrated(e))?
        }
    };
    let rows = rows.into_iter().map(FetchedRow::into_record).collect::<Result<Vec<_>>>()?;
    let fetched = rows.len();
    let mut by_key: HashMap<String, Vec<(Record, bool)>> = HashMap::new();
    for (record, due) in rows {
        by_key.entry(record.key.clone()).or_default().push((record, due));
    }
    let budget = outbox.config().key_lookahead_bytes;
    let runs: Vec<Vec<Record>> = by_key
        .into_values()
        .map(|mut run| {
            run.sort_by_key(|(r, _)| r.seq);
            // A run stops before the first record that is not due (FAILED or waiting for a retry), and
            // before the record that takes its payloads past the byte budget (the head always comes).
            let mut bytes = 0;
            run.into_iter()
                .enumerate()
                .take_while(|(i, (r, due))| {
                    bytes += r.payload.len();
                    *due && (*i == 0 || bytes <= budget)
                })
                .map(|(_, (r, _))| r)
                .collect()
        })
        .collect();
    debug!(keys = runs.len(), records = fetched, "fetched");
    Ok(runs)
}

/// PostgreSQL's fetch: one statement in a JIT-off transaction.
async fn fetch_postgres(
    outbox: &Outbox,
    pool: &PgPool,
    partitions: &[i16],
    exclude: &[String],
    limit: usize,
    followers: usize,
) -> Result<Vec<FetchedRow>> {
    let mut tx = begin(outbox, pool).await?;
    let rows = sqlx::query_as(stmt(&outbox.sql().fetch))
        .bind(partitions)
        .bind(exclude)
        .bind(i64::try_from(limit).unwrap_or(i64::MAX))
        .bind(i64::try_from(followers).unwrap_or(i64::MAX))
        .bind(i64::try_from(outbox.config().key_lookahead_bytes).unwrap_or(i64::MAX))
        .fetch_all(&mut *tx)
        .await
        .map_err(|e| outbox.db_error(e))?;
    tx.commit().await.map_err(|e| outbox.db_error(e))?;
    Ok(rows)
}

/// Starts a transaction for the processor's statements, with JIT compilation off. The planner prices
/// the fetch's loose index scan far above `jit_above_cost` (generic plan: ~213,000), so with JIT on
/// (PostgreSQL's default) every fetch was compiled first: ~45 ms of CPU for a query that runs in ~1 ms
/// (seen with auto_explain). `BEGIN` and `SET LOCAL` travel in one round trip; nothing outlives the
/// transaction, so pooled connections are left as they were.
///
/// Cancel-safe: the `BEGIN` runs on a task of its own. sqlx 0.9's Postgres `begin` is not: a future
/// dropped while `BEGIN` is in flight returns its connection to the pool inside a transaction nobody
/// tracks (transact-rs/sqlx#4393), and the next borrower's statements then hold their row locks
/// forever. The processor drops its in-flight fetch at shutdown, and a node stopping that way
/// deadlocked its own `release` behind such a transaction. Dropped here, the task still finishes and
/// its `Transaction` rolls back properly.
async fn begin(outbox: &Outbox, pool: &PgPool) -> Result<sqlx::Transaction<'static, sqlx::Postgres>> {
    let pool = pool.clone();
    let begun = tokio::spawn(async move { pool.begin_with("BEGIN; SET LOCAL jit = off").await });
    // The task is never aborted; it can only end without an answer if it panicked inside sqlx.
    begun.await.unwrap_or(Err(sqlx::Error::WorkerCrashed)).map_err(|e| outbox.db_error(e))
}

/// A fetched row, as both backends' fetch statements name their columns: the record and whether it is
/// due (SQLite renders its millisecond times as RFC 3339 text for it).
#[derive(sqlx::FromRow)]
pub(crate) struct FetchedRow {
    id: Uuid,
    partition: i16,
    key: String,
    seq: i64,
    event_type: String,
    payload: Vec<u8>,
    headers: sqlx::types::Json<Headers>,
    attempts: i32,
    created_at: chrono::DateTime<chrono::Utc>,
    due: bool,
}

impl FetchedRow {
    /// (partition, key, seq, due), for tests that check which rows a fetch returns.
    #[cfg(test)]
    pub(crate) fn position(&self) -> (i16, String, i64, bool) {
        (self.partition, self.key.clone(), self.seq, self.due)
    }

    pub(crate) fn key(&self) -> &str {
        &self.key
    }

    pub(crate) fn seq(&self) -> i64 {
        self.seq
    }

    pub(crate) fn payload_len(&self) -> usize {
        self.payload.len()
    }

    fn into_record(self) -> Result<(Record, bool)> {
        let record = Record {
            id: self.id,
            partition: partition_from_db(self.partition)?,
            key: self.key,
            seq: self.seq,
            event_type: self.event_type,
            payload: self.payload.into(),
            headers: self.headers.0,
            attempts: self.attempts,
            created_at: self.created_at,
            epoch: 0,
        };
        Ok((record, self.due))
    }
}

/// Delivers a key's run one record at a time, each finished before the next starts. Stops after a
/// record that is not completed (retry or FAILED: the rest must wait), and before the next record if
/// the partition is no longer assigned at this epoch (or the lease deadline passed), or on shutdown.
async fn deliver_run(
    handlers: Arc<Handlers>,
    config: crate::Config,
    run: Vec<Record>,
    epoch: i64,
    assignment: watch::Receiver<Assignment>,
    shutdown: CancellationToken,
) -> (String, Vec<Outcome>) {
    let key = run.first().map(|r| r.key.clone()).unwrap_or_default();
    let mut outcomes = Vec::with_capacity(run.len());
    for (i, record) in run.into_iter().enumerate() {
        if i > 0 && (shutdown.is_cancelled() || assignment.borrow().epoch(record.partition) != Some(epoch)) {
            break;
        }
        let outcome = deliver(&handlers, &config, record, epoch).await;
        let completed = matches!(outcome.verdict, Verdict::Delivered | Verdict::Fallback);
        outcomes.push(outcome);
        if !completed {
            break;
        }
    }
    (key, outcomes)
}

/// Delivers one record: handler (with timeout), then retry decision, then fallback. Never panics and
/// always returns an outcome, so no record is forgotten.
async fn deliver(handlers: &Handlers, config: &crate::Config, record: Record, epoch: i64) -> Outcome {
    let route = handlers.get(&record.event_type);
    let timeout = config.handler_timeout;
    let result = match route {
        None => Err(HandlerError::permanent(format!("no handler for event type {:?}", record.event_type))),
        Some(route) => guarded(timeout, route.handler.handle(&record)).await,
    };
    let (verdict, attempts) = match result {
        Ok(()) => (Verdict::Delivered, record.attempts),
        Err(failure) => {
            let attempts = record.attempts.saturating_add(1);
            let route_retry = route.and_then(|r| r.retry.as_ref());
            let policy = route_retry.unwrap_or(&config.retry);
            let retries = u32::try_from(attempts).unwrap_or(u32::MAX);
            let verdict = if failure.kind() == FailureKind::Retryable && policy.may_retry(retries) {
                let delay =
                    failure.retry_after().map_or_else(|| policy.delay(record.id, retries), |d| d.min(policy.max_delay));
                warn!(record = %record.id, key = %record.key, partition = record.partition, attempts,
                    retry_in = ?delay, error = %failure, "delivery failed; will retry");
                Verdict::Retry { delay, error: failure.to_string() }
            } else {
                match route.and_then(|r| r.fallback.as_ref()) {
                    Some(fallback) => match guarded(timeout, fallback.handle(&record, &failure)).await {
                        Ok(()) => {
                            info!(record = %record.id, key = %record.key, partition = record.partition, attempts,
                                error = %failure, "delivery failed; the fallback handled the record");
                            Verdict::Fallback
                        }
                        Err(fallback_failure) => {
                            failed(&record, attempts, format!("{failure}; fallback: {fallback_failure}"))
                        }
                    },
                    None => failed(&record, attempts, failure.to_string()),
                }
            };
            (verdict, attempts)
        }
    };
    Outcome {
        id: record.id,
        partition: record.partition,
        epoch,
        key: record.key,
        attempts,
        created_at: record.created_at,
        verdict,
    }
}

fn failed(record: &Record, attempts: i32, error: String) -> Verdict {
    error!(record = %record.id, key = %record.key, partition = record.partition, attempts, error = %error,
        "record FAILED; its key is blocked until an operator requeues or skips it");
    Verdict::Failed { error }
}

/// Runs a handler future with a timeout, turning a timeout or a panic into a retryable failure.
async fn guarded(
    timeout: Duration,
    call: BoxFuture<'_, std::result::Result<(), HandlerError>>,
) -> std::result::Result<(), HandlerError> {
    match tokio::time::timeout(timeout, AssertUnwindSafe(call).catch_unwind()).await {
        Ok(Ok(result)) => result,
        Ok(Err(_panic)) => Err(HandlerError::retryable("handler panicked")),
        Err(_) => Err(HandlerError::retryable(format!("handler timed out after {timeout:?}"))),
    }
}

/// Writes a batch of outcomes in one transaction: completions in one fenced statement, failures in
/// another.
async fn complete(outbox: &Outbox, db: &Db, owner: Uuid, outcomes: Vec<Outcome>) -> FlushResult {
    let written = match db {
        Db::Postgres(pool) => write_outcomes(outbox, pool, owner, &outcomes).await,
        Db::Sqlite(pool) => crate::sqlite::write_outcomes(pool, outbox.sqlite(), owner, &outcomes).await,
    };
    match written {
        Ok(written) => Ok(Flushed { outcomes, written }),
        Err(e) => Err((outcomes, e)),
    }
}

async fn write_outcomes(outbox: &Outbox, pool: &PgPool, owner: Uuid, outcomes: &[Outcome]) -> Result<BTreeSet<Uuid>> {
    let (done, failures): (Vec<&Outcome>, Vec<&Outcome>) =
        outcomes.iter().partition(|o| matches!(o.verdict, Verdict::Delivered | Verdict::Fallback));
    let mut written = BTreeSet::new();
    let mut tx = begin(outbox, pool).await?;
    if !done.is_empty() {
        let (partitions, epochs) = fence_params(&done);
        let ids: Vec<Uuid> = done.iter().map(|o| o.id).collect();
        let outcome_names: Vec<&str> = done
            .iter()
            .map(|o| if matches!(o.verdict, Verdict::Fallback) { "fallback" } else { "delivered" })
            .collect();
        let attempts: Vec<i32> = done.iter().map(|o| o.attempts).collect();
        let rows: Vec<(Uuid,)> = sqlx::query_as(stmt(&outbox.sql().complete))
            .bind(&partitions)
            .bind(&epochs)
            .bind(owner)
            .bind(&ids)
            .bind(&outcome_names)
            .bind(&attempts)
            .fetch_all(&mut *tx)
            .await
            .map_err(|e| outbox.db_error(e))?;
        written.extend(rows.into_iter().map(|(id,)| id));
    }
    if !failures.is_empty() {
        let (partitions, epochs) = fence_params(&failures);
        let mut ids = Vec::new();
        let mut attempts = Vec::new();
        let mut errors = Vec::new();
        let mut delays = Vec::new();
        let mut is_failed = Vec::new();
        for o in &failures {
            let (error, delay, failed) = match &o.verdict {
                Verdict::Retry { delay, error } => (error.as_str(), *delay, false),
                Verdict::Failed { error } => (error.as_str(), Duration::ZERO, true),
                Verdict::Delivered | Verdict::Fallback => continue,
            };
            ids.push(o.id);
            attempts.push(o.attempts);
            errors.push(error);
            delays.push(i64::try_from(delay.as_millis()).unwrap_or(i64::MAX));
            is_failed.push(failed);
        }
        let rows: Vec<(Uuid,)> = sqlx::query_as(stmt(&outbox.sql().fail))
            .bind(&partitions)
            .bind(&epochs)
            .bind(owner)
            .bind(&ids)
            .bind(&attempts)
            .bind(&errors)
            .bind(&delays)
            .bind(&is_failed)
            .fetch_all(&mut *tx)
            .await
            .map_err(|e| outbox.db_error(e))?;
        written.extend(rows.into_iter().map(|(id,)| id));
    }
    tx.commit().await.map_err(|e| outbox.db_error(e))?;
    Ok(written)
}

/// The distinct (partition, epoch) pairs of a batch, as the fence's parameter arrays.
fn fence_params(outcomes: &[&Outcome]) -> (Vec<i16>, Vec<i64>) {
    let pairs: BTreeSet<(Partition, i64)> = outcomes.iter().map(|o| (o.partition, o.epoch)).collect();
    pairs.into_iter().map(|(p, e)| (i16::from(p), e)).unzip()
}

#[cfg(test)]
mod tests {
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
        let sqlite = sqlx::sqlite::SqlitePoolOptions::new()
            .max_connections(1)
            .connect_with(crate::db::sqlite_options("sqlite::memory:").unwrap())
            .await
            .unwrap();
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

        let partitions: Vec<i16> = (0..256).collect();
        let runs = super::fetch_runs(&outbox, &db, &partitions, &[], 10, 7).await.unwrap();
        let mut lengths: Vec<(String, usize)> = runs.iter().map(|run| (run[0].key.clone(), run.len())).collect();
        lengths.sort();
        let expected = [("huge".to_string(), 1), ("large".to_string(), 2), ("small".to_string(), 5)];
        assert_eq!(lengths, expected);
        for run in &runs {
            assert!(run.windows(2).all(|w| w[1].seq == w[0].seq + 1), "a run is consecutive: {run:?}");
        }
    }
}
