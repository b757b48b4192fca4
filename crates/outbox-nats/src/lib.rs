//! # outbox-nats
//!
//! Delivers outbox records to NATS JetStream, the handler most users plug in.
//!
//! - The JetStream message id (`Nats-Msg-Id`) is the record's stable id, so a redelivery within the
//!   stream's duplicate window is dropped by the broker (an ack flagged duplicate counts as delivered).
//! - The body is the payload, unchanged. Headers: `Nats-Msg-Id`, `Outbox-Key`, `Outbox-Partition`,
//!   `Outbox-Seq`, `Outbox-Event-Type`, `Outbox-Epoch`, plus the record's own headers (trace context
//!   passes through).
//! - A record counts as delivered only when JetStream acknowledged it; the processor keeps at most one
//!   unacknowledged record per key and many keys in flight, and the handler sends the publishes of the
//!   keys in flight to the connection together.
//! - Failures are classified by kind: unreachable broker, timeouts, no responders, a full stream are
//!   retryable; a message over the server's `max_payload`, its stream's `max_msg_size` or JetStream's
//!   64 KiB of headers, a record's `Nats-Expected-*` header the stream does not meet, or a subject no
//!   stream captures while the configured stream is there, are permanent.
//! - On the consuming side, [`apply_once`] applies each message of a JetStream consumer once to a
//!   database, through the consumer's [`Inbox`](outbox_core::inbox::Inbox).
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use outbox_core::{Handlers, Route};
//! use outbox_nats::{JetStreamHandler, NatsConfig};
//! let config = NatsConfig::default();
//! let client = outbox_nats::connect(&config).await?;
//! outbox_nats::ensure_stream(&client, &config.stream).await?;
//! let handlers = Handlers::new().default_route(Route::new(JetStreamHandler::new(client, &config)?));
//! # let _ = handlers;
//! # Ok(()) }
//! ```
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used))]

pub mod config;
mod connection;
pub mod consume;
mod outgoing;
pub mod publisher;
pub mod stream;
pub mod subject;

pub use config::{Auth, NatsConfig, StreamSettings, Tls};
pub use connection::connect;
pub use consume::{Consumed, apply_once, key_and_seq};
pub use publisher::{JetStreamHandler, headers};
pub use stream::ensure_stream;
pub use subject::SubjectTemplate;

/// Errors of `outbox-nats` (setting up; delivery failures are `outbox_core::HandlerError`s).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Invalid configuration; the message names the field.
    #[error("invalid NATS configuration: {0}")]
    Config(String),
    /// The broker could not be reached or refused the connection.
    #[error("cannot connect to NATS at {servers}: {source}")]
    Connect {
        /// The configured servers, credentials redacted.
        servers: String,
        /// The client's error.
        source: async_nats::ConnectError,
    },
    /// Reading a credentials file failed.
    #[error("cannot read NATS credentials file {}: {source}", path.display())]
    Credentials {
        /// The configured file.
        path: std::path::PathBuf,
        /// Why it could not be read.
        source: std::io::Error,
    },
    /// A JetStream API request about the stream failed.
    #[error("JetStream stream {stream:?}: {message}")]
    Stream {
        /// Stream name.
        stream: String,
        /// What failed.
        message: String,
        /// Whether the server refused the stream for good: subjects another stream captures, replicas
        /// a server that is not clustered cannot keep, settings it finds invalid, JetStream not enabled
        /// (for the account). Otherwise the broker did not answer, or not yet.
        refused: bool,
    },
    /// Reading a consumer's messages ended with an error it does not read on after (the consumer was
    /// deleted, is push based, or refused the pull's size), or with one it reads on after (the broker
    /// out of reach) that went on for a minute: [`Error::is_transient`] tells them apart.
    #[error("reading JetStream messages: {0}")]
    Messages(#[source] async_nats::jetstream::consumer::pull::MessagesError),
    /// [`apply_once`] was given a consumer whose acks are not message by message: with `AckPolicy::All`
    /// the ack of a later message settles a failed one, with `AckPolicy::None` nothing comes again.
    #[error(
        "JetStream consumer {consumer:?} of stream {stream:?} acks with {policy:?}; apply_once needs AckPolicy::Explicit"
    )]
    AckPolicy {
        /// Stream name.
        stream: String,
        /// Consumer name.
        consumer: String,
        /// Its ack policy.
        policy: async_nats::jetstream::consumer::AckPolicy,
    },
    /// The stream exists with settings that differ from the configured ones.
    #[error("JetStream stream {stream:?} exists but differs from the configuration: {}", differences.join("; "))]
    StreamMismatch {
        /// Stream name.
        stream: String,
        /// One entry per differing setting.
        differences: Vec<String>,
    },
}

impl Error {
    /// Whether retrying later may succeed: the broker was unreachable (refused, timed out, a name not
    /// resolved yet), a stream request went unanswered, or a consumer's messages could not be read for
    /// a minute. Not credentials the server refuses, a TLS setup it does not meet (a server without TLS
    /// answers the handshake with data that is not TLS), an address that does not parse, a stream the
    /// server refused, or a message stream that ended: a start-up loop retrying those would never end.
    pub fn is_transient(&self) -> bool {
        use async_nats::ConnectErrorKind as Kind;
        match self {
            Error::Connect { source, .. } => match source.kind() {
                Kind::ServerParse | Kind::Authentication | Kind::AuthorizationViolation | Kind::Tls => false,
                Kind::Io => std::error::Error::source(source)
                    .and_then(|e| e.downcast_ref::<std::io::Error>())
                    .is_none_or(|e| e.kind() != std::io::ErrorKind::InvalidData),
                Kind::Dns | Kind::TimedOut | Kind::MaxReconnects => true,
            },
            Error::Stream { refused, .. } => !refused,
            Error::Messages(e) => consume::reads_on_after(e),
            _ => false,
        }
    }
}

/// Result alias of `outbox-nats`.
pub type Result<T, E = Error> = std::result::Result<T, E>;
