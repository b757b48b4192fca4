//! Delivery: strict per-key order with many keys in flight, retries, fallback, FAILED and its operator
//! remedies, stop-on-first-failure, fencing, redelivery after a crash, graceful stop.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[macro_use]
mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use common::*;
use outbox_core::operator::FailedFilter;
use outbox_core::{
    Assignment, Deadline, Epoch, Error, HandlerError, Handlers, InstanceId, NewRecord, Processor, RetryPolicy, Route,
    fallback_fn, handler_fn, partition_of,
};
use rand::RngExt;
use sqlx::Connection;
use tokio::sync::{Semaphore, watch};
use tokio_util::sync::CancellationToken;

every_backend!(
    many_keys_are_delivered_in_per_key_order_with_random_latency,
    retries_wait_the_policy_delays_then_succeed,
    handler_timeout_counts_as_a_retryable_failure,
    exhausted_retries_go_to_the_fallback_or_to_failed,
    failed_blocks_its_key_until_requeue_or_skip,
    without_stop_on_first_failure_later_records_proceed,
    slow_and_blocked_keys_do_not_stall_other_keys,
    a_key_behind_more_blocked_keys_than_a_fetch_reads_is_delivered,
    a_write_from_a_stale_epoch_changes_nothing,
    a_crash_mid_batch_redelivers_without_reordering,
    graceful_stop_completes_in_flight_records,
    nothing_is_delivered_past_the_assignment_deadline,
    the_in_process_sink_passes_the_handler_conformance_suite,
    a_run_stops_at_the_lease_deadline,
    no_call_starts_past_the_lease_deadline_before_the_processor_notices,
    a_wake_up_delivers_without_waiting_for_the_poll,
    a_busy_partition_does_not_hold_back_the_poll,
    a_full_batch_is_followed_by_the_partitions_it_did_not_finish,
    calls_of_an_instance_declared_dead_are_cancelled_under_its_new_id,
    a_call_being_handed_over_is_cancelled_when_its_instance_is_declared_dead,
    a_panic_in_the_decision_ends_failed_once_retries_run_out,
    a_skip_that_meets_a_requeue_leaves_the_record_to_it,
    counted_calls_whose_turns_come_after_a_stop_began_are_not_made,
    a_keys_suspects_are_called_one_after_another_in_one_turn,
    a_process_ending_among_a_keys_suspects_counts_only_the_call_it_ended_in,
    a_count_fenced_out_cancels_the_calls_of_its_grant,
);

// A network between: a server's.
on_backends!(
    [postgres, mysql]
    back_to_back_fetches_do_not_hold_back_the_poll,
);

/// On PostgreSQL a producer in another process (here: another `Outbox`, with wake-ups of its own) wakes
/// the processor through `NOTIFY`. The node runs on a pool of one connection: listening takes none of it.
#[sqlx::test(migrations = false)]
async fn a_wake_up_from_another_process_arrives_through_notify(pool: sqlx::PgPool) {
    let db = TestDb::postgres(pool).with_pool_size(1).await;
    let (producer, consumer) = (outbox(&db, |_| {}).await, outbox(&db, hourly).await);
    wakes_up(&db, &producer, &consumer).await;
}

/// Losing the `LISTEN` connection brings the poll forward: a processor that relied on wake-ups (its
/// safety-net poll an hour away) polls every `poll_interval` while it cannot listen again, so a record
/// whose wake-up was lost does not wait for the safety net.
#[sqlx::test(migrations = false)]
async fn losing_the_wake_up_connection_brings_the_poll_forward(pool: sqlx::PgPool) {
    logs();
    let db = TestDb::postgres(pool.clone());
    let kept = common::recorded::Kept::new();
    let _local = metrics::set_default_local_recorder(&kept);
    let consumer = outbox(&db, |c| {
        c.poll_interval = Duration::from_millis(200);
        c.active_poll_interval = Duration::from_millis(200);
        c.listen_poll_interval = Duration::from_secs(3600);
    })
    .await;
    let sink = Sink::new();
    let node = start_unlapsing(&consumer, &db, recording(&sink)).await;
    wait_for("the node owning every partition", LONG, || async { node.assignment().borrow().epochs.len() == 256 })
        .await;
    wait_for("the processor listening", LONG, || async { kept.gauge("outbox_wakeups_listening") == Some(1.0) }).await;
    // Past the last poll at the short interval: from here on only a wake-up or the hourly poll reads.
    tokio::time::sleep(Duration::from_millis(500)).await;
    commit(&consumer, &db, vec![NewRecord::new("k", "t", "1")]).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(sink.len(), 0, "while listening, a record committed without a wake-up waits for the hourly poll");
    // The listener loses its connection and cannot make another (the connections already open stay).
    let name: String = db.scalar("SELECT current_database()", &[]).await;
    let postgres = (*pool.connect_options()).clone().database("postgres");
    let mut elsewhere = sqlx::PgConnection::connect_with(&postgres).await.unwrap();
    // The test's own reads go on a connection opened before: the pool's may all be busy with the node's
    // statements then, and a new one is refused (as it was once in a full run of the suite).
    let mut watching = sqlx::PgConnection::connect_with(&pool.connect_options()).await.unwrap();
    let connections = |allow: bool| sqlx::AssertSqlSafe(format!("ALTER DATABASE \"{name}\" ALLOW_CONNECTIONS {allow}"));
    sqlx::raw_sql(connections(false)).execute(&mut elsewhere).await.unwrap();
    let cut = "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
               WHERE datname = current_database() AND query LIKE 'LISTEN %'";
    assert_eq!(sqlx::query_scalar::<_, i64>(cut).fetch_one(&mut watching).await.unwrap(), 1);
    wait_for("the record delivered while the wake-up connection is down", LONG, || async { sink.len() == 1 }).await;
    let listening =
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND query LIKE 'LISTEN %'";
    let listeners: i64 = sqlx::query_scalar(listening).fetch_one(&mut watching).await.unwrap();
    assert_eq!(listeners, 0, "delivered by a poll, not by a listener come back");
    assert_eq!(kept.gauge("outbox_wakeups_listening"), Some(0.0), "the gauge says it does not listen");
    sqlx::raw_sql(connections(true)).execute(&mut elsewhere).await.unwrap();
    node.shutdown().await.unwrap();
}

/// A `LISTEN` connection that stops answering without a word (a NAT's idle timeout, a host gone) is
/// found out by its check and made again: before, the processor counted on wake-ups that no longer came.
#[sqlx::test(migrations = false)]
async fn a_wake_up_connection_that_stops_answering_is_made_again(pool: sqlx::PgPool) {
    logs();
    let db = TestDb::postgres(pool);
    let (through, proxy) = db.through_proxy().await;
    let consumer = outbox(&db, |c| {
        c.listen_poll_interval = Duration::from_millis(300);
        c.query_timeout = Duration::from_secs(1);
    })
    .await;
    let node = start(&consumer, &through, recording(&Sink::new())).await;
    // A listening session shows its last statement: the `LISTEN`, or the check that ran after it. The
    // stalled one may stay on the server's side or go (its client closes it), so the new one is told
    // apart by when it began.
    let listening_since = "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()
                           AND (query LIKE 'LISTEN %' OR query = 'SELECT 1') AND backend_start > $1::timestamptz";
    let epoch = "1970-01-01 00:00:00+00";
    wait_for("the processor listening", LONG, || async { rows!(db, (i64,), listening_since, epoch) == [(1,)] }).await;
    let stalled_at = rows!(db, (String,), "SELECT clock_timestamp()::text").remove(0).0;
    proxy.stall();
    wait_for("the processor listening on a new connection", LONG, || async {
        rows!(db, (i64,), listening_since, stalled_at.as_str()) == [(1,)]
    })
    .await;
    tokio::time::timeout(LONG, node.shutdown()).await.expect("the node stops").unwrap();
}

/// Behind a pooler in transaction mode (PgBouncer's, Supavisor's) `LISTEN` is answered and hears
/// nothing: the processor finds it out and polls every `poll_interval`, so a record woken from another
/// process is delivered without waiting for the safety-net poll an hour away. Before, it counted on
/// wake-ups that never came.
#[sqlx::test(migrations = false)]
async fn a_wake_up_connection_that_hears_nothing_brings_the_poll_forward(pool: sqlx::PgPool) {
    logs();
    let db = TestDb::postgres(pool);
    let (deaf, _proxy) = db.deaf_to_notices().await;
    let producer = outbox(&db, |_| {}).await;
    let consumer = outbox(&db, |c| {
        c.poll_interval = Duration::from_millis(200);
        c.active_poll_interval = Duration::from_millis(200);
        c.listen_poll_interval = Duration::from_secs(3600);
        c.query_timeout = Duration::from_secs(1);
    })
    .await;
    let sink = Sink::new();
    let node = start(&consumer, &deaf, recording(&sink)).await;
    wait_for("the node owning every partition", LONG, || async { node.assignment().borrow().epochs.len() == 256 })
        .await;
    let listened = "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND query LIKE 'LISTEN %'";
    wait_for("the processor trying to listen", LONG, || async { count(&db, listened).await >= 1 }).await;
    // Past the first look at every partition a new listener takes, and past a query timeout.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let woken = commit(&producer, &db, vec![NewRecord::new("k", "t", "1")]).await;
    producer.wake(&db, &woken).await.unwrap();
    wait_for("the woken record delivered", Duration::from_secs(20), || async { sink.len() == 1 }).await;
    tokio::time::timeout(LONG, node.shutdown()).await.expect("the node stops").unwrap();
}

const LONG: Duration = Duration::from_secs(60);

/// A processor polling once an hour delivers a record at once when its producer calls `wake` after the
/// commit, and not before (a record committed without a wake-up waits, also through another
/// partition's wake-up).
async fn a_wake_up_delivers_without_waiting_for_the_poll(db: TestDb) {
    let consumer = outbox(&db, hourly).await;
    wakes_up(&db, &consumer, &consumer).await;
}

/// `consumer` (polling once an hour) runs a node; `producer` schedules and wakes.
async fn wakes_up(db: &TestDb, producer: &outbox_core::Outbox, consumer: &outbox_core::Outbox) {
    logs();
    let kept = common::recorded::Kept::new();
    let _local = metrics::set_default_local_recorder(&kept);
    let listening = || kept.gauge("outbox_wakeups_listening");
    let sink = Sink::new();
    let node = start_unlapsing(consumer, db, recording(&sink)).await;
    let owns_all = || async { node.assignment().borrow().epochs.len() == 256 };
    wait_for("the node owning every partition", LONG, owns_all).await;
    if db.db.backend() == "postgres" {
        // Once it listens, the processor looks at every partition for what it may have missed; only after
        // that look does nothing but a wake-up or the hourly poll read. Its `LISTEN` statement comes
        // before, and on a loaded run long enough before that a record committed after it was found by
        // that look.
        wait_for("the processor listening", LONG, || async { listening() == Some(1.0) }).await;
    }
    // Once this one is delivered and completed, the processor has nothing to look for for an hour.
    let first = commit(producer, db, vec![NewRecord::new("k-1", "t", "1")]).await;
    producer.wake(db, &first).await.unwrap();
    wait_for("the first record delivered", LONG, || async { sink.len() == 1 }).await;
    drained(db, LONG).await;

    let unwoken = commit(producer, db, vec![NewRecord::new("k-2", "t", "2")]).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(sink.len(), 1, "a record committed without a wake-up waits for the poll");
    let woken = commit(producer, db, vec![NewRecord::new("k-3", "t", "3")]).await;
    producer.wake(db, &woken).await.unwrap();
    wait_for("the woken record delivered", LONG, || async { sink.of_key("k-3").len() == 1 }).await;
    assert_ne!(partition_of("k-2"), partition_of("k-3"));
    assert!(sink.of_key("k-2").is_empty(), "a wake-up reads only the partitions it names");
    producer.wake(db, &unwoken).await.unwrap();
    wait_for("the other record delivered once woken", LONG, || async { sink.len() == 3 }).await;
    node.shutdown().await.unwrap();
    if db.db.backend() == "postgres" {
        assert_eq!(listening(), Some(0.0), "listening after the stop");
    }
}

/// A fetch of a few partitions (one that follows a completion there) is no poll of the others: while one
/// key's records complete one by one, a record committed without a wake-up on another partition is still
/// found by the next poll, not after the busy key falls quiet.
async fn a_busy_partition_does_not_hold_back_the_poll(db: TestDb) {
    logs();
    let outbox = outbox(&db, |c| {
        c.poll_interval = Duration::from_millis(300);
        c.listen_poll_interval = Duration::from_millis(300);
        c.active_poll_interval = Duration::from_millis(300);
        // Each of the busy key's records completes before the next is fetched, by its partition alone.
        c.key_lookahead = 1;
    })
    .await;
    let sink = Sink::new();
    let recorded = sink.clone();
    let handler = handler_fn(move |r: outbox_core::Record| {
        let sink = recorded.clone();
        async move {
            if r.key == "busy" {
                tokio::time::sleep(Duration::from_millis(40)).await;
            }
            sink.record(&r);
            Ok(())
        }
    });
    let node = start(&outbox, &db, Handlers::new().default_route(Route::new(handler))).await;
    wait_for("the node owning every partition", LONG, || async { node.assignment().borrow().epochs.len() == 256 })
        .await;
    let busy: Vec<_> = (0..60).map(|_| NewRecord::new("busy", "t", "b")).collect();
    let busy = commit(&outbox, &db, busy).await;
    outbox.wake(&db, &busy).await.unwrap();
    wait_for("the busy key started", LONG, || async { !sink.of_key("busy").is_empty() }).await;
    assert_ne!(partition_of("busy"), partition_of("quiet"));
    commit(&outbox, &db, vec![NewRecord::new("quiet", "t", "q")]).await;
    wait_for("the quiet record delivered", LONG, || async { sink.of_key("quiet").len() == 1 }).await;
    // 60 records of 40 ms each take 2.4 s; polls come every 300 ms.
    let busy_done = sink.of_key("busy").len();
    assert!(busy_done < 60, "the quiet record waited for the busy key to finish ({busy_done} of 60 delivered first)");
    drained(&db, LONG).await;
    node.shutdown().await.unwrap();
}

/// Fetches that follow one another without a gap (wake-ups for one partition arriving faster than a
/// fetch returns, as from a busy producer in the same process) do not hold back the poll: a record that
/// no wake-up announced (another process's on MySQL, a retry past the timers kept) is still found by
/// it. Before, the poll could only fall due between fetches, and there was no such moment.
async fn back_to_back_fetches_do_not_hold_back_the_poll(db: TestDb) {
    // A fetch 20 ms a round trip from the database is always still running when the next wake-up comes.
    let (far, _proxy) = db.far_away(Duration::from_millis(10)).await;
    logs();
    let outbox = outbox(&db, |c| {
        c.poll_interval = Duration::from_millis(300);
        c.listen_poll_interval = Duration::from_millis(300);
        c.active_poll_interval = Duration::from_millis(300);
    })
    .await;
    let sink = Sink::new();
    let node = start(&outbox, &far, recording(&sink)).await;
    wait_for("the node owning every partition", LONG, || async { node.assignment().borrow().epochs.len() == 256 })
        .await;
    let busy = commit(&outbox, &db, vec![NewRecord::new("busy", "t", "b")]).await;
    let waking = tokio::spawn({
        let (outbox, db) = (outbox.clone(), db.clone());
        async move {
            let until = tokio::time::Instant::now() + Duration::from_secs(15);
            while tokio::time::Instant::now() < until {
                outbox.wake(&db, &busy).await.unwrap();
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }
    });
    wait_for("the busy record delivered", LONG, || async { sink.of_key("busy").len() == 1 }).await;
    assert_ne!(partition_of("busy"), partition_of("quiet"));
    commit(&outbox, &db, vec![NewRecord::new("quiet", "t", "q")]).await;
    wait_for("the quiet record delivered", LONG, || async { sink.of_key("quiet").len() == 1 }).await;
    assert!(
        !waking.is_finished(),
        "the record no wake-up announced waited for the wake-ups to stop (polls every 300 ms)"
    );
    waking.abort();
    node.shutdown().await.unwrap();
}

/// A fetch that fills its batch leaves the rest of its partitions to the next fetch: a backlog over many
/// partitions, announced by one wake-up, drains two keys at a time without a poll.
async fn a_full_batch_is_followed_by_the_partitions_it_did_not_finish(db: TestDb) {
    logs();
    let outbox = outbox(&db, |c| {
        hourly(c);
        c.concurrency = 2;
    })
    .await;
    let sink = Sink::new();
    let node = start(&outbox, &db, recording(&sink)).await;
    wait_for("the node owning every partition", LONG, || async { node.assignment().borrow().epochs.len() == 256 })
        .await;
    let keys: Vec<String> = (0..40).map(|k| format!("k-{k}")).collect();
    let records = keys.iter().flat_map(|k| (0..3).map(move |i| NewRecord::new(k, "t", i.to_string()))).collect();
    let scheduled = commit(&outbox, &db, records).await;
    outbox.wake(&db, &scheduled).await.unwrap();
    wait_for("every record delivered without a poll", LONG, || async { sink.len() == 120 }).await;
    assert_in_order(&sink, &keys, 3);
    drained(&db, LONG).await;
    node.shutdown().await.unwrap();
}

/// Per key, deliveries must be exactly its n records, each once, in order.
fn assert_in_order(sink: &Sink, keys: &[String], n: i64) {
    for key in keys {
        assert_eq!(sink.ranks_of(key), (1..=n).collect::<Vec<_>>(), "key {key}: {:?}", sink.seqs_of(key));
    }
}

async fn many_keys_are_delivered_in_per_key_order_with_random_latency(db: TestDb) {
    logs();
    let outbox = outbox(&db, |c| {
        c.concurrency = 16;
        c.batch_size = 7;
    })
    .await;
    let keys: Vec<String> = (0..60).map(|i| format!("order-{i}")).collect();
    let per_key = 12;
    // Writers interleave keys across concurrent transactions, as a busy service would.
    let writers = (0..4).map(|w| {
        let (o, p, keys) = (outbox.clone(), db.clone(), keys.clone());
        tokio::spawn(async move {
            for round in 0..per_key / 4 {
                let _ = round;
                for chunk in keys.chunks(5).skip(w % 2) {
                    let batch: Vec<_> = chunk.iter().map(|k| NewRecord::new(k.clone(), "order.event", "{}")).collect();
                    commit(&o, &p, batch).await;
                }
                for chunk in keys.chunks(5).take(w % 2) {
                    let batch: Vec<_> = chunk.iter().map(|k| NewRecord::new(k.clone(), "order.event", "{}")).collect();
                    commit(&o, &p, batch).await;
                }
            }
        })
    });
    let sink = Sink::new();
    let s = sink.clone();
    let handlers = Handlers::new().on(
        "order.event",
        handler_fn(move |r| {
            let s = s.clone();
            async move {
                let delay = rand::rng().random_range(0..4);
                tokio::time::sleep(Duration::from_millis(delay)).await;
                s.record(&r);
                Ok(())
            }
        }),
    );
    let node = start(&outbox, &db, handlers).await;
    futures::future::join_all(writers).await;
    drained(&db, LONG).await;
    node.shutdown().await.unwrap();
    assert_in_order(&sink, &keys, per_key as i64);
    assert_eq!(sink.len(), keys.len() * per_key);
    assert_eq!(count(&db, "SELECT count(*) FROM {s}completed WHERE outcome = 'delivered'").await, 720);
}

async fn retries_wait_the_policy_delays_then_succeed(db: TestDb) {
    let outbox = outbox(&db, |_| {}).await;
    let sink = Sink::new();
    let s = sink.clone();
    let policy = RetryPolicy::exponential(Duration::from_millis(150), 2.0, 3);
    let handlers = Handlers::new().route(
        "t",
        Route::new(handler_fn(move |r| {
            let s = s.clone();
            async move {
                s.record(&r);
                if r.payload == "x" && r.attempts < 2 {
                    Err(HandlerError::retryable("downstream busy"))
                } else {
                    Ok(())
                }
            }
        }))
        .retry(policy)
        .unwrap(),
    );
    commit(&outbox, &db, vec![NewRecord::new("k", "t", "x"), NewRecord::new("k", "t", "y")]).await;
    let node = start(&outbox, &db, handlers).await;
    drained(&db, LONG).await;
    node.shutdown().await.unwrap();

    let seqs = sink.seqs_of("k");
    let (x, y) = (seqs[0], *seqs.last().unwrap());
    let first: Vec<_> = sink.all().into_iter().filter(|d| d.seq == x).collect();
    assert_eq!(first.iter().map(|d| d.attempts).collect::<Vec<_>>(), [0, 1, 2]);
    let gaps: Vec<Duration> = first.windows(2).map(|w| w[1].at - w[0].at).collect();
    assert!(gaps[0] >= Duration::from_millis(150), "first retry after {:?}", gaps[0]);
    assert!(gaps[1] >= Duration::from_millis(300), "second retry after {:?}", gaps[1]);
    // Record 2 waited for record 1 (stop-on-first-failure) and was delivered after its success.
    let second = sink.of_key("k").into_iter().filter(|d| d.seq == y).collect::<Vec<_>>();
    assert!(second[0].at > first[2].at);
    let attempts = rows!(db, (i64, i32, String), "SELECT seq, attempts, outcome FROM {s}completed ORDER BY seq");
    assert_eq!(attempts, [(x, 2, "delivered".into()), (y, 0, "delivered".into())]);
}

async fn handler_timeout_counts_as_a_retryable_failure(db: TestDb) {
    let outbox = outbox(&db, |c| c.handler_timeout = Duration::from_millis(100)).await;
    let sink = Sink::new();
    let s = sink.clone();
    let handlers = Handlers::new().route(
        "t",
        Route::new(handler_fn(move |r| {
            let s = s.clone();
            async move {
                s.record(&r);
                if r.attempts == 0 {
                    tokio::time::sleep(Duration::from_secs(30)).await;
                }
                Ok(())
            }
        }))
        .retry(RetryPolicy::fixed(Duration::from_millis(10), 1))
        .unwrap(),
    );
    commit(&outbox, &db, vec![NewRecord::new("k", "t", "")]).await;
    let node = start(&outbox, &db, handlers).await;
    drained(&db, LONG).await;
    node.shutdown().await.unwrap();
    assert_eq!(sink.all().iter().map(|d| d.attempts).collect::<Vec<_>>(), [0, 1]);
}

async fn exhausted_retries_go_to_the_fallback_or_to_failed(db: TestDb) {
    let outbox = outbox(&db, |_| {}).await;
    let fallback_saw = Sink::new();
    let fb = fallback_saw.clone();
    let failing = || handler_fn(|_| async { Err::<(), _>(HandlerError::retryable("broker down")) });
    let handlers = Handlers::new()
        .route(
            "rescued",
            Route::new(failing()).retry(RetryPolicy::fixed(Duration::from_millis(5), 2)).unwrap().fallback(
                fallback_fn(move |r, error| {
                    let fb = fb.clone();
                    async move {
                        assert!(error.contains("broker down"), "{error}");
                        fb.record(&r);
                        Ok(())
                    }
                }),
            ),
        )
        .route(
            "doomed",
            Route::new(failing())
                .retry(RetryPolicy::fixed(Duration::from_millis(5), 1))
                .unwrap()
                .fallback(fallback_fn(|_, _| async { Err(HandlerError::permanent("archive full")) })),
        )
        .route("malformed", Route::new(handler_fn(|_| async { Err::<(), _>(HandlerError::permanent("bad schema")) })));
    commit(
        &outbox,
        &db,
        vec![
            NewRecord::new("a", "rescued", ""),
            NewRecord::new("b", "doomed", ""),
            NewRecord::new("c", "malformed", ""),
            NewRecord::new("d", "unrouted", ""),
        ],
    )
    .await;
    let node = start(&outbox, &db, handlers).await;
    wait_failed(&db, 3).await;
    drained(&db, LONG).await;
    node.shutdown().await.unwrap();

    // 1 + 2 retries, then the fallback completed it.
    assert_eq!(fallback_saw.all().iter().map(|d| (d.key.as_str(), d.attempts)).collect::<Vec<_>>(), [("a", 2)]);
    let completed = rows!(db, (String, i32, String), "SELECT key, attempts, outcome FROM {s}completed");
    assert_eq!(completed, [("a".into(), 3, "fallback".into())]);
    let failed = outbox.failed(&db, &FailedFilter::default()).await.unwrap();
    let by_key: BTreeMap<_, _> = failed.iter().map(|f| (f.key.as_str(), f)).collect();
    assert_eq!(by_key["b"].attempts, 2);
    let b_error = by_key["b"].last_error.as_deref().unwrap();
    assert!(b_error.contains("broker down") && b_error.contains("archive full"), "{b_error}");
    assert_eq!(by_key["c"].attempts, 1, "permanent errors are not retried");
    assert!(by_key["c"].last_error.as_deref().unwrap().contains("bad schema"));
    assert!(by_key["d"].last_error.as_deref().unwrap().contains("no handler for event type \"unrouted\""));
}

/// A FAILED head blocks its key until an operator acts; other keys, also in the same partition, go on.
/// The processor polls once an hour: the operator's requeue and skip wake it.
async fn failed_blocks_its_key_until_requeue_or_skip(db: TestDb) {
    let outbox = outbox(&db, hourly).await;
    let sink = Sink::new();
    let healthy = Arc::new(AtomicBool::new(false));
    let (s, h) = (sink.clone(), healthy.clone());
    let handlers = Handlers::new().default_route(Route::new(handler_fn(move |r| {
        let (s, h) = (s.clone(), h.clone());
        async move {
            s.record(&r);
            if r.payload == "0" && r.key.starts_with("bad") && !h.load(Ordering::SeqCst) {
                return Err(HandlerError::permanent("rejected"));
            }
            Ok(())
        }
    })));
    // A healthy key in the same partition as "bad-1" shows blocking is per key, not per partition.
    let neighbour = (0..).map(|i| format!("good-{i}")).find(|k| partition_of(k) == partition_of("bad-1")).unwrap();
    let mut records = Vec::new();
    for seq in 0..3 {
        for key in ["bad-1", "bad-2", neighbour.as_str()] {
            records.push(NewRecord::new(key, "t", format!("{seq}")));
        }
    }
    commit(&outbox, &db, records).await;
    let node = start(&outbox, &db, handlers).await;
    wait_for("neighbour delivered and both bad heads FAILED", LONG, || async {
        sink.ranks_of(&neighbour) == [1, 2, 3] && failed_count(&db).await == 2
    })
    .await;
    // Give the processor several polls: later records of the blocked keys must stay back.
    let before = sink.len();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(sink.len(), before);
    assert_eq!(sink.ranks_of("bad-1"), [1]);
    assert_eq!(count(&db, "SELECT count(*) FROM {s}records WHERE failed_at IS NULL").await, 4);

    healthy.store(true, Ordering::SeqCst);
    let failed = outbox.failed(&db, &FailedFilter { key: Some("bad-1".into()), ..Default::default() }).await.unwrap();
    assert_eq!(failed.len(), 1);
    outbox.requeue(&db, failed[0].id).await.unwrap();
    let bad2 = outbox.failed(&db, &FailedFilter { key: Some("bad-2".into()), ..Default::default() }).await.unwrap();
    outbox.skip(&db, bad2[0].id).await.unwrap();
    assert!(outbox.skip(&db, bad2[0].id).await.is_err(), "a record can be skipped once");
    drained(&db, LONG).await;
    node.shutdown().await.unwrap();
    assert_eq!(sink.ranks_of("bad-1"), [1, 1, 2, 3], "requeued head redelivered, then the rest in order");
    assert_eq!(sink.ranks_of("bad-2"), [1, 2, 3], "skipped head not redelivered; the rest follow");
    assert_eq!(count(&db, "SELECT count(*) FROM {s}completed WHERE outcome = 'skipped'").await, 1);
    assert_eq!(count(&db, "SELECT count(*) FROM {s}records").await, 0);
}

async fn without_stop_on_first_failure_later_records_proceed(db: TestDb) {
    let outbox = outbox(&db, |c| c.stop_on_first_failure = false).await;
    let sink = Sink::new();
    let s = sink.clone();
    let handlers = Handlers::new().default_route(
        Route::new(handler_fn(move |r| {
            let s = s.clone();
            async move {
                s.record(&r);
                if r.payload == "1" { Err(HandlerError::retryable("flaky")) } else { Ok(()) }
            }
        }))
        .retry(RetryPolicy::fixed(Duration::from_millis(200), 1))
        .unwrap(),
    );
    commit(&outbox, &db, (1..=3).map(|i| NewRecord::new("k", "t", format!("{i}"))).collect()).await;
    let node = start(&outbox, &db, handlers).await;
    wait_failed(&db, 1).await;
    drained(&db, LONG).await;
    node.shutdown().await.unwrap();
    let ranks = sink.ranks_of("k");
    assert_eq!(ranks.iter().filter(|&&r| r == 1).count(), 2);
    // Records 2 and 3 went while record 1 was waiting for its retry.
    assert_eq!(&ranks[..3], [1, 2, 3]);
}

/// A slow key holds one slot only, and keys whose head is FAILED never fill a fetch batch.
async fn slow_and_blocked_keys_do_not_stall_other_keys(db: TestDb) {
    let outbox = outbox(&db, |c| {
        c.batch_size = 3;
        c.concurrency = 4;
    })
    .await;
    let gate = Arc::new(Semaphore::new(0));
    let sink = Sink::new();
    let (s, g) = (sink.clone(), gate.clone());
    let handlers = Handlers::new().default_route(Route::new(handler_fn(move |r| {
        let (s, g) = (s.clone(), g.clone());
        async move {
            if r.key.starts_with("blocked") {
                return Err(HandlerError::permanent("poison"));
            }
            if r.key == "slow" {
                let _permit = g.acquire().await.unwrap();
            }
            s.record(&r);
            Ok(())
        }
    })));
    let blocked: Vec<_> =
        (0..10).flat_map(|i| (0..2).map(move |_| NewRecord::new(format!("blocked-{i}"), "t", ""))).collect();
    commit(&outbox, &db, blocked).await;
    let node = start(&outbox, &db, handlers).await;
    wait_failed(&db, 10).await;
    let mut healthy = vec![NewRecord::new("slow", "t", "")];
    healthy.extend((0..30).flat_map(|i| (0..3).map(move |_| NewRecord::new(format!("fast-{i}"), "t", ""))));
    commit(&outbox, &db, healthy).await;
    wait_for("all fast keys delivered while the slow one hangs", LONG, || async { sink.len() == 90 }).await;
    assert!(sink.of_key("slow").is_empty());
    gate.add_permits(1);
    wait_for("slow key delivered", LONG, || async { sink.of_key("slow").len() == 1 }).await;
    node.shutdown().await.unwrap();
}

/// A due key behind more keys whose head is FAILED than one fetch reads (on MySQL, whose walk reads 16
/// records per head it may take and per key in flight) is delivered: the next fetch goes on in its
/// partition after the key the one before stopped at. 600 FAILED keys in the due key's partition, all
/// sorting before it, a batch of 8, and a node started afresh, whose walks start at each partition's
/// lowest key.
async fn a_key_behind_more_blocked_keys_than_a_fetch_reads_is_delivered(db: TestDb) {
    let outbox = outbox(&db, |c| {
        c.batch_size = 8;
        c.concurrency = 8;
    })
    .await;
    let partition = partition_of("due");
    let blocked = keys_in(partition, "blocked", 600);
    assert!(blocked.iter().all(|k| k.as_str() < "due"));
    commit(&outbox, &db, blocked.iter().map(|k| NewRecord::new(k.clone(), "t", "")).collect()).await;
    let poison =
        Handlers::new().default_route(Route::new(handler_fn(|_| async { Err(HandlerError::permanent("poison")) })));
    let node = start(&outbox, &db, poison).await;
    wait_failed(&db, 600).await;
    node.shutdown().await.unwrap();

    commit(&outbox, &db, vec![NewRecord::new("due", "t", "")]).await;
    let sink = Sink::new();
    let node = start(&outbox, &db, recording(&sink)).await;
    wait_for("the key behind the FAILED ones delivered", LONG, || async { sink.of_key("due").len() == 1 }).await;
    node.shutdown().await.unwrap();
}

/// A processor whose epoch is outdated (the partition changed hands) completes nothing: its write is
/// fenced by the database, and it stops processing the partition. (With lookahead 1, so the record in
/// flight is the only one it ever hands out; with a longer run, the lease deadline is what stops it
/// between records: see `a_run_stops_at_the_lease_deadline`.)
async fn a_write_from_a_stale_epoch_changes_nothing(db: TestDb) {
    let outbox = outbox(&db, |c| c.key_lookahead = 1).await;
    let epoch = Epoch(1);
    let (me, partition) = own_partition_of(&db, "k", epoch).await;
    commit(&outbox, &db, vec![NewRecord::new("k", "t", ""), NewRecord::new("k", "t", "")]).await;

    let sink = Sink::new();
    let (handlers, Gate { entered, release }) = gated(&sink);
    let (_tx, assignment) = watch::channel(Assignment::new(me, [(partition, epoch)].into()));
    let stop = CancellationToken::new();
    let processor = Processor::new(outbox.clone(), db.clone(), handlers, assignment);
    let mut busy = processor.busy_partitions();
    let processor = tokio::spawn(processor.run(stop.clone()));
    entered.acquire().await.unwrap().forget();
    // While the delivery is in flight, the partition changes hands and comes back to the same instance
    // id (as after a lost lease and re-registration): only the epoch tells the old work apart.
    exec!(db, "UPDATE {s}partitions SET epoch = epoch + 2 WHERE partition = $1", i16::from(partition));
    release.add_permits(10);
    // The completion is attempted and refused: the record stays pending.
    busy.wait_for(|b| b.is_empty()).await.unwrap();
    // The zombie does not go on with record 2 over the next polls.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(pending(&db).await, 2);
    assert_eq!(count(&db, "SELECT count(*) FROM {s}completed").await, 0);
    assert_eq!(sink.len(), 1);
    stop.cancel();
    processor.await.unwrap().unwrap();
}

/// A crash between delivery and completion redelivers (at least once) without reordering.
async fn a_crash_mid_batch_redelivers_without_reordering(db: TestDb) {
    logs();
    let outbox = outbox(&db, |c| c.concurrency = 8).await;
    let keys: Vec<String> = (0..20).map(|i| format!("k{i}")).collect();
    let records: Vec<_> = (0..5).flat_map(|_| keys.iter().map(|k| NewRecord::new(k.clone(), "t", ""))).collect();
    commit(&outbox, &db, records).await;

    // First node: delivers, but completions hang on a gate after ~30 deliveries, then it crashes.
    let sink = Sink::new();
    let gate = Arc::new(Semaphore::new(30));
    let (s, g) = (sink.clone(), gate.clone());
    let crashing = Handlers::new().default_route(Route::new(handler_fn(move |r| {
        let (s, g) = (s.clone(), g.clone());
        async move {
            s.record(&r);
            g.acquire().await.unwrap().forget();
            Ok(())
        }
    })));
    let first = start(&outbox, &db, crashing).await;
    wait_for("first node stuck with deliveries in flight", LONG, || async { sink.len() >= 38 }).await;
    first.kill();
    let delivered_before_crash = sink.len();

    // Second node takes over once the first one's lease expires, and redelivers what was not completed.
    let second = start(&outbox, &db, recording(&sink)).await;
    drained(&db, LONG).await;
    second.shutdown().await.unwrap();
    assert!(sink.len() > 100, "some records were delivered twice ({} > 100)", sink.len());
    assert!(delivered_before_crash >= 38);
    for key in &keys {
        // First deliveries are in strict order; redeliveries only repeat the latest record.
        let ranks = sink.ranks_of(key);
        let mut firsts = ranks.clone();
        firsts.dedup();
        assert_eq!(firsts, [1, 2, 3, 4, 5], "key {key}: {ranks:?}");
    }
}

async fn graceful_stop_completes_in_flight_records(db: TestDb) {
    let outbox = outbox(&db, |_| {}).await;
    let (entered, release) = (Arc::new(Semaphore::new(0)), Arc::new(Semaphore::new(0)));
    let (e, r) = (entered.clone(), release.clone());
    let handlers = Handlers::new().default_route(Route::new(handler_fn(move |_| {
        let (e, r) = (e.clone(), r.clone());
        async move {
            e.add_permits(1);
            r.acquire().await.unwrap().forget();
            Ok(())
        }
    })));
    commit(&outbox, &db, (0..5).map(|i| NewRecord::new(format!("k{i}"), "t", "")).collect()).await;
    let node = start(&outbox, &db, handlers).await;
    entered.acquire_many(5).await.unwrap().forget();
    let stopping = tokio::spawn(node.shutdown());
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!stopping.is_finished(), "shutdown waits for in-flight deliveries");
    release.add_permits(5);
    stopping.await.unwrap().unwrap();
    assert_eq!(pending(&db).await, 0, "in-flight records were completed before returning");
    assert_eq!(
        count(&db, "SELECT count(*) FROM {s}partitions WHERE owner IS NOT NULL").await,
        0,
        "partitions released"
    );
    assert_eq!(count(&db, "SELECT count(*) FROM {s}instances").await, 0, "deregistered");
}

/// Registers a new instance with a lease a day long and makes it the owner of `key`'s partition at
/// `epoch`, as the ownership layer would.
async fn own_partition_of(db: &TestDb, key: &str, epoch: Epoch) -> (InstanceId, outbox_core::Partition) {
    let (me, partition) = (register_instance(db).await, partition_of(key));
    exec!(db, "UPDATE {s}partitions SET owner = $1, epoch = $2 WHERE partition = $3", me, epoch, i16::from(partition));
    (me, partition)
}

/// `partition` granted to `me` at epoch 1 and taken over an hour from now: every record there is counted
/// (`careful.rs`).
fn taken_over(me: InstanceId, partition: outbox_core::Partition) -> Assignment {
    Assignment {
        lease: Some(Deadline::now().after(LONG)),
        taken_over: [(partition, chrono::Utc::now() + chrono::Duration::hours(1))].into(),
        ..Assignment::new(me, [(partition, Epoch(1))].into())
    }
}

/// Past the assignment's deadline (the lease may have expired while the process was paused) nothing
/// is fetched or handed to a handler; a renewed deadline resumes delivery.
async fn nothing_is_delivered_past_the_assignment_deadline(db: TestDb) {
    let outbox = outbox(&db, |_| {}).await;
    let (me, partition) = own_partition_of(&db, "k", Epoch(7)).await;
    commit(&outbox, &db, vec![NewRecord::new("k", "t", "")]).await;
    let expired = Assignment { lease: Some(Deadline::now()), ..Assignment::new(me, [(partition, Epoch(7))].into()) };
    let (tx, assignment) = watch::channel(expired);
    let sink = Sink::new();
    let stop = CancellationToken::new();
    let processor =
        tokio::spawn(Processor::new(outbox.clone(), db.clone(), recording(&sink), assignment).run(stop.clone()));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(sink.len(), 0, "an expired assignment must not deliver");
    tx.send_modify(|a| a.lease = Some(Deadline::now().after(LONG)));
    drained(&db, LONG).await;
    assert_eq!(sink.all().iter().map(|d| d.epoch).collect::<Vec<_>>(), [Epoch(7)], "delivered under its epoch");
    stop.cancel();
    processor.await.unwrap().unwrap();
}

/// After a takeover, calls are counted before they are made, and wait for their turns behind a suspect
/// (a record whose call did not finish), called alone. A stop that begins meanwhile makes none of them
/// when the turns come: their counts are taken back, the records left pending with their attempts.
/// Before, each run's first call started after the stop had begun (the assignment still granted it);
/// one still running at the shutdown timeout was cut off, its record a suspect with an attempt spent.
async fn counted_calls_whose_turns_come_after_a_stop_began_are_not_made(db: TestDb) {
    let outbox = outbox(&db, |_| {}).await;
    let (me, partition) = own_partition_of(&db, "suspect", Epoch(1)).await;
    let keys: Vec<String> = (0..).map(|i| format!("k-{i}")).filter(|k| partition_of(k) == partition).take(5).collect();
    let mut records: Vec<NewRecord> = keys.iter().map(|k| NewRecord::new(k, "t", "")).collect();
    records.push(NewRecord::new("suspect", "t", ""));
    commit(&outbox, &db, records).await;
    exec!(
        db,
        "UPDATE {s}records SET attempts = 1, last_error = $1 WHERE key = 'suspect'",
        outbox_core::UNFINISHED_CALL
    );

    let (open, gate) = watch::channel(false);
    let stopping = Arc::new(AtomicBool::new(false));
    let (suspect_called, called_while_stopping) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicUsize::new(0)));
    let handlers = Handlers::new().default_route(Route::new(handler_fn({
        let (stopping, suspect_called, late) =
            (stopping.clone(), suspect_called.clone(), called_while_stopping.clone());
        move |r: outbox_core::Record| {
            let mut gate = gate.clone();
            let suspect = r.key == "suspect";
            if suspect {
                suspect_called.store(true, Ordering::SeqCst);
            } else if stopping.load(Ordering::SeqCst) {
                late.fetch_add(1, Ordering::SeqCst);
            }
            async move {
                if suspect {
                    gate.wait_for(|&open| open).await.unwrap();
                }
                Ok::<(), HandlerError>(())
            }
        }
    })));
    let (_tx, assignment) = watch::channel(taken_over(me, partition));
    let stop = CancellationToken::new();
    let processor = tokio::spawn(Processor::new(outbox.clone(), db.clone(), handlers, assignment).run(stop.clone()));
    wait_for("the suspect called", LONG, || async { suspect_called.load(Ordering::SeqCst) }).await;
    stopping.store(true, Ordering::SeqCst);
    stop.cancel();
    // The processor takes the stop in at once (it waits for nothing else); then the suspect's call ends.
    tokio::time::sleep(Duration::from_millis(200)).await;
    open.send_replace(true);
    tokio::time::timeout(LONG, processor).await.expect("the processor stops").unwrap().unwrap();
    assert_eq!(called_while_stopping.load(Ordering::SeqCst), 0, "calls made after the stop began");
    let left = rows!(db, (i32,), "SELECT attempts FROM {s}records");
    assert_eq!(left, vec![(0,); 5], "the records left, with no attempt spent");
}

/// A key whose run in flight ended with its process leaves every record of that run a suspect (counted,
/// its call unfinished), though one of them at most was being called. Its suspects are called one after
/// another in one turn, each alone, each call's outcome written before the next starts: no other
/// counted call comes between them. Before, each suspect took a turn of its own and waited for every
/// counted run queued meanwhile; a worker that ended in the middle of runs of 20 records over many keys
/// left its next owner alternating one suspect with a whole round of runs, for tens of seconds.
async fn a_keys_suspects_are_called_one_after_another_in_one_turn(db: TestDb) {
    let outbox = outbox(&db, |_| {}).await;
    let (me, partition) = own_partition_of(&db, "suspect", Epoch(1)).await;
    let keys: Vec<String> = (0..).map(|i| format!("k-{i}")).filter(|k| partition_of(k) == partition).take(5).collect();
    let mut records: Vec<NewRecord> = (0..4).map(|_| NewRecord::new("suspect", "t", "")).collect();
    records.extend(keys.iter().flat_map(|k| (0..2).map(move |_| NewRecord::new(k, "t", ""))));
    commit(&outbox, &db, records).await;
    exec!(
        db,
        "UPDATE {s}records SET attempts = 1, last_error = $1 WHERE key = 'suspect'",
        outbox_core::UNFINISHED_CALL
    );

    // Every call as (key, seq, started), (key, seq, ended), in order.
    let calls = Arc::new(std::sync::Mutex::new(Vec::new()));
    let handlers = Handlers::new().default_route(Route::new(handler_fn({
        let calls = calls.clone();
        move |r: outbox_core::Record| {
            let calls = calls.clone();
            async move {
                calls.lock().unwrap().push((r.key.clone(), r.seq, true));
                tokio::time::sleep(Duration::from_millis(20)).await;
                calls.lock().unwrap().push((r.key.clone(), r.seq, false));
                Ok::<(), HandlerError>(())
            }
        }
    })));
    let (_tx, assignment) = watch::channel(taken_over(me, partition));
    let stop = CancellationToken::new();
    let processor = tokio::spawn(Processor::new(outbox.clone(), db.clone(), handlers, assignment).run(stop.clone()));
    drained(&db, LONG).await;
    stop.cancel();
    processor.await.unwrap().unwrap();

    let calls = calls.lock().unwrap().clone();
    assert_eq!(calls.len(), 2 * (4 + 2 * keys.len()), "{calls:?}");
    let suspect_seqs = rows!(db, (i64,), "SELECT seq FROM {s}completed WHERE key = 'suspect' ORDER BY seq");
    let alone: Vec<_> = suspect_seqs
        .iter()
        .flat_map(|&(seq,)| [("suspect".to_string(), seq, true), ("suspect".to_string(), seq, false)])
        .collect();
    let first = calls.iter().position(|c| c.0 == "suspect").unwrap();
    assert_eq!(calls[first..first + alone.len()], alone[..], "the suspects, alone and in one turn: {calls:?}");
    let counted = rows!(db, (String, i32), "SELECT key, attempts FROM {s}completed ORDER BY key");
    // Delivered, each keeps the attempts it was fetched with: no count was left behind.
    assert!(counted.iter().all(|(key, attempts)| *attempts == i32::from(key == "suspect")), "{counted:?}");
}

/// Ending among a key's suspects (the processor's future dropped in the middle of the third one's call,
/// as the process would end) leaves the two before it delivered, the third counted once more, and the
/// one after it as it was: each suspect's count is written with the outcome of the call before it,
/// just before its own call.
async fn a_process_ending_among_a_keys_suspects_counts_only_the_call_it_ended_in(db: TestDb) {
    let outbox = outbox(&db, |_| {}).await;
    let (me, partition) = own_partition_of(&db, "suspect", Epoch(1)).await;
    commit(&outbox, &db, (0..4).map(|_| NewRecord::new("suspect", "t", "")).collect()).await;
    exec!(db, "UPDATE {s}records SET attempts = 1, last_error = $1", outbox_core::UNFINISHED_CALL);
    let third = rows!(db, (i64,), "SELECT seq FROM {s}records ORDER BY seq")[2].0;
    let (in_third, mut entered) = watch::channel(false);
    let handlers = Handlers::new().default_route(Route::new(handler_fn(move |r: outbox_core::Record| {
        let in_third = in_third.clone();
        async move {
            if r.seq == third {
                in_third.send_replace(true);
                std::future::pending::<()>().await;
            }
            Ok::<(), HandlerError>(())
        }
    })));
    let (_tx, assignment) = watch::channel(taken_over(me, partition));
    let processor =
        tokio::spawn(Processor::new(outbox.clone(), db.clone(), handlers, assignment).run(CancellationToken::new()));
    tokio::time::timeout(LONG, entered.wait_for(|&e| e)).await.expect("the third suspect called").unwrap();
    processor.abort();
    let _ = processor.await;
    assert_eq!(count(&db, "SELECT count(*) FROM {s}completed").await, 2, "the two suspects before it delivered");
    let left = rows!(
        db,
        (i64, i32, bool),
        "SELECT seq, attempts, last_error = $1 FROM {s}records ORDER BY seq",
        outbox_core::UNFINISHED_CALL
    );
    assert_eq!(
        left,
        [(third, 2, true), (third + 1, 1, true)],
        "counted: the call it ended in, once more; not the next"
    );
}

/// A count write the database fences out (the partition has a new owner or epoch) stops the partition
/// under that grant as a fenced completion does: the grant's calls still running are cancelled, not
/// left to run beside the new owner's until the lease ends. Here `b`'s count waits for its turn behind
/// a suspect of another partition, the epoch moves meanwhile, and `a` (scheduled after the takeover,
/// so not counted) is in its call when the count is refused.
async fn a_count_fenced_out_cancels_the_calls_of_its_grant(db: TestDb) {
    let outbox = outbox(&db, |_| {}).await;
    let (p, q) = (partition_of("b"), partition_of("suspect"));
    let a = (0..).map(|i| format!("a-{i}")).find(|k| partition_of(k) == p).unwrap();
    assert_ne!(p, q);
    let me = register_instance(&db).await;
    for partition in [p, q] {
        exec!(db, "UPDATE {s}partitions SET owner = $1, epoch = 1 WHERE partition = $2", me, i16::from(partition));
    }
    commit(&outbox, &db, vec![NewRecord::new("suspect", "t", ""), NewRecord::new("b", "t", "")]).await;
    exec!(
        db,
        "UPDATE {s}records SET attempts = 1, last_error = $1 WHERE key = 'suspect'",
        outbox_core::UNFINISHED_CALL
    );
    tokio::time::sleep(Duration::from_millis(100)).await;
    let takeover = chrono::Utc::now();
    tokio::time::sleep(Duration::from_millis(100)).await;
    commit(&outbox, &db, vec![NewRecord::new(&a, "t", "")]).await;

    let (open, gate) = watch::channel(false);
    let (suspect_called, a_called, a_dropped, b_called) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicBool::new(false)),
    );
    let handlers = Handlers::new().default_route(Route::new(handler_fn({
        let (suspect_called, a_called, a_dropped, b_called) =
            (suspect_called.clone(), a_called.clone(), a_dropped.clone(), b_called.clone());
        let a = a.clone();
        move |r: outbox_core::Record| {
            let mut gate = gate.clone();
            let (suspect_called, a_called, a_dropped, b_called) =
                (suspect_called.clone(), a_called.clone(), a_dropped.clone(), b_called.clone());
            let is_a = r.key == a;
            async move {
                if r.key == "suspect" {
                    suspect_called.store(true, Ordering::SeqCst);
                    gate.wait_for(|&open| open).await.unwrap();
                } else if is_a {
                    a_called.store(true, Ordering::SeqCst);
                    let _dropped = SetOnDrop(a_dropped);
                    std::future::pending::<()>().await;
                } else {
                    b_called.store(true, Ordering::SeqCst);
                }
                Ok::<(), HandlerError>(())
            }
        }
    })));
    let granted = |partitions: &[outbox_core::Partition]| Assignment {
        lease: Some(Deadline::now().after(LONG)),
        taken_over: partitions.iter().map(|&p| (p, takeover)).collect(),
        ..Assignment::new(me, partitions.iter().map(|&p| (p, Epoch(1))).collect())
    };
    // The suspect first, so that it holds every turn when b is fetched.
    let (tx, assignment) = watch::channel(granted(&[q]));
    let stop = CancellationToken::new();
    let processor = tokio::spawn(Processor::new(outbox.clone(), db.clone(), handlers, assignment).run(stop.clone()));
    wait_for("the suspect called", LONG, || async { suspect_called.load(Ordering::SeqCst) }).await;
    tx.send_replace(granted(&[p, q]));
    wait_for("a called", LONG, || async { a_called.load(Ordering::SeqCst) }).await;
    exec!(db, "UPDATE {s}partitions SET epoch = epoch + 1 WHERE partition = $1", i16::from(p));
    open.send_replace(true);
    wait_for("the suspect delivered", LONG, || async {
        count(&db, "SELECT count(*) FROM {s}completed WHERE key = 'suspect'").await == 1
    })
    .await;
    wait_for("a's call cancelled", Duration::from_secs(10), || async { a_dropped.load(Ordering::SeqCst) }).await;
    assert!(!b_called.load(Ordering::SeqCst), "b was called under a fenced grant");
    stop.cancel();
    tokio::time::timeout(LONG, processor).await.expect("the processor stops").unwrap().unwrap();
}

/// Sets its flag when dropped: with a handler's future, when the call is cancelled.
struct SetOnDrop(Arc<AtomicBool>);

impl Drop for SetOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// The in-process sink passes the handler conformance suite (the JetStream handler runs it too).
async fn the_in_process_sink_passes_the_handler_conformance_suite(db: TestDb) {
    let outbox = outbox(&db, |_| {}).await;
    common::conformance::run(&outbox, &db, &common::conformance::InProcess::default()).await;
}

/// When the lease runs out, the handler call in progress is cancelled (its future dropped, though the
/// handler would never return by itself) and the rest of the run (fetched with it) is not handed out:
/// a paused or partitioned worker delivers nothing more. Every record of the run stays pending; with
/// the lease renewed, delivery resumes from the first one.
async fn a_run_stops_at_the_lease_deadline(db: TestDb) {
    let outbox = outbox(&db, |c| c.key_lookahead = 8).await;
    let (me, partition) = own_partition_of(&db, "k", Epoch(3)).await;
    commit(&outbox, &db, (0..3).map(|_| NewRecord::new("k", "t", "")).collect()).await;
    let deadline = Deadline::now().after(Duration::from_millis(300));
    let InCall { sink, release, assignment: tx, mut busy, stop, processor } =
        in_call(&outbox, &db, me, partition, deadline).await;
    // Record 1 is in the handler, which waits for a release that does not come; the deadline passes.
    busy.wait_for(|b| b.is_empty()).await.unwrap();
    assert!(deadline.passed(), "the call ended only because the lease ran out");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(sink.len(), 1, "records 2 and 3 were fetched with record 1 but not handed out");
    assert_eq!(pending(&db).await, 3, "the cancelled record was not completed");

    tx.send_modify(|a| a.lease = Some(Deadline::now().after(LONG)));
    release.add_permits(10);
    drained(&db, LONG).await;
    assert_eq!(sink.ranks_of("k"), [1, 1, 2, 3], "delivered again from the first record");
    stop.cancel();
    processor.await.unwrap().unwrap();
}

/// A call that returns past the lease deadline, before anything else ran (as a process stopped in the
/// middle of a call and resumed would), is followed by no other: the run checks the deadline itself
/// before each call, not only the processor's watch over it (which cancels calls, but had not run yet).
/// Record 1's handler blocks its thread past the deadline; records 2 and 3 are not handed out.
async fn no_call_starts_past_the_lease_deadline_before_the_processor_notices(db: TestDb) {
    let outbox = outbox(&db, |c| c.key_lookahead = 8).await;
    let (me, partition) = own_partition_of(&db, "k", Epoch(3)).await;
    commit(&outbox, &db, (0..3).map(|_| NewRecord::new("k", "t", "")).collect()).await;
    let sink = Sink::new();
    let deadline = Deadline::now().after(Duration::from_millis(500));
    let calls = sink.clone();
    let handlers = Handlers::new().default_route(Route::new(handler_fn(move |r| {
        calls.record(&r);
        // A thread stopped until the lease is over (SIGSTOP, say), then going on: no `.await` between.
        std::thread::sleep(deadline.instant().saturating_duration_since(tokio::time::Instant::now()));
        async { Ok::<(), HandlerError>(()) }
    })));
    let (tx, watched) =
        watch::channel(Assignment { lease: Some(deadline), ..Assignment::new(me, [(partition, Epoch(3))].into()) });
    let stop = CancellationToken::new();
    let processor = tokio::spawn(Processor::new(outbox.clone(), db.clone(), handlers, watched).run(stop.clone()));
    wait_for("record 1 called", LONG, || async { sink.len() >= 1 }).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(deadline.passed());
    assert_eq!(sink.len(), 1, "records 2 and 3 were fetched with record 1 but not handed out");
    tx.send_modify(|a| a.lease = Some(Deadline::now().after(LONG)));
    drained(&db, LONG).await;
    assert_eq!(sink.ranks_of("k"), [1, 2, 3]);
    stop.cancel();
    processor.await.unwrap().unwrap();
}

/// A processor under `me`'s grant of `partition` at epoch 3, its lease ending at `lease`, with a
/// handler call in progress: recorded in `sink`, it waits for a `release` permit.
struct InCall {
    sink: Arc<Sink>,
    release: Arc<Semaphore>,
    assignment: watch::Sender<Assignment>,
    busy: watch::Receiver<std::collections::BTreeSet<outbox_core::Partition>>,
    stop: CancellationToken,
    processor: tokio::task::JoinHandle<outbox_core::Result<()>>,
}

async fn in_call(
    outbox: &outbox_core::Outbox,
    db: &TestDb,
    me: InstanceId,
    partition: outbox_core::Partition,
    lease: Deadline,
) -> InCall {
    let sink = Sink::new();
    let (handlers, Gate { entered, release }) = gated(&sink);
    let (assignment, watched) =
        watch::channel(Assignment { lease: Some(lease), ..Assignment::new(me, [(partition, Epoch(3))].into()) });
    let stop = CancellationToken::new();
    let processor = Processor::new(outbox.clone(), db.clone(), handlers, watched);
    let mut busy = processor.busy_partitions();
    let processor = tokio::spawn(processor.run(stop.clone()));
    entered.acquire().await.unwrap().forget();
    busy.wait_for(|b| !b.is_empty()).await.unwrap();
    InCall { sink, release, assignment, busy, stop, processor }
}

/// An instance declared dead registers again under a new id. The call it was running under the old id
/// is cancelled at once, even when the processor sees only the new assignment and its lease has not
/// run out here: another instance may already be delivering that partition.
async fn calls_of_an_instance_declared_dead_are_cancelled_under_its_new_id(db: TestDb) {
    cancelled_under_a_new_id(db, false).await;
}

/// The same for a call of a partition being handed over: the handover lets it finish, forgetting its
/// handle, but the instance is then declared dead (its lease ended early by database time) and the
/// processor sees only its new id: the next owner may take the partition once it is quiet, so the call
/// is cancelled all the same. Before, it ran on until it ended or timed out.
async fn a_call_being_handed_over_is_cancelled_when_its_instance_is_declared_dead(db: TestDb) {
    cancelled_under_a_new_id(db, true).await;
}

/// A call in progress, its partition first `handed_over` or not, then the processor's instance
/// registered again: the call is cancelled and its record left pending.
async fn cancelled_under_a_new_id(db: TestDb, handed_over: bool) {
    let outbox = outbox(&db, |_| {}).await;
    let (me, partition) = own_partition_of(&db, "k", Epoch(3)).await;
    commit(&outbox, &db, vec![NewRecord::new("k", "t", "")]).await;
    let lease = Deadline::now().after(LONG);
    let InCall { assignment: tx, mut busy, stop, processor, .. } = in_call(&outbox, &db, me, partition, lease).await;
    if handed_over {
        tx.send_replace(Assignment { lease: Some(lease), ..Assignment::new(me, Default::default()) });
        // Time for the processor to take in the handover on its own, not with the new id.
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(!busy.borrow().is_empty(), "a handover lets the call finish");
    }
    let again = register_instance(&db).await;
    tx.send_replace(Assignment { lease: Some(lease), ..Assignment::new(again, Default::default()) });
    tokio::time::timeout(Duration::from_secs(10), busy.wait_for(|b| b.is_empty()))
        .await
        .expect("the call under the old id was not cancelled")
        .unwrap();
    assert_eq!(pending(&db).await, 1, "the cancelled record was not completed");
    stop.cancel();
    processor.await.unwrap().unwrap();
}

/// A completion batch the database refuses for good is written one outcome at a time. When a key's
/// first outcome is then refused for the moment, its later outcomes wait with it and the key stays in
/// flight: its first record is not fetched and delivered again after the later ones.
#[sqlx::test(migrations = false)]
async fn a_key_waits_for_its_outcome_left_to_retry(pool: sqlx::PgPool) {
    completes_despite_refusals(TestDb::postgres(pool), &["P0001", "40001"]).await;
}

/// A completion cut short by `lock_timeout` or `statement_timeout` is retried: the delivered record is
/// completed, never written as FAILED.
#[sqlx::test(migrations = false)]
async fn a_completion_that_timed_out_is_retried(pool: sqlx::PgPool) {
    completes_despite_refusals(TestDb::postgres(pool), &["55P03", "57014"]).await;
}

/// A database that takes no writes for a while (a primary turned read-only, a pool's connections now
/// on a standby after a failover: SQLSTATE 25006) is waited out: the delivered record is completed,
/// not written as FAILED once writes come back.
#[sqlx::test(migrations = false)]
async fn a_read_only_database_is_waited_out(pool: sqlx::PgPool) {
    completes_despite_refusals(TestDb::postgres(pool), &["25006", "25006", "25006"]).await;
}

/// An outcome the database rejects in its batch and alone, whose FAILED stand-in it rejects as well, is
/// tried again as it was: FAILED is written in its place only when the database takes writes and
/// rejects the outcome itself, never for a record whose handler succeeded and whose write met a
/// passing refusal.
#[sqlx::test(migrations = false)]
async fn an_outcome_is_retried_as_it_was_when_its_failed_stand_in_is_refused_too(pool: sqlx::PgPool) {
    completes_despite_refusals(TestDb::postgres(pool), &["P0001", "P0001", "P0001"]).await;
}

/// Three records of key `k` are delivered once each, in order, and completed, none written FAILED,
/// though the first record's writes were refused with `codes` one after another (see
/// [`refuse_completing`]).
async fn completes_despite_refusals(db: TestDb, codes: &[&str]) {
    let (sink, refusals) = refuse_completing(&db, codes).await;
    let refused = i64::try_from(codes.len()).unwrap();
    assert!(refusals > refused, "the first record's writes were refused {codes:?}, then written ({refusals} seen)");
    assert_eq!(sink.ranks_of("k"), [1, 2, 3], "delivered once each, in order");
    assert_eq!(failed_count(&db).await, 0, "FAILED written for a record whose handler succeeded ({codes:?})");
    assert_eq!(count(&db, "SELECT count(*) FROM {s}completed WHERE outcome = 'delivered'").await, 3);
}

/// Delivers three records of key `k` while a trigger refuses the first record's delete or update (its
/// completion, or FAILED written in its place) with SQLSTATE `codes[0]`, then `codes[1]` and so on, then
/// lets it through. Returns the deliveries and how often the trigger saw that record written.
async fn refuse_completing(db: &TestDb, codes: &[&str]) -> (Arc<Sink>, i64) {
    logs();
    let outbox = outbox(db, |_| {}).await;
    let scheduled = commit(&outbox, db, (0..3).map(|_| NewRecord::new("k", "t", "")).collect()).await;
    refuse_writes_of(db, scheduled[0].id, codes).await;
    let sink = Sink::new();
    let node = start(&outbox, db, recording(&sink)).await;
    drained(db, LONG).await;
    node.shutdown().await.unwrap();
    (sink, db.scalar("SELECT last_value FROM {s}refusals", &[]).await)
}

/// A trigger that refuses record `id`'s delete or update with SQLSTATE `codes[0]`, then `codes[1]` and
/// so on, then lets it through.
async fn refuse_writes_of(db: &TestDb, id: uuid::Uuid, codes: &[&str]) {
    let refusals: String = (1..)
        .zip(codes)
        .map(|(n, code)| format!("WHEN {n} THEN RAISE EXCEPTION 'refused' USING ERRCODE = '{code}';\n"))
        .collect();
    db.exec("CREATE SEQUENCE {s}refusals", &[]).await;
    db.exec(
        &format!(
            "CREATE FUNCTION {{s}}refuse() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                IF OLD.id = '{id}' THEN
                    CASE nextval('outbox.refusals')
                        {refusals}
                        ELSE NULL;
                    END CASE;
                END IF;
                RETURN CASE TG_OP WHEN 'DELETE' THEN OLD ELSE NEW END;
            END $$"
        ),
        &[],
    )
    .await;
    db.exec(
        "CREATE TRIGGER refuse BEFORE DELETE OR UPDATE ON {s}records FOR EACH ROW EXECUTE FUNCTION {s}refuse()",
        &[],
    )
    .await;
}

/// A key's first record whose completion the database refuses for good is written FAILED in its
/// outcome's place; the key's later records, delivered in the same run, stay pending behind it and are
/// delivered again after it once it is requeued. Completed, as they were, the requeue delivered the
/// first record after them.
#[sqlx::test(migrations = false)]
async fn records_after_one_written_failed_in_its_outcomes_place_wait_behind_it(pool: sqlx::PgPool) {
    logs();
    let db = TestDb::postgres(pool);
    let outbox = outbox(&db, |_| {}).await;
    let scheduled = commit(&outbox, &db, (0..3).map(|_| NewRecord::new("k", "t", "")).collect()).await;
    // Its batch refused, then the record alone: FAILED goes through.
    refuse_writes_of(&db, scheduled[0].id, &["P0001", "P0001"]).await;
    let sink = Sink::new();
    let node = start(&outbox, &db, recording(&sink)).await;
    wait_for("the first record FAILED", LONG, || async { failed_count(&db).await == 1 }).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(sink.ranks_of("k"), [1, 2, 3], "delivered once each, in order");
    assert_eq!(pending(&db).await, 3, "the later records stay pending behind the FAILED one");
    outbox.requeue(&db, scheduled[0].id).await.unwrap();
    drained(&db, LONG).await;
    node.shutdown().await.unwrap();
    assert_eq!(sink.ranks_of("k"), [1, 2, 3, 1, 2, 3], "delivered again in order after the requeue");
}

/// Calls counted before they are made (in partitions taken over from an owner whose lease ran out) are
/// counted in a smaller write after one given up at its time limit: fetched again at the same size,
/// the records met the same limit in a loop and none was ever delivered. Here a write counting more
/// than 50 calls takes 2 s against a `query_timeout` of 1 s.
#[sqlx::test(migrations = false)]
async fn calls_counted_past_the_time_limit_are_counted_fewer_at_a_time(pool: sqlx::PgPool) {
    logs();
    let db = TestDb::postgres(pool);
    let outbox = outbox(&db, |c| c.query_timeout = Duration::from_secs(1)).await;
    commit(&outbox, &db, (0..400).map(|i| NewRecord::new(format!("k-{i}"), "t", "")).collect()).await;
    exec!(
        db,
        "CREATE FUNCTION {s}slow_counts() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF (SELECT count(*) FROM counted WHERE last_error LIKE 'the handler call did not finish%') > 50 THEN
                 PERFORM pg_sleep(2);
             END IF;
             RETURN NULL;
         END $$"
    );
    exec!(
        db,
        "CREATE TRIGGER slow_counts AFTER UPDATE ON {s}records REFERENCING NEW TABLE AS counted
         FOR EACH STATEMENT EXECUTE FUNCTION {s}slow_counts()"
    );
    let dead = register_instance(&db).await;
    exec!(db, "UPDATE {s}instances SET expires_at = {ago:60} WHERE id = $1", dead);
    exec!(db, "UPDATE {s}partitions SET owner = $1", dead);
    let sink = Sink::new();
    let node = start(&outbox, &db, recording(&sink)).await;
    drained(&db, LONG).await;
    node.shutdown().await.unwrap();
    assert_eq!(sink.len(), 400);
}

/// An outcome the database refuses for good, and its FAILED as well (here a trigger on that row), is
/// retried on its own: another key's outcome is written meanwhile, not held back until the refused
/// one's next try. It waited for it (its backoff grows to 5 s), and was then written in a batch with
/// it, refused whole and written again one outcome at a time.
#[sqlx::test(migrations = false)]
async fn an_outcome_the_database_keeps_refusing_holds_back_no_other_key(pool: sqlx::PgPool) {
    logs();
    let db = TestDb::postgres(pool);
    let outbox = outbox(&db, |_| {}).await;
    refuse_until_the_gate_opens(&db, "DELETE OR UPDATE", "OLD.key = 'refused'", "P0001").await;
    commit(&outbox, &db, vec![NewRecord::new("refused", "t", "")]).await;
    let sink = Sink::new();
    let node = start(&outbox, &db, recording(&sink)).await;
    // Five tries, three refusals each (the batch, the outcome alone, its FAILED): the next is 3 s away.
    wait_for("five tries refused", LONG, || async { refusals(&db).await >= 15 }).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let before = refusals(&db).await;
    let other = commit(&outbox, &db, vec![NewRecord::new("other", "t", "")]).await;
    // Woken, not left to the next poll (5 s apart while the processor listens).
    outbox.wake(&db, &other).await.unwrap();
    wait_for("the other key's record completed", LONG, || async {
        db.scalar::<i64>("SELECT count(*) FROM {s}records WHERE key = 'other'", &[]).await == 0
    })
    .await;
    assert_eq!(refusals(&db).await, before, "the other key's outcome waited for the refused one's next try");
    open_the_gate(&db).await;
    drained(&db, LONG).await;
    node.shutdown().await.unwrap();
    assert_eq!(sink.of_key("refused").len(), 1, "delivered once, its outcome retried");
}

/// An outcome of this instance's earlier grant of a partition, still waiting to be written when the
/// instance registered again and got the partition back at a new epoch, is fenced out, even batched
/// with an outcome of the new grant: its record is delivered again under the new grant instead of
/// being completed by the old one.
#[sqlx::test(migrations = false)]
async fn an_outcome_of_an_earlier_grant_is_fenced_beside_one_of_the_current_grant(pool: sqlx::PgPool) {
    logs();
    let db = TestDb::postgres(pool);
    let outbox = outbox(&db, |_| {}).await;
    let (old, partition) = own_partition_of(&db, "k1", Epoch(3)).await;
    let neighbour = (0..).map(|i| format!("k2-{i}")).find(|k| partition_of(k) == partition).unwrap();
    commit(&outbox, &db, vec![NewRecord::new("k1", "t", "")]).await;
    // k1's completion is refused (for the moment) until the gate opens.
    refuse_until_the_gate_opens(&db, "DELETE", "OLD.key = 'k1'", "40001").await;

    let sink = Sink::new();
    let lease = Some(Deadline::now().after(LONG));
    let (tx, assignment) = watch::channel(Assignment { lease, ..Assignment::new(old, [(partition, Epoch(3))].into()) });
    let stop = CancellationToken::new();
    let processor =
        tokio::spawn(Processor::new(outbox.clone(), db.clone(), recording(&sink), assignment).run(stop.clone()));
    let refused = || async { refusals(&db).await > 1 };
    wait_for("k1 delivered and its completion refused", LONG, refused).await;

    // Declared dead, the instance registers again and gets the partition back at epoch 5.
    let again = register_instance(&db).await;
    exec!(db, "UPDATE {s}partitions SET owner = $1, epoch = 5 WHERE partition = $2", again, i16::from(partition));
    tx.send_replace(Assignment { lease, ..Assignment::new(again, [(partition, Epoch(5))].into()) });
    commit(&outbox, &db, vec![NewRecord::new(neighbour.clone(), "t", "")]).await;
    wait_for("the neighbour delivered", LONG, || async { sink.of_key(&neighbour).len() == 1 }).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    open_the_gate(&db).await;
    drained(&db, LONG).await;
    stop.cancel();
    processor.await.unwrap().unwrap();
    let epochs: Vec<Epoch> = sink.of_key("k1").iter().map(|d| d.epoch).collect();
    assert_eq!(epochs, [Epoch(3), Epoch(5)], "k1 completed only under the current grant");
    assert_eq!(failed_count(&db).await, 0);
}

/// A panic while deciding what a failure means (here in the error's `Display`) is a retryable failure
/// under the route's policy, and ends FAILED once its retries run out: never retried for ever.
async fn a_panic_in_the_decision_ends_failed_once_retries_run_out(db: TestDb) {
    #[derive(Debug)]
    struct Unprintable;
    impl std::fmt::Display for Unprintable {
        fn fmt(&self, _: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            panic!("an error that cannot be printed")
        }
    }
    impl std::error::Error for Unprintable {}

    let outbox = outbox(&db, |_| {}).await;
    let calls = Sink::new();
    let c = calls.clone();
    let handler = handler_fn(move |r| {
        let c = c.clone();
        async move {
            c.record(&r);
            Err::<(), _>(HandlerError::retryable(Unprintable))
        }
    });
    let route = Route::new(handler).retry(RetryPolicy::fixed(Duration::from_millis(5), 2)).unwrap();
    commit(&outbox, &db, vec![NewRecord::new("k", "t", "")]).await;
    let node = start(&outbox, &db, Handlers::new().default_route(route)).await;
    wait_failed(&db, 1).await;
    node.shutdown().await.unwrap();
    assert_eq!(calls.len(), 3, "the first call and two retries");
    let error: String = db.scalar("SELECT last_error FROM {s}records", &[]).await;
    assert!(error.contains("delivery panicked") && error.contains("cannot be printed"), "{error}");
}

/// A skip that meets a requeue in progress leaves the record to the requeue: nothing of it goes to
/// `completed`. On MySQL the copy was made before the delete found the record requeued; the record's own
/// completion then hit the copy's primary key, and the delivered record ended FAILED.
async fn a_skip_that_meets_a_requeue_leaves_the_record_to_it(db: TestDb) {
    let outbox = outbox(&db, hourly).await;
    let id = commit(&outbox, &db, vec![NewRecord::new("k", "t", "")]).await[0].id;
    exec!(db, "UPDATE {s}records SET failed_at = {now} WHERE id = $1", id);
    let mut requeue = db.begin().await;
    let sql = db.sql("UPDATE {s}records SET failed_at = NULL, requeues = requeues + 1 WHERE id = $1");
    requeue.execute(sqlx::AssertSqlSafe(sql), &[id.into()]).await.unwrap();
    let skip = {
        let (outbox, db) = (outbox.clone(), db.clone());
        tokio::spawn(async move { outbox.skip(&db, id).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    requeue.commit().await.unwrap();
    let err = skip.await.unwrap().unwrap_err();
    assert!(matches!(err, Error::RecordNotFound { .. }), "{err:?}");
    assert_eq!(count(&db, "SELECT count(*) FROM {s}completed").await, 0);
    deliver_all(&outbox, &db).await;
    assert_eq!(count(&db, "SELECT count(*) FROM {s}completed").await, 1);
    assert_eq!(failed_count(&db).await, 0);
}
