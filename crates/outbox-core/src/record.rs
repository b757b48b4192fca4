//! The record model: what a caller schedules ([`NewRecord`]) and what a handler receives ([`Record`]).

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use bytes::Bytes;
use chrono::{DateTime, Datelike, Utc};
use serde::Serialize;
use uuid::Uuid;

use crate::assignment::Epoch;
use crate::error::{Error, Result};
use crate::partition::{Partition, partition_of};

/// Longest accepted key, in bytes (any UTF-8 text without control characters). Keys are stored in a btree index and carried in a NATS header; 512
/// bytes leaves room for composite keys while keeping index entries small.
pub const MAX_KEY_BYTES: usize = 512;

/// Longest accepted event type, in bytes.
pub const MAX_EVENT_TYPE_BYTES: usize = 256;

/// Record headers (e.g. trace context), carried to the handler unchanged. Ordered for stable output.
pub type Headers = BTreeMap<String, String>;

/// Most bytes a record's header names and values may take together: metadata, not a second payload
/// (they are not counted in `max_payload_bytes` nor in the fetch's byte budget).
pub const MAX_HEADERS_BYTES: usize = 64 * 1024;

/// Longest accepted [`Delay::After`]: far enough for any reminder, near enough that every database's
/// time type holds the result.
pub const MAX_DELAY: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// When a record may first be delivered, if not at once. Both are judged by the database's clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Delay {
    /// Not before this time (a time already past: at once).
    At(DateTime<Utc>),
    /// Not before this long after the `schedule` call, by the database's clock.
    After(Duration),
}

impl Delay {
    /// Rounded up to a whole millisecond, the coarsest time a driver keeps: cut down to what the
    /// database keeps, a delivery would come before the time asked for (0.9 ms after was no delay at
    /// all). Applied when the record is scheduled, however the delay was made.
    pub(crate) fn in_whole_millis(self) -> Delay {
        const MS: u32 = 1_000_000;
        match self {
            Delay::At(at) => {
                let up = chrono::Duration::nanoseconds(i64::from((MS - at.timestamp_subsec_nanos() % MS) % MS));
                Delay::At(at.checked_add_signed(up).unwrap_or(at))
            }
            Delay::After(after) => {
                let up = Duration::from_nanos(u64::from((MS - after.subsec_nanos() % MS) % MS));
                Delay::After(after.checked_add(up).unwrap_or(after))
            }
        }
    }
}

/// A record to schedule inside the caller's transaction. Its `Debug` shows the payload's length, never
/// its bytes (payloads are never logged).
#[derive(Clone)]
pub struct NewRecord {
    /// Ordering key: records of one key are delivered one at a time, in commit order.
    pub key: String,
    /// Event type; handlers are routed by it.
    pub event_type: String,
    /// Payload bytes, delivered unchanged.
    pub payload: Bytes,
    /// Headers, delivered unchanged.
    pub headers: Headers,
    /// When it may first be delivered; `None`: at once.
    pub delay: Option<Delay>,
}

impl NewRecord {
    /// A record with raw payload bytes.
    pub fn new(key: impl Into<String>, event_type: impl Into<String>, payload: impl Into<Bytes>) -> Self {
        Self {
            key: key.into(),
            event_type: event_type.into(),
            payload: payload.into(),
            headers: Headers::new(),
            delay: None,
        }
    }

    /// A record whose payload is `value` serialised as JSON.
    pub fn json<T: Serialize + ?Sized>(
        key: impl Into<String>,
        event_type: impl Into<String>,
        value: &T,
    ) -> Result<Self> {
        let key = key.into();
        let payload = serde_json::to_vec(value).map_err(|source| Error::Json { key: key.clone(), source })?;
        Ok(Self::new(key, event_type, payload))
    }

    /// Adds a header.
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.insert(name.into(), value.into());
        self
    }

    /// Delivers the record no earlier than `at` (the database's clock). With stop-on-first-failure on, the
    /// key's later records wait for it (strict per-key order); with it off, they go ahead.
    /// The time is kept to the millisecond, rounded up, so that no database stores it earlier than asked.
    pub fn deliver_at(mut self, at: impl Into<DateTime<Utc>>) -> Self {
        self.delay = Some(Delay::At(at.into()));
        self
    }

    /// Delivers the record no earlier than `delay` after the `schedule` call, by the database's clock (not
    /// after its transaction's start, however long that ran); see
    /// [`NewRecord::deliver_at`]. The delay is kept to the millisecond, rounded up.
    pub fn deliver_after(mut self, delay: Duration) -> Self {
        self.delay = Some(Delay::After(delay));
        self
    }

    /// Checks the record against the limits, before anything is written.
    pub(crate) fn validate(&self, max_payload_bytes: usize) -> Result<()> {
        let key = &self.key;
        check_key(key)?;
        // The key travels as a header value (`Outbox-Key`), which NATS and HTTP clients trim. Records
        // stored before this check keep their keys, and an operator can still look them up.
        if key.starts_with(char::is_whitespace) || key.ends_with(char::is_whitespace) {
            let reason =
                "starts or ends with whitespace, which headers lose on the way (the consumer would see another key)";
            return Err(Error::BadKey { key: key.clone(), reason });
        }
        let event_type = &self.event_type;
        let reason = if event_type.is_empty() || event_type.len() > MAX_EVENT_TYPE_BYTES {
            Some("must be 1 to 256 bytes")
        } else if event_type.chars().any(char::is_control) {
            Some("has a control character")
        } else if event_type.starts_with(char::is_whitespace) || event_type.ends_with(char::is_whitespace) {
            Some("starts or ends with whitespace, which headers lose on the way")
        } else {
            None
        };
        if let Some(reason) = reason {
            let event_type = event_type.chars().take(64).collect();
            return Err(Error::BadEventType { key: key.clone(), event_type, reason });
        }
        if self.payload.len() > max_payload_bytes {
            return Err(Error::PayloadTooLarge { key: key.clone(), len: self.payload.len(), max: max_payload_bytes });
        }
        // The delay as stored, rounded up to the millisecond: a time in the last millisecond of the
        // last year would be stored in the next.
        match (self.delay, self.delay.map(Delay::in_whole_millis)) {
            (Some(Delay::After(delay)), Some(Delay::After(stored))) if stored > MAX_DELAY => {
                return Err(Error::DelayTooLong { key: key.clone(), delay, max: MAX_DELAY });
            }
            (Some(Delay::At(at)), Some(Delay::At(stored))) if !(1..=MAX_YEAR).contains(&stored.year()) => {
                return Err(Error::DeliverAtOutOfRange { key: key.clone(), at });
            }
            _ => {}
        }
        let mut header_bytes = 0_usize;
        for (name, value) in &self.headers {
            let bad = |reason| Err(Error::BadHeader { key: key.clone(), name: name.clone(), reason });
            header_bytes += name.len() + value.len();
            if header_bytes > MAX_HEADERS_BYTES {
                return bad("the headers' names and values take more than 65536 bytes together");
            }
            if name.is_empty() {
                return bad("empty name");
            }
            // NATS and HTTP header names: visible ASCII, no ':' (RFC 7230 field-name is stricter still).
            if !name.bytes().all(|b| b.is_ascii_graphic() && b != b':') {
                return bad("name must be visible ASCII without ':'");
            }
            if value.contains(['\r', '\n', '\0']) {
                return bad("value must not contain CR, LF or NUL");
            }
            if value.starts_with(char::is_whitespace) || value.ends_with(char::is_whitespace) {
                return bad("value must not start or end with whitespace (NATS and HTTP trim it)");
            }
        }
        Ok(())
    }

    pub(crate) fn partition(&self) -> Partition {
        partition_of(&self.key)
    }
}

/// The last year a [`Delay::At`] may fall in (MySQL's `DATETIME` ends with it; the first is year 1).
const MAX_YEAR: i32 = 9999;

/// A stored record as handed to a handler. Its `Debug` shows the payload's length, never its bytes, so
/// a handler that logs `?record` logs no payload.
#[derive(Clone, PartialEq, Eq)]
pub struct Record {
    /// Stable id (UUID v7). Use it for deduplication downstream (it is the JetStream message id).
    pub id: Uuid,
    /// `xxh3_64(key) % 256`.
    pub partition: Partition,
    /// Ordering key.
    pub key: String,
    /// Per-key sequence number: strictly increasing in commit order for the life of the database, so a
    /// consumer may deduplicate by (key, seq) and drop anything not above the last seq it applied. Not
    /// consecutive: numbers come from one database-wide sequence.
    pub seq: i64,
    /// Event type.
    pub event_type: String,
    /// Payload bytes.
    pub payload: Bytes,
    /// Headers.
    pub headers: Headers,
    /// Failed deliveries so far (0 on the first delivery), counting calls that did not finish in a
    /// partition taken over from an owner that did not give it up (the processor's docs).
    pub attempts: i32,
    /// When the record was scheduled, database time: the scheduling transaction's start on PostgreSQL,
    /// the `schedule` statement's time on MySQL and SQLite.
    pub created_at: DateTime<Utc>,
    /// When it was scheduled to be delivered at, if later than `created_at` (see [`NewRecord::delay`]).
    pub deliver_at: Option<DateTime<Utc>>,
    /// The partition's ownership epoch this delivery runs under: a fencing token that grows with every
    /// change of owner, for targets that want to reject deliveries from a superseded owner.
    pub epoch: Epoch,
}

/// Where a scheduled record landed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scheduled {
    /// The record's stable id.
    pub id: Uuid,
    /// Its partition.
    pub partition: Partition,
    /// Its per-key sequence number.
    pub seq: i64,
    /// When it may first be delivered, as asked ([`NewRecord::delay`]).
    pub delay: Option<Delay>,
}

impl fmt::Debug for NewRecord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NewRecord")
            .field("key", &self.key)
            .field("event_type", &self.event_type)
            .field("payload_bytes", &self.payload.len())
            .field("headers", &self.headers)
            .field("delay", &self.delay)
            .finish()
    }
}

impl fmt::Debug for Record {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Record")
            .field("id", &self.id)
            .field("partition", &self.partition)
            .field("key", &self.key)
            .field("seq", &self.seq)
            .field("event_type", &self.event_type)
            .field("payload_bytes", &self.payload.len())
            .field("headers", &self.headers)
            .field("attempts", &self.attempts)
            .field("created_at", &self.created_at)
            .field("deliver_at", &self.deliver_at)
            .field("epoch", &self.epoch)
            .finish()
    }
}

/// A key any record could have (and an operator may look up): not empty, at most `MAX_KEY_BYTES`,
/// without control characters.
pub(crate) fn check_key(key: &str) -> Result<()> {
    if key.is_empty() {
        return Err(Error::EmptyKey);
    }
    if key.len() > MAX_KEY_BYTES {
        return Err(Error::KeyTooLong { start: key.chars().take(32).collect(), len: key.len(), max: MAX_KEY_BYTES });
    }
    // NUL cannot be stored in PostgreSQL text, CR/LF would break a header carrying the key: say so here
    // instead of failing inside the caller's transaction or at delivery.
    if key.chars().any(char::is_control) {
        let reason = "has a control character (NUL cannot be stored, CR and LF cannot travel in a header)";
        return Err(Error::BadKey { key: key.to_string(), reason });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    /// A delivery time or delay is kept to the millisecond and never brought forward or shortened.
    #[test]
    fn delays_are_rounded_up_to_the_millisecond() {
        use super::Delay;
        use chrono::TimeZone;
        let whole = Utc.timestamp_millis_opt(1_700_000_000_123).unwrap();
        let at = |nanos| Delay::At(whole + chrono::Duration::nanoseconds(nanos)).in_whole_millis();
        let next = Delay::At(whole + chrono::Duration::milliseconds(1));
        assert_eq!((at(0), at(1), at(999_999)), (Delay::At(whole), next, next));
        let after = |micros| Delay::After(Duration::from_micros(micros)).in_whole_millis();
        let ms = |n| Delay::After(Duration::from_millis(n));
        assert_eq!((after(900), after(1500), after(2000)), (ms(1), ms(2), ms(2)));
    }

    use super::*;

    fn check(r: NewRecord) -> Result<()> {
        r.validate(16)
    }

    #[test]
    fn debug_shows_a_payloads_length_never_its_bytes() {
        let new = NewRecord::new("order-7", "order.created", "card=4111111111111111");
        let shown = format!("{new:?}");
        assert!(shown.contains("order-7") && shown.contains("payload_bytes: 21") && !shown.contains("4111"), "{shown}");
    }

    #[test]
    fn rejects_bad_input_with_typed_errors() {
        assert!(matches!(check(NewRecord::new("", "t", "")), Err(Error::EmptyKey)));
        let long = "k".repeat(MAX_KEY_BYTES + 1);
        assert!(matches!(check(NewRecord::new(long, "t", "")), Err(Error::KeyTooLong { len: 513, .. })));
        for key in ["o-7 ", " o-7", "\u{a0}o-7", " ", "o\r\n"] {
            let err = check(NewRecord::new(key, "t", "")).unwrap_err();
            assert!(matches!(&err, Error::BadKey { key: bad, .. } if bad == key), "{key:?}: {err:?}");
        }
        assert!(check(NewRecord::new("order 7", "t", "")).is_ok(), "whitespace inside a key travels");
        for value in [" v", "v ", "v\t"] {
            let err = check(NewRecord::new("k", "t", "").header("h", value)).unwrap_err();
            assert!(matches!(err, Error::BadHeader { .. }), "{value:?}: {err:?}");
        }
        assert!(check(NewRecord::new("k", "t", "").header("h", "a b")).is_ok());
        let most = NewRecord::new("k", "t", "").header("h", "v".repeat(MAX_HEADERS_BYTES - 1));
        assert!(check(most.clone()).is_ok());
        let err = check(most.header("i", "")).unwrap_err();
        assert!(matches!(&err, Error::BadHeader { name, .. } if name == "i"), "{err:?}");
        assert!(check(NewRecord::new("k".repeat(MAX_KEY_BYTES), "t", "")).is_ok());
        assert!(matches!(check(NewRecord::new("k", "", "")), Err(Error::BadEventType { .. })));
        for event_type in ["order.paid ".to_string(), " order.paid".into(), "t\n".into(), "t".repeat(257)] {
            let err = check(NewRecord::new("k", event_type.as_str(), "")).unwrap_err();
            assert!(matches!(err, Error::BadEventType { .. }), "{event_type:?}: {err:?}");
        }
        assert!(check(NewRecord::new("k", "t".repeat(256), "")).is_ok());
        assert!(matches!(check(NewRecord::new("k", "t", vec![0u8; 17])), Err(Error::PayloadTooLarge { len: 17, .. })));
        assert!(check(NewRecord::new("k", "t", vec![0u8; 16])).is_ok());
        for name in ["", "a b", "a:b", "é"] {
            assert!(
                matches!(check(NewRecord::new("k", "t", "").header(name, "v")), Err(Error::BadHeader { .. })),
                "{name:?}"
            );
        }
        assert!(matches!(check(NewRecord::new("k", "t", "").header("h", "a\r\nb")), Err(Error::BadHeader { .. })));
        assert!(check(NewRecord::new("k", "t", "").header("traceparent", "00-ab-cd-01")).is_ok());
        assert!(check(NewRecord::new("k", "t", "").deliver_after(MAX_DELAY)).is_ok());
        assert!(matches!(
            check(NewRecord::new("k", "t", "").deliver_after(MAX_DELAY + Duration::from_secs(1))),
            Err(Error::DelayTooLong { .. })
        ));
        let late = chrono::TimeZone::with_ymd_and_hms(&Utc, 10_000, 1, 1, 0, 0, 0).unwrap();
        assert!(matches!(check(NewRecord::new("k", "t", "").deliver_at(late)), Err(Error::DeliverAtOutOfRange { .. })));
        let early = chrono::DateTime::<Utc>::MIN_UTC;
        assert!(matches!(
            check(NewRecord::new("k", "t", "").deliver_at(early)),
            Err(Error::DeliverAtOutOfRange { .. })
        ));
        let first = chrono::TimeZone::with_ymd_and_hms(&Utc, 1, 1, 1, 0, 0, 0).unwrap();
        assert!(check(NewRecord::new("k", "t", "").deliver_at(first)).is_ok(), "a time long past is due at once");
        // Rounded up to the millisecond as stored: .NET's `DateTime.MaxValue`, a common "never", is in
        // year 10000 then.
        let never = late - chrono::Duration::nanoseconds(100);
        assert!(matches!(
            check(NewRecord::new("k", "t", "").deliver_at(never)),
            Err(Error::DeliverAtOutOfRange { .. })
        ));
        let last = late - chrono::Duration::milliseconds(1);
        assert!(check(NewRecord::new("k", "t", "").deliver_at(last)).is_ok());
    }
}
