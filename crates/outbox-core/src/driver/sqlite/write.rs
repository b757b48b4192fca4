//! Transactions on a SQLite file take turns, first come first served, per file and process: the
//! outbox's own writes and the application's (`Db::begin`).
//!
//! SQLite's busy handler is not a queue: a writer that finds the lock taken sleeps (1, 2, 5, 10 ms and
//! on, up to 100 ms at a time) and retries, and one that finds it free takes it. A heartbeat behind a
//! worker completing batches back to back could wait seconds, and a completion behind producers'
//! commits sat out those sleeps. In turn, a writer in one process waits at most for the transactions
//! queued before it; writers in other processes still meet the busy handler
//! ([`BUSY_TIMEOUT`](super::BUSY_TIMEOUT)).

use std::collections::HashMap;
use std::ops::{Deref, DerefMut};
use std::path::PathBuf;
use std::sync::{Arc, LazyLock, PoisonError};

use sqlx::{AssertSqlSafe, Connection, SqlSafeStr, Sqlite, SqliteConnection, SqlitePool, Transaction};
use tokio::sync::{Mutex, OwnedMutexGuard};

use super::BUSY_TIMEOUT;
use crate::error::{Error, Result};

/// A write transaction on a SQLite database ([`write()`]): `BEGIN IMMEDIATE`, and this process's turn at
/// the database file until it commits, rolls back or is dropped. Derefs to the connection.
#[derive(Debug)]
pub struct Write<'c> {
    // Declared (so dropped) before the turn. A dropped write only queues its rollback on the connection's
    // worker, so the next writer in this process may find the file still locked for a moment and wait
    // in SQLite's busy handler (up to BUSY_TIMEOUT) rather than in the turns' queue: no write is lost.
    tx: Transaction<'c, Sqlite>,
    _turn: OwnedMutexGuard<()>,
}

impl Write<'_> {
    /// Commits, then hands the turn on.
    pub async fn commit(self) -> Result<()> {
        self.tx.commit().await?;
        Ok(())
    }

    /// Rolls back, then hands the turn on.
    pub async fn rollback(self) -> Result<()> {
        self.tx.rollback().await?;
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

/// Starts a write (the application's transactions, completions, heartbeats, ownership, operator
/// commands): waits for this process's turn at the database file and a pooled connection, then begins
/// `BEGIN IMMEDIATE` (the write lock from the start). For crates that add statements over the outbox tables
/// (`outbox-cluster`). Cancel-safe: sqlx's SQLite worker rolls back a `BEGIN` whose caller went away.
///
/// # Errors
/// [`Error::WriteLockTimeout`] after waiting [`BUSY_TIMEOUT`](super::BUSY_TIMEOUT) for the turn (as
/// SQLite's busy error after as long for the lock): a transaction of this process held it that long,
/// maybe the caller's own.
pub async fn write(pool: &SqlitePool) -> Result<Write<'static>> {
    let turn = take_turn(pool).await?;
    // A writer that waited for a pooled connection in its turn (the application holding the pool) held
    // up every writer of the process, the heartbeat on its own connection too. With none idle and no
    // room to open one, it waits in the pool's queue without the turn (taking its place in that fair
    // queue, so it is not passed over), then in the turn's with its connection. Waiting in the turn's
    // queue holds none otherwise, so a turn's holder that reads from the pool meanwhile finds one
    // (unless the pool ran out and the writers that waited for it hold them all).
    let room = pool.size() < pool.options().get_max_connections();
    let (turn, conn) = match pool.try_acquire() {
        Some(conn) => (turn, conn),
        // Opening one takes a moment: the turn is kept.
        None if room => (turn, pool.acquire().await?),
        None => {
            drop(turn);
            let conn = pool.acquire().await?;
            (take_turn(pool).await?, conn)
        }
    };
    // What `Pool::begin_with` does, on the connection already held.
    let tx = Transaction::begin(conn, Some(AssertSqlSafe("BEGIN IMMEDIATE").into_sql_str())).await?;
    Ok(Write { tx, _turn: turn })
}

/// [`write()`] on a connection of the caller's own (to the file `pool` opens), for a writer that must not
/// wait for a pooled connection behind the application's use of the pool: the heartbeat. Cancel-safe as
/// well: sqlx's SQLite worker rolls back a `BEGIN` whose caller went away.
pub async fn write_on<'c>(pool: &SqlitePool, conn: &'c mut SqliteConnection) -> Result<Write<'c>> {
    let turn = take_turn(pool).await?;
    let tx = conn.begin_with("BEGIN IMMEDIATE").await?;
    Ok(Write { tx, _turn: turn })
}

/// This process's turn at the file `pool` opens, waited for at most [`BUSY_TIMEOUT`].
async fn take_turn(pool: &SqlitePool) -> Result<OwnedMutexGuard<()>> {
    let waited = BUSY_TIMEOUT;
    let turn = tokio::time::timeout(waited, turn_of(pool).lock_owned()).await;
    turn.map_err(|_| {
        let database = format!("the SQLite database {}", pool.connect_options().get_filename().display());
        Error::WriteLockTimeout { database, waited }
    })
}

/// The turn (a FIFO lock) of the database file `pool` opens; one per file per process, whatever path
/// names it (`data/app.db`, `./data/app.db`, `/srv/data/app.db`: pools naming it apart took turns apart,
/// and their writers met in SQLite's busy handler, which is no queue).
fn turn_of(pool: &SqlitePool) -> Arc<Mutex<()>> {
    static TURNS: LazyLock<std::sync::Mutex<HashMap<PathBuf, Arc<Mutex<()>>>>> = LazyLock::new(Default::default);
    let options = pool.connect_options();
    let named = options.get_filename();
    // A file not there (an in-memory database) keeps its name.
    let file = std::fs::canonicalize(named).unwrap_or_else(|_| named.to_path_buf());
    // The map is only ever inserted into, so a panic elsewhere cannot leave it inconsistent.
    let mut turns = TURNS.lock().unwrap_or_else(PoisonError::into_inner);
    Arc::clone(turns.entry(file).or_default())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

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
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        let (a, b, other) = (pool(url("a.db")).await, pool(url("sub/../a.db")).await, pool(url("b.db")).await);
        assert!(Arc::ptr_eq(&turn_of(&a), &turn_of(&b)), "one file, named two ways");
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

    /// A writer waiting for a pooled connection (the application holds them all) does not hold up the
    /// heartbeat, which writes on a connection of its own: the file is free, so it goes first. Before,
    /// the waiting writer held the process's turn, and the heartbeat waited up to the pool's acquire
    /// timeout (30 s by default) behind it, far past its lease.
    #[tokio::test]
    async fn a_writer_waiting_for_a_pooled_connection_does_not_hold_up_the_heartbeat() {
        let dir = tempfile::tempdir().unwrap();
        let options = super::super::options(&format!("sqlite://{}", dir.path().join("a.db").display())).unwrap();
        let pool =
            sqlx::sqlite::SqlitePoolOptions::new().max_connections(1).connect_with(options.clone()).await.unwrap();
        let held = pool.acquire().await.unwrap();
        let waiting = tokio::spawn({
            let pool = pool.clone();
            async move { write(&pool).await.map(drop) }
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!waiting.is_finished(), "the writer waits for the pooled connection");
        let mut own = SqliteConnection::connect_with(&options).await.unwrap();
        let heartbeat = tokio::time::timeout(Duration::from_secs(2), write_on(&pool, &mut own)).await;
        heartbeat.expect("the heartbeat's write began at once").unwrap().commit().await.unwrap();
        drop(held);
        waiting.await.unwrap().unwrap();
    }

    /// Writers queued for the turn hold no pooled connection, so the turn's holder may read from the
    /// pool meanwhile (an application reading outside its transaction): with the connections taken by
    /// the queue, it would wait for them, and they for it.
    #[tokio::test]
    async fn writers_queued_for_the_turn_leave_the_pool_to_its_holder() {
        let dir = tempfile::tempdir().unwrap();
        let options = super::super::options(&format!("sqlite://{}", dir.path().join("a.db").display())).unwrap();
        let pool = sqlx::sqlite::SqlitePoolOptions::new()
            .max_connections(2)
            .acquire_timeout(Duration::from_secs(2))
            .connect_with(options)
            .await
            .unwrap();
        let holder = write(&pool).await.unwrap();
        let queued = tokio::spawn({
            let pool = pool.clone();
            async move { write(&pool).await.map(drop) }
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!queued.is_finished(), "the second writer waits for the turn");
        let read: i64 =
            sqlx::query_scalar("SELECT 1").fetch_one(&pool).await.expect("a connection for the holder's read");
        assert_eq!(read, 1);
        holder.commit().await.unwrap();
        queued.await.unwrap().unwrap();
    }

    /// A second transaction begun in one process while the first is open waits for its turn as long as
    /// SQLite would wait for the lock, then fails with a typed error, not a hang (here the caller's own
    /// first transaction, which would never commit while the caller waits).
    #[tokio::test]
    async fn a_turn_waited_for_past_the_busy_timeout_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let options = super::super::options(&format!("sqlite://{}", dir.path().join("a.db").display())).unwrap();
        let pool = sqlx::sqlite::SqlitePoolOptions::new().max_connections(2).connect_with(options).await.unwrap();
        let db = crate::Db::Sqlite(pool.clone());
        let first = db.begin().await.unwrap();
        // The clock runs on by itself while the runtime waits for nothing but the turn.
        tokio::time::pause();
        let started = tokio::time::Instant::now();
        let second = db.begin().await.unwrap_err();
        assert!(matches!(second, Error::WriteLockTimeout { waited: BUSY_TIMEOUT, .. }), "{second}");
        assert!(second.is_transient(), "the outbox's own writers try again later");
        assert!(second.to_string().contains("a.db"), "{second}");
        // The paused clock's time: the timer's 1 ms grain on top.
        let waited = started.elapsed();
        assert!(waited >= BUSY_TIMEOUT && waited < BUSY_TIMEOUT + Duration::from_millis(10), "{waited:?}");
        tokio::time::resume();
        first.rollback().await.unwrap();
        db.begin().await.unwrap().commit().await.unwrap();
    }
}
