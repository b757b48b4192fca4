//! The producer's cost: `schedule` once per record, and `schedule_batch`, in transactions of 100 on one
//! connection, against a plain `INSERT` of the same rows into a table of the records' shape (same
//! columns, constraints and indexes), measured in the same round on the same database.

use std::time::Instant;

use outbox_core::{NewRecord, Value};
use serde_json::json;
use uuid::Uuid;

use super::Bench;
use super::report::Row;
use crate::Failure;

const KEYS: usize = 1000;
const PER_TRANSACTION: usize = 100;

/// The names of one database's producer rows: plain insert, `schedule` per record, `schedule_batch`.
pub(super) type Names = [&'static str; 3];

pub(super) const POSTGRES: Names =
    ["producer_plain_insert", "producer_schedule_per_record", "producer_schedule_batch_100"];
#[cfg(feature = "sqlite")]
pub(super) const SQLITE: Names =
    ["sqlite_producer_plain_insert", "sqlite_producer_schedule_per_record", "sqlite_producer_schedule_batch_100"];

impl Bench {
    /// The three ways of writing the same records, each from an empty table; `plain` is the name of a
    /// fresh table of the records' shape on this bench's database.
    pub(super) async fn producer(&self, names: Names, plain: &str) -> Result<Vec<Row>, Failure> {
        let n = if self.sizes.quick { 2_000 } else { 20_000 };
        let records: Vec<NewRecord> =
            (0..n).map(|i| NewRecord::new(format!("key-{}", i % KEYS), "bench", self.payload())).collect();

        let insert = format!(
            "INSERT INTO {plain} (id, partition, key, seq, event_type, payload) VALUES ($1, $2, $3, $4, $5, $6)"
        );
        let body = self.payload();
        let started = Instant::now();
        for (c, chunk) in records.chunks(PER_TRANSACTION).enumerate() {
            let mut tx = self.db.begin().await?;
            for (i, record) in chunk.iter().enumerate() {
                let seq = (c * PER_TRANSACTION + i) as i64;
                let values: [Value; 6] = [
                    Uuid::now_v7().into(),
                    ((seq % 256) as i16).into(),
                    record.key.as_str().into(),
                    seq.into(),
                    "bench".into(),
                    body.as_slice().into(),
                ];
                tx.execute(sqlx::AssertSqlSafe(insert.clone()), &values).await?;
            }
            tx.commit().await?;
        }
        let plain_rate = n as f64 / started.elapsed().as_secs_f64();

        self.reset().await?;
        let started = Instant::now();
        for chunk in records.chunks(PER_TRANSACTION) {
            let mut tx = self.db.begin().await?;
            for record in chunk {
                self.outbox.schedule(&mut tx, record.clone()).await?;
            }
            tx.commit().await?;
        }
        let per_record = n as f64 / started.elapsed().as_secs_f64();

        self.reset().await?;
        let started = Instant::now();
        for chunk in records.chunks(PER_TRANSACTION) {
            let mut tx = self.db.begin().await?;
            self.outbox.schedule_batch(&mut tx, chunk).await?;
            tx.commit().await?;
        }
        let batched = n as f64 / started.elapsed().as_secs_f64();

        let row = |scenario, value: f64| Row {
            scenario,
            value,
            unit: "records/s",
            extra: json!({"records": n, "keys": KEYS, "per_transaction": PER_TRANSACTION,
                "vs_plain_insert": value / plain_rate}),
        };
        Ok(vec![row(names[0], plain_rate), row(names[1], per_record), row(names[2], batched)])
    }
}

#[cfg(feature = "sqlite")]
impl Bench {
    /// The same on a fresh SQLite file with the library's defaults (`synchronous = FULL`).
    pub(super) async fn producer_on_sqlite(&self) -> Result<Vec<Row>, Failure> {
        use super::sqlite::{self, Durability};
        let dir = tempfile::tempdir().map_err(|e| Failure(format!("bench: no temporary directory: {e}")))?;
        let db = sqlite::file(&dir.path().join("producer.db"), Durability::Full).await?;
        self.outbox.migrate(&db).await?;
        let bench = self.on(db);
        bench.reset().await?;
        let plain = sqlite::plain_table(&bench.db, &bench.table("records")).await?;
        let rows = bench.producer(SQLITE, &plain).await;
        bench.db.close().await;
        rows
    }
}
