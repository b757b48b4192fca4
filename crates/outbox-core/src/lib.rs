//! # outbox-core
//!
//! A transactional outbox on PostgreSQL. A service writes its business rows and the events describing
//! them in **one transaction**; a [`Processor`] then delivers those events to a [`Handler`] **at least
//! once**, in **strict per-key order**, with retries, an optional fallback, and a visible FAILED state.
//!
//! A record's journey, file by file: [`record`] (what is scheduled) → [`partition`] (`xxh3_64(key) % 256`)
//! → [`schedule`](Outbox::schedule) (inside the caller's transaction) → [`processor`] (fetch each key's
//! head from owned partitions, deliver many keys at once, complete in fenced batches) → [`retry`] /
//! [`handler`] (retry, fallback, FAILED) → [`operator`] (list, requeue, skip FAILED; stats) → [`purge`].
//! All SQL is in `sql.rs`; the schema is in `migrations/`.
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

use std::sync::Arc;

use sqlx::PgPool;

pub use config::{Completion, Config};
pub use error::{Error, Result, is_not_migrated};
pub use handler::{BoxError, FailureKind, Fallback, Handler, HandlerError, Handlers, Route, fallback_fn, handler_fn};
pub use operator::{FailedRecord, PartitionStats};
pub use partition::{PARTITIONS, Partition, partition_of};
pub use processor::{Assignment, Epochs, Processor};
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
}

impl Outbox {
    /// Validates `config` and prepares the statements for its schema.
    pub fn new(config: Config) -> Result<Self> {
        config.validate()?;
        let sql = sql::Sql::new(&config.schema, config.stop_on_first_failure, config.completion == Completion::Keep);
        Ok(Self { inner: Arc::new(Inner { config, sql }) })
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.inner.config
    }

    /// Applies missing migrations to the configured schema (see [`migrate`]).
    pub async fn migrate(&self, pool: &PgPool) -> Result<()> {
        migrate::run(pool, &self.inner.sql).await
    }

    pub(crate) fn sql(&self) -> &sql::Sql {
        &self.inner.sql
    }

    /// Maps "relation/schema does not exist" to [`Error::NotMigrated`], which says what to do.
    pub(crate) fn db_error(&self, e: sqlx::Error) -> Error {
        if is_not_migrated(&e) {
            Error::NotMigrated { schema: self.config().schema.clone() }
        } else {
            Error::Database(e)
        }
    }
}
