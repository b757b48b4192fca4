//! Instance registry: register, heartbeat (lease renewal by database time), deregister, reap the dead.

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

pub(crate) async fn register(db: &Db, sql: &Sql, id: Uuid, name: &str, lease: Duration) -> Result<()> {
    match db {
        Db::Postgres(pool) => {
            sqlx::query(stmt(&sql.register)).bind(id).bind(name).bind(millis(lease)).execute(pool).await?;
            Ok(())
        }
        Db::Sqlite(pool) => sqlite::register(pool, &sql.sqlite, id, name, lease).await,
    }
}

/// Renews the lease; `false` when the instance is no longer registered (declared dead by others).
pub(crate) async fn heartbeat(conn: &mut PgConnection, sql: &Sql, id: Uuid, lease: Duration) -> Result<bool> {
    let row = sqlx::query(stmt(&sql.heartbeat)).bind(id).bind(millis(lease)).fetch_optional(conn).await?;
    Ok(row.is_some())
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
