//! The consumer: another service's view of the orders, kept from the stream. It reads the JetStream
//! stream through a durable consumer and keeps a read model (order → last status) in the database,
//! each event applied once through the inbox (`outbox_nats::apply_once`): a consumer killed between
//! its commit and its ack sees the event again and skips it. An event the consumer had not applied when
//! it died comes back after the order's later events, so the read model also keeps each order's last
//! applied `Outbox-Seq` (`Inbox::accept_in_order`) and skips the older one. `verify` compares the read
//! model with the orders table.

use std::time::Duration;

use async_nats::jetstream::Message;
use async_nats::jetstream::consumer::{PullConsumer, pull};
use futures::StreamExt;
use outbox_core::{BoxError, Db, Tx};
use tokio::signal::unix::{SignalKind, signal};

use crate::orders::OrderEvent;
use crate::sink::Target;
use crate::{Context, Failure};

/// The read model, in SQL every backend accepts.
const READ_MODEL: &str = "CREATE TABLE IF NOT EXISTS demo_read_model (
    order_id VARCHAR(64) PRIMARY KEY,
    status   VARCHAR(64) NOT NULL,
    seq      INTEGER     NOT NULL
)";
/// Updated, or inserted when the update found no row (no upsert syntax is common to the backends;
/// one consumer applies an order's events one after another).
const UPDATE: &str = "UPDATE demo_read_model SET status = $2, seq = $3 WHERE order_id = $1";
const INSERT: &str = "INSERT INTO demo_read_model (order_id, status, seq) VALUES ($1, $2, $3)";

/// The durable consumer's name, and the inbox source of its messages.
const CONSUMER: &str = "demo-read-model";

pub async fn create_tables(db: &Db) -> Result<(), Failure> {
    db.execute(READ_MODEL, &[]).await?;
    Ok(())
}

/// Keeps the read model until SIGTERM or SIGINT.
pub async fn run(ctx: &Context) -> Result<(), Failure> {
    if !matches!(ctx.target, Target::JetStream) {
        return Err(Failure("consume reads NATS JetStream: set NATS_URL (or run ./scripts/demo.sh consume)".into()));
    }
    create_tables(&ctx.db).await?;
    let client = outbox_nats::connect(&ctx.config.nats).await?;
    let settings = &ctx.config.nats.stream;
    let stream = outbox_nats::ensure_stream(&client, settings).await?;
    let js = async_nats::jetstream::new(client);
    let consumer: PullConsumer = js
        .get_stream(&stream.config.name)
        .await
        .map_err(|e| Failure(format!("JetStream stream {:?}: {e}", stream.config.name)))?
        .get_or_create_consumer(
            CONSUMER,
            pull::Config {
                durable_name: Some(CONSUMER.into()),
                ack_wait: Duration::from_secs(5),
                ..Default::default()
            },
        )
        .await
        .map_err(|e| Failure(format!("JetStream consumer {CONSUMER:?}: {e}")))?;
    let messages = consumer.messages().await.map_err(|e| Failure(format!("reading {CONSUMER:?}: {e}")))?;
    let (mut term, mut int) = (
        signal(SignalKind::terminate()).map_err(|e| Failure(e.to_string()))?,
        signal(SignalKind::interrupt()).map_err(|e| Failure(e.to_string()))?,
    );
    let stopped = async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
    };
    eprintln!("consumer {CONSUMER} running; SIGTERM or Ctrl-C stops it");
    let inbox = ctx.outbox.inbox();
    let apply = async |tx: &mut Tx, message: &Message| {
        // A redelivered event can arrive after the order's next one: only a later event moves the state.
        let (key, seq) = outbox_nats::key_and_seq(message).ok_or("no Outbox-Key and Outbox-Seq headers")?;
        if inbox.accept_in_order(&mut *tx, CONSUMER, key, seq).await? {
            apply(tx, message).await?;
        }
        Ok(())
    };
    let consumed = outbox_nats::apply_once(messages.take_until(stopped), &ctx.db, &inbox, CONSUMER, apply)
        .await
        .map_err(|e| Failure(format!("reading {CONSUMER:?}: {e}")))?;
    eprintln!(
        "consumer stopped: {} applied, {} already applied, {} failed ({} on their last delivery, the others delivered again)",
        consumed.applied, consumed.duplicates, consumed.failed, consumed.given_up
    );
    Ok(())
}

/// Applies one order event to the read model.
async fn apply(tx: &mut Tx, message: &Message) -> Result<(), BoxError> {
    let event: OrderEvent = serde_json::from_slice(&message.payload)?;
    let seq = i64::from(event.seq);
    let args = [(&event.key).into(), (&event.step).into(), seq.into()];
    if tx.execute(UPDATE, &args).await? == 0 {
        tx.execute(INSERT, &args).await?;
    }
    Ok(())
}

/// Orders whose status in the read model differs from the orders table (missing rows included),
/// with both statuses; `None` if the read model was never kept.
pub async fn mismatches(db: &Db) -> Result<Option<Vec<(String, String, Option<String>)>>, Failure> {
    let kept: Result<Vec<(i64,)>, _> = db.fetch_all("SELECT count(*) FROM demo_read_model", &[]).await;
    if !matches!(kept.as_deref(), Ok([(n,)]) if *n > 0) {
        return Ok(None);
    }
    const COMPARE: &str = "SELECT o.id, o.status, m.status FROM demo_orders o
        LEFT JOIN demo_read_model m ON m.order_id = o.id
        WHERE m.status IS NULL OR m.status <> o.status";
    Ok(Some(db.fetch_all(COMPARE, &[]).await?))
}
