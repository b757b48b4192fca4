//! Scheduling and schema: atomic with the caller's transaction, per-key order = commit order, typed
//! rejection of bad input, and the library's own migrator.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::*;
use outbox_core::{Config, Error, NewRecord, Outbox, Scheduled, partition_of};
use sqlx::PgPool;

#[sqlx::test(migrations = false)]
async fn committed_records_exist_and_rolled_back_ones_do_not(pool: PgPool) {
    let outbox = outbox(&pool, |_| {}).await;
    let mut tx = pool.begin().await.unwrap();
    let kept =
        outbox.schedule(&mut tx, NewRecord::new("k", "t", "kept").header("traceparent", "00-1-2-01")).await.unwrap();
    tx.commit().await.unwrap();

    let mut tx = pool.begin().await.unwrap();
    outbox.schedule(&mut tx, NewRecord::new("k", "t", "dropped")).await.unwrap();
    outbox.schedule(&mut tx, NewRecord::new("other", "t", "dropped")).await.unwrap();
    tx.rollback().await.unwrap();

    let rows: Vec<(uuid::Uuid, i16, String, i64, Vec<u8>, serde_json::Value)> =
        sqlx::query_as("SELECT id, partition, key, seq, payload, headers FROM outbox.records")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(rows.len(), 1);
    let (id, partition, key, seq, payload, headers) = &rows[0];
    assert_eq!((*id, *partition, key.as_str(), *seq), (kept.id, i16::from(partition_of("k")), "k", 1));
    assert_eq!(payload.as_slice(), b"kept");
    assert_eq!(headers["traceparent"], "00-1-2-01");
    assert_eq!(kept.id.get_version_num(), 7, "ids are UUID v7");
    // The rolled-back transaction consumed no sequence number.
    let mut tx = pool.begin().await.unwrap();
    let next = outbox.schedule(&mut tx, NewRecord::new("k", "t", "")).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(next.seq, 2);
}

#[sqlx::test(migrations = false)]
async fn batch_gives_consecutive_sequences_per_key(pool: PgPool) {
    let outbox = outbox(&pool, |_| {}).await;
    let mut tx = pool.begin().await.unwrap();
    let first = outbox.schedule(&mut tx, NewRecord::new("a", "t", "")).await.unwrap();
    let batch = ["b", "a", "b", "a", "c"].map(|k| NewRecord::new(k, "t", ""));
    let scheduled = outbox.schedule_batch(&mut tx, &batch).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(first.seq, 1);
    assert_eq!(scheduled.iter().map(|s| s.seq).collect::<Vec<_>>(), [1, 2, 2, 3, 1]);
    assert_eq!(outbox.schedule_batch(&mut pool.acquire().await.unwrap(), &[]).await.unwrap(), []);
}

/// Two transactions write the same key; the one that schedules first holds the key until it commits,
/// so the second gets the next sequence number and commits after it: sequence order = commit order.
#[sqlx::test(migrations = false)]
async fn concurrent_writers_of_one_key_commit_in_sequence_order(pool: PgPool) {
    let outbox = outbox(&pool, |_| {}).await;
    let mut first = pool.begin().await.unwrap();
    let a = outbox.schedule(&mut first, NewRecord::new("k", "t", "first")).await.unwrap();

    // Forced interleaving: the second writer is observed blocked on the first one's lock.
    let second = blocked_writer(&outbox, &pool, "second").await;
    assert!(!second.is_finished());
    first.commit().await.unwrap();
    let b = second.await.unwrap();
    assert_eq!((a.seq, b.seq), (1, 2));

    // A rolled-back first writer frees the sequence number for the waiting one.
    let mut first = pool.begin().await.unwrap();
    outbox.schedule(&mut first, NewRecord::new("k", "t", "rolled back")).await.unwrap();
    let second = blocked_writer(&outbox, &pool, "third").await;
    first.rollback().await.unwrap();
    assert_eq!(second.await.unwrap().seq, 3);
    let seqs: Vec<(i64, Vec<u8>)> =
        sqlx::query_as("SELECT seq, payload FROM outbox.records ORDER BY seq").fetch_all(&pool).await.unwrap();
    assert_eq!(seqs, [(1, b"first".to_vec()), (2, b"second".to_vec()), (3, b"third".to_vec())]);
}

/// Starts a transaction scheduling `payload` on key "k" and returns once it is seen waiting for the key's
/// lock; the task commits when the lock is granted.
async fn blocked_writer(outbox: &Outbox, pool: &PgPool, payload: &'static str) -> tokio::task::JoinHandle<Scheduled> {
    let (o, p) = (outbox.clone(), pool.clone());
    let writer = tokio::spawn(async move {
        let mut tx = p.begin().await.unwrap();
        let scheduled = o.schedule(&mut tx, NewRecord::new("k", "t", payload)).await.unwrap();
        tx.commit().await.unwrap();
        scheduled
    });
    wait_for("writer blocked on the key lock", Duration::from_secs(10), || async {
        count(
            pool,
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%outbox.keys%'",
        )
        .await
            == 1
    })
    .await;
    writer
}

#[sqlx::test(migrations = false)]
async fn bad_input_is_rejected_before_writing_and_the_transaction_stays_usable(pool: PgPool) {
    let outbox = outbox(&pool, |c| c.max_payload_bytes = 64).await;
    let mut tx = pool.begin().await.unwrap();
    let cases = [
        (NewRecord::new("", "t", ""), "EmptyKey"),
        (NewRecord::new("k".repeat(513), "t", ""), "KeyTooLong"),
        (NewRecord::new("k\0", "t", ""), "KeyHasControl"),
        (NewRecord::new("k\r\nInjected: header", "t", ""), "KeyHasControl"),
        (NewRecord::new("k", "", ""), "BadEventType"),
        (NewRecord::new("k", "t", vec![1u8; 65]), "PayloadTooLarge"),
        (NewRecord::new("k", "t", "").header("bad name", "v"), "BadHeader"),
        (NewRecord::new("k", "t", "").header("h", "line\nbreak"), "BadHeader"),
    ];
    for (record, expected) in cases {
        let err = outbox.schedule(&mut tx, record.clone()).await.unwrap_err();
        assert!(format!("{err:?}").starts_with(expected), "{expected}: got {err:?}");
        assert!(!err.is_transient());
        // In a batch, one bad record rejects the whole batch.
        let batch = [NewRecord::new("fine", "t", ""), record];
        assert!(outbox.schedule_batch(&mut tx, &batch).await.is_err());
    }
    let err = outbox.schedule(&mut tx, NewRecord::new("k", "t", vec![1u8; 65])).await.unwrap_err();
    assert!(err.to_string().contains("65 bytes") && err.to_string().contains("\"k\""), "{err}");
    // The caller's transaction is intact and commits its own valid record.
    outbox.schedule(&mut tx, NewRecord::new("k", "t", vec![1u8; 64])).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(pending(&pool).await, 1);
}

#[sqlx::test(migrations = false)]
async fn migrations_are_idempotent_concurrent_and_use_their_own_table(pool: PgPool) {
    let outbox = Outbox::new(Config::default()).unwrap();
    let runs = (0..6).map(|_| {
        let (o, p) = (outbox.clone(), pool.clone());
        tokio::spawn(async move { o.migrate(&p).await })
    });
    for run in futures::future::join_all(runs).await {
        run.unwrap().unwrap();
    }
    outbox.migrate(&pool).await.unwrap();
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox.schema_migrations").await, 1);
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox.partitions").await, 256);
    assert_eq!(
        count(&pool, "SELECT count(*) FROM information_schema.tables WHERE table_name = '_sqlx_migrations'").await,
        0
    );

    // A second outbox in another schema lives beside the first.
    let other = Outbox::new(Config { schema: "events".into(), ..Config::default() }).unwrap();
    other.migrate(&pool).await.unwrap();
    assert_eq!(count(&pool, "SELECT count(*) FROM events.partitions").await, 256);

    // A database migrated by a newer library version is refused, not silently used.
    sqlx::query("INSERT INTO outbox.schema_migrations (version, name, checksum) VALUES (999, 'future', 0)")
        .execute(&pool)
        .await
        .unwrap();
    let err = outbox.migrate(&pool).await.unwrap_err();
    assert!(matches!(err, Error::Migration { version: 999, .. }), "{err:?}");
    // A changed migration text is detected.
    sqlx::query("UPDATE events.schema_migrations SET checksum = checksum + 1").execute(&pool).await.unwrap();
    assert!(matches!(other.migrate(&pool).await.unwrap_err(), Error::Migration { version: 1, .. }));
}

#[sqlx::test(migrations = false)]
async fn scheduling_before_migrating_says_so(pool: PgPool) {
    let outbox = Outbox::new(Config::default()).unwrap();
    let mut tx = pool.begin().await.unwrap();
    let err = outbox.schedule(&mut tx, NewRecord::new("k", "t", "")).await.unwrap_err();
    assert!(matches!(err, Error::NotMigrated { .. }), "{err:?}");
    assert!(err.to_string().contains("migrat"));
}
