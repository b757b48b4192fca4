//! The JetStream handler: publish with `Nats-Msg-Id` = record id, wait for the ack, classify failures.

use async_nats::Client;
use async_nats::jetstream::ErrorCode;
use async_nats::jetstream::context::{
    Context, ContextBuilder, GetStreamByNameErrorKind, PublishError, PublishErrorKind,
};
use async_nats::jetstream::message::PublishMessage;
use async_nats::{HeaderMap, HeaderName};
use outbox_core::{Handler, HandlerError, Record};
use tracing::debug;

use crate::Result;
use crate::config::NatsConfig;
use crate::outgoing::Outgoing;
use crate::subject::{SubjectTemplate, matches};

/// Header carrying the record key.
pub const KEY_HEADER: &str = "Outbox-Key";
/// Header carrying the partition.
pub const PARTITION_HEADER: &str = "Outbox-Partition";
/// Header carrying the per-key sequence number (strictly increasing in commit order, not consecutive).
pub const SEQ_HEADER: &str = "Outbox-Seq";
/// Header carrying the event type.
pub const EVENT_TYPE_HEADER: &str = "Outbox-Event-Type";
/// Header carrying the ownership epoch the record was delivered under.
pub const EPOCH_HEADER: &str = "Outbox-Epoch";

// The same names as the client's header names, built once: a name given as `&str` is checked and
// copied into a fresh allocation on every insert, five per message.
const KEY: HeaderName = HeaderName::from_static(KEY_HEADER);
const PARTITION: HeaderName = HeaderName::from_static(PARTITION_HEADER);
const SEQ: HeaderName = HeaderName::from_static(SEQ_HEADER);
const EVENT_TYPE: HeaderName = HeaderName::from_static(EVENT_TYPE_HEADER);
const EPOCH: HeaderName = HeaderName::from_static(EPOCH_HEADER);

/// Publishes records to JetStream. Clone-cheap; share one per process.
#[derive(Clone)]
pub struct JetStreamHandler {
    js: Context,
    outgoing: Outgoing,
    subject: SubjectTemplate,
    /// The configured stream's name.
    stream: String,
}

impl JetStreamHandler {
    /// A handler publishing through `client` with the subject template and publish timeout of `config`.
    pub fn new(client: Client, config: &NatsConfig) -> Result<Self> {
        config.validate()?;
        let js = ContextBuilder::new().timeout(config.publish_timeout).build(client);
        let subject = SubjectTemplate::parse(&config.subject)?;
        let outgoing = Outgoing::new(js.clone(), config.publish_timeout);
        Ok(Self { outgoing, js, subject, stream: config.stream.name.clone() })
    }

    /// The subject a record is published to.
    pub fn subject(&self, record: &Record) -> String {
        self.subject.render(record)
    }

    async fn publish(&self, record: &Record) -> std::result::Result<(), HandlerError> {
        let message = PublishMessage::build()
            .payload(record.payload.clone())
            .headers(headers(record))
            .message_id(record.id.hyphenated().encode_lower(&mut uuid::Uuid::encode_buffer()));
        // The subject is rendered again only for a failure's message.
        let ack = self.outgoing.publish(self.subject(record), message).await.map_err(|stopped| {
            HandlerError::retryable(format!("{}: {stopped}", about(record, &self.subject(record))))
        })?;
        match ack {
            Ok(ack) => {
                debug!(record = %record.id, key = %record.key, stream = %ack.stream, sequence = ack.sequence,
                    duplicate = ack.duplicate, "published");
                Ok(())
            }
            Err(e) => Err(self.classify(record, &self.subject(record), e).await),
        }
    }

    /// Retryable unless retrying cannot help: a message over the server's or its stream's limit, over
    /// JetStream's 64 KiB of headers, a `Nats-Expected-*` header of the record's that the stream does
    /// not meet (it never will: the stream only moves on), or a subject that no stream captures while
    /// the configured stream is there. "No responders" means no stream, a stream without a leader right
    /// now, or the configured stream missing for a while (deleted and made again, restored); asking the
    /// server which stream captures the subject, then whether the configured one is there (and, if it
    /// is, whether it was made again meanwhile, capturing the subject), tells them apart.
    async fn classify(&self, record: &Record, subject: &str, error: PublishError) -> HandlerError {
        let context = about(record, subject);
        match error.kind() {
            PublishErrorKind::MaxPayloadExceeded => HandlerError::permanent(format!(
                "{context}: {error} (raise the server's max_payload or shrink the event)"
            )),
            PublishErrorKind::WrongLastSequence | PublishErrorKind::WrongLastMessageId => {
                HandlerError::permanent(format!("{context}: {error} (the record's Nats-Expected-* header was not met)"))
            }
            PublishErrorKind::Other => match api_error(&error) {
                Some(ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM) => HandlerError::permanent(format!(
                    "{context}: {error} (raise the stream's max_msg_size or shrink the event)"
                )),
                Some(ErrorCode::STREAM_HEADER_EXCEEDS_MAXIMUM) => {
                    HandlerError::permanent(format!("{context}: {error} (shrink the record's headers)"))
                }
                Some(ErrorCode::STREAM_NOT_MATCH) => HandlerError::permanent(format!(
                    "{context}: {error} (the record's Nats-Expected-Stream header was not met)"
                )),
                _ => HandlerError::retryable(format!("{context}: {error}")),
            },
            PublishErrorKind::StreamNotFound => match self.js.stream_by_subject(subject).await {
                Err(e) if matches!(e.kind(), GetStreamByNameErrorKind::NotFound) => {
                    match self.js.get_stream(&self.stream).await {
                        // Made again between the two lookups: the publish meets it next time.
                        Ok(stream) if stream.cached_info().config.subjects.iter().any(|p| matches(p, subject)) => {
                            HandlerError::retryable(format!(
                                "{context}: no JetStream stream captured this subject; stream {:?} is back",
                                self.stream
                            ))
                        }
                        Ok(_) => {
                            HandlerError::permanent(format!("{context}: no JetStream stream captures this subject"))
                        }
                        Err(e) if crate::stream::is_not_found(&e) => HandlerError::retryable(format!(
                            "{context}: no JetStream stream captures this subject, and stream {:?} is missing \
                             (deleted, or being restored?)",
                            self.stream
                        )),
                        Err(e) => HandlerError::retryable(format!(
                            "{context}: no JetStream stream captures this subject; looking up stream {:?} failed: {e}",
                            self.stream
                        )),
                    }
                }
                Ok(stream) => {
                    HandlerError::retryable(format!("{context}: no responders for stream {stream:?} (no leader?)"))
                }
                Err(e) => HandlerError::retryable(format!("{context}: no responders; stream lookup failed: {e}")),
            },
            _ => HandlerError::retryable(format!("{context}: {error}")),
        }
    }
}

/// The code of the JetStream API error a publish was answered with, if it was.
fn api_error(error: &PublishError) -> Option<ErrorCode> {
    std::error::Error::source(error)?.downcast_ref::<async_nats::jetstream::Error>().map(|e| e.error_code())
}

/// Which record a failure is about, and where it was going.
fn about(record: &Record, subject: &str) -> String {
    format!("record {} (key {:?}, partition {}) to {subject:?}", record.id, record.key, record.partition)
}

impl Handler for JetStreamHandler {
    fn handle(&self, record: &Record) -> impl Future<Output = std::result::Result<(), HandlerError>> + Send {
        self.publish(record)
    }
}

/// The headers a record is published with (`Nats-Msg-Id` is added by the publish itself).
pub fn headers(record: &Record) -> HeaderMap {
    let mut headers = HeaderMap::new();
    for (name, value) in &record.headers {
        headers.insert(name.as_str(), value.as_str());
    }
    headers.insert(KEY, record.key.as_str());
    headers.insert(PARTITION, record.partition.to_string());
    headers.insert(SEQ, record.seq.to_string());
    headers.insert(EVENT_TYPE, record.event_type.as_str());
    headers.insert(EPOCH, record.epoch.to_string());
    headers
}
