//! Partition ownership: acquire (free or dead owner) and release, each a compare-and-set that bumps the
//! partition's epoch. The processor fences every write with the (owner, epoch) it was given.

use std::time::Duration;

use outbox_core::{Db, Epochs, Partition};
use tracing::info;
use uuid::Uuid;

use crate::sql::{Sql, stmt};
use crate::{Result, sqlite};

/// (partition, new epoch, previous owner, the previous owner's heartbeat interval in ms).
pub(crate) type AcquiredRow = (i16, i64, Option<Uuid>, Option<i64>);

/// A partition just acquired.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Acquired {
    pub(crate) partition: Partition,
    pub(crate) epoch: i64,
    /// Taken from an owner whose lease expired (not free): deliver nothing of it for this long, the
    /// time the previous owner needs to notice its lease expired and stop (two of its heartbeat
    /// intervals, or of ours if longer or if its row is gone).
    pub(crate) quiet: Option<Duration>,
}

/// Acquires the partitions targeted at this instance that are free or whose owner is dead.
pub(crate) async fn acquire(db: &Db, sql: &Sql, me: Uuid, heartbeat: Duration) -> Result<Vec<Acquired>> {
    let rows: Vec<AcquiredRow> = match db {
        Db::Postgres(pool) => sqlx::query_as(stmt(&sql.acquire)).bind(me).fetch_all(pool).await?,
        Db::Sqlite(pool) => sqlite::acquire(pool, &sql.sqlite, me).await?,
    };
    let mut acquired = Vec::with_capacity(rows.len());
    for (partition, epoch, previous, previous_heartbeat) in rows {
        let partition = to_partition(partition)?;
        let quiet = previous.map(|previous| {
            let theirs = Duration::from_millis(previous_heartbeat.and_then(|ms| u64::try_from(ms).ok()).unwrap_or(0));
            let quiet = 2 * theirs.max(heartbeat);
            info!(partition, epoch, instance = %me, %previous, reason = "owner lease expired", ?quiet,
                "partition stolen; delivering it after the quiet period");
            quiet
        });
        if quiet.is_none() {
            info!(partition, epoch, instance = %me, reason = "free", "partition acquired");
        }
        acquired.push(Acquired { partition, epoch, quiet });
    }
    Ok(acquired)
}

/// What the database says this instance owns.
pub(crate) async fn owned(db: &Db, sql: &Sql, me: Uuid) -> Result<Epochs> {
    let rows: Vec<(i16, i64)> = match db {
        Db::Postgres(pool) => sqlx::query_as(stmt(&sql.owned)).bind(me).fetch_all(pool).await?,
        Db::Sqlite(pool) => sqlite::owned(pool, &sql.sqlite, me).await?,
    };
    rows.into_iter().map(|(p, e)| Ok((to_partition(p)?, e))).collect()
}

/// Releases the given partitions (at their epochs); returns how many were still ours to release.
pub(crate) async fn release(db: &Db, sql: &Sql, me: Uuid, partitions: &Epochs, reason: &'static str) -> Result<usize> {
    let held: Vec<(i16, i64)> = partitions.iter().map(|(&p, &e)| (i16::from(p), e)).collect();
    let rows: Vec<(i16,)> = match db {
        Db::Postgres(pool) => {
            let (ids, epochs): (Vec<i16>, Vec<i64>) = held.into_iter().unzip();
            sqlx::query_as(stmt(&sql.release)).bind(me).bind(&ids).bind(&epochs).fetch_all(pool).await?
        }
        Db::Sqlite(pool) => sqlite::release(pool, &sql.sqlite, me, &held).await?,
    };
    for (p,) in &rows {
        info!(partition = p, instance = %me, reason, "partition released");
    }
    Ok(rows.len())
}

fn to_partition(p: i16) -> Result<Partition> {
    Partition::try_from(p)
        .map_err(|_| crate::Error::Database(sqlx::Error::Decode(format!("partition {p} out of range").into())))
}

/// One partition's ownership row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PartitionRow {
    /// Partition.
    pub partition: Partition,
    /// Current owner, if any.
    pub owner: Option<Uuid>,
    /// Fencing epoch.
    pub epoch: i64,
    /// Where the rebalancer wants it.
    pub target: Option<Uuid>,
}

/// Every partition's ownership row.
pub(crate) async fn partitions(db: &Db, sql: &Sql) -> Result<Vec<PartitionRow>> {
    let rows: Vec<(i16, Option<Uuid>, i64, Option<Uuid>)> = match db {
        Db::Postgres(pool) => sqlx::query_as(stmt(&sql.partitions)).fetch_all(pool).await?,
        Db::Sqlite(pool) => sqlite::partitions(pool, &sql.sqlite).await?,
    };
    rows.into_iter()
        .map(|(p, owner, epoch, target)| Ok(PartitionRow { partition: to_partition(p)?, owner, epoch, target }))
        .collect()
}

/// Live instances taking part in the assignment, by id.
pub(crate) async fn live(db: &Db, sql: &Sql) -> Result<Vec<Uuid>> {
    let rows: Vec<(Uuid,)> = match db {
        Db::Postgres(pool) => sqlx::query_as(stmt(&sql.live)).fetch_all(pool).await?,
        Db::Sqlite(pool) => sqlite::live(pool, &sql.sqlite).await?,
    };
    Ok(rows.into_iter().map(|(id,)| id).collect())
}

/// Computes the targets from the database's view and writes those that changed; returns them.
pub(crate) async fn rebalance(
    db: &Db,
    sql: &Sql,
    me: Uuid,
    live: &[Uuid],
    rows: &[PartitionRow],
) -> Result<crate::rebalance::Targets> {
    let is_live = |id: &Uuid| live.contains(id);
    // A partition's present holder: its target if that is live, else its owner if live.
    let current = rows
        .iter()
        .filter_map(|r| r.target.filter(is_live).or(r.owner.filter(is_live)).map(|h| (r.partition, h)))
        .collect();
    let targets = crate::rebalance::assign(live, &current);
    let wanted: Vec<(i16, Uuid)> = targets.iter().map(|(&p, &id)| (i16::from(p), id)).collect();
    let changed: Vec<(i16,)> = match db {
        Db::Postgres(pool) => {
            let (ids, owners): (Vec<i16>, Vec<Uuid>) = wanted.into_iter().unzip();
            sqlx::query_as(stmt(&sql.set_targets)).bind(&ids).bind(&owners).fetch_all(pool).await?
        }
        Db::Sqlite(pool) => sqlite::set_targets(pool, &sql.sqlite, &wanted).await?,
    };
    if !changed.is_empty() {
        metrics::counter!("outbox_rebalances_total").increment(1);
        info!(instance = %me, live = live.len(), moved = changed.len(), "rebalanced: partition targets changed");
    }
    Ok(targets)
}

/// Marks this instance as leaving, so assignments stop counting it.
pub(crate) async fn drain(db: &Db, sql: &Sql, me: Uuid) -> Result<()> {
    match db {
        Db::Postgres(pool) => {
            sqlx::query(stmt(&sql.drain)).bind(me).execute(pool).await?;
            Ok(())
        }
        Db::Sqlite(pool) => sqlite::drain(pool, &sql.sqlite, me).await,
    }
}
