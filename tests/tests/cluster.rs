//! In-process cluster behaviour: balanced ownership as instances join and leave, graceful handover
//! without duplicates, takeover after a crash, and never two instances delivering one partition at once.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[macro_use]
mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use common::*;
use outbox_cluster::Node;
use outbox_core::{HandlerError, Handlers, InstanceId, NewRecord, Outbox, Route, handler_fn};
use rand::RngExt;
use sqlx::AssertSqlSafe;
use tokio::time::Instant;

every_backend!(
    graceful_scale_up_and_down_delivers_every_record_once_in_order,
    a_release_that_fails_names_its_partitions,
    a_crashed_instances_partitions_move_on_after_its_lease,
    a_lease_that_ends_early_never_lets_two_instances_deliver_one_partition,
    a_partition_handed_on_during_its_quiet_period_stays_quiet,
    a_partition_acquired_by_a_lost_reply_stays_quiet,
    a_partition_still_quiet_when_its_owner_stops_stays_quiet,
    a_partition_taken_from_an_owner_whose_row_was_reaped_stays_quiet,
    a_partition_whose_new_owner_lapses_in_its_quiet_period_stays_quiet,
    a_partition_whose_new_owner_lapses_before_it_renews_stays_quiet,
    a_partition_still_quiet_stays_quiet_when_its_owner_cannot_release_at_stop,
    a_handover_does_not_wait_for_the_rounds,
    a_node_that_owns_nothing_stops_without_waiting,
    a_stop_given_up_part_way_stops_every_task,
    a_stop_with_a_call_that_outlasts_it_ends_within_the_shutdown_timeout,
    a_node_declared_dead_while_leaving_still_leaves,
    a_failing_reap_holds_no_round_up,
    calls_of_records_older_than_a_takeover_are_counted_before_they_are_made,
    counts_of_calls_a_failure_kept_from_being_made_are_taken_back,
    counts_of_calls_a_handover_kept_from_being_made_are_taken_back,
    counts_written_while_the_partition_was_handed_on_are_taken_back,
    records_whose_last_call_failed_are_no_suspects_after_a_takeover,
    without_stop_on_first_failure_every_call_older_than_a_takeover_is_counted,
);

// Row locks other sessions hold, or a network to cut: a server's (SQLite has one writer at a time).
on_backends!(
    [postgres, mysql]
    a_lease_renewed_after_it_lapsed_is_followed_by_a_round,
    a_partition_still_quiet_stays_quiet_when_the_release_waits_out_the_stop,
    a_stop_while_the_database_answers_nobody_ends_in_bounded_time,
    an_acquisition_whose_host_vanished_kills_no_other_instance,
);

const LONG: Duration = Duration::from_secs(60);

/// Handlers recording each delivery and checking exclusivity; each call takes two awaits of up to
/// `step_ms` each (as a handler that connects, then sends a request).
fn handlers(name: &str, sink: &Arc<Sink>, exclusive: &Arc<Exclusive>, step_ms: u64) -> Handlers {
    paced_handlers(name, sink, exclusive, step_ms, Arc::new(AtomicBool::new(false)))
}

/// As [`handlers`]; a call first waits while `held` is set (a handler stuck on a slow downstream),
/// inside the handler as far as `exclusive` is concerned, until it is let go or cancelled.
fn paced_handlers(
    name: &str,
    sink: &Arc<Sink>,
    exclusive: &Arc<Exclusive>,
    step_ms: u64,
    held: Arc<AtomicBool>,
) -> Handlers {
    let (name, sink, exclusive) = (name.to_string(), sink.clone(), exclusive.clone());
    Handlers::new().default_route(Route::new(handler_fn(move |r| {
        let (name, sink, exclusive, held) = (name.clone(), sink.clone(), exclusive.clone(), held.clone());
        async move {
            let _inside = exclusive.enter(&name, r.partition);
            while held.load(Ordering::SeqCst) {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            let (connect, request) = (rand::rng().random_range(0..step_ms), rand::rng().random_range(0..step_ms));
            tokio::time::sleep(Duration::from_millis(connect)).await;
            tokio::time::sleep(Duration::from_millis(request)).await;
            sink.record(&r);
            Ok::<(), HandlerError>(())
        }
    })))
}

/// Produces `rounds` records for each key, one transaction per round.
fn produce(outbox: &Outbox, db: &TestDb, keys: usize, rounds: usize) -> tokio::task::JoinHandle<()> {
    let (outbox, db) = (outbox.clone(), db.clone());
    tokio::spawn(async move {
        for _ in 0..rounds {
            commit(&outbox, &db, (0..keys).map(|k| NewRecord::new(format!("key-{k}"), "t", "")).collect()).await;
            tokio::time::sleep(Duration::from_millis(40)).await;
        }
    })
}

async fn start_named(outbox: &Outbox, db: &TestDb, name: &str, sink: &Arc<Sink>, ex: &Arc<Exclusive>) -> Node {
    let config = outbox_cluster::ClusterConfig { name: name.into(), ..fast_cluster() };
    start_calls(outbox, db, config, sink, ex, 3).await
}

/// A cluster configuration that heartbeats every 500 ms (a 3 s stale timeout): slow to notice that its
/// lease was ended early.
fn slow_heartbeat(name: &str) -> outbox_cluster::ClusterConfig {
    outbox_cluster::ClusterConfig {
        name: name.into(),
        heartbeat_interval: Duration::from_millis(500),
        stale_timeout: Duration::from_secs(3),
        ..fast_cluster()
    }
}

/// Ends the lease of `id` in the database, as if its heartbeats had stopped a second ago.
async fn end_lease(db: &TestDb, id: InstanceId) {
    exec!(db, "UPDATE {s}instances SET expires_at = {ago:1} WHERE id = $1", id);
}

/// A node with `config` whose handler calls take two awaits of up to `step_ms` each.
async fn start_calls(
    outbox: &Outbox,
    db: &TestDb,
    config: outbox_cluster::ClusterConfig,
    sink: &Arc<Sink>,
    ex: &Arc<Exclusive>,
    step_ms: u64,
) -> Node {
    let handlers = handlers(&config.name, sink, ex, step_ms);
    Node::start(outbox.clone(), db, handlers, config).await.unwrap()
}

/// A node declared dead while it leaves (its handover waiting on handler calls) registers again under
/// a new id, and that id leaves too (or, if the stop reached its release first, the registration is
/// taken back): the other instance ends up with every partition and the node stops without waiting out
/// its shutdown timeout. The new id used to count as live, so the leaving node's own rounds gave it
/// partitions it never handed back (found in the fault test on SQLite).
async fn a_node_declared_dead_while_leaving_still_leaves(db: TestDb) {
    logs();
    let outbox = outbox(&db, |c| c.shutdown_timeout = LONG * 2).await;
    let (sink, exclusive) = (Sink::new(), Arc::new(Exclusive::default()));
    // a notices the end of its lease only at its next heartbeat, after b has taken its partitions. Its
    // calls end only when cancelled, as they are when it fences itself at the declared death: calls
    // that ended on their own let a finish leaving first when that heartbeat came late (a loaded
    // machine, SQLite's writer busy), and a stopped node renews nothing, so it was never declared dead.
    let stuck = {
        let exclusive = exclusive.clone();
        Handlers::new().default_route(Route::new(handler_fn(move |r| {
            let inside = exclusive.enter("a", r.partition);
            async move {
                let _inside = inside;
                std::future::pending::<Result<(), HandlerError>>().await
            }
        })))
    };
    let a = Node::start(outbox.clone(), &db, stuck, slow_heartbeat("a")).await.unwrap();
    let b = start_named(&outbox, &db, "b", &sink, &exclusive).await;
    let (a_id, b_id, a_assigned) = (a.id(), b.id(), a.assignment());
    // Balanced between the two, not merely nobody owning more than half (before anyone owns anything).
    let balanced = BTreeMap::from([(a_id, 128), (b_id, 128)]);
    wait_for("two instances balanced", LONG, || async { owners(&db).await == balanced }).await;
    // Records on most partitions, so that a has calls running when it leaves (its partitions without
    // records it hands over at once).
    let producer = produce(&outbox, &db, 300, 5);
    wait_for("a inside many calls", LONG, || async { exclusive.calls_of("a") >= 40 }).await;
    let leaving = tokio::spawn(a.shutdown());
    wait_for("a handing over", LONG, || async { owners(&db).await.get(&b_id).is_some_and(|&n| n > 128) }).await;
    end_lease(&db, a_id).await;
    wait_for("a declared dead", LONG, || async {
        let now = a_assigned.borrow();
        now.instance != a_id || !now.is_live()
    })
    .await;
    tokio::time::timeout(LONG, leaving).await.expect("the node waited out its shutdown timeout").unwrap().unwrap();
    wait_for("b owns every partition", LONG, || async { owners(&db).await == BTreeMap::from([(b_id, 256)]) }).await;
    producer.await.unwrap();
    drained(&db, LONG).await;
    b.shutdown().await.unwrap();
    assert_eq!(*exclusive.violations.lock().unwrap(), Vec::<String>::new());
}

async fn graceful_scale_up_and_down_delivers_every_record_once_in_order(db: TestDb) {
    logs();
    let outbox = outbox(&db, |_| {}).await;
    let (sink, exclusive) = (Sink::new(), Arc::new(Exclusive::default()));
    let producer = produce(&outbox, &db, 50, 60);
    let a = start_named(&outbox, &db, "a", &sink, &exclusive).await;
    wait_for("a owns everything", LONG, || async { owners(&db).await.get(&a.id()) == Some(&256) }).await;
    let b = start_named(&outbox, &db, "b", &sink, &exclusive).await;
    let c = start_named(&outbox, &db, "c", &sink, &exclusive).await;
    wait_for("three instances balanced 86/85/85", LONG, || async {
        let mut counts: Vec<i64> = owners(&db).await.into_values().collect();
        counts.sort();
        counts == [85, 85, 86]
    })
    .await;
    let stopped = Instant::now();
    b.shutdown().await.unwrap();
    wait_for("b's partitions taken over", LONG, || async {
        let o = owners(&db).await;
        o.len() == 2 && o.values().sum::<i64>() == 256
    })
    .await;
    eprintln!("graceful handover of b's partitions took {:?}", stopped.elapsed());
    c.shutdown().await.unwrap();
    producer.await.unwrap();
    drained(&db, LONG).await;
    a.shutdown().await.unwrap();

    assert_eq!(*exclusive.violations.lock().unwrap(), Vec::<String>::new());
    let keys: Vec<String> = (0..50).map(|k| format!("key-{k}")).collect();
    for key in &keys {
        assert_eq!(sink.ranks_of(key), (1..=60).collect::<Vec<i64>>(), "{key}: every record once, in order");
    }
}

/// Nodes whose rounds tick once an hour still hand partitions over at once when one joins and when it
/// leaves gracefully: the new instance nudges the leader, the leader releases what the newcomer is to
/// take (each partition the moment its records in flight are completed: a producer keeps the keys busy)
/// and nudges it. Nothing is delivered twice or out of order, and no partition is inside two nodes'
/// handlers at once.
async fn a_handover_does_not_wait_for_the_rounds(db: TestDb) {
    let outbox = outbox(&db, |_| {}).await;
    hands_over_without_rounds(&db, &outbox, &outbox).await;
}

/// The same between processes on PostgreSQL: each node has an `Outbox` of its own, so the nudges travel
/// through `NOTIFY`.
#[sqlx::test(migrations = false)]
async fn a_handover_between_processes_does_not_wait_for_the_rounds(pool: sqlx::PgPool) {
    let db = TestDb::postgres(pool);
    let (first, second) = (outbox(&db, |_| {}).await, outbox(&db, |_| {}).await);
    hands_over_without_rounds(&db, &first, &second).await;
}

/// A node declared dead registers again, and that registration is written but its answer lost (a
/// trigger holds its commit past the query timeout, which gives it up): the retry goes under the same id, so
/// the node is the one live instance and takes every partition. A new id per retry left the first
/// counted as live, never heartbeating, for its whole lease: the rebalancer targeted half the
/// partitions at it, and their records waited for that lease to end.
#[sqlx::test(migrations = false)]
async fn a_registration_whose_answer_was_lost_leaves_no_second_instance(pool: sqlx::PgPool) {
    logs();
    let db = TestDb::postgres(pool);
    let outbox = outbox(&db, |c| c.query_timeout = Duration::from_millis(300)).await;
    let (sink, exclusive) = (Sink::new(), Arc::new(Exclusive::default()));
    // Leases far longer than the test: a stray registration would keep its share throughout.
    let config =
        outbox_cluster::ClusterConfig { name: "a".into(), stale_timeout: Duration::from_secs(600), ..fast_cluster() };
    let a = start_calls(&outbox, &db, config, &sink, &exclusive, 3).await;
    let first = a.id();
    wait_for("a owns everything", LONG, || async { owners(&db).await.get(&first) == Some(&256) }).await;

    slow_registrations(&db, "0.6").await;
    end_lease(&db, first).await;
    wait_for("a registration written, its answer given up", LONG, || async {
        count(&db, "SELECT count(*) FROM {s}instances").await >= 2
    })
    .await;
    exec!(db, "DROP TRIGGER slowly ON {s}instances");
    wait_for("a registered again", LONG, || async { a.id() != first }).await;
    let live = rows!(db, (InstanceId,), "SELECT id FROM {s}instances WHERE expires_at > now()");
    assert_eq!(live, [(a.id(),)], "one live instance: the node under its new id");
    wait_for("a owns everything again", LONG, || async { owners(&db).await.get(&a.id()) == Some(&256) }).await;

    let records = (0..256).map(|k| NewRecord::new(format!("key-{k}"), "t", "")).collect();
    commit(&outbox, &db, records).await;
    drained(&db, LONG).await;
    a.shutdown().await.unwrap();
    assert_eq!(*exclusive.violations.lock().unwrap(), Vec::<String>::new());
}

/// A node declared dead is stopped while its registration under a new id is on its way (a trigger holds
/// it longer than the stop waits for its tasks before releasing), and its process ends once `shutdown`
/// returns: no live instance is left, then or once the registration lands. Before, the new row was
/// written after the stop had deregistered the old id, a live instance that nothing ran, which the
/// rebalancer gave a share nobody delivered until its lease ran out.
#[sqlx::test(migrations = false)]
async fn a_registration_landing_after_a_stop_leaves_no_live_instance(pool: sqlx::PgPool) {
    logs();
    let db = TestDb::postgres(pool);
    let outbox = outbox(&db, |c| {
        c.query_timeout = Duration::from_secs(2);
        c.shutdown_timeout = Duration::from_millis(200);
    })
    .await;
    let (url, node_outbox) = (db.url().await, outbox.clone());
    let (started, a) = tokio::sync::oneshot::channel();
    let (stop, stopping) = tokio::sync::oneshot::channel::<()>();
    // The node in a runtime of its own, dropped when `shutdown` returns, as a process that then exits.
    let process = tokio::task::spawn_blocking(move || {
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        runtime.block_on(async {
            let db = outbox_core::Db::connect(&url).await.unwrap();
            // A lease far longer than the test: a stray registration would stay live throughout.
            let config = outbox_cluster::ClusterConfig {
                name: "a".into(),
                stale_timeout: Duration::from_secs(600),
                ..fast_cluster()
            };
            let a = Node::start(node_outbox, db, recording(&Sink::new()), config).await.unwrap();
            started.send((a.id(), a.assignment())).ok().unwrap();
            stopping.await.unwrap();
            a.shutdown().await.unwrap();
        });
    });
    let (first, assignment) = a.await.unwrap();
    wait_for("a owns everything", LONG, || async { owners(&db).await.get(&first) == Some(&256) }).await;

    // Longer than the stop waits for its tasks (half the query timeout) by far more than the stop takes
    // to get there, shorter than the query timeout.
    slow_registrations(&db, "1.8").await;
    end_lease(&db, first).await;
    // Fenced: the registration under a new id goes out next.
    wait_for("a fenced", LONG, || async { assignment.borrow().epochs.is_empty() }).await;
    stop.send(()).unwrap();
    process.await.unwrap();
    let live = "SELECT id FROM {s}instances WHERE expires_at > now()";
    assert_eq!(rows!(db, (InstanceId,), live), [], "no live instance once the stop returned");
    // Nor later: the registration lands (or is given up) within the query timeout of its start.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(rows!(db, (InstanceId,), live), [], "no live instance left behind by the stop");
}

/// Makes every registration of an instance (PostgreSQL) take `seconds` more at its commit, until its
/// trigger `slowly` on `instances` is dropped: a registration given up meanwhile is written all the
/// same, as one whose answer was lost (its transaction, left unfinished, would be rolled back).
async fn slow_registrations(db: &TestDb, seconds: &str) {
    let slowly = format!(
        "CREATE FUNCTION {{s}}slowly() RETURNS trigger AS $$ BEGIN PERFORM pg_sleep({seconds}); RETURN NULL; END $$ LANGUAGE plpgsql"
    );
    db.exec(&slowly, &[]).await;
    exec!(
        db,
        "CREATE CONSTRAINT TRIGGER slowly AFTER INSERT ON {s}instances DEFERRABLE INITIALLY DEFERRED
         FOR EACH ROW EXECUTE FUNCTION {s}slowly()"
    );
}

/// A release that goes unanswered (given up at its time limit) may still commit: until a release of its
/// partitions is answered they stay out of the processor's assignment, even if targeted back here
/// meanwhile. Before, such a partition was delivered again under the epoch of the pending release; once
/// that committed, the partition was free for any instance to take with no quiet period while those
/// calls ran, and their outcomes were fenced out: the record was delivered twice. Here the release waits
/// for a lock past its time limit (the database ends its wait then too), the target comes back
/// meanwhile, and the release sent again takes 3 s to commit, past its time limit.
#[sqlx::test(migrations = false)]
async fn a_partition_whose_release_went_unanswered_is_not_delivered_until_it_is_answered(pool: sqlx::PgPool) {
    let logs = Captured::start("outbox_cluster=warn");
    let db = TestDb::postgres(pool);
    let outbox = outbox(&db, |c| c.query_timeout = Duration::from_secs(1)).await;
    // The leader runs nothing: the test writes the targets. The node's rounds run only when nudged, on
    // a lease no stall of a loaded machine lets lapse: a lease renewed after it lapsed is followed by
    // a round, which released the partition before the test locked it (in a loaded run).
    let leader = register_instance(&db).await;
    let config = outbox_cluster::ClusterConfig { rebalance_interval: Duration::from_secs(3600), ..unlapsing_cluster() };
    let sink = Sink::new();
    let a = Node::start(outbox.clone(), &db, recording(&sink), config).await.unwrap();
    let nudge = async || outbox.nudge(&db, &[a.id()]).await.unwrap();
    exec!(db, "UPDATE {s}partitions SET target_owner = $1", a.id());
    nudge().await;
    wait_for("a owns everything", LONG, || async { owners(&db).await.get(&a.id()) == Some(&256) }).await;
    // At the release's commit, once a transaction: given up meanwhile, it commits all the same, as one
    // whose answer was lost.
    let slowly = "CREATE FUNCTION {s}slow_releases() RETURNS trigger AS $$ BEGIN
        IF current_setting('test.slept', true) IS DISTINCT FROM 'yes' THEN
            PERFORM set_config('test.slept', 'yes', true); PERFORM pg_sleep(3);
        END IF; RETURN NULL; END $$ LANGUAGE plpgsql";
    db.exec(slowly, &[]).await;
    exec!(
        db,
        "CREATE CONSTRAINT TRIGGER slow_releases AFTER UPDATE ON {s}partitions DEFERRABLE INITIALLY DEFERRED
        FOR EACH ROW WHEN (OLD.owner IS NOT NULL AND NEW.owner IS NULL) EXECUTE FUNCTION {s}slow_releases()"
    );
    let partition: outbox_core::Partition = 7;
    let epoch = || async { db.scalar::<i64>("SELECT epoch FROM {s}partitions WHERE partition = 7", &[]).await };
    let given_up_at = epoch().await;

    // Targeted elsewhere, then locked: the release waits for the lock past its time limit.
    exec!(db, "UPDATE {s}partitions SET target_owner = $1 WHERE partition = 7", leader);
    let mut lock = db.holding("SELECT 1 FROM {s}partitions WHERE partition = 7 FOR UPDATE", &[]).await;
    nudge().await;
    // Read in the log, not as a lock waiter: the wait lasts its 1 s time limit, and a test stalled that
    // long (a loaded run) never saw it and waited in vain.
    let given_up = || logs.text().contains("releasing partitions failed or went unanswered");
    wait_for("the release given up waiting for the lock", LONG, || async { given_up() }).await;
    // Targeted back; the release, sent again, then takes 3 s to commit.
    lock.execute(
        AssertSqlSafe(db.sql("UPDATE {s}partitions SET target_owner = $1 WHERE partition = 7")),
        &[a.id().into()],
    )
    .await
    .unwrap();
    lock.commit().await.unwrap();
    let key = keys_in(partition, "k", 1).remove(0);
    commit(&outbox, &db, vec![NewRecord::new(&key, "t", "")]).await;
    nudge().await;
    wait_for("the release committed", LONG, || async { epoch().await > given_up_at }).await;
    nudge().await;
    drained(&db, LONG).await;
    let calls: Vec<i64> = sink.of_key(&key).iter().map(|d| d.epoch.0).collect();
    assert_eq!(calls.len(), 1, "calls under epochs {calls:?}");
    assert_ne!(calls[0], given_up_at, "called under the epoch of the pending release");
    exec!(db, "DROP TRIGGER slow_releases ON {s}partitions");
    a.shutdown().await.unwrap();
}

/// Polls hourly and retries 10 s after a failure: long enough that a next owner takes the partitions
/// well before, so its fetch at takeover finds the records not yet due.
fn hourly_retrying(c: &mut outbox_core::Config) {
    hourly(c);
    c.retry = outbox_core::RetryPolicy::fixed(Duration::from_secs(10), 5);
}

/// Two outboxes on `db` (as two processes) retrying as [`hourly_retrying`], and a node of the first
/// owning every partition, whose handler fails each key's first call once `gate` is open and records
/// later ones in `sink`; with the keys called so far.
async fn first_calls_failing(
    db: &TestDb,
    sink: &Arc<Sink>,
    gate: tokio::sync::watch::Receiver<bool>,
) -> (Outbox, Outbox, Node, Arc<std::sync::Mutex<std::collections::HashSet<String>>>) {
    let (first, second) = (outbox(db, hourly_retrying).await, outbox(db, hourly_retrying).await);
    let tried = Arc::new(std::sync::Mutex::new(std::collections::HashSet::new()));
    let (seen, recorded) = (tried.clone(), sink.clone());
    let failing = handler_fn(move |r: outbox_core::Record| {
        let first_call = seen.lock().unwrap().insert(r.key.clone());
        let (recorded, mut gate) = (recorded.clone(), gate.clone());
        async move {
            if first_call {
                gate.wait_for(|&open| open).await.unwrap();
                return Err(HandlerError::retryable("not yet"));
            }
            recorded.record(&r);
            Ok(())
        }
    });
    let a = Node::start(first.clone(), db, Handlers::new().default_route(Route::new(failing)), fast_cluster())
        .await
        .unwrap();
    wait_for("a owns everything", LONG, || async { owners(db).await.get(&a.id()) == Some(&256) }).await;
    (first, second, a, tried)
}

/// Commits and wakes one record in every partition through `outbox`.
async fn one_record_per_partition(outbox: &Outbox, db: &TestDb) {
    let records = (0..=255u8).map(|p| NewRecord::new(keys_in(p, "key", 1).remove(0), "t", "")).collect();
    let scheduled = commit(outbox, db, records).await;
    outbox.wake(db, &scheduled).await.unwrap();
}

/// A record waiting for its retry when its partition moves to another process (its owner stops) is
/// retried there when its time comes, though that process polls hourly: the owner hands its timers on
/// as wake-ups. Before, the next owner found the record not yet due when it took the partition, and
/// the retry waited for its poll. The record is written once the other process listens, to a partition
/// the owner keeps when the other joins: at the join the other may not listen yet, and a hand-on then
/// is not heard (see `retries_due_after_a_rebalance_are_made_in_time`).
#[sqlx::test(migrations = false)]
async fn a_retry_due_after_its_partition_moved_is_made_in_time(pool: sqlx::PgPool) {
    let db = TestDb::postgres(pool);
    let sink = Sink::new();
    let (first, second, a, _) = first_calls_failing(&db, &sink, tokio::sync::watch::channel(true).1).await;
    let b = Node::start(second.clone(), &db, recording(&sink), fast_cluster()).await.unwrap();
    let listening =
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND query LIKE 'LISTEN %'";
    wait_for("both processors listening", LONG, || async { count(&db, listening).await == 2 }).await;
    let balanced = BTreeMap::from([(a.id(), 128), (b.id(), 128)]);
    wait_for("a and b balanced", LONG, || async { owners(&db).await == balanced }).await;
    let kept = *a.assignment().borrow().epochs.keys().next().expect("a keeps partitions");
    let scheduled = commit(&first, &db, vec![NewRecord::new(keys_in(kept, "k", 1).remove(0), "t", "")]).await;
    first.wake(&db, &scheduled).await.unwrap();
    wait_for("the first call failed", LONG, || async {
        count(&db, "SELECT count(*) FROM {s}records WHERE attempts = 1").await == 1
    })
    .await;
    a.shutdown().await.unwrap();
    wait_for("b owns everything", LONG, || async { owners(&db).await.get(&b.id()) == Some(&256) }).await;
    wait_for("the retry made by b", LONG, || async { sink.len() == 1 }).await;
    b.shutdown().await.unwrap();
}

/// The same when partitions move because another node joined: the retries of the records on the
/// partitions it is given are made there in time, and every record is delivered. The node joins in the
/// same process, where the hand-on reaches it at once: one in another process hears it only if its
/// `LISTEN` connection is up by then, which races its first rounds.
#[sqlx::test(migrations = false)]
async fn retries_due_after_a_rebalance_are_made_in_time(pool: sqlx::PgPool) {
    let db = TestDb::postgres(pool);
    let sink = Sink::new();
    let (first, _, a, _) = first_calls_failing(&db, &sink, tokio::sync::watch::channel(true).1).await;
    one_record_per_partition(&first, &db).await;
    wait_for("every first call failed", LONG, || async {
        count(&db, "SELECT count(*) FROM {s}records WHERE attempts = 1").await == 256
    })
    .await;
    let b = Node::start(first.clone(), &db, recording(&sink), fast_cluster()).await.unwrap();
    let balanced = BTreeMap::from([(a.id(), 128), (b.id(), 128)]);
    wait_for("a and b balanced", LONG, || async { owners(&db).await == balanced }).await;
    wait_for("every record delivered", LONG, || async { sink.len() == 256 }).await;
    b.shutdown().await.unwrap();
    a.shutdown().await.unwrap();
}

/// The same for a retry written after its partition left the assignment: a call running when the
/// partitions move (a graceful handover lets it finish) fails, and the retry goes to the next owner.
#[sqlx::test(migrations = false)]
async fn a_retry_written_after_its_partition_moved_is_made_in_time(pool: sqlx::PgPool) {
    let db = TestDb::postgres(pool);
    let sink = Sink::new();
    let (open, gate) = tokio::sync::watch::channel(false);
    let (first, _, a, tried) = first_calls_failing(&db, &sink, gate).await;
    one_record_per_partition(&first, &db).await;
    wait_for("every first call running", LONG, || async { tried.lock().unwrap().len() == 256 }).await;
    let b = Node::start(first.clone(), &db, recording(&sink), fast_cluster()).await.unwrap();
    // Half the partitions left a's assignment while their calls run.
    let assigned = a.assignment();
    wait_for("a assigned half", LONG, || async { assigned.borrow().epochs.len() == 128 }).await;
    open.send(true).unwrap();
    let balanced = BTreeMap::from([(a.id(), 128), (b.id(), 128)]);
    wait_for("a and b balanced", LONG, || async { owners(&db).await == balanced }).await;
    wait_for("every record delivered", LONG, || async { sink.len() == 256 }).await;
    b.shutdown().await.unwrap();
    a.shutdown().await.unwrap();
}

/// A `shutdown` given up part way (a caller's time limit, a `select!`) stops the node's tasks with it,
/// as a crash would: the lease runs out and another node takes every partition. Before, its heartbeat
/// and ownership rounds ran on for the life of the process, a live instance the leader kept giving a
/// share that nobody delivered.
async fn a_stop_given_up_part_way_stops_every_task(db: TestDb) {
    let outbox = outbox(&db, |_| {}).await;
    let sink = Sink::new();
    // Given up before its first poll (a `select!` that took another branch), and after it.
    for polls in [0, 1] {
        let a = start(&outbox, &db, recording(&sink)).await;
        let first = a.id();
        wait_for("a owns everything", LONG, || async { owners(&db).await.get(&first) == Some(&256) }).await;
        let mut stop = Box::pin(a.shutdown());
        for _ in 0..polls {
            assert!(futures::poll!(stop.as_mut()).is_pending(), "a stop takes more than one poll");
        }
        drop(stop);
        let b = start(&outbox, &db, recording(&sink)).await;
        wait_for("b owns everything", LONG, || async { owners(&db).await.get(&b.id()) == Some(&256) }).await;
        // Not at once: a round of a's already under way when its tasks stopped may have released what b
        // was then targeted (taken as free, leaving a's lease to run out on its own).
        let live = async || {
            let status = outbox_cluster::status(&db, &outbox).await.unwrap();
            status.instances.iter().filter(|i| i.live).map(|i| i.id).collect::<Vec<_>>()
        };
        let only_b = || async { live().await == [b.id()] };
        wait_for(&format!("{polls} polls: the node whose stop was given up no longer renews its lease"), LONG, only_b)
            .await;
        let records: Vec<_> = (0..256).map(|k| NewRecord::new(format!("key-{polls}-{k}"), "t", "")).collect();
        commit(&outbox, &db, records).await;
        wait_for("every record delivered", LONG, || async { sink.len() == 256 * (polls + 1) }).await;
        b.shutdown().await.unwrap();
    }
}

/// The leader's renewal is held up behind a lock past its lease, and renewed once the lock goes (it
/// was sent in time). Meanwhile the other node took the leader for dead, led, and pointed every target
/// at itself; once the leader is renewed it leads again, and its partitions are targeted elsewhere.
/// The leader runs a round once renewed: with its rounds an hour apart, it went on holding partitions
/// targeted at the other node for that hour (which, no longer leading, points no target back).
async fn a_lease_renewed_after_it_lapsed_is_followed_by_a_round(db: TestDb) {
    let outbox = outbox(&db, |_| {}).await;
    let config = outbox_cluster::ClusterConfig {
        // A lease of 8 s. The renewal held up by the lock was sent up to 4 s into it, and a second one
        // beside it two seconds later: both were sent within the lease, so both renew it once the lock
        // goes, if that is within a lease of the first (after which it is given up, and the next
        // renewal finds the lease expired). The lock must go in the 4 s between, after `b` led and
        // pointed every target at itself: 2 s (heartbeats of 2 s) were too few once in a full run of
        // the suite, and `a` registered again under a new id.
        heartbeat_interval: Duration::from_secs(4),
        stale_timeout: Duration::from_secs(16),
        rebalance_interval: Duration::from_secs(3600),
        ..fast_cluster()
    };
    let sink = Sink::new();
    let a = Node::start(outbox.clone(), &db, recording(&sink), config.clone()).await.unwrap();
    let leader = a.id();
    wait_for("a owns everything", LONG, || async { owners(&db).await.get(&leader) == Some(&256) }).await;
    // Started beforehand, with rounds of its own often, so it leads within a round of the lapse: well
    // inside that window on a busy machine too. Started after the lapse, it missed the window at times,
    // and `a` registered again, under an id that led.
    let often = outbox_cluster::ClusterConfig { rebalance_interval: Duration::from_millis(100), ..config };
    let b = Node::start(outbox.clone(), &db, recording(&sink), often).await.unwrap();
    wait_for("b given a share by a", LONG, || async { owners(&db).await.get(&b.id()).copied().unwrap_or(0) > 0 }).await;
    let lock = db.holding("SELECT 1 FROM {s}instances WHERE id = $1 FOR UPDATE", &[leader.into()]).await;
    let assignment = a.assignment();
    wait_for("a's lease lapsed by its clock", LONG, || async { !assignment.borrow().is_live() }).await;
    let targeted = async |id: InstanceId| {
        db.scalar::<i64>("SELECT count(*) FROM {s}partitions WHERE target_owner = $1", &[id.into()]).await
    };
    wait_for("b, the leader, pointing every target at itself", LONG, || async { targeted(b.id()).await == 256 }).await;
    lock.rollback().await.unwrap();
    let settled = "SELECT count(*) FROM {s}partitions WHERE owner = target_owner AND owner = $1";
    wait_for("a targeted again, owning only what it is targeted", LONG, || async {
        let a_targeted = targeted(leader).await;
        let a_owns = owners(&db).await.get(&leader).copied().unwrap_or(0);
        a_targeted > 0 && a_owns == db.scalar::<i64>(settled, &[leader.into()]).await
    })
    .await;
    assert_eq!(a.id(), leader, "the leader kept its lease");
    b.shutdown().await.unwrap();
    a.shutdown().await.unwrap();
}

/// A graceful stop runs out of time (`shutdown_timeout`) while a handler is in the middle of a poll on
/// the other runtime thread: the stop waits until the call is dropped before it releases the
/// partition, so no next owner delivers while the call runs on. Before, the stop returned, the
/// partition released, with the call still running.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_out_of_time_releases_nothing_while_a_call_runs() {
    let db = TestDb::sqlite().await;
    let outbox = outbox(&db, |c| c.shutdown_timeout = Duration::from_millis(100)).await;
    commit(&outbox, &db, vec![NewRecord::new("k", "t", "")]).await;
    let running = Arc::new(AtomicBool::new(false));
    let call = running.clone();
    let handlers = Handlers::new().default_route(Route::new(handler_fn(move |_| {
        let call = call.clone();
        async move {
            call.store(true, Ordering::SeqCst);
            // Work that does not yield (as a handler computing, or blocking on a lock, may do).
            std::thread::sleep(Duration::from_secs(1));
            call.store(false, Ordering::SeqCst);
            Ok::<(), HandlerError>(())
        }
    })));
    let node = start(&outbox, &db, handlers).await;
    wait_for("the call running", LONG, || async { running.load(Ordering::SeqCst) }).await;
    let stopped = node.shutdown().await;
    assert!(!running.load(Ordering::SeqCst), "the stop returned while the call still ran");
    let error = stopped.expect_err("the stop ran out of time");
    assert!(matches!(error, outbox_cluster::Error::Core(outbox_core::Error::ShutdownTimeout(_))), "{error}");
}

async fn hands_over_without_rounds(db: &TestDb, first: &Outbox, second: &Outbox) {
    logs();
    let hourly = |name: &str| outbox_cluster::ClusterConfig {
        name: name.into(),
        rebalance_interval: Duration::from_secs(3600),
        ..fast_cluster()
    };
    let (sink, exclusive) = (Sink::new(), Arc::new(Exclusive::default()));
    let producer = produce(first, db, 50, 60);
    let a = start_calls(first, db, hourly("a"), &sink, &exclusive, 3).await;
    wait_for("a owns everything after its first round", LONG, || async { owners(db).await.get(&a.id()) == Some(&256) })
        .await;
    let b = start_calls(second, db, hourly("b"), &sink, &exclusive, 3).await;
    wait_for("a newcomer given its share without a round on the ticker", LONG, || async {
        let o = owners(db).await;
        o.get(&a.id()) == Some(&128) && o.get(&b.id()) == Some(&128)
    })
    .await;
    b.shutdown().await.unwrap();
    wait_for("a leaver's share taken over without a round on the ticker", LONG, || async {
        owners(db).await.get(&a.id()) == Some(&256)
    })
    .await;
    producer.await.unwrap();
    drained(db, LONG).await;
    a.shutdown().await.unwrap();
    assert_eq!(*exclusive.violations.lock().unwrap(), Vec::<String>::new());
    for k in 0..50 {
        assert_eq!(
            sink.ranks_of(&format!("key-{k}")),
            (1..=60).collect::<Vec<i64>>(),
            "key-{k}: every record once, in order"
        );
    }
}

/// A node stopped before it was given any partition has nothing to hand over: its shutdown does not
/// wait for a handover (here up to a minute, the outbox's `shutdown_timeout`).
async fn a_node_that_owns_nothing_stops_without_waiting(db: TestDb) {
    logs();
    let outbox = outbox(&db, |c| c.shutdown_timeout = Duration::from_secs(60)).await;
    let (sink, exclusive) = (Sink::new(), Arc::new(Exclusive::default()));
    let a = start_named(&outbox, &db, "a", &sink, &exclusive).await;
    wait_for("a owns everything", LONG, || async { owners(&db).await.get(&a.id()) == Some(&256) }).await;
    let b = start_named(&outbox, &db, "b", &sink, &exclusive).await;
    let stopped = tokio::time::timeout(Duration::from_secs(20), b.shutdown()).await;
    assert!(stopped.is_ok(), "a node's shutdown waited for a handover of nothing");
    stopped.unwrap().unwrap();
    a.shutdown().await.unwrap();
}

async fn a_crashed_instances_partitions_move_on_after_its_lease(db: TestDb) {
    logs();
    let outbox = outbox(&db, |_| {}).await;
    let (sink, exclusive) = (Sink::new(), Arc::new(Exclusive::default()));
    let producer = produce(&outbox, &db, 40, 40);
    let a = start_named(&outbox, &db, "a", &sink, &exclusive).await;
    let b = start_named(&outbox, &db, "b", &sink, &exclusive).await;
    let b_id = b.id();
    let balanced = BTreeMap::from([(a.id(), 128), (b_id, 128)]);
    wait_for("two instances balanced", LONG, || async { owners(&db).await == balanced }).await;
    let crashed = Instant::now();
    b.kill();
    wait_for("a owns everything after b's lease expired", LONG, || async {
        owners(&db).await.get(&a.id()) == Some(&256)
    })
    .await;
    let took = crashed.elapsed();
    eprintln!("failover after a crash took {took:?} (lease 600 ms, rounds 100 ms)");
    assert!(!owners(&db).await.contains_key(&b_id));
    producer.await.unwrap();
    drained(&db, LONG).await;
    a.shutdown().await.unwrap();
    assert_eq!(*exclusive.violations.lock().unwrap(), Vec::<String>::new());
    for k in 0..40 {
        let seqs = sink.ranks_of(&format!("key-{k}"));
        // At least once, in order: each key's deliveries go up one at a time, except that the crash may
        // replay the records `b` had delivered but not yet completed (up to a lookahead run), once.
        let mut firsts: Vec<i64> = Vec::new();
        let mut replays = 0;
        for w in seqs.windows(2) {
            if w[1] <= w[0] {
                replays += 1;
            } else {
                assert_eq!(w[1], w[0] + 1, "key-{k}: a gap in {seqs:?}");
            }
        }
        for &seq in &seqs {
            if !firsts.contains(&seq) {
                firsts.push(seq);
            }
        }
        assert_eq!(firsts, (1..=40).collect::<Vec<i64>>(), "key-{k}: first deliveries out of order in {seqs:?}");
        assert!(replays <= 1, "key-{k}: replayed {replays} times after one crash: {seqs:?}");
    }
}

/// A database clock step, as the cluster sees it: an instance's lease ends early by database time while
/// its own deadline has not passed. Several times one instance's `expires_at` is forced into the past
/// (the other may take its partitions at once), then every instance's (a step beyond the whole lease).
/// Instance `a` heartbeats every 500 ms, so it finds out up to half a second after `b`, rebalancing
/// every 100 ms, could take its partitions; its handler calls take up to 100 ms, so many are running at
/// each step. No partition is ever inside handlers of two instances at once, and every record is
/// delivered, first deliveries in order.
async fn a_lease_that_ends_early_never_lets_two_instances_deliver_one_partition(db: TestDb) {
    logs();
    let outbox = outbox(&db, |_| {}).await;
    let (sink, exclusive) = (Sink::new(), Arc::new(Exclusive::default()));
    let producer = produce(&outbox, &db, 60, 100);
    let a = start_calls(&outbox, &db, slow_heartbeat("a"), &sink, &exclusive, 50).await;
    let b_config = outbox_cluster::ClusterConfig { name: "b".into(), ..fast_cluster() };
    let b = start_calls(&outbox, &db, b_config, &sink, &exclusive, 10).await;
    let balanced = || async {
        let o = owners(&db).await;
        o.len() == 2 && o.values().all(|&n| n == 128)
    };
    let end_early = |ids: Vec<InstanceId>| {
        let db = db.clone();
        async move {
            for id in ids {
                end_lease(&db, id).await;
            }
        }
    };
    for step in 0..4 {
        wait_for("two instances balanced", LONG, balanced).await;
        let node = if step % 2 == 0 { &a } else { &b };
        let before = node.id();
        end_early(vec![before]).await;
        wait_for("registered again under a new id", LONG, || async { node.id() != before }).await;
    }
    wait_for("two instances balanced", LONG, balanced).await;
    let (a_id, b_id) = (a.id(), b.id());
    end_early(vec![a_id, b_id]).await;
    wait_for("both registered again", LONG, || async { a.id() != a_id && b.id() != b_id }).await;
    producer.await.unwrap();
    drained(&db, LONG).await;
    a.shutdown().await.unwrap();
    b.shutdown().await.unwrap();
    assert_eq!(*exclusive.violations.lock().unwrap(), Vec::<String>::new());
    assert_first_deliveries_in_order(&sink, 60, 100);
}

/// Starts `a` with `a_config` (calls of two awaits of up to 100 ms, each first held while `a_held` is
/// set) and `b` (fast, short calls); returns them once they own half the partitions each.
async fn a_and_b_balanced(
    outbox: &Outbox,
    db: &TestDb,
    (a_config, a_held): (outbox_cluster::ClusterConfig, Arc<AtomicBool>),
    sink: &Arc<Sink>,
    exclusive: &Arc<Exclusive>,
) -> (Node, Node) {
    let handlers = paced_handlers(&a_config.name, sink, exclusive, 100, a_held);
    let a = Node::start(outbox.clone(), db, handlers, a_config).await.unwrap();
    let b = start_named(outbox, db, "b", sink, exclusive).await;
    wait_for("two instances balanced", LONG, || async {
        let o = owners(db).await;
        o.len() == 2 && o.values().all(|&n| n == 128)
    })
    .await;
    (a, b)
}

/// A partition taken from an instance whose lease ended early stays quiet for its whole quiet period
/// even when the rebalance hands it on meanwhile: released at once, it was taken as free by the next
/// instance, which delivered while the first one's calls still ran (it notices at its next heartbeat).
async fn a_partition_handed_on_during_its_quiet_period_stays_quiet(db: TestDb) {
    logs();
    let outbox = outbox(&db, |_| {}).await;
    let (sink, exclusive) = (Sink::new(), Arc::new(Exclusive::default()));
    let producer = produce(&outbox, &db, 200, 30);
    let a_config = outbox_cluster::ClusterConfig {
        name: "a".into(),
        heartbeat_interval: Duration::from_secs(3),
        stale_timeout: Duration::from_secs(12),
        ..fast_cluster()
    };
    // a's calls run until a notices the end of its lease and cancels them, at its next heartbeat. They
    // are under way in 40 of a's partitions or more, which a cannot release, so b takes them over and
    // hands about a third on to c. The lease ends in the first second after a renewal, at least 2 s
    // before a notices: time enough for b to take them and for c to join and take some (at once, if b
    // released them in their quiet period). With calls that ended on their own, at any point of a's
    // interval, the test missed such a release 3 runs in 9; without the 40 calls, a released its
    // partitions itself when nothing of them was under way, and nothing was taken over.
    // (Held only once balanced: a hands partitions over only once their calls are done.)
    let a_held = Arc::new(AtomicBool::new(false));
    let (a, b) = a_and_b_balanced(&outbox, &db, (a_config, a_held.clone()), &sink, &exclusive).await;
    a_held.store(true, Ordering::SeqCst);
    wait_for("a's calls under way in 40 partitions", LONG, || async { exclusive.partitions_of("a") >= 40 }).await;
    let a_id = a.id();
    // A renewal writes a lease of 6 s (the stale timeout less two intervals): 5 s or more left means
    // renewed within the last second.
    let just_renewed = "UPDATE {s}instances SET expires_at = {ago:1} WHERE id = $1 AND expires_at > {ago:-5}";
    wait_for("a's lease ended just after a renewal", LONG, || async { exec!(db, just_renewed, a_id) == 1 }).await;
    // Taken by b, or some by a under its new id when its next heartbeat (fenced, it registers again)
    // comes before b's round: then b never holds all 256, and waiting for that timed out.
    wait_for("a's partitions taken over", LONG, || async { !owners(&db).await.contains_key(&a_id) }).await;
    let c = start_named(&outbox, &db, "c", &sink, &exclusive).await;
    wait_for("c owning partitions", LONG, || async { owners(&db).await.contains_key(&c.id()) }).await;
    wait_for("a registered again", LONG, || async { a.id() != a_id }).await;
    a_held.store(false, Ordering::SeqCst);
    producer.await.unwrap();
    drained(&db, LONG).await;
    for node in [a, b, c] {
        node.shutdown().await.unwrap();
    }
    assert_eq!(*exclusive.violations.lock().unwrap(), Vec::<String>::new());
    assert_first_deliveries_in_order(&sink, 200, 30);
}

/// An acquisition whose reply was lost (committed, then the connection dropped) leaves the instance
/// owning partitions it never heard it took, from an owner that may still be delivering: they are held
/// back for the quiet period the acquisition stored. Here b is made the owner of a's partitions behind
/// both their backs, quiet for a second.
async fn a_partition_acquired_by_a_lost_reply_stays_quiet(db: TestDb) {
    logs();
    let outbox = outbox(&db, |_| {}).await;
    let (sink, exclusive) = (Sink::new(), Arc::new(Exclusive::default()));
    let producer = produce(&outbox, &db, 60, 100);
    let a_config = outbox_cluster::ClusterConfig { name: "a".into(), ..fast_cluster() };
    let (a, b) = a_and_b_balanced(&outbox, &db, (a_config, Arc::new(AtomicBool::new(false))), &sink, &exclusive).await;
    exec!(
        db,
        "UPDATE {s}partitions SET owner = $1, epoch = epoch + 1, target_owner = $1, quiet_until = {ago:-1}
         WHERE owner = $2",
        b.id(),
        a.id()
    );
    producer.await.unwrap();
    drained(&db, LONG).await;
    a.shutdown().await.unwrap();
    b.shutdown().await.unwrap();
    assert_eq!(*exclusive.violations.lock().unwrap(), Vec::<String>::new());
    assert_first_deliveries_in_order(&sink, 60, 100);
}

/// An instance takes every partition from an owner whose lease ran out and that heartbeated every
/// 1.5 s (a 3 s quiet period), and stops before the period is over (its `shutdown_timeout` is shorter):
/// the next instance delivers nothing before the period ends, then everything. The stopping instance
/// releases the partitions, and the next takes them free with the rest of the period. Before the period
/// was kept with the partition, it delivered them at once, while the owner they were taken from might
/// still be delivering.
async fn a_partition_still_quiet_when_its_owner_stops_stays_quiet(db: TestDb) {
    // Shorter than the quiet period; the stop's first write (marking the instance draining) must fit in
    // it, which 100 ms did not on a loaded machine (the stop then failed).
    let outbox = outbox(&db, |c| c.shutdown_timeout = Duration::from_secs(1)).await;
    owner_of_all_dead_since_a_minute(&db, 1500).await;
    commit(&outbox, &db, (0..64).map(|k| NewRecord::new(format!("k-{k}"), "t", "")).collect()).await;
    let (sink, exclusive) = (Sink::new(), Arc::new(Exclusive::default()));

    let before_the_takeover = Instant::now();
    let a = start_named(&outbox, &db, "a", &sink, &exclusive).await;
    wait_for("a took every partition", LONG, || async { owners(&db).await.get(&a.id()) == Some(&256) }).await;
    a.shutdown().await.unwrap();
    let b = start_named(&outbox, &db, "b", &sink, &exclusive).await;
    drained(&db, LONG).await;
    b.shutdown().await.unwrap();
    quiet_until_the_end(&sink, &exclusive, 64, before_the_takeover + Duration::from_secs(3));
}

/// Each of `records` delivered once, none before `quiet_until`, and no two instances in one partition.
fn quiet_until_the_end(sink: &Sink, exclusive: &Exclusive, records: usize, quiet_until: Instant) {
    let deliveries = sink.all();
    assert_eq!(deliveries.len(), records, "each record delivered once");
    let first = deliveries.iter().map(|d| d.at).min().unwrap();
    assert!(first >= quiet_until, "the first delivery came {:?} before the quiet period ended", quiet_until - first);
    assert_eq!(*exclusive.violations.lock().unwrap(), Vec::<String>::new());
}

/// An owner of every partition, heartbeating every 3 s (a 6 s quiet period), with 64 records, whose
/// lease ends now; returns when.
async fn owner_of_64_records_ending_its_lease(outbox: &Outbox, db: &TestDb) -> Instant {
    let dead = owner_of_all_dead_since_a_minute(db, 3000).await;
    commit(outbox, db, (0..64).map(|k| NewRecord::new(format!("k-{k}"), "t", "")).collect()).await;
    exec!(db, "UPDATE {s}instances SET expires_at = {now} WHERE id = $1", dead);
    Instant::now()
}

/// The row of a dead owner stays until twice its declared heartbeat has passed since its lease ended,
/// whatever the leader's stale timeout, so a partition taken from it later still waits out its quiet
/// period. Before, the leader deleted the row two of its own stale timeouts after the lease (1.2 s here,
/// against the owner's 3 s heartbeats), and a partition taken over after that was delivered 200 ms later
/// (twice the taker's heartbeat), while the owner it came from might still be delivering.
async fn a_partition_taken_from_an_owner_whose_row_was_reaped_stays_quiet(db: TestDb) {
    let outbox = outbox(&db, |_| {}).await;
    let lease_ended = owner_of_64_records_ending_its_lease(&outbox, &db).await;
    // Live, with no node behind it, and its id sorting after a's (a leads): half the targets go to it,
    // and their partitions stay with the dead owner until it goes.
    let idle = InstanceId(uuid::Uuid::max());
    exec!(db, "INSERT INTO {s}instances (id, name, expires_at) VALUES ($1, 'idle', {ago:-86400})", idle);
    let (sink, exclusive) = (Sink::new(), Arc::new(Exclusive::default()));
    let a = start_named(&outbox, &db, "a", &sink, &exclusive).await;
    wait_for("a owning its half", LONG, || async { owners(&db).await.get(&a.id()) == Some(&128) }).await;
    // Past two of a's stale timeouts since the lease ended, and a has reaped since.
    tokio::time::sleep_until(lease_ended + Duration::from_secs(2)).await;
    exec!(db, "DELETE FROM {s}instances WHERE id = $1", idle);
    wait_for("a owning every partition", LONG, || async { owners(&db).await.get(&a.id()) == Some(&256) }).await;
    drained(&db, LONG).await;
    a.shutdown().await.unwrap();
    // Twice the owner's 3 s heartbeats since its lease ended.
    quiet_until_the_end(&sink, &exclusive, 64, lease_ended + Duration::from_secs(6));
}

/// A partition taken over keeps its quiet period when its new owner's lease lapses during it: the next
/// owner (here the same node under a new id) waits out what is left. Before, renewals declared only the
/// configured heartbeat interval, and the next owner waited twice that (200 ms here) while the owner
/// the partition was first taken from (3 s heartbeats: a 6 s period) might still be delivering.
async fn a_partition_whose_new_owner_lapses_in_its_quiet_period_stays_quiet(db: TestDb) {
    // A few of the new owner's renewals (every 100 ms) since the takeover, then its lease lapses.
    new_owner_lapsing_in_the_quiet_period(&db, fast_cluster(), Duration::from_millis(500)).await;
}

/// As above, the new owner's lease lapsing before its first renewal after the takeover: it renews
/// every second from its registration, and its lease ends as soon as it owns every partition. Before,
/// a renewal declared half the quiet period still ahead as its heartbeat interval, and with none since
/// the takeover the next owner waited twice the configured one (2 s, against 6 s).
async fn a_partition_whose_new_owner_lapses_before_it_renews_stays_quiet(db: TestDb) {
    let config = outbox_cluster::ClusterConfig {
        heartbeat_interval: Duration::from_secs(1),
        stale_timeout: Duration::from_secs(4),
        ..fast_cluster()
    };
    new_owner_lapsing_in_the_quiet_period(&db, config, Duration::ZERO).await;
}

/// A node with `config` takes every partition (and 64 records) from an owner whose lease ended (a 6 s
/// quiet period), and its own lease ends `after` that: nothing is delivered before the period is over.
async fn new_owner_lapsing_in_the_quiet_period(db: &TestDb, config: outbox_cluster::ClusterConfig, after: Duration) {
    let outbox = outbox(db, |_| {}).await;
    let lease_ended = owner_of_64_records_ending_its_lease(&outbox, db).await;
    let (sink, exclusive) = (Sink::new(), Arc::new(Exclusive::default()));
    let config = outbox_cluster::ClusterConfig { name: "a".into(), ..config };
    let a = start_calls(&outbox, db, config, &sink, &exclusive, 3).await;
    let a_id = a.id();
    wait_for("a took every partition", LONG, || async { owners(db).await.get(&a_id) == Some(&256) }).await;
    tokio::time::sleep(after).await;
    end_lease(db, a_id).await;
    wait_for("a registered again", LONG, || async { a.id() != a_id }).await;
    drained(db, LONG).await;
    a.shutdown().await.unwrap();
    quiet_until_the_end(&sink, &exclusive, 64, lease_ended + Duration::from_secs(6));
}

/// A release the database refuses leaves its partitions delivered by nobody until one is answered; the
/// warning names them and the instance. Before, only "ownership round failed" was logged, with the
/// instance and the database's error: which partitions stood still was nowhere.
async fn a_release_that_fails_names_its_partitions(db: TestDb) {
    let logs = Captured::start("outbox_cluster=warn");
    let outbox = outbox(&db, |_| {}).await;
    let a = start(&outbox, &db, Handlers::new()).await;
    wait_for("a owning every partition", LONG, || async { owners(&db).await.get(&a.id()) == Some(&256) }).await;
    db.refuse_releases().await;
    let b = start(&outbox, &db, Handlers::new()).await;
    let warned =
        || logs.text().lines().any(|l| l.contains("releasing partitions failed") && l.contains(&a.id().to_string()));
    wait_for("a's failed release warned of", LONG, || async { warned() }).await;
    let line = logs.text().lines().find(|l| l.contains("releasing partitions failed")).unwrap().to_string();
    // b's half: the partitions a gives up, named.
    let named = (0..=255).filter(|p| line.contains(&format!(" {p},")) || line.contains(&format!("[{p},"))).count();
    assert!(named >= 64, "the partitions are named: {line}");
    db.allow_releases().await;
    wait_for("the partitions shared", LONG, || async { owners(&db).await.get(&b.id()) == Some(&128) }).await;
    a.shutdown().await.unwrap();
    b.shutdown().await.unwrap();
}

/// As above, with one more partition, taken free (no quiet period), and the database refusing releases
/// at the stop: the partitions stay with the stopped instance until its lease runs out (600 ms), and
/// the next instance, taking them from it, still waits out the rest of the quiet period. Before, it
/// waited only twice the stopped one's heartbeat before delivering.
async fn a_partition_still_quiet_stays_quiet_when_its_owner_cannot_release_at_stop(db: TestDb) {
    quiet_through_a_failed_release_at_stop(
        &db,
        async || db.refuse_releases().await,
        async |()| db.allow_releases().await,
    )
    .await;
}

/// As above, the release waiting for a row lock past the stop's budget (`query_timeout`, 1 s) instead
/// (given up, it may still commit: the next instance then takes the partitions free, with the rest of
/// their period).
async fn a_partition_still_quiet_stays_quiet_when_the_release_waits_out_the_stop(db: TestDb) {
    let lock = async || db.holding("SELECT 1 FROM {s}partitions WHERE partition = 0 FOR UPDATE", &[]).await;
    quiet_through_a_failed_release_at_stop(&db, lock, async |lock| lock.rollback().await.unwrap()).await;
}

/// A node takes 255 partitions from an owner whose lease ran out and that heartbeated every 1.5 s (a
/// 3 s quiet period) and one more free, and stops while `fail_release` makes its releases fail (the
/// database refuses them, or the free one's row lock holds them up; `mend`, given what it returned,
/// ends that); the next node delivers nothing of the others before the period ends.
async fn quiet_through_a_failed_release_at_stop<T>(
    db: &TestDb,
    fail_release: impl AsyncFnOnce() -> T,
    mend: impl AsyncFnOnce(T),
) {
    let outbox = outbox(db, |c| {
        c.shutdown_timeout = Duration::from_millis(100);
        c.query_timeout = Duration::from_secs(1);
    })
    .await;
    owner_of_all_dead_since_a_minute(db, 1500).await;
    exec!(db, "UPDATE {s}partitions SET owner = NULL, epoch = epoch + 1 WHERE partition = 0");
    commit(&outbox, db, (0..64).map(|k| NewRecord::new(format!("k-{k}"), "t", "")).collect()).await;
    let (sink, exclusive) = (Sink::new(), Arc::new(Exclusive::default()));

    let before_the_takeover = Instant::now();
    let a = start_named(&outbox, db, "a", &sink, &exclusive).await;
    wait_for("a took every partition", LONG, || async { owners(db).await.get(&a.id()) == Some(&256) }).await;
    let failing = fail_release().await;
    assert!(a.shutdown().await.is_err(), "the release failed");
    mend(failing).await;
    let b = start_named(&outbox, db, "b", &sink, &exclusive).await;
    drained(db, LONG).await;
    b.shutdown().await.unwrap();

    let from_quiet_partitions = sink.all().into_iter().filter(|d| outbox_core::partition_of(&d.key) != 0);
    let first = from_quiet_partitions.map(|d| d.at).min().unwrap();
    assert!(
        first >= before_the_takeover + Duration::from_secs(3),
        "the first delivery of a partition taken over came {:?} after the takeover began, within its 3 s quiet period",
        first - before_the_takeover
    );
    assert_eq!(*exclusive.violations.lock().unwrap(), Vec::<String>::new());
}

/// A partition taken from an owner whose lease ran out is stamped with the time in the database, so
/// each call of a record scheduled before then is written as an unfinished attempt before it is made
/// (the handler finds it stored), by the instance that took the partition and by one it is handed on
/// to gracefully before the record was reached (here: during the quiet period of the takeover).
/// Records scheduled after the takeover are not counted, and a counted call that succeeds leaves no
/// trace in `completed`.
async fn calls_of_records_older_than_a_takeover_are_counted_before_they_are_made(db: TestDb) {
    let outbox = outbox(&db, |_| {}).await;
    // A dead owner of every partition that heartbeated every 2.5 s: a 5 s quiet period after a takeover.
    owner_of_all_dead_since_a_minute(&db, 2500).await;
    let keys: Vec<String> = (0..40).map(|k| format!("k-{k}")).collect();
    commit(&outbox, &db, keys.iter().map(|k| NewRecord::new(k, "before", "")).collect()).await;

    let seen: Seen = Arc::default();
    let start = |name: &str| {
        let config = outbox_cluster::ClusterConfig { name: name.into(), ..fast_cluster() };
        Node::start(outbox.clone(), &db, what_calls_find_stored(&db, name, &seen), config)
    };
    let a = start("a").await.unwrap();
    wait_for("a took every partition over", LONG, || async { owners(&db).await.get(&a.id()) == Some(&256) }).await;
    let b = start("b").await.unwrap();
    wait_for("half handed on to b", LONG, || async { owners(&db).await.get(&b.id()) == Some(&128) }).await;
    drained(&db, LONG).await;
    commit(&outbox, &db, keys.iter().map(|k| NewRecord::new(k, "after", "")).collect()).await;
    drained(&db, LONG).await;
    a.shutdown().await.unwrap();
    b.shutdown().await.unwrap();

    let seen = seen.lock().unwrap().clone();
    let calls = |event: &str| -> Vec<(String, i32, bool)> {
        seen.iter().filter(|(_, e, ..)| e == event).map(|(n, _, a, u)| (n.clone(), *a, *u)).collect()
    };
    let (before, after) = (calls("before"), calls("after"));
    assert_eq!(before.len(), 40, "{seen:?}");
    assert!(before.iter().all(|&(_, attempts, unfinished)| attempts == 1 && unfinished), "{seen:?}");
    assert!(before.iter().any(|(name, ..)| name == "b"), "b was handed some before reaching them: {seen:?}");
    assert_eq!(after.len(), 40, "{seen:?}");
    assert!(after.iter().all(|&(_, attempts, unfinished)| attempts == 0 && !unfinished), "{seen:?}");
    let traces = count(&db, "SELECT count(*) FROM {s}completed WHERE attempts <> 0").await;
    assert_eq!(traces, 0, "a counted call that succeeded leaves its record as if uncounted");
}

/// Per call: (instance name, event type, the attempts and whether the error says "did not finish", as
/// stored for the record during the call).
type Seen = Arc<std::sync::Mutex<Vec<(String, String, i32, bool)>>>;

/// Handlers of instance `name` that note in `seen` what each call finds stored for its record.
fn what_calls_find_stored(db: &TestDb, name: &str, seen: &Seen) -> Handlers {
    let (name, seen, db) = (name.to_string(), seen.clone(), db.clone());
    Handlers::new().default_route(Route::new(handler_fn(move |r| {
        let (name, seen, db) = (name.clone(), seen.clone(), db.clone());
        async move {
            let stored =
                rows!(db, (i32, Option<String>), "SELECT attempts, last_error FROM {s}records WHERE id = $1", r.id);
            let (attempts, error) = stored.into_iter().next().unwrap_or_default();
            let unfinished = error.is_some_and(|e| e.contains("did not finish"));
            seen.lock().unwrap().push((name, r.event_type.clone(), attempts, unfinished));
            Ok::<(), HandlerError>(())
        }
    })))
}

/// Without stop-on-first-failure a key's records are fetched one at a time, and the previous owner may
/// have been calling any of those scheduled before the takeover (a later one while an earlier waited
/// for its retry), so the call of each is counted, not only of the first one fetched. Before, only the
/// first was: a later record that ended the process ended its next owner's too, uncounted.
async fn without_stop_on_first_failure_every_call_older_than_a_takeover_is_counted(db: TestDb) {
    let outbox = outbox(&db, |c| c.stop_on_first_failure = false).await;
    owner_of_all_dead_since_a_minute(&db, 100).await;
    let records = (0..10).flat_map(|k| ["first", "second"].map(|event| NewRecord::new(format!("k-{k}"), event, "")));
    commit(&outbox, &db, records.collect()).await;

    let seen: Seen = Arc::default();
    let a = Node::start(outbox.clone(), &db, what_calls_find_stored(&db, "a", &seen), fast_cluster()).await.unwrap();
    drained(&db, LONG).await;
    a.shutdown().await.unwrap();
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 20, "{seen:?}");
    assert!(seen.iter().all(|&(_, _, attempts, unfinished)| attempts == 1 && unfinished), "{seen:?}");
}

/// A key's run is counted whole before its first call, but a failure stops the run: the counts of the
/// records it did not reach are taken back, so they keep their retries. Here each key's first record
/// fails once after a takeover; its two followers are delivered with no attempt spent. Before, each
/// follower carried one attempt it never made, and came back as a suspect, called alone.
async fn counts_of_calls_a_failure_kept_from_being_made_are_taken_back(db: TestDb) {
    let outbox = outbox(&db, |c| c.retry = outbox_core::RetryPolicy::fixed(Duration::from_millis(100), 5)).await;
    owner_of_all_dead_since_a_minute(&db, 100).await;
    let records =
        (0..10).flat_map(|k| ["first", "second", "third"].map(|event| NewRecord::new(format!("k-{k}"), event, "")));
    commit(&outbox, &db, records.collect()).await;

    let failed_once = Arc::new(std::sync::Mutex::new(std::collections::HashSet::new()));
    let handlers = Handlers::new().default_route(Route::new(handler_fn(move |r| {
        let first_call = r.event_type == "first" && failed_once.lock().unwrap().insert(r.id);
        async move { if first_call { Err(HandlerError::retryable("fails once")) } else { Ok(()) } }
    })));
    let config = outbox_cluster::ClusterConfig { name: "a".into(), ..fast_cluster() };
    let a = Node::start(outbox.clone(), &db, handlers, config).await.unwrap();
    drained(&db, LONG).await;
    a.shutdown().await.unwrap();

    let spent = spent(&db).await;
    let expected = BTreeMap::from([(("first".into(), 1), 10), (("second".into(), 0), 10), (("third".into(), 0), 10)]);
    assert_eq!(spent, expected, "(event type, attempts spent) of the delivered records");
}

/// The same when the run is stopped by a graceful handover: after a takeover, each key's first call
/// waits until a second instance has joined and the first has given up its share; the records of the
/// runs in that share not reached are handed on with their counts taken back. Before, each kept an
/// attempt never made, its next owner took it for a suspect (a call that did not finish), called it
/// alone and counted it again: it completed with 1 attempt spent.
async fn counts_of_calls_a_handover_kept_from_being_made_are_taken_back(db: TestDb) {
    let outbox = outbox(&db, |_| {}).await;
    owner_of_all_dead_since_a_minute(&db, 100).await;
    let keys = 40;
    let records =
        (0..keys).flat_map(|k| ["first", "second", "third"].map(|event| NewRecord::new(format!("k-{k}"), event, "")));
    commit(&outbox, &db, records.collect()).await;

    let (open, gate) = tokio::sync::watch::channel(false);
    let entered = Arc::new(AtomicUsize::new(0));
    let waiting = entered.clone();
    let handlers = Handlers::new().default_route(Route::new(handler_fn(move |r| {
        let (mut gate, entered, first) = (gate.clone(), entered.clone(), r.event_type == "first");
        async move {
            if first {
                entered.fetch_add(1, Ordering::SeqCst);
                gate.wait_for(|&open| open).await.unwrap();
            }
            Ok::<(), HandlerError>(())
        }
    })));
    let a = Node::start(outbox.clone(), &db, handlers, fast_cluster()).await.unwrap();
    wait_for("every key's first call made", LONG, || async { waiting.load(Ordering::SeqCst) == keys }).await;
    hand_half_on_then_open(&outbox, &db, a, &open).await;

    let spent = spent(&db).await;
    let expected =
        BTreeMap::from([(("first".into(), 0), keys), (("second".into(), 0), keys), (("third".into(), 0), keys)]);
    assert_eq!(spent, expected, "(event type, attempts spent) of the delivered records");
}

/// Counts wait for their turns: after a takeover, a suspect (a record counted before) is called alone
/// while the other keys' counts wait, and here its call waits until a second instance has joined and
/// the first has given up its share. The counts of that share's runs are written once the suspect is
/// done, to partitions no longer granted: the runs are not started, and their counts are taken back.
/// Before, they stayed, and the next owner called each of those records as a suspect, counted again.
async fn counts_written_while_the_partition_was_handed_on_are_taken_back(db: TestDb) {
    let outbox = outbox(&db, |_| {}).await;
    owner_of_all_dead_since_a_minute(&db, 100).await;
    let keys = 40;
    let mut records: Vec<NewRecord> =
        (0..keys).flat_map(|k| ["first", "second"].map(|event| NewRecord::new(format!("k-{k}"), event, ""))).collect();
    records.push(NewRecord::new("suspect", "suspect", ""));
    commit(&outbox, &db, records).await;
    exec!(
        db,
        "UPDATE {s}records SET attempts = 1, last_error = $1 WHERE key = 'suspect'",
        outbox_core::UNFINISHED_CALL
    );

    let (open, gate) = tokio::sync::watch::channel(false);
    let called = Arc::new(AtomicBool::new(false));
    let suspect_called = called.clone();
    let handlers = Handlers::new().default_route(Route::new(handler_fn(move |r| {
        let (mut gate, called, suspect) = (gate.clone(), called.clone(), r.event_type == "suspect");
        async move {
            if suspect {
                called.store(true, Ordering::SeqCst);
                gate.wait_for(|&open| open).await.unwrap();
            }
            Ok::<(), HandlerError>(())
        }
    })));
    let a = Node::start(outbox.clone(), &db, handlers, fast_cluster()).await.unwrap();
    wait_for("the suspect called", LONG, || async { suspect_called.load(Ordering::SeqCst) }).await;
    let before = count(&db, "SELECT count(*) FROM {s}completed").await;
    assert_eq!(before, 0, "the other keys wait for the suspect's turn");
    hand_half_on_then_open(&outbox, &db, a, &open).await;

    let spent = spent(&db).await;
    let expected =
        BTreeMap::from([(("first".into(), 0), keys), (("second".into(), 0), keys), (("suspect".into(), 1), 1)]);
    assert_eq!(spent, expected, "(event type, attempts spent) of the delivered records");
}

/// After a takeover, a record whose last call finished with an error (here: ten keys' records, each
/// failed once before the owner died, a downstream outage) is retried as usual, its calls counted side
/// by side with the others: only a call that did not finish makes a suspect, called alone. Before,
/// any earlier attempt did, and the ten were called one at a time, each waiting for the one before
/// (for its handler timeout, were the downstream hanging).
async fn records_whose_last_call_failed_are_no_suspects_after_a_takeover(db: TestDb) {
    let outbox = outbox(&db, |_| {}).await;
    owner_of_all_dead_since_a_minute(&db, 100).await;
    let keys = 10;
    commit(&outbox, &db, (0..keys).map(|k| NewRecord::new(format!("k-{k}"), "retried", "")).collect()).await;
    exec!(db, "UPDATE {s}records SET attempts = 1, last_error = 'downstream unavailable'");

    let (open, gate) = tokio::sync::watch::channel(false);
    let entered = Arc::new(AtomicUsize::new(0));
    let running = entered.clone();
    let handlers = Handlers::new().default_route(Route::new(handler_fn(move |_| {
        let (mut gate, entered) = (gate.clone(), entered.clone());
        async move {
            entered.fetch_add(1, Ordering::SeqCst);
            gate.wait_for(|&open| open).await.unwrap();
            Ok::<(), HandlerError>(())
        }
    })));
    let a = Node::start(outbox.clone(), &db, handlers, fast_cluster()).await.unwrap();
    wait_for("every key's call running at once", LONG, || async { running.load(Ordering::SeqCst) == keys }).await;
    open.send_replace(true);
    drained(&db, LONG).await;
    a.shutdown().await.unwrap();
    let spent = spent(&db).await;
    assert_eq!(spent, BTreeMap::from([(("retried".into(), 1), keys)]), "(event type, attempts spent)");
}

/// How many delivered records spent how many attempts, by event type.
async fn spent(db: &TestDb) -> BTreeMap<(String, i32), usize> {
    let rows = rows!(db, (String, i32), "SELECT event_type, attempts FROM {s}completed");
    rows.into_iter().fold(BTreeMap::new(), |mut m, row| {
        *m.entry(row).or_default() += 1;
        m
    })
}

/// Starts a second instance beside `a`, waits until `a` has given up its share, opens `a`'s handlers'
/// gate and waits until everything is delivered; then stops both.
async fn hand_half_on_then_open(outbox: &Outbox, db: &TestDb, a: Node, open: &tokio::sync::watch::Sender<bool>) {
    let ok = Handlers::new().default_route(Route::new(handler_fn(|_| async { Ok::<(), HandlerError>(()) })));
    let b = Node::start(outbox.clone(), db, ok, fast_cluster()).await.unwrap();
    let assignment = a.assignment();
    wait_for("a's share given up", LONG, || async { assignment.borrow().epochs.len() == 128 }).await;
    open.send_replace(true);
    drained(db, LONG).await;
    a.shutdown().await.unwrap();
    b.shutdown().await.unwrap();
}

/// The leader's housekeeping, deleting the rows of instances dead long since, fails (here refused; on
/// MySQL, a lock held by a client whose host vanished is waited for past `query_timeout`): its rounds
/// go on all the same, so partitions are taken and shared as instances join, and the deletion is tried
/// again a stale timeout later. Before, the failure ended every round of the leader before its
/// targets were written: nothing was ever assigned.
async fn a_failing_reap_holds_no_round_up(db: TestDb) {
    let outbox = outbox(&db, |_| {}).await;
    exec!(db, "INSERT INTO {s}instances (id, name, expires_at) VALUES ($1, 'stale', {ago:3600})", InstanceId::new());
    db.refuse_deleting_stale_instances().await;
    let (sink, exclusive) = (Sink::new(), Arc::new(Exclusive::default()));
    let a = start_named(&outbox, &db, "a", &sink, &exclusive).await;
    wait_for("every partition owned", LONG, || async { owners(&db).await.values().sum::<i64>() == 256 }).await;
    let b = start_named(&outbox, &db, "b", &sink, &exclusive).await;
    wait_for("the partitions shared by both", LONG, || async {
        owners(&db).await.values().copied().collect::<Vec<_>>() == [128, 128]
    })
    .await;
    commit(&outbox, &db, (0..16).map(|k| NewRecord::new(format!("key-{k}"), "t", "")).collect()).await;
    wait_for("the records delivered", LONG, || async { sink.len() == 16 }).await;
    db.allow_deleting_instances().await;
    let stale = "SELECT count(*) FROM {s}instances WHERE name = 'stale'";
    wait_for("the dead instance's row deleted", LONG, || async { count(&db, stale).await == 0 }).await;
    for node in [a, b] {
        tokio::time::timeout(LONG, node.shutdown()).await.expect("the node stops").unwrap();
    }
}

/// An instance's host vanishes (no FIN, no RST) in the middle of an acquisition, after it locked the
/// rows of the partitions' live owner to judge its lease (MySQL: in a transaction, across round trips).
/// The database ends that transaction once it has sat idle for half a lease (or `query_timeout`, if
/// shorter), and the owner's
/// heartbeat, which waited on its own row meanwhile, renews the lease in time: the healthy instance
/// keeps its lease and delivers on. Before, on MySQL the row stayed locked until the server's TCP
/// keepalive gave up (two hours by default), every renewal waited on it, and the owner's lease ran out:
/// it delivered nothing, silently, as nobody could declare it dead.
async fn an_acquisition_whose_host_vanished_kills_no_other_instance(db: TestDb) {
    let (far, proxy) = db.through_proxy().await;
    // The default time limit (10 s), longer than the lease: the cluster's own transactions are limited
    // to half a lease, or b's, holding a's row, would outlast a's lease.
    let outbox = outbox(&db, |_| {}).await;
    let (sink, exclusive) = (Sink::new(), Arc::new(Exclusive::default()));
    // A lease of 4 s.
    let config = |name: &str| outbox_cluster::ClusterConfig {
        heartbeat_interval: Duration::from_millis(500),
        stale_timeout: Duration::from_secs(5),
        name: name.into(),
        ..fast_cluster()
    };
    // a's calls wait at a gate, so a hands over none of its partitions with records: b's acquisitions
    // keep finding a as their owner, and lock its row, until the gate opens. (Held back by nothing, a
    // could hand them all over before b's first acquisition, which then waited for no row; the test
    // then held a's row until a's lease ran out.)
    let gate = Arc::new(tokio::sync::RwLock::new(()));
    let closed = gate.clone().try_write_owned().unwrap();
    let gated = {
        let (sink, exclusive) = (sink.clone(), exclusive.clone());
        Handlers::new().default_route(Route::new(handler_fn(move |r| {
            let (sink, exclusive, gate) = (sink.clone(), exclusive.clone(), gate.clone());
            async move {
                let _inside = exclusive.enter("a", r.partition);
                let _open = gate.read().await;
                sink.record(&r);
                Ok::<(), HandlerError>(())
            }
        })))
    };
    let a = Node::start(outbox.clone(), &db, gated, config("a")).await.unwrap();
    wait_for("a owns every partition", LONG, || async { owners(&db).await.values().sum::<i64>() == 256 }).await;
    let a_id = a.id();
    commit(&outbox, &db, (0..64).map(|k| NewRecord::new(format!("key-{k}"), "t", "")).collect()).await;
    wait_for("a inside calls", LONG, || async { exclusive.calls_of("a") >= 32 }).await;
    let b = start_calls(&outbox, &far, config("b"), &sink, &exclusive, 3).await;
    wait_for("b acquiring", LONG, || async { owners(&db).await.get(&b.id()).is_some_and(|&n| n > 0) }).await;
    // b's next acquisition waits for a's row, locked here, inside the step that locks it.
    // By its primary key: MySQL's REPEATABLE READ would lock every row and gap a scan passes.
    let blocker = db.holding("SELECT name FROM {s}instances WHERE id = $1 FOR UPDATE", &[a_id.into()]).await;
    wait_for("b's acquisition waiting for a's row", LONG, || async { db.acquisitions_waiting().await >= 1 }).await;
    proxy.vanish();
    blocker.rollback().await.unwrap();
    drop(closed);
    // Past a's lease: a's renewals got through, and a delivers on.
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert_eq!(a.id(), a_id, "a was declared dead and registered again");
    assert!(a.assignment().borrow().is_live(), "a's lease ended: it delivers nothing");
    wait_for("the partitions shared by both", LONG, || async {
        owners(&db).await.values().copied().collect::<Vec<_>>() == [128, 128]
    })
    .await;
    commit(&outbox, &db, (0..64).map(|k| NewRecord::new(format!("key-{k}"), "t", "")).collect()).await;
    drained(&db, LONG).await;
    tokio::time::timeout(LONG, a.shutdown()).await.expect("a stops").unwrap();
    // b's connections may have vanished with its host: an error, but it stops.
    let _ = tokio::time::timeout(LONG, b.shutdown()).await.expect("b stops");
    db.end_other_sessions().await;
    assert_eq!(*exclusive.violations.lock().unwrap(), Vec::<String>::new());
}

/// A graceful stop while the database answers nobody (it hangs, or the network to it went) ends
/// within `shutdown_timeout`, and `query_timeout` more for the last release and deregistration: the
/// steps around the handover each waited their own time limits, rounds and renewals under way
/// theirs, and the stop outlasted a grace period set to `shutdown_timeout`, so the pod was killed in
/// the middle of it. What is left moves on when the lease runs out, as after a crash.
async fn a_stop_while_the_database_answers_nobody_ends_in_bounded_time(db: TestDb) {
    let (far, proxy) = db.through_proxy().await;
    let outbox = outbox(&far, |c| {
        c.shutdown_timeout = Duration::from_secs(1);
        c.query_timeout = Duration::from_secs(3);
    })
    .await;
    let node = Node::start(outbox.clone(), &far, Handlers::new(), fast_cluster()).await.unwrap();
    let assignment = node.assignment();
    wait_for("every partition owned", LONG, || async { assignment.borrow().epochs.len() == 256 }).await;
    proxy.blackhole();
    let stopping = Instant::now();
    let stopped = node.shutdown().await;
    let took = stopping.elapsed();
    assert!(stopped.is_err(), "nothing could be handed over: {stopped:?}");
    // 1 s, then 3 s for the last release; each step's own limit made at least 6 (the draining mark's
    // and the release's first statement's, 3 s each).
    assert!(took < Duration::from_secs(5), "the stop took {took:?} for timeouts of 1 s and 3 s");
}

/// A graceful stop whose handler call outlasts it ends within `shutdown_timeout` as a whole, as the
/// docs say. Before, the wait for the handover took the whole timeout, then the processor's own stop
/// began a second one: twice the timeout, past a grace period set to it, so the pod was killed in the
/// middle of its stop and its partitions waited out the stale timeout.
async fn a_stop_with_a_call_that_outlasts_it_ends_within_the_shutdown_timeout(db: TestDb) {
    let outbox = outbox(&db, |c| {
        c.shutdown_timeout = Duration::from_secs(2);
        c.handler_timeout = Duration::from_secs(60);
    })
    .await;
    let called = Arc::new(AtomicBool::new(false));
    let calling = called.clone();
    let slow = handler_fn(move |_| {
        calling.store(true, Ordering::SeqCst);
        async {
            tokio::time::sleep(Duration::from_secs(30)).await;
            Ok::<(), HandlerError>(())
        }
    });
    // A lease of 2 s, not fast_cluster's 400 ms, which a heartbeat held up on a loaded machine can miss:
    // a node declared dead cancels its call, and its stop then rightly finds nothing unfinished.
    let node = Node::start(outbox.clone(), &db, Handlers::new().default_route(Route::new(slow)), slow_heartbeat("a"))
        .await
        .unwrap();
    commit(&outbox, &db, vec![NewRecord::new("k", "t", "")]).await;
    wait_for("the call made", LONG, || async { called.load(Ordering::SeqCst) }).await;
    let stopping = Instant::now();
    let stopped = node.shutdown().await;
    let took = stopping.elapsed();
    assert!(stopped.is_err(), "the call was not finished: {stopped:?}");
    // 2 s, and the release and deregistration after it; two timeouts would be 4 s.
    assert!(took < Duration::from_millis(3500), "the stop took {took:?} for a shutdown_timeout of 2 s");
    assert_eq!(pending(&db).await, 1, "the record is left to be delivered again");
}
