//! Scheduling: records are written with the caller's connection, inside the caller's transaction, so
//! they exist if and only if that transaction commits.

use tracing::instrument;
use uuid::Uuid;

use crate::db::Conn;
use crate::error::{Error, Result};
use crate::record::{NewRecord, Scheduled};
use crate::sql::stmt;
use crate::{Outbox, sqlite};

impl Outbox {
    /// Schedules one record in the caller's transaction.
    ///
    /// Pass the transaction (`&mut *tx` or `&mut tx`, PostgreSQL or SQLite): there is no conversion from a
    /// pool, so scheduling outside the transaction cannot happen by mistake. Bad input is rejected before
    /// anything is sent, leaving the transaction usable.
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
    /// consecutive sequence numbers in slice order. Either all are validated and written, or none.
    #[instrument(skip_all, fields(records = records.len()))]
    pub async fn schedule_batch<'c>(&self, conn: impl Into<Conn<'c>>, records: &[NewRecord]) -> Result<Vec<Scheduled>> {
        let conn = conn.into();
        let max_payload = self.config().max_payload_bytes;
        let n = records.len();
        let (mut ids, mut partitions, mut keys, mut types, mut payloads, mut headers) = (
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
        );
        for record in records {
            record.validate(max_payload)?;
            ids.push(Uuid::now_v7());
            partitions.push(i16::from(record.partition()));
            keys.push(record.key.as_str());
            types.push(record.event_type.as_str());
            payloads.push(record.payload.as_ref());
            headers.push(
                serde_json::to_string(&record.headers)
                    .map_err(|source| Error::Json { key: record.key.clone(), source })?,
            );
        }
        if records.is_empty() {
            return Ok(Vec::new());
        }
        let rows: Vec<(Uuid, i64)> = match conn {
            Conn::Postgres(conn) => sqlx::query_as(stmt(&self.sql().schedule))
                .bind(&ids)
                .bind(&partitions)
                .bind(&keys)
                .bind(&types)
                .bind(&payloads)
                .bind(&headers)
                .fetch_all(conn)
                .await
                .map_err(|e| self.db_error(e))?,
            Conn::Sqlite(conn) => {
                let input = ids.iter().zip(&partitions).zip(&keys).zip(&types).zip(&payloads).zip(headers.iter());
                let rows = input.map(|(((((&id, &p), &k), &t), &b), h)| (id, p, k, t, b, h.clone())).collect();
                let seqs = sqlite::schedule(conn, self.sqlite(), rows).await.map_err(|e| self.db_error(e))?;
                ids.iter().copied().zip(seqs).collect()
            }
        };
        // Counted when written; a transaction rolled back later still counts here.
        metrics::counter!("outbox_records_scheduled_total").increment(rows.len() as u64);
        let seq_of: std::collections::HashMap<Uuid, i64> = rows.into_iter().collect();
        ids.iter()
            .zip(records)
            .map(|(id, record)| {
                let seq = seq_of.get(id).copied().ok_or(Error::Database(sqlx::Error::RowNotFound))?;
                Ok(Scheduled { id: *id, partition: record.partition(), seq })
            })
            .collect()
    }
}
