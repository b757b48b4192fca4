//! What the processor may process, and under which identity: the instance id whose lease holds the
//! partitions, each partition's fencing epoch, and the lease's deadline.

use std::collections::BTreeMap;
use std::fmt;
use std::time::{Duration, SystemTime};

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use tokio::time::Instant;
use uuid::Uuid;

use crate::partition::Partition;

/// An instance's id in the instances table. A process that registers again (after its lease expired)
/// gets a new one, so nothing held under the old id can come back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, sqlx::Type)]
#[sqlx(transparent)]
pub struct InstanceId(pub Uuid);

impl InstanceId {
    /// A new, time-ordered id.
    pub fn new() -> Self {
        Self(Uuid::now_v7())
    }
}

impl Default for InstanceId {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Display for InstanceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// A partition's fencing epoch: it grows with every change of owner, and every write for the
/// partition's records is checked against it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, sqlx::Type)]
#[sqlx(transparent)]
pub struct Epoch(pub i64);

impl fmt::Display for Epoch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// Partitions with the epoch held for each.
pub type Epochs = BTreeMap<Partition, Epoch>;

/// A point in time on two clocks: the monotonic clock, which no clock step moves, and the wall clock,
/// which (unlike the monotonic clock) goes on while a virtual machine is suspended. It has passed once
/// either clock says so.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deadline {
    at: Instant,
    wall: SystemTime,
}

impl Deadline {
    /// Now.
    pub fn now() -> Self {
        Self { at: Instant::now(), wall: SystemTime::now() }
    }

    /// `duration` after this one.
    pub fn after(self, duration: Duration) -> Self {
        Self { at: self.at + duration, wall: self.wall + duration }
    }

    /// Whether it has passed, by either clock.
    pub fn passed(&self) -> bool {
        Instant::now() >= self.at || SystemTime::now() >= self.wall
    }

    /// The monotonic instant (for timers).
    pub fn instant(&self) -> Instant {
        self.at
    }
}

/// What the processor may process: the instance whose lease holds the partitions, the partitions with
/// their epochs, and the lease's deadline, after which it must neither fetch nor start a handler call
/// and cancels the calls running (the lease may have expired, e.g. while the process was paused).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Assignment {
    /// The instance registered in the instances table: every fetch and completion is fenced by it (its
    /// lease must be live, and it must own the partitions).
    pub instance: InstanceId,
    /// Partitions and epochs.
    pub epochs: Epochs,
    /// The lease's deadline; `None`: no deadline (the database's lease still fences every fetch).
    pub lease: Option<Deadline>,
    /// Partitions of `epochs` that were ever taken from an owner that did not give them up (its lease
    /// ran out), with the database time of the last such takeover: that owner may have ended in the
    /// middle of a handler call, so each call of a record scheduled before then is counted before it is
    /// made (see the processor's docs).
    pub taken_over: BTreeMap<Partition, DateTime<Utc>>,
}

impl Assignment {
    /// An assignment without deadline.
    pub fn new(instance: InstanceId, epochs: Epochs) -> Self {
        Self { instance, epochs, lease: None, taken_over: BTreeMap::new() }
    }

    /// Whether the lease lets the processor fetch and deliver.
    pub fn is_live(&self) -> bool {
        self.lease.is_none_or(|deadline| !deadline.passed())
    }

    /// Whether a handler call for `partition` may start under `instance` at `epoch`.
    pub fn grants(&self, instance: InstanceId, partition: Partition, epoch: Epoch) -> bool {
        self.instance == instance && self.is_live() && self.epochs.get(&partition) == Some(&epoch)
    }
}
