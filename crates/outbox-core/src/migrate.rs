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
pub const MIGRATIONS: &[Migration] =
    &[Migration { version: 1, name: "initial", sql: include_str!("../../../migrations/postgres/0001_initial.sql") }];

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
