//! The storage drivers: one module per database, each holding that database's statements and their
//! execution, behind the one interface below. This is the only module of the crate that names a
//! database. To add one: a `driver/<name>/` module, a variant of [`Db`], [`Conn`] and [`Tx`], and its
//! arm in `dispatch!`.
//!
//! The contract of every operation is written once, on its method here; the conformance suite
//! (`driver/tests.rs`) checks it against every backend.

#[cfg(not(any(feature = "postgres", feature = "sqlite", feature = "mysql")))]
compile_error!(
    "outbox-core needs a database driver: enable one or more of its features `postgres`, `sqlite` and \
     `mysql` (a crate that needs none, like outbox-nats, builds once the application enables one)"
);

#[cfg(feature = "mysql")]
pub mod mysql;
#[cfg(feature = "postgres")]
pub mod postgres;
#[cfg(feature = "sqlite")]
pub mod sqlite;
// The conformance suite compares the backends, so it needs all of them.
#[cfg(all(test, feature = "postgres", feature = "sqlite", feature = "mysql"))]
mod tests;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::{Duration, Instant};

use sqlx::{AssertSqlSafe, SqlSafeStr};
use tokio::sync::watch;
use uuid::Uuid;

use crate::assignment::{Epoch, InstanceId};
use crate::error::{Error, Result};
use crate::migrate::Migration;
use crate::notice::{Message, Wakeups};
use crate::stored::{FailedFilter, FailedRecord, Found, NewRow, Outcome, PartitionStats, Request, Requeue, Written};

/// Runs `$body` with `$pool` bound to the backend's pool (or connection) and `$s` to its statements.
macro_rules! dispatch {
    ($value:expr, $statements:expr, |$pool:ident, $s:ident| $body:expr) => {
        match $value {
            #[cfg(feature = "postgres")]
            Db::Postgres($pool) => {
                let $s = &$statements.postgres;
                $body
            }
            #[cfg(feature = "sqlite")]
            Db::Sqlite($pool) => {
                let $s = &$statements.sqlite;
                $body
            }
            #[cfg(feature = "mysql")]
            Db::MySql($pool) => {
                let $s = &$statements.mysql;
                $body
            }
        }
    };
}

/// What the driver of the backend `$db` came from says of it with its function `$judge` (each driver's
/// answers `None` for another backend's error); `false` if none knows it.
macro_rules! judged {
    ($db:expr, $judge:ident) => {{
        let db: &dyn sqlx::error::DatabaseError = $db;
        let answers = [
            #[cfg(feature = "sqlite")]
            sqlite::$judge(db),
            #[cfg(feature = "postgres")]
            postgres::$judge(db),
            #[cfg(feature = "mysql")]
            mysql::$judge(db),
        ];
        answers.into_iter().flatten().next().unwrap_or(false)
    }};
}

/// A connection pool of either backend. Cheap to clone (pools are shared handles).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum Db {
    /// PostgreSQL.
    #[cfg(feature = "postgres")]
    Postgres(sqlx::PgPool),
    /// SQLite (WAL mode).
    #[cfg(feature = "sqlite")]
    Sqlite(sqlx::SqlitePool),
    /// MySQL or MariaDB (InnoDB).
    #[cfg(feature = "mysql")]
    MySql(sqlx::MySqlPool),
}

/// How [`Db::connect_with`] sizes and waits for its pool. Its pools ping a connection before handing it
/// out only if it sat idle for [`PING_IF_IDLE_FOR`] (sqlx's own default pings on every acquire: a round
/// trip per statement). A pool of the application's, passed in as a [`Db`], keeps its own settings.
#[derive(Debug, Clone)]
pub struct ConnectOptions {
    /// Connections in the pool.
    pub max_connections: u32,
    /// How long to wait for a pooled connection (and, at connect, for the first one).
    pub acquire_timeout: Duration,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        Self { max_connections: 8, acquire_timeout: Duration::from_secs(30) }
    }
}

impl ConnectOptions {
    /// Checks the values; the error names the field. [`Db::connect_with`] and [`Db::new_pool`] call it.
    pub fn validate(&self) -> Result<()> {
        if self.max_connections == 0 {
            return Err(Error::Config("max_connections must be at least 1".into()));
        }
        if self.acquire_timeout.is_zero() || self.acquire_timeout > crate::config::MAX_DURATION {
            return Err(Error::Config(format!(
                "acquire_timeout must be within (0, 100 years], got {:?}",
                self.acquire_timeout
            )));
        }
        Ok(())
    }
}

impl Db {
    /// Connects by URL: `postgres://…` / `postgresql://…`, `mysql://…` / `mariadb://…`, or `sqlite://path` /
    /// `sqlite::memory:` (created if missing, with `driver::sqlite::options`), with
    /// [`ConnectOptions::default`].
    pub async fn connect(url: &str) -> Result<Db> {
        Db::connect_with(url, &ConnectOptions::default()).await
    }

    /// [`Db::connect`] with the pool's size and wait of `options`. A URL of another scheme, or of a
    /// backend this build leaves out, is refused with [`Error::UnsupportedUrl`].
    pub async fn connect_with(url: &str, options: &ConnectOptions) -> Result<Db> {
        options.validate()?;
        let scheme = url.split(':').next().unwrap_or_default();
        match scheme {
            #[cfg(feature = "postgres")]
            "postgres" | "postgresql" => postgres::connect(url, options).await.map(Db::Postgres),
            #[cfg(feature = "sqlite")]
            "sqlite" => sqlite::connect(url, options).await.map(Db::Sqlite),
            #[cfg(feature = "mysql")]
            "mysql" | "mariadb" => mysql::connect(url, options).await.map(Db::MySql),
            _ => Err(Error::UnsupportedUrl { scheme: scheme.to_string(), supported: SUPPORTED_URLS.join(", ") }),
        }
    }

    /// `"postgres"`, `"sqlite"` or `"mysql"`.
    pub fn backend(&self) -> &'static str {
        match self {
            #[cfg(feature = "postgres")]
            Db::Postgres(_) => "postgres",
            #[cfg(feature = "sqlite")]
            Db::Sqlite(_) => "sqlite",
            #[cfg(feature = "mysql")]
            Db::MySql(_) => "mysql",
        }
    }

    /// The name of the outbox table `table` of `schema` as statements write it: `"schema".table` on
    /// PostgreSQL (a schema, quoted), `schema_table` on SQLite and MySQL (a prefix, in the connection's
    /// database).
    pub fn table(&self, schema: &str, table: &str) -> String {
        match self {
            #[cfg(feature = "postgres")]
            Db::Postgres(_) => format!("{}.{table}", postgres::quoted(schema)),
            #[cfg(feature = "sqlite")]
            Db::Sqlite(_) => format!("{schema}_{table}"),
            #[cfg(feature = "mysql")]
            Db::MySql(_) => format!("{schema}_{table}"),
        }
    }

    /// Begins a transaction for business writes and [`Outbox::schedule`](crate::Outbox::schedule), on
    /// either backend; on SQLite with `BEGIN IMMEDIATE` (the write lock from the start, so a transaction
    /// that reads before it writes cannot meet a busy error at its first write), after this process's
    /// earlier transactions on the file ([`sqlite::write`]).
    pub async fn begin(&self) -> Result<Tx> {
        Ok(match self {
            #[cfg(feature = "postgres")]
            Db::Postgres(pool) => Tx::Postgres(begin_detached(pool, None).await?),
            #[cfg(feature = "sqlite")]
            Db::Sqlite(pool) => Tx::Sqlite(sqlite::write(pool).await?),
            #[cfg(feature = "mysql")]
            Db::MySql(pool) => Tx::MySql(begin_detached(pool, None).await?),
        })
    }

    /// A new pool to the same database with the same connection settings (on SQLite its journal and
    /// synchronous modes too), sized by `options`: for work that must not share connections.
    pub async fn new_pool(&self, options: &ConnectOptions) -> Result<Db> {
        options.validate()?;
        Ok(match self {
            #[cfg(feature = "postgres")]
            Db::Postgres(p) => {
                Db::Postgres(sized(options, true).connect_with(p.connect_options().as_ref().clone()).await?)
            }
            #[cfg(feature = "sqlite")]
            Db::Sqlite(p) => {
                Db::Sqlite(sized(options, false).connect_with(p.connect_options().as_ref().clone()).await?)
            }
            #[cfg(feature = "mysql")]
            Db::MySql(p) => Db::MySql(sized(options, true).connect_with(p.connect_options().as_ref().clone()).await?),
        })
    }

    /// Closes the pool.
    pub async fn close(&self) {
        match self {
            #[cfg(feature = "postgres")]
            Db::Postgres(pool) => pool.close().await,
            #[cfg(feature = "sqlite")]
            Db::Sqlite(pool) => pool.close().await,
            #[cfg(feature = "mysql")]
            Db::MySql(pool) => pool.close().await,
        }
    }

    /// Runs one statement of the application's (its own tables) with `args` bound to `$1`, `$2`, … on
    /// every backend (MySQL's `?` are written for it); returns the rows affected. Write it in SQL every
    /// backend of the application accepts.
    pub async fn execute(&self, sql: impl SqlSafeStr, args: &[Value<'_>]) -> Result<u64> {
        Ok(match self {
            #[cfg(feature = "postgres")]
            Db::Postgres(pool) => {
                sqlx::query_with(sql, arguments::<sqlx::Postgres>(args)?).execute(pool).await?.rows_affected()
            }
            #[cfg(feature = "sqlite")]
            Db::Sqlite(pool) => {
                sqlx::query_with(sql, arguments::<sqlx::Sqlite>(args)?).execute(pool).await?.rows_affected()
            }
            #[cfg(feature = "mysql")]
            Db::MySql(pool) => {
                let (sql, args) = mysql_positional(sql, args)?;
                sqlx::query_with(sql, arguments::<sqlx::MySql>(&args)?).execute(pool).await?.rows_affected()
            }
        })
    }

    /// Runs several statements without arguments (a script: the application's own schema).
    pub async fn execute_script(&self, sql: impl SqlSafeStr) -> Result<()> {
        match self {
            #[cfg(feature = "postgres")]
            Db::Postgres(pool) => {
                sqlx::raw_sql(sql).execute(pool).await?;
            }
            #[cfg(feature = "sqlite")]
            Db::Sqlite(pool) => {
                sqlx::raw_sql(sql).execute(pool).await?;
            }
            #[cfg(feature = "mysql")]
            Db::MySql(pool) => {
                sqlx::raw_sql(sql).execute(pool).await?;
            }
        }
        Ok(())
    }

    /// Runs one query of the application's with `args` bound; returns every row as a `T` (a tuple, or a
    /// struct deriving `sqlx::FromRow`).
    pub async fn fetch_all<T: DbRow>(&self, sql: impl SqlSafeStr, args: &[Value<'_>]) -> Result<Vec<T>> {
        Ok(match self {
            #[cfg(feature = "postgres")]
            Db::Postgres(pool) => sqlx::query_as_with(sql, arguments::<sqlx::Postgres>(args)?).fetch_all(pool).await?,
            #[cfg(feature = "sqlite")]
            Db::Sqlite(pool) => sqlx::query_as_with(sql, arguments::<sqlx::Sqlite>(args)?).fetch_all(pool).await?,
            #[cfg(feature = "mysql")]
            Db::MySql(pool) => {
                let (sql, args) = mysql_positional(sql, args)?;
                sqlx::query_as_with(sql, arguments::<sqlx::MySql>(&args)?).fetch_all(pool).await?
            }
        })
    }

    /// [`Db::fetch_all`] for a query of exactly one row.
    pub async fn fetch_one<T: DbRow>(&self, sql: impl SqlSafeStr, args: &[Value<'_>]) -> Result<T> {
        Ok(match self {
            #[cfg(feature = "postgres")]
            Db::Postgres(pool) => sqlx::query_as_with(sql, arguments::<sqlx::Postgres>(args)?).fetch_one(pool).await?,
            #[cfg(feature = "sqlite")]
            Db::Sqlite(pool) => sqlx::query_as_with(sql, arguments::<sqlx::Sqlite>(args)?).fetch_one(pool).await?,
            #[cfg(feature = "mysql")]
            Db::MySql(pool) => {
                let (sql, args) = mysql_positional(sql, args)?;
                sqlx::query_as_with(sql, arguments::<sqlx::MySql>(&args)?).fetch_one(pool).await?
            }
        })
    }

    /// Applies the missing migrations of `statements`' schema, once however many instances run it.
    pub(crate) async fn migrate(&self, statements: &Statements) -> Result<()> {
        dispatch!(self, statements, |pool, s| pool_of(pool, s).migrate().await)
    }

    /// The migrations this library applies on this backend, in order.
    pub fn migrations(&self) -> &'static [Migration] {
        match self {
            #[cfg(feature = "postgres")]
            Db::Postgres(_) => postgres::MIGRATIONS,
            #[cfg(feature = "sqlite")]
            Db::Sqlite(_) => sqlite::MIGRATIONS,
            #[cfg(feature = "mysql")]
            Db::MySql(_) => mysql::MIGRATIONS,
        }
    }

    /// Tells the listeners of other processes `message`, in the notices `wakeups` words (see
    /// `wake.rs`): `NOTIFY` on PostgreSQL; nothing where the database has no such channel (they find out
    /// by polling, or at their next round).
    pub(crate) async fn notify(&self, statements: &Statements, wakeups: &Wakeups, message: Message<'_>) -> Result<()> {
        match self {
            #[cfg(feature = "postgres")]
            Db::Postgres(pool) => {
                for (channel, notice) in wakeups.notices(message) {
                    pool_of(pool, &statements.postgres).notify(channel, &notice).await?;
                }
                Ok(())
            }
            #[allow(unreachable_patterns)] // in a build with PostgreSQL alone
            _ => {
                let _ = (statements, wakeups, message);
                Ok(())
            }
        }
    }

    /// A pool of its own for a processor's fetches, where the backend needs one (the processor closes it
    /// when it stops; `None`: fetch through this pool). On PostgreSQL, one connection (opened lazily,
    /// with this pool's settings) with JIT compilation off for its session, so the fetch is one
    /// statement: its planned cost rises with the table's statistics past `jit_above_cost`, and
    /// compiling it cost many times the query; its statements end on the server after `query_timeout`.
    #[cfg_attr(not(feature = "postgres"), allow(unused_variables))]
    pub(crate) fn fetch_pool(&self, query_timeout: Duration) -> Option<Db> {
        match self {
            #[cfg(feature = "postgres")]
            Db::Postgres(pool) => Some(Db::Postgres(postgres::fetch_pool(pool, query_timeout))),
            #[allow(unreachable_patterns)] // in a build with PostgreSQL alone
            _ => None,
        }
    }

    /// Whether [`Db::listen`] can hear other processes' notices here (PostgreSQL).
    pub(crate) fn can_listen(&self) -> bool {
        #[cfg(feature = "postgres")]
        return matches!(self, Db::Postgres(_));
        #[cfg(not(feature = "postgres"))]
        false
    }

    /// Hears other processes' wake-ups and nudges on a connection of its own and passes them to
    /// `wakeups`, until the connection is lost (`Ok`) or cannot be made; `listening` is true while it
    /// listens. Right after it starts listening it tells `wakeups` that earlier notices were missed.
    /// Every `check.0` the connection must answer a statement within `check.1`, or it is given up
    /// ([`Error::QueryTimeout`]). Returns at once where the database cannot listen.
    pub(crate) async fn listen(
        &self,
        statements: &Statements,
        wakeups: &Wakeups,
        listening: &watch::Sender<bool>,
        check: (Duration, Duration),
    ) -> Result<()> {
        match self {
            #[cfg(feature = "postgres")]
            Db::Postgres(pool) => pool_of(pool, &statements.postgres).listen(wakeups, listening, check).await,
            #[allow(unreachable_patterns)] // in a build with PostgreSQL alone
            _ => {
                let _ = (statements, wakeups, listening, check);
                Ok(())
            }
        }
    }

    /// Fetches what `request` asks for, in one snapshot: per key not excluded, of the requested
    /// partitions in the order given (within a partition starting after its start key, then wrapping
    /// around), the head (with stop-on-first-failure the key's lowest sequence, passed over unless due;
    /// without, its lowest due one) and up to `followers` records after it, gapless, as long as the
    /// run's payloads stay within `budget` (the head always comes); at most `limit` heads. Only of
    /// partitions whose row still shows `request.instance` as owner at the requested epoch, and only
    /// while that instance's lease is live by database time. MySQL's walk also stops after a bounded
    /// number of records (`mysql::walk_records`), returning the key it stopped at marked (`stop`).
    /// `Found::last_served` names each partition's last head in walk order (or the key a cut walk
    /// stopped at), `Found::cut_in` the partition where the walk was cut, if it was. The processor runs
    /// it on its [`Db::fetch_pool`].
    pub(crate) async fn fetch(&self, statements: &Statements, request: &Request) -> Result<Found> {
        dispatch!(self, statements, |pool, s| pool_of(pool, s).fetch(request).await)
    }

    /// Writes a batch of outcomes in one transaction, each only if its partition's row still shows its
    /// instance at its epoch (locked against change until commit): a completion deletes the record
    /// (keeping a copy in `completed` unless completion is `delete`); a retry sets its attempts, error
    /// and next attempt (database time + delay); FAILED sets attempts, error and the failure time. A
    /// failure is written only to a pending record not requeued since it was fetched. Says which
    /// outcomes were written and which (partition, instance, epoch) held.
    pub(crate) async fn complete(&self, statements: &Statements, outcomes: &[Outcome]) -> Result<Written> {
        dispatch!(self, statements, |pool, s| pool_of(pool, s).complete(outcomes).await)
    }

    /// FAILED records matching `filter`, in (partition, key, seq) order.
    pub(crate) async fn failed(&self, statements: &Statements, filter: &FailedFilter) -> Result<Vec<FailedRecord>> {
        dispatch!(self, statements, |pool, s| pool_of(pool, s).failed(filter).await)
    }

    /// Requeues FAILED records (one id, all of a key, or all) with a fresh retry budget, counting the
    /// requeue; returns how many.
    ///
    /// All of them go [`REQUEUE_AT_ONCE`] at a time in (partition, key, seq) order, each batch a
    /// transaction of its own, after the last one's place: after an outage that failed millions, one
    /// statement over all of them ran for minutes, and a caller that gave up (an HTTP request timed out
    /// by a proxy) lost it all, rolled back. Each record is requeued once: one that failed again
    /// meanwhile waits for the next call.
    pub(crate) async fn requeue(&self, statements: &Statements, which: Requeue<'_>) -> Result<u64> {
        let (id, key) = match which {
            Requeue::One(id) => (Some(id), None),
            Requeue::Key(key) => (None, Some(key)),
            Requeue::All => return self.requeue_all(statements).await,
        };
        dispatch!(self, statements, |pool, s| pool_of(pool, s).requeue(id, key).await)
    }

    async fn requeue_all(&self, statements: &Statements) -> Result<u64> {
        let (mut after, mut requeued) = ((-1_i16, String::new(), 0_i64), 0_u64);
        loop {
            let batch: RequeuedBatch =
                dispatch!(self, statements, |pool, s| pool_of(pool, s).requeue_batch(&after, REQUEUE_AT_ONCE).await)?;
            requeued += batch.requeued;
            match batch.last {
                Some(last) if batch.read == REQUEUE_AT_ONCE as u64 => after = last,
                _ => return Ok(requeued),
            }
        }
    }

    /// Removes a FAILED record, kept in `completed` as `skipped`; `false` if there is no such record.
    pub(crate) async fn skip(&self, statements: &Statements, id: Uuid) -> Result<bool> {
        dispatch!(self, statements, |pool, s| pool_of(pool, s).skip(id).await)
    }

    /// Checks that workers can run on this pool's connections, within `limit`: on MySQL, that they have
    /// `autocommit` on and read only committed data ([`Error::UnsuitableSession`] if not). The processor
    /// checks it when it starts, and a cluster node on the connection it registers on.
    #[cfg_attr(not(feature = "mysql"), allow(unused_variables))]
    pub async fn check_worker_session(&self, limit: Duration) -> Result<()> {
        match self {
            #[cfg(feature = "mysql")]
            Db::MySql(pool) => {
                answered_within(limit, "session check", finishing(pool, async |conn| mysql::check_session(conn).await))
                    .await
            }
            #[allow(unreachable_patterns)] // in a build with MySQL alone
            _ => Ok(()),
        }
    }

    /// Pending and FAILED counts per partition holding records, with the oldest pending record's age.
    pub(crate) async fn stats(&self, statements: &Statements) -> Result<Vec<PartitionStats>> {
        dispatch!(self, statements, |pool, s| pool_of(pool, s).stats().await)
    }

    /// Deletes at most `limit` completed records older than `retention` (database time).
    pub(crate) async fn purge(&self, statements: &Statements, retention: Duration, limit: usize) -> Result<u64> {
        dispatch!(self, statements, |pool, s| pool_of(pool, s).purge(retention, limit).await)
    }

    /// Deletes at most `limit` inbox rows accepted more than `retention` ago (database time).
    pub(crate) async fn purge_inbox(&self, statements: &Statements, retention: Duration, limit: usize) -> Result<u64> {
        dispatch!(self, statements, |pool, s| pool_of(pool, s).purge_inbox(retention, limit).await)
    }

    /// Reads at most `limit` per-key lock rows after key `after`, in key order, and deletes those of keys
    /// with no record left, skipping rows a writer holds (a backend that keeps no such rows reads none).
    pub(crate) async fn prune_keys(&self, statements: &Statements, limit: usize, after: &str) -> Result<KeysPruned> {
        dispatch!(self, statements, |pool, s| pool_of(pool, s).prune_keys(limit, after).await)
    }
}

/// FAILED records requeued per transaction by [`Db::requeue`] of them all.
pub(crate) const REQUEUE_AT_ONCE: usize = 1000;

/// What one batch of [`Db::requeue`] of all FAILED records did.
#[derive(Debug)]
pub(crate) struct RequeuedBatch {
    /// FAILED records read, in (partition, key, seq) order.
    pub(crate) read: u64,
    /// Of them, requeued (one resolved meanwhile is not).
    pub(crate) requeued: u64,
    /// The place of the last one read: where the next batch goes on.
    pub(crate) last: Option<(i16, String, i64)>,
}

/// What one batch of [`Db::prune_keys`] did.
#[derive(Debug, Default)]
pub(crate) struct KeysPruned {
    /// Key rows read.
    pub(crate) read: u64,
    /// Of them, deleted.
    pub(crate) deleted: u64,
    /// The last key read: where the next batch goes on.
    pub(crate) last: Option<String>,
}

/// How a connection error names a database server: backend, database (when the URL names one) and
/// address, never the user or password.
#[cfg(any(feature = "postgres", feature = "mysql"))]
fn server(backend: &str, database: Option<&str>, host: &str, port: u16) -> String {
    match database {
        Some(name) => format!("{backend} database {name:?} at {host}:{port}"),
        None => format!("{backend} at {host}:{port}"),
    }
}

/// A pooled connection idle this long is pinged before it is handed out; one used more recently is not.
/// sqlx pings on every acquire by default: a round trip per statement, which doubles a statement's
/// time when the database is a network away. A connection that dies anyway fails its statement with a
/// transient error, which the library retries.
pub const PING_IF_IDLE_FOR: Duration = Duration::from_secs(1);

/// A pool of `options`' size and wait, for any backend, pinging only connections idle for
/// [`PING_IF_IDLE_FOR`]; a pool of a server that can fail over also closes the connections opened
/// before a read-only answer ([`retire_before`]). Not SQLite's: its file has no other server to reach,
/// and an in-memory database lives only as long as its connections.
fn sized<DB: sqlx::Database>(options: &ConnectOptions, fails_over: bool) -> sqlx::pool::PoolOptions<DB> {
    use futures::FutureExt;
    use sqlx::Connection;
    sqlx::pool::PoolOptions::new()
        .max_connections(options.max_connections)
        .acquire_timeout(options.acquire_timeout)
        .test_before_acquire(false)
        .before_acquire(move |conn: &mut DB::Connection, meta| {
            async move {
                if fails_over && opened_before_read_only(&meta) {
                    return Ok(false);
                }
                if meta.idle_for >= PING_IF_IDLE_FOR {
                    conn.ping().await?;
                }
                Ok(true)
            }
            .boxed()
        })
}

/// `work`, or [`Error::QueryTimeout`] naming it if it has not finished within `limit`. Run its
/// statements with [`finishing`], so that a connection it leaves unanswered is closed.
pub async fn answered_within<T, E: From<Error>>(
    limit: Duration,
    work: &'static str,
    future: impl Future<Output = std::result::Result<T, E>>,
) -> std::result::Result<T, E> {
    tokio::time::timeout(limit, future).await.unwrap_or(Err(Error::QueryTimeout { work, after: limit }.into()))
}

/// Runs `work` on a connection of `pool`'s, which goes back to the pool once `work` returns (with an
/// error too); dropped before that (a time limit, a cancelled task), the connection is closed instead.
/// sqlx pings a connection handed back to its pool before reusing it (sqlx-core `pool/connection.rs`,
/// `return_to_pool`), and on a connection that stopped answering that ping waits forever, holding a
/// place in the pool: a one-connection pool, such as the processor's fetches', would never answer
/// again. So a cut-short connection is closed without a word, and a finished one's ping is given up
/// after [`RELEASE_PING_LIMIT`], closing it. A transaction begun here and cut short ends with its
/// connection, whatever stage its `BEGIN` reached.
pub async fn finishing<DB: sqlx::Database, T, E: From<sqlx::Error>>(
    pool: &sqlx::Pool<DB>,
    work: impl AsyncFnOnce(&mut DB::Connection) -> std::result::Result<T, E>,
) -> std::result::Result<T, E> {
    /// Closes the connection it still holds when dropped.
    struct Unfinished<DB: sqlx::Database>(Option<sqlx::pool::PoolConnection<DB>>);
    impl<DB: sqlx::Database> Drop for Unfinished<DB> {
        fn drop(&mut self) {
            if let Some(conn) = self.0.take() {
                drop(conn.detach());
            }
        }
    }
    let mut conn = Unfinished(Some(pool.acquire().await?));
    let Some(held) = conn.0.as_deref_mut() else { unreachable!("held until the work returns") };
    let done = work(held).await;
    if let Some(mut finished) = conn.0.take() {
        // Given up, the return's future drops the connection, which closes it and frees its place.
        tokio::spawn(tokio::time::timeout(RELEASE_PING_LIMIT, finished.return_to_pool()));
    }
    done
}

/// How long a connection handed back to its pool may take to answer sqlx's ping before it is closed
/// (see [`finishing`]): a ping is one round trip, under a millisecond on a healthy connection.
pub const RELEASE_PING_LIMIT: Duration = Duration::from_secs(5);

/// Begins a transaction (with `statement` in place of the backend's plain `BEGIN`) so that a caller
/// dropped while the `BEGIN` is in flight cannot leave the pooled connection inside a transaction nobody
/// ends: sqlx 0.9 arms its rollback only once the answer is read (transact-rs/sqlx#4393), and the
/// connection's next borrower would write, uncommitted, inside it. Such a begin is finished on a task of
/// its own, whose transaction then rolls back as any dropped one does; the others run on the caller's
/// task (a task for every begin slowed producers measurably).
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) async fn begin_detached<DB: sqlx::Database>(
    pool: &sqlx::Pool<DB>,
    statement: Option<&'static str>,
) -> sqlx::Result<sqlx::Transaction<'static, DB>> {
    let pool = pool.clone();
    FinishedIfDropped(Some(Box::pin(async move {
        match statement {
            Some(statement) => pool.begin_with(statement).await,
            None => pool.begin().await,
        }
    })))
    .await
}

/// A future that, dropped before it finished, is finished on a task of its own, its output dropped there.
#[cfg(any(feature = "postgres", feature = "mysql"))]
struct FinishedIfDropped<F: Future<Output: Send + 'static> + Send + 'static>(Option<std::pin::Pin<Box<F>>>);

#[cfg(any(feature = "postgres", feature = "mysql"))]
impl<F: Future<Output: Send + 'static> + Send + 'static> Future for FinishedIfDropped<F> {
    type Output = F::Output;

    fn poll(mut self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<F::Output> {
        let Some(unfinished) = self.0.as_mut() else { return std::task::Poll::Pending };
        let output = std::task::ready!(unfinished.as_mut().poll(cx));
        self.0 = None;
        std::task::Poll::Ready(output)
    }
}

#[cfg(any(feature = "postgres", feature = "mysql"))]
impl<F: Future<Output: Send + 'static> + Send + 'static> Drop for FinishedIfDropped<F> {
    fn drop(&mut self) {
        // Outside a runtime (one shutting down) it is dropped unfinished, as sqlx's own begin would be.
        if let (Some(unfinished), Ok(runtime)) = (self.0.take(), tokio::runtime::Handle::try_current()) {
            runtime.spawn(async move { drop(unfinished.await) });
        }
    }
}

/// The application's values as a backend's arguments.
fn arguments<DB: sqlx::Database>(values: &[Value<'_>]) -> Result<DB::Arguments>
where
    Option<String>: for<'t> sqlx::Encode<'t, DB> + sqlx::Type<DB>,
    bool: for<'t> sqlx::Encode<'t, DB> + sqlx::Type<DB>,
    i64: for<'t> sqlx::Encode<'t, DB> + sqlx::Type<DB>,
    f64: for<'t> sqlx::Encode<'t, DB> + sqlx::Type<DB>,
    String: for<'t> sqlx::Encode<'t, DB> + sqlx::Type<DB>,
    Vec<u8>: for<'t> sqlx::Encode<'t, DB> + sqlx::Type<DB>,
    Uuid: for<'t> sqlx::Encode<'t, DB> + sqlx::Type<DB>,
{
    use sqlx::Arguments;
    let mut args = DB::Arguments::default();
    for value in values {
        match *value {
            Value::Null => args.add(None::<String>),
            Value::Bool(v) => args.add(v),
            Value::Int(v) => args.add(v),
            Value::Float(v) => args.add(v),
            Value::Text(v) => args.add(v.to_string()),
            Value::Bytes(v) => args.add(v.to_vec()),
            Value::Uuid(v) => args.add(v),
        }
        .map_err(sqlx::Error::Encode)?;
    }
    Ok(args)
}

/// A pool of a backend with the statements built for it: what each driver's operations run on.
fn pool_of<'a, P, S>(pool: &'a P, statements: &'a S) -> Driver<'a, P, S> {
    Driver { pool, statements }
}

/// A backend's pool and statements, on which each driver implements the operations of [`Db`].
pub(crate) struct Driver<'a, P, S> {
    pub(crate) pool: &'a P,
    pub(crate) statements: &'a S,
}

/// The URL schemes this build connects to.
const SUPPORTED_URLS: &[&str] = &[
    #[cfg(feature = "postgres")]
    "postgres://…",
    #[cfg(feature = "postgres")]
    "postgresql://…",
    #[cfg(feature = "sqlite")]
    "sqlite://…",
    #[cfg(feature = "mysql")]
    "mysql://…",
    #[cfg(feature = "mysql")]
    "mariadb://…",
];

/// An application statement written with `$1`, `$2`, … as MySQL takes it, with its arguments in the
/// order of its `?`.
#[cfg(feature = "mysql")]
fn mysql_positional<'a>(sql: impl SqlSafeStr, args: &[Value<'a>]) -> Result<(AssertSqlSafe<String>, Vec<Value<'a>>)> {
    let (text, order) = mysql::positional(sql.into_sql_str().as_str())?;
    let args = order
        .into_iter()
        .map(|i| {
            args.get(i).copied().ok_or_else(|| {
                Error::Database(sqlx::Error::Protocol(format!(
                    "statement uses ${} but {} were bound",
                    i + 1,
                    args.len()
                )))
            })
        })
        .collect::<Result<_>>()?;
    Ok((AssertSqlSafe(text), args))
}

/// The caller's connection (inside its transaction) for [`Outbox::schedule`](crate::Outbox::schedule).
/// Built from `&mut *tx` or `&mut tx`; there is deliberately no conversion from a pool.
#[derive(Debug)]
#[non_exhaustive]
pub enum Conn<'c> {
    /// A PostgreSQL connection.
    #[cfg(feature = "postgres")]
    Postgres(&'c mut sqlx::PgConnection),
    /// A SQLite connection.
    #[cfg(feature = "sqlite")]
    Sqlite(&'c mut sqlx::SqliteConnection),
    /// A MySQL connection.
    #[cfg(feature = "mysql")]
    MySql(&'c mut sqlx::MySqlConnection),
}

impl Conn<'_> {
    /// Inserts `rows` in the caller's transaction, numbering each key's records after its earlier ones
    /// in commit order (writers of one key wait for each other until commit). All or nothing: the rows
    /// are inserted together or not at all (a number drawn for a row that was not inserted is skipped;
    /// a key's numbers need only grow). A future dropped before it returns leaves no transaction open
    /// that the caller had not opened (except on MySQL, on a connection outside any transaction, dropped
    /// while the `BEGIN` of the transaction it opens there is unanswered: sqlx arms the rollback only
    /// once it is answered, transact-rs/sqlx#4393, and a borrowed connection cannot be closed instead;
    /// schedule inside a transaction where a time limit may cut it short); whether its rows are in the
    /// caller's transaction is then unknown, so the caller rolls that back. Returns each row's (id,
    /// sequence number).
    pub(crate) async fn schedule(self, statements: &Statements, rows: &[NewRow<'_>]) -> Result<Vec<(Uuid, i64)>> {
        match self {
            #[cfg(feature = "postgres")]
            Conn::Postgres(conn) => postgres::schedule(conn, &statements.postgres, rows).await,
            #[cfg(feature = "sqlite")]
            Conn::Sqlite(conn) => sqlite::schedule(conn, &statements.sqlite, rows).await,
            #[cfg(feature = "mysql")]
            Conn::MySql(conn) => mysql::schedule(conn, &statements.mysql, rows).await,
        }
    }

    /// Inserts the inbox row of (`source`, `message_id`) unless it exists; whether it did not. A row
    /// another transaction inserted and has not yet committed makes this wait for it: the answer is
    /// false if it commits, true (this one inserts) if it rolls back.
    pub(crate) async fn accept(mut self, statements: &Statements, source: &str, message_id: &str) -> Result<bool> {
        self.in_a_transaction("Inbox::accept").await?;
        match self {
            #[cfg(feature = "postgres")]
            Conn::Postgres(conn) => postgres::accept(conn, &statements.postgres, source, message_id).await,
            #[cfg(feature = "sqlite")]
            Conn::Sqlite(conn) => sqlite::accept(conn, &statements.sqlite, source, message_id).await,
            #[cfg(feature = "mysql")]
            Conn::MySql(conn) => mysql::accept(conn, &statements.mysql, source, message_id).await,
        }
    }

    /// Makes `seq` the last applied event of (`source`, `key`) if it is later than the last one (or
    /// the first); whether it did. Concurrent callers for one key wait for each other, as for `accept`.
    pub(crate) async fn accept_in_order(
        mut self,
        statements: &Statements,
        source: &str,
        key: &str,
        seq: i64,
    ) -> Result<bool> {
        self.in_a_transaction("Inbox::accept_in_order").await?;
        match self {
            #[cfg(feature = "postgres")]
            Conn::Postgres(conn) => postgres::accept_in_order(conn, &statements.postgres, source, key, seq).await,
            #[cfg(feature = "sqlite")]
            Conn::Sqlite(conn) => sqlite::accept_in_order(conn, &statements.sqlite, source, key, seq).await,
            #[cfg(feature = "mysql")]
            Conn::MySql(conn) => mysql::accept_in_order(conn, &statements.mysql, source, key, seq).await,
        }
    }

    /// Refuses `call` ([`Error::NotInTransaction`]) on a connection outside every transaction: sqlx's
    /// own, or one the application began with its own SQL, which only the server knows of.
    async fn in_a_transaction(&mut self, call: &'static str) -> Result<()> {
        let inside = match self {
            #[cfg(feature = "postgres")]
            Conn::Postgres(conn) => postgres::in_a_transaction(conn).await?,
            #[cfg(feature = "sqlite")]
            Conn::Sqlite(conn) => sqlite::in_a_transaction(conn).await?,
            #[cfg(feature = "mysql")]
            Conn::MySql(conn) => mysql::in_a_transaction(conn).await?,
        };
        if inside { Ok(()) } else { Err(Error::NotInTransaction { call }) }
    }
}

#[cfg(feature = "postgres")]
impl<'c> From<&'c mut sqlx::PgConnection> for Conn<'c> {
    fn from(conn: &'c mut sqlx::PgConnection) -> Self {
        Conn::Postgres(conn)
    }
}

#[cfg(feature = "sqlite")]
impl<'c> From<&'c mut sqlx::SqliteConnection> for Conn<'c> {
    fn from(conn: &'c mut sqlx::SqliteConnection) -> Self {
        Conn::Sqlite(conn)
    }
}

#[cfg(feature = "mysql")]
impl<'c> From<&'c mut sqlx::MySqlConnection> for Conn<'c> {
    fn from(conn: &'c mut sqlx::MySqlConnection) -> Self {
        Conn::MySql(conn)
    }
}

#[cfg(feature = "mysql")]
impl<'c, 't> From<&'c mut sqlx::Transaction<'t, sqlx::MySql>> for Conn<'c> {
    fn from(tx: &'c mut sqlx::Transaction<'t, sqlx::MySql>) -> Self {
        Conn::MySql(tx)
    }
}

#[cfg(feature = "postgres")]
impl<'c, 't> From<&'c mut sqlx::Transaction<'t, sqlx::Postgres>> for Conn<'c> {
    fn from(tx: &'c mut sqlx::Transaction<'t, sqlx::Postgres>) -> Self {
        Conn::Postgres(tx)
    }
}

#[cfg(feature = "sqlite")]
impl<'c, 't> From<&'c mut sqlx::Transaction<'t, sqlx::Sqlite>> for Conn<'c> {
    fn from(tx: &'c mut sqlx::Transaction<'t, sqlx::Sqlite>) -> Self {
        Conn::Sqlite(tx)
    }
}

/// A transaction of either backend ([`Db::begin`]). `&mut tx` is a [`Conn`] for `schedule`; the
/// application's own statements run in it with [`Tx::execute`] and [`Tx::fetch_all`].
#[derive(Debug)]
#[non_exhaustive]
pub enum Tx {
    /// A PostgreSQL transaction.
    #[cfg(feature = "postgres")]
    Postgres(sqlx::Transaction<'static, sqlx::Postgres>),
    /// A SQLite transaction, holding this process's turn at the file ([`sqlite::Write`]).
    #[cfg(feature = "sqlite")]
    Sqlite(sqlite::Write<'static>),
    /// A MySQL transaction.
    #[cfg(feature = "mysql")]
    MySql(sqlx::Transaction<'static, sqlx::MySql>),
}

impl Tx {
    /// Commits.
    pub async fn commit(self) -> Result<()> {
        match self {
            #[cfg(feature = "postgres")]
            Tx::Postgres(tx) => tx.commit().await?,
            #[cfg(feature = "sqlite")]
            Tx::Sqlite(tx) => tx.commit().await?,
            #[cfg(feature = "mysql")]
            Tx::MySql(tx) => tx.commit().await?,
        }
        Ok(())
    }

    /// Rolls back.
    pub async fn rollback(self) -> Result<()> {
        match self {
            #[cfg(feature = "postgres")]
            Tx::Postgres(tx) => tx.rollback().await?,
            #[cfg(feature = "sqlite")]
            Tx::Sqlite(tx) => tx.rollback().await?,
            #[cfg(feature = "mysql")]
            Tx::MySql(tx) => tx.rollback().await?,
        }
        Ok(())
    }

    /// [`Db::execute`] inside this transaction.
    pub async fn execute(&mut self, sql: impl SqlSafeStr, args: &[Value<'_>]) -> Result<u64> {
        Ok(match self {
            #[cfg(feature = "postgres")]
            Tx::Postgres(tx) => {
                sqlx::query_with(sql, arguments::<sqlx::Postgres>(args)?).execute(&mut **tx).await?.rows_affected()
            }
            #[cfg(feature = "sqlite")]
            Tx::Sqlite(tx) => {
                sqlx::query_with(sql, arguments::<sqlx::Sqlite>(args)?).execute(&mut **tx).await?.rows_affected()
            }
            #[cfg(feature = "mysql")]
            Tx::MySql(tx) => {
                let (sql, args) = mysql_positional(sql, args)?;
                sqlx::query_with(sql, arguments::<sqlx::MySql>(&args)?).execute(&mut **tx).await?.rows_affected()
            }
        })
    }

    /// [`Db::fetch_all`] inside this transaction.
    pub async fn fetch_all<T: DbRow>(&mut self, sql: impl SqlSafeStr, args: &[Value<'_>]) -> Result<Vec<T>> {
        Ok(match self {
            #[cfg(feature = "postgres")]
            Tx::Postgres(tx) => {
                sqlx::query_as_with(sql, arguments::<sqlx::Postgres>(args)?).fetch_all(&mut **tx).await?
            }
            #[cfg(feature = "sqlite")]
            Tx::Sqlite(tx) => sqlx::query_as_with(sql, arguments::<sqlx::Sqlite>(args)?).fetch_all(&mut **tx).await?,
            #[cfg(feature = "mysql")]
            Tx::MySql(tx) => {
                let (sql, args) = mysql_positional(sql, args)?;
                sqlx::query_as_with(sql, arguments::<sqlx::MySql>(&args)?).fetch_all(&mut **tx).await?
            }
        })
    }
}

impl<'c> From<&'c mut Tx> for Conn<'c> {
    fn from(tx: &'c mut Tx) -> Self {
        match tx {
            #[cfg(feature = "postgres")]
            Tx::Postgres(tx) => Conn::Postgres(tx),
            #[cfg(feature = "sqlite")]
            Tx::Sqlite(tx) => Conn::Sqlite(tx),
            #[cfg(feature = "mysql")]
            Tx::MySql(tx) => Conn::MySql(tx),
        }
    }
}

#[cfg(feature = "postgres")]
impl From<sqlx::PgPool> for Db {
    fn from(pool: sqlx::PgPool) -> Self {
        Db::Postgres(pool)
    }
}

#[cfg(feature = "postgres")]
impl From<&sqlx::PgPool> for Db {
    fn from(pool: &sqlx::PgPool) -> Self {
        Db::Postgres(pool.clone())
    }
}

#[cfg(feature = "sqlite")]
impl From<sqlx::SqlitePool> for Db {
    fn from(pool: sqlx::SqlitePool) -> Self {
        Db::Sqlite(pool)
    }
}

#[cfg(feature = "sqlite")]
impl From<&sqlx::SqlitePool> for Db {
    fn from(pool: &sqlx::SqlitePool) -> Self {
        Db::Sqlite(pool.clone())
    }
}

#[cfg(feature = "mysql")]
impl From<sqlx::MySqlPool> for Db {
    fn from(pool: sqlx::MySqlPool) -> Self {
        Db::MySql(pool)
    }
}

#[cfg(feature = "mysql")]
impl From<&sqlx::MySqlPool> for Db {
    fn from(pool: &sqlx::MySqlPool) -> Self {
        Db::MySql(pool.clone())
    }
}

impl From<&Db> for Db {
    fn from(db: &Db) -> Self {
        db.clone()
    }
}

/// A value bound to an application statement run on either backend ([`Db::execute`], [`Tx::execute`],
/// [`Db::fetch_all`]).
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub enum Value<'a> {
    /// SQL `NULL` (of a text column).
    Null,
    /// A boolean.
    Bool(bool),
    /// An integer (any width: the database converts).
    Int(i64),
    /// A floating-point number.
    Float(f64),
    /// Text.
    Text(&'a str),
    /// Bytes.
    Bytes(&'a [u8]),
    /// A UUID (PostgreSQL `uuid`, SQLite a 16-byte blob).
    Uuid(Uuid),
}

impl From<bool> for Value<'_> {
    fn from(v: bool) -> Self {
        Value::Bool(v)
    }
}

impl From<i64> for Value<'_> {
    fn from(v: i64) -> Self {
        Value::Int(v)
    }
}

impl From<i32> for Value<'_> {
    fn from(v: i32) -> Self {
        Value::Int(v.into())
    }
}

impl From<i16> for Value<'_> {
    fn from(v: i16) -> Self {
        Value::Int(v.into())
    }
}

impl From<u8> for Value<'_> {
    fn from(v: u8) -> Self {
        Value::Int(v.into())
    }
}

impl From<f64> for Value<'_> {
    fn from(v: f64) -> Self {
        Value::Float(v)
    }
}

impl<'a> From<&'a str> for Value<'a> {
    fn from(v: &'a str) -> Self {
        Value::Text(v)
    }
}

impl<'a> From<&'a String> for Value<'a> {
    fn from(v: &'a String) -> Self {
        Value::Text(v)
    }
}

impl<'a> From<&'a [u8]> for Value<'a> {
    fn from(v: &'a [u8]) -> Self {
        Value::Bytes(v)
    }
}

impl<'a> From<&'a Vec<u8>> for Value<'a> {
    fn from(v: &'a Vec<u8>) -> Self {
        Value::Bytes(v)
    }
}

impl From<Uuid> for Value<'_> {
    fn from(v: Uuid) -> Self {
        Value::Uuid(v)
    }
}

impl From<InstanceId> for Value<'_> {
    fn from(v: InstanceId) -> Self {
        Value::Uuid(v.0)
    }
}

impl From<Epoch> for Value<'_> {
    fn from(v: Epoch) -> Self {
        Value::Int(v.0)
    }
}

impl<'a, T: Into<Value<'a>>> From<Option<T>> for Value<'a> {
    fn from(v: Option<T>) -> Self {
        v.map_or(Value::Null, Into::into)
    }
}

/// A row type every backend of this build decodes: a tuple, or a struct deriving `sqlx::FromRow`, of
/// types every database knows.
pub trait DbRow: rows::FromPg + rows::FromSqlite + rows::FromMySql + Send + Unpin {}
impl<T> DbRow for T where T: rows::FromPg + rows::FromSqlite + rows::FromMySql + Send + Unpin {}

/// Per backend, "decodes from its rows", or nothing when the backend is not built.
mod rows {
    /// Decodes from a PostgreSQL row.
    #[cfg(feature = "postgres")]
    pub trait FromPg: for<'r> sqlx::FromRow<'r, sqlx::postgres::PgRow> {}
    #[cfg(feature = "postgres")]
    impl<T> FromPg for T where T: for<'r> sqlx::FromRow<'r, sqlx::postgres::PgRow> {}
    /// PostgreSQL is not built.
    #[cfg(not(feature = "postgres"))]
    pub trait FromPg {}
    #[cfg(not(feature = "postgres"))]
    impl<T> FromPg for T {}

    /// Decodes from a SQLite row.
    #[cfg(feature = "sqlite")]
    pub trait FromSqlite: for<'r> sqlx::FromRow<'r, sqlx::sqlite::SqliteRow> {}
    #[cfg(feature = "sqlite")]
    impl<T> FromSqlite for T where T: for<'r> sqlx::FromRow<'r, sqlx::sqlite::SqliteRow> {}
    /// SQLite is not built.
    #[cfg(not(feature = "sqlite"))]
    pub trait FromSqlite {}
    #[cfg(not(feature = "sqlite"))]
    impl<T> FromSqlite for T {}

    /// Decodes from a MySQL row.
    #[cfg(feature = "mysql")]
    pub trait FromMySql: for<'r> sqlx::FromRow<'r, sqlx::mysql::MySqlRow> {}
    #[cfg(feature = "mysql")]
    impl<T> FromMySql for T where T: for<'r> sqlx::FromRow<'r, sqlx::mysql::MySqlRow> {}
    /// MySQL is not built.
    #[cfg(not(feature = "mysql"))]
    pub trait FromMySql {}
    #[cfg(not(feature = "mysql"))]
    impl<T> FromMySql for T {}
}

/// Every backend's statements, built once for one schema and mode by [`Outbox::new`](crate::Outbox::new).
#[derive(Debug)]
pub(crate) struct Statements {
    #[cfg(feature = "postgres")]
    pub(crate) postgres: postgres::PgStatements,
    #[cfg(feature = "sqlite")]
    pub(crate) sqlite: sqlite::SqliteStatements,
    #[cfg(feature = "mysql")]
    pub(crate) mysql: mysql::MySqlStatements,
}

impl Statements {
    /// `schema` must already be validated as an identifier.
    pub(crate) fn new(
        schema: &str,
        stop_on_first_failure: bool,
        keep_completed: bool,
        query_timeout: Duration,
    ) -> Self {
        let _ = query_timeout; // SQLite's statements do not carry it (a build with SQLite alone)
        Self {
            #[cfg(feature = "postgres")]
            postgres: postgres::PgStatements::new(schema, stop_on_first_failure, keep_completed, query_timeout),
            #[cfg(feature = "sqlite")]
            sqlite: sqlite::SqliteStatements::new(schema, stop_on_first_failure, keep_completed),
            #[cfg(feature = "mysql")]
            mysql: mysql::MySqlStatements::new(schema, stop_on_first_failure, keep_completed, query_timeout),
        }
    }
}

/// A prebuilt statement, ready for sqlx without copying. For crates that add statements over the outbox
/// tables (`outbox-cluster`).
pub fn statement(text: &Arc<str>) -> AssertSqlSafe<Arc<str>> {
    AssertSqlSafe(Arc::clone(text))
}

/// A duration as the statements take it: whole milliseconds.
pub fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// A list as the statements of SQLite and MySQL take it: one JSON argument, opened in SQL. For crates
/// that add statements over the outbox tables (`outbox-cluster`).
#[cfg(any(feature = "sqlite", feature = "mysql"))]
pub fn json<T: serde::Serialize + ?Sized>(value: &T) -> Result<String> {
    serde_json::to_string(value).map_err(|e| Error::Database(sqlx::Error::Encode(Box::new(e))))
}

/// A failure as the SQLite and MySQL statements take it: `[hex id, requeues, attempts, error, failed (0
/// or 1), delay ms]`.
#[cfg(any(feature = "sqlite", feature = "mysql"))]
type Failure<'a> = (String, i32, i32, Option<&'a str>, i32, i64);

/// The outcomes that keep their record queued (a retry, FAILED, a call not made) under a grant that
/// `written` found held, as the SQLite and MySQL statements take them.
#[cfg(any(feature = "sqlite", feature = "mysql"))]
fn failures<'a>(written: &Written, outcomes: &'a [Outcome]) -> Vec<Failure<'a>> {
    outcomes
        .iter()
        .filter(|o| written.holds(o))
        .filter_map(|o| {
            let u = o.verdict.still_queued()?;
            let id = o.id.simple().to_string();
            Some((id, o.requeues, o.attempts, u.error, i32::from(u.failed), millis(u.delay)))
        })
        .collect()
}

/// Whether `r`'s last error is that of a counted call that did not finish ([`crate::UNFINISHED_CALL`]),
/// in SQL every backend reads alike (the text holds no quote or backslash).
pub(crate) fn unfinished() -> String {
    format!("coalesce(r.last_error = '{}', false)", crate::UNFINISHED_CALL)
}

/// A count or limit as the statements take it.
pub(crate) fn count(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

impl Error {
    /// Whether retrying the same operation later may succeed (connection trouble, timeouts, serialisation
    /// failures, deadlocks, a busy database). Input and configuration errors are never transient.
    pub fn is_transient(&self) -> bool {
        match self {
            // Connecting, TLS that fails (not built in, refused by the server, a certificate not trusted)
            // is the URL's or the server's configuration. Later, on a pool that connected, it is
            // connection trouble like any other, never the statement's fault.
            Error::Connect { source: sqlx::Error::Tls(_), .. } => false,
            Error::Connect { source: sqlx::Error::Io(e), .. } if e.kind() == std::io::ErrorKind::InvalidData => false,
            Error::Database(e) | Error::Connect { source: e, .. } => is_transient(e),
            Error::WriteLockTimeout { .. } | Error::QueryTimeout { .. } => true,
            _ => false,
        }
    }

    /// Whether the work did not fit its time: no answer within `query_timeout`, a lock or the write
    /// lock not had in time, a statement past the database's own time limit. Smaller work may fit.
    pub(crate) fn is_time_limit(&self) -> bool {
        match self {
            Error::QueryTimeout { .. } | Error::WriteLockTimeout { .. } => true,
            Error::Database(sqlx::Error::Database(db)) => judged!(db.as_ref(), is_time_limit),
            _ => false,
        }
    }

    /// [`Error::NotMigrated`] for `schema` in place of an error that [`is_not_migrated`](Self::is_not_migrated),
    /// which says what to do; any other error unchanged.
    pub fn not_migrated_in(self, schema: &str) -> Error {
        if !self.is_not_migrated() || matches!(self, Error::NotMigrated { .. }) {
            return self;
        }
        let missing = match &self {
            Error::Database(sqlx::Error::Database(db)) => db.message().to_string(),
            other => other.to_string(),
        };
        Error::NotMigrated { schema: schema.to_string(), missing }
    }

    /// Whether the outbox's tables, columns or schema are missing: the database needs `migrate` first.
    pub fn is_not_migrated(&self) -> bool {
        match self {
            Error::NotMigrated { .. } => true,
            Error::Database(e) => is_not_migrated(e),
            _ => false,
        }
    }
}

/// Whether a database error may go away if the same operation is tried again later (connection trouble,
/// serialisation failures, deadlocks, a busy database).
fn is_transient(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed
        | sqlx::Error::Tls(_) => true,
        sqlx::Error::Database(db) => judged!(db.as_ref(), is_transient),
        // A connection closed before the server answered PostgreSQL's TLS request: sqlx 0.9 reads the
        // end of the stream as a byte 0 and calls it a protocol error (sqlx#4395). Connection trouble,
        // as the same end is at any other step.
        sqlx::Error::Protocol(m) => m.starts_with("unexpected response from SSLRequest: 0x00"),
        _ => false,
    }
}

impl From<sqlx::Error> for Error {
    /// Every database error of the library passes here, so that an answer of a server that takes no
    /// writes retires the connections opened before it (see [`opened_before_read_only`]), whichever
    /// path met it.
    fn from(e: sqlx::Error) -> Self {
        if is_read_only(&e) {
            retire_before(Instant::now());
        }
        Error::Database(e)
    }
}

/// Whether a database error says the server (or the session) takes no writes, as a primary turned
/// replica in a failover answers on the connections it keeps open.
fn is_read_only(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(db) if judged!(db.as_ref(), is_read_only))
}

/// When the process's pools were last told that a server takes no writes, in nanoseconds since
/// [`EPOCH`] (0: never).
static READ_ONLY_SINCE: AtomicU64 = AtomicU64::new(0);
static EPOCH: LazyLock<Instant> = LazyLock::new(Instant::now);

/// Has the PostgreSQL and MySQL pools of [`Db::connect_with`] close, rather than hand out, every
/// connection opened before `instant`. After a failover the old primary's open connections answer
/// "read-only" to every write (MySQL keeps them, and so do poolers and proxies), while a new connection
/// reaches the new primary by its address; a pool would keep handing the old ones out until their
/// `max_lifetime`, 30 minutes. The mark is the process's, not one pool's: the error that sets it does
/// not know its pool, and a pool of a healthy server only reconnects once. It moves at most once per
/// [`RETIRE_AT_MOST_EVERY`]: while the answers go on (a DNS switch that lags, a planned read-only
/// window), each connection is opened again at most that often, not at every failed write.
fn retire_before(instant: Instant) {
    let since = u64::try_from(instant.saturating_duration_since(*EPOCH).as_nanos()).unwrap_or(u64::MAX).max(1);
    let every = u64::try_from(RETIRE_AT_MOST_EVERY.as_nanos()).unwrap_or(u64::MAX);
    let _ = READ_ONLY_SINCE.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |last| {
        (last == 0 || since >= last.saturating_add(every)).then_some(since)
    });
}

/// How often the read-only mark moves at most (see [`retire_before`]).
const RETIRE_AT_MOST_EVERY: Duration = Duration::from_secs(1);

/// Whether a pooled connection was opened before the last answer of a server that takes no writes
/// (PostgreSQL 25006; MySQL 1290, 1792, 1836) that reached this process's outbox, and so may lead to a
/// primary turned replica. The pools of [`Db::connect_with`] close such connections rather than hand
/// them out; a pool of the application's does the same with this in its `before_acquire`:
///
/// ```
/// fn failing_over<DB: sqlx::Database>(pool: sqlx::pool::PoolOptions<DB>) -> sqlx::pool::PoolOptions<DB> {
///     pool.before_acquire(|_conn, meta| {
///         Box::pin(async move { Ok(!outbox_core::driver::opened_before_read_only(&meta)) })
///     })
/// }
/// ```
pub fn opened_before_read_only(meta: &sqlx::pool::PoolConnectionMetadata) -> bool {
    let since = READ_ONLY_SINCE.load(Ordering::Relaxed);
    let opened = EPOCH.elapsed().saturating_sub(meta.age);
    since != 0 && u64::try_from(opened.as_nanos()).unwrap_or(u64::MAX) <= since
}

/// Whether a database error says the outbox's tables or schema do not exist: `migrate` first.
fn is_not_migrated(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(db) if judged!(db.as_ref(), is_not_migrated))
}
