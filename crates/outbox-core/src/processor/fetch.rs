//! What the next fetch asks for: the partitions held (not fenced out) that it was asked to read (all for
//! a poll, some for a wake-up or a completion), in a rotating order so no
//! partition is always served last, each with the key its walk starts after where the last walk there
//! was cut (a rotating cursor, so keys that sort low cannot starve the others; a partition read to its
//! end starts at its lowest key), and the keys in flight to pass over. The driver's fetch is fenced by
//! the database (see `Db::fetch`).

use std::collections::{BTreeMap, HashMap};

use crate::assignment::{Assignment, Epoch, InstanceId};
use crate::config::Config;
use crate::notice::Partitions;
use crate::partition::Partition;
use crate::stored::{Found, Request};

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

    /// After `found` answered `request`: the partitions its walk read to their end start the next one
    /// at their lowest key (a start key would only add a second range to read); the one where it was
    /// cut goes on after the last key it served or read there; those it did not reach keep theirs.
    pub(super) fn served(&mut self, request: &Request, found: &Found) {
        let cut_off = found.cut_off(request);
        for (partition, ..) in &request.partitions {
            if !cut_off.contains(*partition) {
                self.cursors.remove(partition);
            } else if let Some(key) = found.last_served.get(partition) {
                self.cursors.insert(*partition, key.clone());
            }
        }
    }

    /// Forgets the cursors of partitions no longer held.
    pub(super) fn retain(&mut self, held: impl Fn(Partition) -> bool) {
        self.cursors.retain(|&p, _| held(p));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A walk cut in partition 6 (of 3, 6, 1 in that order): partition 3, read to its end, starts its
    /// next walk at its lowest key; 6 goes on after the key it stopped at; 1, not reached, keeps its
    /// start key.
    #[test]
    fn only_partitions_a_walk_did_not_finish_keep_a_start_key() {
        let mut fetches =
            Fetches { cursors: [(3, "c".to_string()), (6, "f".to_string()), (1, "a".to_string())].into(), rotation: 0 };
        let request = Request {
            instance: InstanceId::new(),
            partitions: [3, 6, 1].map(|p| (p, Epoch(1), fetches.cursors.get(&p).cloned())).to_vec(),
            exclude: Vec::new(),
            limit: 10,
            followers: 0,
            budget: usize::MAX,
        };
        let found = Found {
            last_served: [(3, "d".to_string()), (6, "k".to_string())].into(),
            cut_in: Some(6),
            ..Found::default()
        };
        fetches.served(&request, &found);
        assert_eq!(fetches.cursors, [(6, "k".to_string()), (1, "a".to_string())].into());
        // Whether or not it served anything (`Found::unread` differs, not the start keys).
        assert!(found.runs.is_empty() && found.unread(&request).is_empty());
    }
}
