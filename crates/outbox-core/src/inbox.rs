//! The inbox: the consumer's half of at-least-once. An outbox delivers each record at least once, so a
//! consumer sees some twice (a redelivery after a crash, a broker's own retry). It applies a message in
//! a transaction of its own database that also calls [`Inbox::accept`] with the message's source and
//! id: the first time, `accept` records them and says so; any later time it finds them and says the
//! message was applied already, so the consumer changes nothing and just acknowledges it. Its table
//! lives in the outbox schema (migrated with it); the consumer purges it with [`Inbox::purge`], in
//! bounded batches (nothing else does: the retention is the consumer's to choose).

use std::time::Duration;

use tracing::instrument;

use crate::Outbox;
use crate::driver::{Conn, Db, answered_within};
use crate::error::{Error, Result};

/// Longest accepted source or message id, in bytes.
pub const MAX_INBOX_ID_BYTES: usize = 256;

/// A consumer's record of the messages it has applied, in the tables of an [`Outbox`]'s schema (see the
/// [module docs](self)).
#[derive(Debug, Clone)]
pub struct Inbox {
    outbox: Outbox,
}

impl Outbox {
    /// The inbox in this outbox's schema, migrated with it.
    pub fn inbox(&self) -> Inbox {
        Inbox { outbox: self.clone() }
    }
}

impl Inbox {
    /// Records in the caller's transaction that message `message_id` (such as an outbox record's id) is
    /// applied by `source` (the consumer applying it, say its read model's name: two consumers of one
    /// stream that share a source skip each other's messages); `true` if it is new, `false` if
    /// a committed transaction accepted it already, in which case nothing changes. If another
    /// transaction accepted it and has not ended, this waits for that one: `false` if it commits,
    /// `true` if it rolls back. Apply the message in the same transaction, after a `true`. (On
    /// PostgreSQL at REPEATABLE READ or SERIALIZABLE, a message another transaction accepted after this
    /// one began is a serialization failure instead, which [`Error::is_transient`] says to retry: the
    /// transaction run again answers `false`.)
    ///
    /// An empty or over-long source or id is refused with [`Error::BadInboxId`] before anything is
    /// sent, leaving the transaction usable. A connection outside any transaction (sqlx's, or one the
    /// application began with its own `BEGIN`) is refused with [`Error::NotInTransaction`]: the row
    /// would commit before the message is applied.
    ///
    /// ```no_run
    /// # async fn demo(pool: sqlx::PgPool, outbox: outbox_core::Outbox) -> outbox_core::Result<()> {
    /// let inbox = outbox.inbox();
    /// let mut tx = pool.begin().await?;
    /// if inbox.accept(&mut *tx, "orders", "01a20c-…").await? {
    ///     sqlx::query("UPDATE read_model SET status = 'paid' WHERE id = 'o-7'").execute(&mut *tx).await?;
    /// }
    /// tx.commit().await?;
    /// // then acknowledge the message to the broker
    /// # Ok(()) }
    /// ```
    #[instrument(skip(self, conn))]
    pub async fn accept<'c>(&self, conn: impl Into<Conn<'c>>, source: &str, message_id: &str) -> Result<bool> {
        check_id("source", source)?;
        check_id("message id", message_id)?;
        let outbox = &self.outbox;
        conn.into().accept(outbox.statements(), source, message_id).await.map_err(|e| outbox.not_migrated(e))
    }

    /// Records in the caller's transaction that event `seq` of `key` from `source` (an outbox record's
    /// key and `seq`; the `Outbox-Seq` header on NATS) is the last one applied for that key, if it is
    /// later than the last; `true` if so (apply it), `false` if the same or a later event of the key
    /// was applied already. For a consumer that keeps only each key's latest state: an older event
    /// that arrives after a newer one (a redelivery overtaken by the next event) is skipped rather than
    /// applied over the newer state. Its rows are one per key and are not purged. Consumers of one key
    /// in concurrent transactions queue on its row. On MySQL a new key's row starts one below the
    /// event, so a first event numbered `i64::MIN` is not accepted there (outbox numbers start at 1).
    /// Outside any transaction it is refused, as [`Inbox::accept`] is.
    #[instrument(skip(self, conn))]
    pub async fn accept_in_order<'c>(
        &self,
        conn: impl Into<Conn<'c>>,
        source: &str,
        key: &str,
        seq: i64,
    ) -> Result<bool> {
        check_id("source", source)?;
        if key.is_empty() || key.len() > crate::MAX_KEY_BYTES || key.contains('\0') {
            return Err(bad_id("key", key, crate::MAX_KEY_BYTES));
        }
        let outbox = &self.outbox;
        let conn = conn.into();
        conn.accept_in_order(outbox.statements(), source, key, seq).await.map_err(|e| outbox.not_migrated(e))
    }

    /// Deletes the rows of messages accepted more than `retention` ago (database time), `batch_size`
    /// per statement, until none are left; returns how many. Keep `retention` longer than any message
    /// can be delivered again (the broker's redelivery window), or a late duplicate is applied twice.
    #[instrument(skip(self, db))]
    pub async fn purge(&self, db: impl Into<Db>, retention: Duration, batch_size: usize) -> Result<u64> {
        crate::purge::check_retention(retention)?;
        let (db, outbox) = (&db.into(), &self.outbox);
        crate::purge::in_batches(batch_size, |limit| async move {
            let purge = db.purge_inbox(outbox.statements(), retention, limit);
            answered_within(outbox.config().query_timeout, "purging the inbox", purge)
                .await
                .map(crate::purge::Batch::deleted)
                .map_err(|e| outbox.not_migrated(e))
        })
        .await
    }
}

fn check_id(what: &'static str, id: &str) -> Result<()> {
    if id.is_empty() || id.len() > MAX_INBOX_ID_BYTES || id.contains('\0') {
        return Err(bad_id(what, id, MAX_INBOX_ID_BYTES));
    }
    Ok(())
}

fn bad_id(what: &'static str, id: &str, max: usize) -> Error {
    Error::BadInboxId { what, start: id.chars().take(32).collect(), len: id.len(), max }
}
