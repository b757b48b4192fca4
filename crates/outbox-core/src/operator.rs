//! Operator functions: inspect and resolve FAILED records, and watch the backlog.

use chrono::{DateTime, Utc};
use tracing::{info, instrument};
use uuid::Uuid;

use crate::db::Db;
use crate::error::{Error, Result};
use crate::partition::Partition;
use crate::sql::stmt;
use crate::{Outbox, sqlite};

/// A FAILED record, without its payload.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct FailedRecord {
    /// Record id.
    pub id: Uuid,
    /// Partition.
    #[sqlx(try_from = "i16")]
    pub partition: Partition,
    /// Key.
    pub key: String,
    /// Per-key sequence.
    pub seq: i64,
    /// Event type.
    pub event_type: String,
    /// Failed deliveries since it was scheduled or last requeued.
    pub attempts: i32,
    /// How often an operator requeued it.
    pub requeues: i32,
    /// The last error (handler, and fallback if one ran).
    pub last_error: Option<String>,
    /// When it was scheduled.
    pub created_at: DateTime<Utc>,
    /// When it became FAILED.
    pub failed_at: DateTime<Utc>,
}

/// Backlog of one partition.
#[derive(Debug, Clone, PartialEq)]
pub struct PartitionStats {
    /// Partition.
    pub partition: Partition,
    /// Records waiting for delivery (including those backing off).
    pub pending: i64,
    /// FAILED records.
    pub failed: i64,
    /// Age of the oldest pending record, by database time.
    pub oldest_pending: Option<std::time::Duration>,
}

/// Which FAILED records to list.
#[derive(Debug, Clone, Default)]
pub struct FailedFilter {
    /// Only this key.
    pub key: Option<String>,
    /// Only this partition.
    pub partition: Option<Partition>,
    /// At most this many (default 100).
    pub limit: Option<i64>,
}

impl Outbox {
    /// Lists FAILED records in (partition, key, seq) order.
    #[instrument(skip_all)]
    pub async fn failed(&self, db: impl Into<Db>, filter: &FailedFilter) -> Result<Vec<FailedRecord>> {
        let pool = match db.into() {
            Db::Postgres(pool) => pool,
            Db::Sqlite(pool) => {
                return sqlite::failed(&pool, self.sqlite(), filter).await.map_err(|e| self.not_migrated(e));
            }
        };
        sqlx::query_as(stmt(&self.sql().list_failed))
            .bind(filter.key.as_deref())
            .bind(filter.partition.map(i16::from))
            .bind(filter.limit.unwrap_or(100))
            .fetch_all(&pool)
            .await
            .map_err(|e| self.db_error(e))
    }

    /// Requeues one FAILED record with a fresh retry budget; its key unblocks when it is delivered.
    #[instrument(skip(self, db))]
    pub async fn requeue(&self, db: impl Into<Db>, id: Uuid) -> Result<()> {
        let n = self.requeue_where(db.into(), Some(id), None).await?;
        if n == 0 {
            return Err(Error::RecordNotFound { id, state: "FAILED" });
        }
        Ok(())
    }

    /// Requeues every FAILED record of `key`; returns how many.
    #[instrument(skip(self, db))]
    pub async fn requeue_key(&self, db: impl Into<Db>, key: &str) -> Result<u64> {
        self.requeue_where(db.into(), None, Some(key)).await
    }

    async fn requeue_where(&self, db: Db, id: Option<Uuid>, key: Option<&str>) -> Result<u64> {
        let requeued = match db {
            Db::Postgres(pool) => {
                let query = sqlx::query(stmt(&self.sql().requeue)).bind(id).bind(key);
                query.execute(&pool).await.map_err(|e| self.db_error(e))?.rows_affected()
            }
            Db::Sqlite(pool) => {
                sqlite::requeue(&pool, self.sqlite(), id, key).await.map_err(|e| self.not_migrated(e))?
            }
        };
        info!(?id, ?key, requeued, "requeued FAILED records");
        Ok(requeued)
    }

    /// Skips one FAILED record: it counts as handled (kept in `completed` as `skipped`), and the next
    /// record of its key proceeds.
    #[instrument(skip(self, db))]
    pub async fn skip(&self, db: impl Into<Db>, id: Uuid) -> Result<()> {
        let skipped = match db.into() {
            Db::Postgres(pool) => {
                let query = sqlx::query(stmt(&self.sql().skip)).bind(id);
                query.fetch_optional(&pool).await.map_err(|e| self.db_error(e))?.is_some()
            }
            Db::Sqlite(pool) => sqlite::skip(&pool, self.sqlite(), id).await.map_err(|e| self.not_migrated(e))?,
        };
        if !skipped {
            return Err(Error::RecordNotFound { id, state: "FAILED" });
        }
        info!(%id, "skipped FAILED record");
        Ok(())
    }

    /// Pending and FAILED counts per partition (only partitions holding records), with the age of the
    /// oldest pending record.
    #[instrument(skip_all)]
    pub async fn stats(&self, db: impl Into<Db>) -> Result<Vec<PartitionStats>> {
        let pool = match db.into() {
            Db::Postgres(pool) => pool,
            Db::Sqlite(pool) => return sqlite::stats(&pool, self.sqlite()).await.map_err(|e| self.not_migrated(e)),
        };
        let rows = sqlx::query_as(stmt(&self.sql().stats)).fetch_all(&pool).await.map_err(|e| self.db_error(e))?;
        stats_from_rows(rows)
    }
}

/// A partition's (partition, pending, failed, oldest pending age in seconds), as both backends' stats
/// statements return it.
pub(crate) type StatsRow = (i16, i64, i64, Option<f64>);

pub(crate) fn stats_from_rows(rows: Vec<StatsRow>) -> Result<Vec<PartitionStats>> {
    rows.into_iter()
        .map(|(partition, pending, failed, oldest)| {
            Ok(PartitionStats {
                partition: partition_from_db(partition)?,
                pending,
                failed,
                oldest_pending: oldest.map(|s| std::time::Duration::from_secs_f64(s.max(0.0))),
            })
        })
        .collect()
}

/// Converts the stored `smallint` (checked 0..=255 by the schema).
pub(crate) fn partition_from_db(value: i16) -> Result<Partition> {
    Partition::try_from(value)
        .map_err(|_| Error::Database(sqlx::Error::Decode(format!("partition {value} out of range").into())))
}
