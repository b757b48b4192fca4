//! Operator views and maintenance: backlog per partition, oldest pending age, bounded purge.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[macro_use]
mod common;

use std::time::Duration;

use common::*;
use outbox_cluster::{ClusterConfig, Node};
use outbox_core::operator::FailedFilter;
use outbox_core::{Completion, Config, Error, Handlers, NewRecord, Route, Value, handler_fn, partition_of};

const LONG: Duration = Duration::from_secs(60);

every_backend!(
    stats_count_pending_and_failed_per_partition_with_the_oldest_age,
    purge_deletes_only_expired_completed_records_in_bounded_batches,
    a_stop_ends_a_purge_pass_under_way,
    only_the_leader_purges_at_its_own_retention,
    delete_on_complete_keeps_no_completed_rows,
    operator_calls_refuse_bad_keys_and_limits_with_typed_errors,
);

// Row and table locks other sessions hold: a server's (SQLite has one writer at a time).
on_backends!(
    [postgres, mysql]
    a_requeue_waiting_for_a_row_holds_up_no_writer,
    operator_calls_given_up_by_their_caller_give_their_connection_up,
);

async fn stats_count_pending_and_failed_per_partition_with_the_oldest_age(db: TestDb) {
    let outbox = outbox(&db, |_| {}).await;
    commit(
        &outbox,
        &db,
        vec![NewRecord::new("a", "t", ""), NewRecord::new("a", "t", ""), NewRecord::new("b", "t", "")],
    )
    .await;
    exec!(db, "UPDATE {s}records SET created_at = {ago:90} WHERE key = 'a' AND seq = 1");
    exec!(db, "UPDATE {s}records SET failed_at = {now} WHERE key = 'b'");
    let stats = outbox.stats(&db).await.unwrap();
    let a = stats.iter().find(|s| s.partition == partition_of("a")).unwrap();
    assert_eq!((a.pending, a.failed), (2, 0));
    assert!(a.oldest_pending.unwrap() >= Duration::from_secs(90));
    let b = stats.iter().find(|s| s.partition == partition_of("b")).unwrap();
    assert_eq!((b.pending, b.failed, b.oldest_pending), (0, 1, None));
    let totals = outbox_core::operator::BacklogTotals::of(&stats);
    assert_eq!((totals.pending, totals.scheduled, totals.failed), (2, 0, 1));
    assert_eq!(totals.oldest_pending, a.oldest_pending, "the oldest over every partition");
}

async fn purge_deletes_only_expired_completed_records_in_bounded_batches(db: TestDb) {
    let outbox = outbox(&db, |_| {}).await;
    commit(&outbox, &db, (0..25).map(|i| NewRecord::new(format!("k{i}"), "t", "")).collect()).await;
    deliver_all(&outbox, &db).await;
    assert_eq!(count(&db, "SELECT count(*) FROM {s}completed").await, 25);
    exec!(db, "UPDATE {s}completed SET completed_at = {ago:7200} WHERE key < 'k2'");
    let expired = count(&db, "SELECT count(*) FROM {s}completed WHERE key < 'k2'").await;
    assert_eq!(expired, 12); // k0, k1, k10..k19
    assert_eq!(outbox.purge_completed(&db, Duration::from_secs(3600), 5).await.unwrap(), 12);
    assert_eq!(count(&db, "SELECT count(*) FROM {s}completed").await, 13);
    assert_eq!(outbox.purge_completed(&db, Duration::from_secs(3600), 5).await.unwrap(), 0);
}

/// A stop ends a purge pass under way (its statement is dropped), not at the end of the pass: a
/// stopping node waits for its background tasks before it hands its partitions over, and its lease may
/// run out meanwhile.
/// Before, a pass over a backlog of completed records ran to its end (here 2,000 statements).
async fn a_stop_ends_a_purge_pass_under_way(db: TestDb) {
    let outbox = outbox(&db, |c| {
        c.completed_retention = Duration::ZERO;
        c.purge_batch_size = 1;
    })
    .await;
    commit(&outbox, &db, (0..2_000).map(|i| NewRecord::new(format!("k{i}"), "t", "")).collect()).await;
    deliver_all(&outbox, &db).await;
    exec!(db, "UPDATE {s}completed SET completed_at = {ago:60}");
    let stop = tokio_util::sync::CancellationToken::new();
    let leads = tokio::sync::watch::channel(true).1;
    let purging = tokio::spawn(outbox.clone().run_purge(db.db.clone(), leads, stop.clone()));
    wait_for("the purge under way", Duration::from_secs(30), || async {
        count(&db, "SELECT count(*) FROM {s}completed").await < 2_000
    })
    .await;
    stop.cancel();
    tokio::time::timeout(Duration::from_secs(60), purging).await.expect("the purge ended").unwrap();
    let left = count(&db, "SELECT count(*) FROM {s}completed").await;
    assert!(left > 0, "the pass went on to its end after the stop");
}

/// Only the leader purges, at its own retention: a second node whose retention would purge every
/// completed record at once purges none while the first leads, and all of them once it leads. Before,
/// every node purged and pruned key rows (a read of the whole backlog) each `purge_interval`: a cluster
/// of N did the work N times, and each at its own retention.
async fn only_the_leader_purges_at_its_own_retention(db: TestDb) {
    let tune = |retention| {
        move |c: &mut Config| {
            c.completed_retention = retention;
            c.purge_interval = Duration::from_millis(50);
        }
    };
    let keeps = outbox(&db, tune(Duration::from_secs(3600))).await;
    let purges = outbox(&db, tune(Duration::ZERO)).await;
    commit(&keeps, &db, (0..10).map(|i| NewRecord::new(format!("k{i}"), "t", "")).collect()).await;
    let ok = || Handlers::new().default_route(Route::new(handler_fn(|_| async { Ok(()) })));
    // Leases long enough that no stall of a loaded machine makes the first register again (and so
    // lose the lead to the second, whose id is older).
    let config = || ClusterConfig { stale_timeout: Duration::from_secs(10), ..fast_cluster() };
    let leader = Node::start(keeps.clone(), &db, ok(), config()).await.unwrap();
    drained(&db, LONG).await;
    let follower = Node::start(purges.clone(), &db, ok(), config()).await.unwrap();
    let owns = "SELECT count(*) FROM {s}partitions WHERE owner = $1";
    let id = follower.id();
    wait_for("the second node's share", LONG, || async { db.scalar::<i64>(owns, &[Value::from(id)]).await == 128 })
        .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(count(&db, "SELECT count(*) FROM {s}completed").await, 10, "purged by a node that does not lead");
    leader.shutdown().await.unwrap();
    wait_for("the purge of the next leader", LONG, || async {
        count(&db, "SELECT count(*) FROM {s}completed").await == 0
    })
    .await;
    follower.shutdown().await.unwrap();
}

/// A requeue of a key, or of everything, that waits for a row another transaction holds (here the
/// FAILED record of another key, as a skip holds it) keeps no other row locked meanwhile: a producer's
/// schedule goes on. On MySQL both ran at the server's REPEATABLE READ and chose their rows by
/// scanning the table, so every row read, and the gaps between them, stayed locked while they waited:
/// schedules and completions waited as long. SQLite has one writer at a time.
async fn a_requeue_waiting_for_a_row_holds_up_no_writer(db: TestDb) {
    let outbox = outbox(&db, |_| {}).await;
    for requeue_all in [false, true] {
        commit(&outbox, &db, ["a", "b", "c"].map(|k| NewRecord::new(k, "t", "")).to_vec()).await;
        exec!(db, "UPDATE {s}records SET failed_at = {now} WHERE key IN ('a', 'b')");
        let b: uuid::Uuid = db.scalar(&db.sql("SELECT id FROM {s}records WHERE key = 'b'"), &[]).await;
        let holder = db.holding("SELECT id FROM {s}records WHERE id = $1 FOR UPDATE", &[b.into()]).await;
        let requeue = tokio::spawn({
            let (outbox, db) = (outbox.clone(), db.db.clone());
            async move { if requeue_all { outbox.requeue_all(&db).await } else { outbox.requeue_key(&db, "a").await } }
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        let scheduled = tokio::time::timeout(Duration::from_secs(3), async {
            let mut tx = db.begin().await;
            outbox.schedule(&mut tx, NewRecord::new("d", "t", "")).await.unwrap();
            tx.commit().await.unwrap();
        })
        .await;
        holder.commit().await.unwrap();
        let requeued = requeue.await.unwrap().unwrap();
        assert!(scheduled.is_ok(), "requeue_all {requeue_all}: a schedule waited behind the requeue");
        assert_eq!(requeued, if requeue_all { 2 } else { 1 }, "requeue_all {requeue_all}");
        exec!(db, "DELETE FROM {s}records");
    }
}

async fn delete_on_complete_keeps_no_completed_rows(db: TestDb) {
    let outbox = outbox(&db, |c| c.completion = Completion::Delete).await;
    commit(&outbox, &db, (0..10).map(|i| NewRecord::new(format!("k{i}"), "t", "")).collect()).await;
    deliver_all(&outbox, &db).await;
    assert_eq!(count(&db, "SELECT count(*) FROM {s}completed").await, 0);
    assert_eq!(pending(&db).await, 0);
}

/// Keys no record can have and page sizes out of range are typed errors before any statement (a NUL
/// reached PostgreSQL as an untyped error; a negative limit listed every FAILED record on SQLite).
async fn operator_calls_refuse_bad_keys_and_limits_with_typed_errors(db: TestDb) {
    let outbox = outbox(&db, |_| {}).await;
    commit(&outbox, &db, (0..3).map(|i| NewRecord::new(format!("k{i}"), "t", "")).collect()).await;
    exec!(db, "UPDATE {s}records SET failed_at = {now}");
    for limit in [-1, 0, outbox_core::operator::MAX_FAILED_PAGE + 1] {
        let filter = FailedFilter { limit: Some(limit), ..FailedFilter::default() };
        let err = outbox.failed(&db, &filter).await.unwrap_err();
        assert!(matches!(err, Error::BadLimit { .. }), "limit {limit}: {err}");
    }
    let filter = FailedFilter { key: Some("k\0".into()), ..FailedFilter::default() };
    assert!(matches!(outbox.failed(&db, &filter).await.unwrap_err(), Error::BadKey { .. }));
    assert!(matches!(outbox.requeue_key(&db, "k\0").await.unwrap_err(), Error::BadKey { .. }));
    assert!(matches!(outbox.requeue_key(&db, "").await.unwrap_err(), Error::EmptyKey));
    let filter = FailedFilter { limit: Some(2), ..FailedFilter::default() };
    assert_eq!(outbox.failed(&db, &filter).await.unwrap().len(), 2);
    assert_eq!(failed_count(&db).await, 3, "nothing changed");
}

/// Operator calls given up by their caller (the operator page's time limit, a cancelled request) give
/// their pooled connection up with them, and end on the server. Before, each one waiting for a table
/// lock (maintenance, a migration) kept its place in the pool until the lock went: each refresh of the
/// operator page took one more, until the application's own statements and the workers' completions
/// waited for a connection.
async fn operator_calls_given_up_by_their_caller_give_their_connection_up(db: TestDb) {
    let outbox = outbox(&db, |c| c.query_timeout = Duration::from_secs(1)).await;
    let options = outbox_core::ConnectOptions { max_connections: 2, acquire_timeout: Duration::from_secs(5) };
    let small = db.db.new_pool(&options).await.unwrap();
    let maintenance = db.lock_table("records").await;
    let id = uuid::Uuid::now_v7();
    let limit = Duration::from_millis(300);
    for _ in 0..2 {
        assert!(tokio::time::timeout(limit, outbox.stats(&small)).await.is_err(), "stats waited for the lock");
        assert!(tokio::time::timeout(limit, outbox.failed(&small, &FailedFilter::default())).await.is_err());
        assert!(tokio::time::timeout(limit, outbox.requeue(&small, id)).await.is_err());
        assert!(tokio::time::timeout(limit, outbox.skip(&small, id)).await.is_err());
    }
    // They end on the server too: PostgreSQL's waits at `query_timeout` (a closed connection goes on
    // waiting there), MySQL's when their connections close.
    wait_for("the calls given up ended on the server", LONG, || async { db.table_lock_waiters().await == 0 }).await;
    let answered = small.fetch_one::<(i32,)>(sqlx::AssertSqlSafe("SELECT 1"), &[]).await;
    maintenance.release().await;
    assert!(answered.is_ok(), "the pool had no connection left: {answered:?}");
}
