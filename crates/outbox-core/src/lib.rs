//! # outbox-core
//!
//! A transactional outbox on PostgreSQL or SQLite ([`Db`]). A service writes its business rows and the
//! events describing them in **one transaction**; a [`Processor`] then delivers those events to a
//! [`Handler`] **at least once**, in **strict per-key order**, with retries, an optional fallback, and a
//! visible FAILED state.
//!
//! A record's journey, file by file: [`record`] (what is scheduled) → [`partition`] (`xxh3_64(key) % 256`)
//! → [`schedule`](Outbox::schedule) (inside the caller's transaction) → [`processor`] (fetch each key's
//! head from owned partitions, deliver many keys at once, complete in fenced batches) → [`retry`] /
//! [`handler`] (retry, fallback, FAILED) → [`operator`] (list, requeue, skip FAILED; stats) → [`purge`].
//! PostgreSQL's SQL is in `sql.rs`, SQLite's in `sqlite.rs` (the [`db`] module says what differs); the
//! schemas are in `migrations/postgres/` and `migrations/sqlite/`.
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

pub mod config;
pub mod db;
pub mod error;
pub mod handler;
pub mod migrate;
pub mod operator;
pub mod partition;
pub mod processor;
pub mod purge;
pub mod record;
pub mod retry;
mod schedule;
mod sql;
mod sqlite;

use std::sync::Arc;

pub use config::{Completion, Config};
pub use db::{Conn, Db, Tx};
pub use error::{Error, Result, is_not_migrated};
pub use handler::{BoxError, FailureKind, Fallback, Handler, HandlerError, Handlers, Route, fallback_fn, handler_fn};
pub use operator::{FailedFilter, FailedRecord, PartitionStats};
pub use partition::{PARTITIONS, Partition, partition_of};
pub use processor::{Assignment, Deadline, Epochs, MAX_ERROR_BYTES, Processor};
pub use record::{Headers, MAX_EVENT_TYPE_BYTES, MAX_KEY_BYTES, NewRecord, Record, Scheduled};
pub use retry::{Backoff, RetryPolicy};

/// The outbox: validated configuration and the statements built for its schema. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Outbox {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    config: Config,
    sql: sql::Sql,
    sqlite: sqlite::Sql,
}

impl Outbox {
    /// Validates `config` and prepares the statements for its schema.
    pub fn new(config: Config) -> Result<Self> {
        config.validate()?;
        let keep = config.completion == Completion::Keep;
        let sql = sql::Sql::new(&config.schema, config.stop_on_first_failure, keep);
        let sqlite = sqlite::Sql::new(&config.schema, config.stop_on_first_failure, keep);
        Ok(Self { inner: Arc::new(Inner { config, sql, sqlite }) })
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.inner.config
    }

    /// Applies missing migrations to the configured schema (see [`migrate`]).
    pub async fn migrate(&self, db: impl Into<Db>) -> Result<()> {
        match db.into() {
            Db::Postgres(pool) => migrate::postgres(&pool, &self.inner.sql).await,
            Db::Sqlite(pool) => sqlite::migrate(&pool, &self.inner.sqlite).await,
        }
    }

    pub(crate) fn sql(&self) -> &sql::Sql {
        &self.inner.sql
    }

    pub(crate) fn sqlite(&self) -> &sqlite::Sql {
        &self.inner.sqlite
    }

    /// Maps "relation/schema does not exist" to [`Error::NotMigrated`], which says what to do.
    pub(crate) fn db_error(&self, e: sqlx::Error) -> Error {
        if is_not_migrated(&e) {
            Error::NotMigrated { schema: self.config().schema.clone() }
        } else {
            Error::Database(e)
        }
    }

    /// [`Outbox::db_error`] for an error already wrapped.
    pub(crate) fn not_migrated(&self, e: Error) -> Error {
        match e {
            Error::Database(e) => self.db_error(e),
            other => other,
        }
    }
}
