//! The outbox's own writes on a SQLite file take turns, first come first served, per file and process.
//!
//! SQLite's busy handler is not a queue: a writer that finds the lock taken sleeps (up to 100 ms at a
//! time) and retries, and one that finds it free takes it, so a heartbeat behind a worker completing
//! batches back to back could wait seconds. In turn, the outbox's writers in one process wait at most for
//! the writes queued before them; writers in other processes and the application's own transactions
//! still meet the busy handler ([`BUSY_TIMEOUT`](super::BUSY_TIMEOUT)).

use std::collections::HashMap;
use std::ops::{Deref, DerefMut};
use std::path::PathBuf;
use std::sync::{Arc, LazyLock, PoisonError};

use sqlx::{Connection, Sqlite, SqliteConnection, SqlitePool, Transaction};
use tokio::sync::{Mutex, OwnedMutexGuard};

use crate::error::Result;

/// A write transaction of the outbox on a SQLite database ([`write()`]): `BEGIN IMMEDIATE`, and this
/// process's turn at the database file until it commits or is dropped. Derefs to the connection.
#[derive(Debug)]
pub struct Write<'c> {
    // Declared (so dropped) before the turn: a dropped write rolls back before the next writer's turn.
    tx: Transaction<'c, Sqlite>,
    _turn: OwnedMutexGuard<()>,
}

impl Write<'_> {
    /// Commits, then hands the turn on.
    pub async fn commit(self) -> Result<()> {
        self.tx.commit().await?;
        Ok(())
    }
}

impl Deref for Write<'_> {
    type Target = SqliteConnection;
    fn deref(&self) -> &SqliteConnection {
        &self.tx
    }
}

impl DerefMut for Write<'_> {
    fn deref_mut(&mut self) -> &mut SqliteConnection {
        &mut self.tx
    }
}

/// Starts a write of the outbox's own (completions, heartbeats, ownership, operator commands): waits for
/// this process's turn at the database file, then begins `BEGIN IMMEDIATE` (the write lock from the
/// start). For crates that add statements over the outbox tables (`outbox-cluster`). Cancel-safe: sqlx's
/// SQLite worker rolls back a `BEGIN` whose caller went away.
pub async fn write(pool: &SqlitePool) -> Result<Write<'static>> {
    let turn = turn_of(pool).lock_owned().await;
    let tx = pool.begin_with("BEGIN IMMEDIATE").await?;
    Ok(Write { tx, _turn: turn })
}

/// [`write()`] on a connection of the caller's own (to the file `pool` opens), for a writer that must not
/// wait for a pooled connection behind the application's use of the pool: the heartbeat. Cancel-safe as
/// well: sqlx's SQLite worker rolls back a `BEGIN` whose caller went away.
pub async fn write_on<'c>(pool: &SqlitePool, conn: &'c mut SqliteConnection) -> Result<Write<'c>> {
    let turn = turn_of(pool).lock_owned().await;
    let tx = conn.begin_with("BEGIN IMMEDIATE").await?;
    Ok(Write { tx, _turn: turn })
}

/// The turn (a FIFO lock) of the database file `pool` opens; one per file per process.
fn turn_of(pool: &SqlitePool) -> Arc<Mutex<()>> {
    static TURNS: LazyLock<std::sync::Mutex<HashMap<PathBuf, Arc<Mutex<()>>>>> = LazyLock::new(Default::default);
    let file = pool.connect_options().get_filename().to_path_buf();
    // The map is only ever inserted into, so a panic elsewhere cannot leave it inconsistent.
    let mut turns = TURNS.lock().unwrap_or_else(PoisonError::into_inner);
    Arc::clone(turns.entry(file).or_default())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every pool on one file shares one turn, held from `write` until commit or drop; another file has
    /// its own.
    #[tokio::test]
    async fn writes_to_one_file_take_turns_across_pools() {
        let dir = tempfile::tempdir().unwrap();
        let url = |name: &str| format!("sqlite://{}", dir.path().join(name).display());
        let pool = |url: String| async move {
            let options = super::super::options(&url).unwrap();
            sqlx::sqlite::SqlitePoolOptions::new().max_connections(2).connect_with(options).await.unwrap()
        };
        let (a, b, other) = (pool(url("a.db")).await, pool(url("a.db")).await, pool(url("b.db")).await);
        assert!(Arc::ptr_eq(&turn_of(&a), &turn_of(&b)));
        assert!(!Arc::ptr_eq(&turn_of(&a), &turn_of(&other)));

        let first = write(&a).await.unwrap();
        assert!(turn_of(&b).try_lock().is_err(), "b waits while a writes");
        assert!(turn_of(&other).try_lock().is_ok(), "another file is not held up");
        first.commit().await.unwrap();
        assert!(turn_of(&b).try_lock().is_ok(), "the turn is handed on at commit");

        let dropped = write(&b).await.unwrap();
        drop(dropped);
        let mut again = write(&a).await.unwrap();
        sqlx::query("SELECT 1").execute(&mut *again).await.unwrap();
        again.commit().await.unwrap();
    }
}
