//! The SQLite driver: its statements (`statements.rs`), the turns its writes take (`write.rs`), and how
//! they run. SQLite allows one writer at a time, which does the work PostgreSQL's row locks do: a
//! scheduling transaction holds the write lock from its first write to its commit, so sequence order is
//! commit order, and a completion checks (owner, epoch) inside its write transaction, where no epoch can
//! move before it commits.

mod statements;
mod write;

use std::str::FromStr;
use std::time::Duration;

use backon::{ExponentialBuilder, Retryable};
use chrono::{DateTime, Utc};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqliteSynchronous};
use sqlx::{AssertSqlSafe, Connection, SqliteConnection, SqlitePool};
use tracing::{info, warn};
use uuid::Uuid;

use self::statements::MIGRATIONS_TABLE;
pub use self::statements::{SqliteStatements, render};
pub use self::write::{Write, write, write_on};
use super::{ConnectOptions, Driver, count, json, millis, statement};
use crate::error::{Error, Result};
use crate::migrate::{Migration, checksum, recorded_columns, to_apply};
use crate::stored::{
    FAILED_PAGE_PAYLOAD_BYTES, FailedFilter, FailedRecord, FetchedRow, Found, NewRow, Outcome, PartitionStats, Request,
    Runs, StatsRow, Written, fits_one_statement, grants_list,
};

/// The migrations of the SQLite schema, in order (`{s}` is the table prefix).
pub const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        name: "initial",
        sql: include_str!("../../../../../migrations/sqlite/0001_initial.sql"),
        earlier: &[],
        older_versions_run: false,
    },
    Migration {
        version: 2,
        name: "leases_requeues_sequences",
        sql: include_str!("../../../../../migrations/sqlite/0002_leases_requeues_sequences.sql"),
        earlier: &[],
        older_versions_run: false,
    },
    Migration {
        version: 3,
        name: "numbered_on_insert",
        sql: include_str!("../../../../../migrations/sqlite/0003_numbered_on_insert.sql"),
        earlier: &[],
        older_versions_run: false,
    },
    Migration {
        version: 4,
        name: "delivery_times",
        sql: include_str!("../../../../../migrations/sqlite/0004_delivery_times.sql"),
        earlier: &[],
        older_versions_run: false,
    },
    Migration {
        version: 5,
        name: "inbox",
        sql: include_str!("../../../../../migrations/sqlite/0005_inbox.sql"),
        earlier: &[],
        older_versions_run: false,
    },
    Migration {
        version: 6,
        name: "delivered counts",
        sql: include_str!("../../../../../migrations/sqlite/0006_delivered_counts.sql"),
        earlier: &[],
        older_versions_run: false,
    },
    Migration {
        version: 7,
        name: "numbered_by_rowid",
        sql: include_str!("../../../../../migrations/sqlite/0007_numbered_by_rowid.sql"),
        // Its first text (02fe401), which failed on records of version 1 that share numbers.
        earlier: &[2_231_032_707_873_112_697],
        older_versions_run: false,
    },
    Migration {
        version: 8,
        name: "takeovers",
        sql: include_str!("../../../../../migrations/sqlite/0008_takeovers.sql"),
        earlier: &[],
        older_versions_run: false,
    },
    Migration {
        version: 9,
        name: "ended_leases",
        sql: include_str!("../../../../../migrations/sqlite/0009_ended_leases.sql"),
        earlier: &[],
        older_versions_run: false,
    },
    Migration {
        version: 10,
        name: "migration_compatibility",
        sql: include_str!("../../../../../migrations/sqlite/0010_migration_compatibility.sql"),
        earlier: &[],
        // Adds a column with a default, which older libraries ignore (none reads this flag: a library
        // that reads flags knows this migration).
        older_versions_run: true,
    },
    Migration {
        version: 11,
        name: "quiet_periods",
        sql: include_str!("../../../../../migrations/sqlite/0011_quiet_periods.sql"),
        earlier: &[],
        // Adds a column older libraries ignore. Alone on the schema they run as before; beside newer
        // ones (a rolling deploy) they neither set nor honour it.
        older_versions_run: true,
    },
    Migration {
        version: 12,
        name: "due_heads",
        sql: include_str!("../../../../../migrations/sqlite/0012_due_heads.sql"),
        earlier: &[],
        // Adds indexes; the index older libraries walk stays.
        older_versions_run: true,
    },
];

/// The most a statement's string argument carries: SQLite's largest string (`SQLITE_MAX_LENGTH`, a
/// billion bytes as sqlx builds it), less room for the rest.
const STATEMENT_BYTES: usize = 1_000_000_000 - (1 << 20);

/// How long a connection waits for the write lock before a statement fails with "busy". Writers hold
/// it for milliseconds; a long wait means something is wrong, not busy.
pub const BUSY_TIMEOUT: Duration = Duration::from_secs(30);

/// Connection options for a SQLite outbox database: created if missing, WAL mode (readers never block
/// the writer), `synchronous = FULL` and [`BUSY_TIMEOUT`].
///
/// `FULL` makes every commit durable before it returns. With `NORMAL` a power cut or an operating-system
/// crash may roll back the last transactions after their records were delivered: opt into it only if
/// that is acceptable, with `.synchronous(SqliteSynchronous::Normal)` on the result.
pub fn options(url: &str) -> Result<SqliteConnectOptions> {
    Ok(SqliteConnectOptions::from_str(url)?
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Full)
        .busy_timeout(BUSY_TIMEOUT))
}

/// Opens the pool, waiting out "database is locked" for up to [`BUSY_TIMEOUT`]: a connection that
/// switches a file to WAL while another process opens it too gets that at once, without the busy
/// timeout's wait (the first workers of a fresh deployment, starting together).
pub(super) async fn connect(url: &str, connect: &ConnectOptions) -> Result<SqlitePool> {
    let file = options(url).map_err(|e| match e {
        Error::Database(e) => Error::BadUrl(e),
        other => other,
    })?;
    let database = format!("the SQLite database {}", file.get_filename().display());
    let backoff = ExponentialBuilder::new()
        .with_min_delay(Duration::from_millis(10))
        .with_max_delay(Duration::from_secs(1))
        .with_jitter()
        .without_max_times()
        .with_total_delay(Some(BUSY_TIMEOUT));
    (|| super::sized(connect, false).connect_with(file.clone()))
        .retry(backoff)
        .when(|e| matches!(e, sqlx::Error::Database(db) if is_transient(db.as_ref()) == Some(true)))
        .await
        .map_err(|source| Error::Connect { database, source })
}

/// Busy (another writer held the lock past the busy timeout, or a read snapshot went stale before its
/// first write), locked, out of memory (7), a disk I/O error (10) and a full disk or database (13) are
/// worth retrying, as PostgreSQL's class 53 is; judged by the primary code, the low byte of the extended
/// one sqlx reports. `None`: not a SQLite error.
pub(super) fn is_transient(db: &dyn sqlx::error::DatabaseError) -> Option<bool> {
    db.try_downcast_ref::<sqlx::sqlite::SqliteError>()?;
    let primary = db.code().and_then(|code| code.parse::<i32>().ok()).map(|code| code & 0xff);
    Some(matches!(primary, Some(5 | 6 | 7 | 10 | 13)))
}

/// Busy or locked (5, 6): the write lock was not had within the busy timeout. `None`: not a SQLite
/// error.
pub(super) fn is_time_limit(db: &dyn sqlx::error::DatabaseError) -> Option<bool> {
    db.try_downcast_ref::<sqlx::sqlite::SqliteError>()?;
    let primary = db.code().and_then(|code| code.parse::<i32>().ok()).map(|code| code & 0xff);
    Some(matches!(primary, Some(5 | 6)))
}

/// SQLite has no read-only answer a failover gives. `None`: not a SQLite error.
pub(super) fn is_read_only(db: &dyn sqlx::error::DatabaseError) -> Option<bool> {
    db.try_downcast_ref::<sqlx::sqlite::SqliteError>()?;
    Some(false)
}

/// SQLite has no code of its own for a missing table ("no such table") or column, as in a schema that a
/// later migration has not reached ("no such column", or "table … has no column named …" from an
/// insert). `None`: not a SQLite error.
pub(super) fn is_not_migrated(db: &dyn sqlx::error::DatabaseError) -> Option<bool> {
    db.try_downcast_ref::<sqlx::sqlite::SqliteError>()?;
    let message = db.message();
    Some(
        message.starts_with("no such table")
            || message.starts_with("no such column")
            || message.contains(" has no column named "),
    )
}

/// Inserts records on the caller's connection (see `Conn::schedule`).
///
/// One statement: SQLite numbers the records as it inserts them (migration 7), one past the last number
/// it gave, and the result names the last; a statement's rows are numbered one after another in list
/// order, so the first is `n - 1` below it. One record binds its values, more go as one JSON list. On a
/// bare connection the statement runs in a `BEGIN IMMEDIATE` transaction of sqlx's own, which sqlx rolls
/// back if this future is dropped half way (say, by a timeout while waiting for the write lock), where a
/// lone statement would still write once the lock came free. A transaction the application began with
/// its own SQL, which sqlx does not know of, refuses that `BEGIN`; the statement joins it instead.
pub(super) async fn schedule(
    conn: &mut SqliteConnection,
    s: &SqliteStatements,
    rows: &[NewRow<'_>],
) -> Result<Vec<(Uuid, i64)>> {
    if !conn.is_in_transaction() {
        match conn.begin_with("BEGIN IMMEDIATE").await {
            Ok(mut tx) => {
                let numbered = insert(&mut tx, s, rows).await?;
                tx.commit().await?;
                return Ok(numbered);
            }
            Err(sqlx::Error::Database(e)) if e.message() == "cannot start a transaction within a transaction" => {}
            Err(e) => return Err(e.into()),
        }
    }
    insert(conn, s, rows).await
}

/// A delivery time as stored (milliseconds since the epoch), rounded up: a record is never due early.
fn millis_not_before(at: DateTime<Utc>) -> i64 {
    let millis = at.timestamp_millis();
    if at.timestamp_subsec_nanos().is_multiple_of(1_000_000) { millis } else { millis + 1 }
}

async fn insert(conn: &mut SqliteConnection, s: &SqliteStatements, rows: &[NewRow<'_>]) -> Result<Vec<(Uuid, i64)>> {
    let done = if let [row] = rows {
        sqlx::query(statement(&s.insert))
            .bind(row.id)
            .bind(i16::from(row.partition))
            .bind(row.key)
            .bind(row.event_type)
            .bind(row.payload)
            .bind(&row.headers)
            .bind(row.deliver_at.map(millis_not_before))
            .bind(row.deliver_after_ms)
            .execute(conn)
            .await?
    } else {
        fits_one_statement(rows, 2, STATEMENT_BYTES)?;
        let list: Vec<_> = rows
            .iter()
            .map(|r| {
                let payload = hex::encode(r.payload);
                let at = r.deliver_at.map(millis_not_before);
                let (id, partition) = (r.id.simple().to_string(), i16::from(r.partition));
                (id, partition, r.key, r.event_type, payload, r.headers.as_str(), at, r.deliver_after_ms)
            })
            .collect();
        sqlx::query(statement(&s.insert_many)).bind(json(&list)?).execute(conn).await?
    };
    let first = done.last_insert_rowid() - count(rows.len()) + 1;
    Ok((first..).zip(rows).map(|(seq, row)| (row.id, seq)).collect())
}

/// Accepts a message on the caller's connection (see `Conn::accept`).
pub(super) async fn accept(
    conn: &mut SqliteConnection,
    s: &SqliteStatements,
    source: &str,
    message_id: &str,
) -> Result<bool> {
    let done = sqlx::query(statement(&s.accept)).bind(source).bind(message_id).execute(conn).await?;
    Ok(done.rows_affected() == 1)
}

/// Whether `conn` is inside a transaction: sqlx's own, or the application's `BEGIN`, which refuses
/// another `BEGIN` (one that succeeds, outside any transaction, is rolled back at once: it took no lock).
pub(super) async fn in_a_transaction(conn: &mut SqliteConnection) -> Result<bool> {
    if conn.is_in_transaction() {
        return Ok(true);
    }
    match conn.begin().await {
        Ok(probe) => {
            probe.rollback().await?;
            Ok(false)
        }
        Err(sqlx::Error::Database(e)) if e.message() == "cannot start a transaction within a transaction" => Ok(true),
        Err(e) => Err(e.into()),
    }
}

/// Accepts a key's event in order on the caller's connection (see `Conn::accept_in_order`).
pub(super) async fn accept_in_order(
    conn: &mut SqliteConnection,
    s: &SqliteStatements,
    source: &str,
    key: &str,
    seq: i64,
) -> Result<bool> {
    let done = sqlx::query(statement(&s.accept_in_order)).bind(source).bind(key).bind(seq).execute(conn).await?;
    Ok(done.rows_affected() == 1)
}

impl Driver<'_, SqlitePool, SqliteStatements> {
    /// Applies the missing migrations in one write transaction (the write lock serialises migrators).
    pub(crate) async fn migrate(&self) -> Result<()> {
        let schema = self.statements.schema.as_str();
        let mut tx = write(self.pool).await?;
        sqlx::raw_sql(AssertSqlSafe(render(MIGRATIONS_TABLE, schema).to_string())).execute(&mut *tx).await?;
        let applied: Vec<(i64, i64)> =
            sqlx::query_as(AssertSqlSafe(format!("SELECT version, checksum FROM {schema}_schema_migrations")))
                .fetch_all(&mut *tx)
                .await?;
        let flagged = format!("SELECT version FROM {schema}_schema_migrations WHERE older_versions_run");
        let read_flags = async || Ok(sqlx::query_scalar(AssertSqlSafe(flagged)).fetch_all(&mut *tx).await?);
        let pending = to_apply(schema, &applied, MIGRATIONS, read_flags).await?;
        for m in pending {
            sqlx::raw_sql(AssertSqlSafe(render(m.sql, schema).to_string())).execute(&mut *tx).await.inspect_err(|e| {
                warn!(schema, version = m.version, name = m.name, error = %e, "outbox migration failed; none of this run's is kept");
            })?;
            let (columns, flag) = recorded_columns(m);
            let record = format!("INSERT INTO {schema}_schema_migrations ({columns}) VALUES ($1, $2, $3{flag})");
            sqlx::query(AssertSqlSafe(record))
                .bind(m.version)
                .bind(m.name)
                .bind(checksum(m.sql))
                .execute(&mut *tx)
                .await?;
            info!(schema, version = m.version, name = m.name, "applied outbox migration (SQLite)");
        }
        tx.commit().await?;
        Ok(())
    }

    /// One statement, one snapshot; the byte budget holds while the rows stream in ([`Runs`]).
    pub(crate) async fn fetch(&self, request: &Request) -> Result<Found> {
        let partitions: Vec<(i16, i64, Option<&str>)> =
            request.partitions.iter().map(|(p, epoch, after)| (i16::from(*p), epoch.0, after.as_deref())).collect();
        let rows = sqlx::query_as::<_, FetchedRow>(statement(&self.statements.fetch))
            .bind(json(&partitions)?)
            .bind(json(&request.exclude)?)
            .bind(count(request.limit))
            .bind(count(request.followers))
            .bind(request.instance)
            .fetch(self.pool);
        Runs::collect(rows, request).await
    }

    /// One write transaction: the grants checked in one statement, then the completions of those that
    /// hold in two set statements (copy, delete), then their failures in one.
    pub(crate) async fn complete(&self, outcomes: &[Outcome]) -> Result<Written> {
        let s = self.statements;
        let mut tx = write(self.pool).await?;
        let mut written = Written::default();
        let grants = json(&grants_list(outcomes))?;
        written.hold(sqlx::query_as(statement(&s.fence)).bind(grants).fetch_all(&mut *tx).await?);
        let done = written.completions(outcomes);
        if !done.is_empty() {
            let done = json(&done)?;
            if let Some(keep) = &s.keep {
                sqlx::query(statement(keep)).bind(&done).execute(&mut *tx).await?;
            }
            let deleted: Vec<(Uuid,)> = sqlx::query_as(statement(&s.delete)).bind(&done).fetch_all(&mut *tx).await?;
            written.ids.extend(deleted.into_iter().map(|(id,)| id));
        }
        let failures = super::failures(&written, outcomes);
        if !failures.is_empty() {
            let failed: Vec<(Uuid,)> =
                sqlx::query_as(statement(&s.fail)).bind(json(&failures)?).fetch_all(&mut *tx).await?;
            written.ids.extend(failed.into_iter().map(|(id,)| id));
        }
        tx.commit().await?;
        Ok(written)
    }

    pub(crate) async fn failed(&self, filter: &FailedFilter) -> Result<Vec<FailedRecord>> {
        Ok(sqlx::query_as(statement(&self.statements.list_failed))
            .bind(filter.key.as_deref())
            .bind(filter.partition.map(i16::from))
            .bind(filter.limit.unwrap_or(100))
            .bind(filter.after.as_ref().map(|a| i16::from(a.partition)))
            .bind(filter.after.as_ref().map(|a| a.key.as_str()))
            .bind(filter.after.as_ref().map(|a| a.seq))
            .bind(filter.payloads)
            .bind(count(FAILED_PAGE_PAYLOAD_BYTES))
            .fetch_all(self.pool)
            .await?)
    }

    /// Requeues the FAILED record `id`, or those of `key`.
    pub(crate) async fn requeue(&self, id: Option<Uuid>, key: Option<&str>) -> Result<u64> {
        let query = sqlx::query(statement(&self.statements.requeue)).bind(id).bind(key);
        let mut tx = write(self.pool).await?;
        let requeued = query.execute(&mut *tx).await?.rows_affected();
        tx.commit().await?;
        Ok(requeued)
    }

    /// The next `limit` FAILED records after `after`, requeued in one write: the write lock is the whole
    /// database's, and one statement over every FAILED record rewrote each row, payload and all, while
    /// every writer waited, heartbeats too, past their leases.
    pub(crate) async fn requeue_batch(&self, after: &(i16, String, i64), limit: usize) -> Result<super::RequeuedBatch> {
        let mut tx = write(self.pool).await?;
        let batch: Vec<(i16, String, i64)> = sqlx::query_as(statement(&self.statements.requeue_all))
            .bind(after.0)
            .bind(&after.1)
            .bind(after.2)
            .bind(count(limit))
            .fetch_all(&mut *tx)
            .await?;
        tx.commit().await?;
        // Under the write lock every record read is requeued.
        let n = batch.len() as u64;
        Ok(super::RequeuedBatch { read: n, requeued: n, last: batch.into_iter().max() })
    }

    pub(crate) async fn skip(&self, id: Uuid) -> Result<bool> {
        let mut tx = write(self.pool).await?;
        sqlx::query(statement(&self.statements.skip_keep)).bind(id).execute(&mut *tx).await?;
        let deleted = sqlx::query(statement(&self.statements.skip_delete)).bind(id).fetch_optional(&mut *tx).await?;
        tx.commit().await?;
        Ok(deleted.is_some())
    }

    pub(crate) async fn stats(&self) -> Result<Vec<PartitionStats>> {
        let rows: Vec<StatsRow> = sqlx::query_as(statement(&self.statements.stats)).fetch_all(self.pool).await?;
        Ok(rows.into_iter().map(PartitionStats::from).collect())
    }

    pub(crate) async fn purge(&self, retention: Duration, limit: usize) -> Result<u64> {
        self.delete_old(&self.statements.purge, retention, limit).await
    }

    pub(crate) async fn purge_inbox(&self, retention: Duration, limit: usize) -> Result<u64> {
        self.delete_old(&self.statements.purge_inbox, retention, limit).await
    }

    /// Runs a purge statement (`$1` retention in ms, `$2` rows at most) in a write transaction.
    async fn delete_old(&self, purge: &std::sync::Arc<str>, retention: Duration, limit: usize) -> Result<u64> {
        let mut tx = write(self.pool).await?;
        let query = sqlx::query(statement(purge)).bind(millis(retention)).bind(count(limit));
        let purged = query.execute(&mut *tx).await?.rows_affected();
        tx.commit().await?;
        Ok(purged)
    }

    /// SQLite keeps no per-key rows: its single writer serialises the writers of every key.
    pub(crate) async fn prune_keys(&self, _limit: usize, _after: &str) -> Result<super::KeysPruned> {
        Ok(super::KeysPruned::default())
    }
}

/// A private in-memory database (one connection: each has its own database).
#[cfg(test)]
pub(crate) async fn memory() -> SqlitePool {
    let options = options("sqlite::memory:").unwrap();
    sqlx::sqlite::SqlitePoolOptions::new().max_connections(1).connect_with(options).await.unwrap()
}

#[cfg(test)]
mod tests {
    use sqlx::AssertSqlSafe;

    use super::memory as sqlite_memory;
    use super::render;
    use crate::{Config, Db, Outbox};

    /// A delivery time is stored as whole milliseconds, never before the time asked for.
    #[test]
    fn delivery_times_round_up_to_the_millisecond() {
        let at = |ms: i64, ns: u32| chrono::DateTime::from_timestamp(ms / 1000, (ms % 1000) as u32 * 1_000_000 + ns);
        assert_eq!(super::millis_not_before(at(1_700_000_000_123, 0).unwrap()), 1_700_000_000_123);
        assert_eq!(super::millis_not_before(at(1_700_000_000_123, 1).unwrap()), 1_700_000_000_124);
        assert_eq!(super::millis_not_before(at(1_700_000_000_123, 999_999).unwrap()), 1_700_000_000_124);
        let before_1970 = chrono::DateTime::from_timestamp(-2, 999_500_000).unwrap(); // -1000.5 ms
        assert_eq!(super::millis_not_before(before_1970), -1_000);
    }

    /// A migrated outbox on a private in-memory database.
    async fn migrated() -> (sqlx::SqlitePool, Outbox) {
        let pool = sqlite_memory().await;
        let outbox = Outbox::new(Config::default()).unwrap();
        outbox.migrate(Db::from(&pool)).await.unwrap();
        (pool, outbox)
    }

    /// "Requeue all FAILED" takes the database's write lock a batch at a time: another writer (here,
    /// one marking a table in its turns; a heartbeat, in a service) gets in between its batches. As one
    /// statement over every FAILED record it held the lock throughout, for long enough, with many large
    /// records, that heartbeats waited past their leases. Each record is requeued once.
    #[tokio::test]
    async fn requeue_all_lets_other_writers_in_between_its_batches() {
        let (pool, outbox) = migrated().await;
        let failed = 5 * crate::driver::REQUEUE_AT_ONCE + 7;
        sqlx::raw_sql(AssertSqlSafe(format!(
            "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < {failed})
             INSERT INTO outbox_records (id, partition, key, event_type, payload, attempts, failed_at)
             SELECT randomblob(16), i % 256, 'k' || i, 't', x'', 3, 1 FROM n;
             CREATE TABLE marks (n INTEGER);
             CREATE TABLE seen (marks INTEGER);
             CREATE TRIGGER seen AFTER UPDATE OF failed_at ON outbox_records
             BEGIN INSERT INTO seen SELECT count(*) FROM marks; END;"
        )))
        .execute(&pool)
        .await
        .unwrap();
        let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let marking = tokio::spawn({
            let (pool, done) = (pool.clone(), done.clone());
            async move {
                while !done.load(std::sync::atomic::Ordering::Relaxed) {
                    let mut tx = super::write(&pool).await.unwrap();
                    sqlx::query("INSERT INTO marks (n) VALUES (1)").execute(&mut *tx).await.unwrap();
                    tx.commit().await.unwrap();
                }
            }
        });
        let requeued = outbox.requeue_all(Db::from(&pool)).await.unwrap();
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        marking.await.unwrap();
        assert_eq!(requeued, failed as u64);
        let counts = "SELECT (SELECT count(*) FROM outbox_records WHERE failed_at IS NOT NULL),
            (SELECT count(*) FROM seen), (SELECT count(DISTINCT marks) FROM seen)";
        let (left, updated, views): (i64, i64, i64) = sqlx::query_as(counts).fetch_one(&pool).await.unwrap();
        assert_eq!((left, updated), (0, failed as i64), "every record requeued, once");
        assert!(views > 1, "another writer got in between the batches");
    }

    /// A migrated outbox whose record inserts fail when `condition` (on `NEW`) holds.
    async fn refusing(condition: &str) -> (sqlx::SqlitePool, Outbox) {
        let (pool, outbox) = migrated().await;
        let trigger = format!(
            "CREATE TRIGGER refuse BEFORE INSERT ON outbox_records WHEN {condition}
             BEGIN SELECT RAISE(ABORT, 'refused by the test'); END"
        );
        sqlx::query(AssertSqlSafe(trigger)).execute(&pool).await.unwrap();
        (pool, outbox)
    }

    /// A database opened the documented ways is durable by default: every commit is synced
    /// (`synchronous = FULL`, 2), in WAL mode.
    #[tokio::test]
    async fn databases_are_durable_by_default() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("durable.db").display());
        #[allow(irrefutable_let_patterns)] // in a build with SQLite alone
        let Db::Sqlite(connected) = Db::connect(&url).await.unwrap() else { panic!("not SQLite") };
        let own = sqlx::SqlitePool::connect_with(super::options(&url).unwrap()).await.unwrap();
        for pool in [connected, own] {
            let synchronous: i64 = sqlx::query_scalar("PRAGMA synchronous").fetch_one(&pool).await.unwrap();
            let journal: String = sqlx::query_scalar("PRAGMA journal_mode").fetch_one(&pool).await.unwrap();
            assert_eq!((synchronous, journal.as_str()), (2, "wal"));
        }
    }

    /// The fetch walks the served partitions through the (partition, key, seq) index and stops at its
    /// limit: no table scan, no sort or grouping that would read every record first, in both modes.
    #[tokio::test]
    async fn fetch_walks_the_index_and_never_sorts_or_groups() {
        let (pool, _) = migrated().await;
        for stop_on_first_failure in [true, false] {
            let sql = super::SqliteStatements::new("outbox", stop_on_first_failure, true);
            let explain = format!("EXPLAIN QUERY PLAN {}", sql.fetch);
            let rows: Vec<(i64, i64, i64, String)> = sqlx::query_as(sqlx::AssertSqlSafe(explain))
                .bind("[[0, 1, null], [1, 1, \"k\"], [2, 1, null]]")
                .bind("[]")
                .bind(100_i64)
                .bind(7_i64)
                .bind(uuid::Uuid::now_v7())
                .fetch_all(&pool)
                .await
                .unwrap();
            let plan = rows.into_iter().map(|(.., detail)| detail).collect::<Vec<_>>().join("\n");
            // Key to key by index seeks; every other lookup an index seek too: no scan of the records,
            // no sort.
            let seek = "SEARCH k USING COVERING INDEX outbox_records_ready (partition=? AND key>?)";
            assert!(plan.contains(seek), "{plan}");
            assert!(plan.contains("RECURSIVE STEP"), "{plan}");
            let scans = |alias: &str| {
                plan.lines().any(|line| {
                    let words: Vec<&str> = line.split_whitespace().collect();
                    words.windows(2).any(|w| w[0].ends_with("SCAN") && w[1] == alias)
                })
            };
            for records in ["r", "k", "h", "x", "c"] {
                assert!(!scans(records), "records ({records}) scanned: {plan}");
            }
            // (A Bloom filter over the skipped keys' list is fine; one built on a table scans it.)
            // Only the list of served partitions (at most 256) is sorted, never records.
            let sorts = plan.lines().filter(|l| l.contains("TEMP B-TREE") && !l.contains("json_group_array(ORDER BY)"));
            assert!(!plan.contains("BLOOM FILTER ON") && sorts.count() == 0, "{plan}");
        }
    }

    /// Keys whose every record waits (here one each, scheduled an hour from now or FAILED: reminders, or
    /// what a broker's outage left) cost the fetch nothing: beside 20,000 of them, half sorting before the
    /// others in every partition, its walk takes as many steps and serves the same heads. Walking every
    /// key, it stepped through each of them on every poll (a fetch beside 200,000 took 24 ms in a release
    /// build, beside a million 110 ms; 4 and 6 ms now).
    #[tokio::test]
    async fn keys_whose_records_all_wait_cost_the_fetch_nothing() {
        let (pool, _) = migrated().await;
        let instance = owning_every_partition(&pool).await;
        insert(&pool, "key-", 2_000, 10, "NULL", "NULL").await;
        let (alone_steps, alone) = fetch_every_partition(&pool, instance).await;
        insert(&pool, "held-", 10_000, 1, "NULL", "1").await;
        insert(&pool, "later-", 10_000, 1, &format!("{} + 3600000", super::statements::NOW_MS), "NULL").await;
        let (beside_steps, beside) = fetch_every_partition(&pool, instance).await;
        assert_eq!(alone.len(), 100, "100 heads");
        assert_eq!(alone, beside, "the heads served");
        assert_eq!(alone_steps, beside_steps, "the walk's steps");
    }

    /// Records whose retry came due take at most half a fetch's batch: 200 keys retrying beside 200 keys
    /// due at once, in one partition, fill a batch of 100 half and half, though they sort first. Walked
    /// to in key order, a storm of retries held back the partition's other keys for as long as it lasted.
    /// With nothing else due they fill it.
    #[tokio::test]
    async fn retries_that_came_due_leave_half_the_batch_to_the_rest() {
        for (ready, expected) in [(true, (50, 100)), (false, (100, 100))] {
            let (pool, _) = migrated().await;
            let instance = owning_every_partition(&pool).await;
            sqlx::raw_sql(AssertSqlSafe(format!(
                "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 400)
                 INSERT INTO outbox_records (id, partition, key, event_type, payload, attempts, next_attempt_at)
                 SELECT randomblob(16), 0, iif(i % 2 = 0, 'came-due-', 'ready-') || i, 't', x'00', 1,
                        iif(i % 2 = 0, {now} - 60000, iif({ready}, NULL, {now} + 3600000))
                 FROM n",
                now = super::statements::NOW_MS
            )))
            .execute(&pool)
            .await
            .unwrap();
            let (_, heads) = fetch_every_partition(&pool, instance).await;
            let retried = heads.iter().filter(|key| key.starts_with("came-due-"));
            assert_eq!((retried.count(), heads.len()), expected, "heads that came due, heads (ready: {ready})");
        }
    }

    /// A live instance that owns every partition at epoch 1.
    async fn owning_every_partition(pool: &sqlx::SqlitePool) -> uuid::Uuid {
        let instance = uuid::Uuid::now_v7();
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO outbox_instances (id, name, expires_at) VALUES ($1, 'test', {} + 86400000)",
            super::statements::NOW_MS
        )))
        .bind(instance)
        .execute(pool)
        .await
        .unwrap();
        sqlx::query("UPDATE outbox_partitions SET owner = $1, epoch = 1").bind(instance).execute(pool).await.unwrap();
        instance
    }

    /// `per_key` records for each of `keys` keys named `prefix` and a number, spread over the partitions,
    /// each with `next_attempt_at` and `failed_at` as given (SQL).
    async fn insert(pool: &sqlx::SqlitePool, prefix: &str, keys: u32, per_key: u32, next: &str, failed: &str) {
        sqlx::raw_sql(AssertSqlSafe(format!(
            "WITH RECURSIVE k(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM k WHERE i < {keys}),
                 s(j) AS (SELECT 1 UNION ALL SELECT j + 1 FROM s WHERE j < {per_key})
             INSERT INTO outbox_records (id, partition, key, event_type, payload, next_attempt_at, failed_at)
             SELECT randomblob(16), i % 256, '{prefix}' || i, 't', x'00', {next}, {failed} FROM s, k ORDER BY j, i"
        )))
        .execute(pool)
        .await
        .unwrap();
    }

    /// One fetch of every partition (100 heads, 7 records after each): the rows its walk took, and the
    /// keys of the heads it served, sorted.
    async fn fetch_every_partition(pool: &sqlx::SqlitePool, instance: uuid::Uuid) -> (i64, Vec<String>) {
        use sqlx::Row;
        let sql = super::SqliteStatements::new("outbox", true, true);
        let partitions: Vec<(i64, i64, Option<&str>)> = (0..256).map(|p| (p, 1, None)).collect();
        let partitions = serde_json::to_string(&partitions).unwrap();
        let cut = sql.fetch.find("\nheads AS (").unwrap();
        let steps = format!("{} SELECT count(*) FROM walk", sql.fetch[..cut].trim_end_matches(','));
        let served = format!("SELECT DISTINCT key FROM ({}) ORDER BY key", sql.fetch);
        let mut rows = Vec::new();
        for text in [steps, served] {
            let query = sqlx::query(AssertSqlSafe(text)).bind(&partitions).bind("[]").bind(100_i64).bind(7_i64);
            rows.push(query.bind(instance).fetch_all(pool).await.unwrap());
        }
        let steps: i64 = rows[0][0].get(0);
        (steps, rows[1].iter().map(|row| row.get(0)).collect())
    }

    /// A completion's failures are written in one statement that finds each record by its id: the
    /// list drives the join, so the records are not scanned however many there are.
    #[tokio::test]
    async fn failures_are_written_by_id_in_one_statement() {
        let (pool, _) = migrated().await;
        let sql = super::SqliteStatements::new("outbox", true, true);
        let explain = format!("EXPLAIN QUERY PLAN {}", sql.fail);
        let rows: Vec<(i64, i64, i64, String)> = sqlx::query_as(sqlx::AssertSqlSafe(explain))
            .bind(r#"[["00", 0, 1, "e", 0, 5]]"#)
            .fetch_all(&pool)
            .await
            .unwrap();
        let plan = rows.into_iter().map(|(.., detail)| detail).collect::<Vec<_>>().join("\n");
        assert!(plan.contains("SCAN j VIRTUAL TABLE"), "{plan}");
        assert!(plan.contains("SEARCH r USING INDEX") && plan.contains("(id=?)"), "{plan}");
    }

    /// A batch that fails part way writes nothing, even when the caller commits after the error; and
    /// no sequence number is used up.
    #[tokio::test]
    async fn a_failed_batch_leaves_nothing_behind() {
        let (pool, outbox) = refusing("NEW.key = 'refused'").await;
        let batch = [crate::NewRecord::new("k", "t", "1"), crate::NewRecord::new("refused", "t", "2")];
        let mut tx = pool.begin().await.unwrap();
        assert!(outbox.schedule_batch(&mut tx, &batch).await.is_err());
        tx.commit().await.unwrap();
        let counts: (i64, i64) = sqlx::query_as(
            "SELECT (SELECT count(*) FROM outbox_records),
                        (SELECT coalesce(max(seq), 0) FROM sqlite_sequence WHERE name = 'outbox_records')",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(counts, (0, 0), "no record, and no sequence number taken");
        // Without a transaction too, and the connection is left outside one.
        let mut conn = pool.acquire().await.unwrap();
        assert!(outbox.schedule_batch(&mut *conn, &batch).await.is_err());
        let scheduled = outbox.schedule(&mut *conn, crate::NewRecord::new("k", "t", "3")).await.unwrap();
        assert_eq!(scheduled.seq, 1);
        drop(conn);
        let records: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_records").fetch_one(&pool).await.unwrap();
        assert_eq!(records, 1);
    }

    /// The completion's set statements find each record and partition by its key, never by a scan.
    #[tokio::test]
    async fn completions_find_records_by_id() {
        let (pool, _) = migrated().await;
        let sql = super::SqliteStatements::new("outbox", true, true);
        let keep = sql.keep.as_deref().unwrap_or_default();
        for (name, text) in [("fence", &*sql.fence), ("keep", keep), ("delete", &*sql.delete)] {
            let explain = format!("EXPLAIN QUERY PLAN {text}");
            let rows: Vec<(i64, i64, i64, String)> =
                sqlx::query_as(AssertSqlSafe(explain)).bind("[]").fetch_all(&pool).await.unwrap();
            let plan = rows.into_iter().map(|(.., detail)| detail).collect::<Vec<_>>().join("\n");
            let scans_a_table = plan.lines().any(|l| l.contains("SCAN") && !l.contains("VIRTUAL TABLE"));
            assert!(!scans_a_table && plan.contains("SEARCH"), "{name}: {plan}");
        }
    }

    /// A batch travels as one JSON list: keys, payloads of every byte value, headers and ids come back
    /// exactly, numbered in batch order.
    #[tokio::test]
    async fn a_batch_is_stored_byte_for_byte() {
        let (pool, outbox) = migrated().await;
        let bytes: Vec<u8> = (0..=255).collect();
        let batch = [
            crate::NewRecord::new("ключ-🔑 \"quoted\"", "t.ü", bytes.clone()).header("x-trace", "a\\b"),
            crate::NewRecord::new("k", "t", Vec::new()),
            crate::NewRecord::new("ключ-🔑 \"quoted\"", "t", vec![0_u8; 3]),
        ];
        let mut tx = pool.begin().await.unwrap();
        let scheduled = outbox.schedule_batch(&mut tx, &batch).await.unwrap();
        tx.commit().await.unwrap();
        let stored: Vec<(uuid::Uuid, String, i64, String, Vec<u8>, String)> =
            sqlx::query_as("SELECT id, key, seq, event_type, payload, headers FROM outbox_records ORDER BY seq")
                .fetch_all(&pool)
                .await
                .unwrap();
        assert_eq!(stored.len(), 3);
        for ((row, record), done) in stored.iter().zip(&batch).zip(&scheduled) {
            assert_eq!((row.0, row.2), (done.id, done.seq));
            assert_eq!(
                (row.1.as_str(), row.3.as_str(), &row.4[..]),
                (&record.key[..], &record.event_type[..], &record.payload[..])
            );
        }
        assert!(stored[0].5.contains("x-trace") && stored[0].5.contains(r"a\\b"), "{}", stored[0].5);
        assert!(scheduled[0].seq < scheduled[1].seq && scheduled[1].seq < scheduled[2].seq);
    }

    /// One record in the caller's transaction has no savepoint: when its insert fails, nothing of it is
    /// stored and the transaction goes on, its key's numbers still growing.
    #[tokio::test]
    async fn a_single_record_that_fails_stores_nothing_and_the_transaction_goes_on() {
        let (pool, outbox) = refusing("NEW.event_type = 'refused'").await;
        let mut tx = pool.begin().await.unwrap();
        let first = outbox.schedule(&mut tx, crate::NewRecord::new("k", "t", "1")).await.unwrap();
        assert!(outbox.schedule(&mut tx, crate::NewRecord::new("k", "refused", "2")).await.is_err());
        let third = outbox.schedule(&mut tx, crate::NewRecord::new("k", "t", "3")).await.unwrap();
        tx.commit().await.unwrap();
        assert!(first.seq < third.seq, "{} {}", first.seq, third.seq);
        let stored: Vec<(i64, Vec<u8>)> =
            sqlx::query_as("SELECT seq, payload FROM outbox_records ORDER BY seq").fetch_all(&pool).await.unwrap();
        assert_eq!(stored, vec![(first.seq, b"1".to_vec()), (third.seq, b"3".to_vec())]);
    }

    /// A database with the first `version` migrations applied, as an older release left it.
    async fn at_version(version: usize) -> sqlx::SqlitePool {
        let pool = sqlite_memory().await;
        sqlx::raw_sql(AssertSqlSafe(render(super::MIGRATIONS_TABLE, "outbox").to_string()))
            .execute(&pool)
            .await
            .unwrap();
        for super::Migration { version, name, sql: text, .. } in &super::MIGRATIONS[..version] {
            sqlx::raw_sql(AssertSqlSafe(render(text, "outbox").to_string())).execute(&pool).await.unwrap();
            sqlx::query("INSERT INTO outbox_schema_migrations (version, name, checksum) VALUES ($1, $2, $3)")
                .bind(version)
                .bind(name)
                .bind(crate::migrate::checksum(text))
                .execute(&pool)
                .await
                .unwrap();
        }
        pool
    }

    /// A database file left at version 1 (per-key counter rows) is upgraded without any key's sequence
    /// going backwards.
    #[tokio::test]
    async fn upgrading_from_version_1_keeps_every_keys_sequence_growing() {
        let pool = at_version(1).await;
        sqlx::query("INSERT INTO outbox_keys (key, last_seq) VALUES ('old', 41), ('drained', 7)")
            .execute(&pool)
            .await
            .unwrap();
        let outbox = Outbox::new(Config::default()).unwrap();
        outbox.migrate(&pool).await.unwrap();
        let mut tx = pool.begin().await.unwrap();
        let old = outbox.schedule(&mut tx, crate::NewRecord::new("old", "t", "")).await.unwrap();
        let drained = outbox.schedule(&mut tx, crate::NewRecord::new("drained", "t", "")).await.unwrap();
        tx.commit().await.unwrap();
        assert!(old.seq > 41 && drained.seq > 41, "{} {}", old.seq, drained.seq);
    }

    /// A database file left at version 1 with records still pending or FAILED (numbered per key, so two
    /// keys' records share numbers) is upgraded: every record is kept, each key's in its order, numbered
    /// past every number given out, and numbering goes on past them. Migration 7, which makes the number
    /// the table's key, failed on the shared numbers, on every start.
    #[tokio::test]
    async fn upgrading_from_version_1_with_records_left_keeps_them_in_order() {
        let pool = at_version(1).await;
        sqlx::raw_sql(
            "INSERT INTO outbox_keys (key, last_seq) VALUES ('a', 3), ('b', 2);
             INSERT INTO outbox_records (id, partition, key, seq, event_type, payload, failed_at) VALUES
                 (x'0a01', 1, 'a', 2, 't', x'', 1), (x'0a02', 1, 'a', 3, 't', x'', NULL),
                 (x'0b01', 2, 'b', 1, 't', x'', NULL), (x'0b02', 2, 'b', 2, 't', x'', NULL)",
        )
        .execute(&pool)
        .await
        .unwrap();
        let outbox = Outbox::new(Config::default()).unwrap();
        outbox.migrate(&pool).await.unwrap();
        let numbered: Vec<(Vec<u8>, String, i64)> =
            sqlx::query_as("SELECT id, key, seq FROM outbox_records ORDER BY key, seq").fetch_all(&pool).await.unwrap();
        let ids: Vec<&[u8]> = numbered.iter().map(|(id, _, _)| id.as_slice()).collect();
        assert_eq!(ids, [&[0x0a, 1][..], &[0x0a, 2], &[0x0b, 1], &[0x0b, 2]], "each key's records, in order");
        assert!(numbered.iter().all(|&(_, _, seq)| seq > 3), "past every number given out: {numbered:?}");
        let mut tx = pool.begin().await.unwrap();
        let next = outbox.schedule(&mut tx, crate::NewRecord::new("a", "t", "")).await.unwrap();
        tx.commit().await.unwrap();
        assert!(numbered.iter().all(|&(_, _, seq)| seq < next.seq), "{} after {numbered:?}", next.seq);
    }

    /// A database migrated by migration 7's first text (before it was corrected) is not refused as one
    /// whose applied SQL changed; another text still is.
    #[tokio::test]
    async fn a_migration_applied_in_its_earlier_text_is_not_refused() {
        let pool = at_version(super::MIGRATIONS.len()).await;
        let outbox = Outbox::new(Config::default()).unwrap();
        let set = "UPDATE outbox_schema_migrations SET checksum = $1 WHERE version = 7";
        sqlx::query(set).bind(super::MIGRATIONS[6].earlier[0]).execute(&pool).await.unwrap();
        outbox.migrate(&pool).await.unwrap();
        sqlx::query(set).bind(12345_i64).execute(&pool).await.unwrap();
        let refused = outbox.migrate(&pool).await.unwrap_err();
        assert!(matches!(refused, crate::Error::Migration { version: 7, .. }), "{refused:?}");
    }

    /// A database file at version 6 (numbers from a counter row) is upgraded with its pending records'
    /// numbers kept, and numbering goes on past every number the counter gave out, even to records
    /// already completed. A batch's numbers, as `schedule_batch` returns them, are the stored ones, in
    /// list order.
    #[tokio::test]
    async fn upgrading_from_version_6_numbers_on_past_the_counter() {
        let pool = at_version(6).await;
        sqlx::raw_sql(
            "INSERT INTO outbox_records (id, partition, key, seq, event_type, payload) VALUES (x'01', 1, 'k', 5, 't', x'');
             UPDATE outbox_sequence SET last = 9",
        )
        .execute(&pool)
        .await
        .unwrap();
        let outbox = Outbox::new(Config::default()).unwrap();
        outbox.migrate(&pool).await.unwrap();

        let kept: i64 = sqlx::query_scalar("SELECT seq FROM outbox_records").fetch_one(&pool).await.unwrap();
        assert_eq!(kept, 5);
        let mut tx = pool.begin().await.unwrap();
        let one = outbox.schedule(&mut tx, crate::NewRecord::new("k", "t", "")).await.unwrap();
        let batch = ["k", "other", "k"].map(|key| crate::NewRecord::new(key, "t", ""));
        let many = outbox.schedule_batch(&mut tx, &batch).await.unwrap();
        tx.commit().await.unwrap();
        assert_eq!(one.seq, 10);
        assert_eq!(many.iter().map(|s| s.seq).collect::<Vec<_>>(), [11, 12, 13]);
        for scheduled in many.iter().chain([&one]) {
            let stored: i64 = sqlx::query_scalar("SELECT seq FROM outbox_records WHERE id = $1")
                .bind(scheduled.id)
                .fetch_one(&pool)
                .await
                .unwrap();
            assert_eq!(stored, scheduled.seq, "record {}", scheduled.id);
        }
        let counters: Vec<(String, i64)> =
            sqlx::query_as("SELECT name, seq FROM sqlite_sequence").fetch_all(&pool).await.unwrap();
        assert_eq!(counters, [("outbox_records".to_string(), 13)]);
    }

    /// A `schedule` on a bare pooled connection, dropped by a timeout while it waits for the write lock
    /// (another connection holds `BEGIN IMMEDIATE`), leaves no transaction open on the connection: once
    /// the other writer commits, writes through the same pool commit, and other writers are not locked out.
    #[tokio::test]
    async fn a_schedule_dropped_while_waiting_for_the_write_lock_leaves_no_transaction_open() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("outbox.db").display());
        let options = super::options(&url).unwrap().busy_timeout(std::time::Duration::from_secs(2));
        let connect = || sqlx::sqlite::SqlitePoolOptions::new().max_connections(1).connect_with(options.clone());
        let (pool, other) = (connect().await.unwrap(), connect().await.unwrap());
        let outbox = Outbox::new(Config::default()).unwrap();
        outbox.migrate(&pool).await.unwrap();

        let holder = other.begin_with("BEGIN IMMEDIATE").await.unwrap();
        {
            let mut conn = pool.acquire().await.unwrap();
            let schedule = outbox.schedule(&mut *conn, crate::NewRecord::new("k", "t", "dropped"));
            let dropped = tokio::time::timeout(std::time::Duration::from_millis(100), schedule).await;
            assert!(dropped.is_err(), "the schedule was waiting for the write lock");
        }
        holder.commit().await.unwrap();

        let mut conn = pool.acquire().await.unwrap();
        outbox.schedule(&mut *conn, crate::NewRecord::new("k", "t", "after")).await.unwrap();
        drop(conn);
        let writer = other.begin_with("BEGIN IMMEDIATE").await.expect("no transaction of the pool holds the lock");
        writer.commit().await.unwrap();
        let payloads: Vec<Vec<u8>> =
            sqlx::query_scalar("SELECT payload FROM outbox_records").fetch_all(&other).await.unwrap();
        assert_eq!(payloads, [b"after".to_vec()]);
    }

    /// Processes that open a database file nobody has created yet, at the same moment (the first workers
    /// of a fresh deployment), all connect: a "database is locked" from the first connection's switch to
    /// WAL is waited out, not returned.
    #[tokio::test]
    async fn connections_opening_a_new_file_at_once_all_succeed() {
        for attempt in 0..30 {
            let dir = tempfile::tempdir().unwrap();
            let url = format!("sqlite://{}", dir.path().join("new.db").display());
            let opens = (0..4).map(|_| {
                let url = url.clone();
                tokio::spawn(async move {
                    let db = crate::Db::connect(&url).await?;
                    db.execute("CREATE TABLE IF NOT EXISTS t (x INTEGER)", &[]).await
                })
            });
            for opened in futures::future::join_all(opens).await {
                opened.unwrap().unwrap_or_else(|e| panic!("attempt {attempt}: {e}"));
            }
        }
    }
}
