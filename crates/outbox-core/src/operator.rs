//! Operator functions: inspect and resolve FAILED records, and watch the backlog.

use tracing::{info, instrument, warn};
use uuid::Uuid;

use crate::Outbox;
use crate::driver::Db;
use crate::error::{Error, Result};
use crate::notice::{Partitions, Wake};
use crate::record::check_key;
use crate::stored::Requeue;
pub use crate::stored::{
    BacklogTotals, FAILED_PAGE_PAYLOAD_BYTES, FailedFilter, FailedPosition, FailedRecord, PartitionStats,
};

/// The most FAILED records one call of [`Outbox::failed`] lists.
pub const MAX_FAILED_PAGE: i64 = 10_000;

impl Outbox {
    /// Lists FAILED records in (partition, key, seq) order, at most [`MAX_FAILED_PAGE`] at a time.
    ///
    /// With payloads ([`FailedFilter::payloads`]) a page also ends after the record whose payload takes
    /// the page's payloads to [`FAILED_PAGE_PAYLOAD_BYTES`] (the first record always comes): a page
    /// whose payloads add up to that much may have more after it, read by a next page that starts after
    /// its last record ([`FailedFilter::after`]), as after a page of the full limit.
    #[instrument(skip_all)]
    pub async fn failed(&self, db: impl Into<Db>, filter: &FailedFilter) -> Result<Vec<FailedRecord>> {
        for key in filter.key.iter().chain(filter.after.as_ref().map(|after| &after.key)) {
            check_key(key)?;
        }
        if let Some(limit) = filter.limit
            && !(1..=MAX_FAILED_PAGE).contains(&limit)
        {
            return Err(Error::BadLimit { limit, max: MAX_FAILED_PAGE });
        }
        db.into().failed(self.statements(), filter).await.map_err(|e| self.not_migrated(e))
    }

    /// Requeues one FAILED record with a fresh retry budget; its key unblocks when it is delivered.
    #[instrument(skip(self, db))]
    pub async fn requeue(&self, db: impl Into<Db>, id: Uuid) -> Result<()> {
        let n = self.requeue_where(db.into(), Requeue::One(id)).await?;
        if n == 0 {
            return Err(Error::RecordNotFound { id, state: "FAILED" });
        }
        Ok(())
    }

    /// Requeues every FAILED record of `key`; returns how many.
    #[instrument(skip(self, db))]
    pub async fn requeue_key(&self, db: impl Into<Db>, key: &str) -> Result<u64> {
        check_key(key)?;
        self.requeue_where(db.into(), Requeue::Key(key)).await
    }

    /// Requeues every FAILED record (after an outage that failed many); returns how many. Each record
    /// changes once, so a second call finds only those that failed again. One statement on PostgreSQL
    /// and MySQL (row locks); on SQLite, whose write lock is the whole database's, batches of a thousand,
    /// each its own transaction, so heartbeats and deliveries go on between them.
    #[instrument(skip_all)]
    pub async fn requeue_all(&self, db: impl Into<Db>) -> Result<u64> {
        self.requeue_where(db.into(), Requeue::All).await
    }

    async fn requeue_where(&self, db: Db, which: Requeue<'_>) -> Result<u64> {
        let requeued = db.requeue(self.statements(), which).await.map_err(|e| self.not_migrated(e))?;
        info!(?which, requeued, "requeued FAILED records");
        if requeued > 0 {
            self.wake_after_resolving(&db).await;
        }
        Ok(requeued)
    }

    /// A resolved FAILED record unblocks its key: wake every owner (an operator's action is rare, and
    /// the partition is not at hand) rather than leave the key to the next idle poll. Already done, so
    /// a failed wake-up is only logged.
    async fn wake_after_resolving(&self, db: &Db) {
        if let Err(e) = self.send_wakes(db, &[Wake::now(Partitions::ALL)]).await {
            warn!(error = %e, "wake-up after resolving FAILED records not sent; owners find them at their next poll");
        }
    }

    /// Skips one FAILED record: it counts as handled (kept in `completed` as `skipped`), and the next
    /// record of its key proceeds.
    #[instrument(skip(self, db))]
    pub async fn skip(&self, db: impl Into<Db>, id: Uuid) -> Result<()> {
        let db = db.into();
        let skipped = db.skip(self.statements(), id).await.map_err(|e| self.not_migrated(e))?;
        if !skipped {
            return Err(Error::RecordNotFound { id, state: "FAILED" });
        }
        info!(%id, "skipped FAILED record");
        self.wake_after_resolving(&db).await;
        Ok(())
    }

    /// Pending and FAILED counts per partition (only partitions holding records), with the age of the
    /// oldest pending record.
    #[instrument(skip_all)]
    pub async fn stats(&self, db: impl Into<Db>) -> Result<Vec<PartitionStats>> {
        db.into().stats(self.statements()).await.map_err(|e| self.not_migrated(e))
    }
}
