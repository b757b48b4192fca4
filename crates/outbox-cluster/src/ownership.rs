//! Partition ownership: acquire (free or dead owner) and release, each a compare-and-set that bumps the
//! partition's epoch. The processor fences every write with the (owner, epoch) it was given.

use outbox_core::{Assignment, Partition};
use sqlx::PgPool;
use tracing::info;
use uuid::Uuid;

use crate::Result;
use crate::sql::{Sql, stmt};

/// Acquires every partition that is free or whose owner's lease expired; returns them with their new epochs.
pub(crate) async fn acquire(pool: &PgPool, sql: &Sql, me: Uuid) -> Result<Assignment> {
    let rows: Vec<(i16, i64, Option<Uuid>)> = sqlx::query_as(stmt(&sql.acquire)).bind(me).fetch_all(pool).await?;
    let mut acquired = Assignment::new();
    for (partition, epoch, previous) in rows {
        let partition = to_partition(partition)?;
        match previous {
            Some(previous) => {
                info!(partition, epoch, instance = %me, %previous, reason = "owner lease expired", "partition stolen")
            }
            None => info!(partition, epoch, instance = %me, reason = "free", "partition acquired"),
        }
        acquired.insert(partition, epoch);
    }
    Ok(acquired)
}

/// What the database says this instance owns.
pub(crate) async fn owned(pool: &PgPool, sql: &Sql, me: Uuid) -> Result<Assignment> {
    let rows: Vec<(i16, i64)> = sqlx::query_as(stmt(&sql.owned)).bind(me).fetch_all(pool).await?;
    rows.into_iter().map(|(p, e)| Ok((to_partition(p)?, e))).collect()
}

/// Releases the given partitions (at their epochs); returns how many were still ours to release.
pub(crate) async fn release(pool: &PgPool, sql: &Sql, me: Uuid, partitions: &Assignment) -> Result<usize> {
    let (ids, epochs): (Vec<i16>, Vec<i64>) = partitions.iter().map(|(&p, &e)| (i16::from(p), e)).unzip();
    let rows: Vec<(i16,)> =
        sqlx::query_as(stmt(&sql.release)).bind(me).bind(&ids).bind(&epochs).fetch_all(pool).await?;
    info!(instance = %me, released = rows.len(), "partitions released");
    Ok(rows.len())
}

fn to_partition(p: i16) -> Result<Partition> {
    Partition::try_from(p)
        .map_err(|_| crate::Error::Database(sqlx::Error::Decode(format!("partition {p} out of range").into())))
}
