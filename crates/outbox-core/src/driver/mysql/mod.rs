//! The MySQL driver (MariaDB 10.6+ and MySQL 8.0+; tested on MariaDB): its statements
//! (`statements.rs`) and how they run. Each key's writers serialise on the key's lock row, whose
//! `AUTO_INCREMENT`-numbered records therefore follow commit order; every worker write locks its
//! partitions' rows `LOCK IN SHARE MODE` at the (owner, epoch) it holds; times are the server's UTC clock.

mod statements;

use std::collections::BTreeSet;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use base64::Engine;
use sqlx::mysql::{MySqlConnectOptions, MySqlDatabaseError};
use sqlx::{AssertSqlSafe, Connection, MySqlConnection, MySqlPool};
use tracing::info;
use uuid::Uuid;

use self::statements::MIGRATIONS_TABLE;
pub use self::statements::{MySqlStatements, NOW, begin_statement, render, session_seconds};
use super::{ConnectOptions, Driver, count, json, millis, statement};
use crate::error::{Error, Result};
use crate::migrate::{self, Migration, checksum, recorded_columns, to_apply};
use crate::stored::{
    FAILED_PAGE_PAYLOAD_BYTES, FailedFilter, FailedRecord, FetchedRow, Found, NewRow, Outcome, PartitionStats, Request,
    Runs, StatsRow, Written, grants_list,
};

/// The migrations of the MySQL schema, in order (`{s}` is the table prefix, `{bin}` the key collation).
pub const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        name: "initial",
        sql: include_str!("../../../../../migrations/mysql/0001_initial.sql"),
        earlier: &[],
        older_versions_run: false,
    },
    Migration {
        version: 2,
        name: "delivery_times",
        sql: include_str!("../../../../../migrations/mysql/0002_delivery_times.sql"),
        earlier: &[],
        older_versions_run: false,
    },
    Migration {
        version: 3,
        name: "inbox",
        sql: include_str!("../../../../../migrations/mysql/0003_inbox.sql"),
        earlier: &[],
        older_versions_run: false,
    },
    Migration {
        version: 4,
        name: "delivered counts",
        sql: include_str!("../../../../../migrations/mysql/0004_delivered_counts.sql"),
        earlier: &[],
        older_versions_run: false,
    },
    Migration {
        version: 5,
        name: "takeovers",
        sql: include_str!("../../../../../migrations/mysql/0005_takeovers.sql"),
        earlier: &[],
        older_versions_run: false,
    },
    Migration {
        version: 6,
        name: "ended leases",
        sql: include_str!("../../../../../migrations/mysql/0006_ended_leases.sql"),
        earlier: &[],
        older_versions_run: false,
    },
    Migration {
        version: 7,
        name: "migration_compatibility",
        sql: include_str!("../../../../../migrations/mysql/0007_migration_compatibility.sql"),
        earlier: &[],
        // Adds a column with a default, which older libraries ignore (none reads this flag: a library
        // that reads flags knows this migration).
        older_versions_run: true,
    },
    Migration {
        version: 8,
        name: "quiet_periods",
        sql: include_str!("../../../../../migrations/mysql/0008_quiet_periods.sql"),
        earlier: &[],
        // Adds a column older libraries ignore. Alone on the schema they run as before; beside newer
        // ones (a rolling deploy) they neither set nor honour it.
        older_versions_run: true,
    },
];

/// How long a migrator waits for another one of the same schema (`GET_LOCK`).
const MIGRATION_LOCK_WAIT_SECS: i64 = 300;

pub(super) async fn connect(url: &str, options: &ConnectOptions) -> Result<MySqlPool> {
    let server = MySqlConnectOptions::from_str(url).map_err(Error::BadUrl)?;
    let database = super::server("MySQL", server.get_database(), server.get_host(), server.get_port());
    super::sized(options, true).connect_with(server).await.map_err(|source| Error::Connect { database, source })
}

/// Whether workers can run on `conn` ([`crate::Db::check_worker_session`]): `autocommit` on, and an
/// isolation level above READ UNCOMMITTED. With autocommit off, each of their single statements (a
/// fetch, a heartbeat, a purge) would open a transaction that stays open on its pooled connection, its
/// reads an old snapshot and its writes never committed; at READ UNCOMMITTED a fetch reads records of
/// transactions not yet committed, and would deliver events of one that then rolls back. For the
/// cluster layer, which checks the connection it registers an instance on. (MySQL 8 names the level
/// `transaction_isolation`, MariaDB before 11.1 `tx_isolation`.)
pub async fn check_session(conn: &mut MySqlConnection) -> Result<()> {
    const SETTINGS: &str =
        "SHOW SESSION VARIABLES WHERE Variable_name IN ('autocommit', 'tx_isolation', 'transaction_isolation')";
    let settings: Vec<(String, String)> = sqlx::query_as(SETTINGS).fetch_all(conn).await?;
    let off = |name: &str, value: &str| settings.iter().any(|(n, v)| n == name && v.eq_ignore_ascii_case(value));
    if off("autocommit", "OFF") {
        return Err(Error::UnsuitableSession(
            "the pool's MySQL connections have autocommit off (a server-wide `autocommit = 0`, or the pool's \
             connect hook): the workers' single statements would stay in open transactions, reading old \
             snapshots and never committing. Run the workers on a pool whose connections have it on (one \
             `Db::new_pool` opens carries no connect hook), or set `autocommit = 1` on the server"
                .into(),
        ));
    }
    if off("tx_isolation", "READ-UNCOMMITTED") || off("transaction_isolation", "READ-UNCOMMITTED") {
        return Err(Error::UnsuitableSession(
            "the pool's MySQL connections read uncommitted data (isolation level READ UNCOMMITTED, server-wide \
             or set by the pool's connect hook): a fetch would deliver records of transactions that have not \
             committed, and may roll back. Run the workers on a pool at READ COMMITTED or above (one \
             `Db::new_pool` opens carries no connect hook), or change the server's `transaction_isolation`"
                .into(),
        ));
    }
    Ok(())
}

/// Runs `work` in one of the outbox's own transactions on `conn` (completions, ownership rounds,
/// pruning), begun with `begin` ([`begin_statement`]), and commits it if `work` succeeds.
///
/// It runs at READ COMMITTED, where InnoDB locks only the rows a locking read returns: at REPEATABLE
/// READ it also locks every row and gap it passes, so an ownership round's look for its free partitions
/// held all 256 rows and stalled every other worker's fenced completion. The caller's transactions keep
/// their own level.
///
/// For its length the session's `wait_timeout` and `innodb_lock_wait_timeout` are the outbox's
/// `query_timeout`, so the server gives up when the client does:
/// - a transaction whose client's host vanished (no FIN, no RST) is ended after that long, with its
///   locks, where it held them until the server's TCP keepalive gave up, two hours by default;
/// - a statement whose client gave up waiting for a lock stops waiting too, where it waited on (50 s by
///   default) with its locks held and one more such statement came with each retry.
///
/// MySQL has no setting for one transaction, so the session's own values go back in the round trip of
/// the `COMMIT` (or `ROLLBACK`), and an application's connection from a shared pool keeps them.
///
/// Run it under `finishing`, which closes the connection, and so ends the transaction, if it is cut
/// short at any stage.
pub async fn transaction<T, E: From<sqlx::Error>>(
    conn: &mut MySqlConnection,
    begin: &Arc<str>,
    work: impl AsyncFnOnce(&mut MySqlConnection) -> std::result::Result<T, E>,
) -> std::result::Result<T, E> {
    const RESTORE: &str =
        "SET SESSION wait_timeout = @outbox_wait_timeout, SESSION innodb_lock_wait_timeout = @outbox_lock_wait_timeout";
    const COMMIT: &str = "COMMIT; SET SESSION wait_timeout = @outbox_wait_timeout,
        SESSION innodb_lock_wait_timeout = @outbox_lock_wait_timeout";
    const ROLLBACK: &str = "ROLLBACK; SET SESSION wait_timeout = @outbox_wait_timeout,
        SESSION innodb_lock_wait_timeout = @outbox_lock_wait_timeout";
    if let Err(e) = sqlx::raw_sql(statement(begin)).execute(&mut *conn).await {
        // Its first statement may have changed the session's limits (a later one refused: a transaction
        // left open on a pool without autocommit): put them back before the connection goes back to a pool.
        let _ = sqlx::raw_sql(RESTORE).execute(&mut *conn).await;
        return Err(e.into());
    }
    let done = work(&mut *conn).await;
    let failed = match &done {
        Ok(_) => match sqlx::raw_sql(COMMIT).execute(&mut *conn).await {
            Ok(_) => return done,
            Err(e) => Err(e.into()),
        },
        Err(_) => done,
    };
    // `work` or the COMMIT failed, and the transaction may still be open. A ROLLBACK that fails too
    // leaves a broken connection, which the pool closes on its return.
    let _ = sqlx::raw_sql(ROLLBACK).execute(&mut *conn).await;
    failed
}

/// Deadlock (1213), lock wait timeout (1205), a row changed since the transaction's snapshot (MariaDB's
/// snapshot isolation, 1020), too many connections for the server or the user (1040, 1203, 1226),
/// server shutdown (1053), connection killed (1927), query interrupted (1317), a statement time limit
/// (MariaDB 1969, MySQL 3024), a full disk or table (1021; 1114, InnoDB's answer when its disk or
/// tablespace is full), exhausted memory or resources (1037, 1038, 1041), a
/// server or transaction running read-only (1290, as a failed-over primary does; 1792, 1836), a commit
/// Group Replication's certification rolled back (3101) and a connection the server closed as idle
/// (4031) are worth retrying, as PostgreSQL's classes 40, 53, 57014 and 25006 are. Not 1047, 1180 nor
/// 3100: a Galera node outside the primary component answers them, but so do a command the server does
/// not know and a transaction over the cluster's size limit, which no retry helps. `None`: not a MySQL
/// error.
pub(super) fn is_transient(db: &dyn sqlx::error::DatabaseError) -> Option<bool> {
    let db = db.try_downcast_ref::<MySqlDatabaseError>()?;
    Some(matches!(
        db.number(),
        1020 | 1021
            | 1037
            | 1038
            | 1040
            | 1041
            | 1053
            | 1114
            | 1203
            | 1205
            | 1213
            | 1226
            | 1290
            | 1317
            | 1792
            | 1836
            | 1927
            | 1969
            | 3024
            | 3101
            | 4031
    ))
}

/// A lock waited for past `innodb_lock_wait_timeout` (1205) or a statement past its time limit (MariaDB
/// 1969, MySQL 3024): the work did not fit its time. `None`: not a MySQL error.
pub(super) fn is_time_limit(db: &dyn sqlx::error::DatabaseError) -> Option<bool> {
    let db = db.try_downcast_ref::<MySqlDatabaseError>()?;
    Some(matches!(db.number(), 1205 | 1969 | 3024))
}

/// A server running read-only (1290, MariaDB's 1836) or a read-only transaction (1792), as a primary
/// turned replica answers (see `driver::retire_before`). `None`: not a MySQL error.
pub(super) fn is_read_only(db: &dyn sqlx::error::DatabaseError) -> Option<bool> {
    let db = db.try_downcast_ref::<MySqlDatabaseError>()?;
    Some(matches!(db.number(), 1290 | 1792 | 1836))
}

/// 1146 no such table, 1054 unknown column (a schema that a later migration has not reached). `None`:
/// not a MySQL error.
pub(super) fn is_not_migrated(db: &dyn sqlx::error::DatabaseError) -> Option<bool> {
    let db = db.try_downcast_ref::<MySqlDatabaseError>()?;
    Some(matches!(db.number(), 1146 | 1054))
}

/// `sql` with PostgreSQL-style `$1`, `$2`, … (outside quotes) as MySQL's `?`, and the argument each `?`
/// takes, so the application writes one statement for every backend.
pub(super) fn positional(sql: &str) -> Result<(String, Vec<usize>)> {
    let (mut text, mut order) = (String::with_capacity(sql.len()), Vec::new());
    let mut chars = sql.chars().peekable();
    let mut quote: Option<char> = None;
    while let Some(c) = chars.next() {
        match quote {
            Some(q) => {
                if c == q {
                    quote = None;
                }
                text.push(c);
            }
            None if matches!(c, '\'' | '"' | '`') => {
                quote = Some(c);
                text.push(c);
            }
            None if c == '$' && chars.peek().is_some_and(char::is_ascii_digit) => {
                let mut n = 0_usize;
                while let Some(d) = chars.peek().and_then(|d| d.to_digit(10)) {
                    n = n * 10 + d as usize;
                    chars.next();
                }
                if n == 0 {
                    return Err(Error::Database(sqlx::Error::Protocol("parameter $0 in a statement".into())));
                }
                order.push(n - 1);
                text.push('?');
            }
            None => text.push(c),
        }
    }
    Ok((text, order))
}

fn hex(id: Uuid) -> String {
    id.simple().to_string()
}

/// Whether the server is MariaDB (else MySQL): their names for a key's collation differ.
async fn is_mariadb(conn: &mut MySqlConnection) -> Result<bool> {
    let version: String = sqlx::query_scalar("SELECT VERSION()").fetch_one(conn).await?;
    Ok(version.contains("MariaDB"))
}

/// Inserts records on the caller's connection (see `Conn::schedule`): their keys' lock rows first, then
/// the records, then the numbers they were given, in a transaction of sqlx's own (a savepoint inside the
/// caller's transaction), which sqlx rolls back if this future is dropped half way.
///
/// A transaction sqlx does not know of (the application's own `BEGIN`, or `autocommit` off) is joined
/// with a savepoint instead: sqlx's `BEGIN` there would commit it, and leave the rest of it to autocommit.
pub(super) async fn schedule(
    conn: &mut MySqlConnection,
    s: &MySqlStatements,
    rows: &[NewRow<'_>],
) -> Result<Vec<(Uuid, i64)>> {
    let keys: BTreeSet<(&str, i16)> = rows.iter().map(|r| (r.key, i16::from(r.partition))).collect();
    let records = rows
        .iter()
        .map(|r| {
            let payload = base64::engine::general_purpose::STANDARD.encode(r.payload);
            // The text form a DATETIME(6) column takes from JSON.
            let at = r.deliver_at.map(|at| at.format("%Y-%m-%d %H:%M:%S%.6f").to_string());
            let (id, partition) = (hex(r.id), i16::from(r.partition));
            json(&(id, partition, r.key, r.event_type, payload, r.headers.as_str(), at, r.deliver_after_ms))
        })
        .collect::<Result<Vec<String>>>()?;
    fits_a_packet(conn, rows, &records).await?;
    // Keys and ids in lists of a bounded size too: in one list each, a batch of many records on long
    // keys was over the packet. The keys stay in sorted order across their lists.
    let (keys, ids) = (json_lists(keys)?, json_lists(rows.iter().map(|r| hex(r.id)))?);
    let records = json_arrays(&records, LIST_BYTES);
    let numbers = if !conn.is_in_transaction() && savepoint_in_applications_transaction(conn).await? {
        match insert(conn, s, &keys, &records, &ids).await {
            Ok(numbers) => {
                sqlx::raw_sql("RELEASE SAVEPOINT outbox_schedule").execute(&mut *conn).await?;
                numbers
            }
            Err(e) => {
                // After a deadlock the whole transaction is gone, and with it the savepoint.
                let _ = sqlx::raw_sql("ROLLBACK TO SAVEPOINT outbox_schedule").execute(&mut *conn).await;
                return Err(e);
            }
        }
    } else {
        let mut tx = conn.begin().await?;
        let numbers = insert(&mut tx, s, &keys, &records, &ids).await?;
        tx.commit().await?;
        numbers
    };
    let numbers: std::collections::HashMap<Uuid, i64> = numbers.into_iter().collect();
    rows.iter()
        .map(|r| {
            numbers.get(&r.id).map(|&seq| (r.id, seq)).ok_or_else(|| {
                Error::Database(sqlx::Error::Protocol(format!("record {} was not numbered at insert", r.id)))
            })
        })
        .collect()
}

/// The statements of [`schedule`], in a transaction begun by the caller; each list is a JSON array.
async fn insert(
    conn: &mut MySqlConnection,
    s: &MySqlStatements,
    keys: &[String],
    records: &[String],
    ids: &[String],
) -> Result<Vec<(Uuid, i64)>> {
    for chunk in keys {
        sqlx::query(statement(&s.lock_keys)).bind(chunk).execute(&mut *conn).await?;
    }
    for chunk in records {
        sqlx::query(statement(&s.insert)).bind(chunk).execute(&mut *conn).await?;
    }
    let mut numbers = Vec::with_capacity(ids.len());
    for chunk in ids {
        numbers
            .extend(sqlx::query_as::<_, (Uuid, i64)>(statement(&s.numbers)).bind(chunk).fetch_all(&mut *conn).await?);
    }
    Ok(numbers)
}

/// Whether `conn`, outside every transaction sqlx began, is inside one the application began itself;
/// if so, a savepoint `outbox_schedule` is now set in it.
async fn savepoint_in_applications_transaction(conn: &mut MySqlConnection) -> Result<bool> {
    applications_transaction(conn, "SAVEPOINT outbox_probe; RELEASE SAVEPOINT outbox_probe; SAVEPOINT outbox_schedule")
        .await
}

/// Whether `conn` is inside a transaction: sqlx's own, or one the application began itself.
pub(super) async fn in_a_transaction(conn: &mut MySqlConnection) -> Result<bool> {
    Ok(conn.is_in_transaction()
        || applications_transaction(conn, "SAVEPOINT outbox_probe; RELEASE SAVEPOINT outbox_probe").await?)
}

/// Whether `probe` (a savepoint set and released, and what follows it) ran inside a transaction the
/// application began itself. MySQL has no question for it, but a savepoint set outside a transaction is
/// gone at once, so releasing it fails (1305), and nothing after it runs.
async fn applications_transaction(conn: &mut MySqlConnection, probe: &'static str) -> Result<bool> {
    match sqlx::raw_sql(probe).execute(conn).await {
        Ok(_) => Ok(true),
        Err(sqlx::Error::Database(e))
            if e.try_downcast_ref::<MySqlDatabaseError>().is_some_and(|e| e.number() == 1305) =>
        {
            Ok(false)
        }
        Err(e) => Err(e.into()),
    }
}

/// JSON per statement of a list ([`schedule`]'s records, a completion's outcomes). MySQL answers a
/// statement over `max_allowed_packet` (16 MiB by default on MariaDB, 4 MiB on MySQL 5.7) with an error,
/// or by closing the connection, which looks transient and would come back on every retry; so a large
/// batch goes as several statements of the one transaction, in batch order (the `AUTO_INCREMENT`
/// numbers follow).
const LIST_BYTES: usize = 1 << 20;

/// Room in a packet for the statement's own bytes around the records' JSON.
const PACKET_SLACK: usize = 4096;

/// The records' JSON elements as JSON arrays of about `budget` bytes each (a larger record alone).
fn json_arrays(records: &[String], budget: usize) -> Vec<String> {
    let mut arrays = Vec::new();
    let mut array = String::from("[");
    for record in records {
        if array.len() > 1 && array.len() + record.len() + 1 > budget {
            array.push(']');
            arrays.push(std::mem::replace(&mut array, String::from("[")));
        }
        if array.len() > 1 {
            array.push(',');
        }
        array.push_str(record);
    }
    array.push(']');
    arrays.push(array);
    arrays
}

/// `items` as JSON arrays of about [`LIST_BYTES`] each; none if there are no items. A completion's
/// failures carry errors of up to 4 KiB, twice that in JSON: many keys failing at once went past the
/// packet in one list.
fn json_lists<T: serde::Serialize>(items: impl IntoIterator<Item = T>) -> Result<Vec<String>> {
    let items = items.into_iter().map(|item| json(&item)).collect::<Result<Vec<String>>>()?;
    Ok(if items.is_empty() { Vec::new() } else { json_arrays(&items, LIST_BYTES) })
}

/// Refuses, before writing, a record whose JSON (its payload in base64) is more than the server takes in
/// one statement. Asks the server its limit only when a record is over [`LIST_BYTES`].
async fn fits_a_packet(conn: &mut MySqlConnection, rows: &[NewRow<'_>], records: &[String]) -> Result<()> {
    if records.iter().all(|r| r.len() + 2 <= LIST_BYTES) {
        return Ok(());
    }
    let limit: u64 = sqlx::query_scalar("SELECT CAST(@@max_allowed_packet AS UNSIGNED)").fetch_one(&mut *conn).await?;
    let limit = usize::try_from(limit).unwrap_or(usize::MAX).saturating_sub(PACKET_SLACK);
    match rows.iter().zip(records).find(|(_, json)| json.len() + 2 > limit) {
        Some((row, json)) => {
            // The largest payload whose base64 fits beside the rest of this record's JSON.
            let room = limit.saturating_sub(json.len() + 2 - row.payload.len().div_ceil(3) * 4);
            Err(Error::PayloadTooLarge { key: row.key.to_string(), len: row.payload.len(), max: room / 4 * 3 })
        }
        None => Ok(()),
    }
}

/// Accepts a message on the caller's connection (see `Conn::accept`).
pub(super) async fn accept(
    conn: &mut MySqlConnection,
    s: &MySqlStatements,
    source: &str,
    message_id: &str,
) -> Result<bool> {
    let done = sqlx::query(statement(&s.accept)).bind(source).bind(message_id).execute(conn).await?;
    Ok(done.rows_affected() == 1)
}

/// Accepts a key's event in order on the caller's connection (see `Conn::accept_in_order`): the key's
/// row locked (inserted just before the event if it is new), then moved on if the event is later. The
/// first event of a key at `i64::MIN`, which has nothing before it, is not accepted.
pub(super) async fn accept_in_order(
    conn: &mut MySqlConnection,
    s: &MySqlStatements,
    source: &str,
    key: &str,
    seq: i64,
) -> Result<bool> {
    let lock = sqlx::query(statement(&s.lock_inbox_key)).bind(source).bind(key).bind(seq.saturating_sub(1));
    lock.execute(&mut *conn).await?;
    let later = sqlx::query(statement(&s.accept_later_of_key)).bind(seq).bind(source).bind(key).bind(seq);
    Ok(later.execute(conn).await?.rows_affected() == 1)
}

/// A failed migration as [`Error::Migration`], which says it may be half applied (MySQL commits each
/// DDL statement on its own). A transient error (a lost connection, a deadlock) stays one: migrating
/// again may succeed.
fn applied_in_part(e: Error, schema: &str, m: &Migration) -> Error {
    if e.is_transient() {
        return e;
    }
    let (version, name) = (m.version, m.name);
    Error::Migration {
        schema: schema.to_string(),
        version,
        reason: format!(
            "{e}; migration {version} ({name}) may be applied in part, as MySQL commits each of its statements: \
             finish or undo it by hand (and record version {version} in {schema}_schema_migrations once it is \
             whole), then migrate again"
        ),
    }
}

impl Driver<'_, MySqlPool, MySqlStatements> {
    /// Applies the missing migrations, one migrator of the schema at a time (`GET_LOCK`, held by this
    /// connection's session, so the connection is closed if the migrate is cut short: `finishing`).
    /// MySQL commits each DDL statement on its own, so a migration that fails half way is not rolled
    /// back: its error names it, and it must be finished by hand. A statement that waits
    /// [`migrate::LOCK_TIMEOUT`] for a table's metadata lock gives up, having changed nothing, and the
    /// migrate is tried again after a pause ([`migrate::patiently`]).
    pub(crate) async fn migrate(&self) -> Result<()> {
        migrate::patiently(&self.statements.schema, || self.migrate_once()).await
    }

    async fn migrate_once(&self) -> Result<()> {
        let schema = self.statements.schema.as_str();
        super::finishing(self.pool, async |conn| {
            // Named after database and schema (lock names are server-wide, at most 64 characters).
            let lock = "CONCAT('outbox_migrate_', MD5(CONCAT(DATABASE(), '.', ?)))";
            let locked: Option<i64> = sqlx::query_scalar(AssertSqlSafe(format!("SELECT GET_LOCK({lock}, ?)")))
                .bind(schema)
                .bind(MIGRATION_LOCK_WAIT_SECS)
                .fetch_one(&mut *conn)
                .await?;
            if locked != Some(1) {
                return Err(Error::Database(sqlx::Error::Protocol(format!(
                    "another migrator of schema {schema} held its lock for {MIGRATION_LOCK_WAIT_SECS} s"
                ))));
            }
            let applied = self.apply(conn, schema).await;
            // With autocommit off (an application's pool) the last migration's row, and the reads'
            // snapshot, would stay in a transaction nobody ends (DDL commits only what came before it).
            let committed = sqlx::raw_sql("COMMIT").execute(&mut *conn).await;
            let released = sqlx::query(AssertSqlSafe(format!("SELECT RELEASE_LOCK({lock})")))
                .bind(schema)
                .execute(&mut *conn)
                .await;
            applied?;
            committed?;
            released?;
            Ok(())
        })
        .await
    }

    async fn apply(&self, conn: &mut MySqlConnection, schema: &str) -> Result<()> {
        // Created only if missing: `CREATE TABLE IF NOT EXISTS` wants the right to create even when the
        // table is there, which an application's user seldom has (it runs `migrate` at every start).
        let table_exists: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM information_schema.tables WHERE table_schema = DATABASE() AND table_name = ?)",
        )
        .bind(format!("{schema}_schema_migrations"))
        .fetch_one(&mut *conn)
        .await?;
        if !table_exists {
            sqlx::query(AssertSqlSafe(render(MIGRATIONS_TABLE, schema))).execute(&mut *conn).await?;
        }
        let applied: Vec<(i64, i64)> =
            sqlx::query_as(AssertSqlSafe(format!("SELECT version, checksum FROM {schema}_schema_migrations")))
                .fetch_all(&mut *conn)
                .await?;
        let flagged = format!("SELECT version FROM {schema}_schema_migrations WHERE older_versions_run");
        let read_flags = async || Ok(sqlx::query_scalar(AssertSqlSafe(flagged)).fetch_all(&mut *conn).await?);
        let pending = to_apply(schema, &applied, MIGRATIONS, read_flags).await?;
        let collation = if is_mariadb(conn).await? { "utf8mb4_nopad_bin" } else { "utf8mb4_0900_bin" };
        // The session's own wait comes back after, for an application's connection from a shared pool.
        let wait = migrate::LOCK_TIMEOUT.as_secs();
        sqlx::raw_sql(AssertSqlSafe(format!(
            "SET @outbox_mdl_wait = @@SESSION.lock_wait_timeout, SESSION lock_wait_timeout = {wait}"
        )))
        .execute(&mut *conn)
        .await?;
        let applied = self.apply_pending(conn, schema, pending, collation).await;
        let restored = sqlx::raw_sql("SET SESSION lock_wait_timeout = @outbox_mdl_wait").execute(&mut *conn).await;
        applied?;
        restored?;
        Ok(())
    }

    async fn apply_pending(
        &self,
        conn: &mut MySqlConnection,
        schema: &str,
        pending: Vec<&Migration>,
        collation: &str,
    ) -> Result<()> {
        for m in pending {
            let sql = render(m.sql, schema).replace("{bin}", collation);
            let applied = async {
                sqlx::raw_sql(AssertSqlSafe(sql)).execute(&mut *conn).await?;
                let (columns, flag) = recorded_columns(m);
                let record = format!("INSERT INTO {schema}_schema_migrations ({columns}) VALUES (?, ?, ?{flag})");
                sqlx::query(AssertSqlSafe(record))
                    .bind(m.version)
                    .bind(m.name)
                    .bind(checksum(m.sql))
                    .execute(&mut *conn)
                    .await
            };
            applied.await.map_err(|e| applied_in_part(e.into(), schema, m))?;
            info!(schema, version = m.version, name = m.name, "applied outbox migration (MySQL)");
        }
        Ok(())
    }

    /// One statement, one snapshot; the byte budget holds while the rows stream in ([`Runs`]).
    pub(crate) async fn fetch(&self, request: &Request) -> Result<Found> {
        let query = fetch_query(self.statements, request)?;
        super::finishing(self.pool, async |conn| Runs::collect(query.fetch(conn), request).await).await
    }

    /// One transaction: the grants checked and locked, then the completions of those that hold in three
    /// set statements, then their failures in two.
    pub(crate) async fn complete(&self, outcomes: &[Outcome]) -> Result<Written> {
        super::finishing(self.pool, async |conn| self.write_outcomes(conn, outcomes).await).await
    }

    async fn write_outcomes(&self, conn: &mut MySqlConnection, outcomes: &[Outcome]) -> Result<Written> {
        let s = self.statements;
        let mut written = Written::default();
        transaction(conn, &s.begin, async |tx| {
            let grants = json(&grants_list(outcomes))?;
            written.hold(sqlx::query_as(statement(&s.fence)).bind(grants).fetch_all(&mut *tx).await?);
            for done in json_lists(written.completions(outcomes))? {
                let found: Vec<(Uuid,)> =
                    sqlx::query_as(statement(&s.lock_done)).bind(&done).fetch_all(&mut *tx).await?;
                if let Some(keep) = &s.keep {
                    sqlx::query(statement(keep)).bind(&done).execute(&mut *tx).await?;
                }
                sqlx::query(statement(&s.delete)).bind(&done).execute(&mut *tx).await?;
                written.ids.extend(found.into_iter().map(|(id,)| id));
            }
            for failures in json_lists(super::failures(&written, outcomes))? {
                let found: Vec<(Uuid,)> =
                    sqlx::query_as(statement(&s.lock_failing)).bind(&failures).fetch_all(&mut *tx).await?;
                if !found.is_empty() {
                    sqlx::query(statement(&s.fail)).bind(&failures).execute(&mut *tx).await?;
                }
                written.ids.extend(found.into_iter().map(|(id,)| id));
            }
            Ok(written)
        })
        .await
    }

    /// Runs `work` in a transaction of the library's own ([`transaction`], with `begin`), under
    /// `finishing`, as every operator call: one its caller gives up closes its connection, where it kept
    /// a place in the pool until the server finished. The reads too: on a connection with autocommit
    /// off (an application's pool) a read alone left its snapshot open there, for the next one to see
    /// the same data.
    async fn within<T>(&self, work: impl AsyncFnOnce(&mut MySqlConnection) -> Result<T>) -> Result<T> {
        super::finishing(self.pool, async |conn| transaction(conn, &self.statements.begin, work).await).await
    }

    pub(crate) async fn failed(&self, filter: &FailedFilter) -> Result<Vec<FailedRecord>> {
        let partition = filter.partition.map(i16::from);
        let after = filter.after.as_ref().map(|a| i16::from(a.partition));
        let query = sqlx::query_as(statement(&self.statements.list_failed))
            .bind(filter.payloads)
            .bind(filter.key.as_deref())
            .bind(filter.key.as_deref())
            .bind(partition)
            .bind(partition)
            .bind(after)
            .bind(after)
            .bind(filter.after.as_ref().map(|a| a.key.as_str()))
            .bind(filter.after.as_ref().map(|a| a.seq))
            .bind(filter.limit.unwrap_or(100))
            .bind(count(FAILED_PAGE_PAYLOAD_BYTES))
            .bind(filter.payloads);
        self.within(async |tx| Ok(query.fetch_all(tx).await?)).await
    }

    /// At READ COMMITTED, as the purges below: at the server's REPEATABLE READ a requeue of a key or of
    /// everything scans the records and keeps every row it read, and the gaps between them, locked
    /// while it waits for one, holding up every schedule and completion as long.
    /// Requeues the FAILED record `id`, or those of `key`.
    pub(crate) async fn requeue(&self, id: Option<Uuid>, key: Option<&str>) -> Result<u64> {
        let query = sqlx::query(statement(&self.statements.requeue)).bind(id).bind(key);
        self.within(async |tx| Ok(query.execute(tx).await?.rows_affected())).await
    }

    pub(crate) async fn requeue_batch(&self, after: &(i16, String, i64), limit: usize) -> Result<super::RequeuedBatch> {
        self.within(async |tx| {
            let (partition, key, seq) = after;
            let batch: Vec<(Uuid, i16, String, i64)> = sqlx::query_as(statement(&self.statements.requeue_next))
                .bind(partition)
                .bind(partition)
                .bind(key)
                .bind(key)
                .bind(seq)
                .bind(count(limit))
                .fetch_all(&mut *tx)
                .await?;
            let ids: Vec<String> = batch.iter().map(|(id, ..)| id.simple().to_string()).collect();
            let requeued = if ids.is_empty() {
                0
            } else {
                let listed = serde_json::Value::from(ids).to_string();
                sqlx::query(statement(&self.statements.requeue_listed))
                    .bind(listed)
                    .execute(&mut *tx)
                    .await?
                    .rows_affected()
            };
            let last = batch.last().map(|(_, partition, key, seq)| (*partition, key.clone(), *seq));
            Ok(super::RequeuedBatch { read: batch.len() as u64, requeued, last })
        })
        .await
    }

    pub(crate) async fn skip(&self, id: Uuid) -> Result<bool> {
        self.within(async |tx| {
            if sqlx::query(statement(&self.statements.skip_lock)).bind(id).fetch_optional(&mut *tx).await?.is_none() {
                return Ok(false);
            }
            sqlx::query(statement(&self.statements.skip_keep)).bind(id).execute(&mut *tx).await?;
            let deleted = sqlx::query(statement(&self.statements.skip_delete)).bind(id).execute(&mut *tx).await?;
            Ok(deleted.rows_affected() > 0)
        })
        .await
    }

    pub(crate) async fn stats(&self) -> Result<Vec<PartitionStats>> {
        let query = sqlx::query_as::<_, StatsRow>(statement(&self.statements.stats));
        let rows = self.within(async |tx| Ok(query.fetch_all(tx).await?)).await?;
        Ok(rows.into_iter().map(PartitionStats::from).collect())
    }

    pub(crate) async fn purge(&self, retention: Duration, limit: usize) -> Result<u64> {
        let query = sqlx::query(statement(&self.statements.purge)).bind(millis(retention)).bind(count(limit));
        self.within(async |tx| Ok(query.execute(tx).await?.rows_affected())).await
    }

    pub(crate) async fn purge_inbox(&self, retention: Duration, limit: usize) -> Result<u64> {
        let query = sqlx::query(statement(&self.statements.purge_inbox)).bind(millis(retention)).bind(count(limit));
        self.within(async |tx| Ok(query.execute(tx).await?.rows_affected())).await
    }

    pub(crate) async fn prune_keys(&self, limit: usize, after: &str) -> Result<super::KeysPruned> {
        self.within(async |tx| {
            let walked: Vec<(String, bool)> = sqlx::query_as(statement(&self.statements.prunable_keys))
                .bind(after)
                .bind(count(limit))
                .fetch_all(&mut *tx)
                .await?;
            let unused: Vec<&String> = walked.iter().filter(|(_, unused)| *unused).map(|(key, _)| key).collect();
            let mut deleted = 0;
            for chunk in unused.chunks(statements::DELETE_KEYS_AT_ONCE) {
                let mut query = sqlx::query(statement(&self.statements.delete_keys));
                for i in 0..statements::DELETE_KEYS_AT_ONCE {
                    query = query.bind(chunk.get(i).or(chunk.last()).copied());
                }
                deleted += query.execute(&mut *tx).await?.rows_affected();
            }
            Ok(super::KeysPruned {
                read: walked.len() as u64,
                deleted,
                last: walked.last().map(|(key, _)| key.clone()),
            })
        })
        .await
    }
}

/// Index entries a fetch's walk reads at most, per head it may take and per key in flight (which it
/// reads past): about a microsecond each, so a fetch of 500 heads reads for about 8 ms at most, and
/// fills its batch unless the keys hold more than 16 records each on average or their heads wait.
const WALK_PER_KEY: usize = 16;

/// The records (index entries) the walk of `request` reads at most.
pub(crate) fn walk_records(request: &Request) -> usize {
    (request.limit + request.exclude.len()).saturating_mul(WALK_PER_KEY)
}

/// The fetch statement bound for `request`.
fn fetch_query<'q>(
    s: &'q MySqlStatements,
    request: &Request,
) -> Result<sqlx::query::QueryAs<'q, sqlx::MySql, FetchedRow, sqlx::mysql::MySqlArguments>> {
    Ok(sqlx::query_as_with(statement(&s.fetch), fetch_arguments(request)?))
}

/// The fetch's arguments (see `statements::FETCH`): one statement for any partitions (their list is one
/// JSON argument), prepared once per connection. A text per list filled sqlx's statement cache, and
/// each statement it then closed, a command the server does not answer, held up the next one until the
/// server's delayed ACK: sqlx 0.9 leaves Nagle's algorithm on (transact-rs/sqlx#4335).
fn fetch_arguments(request: &Request) -> Result<sqlx::mysql::MySqlArguments> {
    use sqlx::Arguments;
    let walk = count(walk_records(request));
    // MariaDB and MySQL stop a recursion after 1,000 steps by default; a run is cut shorter instead.
    let followers = count(request.followers.min(999));
    let mut args = sqlx::mysql::MySqlArguments::default();
    let add = |result: std::result::Result<(), sqlx::error::BoxDynError>| result.map_err(sqlx::Error::Encode);
    add(args.add(json(&walk_segments(request))?))?;
    add(args.add(request.instance))?;
    add(args.add(request.instance))?;
    add(args.add(walk))?;
    add(args.add(walk))?;
    add(args.add(json(&request.exclude)?))?;
    add(args.add(count(request.limit)))?;
    add(args.add(followers))?;
    add(args.add(count(request.budget)))?;
    Ok(args)
}

/// The segments of `request`'s walk, in order (see the fetch statement): per partition, its keys after
/// its start key (all, without one: keys are never empty), then those up to it.
fn walk_segments(request: &Request) -> Vec<(i16, i64, &str, Option<&str>)> {
    let mut segments = Vec::with_capacity(request.partitions.len() * 2);
    for (partition, epoch, after) in &request.partitions {
        let (partition, epoch) = (i16::from(*partition), epoch.0);
        segments.push((partition, epoch, after.as_deref().unwrap_or(""), None));
        if let Some(after) = after {
            segments.push((partition, epoch, "", Some(after.as_str())));
        }
    }
    segments
}

/// A fresh, empty database on the test server (`MYSQL_URL`, by default MariaDB on loopback as root),
/// for the test suites of this workspace; `./scripts/test.sh` drops the `outbox_t_…` databases of
/// earlier runs. Panics when the server does not answer.
#[doc(hidden)]
#[allow(clippy::unwrap_used)]
pub async fn test_database() -> super::Db {
    let base = std::env::var("MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306".into());
    let name = format!("outbox_t_{}", Uuid::now_v7().simple());
    let mut admin = MySqlConnection::connect(&base).await.unwrap();
    sqlx::raw_sql(AssertSqlSafe(format!("CREATE DATABASE {name}"))).execute(&mut admin).await.unwrap();
    let url = format!("{base}/{name}");
    super::Db::MySql(sqlx::mysql::MySqlPoolOptions::new().max_connections(8).connect(&url).await.unwrap())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use sqlx::mysql::{MySqlArguments, MySqlPoolOptions, MySqlRow};
    use sqlx::query::Query;
    use sqlx::{AssertSqlSafe, Connection, MySql, MySqlConnection, MySqlPool, Row};
    use uuid::Uuid;

    use super::{MySqlStatements, json_arrays};
    use crate::assignment::{Epoch, InstanceId};
    use crate::stored::Request;
    use crate::{Config, Db, Outbox};

    /// On a pool whose connections have autocommit off (an application's, through a connect hook),
    /// `migrate` and the operator's reads end what they begin. The last migration's row stayed in a
    /// transaction nobody ended, lost when the pool closed, and the next `migrate` ran that migration
    /// again over its own tables and failed, "applied in part"; a backlog reading left its snapshot
    /// open, so the next one on the connection saw the same backlog, and the next operator write
    /// failed (1568: a transaction's level set inside a transaction).
    #[tokio::test]
    async fn on_a_pool_without_autocommit_migrate_and_reads_end_their_transactions() {
        let db = super::test_database().await;
        #[allow(irrefutable_let_patterns, reason = "the only variant in a MySQL-only build")]
        let Db::MySql(plain) = &db else { unreachable!("a MySQL database") };
        let without_autocommit = MySqlPoolOptions::new()
            .max_connections(1)
            .after_connect(|conn, _| {
                Box::pin(async move { sqlx::raw_sql("SET autocommit = 0").execute(conn).await.map(drop) })
            })
            .connect_with((*plain.connect_options()).clone())
            .await
            .unwrap();
        let outbox = Outbox::new(Config::default()).unwrap();
        outbox.migrate(&without_autocommit).await.unwrap();
        let newest: i64 =
            sqlx::query_scalar("SELECT MAX(version) FROM outbox_schema_migrations").fetch_one(plain).await.unwrap();
        assert_eq!(newest, super::MIGRATIONS.last().unwrap().version, "every migration's row committed");

        assert!(outbox.stats(&without_autocommit).await.unwrap().is_empty());
        assert!(outbox.failed(&without_autocommit, &Default::default()).await.unwrap().is_empty());
        let mut tx = db.begin().await.unwrap();
        outbox.schedule(&mut tx, crate::NewRecord::new("k", "t", "")).await.unwrap();
        tx.commit().await.unwrap();
        let pending: i64 = outbox.stats(&without_autocommit).await.unwrap().iter().map(|s| s.pending).sum();
        assert_eq!(pending, 1, "the reading sees what committed since the last one");
        assert_eq!(outbox.requeue_all(&without_autocommit).await.unwrap(), 0);
        without_autocommit.close().await;
        outbox.migrate(&db).await.unwrap();
    }

    #[test]
    fn records_split_into_arrays_within_the_budget_in_order() {
        let records: Vec<String> = ["1", "22", "333", "4444", "55555"].map(String::from).into();
        assert_eq!(json_arrays(&records, 8), ["[1,22]", "[333]", "[4444]", "[55555]"]);
        assert_eq!(json_arrays(&records, 100), ["[1,22,333,4444,55555]"]);
        assert_eq!(json_arrays(&records, 1), ["[1]", "[22]", "[333]", "[4444]", "[55555]"]);
    }

    /// The outbox's own transactions bound how long the server waits for their client, and for a lock,
    /// to the `query_timeout` (whole seconds, rounded up), and give the session its own values back after
    /// a commit and after a failure, which is rolled back: an application's connection from a shared pool
    /// keeps its settings.
    #[tokio::test]
    async fn a_transaction_bounds_the_wait_for_its_client_and_gives_the_setting_back() {
        #[allow(irrefutable_let_patterns)] // in a build with MySQL alone
        let Db::MySql(pool) = super::test_database().await else { unreachable!("a MySQL test database") };
        let mut conn = pool.acquire().await.unwrap();
        let own =
            "CREATE TABLE written (n INT); SET SESSION wait_timeout = 1234, SESSION innodb_lock_wait_timeout = 77";
        sqlx::raw_sql(own).execute(&mut *conn).await.unwrap();
        let begin = super::begin_statement(Duration::from_millis(2500));
        let session =
            "SELECT CAST(@@SESSION.wait_timeout AS SIGNED), CAST(@@SESSION.innodb_lock_wait_timeout AS SIGNED)";
        let inside: (i64, i64) =
            super::transaction(&mut conn, &begin, async |tx| sqlx::query_as(session).fetch_one(tx).await)
                .await
                .unwrap();
        assert_eq!(inside, (3, 3));
        let after: (i64, i64) = sqlx::query_as(session).fetch_one(&mut *conn).await.unwrap();
        assert_eq!(after, (1234, 77), "after a commit");
        let failed = super::transaction(&mut conn, &begin, async |tx| {
            sqlx::query("INSERT INTO written (n) VALUES (1)").execute(&mut *tx).await?;
            sqlx::query("SELECT no_such_column FROM written").execute(&mut *tx).await
        })
        .await;
        assert!(failed.is_err());
        let after: (i64, i64) = sqlx::query_as(session).fetch_one(&mut *conn).await.unwrap();
        assert_eq!(after, (1234, 77), "after a failure");
        let (written, open): (i64, i64) =
            sqlx::query_as("SELECT (SELECT count(*) FROM written), CAST(@@in_transaction AS SIGNED)")
                .fetch_one(&mut *conn)
                .await
                .unwrap();
        assert_eq!((written, open), (0, 0), "the failed transaction was rolled back and ended");
        // A begin refused after its first statement (1568: a transaction left open on a connection
        // without autocommit) gives the session its values back too: the server dropped an
        // application's idle connection after the outbox's few seconds.
        sqlx::raw_sql("SET autocommit = 0; INSERT INTO written (n) VALUES (2)").execute(&mut *conn).await.unwrap();
        let refused = super::transaction(&mut conn, &begin, async |tx| sqlx::query(session).execute(tx).await).await;
        assert!(refused.is_err(), "{refused:?}");
        let after: (i64, i64) = sqlx::query_as(session).fetch_one(&mut *conn).await.unwrap();
        assert_eq!(after, (1234, 77), "after a refused begin");
        sqlx::raw_sql("ROLLBACK; SET autocommit = 1").execute(&mut *conn).await.unwrap();
    }

    /// A migrated test database and its outbox (default configuration).
    async fn migrated() -> (MySqlPool, Outbox) {
        #[allow(irrefutable_let_patterns)] // in a build with MySQL alone
        let Db::MySql(pool) = super::test_database().await else { unreachable!("a MySQL test database") };
        let outbox = Outbox::new(Config::default()).unwrap();
        outbox.migrate(&pool).await.unwrap();
        (pool, outbox)
    }

    /// A purge whose batches each take longer than `query_timeout` (deleting large payloads, logged
    /// whole in the binary log) still empties the table: the batch is halved until it fits. At full
    /// size every batch was given up at the time limit and rolled back, pass after pass, and the table
    /// only grew. A trigger slows each deleted row, so a full batch of 1,000 takes about 4 s, and the
    /// server goes on with a batch given up for a while, its rows locked: the next, smaller batch waits
    /// for them past its lock wait limit, and is halved again (the rows come from MariaDB's sequence
    /// engine).
    #[tokio::test]
    async fn a_purge_too_slow_for_the_time_limit_goes_on_in_smaller_batches() {
        let (pool, _) = migrated().await;
        let outbox = Outbox::new(Config { query_timeout: Duration::from_secs(1), ..Config::default() }).unwrap();
        sqlx::raw_sql(
            "INSERT INTO outbox_completed (id, `partition`, `key`, seq, event_type, payload, headers, created_at,
                 attempts, outcome, completed_at)
             SELECT UNHEX(MD5(seq)), 0, 'k', seq, 't', '', '{}', UTC_TIMESTAMP(6), 1, 'delivered',
                 UTC_TIMESTAMP(6) - INTERVAL 2 HOUR
             FROM seq_1_to_1500;
             CREATE TRIGGER slow_purge BEFORE DELETE ON outbox_completed FOR EACH ROW DO SLEEP(0.004)",
        )
        .execute(&pool)
        .await
        .unwrap();
        let purged = outbox.purge_completed(&pool, Duration::from_secs(3600), 1000).await.unwrap();
        let (left,): (i64,) = sqlx::query_as("SELECT count(*) FROM outbox_completed").fetch_one(&pool).await.unwrap();
        assert_eq!((purged, left), (1500, 0));
    }

    /// A migrate cut short (its future dropped, as by a start-up time limit) while it holds the
    /// migrators' lock leaves the lock free once its statement ends: the connection is closed, where it
    /// went back to the pool with its session, and the lock, alive, and every other migrator of the
    /// schema waited for it (300 s) and failed.
    #[tokio::test]
    async fn a_migrate_cut_short_leaves_the_lock_free() {
        let (pool, outbox) = migrated().await;
        let mut blocker = MySqlConnection::connect_with(&pool.connect_options()).await.unwrap();
        sqlx::raw_sql("LOCK TABLES outbox_schema_migrations WRITE").execute(&mut blocker).await.unwrap();
        let holder = "SELECT IS_USED_LOCK(CONCAT('outbox_migrate_', MD5(CONCAT(DATABASE(), '.', 'outbox'))))";
        let cut = tokio::time::timeout(Duration::from_secs(5), async {
            let migrating = outbox.migrate(&pool);
            tokio::pin!(migrating);
            // Past GET_LOCK, waiting for the table.
            loop {
                tokio::select! {
                    done = &mut migrating => panic!("migrate ended while the table was locked: {done:?}"),
                    () = tokio::time::sleep(Duration::from_millis(20)) => {}
                }
                let (held,): (Option<i64>,) = sqlx::query_as(holder).fetch_one(&mut blocker).await.unwrap();
                if held.is_some() {
                    return;
                }
            }
        })
        .await;
        assert!(cut.is_ok(), "the migrator took the lock");
        sqlx::raw_sql("UNLOCK TABLES").execute(&mut blocker).await.unwrap();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let (held,): (Option<i64>,) = sqlx::query_as(holder).fetch_one(&mut blocker).await.unwrap();
            if held.is_none() {
                break;
            }
            assert!(tokio::time::Instant::now() < deadline, "the lock is still held by connection {held:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        outbox.migrate(&pool).await.unwrap();
    }

    /// A migration MySQL applied only in part (each DDL statement commits on its own; here the last one,
    /// whose version row is then missing, as after a crash before it was written) stops every later
    /// migrate with an error that names it and says what to do, not with the server's bare complaint.
    #[tokio::test]
    async fn a_migration_applied_in_part_names_itself() {
        let (pool, outbox) = migrated().await;
        let last = super::MIGRATIONS.last().unwrap();
        sqlx::query("DELETE FROM outbox_schema_migrations WHERE version = ?")
            .bind(last.version)
            .execute(&pool)
            .await
            .unwrap();
        let err = outbox.migrate(&pool).await.unwrap_err();
        match &err {
            crate::Error::Migration { version, reason, .. } => {
                assert_eq!(*version, last.version);
                assert!(reason.contains(last.name) && reason.contains("by hand"), "{reason}");
            }
            other => panic!("expected a migration error, got {other:?}"),
        }
    }

    /// Under MariaDB's snapshot isolation (`innodb_snapshot_isolation`, on by default from 11.6), a
    /// caller's transaction that read before another transaction wrote the same key's lock row is told
    /// "record has changed since last read" (1020) when it schedules that key. The whole transaction
    /// tried again succeeds, so the error says it is transient, as PostgreSQL's serialisation failures do.
    #[tokio::test]
    async fn a_key_written_since_the_callers_snapshot_is_a_transient_error() {
        let (pool, outbox) = migrated().await;
        let mut conn = pool.acquire().await.unwrap();
        if let Err(e) = sqlx::query("SET SESSION innodb_snapshot_isolation = ON").execute(&mut *conn).await {
            eprintln!("skipped: this server has no snapshot isolation (MariaDB 10.6.18+, 10.11.8+): {e}");
            return;
        }
        let mut first = conn.begin().await.unwrap();
        sqlx::query("SELECT count(*) FROM outbox_records").execute(&mut *first).await.unwrap();
        let mut second = pool.begin().await.unwrap();
        outbox.schedule(&mut second, crate::NewRecord::new("k", "t", "")).await.unwrap();
        second.commit().await.unwrap();
        let err = outbox.schedule(&mut first, crate::NewRecord::new("k", "t", "")).await.unwrap_err();
        assert!(err.is_transient(), "{err:?}");
    }

    /// A connection refused for the user's own connection limit (1203) is worth trying again, as one
    /// refused for the server's (1040) is: the outcome of a delivery whose write met it is not FAILED.
    #[tokio::test]
    async fn a_user_over_its_connection_limit_is_a_transient_error() {
        let base = std::env::var("MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306".into());
        let mut admin = MySqlConnection::connect(&base).await.unwrap();
        let user = format!("outbox_u_{}", Uuid::now_v7().simple());
        sqlx::raw_sql(AssertSqlSafe(format!("CREATE USER '{user}'@'%' WITH MAX_USER_CONNECTIONS 1")))
            .execute(&mut admin)
            .await
            .unwrap();
        let (scheme, server) = base.split_once("://").unwrap();
        let server = server.rsplit_once('@').map_or(server, |(_, host)| host);
        let url = format!("{scheme}://{user}@{server}");
        let held = MySqlConnection::connect(&url).await.unwrap();
        let refused = crate::Db::connect(&url).await.map(|_| ()).unwrap_err();
        drop(held);
        sqlx::raw_sql(AssertSqlSafe(format!("DROP USER '{user}'@'%'"))).execute(&mut admin).await.unwrap();
        assert!(refused.is_transient(), "{refused:?}");
    }

    /// A server running read-only (1290, as a primary turned read-only in a failover answers every
    /// write) is worth waiting out: a delivered record's completion that met it is not written FAILED.
    /// The errors are raised as the server sends them, without making the shared server read-only.
    #[tokio::test]
    async fn a_read_only_server_is_a_transient_error() {
        let base = std::env::var("MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306".into());
        let mut conn = MySqlConnection::connect(&base).await.unwrap();
        // Read-only server or transaction (MySQL's --innodb-read-only, transaction_read_only), a commit
        // Group Replication's certification rolled back.
        for errno in [1290, 1792, 1836, 3101] {
            let signal = format!("SIGNAL SQLSTATE 'HY000' SET MYSQL_ERRNO = {errno}, MESSAGE_TEXT = 'failing over'");
            let refused = sqlx::raw_sql(AssertSqlSafe(signal)).execute(&mut conn).await.unwrap_err();
            let sqlx::Error::Database(answer) = &refused else { panic!("{refused:?}") };
            // A read-only server's answer also retires the pools' older connections (3101 is not one).
            assert_eq!(super::is_read_only(answer.as_ref()), Some(errno != 3101), "{errno}");
            assert!(crate::Error::Database(refused).is_transient(), "{errno}");
        }
    }

    /// Only what a run's byte budget admits crosses the wire: for keys of ten 40 KiB records and a
    /// 100 KiB budget, each key's first two records. The statement sent every follower, and the client
    /// cut the runs after they had come (five times what it kept here; 32 times for runs of the default
    /// lookahead whose payloads fill the budget alone).
    #[tokio::test]
    async fn a_fetch_sends_only_what_the_byte_budget_admits() {
        let db = super::test_database().await;
        #[allow(irrefutable_let_patterns, reason = "the only variant in a MySQL-only build")]
        let Db::MySql(pool) = &db else { unreachable!("a MySQL database") };
        let outbox = Outbox::new(Config::default()).unwrap();
        outbox.migrate(&db).await.unwrap();
        let records: Vec<crate::NewRecord> = (0..10)
            .flat_map(|_| (0..3).map(|k| crate::NewRecord::new(format!("k{k}"), "t", vec![7_u8; 40 * 1024])))
            .collect();
        let mut tx = db.begin().await.unwrap();
        outbox.schedule_batch(&mut tx, &records).await.unwrap();
        tx.commit().await.unwrap();
        let instance = InstanceId::new();
        let register = "INSERT INTO outbox_instances (id, name, expires_at)
                        VALUES ($1, 'test', UTC_TIMESTAMP(6) + INTERVAL 1 DAY)";
        db.execute(register, &[instance.into()]).await.unwrap();
        db.execute("UPDATE outbox_partitions SET owner = $1, epoch = 1", &[instance.into()]).await.unwrap();
        let request = Request {
            instance,
            partitions: crate::partition::all_partitions().map(|p| (p, Epoch(1), None)).collect(),
            exclude: vec![],
            limit: 100,
            followers: 31,
            budget: 100 * 1024,
        };
        let sent = super::fetch_query(&outbox.statements().mysql, &request).unwrap().fetch_all(pool).await.unwrap();
        assert_eq!(sent.len(), 3 * 2, "rows sent for 3 keys");
    }

    /// A key's head is its lowest record whatever order the server walks the index in: the walk has no
    /// `ORDER BY` (its plan, pinned below on MariaDB, reads in index order), and a server that read a
    /// key's later records first, and stopped before its first, must not serve a later one ahead of it.
    /// Here the walk is made to read newest first: key `a`'s oldest records are past its limit.
    #[tokio::test]
    async fn a_walk_read_out_of_order_serves_no_record_ahead_of_its_key() {
        let instance = Uuid::now_v7();
        let pool = held_by(instance).await;
        let outbox = Outbox::new(Config::default()).unwrap();
        let records: Vec<crate::NewRecord> =
            (0..40).map(|_| crate::NewRecord::new("a", "t", "")).chain([crate::NewRecord::new("b", "t", "")]).collect();
        let mut tx = pool.begin().await.unwrap();
        let scheduled = outbox.schedule_batch(&mut *tx, &records).await.unwrap();
        tx.commit().await.unwrap();
        let all: Vec<(u8, Option<&str>)> = (0..=255).map(|p| (p, None)).collect();
        let request = Request { limit: 1, followers: 0, budget: usize::MAX, ..fetch_request(instance, &all, vec![]) };
        assert!(super::walk_records(&request) < 40, "the walk stops inside key a");
        for stop_on_first_failure in [true, false] {
            let mut statements = MySqlStatements::new("outbox", stop_on_first_failure, true, Duration::from_secs(10));
            let walk_end = "\n    LIMIT ?\n), keyed AS";
            assert!(statements.fetch.contains(walk_end), "the walk's end moved: change this test");
            statements.fetch =
                statements.fetch.replace(walk_end, "\n    ORDER BY r.seq DESC LIMIT ?\n), keyed AS").into();
            let found = super::fetch_query(&statements, &request).unwrap().fetch_all(&pool).await.unwrap();
            let first_of_a = scheduled[0].id;
            let served: Vec<(String, bool)> = found
                .iter()
                .filter(|row| row.due)
                .map(|row| (row.key.clone(), row.key != "a" || row.id == first_of_a))
                .collect();
            assert!(served.iter().all(|(_, first)| *first), "{stop_on_first_failure}: {served:?}");
        }
    }

    /// One line of MariaDB's `EXPLAIN`: query kind, table, access type, index, extra.
    #[derive(Debug)]
    struct Step {
        kind: String,
        table: String,
        access: String,
        index: String,
        extra: String,
    }

    fn explain(sql: &str) -> Query<'static, MySql, MySqlArguments> {
        sqlx::query(AssertSqlSafe(format!("EXPLAIN {sql}")))
    }

    /// The fetch of `partitions` (each with its start key) by `instance`, with `exclude` in flight: 100
    /// heads at most, 7 followers, a 64 KiB budget.
    fn fetch_request(instance: Uuid, partitions: &[(u8, Option<&str>)], exclude: Vec<String>) -> Request {
        Request {
            instance: InstanceId(instance),
            partitions: partitions.iter().map(|(p, after)| (*p, Epoch(1), after.map(String::from))).collect(),
            exclude,
            limit: 100,
            followers: 7,
            budget: 65_536,
        }
    }

    /// `EXPLAIN` of the fetch of `request`.
    fn explain_fetch(sql: &MySqlStatements, request: &Request) -> Query<'static, MySql, MySqlArguments> {
        sqlx::query_with(AssertSqlSafe(format!("EXPLAIN {}", sql.fetch)), super::fetch_arguments(request).unwrap())
    }

    /// A migrated test database whose partitions `instance` all holds at epoch 1, with a live lease.
    async fn held_by(instance: Uuid) -> MySqlPool {
        let (pool, _) = migrated().await;
        let held = format!(
            "UPDATE outbox_partitions SET epoch = 1, owner = UNHEX('{id}');
             INSERT INTO outbox_instances (id, name, expires_at)
             VALUES (UNHEX('{id}'), 'explain', UTC_TIMESTAMP(6) + INTERVAL 1 DAY);",
            id = instance.simple()
        );
        sqlx::raw_sql(AssertSqlSafe(held)).execute(&pool).await.unwrap();
        pool
    }

    /// `per_key` records for each of the keys `key-1` to `key-{keys}` (each in the partition of its
    /// number modulo 256), then the table's statistics taken anew.
    fn insert(keys: u32, per_key: u32) -> String {
        format!(
            "SET SESSION max_recursive_iterations = 100000;
             INSERT INTO outbox_records (id, `partition`, `key`, event_type, payload, headers)
             WITH RECURSIVE k (n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM k WHERE n < {keys}),
                 s (m) AS (SELECT 1 UNION ALL SELECT m + 1 FROM s WHERE m < {per_key})
             SELECT UNHEX(REPLACE(UUID(), '-', '')), n % 256, CONCAT('key-', n), 't', 'x', '{{}}'
             FROM s, k ORDER BY m, n;
             ANALYZE TABLE outbox_records;"
        )
    }

    async fn plan(conn: &mut MySqlConnection, explain: Query<'static, MySql, MySqlArguments>) -> Vec<Step> {
        let text = |row: &MySqlRow, column: &str| row.try_get::<Option<String>, _>(column).unwrap().unwrap_or_default();
        let rows = explain.fetch_all(conn).await.unwrap();
        rows.iter()
            .map(|row| Step {
                kind: text(row, "select_type"),
                table: text(row, "table"),
                access: text(row, "type"),
                index: text(row, "key"),
                extra: text(row, "Extra"),
            })
            .collect()
    }

    /// The list-joined statements go from the list to each row by primary key, whatever the table's size:
    /// a plan that scans would lock every row it passes in the locking ones (two workers' completions
    /// deadlocked that way on a table whose statistics said it was almost empty).
    async fn assert_found_by_primary_key(conn: &mut MySqlConnection, sql: &MySqlStatements, table_rows: &str) {
        let ids: String =
            sqlx::query_scalar("SELECT JSON_ARRAYAGG(JSON_ARRAY(HEX(id), 1, 'delivered')) FROM (SELECT id FROM outbox_records LIMIT 1000) t")
                .fetch_one(&mut *conn)
                .await
                .unwrap();
        let grants: String = sqlx::query_scalar(
            "SELECT JSON_ARRAYAGG(JSON_ARRAY(`partition`, HEX(owner), epoch)) FROM outbox_partitions",
        )
        .fetch_one(&mut *conn)
        .await
        .unwrap();
        let failures: String = sqlx::query_scalar(
            "SELECT JSON_ARRAYAGG(JSON_ARRAY(HEX(id), 0, 1, 'e', 0, 0)) FROM (SELECT id FROM outbox_records LIMIT 1000) t",
        )
        .fetch_one(&mut *conn)
        .await
        .unwrap();
        let keep = sql.keep.as_deref().unwrap_or_default();
        let statements = [
            ("records", "numbers", &*sql.numbers, &ids),
            ("records", "lock", &*sql.lock_done, &ids),
            ("records", "keep", keep, &ids),
            ("records", "delete", &*sql.delete, &ids),
            ("records", "lock failing", &*sql.lock_failing, &failures),
            ("records", "fail", &*sql.fail, &failures),
            ("partitions", "fence", &*sql.fence, &grants),
        ];
        for (table, name, text, list) in statements {
            let list = list.clone();
            let plan = plan(conn, explain(text).bind(list)).await;
            let alias = if table == "records" { "r" } else { "p" };
            let by_key = plan.iter().filter(|s| s.table == alias).all(|s| s.access == "eq_ref" && s.index == "PRIMARY");
            assert!(
                by_key && plan.iter().any(|s| s.table == alias),
                "{name} reads {table} other than by primary key ({table_rows}): {plan:#?}"
            );
        }
    }

    /// The fetch reads the records only through the (partition, key, seq) index: the walk by a range of
    /// its own per segment ("range checked for each record", no other index in its map), each head and
    /// follower by an index lookup, never a table or full index scan, in both stop-on-first-failure
    /// modes; completions find records by primary key.
    #[tokio::test]
    async fn fetch_walks_the_index_without_scanning_records() {
        let instance = Uuid::now_v7();
        let pool = held_by(instance).await;
        let mut conn = pool.acquire().await.unwrap();
        sqlx::raw_sql(AssertSqlSafe(insert(5, 1))).execute(&mut *conn).await.unwrap();
        let sql = MySqlStatements::new("outbox", true, true, Duration::from_secs(10));
        assert_found_by_primary_key(&mut conn, &sql, "5 records").await;

        // 2,000 keys × 20 records over 256 partitions.
        sqlx::raw_sql(AssertSqlSafe(insert(2000, 20))).execute(&mut *conn).await.unwrap();
        let records =
            |step: &Step| matches!(step.table.as_str(), "r" | "x" | "e") && !step.extra.contains("Table function");
        let walk = |step: &Step| step.extra.contains("Range checked for each record (index map: 0x2)");
        for stop_on_first_failure in [true, false] {
            let sql = MySqlStatements::new("outbox", stop_on_first_failure, true, Duration::from_secs(10));
            let request = fetch_request(instance, &[(0, None), (1, Some("key-500")), (2, None)], vec![]);
            let plan = plan(&mut conn, explain_fetch(&sql, &request)).await;
            assert!(plan.iter().any(|s| records(s) && walk(s)), "keys not walked by a range per segment: {plan:#?}");
            for step in plan.iter().filter(|s| records(s) && !walk(s)) {
                assert!(
                    matches!(step.access.as_str(), "range" | "ref" | "eq_ref")
                        && step.index == "outbox_records_partition_key_seq",
                    "records read other than by the (partition, key, seq) index: {step:?} in {plan:#?}"
                );
            }
            assert!(plan.iter().any(|s| s.table == "p" && s.access == "eq_ref"), "{plan:#?}");
        }
        assert_found_by_primary_key(
            &mut conn,
            &MySqlStatements::new("outbox", true, true, Duration::from_secs(10)),
            "40,005 records",
        )
        .await;
    }

    /// A poll (every partition, each with a start key) reads about as much of a backlog of 20,000 keys as
    /// of one of 2,000, their heads due or all FAILED: what its walk may read, not every key of the
    /// partitions asked for (which read ten times as much here, and took 30 s for 100,000 keys). Each
    /// segment's range is its own: read from the partition's start, the keys up to a start key would
    /// be read again.
    #[tokio::test]
    async fn a_poll_reads_as_much_of_a_large_backlog_as_of_a_small_one() {
        let instance = Uuid::now_v7();
        let pool = held_by(instance).await;
        let mut conn = pool.acquire().await.unwrap();
        let sql = MySqlStatements::new("outbox", true, true, Duration::from_secs(10));
        let all: Vec<(u8, Option<&str>)> = crate::partition::all_partitions().map(|p| (p, Some("key-5"))).collect();
        let request = fetch_request(instance, &all, vec![]);
        let reads = "SELECT CAST(SUM(VARIABLE_VALUE) AS SIGNED) FROM information_schema.SESSION_STATUS
                     WHERE VARIABLE_NAME LIKE 'HANDLER_READ%'";
        let mut read = Vec::new();
        for keys in [2_000, 20_000] {
            let refill = format!("DELETE FROM outbox_records; {}", insert(keys, 2));
            sqlx::raw_sql(AssertSqlSafe(refill)).execute(&mut *conn).await.unwrap();
            for failed in [false, true] {
                if failed {
                    sqlx::query("UPDATE outbox_records SET failed_at = UTC_TIMESTAMP(6)")
                        .execute(&mut *conn)
                        .await
                        .unwrap();
                }
                let before: i64 = sqlx::query_scalar(reads).fetch_one(&mut *conn).await.unwrap();
                let found = super::fetch_query(&sql, &request).unwrap().fetch_all(&mut *conn).await.unwrap();
                let after: i64 = sqlx::query_scalar(reads).fetch_one(&mut *conn).await.unwrap();
                let heads = found.iter().filter(|row| row.due && row.walk.is_some()).count();
                assert_eq!(heads, if failed { 0 } else { 100 }, "{keys} keys, failed: {failed}");
                assert_eq!(found.iter().filter(|row| row.stop).count(), usize::from(failed), "{keys} keys");
                read.push(after - before);
            }
        }
        assert!(
            read[2] <= 2 * read[0] && read[3] <= 2 * read[1],
            "rows read, due then FAILED, 2,000 then 20,000 keys: {read:?}"
        );
    }

    /// A poll (every partition) with keys in flight reads the list of keys in flight once: as a
    /// dependent subquery it was read again for every candidate key.
    #[tokio::test]
    async fn a_poll_reads_the_keys_in_flight_once() {
        let instance = Uuid::now_v7();
        let pool = held_by(instance).await;
        let mut conn = pool.acquire().await.unwrap();
        let all: Vec<(u8, Option<&str>)> = crate::partition::all_partitions().map(|p| (p, None)).collect();
        let in_flight: Vec<String> = (1..=100).map(|n| format!("key-{n}")).collect();
        // 1,000 keys of 2 records, as a steady load leaves them; then 1,000 keys of 50.
        for per_key in [2, 50] {
            let refill = format!("DELETE FROM outbox_records; {}", insert(1000, per_key));
            sqlx::raw_sql(AssertSqlSafe(refill)).execute(&mut *conn).await.unwrap();
            for stop_on_first_failure in [true, false] {
                let sql = MySqlStatements::new("outbox", stop_on_first_failure, true, Duration::from_secs(10));
                let request = fetch_request(instance, &all, in_flight.clone());
                let plan = plan(&mut conn, explain_fetch(&sql, &request)).await;
                assert!(
                    !plan.iter().any(|s| s.kind.contains("DEPENDENT") && s.extra.contains("Table function")),
                    "keys in flight read per candidate key ({per_key} per key): {plan:#?}"
                );
            }
        }
    }

    /// Fetches of any partitions are one statement, prepared once per connection: a statement closed
    /// to make room in sqlx's cache holds up the connection's next command (see `fetch_arguments`).
    #[tokio::test]
    async fn fetches_of_any_partitions_are_one_prepared_statement() {
        let pool = held_by(Uuid::now_v7()).await;
        let outbox = Outbox::new(Config::default()).unwrap();
        // One connection, so that its session counters see every fetch.
        let one =
            MySqlPoolOptions::new().max_connections(1).connect_with((*pool.connect_options()).clone()).await.unwrap();
        let counters = || async {
            let rows: Vec<(String, String)> = sqlx::query_as(
                "SELECT VARIABLE_NAME, VARIABLE_VALUE FROM information_schema.SESSION_STATUS
                 WHERE VARIABLE_NAME IN ('COM_STMT_CLOSE', 'COM_STMT_PREPARE') ORDER BY VARIABLE_NAME",
            )
            .fetch_all(&one)
            .await
            .unwrap();
            rows.into_iter().map(|(_, n)| n.parse::<i64>().unwrap()).collect::<Vec<_>>()
        };
        let before = counters().await;
        let db = Db::MySql(one.clone());
        for p in 0..=255_u8 {
            let request = Request {
                instance: InstanceId::new(),
                partitions: vec![(p, Epoch(1), None), (p.wrapping_mul(7), Epoch(1), Some("k".into()))],
                exclude: vec!["k".into()],
                limit: 10,
                followers: 3,
                budget: 1 << 20,
            };
            db.fetch(outbox.statements(), &request).await.unwrap();
        }
        let after = counters().await;
        assert_eq!(after[0] - before[0], 0, "statements closed (Com_stmt_close before, after: {before:?}, {after:?})");
        assert_eq!(
            after[1] - before[1],
            1,
            "statements prepared (Com_stmt_prepare before, after: {before:?}, {after:?})"
        );
    }
}
