//! Instance registry: register, heartbeat (lease renewal by database time), deregister, reap the dead.
//!
//! An instance's row holds its lease (`expires_at`), until which it counts as live, and its heartbeat
//! interval. A heartbeat renews the lease only while it has not expired: an expired lease means the
//! instance was declared dead (others may take its partitions), and it must fence itself and register
//! again under a new id.

use std::time::Duration;

use chrono::{DateTime, Utc};
use outbox_core::Db;
use sqlx::PgConnection;
use uuid::Uuid;

use crate::sql::{Sql, millis, stmt};
use crate::{Result, sqlite};

/// One registered instance, as status shows it.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct InstanceInfo {
    /// Instance id (new on every start).
    pub id: Uuid,
    /// Name given in its config.
    pub name: String,
    /// When it registered.
    pub started_at: DateTime<Utc>,
    /// Its last heartbeat.
    pub heartbeat_at: DateTime<Utc>,
    /// Whether its lease is still valid by database time.
    pub live: bool,
    /// Partitions it owns.
    pub partitions: i64,
}

/// What a registration or renewal declares: live for `live`, renewed every `heartbeat`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Lease {
    pub(crate) live: Duration,
    pub(crate) heartbeat: Duration,
}

/// Registers `id`; returns the lease's remaining time as the database answered it.
pub(crate) async fn register(db: &Db, sql: &Sql, id: Uuid, name: &str, lease: Lease) -> Result<Duration> {
    let remaining = match db {
        Db::Postgres(pool) => {
            sqlx::query_scalar(stmt(&sql.register))
                .bind(id)
                .bind(name)
                .bind(millis(lease.live))
                .bind(millis(lease.heartbeat))
                .fetch_one(pool)
                .await?
        }
        Db::Sqlite(pool) => sqlite::register(pool, &sql.sqlite, id, name, lease).await?,
    };
    Ok(from_millis(remaining))
}

/// Renews an unexpired lease; returns its remaining time, or `None` when it had expired (the instance
/// was declared dead).
pub(crate) async fn heartbeat(conn: &mut PgConnection, sql: &Sql, id: Uuid, lease: Lease) -> Result<Option<Duration>> {
    let remaining: Option<i64> =
        sqlx::query_scalar(stmt(&sql.heartbeat)).bind(id).bind(millis(lease.live)).fetch_optional(conn).await?;
    Ok(remaining.map(from_millis))
}

fn from_millis(ms: i64) -> Duration {
    Duration::from_millis(u64::try_from(ms).unwrap_or(0))
}

pub(crate) async fn deregister(db: &Db, sql: &Sql, id: Uuid) -> Result<()> {
    match db {
        Db::Postgres(pool) => {
            sqlx::query(stmt(&sql.deregister)).bind(id).execute(pool).await?;
            Ok(())
        }
        Db::Sqlite(pool) => sqlite::deregister(pool, &sql.sqlite, id).await,
    }
}

/// Deletes instances whose lease expired more than `grace` ago.
pub(crate) async fn reap(db: &Db, sql: &Sql, grace: Duration) -> Result<u64> {
    match db {
        Db::Postgres(pool) => Ok(sqlx::query(stmt(&sql.reap)).bind(millis(grace)).execute(pool).await?.rows_affected()),
        Db::Sqlite(pool) => sqlite::reap(pool, &sql.sqlite, grace).await,
    }
}

pub(crate) async fn instances(db: &Db, sql: &Sql) -> Result<Vec<InstanceInfo>> {
    let pool = match db {
        Db::Postgres(pool) => pool,
        Db::Sqlite(pool) => return sqlite::instances(pool, &sql.sqlite).await,
    };
    Ok(sqlx::query_as(stmt(&sql.instances)).fetch_all(pool).await?)
}
