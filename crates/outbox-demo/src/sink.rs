//! Where the demo's events go and how `run` and `verify` read them back: NATS JetStream, or, when no
//! NATS is configured, a local sink: a SQLite file of messages in arrival order that drops a record id
//! it already holds, as JetStream drops a repeated `Nats-Msg-Id`.

use std::path::PathBuf;

use async_nats::jetstream::stream::RawMessageErrorKind;
use futures::{StreamExt, TryStreamExt};
use outbox_core::{ConnectOptions, Db};
use outbox_core::{HandlerError, Handlers, Record, Route};
use outbox_nats::JetStreamHandler;

use crate::orders::OrderEvent;
use crate::{Context, Failure};

/// The local sink's file when `--sink` / `OUTBOX_DEMO_SINK` is not given.
pub const DEFAULT_PATH: &str = "outbox-demo-sink.db";

const MESSAGES: &str = "CREATE TABLE IF NOT EXISTS messages (
    seq       INTEGER PRIMARY KEY AUTOINCREMENT,  -- arrival order; never reused, like a stream sequence
    record_id BLOB    NOT NULL UNIQUE,            -- the dedup key, as Nats-Msg-Id
    subject   TEXT    NOT NULL,
    payload   BLOB    NOT NULL
)";

/// The configured delivery target.
#[derive(Debug, Clone)]
pub enum Target {
    /// NATS JetStream, as configured in `[nats]` / `NATS_URL`.
    JetStream,
    /// The local sink file.
    Local(PathBuf),
}

/// The delivery target opened for reading back.
pub enum Sink {
    /// The JetStream stream.
    JetStream(Box<async_nats::jetstream::stream::Stream>),
    /// The local sink.
    Local(LocalSink),
}

/// Handlers that deliver every event to the configured target (creating the stream or file if needed).
pub async fn handlers(ctx: &Context) -> Result<Handlers, Failure> {
    Ok(match &ctx.target {
        Target::JetStream => {
            let client = outbox_nats::connect(&ctx.config.nats).await?;
            outbox_nats::ensure_stream(&client, &ctx.config.nats.stream).await?;
            Handlers::new().default_route(Route::new(JetStreamHandler::new(client, &ctx.config.nats)?))
        }
        Target::Local(path) => Handlers::new().default_route(Route::new(LocalSink::open(path).await?)),
    })
}

impl Sink {
    /// Opens the target; `create`: make the stream or file if this is the first run.
    pub async fn open(ctx: &Context, create: bool) -> Result<Sink, Failure> {
        match &ctx.target {
            Target::Local(path) => {
                if !create && !path.exists() {
                    return Err(Failure(format!("no local sink at {} (has a worker run yet?)", path.display())));
                }
                Ok(Sink::Local(LocalSink::open(path).await?))
            }
            Target::JetStream => {
                let settings = &ctx.config.nats.stream;
                let client = outbox_nats::connect(&ctx.config.nats).await?;
                if create {
                    outbox_nats::ensure_stream(&client, settings).await?;
                }
                let stream = async_nats::jetstream::new(client).get_stream(&settings.name).await.map_err(|e| {
                    Failure(format!("cannot open stream {:?}: {e} (has a worker run yet?)", settings.name))
                })?;
                Ok(Sink::JetStream(Box::new(stream)))
            }
        }
    }

    /// Deletes every message; sequence numbers go on from where they were.
    pub async fn purge(&mut self) -> Result<(), Failure> {
        match self {
            Sink::JetStream(stream) => {
                stream.purge().await.map_err(|e| Failure(format!("purging the demo stream: {e}")))?;
            }
            Sink::Local(sink) => {
                sink.db.execute("DELETE FROM messages", &[]).await.map_err(local)?;
            }
        }
        Ok(())
    }

    /// The sequence number of the last message ever stored (0: none).
    pub async fn last_seq(&mut self) -> Result<u64, Failure> {
        match self {
            Sink::JetStream(stream) => {
                Ok(stream.info().await.map_err(|e| Failure(format!("stream info: {e}")))?.state.last_sequence)
            }
            Sink::Local(sink) => {
                let (last,): (i64,) =
                    sink.db.fetch_one("SELECT coalesce(max(seq), 0) FROM messages", &[]).await.map_err(local)?;
                Ok(u64::try_from(last).unwrap_or_default())
            }
        }
    }

    /// Every order event held, in arrival order.
    pub async fn read_all(&mut self) -> Result<Vec<OrderEvent>, Failure> {
        match self {
            Sink::JetStream(stream) => {
                let state = stream.info().await.map_err(|e| Failure(format!("stream info: {e}")))?.state.clone();
                if state.messages == 0 {
                    return Ok(Vec::new());
                }
                self.read_range(state.first_sequence, state.last_sequence).await
            }
            Sink::Local(_) => self.read_range(0, u64::MAX).await,
        }
    }

    /// The order events with sequence `from..=to`, in order; other messages and gaps are skipped.
    pub async fn read_range(&self, from: u64, to: u64) -> Result<Vec<OrderEvent>, Failure> {
        let payloads: Vec<Option<Vec<u8>>> = match self {
            Sink::JetStream(stream) => {
                futures::stream::iter(from..=to)
                    .map(|seq| async move {
                        match stream.get_raw_message(seq).await {
                            Ok(message) => Ok(Some(message.payload.to_vec())),
                            // A deleted sequence number inside the range is not an error.
                            Err(e) if e.kind() == RawMessageErrorKind::NoMessageFound => Ok(None),
                            Err(e) => Err(Failure(format!("reading stream message {seq}: {e}"))),
                        }
                    })
                    .buffered(64)
                    .try_collect()
                    .await?
            }
            Sink::Local(sink) => {
                let range = [from, to].map(|seq| i64::try_from(seq).unwrap_or(i64::MAX).into());
                let rows: Vec<(Vec<u8>,)> = sink
                    .db
                    .fetch_all("SELECT payload FROM messages WHERE seq BETWEEN $1 AND $2 ORDER BY seq", &range)
                    .await
                    .map_err(local)?;
                rows.into_iter().map(|(payload,)| Some(payload)).collect()
            }
        };
        Ok(payloads.into_iter().flatten().filter_map(|p| serde_json::from_slice(&p).ok()).collect())
    }
}

/// The local sink: a handler that stores each event once, by record id.
#[derive(Clone)]
pub struct LocalSink {
    db: Db,
}

impl LocalSink {
    /// Opens (creating if needed) the sink file.
    pub async fn open(path: &std::path::Path) -> Result<LocalSink, Failure> {
        let url = format!("sqlite://{}", path.display());
        let options = ConnectOptions { max_connections: 4, ..ConnectOptions::default() };
        let db = Db::connect_with(&url, &options).await.map_err(local)?;
        db.execute(MESSAGES, &[]).await.map_err(local)?;
        Ok(LocalSink { db })
    }
}

impl outbox_core::Handler for LocalSink {
    async fn handle(&self, record: &Record) -> Result<(), HandlerError> {
        let subject = format!("outbox.{}", record.event_type);
        self.db
            .execute(
                "INSERT INTO messages (record_id, subject, payload) VALUES ($1, $2, $3) ON CONFLICT (record_id) DO NOTHING",
                &[record.id.into(), subject.as_str().into(), record.payload.as_ref().into()],
            )
            .await
            .map_err(|e| HandlerError::retryable(format!("local sink: {e}")))?;
        Ok(())
    }
}

fn local(e: outbox_core::Error) -> Failure {
    Failure(format!("local sink: {e}"))
}
