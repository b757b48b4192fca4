//! Shared test harness: an outbox on the test's own database, a recording sink, fast cluster tunables,
//! and waiting on conditions (never sleeping for an outcome).
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

pub mod conformance;
#[allow(unused_imports)]
pub use outbox_tests::nats;

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use outbox_cluster::{ClusterConfig, Node};
use outbox_core::{Config, Handlers, NewRecord, Outbox, Record};
use sqlx::PgPool;
use tokio::time::Instant;

/// An outbox on `pool`'s database, migrated, with test-friendly tunables changed by `tune`.
pub async fn outbox(pool: &PgPool, tune: impl FnOnce(&mut Config)) -> Outbox {
    let mut config = Config { poll_interval: Duration::from_millis(20), ..Config::default() };
    tune(&mut config);
    let outbox = Outbox::new(config).unwrap();
    outbox.migrate(pool).await.unwrap();
    outbox
}

/// Cluster tunables fast enough for tests: lease 600 ms.
pub fn fast_cluster() -> ClusterConfig {
    ClusterConfig {
        name: "test".into(),
        heartbeat_interval: Duration::from_millis(100),
        stale_timeout: Duration::from_millis(600),
        rebalance_interval: Duration::from_millis(100),
    }
}

pub async fn start(outbox: &Outbox, pool: &PgPool, handlers: Handlers) -> Node {
    Node::start(outbox.clone(), pool.clone(), handlers, fast_cluster()).await.unwrap()
}

/// One delivery as a handler saw it.
#[derive(Debug, Clone)]
pub struct Delivery {
    pub id: uuid::Uuid,
    pub epoch: i64,
    pub key: String,
    pub seq: i64,
    pub attempts: i32,
    pub at: Instant,
}

/// Records every delivery handed to a handler.
#[derive(Debug, Default)]
pub struct Sink {
    deliveries: Mutex<Vec<Delivery>>,
}

impl Sink {
    pub fn new() -> Arc<Self> {
        Arc::default()
    }

    pub fn record(&self, record: &Record) {
        self.deliveries.lock().unwrap().push(Delivery {
            id: record.id,
            epoch: record.epoch,
            key: record.key.clone(),
            seq: record.seq,
            attempts: record.attempts,
            at: Instant::now(),
        });
    }

    pub fn all(&self) -> Vec<Delivery> {
        self.deliveries.lock().unwrap().clone()
    }

    pub fn len(&self) -> usize {
        self.deliveries.lock().unwrap().len()
    }

    pub fn of_key(&self, key: &str) -> Vec<Delivery> {
        self.all().into_iter().filter(|d| d.key == key).collect()
    }

    pub fn seqs_of(&self, key: &str) -> Vec<i64> {
        self.of_key(key).iter().map(|d| d.seq).collect()
    }
}

/// Waits until `condition` holds, polling every 10 ms; panics with `what` after `timeout`.
pub async fn wait_for<F, Fut>(what: &str, timeout: Duration, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    while !condition().await {
        assert!(Instant::now() < deadline, "timed out after {timeout:?} waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

pub async fn count(pool: &PgPool, sql: &'static str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

pub async fn pending(pool: &PgPool) -> i64 {
    count(pool, "SELECT count(*) FROM outbox.records").await
}

/// Schedules `records` in one committed transaction.
pub async fn commit(outbox: &Outbox, pool: &PgPool, records: Vec<NewRecord>) {
    let mut tx = pool.begin().await.unwrap();
    outbox.schedule_batch(&mut tx, &records).await.unwrap();
    tx.commit().await.unwrap();
}

pub async fn failed_count(pool: &PgPool) -> i64 {
    count(pool, "SELECT count(*) FROM outbox.records WHERE failed_at IS NOT NULL").await
}

/// Waits until exactly `n` records are FAILED.
pub async fn wait_failed(pool: &PgPool, n: i64) {
    wait_for(&format!("{n} FAILED records"), Duration::from_secs(60), || async { failed_count(pool).await == n }).await;
}

/// Runs a node whose handler accepts everything until the outbox is drained, then stops it.
pub async fn deliver_all(outbox: &Outbox, pool: &PgPool) {
    let ok = outbox_core::handler_fn(|_| async { Ok::<(), outbox_core::HandlerError>(()) });
    let node = start(outbox, pool, Handlers::new().default_route(outbox_core::Route::new(ok))).await;
    drained(pool, Duration::from_secs(60)).await;
    node.shutdown().await.unwrap();
}

/// Waits until the outbox holds no pending (non-FAILED) record.
pub async fn drained(pool: &PgPool, timeout: Duration) {
    wait_for("all records completed", timeout, || async {
        count(pool, "SELECT count(*) FROM outbox.records WHERE failed_at IS NULL").await == 0
    })
    .await;
}

/// A handler that records each delivery, signals `entered`, then waits for a `release` permit.
pub struct Gate {
    pub entered: Arc<tokio::sync::Semaphore>,
    pub release: Arc<tokio::sync::Semaphore>,
}

pub fn gated(sink: &Arc<Sink>) -> (Handlers, Gate) {
    let gate =
        Gate { entered: Arc::new(tokio::sync::Semaphore::new(0)), release: Arc::new(tokio::sync::Semaphore::new(0)) };
    let (s, e, r) = (sink.clone(), gate.entered.clone(), gate.release.clone());
    let handlers = Handlers::new().default_route(outbox_core::Route::new(outbox_core::handler_fn(move |rec| {
        let (s, e, r) = (s.clone(), e.clone(), r.clone());
        async move {
            s.record(&rec);
            e.add_permits(1);
            r.acquire().await.unwrap().forget();
            Ok(())
        }
    })));
    (handlers, gate)
}

/// Sets a test-wide tracing subscriber once (RUST_LOG controls it).
pub fn logs() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}
