//! The PostgreSQL driver: its statements (`statements.rs`) and how they run. Each key's writers
//! serialise on the key's lock row, every worker write locks its partitions' rows `FOR SHARE` at the
//! (owner, epoch) it holds, and the processor's statements run with JIT compilation off.

mod statements;

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::{PgArguments, PgConnectOptions, PgListener, PgNotification, PgPoolOptions};
use sqlx::{Connection, PgConnection, PgPool, Postgres, Transaction};
use tokio::sync::watch;
use tracing::{debug, info, warn};
use uuid::Uuid;

pub use self::statements::{PgStatements, quoted};
use super::{ConnectOptions, Driver, count, millis, statement};
use crate::assignment::{Epoch, InstanceId};
use crate::error::{Error, Result};
use crate::migrate::{self, Migration, checksum, recorded_columns, to_apply};
use crate::notice::{Channel, Wakeups};
use crate::stored::{
    FAILED_PAGE_PAYLOAD_BYTES, FailedFilter, FailedRecord, FetchedRow, Found, NewRow, Outcome, PartitionStats, Request,
    Runs, StatsRow, Written, fits_one_statement,
};

/// The migrations of the PostgreSQL schema, in order.
pub const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        name: "initial",
        sql: include_str!("../../../../../migrations/postgres/0001_initial.sql"),
        earlier: &[],
        older_versions_run: false,
    },
    Migration {
        version: 2,
        name: "leases_requeues_sequences",
        sql: include_str!("../../../../../migrations/postgres/0002_leases_requeues_sequences.sql"),
        earlier: &[],
        older_versions_run: false,
    },
    Migration {
        version: 3,
        name: "delivery_times",
        sql: include_str!("../../../../../migrations/postgres/0003_delivery_times.sql"),
        earlier: &[],
        older_versions_run: false,
    },
    Migration {
        version: 4,
        name: "inbox",
        sql: include_str!("../../../../../migrations/postgres/0004_inbox.sql"),
        earlier: &[],
        older_versions_run: false,
    },
    Migration {
        version: 5,
        name: "delivered counts",
        sql: include_str!("../../../../../migrations/postgres/0005_delivered_counts.sql"),
        earlier: &[],
        older_versions_run: false,
    },
    Migration {
        version: 6,
        name: "takeovers",
        sql: include_str!("../../../../../migrations/postgres/0006_takeovers.sql"),
        earlier: &[],
        older_versions_run: false,
    },
    Migration {
        version: 7,
        name: "ended leases",
        sql: include_str!("../../../../../migrations/postgres/0007_ended_leases.sql"),
        earlier: &[],
        older_versions_run: false,
    },
    Migration {
        version: 8,
        name: "migration_compatibility",
        sql: include_str!("../../../../../migrations/postgres/0008_migration_compatibility.sql"),
        earlier: &[],
        // Adds a column with a default, which older libraries ignore (none reads this flag: a library
        // that reads flags knows this migration).
        older_versions_run: true,
    },
    Migration {
        version: 9,
        name: "due_heads",
        sql: include_str!("../../../../../migrations/postgres/0009_due_heads.sql"),
        earlier: &[],
        // Adds indexes; the index older libraries walk stays.
        older_versions_run: true,
    },
    Migration {
        version: 10,
        name: "quiet_periods",
        sql: include_str!("../../../../../migrations/postgres/0010_quiet_periods.sql"),
        earlier: &[],
        // Adds a column older libraries ignore. Alone on the schema they run as before; beside newer
        // ones (a rolling deploy) they neither set nor honour it.
        older_versions_run: true,
    },
];

/// The channels a listener hears (besides its probe's).
const CHANNELS: [Channel; 2] = [Channel::Wake, Channel::Nudge];

/// The most a statement's message carries: PostgreSQL's largest message (1 GiB less a byte), less room
/// for the statement's own bytes.
const STATEMENT_BYTES: usize = (1 << 30) - (1 << 20);

/// Arbitrary constant namespacing the migrators' advisory lock (ASCII "outbox").
const LOCK_NAMESPACE: i32 = 0x6f75_7462;

pub(super) async fn connect(url: &str, options: &ConnectOptions) -> Result<PgPool> {
    let server = PgConnectOptions::from_str(url).map_err(Error::BadUrl)?;
    let database = super::server("PostgreSQL", server.get_database(), server.get_host(), server.get_port());
    super::sized(options, true).connect_with(server).await.map_err(|source| Error::Connect { database, source })
}

/// SQLSTATE classes 08 (connection), 40 (serialisation failure, deadlock), 53 (insufficient
/// resources), 57P01..03 (shutdown, crash, cannot connect now), 57014 (cancelled, as by
/// `statement_timeout`), 55P03 (`lock_timeout`), 25P03 and 25P04 (a session ended for a transaction
/// idle, or open, too long: `idle_in_transaction_session_timeout`, which the library sets, and
/// PostgreSQL 17's `transaction_timeout`) and 25006 (a read-only transaction: a standby, or a primary
/// turned read-only, during a failover) are worth retrying. `None`: not a PostgreSQL error.
pub(super) fn is_transient(db: &dyn sqlx::error::DatabaseError) -> Option<bool> {
    let db = db.try_downcast_ref::<sqlx::postgres::PgDatabaseError>()?;
    let code = db.code();
    Some(
        ["08", "40", "53", "57P"].iter().any(|class| code.starts_with(class))
            || matches!(code, "57014" | "55P03" | "25P03" | "25P04" | "25006"),
    )
}

/// 57014 (a statement cancelled, as by `statement_timeout`) and 55P03 (`lock_timeout`): the work did
/// not fit its time. `None`: not a PostgreSQL error.
pub(super) fn is_time_limit(db: &dyn sqlx::error::DatabaseError) -> Option<bool> {
    let db = db.try_downcast_ref::<sqlx::postgres::PgDatabaseError>()?;
    Some(matches!(db.code(), "57014" | "55P03"))
}

/// 25006: a write in a read-only transaction, as a standby answers (see `driver::retire_before`).
/// `None`: not a PostgreSQL error.
pub(super) fn is_read_only(db: &dyn sqlx::error::DatabaseError) -> Option<bool> {
    let db = db.try_downcast_ref::<sqlx::postgres::PgDatabaseError>()?;
    Some(db.code() == "25006")
}

/// 42P01 undefined table, 3F000 undefined schema, 42703 undefined column (a schema that a later
/// migration has not reached). `None`: not a PostgreSQL error.
pub(super) fn is_not_migrated(db: &dyn sqlx::error::DatabaseError) -> Option<bool> {
    let db = db.try_downcast_ref::<sqlx::postgres::PgDatabaseError>()?;
    Some(matches!(db.code(), "42P01" | "3F000" | "42703"))
}

/// Schedules in one statement on the caller's connection (see `Conn::schedule`).
pub(super) async fn schedule(
    conn: &mut PgConnection,
    s: &PgStatements,
    rows: &[NewRow<'_>],
) -> Result<Vec<(Uuid, i64)>> {
    if let [row] = rows {
        let one = sqlx::query_as(statement(&s.schedule_one))
            .bind(row.id)
            .bind(i16::from(row.partition))
            .bind(row.key)
            .bind(row.event_type)
            .bind(row.payload)
            .bind(row.headers.as_str())
            .bind(row.deliver_at)
            .bind(row.deliver_after_ms);
        return Ok(vec![one.fetch_one(conn).await?]);
    }
    // Over it, the server resets the connection: an error that looks worth retrying, and never passes.
    fits_one_statement(rows, 1, STATEMENT_BYTES)?;
    Ok(sqlx::query_as(statement(&s.schedule))
        .bind(rows.iter().map(|r| r.id).collect::<Vec<_>>())
        .bind(rows.iter().map(|r| i16::from(r.partition)).collect::<Vec<_>>())
        .bind(rows.iter().map(|r| r.key).collect::<Vec<_>>())
        .bind(rows.iter().map(|r| r.event_type).collect::<Vec<_>>())
        .bind(rows.iter().map(|r| r.payload).collect::<Vec<_>>())
        .bind(rows.iter().map(|r| r.headers.as_str()).collect::<Vec<_>>())
        .bind(rows.iter().map(|r| r.deliver_at).collect::<Vec<_>>())
        .bind(rows.iter().map(|r| r.deliver_after_ms).collect::<Vec<_>>())
        .fetch_all(conn)
        .await?)
}

/// One connection of its own for the processor's fetches, with JIT off for its session (see
/// `Db::fetch_pool`); opened at the first fetch, and again after it is lost. Its statements end on the
/// server after `query_timeout`, when the processor gives them up: a fetch given up waiting for a table
/// lock (`REINDEX`, `VACUUM FULL`) went on waiting, its connection closed, and every poll added one.
pub(super) fn fetch_pool(pool: &PgPool, query_timeout: Duration) -> PgPool {
    let options = ConnectOptions { max_connections: 1, acquire_timeout: pool.options().get_acquire_timeout() };
    let limit = format!("{}ms", query_timeout.as_millis().max(1));
    let session = [("jit", "off"), ("statement_timeout", limit.as_str())];
    super::sized(&options, true).connect_lazy_with((*pool.connect_options()).clone().options(session))
}

/// Accepts a message on the caller's connection (see `Conn::accept`).
pub(super) async fn accept(conn: &mut PgConnection, s: &PgStatements, source: &str, message_id: &str) -> Result<bool> {
    let done = sqlx::query(statement(&s.accept)).bind(source).bind(message_id).execute(conn).await?;
    Ok(done.rows_affected() == 1)
}

/// Whether `conn` is inside a transaction: sqlx's own, or the application's `BEGIN`, which a savepoint
/// tells (PostgreSQL refuses one outside a transaction block, 25P01, and changes nothing).
pub(super) async fn in_a_transaction(conn: &mut PgConnection) -> Result<bool> {
    if conn.is_in_transaction() {
        return Ok(true);
    }
    match sqlx::raw_sql("SAVEPOINT outbox_probe").execute(&mut *conn).await {
        Ok(_) => {
            sqlx::raw_sql("RELEASE SAVEPOINT outbox_probe").execute(conn).await?;
            Ok(true)
        }
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("25P01") => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// Accepts a key's event in order on the caller's connection (see `Conn::accept_in_order`).
pub(super) async fn accept_in_order(
    conn: &mut PgConnection,
    s: &PgStatements,
    source: &str,
    key: &str,
    seq: i64,
) -> Result<bool> {
    let done = sqlx::query(statement(&s.accept_in_order)).bind(source).bind(key).bind(seq).execute(conn).await?;
    Ok(done.rows_affected() == 1)
}

/// Starts a transaction of the library's own on the application's pool (the processor's completions,
/// purges) on `conn` with `s.begin`: at READ COMMITTED whatever the database's default (a row changed
/// under a statement is checked again, where REPEATABLE READ fails the transaction: the fence, the
/// purges, the pruning's key rows), JIT compilation off (see `Db::fetch_pool`), and the server giving
/// up when the client does, after `query_timeout`:
/// - the session is ended if the transaction sits idle that long. A worker whose host vanished
///   mid-completion (no FIN, no RST) otherwise leaves its locks held until the server's TCP keepalive
///   gives up, hours by default: its partitions' rows stay locked `FOR SHARE`, which every acquisition
///   skips, so nobody delivers them;
/// - a lock is waited for, and a statement runs, at most that long. A statement whose client gave up
///   otherwise goes on for ever (a table lock of maintenance's waited for), its connection taken and
///   its partitions' rows locked, and each retry adds one.
///
/// Run it under `finishing`, which closes the connection if it is cut short.
pub(super) async fn begin<'c>(conn: &'c mut PgConnection, s: &PgStatements) -> Result<Transaction<'c, Postgres>> {
    Ok(conn.begin_with(statement(&s.begin)).await?)
}

/// Runs `query` in a transaction of [`begin`]'s; returns the rows it affected.
async fn bounded(pool: &PgPool, s: &PgStatements, query: sqlx::query::Query<'_, Postgres, PgArguments>) -> Result<u64> {
    within(pool, &s.begin, async |tx| Ok(query.execute(tx).await?.rows_affected())).await
}

/// Runs `work` under `finishing` in a transaction begun with `begin` (`PgStatements::begin` or
/// `begin_operator`), whose limits the server holds it to when the client is gone.
async fn within<T>(
    pool: &PgPool,
    begin: &Arc<str>,
    work: impl AsyncFnOnce(&mut PgConnection) -> Result<T>,
) -> Result<T> {
    super::finishing(pool, async |conn| {
        let mut tx = conn.begin_with(statement(begin)).await?;
        let done = work(&mut tx).await?;
        tx.commit().await?;
        Ok(done)
    })
    .await
}

impl Driver<'_, PgPool, PgStatements> {
    pub(crate) async fn notify(&self, channel: Channel, notice: &str) -> Result<()> {
        self.notify_on(self.statements.channel(channel), notice).await
    }

    async fn notify_on(&self, channel: &str, notice: &str) -> Result<()> {
        let query = sqlx::query(statements::NOTIFY).bind(channel).bind(notice);
        super::finishing(self.pool, async |conn| {
            query.execute(conn).await?;
            Ok(())
        })
        .await
    }

    /// Listens on a connection of its own until it is lost: `PgListener` keeps the connection it is
    /// given for its whole life, so it gets a one-connection pool, not one of the processor's.
    /// It listens only once it has heard a notice sent from another connection, within `check.1`:
    /// behind a pooler in transaction mode (PgBouncer's, Supavisor's) `LISTEN` is answered and the
    /// server session then goes to other clients, so nothing sent later arrives, and the processor
    /// would count on wake-ups that never come.
    /// A connection that is dropped without a word (a NAT's or load balancer's idle timeout, a host
    /// gone) never ends `try_recv` either. So it must answer a statement every `check.0` (which also
    /// keeps it from looking idle), within `check.1`.
    pub(crate) async fn listen(
        &self,
        wakeups: &Wakeups,
        listening: &watch::Sender<bool>,
        (every, within): (Duration, Duration),
    ) -> Result<()> {
        let own = PgPoolOptions::new().max_connections(1).connect_lazy_with((*self.pool.connect_options()).clone());
        let mut listener = PgListener::connect_with(&own).await?;
        // A channel of this outbox's own, so that no other outbox's listener hears its probe.
        let probe = wakeups.probe_channel();
        let channels = CHANNELS.map(|c| self.statements.channel(c));
        listener.listen_all(channels.into_iter().chain([probe.as_str()])).await?;
        let heard = async {
            self.notify_on(&probe, "").await?;
            loop {
                match listener.try_recv().await? {
                    Some(notification) if notification.channel() == probe => return Ok(true),
                    Some(notification) => self.pass_on(wakeups, &notification),
                    None => return Ok::<_, Error>(false),
                }
            }
        };
        let work = "hearing a notice sent to the wake-up connection from another (behind a pooler in \
                    transaction mode, such as PgBouncer's, LISTEN hears none: it needs a session of its own)";
        if !tokio::time::timeout(within, heard).await.map_err(|_| Error::QueryTimeout { work, after: within })?? {
            return Ok(());
        }
        listening.send_replace(true);
        // Notices sent before this connection listened are lost: look once at everything.
        wakeups.missed();
        let mut check = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                heard = listener.try_recv() => {
                    let Some(notification) = heard? else { return Ok(()) };
                    self.pass_on(wakeups, &notification);
                }
                _ = check.tick() => {
                    let answered = tokio::time::timeout(within, sqlx::query("SELECT 1").execute(&mut listener)).await;
                    answered.map_err(|_| Error::QueryTimeout { work: "checking the wake-up connection", after: within })??;
                }
            }
        }
    }

    /// Tells this process's processors or rounds a notice heard on one of the schema's channels.
    fn pass_on(&self, wakeups: &Wakeups, notification: &PgNotification) {
        match CHANNELS.into_iter().find(|&c| self.statements.channel(c) == notification.channel()) {
            Some(channel) => wakeups.heard(channel, notification.payload()),
            None => debug!(channel = notification.channel(), "ignored a notice on an unknown channel"),
        }
    }

    /// Applies the missing migrations in one transaction, one migrator of the schema at a time. A
    /// statement that waits [`migrate::LOCK_TIMEOUT`] for a table lock gives up, and with it the whole
    /// transaction, which is tried again after a pause ([`migrate::patiently`]).
    pub(crate) async fn migrate(&self) -> Result<()> {
        migrate::patiently(self.statements.schema(), || self.migrate_once()).await
    }

    /// Under `finishing`: a migration cut short during its `BEGIN` would otherwise hand the connection
    /// back to the pool inside a transaction (sqlx#4393).
    async fn migrate_once(&self) -> Result<()> {
        super::finishing(self.pool, async |conn| self.apply(conn).await).await
    }

    async fn apply(&self, conn: &mut PgConnection) -> Result<()> {
        let schema = self.statements.schema();
        // READ COMMITTED whatever the database's default, so that each statement sees what a migrator
        // that held the lock before committed: at REPEATABLE READ the snapshot is taken by the lock's
        // own statement, before it waits.
        let mut tx = conn.begin_with("BEGIN ISOLATION LEVEL READ COMMITTED").await?;
        // Serialise migrators of this schema across the cluster; released at commit.
        sqlx::query("SELECT pg_advisory_xact_lock($1, hashtext($2))")
            .bind(LOCK_NAMESPACE)
            .bind(schema)
            .execute(&mut *tx)
            .await?;
        let timeout = migrate::LOCK_TIMEOUT.as_millis();
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("SET LOCAL lock_timeout = {timeout}"))).execute(&mut *tx).await?;
        let ident = self.statements.schema_ident();
        // Each created only if missing: `CREATE … IF NOT EXISTS` wants the right to create even when the
        // object is there, which an application's role seldom has (it runs `migrate` at every start).
        let (schema_exists, table_exists): (bool, bool) = sqlx::query_as(
            "SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1),
                    EXISTS (SELECT 1 FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                            WHERE n.nspname = $1 AND c.relname = 'schema_migrations')",
        )
        .bind(schema)
        .fetch_one(&mut *tx)
        .await?;
        if !schema_exists {
            sqlx::query(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {ident}"))).execute(&mut *tx).await?;
        }
        if !table_exists {
            sqlx::query(statement(&self.statements.migrations_table)).execute(&mut *tx).await?;
        }
        let applied: Vec<(i64, i64)> =
            sqlx::query_as(sqlx::AssertSqlSafe(format!("SELECT version, checksum FROM {ident}.schema_migrations")))
                .fetch_all(&mut *tx)
                .await?;
        let flagged = format!("SELECT version FROM {ident}.schema_migrations WHERE older_versions_run");
        let read_flags = async || Ok(sqlx::query_scalar(sqlx::AssertSqlSafe(flagged)).fetch_all(&mut *tx).await?);
        let pending = to_apply(schema, &applied, MIGRATIONS, read_flags).await?;
        sqlx::query(sqlx::AssertSqlSafe(format!("SET LOCAL search_path TO {ident}"))).execute(&mut *tx).await?;
        for m in pending {
            sqlx::raw_sql(m.sql).execute(&mut *tx).await.inspect_err(|e| {
                warn!(schema, version = m.version, name = m.name, error = %e, "outbox migration failed; none of this run's is kept");
            })?;
            let (columns, flag) = recorded_columns(m);
            let record = format!("INSERT INTO {ident}.schema_migrations ({columns}) VALUES ($1, $2, $3{flag})");
            sqlx::query(sqlx::AssertSqlSafe(record))
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

    pub(crate) async fn fetch(&self, request: &Request) -> Result<Found> {
        let partitions: Vec<i16> = request.partitions.iter().map(|p| i16::from(p.0)).collect();
        let epochs: Vec<Epoch> = request.partitions.iter().map(|p| p.1).collect();
        let cursors: Vec<Option<&str>> = request.partitions.iter().map(|p| p.2.as_deref()).collect();
        super::finishing(self.pool, async |conn| {
            let rows = sqlx::query_as::<_, FetchedRow>(statement(&self.statements.fetch))
                .bind(&partitions)
                .bind(&epochs)
                .bind(&cursors)
                .bind(request.instance)
                .bind(&request.exclude)
                .bind(count(request.limit))
                .bind(count(request.followers))
                .bind(count(request.budget))
                .fetch(conn);
            // The statement already cut each run to the byte budget; the collector groups rows by key.
            Runs::collect(rows, request).await
        })
        .await
    }

    /// Completions in one fenced statement, failures in another, one transaction.
    pub(crate) async fn complete(&self, outcomes: &[Outcome]) -> Result<Written> {
        let (done, failures): (Vec<&Outcome>, Vec<&Outcome>) = outcomes.iter().partition(|o| o.verdict.completes());
        super::finishing(self.pool, async |conn| self.write_outcomes(conn, &done, &failures).await).await
    }

    async fn write_outcomes(
        &self,
        conn: &mut PgConnection,
        done: &[&Outcome],
        failures: &[&Outcome],
    ) -> Result<Written> {
        let mut written = Written::default();
        let mut tx = begin(conn, self.statements).await?;
        if !done.is_empty() {
            let (partitions, instances, epochs) = fence_arguments(done);
            let ids: Vec<Uuid> = done.iter().map(|o| o.id).collect();
            let completed_as: Vec<&str> = done.iter().map(|o| o.verdict.completed_as()).collect();
            let attempts: Vec<i32> = done.iter().map(|o| o.attempts).collect();
            let rows: Vec<FencedRow> = sqlx::query_as(statement(&self.statements.complete))
                .bind(&partitions)
                .bind(&instances)
                .bind(&epochs)
                .bind(&ids)
                .bind(&completed_as)
                .bind(&attempts)
                .fetch_all(&mut *tx)
                .await?;
            written.merge(FencedRow::collect(rows));
        }
        if !failures.is_empty() {
            let (partitions, instances, epochs) = fence_arguments(failures);
            let mut ids = Vec::with_capacity(failures.len());
            let mut values = serde_json::Map::with_capacity(failures.len());
            for o in failures {
                let Some(u) = o.verdict.still_queued() else { continue };
                ids.push(o.id);
                let row = serde_json::json!([o.attempts, o.requeues, u.error, millis(u.delay), u.failed]);
                values.insert(o.id.to_string(), row);
            }
            let rows: Vec<FencedRow> = sqlx::query_as(statement(&self.statements.fail))
                .bind(&partitions)
                .bind(&instances)
                .bind(&epochs)
                .bind(&ids)
                .bind(sqlx::types::Json(values))
                .fetch_all(&mut *tx)
                .await?;
            written.merge(FencedRow::collect(rows));
        }
        tx.commit().await?;
        Ok(written)
    }

    /// Under `finishing`, as every operator call, and waiting for a lock at most `query_timeout` on the
    /// server: given up by its caller (waiting for a table lock, say), one kept its place in the pool
    /// until the server finished, and a closed connection alone leaves it waiting there until the lock
    /// goes; each refresh of the operator page added one.
    pub(crate) async fn failed(&self, filter: &FailedFilter) -> Result<Vec<FailedRecord>> {
        let query = sqlx::query_as(statement(&self.statements.list_failed))
            .bind(filter.key.as_deref())
            .bind(filter.partition.map(i16::from))
            .bind(filter.limit.unwrap_or(100))
            .bind(filter.after.as_ref().map(|a| i16::from(a.partition)))
            .bind(filter.after.as_ref().map(|a| a.key.as_str()))
            .bind(filter.after.as_ref().map(|a| a.seq))
            .bind(filter.payloads)
            .bind(count(FAILED_PAGE_PAYLOAD_BYTES));
        within(self.pool, &self.statements.begin_operator, async |conn| Ok(query.fetch_all(conn).await?)).await
    }

    /// Requeues the FAILED record `id`, or those of `key`.
    pub(crate) async fn requeue(&self, id: Option<Uuid>, key: Option<&str>) -> Result<u64> {
        let query = sqlx::query(statement(&self.statements.requeue)).bind(id).bind(key);
        within(self.pool, &self.statements.begin_operator, async |conn| Ok(query.execute(conn).await?.rows_affected()))
            .await
    }

    pub(crate) async fn requeue_batch(&self, after: &(i16, String, i64), limit: usize) -> Result<super::RequeuedBatch> {
        let query = sqlx::query_as(statement(&self.statements.requeue_all))
            .bind(after.0)
            .bind(&after.1)
            .bind(after.2)
            .bind(count(limit));
        let row: Option<(i64, i16, String, i64, i64)> =
            within(self.pool, &self.statements.begin_operator, async |conn| Ok(query.fetch_optional(conn).await?))
                .await?;
        Ok(match row {
            None => super::RequeuedBatch { read: 0, requeued: 0, last: None },
            Some((read, partition, key, seq, requeued)) => super::RequeuedBatch {
                read: read.try_into().unwrap_or(0),
                requeued: requeued.try_into().unwrap_or(0),
                last: Some((partition, key, seq)),
            },
        })
    }

    pub(crate) async fn skip(&self, id: Uuid) -> Result<bool> {
        let query = sqlx::query(statement(&self.statements.skip)).bind(id);
        within(self.pool, &self.statements.begin_operator, async |conn| Ok(query.fetch_optional(conn).await?.is_some()))
            .await
    }

    pub(crate) async fn stats(&self) -> Result<Vec<PartitionStats>> {
        let query = sqlx::query_as::<_, StatsRow>(statement(&self.statements.stats));
        let operator = &self.statements.begin_operator;
        let rows = within(self.pool, operator, async |conn| Ok(query.fetch_all(conn).await?)).await?;
        Ok(rows.into_iter().map(PartitionStats::from).collect())
    }

    pub(crate) async fn purge(&self, retention: Duration, limit: usize) -> Result<u64> {
        let query = sqlx::query(statement(&self.statements.purge)).bind(millis(retention)).bind(count(limit));
        bounded(self.pool, self.statements, query).await
    }

    pub(crate) async fn purge_inbox(&self, retention: Duration, limit: usize) -> Result<u64> {
        let query = sqlx::query(statement(&self.statements.purge_inbox)).bind(millis(retention)).bind(count(limit));
        bounded(self.pool, self.statements, query).await
    }

    pub(crate) async fn prune_keys(&self, limit: usize, after: &str) -> Result<super::KeysPruned> {
        let query = sqlx::query_as(statement(&self.statements.prune_keys)).bind(count(limit)).bind(after);
        let (read, last, deleted): (i64, Option<String>, i64) =
            within(self.pool, &self.statements.begin, async |tx| Ok(query.fetch_one(tx).await?)).await?;
        Ok(super::KeysPruned { read: read.try_into().unwrap_or(0), deleted: deleted.try_into().unwrap_or(0), last })
    }
}

/// A row of a fenced write's answer: a record it wrote, or a (partition, owner, epoch) its fence held.
#[derive(sqlx::FromRow)]
struct FencedRow {
    id: Option<Uuid>,
    partition: Option<i16>,
    owner: Option<InstanceId>,
    epoch: Option<Epoch>,
}

impl FencedRow {
    fn collect(rows: Vec<FencedRow>) -> Written {
        let mut written = Written::default();
        for row in rows {
            match row {
                FencedRow { id: Some(id), .. } => {
                    written.ids.insert(id);
                }
                FencedRow { partition: Some(p), owner: Some(owner), epoch: Some(epoch), .. } => {
                    // The fence's own partition numbers, so always in range.
                    if let Ok(p) = crate::partition::Partition::try_from(p) {
                        written.held.insert((p, owner, epoch));
                    }
                }
                FencedRow { .. } => {}
            }
        }
        written
    }
}

/// The distinct (partition, instance, epoch) of a batch, as the fence's argument arrays.
fn fence_arguments(outcomes: &[&Outcome]) -> (Vec<i16>, Vec<InstanceId>, Vec<Epoch>) {
    let grants: std::collections::BTreeSet<_> = outcomes.iter().map(|o| o.grant()).collect();
    let mut arguments = (Vec::new(), Vec::new(), Vec::new());
    for (p, instance, epoch) in grants {
        arguments.0.push(i16::from(p));
        arguments.1.push(instance);
        arguments.2.push(epoch);
    }
    arguments
}

#[cfg(test)]
mod tests {
    use sqlx::PgPool;

    use super::MIGRATIONS;
    use crate::driver::statement;
    use crate::migrate::checksum;
    use crate::{Config, NewRecord, Outbox, partition_of};

    /// A database left at version 1 by an older library (per-key counter rows) is upgraded without any
    /// key's sequence going backwards: the new sequence starts above every number given out.
    #[sqlx::test(migrations = false)]
    async fn upgrading_from_version_1_keeps_every_keys_sequence_growing(pool: PgPool) {
        let outbox = Outbox::new(Config::default()).unwrap();
        let mut tx = pool.begin().await.unwrap();
        sqlx::query("CREATE SCHEMA outbox").execute(&mut *tx).await.unwrap();
        sqlx::query(statement(&outbox.statements().postgres.migrations_table)).execute(&mut *tx).await.unwrap();
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

    /// The last migration undone, as on a database the new release has not migrated yet.
    async fn migrations_behind(pool: &PgPool) -> Outbox {
        let outbox = Outbox::new(Config::default()).unwrap();
        outbox.migrate(pool).await.unwrap();
        let [.., last] = MIGRATIONS else { panic!("a migration at least") };
        assert_eq!(last.name, "quiet_periods", "the undo below is the last one's");
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "ALTER TABLE outbox.partitions DROP COLUMN quiet_until;
             DELETE FROM outbox.schema_migrations WHERE version = {}",
            last.version
        )))
        .execute(pool)
        .await
        .unwrap();
        outbox
    }

    /// Migrators that start together each see what the one before them applied, whatever the
    /// database's default isolation: at REPEATABLE READ the second one's snapshot, taken as it asked for
    /// the migrators' lock, predated the first one's commit, and it applied the migration again.
    #[sqlx::test(migrations = false)]
    async fn migrators_see_each_others_work_at_any_default_isolation(pool: PgPool) {
        let outbox = migrations_behind(&pool).await;
        let fresh = at_repeatable_read(&pool).await;
        let (first, second) = tokio::join!(outbox.migrate(&fresh), outbox.migrate(&fresh));
        first.unwrap();
        second.unwrap();
    }

    /// A pool of new connections to `pool`'s database, made REPEATABLE READ by default.
    async fn at_repeatable_read(pool: &PgPool) -> PgPool {
        let database: String = sqlx::query_scalar("SELECT current_database()").fetch_one(pool).await.unwrap();
        let isolation = format!("ALTER DATABASE \"{database}\" SET default_transaction_isolation = 'repeatable read'");
        sqlx::raw_sql(sqlx::AssertSqlSafe(isolation)).execute(pool).await.unwrap();
        let options = pool.connect_options().as_ref().clone();
        sqlx::postgres::PgPoolOptions::new().max_connections(4).connect_with(options).await.unwrap()
    }

    /// The library's own transactions read at READ COMMITTED whatever the database's default: at
    /// REPEATABLE READ, a key row a producer updated after the pruning's snapshot was taken failed the
    /// whole pass with a serialization error (40001) instead of being checked again, and so did purges
    /// and completions meeting a row changed under them.
    #[sqlx::test(migrations = false)]
    async fn pruning_goes_on_past_a_key_a_producer_just_wrote_at_any_default_isolation(pool: PgPool) {
        let outbox = Outbox::new(Config::default()).unwrap();
        outbox.migrate(&pool).await.unwrap();
        let pool = at_repeatable_read(&pool).await;
        sqlx::query("INSERT INTO outbox.keys (key, partition) VALUES ('k', $1)")
            .bind(i16::from(partition_of("k")))
            .execute(&pool)
            .await
            .unwrap();
        // The pruning takes its snapshot, then waits for the records table behind this lock.
        let mut holder = pool.begin().await.unwrap();
        sqlx::query("LOCK TABLE outbox.records IN ACCESS EXCLUSIVE MODE").execute(&mut *holder).await.unwrap();
        let pruning = tokio::spawn({
            let (outbox, pool) = (outbox.clone(), pool.clone());
            async move { outbox.prune_keys(&pool, 10).await }
        });
        let waiting =
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE 'WITH walked AS%'";
        while sqlx::query_scalar::<_, i64>(waiting).fetch_one(&pool).await.unwrap() == 0 {
            assert!(!pruning.is_finished(), "the pruning waits for the table: {:?}", pruning.await);
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        // A producer writes the key's row (as `schedule`'s upsert does) and commits meanwhile.
        sqlx::query("UPDATE outbox.keys SET partition = partition WHERE key = 'k'").execute(&pool).await.unwrap();
        holder.commit().await.unwrap();
        assert_eq!(pruning.await.unwrap().unwrap(), 1, "the key has no record left");
    }

    /// The processor's statements run with JIT off (fetches on a connection of their own, bounded to
    /// `query_timeout`; completions in transactions, which bound idling and lock waits to it), and the application's
    /// pool keeps its settings.
    #[sqlx::test(migrations = false)]
    async fn processor_statements_run_without_jit(pool: PgPool) {
        let fetches = super::fetch_pool(&pool, std::time::Duration::from_millis(2500));
        let fetching: String = sqlx::query_scalar("SHOW jit").fetch_one(&fetches).await.unwrap();
        let limit: String = sqlx::query_scalar("SHOW statement_timeout").fetch_one(&fetches).await.unwrap();
        assert_eq!((fetching.as_str(), limit.as_str()), ("off", "2500ms"));
        let mut conn = pool.acquire().await.unwrap();
        let statements = super::PgStatements::new("outbox", true, true, std::time::Duration::from_millis(2500));
        let mut tx = super::begin(&mut conn, &statements).await.unwrap();
        let inside: String = sqlx::query_scalar("SHOW jit").fetch_one(&mut *tx).await.unwrap();
        let idle: String =
            sqlx::query_scalar("SHOW idle_in_transaction_session_timeout").fetch_one(&mut *tx).await.unwrap();
        let lock: String = sqlx::query_scalar("SHOW lock_timeout").fetch_one(&mut *tx).await.unwrap();
        let statements_run: String = sqlx::query_scalar("SHOW statement_timeout").fetch_one(&mut *tx).await.unwrap();
        tx.commit().await.unwrap();
        drop(conn);
        assert_eq!(
            (inside.as_str(), idle.as_str(), lock.as_str(), statements_run.as_str()),
            ("off", "2500ms", "2500ms", "2500ms")
        );
        let after: String = sqlx::query_scalar("SHOW jit").fetch_one(&pool).await.unwrap();
        let default: String =
            sqlx::query_scalar("SELECT reset_val FROM pg_settings WHERE name = 'jit'").fetch_one(&pool).await.unwrap();
        assert_eq!(after, default);
        assert_eq!(default, "on", "this test needs a database where JIT is on by default");
        let _ = Outbox::new(Config::default()).unwrap();
    }

    /// A pooled connection the server closed while it sat idle fails its ping before it is handed out
    /// and is replaced (the library's pools ping only connections idle for `PING_IF_IDLE_FOR`).
    #[sqlx::test(migrations = false)]
    async fn a_connection_closed_while_idle_is_replaced(pool: PgPool) {
        let options = crate::driver::ConnectOptions { max_connections: 1, ..Default::default() };
        let ours: PgPool =
            crate::driver::sized(&options, true).connect_with(pool.connect_options().as_ref().clone()).await.unwrap();
        let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(&ours).await.unwrap();
        sqlx::query("SELECT pg_terminate_backend($1)").bind(pid).execute(&pool).await.unwrap();
        tokio::time::sleep(crate::driver::PING_IF_IDLE_FOR + std::time::Duration::from_millis(200)).await;
        let replaced: i32 = sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(&ours).await.unwrap();
        assert_ne!(replaced, pid);
    }
}
