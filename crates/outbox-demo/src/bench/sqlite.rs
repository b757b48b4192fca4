//! The bench's SQLite side (the only bench file naming it): a fresh outbox file per durability mode.

use sqlx::sqlite::{SqlitePoolOptions, SqliteSynchronous};

use crate::Failure;

/// `synchronous = FULL` (the library's default: every commit durable) or `NORMAL`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    Full,
    Normal,
}

/// A SQLite outbox database at `path` with the library's options but `durability`.
pub async fn file(path: &std::path::Path, durability: Durability) -> Result<outbox_core::Db, Failure> {
    let url = format!("sqlite://{}", path.display());
    let synchronous = match durability {
        Durability::Full => SqliteSynchronous::Full,
        Durability::Normal => SqliteSynchronous::Normal,
    };
    let options = outbox_core::driver::sqlite::options(&url)?.synchronous(synchronous);
    let pool = SqlitePoolOptions::new()
        .max_connections(8)
        .connect_with(options)
        .await
        .map_err(|e| Failure(format!("bench: SQLite file {url}: {e}")))?;
    Ok(outbox_core::Db::from(pool))
}

/// A fresh, empty table of the shape of `records` (its columns, constraints and indexes, from the
/// schema's own text, but none of its triggers): the producer's yardstick writes into it.
pub async fn plain_table(db: &outbox_core::Db, records: &str) -> Result<String, Failure> {
    let plain = records.replace("records", "plain");
    let ddl: Vec<(String,)> = db
        .fetch_all(
            "SELECT sql FROM sqlite_master WHERE tbl_name = $1 AND type IN ('table', 'index') AND sql IS NOT NULL",
            &[records.into()],
        )
        .await?;
    let create: Vec<String> = ddl.iter().map(|(sql,)| sql.replace(records, &plain)).collect();
    db.execute_script(sqlx::AssertSqlSafe(format!("DROP TABLE IF EXISTS {plain};\n{};", create.join(";\n")))).await?;
    Ok(plain)
}
