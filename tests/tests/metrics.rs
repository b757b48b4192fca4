//! The metrics the README lists, as an operator's alerts read them: each record counted once by how
//! it ended, and a partition counted as taken over only when its owner did not hand it over.
//!
//! Each test records into a recorder of its own, set for its thread: the tests' runtimes run on one
//! thread, so every task of the nodes they start records there, and tests running at once do not mix.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[macro_use]
mod common;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::recorded::{Kept, Recorded};
use common::*;
use metrics_util::debugging::DebuggingRecorder;
use outbox_cluster::{ClusterConfig, Node};
use outbox_core::{HandlerError, Handlers, InstanceId, NewRecord, RetryPolicy, Route, Value, fallback_fn, handler_fn};

every_backend!(
    each_record_is_counted_once_by_how_it_ended,
    only_partitions_whose_owner_did_not_hand_them_over_count_as_taken_over,
    the_leader_reports_the_backlog_and_sets_it_back_to_zero_when_it_stops,
    live_instances_and_rebalances_follow_joins_and_departures,
    two_outboxes_in_one_process_report_apart,
);

// A network to cut, or a table lock: a server's.
on_backends!(
    [postgres, mysql]
    owned_partitions_fall_to_none_when_the_lease_runs_out_and_at_stop,
    the_ownership_task_waits_while_its_lease_has_run_out,
    a_leader_whose_lease_runs_out_sets_the_backlog_back_to_zero,
    a_reading_that_fails_leaves_the_time_of_the_last_one,
);

const LONG: Duration = Duration::from_secs(60);

/// Six records delivered (one of them after a retry), one handled by its fallback, one FAILED.
async fn each_record_is_counted_once_by_how_it_ended(db: TestDb) {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _local = metrics::set_default_local_recorder(&recorder);

    let outbox = outbox(&db, |c| c.retry = RetryPolicy::fixed(Duration::from_millis(20), 3)).await;
    let mut records: Vec<NewRecord> = (0..5).map(|k| NewRecord::new(format!("ok-{k}"), "ok", "")).collect();
    records.extend([
        NewRecord::new("flaky", "flaky", ""),
        NewRecord::new("rescued", "rescued", ""),
        NewRecord::new("broken", "broken", ""),
    ]);
    commit(&outbox, &db, records).await;
    assert_eq!(Recorded::take(&snapshotter).counter("outbox_records_scheduled_total", &[]), 8);

    let failed_once = Arc::new(Mutex::new(false));
    let flaky = handler_fn(move |_| {
        let first = !std::mem::replace(&mut *failed_once.lock().unwrap(), true);
        async move { if first { Err(HandlerError::retryable("fails once")) } else { Ok(()) } }
    });
    let refuse = || handler_fn(|_| async { Err(HandlerError::permanent("malformed")) });
    let handlers = Handlers::new()
        .route("ok", Route::new(handler_fn(|_| async { Ok(()) })))
        .route("flaky", Route::new(flaky))
        .route("rescued", Route::new(refuse()).fallback(fallback_fn(|_, _| async { Ok(()) })))
        .route("broken", Route::new(refuse()));
    let node = start(&outbox, &db, handlers).await;
    wait_failed(&db, 1).await;
    drained(&db, LONG).await;
    node.shutdown().await.unwrap();

    let recorded = Recorded::take(&snapshotter);
    let completed = |outcome| recorded.counter("outbox_records_completed_total", &[("outcome", outcome)]);
    assert_eq!(completed("delivered"), 6);
    assert_eq!(completed("fallback"), 1);
    assert_eq!(recorded.counter("outbox_records_retried_total", &[]), 1);
    assert_eq!(recorded.counter("outbox_records_failed_total", &[]), 1);
    assert_eq!(recorded.histogram("outbox_delivery_latency_seconds", &[]).len(), 7, "one latency per completed record");
    assert_eq!(recorded.counter("outbox_partitions_taken_over_total", &[]), 0, "no partition had an owner");
    assert_eq!(recorded.counter("outbox_records_scheduled_total", &[]), 0, "nothing scheduled since");
}

/// An instance whose lease ran out owns every partition: the first node takes all 256 over. A second
/// node then gets its share handed over, which is not a takeover, and neither is the share the second
/// takes back when the first leaves.
async fn only_partitions_whose_owner_did_not_hand_them_over_count_as_taken_over(db: TestDb) {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _local = metrics::set_default_local_recorder(&recorder);

    let outbox = outbox(&db, |_| {}).await;
    let dead = owner_of_all_dead_since_a_minute(&db, 100).await;
    let owns = "SELECT count(*) FROM {s}partitions WHERE owner = $1";
    let owned_by = |id: InstanceId| {
        let db = db.clone();
        async move { db.scalar::<i64>(owns, &[Value::from(id)]).await }
    };

    let ok = || Handlers::new().default_route(Route::new(handler_fn(|_| async { Ok(()) })));
    // Leases long enough that no stall of a loaded machine lets one node take from the other.
    let config = || ClusterConfig { stale_timeout: Duration::from_secs(10), ..fast_cluster() };
    let a = Node::start(outbox.clone(), &db, ok(), config()).await.unwrap();
    wait_for("every partition taken from the dead instance", LONG, || async { owned_by(dead).await == 0 }).await;
    let b = Node::start(outbox.clone(), &db, ok(), config()).await.unwrap();
    wait_for("the partitions shared by both", LONG, || async { owned_by(b.id()).await == 128 }).await;
    a.shutdown().await.unwrap();
    wait_for("every partition with the second node", LONG, || async { owned_by(b.id()).await == 256 }).await;
    b.shutdown().await.unwrap();

    assert_eq!(Recorded::take(&snapshotter).counter("outbox_partitions_taken_over_total", &[]), 256);
}

/// `outbox_live_instances` follows the cluster's size as instances join and leave, and
/// `outbox_rebalances_total` counts changes of the partitions' targets, not rounds: it grows when the
/// first instance starts, when a second joins and when that one leaves (by the leader, the leaving
/// instance, or both), and stays put while nobody joins or leaves (ten rounds a second here).
async fn live_instances_and_rebalances_follow_joins_and_departures(db: TestDb) {
    let kept = Kept::new();
    let _local = metrics::set_default_local_recorder(&kept);
    let outbox = outbox(&db, |_| {}).await;
    let ok = || Handlers::new().default_route(Route::new(handler_fn(|_| async { Ok(()) })));
    // Leases long enough that no stall of a loaded machine ends one and moves partitions once more.
    let config = || ClusterConfig { stale_timeout: Duration::from_secs(10), ..fast_cluster() };
    let live = || kept.gauge("outbox_live_instances");
    let rebalances = || kept.counter("outbox_rebalances_total");
    let a = Node::start(outbox.clone(), &db, ok(), config()).await.unwrap();
    wait_for("a owning every partition", LONG, || async { owners(&db).await.get(&a.id()) == Some(&256) }).await;
    wait_for("one live instance", LONG, || async { live() == Some(1.0) }).await;
    let alone = rebalances();
    assert!(alone >= 1, "a's first round set every target");
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(rebalances(), alone, "rounds that changed no target counted");
    let b = Node::start(outbox.clone(), &db, ok(), config()).await.unwrap();
    let shared = BTreeMap::from([(a.id(), 128), (b.id(), 128)]);
    wait_for("the partitions shared by both", LONG, || async { owners(&db).await == shared }).await;
    wait_for("two live instances", LONG, || async { live() == Some(2.0) }).await;
    let joined = rebalances();
    assert!(joined > alone, "b's joining counted");
    b.shutdown().await.unwrap();
    wait_for("a owning every partition again", LONG, || async { owners(&db).await.get(&a.id()) == Some(&256) }).await;
    wait_for("one live instance", LONG, || async { live() == Some(1.0) }).await;
    assert!(rebalances() > joined, "b's leaving counted");
    a.shutdown().await.unwrap();
}

/// Two outboxes in one process (two schemas, each its own cluster) report apart, each series labelled
/// with its schema: the records each delivered, the partitions each holds, and on PostgreSQL whether
/// each hears wake-ups; one stopping leaves the other's gauges as they were. Before, the series carried
/// no schema, so the last to write a gauge won: a stop set "none held" and "not listening" for both.
async fn two_outboxes_in_one_process_report_apart(db: TestDb) {
    let kept = Kept::new();
    let _local = metrics::set_default_local_recorder(&kept);
    let orders = outbox(&db, |_| {}).await;
    let billing = outbox(&db, |c| c.schema = "billing".into()).await;
    let ok = || Handlers::new().default_route(Route::new(handler_fn(|_| async { Ok(()) })));
    let a = Node::start(orders.clone(), &db, ok(), unlapsing_cluster()).await.unwrap();
    let b = Node::start(billing.clone(), &db, ok(), unlapsing_cluster()).await.unwrap();
    commit(&orders, &db, (0..3).map(|i| NewRecord::new(format!("o-{i}"), "t", "")).collect()).await;
    commit(&billing, &db, (0..2).map(|i| NewRecord::new(format!("b-{i}"), "t", "")).collect()).await;
    let completed = |schema| kept.counter_of("outbox_records_completed_total", &[("schema", schema)]);
    wait_for("each outbox's records delivered", LONG, || async {
        completed("outbox") == 3 && completed("billing") == 2
    })
    .await;
    let scheduled = |schema| kept.counter_of("outbox_records_scheduled_total", &[("schema", schema)]);
    assert_eq!((scheduled("outbox"), scheduled("billing")), (3, 2));
    let gauge = |name, schema| kept.gauge_of(name, &[("schema", schema)]);
    let both = |name| (gauge(name, "outbox"), gauge(name, "billing"));
    wait_for("each instance holding its outbox's every partition", LONG, || async {
        both("outbox_owned_partitions") == (Some(256.0), Some(256.0))
    })
    .await;
    let listens = !db.is_sqlite() && !db.is_mysql();
    if listens {
        wait_for("each processor listening", LONG, || async {
            both("outbox_wakeups_listening") == (Some(1.0), Some(1.0))
        })
        .await;
    }
    b.shutdown().await.unwrap();
    assert_eq!(both("outbox_owned_partitions"), (Some(256.0), Some(0.0)), "the stop of billing's instance");
    if listens {
        assert_eq!(both("outbox_wakeups_listening"), (Some(1.0), Some(0.0)), "the stop of billing's processor");
    }
    a.shutdown().await.unwrap();
    assert_eq!(both("outbox_owned_partitions"), (Some(0.0), Some(0.0)));
}

/// `outbox_owned_partitions` says what the instance delivers: every partition while it holds them, none
/// once its lease has run out (here the database out of reach, each failed renewal counted) and none
/// after it stopped; the instance declared dead meanwhile is counted. Before, the gauge kept the last
/// round's count, so a dashboard showed 256 partitions held by an instance that delivered nothing.
async fn owned_partitions_fall_to_none_when_the_lease_runs_out_and_at_stop(db: TestDb) {
    let (far, proxy) = db.through_proxy().await;
    let kept = Kept::new();
    let _local = metrics::set_default_local_recorder(&kept);
    let outbox = outbox(&db, |_| {}).await;
    let owned = || async { kept.gauge("outbox_owned_partitions") };
    let ok = Handlers::new().default_route(Route::new(handler_fn(|_| async { Ok(()) })));
    let node = Node::start(outbox.clone(), &far, ok, fast_cluster()).await.unwrap();
    wait_for("every partition held", LONG, || async { owned().await == Some(256.0) }).await;
    proxy.cut();
    wait_for("none held once the lease ran out", LONG, || async { owned().await == Some(0.0) }).await;
    assert!(kept.counter("outbox_heartbeat_failures_total") > 0, "renewals failed while cut off");
    // The instance stops at its own deadline, which passes no later than its lease in the database.
    let expired = "SELECT count(*) FROM {s}instances WHERE id = $1 AND expires_at < {now}";
    let id = node.id();
    wait_for("the lease over in the database", LONG, || async {
        db.scalar::<i64>(expired, &[Value::from(id)]).await == 1
    })
    .await;
    proxy.mend();
    wait_for("every partition held again", LONG, || async { owned().await == Some(256.0) }).await;
    assert_eq!(kept.counter("outbox_leases_expired_total"), 1, "declared dead once");
    node.shutdown().await.unwrap();
    assert_eq!(owned().await, Some(0.0), "none after the stop");
}

/// The ownership task waits for its next tick while the lease has run out, also once the quiet period
/// of partitions it took over has ended. Before, that period's timer, already past, fired at once on
/// every pass (only a successful round cleared it), and the task spun a core for as long as the
/// database stayed out of reach, setting `outbox_owned_partitions` on each turn.
async fn the_ownership_task_waits_while_its_lease_has_run_out(db: TestDb) {
    let (far, proxy) = db.through_proxy().await;
    let kept = Kept::new();
    let _local = metrics::set_default_local_recorder(&kept);
    let outbox = outbox(&db, |_| {}).await;
    // Partitions taken from it are quiet for twice its heartbeat: 3 s.
    let dead = owner_of_all_dead_since_a_minute(&db, 1500).await;
    let ok = Handlers::new().default_route(Route::new(handler_fn(|_| async { Ok(()) })));
    let node = Node::start(outbox.clone(), &far, ok, fast_cluster()).await.unwrap();
    let owns = "SELECT count(*) FROM {s}partitions WHERE owner = $1";
    wait_for("every partition taken over", LONG, || async { db.scalar::<i64>(owns, &[Value::from(dead)]).await == 0 })
        .await;
    // The lease (400 ms) runs out long before the quiet period ends.
    proxy.cut();
    tokio::time::sleep(Duration::from_secs(4)).await;
    let before = kept.gauge_settings();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let in_a_second = kept.gauge_settings() - before;
    proxy.mend();
    node.shutdown().await.unwrap();
    // A tick every 100 ms (the rebalance interval) sets the gauge about ten times a second.
    assert!(in_a_second < 100, "the gauge was set {in_a_second} times in a second: the ownership task spins");
}

/// The backlog gauges count what waits: a record backing off (pending, with the oldest pending age), one
/// scheduled for later, one FAILED. The leader reports them; once it stops, the next leader does (a
/// record scheduled after the first one stopped shows), and the last to stop sets them back to 0.
/// Before, only the demo's worker set them: a service embedding `Node` had no backlog to alert on.
async fn the_leader_reports_the_backlog_and_sets_it_back_to_zero_when_it_stops(db: TestDb) {
    let kept = Kept::new();
    let _local = metrics::set_default_local_recorder(&kept);
    let outbox = outbox(&db, |c| c.backlog_gauges_interval = Duration::from_millis(50)).await;
    let written = commit(
        &outbox,
        &db,
        vec![
            NewRecord::new("backing-off", "flaky", ""),
            NewRecord::new("later", "ok", "").deliver_after(Duration::from_secs(3600)),
            NewRecord::new("broken", "broken", ""),
        ],
    )
    .await;
    let (flaky, later, broken) = (written[0].partition.to_string(), written[1].partition.to_string(), written[2].id);
    let handlers = || {
        let not_yet = handler_fn(|_| async { Err(HandlerError::retryable("not yet").with_retry_after(LONG)) });
        Handlers::new()
            .route("flaky", Route::new(not_yet))
            .route("broken", Route::new(handler_fn(|_| async { Err(HandlerError::permanent("malformed")) })))
            .default_route(Route::new(handler_fn(|_| async { Ok(()) })))
    };
    let pending = |partition: &str| kept.gauge_of("outbox_pending_records", &[("partition", partition)]);
    let scheduled = |partition: &str| kept.gauge_of("outbox_scheduled_records", &[("partition", partition)]);
    let failed = || kept.gauge_of("outbox_failed_records", &[]);
    let oldest = || kept.gauge_of("outbox_oldest_pending_seconds", &[]).unwrap_or_default();
    let read_at = || kept.gauge_of("outbox_backlog_read_timestamp_seconds", &[]).unwrap_or_default();
    // Seconds since the Unix epoch, as the reading's time is recorded.
    let now_seconds = || outbox_tests::wall_micros() as f64 / 1e6;

    let started = now_seconds();
    let a = start(&outbox, &db, handlers()).await;
    wait_for("the backlog reported", LONG, || async {
        pending(&flaky) == Some(1.0) && scheduled(&later) == Some(1.0) && failed() == Some(1.0) && oldest() > 0.0
    })
    .await;
    assert!((started..=now_seconds()).contains(&read_at()), "read at {}, started at {started}", read_at());
    outbox.skip(&db, broken).await.unwrap();
    wait_for("the skipped record gone from the gauge", LONG, || async { failed() == Some(0.0) }).await;

    let b = start(&outbox, &db, handlers()).await;
    a.shutdown().await.unwrap();
    let fresh =
        commit(&outbox, &db, vec![NewRecord::new("fresh", "ok", "").deliver_after(Duration::from_secs(3600))]).await;
    let fresh = fresh[0].partition.to_string();
    let expected = if fresh == later { 2.0 } else { 1.0 };
    wait_for("the next leader reporting", LONG, || async {
        scheduled(&fresh) == Some(expected) && pending(&flaky) == Some(1.0)
    })
    .await;
    b.shutdown().await.unwrap();
    for partition in [&flaky, &later, &fresh] {
        assert_eq!(pending(partition), Some(0.0), "partition {partition} after the stop");
        assert_eq!(scheduled(partition), Some(0.0), "partition {partition} after the stop");
    }
    assert_eq!((failed(), oldest(), read_at()), (Some(0.0), 0.0, 0.0), "after the stop");
}

/// A backlog reading that fails (here, waiting for a table lock past its time limit) leaves the gauges
/// as they were, and the time of the last reading with them: an alert on its age tells gauges that no
/// longer move from a backlog that does not. Before, nothing told them apart.
async fn a_reading_that_fails_leaves_the_time_of_the_last_one(db: TestDb) {
    let kept = Kept::new();
    let _local = metrics::set_default_local_recorder(&kept);
    let outbox = outbox(&db, |c| {
        c.backlog_gauges_interval = Duration::from_millis(50);
        c.query_timeout = Duration::from_millis(300);
    })
    .await;
    let node = start(&outbox, &db, Handlers::new().default_route(Route::new(handler_fn(|_| async { Ok(()) })))).await;
    let read_at = || kept.gauge_of("outbox_backlog_read_timestamp_seconds", &[]).unwrap_or_default();
    wait_for("a reading", LONG, || async { read_at() > 0.0 }).await;
    let lock = db.lock_table("records").await;
    // A reading under way when the lock was taken may still end well; after a time limit none can.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let last = read_at();
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(read_at(), last, "no reading got through the lock");
    assert!(kept.gauge_of("outbox_owned_partitions", &[]) == Some(256.0), "the instance still leads and owns");
    lock.release().await;
    wait_for("a reading once the lock is gone", LONG, || async { read_at() > last }).await;
    node.shutdown().await.unwrap();
    assert_eq!(read_at(), 0.0, "after the stop");
}

/// A leader cut off from the database stops leading once its lease runs out, and sets the backlog
/// gauges it set back to 0: the others elect a leader of their own, and a frozen reading (every count
/// failing) would otherwise keep an alert on the maximum over the instances firing after an operator
/// resolved what it showed. Back in reach, it leads and reports again.
async fn a_leader_whose_lease_runs_out_sets_the_backlog_back_to_zero(db: TestDb) {
    let (far, proxy) = db.through_proxy().await;
    let kept = Kept::new();
    let _local = metrics::set_default_local_recorder(&kept);
    let outbox = outbox(&db, |c| c.backlog_gauges_interval = Duration::from_millis(50)).await;
    commit(&outbox, &db, vec![NewRecord::new("broken", "broken", "")]).await;
    let refuse =
        Handlers::new().default_route(Route::new(handler_fn(|_| async { Err(HandlerError::permanent("no")) })));
    let node = Node::start(outbox.clone(), &far, refuse, fast_cluster()).await.unwrap();
    let failed = || async { kept.gauge_of("outbox_failed_records", &[]) };
    wait_for("the FAILED record reported", LONG, || async { failed().await == Some(1.0) }).await;
    proxy.cut();
    wait_for("the gauge back to 0 once the lease ran out", LONG, || async { failed().await == Some(0.0) }).await;
    proxy.mend();
    wait_for("reported again", LONG, || async { failed().await == Some(1.0) }).await;
    node.shutdown().await.unwrap();
}

/// A handler call that blocks its thread (a synchronous sleep inside an async handler) can be neither
/// timed out nor cancelled, and its key waited without a word. It is reported once it has run past
/// twice `handler_timeout` and a second, and `outbox_handler_calls_overdue` counts it while it runs.
/// On a runtime of two threads, as a blocked thread leaves the other to the processor; its tasks record
/// into a recorder set for the whole process (this file's other tests record into their own threads').
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_call_that_blocks_its_thread_is_reported_overdue() {
    let kept: &'static Kept = Box::leak(Box::new(Kept::new()));
    assert!(metrics::set_global_recorder(kept).is_ok(), "no other test sets the global recorder");
    let db = TestDb::sqlite().await;
    let outbox = outbox(&db, |c| c.handler_timeout = Duration::from_millis(200)).await;
    commit(&outbox, &db, vec![NewRecord::new("stuck", "t", "")]).await;
    let blocking = handler_fn(|_| async {
        std::thread::sleep(Duration::from_secs(3));
        Ok::<(), HandlerError>(())
    });
    let node = start(&outbox, &db, Handlers::new().default_route(Route::new(blocking))).await;
    let overdue = || kept.gauge("outbox_handler_calls_overdue");
    wait_for("the call reported overdue", LONG, || async { overdue() == Some(1.0) }).await;
    drained(&db, LONG).await;
    wait_for("no call overdue once it returned", LONG, || async { overdue() == Some(0.0) }).await;
    node.shutdown().await.unwrap();
}
