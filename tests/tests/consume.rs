//! Consuming JetStream exactly once through an inbox (`outbox_nats::apply_once`), against a real
//! nats-server and every database: messages redelivered after a consumer committed but never acked
//! are acknowledged without being applied again, a failed apply is rolled back and applied on its
//! redelivery, and every message is applied once.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[macro_use]
mod common;

use std::time::Duration;

use async_nats::jetstream::consumer::{PullConsumer, pull};
use common::nats::NatsServer;
use common::*;
use futures::StreamExt;
use outbox_core::{BoxError, Handler, Record, Tx};
use outbox_nats::{Consumed, JetStreamHandler, NatsConfig, apply_once, ensure_stream};

every_backend!(a_consumer_applies_each_message_once_through_its_inbox,);

// A network to cut: a server's.
on_backends!(
    [postgres, mysql]
    a_database_out_of_reach_uses_up_no_deliveries,
);

fn record(i: u32) -> Record {
    Record {
        id: uuid::Uuid::now_v7(),
        partition: 0,
        key: format!("order-{i}"),
        seq: 1,
        event_type: "order.placed".into(),
        payload: format!("{i}").into(),
        headers: Default::default(),
        attempts: 0,
        created_at: chrono::Utc::now(),
        deliver_at: None,
        epoch: outbox_core::Epoch(1),
    }
}

/// Applies a message to the read model: one row per application.
async fn apply(tx: &mut Tx, message: &async_nats::jetstream::Message) -> Result<(), BoxError> {
    let body = String::from_utf8(message.payload.to_vec())?;
    tx.execute("INSERT INTO read_model (body) VALUES ($1)", &[(&body).into()]).await?;
    Ok(())
}

async fn a_consumer_applies_each_message_once_through_its_inbox(db: TestDb) {
    let server = NatsServer::start();
    let (_client, publisher, consumer) = consuming(&server, &db, |_| {}).await;
    for i in 1..=5 {
        publisher.handle(&record(i)).await.unwrap();
    }
    let inbox = outbox(&db, |_| {}).await.inbox();

    // A consumer that crashes after committing its first three messages, before acknowledging them.
    let mut first = consumer.fetch().max_messages(3).messages().await.unwrap();
    while let Some(message) = first.next().await {
        let message = message.unwrap();
        let id = message.headers.as_ref().unwrap().get("Nats-Msg-Id").unwrap().to_string();
        let mut tx = db.begin().await;
        assert!(inbox.accept(&mut tx, "orders", &id).await.unwrap());
        apply(&mut tx, &message).await.unwrap();
        tx.commit().await.unwrap();
    }

    // Its successor: the three come back after the ack wait, and message 4 fails once.
    let mut failed_once = false;
    let messages = consumer.messages().await.unwrap().take(6);
    let consumed = tokio::time::timeout(
        Duration::from_secs(30),
        apply_once(messages, &db.db, &inbox, "orders", async |tx: &mut Tx, message| {
            if message.payload == "4" && !failed_once {
                failed_once = true;
                return Err("the read model refused it".into());
            }
            apply(tx, message).await
        }),
    )
    .await
    .expect("six deliveries")
    .unwrap();
    assert_eq!(consumed, Consumed { applied: 2, duplicates: 3, failed: 1, given_up: 0 });
    let mut bodies: Vec<(String,)> = rows!(db, (String,), "SELECT body FROM read_model ORDER BY body");
    bodies.dedup();
    assert_eq!(bodies.len(), 5, "{bodies:?}");
    assert_eq!(count(&db, "SELECT count(*) FROM read_model").await, 5, "each message applied once");
    wait_for("every message acknowledged", Duration::from_secs(10), || {
        let mut consumer = consumer.clone();
        async move { consumer.info().await.unwrap().num_ack_pending == 0 }
    })
    .await;
}

/// The consumer's database out of reach for a few seconds (a failover) fails nothing for good: the
/// message waits in place, JetStream told it is in progress (delivered once), and it is applied once
/// the database is back. Before, every failed begin naked it, and a consumer with a `max_deliver` gave
/// up each message the outage outlasted: never applied, though nothing was wrong with it.
async fn a_database_out_of_reach_uses_up_no_deliveries(db: TestDb) {
    let (far, proxy) = db.through_proxy().await;
    let server = NatsServer::start();
    let (_client, publisher, mut consumer) = consuming(&server, &db, |c| c.max_deliver = 2).await;
    let inbox = outbox(&db, |_| {}).await.inbox();
    publisher.handle(&record(1)).await.unwrap();
    proxy.cut();
    let messages = consumer.messages().await.unwrap();
    let consuming = tokio::spawn(async move { apply_once(messages, &far.db, &inbox, "orders", apply).await });
    // Four times the consumer's ack wait, and past its two deliveries' naks.
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(count(&db, "SELECT count(*) FROM read_model").await, 0, "applied through a cut link");
    proxy.mend();
    wait_for("applied", Duration::from_secs(60), || async { count(&db, "SELECT count(*) FROM read_model").await == 1 })
        .await;
    assert!(!consuming.is_finished(), "the consumer ended: {:?}", consuming.await);
    consuming.abort();
    // Deliveries the consumer made, a message delivered again counted again.
    assert_eq!(consumer.info().await.unwrap().delivered.consumer_sequence, 1, "delivered again meanwhile");
}

/// A database error that may pass but does not (one the message itself causes: too large for a time
/// limit, say) is tried again in place for a minute, then counts as a delivery like any failure: on
/// the last one the consumer allows, the message is given up, not held for ever.
#[sqlx::test(migrations = false)]
async fn a_database_error_that_does_not_pass_is_given_up_after_a_minute(pool: sqlx::PgPool) {
    let too_slow = async |_: &mut Tx, _: &async_nats::jetstream::Message| -> Result<(), BoxError> {
        Err(outbox_core::Error::QueryTimeout { work: "applying", after: Duration::from_secs(1) }.into())
    };
    let consumed = one_message_delivered(pool, 1, Duration::from_secs(120), too_slow).await;
    assert_eq!(consumed, Consumed { applied: 0, duplicates: 0, failed: 1, given_up: 1 });
}

/// A message given up at `max_deliver` is logged with where to find it (its stream and sequence, its
/// subject, the outbox key and sequence): that line is its one trace, and it named only the message id,
/// which JetStream cannot look up.
#[sqlx::test(migrations = false)]
async fn a_message_given_up_is_logged_with_where_to_find_it(pool: sqlx::PgPool) {
    let logs = Captured::start("outbox_nats=error");
    let refused = async |_: &mut Tx, _: &async_nats::jetstream::Message| -> Result<(), BoxError> {
        Err("the read model refuses it".into())
    };
    let consumed = one_message_delivered(pool, 1, Duration::from_secs(60), refused).await;
    assert_eq!(consumed, Consumed { applied: 0, duplicates: 0, failed: 1, given_up: 1 });
    let text = logs.text();
    for field in ["stream=\"OUTBOX\"", "stream_sequence=1", "subject=outbox.order.placed", "key=\"order-1\"", "seq=1"] {
        assert!(text.contains(field), "{field} missing from: {text}");
    }
}

/// What `apply_once` did with one message, by `apply`, on a consumer that delivers it at most
/// `deliveries` times, once it has read them all (within `within`).
async fn one_message_delivered(
    pool: sqlx::PgPool,
    deliveries: i64,
    within: Duration,
    apply: impl AsyncFnMut(&mut Tx, &async_nats::jetstream::Message) -> Result<(), BoxError>,
) -> Consumed {
    let db = TestDb::postgres(pool);
    let server = NatsServer::start();
    let (_client, publisher, consumer) = consuming(&server, &db, |c| c.max_deliver = deliveries).await;
    let inbox = outbox(&db, |_| {}).await.inbox();
    publisher.handle(&record(1)).await.unwrap();
    let messages = consumer.messages().await.unwrap().take(usize::try_from(deliveries).unwrap());
    let consuming = apply_once(messages, &db.db, &inbox, "orders", apply);
    tokio::time::timeout(within, consuming).await.expect("every delivery read in time").unwrap()
}

/// A message whose apply outlasts the consumer's ack wait (here 1 s) is not delivered again meanwhile:
/// the consumer tells JetStream it is in progress.
#[sqlx::test(migrations = false)]
async fn a_message_applied_for_longer_than_the_ack_wait_is_not_delivered_again(pool: sqlx::PgPool) {
    let db = TestDb::postgres(pool);
    let server = NatsServer::start();
    let (_client, publisher, mut consumer) = consuming(&server, &db, |_| {}).await;
    let inbox = outbox(&db, |_| {}).await.inbox();
    publisher.handle(&record(1)).await.unwrap();
    let messages = consumer.messages().await.unwrap().take(1);
    let slow = async |tx: &mut Tx, message: &async_nats::jetstream::Message| {
        tokio::time::sleep(Duration::from_secs(3)).await;
        apply(tx, message).await
    };
    let consumed = apply_once(messages, &db.db, &inbox, "orders", slow).await.unwrap();
    assert_eq!(consumed, Consumed { applied: 1, duplicates: 0, failed: 0, given_up: 0 });
    // Deliveries the consumer made, a message delivered again counted again.
    let deliveries = consumer.info().await.unwrap().delivered.consumer_sequence;
    assert_eq!(deliveries, 1, "delivered again while it was applied");
}

/// A consumer set up as the outbox's: a server, its stream, a publisher of records and a durable pull
/// consumer (its settings `tune`d), and an empty read model in `db`.
async fn consuming(
    server: &NatsServer,
    db: &TestDb,
    tune: impl FnOnce(&mut pull::Config),
) -> (async_nats::Client, JetStreamHandler, PullConsumer) {
    let config = NatsConfig { servers: vec![server.url()], ..NatsConfig::default() };
    let client = outbox_nats::connect(&config).await.unwrap();
    let stream = ensure_stream(&client, &config.stream).await.unwrap();
    let publisher = JetStreamHandler::new(client.clone(), &config).unwrap();
    let js = async_nats::jetstream::new(client.clone());
    let consumer: PullConsumer = js
        .get_stream(&stream.config.name)
        .await
        .unwrap()
        .create_consumer({
            let mut config = pull::Config {
                durable_name: Some("read-model".into()),
                ack_wait: Duration::from_secs(1),
                ..Default::default()
            };
            tune(&mut config);
            config
        })
        .await
        .unwrap();
    db.db.execute("CREATE TABLE read_model (body VARCHAR(16) NOT NULL)", &[]).await.unwrap();
    (client, publisher, consumer)
}

/// A broker that stops answering for a while (a frozen host; a leader election reads as "no
/// responders") makes the consumer's message stream report errors it reads on after: the consumer
/// reads on too, and applies what comes after. It used to end at the first such error.
#[sqlx::test(migrations = false)]
async fn a_consumer_reads_on_through_a_broker_that_stopped_answering(pool: sqlx::PgPool) {
    let db = TestDb::postgres(pool);
    let server = NatsServer::start();
    let (_client, publisher, consumer) = consuming(&server, &db, |_| {}).await;
    let inbox = outbox(&db, |_| {}).await.inbox();
    // Heartbeats every second: one missing for two seconds is reported.
    let messages = consumer.stream().heartbeat(Duration::from_secs(1)).messages().await.unwrap();
    let consuming = tokio::spawn({
        let (db, inbox) = (db.db.clone(), inbox.clone());
        async move { apply_once(messages, &db, &inbox, "orders", apply).await }
    });
    for i in 1..=2 {
        publisher.handle(&record(i)).await.unwrap();
    }
    wait_for("two applied", Duration::from_secs(10), || async {
        count(&db, "SELECT count(*) FROM read_model").await == 2
    })
    .await;
    server.signal("STOP");
    tokio::time::sleep(Duration::from_secs(4)).await;
    server.signal("CONT");
    for i in 3..=4 {
        publisher.handle(&record(i)).await.unwrap();
    }
    wait_for("four applied", Duration::from_secs(30), || async {
        count(&db, "SELECT count(*) FROM read_model").await == 4
    })
    .await;
    assert!(!consuming.is_finished(), "the consumer ended: {:?}", consuming.await);
    consuming.abort();
}

/// A consumer whose acks are not message by message is refused before anything is applied: with
/// `AckPolicy::All` the ack of a later message settles a failed one JetStream was to deliver again,
/// and with `AckPolicy::None` nothing is delivered again.
#[sqlx::test(migrations = false)]
async fn a_consumer_without_explicit_acks_is_refused(pool: sqlx::PgPool) {
    use async_nats::jetstream::consumer::AckPolicy;
    let db = TestDb::postgres(pool);
    let server = NatsServer::start();
    let (_client, publisher, consumer) = consuming(&server, &db, |c| c.ack_policy = AckPolicy::All).await;
    let inbox = outbox(&db, |_| {}).await.inbox();
    publisher.handle(&record(1)).await.unwrap();
    let messages = consumer.messages().await.unwrap().take(1);
    let refused = apply_once(messages, &db.db, &inbox, "orders", apply).await.unwrap_err();
    assert!(
        matches!(&refused, outbox_nats::Error::AckPolicy { consumer, policy: AckPolicy::All, .. } if consumer == "read-model"),
        "{refused:?}"
    );
    assert_eq!(count(&db, "SELECT count(*) FROM read_model").await, 0);
}

/// A message that fails on the last delivery its consumer allows (`max_deliver`) is counted as given up
/// (and logged as an error): JetStream will not deliver it again. Before, it was logged as "delivered
/// again later", and nothing told it from a failure that would be.
#[sqlx::test(migrations = false)]
async fn a_message_failed_on_its_last_delivery_is_counted_as_given_up(pool: sqlx::PgPool) {
    let refuse =
        async |_: &mut Tx, _: &async_nats::jetstream::Message| -> Result<(), BoxError> { Err("always refused".into()) };
    let consumed = one_message_delivered(pool, 2, Duration::from_secs(30), refuse).await;
    assert_eq!(consumed, Consumed { applied: 0, duplicates: 0, failed: 2, given_up: 1 });
}

/// A message whose `Nats-Msg-Id` is longer than an inbox id (another publisher's, on a shared stream)
/// is applied once, by a digest of its id, instead of failing on every delivery.
#[sqlx::test(migrations = false)]
async fn a_message_id_longer_than_an_inbox_id_is_applied_once(pool: sqlx::PgPool) {
    let db = TestDb::postgres(pool);
    let server = NatsServer::start();
    let (client, _publisher, consumer) = consuming(&server, &db, |_| {}).await;
    let inbox = outbox(&db, |_| {}).await.inbox();
    let js = async_nats::jetstream::new(client);
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Msg-Id", "x".repeat(300).as_str());
    js.publish_with_headers("outbox.order.placed.k", headers, "1".into()).await.unwrap().await.unwrap();
    let messages = consumer.messages().await.unwrap().take(1);
    let consumed = apply_once(messages, &db.db, &inbox, "orders", apply).await.unwrap();
    assert_eq!(consumed, Consumed { applied: 1, duplicates: 0, failed: 0, given_up: 0 });
}
