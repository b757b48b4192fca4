//! One read of the cluster and its backlog, shared by every request while it is fresh, and the
//! history of delivered/s and backlog those reads leave behind.
//!
//! However many pages are open, the database answers at most one status and one backlog read per
//! [`FRESH_FOR`], or per [`BUSY_SHARE`]⁻¹ times the last read's duration if that is longer: the backlog
//! read counts every record (~120 ms at a million on PostgreSQL here), so a large backlog slows the
//! refresh rather than loading the database it is about. A read given up at [`READ_TIMEOUT`] goes on in
//! the database, so none starts again for ten times that, twice as long after each one given up in a
//! row (up to [`MAX_REST`]). The history holds a sample per read, at most
//! one per [`SAMPLE_EVERY`], for [`HISTORY`] (the time the page has been watched since the process
//! started).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use outbox_core::operator::{BacklogTotals, PartitionStats};
use outbox_core::{Db, InstanceId, Outbox};
use tokio::sync::Mutex;
use tokio::time::Instant;

use super::api::Sample;
use super::error::ApiError;
use crate::status::{ClusterStatus, status};

/// A read younger than this is served again.
const FRESH_FOR: Duration = Duration::from_secs(1);
/// The most of the database's time (of one connection) the page's reads may take.
const BUSY_SHARE: u32 = 10;
/// At most one history sample per this.
const SAMPLE_EVERY: Duration = Duration::from_secs(2);
/// A read that takes longer fails (requests wait behind it; a hung database must not hold them all).
const READ_TIMEOUT: Duration = Duration::from_secs(10);
/// The longest rest after reads given up at [`READ_TIMEOUT`].
const MAX_REST: Duration = Duration::from_secs(15 * 60);
/// How far back the history goes.
const HISTORY: Duration = Duration::from_secs(10 * 60);

/// One read of the cluster and its backlog.
pub(super) struct Snapshot {
    pub(super) cluster: ClusterStatus,
    pub(super) stats: Vec<PartitionStats>,
    pub(super) totals: BacklogTotals,
    /// Delivered/s per instance, from its last two heartbeats that moved its count's time.
    pub(super) rates: HashMap<InstanceId, f64>,
    pub(super) history: Vec<Sample>,
}

#[derive(Default)]
pub(super) struct Snapshots {
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// The last read: when it was taken, how long it stays fresh, and what it found.
    last: Option<(Instant, Duration, Arc<Snapshot>)>,
    /// After a read given up at its time limit: when, and how long no read starts. The database goes on
    /// counting a read its client gave up (the backlog read has no time limit of its own), so each
    /// request starting another piled counts of the whole table onto a database already slow.
    resting: Option<(Instant, Duration)>,
    /// Per instance: its last heartbeat time and count seen, and the rate between the two before.
    counts: HashMap<InstanceId, (DateTime<Utc>, i64, f64)>,
    history: VecDeque<(Instant, Sample)>,
}

impl Snapshots {
    /// The last read if fresh, else a new one (requests arriving meanwhile wait for it).
    pub(super) async fn get(&self, outbox: &Outbox, db: &Db) -> Result<Arc<Snapshot>, ApiError> {
        let mut state = self.state.lock().await;
        if let Some((at, fresh_for, snapshot)) = &state.last
            && at.elapsed() < *fresh_for
        {
            return Ok(snapshot.clone());
        }
        if let Some((since, rest)) = state.resting
            && since.elapsed() < rest
        {
            return Err(ApiError::Resting(rest - since.elapsed()));
        }
        let started = Instant::now();
        let read = async { Ok::<_, ApiError>((status(db.clone(), outbox).await?, outbox.stats(db.clone()).await?)) };
        let Ok(read) = tokio::time::timeout(READ_TIMEOUT, read).await else {
            // As much rest as keeps the page's share of the database at BUSY_SHARE for a read that took
            // the time limit, doubled at each read given up in a row.
            let rest = state.resting.map_or(READ_TIMEOUT * BUSY_SHARE, |(_, rest)| (rest * 2).min(MAX_REST));
            state.resting = Some((Instant::now(), rest));
            return Err(ApiError::TimedOut);
        };
        let (cluster, stats) = read?;
        state.resting = None;
        let now = Instant::now();
        let fresh_for = FRESH_FOR.max((now - started) * BUSY_SHARE);
        let rates = state.rates(&cluster);
        let totals = BacklogTotals::of(&stats);
        let sample = Sample {
            at_ms: Utc::now().timestamp_millis(),
            pending: totals.pending,
            failed: totals.failed,
            delivered_per_s: rates.values().sum(),
        };
        if state.history.back().is_none_or(|(at, _)| now.duration_since(*at) >= SAMPLE_EVERY) {
            state.history.push_back((now, sample));
        }
        while state.history.front().is_some_and(|(at, _)| now.duration_since(*at) > HISTORY) {
            state.history.pop_front();
        }
        let history = state.history.iter().map(|(_, s)| s.clone()).collect();
        let snapshot = Arc::new(Snapshot { cluster, stats, totals, rates, history });
        state.last = Some((now, fresh_for, snapshot.clone()));
        Ok(snapshot)
    }
}

impl State {
    /// Each instance's delivered/s: its count's change over the time between the heartbeats that
    /// reported them (counts arrive with heartbeats, so sampling them by the clock would see steps).
    fn rates(&mut self, cluster: &ClusterStatus) -> HashMap<InstanceId, f64> {
        let mut rates = HashMap::new();
        for i in cluster.instances.iter().filter(|i| i.live) {
            let rate = match self.counts.get(&i.id) {
                Some(&(at, _, rate)) if at == i.heartbeat_at => rate,
                Some(&(at, count, _)) => {
                    let seconds = (i.heartbeat_at - at).num_milliseconds() as f64 / 1000.0;
                    if seconds > 0.0 { (i.delivered - count).max(0) as f64 / seconds } else { 0.0 }
                }
                None => 0.0,
            };
            self.counts.insert(i.id, (i.heartbeat_at, i.delivered, rate));
            rates.insert(i.id, rate);
        }
        self.counts.retain(|id, _| rates.contains_key(id));
        rates
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::InstanceInfo;

    fn cluster(at_ms: i64, delivered: i64, id: InstanceId) -> ClusterStatus {
        let at = DateTime::from_timestamp_millis(at_ms).unwrap();
        let instance = InstanceInfo {
            id,
            name: "w1".into(),
            started_at: at,
            heartbeat_at: at,
            heartbeat_age_ms: 0,
            live: true,
            draining: false,
            partitions: 256,
            delivered,
        };
        ClusterStatus { instances: vec![instance], partitions: Vec::new() }
    }

    #[test]
    fn rates_follow_the_heartbeats_that_reported_the_counts() {
        let (id, mut state) = (InstanceId::new(), State::default());
        assert_eq!(state.rates(&cluster(0, 500, id))[&id], 0.0, "one count is no rate yet");
        assert_eq!(state.rates(&cluster(2_000, 1_500, id))[&id], 500.0, "1,000 in the 2 s between heartbeats");
        assert_eq!(state.rates(&cluster(2_000, 1_500, id))[&id], 500.0, "no new heartbeat: the same rate");
        assert_eq!(state.rates(&cluster(4_000, 1_500, id))[&id], 0.0, "idle");
        let other = InstanceId::new();
        let rates = state.rates(&cluster(6_000, 9, other));
        assert_eq!(rates.len(), 1, "an instance gone is forgotten");
        assert!(state.counts.len() == 1 && state.counts.contains_key(&other));
    }
}
