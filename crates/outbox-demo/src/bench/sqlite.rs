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
