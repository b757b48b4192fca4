//! Operator views and maintenance: backlog per partition, oldest pending age, bounded purge.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::*;
use outbox_core::{Completion, NewRecord, partition_of};
use sqlx::PgPool;

#[sqlx::test(migrations = false)]
async fn stats_count_pending_and_failed_per_partition_with_the_oldest_age(pool: PgPool) {
    let outbox = outbox(&pool, |_| {}).await;
    commit(
        &outbox,
        &pool,
        vec![NewRecord::new("a", "t", ""), NewRecord::new("a", "t", ""), NewRecord::new("b", "t", "")],
    )
    .await;
    sqlx::query("UPDATE outbox.records SET created_at = now() - interval '90 seconds' WHERE key = 'a' AND seq = 1")
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("UPDATE outbox.records SET failed_at = now() WHERE key = 'b'").execute(&pool).await.unwrap();
    let stats = outbox.stats(&pool).await.unwrap();
    let a = stats.iter().find(|s| s.partition == partition_of("a")).unwrap();
    assert_eq!((a.pending, a.failed), (2, 0));
    assert!(a.oldest_pending.unwrap() >= Duration::from_secs(90));
    let b = stats.iter().find(|s| s.partition == partition_of("b")).unwrap();
    assert_eq!((b.pending, b.failed, b.oldest_pending), (0, 1, None));
}

#[sqlx::test(migrations = false)]
async fn purge_deletes_only_expired_completed_records_in_bounded_batches(pool: PgPool) {
    let outbox = outbox(&pool, |_| {}).await;
    commit(&outbox, &pool, (0..25).map(|i| NewRecord::new(format!("k{i}"), "t", "")).collect()).await;
    deliver_all(&outbox, &pool).await;
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox.completed").await, 25);
    sqlx::query("UPDATE outbox.completed SET completed_at = now() - interval '2 hours' WHERE key < 'k2'")
        .execute(&pool)
        .await
        .unwrap();
    let expired = count(&pool, "SELECT count(*) FROM outbox.completed WHERE key < 'k2'").await;
    assert_eq!(expired, 12); // k0, k1, k10..k19
    assert_eq!(outbox.purge_completed(&pool, Duration::from_secs(3600), 5).await.unwrap(), 12);
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox.completed").await, 13);
    assert_eq!(outbox.purge_completed(&pool, Duration::from_secs(3600), 5).await.unwrap(), 0);
}

#[sqlx::test(migrations = false)]
async fn delete_on_complete_keeps_no_completed_rows(pool: PgPool) {
    let outbox = outbox(&pool, |c| c.completion = Completion::Delete).await;
    commit(&outbox, &pool, (0..10).map(|i| NewRecord::new(format!("k{i}"), "t", "")).collect()).await;
    deliver_all(&outbox, &pool).await;
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox.completed").await, 0);
    assert_eq!(pending(&pool).await, 0);
}
