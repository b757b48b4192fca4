//! The library's own migrator: plain SQL files from `migrations/postgres/` (or `migrations/sqlite/`),
//! applied in one transaction under an advisory lock (SQLite: the write lock), so instances starting
//! together apply them once, tracked in `<schema>.schema_migrations` (SQLite: `<schema>_schema_migrations`),
//! never the host application's `_sqlx_migrations`.

use sqlx::{Connection, PgPool};
use tracing::info;
use xxhash_rust::xxh3::xxh3_64;

use crate::error::{Error, Result};
use crate::sql::{Sql, stmt};

/// A forward-only migration.
#[derive(Debug, Clone, Copy)]
pub struct Migration {
    /// Version, increasing.
    pub version: i64,
    /// Short name.
    pub name: &'static str,
    /// SQL with unqualified names; runs with `search_path` set to the schema.
    pub sql: &'static str,
}

/// The PostgreSQL migrations this version of the library knows, in order (SQLite's are in `sqlite.rs`).
pub const MIGRATIONS: &[Migration] = &[
    Migration { version: 1, name: "initial", sql: include_str!("../../../migrations/postgres/0001_initial.sql") },
    Migration {
        version: 2,
        name: "leases_requeues_sequences",
        sql: include_str!("../../../migrations/postgres/0002_leases_requeues_sequences.sql"),
    },
];

/// Arbitrary constant namespacing the advisory lock (ASCII "outbox").
const LOCK_NAMESPACE: i32 = 0x6f75_7462;

pub(crate) fn checksum(sql: &str) -> i64 {
    i64::from_ne_bytes(xxh3_64(sql.as_bytes()).to_ne_bytes())
}

/// Applies the migrations that are missing. Idempotent, and safe when many instances run it at once.
pub(crate) async fn postgres(pool: &PgPool, sql: &Sql) -> Result<()> {
    let schema = sql.schema();
    let mut conn = pool.acquire().await?;
    let mut tx = conn.begin().await?;
    // Serialise migrators of this schema across the cluster; released at commit.
    sqlx::query("SELECT pg_advisory_xact_lock($1, hashtext($2))")
        .bind(LOCK_NAMESPACE)
        .bind(schema)
        .execute(&mut *tx)
        .await?;
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE SCHEMA IF NOT EXISTS {schema}"))).execute(&mut *tx).await?;
    sqlx::query(stmt(&sql.migrations_table)).execute(&mut *tx).await?;
    let applied: Vec<(i64, i64)> =
        sqlx::query_as(sqlx::AssertSqlSafe(format!("SELECT version, checksum FROM {schema}.schema_migrations")))
            .fetch_all(&mut *tx)
            .await?;
    let known: Vec<(i64, &str, i64)> = MIGRATIONS.iter().map(|m| (m.version, m.name, checksum(m.sql))).collect();
    check_applied(schema, &applied, &known)?;
    sqlx::query(sqlx::AssertSqlSafe(format!("SET LOCAL search_path TO {schema}"))).execute(&mut *tx).await?;
    for m in MIGRATIONS.iter().filter(|m| !applied.iter().any(|&(v, _)| v == m.version)) {
        sqlx::raw_sql(m.sql).execute(&mut *tx).await?;
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO {schema}.schema_migrations (version, name, checksum) VALUES ($1, $2, $3)"
        )))
        .bind(m.version)
        .bind(m.name)
        .bind(checksum(m.sql))
        .execute(&mut *tx)
        .await?;
        info!(schema, version = m.version, name = m.name, "applied outbox migration");
    }
    tx.commit().await?;
    Ok(())
}

/// Refuses a database holding a migration this library does not know, or a known one whose text changed.
/// `applied` and `known` are (version, checksum) and (version, name, checksum).
pub(crate) fn check_applied(schema: &str, applied: &[(i64, i64)], known: &[(i64, &str, i64)]) -> Result<()> {
    let latest = known.last().map_or(0, |m| m.0);
    for &(version, sum) in applied {
        let bad = |reason: String| Err(Error::Migration { schema: schema.to_string(), version, reason });
        match known.iter().find(|m| m.0 == version) {
            None if version > latest => {
                return bad(format!("applied by a newer library version (this one knows up to {latest})"));
            }
            None => return bad("applied but unknown to this library".into()),
            Some(m) if m.2 != sum => return bad("its SQL changed after it was applied".into()),
            Some(_) => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use sqlx::PgPool;

    use super::{MIGRATIONS, checksum};
    use crate::sql::stmt;
    use crate::{Config, NewRecord, Outbox, partition_of};

    /// A database left at version 1 by an older library (per-key counter rows) is upgraded without any
    /// key's sequence going backwards: the new sequence starts above every number given out.
    #[sqlx::test(migrations = false)]
    async fn upgrading_from_version_1_keeps_every_keys_sequence_growing(pool: PgPool) {
        let outbox = Outbox::new(Config::default()).unwrap();
        let mut tx = pool.begin().await.unwrap();
        sqlx::query("CREATE SCHEMA outbox").execute(&mut *tx).await.unwrap();
        sqlx::query(stmt(&outbox.sql().migrations_table)).execute(&mut *tx).await.unwrap();
        sqlx::query("SET LOCAL search_path TO outbox").execute(&mut *tx).await.unwrap();
        sqlx::raw_sql(MIGRATIONS[0].sql).execute(&mut *tx).await.unwrap();
        sqlx::query("INSERT INTO outbox.schema_migrations (version, name, checksum) VALUES (1, 'initial', $1)")
            .bind(checksum(MIGRATIONS[0].sql))
            .execute(&mut *tx)
            .await
            .unwrap();
        sqlx::query("INSERT INTO outbox.keys (key, last_seq) VALUES ('old', 41), ('drained', 7)")
            .execute(&mut *tx)
            .await
            .unwrap();
        sqlx::query("INSERT INTO outbox.records (id, partition, key, seq, event_type, payload) VALUES ($1, $2, 'old', 41, 't', '')")
            .bind(uuid::Uuid::now_v7())
            .bind(i16::from(partition_of("old")))
            .execute(&mut *tx)
            .await
            .unwrap();
        tx.commit().await.unwrap();

        outbox.migrate(&pool).await.unwrap();
        let mut tx = pool.begin().await.unwrap();
        let old = outbox.schedule(&mut *tx, NewRecord::new("old", "t", "")).await.unwrap();
        let drained = outbox.schedule(&mut *tx, NewRecord::new("drained", "t", "")).await.unwrap();
        tx.commit().await.unwrap();
        assert!(old.seq > 41 && drained.seq > 41, "{} {}", old.seq, drained.seq);
        let kept: i64 =
            sqlx::query_scalar("SELECT count(*) FROM outbox.records WHERE seq = 41").fetch_one(&pool).await.unwrap();
        assert_eq!(kept, 1, "pending records are kept");
    }
}
