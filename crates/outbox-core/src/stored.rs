//! What the outbox writes to its tables and reads back, as the drivers exchange it with the domain
//! modules: records to insert, fetch requests and fetched runs, outcomes to complete and what the
//! database answered, FAILED records and per-partition statistics. No SQL and no database here, so the
//! drivers can import it without importing the modules that use them.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use chrono::{DateTime, Utc};
use uuid::Uuid;

use crate::assignment::{Epoch, InstanceId};
use crate::error::Result;
use crate::notice::Partitions;
use crate::partition::Partition;
use crate::record::{Headers, Record};

/// One record to insert (no `Debug`: it holds the payload).
#[derive(Clone)]
pub(crate) struct NewRow<'a> {
    pub(crate) id: Uuid,
    pub(crate) partition: Partition,
    pub(crate) key: &'a str,
    pub(crate) event_type: &'a str,
    pub(crate) payload: &'a [u8],
    /// The headers as JSON text.
    pub(crate) headers: String,
    /// Not to be delivered before this database time…
    pub(crate) deliver_at: Option<DateTime<Utc>>,
    /// …or this many milliseconds after the scheduling transaction's database time.
    pub(crate) deliver_after_ms: Option<i64>,
}

/// [`Error::BatchTooLarge`] unless `rows` fit in `max` bytes of one statement, each payload byte taking
/// `per_payload_byte` of them (2 in hex) and each row its key, event type and headers, and 128 bytes for
/// the rest of it.
#[cfg(any(feature = "postgres", feature = "sqlite"))]
pub(crate) fn fits_one_statement(rows: &[NewRow<'_>], per_payload_byte: usize, max: usize) -> Result<()> {
    let bytes = rows
        .iter()
        .map(|r| r.payload.len() * per_payload_byte + r.key.len() + r.event_type.len() + r.headers.len() + 128)
        .sum();
    if bytes > max {
        return Err(crate::Error::BatchTooLarge { records: rows.len(), bytes, max });
    }
    Ok(())
}

/// What one fetch asks for.
#[derive(Debug, Clone)]
pub(crate) struct Request {
    /// The instance holding the partitions.
    pub(crate) instance: InstanceId,
    /// Partitions in the order to serve them, each with the epoch held and the key to start after.
    pub(crate) partitions: Vec<(Partition, Epoch, Option<String>)>,
    /// Keys in flight: not fetched.
    pub(crate) exclude: Vec<String>,
    /// Heads (keys) at most.
    pub(crate) limit: usize,
    /// Records after each head at most.
    pub(crate) followers: usize,
    /// Payload bytes a run may hold (its head always comes).
    pub(crate) budget: usize,
}

/// A fetched row, as every driver's fetch statement names its columns.
#[derive(sqlx::FromRow)]
pub(crate) struct FetchedRow {
    pub(crate) id: Uuid,
    #[sqlx(try_from = "i16")]
    pub(crate) partition: Partition,
    pub(crate) key: String,
    pub(crate) seq: i64,
    pub(crate) event_type: String,
    pub(crate) payload: Vec<u8>,
    pub(crate) headers: sqlx::types::Json<StoredHeaders>,
    pub(crate) attempts: i32,
    pub(crate) requeues: i32,
    pub(crate) created_at: DateTime<Utc>,
    pub(crate) deliver_at: Option<DateTime<Utc>>,
    /// Its last error is that of a counted call that did not finish ([`crate::UNFINISHED_CALL`]).
    pub(crate) unfinished: bool,
    /// Not FAILED and not waiting for a retry.
    pub(crate) due: bool,
    /// A head's place in the walk (increasing in the order keys were served); `None` for followers.
    pub(crate) walk: Option<i64>,
    /// The walk read all it may and ended at this key (a head, served only if due). Only MySQL's walk
    /// is bounded (see its fetch statement); the others read on until the batch is full.
    #[sqlx(default)]
    pub(crate) stop: bool,
}

/// A record's headers as read back. `schedule` stores an object of strings; from a row written by other
/// means, a value of another JSON type comes as its JSON text, and headers that are no object at all
/// come as none, so that one such row cannot fail every fetch of its partitions.
#[derive(Debug, Default)]
pub(crate) struct StoredHeaders(pub(crate) Headers);

impl<'de> serde::Deserialize<'de> for StoredHeaders {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let serde_json::Value::Object(values) = serde_json::Value::deserialize(deserializer)? else {
            return Ok(Self::default());
        };
        let text = |value| match value {
            serde_json::Value::String(text) => text,
            other => other.to_string(),
        };
        Ok(Self(values.into_iter().map(|(name, value)| (name, text(value))).collect()))
    }
}

/// A fetched record with what its completion needs.
#[derive(Debug, Clone)]
pub(crate) struct Fetched {
    pub(crate) record: Record,
    /// The instance whose lease fenced the fetch.
    pub(crate) instance: InstanceId,
    /// Operator requeues of the record when it was fetched.
    pub(crate) requeues: i32,
    /// Whether its call is counted before it is made (see `processor/careful.rs`).
    pub(crate) careful: bool,
    /// Whether its last call was counted and did not finish (see `processor/careful.rs`).
    pub(crate) unfinished: bool,
}

/// What a fetch found.
#[derive(Debug, Default)]
pub(crate) struct Found {
    /// Per key: its head and the due records after it, in sequence order, within the byte budget.
    pub(crate) runs: Vec<Vec<Fetched>>,
    /// Per partition served: the last key the walk served there, or where it stopped.
    pub(crate) last_served: BTreeMap<Partition, String>,
    /// Where the walk ended before the partitions asked for were read to their end, if it did: the
    /// partition of the last head of a full batch, or where a walk that read all it may stopped.
    pub(crate) cut_in: Option<Partition>,
}

impl Found {
    /// Builds what a fetch found from its rows, one vector per key, each gapless from the key's head
    /// and within the byte budget (the drivers see to both): each run ends before its first record
    /// that is not due, and carries the epoch `request` holds for its partition.
    pub(crate) fn from_runs(runs: impl IntoIterator<Item = Vec<FetchedRow>>, request: &Request) -> Result<Found> {
        let mut found = Found::default();
        let mut last: BTreeMap<Partition, (i64, String)> = BTreeMap::new();
        let mut last_walk = None;
        let mut stopped = None;
        for mut rows in runs {
            rows.sort_by_key(|row| row.seq);
            // A run is one key's, so one partition's.
            let Some(partition) = rows.first().map(|row| row.partition) else { continue };
            if let Some(head) = rows.first().filter(|head| head.stop) {
                stopped = Some((partition, head.key.clone()));
            }
            let epoch = request.partitions.iter().find(|p| p.0 == partition).map_or(Epoch(0), |p| p.1);
            let mut run = Vec::with_capacity(rows.len());
            for row in rows.into_iter().take_while(|row| row.due) {
                if let Some(walk) = row.walk {
                    if last.get(&partition).is_none_or(|(at, _)| *at < walk) {
                        last.insert(partition, (walk, row.key.clone()));
                    }
                    if last_walk.is_none_or(|(at, _)| at < walk) {
                        last_walk = Some((walk, partition));
                    }
                }
                let record = Record {
                    id: row.id,
                    partition: row.partition,
                    key: row.key,
                    seq: row.seq,
                    event_type: row.event_type,
                    payload: row.payload.into(),
                    headers: row.headers.0.0,
                    attempts: row.attempts,
                    created_at: row.created_at,
                    deliver_at: row.deliver_at,
                    epoch,
                };
                let (requeues, unfinished) = (row.requeues, row.unfinished);
                run.push(Fetched { record, instance: request.instance, requeues, careful: false, unfinished });
            }
            if !run.is_empty() {
                found.runs.push(run);
            }
        }
        found.last_served = last.into_iter().map(|(p, (_, key))| (p, key)).collect();
        if found.runs.len() >= request.limit {
            // The keys after the last head were not taken, wherever the walk stopped; with no head of
            // the walk's (SQLite's records that came due took the batch), before it served anything.
            found.cut_in = last_walk.map(|(_, p)| p).or_else(|| request.partitions.first().map(|p| p.0));
        } else if let Some((partition, key)) = stopped {
            found.last_served.insert(partition, key);
            found.cut_in = Some(partition);
        }
        Ok(found)
    }

    /// The partitions of `request` its walk did not read to their end: none unless it was cut, else
    /// those from the partition where it was cut on, in the request's order.
    pub(crate) fn cut_off(&self, request: &Request) -> Partitions {
        let Some(cut_in) = self.cut_in else { return Partitions::default() };
        let from = request.partitions.iter().position(|p| p.0 == cut_in).unwrap_or(0);
        request.partitions[from..].iter().map(|p| p.0).collect()
    }

    /// The partitions of `request` to fetch again at once: those it cut off, if it served anything. A
    /// walk cut short of what it may read that served nothing goes on at the next poll, or a partition
    /// with more blocked records than a walk reads would be fetched again and again for as long as
    /// they stay blocked.
    pub(crate) fn unread(&self, request: &Request) -> Partitions {
        if self.runs.is_empty() {
            return Partitions::default();
        }
        self.cut_off(request)
    }
}

/// A fetch's rows grouped into runs by key as they stream in, each cut to the byte budget (a no-op where
/// the statement already cut them): a key keeps its head and then its lowest sequences while their
/// payloads fit, so a fetch never holds more than the budget per key plus one payload.
#[derive(Default)]
pub(crate) struct Runs {
    by_key: std::collections::HashMap<String, Run>,
}

/// One key's rows while a fetch streams in.
#[derive(Default)]
struct Run {
    rows: Vec<FetchedRow>,
    bytes: usize,
    /// The lowest sequence dropped for the budget: nothing from it on is kept.
    cut: Option<i64>,
}

impl Runs {
    /// Collects a fetch's rows as they stream in, each run cut to `request`'s budget.
    pub(crate) async fn collect<'s>(
        mut rows: impl futures::Stream<Item = std::result::Result<FetchedRow, sqlx::Error>> + Unpin + 's,
        request: &Request,
    ) -> Result<Found> {
        use futures::TryStreamExt;
        let mut runs = Runs::default();
        while let Some(row) = rows.try_next().await? {
            runs.push(row, request.budget);
        }
        runs.found(request)
    }

    /// Takes one row, arriving in any order. Dropping the highest until the run fits, and every later
    /// arrival at or above a dropped sequence, leaves a gapless run from the head holding all the
    /// budget admits.
    fn push(&mut self, row: FetchedRow, budget: usize) {
        // The key is copied once per run, not once per row.
        let run = match self.by_key.get_mut(&row.key) {
            Some(run) => run,
            None => self.by_key.entry(row.key.clone()).or_default(),
        };
        if run.cut.is_some_and(|cut| row.seq >= cut) {
            return;
        }
        run.bytes += row.payload.len();
        let at = run.rows.partition_point(|r| r.seq < row.seq);
        run.rows.insert(at, row);
        while run.bytes > budget && run.rows.len() > 1 {
            if let Some(last) = run.rows.pop() {
                run.bytes -= last.payload.len();
                run.cut = Some(run.cut.map_or(last.seq, |cut| cut.min(last.seq)));
            }
        }
    }

    fn found(self, request: &Request) -> Result<Found> {
        Found::from_runs(self.by_key.into_values().map(|run| run.rows), request)
    }
}

/// What happened to one delivery.
#[derive(Debug, Clone)]
pub(crate) enum Verdict {
    Delivered,
    Fallback,
    /// Deliver again after `delay`; `error` is storable (see `MAX_ERROR_BYTES`).
    Retry {
        delay: Duration,
        error: String,
    },
    /// FAILED; `error` is storable.
    Failed {
        error: String,
    },
    /// Not called, though its call was counted before (`careful.rs`): the count is taken back, and the
    /// record is due, as it was fetched: its attempts, and no error, or for a suspect (`unfinished`) its
    /// call that did not finish. No delivery failed: no retry is counted.
    NotCalled {
        unfinished: bool,
    },
}

/// What a record that stays in the queue is written with.
#[derive(Debug, Clone, Copy)]
pub(crate) struct StillQueued<'a> {
    pub(crate) error: Option<&'a str>,
    /// Until it is due again.
    pub(crate) delay: Duration,
    pub(crate) failed: bool,
}

impl Verdict {
    /// What the record is written with if it stays in the queue; `None` if it leaves.
    pub(crate) fn still_queued(&self) -> Option<StillQueued<'_>> {
        let (error, delay, failed) = match self {
            Verdict::Delivered | Verdict::Fallback => return None,
            Verdict::Retry { delay, error } => (Some(error.as_str()), *delay, false),
            Verdict::Failed { error } => (Some(error.as_str()), Duration::ZERO, true),
            Verdict::NotCalled { unfinished } => (unfinished.then_some(crate::UNFINISHED_CALL), Duration::ZERO, false),
        };
        Some(StillQueued { error, delay, failed })
    }

    /// Delivered or handled by the fallback: the record leaves the queue.
    pub(crate) fn completes(&self) -> bool {
        matches!(self, Verdict::Delivered | Verdict::Fallback)
    }

    /// How a completed record is kept in `completed`: `delivered` or `fallback`.
    pub(crate) fn completed_as(&self) -> &'static str {
        if matches!(self, Verdict::Fallback) { "fallback" } else { "delivered" }
    }
}

/// The outcome of one delivery, with what its completion is fenced by.
#[derive(Debug, Clone)]
pub(crate) struct Outcome {
    pub(crate) id: Uuid,
    pub(crate) partition: Partition,
    /// The instance and epoch the record was delivered under.
    pub(crate) instance: InstanceId,
    pub(crate) epoch: Epoch,
    pub(crate) key: String,
    /// Failed deliveries including this one (unchanged on success).
    pub(crate) attempts: i32,
    /// Operator requeues of the record when it was fetched: a failure is written only if the record
    /// has not been requeued since (a late retry of a FAILED write must not undo a requeue).
    pub(crate) requeues: i32,
    /// Since when the record was due: scheduled, or its `deliver_at` (for the delivery latency).
    pub(crate) due_since: DateTime<Utc>,
    pub(crate) verdict: Verdict,
}

impl Outcome {
    /// What completing a delivered record needs, taken from the record (its key moved, not copied).
    pub(crate) fn of(fetched: Fetched, verdict: Verdict, attempts: i32) -> Outcome {
        let Fetched { record, instance, requeues, .. } = fetched;
        Outcome {
            id: record.id,
            partition: record.partition,
            instance,
            epoch: record.epoch,
            key: record.key,
            attempts,
            requeues,
            due_since: record.deliver_at.unwrap_or(record.created_at),
            verdict,
        }
    }

    /// What fences its completion.
    pub(crate) fn grant(&self) -> (Partition, InstanceId, Epoch) {
        (self.partition, self.instance, self.epoch)
    }
}

/// What the database answered for a batch of outcomes.
#[derive(Debug, Default)]
pub(crate) struct Written {
    /// Outcomes written.
    pub(crate) ids: BTreeSet<Uuid>,
    /// (partition, instance, epoch) the fence held.
    pub(crate) held: BTreeSet<(Partition, InstanceId, Epoch)>,
}

impl Written {
    pub(crate) fn merge(&mut self, other: Written) {
        self.ids.extend(other.ids);
        self.held.extend(other.held);
    }
}

/// A completion's lists as the SQLite and MySQL statements take them (ids as hex): the distinct grants
/// of `outcomes`, `[[partition, hex owner, epoch], …]`.
#[cfg(any(feature = "sqlite", feature = "mysql"))]
pub(crate) fn grants_list(outcomes: &[Outcome]) -> Vec<(i16, String, i64)> {
    let grants: BTreeSet<_> = outcomes.iter().map(Outcome::grant).collect();
    grants.into_iter().map(|(p, instance, epoch)| (i16::from(p), instance.0.simple().to_string(), epoch.0)).collect()
}

#[cfg(any(feature = "sqlite", feature = "mysql"))]
impl Written {
    /// Records the grants the fence returned.
    pub(crate) fn hold(&mut self, rows: Vec<(i16, InstanceId, Epoch)>) {
        for (p, instance, epoch) in rows {
            if let Ok(p) = Partition::try_from(p) {
                self.held.insert((p, instance, epoch));
            }
        }
    }

    /// Whether `outcome`'s grant held.
    pub(crate) fn holds(&self, outcome: &Outcome) -> bool {
        self.held.contains(&outcome.grant())
    }

    /// The outcomes that complete their record under a grant that held: `[[hex id, attempts, outcome],
    /// …]`.
    pub(crate) fn completions<'a>(&self, outcomes: &'a [Outcome]) -> Vec<(String, i32, &'a str)> {
        outcomes
            .iter()
            .filter(|o| self.holds(o) && o.verdict.completes())
            .map(|o| (o.id.simple().to_string(), o.attempts, o.verdict.completed_as()))
            .collect()
    }
}

/// A FAILED record, with its payload only when asked for ([`FailedFilter::payloads`]). Serialized
/// without the payload: whoever shows it decides how.
#[derive(Clone, PartialEq, sqlx::FromRow, serde::Serialize, serde::Deserialize)]
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
    /// Its payload, only when [`FailedFilter::payloads`] asked for it.
    #[serde(skip)]
    pub payload: Option<Vec<u8>>,
}

/// Without the payload's bytes (only their length): a record printed with `{:?}` must not log it.
impl std::fmt::Debug for FailedRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FailedRecord")
            .field("id", &self.id)
            .field("partition", &self.partition)
            .field("key", &self.key)
            .field("seq", &self.seq)
            .field("event_type", &self.event_type)
            .field("attempts", &self.attempts)
            .field("requeues", &self.requeues)
            .field("last_error", &self.last_error)
            .field("created_at", &self.created_at)
            .field("failed_at", &self.failed_at)
            .field("payload_bytes", &self.payload.as_ref().map(Vec::len))
            .finish()
    }
}

impl FailedRecord {
    /// Where a listing that ended with this record goes on from ([`FailedFilter::after`]).
    pub fn position(&self) -> FailedPosition {
        FailedPosition { partition: self.partition, key: self.key.clone(), seq: self.seq }
    }
}

/// A place in the (partition, key, seq) order of FAILED records, to list the next page from.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct FailedPosition {
    /// Partition.
    pub partition: Partition,
    /// Key.
    pub key: String,
    /// Per-key sequence.
    pub seq: i64,
}

/// Which FAILED records a requeue gives a fresh retry budget.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Requeue<'a> {
    One(Uuid),
    Key(&'a str),
    All,
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
    /// Only records after this one (the previous page's last [`FailedRecord::position`]): pages stay
    /// stable while records before them are requeued or skipped.
    pub after: Option<FailedPosition>,
    /// Include payloads (callers decide who may see them; they are never logged); the page then ends at
    /// [`FAILED_PAGE_PAYLOAD_BYTES`] of them.
    pub payloads: bool,
}

/// The payload bytes a page of [`Outbox::failed`](crate::Outbox::failed) reaches before it ends: a
/// page of large payloads (10,000 of up to 256 MiB each) would otherwise be read into memory whole, on
/// every refresh of the operator's page.
pub const FAILED_PAGE_PAYLOAD_BYTES: usize = 4 * 1024 * 1024;

/// Backlog of one partition.
#[derive(Debug, Clone, PartialEq)]
pub struct PartitionStats {
    /// Partition.
    pub partition: Partition,
    /// Records waiting for delivery (including those backing off), not counting those scheduled for later.
    pub pending: i64,
    /// Records scheduled for later ([`NewRecord::delay`](crate::NewRecord::delay)) whose time has not come.
    pub scheduled: i64,
    /// FAILED records.
    pub failed: i64,
    /// How long the oldest pending record has waited since it was due (scheduled, or its delivery
    /// time), by database time.
    pub oldest_pending: Option<Duration>,
}

/// The whole backlog: [`PartitionStats`] summed over the partitions.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct BacklogTotals {
    /// Records waiting for delivery.
    pub pending: i64,
    /// Records scheduled for later whose time has not come.
    pub scheduled: i64,
    /// FAILED records.
    pub failed: i64,
    /// The oldest pending record's wait, over every partition.
    pub oldest_pending: Option<Duration>,
}

impl BacklogTotals {
    /// The totals of `stats` (as [`Outbox::stats`](crate::Outbox::stats) returns them).
    pub fn of(stats: &[PartitionStats]) -> BacklogTotals {
        stats.iter().fold(BacklogTotals::default(), |t, s| BacklogTotals {
            pending: t.pending + s.pending,
            scheduled: t.scheduled + s.scheduled,
            failed: t.failed + s.failed,
            oldest_pending: t.oldest_pending.max(s.oldest_pending),
        })
    }
}

/// A partition's statistics as every driver's statement returns them (the age in seconds).
#[derive(sqlx::FromRow)]
pub(crate) struct StatsRow {
    #[sqlx(try_from = "i16")]
    partition: Partition,
    pending: i64,
    scheduled: i64,
    failed: i64,
    oldest_pending_secs: Option<f64>,
}

impl From<StatsRow> for PartitionStats {
    fn from(row: StatsRow) -> Self {
        PartitionStats {
            partition: row.partition,
            pending: row.pending,
            scheduled: row.scheduled,
            failed: row.failed,
            oldest_pending: row.oldest_pending_secs.map(|s| Duration::from_secs_f64(s.max(0.0))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head(partition: Partition, key: &str, walk: i64) -> Vec<FetchedRow> {
        vec![FetchedRow {
            id: Uuid::now_v7(),
            partition,
            key: key.into(),
            seq: walk,
            event_type: "t".into(),
            payload: Vec::new(),
            headers: sqlx::types::Json(StoredHeaders::default()),
            attempts: 0,
            requeues: 0,
            created_at: Utc::now(),
            deliver_at: None,
            unfinished: false,
            due: true,
            walk: Some(walk),
            stop: false,
        }]
    }

    /// The last key of a walk that read all it may: a head, served if `due`.
    fn stopped_at(partition: Partition, key: &str, walk: i64, due: bool) -> Vec<FetchedRow> {
        let mut rows = head(partition, key, walk);
        rows[0].due = due;
        rows[0].stop = true;
        rows
    }

    /// A fetch of partitions 5, 3, 9 and 1, in that order, for `limit` heads.
    fn request(limit: usize) -> Request {
        Request {
            instance: InstanceId(Uuid::now_v7()),
            partitions: [5, 3, 9, 1].map(|p| (p, Epoch(1), None)).to_vec(),
            exclude: Vec::new(),
            limit,
            followers: 0,
            budget: usize::MAX,
        }
    }

    fn partitions(p: Partitions) -> Vec<Partition> {
        (0..=255).filter(|&i| p.contains(i)).collect()
    }

    /// A full batch leaves the partitions from the one where it filled on unread, in the request's order
    /// (the walk read those before it to their end); one that did not fill, none.
    #[test]
    fn a_full_batch_leaves_unread_the_partitions_from_where_it_filled() {
        let found = |heads: Vec<Vec<FetchedRow>>, limit| Found::from_runs(heads, &request(limit)).unwrap();
        let filled_in_9 = found(vec![head(9, "c", 3), head(5, "a", 1), head(3, "b", 2)], 3);
        assert_eq!(filled_in_9.cut_in, Some(9));
        assert_eq!(partitions(filled_in_9.unread(&request(3))), [1, 9]);
        let filled_in_5 = found(vec![head(5, "a", 1), head(5, "b", 2)], 2);
        assert_eq!(partitions(filled_in_5.unread(&request(2))), [1, 3, 5, 9]);
        let short = found(vec![head(9, "c", 1)], 2);
        assert!(short.unread(&request(2)).is_empty(), "a batch that did not fill read every partition to its end");
        // Heads outside the walk (SQLite's records that came due) move no start key; filling the batch
        // alone, they leave every partition unread, the walk not begun.
        let came_due = |partition, key| head(partition, key, 0).into_iter().map(|row| FetchedRow { walk: None, ..row });
        let beside = found(vec![came_due(9, "x").collect(), head(5, "a", 1)], 2);
        assert_eq!((beside.cut_in, beside.last_served.get(&9)), (Some(5), None));
        let alone = found(vec![came_due(9, "x").collect(), came_due(3, "y").collect()], 2);
        assert_eq!(partitions(alone.unread(&request(2))), [1, 3, 5, 9]);
        assert!(alone.last_served.is_empty());
    }

    /// A walk that read all it may ends where it stopped: the next walk of that partition starts after
    /// the key it stopped at, served or not, and the partitions from it on are fetched again at once if
    /// it served anything (else at the next poll). A full batch ends at its last head, wherever the
    /// walk stopped (the keys after that head were not taken).
    #[test]
    fn a_walk_cut_short_goes_on_where_it_stopped() {
        let found = |heads: Vec<Vec<FetchedRow>>, limit| Found::from_runs(heads, &request(limit)).unwrap();
        let blocked = found(vec![head(5, "a", 1), stopped_at(3, "x", 7, false)], 10);
        assert_eq!(blocked.runs.len(), 1, "the key it stopped at is not served: its head is not due");
        assert_eq!(blocked.last_served.get(&3).map(String::as_str), Some("x"));
        assert_eq!(blocked.last_served.get(&5).map(String::as_str), Some("a"));
        assert_eq!(partitions(blocked.unread(&request(10))), [1, 3, 9]);
        let due = found(vec![stopped_at(9, "y", 2, true)], 10);
        assert_eq!(due.runs.len(), 1, "the key it stopped at is served: its head is due");
        assert_eq!(partitions(due.unread(&request(10))), [1, 9]);
        let nothing = found(vec![stopped_at(3, "x", 7, false)], 10);
        assert_eq!(nothing.last_served.get(&3).map(String::as_str), Some("x"), "the next walk goes on after it");
        assert!(nothing.unread(&request(10)).is_empty(), "a cut walk that served nothing waits for the poll");
        let full = found(vec![head(5, "a", 1), stopped_at(3, "x", 7, false)], 1);
        assert_eq!(full.last_served.get(&3), None, "the keys after the batch's last head were not read");
        assert_eq!(partitions(full.unread(&request(1))), [1, 3, 5, 9]);
    }
}
