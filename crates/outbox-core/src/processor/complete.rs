//! Completing: outcomes are written in batches, each statement fenced by the (owner, epoch) of every
//! partition it touches, locked `FOR SHARE` (SQLite: checked inside the write transaction). The
//! statements say which outcomes they wrote and which (partition, epoch) pairs the fence held, so an
//! outcome not written is either *fenced* (its partition moved on: stop processing it) or *already
//! settled* (its row is gone or changed: an earlier attempt of this flush committed before its
//! connection dropped, the handler deleted it, an operator requeued or skipped it): nothing to do.
//!
//! A batch the database rejects for good (not a transient error) is written one outcome at a time, so
//! one bad outcome never holds back other keys'; an outcome rejected alone is written as FAILED with
//! the database's reason, where an operator sees it. An outcome left to retry holds back its key's
//! later outcomes, and the key stays in flight until all of them are written. With
//! stop-on-first-failure, a key's outcomes after one written as FAILED in its place are not written:
//! their records stay pending behind it, as behind any FAILED record, and are delivered again after it
//! once an operator requeues or skips it.

use tracing::error;

use super::deliver::storable_error;
use crate::Outbox;
use crate::driver::{Db, answered_within};
use crate::error::{Error, Result};
use crate::stored::{Outcome, Verdict, Written};

/// What a completion did: outcomes settled (written, fenced or already settled, as `written` tells), and
/// outcomes to try again later with the error that stopped them.
#[derive(Debug, Default)]
pub(super) struct Completed {
    pub(crate) settled: Vec<Outcome>,
    pub(crate) written: Written,
    pub(crate) retry: Option<(Vec<Outcome>, Error)>,
}

/// Writes a batch of outcomes in one transaction; see the [module docs](self) for what happens when the
/// database rejects it.
pub(super) async fn complete(outbox: &Outbox, db: &Db, batch: Vec<Outcome>) -> Completed {
    let e = match write(outbox, db, &batch).await {
        Ok(written) => return Completed { settled: batch, written, retry: None },
        Err(e) if e.is_transient() => return Completed { retry: Some((batch, e)), ..Completed::default() },
        Err(e) => e,
    };
    let first = batch.first().map(|o| (o.id, o.key.as_str(), o.partition, o.instance));
    error!(error = %e, records = batch.len(), ?first,
        "the database rejected a completion batch; writing its outcomes one by one (first: record, key, partition, instance)");
    let mut completed = Completed::default();
    let mut retry: Vec<Outcome> = Vec::new();
    let mut last_error = None;
    // Keys whose outcome was written as FAILED in its place (with stop-on-first-failure).
    let mut held_back: Vec<String> = Vec::new();
    for outcome in batch {
        // A key's outcomes are written in its order: once one waits for a retry, the key's later ones
        // wait with it (written first, they would leave the earlier record pending behind them).
        if retry.iter().any(|r| r.key == outcome.key) {
            retry.push(outcome);
            continue;
        }
        // Completed behind a FAILED record, they would be delivered before it once it is requeued.
        if held_back.contains(&outcome.key) {
            error!(record = %outcome.id, key = %outcome.key, partition = outcome.partition, instance = %outcome.instance,
                "an earlier record of this key was written as FAILED in its outcome's place; this one stays pending behind it");
            completed.settled.push(outcome);
            continue;
        }
        match write_alone(outbox, db, outcome).await {
            Ok((outcome, written)) => {
                // A run ends at its first failure, so only a FAILED written in an outcome's place has
                // outcomes of its key after it in the batch.
                if outbox.config().stop_on_first_failure
                    && matches!(outcome.verdict, Verdict::Failed { .. })
                    && written.ids.contains(&outcome.id)
                {
                    held_back.push(outcome.key.clone());
                }
                completed.written.merge(written);
                completed.settled.push(outcome);
            }
            Err((outcome, e)) => {
                retry.push(outcome);
                last_error = Some(e);
            }
        }
    }
    if let Some(e) = last_error {
        completed.retry = Some((retry, e));
    }
    completed
}

/// One outcome on its own; if the database rejects it for good, it is written as FAILED with the
/// reason instead. Hands the outcome back as it was, with the error, if that fails too: the database
/// then rejected any write, not this outcome, and a FAILED written once it takes writes again would
/// stand for a record whose handler may well have succeeded.
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
    let failed = Outcome { verdict: Verdict::Failed { error: reason }, ..outcome.clone() };
    match write(outbox, db, std::slice::from_ref(&failed)).await {
        Ok(written) => Ok((failed, written)),
        Err(e) => {
            error!(record = %outcome.id, key = %outcome.key, partition = outcome.partition, instance = %outcome.instance,
                error = %e, "the database rejected FAILED as well; the key stays in flight and its outcome is retried");
            Err((outcome, e))
        }
    }
}

pub(super) async fn write(outbox: &Outbox, db: &Db, outcomes: &[Outcome]) -> Result<Written> {
    let complete = db.complete(outbox.statements(), outcomes);
    answered_within(outbox.config().query_timeout, "completion", complete).await.map_err(|e| outbox.not_migrated(e))
}
