//! The SQLite driver: its statements (`statements.rs`), the turns its writes take (`write.rs`), and how
//! they run. SQLite allows one writer at a time, which does the work PostgreSQL's row locks do: a
//! scheduling transaction holds the write lock from its first write to its commit, so sequence order is
//! commit order, and a completion checks (owner, epoch) inside its write transaction, where no epoch can
//! move before it commits.

mod statements;
mod write;

use std::str::FromStr;
use std::time::Duration;

use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqliteSynchronous};
use sqlx::{AssertSqlSafe, Connection, SqliteConnection, SqlitePool};
use tracing::info;
use uuid::Uuid;

use self::statements::MIGRATIONS_TABLE;
pub use self::statements::{SqliteStatements, render};
pub use self::write::{Write, write, write_on};
use super::{ConnectOptions, Driver, count, json, millis, statement};
use crate::error::{Error, Result};
use crate::migrate::{Migration, check_applied, checksum};
use crate::stored::{
    FailedFilter, FailedRecord, FetchedRow, Found, NewRow, Outcome, PartitionStats, Request, Runs, StatsRow, Verdict,
    Written,
};

/// The migrations of the SQLite schema, in order (`{s}` is the table prefix).
pub const MIGRATIONS: &[Migration] = &[
    Migration { version: 1, name: "initial", sql: include_str!("../../../../../migrations/sqlite/0001_initial.sql") },
    Migration {
        version: 2,
        name: "leases_requeues_sequences",
        sql: include_str!("../../../../../migrations/sqlite/0002_leases_requeues_sequences.sql"),
    },
];

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

pub(super) async fn connect(url: &str, connect: &ConnectOptions) -> Result<SqlitePool> {
    let file = options(url).map_err(|e| match e {
        Error::Database(e) => Error::BadUrl(e),
        other => other,
    })?;
    let database = format!("the SQLite database {}", file.get_filename().display());
    super::sized(connect).connect_with(file).await.map_err(|source| Error::Connect { database, source })
}

/// Busy (another writer held the lock past the busy timeout, or a read snapshot went stale before its
/// first write) and locked are worth retrying. `None`: not a SQLite error.
pub(super) fn is_transient(db: &dyn sqlx::error::DatabaseError) -> Option<bool> {
    db.try_downcast_ref::<sqlx::sqlite::SqliteError>()?;
    Some(db.code().is_some_and(|code| matches!(code.as_ref(), "5" | "6" | "261" | "262" | "517")))
}

/// SQLite has no code of its own for a missing table: "no such table". `None`: not a SQLite error.
pub(super) fn is_not_migrated(db: &dyn sqlx::error::DatabaseError) -> Option<bool> {
    db.try_downcast_ref::<sqlx::sqlite::SqliteError>()?;
    Some(db.message().starts_with("no such table"))
}

/// Inserts records on the caller's connection (see `Conn::schedule`).
///
/// The statements run in a transaction of sqlx's own (a savepoint inside the caller's transaction, or
/// `BEGIN IMMEDIATE` on a bare connection), which sqlx rolls back if this future is dropped half way
/// (say, by a timeout while waiting for the write lock): all or nothing, and cancel-safe.
pub(super) async fn schedule(
    conn: &mut SqliteConnection,
    s: &SqliteStatements,
    rows: &[NewRow<'_>],
) -> Result<Vec<(Uuid, i64)>> {
    let mut tx =
        if conn.is_in_transaction() { conn.begin().await? } else { conn.begin_with("BEGIN IMMEDIATE").await? };
    let n = count(rows.len());
    let last: i64 = sqlx::query_scalar(statement(&s.take_seqs)).bind(n).fetch_one(&mut *tx).await?;
    let mut scheduled = Vec::with_capacity(rows.len());
    for (seq, row) in (last - n + 1..).zip(rows) {
        sqlx::query(statement(&s.insert))
            .bind(row.id)
            .bind(i16::from(row.partition))
            .bind(row.key)
            .bind(seq)
            .bind(row.event_type)
            .bind(row.payload)
            .bind(&row.headers)
            .execute(&mut *tx)
            .await?;
        scheduled.push((row.id, seq));
    }
    tx.commit().await?;
    Ok(scheduled)
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
        check_applied(schema, &applied, MIGRATIONS)?;
        for m in MIGRATIONS.iter().filter(|m| !applied.iter().any(|&(v, _)| v == m.version)) {
            sqlx::raw_sql(AssertSqlSafe(render(m.sql, schema).to_string())).execute(&mut *tx).await?;
            sqlx::query(AssertSqlSafe(format!(
                "INSERT INTO {schema}_schema_migrations (version, name, checksum) VALUES ($1, $2, $3)"
            )))
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

    /// One write transaction: each (partition, instance, epoch) checked, then the outcomes of those that
    /// hold, one statement each.
    pub(crate) async fn complete(&self, outcomes: &[Outcome]) -> Result<Written> {
        let s = self.statements;
        let mut tx = write(self.pool).await?;
        let grants: std::collections::BTreeSet<_> = outcomes.iter().map(|o| o.grant()).collect();
        let mut written = Written::default();
        for (partition, instance, epoch) in grants {
            let held = sqlx::query(statement(&s.fence))
                .bind(i16::from(partition))
                .bind(instance)
                .bind(epoch)
                .fetch_optional(&mut *tx)
                .await?;
            if held.is_some() {
                written.held.insert((partition, instance, epoch));
            }
        }
        for o in outcomes.iter().filter(|o| written.held.contains(&o.grant())) {
            let row = match &o.verdict {
                Verdict::Delivered | Verdict::Fallback => {
                    if let Some(keep) = &s.keep {
                        let query = sqlx::query(statement(keep)).bind(o.id).bind(o.attempts);
                        query.bind(o.verdict.completed_as()).execute(&mut *tx).await?;
                    }
                    sqlx::query(statement(&s.delete)).bind(o.id).fetch_optional(&mut *tx).await?
                }
                Verdict::Retry { delay, error } => {
                    sqlx::query(statement(&s.fail))
                        .bind(o.id)
                        .bind(o.attempts)
                        .bind(error)
                        .bind(false)
                        .bind(millis(*delay))
                        .bind(o.requeues)
                        .fetch_optional(&mut *tx)
                        .await?
                }
                Verdict::Failed { error } => {
                    sqlx::query(statement(&s.fail))
                        .bind(o.id)
                        .bind(o.attempts)
                        .bind(error)
                        .bind(true)
                        .bind(0_i64)
                        .bind(o.requeues)
                        .fetch_optional(&mut *tx)
                        .await?
                }
            };
            if row.is_some() {
                written.ids.insert(o.id);
            }
        }
        tx.commit().await?;
        Ok(written)
    }

    pub(crate) async fn failed(&self, filter: &FailedFilter) -> Result<Vec<FailedRecord>> {
        Ok(sqlx::query_as(statement(&self.statements.list_failed))
            .bind(filter.key.as_deref())
            .bind(filter.partition.map(i16::from))
            .bind(filter.limit.unwrap_or(100))
            .fetch_all(self.pool)
            .await?)
    }

    pub(crate) async fn requeue(&self, id: Option<Uuid>, key: Option<&str>) -> Result<u64> {
        let mut tx = write(self.pool).await?;
        let query = sqlx::query(statement(&self.statements.requeue)).bind(id).bind(key);
        let requeued = query.execute(&mut *tx).await?.rows_affected();
        tx.commit().await?;
        Ok(requeued)
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
        let mut tx = write(self.pool).await?;
        let query = sqlx::query(statement(&self.statements.purge)).bind(millis(retention)).bind(count(limit));
        let purged = query.execute(&mut *tx).await?.rows_affected();
        tx.commit().await?;
        Ok(purged)
    }

    /// SQLite keeps no per-key rows: its single writer serialises the writers of every key.
    pub(crate) async fn prune_keys(&self, _limit: usize) -> Result<u64> {
        Ok(0)
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

    /// A migrated outbox on a private in-memory database.
    async fn migrated() -> (sqlx::SqlitePool, Outbox) {
        let pool = sqlite_memory().await;
        let outbox = Outbox::new(Config::default()).unwrap();
        outbox.migrate(Db::from(&pool)).await.unwrap();
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
            let seek = "SEARCH k USING COVERING INDEX outbox_records_partition_key_seq (partition=? AND key>?)";
            assert!(plan.contains(seek), "{plan}");
            assert!(plan.contains("RECURSIVE STEP"), "{plan}");
            let scans = |alias: &str| {
                plan.lines().any(|line| {
                    let words: Vec<&str> = line.split_whitespace().collect();
                    words.windows(2).any(|w| w[0].ends_with("SCAN") && w[1] == alias)
                })
            };
            for records in ["r", "k", "h", "x"] {
                assert!(!scans(records), "records ({records}) scanned: {plan}");
            }
            // (A Bloom filter over the skipped keys' list is fine; one built on a table scans it.)
            // Only the list of served partitions (at most 256) is sorted, never records.
            let sorts = plan.lines().filter(|l| l.contains("TEMP B-TREE") && !l.contains("json_group_array(ORDER BY)"));
            assert!(!plan.contains("BLOOM FILTER ON") && sorts.count() == 0, "{plan}");
        }
    }

    /// A batch that fails part way writes nothing, even when the caller commits after the error; and
    /// no sequence number is used up.
    #[tokio::test]
    async fn a_failed_batch_leaves_nothing_behind() {
        let (pool, outbox) = migrated().await;
        sqlx::query(
            "CREATE TRIGGER refuse BEFORE INSERT ON outbox_records WHEN NEW.key = 'refused'
             BEGIN SELECT RAISE(ABORT, 'refused by the test'); END",
        )
        .execute(&pool)
        .await
        .unwrap();
        let batch = [crate::NewRecord::new("k", "t", "1"), crate::NewRecord::new("refused", "t", "2")];
        let mut tx = pool.begin().await.unwrap();
        assert!(outbox.schedule_batch(&mut tx, &batch).await.is_err());
        tx.commit().await.unwrap();
        let counts: (i64, i64) =
            sqlx::query_as("SELECT (SELECT count(*) FROM outbox_records), (SELECT last FROM outbox_sequence)")
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

    /// A database file left at version 1 (per-key counter rows) is upgraded without any key's sequence
    /// going backwards.
    #[tokio::test]
    async fn upgrading_from_version_1_keeps_every_keys_sequence_growing() {
        let pool = sqlite_memory().await;
        let super::Migration { version, name, sql: text } = super::MIGRATIONS[0];
        sqlx::raw_sql(AssertSqlSafe(render(super::MIGRATIONS_TABLE, "outbox").to_string()))
            .execute(&pool)
            .await
            .unwrap();
        sqlx::raw_sql(AssertSqlSafe(render(text, "outbox").to_string())).execute(&pool).await.unwrap();
        sqlx::query("INSERT INTO outbox_schema_migrations (version, name, checksum) VALUES ($1, $2, $3)")
            .bind(version)
            .bind(name)
            .bind(crate::migrate::checksum(text))
            .execute(&pool)
            .await
            .unwrap();
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
}
