//! What the outbox is measured against, in the same round: JetStream publishing alone (pipelined, and
//! in strict per-key order), and an idealised relay (select 500 pending rows, publish them pipelined,
//! delete them by id; no ordering, no fencing).

use std::time::Instant;

use futures::future::try_join_all;
use serde_json::json;
use uuid::Uuid;

use super::Bench;
use super::report::Row;
use crate::Failure;

impl Bench {
    /// JetStream alone, pipelined (up to 1,000 acks outstanding).
    pub(super) async fn raw_publish(&self, scenario: &'static str) -> Result<Row, Failure> {
        let client = self.reset().await?;
        let js = async_nats::jetstream::new(client);
        let n = self.sizes.records();
        // Message ids unique to this run, so JetStream's duplicate window never drops one as a repeat.
        let run = Uuid::now_v7();
        let started = Instant::now();
        for chunk in (0..n).collect::<Vec<_>>().chunks(1000) {
            let mut acks = Vec::with_capacity(chunk.len());
            for i in chunk {
                let message = async_nats::jetstream::message::PublishMessage::build()
                    .payload(self.payload().into())
                    .message_id(format!("raw-{run}-{i}"));
                acks.push(js.send_publish("bench.raw", message).await.map_err(|e| Failure(e.to_string()))?);
            }
            try_join_all(acks.into_iter().map(|ack| ack.into_future())).await.map_err(|e| Failure(e.to_string()))?;
        }
        let rate = n as f64 / started.elapsed().as_secs_f64();
        Ok(Row { scenario, value: rate, unit: "records/s", extra: json!({"records": n}) })
    }

    /// What strict per-key order costs JetStream alone: `keys` keys at once, each publishing its next
    /// message only after the previous one's ack (no database at all).
    pub(super) async fn ordered_publish(&self, keys: usize) -> Result<Row, Failure> {
        let client = self.reset().await?;
        let js = async_nats::jetstream::new(client);
        let n = self.sizes.records();
        let per_key = n.div_ceil(keys);
        let run = Uuid::now_v7();
        let started = Instant::now();
        let tasks = (0..keys).map(|k| {
            let js = js.clone();
            async move {
                for i in 0..per_key {
                    let message = async_nats::jetstream::message::PublishMessage::build()
                        .payload(self.payload().into())
                        .message_id(format!("ordered-{run}-{k}-{i}"));
                    let ack = js.send_publish("bench.ordered", message).await.map_err(|e| Failure(e.to_string()))?;
                    ack.await.map_err(|e| Failure(e.to_string()))?;
                }
                Ok::<(), Failure>(())
            }
        });
        try_join_all(tasks).await?;
        let rate = (per_key * keys) as f64 / started.elapsed().as_secs_f64();
        Ok(Row {
            scenario: "yardstick_ordered_publish",
            value: rate,
            unit: "records/s",
            extra: json!({"records": per_key * keys, "keys_at_once": keys}),
        })
    }

    /// The idealised relay, on PostgreSQL.
    pub(super) async fn idealised_relay(&self) -> Result<Row, Failure> {
        let client = self.reset().await?;
        let n = self.preload().await?.len();
        let js = async_nats::jetstream::new(client);
        let relay = self.pg.relay().await?;
        let cpu = self.cpu.sample();
        let started = Instant::now();
        loop {
            let rows = relay.next().await?;
            if rows.is_empty() {
                break;
            }
            let mut acks = Vec::with_capacity(rows.len());
            for (id, body) in &rows {
                let message = async_nats::jetstream::message::PublishMessage::build()
                    .payload(body.clone().into())
                    .message_id(id.to_string());
                acks.push(js.send_publish("bench.relay", message).await.map_err(|e| Failure(e.to_string()))?);
            }
            try_join_all(acks.into_iter().map(|ack| ack.into_future())).await.map_err(|e| Failure(e.to_string()))?;
            let ids: Vec<Uuid> = rows.iter().map(|(id, _)| *id).collect();
            relay.delete(&ids).await?;
        }
        let rate = n as f64 / started.elapsed().as_secs_f64();
        let mut extra = self.cpu.per_thousand(cpu, n);
        extra["records"] = json!(n);
        relay.close().await;
        Ok(Row { scenario: "yardstick_idealised_relay", value: rate, unit: "records/s", extra })
    }
}
