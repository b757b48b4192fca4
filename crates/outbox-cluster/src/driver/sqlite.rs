//! The SQLite driver of `outbox-cluster`: its statements (`{s}_` prefixes the tables) and their
//! execution.
//!
//! Every write runs in a [`write()`] (`BEGIN IMMEDIATE`, in this process's turn, so heartbeats never
//! starve behind a busy worker). For the compare-and-set steps (acquire, release, targets) SQLite's
//! single writer makes the check and the epoch bump one atomic step, as `FOR UPDATE` does on PostgreSQL.
//! Liveness compares against SQLite's clock (the host's; all instances of a database file share it).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use outbox_core::driver::sqlite::{render, write, write_on};
use outbox_core::driver::{json, millis, statement};
use outbox_core::{Epoch, Epochs, InstanceId, Partition};
use sqlx::{Connection, SqliteConnection, SqlitePool};

use crate::error::Result;
use crate::rebalance::Targets;
use crate::stored::{Held, InstanceInfo, Lease, PartitionOnly, Taken, View, ViewRow, remaining};

/// Registers an instance, afresh if its id is there (see the PostgreSQL statement).
const REGISTER: &str = "INSERT INTO {s}_instances (id, name, expires_at, heartbeat_ms)
VALUES ($1, $2, {now} + $3, $4)
ON CONFLICT (id) DO UPDATE SET name = excluded.name, started_at = {now}, heartbeat_at = {now},
    expires_at = excluded.expires_at, heartbeat_ms = excluded.heartbeat_ms, draining = 0, delivered = 0,
    taken_over_at = NULL
RETURNING expires_at - {now}";

/// Renews a lease that has not expired and whose partitions were not taken (see the PostgreSQL
/// statement); returns its remaining ms. One writer at a time: a renewal never waits inside a takeover
/// here, but the stamp keeps the lease ended if the host's clock steps back.
const HEARTBEAT: &str = "UPDATE {s}_instances SET heartbeat_at = {now}, expires_at = {now} + $2, delivered = $3
WHERE id = $1 AND taken_over_at IS NULL AND expires_at > {now} RETURNING expires_at - {now}";

const DEREGISTER: &str = "DELETE FROM {s}_instances WHERE id = $1";

/// Removes instances whose lease expired more than `$1` ms ago, and more than twice their declared
/// heartbeat (see `Store::reap`).
const REAP: &str = "DELETE FROM {s}_instances WHERE expires_at < {now} - max($1, 2 * heartbeat_ms)";

/// Partitions targeted at `$1` that are free or whose owner has no live lease (one whose partitions
/// were taken has none, whatever its expiry reads), with that owner and the ms of the quiet period
/// taking it starts (0: none; see the PostgreSQL statement, `$2` the acquirer's heartbeat interval);
/// none while `$1`'s own lease has ended.
const ACQUIRABLE: &str = "SELECT p.partition, p.owner, max(0, coalesce(p.quiet_until - {now}, 0),
    CASE WHEN p.owner IS NULL THEN 0
    ELSE 2 * max(coalesce((SELECT i.heartbeat_ms FROM {s}_instances i WHERE i.id = p.owner), 0), $2) END) AS quiet_ms
FROM {s}_partitions p
WHERE p.target_owner = $1 AND p.owner IS NOT $1
  AND (p.owner IS NULL OR NOT EXISTS (
      SELECT 1 FROM {s}_instances i WHERE i.id = p.owner AND i.expires_at > {now} AND i.taken_over_at IS NULL))
  AND EXISTS (SELECT 1 FROM {s}_instances me WHERE me.id = $1 AND me.expires_at > {now} AND me.taken_over_at IS NULL)";

/// Ends for good the leases of the owners `$1` (JSON `[hex id, …]`) whose partitions are being taken
/// (see [`HEARTBEAT`]).
const MARK_TAKEN_OVER: &str = "UPDATE {s}_instances SET taken_over_at = coalesce(taken_over_at, {now})
WHERE id IN (SELECT unhex(value) FROM json_each($1))";

/// Takes the partitions of `$2` (JSON `[[partition, quiet ms], …]`) in one statement (see
/// [`SET_TARGETS`]), each quiet until that many ms from now; one taken from an owner is stamped
/// `taken_over_at` (see `Taken`).
const TAKE: &str = "UPDATE {s}_partitions SET owner = $1, epoch = epoch + 1, changed_at = {now},
    taken_over_at = CASE WHEN owner IS NULL THEN taken_over_at ELSE {now} END,
    quiet_until = CASE WHEN t.value ->> 1 > 0 THEN {now} + (t.value ->> 1) END
FROM json_each($2) t WHERE partition = t.value ->> 0
RETURNING partition, epoch, {time:taken_over_at} AS taken_over_at";

/// What an ownership round reads: every partition's row with the ms left of its quiet period, then
/// (`partition` NULL) the instances taking part in the assignment (lease live by database time and
/// never taken over, not draining), each id in `owner`.
const VIEW: &str = "SELECT partition, owner, epoch, target_owner, {time:taken_over_at} AS taken_over_at,
    CASE WHEN quiet_until > {now} THEN quiet_until - {now} END AS quiet_ms
FROM {s}_partitions
UNION ALL
SELECT NULL, id, NULL, NULL, NULL, NULL FROM {s}_instances
WHERE expires_at > {now} AND taken_over_at IS NULL AND NOT draining";

/// Writes the targets that changed, in one statement: `$1` is JSON `[[partition, hex owner], …]`. One
/// statement per partition held the file's write lock for 256 round trips to sqlx's worker thread,
/// while every other process's heartbeat waited for it (BENCHMARKS.md).
const SET_TARGETS: &str = "UPDATE {s}_partitions SET target_owner = unhex(t.value ->> 1)
FROM json_each($1) t
WHERE partition = t.value ->> 0 AND target_owner IS NOT unhex(t.value ->> 1) RETURNING partition";

const DRAIN: &str = "UPDATE {s}_instances SET draining = 1 WHERE id = $1";

const OWNED: &str = "SELECT partition, epoch FROM {s}_partitions WHERE owner = $1 ORDER BY partition";

/// Releases the partitions `$1` still owns at the epochs of `$2` (JSON `[[partition, epoch], …]`), in one
/// statement (see [`SET_TARGETS`]).
const RELEASE: &str = "UPDATE {s}_partitions SET owner = NULL, epoch = epoch + 1, changed_at = {now}
WHERE owner = $1 AND (partition, epoch) IN (SELECT value ->> 0, value ->> 1 FROM json_each($2))
RETURNING partition";

const INSTANCES: &str = "SELECT i.id, i.name, {time:i.started_at} AS started_at,
    {time:i.heartbeat_at} AS heartbeat_at, (i.expires_at > {now} AND i.taken_over_at IS NULL) AS live,
    i.draining, i.delivered,
    {now} - i.heartbeat_at AS heartbeat_age_ms,
    (SELECT count(*) FROM {s}_partitions p WHERE p.owner = i.id) AS partitions
FROM {s}_instances i ORDER BY i.started_at";

/// The statements, built for one table prefix.
#[derive(Debug)]
pub(super) struct SqliteStatements {
    register: Arc<str>,
    heartbeat: Arc<str>,
    deregister: Arc<str>,
    reap: Arc<str>,
    acquirable: Arc<str>,
    take: Arc<str>,
    mark_taken_over: Arc<str>,
    view: Arc<str>,
    set_targets: Arc<str>,
    drain: Arc<str>,
    owned: Arc<str>,
    release: Arc<str>,
    instances: Arc<str>,
}

/// A partition [`SqliteStatements::acquire`] may take.
#[derive(sqlx::FromRow)]
struct Acquirable {
    #[sqlx(try_from = "i16")]
    partition: Partition,
    owner: Option<InstanceId>,
    quiet_ms: i64,
}

impl SqliteStatements {
    /// `schema` is validated by the outbox's config.
    pub(super) fn new(schema: &str) -> Self {
        let build = |text: &str| render(text, schema);
        Self {
            register: build(REGISTER),
            heartbeat: build(HEARTBEAT),
            deregister: build(DEREGISTER),
            reap: build(REAP),
            acquirable: build(ACQUIRABLE),
            take: build(TAKE),
            mark_taken_over: build(MARK_TAKEN_OVER),
            view: build(VIEW),
            set_targets: build(SET_TARGETS),
            drain: build(DRAIN),
            owned: build(OWNED),
            release: build(RELEASE),
            instances: build(INSTANCES),
        }
    }

    pub(super) async fn register(
        &self,
        pool: &SqlitePool,
        id: InstanceId,
        name: &str,
        lease: Lease,
    ) -> Result<Duration> {
        let mut tx = write(pool).await?;
        let ms: i64 = sqlx::query_scalar(statement(&self.register))
            .bind(id)
            .bind(name)
            .bind(millis(lease.live))
            .bind(millis(lease.heartbeat))
            .fetch_one(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(remaining(ms))
    }

    /// Renews on `own` (opened to `pool`'s file on first use).
    pub(super) async fn heartbeat(
        &self,
        pool: &SqlitePool,
        own: &mut Option<SqliteConnection>,
        id: InstanceId,
        live: Duration,
        delivered: i64,
    ) -> Result<Option<Duration>> {
        let conn = match own {
            Some(conn) => conn,
            None => own.insert(SqliteConnection::connect_with(&pool.connect_options()).await?),
        };
        let mut tx = write_on(pool, conn).await?;
        let ms: Option<i64> = sqlx::query_scalar(statement(&self.heartbeat))
            .bind(id)
            .bind(millis(live))
            .bind(delivered)
            .fetch_optional(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(ms.map(remaining))
    }

    pub(super) async fn deregister(&self, pool: &SqlitePool, id: InstanceId) -> Result<()> {
        let mut tx = write(pool).await?;
        sqlx::query(statement(&self.deregister)).bind(id).execute(&mut *tx).await?;
        Ok(tx.commit().await?)
    }

    pub(super) async fn reap(&self, pool: &SqlitePool, grace: Duration) -> Result<u64> {
        let mut tx = write(pool).await?;
        let reaped = sqlx::query(statement(&self.reap)).bind(millis(grace)).execute(&mut *tx).await?.rows_affected();
        tx.commit().await?;
        Ok(reaped)
    }

    /// The single writer makes finding and taking one atomic step, as `FOR UPDATE` does on PostgreSQL.
    pub(super) async fn acquire(&self, pool: &SqlitePool, me: InstanceId, heartbeat: Duration) -> Result<Vec<Taken>> {
        let mut tx = write(pool).await?;
        let candidates: Vec<Acquirable> =
            sqlx::query_as(statement(&self.acquirable)).bind(me).bind(millis(heartbeat)).fetch_all(&mut *tx).await?;
        if candidates.is_empty() {
            // Ended here: dropped, its rollback would be queued while the turn passed on at once, and
            // the next writer's `BEGIN IMMEDIATE` could find the file still locked and sleep.
            tx.commit().await?;
            return Ok(Vec::new());
        }
        let owners: BTreeSet<String> =
            candidates.iter().filter_map(|c| Some(c.owner?.0.simple().to_string())).collect();
        if !owners.is_empty() {
            sqlx::query(statement(&self.mark_taken_over)).bind(json(&owners)?).execute(&mut *tx).await?;
        }
        let partitions: Vec<(i16, i64)> = candidates.iter().map(|c| (i16::from(c.partition), c.quiet_ms)).collect();
        let rows: Vec<(i16, Epoch, Option<DateTime<Utc>>)> =
            sqlx::query_as(statement(&self.take)).bind(me).bind(json(&partitions)?).fetch_all(&mut *tx).await?;
        tx.commit().await?;
        let candidates: BTreeMap<i16, Acquirable> =
            candidates.into_iter().map(|c| (i16::from(c.partition), c)).collect();
        Ok(rows
            .into_iter()
            .filter_map(|(partition, epoch, taken_over_at)| {
                let c = candidates.get(&partition)?;
                Some(Taken {
                    partition: c.partition,
                    epoch,
                    previous: c.owner,
                    quiet_ms: Some(c.quiet_ms).filter(|&ms| ms > 0),
                    taken_over_at,
                })
            })
            .collect())
    }

    pub(super) async fn view(&self, pool: &SqlitePool) -> Result<View> {
        let rows: Vec<ViewRow> = sqlx::query_as(statement(&self.view)).fetch_all(pool).await?;
        Ok(View::from_rows(rows)?)
    }

    pub(super) async fn set_targets(&self, pool: &SqlitePool, targets: &Targets) -> Result<Vec<Partition>> {
        let list: Vec<(i16, String)> =
            targets.iter().map(|(&partition, owner)| (i16::from(partition), owner.0.simple().to_string())).collect();
        let list = json(&list)?;
        let mut tx = write(pool).await?;
        let changed: Vec<PartitionOnly> =
            sqlx::query_as(statement(&self.set_targets)).bind(list).fetch_all(&mut *tx).await?;
        tx.commit().await?;
        Ok(changed.into_iter().map(|r| r.partition).collect())
    }

    pub(super) async fn drain(&self, pool: &SqlitePool, me: InstanceId) -> Result<()> {
        let mut tx = write(pool).await?;
        sqlx::query(statement(&self.drain)).bind(me).execute(&mut *tx).await?;
        Ok(tx.commit().await?)
    }

    pub(super) async fn owned(&self, pool: &SqlitePool, me: InstanceId) -> Result<Epochs> {
        let rows: Vec<Held> = sqlx::query_as(statement(&self.owned)).bind(me).fetch_all(pool).await?;
        Ok(rows.into_iter().map(|h| (h.partition, h.epoch)).collect())
    }

    pub(super) async fn release(&self, pool: &SqlitePool, me: InstanceId, held: &Epochs) -> Result<Vec<Partition>> {
        let list: Vec<(i16, Epoch)> = held.iter().map(|(&partition, &epoch)| (i16::from(partition), epoch)).collect();
        let list = json(&list)?;
        let mut tx = write(pool).await?;
        let released: Vec<PartitionOnly> =
            sqlx::query_as(statement(&self.release)).bind(me).bind(list).fetch_all(&mut *tx).await?;
        tx.commit().await?;
        Ok(released.into_iter().map(|r| r.partition).collect())
    }

    pub(super) async fn instances(&self, pool: &SqlitePool) -> Result<Vec<InstanceInfo>> {
        Ok(sqlx::query_as(statement(&self.instances)).fetch_all(pool).await?)
    }
}
