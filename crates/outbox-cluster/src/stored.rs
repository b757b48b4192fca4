//! The cluster's rows as every driver returns them, and what a registration declares: shared by the
//! drivers and the domain modules, so no import runs back up.

use std::time::Duration;

use chrono::{DateTime, Utc};
use outbox_core::{Epoch, InstanceId, Partition};

/// One registered instance, as status shows it.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow, serde::Serialize, serde::Deserialize)]
pub struct InstanceInfo {
    /// Instance id (new on every start, and on registering again after its lease expired).
    pub id: InstanceId,
    /// Name given in its config.
    pub name: String,
    /// When it registered.
    pub started_at: DateTime<Utc>,
    /// Its last heartbeat.
    pub heartbeat_at: DateTime<Utc>,
    /// Milliseconds since its last heartbeat, by database time (no host clock involved).
    pub heartbeat_age_ms: i64,
    /// Whether its lease is still valid by database time.
    pub live: bool,
    /// Whether it is shutting down, handing its partitions over.
    pub draining: bool,
    /// Records it delivered (by their handler or a fallback) since it registered, as of its last
    /// heartbeat.
    pub delivered: i64,
    /// Partitions it owns.
    pub partitions: i64,
}

/// One partition's ownership row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PartitionRow {
    /// Partition.
    pub partition: Partition,
    /// Current owner, if any.
    pub owner: Option<InstanceId>,
    /// Fencing epoch.
    pub epoch: Epoch,
    /// Where the rebalancer wants it.
    pub target: Option<InstanceId>,
    /// When it was last taken from an owner that did not give it up (database time), if ever.
    pub taken_over_at: Option<DateTime<Utc>>,
    /// What is left of its quiet period (database time), if it is in one: it was taken from an owner
    /// whose lease ran out, which may still be delivering it, and none of its owners delivers it until
    /// the period ends.
    pub quiet: Option<Duration>,
}

/// What an ownership round reads, in one statement: every partition's row and the instances taking
/// part in the assignment.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct View {
    /// The instances whose lease is live by database time and that are not draining, by id.
    pub(crate) live: Vec<InstanceId>,
    /// Every partition's row, in partition order.
    pub(crate) partitions: Vec<PartitionRow>,
}

/// One row of the view's statement: a partition's row, or (`partition` NULL) a live instance, its id
/// in `owner`.
#[derive(sqlx::FromRow)]
pub(crate) struct ViewRow {
    partition: Option<i16>,
    owner: Option<InstanceId>,
    epoch: Option<Epoch>,
    target_owner: Option<InstanceId>,
    taken_over_at: Option<DateTime<Utc>>,
    quiet_ms: Option<i64>,
}

impl View {
    pub(crate) fn from_rows(rows: Vec<ViewRow>) -> Result<View, sqlx::Error> {
        let mut view = View { live: Vec::new(), partitions: Vec::new() };
        for row in rows {
            match (row.partition, row.owner) {
                (None, Some(id)) => view.live.push(id),
                (Some(partition), owner) => view.partitions.push(PartitionRow {
                    partition: Partition::try_from(partition).map_err(|e| sqlx::Error::Decode(e.into()))?,
                    owner,
                    epoch: row.epoch.ok_or_else(|| sqlx::Error::Decode("partition row without an epoch".into()))?,
                    target: row.target_owner,
                    taken_over_at: row.taken_over_at,
                    quiet: row.quiet_ms.and_then(quiet),
                }),
                (None, None) => return Err(sqlx::Error::Decode("view row with neither partition nor instance".into())),
            }
        }
        view.live.sort_unstable();
        view.partitions.sort_unstable_by_key(|r| r.partition);
        Ok(view)
    }
}

/// A partition just taken by an acquisition, as the driver reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, sqlx::FromRow)]
pub(crate) struct Taken {
    #[sqlx(try_from = "i16")]
    pub(crate) partition: Partition,
    /// The epoch after the bump.
    pub(crate) epoch: Epoch,
    /// The owner it was taken from (`None`: it was free).
    pub(crate) previous: Option<InstanceId>,
    /// The ms of its quiet period, if it has one (see `Store::acquire`).
    pub(crate) quiet_ms: Option<i64>,
    /// When it was last taken from an owner (now, if `previous` is one), by database time. That owner
    /// may have ended in the middle of a handler call: every later owner counts the calls of records
    /// scheduled before then before making them.
    pub(crate) taken_over_at: Option<DateTime<Utc>>,
}

/// A partition number as a statement returns it.
#[derive(sqlx::FromRow)]
pub(crate) struct PartitionOnly {
    #[sqlx(try_from = "i16")]
    pub(crate) partition: Partition,
}

/// A (partition, epoch) pair as a statement returns it.
#[derive(sqlx::FromRow)]
pub(crate) struct Held {
    #[sqlx(try_from = "i16")]
    pub(crate) partition: Partition,
    pub(crate) epoch: Epoch,
}

/// What a registration or renewal asks for: live for `live`; a registration also declares its heartbeat
/// interval, `heartbeat`, which sets the quiet period of partitions taken from it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Lease {
    pub(crate) live: Duration,
    pub(crate) heartbeat: Duration,
}

/// A lease's remaining time as the statements return it (ms, negative once expired). (MySQL's driver
/// knows it without asking: it has no `RETURNING`.)
#[cfg(any(feature = "postgres", feature = "sqlite"))]
pub(crate) fn remaining(ms: i64) -> Duration {
    Duration::from_millis(u64::try_from(ms).unwrap_or(0))
}

/// A quiet period of `ms` as the statements return it; `None` if it has none left.
pub(crate) fn quiet(ms: i64) -> Option<Duration> {
    u64::try_from(ms).ok().filter(|&ms| ms > 0).map(Duration::from_millis)
}
