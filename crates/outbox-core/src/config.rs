//! Configuration: plain data with serde (humantime strings for durations), named defaults, `validate()`.
//!
//! ```toml
//! schema = "outbox"
//! poll_interval = "100ms"
//! listen_poll_interval = "5s"
//! concurrency = 256
//! [retry]
//! max_retries = 5
//! backoff = { kind = "exponential", initial = "200ms", multiplier = 2.0 }
//! ```

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::retry::RetryPolicy;

/// Objects live in their own schema so they never collide with the host application's tables.
pub const DEFAULT_SCHEMA: &str = "outbox";
/// 1 MiB: the default NATS max payload. NATS counts a message's headers in it too (the outbox adds about
/// 200 bytes), so a payload within that of the limit is refused at publish, permanently (FAILED, with
/// the broker's reason): lower this by your headers' size to refuse such records at `schedule` instead.
pub const DEFAULT_MAX_PAYLOAD_BYTES: usize = 1024 * 1024;
/// Polling is the correctness path for new and due records; 100 ms bounds the added latency while an idle
/// instance sends ten cheap index probes a second.
pub const DEFAULT_POLL_INTERVAL: Duration = Duration::from_millis(100);
/// While a processor's `LISTEN` connection is up (PostgreSQL), producers that call `Outbox::wake` wake it
/// at once, so polling is only the safety net for those that do not (and for lost wake-ups): an idle
/// instance then sends one fetch every 5 s.
pub const DEFAULT_LISTEN_POLL_INTERVAL: Duration = Duration::from_secs(5);
/// While fetches keep finding records, poll every 5 ms: a record committed into a busy outbox is picked
/// up within a few milliseconds, and the extra fetches only happen while there is work.
pub const DEFAULT_ACTIVE_POLL_INTERVAL: Duration = Duration::from_millis(5);
/// Heads (one record per key) read per fetch: one round trip feeds many keys.
pub const DEFAULT_BATCH_SIZE: usize = 500;
/// Keys in flight at once. A slow key occupies one slot, never the others.
pub const DEFAULT_CONCURRENCY: usize = 256;
/// Records of one key fetched together: delivered one after another (each acknowledged before the
/// next), completed in one batch. A run checks the assignment before every record, so its length does
/// not slow a handover, while each fetch and completion round trip serves up to 32 records.
pub const DEFAULT_KEY_LOOKAHEAD: usize = 32;
/// Payload bytes a key's run may hold (its first record always comes, whatever its size): bounds the
/// lookahead's memory to `concurrency` × 64 KiB (16 MiB by default) whatever the payload sizes.
pub const DEFAULT_KEY_LOOKAHEAD_BYTES: usize = 64 * 1024;
/// A handler that has not answered in 30 s is treated as a retryable failure.
pub const DEFAULT_HANDLER_TIMEOUT: Duration = Duration::from_secs(30);
/// A round trip of the workers' that has not answered in 10 s is given up and its connection closed: a
/// connection that stopped answering (its host gone, a failover that left it half-open) never ends in
/// an error of its own, and would hold its work, and its place in the pool, forever. Ten seconds is
/// hundreds of times what a fetch or a completion batch takes; the kernel gives up on unacknowledged
/// writes only after about 15 minutes (`tcp_retries2`), and never while the far end acknowledges.
pub const DEFAULT_QUERY_TIMEOUT: Duration = Duration::from_secs(10);
/// Completed records stay an hour for inspection and replay, then are purged.
pub const DEFAULT_COMPLETED_RETENTION: Duration = Duration::from_secs(3600);
/// Purge once a minute.
pub const DEFAULT_PURGE_INTERVAL: Duration = Duration::from_secs(60);
/// Rows deleted per purge statement: short transactions that never hold locks for long.
pub const DEFAULT_PURGE_BATCH_SIZE: usize = 5_000;
/// Read the backlog for its gauges every 15 s (Prometheus' default scrape interval): one count over the
/// records table per interval, on one instance of a cluster.
pub const DEFAULT_BACKLOG_GAUGES_INTERVAL: Duration = Duration::from_secs(15);
/// A graceful stop waits this long for in-flight deliveries before giving up (they will be redelivered).
pub const DEFAULT_SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(30);

/// What happens to a record once delivered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Completion {
    /// Move it to the `completed` table, purged after `completed_retention`.
    Keep,
    /// Delete it: the fewest database writes per record.
    Delete,
}

/// Configuration of the outbox: schema, limits and the processor's tunables.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// PostgreSQL schema holding the outbox tables.
    pub schema: String,
    /// Largest accepted payload.
    pub max_payload_bytes: usize,
    /// How often the processor looks for new or due records when nothing woke it.
    #[serde(with = "humantime_serde")]
    pub poll_interval: Duration,
    /// How often the processor polls when nothing woke it while its `LISTEN` connection is up
    /// (PostgreSQL, see [`Outbox::wake`](crate::Outbox::wake)); never more often than `poll_interval`.
    #[serde(with = "humantime_serde")]
    pub listen_poll_interval: Duration,
    /// Poll interval while recent fetches found records (within the last second); at most `poll_interval`.
    /// Not while the `LISTEN` connection is up: wake-ups carry the latency then.
    #[serde(with = "humantime_serde")]
    pub active_poll_interval: Duration,
    /// Heads fetched per round trip.
    pub batch_size: usize,
    /// Keys in flight at once.
    pub concurrency: usize,
    /// Records of one key fetched and delivered in one run (1: one at a time). Only with
    /// stop-on-first-failure; without it every record of a key is fetched on its own.
    pub key_lookahead: usize,
    /// Payload bytes one key's run may hold (its first record always comes, whatever its size). With
    /// `concurrency` this bounds the memory the lookahead uses: 256 keys × 64 KiB = 16 MiB by default.
    pub key_lookahead_bytes: usize,
    /// Time limit of one handler call; exceeding it is a retryable failure. It may exceed the cluster's
    /// lease: a call still running when the lease runs out, or when its partition turns out to have
    /// moved on, is cancelled then (its future dropped at its next `.await`; the record is delivered
    /// again), so no call outlives its instance's hold on the partition.
    #[serde(with = "humantime_serde")]
    pub handler_timeout: Duration,
    /// Time limit of one of the workers' round trips to the database: a fetch, a batch of completions, a
    /// step of an ownership round. Past it the work is given up (retried, as after a lost connection)
    /// and its connection closed, not returned to the pool. Raise it only for a database that
    /// legitimately takes longer.
    #[serde(with = "humantime_serde")]
    pub query_timeout: Duration,
    /// Hold back a key's later records while an earlier one is failing (default on).
    pub stop_on_first_failure: bool,
    /// Default retry policy (handlers may register their own).
    pub retry: RetryPolicy,
    /// Keep or delete delivered records.
    pub completion: Completion,
    /// How long completed records are kept before the purge deletes them.
    #[serde(with = "humantime_serde")]
    pub completed_retention: Duration,
    /// How often the purge runs.
    #[serde(with = "humantime_serde")]
    pub purge_interval: Duration,
    /// Rows per purge statement.
    pub purge_batch_size: usize,
    /// How often the backlog gauges are read ([`Outbox::run_backlog_gauges`](crate::Outbox::run_backlog_gauges));
    /// `0s` reads them never.
    #[serde(with = "humantime_serde")]
    pub backlog_gauges_interval: Duration,
    /// How long a graceful stop waits for in-flight deliveries; then their calls are cancelled, and
    /// the stop returns once each has yielded (a call that never yields holds the partition with it).
    #[serde(with = "humantime_serde")]
    pub shutdown_timeout: Duration,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            schema: DEFAULT_SCHEMA.into(),
            max_payload_bytes: DEFAULT_MAX_PAYLOAD_BYTES,
            poll_interval: DEFAULT_POLL_INTERVAL,
            listen_poll_interval: DEFAULT_LISTEN_POLL_INTERVAL,
            active_poll_interval: DEFAULT_ACTIVE_POLL_INTERVAL,
            batch_size: DEFAULT_BATCH_SIZE,
            concurrency: DEFAULT_CONCURRENCY,
            key_lookahead: DEFAULT_KEY_LOOKAHEAD,
            key_lookahead_bytes: DEFAULT_KEY_LOOKAHEAD_BYTES,
            handler_timeout: DEFAULT_HANDLER_TIMEOUT,
            query_timeout: DEFAULT_QUERY_TIMEOUT,
            stop_on_first_failure: true,
            retry: RetryPolicy::default(),
            completion: Completion::Keep,
            completed_retention: DEFAULT_COMPLETED_RETENTION,
            purge_interval: DEFAULT_PURGE_INTERVAL,
            purge_batch_size: DEFAULT_PURGE_BATCH_SIZE,
            backlog_gauges_interval: DEFAULT_BACKLOG_GAUGES_INTERVAL,
            shutdown_timeout: DEFAULT_SHUTDOWN_TIMEOUT,
        }
    }
}

impl Config {
    /// Checks every value and the relations between them; the error names the field.
    pub fn validate(&self) -> Result<()> {
        let bad = |msg: String| Err(Error::Config(msg));
        if !is_schema_name(&self.schema) {
            return bad(format!(
                "schema must be a lowercase SQL identifier ([a-z_][a-z0-9_]*, at most {MAX_SCHEMA_BYTES} bytes, \
                 not starting with pg_ or sqlite_, not ending in _inbox), got {:?}",
                self.schema
            ));
        }
        if self.max_payload_bytes == 0 || self.max_payload_bytes > 256 * 1024 * 1024 {
            return bad(format!("max_payload_bytes must be within 1..=268435456, got {}", self.max_payload_bytes));
        }
        for (name, value) in [
            ("poll_interval", self.poll_interval),
            ("listen_poll_interval", self.listen_poll_interval),
            ("active_poll_interval", self.active_poll_interval),
            ("handler_timeout", self.handler_timeout),
            ("query_timeout", self.query_timeout),
            ("purge_interval", self.purge_interval),
            ("shutdown_timeout", self.shutdown_timeout),
            // 0: purged at the next purge.
            ("completed_retention", self.completed_retention),
            // 0: never read.
            ("backlog_gauges_interval", self.backlog_gauges_interval),
        ] {
            if value.is_zero() && !matches!(name, "completed_retention" | "backlog_gauges_interval") {
                return bad(format!("{name} must be > 0"));
            }
            if value > MAX_DURATION {
                return bad(format!("{name} must be at most 100 years ({MAX_DURATION:?}), got {value:?}"));
            }
        }
        for (name, value, max) in [
            ("batch_size", self.batch_size, 100_000),
            ("concurrency", self.concurrency, 100_000),
            ("key_lookahead", self.key_lookahead, 1_000),
            ("key_lookahead_bytes", self.key_lookahead_bytes, 1 << 30),
            ("purge_batch_size", self.purge_batch_size, 1_000_000),
        ] {
            if value == 0 || value > max {
                return bad(format!("{name} must be within 1..={max}, got {value}"));
            }
        }
        if self.query_timeout > MAX_QUERY_TIMEOUT {
            return bad(format!(
                "query_timeout must be at most {MAX_QUERY_TIMEOUT:?} (the longest time limit a database statement \
                 takes), got {:?}",
                self.query_timeout
            ));
        }
        if self.active_poll_interval > self.poll_interval {
            return bad(format!(
                "active_poll_interval ({:?}) must not exceed poll_interval ({:?})",
                self.active_poll_interval, self.poll_interval
            ));
        }
        self.retry.validate()
    }
}

/// Longest duration a setting takes: long enough to mean "never", short enough that the clock or a
/// database can add it to now (an interval of tokio's or a deadline past what a clock holds panicked);
/// the bound of a record's delay.
pub const MAX_DURATION: Duration = crate::MAX_DELAY;

/// Longest `query_timeout`: 2^31 - 1 ms, the most a database's statement or lock time limit is set to.
const MAX_QUERY_TIMEOUT: Duration = Duration::from_millis(i32::MAX as u64);

/// Longest schema name: the names built from it must fit every database's limit (MySQL's index
/// `<schema>_records_partition_key_seq` its 64 characters, PostgreSQL's channel `<schema>.nudge` its 63).
const MAX_SCHEMA_BYTES: usize = 32;

/// A schema name every backend accepts: a lowercase SQL identifier (spliced into statements: quoted on
/// PostgreSQL, as a table name prefix elsewhere), short enough, and outside the prefixes the databases
/// keep for themselves (`pg_` schemas on PostgreSQL, `sqlite_` tables on SQLite, where the tables are
/// named `<schema>_…`), nor one ending in `_inbox`: on MySQL and SQLite the key table of `<name>_inbox`
/// would be the inbox's key table of `<name>` (`<name>_inbox_keys`), and the second to migrate failed.
fn is_schema_name(s: &str) -> bool {
    let mut bytes = s.bytes();
    matches!(bytes.next(), Some(b'a'..=b'z' | b'_'))
        && bytes.all(|b| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'_'))
        && s.len() <= MAX_SCHEMA_BYTES
        && !s.starts_with("pg_")
        && s != "sqlite"
        && !s.starts_with("sqlite_")
        && !s.ends_with("_inbox")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_round_trip_through_toml() {
        let config = Config::default();
        config.validate().unwrap();
        let text = toml::to_string(&config).unwrap();
        assert!(text.contains("poll_interval = \"100ms\""), "{text}");
        assert_eq!(toml::from_str::<Config>(&text).unwrap(), config);
    }

    #[test]
    fn partial_toml_keeps_defaults_and_unknown_fields_are_rejected() {
        let config: Config = toml::from_str(
            "poll_interval = \"250ms\"\n[retry]\nmax_retries = 2\nbackoff = { kind = \"fixed\", delay = \"1s\" }\n",
        )
        .unwrap();
        assert_eq!(config.poll_interval, Duration::from_millis(250));
        assert_eq!(config.retry.max_retries, 2);
        assert_eq!(config.batch_size, DEFAULT_BATCH_SIZE);
        // A fixed delay over the default cap is refused, not cut to a minute.
        let config: Config = toml::from_str("[retry]\nbackoff = { kind = \"fixed\", delay = \"5m\" }\n").unwrap();
        assert!(config.validate().unwrap_err().to_string().contains("max_delay"));
        let err = toml::from_str::<Config>("pol_interval = \"1s\"").unwrap_err();
        assert!(err.to_string().contains("unknown field"), "{err}");
    }

    #[test]
    fn validate_names_the_bad_field() {
        type Mutate = fn(&mut Config);
        let cases: [(Mutate, &str); 11] = [
            (|c| c.schema = "Outbox; drop".into(), "schema"),
            (|c| c.purge_interval = Duration::MAX, "purge_interval"),
            (|c| c.backlog_gauges_interval = MAX_DURATION + Duration::from_secs(1), "backlog_gauges_interval"),
            (|c| c.shutdown_timeout = Duration::MAX, "shutdown_timeout"),
            (|c| c.completed_retention = MAX_DURATION + Duration::from_secs(1), "completed_retention"),
            (|c| c.retry = RetryPolicy::fixed(Duration::MAX, 3), "max_delay"),
            (|c| c.poll_interval = Duration::ZERO, "poll_interval"),
            (|c| c.query_timeout = Duration::from_secs(30 * 24 * 3600), "query_timeout"),
            (|c| c.concurrency = 0, "concurrency"),
            (|c| c.max_payload_bytes = 0, "max_payload_bytes"),
            (|c| c.retry.jitter = -1.0, "jitter"),
        ];
        for (mutate, field) in cases {
            let mut config = Config::default();
            mutate(&mut config);
            let err = config.validate().unwrap_err().to_string();
            assert!(err.contains(field), "{err} should name {field}");
        }
    }

    /// Names every backend would refuse later, at migrate or at the first wake-up, are refused here.
    #[test]
    fn schema_names_fit_every_backend() {
        for schema in ["outbox", "svc_outbox_2", &"s".repeat(MAX_SCHEMA_BYTES), "sqlitex"] {
            let config = Config { schema: schema.into(), ..Config::default() };
            config.validate().unwrap_or_else(|e| panic!("{schema}: {e}"));
        }
        for schema in [&"s".repeat(MAX_SCHEMA_BYTES + 1) as &str, "pg_outbox", "sqlite", "sqlite_outbox", "", "a_inbox"]
        {
            let config = Config { schema: schema.into(), ..Config::default() };
            assert!(config.validate().unwrap_err().to_string().contains("schema"), "{schema} accepted");
        }
    }
}
