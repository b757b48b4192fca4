//! The handler conformance suite: what any delivery target must satisfy, run against the in-process
//! sink and the JetStream handler alike.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::time::Duration;

use outbox_core::{Handler, Handlers, NewRecord, Outbox, Record, Route};
use uuid::Uuid;

use super::{drained, start};

/// One message as the target holds it.
#[derive(Debug, Clone, PartialEq)]
pub struct Received {
    pub id: Uuid,
    pub key: String,
    pub seq: i64,
    pub payload: Vec<u8>,
    pub headers: BTreeMap<String, String>,
}

/// A delivery target under test.
pub trait Target {
    type H: Handler + Clone;
    fn handler(&self) -> Self::H;
    /// Everything the target received, in the order it holds it.
    fn received(&self) -> impl Future<Output = Vec<Received>>;
    /// Whether the target keeps one copy of a record delivered twice (JetStream, by `Nats-Msg-Id`).
    fn dedupes(&self) -> bool;
}

/// Runs the suite on a fresh, migrated outbox.
pub async fn run<T: Target>(outbox: &Outbox, pool: &super::TestDb, target: &T) {
    // 1. Many keys through a node: each committed record arrives, payload and headers unchanged, each
    //    key's records in sequence order.
    let keys: Vec<String> = (0..20).map(|k| format!("conf-{k}")).collect();
    // (key, seq) → round; and each key's sequence numbers, round by round.
    let mut expected: BTreeMap<(String, i64), i64> = BTreeMap::new();
    let mut in_order: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for round in 1..=5 {
        let records: Vec<NewRecord> = keys
            .iter()
            .map(|k| {
                NewRecord::new(k.clone(), "conformance", format!("{k}#{round}"))
                    .header("traceparent", format!("00-{k}-{round}-01"))
            })
            .collect();
        let scheduled = super::commit(outbox, pool, records).await;
        for (k, s) in keys.iter().zip(scheduled) {
            expected.insert((k.clone(), s.seq), round);
            in_order.entry(k.clone()).or_default().push(s.seq);
        }
    }
    let node = start(outbox, pool, Handlers::new().default_route(Route::new(target.handler()))).await;
    drained(pool, Duration::from_secs(60)).await;
    node.shutdown().await.unwrap();

    let received = target.received().await;
    let mut firsts: BTreeMap<&str, Vec<i64>> = BTreeMap::new();
    let mut seen = BTreeSet::new();
    for r in &received {
        if seen.insert(r.id) {
            firsts.entry(&r.key).or_default().push(r.seq);
            let round = expected[&(r.key.clone(), r.seq)];
            assert_eq!(r.payload, format!("{}#{round}", r.key).into_bytes(), "payload of {} #{}", r.key, r.seq);
            assert_eq!(r.headers.get("traceparent"), Some(&format!("00-{}-{round}-01", r.key)), "headers pass through");
        }
    }
    assert_eq!(seen.len(), expected.len(), "every committed record arrived");
    for k in &keys {
        assert_eq!(firsts[k.as_str()], in_order[k], "{k} in sequence order");
    }

    // 2. Redelivery of the same record (a crash between delivery and completion) is accepted: a target
    //    that dedupes holds it once, any other as often as it was handed over.
    let record = Record {
        id: Uuid::now_v7(),
        partition: outbox_core::partition_of("again"),
        key: "again".into(),
        seq: 1,
        event_type: "conformance".into(),
        payload: "twice".into(),
        headers: Default::default(),
        attempts: 0,
        created_at: chrono::Utc::now(),
        deliver_at: None,
        epoch: outbox_core::Epoch(1),
    };
    let handler = target.handler();
    handler.handle(&record).await.unwrap();
    handler.handle(&record).await.unwrap();
    let received = target.received().await;
    let copies = received.iter().filter(|r| r.id == record.id).count();
    assert_eq!(copies, if target.dedupes() { 1 } else { 2 }, "copies of the record delivered twice");
    let ids: BTreeSet<Uuid> = received.iter().map(|r| r.id).collect();
    assert_eq!(ids.len(), expected.len() + 1);
}

/// The in-process target: keeps every delivery in memory.
#[derive(Clone, Default)]
pub struct InProcess(std::sync::Arc<std::sync::Mutex<Vec<Received>>>);

impl Handler for InProcess {
    fn handle(&self, r: &Record) -> impl Future<Output = Result<(), outbox_core::HandlerError>> + Send {
        let received = Received {
            id: r.id,
            key: r.key.clone(),
            seq: r.seq,
            payload: r.payload.to_vec(),
            headers: r.headers.clone(),
        };
        let store = self.0.clone();
        async move {
            store.lock().unwrap().push(received);
            Ok(())
        }
    }
}

impl Target for InProcess {
    type H = InProcess;
    fn handler(&self) -> InProcess {
        self.clone()
    }
    fn dedupes(&self) -> bool {
        false
    }

    async fn received(&self) -> Vec<Received> {
        self.0.lock().unwrap().clone()
    }
}
