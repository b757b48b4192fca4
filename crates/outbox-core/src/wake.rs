//! Wake-ups: a producer that has committed records tells their partitions' owners to fetch now instead
//! of at their next poll ([`Outbox::wake`]). In the producer's process the owners' processors hear it at
//! once; on PostgreSQL the others hear it through `NOTIFY`, sent after the caller's commit (never inside
//! it: `NOTIFY` in a transaction takes a lock every committing notifier queues on) and heard by one
//! `LISTEN` connection per processor, which then fetches from the partitions named that it holds.
//!
//! Polling stays the correctness path: a wake-up is a hint that can be lost (a listener reconnecting, a
//! producer that does not call `wake`), so a processor still polls, every `poll_interval`, or every
//! `listen_poll_interval` while its `LISTEN` connection is up.
//!
//! Nudges travel the same way for the ownership layer ([`Outbox::nudge`]): they name instances whose
//! ownership round should run now rather than at its next tick, because partitions they own or are
//! meant to take moved. Rounds on their tickers stay the correctness path there too.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::Outbox;
use crate::assignment::InstanceId;
use crate::driver::{Db, answered_within};
use crate::error::Result;
use crate::notice::{Message, Nudges, Partitions, Wake, millis_up};
use crate::record::{Delay, Scheduled};

impl Outbox {
    /// Wakes the owners of `scheduled`'s partitions so they deliver now rather than at their next poll;
    /// for records scheduled for later, when their time comes (by this host's clock; a processor that
    /// stops meanwhile, or misses it, leaves them to its successor's poll). Call it after the transaction
    /// that scheduled them has committed (before, the records are not yet visible, and the owner looks
    /// in vain). An error (no answer within `query_timeout`, PostgreSQL's notification queue full) comes
    /// after that commit: the records are stored whatever this returns, so log it rather than fail the
    /// request, whose client might run the business transaction again.
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
    /// if let Err(e) = outbox.wake(&pool, &[scheduled]).await {
    ///     tracing::warn!(error = %e, "wake-up not sent; the record goes at its owner's next poll");
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn wake(&self, db: impl Into<Db>, scheduled: &[Scheduled]) -> Result<()> {
        // Per wait (0: due now), the partitions with records due then.
        let mut by_wait: BTreeMap<Duration, Partitions> = BTreeMap::new();
        let now = chrono::Utc::now();
        for s in scheduled {
            let wait = match s.delay {
                None => Duration::ZERO,
                Some(Delay::After(after)) => after,
                Some(Delay::At(at)) => (at - now).to_std().unwrap_or_default(),
            };
            by_wait.entry(millis_up(wait)).or_default().insert(s.partition);
        }
        let wakes: Vec<Wake> = by_wait.into_iter().map(|(after, partitions)| Wake { partitions, after }).collect();
        self.send_wakes(&db.into(), &wakes).await
    }

    pub(crate) async fn send_wakes(&self, db: &Db, wakes: &[Wake]) -> Result<()> {
        if wakes.is_empty() {
            return Ok(());
        }
        self.wakeups().send(wakes);
        let notify = db.notify(self.statements(), self.wakeups(), Message::Wake(wakes));
        answered_within(self.config().query_timeout, "sending wake-ups", notify).await
    }

    /// Asks the ownership rounds of `instances` to run now instead of at their next tick: the cluster
    /// layer's hint that partitions they own, or are meant to take, have moved. Rounds of this `Outbox`
    /// in this process hear it at once; on PostgreSQL it also sends `NOTIFY` on `<schema>.nudge`, heard
    /// by the `LISTEN` connection of every other process's processor. A nudge that is lost costs only
    /// the wait for the next round.
    pub async fn nudge(&self, db: impl Into<Db>, instances: &[InstanceId]) -> Result<()> {
        if instances.is_empty() {
            return Ok(());
        }
        self.wakeups().nudge(instances);
        let db = db.into();
        let notify = db.notify(self.statements(), self.wakeups(), Message::Nudge(instances));
        answered_within(self.config().query_timeout, "sending nudges", notify).await
    }

    /// The nudges this process hears for this `Outbox`: those sent here, and on PostgreSQL those heard
    /// from other processes while a processor of this `Outbox` runs (its `LISTEN` connection hears them).
    pub fn nudges(&self) -> Nudges {
        self.wakeups().subscribe_nudges()
    }
}
