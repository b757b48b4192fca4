//! Consuming a JetStream stream exactly once into a database: for each message, one transaction of the
//! consumer's database accepts the message in its [`Inbox`] and, if it is new, applies it; the
//! transaction commits, and only then is the message acknowledged. A message delivered again (the
//! consumer crashed between commit and ack, the ack was lost, a producer published it twice) finds its
//! inbox row and is acknowledged without being applied again. A message whose apply or transaction
//! fails is rolled back and negatively acknowledged with a growing delay, so JetStream delivers it
//! again; unless the database failed in a way that may pass (out of reach, a deadlock): then the same
//! message is tried again in place, for up to a minute, and JetStream told it is in progress, so a
//! short outage does not use up its deliveries (a consumer's `max_deliver`).

use std::time::Duration;

use async_nats::jetstream::consumer::AckPolicy;
use async_nats::jetstream::consumer::pull::{self, MessagesError, MessagesErrorKind};
use async_nats::jetstream::{AckKind, Message};
use backon::{BackoffBuilder, ExponentialBackoff, ExponentialBuilder};
use futures::{Stream, StreamExt};
use outbox_core::inbox::{Inbox, MAX_INBOX_ID_BYTES};
use outbox_core::{BoxError, Db, Tx};
use tokio::time::Instant;
use tracing::{debug, error, warn};
use xxhash_rust::xxh3::xxh3_128;

use crate::{Error, Result};

/// What [`apply_once`] did with the messages it read.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Consumed {
    /// Applied and acknowledged.
    pub applied: u64,
    /// Found in the inbox (applied before) and acknowledged.
    pub duplicates: u64,
    /// Rolled back and negatively acknowledged, for JetStream to deliver again.
    pub failed: u64,
    /// Of those failed, the ones that failed on the last delivery the consumer allows (its
    /// `max_deliver`): JetStream will not deliver them again, and each is logged as an error.
    pub given_up: u64,
}

/// Reads `messages` (a JetStream pull consumer's, say `consumer.messages().await?`) until the stream
/// ends, applying each once through `inbox` under `source` (see the [module docs](self)). A message's
/// inbox id is its `Nats-Msg-Id` header (the outbox record's id, for messages the outbox published; a
/// digest of it if longer than an inbox id), else its stream sequence. `apply` runs inside the
/// transaction; its error, or the database's, rolls the message back and naks it. An error of the
/// database's ([`outbox_core::Error`], from `apply` too) that [`is_transient`](outbox_core::Error::is_transient)
/// instead has the message tried again after a pause (50 ms, doubling up to 2 s), for up to a minute
/// of such errors (a failover's), then it is nak'ed as any failure. JetStream is told the message is
/// in progress every third of the consumer's `ack_wait` until it is settled, so it delivers it neither
/// again nor to another reader meanwhile; the messages the client has already pulled behind it still
/// reach their ack wait and are delivered again (counted towards `max_deliver`), so with a
/// `max_deliver` pull few at a time.
///
/// The consumer must acknowledge message by message (`AckPolicy::Explicit`, the default): another
/// policy is refused at the first message ([`Error::AckPolicy`]), as failed messages would be lost.
/// A consumer with a `max_deliver` stops delivering a message that failed that many times: such a
/// last failure is counted in [`Consumed::given_up`] and logged as an error naming the message.
/// Errors the message stream reads on after (a missed heartbeat, no responders during a leader
/// election, a pull that failed while the client reconnected) are logged and read past, after a short
/// pause that grows while they repeat, for up to a minute of errors in a row (each within a minute of
/// the last, no message between); then, and at once for one that ends the stream (the consumer was
/// deleted while connected), the error is returned.
pub async fn apply_once<S, F>(messages: S, db: &Db, inbox: &Inbox, source: &str, mut apply: F) -> Result<Consumed>
where
    S: Stream<Item = Result<Message, MessagesError>>,
    F: AsyncFnMut(&mut Tx, &Message) -> Result<(), BoxError>,
{
    let mut consumed = Consumed::default();
    let mut messages = std::pin::pin!(messages);
    // The consumer's settings, read at the first message.
    let mut settings = None;
    let mut pauses = read_on_pauses();
    // When the errors in a row began, and when the last one came.
    let mut failing: Option<(Instant, Instant)> = None;
    while let Some(message) = messages.next().await {
        let message = match message {
            Ok(message) => {
                pauses = read_on_pauses();
                failing = None;
                message
            }
            Err(e) if reads_on_after(&e) && read_on(&mut failing, &mut pauses) => {
                let pause = pauses.next().unwrap_or(READ_ON_MAX);
                warn!(source, error = %e, retry_in = ?pause, "reading JetStream messages failed; reading on");
                tokio::time::sleep(pause).await;
                continue;
            }
            Err(e) => return Err(Error::Messages(e)),
        };
        let Settings { max_deliver, ack_wait } = match settings {
            Some(checked) => checked,
            None => *settings.insert(explicit_acks(&message, source).await?),
        };
        let id = message_id(&message);
        let settled = async {
            let mut pauses = read_on_pauses();
            let since = Instant::now();
            loop {
                match apply_in_transaction(db, inbox, source, &id, &message, &mut apply).await {
                    // Past a minute it counts as a delivery, as any failure: one the message causes
                    // (too large for a time limit) or a pool closed for good must not hold it for ever.
                    Err(e) if outage(&*e) && since.elapsed() < READ_ON_FOR => {
                        let pause = pauses.next().unwrap_or(READ_ON_MAX);
                        warn!(source, message = %id, error = %e, retry_in = ?pause,
                            "applying a message failed on the database's side; rolled back, tried again in place");
                        tokio::time::sleep(pause).await;
                    }
                    settled => return settled,
                }
            }
        };
        match in_progress(&message, (ack_wait / 3).max(PROGRESS_AT_MOST_EVERY), settled).await {
            Ok(applied) => {
                if let Err(e) = message.ack().await {
                    // Applied and committed: delivered again, it finds its inbox row.
                    warn!(source, message = %id, error = %e, "ack failed; the message will be delivered again and skipped");
                }
                if applied {
                    consumed.applied += 1;
                } else {
                    debug!(source, message = %id, "already applied; acknowledged");
                    consumed.duplicates += 1;
                }
            }
            Err(e) => {
                let delay = redelivery_delay(&message);
                let info = message.info().ok();
                let delivered = info.as_ref().map_or(1, |info| info.delivered);
                if max_deliver.is_some_and(|most| delivered >= most) {
                    // The one trace of a message never delivered again: enough to find it in the stream.
                    let (stream, stream_sequence) = info.map_or(("?", 0), |info| (info.stream, info.stream_sequence));
                    let (key, seq) = key_and_seq(&message).map_or((None, None), |(k, s)| (Some(k), Some(s)));
                    error!(source, message = %id, error = %e, delivered, stream, stream_sequence,
                        subject = %message.subject, key, seq,
                        "applying a message failed on the last delivery the consumer allows (max_deliver); rolled back, and JetStream will not deliver it again");
                    consumed.given_up += 1;
                } else {
                    warn!(source, message = %id, error = %e, redelivered_in = ?delay,
                        "applying a message failed; rolled back, delivered again later");
                }
                if let Err(e) = message.ack_with(AckKind::Nak(Some(delay))).await {
                    warn!(source, message = %id, error = %e, "nak failed; JetStream delivers the message again after its ack wait");
                }
                consumed.failed += 1;
            }
        }
    }
    Ok(consumed)
}

/// Whether `error` is the database's, and may pass: the message is not at fault, and trying it again
/// later must not count as one of its deliveries.
fn outage(error: &(dyn std::error::Error + 'static)) -> bool {
    error.downcast_ref::<outbox_core::Error>().is_some_and(outbox_core::Error::is_transient)
}

/// The shortest time between two reports that a message is in progress.
const PROGRESS_AT_MOST_EVERY: Duration = Duration::from_millis(10);

/// Runs `work`, telling JetStream every `every` that `message` is in progress (which restarts its ack
/// wait), so that a message waiting for the database is not delivered again.
async fn in_progress<T>(message: &Message, every: Duration, work: impl Future<Output = T>) -> T {
    let mut work = std::pin::pin!(work);
    let mut ticks = tokio::time::interval_at(Instant::now() + every, every);
    loop {
        tokio::select! {
            done = &mut work => return done,
            _ = ticks.tick() => {
                if let Err(e) = message.ack_with(AckKind::Progress).await {
                    debug!(error = %e, "telling JetStream a message is in progress failed");
                }
            }
        }
    }
}

/// Whether the message stream goes on after `error` (async-nats ends it after the others).
pub(crate) fn reads_on_after(error: &MessagesError) -> bool {
    matches!(
        error.kind(),
        MessagesErrorKind::MissingHeartbeat
            | MessagesErrorKind::NoResponders
            | MessagesErrorKind::Pull
            | MessagesErrorKind::Other
    )
}

/// Whether to read on after an error that came now: unless the errors in a row have gone on for
/// [`READ_ON_FOR`]. An error [`READ_ON_FOR`] after the last one begins a new row (and its pauses): a
/// consumer of a quiet subject sees no message after it recovers, and its next hiccup, minutes later,
/// ended it as if the errors had never stopped.
fn read_on(failing: &mut Option<(Instant, Instant)>, pauses: &mut ExponentialBackoff) -> bool {
    let now = Instant::now();
    let since = match *failing {
        Some((since, last)) if now.duration_since(last) < READ_ON_FOR => since,
        Some(_) => {
            *pauses = read_on_pauses();
            now
        }
        None => now,
    };
    *failing = Some((since, now));
    now.duration_since(since) < READ_ON_FOR
}

/// The pauses after errors in a row: 50 ms, doubling up to 2 s.
fn read_on_pauses() -> ExponentialBackoff {
    ExponentialBuilder::new()
        .with_min_delay(Duration::from_millis(50))
        .with_max_delay(READ_ON_MAX)
        .without_max_times()
        .build()
}

const READ_ON_MAX: Duration = Duration::from_secs(2);

/// How long errors may follow one another, without a message between them, before the last one is
/// returned (a consumer deleted while the client was away answers every pull with "no responders", and
/// a pull the server refuses is refused again); how long after the last error a row of them ends; and
/// how long a message is tried again in place while the database fails in a way that may pass.
const READ_ON_FOR: Duration = Duration::from_secs(60);

/// What [`apply_once`] reads of its consumer's settings.
#[derive(Debug, Clone, Copy)]
struct Settings {
    /// `None`: unbounded, or not known.
    max_deliver: Option<i64>,
    /// How long JetStream waits for an ack before delivering a message again.
    ack_wait: Duration,
}

/// JetStream's `ack_wait` where a consumer does not set one.
const DEFAULT_ACK_WAIT: Duration = Duration::from_secs(30);

/// Refuses a consumer that does not acknowledge message by message; returns its settings. A consumer
/// whose settings cannot be read (the account may not allow asking) is taken as it is, with a warning,
/// and JetStream's defaults.
async fn explicit_acks(message: &Message, source: &str) -> Result<Settings> {
    let unknown = Settings { max_deliver: None, ack_wait: DEFAULT_ACK_WAIT };
    let Ok(info) = message.info() else { return Ok(unknown) };
    let (stream, consumer) = (info.stream.to_string(), info.consumer.to_string());
    match message.context.get_consumer_from_stream::<pull::Config, _, _>(&consumer, &stream).await {
        Ok(found) => match &found.cached_info().config {
            config if config.ack_policy == AckPolicy::Explicit => Ok(Settings {
                max_deliver: Some(config.max_deliver).filter(|&n| n > 0),
                ack_wait: Some(config.ack_wait).filter(|wait| !wait.is_zero()).unwrap_or(DEFAULT_ACK_WAIT),
            }),
            config => Err(Error::AckPolicy { stream, consumer, policy: config.ack_policy }),
        },
        Err(e) => {
            warn!(source, %stream, %consumer, error = %e, "cannot read the consumer's ack policy; it must be explicit");
            Ok(unknown)
        }
    }
}

/// How long JetStream waits before delivering a failed message again: 100 ms after its first delivery,
/// doubling with each delivery up to 30 s, so a message that always fails does not spin the consumer.
fn redelivery_delay(message: &Message) -> Duration {
    let deliveries = message.info().map_or(1, |info| info.delivered.max(1));
    let doublings = u32::try_from(deliveries - 1).unwrap_or(u32::MAX).min(9);
    (REDELIVERY_FIRST * 2u32.pow(doublings)).min(REDELIVERY_MAX)
}

const REDELIVERY_FIRST: Duration = Duration::from_millis(100);
const REDELIVERY_MAX: Duration = Duration::from_secs(30);

/// Accepts and, if new, applies one message in a transaction of its own; whether it applied it.
async fn apply_in_transaction<F>(
    db: &Db,
    inbox: &Inbox,
    source: &str,
    id: &str,
    message: &Message,
    apply: &mut F,
) -> Result<bool, BoxError>
where
    F: AsyncFnMut(&mut Tx, &Message) -> Result<(), BoxError>,
{
    let mut tx = db.begin().await?;
    let new = inbox.accept(&mut tx, source, id).await?;
    if new {
        // Dropped on error: the transaction rolls back.
        apply(&mut tx, message).await?;
    }
    tx.commit().await?;
    Ok(new)
}

/// The outbox key and sequence number a message was published with (`Outbox-Key`, `Outbox-Seq`), for
/// [`Inbox::accept_in_order`].
pub fn key_and_seq(message: &Message) -> Option<(&str, i64)> {
    let headers = message.headers.as_ref()?;
    let key = headers.get(crate::publisher::KEY_HEADER)?.as_str();
    let seq = headers.get(crate::publisher::SEQ_HEADER)?.as_str().parse().ok()?;
    Some((key, seq))
}

/// The message's `Nats-Msg-Id` (a digest of it if an inbox id cannot hold it), or its stream sequence.
fn message_id(message: &Message) -> String {
    let header = message.headers.as_ref().and_then(|h| h.get(async_nats::header::NATS_MESSAGE_ID));
    match (header.map(|id| id.as_str()).filter(|id| !id.is_empty()), message.info()) {
        (Some(id), _) if id.len() <= MAX_INBOX_ID_BYTES && !id.contains('\0') => id.to_string(),
        (Some(id), _) => format!("xxh3-128:{:032x}", xxh3_128(id.as_bytes())),
        (None, Ok(info)) => format!("{}:{}", info.stream, info.stream_sequence),
        (None, Err(_)) => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use async_nats::jetstream::consumer::pull::{MessagesError, MessagesErrorKind};
    use futures::{Stream, StreamExt};
    use outbox_core::{Config, Db, Outbox, Tx};

    use super::apply_once;

    /// Missed heartbeats, each `gap` after the one before; then nothing, for ever.
    fn missed_heartbeats(
        gaps: Vec<Duration>,
    ) -> impl Stream<Item = Result<async_nats::jetstream::Message, MessagesError>> {
        futures::stream::iter(gaps)
            .then(|gap| async move {
                tokio::time::sleep(gap).await;
                Err(MessagesError::new(MessagesErrorKind::MissingHeartbeat))
            })
            .chain(futures::stream::pending())
    }

    /// Whether `apply_once` is still reading `messages` after ten minutes (on a paused clock).
    async fn reads_on(messages: impl Stream<Item = Result<async_nats::jetstream::Message, MessagesError>>) -> bool {
        let db = Db::connect("sqlite::memory:").await.unwrap();
        let inbox = Outbox::new(Config::default()).unwrap().inbox();
        // Paused once the database is open: its pool's time limits run on the same clock.
        tokio::time::pause();
        let apply = async |_: &mut Tx, _: &async_nats::jetstream::Message| Ok(());
        let consuming = apply_once(messages, &db, &inbox, "orders", apply);
        tokio::time::timeout(Duration::from_secs(600), consuming).await.is_err()
    }

    /// A hiccup minutes after the last one, with no message between (a quiet subject), begins a new
    /// row of errors: the consumer reads on. It ended, as if the errors had gone on all along.
    #[tokio::test]
    async fn a_hiccup_long_after_the_last_one_is_read_past() {
        let apart = vec![Duration::ZERO, Duration::from_secs(300)];
        assert!(reads_on(missed_heartbeats(apart)).await, "the consumer ended at the second hiccup");
    }

    /// Errors following one another for longer than a minute end the consumer with the last one.
    #[tokio::test]
    async fn errors_in_a_row_for_a_minute_end_the_consumer() {
        let in_a_row = vec![Duration::from_secs(5); 20];
        assert!(!reads_on(missed_heartbeats(in_a_row)).await, "the consumer read on past a minute of errors");
    }
}
