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
use crate::stored::Request;

/// The fetch requests of one processor, and what it remembers between them.
#[derive(Debug, Default)]
pub(super) struct Fetches {
    /// Per partition, the key after which the next walk starts (wrapping around to the lowest).
    cursors: BTreeMap<Partition, String>,
    /// Where the partition list starts next time.
    rotation: usize,
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
        let start = self.rotation % partitions.len();
        partitions.rotate_left(start);
        // Records fetched after each head: only with stop-on-first-failure, where a key's records go
        // strictly one after another anyway.
        let followers = if config.stop_on_first_failure { config.key_lookahead - 1 } else { 0 };
        Some(Request {
            instance: current.instance,
            partitions,
            exclude: in_flight.keys().cloned().collect(),
            limit,
            followers,
            budget: config.key_lookahead_bytes,
        })
    }

    /// Moves the cursors of the partitions a fetch served to the last key it served there.
    pub(super) fn served(&mut self, last_served: &BTreeMap<Partition, String>) {
        self.cursors.extend(last_served.iter().map(|(&p, key)| (p, key.clone())));
    }

    /// Forgets the cursors of partitions no longer held.
    pub(super) fn retain(&mut self, held: impl Fn(Partition) -> bool) {
        self.cursors.retain(|&p, _| held(p));
    }
}
