//! The inbox: a message is accepted once per (source, id) across transactions and consumers, a rolled
//! back acceptance leaves nothing behind, two consumers racing for one message apply it once, bad ids
//! are refused without harming the transaction, and the purge deletes only what is old, in batches.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[macro_use]
mod common;

use std::time::Duration;

use common::*;
use outbox_core::Error;
use outbox_core::inbox::MAX_INBOX_ID_BYTES;

every_backend!(
    a_message_is_accepted_once_per_source,
    a_rolled_back_acceptance_leaves_nothing,
    of_two_consumers_racing_for_a_message_one_applies_it,
    bad_ids_are_refused_and_the_transaction_goes_on,
    the_purge_deletes_only_old_rows_in_batches,
    a_keys_events_are_accepted_only_in_order,
    concurrent_consumers_of_one_key_never_deadlock,
    an_accept_outside_any_transaction_is_refused,
);

async fn a_message_is_accepted_once_per_source(db: TestDb) {
    let inbox = outbox(&db, |_| {}).await.inbox();
    let mut tx = db.begin().await;
    assert!(inbox.accept(&mut tx, "orders", "m-1").await.unwrap());
    assert!(!inbox.accept(&mut tx, "orders", "m-1").await.unwrap(), "twice in one transaction");
    tx.commit().await.unwrap();
    let mut tx = db.begin().await;
    assert!(!inbox.accept(&mut tx, "orders", "m-1").await.unwrap(), "again in a later transaction");
    assert!(inbox.accept(&mut tx, "payments", "m-1").await.unwrap(), "the same id from another source");
    assert!(inbox.accept(&mut tx, "orders", "M-1").await.unwrap(), "ids compare exactly");
    tx.commit().await.unwrap();
    assert_eq!(count(&db, "SELECT count(*) FROM {s}inbox").await, 3);
}

async fn a_rolled_back_acceptance_leaves_nothing(db: TestDb) {
    let inbox = outbox(&db, |_| {}).await.inbox();
    let mut tx = db.begin().await;
    assert!(inbox.accept(&mut tx, "orders", "m-1").await.unwrap());
    tx.rollback().await.unwrap();
    let mut tx = db.begin().await;
    assert!(inbox.accept(&mut tx, "orders", "m-1").await.unwrap(), "the message was never applied");
    tx.commit().await.unwrap();
}

/// The second consumer's `accept` waits for the first one's transaction: it applies nothing if that
/// commits, and applies the message itself if that rolls back.
async fn of_two_consumers_racing_for_a_message_one_applies_it(db: TestDb) {
    let inbox = outbox(&db, |_| {}).await.inbox();
    for first_commits in [true, false] {
        let id = format!("m-{first_commits}");
        let mut first = db.begin().await;
        assert!(inbox.accept(&mut first, "orders", &id).await.unwrap());
        let (inbox2, db2, id2) = (inbox.clone(), db.clone(), id.clone());
        let second = tokio::spawn(async move {
            let mut tx = db2.begin().await;
            let applied = inbox2.accept(&mut tx, "orders", &id2).await.unwrap();
            tx.commit().await.unwrap();
            applied
        });
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(!second.is_finished(), "the second consumer waits for the first");
        if first_commits {
            first.commit().await.unwrap();
        } else {
            first.rollback().await.unwrap();
        }
        assert_eq!(second.await.unwrap(), !first_commits);
    }
    assert_eq!(count(&db, "SELECT count(*) FROM {s}inbox").await, 2);
}

async fn bad_ids_are_refused_and_the_transaction_goes_on(db: TestDb) {
    let inbox = outbox(&db, |_| {}).await.inbox();
    let long = "x".repeat(MAX_INBOX_ID_BYTES + 1);
    let mut tx = db.begin().await;
    for (source, id) in [("", "m"), ("orders", ""), (long.as_str(), "m"), ("orders", long.as_str()), ("orders", "a\0b")]
    {
        let refused = inbox.accept(&mut tx, source, id).await;
        assert!(matches!(refused, Err(Error::BadInboxId { .. })), "{source:?} {id:?}: {refused:?}");
    }
    let refused = inbox.accept(&mut tx, "orders", "a\0b").await.unwrap_err().to_string();
    assert!(refused.starts_with("inbox message id starting \"a\\0b\", of 3 bytes"), "{refused}");
    let longest = "x".repeat(MAX_INBOX_ID_BYTES);
    assert!(inbox.accept(&mut tx, &longest, &longest).await.unwrap());
    tx.commit().await.unwrap();
    assert_eq!(count(&db, "SELECT count(*) FROM {s}inbox").await, 1);
}

/// On a connection outside any transaction an acceptance would commit at once, before the message is
/// applied: a message whose apply failed then would count as applied for good. It is refused and
/// writes nothing. In a transaction the application began with its own SQL it is taken, and rolled
/// back with it.
async fn an_accept_outside_any_transaction_is_refused(db: TestDb) {
    let inbox = outbox(&db, |_| {}).await.inbox();
    macro_rules! on_a_pooled_connection {
        ($pool:expr) => {{
            let mut conn = $pool.acquire().await.unwrap();
            let refused = inbox.accept(&mut *conn, "orders", "m-1").await;
            assert!(matches!(refused, Err(Error::NotInTransaction { .. })), "{refused:?}");
            let refused = inbox.accept_in_order(&mut *conn, "orders", "k", 1).await;
            assert!(matches!(refused, Err(Error::NotInTransaction { .. })), "{refused:?}");
            sqlx::raw_sql("BEGIN").execute(&mut *conn).await.unwrap();
            assert!(inbox.accept(&mut *conn, "orders", "m-2").await.unwrap(), "in the application's own BEGIN");
            assert!(inbox.accept_in_order(&mut *conn, "orders", "k", 1).await.unwrap());
            sqlx::raw_sql("ROLLBACK").execute(&mut *conn).await.unwrap();
        }};
    }
    match &db.db {
        outbox_core::Db::Postgres(pool) => on_a_pooled_connection!(pool),
        outbox_core::Db::Sqlite(pool) => on_a_pooled_connection!(pool),
        outbox_core::Db::MySql(pool) => on_a_pooled_connection!(pool),
        _ => unreachable!("the tests build every backend"),
    }
    let mut tx = db.begin().await;
    assert!(inbox.accept(&mut tx, "orders", "m-1").await.unwrap(), "the refused acceptance wrote nothing");
    assert!(inbox.accept(&mut tx, "orders", "m-2").await.unwrap(), "the rolled back one left nothing");
    assert!(inbox.accept_in_order(&mut tx, "orders", "k", 1).await.unwrap());
    tx.commit().await.unwrap();
}

async fn the_purge_deletes_only_old_rows_in_batches(db: TestDb) {
    let inbox = outbox(&db, |_| {}).await.inbox();
    let mut tx = db.begin().await;
    for i in 0..25 {
        assert!(inbox.accept(&mut tx, "orders", &format!("m-{i}")).await.unwrap());
    }
    tx.commit().await.unwrap();
    exec!(db, "UPDATE {s}inbox SET accepted_at = {ago:7200} WHERE message_id <> 'm-0'");
    assert_eq!(inbox.purge(&db, Duration::from_secs(3600), 7).await.unwrap(), 24);
    assert_eq!(count(&db, "SELECT count(*) FROM {s}inbox").await, 1);
    let mut tx = db.begin().await;
    assert!(!inbox.accept(&mut tx, "orders", "m-0").await.unwrap(), "a row within the retention stays");
    tx.commit().await.unwrap();
}

/// Per key, only an event later than the last one applied is accepted: an older one arriving late, or
/// the same one again, is not; keys and sources are independent; a rollback leaves nothing.
async fn a_keys_events_are_accepted_only_in_order(db: TestDb) {
    let inbox = outbox(&db, |_| {}).await.inbox();
    let mut tx = db.begin().await;
    assert!(inbox.accept_in_order(&mut tx, "orders", "o-1", 5).await.unwrap(), "the key's first event");
    assert!(!inbox.accept_in_order(&mut tx, "orders", "o-1", 3).await.unwrap(), "an older event arriving late");
    assert!(!inbox.accept_in_order(&mut tx, "orders", "o-1", 5).await.unwrap(), "the same event again");
    assert!(inbox.accept_in_order(&mut tx, "orders", "o-2", 1).await.unwrap(), "another key");
    assert!(inbox.accept_in_order(&mut tx, "payments", "o-1", 1).await.unwrap(), "another source");
    tx.commit().await.unwrap();
    let mut tx = db.begin().await;
    assert!(inbox.accept_in_order(&mut tx, "orders", "o-1", 7).await.unwrap(), "a later event");
    tx.rollback().await.unwrap();
    let mut tx = db.begin().await;
    assert!(!inbox.accept_in_order(&mut tx, "orders", "o-1", 4).await.unwrap(), "5 is still the last");
    assert!(inbox.accept_in_order(&mut tx, "orders", "o-1", 7).await.unwrap(), "7 was rolled back");
    let refused = inbox.accept_in_order(&mut tx, "orders", "", 8).await;
    assert!(matches!(refused, Err(Error::BadInboxId { what: "key", .. })), "{refused:?}");
    tx.commit().await.unwrap();
    assert_eq!(count(&db, "SELECT count(*) FROM {s}inbox_keys").await, 3);
}

/// Consumers applying events of one key at once, each in its own transaction, queue on the key's row:
/// none fails, whether the key is known or new. (MySQL: the row was first read under a shared lock,
/// then written, so two consumers each holding the shared lock waited for each other and one was rolled
/// back as a deadlock: 170 of 200 here.)
async fn concurrent_consumers_of_one_key_never_deadlock(db: TestDb) {
    let inbox = outbox(&db, |_| {}).await.inbox();
    let mut tx = db.begin().await;
    assert!(inbox.accept_in_order(&mut tx, "orders", "known", 1).await.unwrap());
    tx.commit().await.unwrap();
    for key in ["known", "new"] {
        let next = std::sync::Arc::new(std::sync::atomic::AtomicI64::new(2));
        let consumers = (0..8).map(|_| {
            let (inbox, db, next) = (inbox.clone(), db.clone(), next.clone());
            tokio::spawn(async move {
                let mut failures = Vec::new();
                for _ in 0..25 {
                    let seq = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let mut tx = db.begin().await;
                    match inbox.accept_in_order(&mut tx, "orders", key, seq).await {
                        Ok(_) => tx.commit().await.unwrap(),
                        Err(e) => failures.push(format!("{seq}: {e}")),
                    }
                }
                failures
            })
        });
        let failures: Vec<String> =
            futures::future::join_all(consumers).await.into_iter().flat_map(|f| f.unwrap()).collect();
        let first = &failures[..failures.len().min(3)];
        assert!(failures.is_empty(), "{key}: {} of 200 acceptances failed, the first: {first:?}", failures.len());
        let last: i64 = db.scalar("SELECT last_seq FROM {s}inbox_keys WHERE key = $1", &[key.into()]).await;
        assert_eq!(last, 201, "{key}: the last of the 200 events accepted");
    }
}
