//! Wake-ups: a producer that has committed records tells their partitions' owners to fetch now instead
//! of at their next poll ([`Outbox::wake`]). In the producer's process the owners' processors hear it at
//! once; on PostgreSQL the others hear it through `NOTIFY`, sent after the caller's commit (never inside
//! it: `NOTIFY` in a transaction takes a lock every committing notifier queues on) and heard by one
//! `LISTEN` connection per processor, which then fetches from the partitions named that it holds.
//!
//! Polling stays the correctness path: a wake-up is a hint that can be lost (a listener reconnecting, a
//! producer that does not call `wake`), so a processor still polls, every `poll_interval`, or every
//! `listen_poll_interval` while its `LISTEN` connection is up.

use tokio::sync::broadcast;

use crate::Outbox;
use crate::driver::Db;
use crate::error::Result;
use crate::partition::Partition;
use crate::record::Scheduled;

/// A set of partitions, as 256 bits; its text form (the `NOTIFY` payload) is 64 hex digits.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Partitions([u64; 4]);

impl Partitions {
    /// Every partition: what a processor is told when wake-ups may have been missed.
    pub(crate) const ALL: Partitions = Partitions([u64::MAX; 4]);

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

/// The wake-ups of one [`Outbox`] (and its clones) in this process.
#[derive(Debug)]
pub(crate) struct Wakeups {
    sender: broadcast::Sender<Partitions>,
    /// Names this `Outbox`'s notices, so its listeners pass over the ones it sent: its processors
    /// heard those when they were sent, and hearing them again would fetch twice per commit.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))] // notices travel only through PostgreSQL
    origin: u128,
}

impl Default for Wakeups {
    fn default() -> Self {
        // A processor that falls this far behind hears `ALL` instead (one extra fetch).
        Self { sender: broadcast::channel(1024).0, origin: uuid::Uuid::now_v7().as_u128() }
    }
}

impl Wakeups {
    pub(crate) fn send(&self, partitions: Partitions) {
        // No processor in this process: nothing to wake.
        let _ = self.sender.send(partitions);
    }

    pub(crate) fn subscribe(&self) -> Listener {
        Listener(self.sender.subscribe())
    }

    /// The text that tells other processes about `partitions`: this outbox's origin (32 hex digits),
    /// then the set (64).
    #[cfg(any(feature = "postgres", test))]
    pub(crate) fn notice(&self, partitions: Partitions) -> String {
        format!("{:032x}{}", self.origin, partitions.to_hex())
    }

    /// A notice heard from the database: wakes this process's processors, unless this outbox sent it
    /// or it is malformed.
    #[cfg(any(feature = "postgres", test))]
    pub(crate) fn heard(&self, notice: &str) {
        let parsed = notice
            .get(..32)
            .zip(notice.get(32..))
            .and_then(|(origin, set)| Some((u128::from_str_radix(origin, 16).ok()?, Partitions::from_hex(set)?)));
        match parsed {
            Some((origin, _)) if origin == self.origin => {}
            Some((_, partitions)) => self.send(partitions),
            None => tracing::debug!(notice, "ignored a malformed wake-up"),
        }
    }
}

/// One processor's end of the wake-ups.
pub(crate) struct Listener(broadcast::Receiver<Partitions>);

impl Listener {
    /// The partitions of the next wake-up (`ALL` if some were missed); pending forever once the sender
    /// is gone (never, while the outbox lives).
    pub(crate) async fn next(&mut self) -> Partitions {
        match self.0.recv().await {
            Ok(partitions) => partitions,
            Err(broadcast::error::RecvError::Lagged(_)) => Partitions::ALL,
            Err(broadcast::error::RecvError::Closed) => std::future::pending().await,
        }
    }
}

impl Outbox {
    /// Wakes the owners of `scheduled`'s partitions so they deliver now rather than at their next poll.
    /// Call it after the transaction that scheduled them has committed (before, the records are not yet
    /// visible, and the owner looks in vain).
    ///
    /// Processors of this `Outbox` in this process hear it at once. On PostgreSQL it also sends one
    /// `NOTIFY` (its own statement, after the caller's commit), heard by the processors of every other
    /// process using the same schema; elsewhere those find the records at their next poll. A wake-up that
    /// is lost costs only latency: polling still finds every record.
    ///
    /// ```no_run
    /// # async fn demo(pool: sqlx::PgPool, outbox: outbox_core::Outbox) -> outbox_core::Result<()> {
    /// use outbox_core::NewRecord;
    /// let mut tx = pool.begin().await?;
    /// let scheduled = outbox.schedule(&mut *tx, NewRecord::new("o-1", "order.created", "{}")).await?;
    /// tx.commit().await?;
    /// outbox.wake(&pool, &[scheduled]).await?;
    /// # Ok(()) }
    /// ```
    pub async fn wake(&self, db: impl Into<Db>, scheduled: &[Scheduled]) -> Result<()> {
        let mut partitions = Partitions::default();
        for s in scheduled {
            partitions.insert(s.partition);
        }
        self.wake_partitions(&db.into(), partitions).await
    }

    pub(crate) async fn wake_partitions(&self, db: &Db, partitions: Partitions) -> Result<()> {
        if partitions.is_empty() {
            return Ok(());
        }
        self.wakeups().send(partitions);
        db.notify(self.statements(), self.wakeups(), partitions).await
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::{Partitions, Wakeups};

    proptest! {
        #[test]
        fn a_set_survives_its_text_form(members in proptest::collection::btree_set(any::<u8>(), 0..40)) {
            let mut set = Partitions::default();
            for &p in &members {
                set.insert(p);
            }
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
        let mut set = Partitions::default();
        set.insert(7);
        let notice = sender.notice(set);
        sender.heard(&notice);
        other.heard(&notice);
        other.heard("not a notice");
        other.heard(&notice[..90]);
        assert_eq!(at_other.next().await, set);
        assert!(at_other.0.is_empty(), "a malformed notice woke a processor");
        assert!(at_sender.0.is_empty(), "an outbox heard its own notice again");
    }

    #[test]
    fn malformed_text_is_refused() {
        assert_eq!(Partitions::from_hex(""), None);
        assert_eq!(Partitions::from_hex(&"g".repeat(64)), None);
        assert_eq!(Partitions::from_hex(&"0".repeat(63)), None);
        assert_eq!(Partitions::from_hex(&"é".repeat(32)), None);
    }
}
