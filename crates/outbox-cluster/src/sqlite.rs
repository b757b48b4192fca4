//! The SQLite backend of `outbox-cluster`: every statement and how it runs (PostgreSQL's are in
//! `sql.rs`). Each function returns what its PostgreSQL twin's statement returns.
//!
//! Every write runs in a [`sqlite_write`] (`BEGIN IMMEDIATE`, in this process's turn, so heartbeats
//! never starve behind a busy worker). For the compare-and-set steps (acquire, release, targets) SQLite's
//! single writer makes the check and the epoch bump one atomic step, as `FOR UPDATE` does on PostgreSQL.
//! Liveness compares against SQLite's clock (the host's; all instances of a database file share it).

use std::sync::Arc;
use std::time::Duration;

use outbox_core::Outbox;
use outbox_core::db::{sqlite_write, sqlite_write_on};
use sqlx::{AssertSqlSafe, SqliteConnection, SqlitePool};
use uuid::Uuid;

use crate::Result;
use crate::ownership::AcquiredRow;
use crate::registry::{InstanceInfo, Lease};
use crate::sql::millis;

const REGISTER: &str = "INSERT INTO {s}_instances (id, name, expires_at, heartbeat_ms)
VALUES ($1, $2, {now} + $3, $4) RETURNING expires_at - {now}";

/// Renews a lease that has not expired (see the PostgreSQL statement); returns its remaining ms.
const HEARTBEAT: &str = "UPDATE {s}_instances SET heartbeat_at = {now}, expires_at = {now} + $2
WHERE id = $1 AND expires_at > {now} RETURNING expires_at - {now}";

const DEREGISTER: &str = "DELETE FROM {s}_instances WHERE id = $1";

const REAP: &str = "DELETE FROM {s}_instances WHERE expires_at < {now} - $1";

/// Partitions targeted at `$1` that are free or whose owner has no live lease, with that owner and its
/// heartbeat interval (if its row is still there).
const ACQUIRABLE: &str =
    "SELECT p.partition, p.owner, (SELECT i.heartbeat_ms FROM {s}_instances i WHERE i.id = p.owner)
FROM {s}_partitions p
WHERE p.target_owner = $1 AND p.owner IS NOT $1
  AND (p.owner IS NULL OR NOT EXISTS (
      SELECT 1 FROM {s}_instances i WHERE i.id = p.owner AND i.expires_at > {now}))";

const TAKE: &str = "UPDATE {s}_partitions SET owner = $1, epoch = epoch + 1, changed_at = {now}
WHERE partition = $2 RETURNING epoch";

const LIVE: &str = "SELECT id FROM {s}_instances WHERE expires_at > {now} AND NOT draining ORDER BY id";

const PARTITIONS: &str = "SELECT partition, owner, epoch, target_owner FROM {s}_partitions ORDER BY partition";

const SET_TARGET: &str = "UPDATE {s}_partitions SET target_owner = $2
WHERE partition = $1 AND target_owner IS NOT $2 RETURNING partition";

const DRAIN: &str = "UPDATE {s}_instances SET draining = 1 WHERE id = $1";

const OWNED: &str = "SELECT partition, epoch FROM {s}_partitions WHERE owner = $1 ORDER BY partition";

const RELEASE: &str = "UPDATE {s}_partitions SET owner = NULL, epoch = epoch + 1, changed_at = {now}
WHERE partition = $2 AND epoch = $3 AND owner = $1 RETURNING partition";

const INSTANCES: &str = "SELECT i.id, i.name, {time:i.started_at} AS started_at,
    {time:i.heartbeat_at} AS heartbeat_at, i.expires_at > {now} AS live,
    (SELECT count(*) FROM {s}_partitions p WHERE p.owner = i.id) AS partitions
FROM {s}_instances i ORDER BY i.started_at";

/// The statements, built for one table prefix.
#[derive(Debug)]
pub(crate) struct Sql {
    register: Arc<str>,
    heartbeat: Arc<str>,
    deregister: Arc<str>,
    reap: Arc<str>,
    acquirable: Arc<str>,
    take: Arc<str>,
    live: Arc<str>,
    partitions: Arc<str>,
    set_target: Arc<str>,
    drain: Arc<str>,
    owned: Arc<str>,
    release: Arc<str>,
    instances: Arc<str>,
}

impl Sql {
    pub(crate) fn new(outbox: &Outbox) -> Self {
        let schema = &outbox.config().schema;
        let build = |text: &str| outbox_core::db::sqlite_statement(text, schema);
        Self {
            register: build(REGISTER),
            heartbeat: build(HEARTBEAT),
            deregister: build(DEREGISTER),
            reap: build(REAP),
            acquirable: build(ACQUIRABLE),
            take: build(TAKE),
            live: build(LIVE),
            partitions: build(PARTITIONS),
            set_target: build(SET_TARGET),
            drain: build(DRAIN),
            owned: build(OWNED),
            release: build(RELEASE),
            instances: build(INSTANCES),
        }
    }
}

fn stmt(text: &Arc<str>) -> AssertSqlSafe<Arc<str>> {
    AssertSqlSafe(Arc::clone(text))
}

/// Registers; returns the lease's remaining ms.
pub(crate) async fn register(pool: &SqlitePool, sql: &Sql, id: Uuid, name: &str, lease: Lease) -> Result<i64> {
    let mut tx = sqlite_write(pool).await?;
    let remaining: i64 = sqlx::query_scalar(stmt(&sql.register))
        .bind(id)
        .bind(name)
        .bind(millis(lease.live))
        .bind(millis(lease.heartbeat))
        .fetch_one(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(remaining)
}

/// Renews an unexpired lease on the heartbeat's own connection `conn` (to `pool`'s file); returns its
/// remaining ms, `None` if it had expired.
pub(crate) async fn heartbeat(
    pool: &SqlitePool,
    conn: &mut SqliteConnection,
    sql: &Sql,
    id: Uuid,
    lease: Lease,
) -> Result<Option<i64>> {
    let mut tx = sqlite_write_on(pool, conn).await?;
    let remaining: Option<i64> =
        sqlx::query_scalar(stmt(&sql.heartbeat)).bind(id).bind(millis(lease.live)).fetch_optional(&mut *tx).await?;
    tx.commit().await?;
    Ok(remaining)
}

pub(crate) async fn deregister(pool: &SqlitePool, sql: &Sql, id: Uuid) -> Result<()> {
    let mut tx = sqlite_write(pool).await?;
    sqlx::query(stmt(&sql.deregister)).bind(id).execute(&mut *tx).await?;
    Ok(tx.commit().await?)
}

pub(crate) async fn reap(pool: &SqlitePool, sql: &Sql, grace: Duration) -> Result<u64> {
    let mut tx = sqlite_write(pool).await?;
    let reaped = sqlx::query(stmt(&sql.reap)).bind(millis(grace)).execute(&mut *tx).await?.rows_affected();
    tx.commit().await?;
    Ok(reaped)
}

/// (partition, new epoch, previous owner, its heartbeat interval in ms) of each partition acquired.
pub(crate) async fn acquire(pool: &SqlitePool, sql: &Sql, me: Uuid) -> Result<Vec<AcquiredRow>> {
    let mut tx = sqlite_write(pool).await?;
    let candidates: Vec<(i16, Option<Uuid>, Option<i64>)> =
        sqlx::query_as(stmt(&sql.acquirable)).bind(me).fetch_all(&mut *tx).await?;
    let mut acquired = Vec::with_capacity(candidates.len());
    for (partition, previous, heartbeat_ms) in candidates {
        let epoch: i64 = sqlx::query_scalar(stmt(&sql.take)).bind(me).bind(partition).fetch_one(&mut *tx).await?;
        acquired.push((partition, epoch, previous, heartbeat_ms));
    }
    tx.commit().await?;
    Ok(acquired)
}

pub(crate) async fn live(pool: &SqlitePool, sql: &Sql) -> Result<Vec<(Uuid,)>> {
    Ok(sqlx::query_as(stmt(&sql.live)).fetch_all(pool).await?)
}

pub(crate) async fn partitions(pool: &SqlitePool, sql: &Sql) -> Result<Vec<(i16, Option<Uuid>, i64, Option<Uuid>)>> {
    Ok(sqlx::query_as(stmt(&sql.partitions)).fetch_all(pool).await?)
}

/// Writes the targets that changed; returns their partitions.
pub(crate) async fn set_targets(pool: &SqlitePool, sql: &Sql, targets: &[(i16, Uuid)]) -> Result<Vec<(i16,)>> {
    let mut tx = sqlite_write(pool).await?;
    let mut changed = Vec::new();
    for &(partition, owner) in targets {
        let row: Option<(i16,)> =
            sqlx::query_as(stmt(&sql.set_target)).bind(partition).bind(owner).fetch_optional(&mut *tx).await?;
        changed.extend(row);
    }
    tx.commit().await?;
    Ok(changed)
}

pub(crate) async fn drain(pool: &SqlitePool, sql: &Sql, me: Uuid) -> Result<()> {
    let mut tx = sqlite_write(pool).await?;
    sqlx::query(stmt(&sql.drain)).bind(me).execute(&mut *tx).await?;
    Ok(tx.commit().await?)
}

pub(crate) async fn owned(pool: &SqlitePool, sql: &Sql, me: Uuid) -> Result<Vec<(i16, i64)>> {
    Ok(sqlx::query_as(stmt(&sql.owned)).bind(me).fetch_all(pool).await?)
}

/// Releases partitions held at the given epochs; returns those that were still this instance's.
pub(crate) async fn release(pool: &SqlitePool, sql: &Sql, me: Uuid, held: &[(i16, i64)]) -> Result<Vec<(i16,)>> {
    let mut tx = sqlite_write(pool).await?;
    let mut released = Vec::new();
    for &(partition, epoch) in held {
        let row: Option<(i16,)> =
            sqlx::query_as(stmt(&sql.release)).bind(me).bind(partition).bind(epoch).fetch_optional(&mut *tx).await?;
        released.extend(row);
    }
    tx.commit().await?;
    Ok(released)
}

pub(crate) async fn instances(pool: &SqlitePool, sql: &Sql) -> Result<Vec<InstanceInfo>> {
    Ok(sqlx::query_as(stmt(&sql.instances)).fetch_all(pool).await?)
}
