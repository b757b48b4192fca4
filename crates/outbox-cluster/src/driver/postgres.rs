//! The PostgreSQL driver of `outbox-cluster`: its statements (`{s}` is the outbox schema) and their
//! execution.

use std::sync::Arc;
use std::time::Duration;

use outbox_core::driver::postgres::quoted;
use outbox_core::driver::{millis, statement};
use outbox_core::{Epochs, InstanceId, Partition};
use sqlx::{Connection, PgConnection, PgPool};

use crate::error::Result;
use crate::rebalance::Targets;
use crate::stored::{Held, InstanceInfo, Lease, PartitionOnly, Taken, View, ViewRow, remaining};

/// The lease's remaining time in milliseconds, by database time.
const REMAINING: &str = "(extract(epoch FROM expires_at - now()) * 1000)::bigint";

/// Registers an instance, live for `$3` ms, heartbeating every `$4` ms. Returns the lease's remaining
/// time. An id already there is registered afresh: it is a registration retried after its answer was
/// lost, which never owned a partition (see `Store::register`).
const REGISTER: &str = "INSERT INTO {s}.instances (id, name, expires_at, heartbeat_ms)
VALUES ($1, $2, now() + $3 * interval '1 millisecond', $4)
ON CONFLICT (id) DO UPDATE SET name = excluded.name, started_at = now(), heartbeat_at = now(),
    expires_at = excluded.expires_at, heartbeat_ms = excluded.heartbeat_ms, draining = false, delivered = 0,
    taken_over_at = NULL
RETURNING {remaining}";

/// Renews a lease that has not expired by database time, for `$2` ms; returns its remaining time. No
/// row: the lease had expired (or the instance was reaped), so the instance was declared dead and may
/// have lost its partitions: it must stop and register again. A lease whose partitions were taken
/// (`taken_over_at`, set by [`ACQUIRE`]) is not renewed either: a renewal that began before the expiry
/// and waited for the row behind that acquisition is checked again against the row it wrote (a row
/// merely locked is not checked again, nor would the clock's time then tell).
const HEARTBEAT: &str = "UPDATE {s}.instances
SET heartbeat_at = now(), expires_at = now() + $2 * interval '1 millisecond', delivered = $3
WHERE id = $1 AND taken_over_at IS NULL AND expires_at > now()
RETURNING {remaining}";

const DEREGISTER: &str = "DELETE FROM {s}.instances WHERE id = $1";

/// Removes instances whose lease expired more than `$1` ms ago, and more than twice their declared
/// heartbeat (see `Store::reap`).
const REAP: &str =
    "DELETE FROM {s}.instances WHERE expires_at < now() - greatest($1, 2 * heartbeat_ms) * interval '1 millisecond'";

/// Acquires the partitions targeted at this instance that are free or whose owner has no live lease by
/// database time. Each acquisition bumps the epoch, fencing out whatever the previous owner still tries
/// to write. Rows being written under a fence are skipped and retried next round. The owners' rows are
/// locked: a renewal written but not yet committed is waited for and its new expiry read, where the
/// statement's snapshot would still show the lease expired and take the partitions of an instance that
/// goes on delivering them. An owner whose partitions are taken is stamped `taken_over_at`, which ends
/// its lease for good (see [`HEARTBEAT`]); the lock is the update's own, so two acquisitions from one
/// owner queue rather than deadlock.
/// A partition taken from an owner is stamped `taken_over_at` too (see `Taken`), and quiet for twice
/// the owner's heartbeat interval or the acquirer's (`$2` ms), whichever is longer (the acquirer's
/// alone if the owner's row is gone), or what is left of an earlier period if longer still:
/// `quiet_until` keeps its end. An acquirer whose own lease has ended takes nothing: its id is one
/// nothing delivers under.
/// Returns (partition, epoch, previous owner, ms left of its quiet period if any, the partition's last
/// takeover time).
const ACQUIRE: &str = "WITH owners AS MATERIALIZED (
    SELECT i.id, i.expires_at, i.heartbeat_ms, i.taken_over_at FROM {s}.instances i
    WHERE i.id IN (SELECT p.owner FROM {s}.partitions p WHERE p.target_owner = $1 AND p.owner <> $1)
    FOR NO KEY UPDATE
), taken AS (
    SELECT p.partition, p.owner, greatest(0, ceil(extract(epoch FROM p.quiet_until - now()) * 1000),
        CASE WHEN p.owner IS NOT NULL THEN 2 * greatest(o.heartbeat_ms, $2) END)::bigint AS quiet_ms
    FROM {s}.partitions p LEFT JOIN owners o ON o.id = p.owner
    WHERE p.target_owner = $1 AND p.owner IS DISTINCT FROM $1
      AND (p.owner IS NULL OR o.id IS NULL OR o.expires_at <= now() OR o.taken_over_at IS NOT NULL)
      AND EXISTS (SELECT 1 FROM {s}.instances me WHERE me.id = $1 AND me.expires_at > now() AND me.taken_over_at IS NULL)
    FOR UPDATE OF p SKIP LOCKED
), ended AS (
    UPDATE {s}.instances i SET taken_over_at = coalesce(i.taken_over_at, now())
    FROM taken WHERE i.id = taken.owner
)
UPDATE {s}.partitions p SET owner = $1, epoch = p.epoch + 1, changed_at = now(),
    taken_over_at = CASE WHEN taken.owner IS NULL THEN p.taken_over_at ELSE now() END,
    quiet_until = CASE WHEN taken.quiet_ms > 0 THEN now() + taken.quiet_ms * interval '1 millisecond' END
FROM taken WHERE p.partition = taken.partition
RETURNING p.partition, p.epoch, taken.owner AS previous, nullif(taken.quiet_ms, 0) AS quiet_ms, p.taken_over_at";

/// What an ownership round reads: every partition's row with the ms left of its quiet period, then
/// (`partition` NULL) the instances taking part in the assignment (lease live by database time and
/// never taken over, not draining), each id in `owner`.
const VIEW: &str = "SELECT partition, owner, epoch, target_owner, taken_over_at,
    CASE WHEN quiet_until > now() THEN ceil(extract(epoch FROM quiet_until - now()) * 1000)::bigint END AS quiet_ms
FROM {s}.partitions
UNION ALL
SELECT NULL, id, NULL, NULL, NULL, NULL FROM {s}.instances
WHERE expires_at > now() AND taken_over_at IS NULL AND NOT draining";

/// Writes the targets that changed. `$1` partitions, `$2` target owners.
const SET_TARGETS: &str = "UPDATE {s}.partitions p SET target_owner = t.owner
FROM unnest($1::smallint[], $2::uuid[]) AS t(partition, owner)
WHERE p.partition = t.partition AND p.target_owner IS DISTINCT FROM t.owner
RETURNING p.partition";

/// Marks an instance as leaving: the assignment no longer counts it.
const DRAIN: &str = "UPDATE {s}.instances SET draining = true WHERE id = $1";

/// What this instance owns according to the database.
const OWNED: &str = "SELECT partition, epoch FROM {s}.partitions WHERE owner = $1 ORDER BY partition";

/// Releases partitions held at the given epochs (`$2`, `$3`); bumps the epoch so the next owner is fenced
/// apart from this one.
const RELEASE: &str = "UPDATE {s}.partitions p SET owner = NULL, epoch = p.epoch + 1, changed_at = now()
FROM unnest($2::smallint[], $3::bigint[]) AS r(partition, epoch)
WHERE p.partition = r.partition AND p.epoch = r.epoch AND p.owner = $1
RETURNING p.partition";

/// Instances with their lease state and partition counts, for status. By the clock as the rows are read,
/// not the transaction's start (`now()`): a heartbeat committed after the transaction began is newer
/// than that, and was shown in the future.
const INSTANCES: &str = "SELECT i.id, i.name, i.started_at, i.heartbeat_at,
    (i.expires_at > clock_timestamp() AND i.taken_over_at IS NULL) AS live, i.draining, i.delivered,
    (extract(epoch FROM clock_timestamp() - i.heartbeat_at) * 1000)::bigint AS heartbeat_age_ms,
    (SELECT count(*) FROM {s}.partitions p WHERE p.owner = i.id) AS partitions
FROM {s}.instances i ORDER BY i.started_at";

/// The statements, built for one schema.
#[derive(Debug)]
pub(super) struct PgStatements {
    register: Arc<str>,
    heartbeat: Arc<str>,
    deregister: Arc<str>,
    reap: Arc<str>,
    acquire: Arc<str>,
    owned: Arc<str>,
    release: Arc<str>,
    instances: Arc<str>,
    view: Arc<str>,
    set_targets: Arc<str>,
    drain: Arc<str>,
    /// Begins the transaction each statement runs in (see [`PgStatements::limited`]).
    begin: Arc<str>,
    /// How long the heartbeat connection's statements wait for a lock.
    heartbeat_lock_limit: Duration,
}

impl PgStatements {
    /// `schema` is validated by the outbox's config; quoted, a reserved word such as `user` names it too.
    /// The store's transactions wait for locks or sit idle for at most `hold` (see
    /// [`PgStatements::limited`]), the heartbeat's statements wait for locks for at most `limit`.
    pub(super) fn new(schema: &str, hold: Duration, limit: Duration) -> Self {
        let schema = quoted(schema);
        let build = |text: &str| -> Arc<str> { text.replace("{remaining}", REMAINING).replace("{s}", &schema).into() };
        Self {
            register: build(REGISTER),
            heartbeat: build(HEARTBEAT),
            deregister: build(DEREGISTER),
            reap: build(REAP),
            acquire: build(ACQUIRE),
            owned: build(OWNED),
            release: build(RELEASE),
            instances: build(INSTANCES),
            view: build(VIEW),
            set_targets: build(SET_TARGETS),
            drain: build(DRAIN),
            begin: {
                let ms = hold.as_millis().max(1);
                format!("BEGIN; SET LOCAL lock_timeout = {ms}; SET LOCAL idle_in_transaction_session_timeout = {ms}")
                    .into()
            },
            heartbeat_lock_limit: limit,
        }
    }

    /// Runs `work` on `conn` in a transaction that waits for a lock, or sits idle (its host vanished
    /// before the `COMMIT`), for at most the store's `hold`, as MySQL's do. PostgreSQL does not notice
    /// a closed client while a statement waits for a lock, so behind a lock held long (an operator's
    /// open transaction on an instance row, a `LOCK TABLE`, DDL) every round given up went on waiting,
    /// one more connection each time, until the server refused the application's connections too. A
    /// step merely slow is not cut short on the server: given up before its `COMMIT`, it is rolled back
    /// with its connection; given up in its `COMMIT`, it may still commit, as one whose answer was lost
    /// does, which the rounds allow for.
    pub(super) async fn limited<T>(
        &self,
        conn: &mut PgConnection,
        work: impl AsyncFnOnce(&mut PgConnection) -> Result<T>,
    ) -> Result<T> {
        let mut tx = conn.begin_with(statement(&self.begin)).await?;
        let done = work(&mut tx).await?;
        tx.commit().await?;
        Ok(done)
    }

    pub(super) async fn register(
        &self,
        conn: &mut PgConnection,
        id: InstanceId,
        name: &str,
        lease: Lease,
    ) -> Result<Duration> {
        let ms: i64 = sqlx::query_scalar(statement(&self.register))
            .bind(id)
            .bind(name)
            .bind(millis(lease.live))
            .bind(millis(lease.heartbeat))
            .fetch_one(conn)
            .await?;
        Ok(remaining(ms))
    }

    /// Renews on `own` (connected to `pool`'s database on first use).
    pub(super) async fn heartbeat(
        &self,
        pool: &PgPool,
        own: &mut Option<PgConnection>,
        id: InstanceId,
        live: Duration,
        delivered: i64,
    ) -> Result<Option<Duration>> {
        let conn = match own {
            Some(conn) => conn,
            // Its statements wait for a lock for at most `query_timeout` (see `limited`).
            None => {
                let limit = format!("{}ms", self.heartbeat_lock_limit.as_millis().max(1));
                let session = [("lock_timeout", limit.as_str())];
                own.insert(PgConnection::connect_with(&(*pool.connect_options()).clone().options(session)).await?)
            }
        };
        let ms: Option<i64> = sqlx::query_scalar(statement(&self.heartbeat))
            .bind(id)
            .bind(millis(live))
            .bind(delivered)
            .fetch_optional(conn)
            .await?;
        Ok(ms.map(remaining))
    }

    pub(super) async fn deregister(&self, conn: &mut PgConnection, id: InstanceId) -> Result<()> {
        sqlx::query(statement(&self.deregister)).bind(id).execute(conn).await?;
        Ok(())
    }

    pub(super) async fn reap(&self, conn: &mut PgConnection, grace: Duration) -> Result<u64> {
        Ok(sqlx::query(statement(&self.reap)).bind(millis(grace)).execute(conn).await?.rows_affected())
    }

    pub(super) async fn acquire(
        &self,
        conn: &mut PgConnection,
        me: InstanceId,
        heartbeat: Duration,
    ) -> Result<Vec<Taken>> {
        Ok(sqlx::query_as(statement(&self.acquire)).bind(me).bind(millis(heartbeat)).fetch_all(conn).await?)
    }

    pub(super) async fn owned(&self, conn: &mut PgConnection, me: InstanceId) -> Result<Epochs> {
        let rows: Vec<Held> = sqlx::query_as(statement(&self.owned)).bind(me).fetch_all(conn).await?;
        Ok(rows.into_iter().map(|h| (h.partition, h.epoch)).collect())
    }

    pub(super) async fn release(
        &self,
        conn: &mut PgConnection,
        me: InstanceId,
        held: &Epochs,
    ) -> Result<Vec<Partition>> {
        let (partitions, epochs): (Vec<i16>, Vec<i64>) = held.iter().map(|(&p, e)| (i16::from(p), e.0)).unzip();
        let rows: Vec<PartitionOnly> =
            sqlx::query_as(statement(&self.release)).bind(me).bind(&partitions).bind(&epochs).fetch_all(conn).await?;
        Ok(rows.into_iter().map(|r| r.partition).collect())
    }

    pub(super) async fn view(&self, conn: &mut PgConnection) -> Result<View> {
        let rows: Vec<ViewRow> = sqlx::query_as(statement(&self.view)).fetch_all(conn).await?;
        Ok(View::from_rows(rows)?)
    }

    pub(super) async fn set_targets(&self, conn: &mut PgConnection, targets: &Targets) -> Result<Vec<Partition>> {
        let (partitions, owners): (Vec<i16>, Vec<InstanceId>) =
            targets.iter().map(|(&p, &owner)| (i16::from(p), owner)).unzip();
        let rows: Vec<PartitionOnly> =
            sqlx::query_as(statement(&self.set_targets)).bind(&partitions).bind(&owners).fetch_all(conn).await?;
        Ok(rows.into_iter().map(|r| r.partition).collect())
    }

    pub(super) async fn drain(&self, conn: &mut PgConnection, me: InstanceId) -> Result<()> {
        sqlx::query(statement(&self.drain)).bind(me).execute(conn).await?;
        Ok(())
    }

    pub(super) async fn instances(&self, conn: &mut PgConnection) -> Result<Vec<InstanceInfo>> {
        Ok(sqlx::query_as(statement(&self.instances)).fetch_all(conn).await?)
    }
}
