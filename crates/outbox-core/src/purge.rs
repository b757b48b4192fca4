//! Purge: deletes completed records older than the retention, in bounded batches (short transactions,
//! no long locks), like Oban's pruner.

use std::time::Duration;

use tokio::sync::watch;
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
        check_retention(retention)?;
        let db = &db.into();
        in_batches(batch_size, |limit| async move {
            let purge = db.purge(self.statements(), retention, limit);
            answered_within(self.config().query_timeout, "purging completed records", purge)
                .await
                .map(Batch::deleted)
                .map_err(|e| self.not_migrated(e))
        })
        .await
    }

    /// Deletes the per-key lock rows of keys with no record left, reading `batch_size` of them per
    /// statement in key order, each once a pass; returns how many. A key's row is written again by its
    /// next `schedule`, and its sequence numbers go on growing: they come from one database-wide
    /// sequence, not from the row.
    #[instrument(skip(self, db))]
    pub async fn prune_keys(&self, db: impl Into<Db>, batch_size: usize) -> Result<u64> {
        let db = &db.into();
        // Where the next batch goes on: the key rows before it were read (keys are never empty).
        let after = &std::sync::Mutex::new(String::new());
        in_batches(batch_size, |limit| async move {
            let from = after.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
            let prune = db.prune_keys(self.statements(), limit, &from);
            let pruned = answered_within(self.config().query_timeout, "pruning key rows", prune)
                .await
                .map_err(|e| self.not_migrated(e))?;
            if let Some(last) = pruned.last {
                *after.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = last;
            }
            Ok(Batch { deleted: pruned.deleted, read: pruned.read })
        })
        .await
    }

    /// Purges completed records (with `completion = "keep"`) and prunes key rows every `purge_interval`
    /// while `leads` holds `true`, until `shutdown`, which also ends a pass under way (each batch is a
    /// statement of its own, so the rest is left for the next pass). Both work on the whole database, so
    /// a cluster runs them on one instance: the node passes whether it leads (as River's and Oban's
    /// leaders run their cleaners), and the leader's `completed_retention` is the one that holds.
    pub async fn run_purge(self, db: impl Into<Db>, leads: watch::Receiver<bool>, shutdown: CancellationToken) {
        let db = db.into();
        let config = self.config().clone();
        let mut ticker = tokio::time::interval(config.purge_interval);
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                _ = ticker.tick() => {}
            }
            if !*leads.borrow() {
                continue;
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

/// A purge's retention within [`MAX_DURATION`](crate::config::MAX_DURATION), as the configuration's
/// are: beyond it the backends disagreed (PostgreSQL and MySQL refused the interval, SQLite purged
/// nothing).
pub(crate) fn check_retention(retention: Duration) -> Result<()> {
    use crate::config::MAX_DURATION;
    if retention > MAX_DURATION {
        return Err(Error::Config(format!(
            "a purge's retention must be at most 100 years ({MAX_DURATION:?}), got {retention:?}"
        )));
    }
    Ok(())
}

/// What one batch did: rows deleted, and rows read (at most the size it was given; fewer when none
/// are left).
pub(crate) struct Batch {
    pub(crate) deleted: u64,
    pub(crate) read: u64,
}

impl Batch {
    /// A delete that reads only the rows it deletes.
    pub(crate) fn deleted(rows: u64) -> Batch {
        Batch { deleted: rows, read: rows }
    }
}

/// Runs `batch` (one statement of at most the size it is given) until one reads fewer rows than it
/// was given; returns how many rows were deleted in all. A `batch_size` of 0 is an error (it would
/// never finish).
///
/// A batch that does not fit its time (given up at `query_timeout`, or a lock not had in time, as
/// behind the rows a batch given up a moment ago still holds on the server) is tried again at half
/// the size, down to one row: a batch too slow for the limit (large payloads, a busy disk) was given
/// up again at every pass, and where the database rolls back what its client gave up (MySQL's
/// transactions) the table never shrank.
pub(crate) async fn in_batches<F, Fut>(batch_size: usize, mut batch: F) -> Result<u64>
where
    F: FnMut(usize) -> Fut,
    Fut: Future<Output = Result<Batch>>,
{
    if batch_size == 0 {
        return Err(Error::Config("a purge's batch_size must be > 0".into()));
    }
    let (mut size, mut total) = (batch_size, 0);
    loop {
        match batch(size).await {
            Ok(done) => {
                total += done.deleted;
                if done.read < size as u64 {
                    return Ok(total);
                }
            }
            Err(e) if e.is_time_limit() && size > 1 => {
                size /= 2;
                warn!(error = %e, batch_size = size, "a batch took too long; going on in smaller ones");
            }
            Err(e) => return Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    /// With nothing left to delete, a batch of 0 rows was "full" every time: it never finished.
    #[tokio::test]
    async fn a_batch_size_of_zero_is_refused_rather_than_looped_on() {
        let mut calls = 0;
        let result = super::in_batches(0, |_| {
            calls += 1;
            async { Ok(super::Batch::deleted(0)) }
        })
        .await;
        assert!(matches!(result, Err(crate::Error::Config(_))), "{result:?}");
        assert_eq!(calls, 0);
    }

    /// A retention past 100 years is refused before any statement, alike on every backend.
    #[cfg(feature = "sqlite")]
    #[tokio::test]
    async fn a_retention_past_a_century_is_refused() {
        let db = crate::Db::Sqlite(crate::driver::sqlite::memory().await);
        let outbox = crate::Outbox::new(crate::Config::default()).unwrap();
        let err = outbox.purge_completed(&db, std::time::Duration::MAX, 10).await.unwrap_err();
        assert!(matches!(&err, crate::Error::Config(m) if m.contains("retention")), "{err:?}");
        let err = outbox.inbox().purge(&db, std::time::Duration::MAX, 10).await.unwrap_err();
        assert!(matches!(&err, crate::Error::Config(m) if m.contains("retention")), "{err:?}");
    }

    /// A batch given up at the time limit is tried again at half its size until one fits; then the rest
    /// goes at that size. One that is given up even at a single row is an error.
    #[tokio::test]
    async fn a_batch_too_slow_for_the_time_limit_is_halved_until_it_fits() {
        let timeout = || crate::Error::QueryTimeout { work: "test", after: std::time::Duration::from_secs(1) };
        let (mut left, mut sizes) = (1000_u64, Vec::new());
        let purged = super::in_batches(1000, |limit| {
            sizes.push(limit);
            let done = (limit as u64).min(left);
            let result = if limit > 300 { Err(timeout()) } else { Ok(super::Batch::deleted(done)) };
            left -= result.as_ref().map_or(0, |n| n.deleted);
            async move { result }
        })
        .await
        .unwrap();
        assert_eq!(purged, 1000);
        assert_eq!(sizes, [1000, 500, 250, 250, 250, 250, 250]);

        let mut calls = 0;
        let result = super::in_batches(4, |_| {
            calls += 1;
            async { Err::<super::Batch, _>(timeout()) }
        })
        .await;
        assert!(matches!(result, Err(crate::Error::QueryTimeout { .. })), "{result:?}");
        assert_eq!(calls, 3, "4, 2, then 1 row");
    }
}
