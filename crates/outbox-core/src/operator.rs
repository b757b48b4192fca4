//! Operator functions: inspect and resolve FAILED records, and watch the backlog.

use std::collections::BTreeSet;
use std::time::{Duration, UNIX_EPOCH};

use metrics::SharedString;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{info, instrument, warn};
use uuid::Uuid;

use crate::driver::{Db, answered_within};
use crate::error::{Error, Result};
use crate::notice::{Partitions, Wake};
use crate::record::check_key;
use crate::stored::Requeue;
pub use crate::stored::{
    BacklogTotals, FAILED_PAGE_PAYLOAD_BYTES, FailedFilter, FailedPosition, FailedRecord, PartitionStats,
};
use crate::{Outbox, Partition};

/// The most FAILED records one call of [`Outbox::failed`] lists.
pub const MAX_FAILED_PAGE: i64 = 10_000;

impl Outbox {
    /// Lists FAILED records in (partition, key, seq) order, at most [`MAX_FAILED_PAGE`] at a time. Keys
    /// are in the database's order: PostgreSQL's collation for the key column, bytes on MySQL and
    /// SQLite; a position ([`FailedFilter::after`]) is one from the same database.
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
    /// changes once, so a second call finds only those that failed again. A thousand at a time in
    /// (partition, key, seq) order, each batch its own transaction: a call given up part way keeps
    /// what it did (the next call goes on with the rest), and on SQLite, whose write lock is the whole
    /// database's, heartbeats and deliveries go on between the batches.
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

    /// Sets the backlog gauges from [`Outbox::stats`] every `backlog_gauges_interval` while `leads`
    /// holds `true`, until `shutdown`: `outbox_pending_records` and `outbox_scheduled_records` per
    /// partition, `outbox_failed_records` and `outbox_oldest_pending_seconds`, with the reading's time in
    /// `outbox_backlog_read_timestamp_seconds`. Each reading counts the whole records table, so a
    /// cluster reads it on one instance (the node passes whether it leads); when `leads` turns `false`,
    /// and at `shutdown`, the gauges this instance set go back to 0, so the maximum over the instances is
    /// the backlog (a sum counts it twice for as long as two instances report it, as around a change of
    /// leader). A reading that fails leaves them as they were, its time too: a stale reading shows.
    pub async fn run_backlog_gauges(
        self,
        db: impl Into<Db>,
        leads: watch::Receiver<bool>,
        shutdown: CancellationToken,
    ) {
        let db = db.into();
        let interval = self.config().backlog_gauges_interval;
        if interval.is_zero() {
            return shutdown.cancelled().await;
        }
        let mut gauges = BacklogGauges { schema: self.schema_label(), set: false, partitions: BTreeSet::new() };
        let mut ticker = tokio::time::interval(interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = shutdown.cancelled() => break,
                _ = ticker.tick() => {}
            }
            if !*leads.borrow() {
                gauges.clear();
                continue;
            }
            // A count over a large backlog may legitimately outlast `query_timeout`; the limit only keeps
            // a connection that stopped answering from silencing the gauges for good.
            let limit = self.config().query_timeout.max(interval.saturating_mul(4));
            let read = tokio::select! {
                () = shutdown.cancelled() => break,
                read = answered_within(limit, "reading the backlog", self.stats(&db)) => read,
            };
            match read {
                Ok(stats) => gauges.set(&stats, UNIX_EPOCH.elapsed().unwrap_or_default()),
                Err(e) => {
                    warn!(error = %e, "reading the backlog for its gauges failed; they keep their last values until a reading succeeds")
                }
            }
        }
        gauges.clear();
    }
}

/// The backlog gauges one instance has set, so that it can set them back to 0.
struct BacklogGauges {
    /// Their `schema` label.
    schema: SharedString,
    /// Whether the totals were set.
    set: bool,
    /// The partitions whose gauges were set (those holding records at the last reading).
    partitions: BTreeSet<Partition>,
}

impl BacklogGauges {
    /// Sets the gauges from a reading taken at `read_at` (since the Unix epoch; zero when clearing).
    fn set(&mut self, stats: &[PartitionStats], read_at: Duration) {
        let now: BTreeSet<Partition> = stats.iter().map(|s| s.partition).collect();
        for &gone in self.partitions.difference(&now) {
            self.set_partition(gone, 0, 0);
        }
        for s in stats {
            self.set_partition(s.partition, s.pending, s.scheduled);
        }
        let totals = BacklogTotals::of(stats);
        let schema = &self.schema;
        metrics::gauge!("outbox_failed_records", "schema" => schema.clone()).set(totals.failed as f64);
        metrics::gauge!("outbox_oldest_pending_seconds", "schema" => schema.clone())
            .set(totals.oldest_pending.unwrap_or_default().as_secs_f64());
        metrics::gauge!("outbox_backlog_read_timestamp_seconds", "schema" => schema.clone()).set(read_at.as_secs_f64());
        (self.set, self.partitions) = (true, now);
    }

    fn set_partition(&self, partition: Partition, pending: i64, scheduled: i64) {
        let (schema, label) = (&self.schema, partition.to_string());
        metrics::gauge!("outbox_pending_records", "schema" => schema.clone(), "partition" => label.clone())
            .set(pending as f64);
        metrics::gauge!("outbox_scheduled_records", "schema" => schema.clone(), "partition" => label)
            .set(scheduled as f64);
    }

    /// Sets what was set back to 0 (and leaves alone the gauges of an instance that never reported).
    fn clear(&mut self) {
        if self.set {
            self.set(&[], Duration::ZERO);
            self.set = false;
        }
    }
}
