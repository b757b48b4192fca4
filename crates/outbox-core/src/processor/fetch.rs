//! Fetching: one statement reads the head record of up to `limit` keys (and, with stop-on-first-failure,
//! the records after each head) from the partitions this instance holds. The statement is fenced: it
//! returns records only of partitions whose row still carries this instance's (owner, epoch), and only
//! while the instance's lease is live by database time. Within a partition the walk starts after the
//! key where the previous fetch of that partition stopped (a rotating cursor), so hot keys that sort
//! low cannot starve the others.

use std::collections::{BTreeMap, HashMap};

use sqlx::PgPool;
use tracing::{debug, instrument};
use uuid::Uuid;

use super::begin;
use crate::Outbox;
use crate::db::Db;
use crate::error::Result;
use crate::operator::partition_from_db;
use crate::partition::Partition;
use crate::record::{Headers, Record};
use crate::sql::stmt;

/// A fetched record with what its completion needs.
#[derive(Debug, Clone)]
pub(crate) struct Fetched {
    pub(crate) record: Record,
    /// The instance whose lease fenced the fetch.
    pub(crate) instance: Uuid,
    /// Operator requeues of the record so far.
    pub(crate) requeues: i32,
}

/// What one fetch asks for.
#[derive(Debug, Clone)]
pub(crate) struct Request {
    /// The instance holding the partitions.
    pub(crate) instance: Uuid,
    /// Partitions in the order to serve them, each with the epoch held and the key to start after.
    pub(crate) partitions: Vec<(Partition, i64, Option<String>)>,
    /// Keys in flight: not fetched.
    pub(crate) exclude: Vec<String>,
    /// Heads (keys) at most.
    pub(crate) limit: usize,
    /// Records after each head at most.
    pub(crate) followers: usize,
}

/// A fetched row, as both backends' fetch statements name their columns: the record and whether it is
/// due (SQLite renders its millisecond times as RFC 3339 text for it).
#[derive(sqlx::FromRow)]
pub(crate) struct FetchedRow {
    id: Uuid,
    partition: i16,
    key: String,
    seq: i64,
    event_type: String,
    payload: Vec<u8>,
    headers: sqlx::types::Json<Headers>,
    attempts: i32,
    requeues: i32,
    created_at: chrono::DateTime<chrono::Utc>,
    due: bool,
    /// A head's place in the walk (increasing in the order keys were served); `None` for followers.
    walk: Option<i64>,
}

impl FetchedRow {
    /// (partition, key, seq, due), for tests that check which rows a fetch returns.
    #[cfg(test)]
    pub(crate) fn position(&self) -> (i16, String, i64, bool) {
        (self.partition, self.key.clone(), self.seq, self.due)
    }

    #[cfg(test)]
    pub(crate) fn walk(&self) -> Option<i64> {
        self.walk
    }

    pub(crate) fn key(&self) -> &str {
        &self.key
    }

    pub(crate) fn seq(&self) -> i64 {
        self.seq
    }

    pub(crate) fn payload_len(&self) -> usize {
        self.payload.len()
    }

    /// The record as delivered under `request`'s instance and the epoch held for its partition.
    fn into_fetched(self, request: &Request) -> Result<(Fetched, bool, Option<i64>)> {
        let partition = partition_from_db(self.partition)?;
        let epoch = request.partitions.iter().find(|p| p.0 == partition).map_or(0, |p| p.1);
        let record = Record {
            id: self.id,
            partition,
            key: self.key,
            seq: self.seq,
            event_type: self.event_type,
            payload: self.payload.into(),
            headers: self.headers.0,
            attempts: self.attempts,
            created_at: self.created_at,
            epoch,
        };
        Ok((Fetched { record, instance: request.instance, requeues: self.requeues }, self.due, self.walk))
    }
}

/// What a fetch found.
#[derive(Debug, Default)]
pub(crate) struct Found {
    /// Per key: its head and the due records after it, in sequence order, within the byte budget.
    pub(crate) runs: Vec<Vec<Fetched>>,
    /// Per partition served: the last key the walk served there.
    pub(crate) last_served: BTreeMap<Partition, String>,
}

/// Fetches what `request` asks for.
#[instrument(skip_all, fields(instance = %request.instance, partitions = request.partitions.len(), limit = request.limit))]
pub(crate) async fn fetch_runs(outbox: &Outbox, db: &Db, request: &Request) -> Result<Found> {
    let budget = outbox.config().key_lookahead_bytes;
    let rows = match db {
        Db::Postgres(pool) => fetch_postgres(outbox, pool, request, budget).await?,
        Db::Sqlite(pool) => {
            crate::sqlite::fetch(pool, outbox.sqlite(), request, budget).await.map_err(|e| outbox.not_migrated(e))?
        }
    };
    let fetched = rows.len();
    let mut by_key: HashMap<String, Vec<(Fetched, bool)>> = HashMap::new();
    let mut last: BTreeMap<Partition, (i64, String)> = BTreeMap::new();
    for row in rows {
        let (fetched, due, walk) = row.into_fetched(request)?;
        let record = &fetched.record;
        if let Some(walk) = walk
            && last.get(&record.partition).is_none_or(|(at, _)| *at < walk)
        {
            last.insert(record.partition, (walk, record.key.clone()));
        }
        by_key.entry(record.key.clone()).or_default().push((fetched, due));
    }
    let runs: Vec<Vec<Fetched>> = by_key
        .into_values()
        .map(|mut run| {
            run.sort_by_key(|(f, _)| f.record.seq);
            // A run stops before the first record that is not due (FAILED or waiting for a retry), and
            // before the record that takes its payloads past the byte budget (the head always comes).
            let mut bytes = 0;
            run.into_iter()
                .enumerate()
                .take_while(|(i, (f, due))| {
                    bytes += f.record.payload.len();
                    *due && (*i == 0 || bytes <= budget)
                })
                .map(|(_, (f, _))| f)
                .collect()
        })
        .collect();
    debug!(keys = runs.len(), records = fetched, "fetched");
    Ok(Found { runs, last_served: last.into_iter().map(|(p, (_, key))| (p, key)).collect() })
}

/// PostgreSQL's fetch: one statement in a JIT-off transaction.
async fn fetch_postgres(outbox: &Outbox, pool: &PgPool, request: &Request, budget: usize) -> Result<Vec<FetchedRow>> {
    let partitions: Vec<i16> = request.partitions.iter().map(|p| i16::from(p.0)).collect();
    let epochs: Vec<i64> = request.partitions.iter().map(|p| p.1).collect();
    let cursors: Vec<Option<&str>> = request.partitions.iter().map(|p| p.2.as_deref()).collect();
    let mut tx = begin(outbox, pool).await?;
    let rows = sqlx::query_as(stmt(&outbox.sql().fetch))
        .bind(&partitions)
        .bind(&epochs)
        .bind(&cursors)
        .bind(request.instance)
        .bind(&request.exclude)
        .bind(i64::try_from(request.limit).unwrap_or(i64::MAX))
        .bind(i64::try_from(request.followers).unwrap_or(i64::MAX))
        .bind(i64::try_from(budget).unwrap_or(i64::MAX))
        .fetch_all(&mut *tx)
        .await
        .map_err(|e| outbox.db_error(e))?;
    tx.commit().await.map_err(|e| outbox.db_error(e))?;
    Ok(rows)
}

/// Per partition, the key after which the next fetch starts walking (wrapping around to the lowest
/// key), so that every key of a partition gets its turn when fetches are cut short by their limit.
#[derive(Debug, Default)]
pub(crate) struct Cursors(BTreeMap<Partition, String>);

impl Cursors {
    /// The key to start after in `partition`.
    pub(crate) fn of(&self, partition: Partition) -> Option<String> {
        self.0.get(&partition).cloned()
    }

    /// Moves the cursors of the partitions a fetch served to the last key it served there.
    pub(crate) fn advance(&mut self, last_served: &BTreeMap<Partition, String>) {
        self.0.extend(last_served.iter().map(|(&p, key)| (p, key.clone())));
    }

    /// Forgets the partitions no longer held.
    pub(crate) fn retain(&mut self, held: impl Fn(Partition) -> bool) {
        self.0.retain(|&p, _| held(p));
    }
}
