//! Operator functions: inspect and resolve FAILED records, and watch the backlog.

use tracing::{info, instrument};
use uuid::Uuid;

use crate::Outbox;
use crate::driver::Db;
use crate::error::{Error, Result};
pub use crate::stored::{FailedFilter, FailedRecord, PartitionStats};

impl Outbox {
    /// Lists FAILED records in (partition, key, seq) order.
    #[instrument(skip_all)]
    pub async fn failed(&self, db: impl Into<Db>, filter: &FailedFilter) -> Result<Vec<FailedRecord>> {
        db.into().failed(self.statements(), filter).await.map_err(|e| self.not_migrated(e))
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
        let requeued = db.requeue(self.statements(), id, key).await.map_err(|e| self.not_migrated(e))?;
        info!(?id, ?key, requeued, "requeued FAILED records");
        Ok(requeued)
    }

    /// Skips one FAILED record: it counts as handled (kept in `completed` as `skipped`), and the next
    /// record of its key proceeds.
    #[instrument(skip(self, db))]
    pub async fn skip(&self, db: impl Into<Db>, id: Uuid) -> Result<()> {
        let skipped = db.into().skip(self.statements(), id).await.map_err(|e| self.not_migrated(e))?;
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
        db.into().stats(self.statements()).await.map_err(|e| self.not_migrated(e))
    }
}
