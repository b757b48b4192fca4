//! The one error type of `outbox-core`.

use std::time::Duration;

use uuid::Uuid;

/// Everything that can go wrong in `outbox-core`.
///
/// Match on the variant, never on the message; [`Error::is_transient`] says whether retrying the same
/// call later may succeed, [`Error::is_not_migrated`] whether the schema is missing.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The record key is empty.
    #[error("record key is empty")]
    EmptyKey,
    /// The record key is longer than [`MAX_KEY_BYTES`](crate::MAX_KEY_BYTES).
    #[error("record key starting {start:?} is {len} bytes, over the limit of {max} bytes")]
    KeyTooLong {
        /// The key's first 32 characters.
        start: String,
        /// Length of the rejected key in bytes.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The record key cannot be carried as it is: it has a control character (NUL cannot be stored,
    /// CR/LF cannot travel in a header), or whitespace at either end (NATS and HTTP trim header values,
    /// so it would arrive as another key).
    #[error("record key {key:?} {reason}")]
    BadKey {
        /// The rejected key.
        key: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The event type is empty, longer than [`MAX_EVENT_TYPE_BYTES`](crate::MAX_EVENT_TYPE_BYTES), has a
    /// control character, or whitespace at either end (it travels as the `Outbox-Event-Type` header,
    /// which NATS and HTTP clients trim).
    #[error("event type {event_type:?} for key {key:?} {reason}")]
    BadEventType {
        /// Key of the rejected record.
        key: String,
        /// The rejected event type (its first 64 characters).
        event_type: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The payload is larger than the configured `max_payload_bytes`, or than the database takes in one
    /// statement (MySQL's `max_allowed_packet`, with the payload in base64).
    #[error("payload of {len} bytes for key {key:?} is over the limit of {max} bytes")]
    PayloadTooLarge {
        /// Key of the rejected record.
        key: String,
        /// Payload size in bytes.
        len: usize,
        /// The configured limit.
        max: usize,
    },
    /// A batch is more than one statement carries on this database (PostgreSQL: a message of at most
    /// 1 GiB; SQLite: a string of at most a billion bytes, the payloads hex-encoded in it): split it,
    /// within the same transaction if it must stay atomic. Refused before anything is sent.
    #[error(
        "a batch of {records} records takes {bytes} bytes in one statement, over the {max} this database carries; split it"
    )]
    BatchTooLarge {
        /// Records in the batch.
        records: usize,
        /// The bytes the batch would take in its statement.
        bytes: usize,
        /// The most one statement carries.
        max: usize,
    },
    /// A header name or value cannot be carried (names: visible ASCII without `:`; values: no CR, LF or
    /// NUL, no whitespace at either end), or the headers are over
    /// [`MAX_HEADERS_BYTES`](crate::MAX_HEADERS_BYTES) together.
    #[error("invalid header {name:?} for key {key:?}: {reason}")]
    BadHeader {
        /// Key of the rejected record.
        key: String,
        /// The offending header name.
        name: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A [`Delay::After`](crate::Delay::After) longer than [`MAX_DELAY`](crate::MAX_DELAY).
    #[error("delay of {delay:?} for key {key:?} is longer than the {max:?} accepted")]
    DelayTooLong {
        /// Key of the rejected record.
        key: String,
        /// The delay asked for.
        delay: std::time::Duration,
        /// The limit.
        max: std::time::Duration,
    },
    /// A [`Delay::At`](crate::Delay::At) outside the years 1 to 9999, which not every database can store.
    #[error("delivery time {at} for key {key:?} is outside the years 1 to 9999")]
    DeliverAtOutOfRange {
        /// Key of the rejected record.
        key: String,
        /// The time asked for.
        at: chrono::DateTime<chrono::Utc>,
    },
    /// An inbox source or message id that is empty, longer than
    /// [`MAX_INBOX_ID_BYTES`](crate::inbox::MAX_INBOX_ID_BYTES) or holds NUL (or a key, longer than
    /// [`MAX_KEY_BYTES`](crate::MAX_KEY_BYTES)).
    #[error("inbox {what} starting {start:?}, of {len} bytes: it must be 1 to {max} bytes without NUL")]
    BadInboxId {
        /// `"source"`, `"message id"` or `"key"`.
        what: &'static str,
        /// Its first 32 characters.
        start: String,
        /// Its length in bytes.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// An inbox call on a connection outside any transaction: its row would commit at once, before the
    /// message is applied, and a message whose apply then failed would be taken as applied for good.
    #[error("{call} must run in the transaction that applies the message; the connection is in none")]
    NotInTransaction {
        /// The call refused (`"Inbox::accept"`, `"Inbox::accept_in_order"`).
        call: &'static str,
    },
    /// A payload could not be serialised to JSON.
    #[error("payload for key {key:?} could not be serialised to JSON: {source}")]
    Json {
        /// Key of the rejected record.
        key: String,
        /// The serde error.
        source: serde_json::Error,
    },
    /// A page of FAILED records asked for too many, or fewer than one.
    #[error("a page of FAILED records holds 1 to {max}, not {limit}")]
    BadLimit {
        /// The limit asked for.
        limit: i64,
        /// The largest page.
        max: i64,
    },
    /// A configuration value is invalid; the message names the field.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// Workers cannot run on the database session as it is set up: the message says which setting and
    /// what to do (MySQL: `autocommit` off, where each single statement of theirs would stay in an open
    /// transaction, its reads stale and its writes never committed; or READ UNCOMMITTED, where a fetch
    /// would deliver records of transactions that may still roll back).
    #[error("the database session cannot run the outbox's workers: {0}")]
    UnsuitableSession(String),
    /// A table or column this library uses is missing: the schema has not been migrated, is older than
    /// this library, or a newer version's migration removed or changed it.
    #[error(
        "the outbox schema {schema:?} lacks a table or column this library version uses ({missing}): run the migrator (Outbox::migrate) first, or, if a newer library version has migrated it, run that version"
    )]
    NotMigrated {
        /// The configured schema name.
        schema: String,
        /// The database's own words: which table or column it did not find.
        missing: String,
    },
    /// The database holds a migration this library does not know (a newer version ran against it), or a
    /// known migration whose text changed.
    #[error("migration {version} in schema {schema:?}: {reason}")]
    Migration {
        /// The configured schema name.
        schema: String,
        /// Migration version.
        version: i64,
        /// What is wrong.
        reason: String,
    },
    /// No record with this id is in the state the operation needs (e.g. requeue of a record that is not FAILED).
    #[error("record {id} not found in state {state}")]
    RecordNotFound {
        /// The record id.
        id: Uuid,
        /// The state the operation looked for.
        state: &'static str,
    },
    /// The graceful stop did not finish within its timeout; unfinished records will be redelivered.
    #[error("graceful stop did not finish within {0:?}")]
    ShutdownTimeout(Duration),
    /// A database URL whose scheme this build cannot connect to.
    #[error("unsupported database URL scheme {scheme:?}: expected {supported}")]
    UnsupportedUrl {
        /// The scheme given.
        scheme: String,
        /// The schemes this build supports.
        supported: String,
    },
    /// A database URL that does not parse, or names options its driver does not know.
    #[error("bad database URL: {0}")]
    BadUrl(sqlx::Error),
    /// The database could not be reached (or opened) when connecting.
    #[error("cannot connect to {database} ({source})")]
    Connect {
        /// Which database: backend and address (never the password).
        database: String,
        /// Why.
        source: sqlx::Error,
    },
    /// A database error.
    #[error("database error: {0}")]
    Database(#[source] sqlx::Error),
    /// A round trip to the database got no answer within the configured `query_timeout`: the connection
    /// stopped answering (its host gone, a half-open connection), the database is overloaded, or (SQLite)
    /// another process held the write lock that long. The work was given up and its transaction rolled
    /// back; a network connection was closed, not returned to its pool. Transient.
    #[error("{work}: no answer from the database within {after:?}; given up")]
    QueryTimeout {
        /// What was asked of the database.
        work: &'static str,
        /// How long it waited.
        after: Duration,
    },
    /// A SQLite transaction waited this long for its turn at the file: another transaction of this
    /// process held the write lock (see `driver::sqlite::write`). Transient, as SQLite's own busy error.
    #[error("waited {waited:?} for the write lock of {database}, held by another transaction of this process")]
    WriteLockTimeout {
        /// The database, as "the SQLite database" and its file name.
        database: String,
        /// How long it waited.
        waited: Duration,
    },
}

// `Error::is_transient` and `Error::is_not_migrated` are defined in `driver/mod.rs`, which knows each
// database's error codes.

/// Result alias of `outbox-core`.
pub type Result<T, E = Error> = std::result::Result<T, E>;
