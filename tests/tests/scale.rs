//! The scale harness (ignored; run by hand): N clustered in-process nodes, each with its own pool,
//! heartbeat and `LISTEN` connections, at default intervals, against a PostgreSQL cluster it starts
//! itself. Per N it measures how long the cluster takes to balance after the nodes start, after one
//! joins, after one leaves gracefully and after a quarter are killed, and what an idle instance costs
//! the database (`pg_stat_statements`, split into fetches and cluster bookkeeping). Then it replaces
//! every node one by one, gracefully, under a steady produce load, and checks what users would feel:
//! nothing lost, each key in order, no two nodes inside one partition's handlers at once, no record
//! delivered twice; and it reports the longest wait from commit to delivery. Each run can add latency
//! each way between the nodes and the database (a TCP proxy), as between real pods and their database.
//!
//! ```sh
//! OUTBOX_SCALE_NODES=1,8,32,64 OUTBOX_SCALE_LATENCY_MS=0,2,10,50 ./scripts/test.sh -p outbox-tests --test scale -- --ignored --nocapture
//! ```
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use common::{Exclusive, Sink, wait_for};
use outbox_cluster::{ClusterConfig, Node};
use outbox_core::{
    ConnectOptions, Db, HandlerError, Handlers, InstanceId, NewRecord, Outbox, Record, Route, handler_fn,
};
use outbox_tests::postgres::PgCluster;
use outbox_tests::proxy::DelayProxy;
use rand::RngExt;
use sqlx::PgPool;
use tokio::time::Instant;

const PARTITIONS: usize = 256;
/// Connections in each node's pool (its heartbeat and `LISTEN` connections come on top).
const POOL: u32 = 4;
const LONG: Duration = Duration::from_secs(120);

fn sizes() -> Vec<usize> {
    let list = std::env::var("OUTBOX_SCALE_NODES").unwrap_or_else(|_| "1,8,32,64".into());
    list.split(',').map(|n| n.trim().parse().expect("OUTBOX_SCALE_NODES: a list of node counts")).collect()
}

/// Milliseconds added each way between the nodes and the database (a TCP proxy), one run per value.
fn latencies() -> Vec<u64> {
    let list = std::env::var("OUTBOX_SCALE_LATENCY_MS").unwrap_or_else(|_| "0".into());
    list.split(',').map(|ms| ms.trim().parse().expect("OUTBOX_SCALE_LATENCY_MS: a list of milliseconds")).collect()
}

fn idle_secs() -> u64 {
    std::env::var("OUTBOX_SCALE_IDLE_SECS").map_or(20, |s| s.parse().expect("OUTBOX_SCALE_IDLE_SECS: seconds"))
}

/// What the nodes' handlers saw: every delivery, and which node was inside which partition's handler.
#[derive(Clone, Default)]
struct Seen {
    sink: Arc<Sink>,
    exclusive: Arc<Exclusive>,
}

/// A node named `node-{number}`, its handler taking a millisecond (so that two nodes inside one
/// partition's handlers at once would overlap in time).
async fn start_node(url: &str, number: usize, seen: &Seen) -> Node {
    let db =
        Db::connect_with(url, &ConnectOptions { max_connections: POOL, ..ConnectOptions::default() }).await.unwrap();
    let name = format!("node-{number}");
    let (sink, exclusive, me) = (seen.sink.clone(), seen.exclusive.clone(), name.clone());
    let handlers = Handlers::new().default_route(Route::new(handler_fn(move |r: Record| {
        let (sink, exclusive, me) = (sink.clone(), exclusive.clone(), me.clone());
        async move {
            let _inside = exclusive.enter(&me, r.partition);
            tokio::time::sleep(Duration::from_millis(1)).await;
            sink.record(&r);
            Ok::<(), HandlerError>(())
        }
    })));
    let config = ClusterConfig { name, ..ClusterConfig::default() };
    Node::start(Outbox::new(outbox_core::Config::default()).unwrap(), db, handlers, config).await.unwrap()
}

async fn owners(admin: &PgPool) -> BTreeMap<i16, Option<InstanceId>> {
    let rows: Vec<(i16, Option<uuid::Uuid>)> =
        sqlx::query_as("SELECT partition, owner FROM outbox.partitions").fetch_all(admin).await.unwrap();
    rows.into_iter().map(|(p, owner)| (p, owner.map(InstanceId))).collect()
}

/// Every partition owned by one of `live`, each holding ⌊256/n⌋ or ⌈256/n⌉.
fn balanced(owners: &BTreeMap<i16, Option<InstanceId>>, live: &BTreeSet<InstanceId>) -> bool {
    let mut counts: BTreeMap<InstanceId, usize> = live.iter().map(|id| (*id, 0)).collect();
    for owner in owners.values() {
        match owner.and_then(|o| counts.get_mut(&o)) {
            Some(count) => *count += 1,
            None => return false,
        }
    }
    let (low, high) = (PARTITIONS / live.len(), PARTITIONS.div_ceil(live.len()));
    counts.values().all(|c| (low..=high).contains(c))
}

/// Seconds from `since` until the cluster is balanced over `nodes`.
async fn until_balanced(admin: &PgPool, nodes: &[Node], since: Instant) -> f64 {
    let live: BTreeSet<InstanceId> = nodes.iter().map(Node::id).collect();
    loop {
        if balanced(&owners(admin).await, &live) {
            return since.elapsed().as_secs_f64();
        }
        assert!(since.elapsed() < LONG, "{} nodes did not balance within {LONG:?}", nodes.len());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Statements per second of an idle cluster over `secs`, per instance: (all, fetches, bookkeeping).
async fn idle_load(admin: &PgPool, n: usize, secs: u64) -> (f64, f64, f64) {
    sqlx::query("SELECT pg_stat_statements_reset()").execute(admin).await.unwrap();
    tokio::time::sleep(Duration::from_secs(secs)).await;
    let rows: Vec<(String, i64)> = sqlx::query_as(
        "SELECT query, calls FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid
         WHERE d.datname = current_database()",
    )
    .fetch_all(admin)
    .await
    .unwrap();
    let (mut all, mut fetches, mut control) = (0, 0, 0);
    for (query, calls) in rows {
        // The harness's own statements: the reset and this read.
        if query.contains("pg_stat_statements") {
            continue;
        }
        all += calls;
        if query.contains("WITH served AS") {
            fetches += calls;
        }
        let head = query.trim_start().to_ascii_uppercase();
        if ["BEGIN", "COMMIT", "ROLLBACK", "SET LOCAL"].iter().any(|c| head.starts_with(c)) {
            control += calls;
        }
    }
    let per = |calls: i64| calls as f64 / secs as f64 / n as f64;
    (per(all), per(fetches), per(all - fetches - control))
}

/// Records committed at `RATE` per second, one per transaction over 10,000 keys, each woken after its
/// commit, until `stop`; when each was committed.
async fn produce(admin: PgPool, stop: tokio_util::sync::CancellationToken) -> HashMap<uuid::Uuid, Instant> {
    const RATE: u64 = 200;
    let outbox = Outbox::new(outbox_core::Config::default()).unwrap();
    let db = Db::from(admin);
    let mut committed = HashMap::new();
    let mut ticker = tokio::time::interval(Duration::from_micros(1_000_000 / RATE));
    while !stop.is_cancelled() {
        ticker.tick().await;
        let key = format!("key-{}", rand::rng().random_range(0..10_000));
        let mut tx = db.begin().await.unwrap();
        let scheduled = outbox.schedule(&mut tx, NewRecord::new(key, "t", "x")).await.unwrap();
        tx.commit().await.unwrap();
        committed.insert(scheduled.id, Instant::now());
        outbox.wake(&db, &[scheduled]).await.unwrap();
    }
    committed
}

/// Replaces each of `nodes` (start a new one, then stop the old one gracefully) under a steady produce
/// load; checks that nothing was lost, each key's records came in order and no partition was inside two
/// nodes' handlers at once. Returns (records, duplicate deliveries, longest commit → delivery in s).
async fn rolling_restart(
    url: &str,
    admin: &PgPool,
    nodes: &mut Vec<Node>,
    numbers: &mut usize,
    seen: &Seen,
) -> (usize, usize, f64) {
    let stop = tokio_util::sync::CancellationToken::new();
    let producer = tokio::spawn(produce(admin.clone(), stop.clone()));
    tokio::time::sleep(Duration::from_secs(1)).await;
    for _ in 0..nodes.len() {
        *numbers += 1;
        nodes.push(start_node(url, *numbers, seen).await);
        nodes.remove(0).shutdown().await.unwrap();
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop.cancel();
    let committed = producer.await.unwrap();
    wait_for("every record committed during the restart delivered", LONG, || async {
        let delivered: BTreeSet<uuid::Uuid> = seen.sink.all().iter().map(|d| d.id).collect();
        committed.keys().all(|id| delivered.contains(id))
    })
    .await;
    let deliveries = seen.sink.all();
    let mut first: HashMap<uuid::Uuid, Instant> = HashMap::new();
    let mut keys: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for d in &deliveries {
        if committed.contains_key(&d.id) && !first.contains_key(&d.id) {
            first.insert(d.id, d.at);
            keys.entry(d.key.clone()).or_default().push(d.seq);
        }
    }
    for (key, seqs) in &keys {
        assert!(seqs.is_sorted(), "key {key} delivered out of order: {seqs:?}");
    }
    assert_eq!(*seen.exclusive.violations.lock().unwrap(), Vec::<String>::new(), "two nodes inside one partition");
    let longest = committed.iter().map(|(id, at)| first[id].saturating_duration_since(*at)).max().unwrap_or_default();
    let duplicates = deliveries.iter().filter(|d| committed.contains_key(&d.id)).count() - committed.len();
    (committed.len(), duplicates, longest.as_secs_f64())
}

#[tokio::test(flavor = "multi_thread")]
#[ignore = "the scale harness: minutes per size; run by hand (see the module docs)"]
async fn scale() {
    let sizes = sizes();
    let most = sizes.iter().max().copied().unwrap_or(1) + 1;
    // Per node: its pool, a heartbeat and a LISTEN connection; and room for the harness.
    let max_connections = (most * (POOL as usize + 2) + 20).to_string();
    let cluster = PgCluster::start(&[
        ("max_connections", &max_connections),
        ("shared_preload_libraries", "pg_stat_statements"),
        ("pg_stat_statements.track", "all"),
    ]);
    println!(
        "latency each way | nodes | start → balanced | join → balanced | leave → balanced | kill a quarter → balanced | idle statements/s per instance (fetches, bookkeeping) | connections | rolling restart at 200 records/s: records, duplicates, longest commit → delivery"
    );
    for latency_ms in latencies() {
        for &n in &sizes {
            measure(&cluster, latency_ms, n).await;
        }
    }
}

/// One row of the table: `n` nodes, `latency_ms` each way between them and the database.
async fn measure(cluster: &PgCluster, latency_ms: u64, n: usize) {
    let database = format!("scale_{latency_ms}ms_{n}");
    cluster.create_database(&database).await;
    let admin = PgPool::connect(&cluster.url(&database)).await.unwrap();
    // The nodes reach the database through the proxy; the harness and the producer directly.
    let proxy = DelayProxy::start(cluster.port, Duration::from_millis(latency_ms)).await;
    let url = format!("postgres://postgres@127.0.0.1:{}/{database}", proxy.port);
    sqlx::query("CREATE EXTENSION pg_stat_statements").execute(&admin).await.unwrap();
    Outbox::new(outbox_core::Config::default()).unwrap().migrate(&Db::from(&admin)).await.unwrap();

    let seen = Seen::default();
    let mut numbers = 0;
    let mut nodes = Vec::new();
    while numbers < n {
        numbers += 1;
        nodes.push(start_node(&url, numbers, &seen).await);
    }
    let start = until_balanced(&admin, &nodes, Instant::now()).await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    let (all, fetches, bookkeeping) = idle_load(&admin, n, idle_secs()).await;
    let connections: (i64,) =
        sqlx::query_as("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()")
            .fetch_one(&admin)
            .await
            .unwrap();

    let joined = Instant::now();
    numbers += 1;
    nodes.push(start_node(&url, numbers, &seen).await);
    let join = until_balanced(&admin, &nodes, joined).await;

    let leaving = nodes.remove(0);
    let left = Instant::now();
    let shutdown = tokio::spawn(leaving.shutdown());
    let leave = until_balanced(&admin, &nodes, left).await;
    shutdown.await.unwrap().unwrap();

    let killed = if nodes.len() > 1 { nodes.len().div_ceil(4) } else { 0 };
    let crash = if killed > 0 {
        let crashed = Instant::now();
        for node in nodes.drain(..killed) {
            node.kill();
        }
        format!("{:.1} s ({killed} killed)", until_balanced(&admin, &nodes, crashed).await)
    } else {
        "-".into()
    };
    // Back to n nodes, balanced, before the rolling restart.
    while nodes.len() < n {
        numbers += 1;
        nodes.push(start_node(&url, numbers, &seen).await);
    }
    until_balanced(&admin, &nodes, Instant::now()).await;
    let (records, duplicates, longest) = rolling_restart(&url, &admin, &mut nodes, &mut numbers, &seen).await;
    println!(
        "{latency_ms} ms | {n} | {start:.1} s | {join:.1} s | {leave:.1} s | {crash} | {all:.2} ({fetches:.2}, {bookkeeping:.2}) | {} | {records}, {duplicates}, {longest:.1} s",
        connections.0 - 1
    );
    assert_eq!(duplicates, 0, "a graceful rolling restart delivers nothing twice");
    for node in nodes {
        node.shutdown().await.unwrap();
    }
    admin.close().await;
}
