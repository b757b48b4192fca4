//! Calls counted before they are made, in partitions taken over from an owner that did not give them up.
//!
//! That owner may have ended in the middle of a handler call. A handler that ends the process (a panic
//! under `panic = "abort"`, a stack overflow, running out of memory) ends every instance that takes its
//! record on, and a failure written after the call is never written. So the database stamps a partition
//! taken from an owner whose lease ran out with the time (`Assignment::taken_over`), and every later
//! owner writes each call of a record scheduled before then as a failed attempt ("did not finish")
//! before making it; the call's own outcome then overwrites that, and a call the run does not make
//! after all (an earlier record failed, the processor is stopping, or the partition is being handed
//! on) takes it back (`Verdict::NotCalled`). A record whose unfinished calls used up its retries is
//! FAILED without another call.
//!
//! With stop-on-first-failure, only a key's first run can hold the record the previous owner was
//! calling (a key is fetched again only once its run is completed), so only the records up to the end
//! of that run are counted. Without it, the previous owner may have been calling any record of the key
//! (a later one while an earlier waited for its retry), so each one scheduled before the takeover is.
//! Records scheduled after the takeover never are. The counts of one fetch's runs are one write, made
//! before the runs start.
//!
//! Every call in flight when a process ends stays counted, including those of records beside the one
//! that ended it. So a record whose last call was counted and never finished (its last error is still
//! [`UNFINISHED_CALL`]: a suspect) is called alone, in a run of its own, among the counted calls: the
//! counted calls take turns from a fair semaphore, one permit each, a suspect all of them, and a turn
//! lasts until the call's outcome is written. Once the suspects have taken their turns, an end of the
//! process is counted against the record that caused it, and the records that were only in flight
//! beside it were counted once. A record whose last call failed in the usual way is no suspect: any
//! earlier attempt made one, and after a downstream outage every retrying key was called alone.
//!
//! An end of the process leaves every record of a counted run a suspect, though one at most was being
//! called. A key's suspects fetched together are called in one turn: each call's outcome is written
//! with the next suspect's count, in one write, before that call starts. A turn each would queue every
//! suspect behind all the counted runs queued meanwhile: a round of runs per suspect.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use chrono::{DateTime, Utc};
use tracing::debug;

use crate::assignment::{Assignment, Epoch, InstanceId};
use crate::config::Config;
use crate::partition::Partition;
use crate::stored::{Fetched, Outcome, Verdict};

/// The error a counted call leaves behind if it never finishes: a record whose last error is this is a
/// suspect.
pub const UNFINISHED_CALL: &str = "the handler call did not finish: the process ended during it, or the call was cancelled \
                          (counted before the call, in a partition taken over from an owner that did not give it up)";

/// A partition taken over, under one grant.
#[derive(Debug)]
struct Taken {
    instance: InstanceId,
    epoch: Epoch,
    /// The last takeover's database time: records scheduled before then are counted.
    since: DateTime<Utc>,
    /// Per key whose first run was fetched: the last sequence number to count (with stop-on-first-failure).
    through: HashMap<String, i64>,
}

/// The partitions taken over that the processor holds.
#[derive(Debug)]
pub(super) struct TakenOver {
    partitions: BTreeMap<Partition, Taken>,
    /// Stop-on-first-failure: only a key's first run is counted.
    first_run_only: bool,
}

/// How a run's calls are made.
#[derive(Debug)]
pub(super) enum Calls {
    /// Uncounted.
    Plain,
    /// Counted (the records marked `careful`) with the other runs of the fetch, side by side.
    Counted,
    /// Its one record was counted before: counted, and called alone. Holds the suspects right after it
    /// in its key, each to be counted and called alone in the same turn once the call before it is
    /// written.
    Suspect(Vec<Fetched>),
}

impl TakenOver {
    pub(super) fn new(config: &Config) -> Self {
        Self { partitions: BTreeMap::new(), first_run_only: config.stop_on_first_failure }
    }

    /// Follows the assignment: a partition taken over starts afresh under a new grant or takeover time;
    /// one no longer held (or never taken over) is forgotten.
    pub(super) fn follow(&mut self, current: &Assignment) {
        self.partitions.retain(|p, taken| {
            current.instance == taken.instance
                && current.epochs.get(p) == Some(&taken.epoch)
                && current.taken_over.get(p) == Some(&taken.since)
        });
        for (&partition, &since) in &current.taken_over {
            let Some(&epoch) = current.epochs.get(&partition) else { continue };
            self.partitions.entry(partition).or_insert_with(|| {
                debug!(partition, %epoch, instance = %current.instance, %since,
                    "partition was taken over from an owner that did not give it up: calls of records scheduled before then are counted before they are made");
                Taken { instance: current.instance, epoch, since, through: HashMap::new() }
            });
        }
    }

    /// Marks the records of `run` whose calls are counted, and cuts the run before the first of them
    /// that was counted before (a suspect), which goes in a run of its own; a run that starts with
    /// suspects is cut to its first, the suspects after it returned.
    pub(super) fn mark(&mut self, run: &mut Vec<Fetched>) -> Calls {
        let Some(head) = run.first() else { return Calls::Plain };
        let Some(taken) = self.partitions.get_mut(&head.record.partition) else { return Calls::Plain };
        if (taken.instance, taken.epoch) != (head.instance, head.record.epoch) {
            return Calls::Plain;
        }
        let key = &head.record.key;
        let through = match taken.through.get(key) {
            Some(&through) => through,
            None => {
                let earlier = run.iter().filter(|f| f.record.created_at <= taken.since).map(|f| f.record.seq).max();
                let Some(through) = earlier else { return Calls::Plain };
                if self.first_run_only {
                    taken.through.insert(key.clone(), through);
                }
                through
            }
        };
        for fetched in run.iter_mut() {
            fetched.careful = fetched.record.seq <= through;
        }
        match run.iter().position(|f| f.careful && f.unfinished) {
            Some(0) => {
                let suspects = run.iter().position(|f| !(f.careful && f.unfinished)).unwrap_or(run.len());
                run.truncate(suspects);
                Calls::Suspect(run.split_off(1))
            }
            Some(suspect) => {
                run.truncate(suspect);
                Calls::Counted
            }
            None if run[0].careful => Calls::Counted,
            None => Calls::Plain,
        }
    }
}

/// The permits of the counted calls' semaphore: `concurrency` (at most 100,000, by validation).
pub(super) fn turns(config: &Config) -> u32 {
    u32::try_from(config.concurrency).unwrap_or(u32::MAX)
}

/// The write that counts the marked calls of `runs`: each a failed attempt that did not finish.
pub(super) fn counts<'a>(runs: impl IntoIterator<Item = &'a Vec<Fetched>>) -> Vec<Outcome> {
    let unfinished = || Verdict::Retry { delay: Duration::ZERO, error: UNFINISHED_CALL.to_string() };
    let careful = runs.into_iter().flatten().filter(|f| f.careful);
    careful.map(|f| Outcome::of(f.clone(), unfinished(), f.record.attempts.saturating_add(1))).collect()
}
