//! Completing: outcomes are written in batches, each statement fenced by the (owner, epoch) of every
//! partition it touches, locked `FOR SHARE` (SQLite: checked inside the write transaction). The
//! statements say which outcomes they wrote and which (partition, epoch) pairs the fence held, so an
//! outcome not written is either *fenced* (its partition moved on: stop processing it) or *already
//! settled* (its row is gone or changed: an earlier attempt of this flush committed before its
//! connection dropped, the handler deleted it, an operator requeued or skipped it): nothing to do.
//!
//! A batch the database rejects for good (not a transient error) is written one outcome at a time, so
//! one bad outcome never holds back the others; an outcome rejected alone is written as FAILED with
//! the database's reason, where an operator sees it.

use std::collections::BTreeSet;
use std::time::Duration;

use sqlx::PgPool;
use tracing::error;
use uuid::Uuid;

use super::begin;
use super::deliver::{Outcome, Verdict, storable_error};
use crate::Outbox;
use crate::db::Db;
use crate::error::{Error, Result};
use crate::partition::Partition;
use crate::sql::stmt;

/// What the database answered for a batch of outcomes.
#[derive(Debug, Default)]
pub(crate) struct Written {
    /// Outcomes written.
    pub(crate) ids: BTreeSet<Uuid>,
    /// (partition, instance, epoch) the fence held.
    pub(crate) held: BTreeSet<(Partition, Uuid, i64)>,
}

impl Written {
    fn merge(&mut self, other: Written) {
        self.ids.extend(other.ids);
        self.held.extend(other.held);
    }
}

/// What a flush did: outcomes settled (written, fenced or already settled, as `written` tells), and
/// outcomes to try again later with the error that stopped them.
#[derive(Debug, Default)]
pub(crate) struct Flushed {
    pub(crate) settled: Vec<Outcome>,
    pub(crate) written: Written,
    pub(crate) retry: Option<(Vec<Outcome>, Error)>,
}

/// Writes a batch of outcomes in one transaction; see the [module docs](self) for what happens when the
/// database rejects it.
pub(crate) async fn complete(outbox: &Outbox, db: &Db, batch: Vec<Outcome>) -> Flushed {
    let e = match write(outbox, db, &batch).await {
        Ok(written) => return Flushed { settled: batch, written, retry: None },
        Err(e) if e.is_transient() => return Flushed { retry: Some((batch, e)), ..Flushed::default() },
        Err(e) => e,
    };
    error!(error = %e, records = batch.len(), "the database rejected a completion batch; writing its outcomes one by one");
    let mut flushed = Flushed::default();
    let mut retry = Vec::new();
    let mut last_error = None;
    for outcome in batch {
        match write_alone(outbox, db, outcome).await {
            Ok((outcome, written)) => {
                flushed.written.merge(written);
                flushed.settled.push(outcome);
            }
            Err((outcome, e)) => {
                retry.push(outcome);
                last_error = Some(e);
            }
        }
    }
    if let Some(e) = last_error {
        flushed.retry = Some((retry, e));
    }
    flushed
}

/// One outcome on its own; if the database rejects it for good, it is written as FAILED with the
/// reason instead. Hands the outcome back with the error if that fails too.
async fn write_alone(
    outbox: &Outbox,
    db: &Db,
    outcome: Outcome,
) -> std::result::Result<(Outcome, Written), (Outcome, Error)> {
    let e = match write(outbox, db, std::slice::from_ref(&outcome)).await {
        Ok(written) => return Ok((outcome, written)),
        Err(e) if e.is_transient() => return Err((outcome, e)),
        Err(e) => e,
    };
    let reason = storable_error(&format!("the database rejected this record's outcome ({:?}): {e}", outcome.verdict));
    error!(record = %outcome.id, key = %outcome.key, partition = outcome.partition, instance = %outcome.instance,
        error = %e, "the database rejected a record's outcome; writing it as FAILED");
    let failed = Outcome { verdict: Verdict::Failed { error: reason }, ..outcome };
    match write(outbox, db, std::slice::from_ref(&failed)).await {
        Ok(written) => Ok((failed, written)),
        Err(e) => {
            error!(record = %failed.id, key = %failed.key, partition = failed.partition, instance = %failed.instance,
                error = %e, "the database rejected FAILED as well; the key stays in flight and its write is retried");
            Err((failed, e))
        }
    }
}

async fn write(outbox: &Outbox, db: &Db, outcomes: &[Outcome]) -> Result<Written> {
    match db {
        Db::Postgres(pool) => write_postgres(outbox, pool, outcomes).await,
        Db::Sqlite(pool) => {
            crate::sqlite::write_outcomes(pool, outbox.sqlite(), outcomes).await.map_err(|e| outbox.not_migrated(e))
        }
    }
}

/// PostgreSQL: completions in one fenced statement, failures in another, one transaction.
async fn write_postgres(outbox: &Outbox, pool: &PgPool, outcomes: &[Outcome]) -> Result<Written> {
    let (done, failures): (Vec<&Outcome>, Vec<&Outcome>) = outcomes.iter().partition(|o| o.verdict.completes());
    let mut written = Written::default();
    let mut tx = begin(outbox, pool).await?;
    if !done.is_empty() {
        let (partitions, instances, epochs) = fence_params(&done);
        let ids: Vec<Uuid> = done.iter().map(|o| o.id).collect();
        let how: Vec<&str> = done
            .iter()
            .map(|o| if matches!(o.verdict, Verdict::Fallback) { "fallback" } else { "delivered" })
            .collect();
        let attempts: Vec<i32> = done.iter().map(|o| o.attempts).collect();
        let rows: Vec<FencedRow> = sqlx::query_as(stmt(&outbox.sql().complete))
            .bind(&partitions)
            .bind(&instances)
            .bind(&epochs)
            .bind(&ids)
            .bind(&how)
            .bind(&attempts)
            .fetch_all(&mut *tx)
            .await
            .map_err(|e| outbox.db_error(e))?;
        written.merge(FencedRow::collect(rows)?);
    }
    if !failures.is_empty() {
        let (partitions, instances, epochs) = fence_params(&failures);
        let (mut ids, mut attempts, mut requeues, mut errors, mut delays, mut is_failed) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for o in &failures {
            let (error, delay, failed) = match &o.verdict {
                Verdict::Retry { delay, error } => (error.as_str(), *delay, false),
                Verdict::Failed { error } => (error.as_str(), Duration::ZERO, true),
                Verdict::Delivered | Verdict::Fallback => continue,
            };
            ids.push(o.id);
            attempts.push(o.attempts);
            requeues.push(o.requeues);
            errors.push(error);
            delays.push(i64::try_from(delay.as_millis()).unwrap_or(i64::MAX));
            is_failed.push(failed);
        }
        let rows: Vec<FencedRow> = sqlx::query_as(stmt(&outbox.sql().fail))
            .bind(&partitions)
            .bind(&instances)
            .bind(&epochs)
            .bind(&ids)
            .bind(&attempts)
            .bind(&requeues)
            .bind(&errors)
            .bind(&delays)
            .bind(&is_failed)
            .fetch_all(&mut *tx)
            .await
            .map_err(|e| outbox.db_error(e))?;
        written.merge(FencedRow::collect(rows)?);
    }
    tx.commit().await.map_err(|e| outbox.db_error(e))?;
    Ok(written)
}

/// A row of a fenced write's answer: a record it wrote, or a (partition, owner, epoch) its fence held.
#[derive(sqlx::FromRow)]
struct FencedRow {
    id: Option<Uuid>,
    partition: Option<i16>,
    owner: Option<Uuid>,
    epoch: Option<i64>,
}

impl FencedRow {
    fn collect(rows: Vec<FencedRow>) -> Result<Written> {
        let mut written = Written::default();
        for row in rows {
            match row {
                FencedRow { id: Some(id), .. } => {
                    written.ids.insert(id);
                }
                FencedRow { partition: Some(p), owner: Some(owner), epoch: Some(epoch), .. } => {
                    written.held.insert((crate::operator::partition_from_db(p)?, owner, epoch));
                }
                FencedRow { .. } => {}
            }
        }
        Ok(written)
    }
}

/// The distinct (partition, instance, epoch) triples of a batch, as the fence's parameter arrays.
fn fence_params(outcomes: &[&Outcome]) -> (Vec<i16>, Vec<Uuid>, Vec<i64>) {
    let triples: BTreeSet<(Partition, Uuid, i64)> =
        outcomes.iter().map(|o| (o.partition, o.instance, o.epoch)).collect();
    let mut params = (Vec::new(), Vec::new(), Vec::new());
    for (p, instance, epoch) in triples {
        params.0.push(i16::from(p));
        params.1.push(instance);
        params.2.push(epoch);
    }
    params
}

#[cfg(test)]
mod tests {
    use sqlx::PgPool;

    use super::{Outcome, Verdict, complete};
    use crate::processor::tests::hold_all;
    use crate::{Config, Db, NewRecord, Outbox};

    /// A FAILED outcome written again after an operator requeued its record (as a completion retried
    /// after an ambiguous commit would) leaves the requeue in place, and is settled, not fenced.
    #[sqlx::test(migrations = false)]
    async fn a_late_failed_write_does_not_undo_a_requeue(pool: PgPool) {
        a_late_failed_write_does_not_undo_a_requeue_on(pool.into()).await;
        let sqlite = crate::db::sqlite_memory().await;
        a_late_failed_write_does_not_undo_a_requeue_on(sqlite.into()).await;
    }

    async fn a_late_failed_write_does_not_undo_a_requeue_on(db: Db) {
        let outbox = Outbox::new(Config::default()).unwrap();
        outbox.migrate(&db).await.unwrap();
        let instance = hold_all(&db).await;
        let mut tx = db.begin().await.unwrap();
        let scheduled = outbox.schedule(&mut tx, NewRecord::new("k", "t", "")).await.unwrap();
        tx.commit().await.unwrap();
        let outcome = Outcome {
            id: scheduled.id,
            partition: scheduled.partition,
            instance,
            epoch: 1,
            key: "k".into(),
            attempts: 1,
            requeues: 0,
            created_at: chrono::Utc::now(),
            verdict: Verdict::Failed { error: "permanent: no".into() },
        };
        let first = complete(&outbox, &db, vec![outcome.clone()]).await;
        assert!(first.retry.is_none() && first.written.ids.contains(&scheduled.id));
        outbox.requeue(&db, scheduled.id).await.unwrap();

        let late = complete(&outbox, &db, vec![outcome]).await;
        assert!(late.retry.is_none());
        assert!(!late.written.ids.contains(&scheduled.id), "the requeued record was not failed again");
        assert!(late.written.held.contains(&(scheduled.partition, instance, 1)), "settled, not fenced");
        assert!(outbox.failed(&db, &Default::default()).await.unwrap().is_empty());
        let stats = outbox.stats(&db).await.unwrap();
        assert_eq!((stats[0].pending, stats[0].failed), (1, 0));
    }
}
