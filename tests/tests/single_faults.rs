//! Single faults a delivery can meet, each of which once stopped a key or a partition without anything
//! turning FAILED: a record removed under its completion, a handler that panics before its first
//! await, an error text the database cannot store, a hot key set that sorts low, a shutdown whose first
//! step fails, a fault in the processor's own code. Each ends in an outcome an operator can see, and the
//! other keys go on.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[macro_use]
mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use common::*;
use outbox_cluster::Node;
use outbox_core::{
    Error, HandlerError, Handlers, InstanceId, NewRecord, Record, RetryPolicy, Route, handler_fn, partition_of,
};

every_backend!(
    a_record_removed_before_its_completion_does_not_stop_its_partition,
    a_handler_that_panics_before_its_first_await_is_retried_then_failed,
    an_error_text_with_nul_is_stored_and_the_rest_of_the_batch_is_completed,
    a_hot_key_set_that_sorts_low_cannot_starve_a_key_that_sorts_high,
    shutdown_stops_every_task_even_when_marking_the_instance_draining_fails,
    a_stop_that_cannot_point_the_targets_elsewhere_still_releases_and_deregisters,
    a_processor_ended_by_a_fault_takes_its_node_out_of_the_cluster,
    a_heartbeat_ended_by_a_fault_takes_its_node_out_of_the_cluster,
    a_header_value_stored_as_a_number_is_delivered_as_its_text,
);

// A network to cut or slow, row locks, or statements that sleep: a server's.
on_backends!(
    [postgres, mysql]
    connections_that_stop_answering_are_given_up_and_delivery_goes_on,
    a_batch_of_failures_far_from_the_database_is_written_within_its_time_limit,
    a_heartbeat_connection_that_stops_answering_costs_no_lease,
    a_heartbeat_connection_that_stops_answering_costs_no_lease_at_the_shortest_stale_timeout,
    a_heartbeat_connection_reset_costs_no_lease_at_the_shortest_stale_timeout,
    a_node_stopped_while_its_renewals_fail_renews_nothing_after,
    a_completion_whose_host_vanished_gives_its_partition_up,
    a_completion_given_up_on_a_lock_ends_on_the_server_too,
    a_start_whose_registration_answer_is_lost_leaves_no_instance_behind,
    a_fetch_too_large_for_its_time_limit_is_tried_again_smaller,
    a_completion_too_large_for_its_time_limit_is_tried_again_smaller,
);

// PostgreSQL's maintenance takes locks plain reads wait for.
on_backends!(
    [postgres]
    statements_given_up_on_a_table_lock_end_on_the_server_too,
);

// A table lock: a server's.
on_backends!(
    [postgres, mysql]
    renewals_and_rounds_given_up_on_a_table_lock_end_on_the_server_too,
    renewals_and_rounds_given_up_on_a_locked_instance_row_end_on_the_server_too,
);

// MySQL session settings.
on_backends!(
    [mysql]
    workers_refuse_a_pool_whose_sessions_do_not_suit_them,
);

const LONG: Duration = Duration::from_secs(60);

/// A worker whose host vanishes in the middle of a completion (no FIN, no RST: the database is never
/// told) holds its partition's row locked in share mode only until the transaction has sat idle for
/// `query_timeout`, when the database ends the session (PostgreSQL's
/// `idle_in_transaction_session_timeout`, MySQL's `wait_timeout`, each set for the transaction).
/// Before, the row stayed locked until the server's TCP keepalive gave up (two hours by default), and
/// every acquisition passed the partition over.
async fn a_completion_whose_host_vanished_gives_its_partition_up(db: TestDb) {
    let (far, proxy) = db.through_proxy().await;
    let (blocker, node, _) = a_completion_waiting_for_a_locked_record(&db, &far).await;
    proxy.vanish();
    // The completion's statement now ends on the server; its answer and the COMMIT never pass.
    blocker.rollback().await.unwrap();
    let partition = i16::from(partition_of("k"));
    wait_for("the partition's row free again", LONG, || async {
        rows!(db, (i64,), "SELECT epoch FROM {s}partitions WHERE partition = $1 FOR UPDATE SKIP LOCKED", partition)
            .len()
            == 1
    })
    .await;
    // Its first step may meet a connection that vanished (an error), but it stops.
    let _ = tokio::time::timeout(LONG, node.shutdown()).await.expect("the node stops");
    // The sessions whose clients went away unannounced stay until told to go.
    db.end_other_sessions().await;
    // The record whose completion's answer never came back is not lost: it was completed (the
    // database ran the COMMIT it was sent), or the next owner delivers and completes it.
    let other = start(&outbox(&db, |_| {}).await, &db, Handlers::new()).await;
    drained(&db, LONG).await;
    assert_eq!(count(&db, "SELECT count(*) FROM {s}completed WHERE key = 'k'").await, 1);
    other.shutdown().await.unwrap();
}

/// A record locked by a transaction outside the outbox (an operator's console left open) holds its
/// completion up: each try is given up after `query_timeout`, and the database ends its lock wait then
/// too. Before, every try given up went on waiting on the server (on MySQL for
/// `innodb_lock_wait_timeout`, 50 s; on PostgreSQL for ever), with its partitions' rows locked and a
/// server connection taken: one more with each retry.
async fn a_completion_given_up_on_a_lock_ends_on_the_server_too(db: TestDb) {
    let (blocker, node, sink) = a_completion_waiting_for_a_locked_record(&db, &db).await;
    // Six time limits: a try and its retry may overlap for a moment, no more.
    tokio::time::sleep(Duration::from_secs(6)).await;
    let waiting = db.lock_waiters().await;
    assert!(waiting <= 2, "{waiting} statements wait for the record's lock");
    blocker.rollback().await.unwrap();
    drained(&db, LONG).await;
    tokio::time::timeout(LONG, node.shutdown()).await.expect("the node stops").unwrap();
    assert_eq!(sink.len(), 1, "the record was delivered again");
}

/// A table lock taken by maintenance (`REINDEX`, `VACUUM FULL`, `CLUSTER`, a hand-written `LOCK`)
/// holds every fetch and purge up: each is given up after `query_timeout`, and the database ends its
/// wait then too. Before, each one given up went on waiting on the server, one more with every poll
/// and purge pass, until the lock went or the server ran out of connections for the whole application.
async fn statements_given_up_on_a_table_lock_end_on_the_server_too(db: TestDb) {
    let outbox = outbox(&db, |c| c.query_timeout = Duration::from_millis(300)).await;
    let mut maintenance = db.begin().await;
    let lock = db.sql("LOCK TABLE {s}records IN ACCESS EXCLUSIVE MODE");
    maintenance.execute(sqlx::AssertSqlSafe(lock), &[]).await.unwrap();
    let sink = Sink::new();
    let node = start(&outbox, &db, recording(&sink)).await;
    wait_for("a fetch waiting for the table", LONG, || async { db.lock_waiters().await >= 1 }).await;
    // Ten time limits: a statement and its next try may overlap for a moment, no more.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let waiting = db.lock_waiters().await;
    let what = rows!(
        db,
        (String,),
        "SELECT left(query, 60) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
    );
    assert!(waiting <= 2, "{waiting} fetches wait for the table: {what:?}");
    maintenance.rollback().await.unwrap();
    commit(&outbox, &db, vec![NewRecord::new("k", "t", "")]).await;
    wait_for("the record delivered", LONG, || async { sink.len() == 1 }).await;
    tokio::time::timeout(LONG, node.shutdown()).await.expect("the node stops").unwrap();
}

/// A lock held long on the instances table (an operator's `LOCK TABLE`, DDL queued behind a long
/// reader) holds up every lease renewal and ownership round: each is given up at its time limit, and
/// the database ends its wait then too. Before, each one given up went on waiting on the server with a
/// connection of its own: two renewals a lease and a round per `query_timeout` more, without end.
async fn renewals_and_rounds_given_up_on_a_table_lock_end_on_the_server_too(db: TestDb) {
    // A renewal and its spare, a round, a fetch, each overlapping its next try for a moment (on MySQL,
    // whose limits are whole seconds, for longer: 4-8 seen). Without the limits: 17 in 3 s and growing.
    renewals_and_rounds_given_up_behind(db, Blocker::Table).await;
}

/// The same behind a lock on the node's own instance row (an operator's transaction left open after
/// an edit of it): a row lock, whose waits MySQL does not end when their client goes, as it ends those
/// for a table's metadata lock. Before, each renewal and single-statement step there waited on the
/// server for `innodb_lock_wait_timeout` (50 s by default): 2 more a lease, and once the lock went
/// each renewal that had waited applied, renewing a lease its node had given up.
async fn renewals_and_rounds_given_up_on_a_locked_instance_row_end_on_the_server_too(db: TestDb) {
    // 1 seen on PostgreSQL, 6 on MySQL; without the limits on MySQL, 18 in 3 s and growing.
    renewals_and_rounds_given_up_behind(db, Blocker::OwnRow).await;
}

/// What holds up a node's renewals and rounds.
enum Blocker {
    /// A lock on the instances table.
    Table,
    /// A transaction holding the node's own instance row.
    OwnRow,
}

/// A node (`query_timeout` 300 ms) behind `blocker` for 3 s: at most 10 of its statements wait for the
/// lock at the end, and once it goes the node holds every partition again.
async fn renewals_and_rounds_given_up_behind(db: TestDb, blocker: Blocker) {
    let outbox = outbox(&db, |c| c.query_timeout = Duration::from_millis(300)).await;
    let node = start(&outbox, &db, Handlers::new()).await;
    wait_for("every partition held", LONG, || async { node.assignment().borrow().epochs.len() == 256 }).await;
    let waiters = async || match blocker {
        Blocker::Table => db.table_lock_waiters().await,
        Blocker::OwnRow => db.lock_waiters().await,
    };
    enum Held {
        Table(TableLock),
        Row(outbox_core::Tx),
    }
    let held = match blocker {
        Blocker::Table => Held::Table(db.lock_table("instances").await),
        Blocker::OwnRow => {
            Held::Row(db.holding("SELECT 1 FROM {s}instances WHERE id = $1 FOR UPDATE", &[node.id().into()]).await)
        }
    };
    wait_for("a renewal waiting for the lock", LONG, || async { waiters().await >= 1 }).await;
    // Eight leases (400 ms) and ten time limits.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let waiting = waiters().await;
    assert!(waiting <= 10, "{waiting} statements wait for the lock");
    match held {
        Held::Table(lock) => lock.release().await,
        Held::Row(tx) => tx.rollback().await.unwrap(),
    }
    wait_for("every partition held again", LONG, || async { node.assignment().borrow().epochs.len() == 256 }).await;
    tokio::time::timeout(LONG, node.shutdown()).await.expect("the node stops").unwrap();
}

/// A node on `through` (`query_timeout` 1 s) that delivered record `k` and whose completion waits for
/// the record's row, locked by the transaction returned; with what its handler recorded.
async fn a_completion_waiting_for_a_locked_record(db: &TestDb, through: &TestDb) -> (outbox_core::Tx, Node, Arc<Sink>) {
    let outbox = outbox(db, |c| c.query_timeout = Duration::from_secs(1)).await;
    commit(&outbox, db, vec![NewRecord::new("k", "t", "")]).await;
    // The completion waits for this lock inside its transaction, past its fence.
    let blocker = db.holding("SELECT 1 FROM {s}records WHERE key = 'k' FOR UPDATE", &[]).await;
    let sink = Sink::new();
    let node = start(&outbox, through, recording(&sink)).await;
    wait_for("the record delivered", LONG, || async { sink.len() == 1 }).await;
    wait_for("the completion waiting for the record", LONG, || async { db.lock_waiters().await >= 1 }).await;
    (blocker, node, sink)
}

/// A completion that finds its record already gone (here the handler deleted it; in production an
/// earlier attempt of the same completion committed before its connection dropped) is settled, not
/// "fenced": the partition goes on being processed.
async fn a_record_removed_before_its_completion_does_not_stop_its_partition(db: TestDb) {
    let outbox = outbox(&db, |_| {}).await;
    let sink = Sink::new();
    let (s, d) = (sink.clone(), db.clone());
    let handlers = Handlers::new().default_route(Route::new(handler_fn(move |r: Record| {
        let (s, d) = (s.clone(), d.clone());
        async move {
            if r.payload == "delete me" {
                exec!(d, "DELETE FROM {s}records WHERE id = $1", r.id);
            }
            s.record(&r);
            Ok(())
        }
    })));
    let node = start(&outbox, &db, handlers).await;
    commit(&outbox, &db, vec![NewRecord::new("k", "t", "delete me")]).await;
    wait_for("the first record delivered and completed", LONG, || async { sink.len() == 1 }).await;
    drained(&db, LONG).await;
    // Work committed afterwards in the same partition: the key itself and a neighbour.
    let neighbour = keys_in(partition_of("k"), "neighbour", 1).remove(0);
    commit(&outbox, &db, vec![NewRecord::new("k", "t", "2"), NewRecord::new(&neighbour, "t", "1")]).await;
    wait_for("later records of the partition delivered", LONG, || async { sink.len() == 3 }).await;
    drained(&db, LONG).await;
    node.shutdown().await.unwrap();
    assert_eq!(sink.ranks_of("k"), [1, 2]);
}

/// A `handler_fn` closure that panics before building its future (so before any await) is a retryable
/// failure carrying the panic message, then FAILED when retries run out; nothing stays in flight, so a
/// graceful stop finishes.
async fn a_handler_that_panics_before_its_first_await_is_retried_then_failed(db: TestDb) {
    let outbox = outbox(&db, |c| c.shutdown_timeout = Duration::from_secs(20)).await;
    let calls = Arc::new(AtomicUsize::new(0));
    let c = calls.clone();
    let handler = handler_fn(move |r: Record| {
        c.fetch_add(1, Ordering::SeqCst);
        assert!(r.key != "poison", "cannot handle {}", r.key);
        async { Ok::<(), HandlerError>(()) }
    });
    let route = Route::new(handler).retry(RetryPolicy::fixed(Duration::from_millis(10), 2)).unwrap();
    commit(&outbox, &db, vec![NewRecord::new("poison", "t", ""), NewRecord::new("fine", "t", "")]).await;
    let node = start(&outbox, &db, Handlers::new().default_route(route)).await;
    wait_failed(&db, 1).await;
    drained(&db, LONG).await;
    node.shutdown().await.expect("nothing left in flight: the graceful stop completes");
    assert_eq!(calls.load(Ordering::SeqCst), 4, "three calls for the poisoned record, one for the other");
    let failed = outbox.failed(&db, &Default::default()).await.unwrap();
    assert_eq!(failed.len(), 1);
    let error = failed[0].last_error.clone().unwrap();
    assert!(error.contains("handler panicked") && error.contains("cannot handle poison"), "{error}");
    assert_eq!(failed[0].attempts, 3);
}

/// A handler error holding a NUL byte (which PostgreSQL's text refuses) is stored with the NUL replaced;
/// the failing key's attempts grow to FAILED, and the other keys of its batches are completed once.
async fn an_error_text_with_nul_is_stored_and_the_rest_of_the_batch_is_completed(db: TestDb) {
    let outbox = outbox(&db, |_| {}).await;
    let sink = Sink::new();
    let s = sink.clone();
    let handler = handler_fn(move |r: Record| {
        let s = s.clone();
        async move {
            s.record(&r);
            if r.key == "nul" { Err(HandlerError::retryable("a\0b")) } else { Ok(()) }
        }
    });
    let route = Route::new(handler).retry(RetryPolicy::fixed(Duration::from_millis(20), 3)).unwrap();
    let mut records = vec![NewRecord::new("nul", "t", "")];
    records.extend((0..20).map(|i| NewRecord::new(format!("ok-{i}"), "t", "")));
    commit(&outbox, &db, records).await;
    let node = start(&outbox, &db, Handlers::new().default_route(route)).await;
    wait_failed(&db, 1).await;
    drained(&db, LONG).await;
    node.shutdown().await.unwrap();
    let failed = outbox.failed(&db, &Default::default()).await.unwrap();
    assert_eq!(failed[0].last_error.as_deref(), Some("retryable: a\u{FFFD}b"));
    assert_eq!(failed[0].attempts, 4);
    assert_eq!(sink.of_key("nul").len(), 4);
    for i in 0..20 {
        assert_eq!(sink.of_key(&format!("ok-{i}")).len(), 1, "ok-{i} delivered once");
    }
}

/// Keys that sort low and keep a backlog cannot starve a key that sorts high in the same partition:
/// each fetch of a partition starts after the key where the previous one stopped.
async fn a_hot_key_set_that_sorts_low_cannot_starve_a_key_that_sorts_high(db: TestDb) {
    let outbox = outbox(&db, |c| {
        c.batch_size = 2;
        c.concurrency = 2;
        c.key_lookahead = 1;
    })
    .await;
    let hot = keys_in(partition_of("z-high"), "a-hot", 3);
    let mut records: Vec<NewRecord> = (0..40).flat_map(|_| hot.iter().map(|k| NewRecord::new(k, "t", ""))).collect();
    records.push(NewRecord::new("z-high", "t", ""));
    commit(&outbox, &db, records).await;
    let sink = Sink::new();
    let handlers = recording(&sink);
    let node = start(&outbox, &db, handlers).await;
    wait_for("the high key delivered", LONG, || async { !sink.of_key("z-high").is_empty() }).await;
    let hot_first = sink.all().iter().take_while(|d| d.key != "z-high").count();
    drained(&db, LONG).await;
    node.shutdown().await.unwrap();
    assert!(hot_first < 20, "{hot_first} of the 120 hot records went before the high key");
}

/// `shutdown` stops the processor and the background tasks even when its first step (marking the
/// instance draining) fails, and says so.
async fn shutdown_stops_every_task_even_when_marking_the_instance_draining_fails(db: TestDb) {
    let outbox = outbox(&db, |_| {}).await;
    db.refuse_draining().await;
    let sink = Sink::new();
    let handlers = recording(&sink);
    let node = start(&outbox, &db, handlers).await;
    let id = node.id();
    wait_for("partitions acquired", LONG, || async {
        count(&db, "SELECT count(*) FROM {s}partitions WHERE owner IS NOT NULL").await == 256
    })
    .await;
    let err = node.shutdown().await.unwrap_err();
    assert!(err.to_string().contains("draining refused"), "{err}");
    // The rest of the shutdown ran: partitions released, instance deregistered.
    assert_eq!(count(&db, "SELECT count(*) FROM {s}partitions WHERE owner IS NOT NULL").await, 0);
    assert_eq!(count(&db, "SELECT count(*) FROM {s}instances").await, 0, "{id} deregistered");
    // And the processor is stopped: a record committed now stays pending.
    commit(&outbox, &db, vec![NewRecord::new("after", "t", "")]).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(sink.len(), 0);
    assert_eq!(pending(&db).await, 1);
}

/// A stop whose targets cannot be written (refused, or a lock waited for past the time limit) still
/// releases its partitions and deregisters: the targets only speed the next owners up. Before, the
/// last release gave up at the targets, and the partitions waited for the lease to run out.
async fn a_stop_that_cannot_point_the_targets_elsewhere_still_releases_and_deregisters(db: TestDb) {
    let outbox = outbox(&db, |c| c.shutdown_timeout = Duration::from_secs(1)).await;
    let node = start(&outbox, &db, Handlers::new()).await;
    let id = node.id();
    wait_for("partitions acquired", LONG, || async {
        count(&db, "SELECT count(*) FROM {s}partitions WHERE owner IS NOT NULL").await == 256
    })
    .await;
    db.refuse_targets().await;
    // Another live instance (that runs nothing), so that leaving means targets to write.
    let other = register_instance(&db).await;
    let stopped = node.shutdown().await;
    assert!(stopped.is_ok(), "{stopped:?}");
    assert_eq!(count(&db, "SELECT count(*) FROM {s}partitions WHERE owner IS NOT NULL").await, 0);
    let left = rows!(db, (InstanceId,), "SELECT id FROM {s}instances");
    assert_eq!(left, [(other,)], "{id} deregistered");
}

/// Workers started on a MySQL pool whose sessions do not suit them are refused, naming the setting:
/// `autocommit` off (a server-wide `autocommit = 0`, or an application's connect hook), where each of
/// their single statements (a fetch, a heartbeat) opened a transaction that stayed open on its pooled
/// connection, fetches read an old snapshot and heartbeats were never committed, and records waited
/// without a word; or READ UNCOMMITTED, where a fetch read records of transactions not yet committed,
/// and delivered events of one that then rolled back. The application still schedules through such a
/// pool, in transactions it commits, and workers on a pool of their own deliver.
async fn workers_refuse_a_pool_whose_sessions_do_not_suit_them(db: TestDb) {
    let settings = [
        ("SET autocommit = 0", "autocommit"),
        ("SET SESSION TRANSACTION ISOLATION LEVEL READ UNCOMMITTED", "READ UNCOMMITTED"),
    ];
    for (setting, named) in settings {
        let off = db.with_session_set(setting).await;
        let outbox = outbox(&db, |_| {}).await;
        let refused = |e: &Error| matches!(e, Error::UnsuitableSession(reason) if reason.contains(named));
        let sink = Sink::new();
        match Node::start(outbox.clone(), &off, recording(&sink), fast_cluster()).await {
            Err(outbox_cluster::Error::Core(e)) => assert!(refused(&e), "{setting}: {e}"),
            Err(e) => panic!("{setting}: {e}"),
            Ok(node) => panic!("{setting}: a node started on it: {}", node.id()),
        }
        assert_eq!(count(&db, "SELECT count(*) FROM {s}instances").await, 0, "{setting}: no instance left behind");
        let assignment = tokio::sync::watch::channel(outbox_core::Assignment::new(InstanceId::new(), [].into())).1;
        let processor = outbox_core::Processor::new(outbox.clone(), off.db.clone(), recording(&sink), assignment);
        let run = tokio::time::timeout(LONG, processor.run(tokio_util::sync::CancellationToken::new())).await;
        let run = run.expect("the processor ran on");
        assert!(run.as_ref().is_err_and(refused), "{setting}: {run:?}");

        // Nothing the refused starts did holds the next one up (a take-back of the registration,
        // uncommitted on a session with autocommit off, held a lock that every registration waited for).
        let workers = off.db.new_pool(&outbox_core::ConnectOptions::default()).await.unwrap();
        let node = Node::start(outbox.clone(), workers, recording(&sink), fast_cluster()).await.unwrap();
        let key = format!("k-{named}");
        commit(&outbox, &off, vec![NewRecord::new(key.clone(), "t", "")]).await;
        drained(&db, LONG).await;
        node.shutdown().await.unwrap();
        assert_eq!(sink.of_key(&key).len(), 1, "{setting}");
    }
}

/// A route's retry policy is checked when the route is built: a jitter above 1 (which made the delay
/// computation panic inside a delivery) is refused, naming the field.
#[test]
fn a_route_with_an_invalid_retry_policy_is_refused_when_built() {
    let handler = handler_fn(|_| async { Ok::<(), HandlerError>(()) });
    let bad = RetryPolicy::fixed(Duration::from_millis(10), 1).with_jitter(1.5);
    match Route::new(handler).retry(bad) {
        Err(Error::Config(message)) => assert!(message.contains("jitter"), "{message}"),
        Err(other) => panic!("expected a configuration error, got {other}"),
        Ok(_) => panic!("an invalid policy was accepted"),
    }
}

/// Every connection to the database stops answering at once, its socket left open (the database's host
/// gone, a failover that left its clients half-open connections), while handler calls run: no statement
/// on those connections ever ends, not even with an error. Each round trip (the calls' completion, the
/// next fetch, the ownership round) gives up after `query_timeout` and closes its connection; the node
/// connects again, completes the calls, delivers what was committed meanwhile, in order, and still
/// stops. Before, the fetch waited forever while the heartbeat, on a new connection, kept the lease:
/// the instance held every partition and delivered nothing, silently.
async fn connections_that_stop_answering_are_given_up_and_delivery_goes_on(db: TestDb) {
    let (through, proxy) = db.through_proxy().await;
    let outbox = outbox(&db, |c| c.query_timeout = Duration::from_secs(1)).await;
    let sink = Sink::new();
    let (handlers, gate) = gated(&sink);
    let node = start(&outbox, &through, handlers).await;
    let keys = |round| (0..8).map(|k| NewRecord::new(format!("key-{k}"), "t", format!("{round}"))).collect();
    commit(&outbox, &db, keys(1)).await;
    let entered = tokio::time::timeout(LONG, gate.entered.acquire_many(8)).await;
    entered.expect("the first round's calls started").unwrap().forget();
    proxy.stall();
    gate.release.add_permits(1_000);
    for round in 2..=4 {
        commit(&outbox, &db, keys(round)).await;
    }
    wait_for("the rounds committed after the stall delivered", LONG, || async {
        (0..8).all(|k| sink.ranks_of(&format!("key-{k}")).contains(&4))
    })
    .await;
    drained(&db, LONG).await;
    tokio::time::timeout(LONG, node.shutdown()).await.expect("the node stops").unwrap();
    assert_first_deliveries_in_order(&sink, 8, 4);
}

/// An outage fails every key at once: the batch of failures that follows is written within
/// `query_timeout` also 20 ms a round trip from the database (one statement for the batch, not one a
/// record), so every record's attempt is counted and its retry scheduled.
async fn a_batch_of_failures_far_from_the_database_is_written_within_its_time_limit(db: TestDb) {
    let (far, _proxy) = db.far_away(Duration::from_millis(10)).await;
    let outbox = outbox(&db, |c| {
        c.query_timeout = Duration::from_secs(2);
        c.retry = RetryPolicy::fixed(Duration::from_secs(3600), 5);
    })
    .await;
    let outage = Handlers::new().default_route(Route::new(handler_fn(|_r: Record| async {
        Err::<(), _>(HandlerError::retryable("the broker is down"))
    })));
    let records: Vec<NewRecord> = (0..400).map(|k| NewRecord::new(format!("key-{k}"), "t", "")).collect();
    commit(&outbox, &db, records).await;
    let node = start(&outbox, &far, outage).await;
    let counted = "SELECT count(*) FROM {s}records WHERE attempts = 1";
    wait_for("every failure written", LONG, || async { count(&db, counted).await == 400 }).await;
    node.shutdown().await.unwrap();
}

/// The heartbeat's own connection stops answering, its socket left open (a failover that left clients
/// half-open connections, a NAT entry dropped): the renewal goes out again on a new connection one
/// heartbeat interval later, well within the lease, so the instance is not declared dead. It keeps its
/// id and its partitions, and its handler calls are not cancelled. Before, the renewal on the dead
/// connection was waited for until the lease had ended, every time.
async fn a_heartbeat_connection_that_stops_answering_costs_no_lease(db: TestDb) {
    // A lease of 2 s, renewed every 500 ms.
    heartbeat_connection_stops_answering(db, Duration::ZERO, Duration::from_millis(500), Duration::from_secs(3)).await;
}

/// The same at the shortest stale timeout allowed, four heartbeat intervals: the lease (two intervals)
/// then ends one interval after a renewal is sent, when the renewal on a new connection went out, so
/// it came too late every time. It goes out after half the time the lease has left.
async fn a_heartbeat_connection_that_stops_answering_costs_no_lease_at_the_shortest_stale_timeout(db: TestDb) {
    // A lease of 4 s, renewed every 2 s, 100 ms a round trip (a new connection takes several): the
    // second renewal goes out after 1 s, 1 s before the end. It went out at the end, and came late.
    let (delay, interval) = (Duration::from_millis(50), Duration::from_secs(2));
    heartbeat_connection_stops_answering(db, delay, interval, 4 * interval).await;
}

async fn heartbeat_connection_stops_answering(
    db: TestDb,
    delay: Duration,
    heartbeat_interval: Duration,
    stale_timeout: Duration,
) {
    let (through, proxy) = db.far_away(delay).await;
    // A MySQL completion far away takes a dozen round trips, a new connection first.
    let outbox = outbox(&db, |c| c.query_timeout = Duration::from_secs(1) + 40 * delay).await;
    let sink = Sink::new();
    let config = outbox_cluster::ClusterConfig { heartbeat_interval, stale_timeout, ..fast_cluster() };
    let node = Node::start(outbox.clone(), &through, recording(&sink), config).await.unwrap();
    let owned = "SELECT count(*) FROM {s}partitions WHERE owner IS NOT NULL";
    wait_for("every partition owned", LONG, || async { count(&db, owned).await == 256 }).await;
    let registered = rows!(db, (outbox_core::InstanceId,), "SELECT id FROM {s}instances");
    assert_eq!(registered.len(), 1, "one instance registered");
    proxy.stall();
    // Three leases: before, the renewal on the dead connection cost the lease.
    tokio::time::sleep(3 * (stale_timeout - 2 * heartbeat_interval)).await;
    commit(&outbox, &db, vec![NewRecord::new("k", "t", "")]).await;
    wait_for("a record committed after the stall delivered", LONG, || async { sink.len() == 1 }).await;
    let now = rows!(db, (outbox_core::InstanceId,), "SELECT id FROM {s}instances");
    assert_eq!(now, registered, "the instance was declared dead and registered again");
    let kept = rows!(db, (i64,), "SELECT count(*) FROM {s}partitions WHERE owner = $1", registered[0].0);
    assert_eq!(kept, vec![(256,)], "the instance lost partitions");
    tokio::time::timeout(LONG, node.shutdown()).await.expect("the node stops").unwrap();
    assert_eq!(sink.len(), 1, "the record was delivered again");
}

/// Every connection reset at once (a pooler or proxy restarted, a failover), at the shortest stale
/// timeout: the renewal on the heartbeat's connection fails at once and goes out again on a new one,
/// within the lease. Before, the next try waited for the next heartbeat, when the lease (two intervals
/// from the last renewal) had ended: the instance was declared dead, its calls cancelled, and its
/// partitions left idle for a quiet period.
async fn a_heartbeat_connection_reset_costs_no_lease_at_the_shortest_stale_timeout(db: TestDb) {
    let (through, proxy) = db.through_proxy().await;
    let outbox = outbox(&db, |c| c.query_timeout = Duration::from_secs(1)).await;
    let sink = Sink::new();
    let heartbeat_interval = Duration::from_millis(500);
    let config =
        outbox_cluster::ClusterConfig { heartbeat_interval, stale_timeout: 4 * heartbeat_interval, ..fast_cluster() };
    let node = Node::start(outbox.clone(), &through, recording(&sink), config).await.unwrap();
    let owned = "SELECT count(*) FROM {s}partitions WHERE owner IS NOT NULL";
    wait_for("every partition owned", LONG, || async { count(&db, owned).await == 256 }).await;
    let registered = rows!(db, (outbox_core::InstanceId,), "SELECT id FROM {s}instances");
    for _ in 0..3 {
        proxy.cut();
        proxy.mend();
        tokio::time::sleep(4 * heartbeat_interval).await;
    }
    commit(&outbox, &db, vec![NewRecord::new("k", "t", "")]).await;
    wait_for("a record committed after the resets delivered", LONG, || async { sink.len() == 1 }).await;
    let now = rows!(db, (outbox_core::InstanceId,), "SELECT id FROM {s}instances");
    assert_eq!(now, registered, "the instance was declared dead and registered again");
    tokio::time::timeout(LONG, node.shutdown()).await.expect("the node stops").unwrap();
}

/// A node stopped (here killed) while its renewals fail, every connection refused, renews nothing once
/// the connections come back. Its heartbeat went on trying for the rest of the lease and renewed it:
/// a crashed node counted live; after a graceful stop, a new registration that nothing ran.
async fn a_node_stopped_while_its_renewals_fail_renews_nothing_after(db: TestDb) {
    let (through, proxy) = db.through_proxy().await;
    let outbox = outbox(&db, |c| c.query_timeout = Duration::from_secs(1)).await;
    let heartbeat_interval = Duration::from_millis(500);
    // A lease of 7 s: the renewals that fail are tried again throughout the test.
    let config =
        outbox_cluster::ClusterConfig { heartbeat_interval, stale_timeout: Duration::from_secs(8), ..fast_cluster() };
    let node = Node::start(outbox.clone(), &through, Handlers::new(), config).await.unwrap();
    let id = node.id();
    let owned = "SELECT count(*) FROM {s}partitions WHERE owner IS NOT NULL";
    wait_for("every partition owned", LONG, || async { count(&db, owned).await == 256 }).await;
    proxy.cut();
    tokio::time::sleep(3 * heartbeat_interval).await;
    let last_heartbeat = || async {
        let status = outbox_cluster::status(&db, &outbox).await.unwrap();
        status.instances.iter().map(|i| (i.id, i.heartbeat_at)).collect::<Vec<_>>()
    };
    let before = last_heartbeat().await;
    node.kill();
    proxy.mend();
    tokio::time::sleep(6 * heartbeat_interval).await;
    assert_eq!(last_heartbeat().await, before, "instance {id} renewed or registered after it was stopped");
}

/// A `Node::start` whose registration was written but whose answer never came (the link went down in
/// between) fails, and takes its row back: before, it left a live instance that nothing ran, which the
/// leader handed partitions to, so they waited a lease for it.
async fn a_start_whose_registration_answer_is_lost_leaves_no_instance_behind(db: TestDb) {
    let delay = Duration::from_millis(150);
    // Room for a new connection far away, a dozen round trips on MySQL.
    let outbox = outbox(&db, |c| c.query_timeout = Duration::from_secs(8)).await;
    let config = outbox_cluster::ClusterConfig {
        heartbeat_interval: Duration::from_secs(1),
        stale_timeout: Duration::from_secs(30),
        ..fast_cluster()
    };
    let registered = "SELECT count(*) FROM {s}instances";
    // The answer is lost only if the link goes down while it is on its way, `delay` after the row is
    // written; a start that got its answer first is stopped and tried again.
    for _ in 0..5 {
        let (through, proxy) = db.far_away(delay).await;
        let watch = async {
            wait_for("the instance registered", LONG, || async { count(&db, registered).await > 0 }).await;
            proxy.stall();
        };
        let (started, ()) =
            tokio::join!(Node::start(outbox.clone(), &through, recording(&Sink::new()), config.clone()), watch);
        match started {
            Ok(node) => tokio::time::timeout(LONG, node.shutdown()).await.expect("the node stops").unwrap(),
            Err(e) => {
                assert!(e.to_string().contains("registering the instance"), "{e}");
                assert_eq!(count(&db, registered).await, 0, "the failed start left its instance registered");
                return;
            }
        }
        assert_eq!(count(&db, registered).await, 0, "the stopped node deregistered");
    }
    panic!("every registration's answer came back before the link went down");
}

/// A fetch too large to come within `query_timeout` (a backlog of large payloads over a slow network)
/// is tried again smaller: before, every poll asked for the same batch, gave it up at the time limit,
/// and nothing was delivered. Here a fetch of every key's record is 6.5 MB, over 3 s on the link; a
/// quarter of it comes in under a second.
async fn a_fetch_too_large_for_its_time_limit_is_tried_again_smaller(db: TestDb) {
    let (through, _proxy) = db.narrow_link(2_000_000).await;
    let outbox = outbox(&db, |c| c.query_timeout = Duration::from_secs(2)).await;
    let records = (0..64).map(|k| NewRecord::new(format!("k{k}"), "t", vec![7u8; 100 * 1024])).collect();
    commit(&outbox, &db, records).await;
    let sink = Sink::new();
    let node = Node::start(outbox.clone(), &through, recording(&sink), fast_cluster()).await.unwrap();
    drained(&db, LONG).await;
    tokio::time::timeout(LONG, node.shutdown()).await.expect("the node stops").unwrap();
    assert_eq!(sink.len(), 64);
}

/// A completion too large to finish within `query_timeout` (here each record's deletion takes 20 ms,
/// so the 200 outcomes that gather while the first completion runs take 4 s) is written in smaller
/// batches, whole keys each: before, the batch was tried again whole after every time limit, with
/// whatever had gathered meanwhile, and no key ever left flight.
async fn a_completion_too_large_for_its_time_limit_is_tried_again_smaller(db: TestDb) {
    let outbox = outbox(&db, |c| c.query_timeout = Duration::from_secs(2)).await;
    db.slow_record_deletes(20).await;
    commit(&outbox, &db, (0..200).map(|k| NewRecord::new(format!("k{k}"), "t", "")).collect()).await;
    let sink = Sink::new();
    let node = Node::start(outbox.clone(), &db, recording(&sink), fast_cluster()).await.unwrap();
    drained(&db, LONG).await;
    tokio::time::timeout(LONG, node.shutdown()).await.expect("the node stops").unwrap();
    assert_eq!(sink.len(), 200, "each record delivered once");
}

/// A fault in the processor's own code (here a panic from the metrics recorder as the first completed
/// record is counted; a handler's panic is caught) ends the processor. The node then stops its other
/// tasks too, the heartbeat included, and says why, so its partitions go on to another instance as from
/// a crashed one. Before, it went on heartbeating and holding partitions that nothing delivered.
async fn a_processor_ended_by_a_fault_takes_its_node_out_of_the_cluster(db: TestDb) {
    a_fault_in_a_node_task_takes_its_node_out_of_the_cluster(db, "outbox_records_completed_total").await;
}

/// The same for a fault in the heartbeat (a panic as the first renewal's round trip is recorded), which
/// `Node::shutdown` reports too.
async fn a_heartbeat_ended_by_a_fault_takes_its_node_out_of_the_cluster(db: TestDb) {
    a_fault_in_a_node_task_takes_its_node_out_of_the_cluster(db, "outbox_heartbeat_seconds").await;
}

/// The node whose task panics when it first records `metric` stops delivering and heartbeating, says
/// so through `Node::faulted`, and a second node delivers what is committed after.
async fn a_fault_in_a_node_task_takes_its_node_out_of_the_cluster(db: TestDb, metric: &'static str) {
    let panicked = Arc::new(AtomicBool::new(false));
    let recorder = PanicsOnce { metric, panicked: panicked.clone() };
    // The test's runtime runs on this thread, and so does every task of its nodes.
    let _local = metrics::set_default_local_recorder(&recorder);
    let outbox = outbox(&db, |_| {}).await;
    let keys = |round: &str| (0..50).map(|k| NewRecord::new(format!("{round}-{k}"), "t", "")).collect();
    commit(&outbox, &db, keys("before")).await;
    let sink = Sink::new();
    let a = Node::start(outbox.clone(), &db, recording(&sink), fast_cluster()).await.unwrap();
    tokio::time::timeout(LONG, a.faulted()).await.expect("the node says it stopped on a fault");
    assert!(panicked.load(Ordering::SeqCst));
    commit(&outbox, &db, keys("after")).await;
    let b = Node::start(outbox.clone(), &db, recording(&sink), fast_cluster()).await.unwrap();
    drained(&db, LONG).await;
    assert_eq!(owners(&db).await.get(&a.id()), None, "the faulty node holds no partition");
    assert_eq!(sink.all().iter().filter(|d| d.key.starts_with("after")).count(), 50);
    b.shutdown().await.unwrap();
    let err = a.shutdown().await.unwrap_err();
    assert!(err.to_string().contains("panicked"), "the fault is reported at shutdown: {err}");
}

/// A metrics recorder whose first record of `metric` (a counter or a histogram) panics.
struct PanicsOnce {
    metric: &'static str,
    panicked: Arc<AtomicBool>,
}

impl metrics::Recorder for PanicsOnce {
    fn describe_counter(&self, _: metrics::KeyName, _: Option<metrics::Unit>, _: metrics::SharedString) {}
    fn describe_gauge(&self, _: metrics::KeyName, _: Option<metrics::Unit>, _: metrics::SharedString) {}
    fn describe_histogram(&self, _: metrics::KeyName, _: Option<metrics::Unit>, _: metrics::SharedString) {}

    fn register_counter(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Counter {
        if key.name() == self.metric {
            metrics::Counter::from_arc(Arc::new(Panicking(self.panicked.clone())))
        } else {
            metrics::Counter::noop()
        }
    }

    fn register_gauge(&self, _: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Gauge {
        metrics::Gauge::noop()
    }

    fn register_histogram(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Histogram {
        if key.name() == self.metric {
            metrics::Histogram::from_arc(Arc::new(Panicking(self.panicked.clone())))
        } else {
            metrics::Histogram::noop()
        }
    }
}

struct Panicking(Arc<AtomicBool>);

impl Panicking {
    fn once(&self) {
        if !self.0.swap(true, Ordering::SeqCst) {
            panic!("a fault in the library's own code");
        }
    }
}

impl metrics::CounterFn for Panicking {
    fn increment(&self, _: u64) {
        self.once();
    }

    fn absolute(&self, _: u64) {}
}

impl metrics::HistogramFn for Panicking {
    fn record(&self, _: f64) {
        self.once();
    }
}

/// A record whose stored headers hold a value that is not a string (a row written by other means than
/// `schedule`, which stores strings only) is delivered with the value's JSON text, and one whose headers
/// are no object with none. Before, reading either failed every fetch of its instance's partitions, on
/// every poll.
async fn a_header_value_stored_as_a_number_is_delivered_as_its_text(db: TestDb) {
    let outbox = outbox(&db, |_| {}).await;
    let records = ["odd", "listed", "plain"].map(|key| NewRecord::new(key, "t", ""));
    commit(&outbox, &db, records.into()).await;
    exec!(db, r#"UPDATE {s}records SET headers = '{"retries": 3, "trace": "x"}' WHERE key = 'odd'"#);
    exec!(db, r#"UPDATE {s}records SET headers = '["x"]' WHERE key = 'listed'"#);
    let seen = Arc::new(std::sync::Mutex::new(std::collections::BTreeMap::new()));
    let saw = seen.clone();
    let handlers = Handlers::new().default_route(Route::new(handler_fn(move |r| {
        saw.lock().unwrap().insert(r.key.clone(), r.headers.clone());
        async { Ok::<(), HandlerError>(()) }
    })));
    let node = start(&outbox, &db, handlers).await;
    drained(&db, LONG).await;
    node.shutdown().await.unwrap();
    let seen = seen.lock().unwrap();
    let odd: Vec<(&str, &str)> = seen["odd"].iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    assert_eq!(odd, [("retries", "3"), ("trace", "x")]);
    assert!(seen["listed"].is_empty(), "headers that are no object come as none");
    assert!(seen["plain"].is_empty());
}

/// A count of calls before they are made (in a partition taken over from a dead owner) that the
/// database refuses is taken back and tried again after the completions' backoff: before, the records
/// were fetched and counted again at once, in a loop as fast as the database answered, and a count
/// that committed despite the error left calls counted that were never made (the records then went
/// as suspects, alone). Here the database refuses every update of a record until a gate opens.
#[sqlx::test(migrations = false)]
async fn a_count_the_database_refuses_is_taken_back_and_tried_again_later(pool: sqlx::PgPool) {
    logs();
    let db = TestDb::postgres(pool);
    let outbox = outbox(&db, |_| {}).await;
    let scheduled = commit(&outbox, &db, vec![NewRecord::new("k", "t", "")]).await;
    owner_of_all_dead_since_a_minute(&db, 100).await;
    refuse_until_the_gate_opens(&db, "UPDATE", "true", "P0001").await;
    let sink = Sink::new();
    let node = start(&outbox, &db, recording(&sink)).await;
    wait_for("the count refused", LONG, || async { refusals(&db).await > 0 }).await;
    let first = refusals(&db).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let in_a_second = refusals(&db).await - first;
    assert!(in_a_second < 50, "{in_a_second} refused writes in a second: the count is tried again in a loop");
    assert_eq!(sink.len(), 0, "a call was made without its count written");
    open_the_gate(&db).await;
    drained(&db, LONG).await;
    node.shutdown().await.unwrap();
    assert_eq!(sink.ranks_of("k"), [1]);
    let outcome =
        db.scalar::<String>("SELECT outcome FROM {s}completed WHERE id = $1", &[scheduled[0].id.into()]).await;
    assert_eq!(outcome, "delivered");
}

/// A record whose earlier calls failed in the usual way (their failures were written), fetched in a
/// partition taken over from a dead owner after its route's retries were lowered below its attempts,
/// is called once more and goes to the fallback, as it would without the takeover. Before, the check
/// meant for a record whose last call never finished took it for one: FAILED without a call or the
/// fallback, with "the last of which did not finish".
#[sqlx::test(migrations = false)]
async fn a_record_that_failed_in_the_usual_way_reaches_its_fallback_after_a_takeover(pool: sqlx::PgPool) {
    logs();
    let db = TestDb::postgres(pool);
    let outbox = outbox(&db, |_| {}).await;
    let scheduled = commit(&outbox, &db, vec![NewRecord::new("k", "t", "")]).await;
    exec!(db, "UPDATE {s}records SET attempts = 3, last_error = 'the broker is down'");
    owner_of_all_dead_since_a_minute(&db, 100).await;
    let (calls, rescued) = (Sink::new(), Sink::new());
    let (called, fallback) = (calls.clone(), rescued.clone());
    let failing = handler_fn(move |r: Record| {
        called.record(&r);
        async { Err::<(), _>(HandlerError::retryable("the broker is still down")) }
    });
    let route = Route::new(failing).retry(RetryPolicy::fixed(Duration::from_millis(5), 1)).unwrap().fallback(
        outbox_core::fallback_fn(move |r, _| {
            fallback.record(&r);
            async { Ok(()) }
        }),
    );
    let node = start(&outbox, &db, Handlers::new().default_route(route)).await;
    drained(&db, LONG).await;
    node.shutdown().await.unwrap();
    assert_eq!(failed_count(&db).await, 0);
    assert_eq!((calls.len(), rescued.len()), (1, 1), "called once more, then the fallback");
    let outcome =
        db.scalar::<String>("SELECT outcome FROM {s}completed WHERE id = $1", &[scheduled[0].id.into()]).await;
    assert_eq!(outcome, "fallback");
}
