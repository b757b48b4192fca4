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

every_backend!(a_consumer_applies_each_message_once_through_its_inbox);

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
    let config = NatsConfig { servers: vec![server.url()], ..NatsConfig::default() };
    let client = outbox_nats::connect(&config).await.unwrap();
    let stream = ensure_stream(&client, &config.stream).await.unwrap();
    let publisher = JetStreamHandler::new(client.clone(), &config).unwrap();
    for i in 1..=5 {
        publisher.handle(&record(i)).await.unwrap();
    }
    let js = async_nats::jetstream::new(client.clone());
    let consumer: PullConsumer = js
        .get_stream(&stream.config.name)
        .await
        .unwrap()
        .create_consumer(pull::Config {
            durable_name: Some("read-model".into()),
            ack_wait: Duration::from_secs(1),
            ..pull::Config::default()
        })
        .await
        .unwrap();
    let inbox = outbox(&db, |_| {}).await.inbox();
    db.db.execute("CREATE TABLE read_model (body VARCHAR(16) NOT NULL)", &[]).await.unwrap();

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
    assert_eq!(consumed, Consumed { applied: 2, duplicates: 3, failed: 1 });
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
