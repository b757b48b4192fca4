//! The notices behind wake-ups and nudges (see `wake.rs`): what they say, their text form on
//! PostgreSQL's channels, and their delivery to this process's processors and ownership rounds.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::broadcast;

use crate::assignment::InstanceId;
use crate::partition::Partition;

/// A set of partitions, as 256 bits; its text form (the `NOTIFY` payload) is 64 hex digits.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Partitions([u64; 4]);

impl Partitions {
    /// Every partition: what a processor is told when wake-ups may have been missed.
    pub(crate) const ALL: Partitions = Partitions([u64::MAX; 4]);

    /// Just `p`.
    pub(crate) fn of(p: Partition) -> Self {
        [p].into_iter().collect()
    }

    pub(crate) fn insert(&mut self, p: Partition) {
        self.0[usize::from(p / 64)] |= 1 << (p % 64);
    }

    pub(crate) fn contains(&self, p: Partition) -> bool {
        self.0[usize::from(p / 64)] & (1 << (p % 64)) != 0
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.0 == [0; 4]
    }

    /// Adds every partition of `other`.
    pub(crate) fn extend(&mut self, other: Partitions) {
        for (word, theirs) in self.0.iter_mut().zip(other.0) {
            *word |= theirs;
        }
    }

    /// The partitions of `other` that are also here.
    pub(crate) fn and(self, other: Partitions) -> Partitions {
        Partitions(std::array::from_fn(|i| self.0[i] & other.0[i]))
    }

    /// The partitions here that are not in `other`.
    pub(crate) fn without(self, other: Partitions) -> Partitions {
        Partitions(std::array::from_fn(|i| self.0[i] & !other.0[i]))
    }

    // The text form travels only through PostgreSQL's NOTIFY.
    #[cfg(any(feature = "postgres", test))]
    pub(crate) fn to_hex(self) -> String {
        self.0.iter().map(|word| format!("{word:016x}")).collect()
    }

    /// `None` unless exactly 64 hex digits.
    #[cfg(any(feature = "postgres", test))]
    pub(crate) fn from_hex(text: &str) -> Option<Self> {
        if text.len() != 64 || !text.is_ascii() {
            return None;
        }
        let mut words = [0; 4];
        for (i, word) in words.iter_mut().enumerate() {
            *word = u64::from_str_radix(&text[i * 16..(i + 1) * 16], 16).ok()?;
        }
        Some(Self(words))
    }
}

impl FromIterator<Partition> for Partitions {
    fn from_iter<I: IntoIterator<Item = Partition>>(partitions: I) -> Self {
        let mut set = Self::default();
        for p in partitions {
            set.insert(p);
        }
        set
    }
}

/// A wake-up: these partitions have records due now, or due `after` from now (records scheduled for
/// later).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Wake {
    pub(crate) partitions: Partitions,
    pub(crate) after: Duration,
}

impl Wake {
    /// Records due now in `partitions`.
    pub(crate) fn now(partitions: Partitions) -> Self {
        Self { partitions, after: Duration::ZERO }
    }

    /// Its text form: the partition set, then `+` and the milliseconds to wait, if any.
    #[cfg(any(feature = "postgres", test))]
    fn to_text(self) -> String {
        match self.after.as_millis() {
            0 => self.partitions.to_hex(),
            ms => format!("{}+{ms}", self.partitions.to_hex()),
        }
    }

    #[cfg(any(feature = "postgres", test))]
    fn from_text(text: &str) -> Option<Self> {
        let (set, after) = match text.split_once('+') {
            Some((set, ms)) => (set, Duration::from_millis(ms.parse().ok()?)),
            None => (text, Duration::ZERO),
        };
        Some(Self { partitions: Partitions::from_hex(set)?, after })
    }
}

/// `wait` in whole milliseconds, rounded up (a wake-up's unit): a processor woken early finds nothing
/// and waits for its poll.
pub(crate) fn millis_up(wait: Duration) -> Duration {
    Duration::from_millis(u64::try_from(wait.as_nanos().div_ceil(1_000_000)).unwrap_or(u64::MAX))
}

/// What a notice tells other processes.
#[derive(Debug, Clone, Copy)]
#[cfg_attr(not(feature = "postgres"), allow(dead_code))] // notices travel only through PostgreSQL
pub(crate) enum Message<'a> {
    /// These partitions have new records, due now or later.
    Wake(&'a [Wake]),
    /// These instances should run their ownership rounds now.
    Nudge(&'a [InstanceId]),
}

/// The two kinds of notice, each on a channel of its own.
#[cfg(any(feature = "postgres", test))]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Channel {
    /// New records in some partitions, for the processors.
    Wake,
    /// Some instances' ownership rounds should run now.
    Nudge,
}

/// The instances a nudge names: some, or every one (after nudges may have been missed).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Nudge(Option<Arc<[InstanceId]>>);

impl Nudge {
    const EVERYONE: Nudge = Nudge(None);

    /// Whether instance `id` should run its ownership round now.
    pub fn names(&self, id: InstanceId) -> bool {
        self.0.as_ref().is_none_or(|ids| ids.contains(&id))
    }
}

/// This process's end of the nudges of one [`Outbox`](crate::Outbox) (see [`Outbox::nudges`](crate::Outbox::nudges)).
#[derive(Debug)]
pub struct Nudges(broadcast::Receiver<Nudge>);

impl Nudges {
    /// The next nudge (one naming everyone if some were missed); pending forever once the outbox is gone.
    pub async fn next(&mut self) -> Nudge {
        match self.0.recv().await {
            Ok(nudge) => nudge,
            Err(broadcast::error::RecvError::Lagged(_)) => Nudge::EVERYONE,
            Err(broadcast::error::RecvError::Closed) => std::future::pending().await,
        }
    }
}

/// At most this many instance ids go in one `NOTIFY` (32 hex digits each; PostgreSQL's payloads stop
/// short of 8,000 bytes).
#[cfg(any(feature = "postgres", test))]
const IDS_PER_NOTICE: usize = 200;

/// At most this many wake-ups go in one `NOTIFY` (up to 86 characters each, comma-separated).
#[cfg(any(feature = "postgres", test))]
const WAKES_PER_NOTICE: usize = 80;

/// The wake-ups and nudges of one [`Outbox`](crate::Outbox) (and its clones) in this process.
#[derive(Debug)]
pub(crate) struct Wakeups {
    /// One message per call or notice, with all its wake-ups: one per wake-up let a single call for
    /// records due at many times outrun the channel, and a processor that fell behind heard "every
    /// partition, now" in place of the times it missed.
    sender: broadcast::Sender<Arc<[Wake]>>,
    nudges: broadcast::Sender<Nudge>,
    /// Names this `Outbox`'s notices, so its listeners pass over the ones it sent: its processors
    /// heard those when they were sent, and hearing them again would fetch twice per commit.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))] // notices travel only through PostgreSQL
    origin: u128,
}

impl Default for Wakeups {
    fn default() -> Self {
        // A processor that falls this far behind hears `ALL` instead (one extra fetch).
        Self {
            sender: broadcast::channel(1024).0,
            nudges: broadcast::channel(64).0,
            origin: uuid::Uuid::now_v7().as_u128(),
        }
    }
}

impl Wakeups {
    pub(crate) fn send(&self, wakes: &[Wake]) {
        // No processor in this process: nothing to wake.
        let _ = self.sender.send(wakes.into());
    }

    pub(crate) fn subscribe(&self) -> Listener {
        Listener(self.sender.subscribe())
    }

    /// Nudges `instances`' ownership rounds in this process.
    pub(crate) fn nudge(&self, instances: &[InstanceId]) {
        // No round in this process: nobody to nudge.
        let _ = self.nudges.send(Nudge(Some(instances.into())));
    }

    pub(crate) fn subscribe_nudges(&self) -> Nudges {
        Nudges(self.nudges.subscribe())
    }

    #[cfg(feature = "postgres")]
    /// What a listener that has just (re)connected tells this process: notices sent while it was not
    /// listening were lost, so every processor looks at every partition and every round runs.
    pub(crate) fn missed(&self) {
        self.send(&[Wake::now(Partitions::ALL)]);
        let _ = self.nudges.send(Nudge::EVERYONE);
    }

    /// The channel a listener of this outbox hears its own probe on (see `Db::listen`): the same for
    /// every connection it makes, so that a pooler's sessions, which keep the `LISTEN` of each attempt
    /// that heard nothing, keep one channel, not one an attempt.
    #[cfg(feature = "postgres")]
    pub(crate) fn probe_channel(&self) -> String {
        format!("outbox_probe_{:032x}", self.origin)
    }

    /// The notices that tell other processes `message`, each with its channel: this outbox's origin
    /// (32 hex digits), then up to [`WAKES_PER_NOTICE`] wake-ups (comma-separated), or up to
    /// [`IDS_PER_NOTICE`] instance ids (32 hex digits each).
    #[cfg(any(feature = "postgres", test))]
    pub(crate) fn notices(&self, message: Message<'_>) -> Vec<(Channel, String)> {
        let origin = format!("{:032x}", self.origin);
        match message {
            Message::Wake(wakes) => wakes
                .chunks(WAKES_PER_NOTICE)
                .map(|chunk| {
                    let wakes: Vec<String> = chunk.iter().map(|w| w.to_text()).collect();
                    (Channel::Wake, format!("{origin}{}", wakes.join(",")))
                })
                .collect(),
            Message::Nudge(ids) => ids
                .chunks(IDS_PER_NOTICE)
                .map(|chunk| {
                    let ids: String = chunk.iter().map(|id| id.0.simple().to_string()).collect();
                    (Channel::Nudge, format!("{origin}{ids}"))
                })
                .collect(),
        }
    }

    /// A notice heard from the database on `channel`: wakes this process's processors or nudges its
    /// ownership rounds, unless this outbox sent it (they heard it then) or it is malformed.
    #[cfg(any(feature = "postgres", test))]
    pub(crate) fn heard(&self, channel: Channel, notice: &str) {
        let Some((origin, body)) = notice.split_at_checked(32) else {
            tracing::debug!(notice, "ignored a malformed notice");
            return;
        };
        if u128::from_str_radix(origin, 16).ok() == Some(self.origin) {
            return;
        }
        match channel {
            Channel::Wake => match body.split(',').map(Wake::from_text).collect::<Option<Vec<_>>>() {
                Some(wakes) => self.send(&wakes),
                None => tracing::debug!(notice, "ignored a malformed wake-up"),
            },
            Channel::Nudge => match parse_ids(body) {
                Some(ids) => {
                    let _ = self.nudges.send(Nudge(Some(ids.into())));
                }
                None => tracing::debug!(notice, "ignored a malformed nudge"),
            },
        }
    }
}

/// Instance ids of 32 hex digits each, back to back; `None` if anything else is there.
#[cfg(any(feature = "postgres", test))]
fn parse_ids(text: &str) -> Option<Vec<InstanceId>> {
    if !text.is_ascii() || !text.len().is_multiple_of(32) {
        return None;
    }
    (0..text.len() / 32).map(|i| uuid::Uuid::try_parse(&text[i * 32..(i + 1) * 32]).ok().map(InstanceId)).collect()
}

/// One processor's end of the wake-ups.
pub(crate) struct Listener(broadcast::Receiver<Arc<[Wake]>>);

impl Listener {
    /// The next call's or notice's wake-ups (every partition, now, if some were missed); pending
    /// forever once the sender is gone (never, while the outbox lives).
    pub(crate) async fn next(&mut self) -> Arc<[Wake]> {
        match self.0.recv().await {
            Ok(wakes) => wakes,
            Err(broadcast::error::RecvError::Lagged(_)) => [Wake::now(Partitions::ALL)].into(),
            Err(broadcast::error::RecvError::Closed) => std::future::pending().await,
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use std::time::Duration;

    use super::{Channel, Message, Partitions, Wake, Wakeups};
    use crate::assignment::InstanceId;

    proptest! {
        #[test]
        fn a_set_survives_its_text_form(members in proptest::collection::btree_set(any::<u8>(), 0..40)) {
            let set: Partitions = members.iter().copied().collect();
            let back = Partitions::from_hex(&set.to_hex()).unwrap();
            prop_assert_eq!(back, set);
            for p in 0..=255u8 {
                prop_assert_eq!(back.contains(p), members.contains(&p));
            }
        }
    }

    /// A notice wakes the processors of every other outbox, not those of the one that sent it (they
    /// heard it when it was sent); malformed ones wake nobody.
    #[tokio::test]
    async fn an_outbox_passes_over_its_own_notices() {
        let (sender, other) = (Wakeups::default(), Wakeups::default());
        let (at_sender, mut at_other) = (sender.subscribe(), other.subscribe());
        let wake = [Wake::now(Partitions::of(7))];
        let [(channel, notice)] = &sender.notices(Message::Wake(&wake))[..] else { panic!("one notice") };
        assert_eq!(*channel, Channel::Wake);
        sender.heard(Channel::Wake, notice);
        other.heard(Channel::Wake, notice);
        other.heard(Channel::Wake, "not a notice");
        other.heard(Channel::Wake, &notice[..90]);
        other.heard(Channel::Wake, &format!("{notice}+soon"));
        assert_eq!(*at_other.next().await, wake);
        assert!(at_other.0.is_empty(), "a malformed notice woke a processor");
        assert!(at_sender.0.is_empty(), "an outbox heard its own notice again");
    }

    /// Wake-ups for records due later carry their wait, many to a notice and every notice within
    /// PostgreSQL's payload limit, and arrive as sent.
    #[tokio::test]
    async fn wake_ups_for_later_carry_their_wait() {
        let (sender, other) = (Wakeups::default(), Wakeups::default());
        let mut at_other = other.subscribe();
        let wakes: Vec<Wake> = (0..200_u64)
            .map(|i| {
                let set = [i % 256, i * 7 % 256].map(|p| u8::try_from(p).unwrap());
                Wake { partitions: set.into_iter().collect(), after: Duration::from_millis(i * 1_000_000_007) }
            })
            .collect();
        let notices = sender.notices(Message::Wake(&wakes));
        assert_eq!(notices.len(), 3);
        assert!(notices.iter().all(|(_, n)| n.len() < 8000), "a NOTIFY payload must stay under 8,000 bytes");
        for (channel, notice) in &notices {
            other.heard(*channel, notice);
        }
        let mut heard = Vec::new();
        for _ in &notices {
            heard.extend_from_slice(&at_other.next().await);
        }
        assert_eq!(heard, wakes);
    }

    /// A nudge names the instances it was sent to, in as many notices as their ids need, and reaches
    /// every other outbox, not the one that sent it.
    #[tokio::test]
    async fn a_nudge_names_its_instances_across_notices() {
        let (sender, other) = (Wakeups::default(), Wakeups::default());
        let (mut at_sender, mut at_other) = (sender.nudges.subscribe(), other.nudges.subscribe());
        let ids: Vec<InstanceId> = (0..450).map(|_| InstanceId::new()).collect();
        let notices: Vec<String> = sender
            .notices(Message::Nudge(&ids))
            .into_iter()
            .map(|(channel, notice)| {
                assert_eq!(channel, Channel::Nudge);
                notice
            })
            .collect();
        assert_eq!(notices.len(), 3);
        assert!(notices.iter().all(|n| n.len() < 8000), "a NOTIFY payload must stay under 8,000 bytes");
        let mut named = Vec::new();
        for notice in &notices {
            sender.heard(Channel::Nudge, notice);
            other.heard(Channel::Nudge, notice);
            let nudge = at_other.recv().await.unwrap();
            named.extend(ids.iter().copied().filter(|id| nudge.names(*id)));
        }
        assert_eq!(named, ids);
        other.heard(Channel::Nudge, &notices[0][..40]);
        other.heard(Channel::Nudge, &notices[0].replace('0', "x"));
        assert!(at_other.is_empty(), "a malformed nudge named someone");
        assert!(at_sender.try_recv().is_err(), "an outbox heard its own nudge again");
    }

    #[test]
    fn malformed_text_is_refused() {
        assert_eq!(Partitions::from_hex(""), None);
        assert_eq!(Partitions::from_hex(&"g".repeat(64)), None);
        assert_eq!(Partitions::from_hex(&"0".repeat(63)), None);
        assert_eq!(Partitions::from_hex(&"é".repeat(32)), None);
    }
}
