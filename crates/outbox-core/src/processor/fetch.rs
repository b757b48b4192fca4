//! What the next fetch asks for: the partitions held (not fenced out) that it was asked to read (all for
//! a poll, some for a wake-up or a completion), in a rotating order so no
//! partition is always served last, each with the key its walk starts after (a rotating cursor, so keys
//! that sort low cannot starve the others), and the keys in flight to pass over. The driver's fetch is
//! fenced by the database (see `Db::fetch`).

use std::collections::{BTreeMap, HashMap};

use crate::assignment::{Assignment, Epoch, InstanceId};
use crate::config::Config;
use crate::notice::Partitions;
use crate::partition::Partition;
use crate::stored::{Found, Request};

/// Keys a walk may read beyond those it serves and those in flight, where the driver reads keys in bulk
/// (see `Request::walk`): keys whose head waits (FAILED, backing off, scheduled later) cost a fetch no
/// more than this many, and the walks after it go on from where it stopped.
const WALK_SLACK: usize = 256;

/// The fetch requests of one processor, and what it remembers between them.
#[derive(Debug, Default)]
pub(super) struct Fetches {
    /// Per partition, the key after which the next walk starts (wrapping around to the lowest).
    cursors: BTreeMap<Partition, String>,
    /// Where the partition list starts next time.
    rotation: usize,
    /// The partition where the last walk cut short stopped: the next fetch that asks for it starts there.
    resume: Option<Partition>,
}

impl Fetches {
    /// The request for up to `limit` heads of the partitions in `wanted` that `current` holds (but those
    /// in `fenced`), passing over the keys in flight; `None` if no partition is left to fetch from.
    pub(super) fn request(
        &mut self,
        config: &Config,
        current: &Assignment,
        fenced: &BTreeMap<Partition, (InstanceId, Epoch)>,
        in_flight: &HashMap<String, Partition>,
        wanted: &Partitions,
        limit: usize,
    ) -> Option<Request> {
        let mut partitions: Vec<(Partition, Epoch, Option<String>)> = current
            .epochs
            .iter()
            .filter(|&(p, &e)| wanted.contains(*p) && fenced.get(p) != Some(&(current.instance, e)))
            .map(|(&p, &e)| (p, e, self.cursors.get(&p).cloned()))
            .collect();
        if partitions.is_empty() {
            return None;
        }
        self.rotation = self.rotation.wrapping_add(1);
        let resume = self.resume.and_then(|r| partitions.iter().position(|p| p.0 == r));
        if resume.is_some() {
            self.resume = None;
        }
        let start = resume.unwrap_or(self.rotation % partitions.len());
        partitions.rotate_left(start);
        // Records fetched after each head: only with stop-on-first-failure, where a key's records go
        // strictly one after another anyway.
        let followers = if config.stop_on_first_failure { config.key_lookahead - 1 } else { 0 };
        Some(Request {
            instance: current.instance,
            partitions,
            exclude: in_flight.keys().cloned().collect(),
            limit,
            walk: limit + in_flight.len() + WALK_SLACK,
            followers,
            budget: config.key_lookahead_bytes,
        })
    }

    /// Moves the cursors of the partitions a fetch served to the last key it served (or read, where its
    /// walk was cut short) there.
    pub(super) fn served(&mut self, found: &Found) {
        self.cursors.extend(found.last_served.iter().map(|(&p, key)| (p, key.clone())));
        if found.stopped.is_some() {
            self.resume = found.stopped;
        }
    }

    /// Forgets the cursors of partitions no longer held.
    pub(super) fn retain(&mut self, held: impl Fn(Partition) -> bool) {
        self.cursors.retain(|&p, _| held(p));
        self.resume = self.resume.filter(|&p| held(p));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::assignment::Epoch;

    /// A walk cut short (a driver that reads keys in bulk) is followed by a fetch that starts in the
    /// partition where it stopped, after the key it stopped at; the rotation goes on from there.
    #[test]
    fn a_walk_cut_short_goes_on_where_it_stopped() {
        let current = Assignment::new(InstanceId::new(), (0..8).map(|p| (p, Epoch(1))).collect());
        let config = Config::default();
        let (fenced, in_flight) = (BTreeMap::new(), HashMap::new());
        let all: Partitions = (0..8).collect();
        let mut fetches = Fetches::default();
        let first = |fetches: &mut Fetches| {
            let request = fetches.request(&config, &current, &fenced, &in_flight, &all, 10).unwrap();
            (request.partitions[0].0, request.partitions[0].2.clone())
        };
        assert_eq!(first(&mut fetches), (1, None));
        let stopped = Found {
            last_served: [(3, "a".to_string()), (6, "k".to_string())].into(),
            stopped: Some(6),
            ..Found::default()
        };
        fetches.served(&stopped);
        assert_eq!(first(&mut fetches), (6, Some("k".into())));
        assert_eq!(first(&mut fetches), (3, Some("a".into())), "the rotation goes on");
    }
}
