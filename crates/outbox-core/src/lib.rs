//! # outbox-core
//!
//! A transactional outbox on PostgreSQL, SQLite or MySQL/MariaDB ([`Db`]). A service writes its business
//! rows and the events describing them in **one transaction**; a [`Processor`] then delivers those events to a
//! [`Handler`] **at least once**, in **strict per-key order**, with retries, an optional fallback, and a
//! visible FAILED state.
//!
//! A record's journey, file by file: [`record`] (what is scheduled) → [`partition`] (`xxh3_64(key) % 256`)
//! → [`schedule`](Outbox::schedule) (inside the caller's transaction) → [`wake`](Outbox::wake) (after the
//! commit, the partitions' owners fetch now) → [`processor`] (fetch each key's head from owned
//! partitions, deliver many keys at once, complete in fenced batches) → [`retry`] / [`handler`] (retry,
//! fallback, FAILED) → [`operator`] (list, requeue, skip FAILED; stats and the backlog gauges) → [`purge`].
//! Every database access goes through [`driver`]: one interface stating each operation's contract, and a
//! module per database with its statements and their execution (`driver/postgres/`, `driver/sqlite/`,
//! `driver/mysql/`, each a Cargo feature); the schemas are in `migrations/<database>/`.
//!
//! ```no_run
//! use outbox_core::{Config, Handlers, HandlerError, NewRecord, Outbox, handler_fn};
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let pool = sqlx::PgPool::connect("postgres://localhost/app").await?;
//! let outbox = Outbox::new(Config::default())?;
//! outbox.migrate(&pool).await?;
//!
//! // In the service: business write and event in one transaction.
//! let mut tx = pool.begin().await?;
//! outbox.schedule(&mut *tx, NewRecord::json("order-7", "order.created", &serde_json::json!({"total": 42}))?).await?;
//! tx.commit().await?;
//!
//! // Delivery: routed by event type. Clustered workers (outbox-cluster) run the processor for the
//! // partitions they own.
//! let handlers = Handlers::new().on("order.created", handler_fn(|record| async move {
//!     println!("{} #{}", record.key, record.seq);
//!     Ok::<(), HandlerError>(())
//! }));
//! # let _ = handlers;
//! # Ok(()) }
//! ```
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used))]

pub mod assignment;
pub mod config;
pub mod driver;
pub mod error;
pub mod handler;
pub mod inbox;
pub mod migrate;
mod notice;
pub mod operator;
pub mod partition;
pub mod processor;
pub mod purge;
pub mod record;
pub mod retry;
mod schedule;
mod stored;
pub mod trace;
mod wake;

use std::sync::Arc;

pub use assignment::{Assignment, Deadline, Epoch, Epochs, InstanceId};
pub use config::{Completion, Config};
pub use driver::{Conn, ConnectOptions, Db, DbRow, Tx, Value};
pub use error::{Error, Result};
pub use handler::{BoxError, FailureKind, Fallback, Handler, HandlerError, Handlers, Route, fallback_fn, handler_fn};
pub use notice::{Nudge, Nudges};
pub use partition::{PARTITIONS, Partition, partition_of};
pub use processor::{MAX_ERROR_BYTES, Processor, UNFINISHED_CALL};
pub use record::{
    Delay, Headers, MAX_DELAY, MAX_EVENT_TYPE_BYTES, MAX_HEADERS_BYTES, MAX_KEY_BYTES, NewRecord, Record, Scheduled,
};
pub use retry::{Backoff, RetryPolicy};
pub use stored::{FailedFilter, FailedPosition, FailedRecord, PartitionStats};

/// The outbox: validated configuration and the statements built for its schema. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Outbox {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    config: Config,
    statements: driver::Statements,
    wakeups: notice::Wakeups,
    /// The schema's name, shared by every metric's `schema` label.
    schema_label: Arc<str>,
}

impl Outbox {
    /// Validates `config` and prepares the statements for its schema.
    pub fn new(config: Config) -> Result<Self> {
        config.validate()?;
        let keep = config.completion == Completion::Keep;
        let statements =
            driver::Statements::new(&config.schema, config.stop_on_first_failure, keep, config.query_timeout);
        let schema_label = Arc::from(config.schema.as_str());
        Ok(Self { inner: Arc::new(Inner { config, statements, wakeups: notice::Wakeups::default(), schema_label }) })
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.inner.config
    }

    /// Applies missing migrations to the configured schema (see [`migrate`]).
    pub async fn migrate(&self, db: impl Into<Db>) -> Result<()> {
        db.into().migrate(self.statements()).await.map_err(|e| self.not_migrated(e))
    }

    /// The name of outbox table `table` on `db` (`outbox.records` on PostgreSQL, `outbox_records` on
    /// SQLite), for statements of one's own over the outbox tables.
    pub fn table(&self, db: &Db, table: &str) -> String {
        db.table(&self.config().schema, table)
    }

    /// The value of the `schema` label every metric of this outbox carries, so that two outboxes in one
    /// process (two schemas) report apart.
    pub fn schema_label(&self) -> metrics::SharedString {
        metrics::SharedString::from(Arc::clone(&self.inner.schema_label))
    }

    pub(crate) fn statements(&self) -> &driver::Statements {
        &self.inner.statements
    }

    pub(crate) fn wakeups(&self) -> &notice::Wakeups {
        &self.inner.wakeups
    }

    /// Maps "relation/schema does not exist" to [`Error::NotMigrated`], which says what to do.
    pub(crate) fn not_migrated(&self, e: Error) -> Error {
        e.not_migrated_in(&self.config().schema)
    }
}
