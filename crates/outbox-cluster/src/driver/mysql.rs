//! The MySQL driver of `outbox-cluster`: its statements (`{s}_` prefixes the tables, in the connection's
//! database) and their execution. Liveness compares against the server's UTC clock. The compare-and-set
//! steps (acquire, release, targets) lock the rows they check `FOR UPDATE` and change them in the same
//! transaction; lists travel as one JSON argument each.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use outbox_core::driver::mysql::{begin_statement, render, session_seconds, transaction};
use outbox_core::driver::{json, millis, statement};
use outbox_core::{Epochs, InstanceId, Partition};
use sqlx::{Connection, MySqlConnection, MySqlPool};

use crate::error::Result;
use crate::rebalance::Targets;
use crate::stored::{Held, InstanceInfo, Lease, PartitionOnly, Taken, View, ViewRow};

/// Registers an instance, afresh if its id is there (see the PostgreSQL statement). Binds: id, name,
/// lease ms, heartbeat ms.
const REGISTER: &str = "INSERT INTO {s}_instances (id, name, expires_at, heartbeat_ms)
VALUES (?, ?, {now} + INTERVAL (? * 1000) MICROSECOND, ?)
ON DUPLICATE KEY UPDATE name = VALUES(name), started_at = {now}, heartbeat_at = {now},
    expires_at = VALUES(expires_at), heartbeat_ms = VALUES(heartbeat_ms), draining = FALSE, delivered = 0,
    taken_over_at = NULL";

/// Renews a lease that has not expired and whose partitions were not taken (see the PostgreSQL
/// statement). Binds: lease ms, delivered, id. No row matched: the lease had ended. A renewal that
/// waited for the row's lock reads the row as committed then, so it finds a takeover that happened
/// meanwhile (`taken_over_at`, set by [`MARK_TAKEN_OVER`]), though `{now}` is the statement's start.
const HEARTBEAT: &str =
    "UPDATE {s}_instances SET heartbeat_at = {now}, expires_at = {now} + INTERVAL (? * 1000) MICROSECOND,
    delivered = ?
WHERE id = ? AND taken_over_at IS NULL AND expires_at > {now}";

const DEREGISTER: &str = "DELETE FROM {s}_instances WHERE id = ?";

/// The instances whose lease expired more than `?` ms ago, and more than twice their declared heartbeat
/// (see `Store::reap`), read without locks: the reap then deletes
/// them by their ids ([`REAP`]). A `DELETE` that chose its rows itself scanned the table, and at
/// REPEATABLE READ kept every row it read locked while it waited for one (an owner's row a renewal or
/// an acquisition held), holding up the renewals of live instances as long.
const EXPIRED: &str = "SELECT HEX(id) FROM {s}_instances WHERE expires_at < {now} - INTERVAL (GREATEST(?, 2 * heartbeat_ms) * 1000) MICROSECOND";

/// Deletes the instances of `?` (JSON array of hex ids) whose lease expired as [`EXPIRED`] reads.
const REAP: &str = "DELETE i FROM JSON_TABLE(?, '$[*]' COLUMNS (id CHAR(32) PATH '$')) t
STRAIGHT_JOIN {s}_instances i FORCE INDEX (PRIMARY) ON i.id = UNHEX(t.id)
WHERE i.expires_at < {now} - INTERVAL (GREATEST(?, 2 * i.heartbeat_ms) * 1000) MICROSECOND";

/// The instances owning partitions targeted at `?` (bound twice) elsewhere, hex ids in id order, read
/// without locks; [`LOCK_OWNERS`] then locks them by id. Locking them here, through `IN (SELECT …)`,
/// scanned the instances and kept every row it read locked while it waited for one.
const OWNERS: &str = "SELECT DISTINCT HEX(owner) FROM {s}_partitions
WHERE target_owner = ? AND NOT (owner <=> ?) AND owner IS NOT NULL ORDER BY 1";

/// Locks the rows of the instances of `?` (JSON array of hex ids, in id order) before [`ACQUIRABLE`]
/// judges their leases: a renewal written but not yet committed is waited for, and the next
/// statement's snapshot sees it, where it would otherwise find the lease expired and take the
/// partitions of an instance that goes on delivering them. Locked for update, as [`MARK_TAKEN_OVER`]
/// writes them, and in id order: two acquisitions from one owner then queue rather than deadlock.
const LOCK_OWNERS: &str = "SELECT i.id FROM JSON_TABLE(?, '$[*]' COLUMNS (owner CHAR(32) PATH '$')) t
STRAIGHT_JOIN {s}_instances i FORCE INDEX (PRIMARY) ON i.id = UNHEX(t.owner)
FOR UPDATE";

/// Partitions targeted at `?` (bound three times, after the acquirer's heartbeat interval `?`) that are
/// free or whose owner has no live lease (one whose partitions were taken has none, whatever its expiry
/// reads), with that owner, the ms of the quiet period taking it starts (see the PostgreSQL statement)
/// and the takeover time they will have; rows a fenced write holds are skipped. None while the
/// acquirer's own lease has ended.
const ACQUIRABLE: &str = "SELECT p.`partition`, p.owner AS previous, p.epoch + 1 AS epoch,
    NULLIF(GREATEST(0, IFNULL((TIMESTAMPDIFF(MICROSECOND, {now}, p.quiet_until) + 999) DIV 1000, 0),
        IF(p.owner IS NULL, 0,
            2 * GREATEST(IFNULL((SELECT i.heartbeat_ms FROM {s}_instances i WHERE i.id = p.owner), 0), ?))), 0) AS quiet_ms,
    IF(p.owner IS NULL, p.taken_over_at, UTC_TIMESTAMP(6)) AS taken_over_at
FROM {s}_partitions p
WHERE p.target_owner = ? AND NOT (p.owner <=> ?)
  AND (p.owner IS NULL OR NOT EXISTS (
      SELECT 1 FROM {s}_instances i WHERE i.id = p.owner AND i.expires_at > {now} AND i.taken_over_at IS NULL))
  AND EXISTS (SELECT 1 FROM {s}_instances me WHERE me.id = ? AND me.expires_at > {now} AND me.taken_over_at IS NULL)
FOR UPDATE SKIP LOCKED";

/// Takes the (locked) partitions of `?` (JSON array of `[partition, 1 if taken from an owner, quiet
/// ms]`) for `?`, bumping their epochs, each quiet until that many ms from now, and stamps those taken
/// from an owner with the takeover time `?` that [`ACQUIRABLE`] read. Joins, here and below, go from
/// the list to each row by its primary key (`IN (SELECT …)`, or a plan that scans, would read, and
/// lock, every partition).
const TAKE: &str =
    "UPDATE JSON_TABLE(?, '$[*]' COLUMNS (x SMALLINT PATH '$[0]', stolen INT PATH '$[1]', quiet BIGINT PATH '$[2]')) t
STRAIGHT_JOIN {s}_partitions p FORCE INDEX (PRIMARY) ON p.`partition` = t.x
SET p.owner = ?, p.epoch = p.epoch + 1, p.changed_at = {now}, p.taken_over_at = IF(t.stolen = 1, ?, p.taken_over_at),
    p.quiet_until = IF(t.quiet > 0, {now} + INTERVAL (t.quiet * 1000) MICROSECOND, NULL)";

/// Stamps the owners of `?` (JSON array of hex ids) whose partitions [`TAKE`] took at `?`: their leases
/// end for good (see [`HEARTBEAT`]).
const MARK_TAKEN_OVER: &str = "UPDATE JSON_TABLE(?, '$[*]' COLUMNS (owner CHAR(32) PATH '$')) t
STRAIGHT_JOIN {s}_instances i FORCE INDEX (PRIMARY) ON i.id = UNHEX(t.owner)
SET i.taken_over_at = IFNULL(i.taken_over_at, ?)";

/// What an ownership round reads: every partition's row with the ms left of its quiet period, then
/// (`partition` NULL) the instances taking part in the assignment (lease live by database time and
/// never taken over, not draining), each id in `owner`.
const VIEW: &str = "SELECT `partition`, owner, epoch, target_owner, taken_over_at,
    IF(quiet_until > {now}, (TIMESTAMPDIFF(MICROSECOND, {now}, quiet_until) + 999) DIV 1000, NULL) AS quiet_ms
FROM {s}_partitions
UNION ALL
SELECT NULL, id, NULL, NULL, NULL, NULL FROM {s}_instances
WHERE expires_at > {now} AND taken_over_at IS NULL AND NOT draining";

/// The targets of `?` (JSON `[[partition, hex owner], …]`) that differ from the stored ones. Not a
/// locking read: that would lock, and wait for, every partition named, where fenced completions hold
/// rows `FOR SHARE`; [`SET_TARGETS`] then writes only these.
const CHANGED_TARGETS: &str = "SELECT p.`partition`
FROM JSON_TABLE(?, '$[*]' COLUMNS (part SMALLINT PATH '$[0]', owner CHAR(32) PATH '$[1]')) t
STRAIGHT_JOIN {s}_partitions p FORCE INDEX (PRIMARY) ON p.`partition` = t.part
WHERE NOT (p.target_owner <=> UNHEX(t.owner))";

/// Writes the targets of `?` (only those that change: every row an `UPDATE` joins is locked, changed
/// or not).
const SET_TARGETS: &str =
    "UPDATE JSON_TABLE(?, '$[*]' COLUMNS (part SMALLINT PATH '$[0]', owner CHAR(32) PATH '$[1]')) t
STRAIGHT_JOIN {s}_partitions p FORCE INDEX (PRIMARY) ON p.`partition` = t.part
SET p.target_owner = UNHEX(t.owner)";

const DRAIN: &str = "UPDATE {s}_instances SET draining = TRUE WHERE id = ?";

const OWNED: &str = "SELECT `partition`, epoch FROM {s}_partitions WHERE owner = ? ORDER BY `partition`";

/// The partitions of `?` (JSON `[[partition, epoch], …]`) `?` still holds at those epochs, locked.
const RELEASABLE: &str = "SELECT p.`partition`
FROM JSON_TABLE(?, '$[*]' COLUMNS (part SMALLINT PATH '$[0]', epoch BIGINT PATH '$[1]')) r
STRAIGHT_JOIN {s}_partitions p FORCE INDEX (PRIMARY) ON p.`partition` = r.part AND p.epoch = r.epoch
WHERE p.owner = ? FOR UPDATE";

const RELEASE: &str = "UPDATE JSON_TABLE(?, '$[*]' COLUMNS (x SMALLINT PATH '$')) t
STRAIGHT_JOIN {s}_partitions p FORCE INDEX (PRIMARY) ON p.`partition` = t.x
SET p.owner = NULL, p.epoch = p.epoch + 1, p.changed_at = {now}";

const INSTANCES: &str = "SELECT i.id, i.name, i.started_at, i.heartbeat_at,
    (i.expires_at > {now} AND i.taken_over_at IS NULL) AS live,
    i.draining, i.delivered, CAST(TIMESTAMPDIFF(MICROSECOND, i.heartbeat_at, {now}) DIV 1000 AS SIGNED) AS heartbeat_age_ms,
    (SELECT count(*) FROM {s}_partitions p WHERE p.owner = i.id) AS partitions
FROM {s}_instances i ORDER BY i.started_at";

/// The statements, built for one table prefix.
#[derive(Debug)]
pub(super) struct MySqlStatements {
    /// Sets up the heartbeat's own connection.
    heartbeat_session: Arc<str>,
    begin: Arc<str>,
    register: Arc<str>,
    heartbeat: Arc<str>,
    deregister: Arc<str>,
    expired: Arc<str>,
    reap: Arc<str>,
    owners: Arc<str>,
    lock_owners: Arc<str>,
    acquirable: Arc<str>,
    take: Arc<str>,
    mark_taken_over: Arc<str>,
    view: Arc<str>,
    changed_targets: Arc<str>,
    set_targets: Arc<str>,
    drain: Arc<str>,
    owned: Arc<str>,
    releasable: Arc<str>,
    release: Arc<str>,
    instances: Arc<str>,
}

impl MySqlStatements {
    /// `schema` is validated by the outbox's config; the store's transactions hold or wait for rows for
    /// at most `hold`, the heartbeat's statements wait for a row for at most `limit` (whole seconds).
    pub(super) fn new(schema: &str, hold: Duration, limit: Duration) -> Self {
        let build = |text: &str| -> Arc<str> { render(text, schema).into() };
        Self {
            heartbeat_session: format!(
                "SET autocommit = 1, SESSION innodb_lock_wait_timeout = {}",
                session_seconds(limit)
            )
            .into(),
            begin: begin_statement(hold),
            register: build(REGISTER),
            heartbeat: build(HEARTBEAT),
            deregister: build(DEREGISTER),
            expired: build(EXPIRED),
            reap: build(REAP),
            owners: build(OWNERS),
            lock_owners: build(LOCK_OWNERS),
            acquirable: build(ACQUIRABLE),
            take: build(TAKE),
            mark_taken_over: build(MARK_TAKEN_OVER),
            view: build(VIEW),
            changed_targets: build(CHANGED_TARGETS),
            set_targets: build(SET_TARGETS),
            drain: build(DRAIN),
            owned: build(OWNED),
            releasable: build(RELEASABLE),
            release: build(RELEASE),
            instances: build(INSTANCES),
        }
    }

    /// Runs `work` on `conn` in a transaction that waits for a row, or sits idle (its host vanished
    /// before the `COMMIT`), for at most the store's `hold`. A statement on its own waited for a row at
    /// the server's `innodb_lock_wait_timeout` (50 s by default), and MySQL does not end a row lock's
    /// wait when its client goes: behind an instance row held long (an operator's open transaction)
    /// each step given up went on waiting with a connection of its own, and applied once the row was
    /// free.
    pub(super) async fn limited<T>(
        &self,
        conn: &mut MySqlConnection,
        work: impl AsyncFnOnce(&mut MySqlConnection) -> Result<T>,
    ) -> Result<T> {
        transaction(conn, &self.begin, work).await
    }

    /// The lease runs from the insert's database time, so it has all of `lease.live` left.
    pub(super) async fn register(
        &self,
        conn: &mut MySqlConnection,
        id: InstanceId,
        name: &str,
        lease: Lease,
    ) -> Result<Duration> {
        outbox_core::driver::mysql::check_session(&mut *conn).await?;
        sqlx::query(statement(&self.register))
            .bind(id)
            .bind(name)
            .bind(millis(lease.live))
            .bind(millis(lease.heartbeat))
            .execute(conn)
            .await?;
        Ok(lease.live)
    }

    /// Renews on `own` (connected to `pool`'s database on first use).
    pub(super) async fn heartbeat(
        &self,
        pool: &MySqlPool,
        own: &mut Option<MySqlConnection>,
        id: InstanceId,
        live: Duration,
        delivered: i64,
    ) -> Result<Option<Duration>> {
        let conn = match own {
            Some(conn) => conn,
            None => {
                // The pool's options carry none of its connect hooks: on a server whose default is
                // `autocommit = 0` (the workers' pool turning it on in a hook), each renewal would stay
                // uncommitted, seen by this node alone, and hold its instance row locked. Its renewals
                // wait for the row for `query_timeout` at most (see `limited`).
                let mut conn = MySqlConnection::connect_with(&pool.connect_options()).await?;
                sqlx::raw_sql(statement(&self.heartbeat_session)).execute(&mut conn).await?;
                own.insert(conn)
            }
        };
        let renewed = sqlx::query(statement(&self.heartbeat))
            .bind(millis(live))
            .bind(delivered)
            .bind(id)
            .execute(conn)
            .await?
            .rows_affected();
        Ok((renewed > 0).then_some(live))
    }

    pub(super) async fn deregister(&self, conn: &mut MySqlConnection, id: InstanceId) -> Result<()> {
        sqlx::query(statement(&self.deregister)).bind(id).execute(conn).await?;
        Ok(())
    }

    pub(super) async fn reap(&self, conn: &mut MySqlConnection, grace: Duration) -> Result<u64> {
        let expired: Vec<String> =
            sqlx::query_scalar(statement(&self.expired)).bind(millis(grace)).fetch_all(&mut *conn).await?;
        if expired.is_empty() {
            return Ok(0);
        }
        let reap = sqlx::query(statement(&self.reap)).bind(json(&expired)?).bind(millis(grace));
        Ok(reap.execute(conn).await?.rows_affected())
    }

    pub(super) async fn acquire(
        &self,
        conn: &mut MySqlConnection,
        me: InstanceId,
        heartbeat: Duration,
    ) -> Result<Vec<Taken>> {
        let owners: Vec<String> =
            sqlx::query_scalar(statement(&self.owners)).bind(me).bind(me).fetch_all(&mut *conn).await?;
        if !owners.is_empty() {
            sqlx::query(statement(&self.lock_owners)).bind(json(&owners)?).execute(&mut *conn).await?;
        }
        let acquirable = sqlx::query_as(statement(&self.acquirable)).bind(millis(heartbeat)).bind(me).bind(me).bind(me);
        let taken: Vec<Taken> = acquirable.fetch_all(&mut *conn).await?;
        if !taken.is_empty() {
            let partitions: Vec<(i16, u8, i64)> = taken
                .iter()
                .map(|t| (i16::from(t.partition), u8::from(t.previous.is_some()), t.quiet_ms.unwrap_or(0)))
                .collect();
            let at = taken.iter().find(|t| t.previous.is_some()).and_then(|t| t.taken_over_at);
            let take = sqlx::query(statement(&self.take)).bind(json(&partitions)?).bind(me).bind(at);
            take.execute(&mut *conn).await?;
            let owners: BTreeSet<String> =
                taken.iter().filter_map(|t| Some(t.previous?.0.simple().to_string())).collect();
            if !owners.is_empty() {
                let mark = sqlx::query(statement(&self.mark_taken_over)).bind(json(&owners)?).bind(at);
                mark.execute(&mut *conn).await?;
            }
        }
        Ok(taken)
    }

    pub(super) async fn owned(&self, conn: &mut MySqlConnection, me: InstanceId) -> Result<Epochs> {
        let rows: Vec<Held> = sqlx::query_as(statement(&self.owned)).bind(me).fetch_all(conn).await?;
        Ok(rows.into_iter().map(|h| (h.partition, h.epoch)).collect())
    }

    pub(super) async fn release(
        &self,
        conn: &mut MySqlConnection,
        me: InstanceId,
        held: &Epochs,
    ) -> Result<Vec<Partition>> {
        let held: Vec<(i16, i64)> = held.iter().map(|(&p, e)| (i16::from(p), e.0)).collect();
        let rows: Vec<PartitionOnly> =
            sqlx::query_as(statement(&self.releasable)).bind(json(&held)?).bind(me).fetch_all(&mut *conn).await?;
        let released: Vec<Partition> = rows.into_iter().map(|r| r.partition).collect();
        if !released.is_empty() {
            let partitions: Vec<i16> = released.iter().map(|&p| i16::from(p)).collect();
            sqlx::query(statement(&self.release)).bind(json(&partitions)?).execute(&mut *conn).await?;
        }
        Ok(released)
    }

    pub(super) async fn view(&self, conn: &mut MySqlConnection) -> Result<View> {
        let rows: Vec<ViewRow> = sqlx::query_as(statement(&self.view)).fetch_all(conn).await?;
        Ok(View::from_rows(rows)?)
    }

    pub(super) async fn set_targets(&self, conn: &mut MySqlConnection, targets: &Targets) -> Result<Vec<Partition>> {
        // `[[partition, hex owner], …]` of the targets of `partitions`.
        let listed = |partitions: &mut dyn Iterator<Item = &Partition>| -> Result<String> {
            let list: Vec<(i16, String)> = partitions
                .filter_map(|p| targets.get(p).map(|owner| (i16::from(*p), owner.0.simple().to_string())))
                .collect();
            Ok(json(&list)?)
        };
        let rows: Vec<PartitionOnly> = sqlx::query_as(statement(&self.changed_targets))
            .bind(listed(&mut targets.keys())?)
            .fetch_all(&mut *conn)
            .await?;
        let changed: Vec<Partition> = rows.into_iter().map(|r| r.partition).collect();
        if !changed.is_empty() {
            sqlx::query(statement(&self.set_targets)).bind(listed(&mut changed.iter())?).execute(&mut *conn).await?;
        }
        Ok(changed)
    }

    pub(super) async fn drain(&self, conn: &mut MySqlConnection, me: InstanceId) -> Result<()> {
        sqlx::query(statement(&self.drain)).bind(me).execute(conn).await?;
        Ok(())
    }

    pub(super) async fn instances(&self, conn: &mut MySqlConnection) -> Result<Vec<InstanceInfo>> {
        Ok(sqlx::query_as(statement(&self.instances)).fetch_all(conn).await?)
    }
}

#[cfg(test)]
mod tests {
    use outbox_core::driver::mysql::{test_database, transaction};
    use outbox_core::driver::statement;
    use outbox_core::{Config, Db, InstanceId, Outbox};
    use sqlx::Connection;

    use super::MySqlStatements;
    use crate::stored::Taken;

    /// An ownership round's look for its free partitions locks only those it finds: meanwhile another
    /// instance's fenced completion (a share lock on its own partitions) goes ahead instead of waiting.
    #[tokio::test]
    async fn an_ownership_round_locks_only_the_partitions_it_takes() {
        #[allow(irrefutable_let_patterns)] // in a build with MySQL alone
        let Db::MySql(pool) = test_database().await else { unreachable!("a MySQL test database") };
        Outbox::new(Config::default()).unwrap().migrate(&pool).await.unwrap();
        let (a, b) = (InstanceId::new(), InstanceId::new());
        sqlx::query(
            "INSERT INTO outbox_instances (id, name, expires_at) VALUES (?, 'a', UTC_TIMESTAMP(6) + INTERVAL 1 DAY)",
        )
        .bind(a)
        .execute(&pool)
        .await
        .unwrap();
        sqlx::query("UPDATE outbox_partitions SET target_owner = IF(`partition` < 8, ?, ?)")
            .bind(a)
            .bind(b)
            .execute(&pool)
            .await
            .unwrap();
        let statements =
            MySqlStatements::new("outbox", std::time::Duration::from_secs(10), std::time::Duration::from_secs(10));
        let mut own = pool.acquire().await.unwrap();
        let mut other = pool.acquire().await.unwrap();
        transaction(&mut own, &statements.begin, async |round| {
            let found: Vec<Taken> = sqlx::query_as(statement(&statements.acquirable))
                .bind(100)
                .bind(a)
                .bind(a)
                .bind(a)
                .fetch_all(&mut *round)
                .await?;
            assert_eq!(found.len(), 8);
            sqlx::query("SET SESSION innodb_lock_wait_timeout = 1").execute(&mut *other).await?;
            let mut fence = other.begin().await?;
            let shared: Vec<(i16,)> =
                sqlx::query_as("SELECT `partition` FROM outbox_partitions WHERE `partition` >= 8 LOCK IN SHARE MODE")
                    .fetch_all(&mut *fence)
                    .await
                    .expect("the round locked partitions it did not take");
            assert_eq!(shared.len(), 248);
            fence.rollback().await
        })
        .await
        .unwrap();
    }
}
