//! The processor: delivers the records of the partitions this instance holds.
//!
//! One loop per instance keeps three things going at once, never waiting on each other:
//! - **fetch** (`fetch.rs`): one round trip reads the head record of up to `batch_size` keys (one per key,
//!   keys in flight excluded, blocked keys passed over) from the held partitions, fenced by the
//!   instance's (owner, epoch) and its live lease. A poll reads every held partition; a wake-up, or a
//!   key's completed run, only the partitions it names, which costs the database a fraction of a
//!   full fetch; a fetch that filled its batch (or, on MySQL, whose bounded walk stopped after serving
//!   something), the partitions its walk did not finish;
//! - **deliver** (`deliver.rs`): each key's run (its head and up to `key_lookahead - 1` records after it)
//!   goes to its handler in its own task, one record after another, each finished before the next
//!   starts, up to `concurrency` keys at once; a key is fetched again only after its run is completed
//!   in the database, so a slow key holds only its own slot (a crash before that completion redelivers
//!   the run: at least once);
//! - **complete** (`complete.rs`): outcomes are written in batches, each statement fenced by (owner, epoch)
//!   per partition: a worker that lost a partition changes nothing;
//! - **count** (`careful.rs`): in a partition once taken over from an owner that did not give it up,
//!   the calls of the records scheduled before then are written as attempts before they are made, one
//!   write per fetch, so a handler that ends the process is counted and its record reaches FAILED
//!   instead of ending every instance in turn.
//!
//! Which partitions it holds, under which instance id and epoch, and until when its lease lets it
//! deliver, comes from an [`Assignment`] watch channel fed by the ownership layer (`outbox-cluster`).
//! When a partition leaves the assignment the processor stops fetching it at once and its runs stop
//! before their next record; [`Processor::busy_partitions`] tells when its in-flight records are done,
//! so the partition can be released at once (release-before-acquire).
//!
//! # What is exclusive
//! A handler call starts only while the assignment grants the record's partition at its epoch and the
//! lease has not run out, and the records it delivers were fetched while the database still showed this
//! instance as the partition's owner at that epoch with a live lease. When the lease runs out, or a
//! completion finds the partition's epoch moved on, the calls still running for it are cancelled (their
//! futures dropped at their next `.await`; their records are delivered again). So no handler call for a
//! partition starts, or keeps running, once another instance may have taken it, with one exception no
//! library can prevent: a call already running in a process that was stopped (SIGSTOP, a frozen VM),
//! or about to start (its grant checked, the handler not yet entered), goes on or starts when the
//! process resumes, until the processor notices the lease ran out and cancels it.

mod careful;
mod complete;
mod deliver;
mod fetch;

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use metrics::SharedString;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tokio::task::{Id as TaskId, JoinSet};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, error, info, instrument, warn};
use uuid::Uuid;

pub use careful::UNFINISHED_CALL;
pub use deliver::MAX_ERROR_BYTES;

use self::careful::{Calls, TakenOver};
use self::complete::{Completed, complete, write};
use self::deliver::{Context, InCall, deliver_run, not_called, out_of_unfinished_calls};
use self::fetch::Fetches;
use crate::Outbox;
use crate::assignment::{Assignment, Epoch, InstanceId};
use crate::config::Config;
use crate::driver::{Db, answered_within};
use crate::error::{Error, Result};
use crate::handler::Handlers;
use crate::notice::{Partitions, Wake, millis_up};
use crate::partition::{Partition, all_partitions};
use crate::stored::{Fetched, Found, Outcome, Request, Verdict, Written};

/// Delivers the records of the assigned partitions. See the [module docs](self).
pub struct Processor {
    outbox: Outbox,
    db: Db,
    handlers: Arc<Handlers>,
    assignment: watch::Receiver<Assignment>,
    busy: watch::Sender<BTreeSet<Partition>>,
    delivered: Arc<AtomicU64>,
}

impl Processor {
    /// A processor delivering through `handlers` what `assignment` holds.
    pub fn new(outbox: Outbox, db: impl Into<Db>, handlers: Handlers, assignment: watch::Receiver<Assignment>) -> Self {
        Self {
            outbox,
            db: db.into(),
            handlers: Arc::new(handlers),
            assignment,
            busy: watch::Sender::default(),
            delivered: Arc::default(),
        }
    }

    /// Records this processor has delivered (by their handler or a fallback) and completed, counted
    /// from its start; a cluster node reports it with each heartbeat.
    pub fn delivered(&self) -> Arc<AtomicU64> {
        self.delivered.clone()
    }

    /// Partitions with records in flight (delivering or awaiting completion). A partition taken out of
    /// the assignment can be released once it is absent here, as read after that assignment was sent:
    /// records are dispatched and published here under one look at the assignment, so none of that
    /// partition's will be dispatched any more.
    pub fn busy_partitions(&self) -> watch::Receiver<BTreeSet<Partition>> {
        self.busy.subscribe()
    }

    /// Runs until `shutdown`, then stops fetching, lets in-flight deliveries finish, completes them and
    /// returns. Gives up after `shutdown_timeout` with [`Error::ShutdownTimeout`]; what was not completed
    /// is delivered again later (at least once). The calls still running then are cancelled at their
    /// next yield, and waited for until they are: a handler that blocks its thread (a synchronous call
    /// in an async handler, reported as overdue) holds the stop until it returns. Refuses to start, with
    /// [`Error::UnsuitableSession`], on connections workers cannot run on ([`Db::check_worker_session`]).
    ///
    /// # Cancel safety
    /// Dropping the future abandons in-flight deliveries without completing them; they are redelivered.
    #[instrument(skip_all, fields(instance = %self.assignment.borrow().instance))]
    pub async fn run(self, shutdown: CancellationToken) -> Result<()> {
        match self.db.check_worker_session(self.outbox.config().query_timeout).await {
            Err(e @ Error::UnsuitableSession(_)) => return Err(e),
            // Not refused: the loop meets the database's trouble as it always does.
            Err(e) => warn!(error = %e, "could not check the database session; delivering anyway"),
            Ok(()) => {}
        }
        let limit = self.outbox.config().query_timeout;
        let own = self.db.fetch_pool(limit);
        let fetches = own.clone().unwrap_or_else(|| self.db.clone());
        let stopped = self.deliver(shutdown, &fetches).await;
        if let Some(own) = own {
            // Closing tells the server goodbye on each connection, and over TLS sqlx then waits for the
            // server to answer, which the host of a connection that vanished never does: the stop
            // hung for its whole budget. Past the limit the pool is dropped, its sockets closed.
            if tokio::time::timeout(limit, own.close()).await.is_err() {
                warn!(?limit, "closing the fetches' connections got no answer; dropped instead");
            }
        }
        stopped
    }

    async fn deliver(mut self, shutdown: CancellationToken, fetches: &Db) -> Result<()> {
        let config = self.outbox.config().clone();
        let context = Arc::new(Context {
            handlers: self.handlers.clone(),
            config: config.clone(),
            assignment: self.assignment.clone(),
            shutdown: shutdown.clone(),
        });
        let mut state = State::new(config, self.outbox.schema_label(), self.delivered.clone());
        state.held = self.assignment.borrow().epochs.keys().copied().collect();
        let mut woken = self.outbox.wakeups().subscribe();
        let (listening, mut listening_rx) = watch::channel(false);
        let stop_listening = CancellationToken::new();
        let _stop_listening = stop_listening.clone().drop_guard();
        let mut listener_open = self.db.can_listen();
        let mut named = self.assignment.borrow().instance;
        if listener_open {
            tokio::spawn(listen(self.outbox.clone(), self.db.clone(), listening, stop_listening).in_current_span());
        }
        loop {
            let current = self.assignment.borrow().clone();
            if !current.is_live() {
                state.cancels.lease_ran_out(state.in_flight.len());
            }
            state.start_fetch(&self.outbox, fetches, &current);
            state.start_completion(&self.outbox, &self.db);
            if let Some(deadline) = state.stop_deadline.filter(|_| state.is_idle()) {
                info!("processor stopped: in-flight records completed");
                // Within the stop's own deadline; past it, the next owners find the records at a poll.
                let timers = state.left_to_hand_on();
                let _ = tokio::time::timeout_at(deadline, hand_on(self.outbox.clone(), self.db.clone(), timers)).await;
                return Ok(());
            }
            if !state.handing_on.is_empty() {
                tokio::spawn(
                    hand_on(self.outbox.clone(), self.db.clone(), std::mem::take(&mut state.handing_on))
                        .in_current_span(),
                );
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
                    // Waits for the aborted calls to be dropped: one in the middle of a poll on another
                    // thread runs on until it yields, and the node releases the partitions next.
                    state.deliveries.shutdown().await;
                    // Not waited for: the stop is out of time already.
                    tokio::spawn(hand_on(self.outbox.clone(), self.db.clone(), state.left_to_hand_on()).in_current_span());
                    return Err(Error::ShutdownTimeout(state.config.shutdown_timeout));
                }
                Some(joined) = state.deliveries.join_next_with_id() => {
                    state.on_joined(joined, &context, (&self.outbox, &self.db));
                    self.publish_busy(&state.in_flight);
                }
                (request, found) = poll_opt(&mut state.fetch) => {
                    state.fetch = None;
                    // The borrow holds back a new assignment until the dispatched keys are published.
                    let current = self.assignment.borrow();
                    state.on_fetched(&request, found, &current, &context, (&self.outbox, &self.db));
                    self.publish_busy(&state.in_flight);
                    drop(current);
                }
                Some(counted) = state.counting.next(), if !state.counting.is_empty() => {
                    let current = self.assignment.borrow();
                    state.on_counted(counted, &current, &context);
                    self.publish_busy(&state.in_flight);
                    drop(current);
                }
                completed = poll_opt(&mut state.completion) => {
                    state.completion = None;
                    state.on_completed(completed);
                    self.publish_busy(&state.in_flight);
                }
                () = tokio::time::sleep_until(state.retry_not_before),
                    if !state.retrying.is_empty() && state.completion.is_none() => {}
                () = sleep_until_opt(state.timers.first_key_value().map(|(&at, _)| at)) => state.timers_due(),
                () = tokio::time::sleep_until(state.next_poll), if state.fetch.is_none() => state.poll_due(),
                wakes = woken.next() => state.on_woken(&wakes),
                changed = listening_rx.changed(), if listener_open => match changed {
                    Ok(()) => state.on_listening(*listening_rx.borrow_and_update()),
                    Err(_) => listener_open = false,
                },
                () = sleep_until_opt(lease_deadline) => {}
                () = tokio::time::sleep_until(state.next_overdue_check),
                    if !state.tasks.is_empty() || state.overdue > 0 => state.check_overdue(),
                changed = self.assignment.changed(), if state.assignment_open => {
                    if changed.is_err() {
                        // The ownership layer is gone, so ownership can no longer be confirmed: stop as
                        // if asked to (in-flight records are still completed under their epochs).
                        warn!("assignment source closed; stopping");
                        state.assignment_open = false;
                        shutdown.cancel();
                    }
                    let current = self.assignment.borrow();
                    state.on_assignment(&current);
                    // Registered again (its lease ran out): this processor's logs name the new id. Only
                    // then: a text log appends a recorded field, so each new assignment added a name.
                    if current.instance != named {
                        named = current.instance;
                        tracing::Span::current().record("instance", tracing::field::display(&named));
                    }
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
    /// The `schema` label of the processor's metrics.
    schema: SharedString,
    /// See [`Processor::delivered`].
    delivered: Arc<AtomicU64>,
    /// Keys dispatched and not yet completed in the database, with their partition.
    in_flight: HashMap<String, Partition>,
    deliveries: JoinSet<(String, Vec<Outcome>)>,
    /// The key of each delivery task (to release it if the task ends without an answer), and the call
    /// it is in.
    tasks: HashMap<TaskId, (String, Arc<InCall>)>,
    /// Calls found running past [`overdue_after`] at the latest check, and when the next check is.
    overdue: usize,
    next_overdue_check: Instant,
    /// Partitions once taken over from an owner that did not give them up (`careful.rs`).
    taken_over: TakenOver,
    /// Runs whose calls are being counted before they start, with their turns (`careful.rs`).
    counting: FuturesUnordered<Pin<Box<dyn Future<Output = CountWritten> + Send>>>,
    /// Turns of the counted calls, one permit each and all for a suspect.
    turns: Arc<Semaphore>,
    /// The turns held by keys whose counted calls' outcomes are still to be written.
    turns_held: HashMap<String, OwnedSemaphorePermit>,
    /// Per key whose suspect is being called, the suspects after it, fetched with it: each is counted
    /// with the outcome of the call before it and called in the same turn (`careful.rs`).
    next_suspects: HashMap<String, Vec<Fetched>>,
    /// Outcomes waiting for the next completion.
    outcomes: Vec<Outcome>,
    /// Outcomes a completion left to write again (their keys stay in flight), written in batches of
    /// their own once `retry_not_before` passes: one the database keeps refusing holds back no other
    /// key's outcomes. Batched with the fresh ones, it held them all back for its backoff.
    retrying: Vec<Outcome>,
    /// Whether the running completion writes `retrying`'s outcomes.
    completing_retries: bool,
    fetch: Pending<(Request, Result<Found>)>,
    fetch_started: Instant,
    /// The most heads a fetch asks for: `batch_size`, half what a fetch given up at its time limit asked
    /// for (down to one: a backlog of large payloads over a slow link), doubled again after a full one
    /// that came within a quarter of it. Asked again for the same batch, every fetch was given up.
    fetch_limit: usize,
    /// Whether the latest fetch reads every partition held: only such a fetch counts as a poll.
    polling: bool,
    fetches: Fetches,
    completion: Pending<Completed>,
    completion_started: Instant,
    /// The most outcomes a completion writes (whole keys): unbounded, then half of a batch given up at
    /// its time limit, doubled again after a full one that finished within a quarter of it. Tried again
    /// whole, with whatever gathered meanwhile, such a batch was given up every time.
    completion_limit: usize,
    /// The most runs whose calls one write counts (`careful.rs`): a fetch's counted runs go in writes of
    /// at most this many; halved after one given up at its time limit, doubled after a full one that
    /// took under a quarter of it.
    count_limit: usize,
    /// The wait before the next batch of `retrying`: doubles with each batch left to retry, up to
    /// [`COMPLETE_RETRY_MAX`], and starts again once one is written.
    retry_backoff: Duration,
    retry_not_before: Instant,
    /// Partitions whose completion was fenced out under this (instance, epoch): not fetched again until
    /// the assignment holds them under another.
    fenced: BTreeMap<Partition, (InstanceId, Epoch)>,
    cancels: Cancels,
    /// The partitions the next fetch reads (of those held): `ALL` for a poll.
    wanted: Partitions,
    /// Partitions to read later, when records there fall due: retries written here, and records
    /// scheduled for later that a wake-up announced. At most [`MAX_TIMERS`] (see `wake_at`).
    timers: BTreeMap<Instant, Partitions>,
    /// The partitions of the latest assignment: those that leave it have their timers handed on.
    held: Partitions,
    /// Timers of partitions no longer held, for their next owners (see [`hand_on`]).
    handing_on: Vec<Wake>,
    next_poll: Instant,
    last_found: Option<Instant>,
    stop_deadline: Option<Instant>,
    assignment_open: bool,
    /// Whether the `LISTEN` connection is up: wake-ups from other processes arrive.
    listening: bool,
}

impl State {
    fn new(config: Config, schema: SharedString, delivered: Arc<AtomicU64>) -> Self {
        let fetch_limit = config.batch_size;
        Self {
            schema,
            delivered,
            next_poll: Instant::now() + config.poll_interval,
            in_flight: HashMap::new(),
            deliveries: JoinSet::new(),
            tasks: HashMap::new(),
            overdue: 0,
            next_overdue_check: Instant::now(),
            taken_over: TakenOver::new(&config),
            counting: FuturesUnordered::new(),
            turns: Arc::new(Semaphore::new(careful::turns(&config) as usize)),
            config,
            turns_held: HashMap::new(),
            next_suspects: HashMap::new(),
            outcomes: Vec::new(),
            retrying: Vec::new(),
            completing_retries: false,
            fetch: None,
            fetch_started: Instant::now(),
            fetch_limit,
            polling: false,
            fetches: Fetches::default(),
            completion: None,
            completion_started: Instant::now(),
            completion_limit: usize::MAX,
            count_limit: usize::MAX,
            retry_backoff: COMPLETE_RETRY_MIN,
            retry_not_before: Instant::now(),
            fenced: BTreeMap::new(),
            cancels: Cancels::default(),
            wanted: Partitions::ALL,
            timers: BTreeMap::new(),
            held: Partitions::default(),
            handing_on: Vec::new(),
            last_found: None,
            stop_deadline: None,
            assignment_open: true,
            listening: false,
        }
    }

    /// Nothing in flight, being fetched or being completed.
    fn is_idle(&self) -> bool {
        self.in_flight.is_empty() && self.fetch.is_none() && self.completion.is_none()
    }

    fn start_fetch(&mut self, outbox: &Outbox, db: &Db, current: &Assignment) {
        // While fetches follow one another (wake-ups or completions asking for a busy partition during
        // each), the loop never waits without a fetch, where the poll's timer runs: a poll that late by
        // `poll_interval` runs here. Not sooner: at the active 5 ms, a whole poll in place of every other
        // targeted fetch would walk the partitions whose keys are all in flight.
        if self.fetch.is_none() && Instant::now() >= self.next_poll + self.config.poll_interval {
            self.poll_due();
        }
        let room = self.config.concurrency.saturating_sub(self.in_flight.len());
        if self.stop_deadline.is_some()
            || self.wanted.is_empty()
            || self.fetch.is_some()
            || room == 0
            || !current.is_live()
        {
            return;
        }
        let wanted = std::mem::take(&mut self.wanted);
        self.polling = wanted == Partitions::ALL;
        let limit = self.fetch_limit.min(room);
        let Some(request) = self.fetches.request(&self.config, current, &self.fenced, &self.in_flight, &wanted, limit)
        else {
            return;
        };
        let (outbox, db) = (outbox.clone(), db.clone());
        self.fetch_started = Instant::now();
        self.fetch = Some(Box::pin(async move {
            let fetch = db.fetch(outbox.statements(), &request);
            let found = answered_within(outbox.config().query_timeout, "fetch", fetch).await;
            (request, found.map_err(|e| outbox.not_migrated(e)))
        }));
    }

    fn start_completion(&mut self, outbox: &Outbox, db: &Db) {
        if self.completion.is_some() {
            return;
        }
        // Retries when their time comes, else the fresh outcomes; never together.
        self.completing_retries = !self.retrying.is_empty() && Instant::now() >= self.retry_not_before;
        let waiting = if self.completing_retries { &mut self.retrying } else { &mut self.outcomes };
        if waiting.is_empty() {
            return;
        }
        // One grant per partition in a batch: a fence then holds a partition under the grant of all of
        // its outcomes, so one of an older grant (this instance's before it registered again) is
        // fenced out rather than let through beside one of the current grant. The rest wait.
        let mut grants = HashMap::new();
        let (mut batch, mut later): (Vec<Outcome>, Vec<Outcome>) =
            std::mem::take(waiting).into_iter().partition(|o: &Outcome| {
                let (partition, instance, epoch) = o.grant();
                *grants.entry(partition).or_insert((instance, epoch)) == (instance, epoch)
            });
        if batch.len() > self.completion_limit {
            // Whole keys: a key's outcomes (one run's, side by side) leave flight together.
            let cut = (self.completion_limit.max(1)..batch.len())
                .find(|&i| batch[i].key != batch[i - 1].key)
                .unwrap_or(batch.len());
            later.extend(batch.split_off(cut));
        }
        *waiting = later;
        let (outbox, db) = (outbox.clone(), db.clone());
        self.completion_started = Instant::now();
        self.completion = Some(Box::pin(async move { complete(&outbox, &db, batch).await }));
    }

    fn on_fetched(
        &mut self,
        request: &Request,
        found: Result<Found>,
        current: &Assignment,
        context: &Arc<Context>,
        (outbox, db): (&Outbox, &Db),
    ) {
        let found = match found {
            Ok(found) => {
                // Only a full fetch tells that more would fit: a few heads come quickly at any limit.
                if found.runs.len() >= request.limit && self.fetch_started.elapsed() < self.config.query_timeout / 4 {
                    self.fetch_limit = (self.fetch_limit * 2).min(self.config.batch_size);
                }
                found
            }
            Err(e) => {
                if e.is_time_limit() {
                    self.fetch_limit = (request.limit / 2).max(1);
                }
                let (partitions, first) = (request.partitions.len(), request.partitions.first().map(|(p, ..)| *p));
                warn!(error = %e, instance = %request.instance, partitions, first_partition = ?first,
                    limit = self.fetch_limit, "fetch failed; retrying at the next poll");
                // What it was asked to read is read by that poll, after `poll_interval` even while
                // listening: its wake-ups were spent on it.
                self.next_poll = self.next_poll.min(Instant::now() + self.config.poll_interval);
                return;
            }
        };
        debug!(instance = %request.instance, keys = found.runs.len(), "fetched");
        // A cut walk (a full batch, or a bounded walk that served something) may have left more in the
        // partitions it did not finish; and a completion that landed while this fetch ran has already
        // asked for another (its keys' next records may not have been visible to this fetch): keep that
        // request. Reading every partition again instead made most fetches of a busy processor walk the
        // partitions whose keys were all in flight.
        self.wanted.extend(found.unread(request));
        if !found.runs.is_empty() {
            self.last_found = Some(Instant::now());
        }
        // A fetch of every partition that just ran is as good as a poll: the next poll is one interval
        // after it. One of a few partitions (after completions there) is not, or a partition busy with
        // completions would put off the poll of all the others for as long as it stays busy.
        if self.polling {
            self.next_poll = Instant::now() + self.poll_interval();
        }
        self.fetches.served(request, &found);
        self.taken_over.follow(current);
        let mut counted = Vec::new();
        for mut run in found.runs {
            let Some(head) = run.first() else { continue };
            let (partition, epoch) = (head.record.partition, head.record.epoch);
            // The assignment may have changed, or the lease run out, while the fetch ran; or a
            // completion may have found the partition fenced (this fetch read it before the steal).
            if !self.may_deliver(current, partition, request.instance, epoch) {
                continue;
            }
            self.in_flight.insert(head.record.key.clone(), partition);
            match self.taken_over.mark(&mut run) {
                Calls::Plain => self.dispatch(run, None, context),
                Calls::Counted => counted.push(run),
                Calls::Suspect(next) => {
                    let r = &run[0].record;
                    warn!(record = %r.id, key = %r.key, partition = r.partition, instance = %request.instance, attempts = r.attempts,
                        suspects_after = next.len(),
                        "a call of this record did not finish (the process may have ended during it): calling it alone, then the suspects after it in its key, each alone; the other counted calls wait for them");
                    if !next.is_empty() {
                        self.next_suspects.insert(r.key.clone(), next);
                    }
                    self.count(vec![run], Vec::new(), careful::turns(&self.config), context, (outbox, db));
                }
            }
        }
        while !counted.is_empty() {
            let rest = counted.split_off(counted.len().min(self.count_limit));
            self.count(counted, Vec::new(), 1, context, (outbox, db));
            counted = rest;
        }
    }

    /// Starts a run's delivery task, holding `turn` until its outcomes are written if it was counted.
    fn dispatch(&mut self, run: Vec<Fetched>, turn: Option<OwnedSemaphorePermit>, context: &Arc<Context>) {
        let Some(head) = run.first() else { return };
        let (key, partition, instance, epoch) =
            (head.record.key.clone(), head.record.partition, head.instance, head.record.epoch);
        if let Some(turn) = turn {
            self.turns_held.insert(key.clone(), turn);
        }
        let fenced = self.cancels.token(partition, instance, epoch);
        let in_call = Arc::new(InCall::default());
        let task = self.deliveries.spawn(deliver_run(context.clone(), run, fenced, in_call.clone()).in_current_span());
        self.tasks.insert(task.id(), (key, in_call));
    }

    /// Logs each call that has run past [`overdue_after`], once, and counts those still running: their
    /// timeouts end well-behaved calls before then, so the handler does not yield (a blocking call in
    /// an async handler) or the runtime is starved. Such a call can be neither timed out nor
    /// cancelled: its key waits, and a stop waits for it. The processor sees it only from a runtime
    /// thread the call does not block (on a current-thread runtime, nothing runs until it returns).
    fn check_overdue(&mut self) {
        let limit = overdue_after(&self.config);
        let before = self.overdue;
        self.overdue = 0;
        for (key, in_call) in self.tasks.values() {
            let Some((call, first)) = in_call.overdue(limit) else { continue };
            self.overdue += 1;
            if first {
                error!(record = %call.record, key, partition = call.partition, instance = %call.instance,
                    running_for = ?call.started.elapsed(), handler_timeout = ?self.config.handler_timeout,
                    "handler call still running long past its timeout: the handler does not yield (a blocking call in an async handler? run it on spawn_blocking) or the runtime is starved; its key waits for it");
            }
        }
        // Changed by this processor's share: other processors of the process count theirs.
        overdue_calls(&self.schema, self.overdue as f64 - before as f64);
        self.next_overdue_check = Instant::now() + OVERDUE_CHECK;
    }

    /// Counts the marked calls of `runs` (their keys in flight) in one write, after the outcomes
    /// `carried`, once it has `per_run` turns for each (none: the turn is held already, by a key's
    /// next suspect); a suspect whose unfinished calls used up its retries is FAILED instead, uncalled.
    fn count(
        &mut self,
        mut runs: Vec<Vec<Fetched>>,
        carried: Vec<Outcome>,
        per_run: u32,
        context: &Arc<Context>,
        (outbox, db): (&Outbox, &Db),
    ) {
        let mut failed = Vec::new();
        runs.retain_mut(|run| {
            // Only a suspect: a record whose last call failed in the usual way is called again and
            // its policy decides (the fallback, say, when its route's retries were lowered meanwhile).
            let suspect = run.first().filter(|f| f.unfinished);
            let Some(verdict) =
                suspect.and_then(|f| out_of_unfinished_calls(&context.handlers, &self.config, &f.record))
            else {
                return true;
            };
            let attempts = run[0].record.attempts;
            failed.push(Outcome::of(run.swap_remove(0), verdict, attempts));
            false
        });
        if runs.is_empty() {
            self.outcomes.extend(carried);
            self.outcomes.extend(failed);
            return;
        }
        self.outcomes.extend(failed);
        let mut outcomes = carried.clone();
        outcomes.extend(careful::counts(&runs));
        let permits = per_run.saturating_mul(u32::try_from(runs.len()).unwrap_or(u32::MAX));
        let (turns, outbox, db) = (self.turns.clone(), outbox.clone(), db.clone());
        self.counting.push(Box::pin(async move {
            let turn = if permits == 0 { None } else { turns.acquire_many_owned(permits).await.ok() };
            let started = Instant::now();
            let written = write(&outbox, &db, &outcomes).await;
            CountWritten { runs, carried, turn, per_run, written, took: started.elapsed() }
        }));
    }

    /// Dispatches the runs whose counts were written, each with its turns; takes the counts back of
    /// those whose partition left the assignment meanwhile, or all once stopping; the others are
    /// fetched again.
    fn on_counted(&mut self, counted: CountWritten, current: &Assignment, context: &Arc<Context>) {
        let CountWritten { runs, carried, mut turn, per_run, written, took } = counted;
        let written = match written {
            Ok(written) => {
                if runs.len() >= self.count_limit && took < self.config.query_timeout / 4 {
                    self.count_limit = self.count_limit.saturating_mul(2);
                }
                for outcome in &carried {
                    self.settle(outcome, &written);
                }
                written
            }
            Err(e) => {
                // Fetched again, these runs would be counted again together: given up at its time limit,
                // such a write was given up every time, and nothing was delivered.
                if e.is_time_limit() {
                    self.count_limit = (runs.len() / 2).max(1);
                }
                let first = runs
                    .first()
                    .and_then(|r| r.first())
                    .map(|f| (f.record.id, f.record.key.clone(), f.record.partition));
                warn!(error = %e, runs = runs.len(), ?first, retry_in = ?self.retry_backoff, limit = self.count_limit,
                    "counting calls before they are made failed; the counts are taken back and their records fetched again (first: record, key, partition)");
                // The write may have committed all the same, and fetched at once again the records would
                // meet the same refusal in a loop: the counts are taken back like a run's calls not made,
                // keeping the keys in flight until that is written, after the retries' backoff.
                let taken_back = carried.into_iter().chain(runs.into_iter().flat_map(not_called)).collect();
                self.retry_later(taken_back);
                return;
            }
        };
        for run in runs {
            let Some(head) = run.first() else { continue };
            let (partition, instance, epoch) = (head.record.partition, head.instance, head.record.epoch);
            let counted = written.ids.contains(&head.record.id);
            // Stopping, no call starts: one still running at the shutdown timeout would be cut off.
            if counted && self.stop_deadline.is_none() && self.may_deliver(current, partition, instance, epoch) {
                let own = turn.as_mut().and_then(|t| t.split(per_run as usize));
                self.dispatch(run, own, context);
            } else if counted {
                // The key stays in flight until they are written (or fenced out).
                self.outcomes.extend(not_called(run));
            } else {
                if !written.held.contains(&(partition, instance, epoch)) {
                    self.fence_out((partition, instance, epoch), head.record.id, &head.record.key);
                }
                self.leave_flight(&head.record.key);
            }
        }
    }

    /// Whether a run under this grant may start: the assignment still grants it, and no completion
    /// has found the partition fenced under it (a new owner may be delivering it already).
    fn may_deliver(&self, current: &Assignment, partition: Partition, instance: InstanceId, epoch: Epoch) -> bool {
        current.grants(instance, partition, epoch) && self.fenced.get(&partition) != Some(&(instance, epoch))
    }

    /// `key` leaves flight: its turn is handed back, and its partition read again (its next records, or
    /// those it did not finish, are fetchable now).
    fn leave_flight(&mut self, key: &str) -> Option<Partition> {
        self.turns_held.remove(key);
        self.next_suspects.remove(key);
        let partition = self.in_flight.remove(key)?;
        self.wanted.insert(partition);
        Some(partition)
    }

    fn on_joined(
        &mut self,
        joined: std::result::Result<(TaskId, (String, Vec<Outcome>)), tokio::task::JoinError>,
        context: &Arc<Context>,
        (outbox, db): (&Outbox, &Db),
    ) {
        match joined {
            Ok((task, (key, outcomes))) => {
                self.tasks.remove(&task);
                if outcomes.is_empty() {
                    // Cancelled before any outcome (the lease ran out): a fetch that started meanwhile
                    // (the lease renewed) passed over its key.
                    self.leave_flight(&key);
                } else if let Some(next) = self.next_suspect(&key, &outcomes, context) {
                    self.count(vec![next], outcomes, 0, context, (outbox, db));
                } else {
                    self.outcomes.extend(outcomes);
                }
            }
            Err(e) => {
                // Deliveries catch their handlers' panics; this is a bug in the processor or an abort.
                let key = self.tasks.remove(&e.id()).map(|(key, _)| key).unwrap_or_default();
                let partition = self.leave_flight(&key);
                error!(error = %e, key, ?partition,
                    "delivery task ended without an outcome; its records will be delivered again");
            }
        }
    }

    /// The next of `key`'s suspects (`careful.rs`), to be counted in the write of `outcomes` and called
    /// in the same turn: only after a call that completed, and not once stopping. A suspect whose
    /// unfinished calls used up its retries is not (it is FAILED uncalled once fetched again), nor are
    /// those after it.
    fn next_suspect(&mut self, key: &str, outcomes: &[Outcome], context: &Context) -> Option<Vec<Fetched>> {
        let mut next = self.next_suspects.remove(key)?;
        let head = next.first()?;
        let completed = matches!(outcomes, [o] if o.verdict.completes());
        if !completed
            || self.stop_deadline.is_some()
            || out_of_unfinished_calls(&context.handlers, &self.config, &head.record).is_some()
        {
            return None;
        }
        let later = next.split_off(1);
        if !later.is_empty() {
            self.next_suspects.insert(key.to_string(), later);
        }
        Some(next)
    }

    fn on_completed(&mut self, completed: Completed) {
        let Completed { settled, written, retry } = completed;
        let written_together = settled.len();
        // A key with an outcome still to write stays in flight: its record is still pending, and
        // fetched again it would be delivered after the key's later ones.
        let unsettled: HashSet<&str> = retry.iter().flat_map(|(batch, _)| batch).map(|o| o.key.as_str()).collect();
        for outcome in settled {
            if !unsettled.contains(outcome.key.as_str()) {
                self.leave_flight(&outcome.key);
            }
            self.settle(&outcome, &written);
        }
        if let Some((batch, e)) = &retry
            && e.is_time_limit()
        {
            self.completion_limit = (batch.len() / 2).max(1);
        } else if retry.is_none()
            && written_together >= self.completion_limit
            && self.completion_started.elapsed() < self.config.query_timeout / 4
        {
            self.completion_limit = self.completion_limit.saturating_mul(2);
        }
        if let Some((batch, e)) = retry {
            let first = batch.first().map(|o| (o.id, o.key.as_str(), o.partition, o.instance, o.epoch));
            warn!(error = %e, records = batch.len(), ?first, retry_in = ?self.retry_backoff,
                limit = self.completion_limit, "completion failed; retrying (first: record, key, partition, instance, epoch)");
            self.retry_later(batch);
        } else if self.completing_retries && self.retrying.is_empty() {
            self.retry_backoff = COMPLETE_RETRY_MIN;
        }
    }

    /// The bookkeeping of an outcome a write settled: written (metrics, the retry's timer), already
    /// settled, or fenced out (its partition stops being processed under that grant).
    fn settle(&mut self, outcome: &Outcome, written: &Written) {
        if written.ids.contains(&outcome.id) {
            record_metrics(&self.schema, outcome);
            if matches!(outcome.verdict, Verdict::Delivered | Verdict::Fallback) {
                self.delivered.fetch_add(1, Ordering::Relaxed);
            }
            if let Verdict::Retry { delay, .. } = outcome.verdict {
                let partition = Partitions::of(outcome.partition);
                if self.held.contains(outcome.partition) {
                    self.wake_at(Instant::now() + delay, partition);
                } else {
                    // Given up while the call ran (a graceful handover lets it finish).
                    self.handing_on.push(Wake { partitions: partition, after: millis_up(delay) });
                }
            }
        } else if written.held.contains(&outcome.grant()) {
            debug!(record = %outcome.id, key = %outcome.key, partition = outcome.partition,
                "outcome already settled (an earlier attempt committed, or the record was removed or requeued)");
        } else {
            self.fence_out(outcome.grant(), outcome.id, &outcome.key);
        }
    }

    /// A write under this grant was fenced out (the partition has a new owner or epoch; `record` of `key`
    /// the first found so): nothing more is fetched or called under it, and its calls running are
    /// cancelled, as the new owner may be delivering their keys already.
    fn fence_out(&mut self, (partition, instance, epoch): (Partition, InstanceId, Epoch), record: Uuid, key: &str) {
        if self.fenced.insert(partition, (instance, epoch)) != Some((instance, epoch)) {
            warn!(partition, %instance, %epoch, %record, key,
                "fenced out: the partition has a new owner or epoch; stopped processing it");
            self.cancels.cancel((partition, instance, epoch));
        }
    }

    /// Writes `outcomes` again after `retry_backoff`, which doubles up to [`COMPLETE_RETRY_MAX`] until
    /// a batch of retries is written whole.
    fn retry_later(&mut self, outcomes: Vec<Outcome>) {
        self.retrying.extend(outcomes);
        self.retry_not_before = Instant::now() + self.retry_backoff;
        self.retry_backoff = (self.retry_backoff * 2).min(COMPLETE_RETRY_MAX);
    }

    /// Takes in a new assignment; the timers of the partitions that left it go to their next owners.
    fn on_assignment(&mut self, current: &Assignment) {
        let held = self.held;
        self.held = current.epochs.keys().copied().collect();
        let handed_on = self.timers_of(held.without(self.held));
        self.handing_on.extend(handed_on);
        self.fenced.retain(|p, held| current.epochs.get(p) == Some(&held.1) && current.instance == held.0);
        // Calls of an earlier instance id are cancelled, all of them (the lease may not have run out
        // here, nor the processor have seen the assignment in between). Calls of partitions that left
        // the assignment finish (a graceful handover); only their handles are forgotten.
        self.cancels.instance_is(current.instance);
        self.cancels.grants.retain(|(p, _, epoch), _| current.epochs.get(p) == Some(epoch));
        self.fetches.retain(|p| current.epochs.contains_key(&p));
        self.wanted = Partitions::ALL;
    }

    /// At a stop: the timers still to hand on, and those of the partitions held.
    fn left_to_hand_on(&mut self) -> Vec<Wake> {
        let mut timers = std::mem::take(&mut self.handing_on);
        timers.extend(self.timers_of(self.held));
        timers
    }

    /// Takes the timers of `partitions` out, as wake-ups after the time left to each (whole
    /// milliseconds, rounded up).
    fn timers_of(&mut self, partitions: Partitions) -> Vec<Wake> {
        let now = Instant::now();
        let mut wakes = Vec::new();
        self.timers.retain(|at, timer| {
            let moved = timer.and(partitions);
            if !moved.is_empty() {
                wakes.push(Wake { partitions: moved, after: millis_up(at.saturating_duration_since(now)) });
                *timer = timer.without(partitions);
            }
            !timer.is_empty()
        });
        wakes
    }

    /// The `LISTEN` connection came up or was lost. Either way a wake-up may have been missed while it
    /// was down, so every partition is read now; then polls come at the interval that now applies.
    fn on_listening(&mut self, listening: bool) {
        self.listening = listening;
        self.poll_due();
        listening_gauge(&self.schema, listening);
    }

    fn on_woken(&mut self, wakes: &[Wake]) {
        let now = Instant::now();
        for wake in wakes {
            if wake.after.is_zero() {
                self.wanted.extend(wake.partitions);
            } else {
                self.wake_at(now + wake.after, wake.partitions);
            }
        }
    }

    fn wake_at(&mut self, at: Instant, partitions: Partitions) {
        self.timers.entry(at).or_default().extend(partitions);
        if self.timers.len() > MAX_TIMERS {
            // The two latest become one at the later time: its partitions are fetched late, not at
            // the next poll (which may be an hour away); the soonest, which matter most, stay exact.
            if let (Some((last, mut merged)), Some((_, earlier))) = (self.timers.pop_last(), self.timers.pop_last()) {
                merged.extend(earlier);
                self.timers.insert(last, merged);
            }
        }
    }

    /// The timers that are due join the next fetch.
    fn timers_due(&mut self) {
        let later = self.timers.split_off(&(Instant::now() + Duration::from_nanos(1)));
        for partitions in std::mem::replace(&mut self.timers, later).into_values() {
            self.wanted.extend(partitions);
        }
    }

    fn poll_due(&mut self) {
        self.wanted = Partitions::ALL;
        self.next_poll = Instant::now() + self.poll_interval();
    }

    /// While wake-ups from other processes arrive, polling is only the safety net: every
    /// `listen_poll_interval` (if longer than `poll_interval`). Otherwise adaptive: every
    /// `active_poll_interval` while fetches keep finding records (low latency under load), every
    /// `poll_interval` once a whole [`ACTIVE_WINDOW`] found nothing (cheap when idle).
    fn poll_interval(&self) -> Duration {
        let active = self.last_found.is_some_and(|at| at.elapsed() < ACTIVE_WINDOW);
        if self.listening {
            self.config.listen_poll_interval.max(self.config.poll_interval)
        } else if active {
            self.config.active_poll_interval
        } else {
            self.config.poll_interval
        }
    }
}

/// However the processor ends (a stop, its future dropped), the calls it counted overdue leave the gauge,
/// and it no longer hears wake-ups.
impl Drop for State {
    fn drop(&mut self) {
        overdue_calls(&self.schema, -(self.overdue as f64));
        if self.listening {
            listening_gauge(&self.schema, false);
        }
    }
}

/// Runs whose calls were being counted, with the turns taken for them (`per_run` each) and what the
/// count wrote.
struct CountWritten {
    runs: Vec<Vec<Fetched>>,
    /// Outcomes written first in the same write (the call before a key's next suspect).
    carried: Vec<Outcome>,
    turn: Option<OwnedSemaphorePermit>,
    per_run: u32,
    written: Result<Written>,
    /// How long the write took.
    took: Duration,
}

/// Hears other processes' wake-ups (see `wake.rs`) until `stop`, connecting again a second after a
/// connection that listened is lost, twice as long after each attempt that could not listen, up to ten
/// minutes; `listening` is true while it listens.
async fn listen(outbox: Outbox, db: Db, listening: watch::Sender<bool>, stop: CancellationToken) {
    // Checked as often as the processor polls while it listens: a lost connection costs no more than
    // one safety-net interval of wake-ups.
    let check = (outbox.config().listen_poll_interval, outbox.config().query_timeout);
    let mut pause = LISTEN_RETRY.0;
    loop {
        let heard = tokio::select! {
            () = stop.cancelled() => return,
            heard = db.listen(outbox.statements(), outbox.wakeups(), &listening, check) => heard,
        };
        // Tried again soon after a connection that listened, ever later after attempts that never did
        // (a pooler that hears nothing stays one).
        if listening.send_replace(false) {
            pause = LISTEN_RETRY.0;
        }
        match heard {
            Ok(()) => info!(?pause, "wake-up connection lost; polling every poll_interval until it is back"),
            Err(e) => warn!(error = %e, ?pause, "cannot listen for wake-ups; polling every poll_interval until it can"),
        }
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(pause) => {}
        }
        pause = (pause * 2).min(LISTEN_RETRY.1);
    }
}

/// Cancellation of running handler calls: one token per (partition, instance, epoch) that runs are
/// delivering under, all children of the token of the lease of the instance id they run under.
#[derive(Debug, Default)]
struct Cancels {
    lease: CancellationToken,
    /// The instance id `lease` belongs to.
    leased_to: Option<InstanceId>,
    grants: HashMap<(Partition, InstanceId, Epoch), CancellationToken>,
}

impl Cancels {
    /// The token a run under this grant watches.
    fn token(&mut self, partition: Partition, instance: InstanceId, epoch: Epoch) -> CancellationToken {
        self.instance_is(instance);
        if self.lease.is_cancelled() {
            self.lease = CancellationToken::new();
            self.grants.clear();
        }
        let lease = &self.lease;
        self.grants.entry((partition, instance, epoch)).or_insert_with(|| lease.child_token()).clone()
    }

    /// The processor runs under `instance`. Under a new id, every call of the earlier one is cancelled,
    /// those whose handles a handover let go of too: that id was declared dead, and its partitions may
    /// be delivered elsewhere.
    fn instance_is(&mut self, instance: InstanceId) {
        if self.leased_to.replace(instance).is_some_and(|earlier| earlier != instance) {
            self.lease.cancel();
            self.lease = CancellationToken::new();
            self.grants.clear();
        }
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
    fn cancel(&mut self, grant: (Partition, InstanceId, Epoch)) {
        if let Some(token) = self.grants.remove(&grant) {
            token.cancel();
        }
    }
}

/// Emits the outcome's metrics once it is written (see the README's metrics table).
fn record_metrics(schema: &SharedString, outcome: &Outcome) {
    let schema = schema.clone();
    match outcome.verdict {
        Verdict::Delivered | Verdict::Fallback => {
            let how = outcome.verdict.completed_as();
            metrics::counter!("outbox_records_completed_total", "schema" => schema.clone(), "outcome" => how)
                .increment(1);
            // Due (the scheduling transaction's start or the delivery time asked for, database clock) to
            // completion (host clock).
            let latency = (chrono::Utc::now() - outcome.due_since).to_std().unwrap_or_default();
            metrics::histogram!("outbox_delivery_latency_seconds", "schema" => schema).record(latency.as_secs_f64());
        }
        Verdict::Retry { .. } => metrics::counter!("outbox_records_retried_total", "schema" => schema).increment(1),
        Verdict::Failed { .. } => metrics::counter!("outbox_records_failed_total", "schema" => schema).increment(1),
        Verdict::NotCalled { .. } => {}
    }
}

/// Sets `outbox_wakeups_listening`.
fn listening_gauge(schema: &SharedString, listening: bool) {
    metrics::gauge!("outbox_wakeups_listening", "schema" => schema.clone()).set(f64::from(u8::from(listening)));
}

/// How long after the last fetch that found records the processor keeps polling at the active rate.
const ACTIVE_WINDOW: Duration = Duration::from_secs(1);

/// Tells the next owners of partitions this processor gave up, in this process and (on PostgreSQL) in
/// the others, when the records it was waiting for there fall due (retries written here, records
/// scheduled for later): otherwise they find them only at a poll, which may be `listen_poll_interval`
/// away, having found them not yet due when they took the partitions.
async fn hand_on(outbox: Outbox, db: Db, timers: Vec<Wake>) {
    if timers.is_empty() {
        return;
    }
    if let Err(e) = outbox.send_wakes(&db, &timers).await {
        let mut given_up = Partitions::default();
        timers.iter().for_each(|timer| given_up.extend(timer.partitions));
        let partitions: Vec<Partition> = all_partitions().filter(|&p| given_up.contains(p)).collect();
        warn!(error = %e, timers = timers.len(), ?partitions, "could not hand on the timers of partitions given up; their next owners' polls find the records");
    }
}

/// Timers a processor keeps at most (see `State::timers`).
const MAX_TIMERS: usize = 4096;

/// How long the wake-up listener waits before connecting again: at first, and at most (a pooler that
/// hears nothing stays one, and each attempt leaves a `LISTEN` on one of its sessions).
const LISTEN_RETRY: (Duration, Duration) = (Duration::from_secs(1), Duration::from_secs(600));

/// Moves `outbox_handler_calls_overdue` by `change`.
fn overdue_calls(schema: &SharedString, change: f64) {
    if change != 0.0 {
        metrics::gauge!("outbox_handler_calls_overdue", "schema" => schema.clone()).increment(change);
    }
}

/// How often the calls under way are looked at for those past [`overdue_after`].
const OVERDUE_CHECK: Duration = Duration::from_secs(1);

/// How long a call may run before it is reported overdue: a handler and then a fallback may each take
/// `handler_timeout`, and a second more covers a busy runtime.
fn overdue_after(config: &Config) -> Duration {
    config.handler_timeout.saturating_mul(2).saturating_add(Duration::from_secs(1))
}

const COMPLETE_RETRY_MIN: Duration = Duration::from_millis(100);
const COMPLETE_RETRY_MAX: Duration = Duration::from_secs(5);

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
