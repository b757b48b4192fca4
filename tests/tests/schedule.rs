//! Scheduling and schema: atomic with the caller's transaction, per-key order = commit order, typed
//! rejection of bad input, and the library's own migrator.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[macro_use]
mod common;

use std::time::Duration;

use common::*;
use outbox_core::{Config, Error, NewRecord, Outbox, Scheduled, partition_of};
use sqlx::types::Json;

every_backend!(
    committed_records_exist_and_rolled_back_ones_do_not,
    a_transaction_begun_by_the_applications_own_begin_holds_its_records,
    batch_numbers_each_keys_records_in_order,
    concurrent_writers_of_one_key_commit_in_sequence_order,
    bad_input_is_rejected_before_writing_and_the_transaction_stays_usable,
    migrations_are_idempotent_concurrent_and_use_their_own_table,
    scheduling_before_migrating_says_so,
    scheduling_on_a_schema_a_migration_behind_says_so,
    key_rows_are_pruned_and_sequences_keep_growing,
    a_reserved_word_names_a_schema,
    a_batch_larger_than_one_statement_carries_is_written_whole,
    a_batch_whose_keys_alone_are_over_a_packet_is_written_whole,
    a_payload_over_the_servers_packet_is_refused_before_writing,
);

// A network between: a server's.
on_backends!(
    [postgres, mysql]
    pruning_key_rows_far_from_the_database_fits_its_time_limit,
);

// MySQL writes such a batch in several statements.
on_backends!(
    [postgres, sqlite]
    a_batch_over_what_one_statement_carries_is_refused_before_writing,
);

async fn committed_records_exist_and_rolled_back_ones_do_not(db: TestDb) {
    let outbox = outbox(&db, |_| {}).await;
    let mut tx = db.begin().await;
    let kept =
        outbox.schedule(&mut tx, NewRecord::new("k", "t", "kept").header("traceparent", "00-1-2-01")).await.unwrap();
    tx.commit().await.unwrap();

    let mut tx = db.begin().await;
    outbox.schedule(&mut tx, NewRecord::new("k", "t", "dropped")).await.unwrap();
    outbox.schedule(&mut tx, NewRecord::new("other", "t", "dropped")).await.unwrap();
    tx.rollback().await.unwrap();

    let rows = rows!(
        db,
        (uuid::Uuid, i16, String, i64, Vec<u8>, Json<serde_json::Value>),
        "SELECT id, partition, key, seq, payload, headers FROM {s}records"
    );
    assert_eq!(rows.len(), 1);
    let (id, partition, key, seq, payload, Json(headers)) = &rows[0];
    assert_eq!((*id, *partition, key.as_str(), *seq), (kept.id, i16::from(partition_of("k")), "k", kept.seq));
    assert_eq!(payload.as_slice(), b"kept");
    assert_eq!(headers["traceparent"], "00-1-2-01");
    assert_eq!(kept.id.get_version_num(), 7, "ids are UUID v7");
    let mut tx = db.begin().await;
    let next = outbox.schedule(&mut tx, NewRecord::new("k", "t", "")).await.unwrap();
    tx.commit().await.unwrap();
    assert!(next.seq > kept.seq);
}

/// A transaction the application began with its own `BEGIN`, which sqlx does not know of, holds the
/// records scheduled in it as a sqlx transaction does: rolled back, neither the business row nor a
/// record stays; committed, both do. (MySQL: the outbox's own `BEGIN` committed the application's
/// transaction, and the rest ran in autocommit. SQLite refused to begin inside it.)
async fn a_transaction_begun_by_the_applications_own_begin_holds_its_records(db: TestDb) {
    let outbox = outbox(&db, |_| {}).await;
    db.exec("CREATE TABLE business_rows (id INT)", &[]).await;
    let (one, two) =
        (&[NewRecord::new("a", "t", "")][..], &[NewRecord::new("a", "t", ""), NewRecord::new("b", "t", "")][..]);
    for records in [one, two] {
        let insert = "INSERT INTO business_rows VALUES (1)";
        let rolled_back = db.schedule_in_own_transaction(&outbox, insert, records, "ROLLBACK").await.unwrap();
        assert_eq!(rolled_back.len(), records.len());
        let rows = (
            count(&db, "SELECT COUNT(*) FROM business_rows").await,
            count(&db, "SELECT COUNT(*) FROM {s}records").await,
        );
        assert_eq!(rows, (0, 0), "{} record(s) rolled back: (business rows, records) left", records.len());

        let committed = db.schedule_in_own_transaction(&outbox, insert, records, "COMMIT").await.unwrap();
        let rows = (
            count(&db, "SELECT COUNT(*) FROM business_rows").await,
            count(&db, "SELECT COUNT(*) FROM {s}records").await,
        );
        assert_eq!(rows, (1, i64::try_from(records.len()).unwrap()), "{} record(s) committed", records.len());
        let seqs = rows!(db, (uuid::Uuid, i64), "SELECT id, seq FROM {s}records");
        assert!(committed.iter().all(|s| seqs.contains(&(s.id, s.seq))), "{committed:?} against {seqs:?}");
        db.exec("DELETE FROM business_rows", &[]).await;
        db.exec("DELETE FROM {s}records", &[]).await;
    }
}

/// A batch numbers each key's records in the order given, after the key's earlier records.
async fn batch_numbers_each_keys_records_in_order(db: TestDb) {
    let outbox = outbox(&db, |_| {}).await;
    let mut tx = db.begin().await;
    let first = outbox.schedule(&mut tx, NewRecord::new("a", "t", "")).await.unwrap();
    let batch = ["b", "a", "b", "a", "c"].map(|k| NewRecord::new(k, "t", ""));
    let s = outbox.schedule_batch(&mut tx, &batch).await.unwrap();
    tx.commit().await.unwrap();
    assert!(first.seq < s[1].seq && s[1].seq < s[3].seq, "a: {} {} {}", first.seq, s[1].seq, s[3].seq);
    assert!(s[0].seq < s[2].seq, "b: {} {}", s[0].seq, s[2].seq);
    assert!(s.iter().all(|s| s.seq > 0));
    // An empty batch needs no transaction and writes nothing.
    let empty = db.schedule_without_transaction(&outbox, &[]).await;
    assert_eq!(empty, []);
}

/// Two transactions write the same key; the one that schedules first holds the key until it commits,
/// so the second gets the next sequence number and commits after it: sequence order = commit order.
/// (PostgreSQL: the key's lock row; SQLite: the database write lock.)
async fn concurrent_writers_of_one_key_commit_in_sequence_order(db: TestDb) {
    let outbox = outbox(&db, |_| {}).await;
    let mut first = db.begin().await;
    let a = outbox.schedule(&mut first, NewRecord::new("k", "t", "first")).await.unwrap();

    // Forced interleaving: the second writer is observed blocked on the first one's lock.
    let second = blocked_writer(&outbox, &db, "second").await;
    assert!(!second.is_finished());
    first.commit().await.unwrap();
    let b = second.await.unwrap();
    assert!(a.seq < b.seq, "{} then {}", a.seq, b.seq);

    // A rolled-back first writer lets the waiting one go on.
    let mut first = db.begin().await;
    outbox.schedule(&mut first, NewRecord::new("k", "t", "rolled back")).await.unwrap();
    let second = blocked_writer(&outbox, &db, "third").await;
    first.rollback().await.unwrap();
    assert!(second.await.unwrap().seq > b.seq);
    let payloads = rows!(db, (Vec<u8>,), "SELECT payload FROM {s}records ORDER BY seq");
    assert_eq!(payloads, [(b"first".to_vec(),), (b"second".to_vec(),), (b"third".to_vec(),)]);
}

/// The per-key bookkeeping stays bounded: lock rows of keys with no record left are pruned (SQLite
/// keeps none), and a key written again after that still gets higher sequence numbers.
async fn key_rows_are_pruned_and_sequences_keep_growing(db: TestDb) {
    let outbox = outbox(&db, |_| {}).await;
    let key_rows = |db: TestDb| async move { db.key_rows().await.unwrap_or(0) };
    let keys: Vec<String> = (0..50).map(|k| format!("key-{k}")).collect();
    let mut tx = db.begin().await;
    let records: Vec<NewRecord> = (0..3).flat_map(|_| keys.iter().map(|k| NewRecord::new(k, "t", ""))).collect();
    let first = outbox.schedule_batch(&mut tx, &records).await.unwrap();
    tx.commit().await.unwrap();
    // SQLite keeps no key rows (its single writer orders a key's writers).
    let keeps_rows = db.key_rows().await.is_some();
    let before = if keeps_rows { 50 } else { 0 };
    assert_eq!(key_rows(db.clone()).await, before);
    assert_eq!(outbox.prune_keys(&db, 7).await.unwrap(), 0, "keys with records pending keep their rows");

    deliver_all(&outbox, &db).await;
    assert_eq!(outbox.prune_keys(&db, 7).await.unwrap(), before as u64);
    assert_eq!(key_rows(db.clone()).await, 0);

    let last_of_key0 = first.iter().zip(&records).filter(|(_, r)| r.key == "key-0").map(|(s, _)| s.seq).max().unwrap();
    let mut tx = db.begin().await;
    let again = outbox.schedule(&mut tx, NewRecord::new("key-0", "t", "")).await.unwrap();
    tx.commit().await.unwrap();
    assert!(again.seq > last_of_key0, "{} after {last_of_key0}", again.seq);
    assert_eq!(outbox.prune_keys(&db, 7).await.unwrap(), 0);
    assert_eq!(key_rows(db.clone()).await, i64::from(keeps_rows));
}

/// Pruning key rows far from the database (20 ms a round trip) fits within `query_timeout`: a few
/// statements for a batch of keys, not one each.
async fn pruning_key_rows_far_from_the_database_fits_its_time_limit(db: TestDb) {
    let (far, _proxy) = db.far_away(Duration::from_millis(10)).await;
    let outbox = outbox(&db, |c| c.query_timeout = Duration::from_secs(2)).await;
    let records: Vec<NewRecord> = (0..300).map(|k| NewRecord::new(format!("key-{k}"), "t", "")).collect();
    let mut tx = db.begin().await;
    outbox.schedule_batch(&mut tx, &records).await.unwrap();
    tx.commit().await.unwrap();
    deliver_all(&outbox, &db).await;
    let rows = db.key_rows().await.unwrap_or(0);
    assert_eq!(outbox.prune_keys(&far, 300).await.unwrap(), rows as u64);
    assert_eq!(db.key_rows().await.unwrap_or(0), 0);
}

/// Starts a transaction scheduling `payload` on key "k" and returns once it is seen waiting for the key's
/// lock; the task commits when the lock is granted. PostgreSQL shows the waiter in `pg_stat_activity`;
/// SQLite has no view of waiters (the writer sleeps in its busy handler for the write lock), so there
/// the writer must still be unfinished after a while.
async fn blocked_writer(outbox: &Outbox, db: &TestDb, payload: &'static str) -> tokio::task::JoinHandle<Scheduled> {
    let (o, d) = (outbox.clone(), db.clone());
    let writer = tokio::spawn(async move {
        let mut tx = d.begin().await;
        let scheduled = o.schedule(&mut tx, NewRecord::new("k", "t", payload)).await.unwrap();
        tx.commit().await.unwrap();
        scheduled
    });
    if db.key_lock_waiters().await.is_some() {
        wait_for("writer blocked on the key lock", Duration::from_secs(10), || async {
            db.key_lock_waiters().await == Some(1)
        })
        .await;
    } else {
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(!writer.is_finished(), "writer of {payload:?} should wait for the write lock");
    }
    writer
}

async fn bad_input_is_rejected_before_writing_and_the_transaction_stays_usable(db: TestDb) {
    let outbox = outbox(&db, |c| c.max_payload_bytes = 64).await;
    let mut tx = db.begin().await;
    let cases = [
        (NewRecord::new("", "t", ""), "EmptyKey"),
        (NewRecord::new("k".repeat(513), "t", ""), "KeyTooLong"),
        (NewRecord::new("k\0", "t", ""), "BadKey"),
        (NewRecord::new("k\r\nInjected: header", "t", ""), "BadKey"),
        (NewRecord::new("k ", "t", ""), "BadKey"),
        (NewRecord::new("k", "", ""), "BadEventType"),
        (NewRecord::new("k", "t", vec![1u8; 65]), "PayloadTooLarge"),
        (NewRecord::new("k", "t", "").header("bad name", "v"), "BadHeader"),
        (NewRecord::new("k", "t", "").header("h", "line\nbreak"), "BadHeader"),
        (NewRecord::new("k", "t", "").deliver_at(chrono::DateTime::<chrono::Utc>::MIN_UTC), "DeliverAtOutOfRange"),
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
    // The earliest time accepted is stored by every backend (and is due at once).
    let first = chrono::TimeZone::with_ymd_and_hms(&chrono::Utc, 1, 1, 1, 0, 0, 0).unwrap();
    outbox.schedule(&mut tx, NewRecord::new("k", "t", "").deliver_at(first)).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(pending(&db).await, 2);
}

async fn migrations_are_idempotent_concurrent_and_use_their_own_table(db: TestDb) {
    let outbox = Outbox::new(Config::default()).unwrap();
    let runs = (0..6).map(|_| {
        let (o, d) = (outbox.clone(), db.clone());
        tokio::spawn(async move { o.migrate(&d).await })
    });
    for run in futures::future::join_all(runs).await {
        run.unwrap().unwrap();
    }
    outbox.migrate(&db).await.unwrap();
    let known = db.db.migrations().len() as i64;
    assert_eq!(count(&db, "SELECT count(*) FROM {s}schema_migrations").await, known);
    assert_eq!(count(&db, "SELECT count(*) FROM {s}partitions").await, 256);
    assert!(!db.table_exists("_sqlx_migrations").await, "sqlx's own migrations table is not used");

    // A second outbox in another schema lives beside the first.
    let other = Outbox::new(Config { schema: "events".into(), ..Config::default() }).unwrap();
    other.migrate(&db).await.unwrap();
    assert_eq!(count(&db, &format!("SELECT count(*) FROM {}", db.db.table("events", "partitions"))).await, 256);

    // A database migrated by a newer library version whose migrations say older versions still run on
    // their schema is used (a deploy rolled back goes on); one whose migration does not say so is
    // refused, not silently used.
    exec!(
        db,
        "INSERT INTO {s}schema_migrations (version, name, checksum, older_versions_run) VALUES (998, 'adds', 0, TRUE)"
    );
    outbox.migrate(&db).await.unwrap();
    let mut tx = db.begin().await;
    outbox.schedule(&mut tx, NewRecord::new("k", "t", "")).await.unwrap();
    tx.commit().await.unwrap();
    exec!(db, "INSERT INTO {s}schema_migrations (version, name, checksum) VALUES (999, 'future', 0)");
    let err = outbox.migrate(&db).await.unwrap_err();
    assert!(matches!(err, Error::Migration { version: 999, .. }), "{err:?}");
    // A changed migration text is detected.
    exec!(db, format!("UPDATE {} SET checksum = checksum + 1", db.db.table("events", "schema_migrations")));
    assert!(matches!(other.migrate(&db).await.unwrap_err(), Error::Migration { version: 1, .. }));
}

async fn scheduling_before_migrating_says_so(db: TestDb) {
    let outbox = Outbox::new(Config::default()).unwrap();
    let mut tx = db.begin().await;
    let err = outbox.schedule(&mut tx, NewRecord::new("k", "t", "")).await.unwrap_err();
    assert!(matches!(err, Error::NotMigrated { .. }), "{err:?}");
    assert!(err.to_string().contains("migrat"));
}

/// A schema missing a column a later migration adds (the service upgraded, its migration not run) is
/// named as not migrated, as a missing table is, instead of the database's bare complaint.
async fn scheduling_on_a_schema_a_migration_behind_says_so(db: TestDb) {
    let outbox = outbox(&db, |_| {}).await;
    exec!(db, "ALTER TABLE {s}records DROP COLUMN deliver_at");
    let mut tx = db.begin().await;
    let err = outbox.schedule(&mut tx, NewRecord::new("k", "t", "")).await.unwrap_err();
    assert!(matches!(&err, Error::NotMigrated { missing, .. } if missing.contains("deliver_at")), "{err:?}");
    drop(tx);
    let err = outbox.stats(&db).await.unwrap_err();
    assert!(matches!(err, Error::NotMigrated { .. }), "{err:?}");
}

/// A service whose role may not create schemas in its database (PostgreSQL's default for a role that does
/// not own the database) migrates into the schema its administrator made for it, on its first start and
/// on every later one, and writes records there.
#[sqlx::test(migrations = false)]
async fn a_role_that_may_not_create_schemas_migrates_the_schema_made_for_it(pool: sqlx::PgPool) {
    let database: String = sqlx::query_scalar("SELECT current_database()").fetch_one(&pool).await.unwrap();
    let role = format!("{database}_app");
    // A run that failed left its role behind (database names repeat from run to run).
    let setup = format!(
        "DROP ROLE IF EXISTS \"{role}\"; CREATE ROLE \"{role}\" LOGIN PASSWORD 'app-password'; \
         CREATE SCHEMA outbox AUTHORIZATION \"{role}\""
    );
    sqlx::raw_sql(sqlx::AssertSqlSafe(setup)).execute(&pool).await.unwrap();
    let options = pool.connect_options().as_ref().clone().username(&role).password("app-password");
    let app = sqlx::postgres::PgPoolOptions::new().max_connections(2).connect_with(options).await.unwrap();
    let may_create: bool = sqlx::query_scalar("SELECT has_database_privilege(current_database(), 'CREATE')")
        .fetch_one(&app)
        .await
        .unwrap();
    assert!(!may_create, "the role under test may not create schemas");

    let db = TestDb::postgres(app.clone());
    let outbox = Outbox::new(Config::default()).unwrap();
    outbox.migrate(&db).await.unwrap();
    outbox.migrate(&db).await.unwrap();
    commit(&outbox, &db, vec![NewRecord::new("k", "t", "")]).await;
    assert_eq!(pending(&db).await, 1);

    app.close().await;
    let cleanup = format!("DROP SCHEMA outbox CASCADE; DROP ROLE \"{role}\"");
    sqlx::raw_sql(sqlx::AssertSqlSafe(cleanup)).execute(&pool).await.unwrap();
}

/// `user` is reserved in PostgreSQL; a schema of that name migrates, takes records and delivers them.
async fn a_reserved_word_names_a_schema(db: TestDb) {
    let config = Config { schema: "user".into(), poll_interval: Duration::from_millis(20), ..Config::default() };
    let outbox = Outbox::new(config).unwrap();
    outbox.migrate(&db).await.unwrap();
    commit(&outbox, &db, vec![NewRecord::new("k", "t", "a"), NewRecord::new("k", "t", "b")]).await;
    let sink = Sink::new();
    let node = start(&outbox, &db, recording(&sink)).await;
    wait_for("both records delivered", Duration::from_secs(30), || async { sink.len() == 2 }).await;
    node.shutdown().await.unwrap();
    assert_eq!(sink.ranks_of("k"), [1, 2]);
    let completed = db.db.table("user", "completed");
    assert_eq!(count(&db, &format!("SELECT count(*) FROM {completed}")).await, 2);
    assert!(outbox.stats(&db).await.unwrap().iter().all(|p| p.pending == 0 && p.failed == 0));
}

/// A batch of payloads at the default limit, 24 MiB in all, more than MariaDB takes in one statement by
/// default (`max_allowed_packet` 16 MiB): every record is written, in order, in the caller's transaction.
async fn a_batch_larger_than_one_statement_carries_is_written_whole(db: TestDb) {
    let outbox = outbox(&db, |_| {}).await;
    let max = outbox.config().max_payload_bytes;
    let batch: Vec<NewRecord> = (0..24u8).map(|i| NewRecord::new("k", "t", vec![i; max])).collect();
    let mut tx = db.begin().await;
    let scheduled = outbox.schedule_batch(&mut tx, &batch).await.unwrap();
    tx.commit().await.unwrap();
    assert!(scheduled.windows(2).all(|w| w[0].seq < w[1].seq), "numbered in batch order");
    let rows = rows!(db, (i64, Vec<u8>), "SELECT seq, payload FROM {s}records ORDER BY seq");
    assert_eq!(rows.len(), 24);
    for (i, ((seq, payload), s)) in rows.iter().zip(&scheduled).enumerate() {
        assert_eq!(*seq, s.seq);
        assert!(payload.len() == max && payload.iter().all(|&b| usize::from(b) == i), "record {i}");
    }
}

/// A batch of many records on long keys, whose keys (and ids) alone are over MySQL's packet (16 MiB on
/// MariaDB by default), is written whole. Before, MySQL took the keys' lock rows, and read the numbers
/// back, each in one statement over the whole batch: the server closed the connection, an error that
/// looked worth retrying, and came back on every retry.
async fn a_batch_whose_keys_alone_are_over_a_packet_is_written_whole(db: TestDb) {
    let outbox = outbox(&db, |_| {}).await;
    let n = 45_000;
    let batch: Vec<NewRecord> = (0..n).map(|i| NewRecord::new(format!("{i:0>400}"), "t", "")).collect();
    let mut tx = db.begin().await;
    let scheduled = outbox.schedule_batch(&mut tx, &batch).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(scheduled.len(), n);
    assert_eq!(pending(&db).await, i64::try_from(n).unwrap());
    if let Some(rows) = db.key_rows().await {
        assert_eq!(rows, i64::try_from(n).unwrap(), "a lock row for every key");
    }
}

/// A payload within `max_payload_bytes` that MySQL still cannot take in one statement (16 MiB as base64
/// is over MariaDB's default `max_allowed_packet`) is refused before writing, with a typed error that is
/// not worth retrying; elsewhere it is written.
async fn a_payload_over_the_servers_packet_is_refused_before_writing(db: TestDb) {
    let outbox = outbox(&db, |c| c.max_payload_bytes = 16 << 20).await;
    let mut tx = db.begin().await;
    let result = outbox
        .schedule_batch(&mut tx, &[NewRecord::new("small", "t", ""), NewRecord::new("k", "t", vec![7u8; 16 << 20])])
        .await;
    if db.is_mysql() {
        let err = result.unwrap_err();
        assert!(
            matches!(&err, Error::PayloadTooLarge { key, len, max } if key == "k" && *len == 16 << 20 && *max < *len),
            "{err:?}"
        );
        assert!(!err.is_transient());
        // The caller's transaction is intact.
        outbox.schedule(&mut tx, NewRecord::new("after", "t", "")).await.unwrap();
        tx.commit().await.unwrap();
        assert_eq!(pending(&db).await, 1);
    } else {
        result.unwrap();
        tx.commit().await.unwrap();
        assert_eq!(pending(&db).await, 2);
    }
}

/// A batch of payloads over what one statement carries (PostgreSQL's 1 GiB to a message; SQLite's
/// billion-byte string, payloads hex-encoded in it) is refused before writing, with a typed error that is
/// not worth retrying, and the caller's transaction stays usable. MySQL writes such a batch in several
/// statements (see above).
async fn a_batch_over_what_one_statement_carries_is_refused_before_writing(db: TestDb) {
    let outbox = outbox(&db, |c| c.max_payload_bytes = 256 << 20).await;
    let batch: Vec<NewRecord> = (0..5u8).map(|i| NewRecord::new("k", "t", vec![i; 220 << 20])).collect();
    let mut tx = db.begin().await;
    let err = outbox.schedule_batch(&mut tx, &batch).await.unwrap_err();
    assert!(matches!(&err, Error::BatchTooLarge { records: 5, .. }), "{err:?}");
    assert!(!err.is_transient());
    outbox.schedule(&mut tx, NewRecord::new("after", "t", "")).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(pending(&db).await, 1);
}
