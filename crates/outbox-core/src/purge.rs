//! Purge: deletes completed records older than the retention, in bounded batches (short transactions,
//! no long locks), like Oban's pruner.

use std::time::Duration;

use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use tracing::{debug, instrument, warn};

use crate::Outbox;
use crate::error::Result;
use crate::sql::stmt;

impl Outbox {
    /// Deletes completed records older than `retention`, `batch_size` per statement, until none are
    /// left; returns how many.
    #[instrument(skip(self, pool))]
    pub async fn purge_completed(&self, pool: &PgPool, retention: Duration, batch_size: usize) -> Result<u64> {
        let retention_ms = i64::try_from(retention.as_millis()).unwrap_or(i64::MAX);
        let limit = i64::try_from(batch_size).unwrap_or(i64::MAX);
        let mut total = 0;
        loop {
            let done = sqlx::query(stmt(&self.sql().purge))
                .bind(retention_ms)
                .bind(limit)
                .execute(pool)
                .await
                .map_err(|e| self.db_error(e))?;
            total += done.rows_affected();
            if done.rows_affected() < batch_size as u64 {
                return Ok(total);
            }
        }
    }

    /// Purges every `purge_interval` until `shutdown` (with `completion = "keep"`; nothing to do otherwise).
    pub async fn run_purge(self, pool: PgPool, shutdown: CancellationToken) {
        let config = self.config().clone();
        let mut ticker = tokio::time::interval(config.purge_interval);
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                _ = ticker.tick() => {}
            }
            match self.purge_completed(&pool, config.completed_retention, config.purge_batch_size).await {
                Ok(n) => debug!(purged = n, "purged completed records"),
                Err(e) => warn!(error = %e, "purge failed; will retry at the next interval"),
            }
        }
    }
}
