//! Every PostgreSQL statement of `outbox-cluster`, in one place (`{s}` is the outbox schema); SQLite's
//! are in `sqlite.rs`.

use std::sync::Arc;

use sqlx::AssertSqlSafe;

/// The lease's remaining time in milliseconds, by database time.
const REMAINING: &str = "(extract(epoch FROM expires_at - now()) * 1000)::bigint";

/// Registers an instance, live for `$3` ms, heartbeating every `$4` ms. Returns the lease's remaining
/// time.
const REGISTER: &str = "INSERT INTO {s}.instances (id, name, expires_at, heartbeat_ms)
VALUES ($1, $2, now() + $3 * interval '1 millisecond', $4)
RETURNING {remaining}";

/// Renews a lease that has not expired by database time, for `$2` ms; returns its remaining time. No
/// row: the lease had expired (or the instance was reaped), so the instance was declared dead and may
/// have lost its partitions: it must stop and register again.
const HEARTBEAT: &str = "UPDATE {s}.instances
SET heartbeat_at = now(), expires_at = now() + $2 * interval '1 millisecond'
WHERE id = $1 AND expires_at > now()
RETURNING {remaining}";

const DEREGISTER: &str = "DELETE FROM {s}.instances WHERE id = $1";

/// Removes instances whose lease expired more than `$1` ms ago.
const REAP: &str = "DELETE FROM {s}.instances WHERE expires_at < now() - $1 * interval '1 millisecond'";

/// Acquires the partitions targeted at this instance that are free or whose owner has no live lease by
/// database time. Each acquisition bumps the epoch, fencing out whatever the previous owner still tries
/// to write. Rows being written under a fence are skipped and retried next round.
/// Returns (partition, epoch, previous owner, the previous owner's heartbeat interval in ms if its row
/// is still there).
const ACQUIRE: &str = "WITH taken AS (
    SELECT p.partition, p.owner,
           (SELECT i.heartbeat_ms FROM {s}.instances i WHERE i.id = p.owner) AS heartbeat_ms
    FROM {s}.partitions p
    WHERE p.target_owner = $1 AND p.owner IS DISTINCT FROM $1
      AND (p.owner IS NULL OR NOT EXISTS (
          SELECT 1 FROM {s}.instances i WHERE i.id = p.owner AND i.expires_at > now()))
    FOR UPDATE OF p SKIP LOCKED
)
UPDATE {s}.partitions p SET owner = $1, epoch = p.epoch + 1, changed_at = now()
FROM taken WHERE p.partition = taken.partition
RETURNING p.partition, p.epoch, taken.owner, taken.heartbeat_ms";

/// Live instances that take part in the assignment (lease valid by database time, not draining).
const LIVE: &str = "SELECT id FROM {s}.instances WHERE expires_at > now() AND NOT draining ORDER BY id";

/// Every partition's owner, epoch and target.
const PARTITIONS: &str = "SELECT partition, owner, epoch, target_owner FROM {s}.partitions ORDER BY partition";

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

/// Instances with their lease state and partition counts, for status.
const INSTANCES: &str = "SELECT i.id, i.name, i.started_at, i.heartbeat_at, i.expires_at > now() AS live,
    (SELECT count(*) FROM {s}.partitions p WHERE p.owner = i.id) AS partitions
FROM {s}.instances i ORDER BY i.started_at";

#[derive(Debug)]
pub(crate) struct Sql {
    pub(crate) register: Arc<str>,
    pub(crate) heartbeat: Arc<str>,
    pub(crate) deregister: Arc<str>,
    pub(crate) reap: Arc<str>,
    pub(crate) acquire: Arc<str>,
    pub(crate) owned: Arc<str>,
    pub(crate) release: Arc<str>,
    pub(crate) instances: Arc<str>,
    pub(crate) live: Arc<str>,
    pub(crate) partitions: Arc<str>,
    pub(crate) set_targets: Arc<str>,
    pub(crate) drain: Arc<str>,
    /// The same steps for SQLite.
    pub(crate) sqlite: crate::sqlite::Sql,
}

impl Sql {
    /// The statements for `outbox`'s (validated) schema.
    pub(crate) fn new(outbox: &outbox_core::Outbox) -> Self {
        let schema = outbox.config().schema.as_str();
        let build = |text: &str| -> Arc<str> { text.replace("{remaining}", REMAINING).replace("{s}", schema).into() };
        Self {
            register: build(REGISTER),
            heartbeat: build(HEARTBEAT),
            deregister: build(DEREGISTER),
            reap: build(REAP),
            acquire: build(ACQUIRE),
            owned: build(OWNED),
            release: build(RELEASE),
            instances: build(INSTANCES),
            live: build(LIVE),
            partitions: build(PARTITIONS),
            set_targets: build(SET_TARGETS),
            drain: build(DRAIN),
            sqlite: crate::sqlite::Sql::new(outbox),
        }
    }
}

pub(crate) fn stmt(text: &Arc<str>) -> AssertSqlSafe<Arc<str>> {
    AssertSqlSafe(Arc::clone(text))
}

pub(crate) fn millis(d: std::time::Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}
