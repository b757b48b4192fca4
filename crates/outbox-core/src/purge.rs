//! Purge: deletes completed records older than the retention, in bounded batches (short transactions,
//! no long locks), like Oban's pruner.

use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::{debug, instrument, warn};

use crate::Outbox;
use crate::driver::{Db, answered_within};
use crate::error::{Error, Result};

impl Outbox {
    /// Deletes completed records older than `retention`, `batch_size` per statement, until none are
    /// left; returns how many.
    #[instrument(skip(self, db))]
    pub async fn purge_completed(&self, db: impl Into<Db>, retention: Duration, batch_size: usize) -> Result<u64> {
        let db = db.into();
        in_batches(batch_size, || async {
            let purge = db.purge(self.statements(), retention, batch_size);
            answered_within(self.config().query_timeout, "purging completed records", purge)
                .await
                .map_err(|e| self.not_migrated(e))
        })
        .await
    }

    /// Deletes the per-key lock rows of keys with no record left, `batch_size` per statement, until none
    /// are left; returns how many. A key's row is written again by its next `schedule`, and its sequence
    /// numbers go on growing: they come from one database-wide sequence, not from the row.
    #[instrument(skip(self, db))]
    pub async fn prune_keys(&self, db: impl Into<Db>, batch_size: usize) -> Result<u64> {
        let db = db.into();
        in_batches(batch_size, || async {
            let prune = db.prune_keys(self.statements(), batch_size);
            answered_within(self.config().query_timeout, "pruning key rows", prune)
                .await
                .map_err(|e| self.not_migrated(e))
        })
        .await
    }

    /// Purges completed records (with `completion = "keep"`) and prunes key rows every `purge_interval`
    /// until `shutdown`, which also ends a pass under way (each batch is a statement of its own, so the
    /// rest is left for the next pass).
    pub async fn run_purge(self, db: impl Into<Db>, shutdown: CancellationToken) {
        let db = db.into();
        let config = self.config().clone();
        let mut ticker = tokio::time::interval(config.purge_interval);
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                _ = ticker.tick() => {}
            }
            let pass = async {
                match self.purge_completed(&db, config.completed_retention, config.purge_batch_size).await {
                    Ok(n) => debug!(purged = n, "purged completed records"),
                    Err(e) => warn!(error = %e, "purge failed; will retry at the next interval"),
                }
                match self.prune_keys(&db, config.purge_batch_size).await {
                    Ok(n) => debug!(pruned = n, "pruned key rows of keys with no record left"),
                    Err(e) => warn!(error = %e, "pruning key rows failed; will retry at the next interval"),
                }
            };
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = pass => {}
            }
        }
    }
}

/// Runs `batch` (one bounded delete, answering how many rows it deleted) until a run deletes fewer than
/// `batch_size`; returns how many in all. A `batch_size` of 0 is an error (it would never finish).
pub(crate) async fn in_batches<F, Fut>(batch_size: usize, mut batch: F) -> Result<u64>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<u64>>,
{
    if batch_size == 0 {
        return Err(Error::Config("a purge's batch_size must be > 0".into()));
    }
    let mut total = 0;
    loop {
        let done = batch().await?;
        total += done;
        if done < batch_size as u64 {
            return Ok(total);
        }
    }
}

#[cfg(test)]
mod tests {
    /// With nothing left to delete, a batch of 0 rows was "full" every time: it never finished.
    #[tokio::test]
    async fn a_batch_size_of_zero_is_refused_rather_than_looped_on() {
        let mut calls = 0;
        let result = super::in_batches(0, || {
            calls += 1;
            async { Ok(0) }
        })
        .await;
        assert!(matches!(result, Err(crate::Error::Config(_))), "{result:?}");
        assert_eq!(calls, 0);
    }
}
