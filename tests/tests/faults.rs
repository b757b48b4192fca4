//! Multi-process fault test: real worker processes (`outbox-test-worker`) against the real PostgreSQL,
//! scaled 1 → 4 → 2 → 3 while a producer writes (and sometimes rolls back), with kill -9, a SIGSTOP
//! longer than the stale timeout (the zombie), and terminated database connections. A checker then
//! reads the database and asserts the invariants.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::*;
use outbox_core::{NewRecord, Outbox};
use rand::RngExt;
use sqlx::PgPool;
use tokio::time::Instant;
use uuid::Uuid;

/// Stated bound: after the last fault, the backlog drains within this (lease 1 s + rounds 200 ms).
const DRAIN_BOUND: Duration = Duration::from_secs(20);
const KEYS: usize = 120;

struct Worker {
    name: String,
    child: Child,
}

impl Worker {
    fn start(url: &str, name: &str) -> Worker {
        let log = std::fs::File::create(std::env::temp_dir().join(format!("outbox-fault-{name}.log"))).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_outbox-test-worker"))
            .env("DATABASE_URL", url)
            .env("WORKER_NAME", name)
            .env("RUST_LOG", "info,sqlx=warn")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        Worker { name: name.into(), child }
    }

    fn signal(&self, signal: &str) {
        let status = Command::new("kill").args([signal, &self.child.id().to_string()]).status().unwrap();
        assert!(status.success(), "kill {signal} {}", self.name);
    }

    /// SIGTERM and wait for the graceful exit.
    async fn stop(mut self) {
        self.signal("-TERM");
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                assert!(status.success(), "{} exited with {status}", self.name);
                return;
            }
            assert!(Instant::now() < deadline, "{} did not stop gracefully", self.name);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn kill9(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }
}

/// The connection string of this test's own database.
async fn url_of(pool: &PgPool) -> String {
    let db: String = sqlx::query_scalar("SELECT current_database()").fetch_one(pool).await.unwrap();
    let base = std::env::var("DATABASE_URL").unwrap();
    let (server, _) = base.rsplit_once('/').unwrap();
    format!("{server}/{db}")
}

#[derive(Default)]
struct Produced {
    committed: Vec<(Uuid, String, i64)>,
    rolled_back: Vec<Uuid>,
}

/// Writes small transactions of random keys until `stop`; about one in ten is rolled back on purpose.
async fn produce(outbox: Outbox, pool: PgPool, stop: Arc<AtomicBool>) -> Produced {
    let mut produced = Produced::default();
    let mut n = 0u64;
    while !stop.load(Ordering::SeqCst) {
        let records: Vec<NewRecord> = (0..5)
            .map(|_| NewRecord::new(format!("key-{}", rand::rng().random_range(0..KEYS)), "t", format!("{n}")))
            .collect();
        n += 1;
        let mut tx = pool.begin().await.unwrap();
        let scheduled = outbox.schedule_batch(&mut tx, &records).await.unwrap();
        if n.is_multiple_of(10) {
            tx.rollback().await.unwrap();
            produced.rolled_back.extend(scheduled.iter().map(|s| s.id));
        } else {
            tx.commit().await.unwrap();
            produced.committed.extend(scheduled.iter().zip(&records).map(|(s, r)| (s.id, r.key.clone(), s.seq)));
        }
        tokio::time::sleep(Duration::from_millis(15)).await;
    }
    produced
}

async fn owners(pool: &PgPool) -> usize {
    count(pool, "SELECT count(DISTINCT owner) FROM outbox.partitions WHERE owner IS NOT NULL").await as usize
}

#[sqlx::test(migrations = false)]
async fn cluster_survives_scaling_crashes_pauses_and_killed_connections(pool: PgPool) {
    let outbox = outbox(&pool, |_| {}).await;
    sqlx::query(
        "CREATE TABLE fault_deliveries (id bigserial PRIMARY KEY, instance text NOT NULL, record_id uuid NOT NULL,
         key text NOT NULL, seq bigint NOT NULL, partition smallint NOT NULL, epoch bigint NOT NULL)",
    )
    .execute(&pool)
    .await
    .unwrap();
    let url = url_of(&pool).await;
    let stop = Arc::new(AtomicBool::new(false));
    let producer = tokio::spawn(produce(outbox.clone(), pool.clone(), stop.clone()));
    let step = Duration::from_millis(1500);
    let wait_owners = |n: usize| {
        let pool = pool.clone();
        async move { wait_for(&format!("{n} owners"), Duration::from_secs(30), || async { owners(&pool).await == n }).await }
    };

    let mut workers: BTreeMap<String, Worker> = BTreeMap::new();
    let mut start = |name: &str| {
        workers.insert(name.into(), Worker::start(&url, name));
    };
    // Scale 1 → 4 → 2 → 3.
    start("w1");
    wait_owners(1).await;
    start("w2");
    start("w3");
    start("w4");
    wait_owners(4).await;
    tokio::time::sleep(step).await;
    workers.remove("w2").unwrap().stop().await;
    workers.remove("w3").unwrap().stop().await;
    wait_owners(2).await;
    workers.insert("w5".into(), Worker::start(&url, "w5"));
    wait_owners(3).await;
    tokio::time::sleep(step).await;

    // kill -9 a worker, and replace it.
    workers.remove("w4").unwrap().kill9();
    workers.insert("w6".into(), Worker::start(&url, "w6"));
    tokio::time::sleep(step).await;

    // The zombie: paused for three stale timeouts; the others take its partitions; then it wakes.
    let paused = workers.get("w5").unwrap();
    paused.signal("-STOP");
    tokio::time::sleep(Duration::from_secs(3)).await;
    paused.signal("-CONT");
    tokio::time::sleep(step).await;

    // Kill a worker's database connections (its pool and heartbeat reconnect).
    let terminated = count(
        &pool,
        "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = 'outbox-w6') t",
    )
    .await;
    assert!(terminated > 0, "w6 had connections to terminate");
    tokio::time::sleep(step).await;

    // One more crash, of the oldest worker (the leader).
    workers.remove("w1").unwrap().kill9();
    tokio::time::sleep(step).await;

    stop.store(true, Ordering::SeqCst);
    let produced = producer.await.unwrap();
    let faults_over = Instant::now();
    drained(&pool, DRAIN_BOUND).await;
    eprintln!("drained {:?} after the last fault", faults_over.elapsed());
    for (_, worker) in std::mem::take(&mut workers) {
        worker.stop().await;
    }

    // The checker.
    assert!(produced.committed.len() > 500, "produced {}", produced.committed.len());
    let deliveries: Vec<(String, Uuid, String, i64, i16, i64)> =
        sqlx::query_as("SELECT instance, record_id, key, seq, partition, epoch FROM fault_deliveries ORDER BY id")
            .fetch_all(&pool)
            .await
            .unwrap();
    let delivered: BTreeSet<Uuid> = deliveries.iter().map(|d| d.1).collect();
    let missing: Vec<_> = produced.committed.iter().filter(|(id, _, _)| !delivered.contains(id)).collect();
    assert!(
        missing.is_empty(),
        "{} committed records never delivered: {:?}",
        missing.len(),
        &missing[..missing.len().min(5)]
    );
    let ghosts: Vec<_> = produced.rolled_back.iter().filter(|id| delivered.contains(id)).collect();
    assert!(ghosts.is_empty(), "rolled-back records delivered: {ghosts:?}");

    let mut expected: BTreeMap<&str, i64> = BTreeMap::new();
    for (_, key, seq) in &produced.committed {
        let last = expected.entry(key).or_insert(0);
        *last = (*last).max(*seq);
    }
    let mut firsts: BTreeMap<&str, Vec<i64>> = BTreeMap::new();
    let mut seen = BTreeSet::new();
    for (_, id, key, seq, _, _) in &deliveries {
        if seen.insert(*id) {
            firsts.entry(key).or_default().push(*seq);
        }
    }
    for (key, last) in &expected {
        assert_eq!(firsts[key], (1..=*last).collect::<Vec<_>>(), "{key}: first deliveries out of sequence");
    }

    let mut by_epoch: BTreeMap<(i16, i64), BTreeSet<&str>> = BTreeMap::new();
    for (instance, _, _, _, partition, epoch) in &deliveries {
        by_epoch.entry((*partition, *epoch)).or_default().insert(instance);
    }
    let shared: Vec<_> = by_epoch.iter().filter(|(_, instances)| instances.len() > 1).collect();
    assert!(shared.is_empty(), "(partition, epoch) delivered by two instances: {shared:?}");

    assert_eq!(failed_count(&pool).await, 0);
    assert_eq!(pending(&pool).await, 0);
    eprintln!(
        "committed {}, rolled back {}, deliveries {} ({} duplicates after crashes), epochs seen {}",
        produced.committed.len(),
        produced.rolled_back.len(),
        deliveries.len(),
        deliveries.len() - delivered.len(),
        by_epoch.len()
    );
}
