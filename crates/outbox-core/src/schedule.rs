//! Scheduling: records are written with the caller's connection, inside the caller's transaction, so
//! they exist if and only if that transaction commits.

use std::collections::HashMap;

use tracing::instrument;
use uuid::Uuid;

use crate::Outbox;
use crate::driver::Conn;
use crate::error::{Error, Result};
use crate::record::{Delay, NewRecord, Scheduled};
use crate::stored::NewRow;

impl Outbox {
    /// Schedules one record in the caller's transaction.
    ///
    /// Pass the transaction (`&mut *tx` or `&mut tx`, on every database): there is no conversion from a
    /// pool, so scheduling outside the transaction cannot happen by mistake. A connection inside a
    /// transaction begun with the application's own SQL (`BEGIN`) schedules in that transaction too; on a
    /// connection outside any, the records commit on their own. Bad input is rejected before anything is
    /// sent, leaving the transaction usable.
    ///
    /// Holds the key's lock row until the caller commits (SQLite: the database write lock): concurrent
    /// writers of the same key wait, which is what makes per-key order equal commit order. Keep such
    /// transactions short. The record's sequence number is strictly increasing per key for the life of
    /// the database (see [`Record::seq`](crate::Record::seq)).
    ///
    /// ```no_run
    /// # async fn demo(pool: sqlx::PgPool, outbox: outbox_core::Outbox) -> outbox_core::Result<()> {
    /// use outbox_core::NewRecord;
    /// let mut tx = pool.begin().await?;
    /// sqlx::query("INSERT INTO orders (id) VALUES ('o-1')").execute(&mut *tx).await?;
    /// outbox.schedule(&mut *tx, NewRecord::json("o-1", "order.created", &serde_json::json!({"id": "o-1"}))?).await?;
    /// tx.commit().await?;
    /// # Ok(()) }
    /// ```
    pub async fn schedule<'c>(&self, conn: impl Into<Conn<'c>>, record: NewRecord) -> Result<Scheduled> {
        let mut scheduled = self.schedule_batch(conn, std::slice::from_ref(&record)).await?;
        scheduled.pop().ok_or_else(|| Error::Database(sqlx::Error::RowNotFound))
    }

    /// Schedules several records in one round trip, in the caller's transaction. Records of one key get
    /// increasing sequence numbers in slice order (not consecutive: the numbers come from one
    /// database-wide sequence). Either all are validated and written, or none. A batch over what one
    /// statement carries on PostgreSQL (1 GiB) or SQLite (a billion bytes, payloads hex-encoded) is
    /// refused before anything is sent ([`Error::BatchTooLarge`]); MySQL writes it in several.
    #[instrument(skip_all, fields(records = records.len()))]
    pub async fn schedule_batch<'c>(&self, conn: impl Into<Conn<'c>>, records: &[NewRecord]) -> Result<Vec<Scheduled>> {
        let max_payload = self.config().max_payload_bytes;
        let mut rows = Vec::with_capacity(records.len());
        for record in records {
            record.validate(max_payload)?;
            let headers = serde_json::to_string(&*crate::trace::with_context(&record.headers))
                .map_err(|source| Error::Json { key: record.key.clone(), source })?;
            rows.push(NewRow {
                id: Uuid::now_v7(),
                partition: record.partition(),
                key: &record.key,
                event_type: &record.event_type,
                payload: &record.payload,
                headers,
                deliver_at: match record.delay.map(Delay::in_whole_millis) {
                    Some(Delay::At(at)) => Some(at),
                    _ => None,
                },
                deliver_after_ms: match record.delay.map(Delay::in_whole_millis) {
                    Some(Delay::After(after)) => Some(crate::driver::millis(after)),
                    _ => None,
                },
            });
        }
        if records.is_empty() {
            return Ok(Vec::new());
        }
        let written = conn.into().schedule(self.statements(), &rows).await.map_err(|e| self.not_migrated(e))?;
        // Counted when written; a transaction rolled back later still counts here.
        metrics::counter!("outbox_records_scheduled_total", "schema" => self.schema_label())
            .increment(written.len() as u64);
        let seq_of: HashMap<Uuid, i64> = written.into_iter().collect();
        rows.iter()
            .zip(records)
            .map(|(row, record)| {
                let seq = seq_of.get(&row.id).copied().ok_or(Error::Database(sqlx::Error::RowNotFound))?;
                Ok(Scheduled { id: row.id, partition: row.partition, seq, delay: record.delay })
            })
            .collect()
    }
}
