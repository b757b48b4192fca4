//! The two databases the outbox runs on, behind one API: PostgreSQL (any number of hosts) and SQLite
//! (one database file; instances in one process or on one host).
//!
//! Every function that reads or writes takes `impl Into<Db>`, so a `&PgPool` or a `&SqlitePool` can be
//! passed as it is; [`Outbox::schedule`](crate::Outbox::schedule) takes the caller's transaction as
//! `impl Into<Conn>` (`&mut *tx` or `&mut tx`), never a pool.
//!
//! What differs on SQLite: there is one writer at a time, so per-key order and the fence come from the
//! database's write lock instead of row locks; "database time" is SQLite's clock, the host's; the
//! configured schema name prefixes the table names (`outbox_records`). The pool must use WAL mode and a
//! busy timeout ([`sqlite_options`] sets both); a transaction that reads before it schedules should
//! start with `BEGIN IMMEDIATE` (`pool.begin_with("BEGIN IMMEDIATE")`, or [`Db::begin`]), or its first
//! write may fail with a (transient) busy error when another writer committed in between.

use std::collections::HashMap;
use std::ops::{Deref, DerefMut};
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::{Arc, LazyLock, PoisonError};
use std::time::Duration;

use sqlx::postgres::PgPoolOptions;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{Connection, PgConnection, PgPool, Postgres, Sqlite, SqliteConnection, SqlitePool, Transaction};
use tokio::sync::{Mutex, OwnedMutexGuard};

use crate::error::Result;

/// How long a SQLite connection waits for the write lock before a statement fails with "busy".
/// Writers hold it for milliseconds; a long wait means something is wrong, not busy.
pub const SQLITE_BUSY_TIMEOUT: Duration = Duration::from_secs(30);

/// A connection pool of either backend. Cheap to clone (pools are shared handles).
#[derive(Debug, Clone)]
pub enum Db {
    /// PostgreSQL.
    Postgres(PgPool),
    /// SQLite (WAL mode).
    Sqlite(SqlitePool),
}

impl Db {
    /// Connects by URL: `postgres://…` / `postgresql://…`, or `sqlite://path` / `sqlite::memory:` (created
    /// if missing, with [`sqlite_options`]).
    pub async fn connect(url: &str) -> Result<Db> {
        if url.starts_with("sqlite:") {
            let pool = SqlitePoolOptions::new().max_connections(8).connect_with(sqlite_options(url)?).await?;
            Ok(Db::Sqlite(pool))
        } else {
            Ok(Db::Postgres(PgPoolOptions::new().connect(url).await?))
        }
    }

    /// `"postgres"` or `"sqlite"`.
    pub fn backend(&self) -> &'static str {
        match self {
            Db::Postgres(_) => "postgres",
            Db::Sqlite(_) => "sqlite",
        }
    }

    /// Begins a transaction for business writes and [`Outbox::schedule`](crate::Outbox::schedule), on
    /// either backend; on SQLite with `BEGIN IMMEDIATE` (the write lock from the start, so a transaction
    /// that reads before it writes cannot meet a busy error at its first write). For code that runs on
    /// both backends; with one backend, its pool's own `begin` does the same.
    pub async fn begin(&self) -> Result<Tx> {
        Ok(match self {
            Db::Postgres(pool) => Tx::Postgres(pool.begin().await?),
            Db::Sqlite(pool) => Tx::Sqlite(pool.begin_with("BEGIN IMMEDIATE").await?),
        })
    }

    /// Closes the pool.
    pub async fn close(&self) {
        match self {
            Db::Postgres(pool) => pool.close().await,
            Db::Sqlite(pool) => pool.close().await,
        }
    }
}

/// Connection options for a SQLite outbox database: created if missing, WAL mode (readers never block
/// the writer), `synchronous = FULL` and [`SQLITE_BUSY_TIMEOUT`].
///
/// `FULL` makes every commit durable before it returns (an fsync of the WAL per commit). With `NORMAL`
/// (SQLite's own suggestion for WAL) a power cut or an operating-system crash, not a process crash, may
/// roll back the last transactions after their records were delivered: a published event whose business
/// transaction vanished. Opt into `NORMAL` only if that is acceptable, by setting
/// `.synchronous(SqliteSynchronous::Normal)` on the result: commits then skip the fsync, which the bench
/// measures (BENCHMARKS.md).
pub fn sqlite_options(url: &str) -> Result<SqliteConnectOptions> {
    Ok(SqliteConnectOptions::from_str(url)?
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Full)
        .busy_timeout(SQLITE_BUSY_TIMEOUT))
}

impl From<PgPool> for Db {
    fn from(pool: PgPool) -> Self {
        Db::Postgres(pool)
    }
}

impl From<&PgPool> for Db {
    fn from(pool: &PgPool) -> Self {
        Db::Postgres(pool.clone())
    }
}

impl From<SqlitePool> for Db {
    fn from(pool: SqlitePool) -> Self {
        Db::Sqlite(pool)
    }
}

impl From<&SqlitePool> for Db {
    fn from(pool: &SqlitePool) -> Self {
        Db::Sqlite(pool.clone())
    }
}

impl From<&Db> for Db {
    fn from(db: &Db) -> Self {
        db.clone()
    }
}

/// The caller's connection (inside its transaction) for [`Outbox::schedule`](crate::Outbox::schedule).
/// Built from `&mut *tx` or `&mut tx`; there is deliberately no conversion from a pool.
#[derive(Debug)]
pub enum Conn<'c> {
    /// A PostgreSQL connection.
    Postgres(&'c mut PgConnection),
    /// A SQLite connection.
    Sqlite(&'c mut SqliteConnection),
}

impl<'c> From<&'c mut PgConnection> for Conn<'c> {
    fn from(conn: &'c mut PgConnection) -> Self {
        Conn::Postgres(conn)
    }
}

impl<'c> From<&'c mut SqliteConnection> for Conn<'c> {
    fn from(conn: &'c mut SqliteConnection) -> Self {
        Conn::Sqlite(conn)
    }
}

impl<'c, 't> From<&'c mut Transaction<'t, Postgres>> for Conn<'c> {
    fn from(tx: &'c mut Transaction<'t, Postgres>) -> Self {
        Conn::Postgres(tx)
    }
}

impl<'c, 't> From<&'c mut Transaction<'t, sqlx::Sqlite>> for Conn<'c> {
    fn from(tx: &'c mut Transaction<'t, sqlx::Sqlite>) -> Self {
        Conn::Sqlite(tx)
    }
}

/// A transaction of either backend ([`Db::begin`]). `&mut tx` is a [`Conn`] for `schedule`; match on
/// it to run the business statements.
#[derive(Debug)]
pub enum Tx {
    /// A PostgreSQL transaction.
    Postgres(Transaction<'static, Postgres>),
    /// A SQLite transaction.
    Sqlite(Transaction<'static, sqlx::Sqlite>),
}

impl Tx {
    /// Commits.
    pub async fn commit(self) -> Result<()> {
        match self {
            Tx::Postgres(tx) => tx.commit().await?,
            Tx::Sqlite(tx) => tx.commit().await?,
        }
        Ok(())
    }

    /// Rolls back.
    pub async fn rollback(self) -> Result<()> {
        match self {
            Tx::Postgres(tx) => tx.rollback().await?,
            Tx::Sqlite(tx) => tx.rollback().await?,
        }
        Ok(())
    }
}

impl<'c> From<&'c mut Tx> for Conn<'c> {
    fn from(tx: &'c mut Tx) -> Self {
        match tx {
            Tx::Postgres(tx) => Conn::Postgres(tx),
            Tx::Sqlite(tx) => Conn::Sqlite(tx),
        }
    }
}

/// A write transaction of the outbox on a SQLite database ([`sqlite_write`]): `BEGIN IMMEDIATE`, and
/// this process's turn at the database file until it commits or is dropped. Derefs to the connection.
#[derive(Debug)]
pub struct SqliteWrite<'c> {
    // Declared (so dropped) before the turn: a dropped write rolls back before the next writer's turn.
    tx: Transaction<'c, Sqlite>,
    _turn: OwnedMutexGuard<()>,
}

impl SqliteWrite<'_> {
    /// Commits, then hands the turn on.
    pub async fn commit(self) -> Result<()> {
        self.tx.commit().await?;
        Ok(())
    }
}

impl Deref for SqliteWrite<'_> {
    type Target = SqliteConnection;
    fn deref(&self) -> &SqliteConnection {
        &self.tx
    }
}

impl DerefMut for SqliteWrite<'_> {
    fn deref_mut(&mut self) -> &mut SqliteConnection {
        &mut self.tx
    }
}

/// Starts a write of the outbox's own (completions, heartbeats, ownership, operator commands) on a
/// SQLite database: waits for this process's turn at the database file, first come first served, then
/// begins `BEGIN IMMEDIATE` (the write lock from the start). For crates that add statements over the
/// outbox tables (`outbox-cluster`).
///
/// Why turns: SQLite's busy handler is not a queue. A writer that finds the lock taken sleeps (up to
/// 100 ms at a time) and retries, and one that finds it free takes it, so a heartbeat behind a worker
/// completing batches back to back waited over 3 s for the lock in the SQLite bench. In turn, the outbox's
/// writers in one process wait at most for the writes queued before them. Writers in other processes
/// and the application's own transactions still meet the busy handler ([`SQLITE_BUSY_TIMEOUT`]).
///
/// The `BEGIN` runs on a task of its own, so a caller dropped while it runs cannot leave the pooled
/// connection inside a transaction.
pub async fn sqlite_write(pool: &SqlitePool) -> Result<SqliteWrite<'static>> {
    let turn = turn_of(pool).lock_owned().await;
    let pool = pool.clone();
    let begun = tokio::spawn(async move { pool.begin_with("BEGIN IMMEDIATE").await });
    let tx = begun.await.unwrap_or(Err(sqlx::Error::WorkerCrashed))?;
    Ok(SqliteWrite { tx, _turn: turn })
}

/// [`sqlite_write`] on a connection of the caller's own (to the file `pool` opens), for a writer that
/// must not wait for a pooled connection behind the application's use of the pool: the heartbeat.
/// Cancel-safe as well: sqlx's SQLite worker rolls back a `BEGIN` whose caller went away.
pub async fn sqlite_write_on<'c>(pool: &SqlitePool, conn: &'c mut SqliteConnection) -> Result<SqliteWrite<'c>> {
    let turn = turn_of(pool).lock_owned().await;
    let tx = conn.begin_with("BEGIN IMMEDIATE").await?;
    Ok(SqliteWrite { tx, _turn: turn })
}

/// The turn (a FIFO lock) of the database file `pool` opens; one per file per process.
fn turn_of(pool: &SqlitePool) -> Arc<Mutex<()>> {
    static TURNS: LazyLock<std::sync::Mutex<HashMap<PathBuf, Arc<Mutex<()>>>>> = LazyLock::new(Default::default);
    let file = pool.connect_options().get_filename().to_path_buf();
    // The map is only ever inserted into, so a panic elsewhere cannot leave it inconsistent.
    let mut turns = TURNS.lock().unwrap_or_else(PoisonError::into_inner);
    Arc::clone(turns.entry(file).or_default())
}

/// Renders a SQLite statement: `{s}` becomes the table prefix (the configured schema name), `{now}`
/// SQLite's clock in milliseconds since the Unix epoch (as the outbox tables store times), and
/// `{time:COLUMN}` such a stored time as RFC 3339 text (which sqlx decodes into `DateTime<Utc>`). For
/// crates that add statements over the outbox tables (`outbox-cluster`).
pub fn sqlite_statement(text: &str, schema: &str) -> std::sync::Arc<str> {
    crate::sqlite::render(text, schema)
}

/// A private in-memory SQLite database for tests (one connection: each has its own database).
#[cfg(test)]
pub(crate) async fn sqlite_memory() -> SqlitePool {
    #[allow(clippy::unwrap_used)]
    SqlitePoolOptions::new().max_connections(1).connect_with(sqlite_options("sqlite::memory:").unwrap()).await.unwrap()
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn pool(url: &str) -> SqlitePool {
        SqlitePoolOptions::new().max_connections(2).connect_with(sqlite_options(url).unwrap()).await.unwrap()
    }

    /// A database opened the documented ways is durable by default: every commit is synced
    /// (`synchronous = FULL`, 2), in WAL mode.
    #[tokio::test]
    async fn sqlite_databases_are_durable_by_default() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("durable.db").display());
        let Db::Sqlite(connected) = Db::connect(&url).await.unwrap() else { panic!("not SQLite") };
        for pool in [connected, pool(&url).await] {
            let synchronous: i64 = sqlx::query_scalar("PRAGMA synchronous").fetch_one(&pool).await.unwrap();
            let journal: String = sqlx::query_scalar("PRAGMA journal_mode").fetch_one(&pool).await.unwrap();
            assert_eq!((synchronous, journal.as_str()), (2, "wal"));
        }
    }

    /// Every pool on one file shares one turn, held from `sqlite_write` until commit or drop; another
    /// file has its own.
    #[tokio::test]
    async fn writes_to_one_file_take_turns_across_pools() {
        let dir = tempfile::tempdir().unwrap();
        let url = |name: &str| format!("sqlite://{}", dir.path().join(name).display());
        let (a, b, other) = (pool(&url("a.db")).await, pool(&url("a.db")).await, pool(&url("b.db")).await);
        assert!(Arc::ptr_eq(&turn_of(&a), &turn_of(&b)));
        assert!(!Arc::ptr_eq(&turn_of(&a), &turn_of(&other)));

        let write = sqlite_write(&a).await.unwrap();
        assert!(turn_of(&b).try_lock().is_err(), "b waits while a writes");
        assert!(turn_of(&other).try_lock().is_ok(), "another file is not held up");
        write.commit().await.unwrap();
        assert!(turn_of(&b).try_lock().is_ok(), "the turn is handed on at commit");

        let dropped = sqlite_write(&b).await.unwrap();
        drop(dropped);
        let mut again = sqlite_write(&a).await.unwrap();
        sqlx::query("SELECT 1").execute(&mut *again).await.unwrap();
        again.commit().await.unwrap();
    }
}
