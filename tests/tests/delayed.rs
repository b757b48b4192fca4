//! Delayed delivery: a record scheduled for later is handed to no handler before its time (database
//! time), holds back its key's later records with stop-on-first-failure and lets them go ahead without,
//! and is counted apart in `stats` until its time comes.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[macro_use]
mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use outbox_core::{Handlers, NewRecord, Outbox, Record, Route, handler_fn, partition_of};

every_backend!(
    a_delayed_record_waits_for_its_time_and_holds_back_its_key,
    without_stop_on_first_failure_later_records_go_ahead_of_a_delayed_one,
    a_time_already_past_is_at_once_and_an_absolute_time_is_kept,
    stats_count_records_scheduled_for_later_apart,
    a_wake_up_delivers_a_delayed_record_when_it_falls_due,
    a_wake_up_for_many_later_times_delivers_each_record_when_it_falls_due,
    a_delay_counts_from_the_call_not_from_the_transaction_start,
);

/// On PostgreSQL the wake-up of a producer in another process (another `Outbox`) carries the wait too.
#[sqlx::test(migrations = false)]
async fn a_wake_up_through_notify_delivers_a_delayed_record_when_it_falls_due(pool: sqlx::PgPool) {
    let db = TestDb::postgres(pool);
    let (producer, consumer) = (outbox(&db, |_| {}).await, outbox(&db, hourly).await);
    wakes_when_due(&db, &producer, &consumer).await;
}

const DELAY: Duration = Duration::from_millis(800);

/// Polls every 50 ms, also while listening: the producers here do not wake the processor.
fn polling(c: &mut outbox_core::Config) {
    c.poll_interval = Duration::from_millis(50);
    c.listen_poll_interval = Duration::from_millis(50);
}

/// Every record a handler was called with, and when.
#[derive(Default)]
struct Calls(Mutex<Vec<(Record, Instant)>>);

impl Calls {
    fn handlers(self: &Arc<Self>) -> Handlers {
        let calls = self.clone();
        Handlers::new().default_route(Route::new(handler_fn(move |r: Record| {
            let calls = calls.clone();
            async move {
                calls.0.lock().unwrap().push((r, Instant::now()));
                Ok(())
            }
        })))
    }

    /// `(payload, called at)` in call order.
    fn all(&self) -> Vec<(String, Instant)> {
        let calls = self.0.lock().unwrap();
        calls.iter().map(|(r, at)| (String::from_utf8_lossy(&r.payload).into_owned(), *at)).collect()
    }

    fn at(&self, payload: &str) -> Instant {
        self.all().into_iter().find(|(p, _)| p == payload).unwrap_or_else(|| panic!("{payload} not delivered")).1
    }

    fn record(&self, payload: &str) -> Record {
        let calls = self.0.lock().unwrap();
        calls.iter().find(|(r, _)| r.payload == payload.as_bytes()).unwrap().0.clone()
    }
}

/// Runs a node of an outbox polling every 50 ms (and tuned by `tune`) until `records`, committed in one
/// transaction once it runs, are delivered; the calls, and when the transaction began.
async fn deliver(
    db: &TestDb,
    tune: impl FnOnce(&mut outbox_core::Config),
    records: Vec<NewRecord>,
) -> (Arc<Calls>, Instant) {
    let outbox = outbox(db, |c| {
        polling(c);
        tune(c);
    })
    .await;
    let calls = Arc::new(Calls::default());
    let node = start(&outbox, db, calls.handlers()).await;
    let before = Instant::now();
    commit(&outbox, db, records).await;
    drained(db, Duration::from_secs(30)).await;
    node.shutdown().await.unwrap();
    (calls, before)
}

/// With stop-on-first-failure (the default), a record delayed by `DELAY` is delivered no earlier than
/// that after its transaction began, the key's next record only after it, and another key at once.
async fn a_delayed_record_waits_for_its_time_and_holds_back_its_key(db: TestDb) {
    let records = vec![
        NewRecord::new("k", "t", "delayed").deliver_after(DELAY),
        NewRecord::new("k", "t", "next"),
        NewRecord::new("other", "t", "other"),
    ];
    let (calls, before) = deliver(&db, |_| {}, records).await;
    let order: Vec<String> = calls.all().into_iter().map(|(p, _)| p).collect();
    assert_eq!(order, ["other", "delayed", "next"], "{order:?}");
    assert!(calls.at("delayed") >= before + DELAY, "delivered {:?} after", calls.at("delayed") - before);
    assert!(calls.at("other") < before + DELAY, "another key is not held back");
    let delayed = calls.record("delayed");
    let deliver_at = delayed.deliver_at.expect("the record carries its delivery time");
    assert!(deliver_at - delayed.created_at >= chrono::Duration::from_std(DELAY).unwrap());
    assert_eq!((delayed.attempts, calls.record("next").deliver_at), (0, None));
}

async fn without_stop_on_first_failure_later_records_go_ahead_of_a_delayed_one(db: TestDb) {
    let records = vec![NewRecord::new("k", "t", "delayed").deliver_after(DELAY), NewRecord::new("k", "t", "next")];
    let (calls, before) = deliver(&db, |c| c.stop_on_first_failure = false, records).await;
    let order: Vec<String> = calls.all().into_iter().map(|(p, _)| p).collect();
    assert_eq!(order, ["next", "delayed"]);
    assert!(calls.at("delayed") >= before + DELAY);
    assert!(calls.at("next") < before + DELAY);
}

/// `deliver_at` a time already past delivers at once (and records no delivery time); a future one is
/// kept, in a batch that mixes both.
async fn a_time_already_past_is_at_once_and_an_absolute_time_is_kept(db: TestDb) {
    // `start + DELAY` comes no later than the future record's time.
    let start = Instant::now();
    let now = chrono::Utc::now();
    let records = vec![
        NewRecord::new("a", "t", "past").deliver_at(now - chrono::Duration::hours(1)),
        NewRecord::new("b", "t", "future").deliver_at(now + chrono::Duration::from_std(DELAY).unwrap()),
    ];
    let (calls, before) = deliver(&db, |_| {}, records).await;
    assert!(calls.at("past") < before + DELAY);
    assert_eq!(calls.record("past").deliver_at, None);
    assert!(calls.at("future") >= start + DELAY);
    // Kept to the millisecond, never brought forward (the asked time has nanoseconds).
    let (kept, asked) = (calls.record("future").deliver_at.unwrap(), now + chrono::Duration::from_std(DELAY).unwrap());
    assert!(kept >= asked && kept - asked < chrono::Duration::milliseconds(1), "kept {kept}, asked {asked}");
}

/// `stats` counts records scheduled for later apart from the pending backlog, and their wait does not
/// age the backlog; once their time has come they are pending, aged from that time.
async fn stats_count_records_scheduled_for_later_apart(db: TestDb) {
    let outbox = outbox(&db, |_| {}).await;
    commit(
        &outbox,
        &db,
        vec![
            NewRecord::new("a", "t", "").deliver_after(Duration::from_secs(3600)),
            NewRecord::new("a", "t", ""),
            NewRecord::new("b", "t", "").deliver_after(Duration::from_millis(300)),
        ],
    )
    .await;
    let stats = outbox.stats(&db).await.unwrap();
    let a = stats.iter().find(|s| s.partition == partition_of("a")).unwrap();
    assert_eq!((a.pending, a.scheduled, a.failed), (1, 1, 0));
    assert!(a.oldest_pending.unwrap() < Duration::from_secs(60));
    let b = stats.iter().find(|s| s.partition == partition_of("b")).unwrap();
    assert_eq!((b.pending, b.scheduled, b.oldest_pending), (0, 1, None));
    tokio::time::sleep(Duration::from_millis(400)).await;
    let stats = outbox.stats(&db).await.unwrap();
    let b = stats.iter().find(|s| s.partition == partition_of("b")).unwrap();
    assert_eq!((b.pending, b.scheduled), (1, 0));
    assert!(b.oldest_pending.unwrap() < Duration::from_millis(400), "{:?}", b.oldest_pending);
}

/// A delay counts from the call that schedules the record, not from its transaction's start: a record
/// scheduled for a second later, a second and a half into its transaction, is still waiting when the
/// transaction commits.
async fn a_delay_counts_from_the_call_not_from_the_transaction_start(db: TestDb) {
    let outbox = outbox(&db, |_| {}).await;
    let mut tx = db.begin().await;
    tx.execute("SELECT 1", &[]).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    outbox.schedule(&mut tx, NewRecord::new("k", "t", "").deliver_after(Duration::from_secs(1))).await.unwrap();
    tx.commit().await.unwrap();
    let stats = outbox.stats(&db).await.unwrap();
    let k = stats.iter().find(|s| s.partition == partition_of("k")).unwrap();
    assert_eq!((k.pending, k.scheduled), (0, 1), "{}: due at the commit already", db.db.backend());
}

async fn a_wake_up_delivers_a_delayed_record_when_it_falls_due(db: TestDb) {
    let consumer = outbox(&db, hourly).await;
    wakes_when_due(&db, &consumer, &consumer).await;
}

/// One wake-up for 2,000 records due at 2,000 different times (more than the in-process channel holds
/// messages) delivers each when its time comes, though the node polls hourly. Before, each time was a
/// message of its own: the processor fell behind the one call, heard "every partition, now" instead,
/// and the times it missed waited for the hourly poll. The soonest half lies in partitions of its own,
/// so no later wake-up fetches them by the way.
async fn a_wake_up_for_many_later_times_delivers_each_record_when_it_falls_due(db: TestDb) {
    let outbox = outbox(&db, hourly).await;
    let calls = Arc::new(Calls::default());
    let node = ready_for_wake_ups(&db, &outbox, &calls).await;
    // 1,000 keys in partitions 0-127, then 1,000 in 128-255 (8 in each, the last ones left out).
    let keys = (0..=255u8).flat_map(|p| keys_in(p, "key", 8));
    let (soonest, latest) = keys.partition::<Vec<_>, _>(|k| partition_of(k) < 128);
    let records = soonest
        .into_iter()
        .take(1000)
        .chain(latest.into_iter().take(1000))
        .zip(0u64..)
        .map(|(key, i)| NewRecord::new(key, "t", format!("{i}")).deliver_after(Duration::from_millis(500 + i)))
        .collect();
    let scheduled = commit(&outbox, &db, records).await;
    outbox.wake(&db, &scheduled).await.unwrap();
    wait_for("every record delivered", Duration::from_secs(60), || async { calls.all().len() == 2000 }).await;
    node.shutdown().await.unwrap();
}

/// Timers for more later times than a processor keeps (4,096) each deliver their record in time: a
/// node polling hourly, woken for 4,200 records due at as many times. Before, the latest timers past the
/// limit were dropped, and their records waited for the hourly poll.
#[sqlx::test(migrations = false)]
async fn more_later_times_than_a_processor_keeps_timers_for_are_each_delivered(pool: sqlx::PgPool) {
    let db = TestDb::postgres(pool);
    let outbox = outbox(&db, hourly).await;
    let calls = Arc::new(Calls::default());
    let node = ready_for_wake_ups(&db, &outbox, &calls).await;
    // Written and announced within the first delay, so that every timer is set before any falls due.
    let first = Duration::from_secs(5);
    let records: Vec<_> = (0..4200u64)
        .map(|i| NewRecord::new(format!("k{i}"), "t", format!("{i}")).deliver_after(first + Duration::from_millis(i)))
        .collect();
    let started = Instant::now();
    let scheduled = commit(&outbox, &db, records).await;
    outbox.wake(&db, &scheduled).await.unwrap();
    assert!(started.elapsed() < first, "every timer set before the first falls due");
    wait_for("every record delivered", Duration::from_secs(60), || async { calls.all().len() == 4200 }).await;
    node.shutdown().await.unwrap();
}

/// A node of `outbox` recording into `calls`, owning every partition, listening on PostgreSQL, and past
/// its first fetch: from here on it fetches only when woken (or at its poll).
async fn ready_for_wake_ups(db: &TestDb, outbox: &Outbox, calls: &Arc<Calls>) -> outbox_cluster::Node {
    let node = start(outbox, db, calls.handlers()).await;
    let owns_all = || async { node.assignment().borrow().epochs.len() == 256 };
    wait_for("the node owning every partition", Duration::from_secs(30), owns_all).await;
    if db.db.backend() == "postgres" {
        let listening =
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND query LIKE 'LISTEN %'";
        wait_for("the processor listening", Duration::from_secs(30), || async { count(db, listening).await == 1 })
            .await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    node
}

/// `consumer` (polling once an hour) runs a node; `producer` schedules two records for later, on two
/// keys, and wakes: each is delivered when its time comes, not before, and without waiting for a poll.
async fn wakes_when_due(db: &TestDb, producer: &Outbox, consumer: &Outbox) {
    let calls = Arc::new(Calls::default());
    let node = ready_for_wake_ups(db, consumer, &calls).await;
    let before = Instant::now();
    let later = DELAY * 2;
    let scheduled = commit(
        producer,
        db,
        vec![
            NewRecord::new("soon", "t", "soon").deliver_after(DELAY),
            NewRecord::new("later", "t", "later")
                .deliver_at(chrono::Utc::now() + chrono::Duration::from_std(later).unwrap()),
        ],
    )
    .await;
    producer.wake(db, &scheduled).await.unwrap();
    wait_for("both delivered", Duration::from_secs(30), || async { calls.all().len() == 2 }).await;
    node.shutdown().await.unwrap();
    // Both arrived within the wait above though the node polls hourly: each woke it when due.
    assert!(calls.at("soon") - before >= DELAY);
    assert!(calls.at("later") - before >= later);
}
