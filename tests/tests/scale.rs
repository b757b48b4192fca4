//! The scale harness (ignored; run by hand): N clustered in-process nodes, each with its own pool,
//! heartbeat and `LISTEN` connections, at default intervals, against a PostgreSQL cluster it starts
//! itself. Per N it measures:
//! - how long the cluster takes to balance after the nodes start, after one joins, after one leaves
//!   gracefully and after a quarter are killed;
//! - what an instance costs the database idle and under a produce load (`OUTBOX_SCALE_RATE` records/s,
//!   one per transaction): statements (`pg_stat_statements`: fetches, cluster bookkeeping, what only the
//!   leader runs) and the database's time executing them;
//! - the heartbeats' round trips and the ownership rounds' durations (the library's own histograms);
//! - a rolling restart: every node replaced one by one, gracefully, under 200 records/s, checking what
//!   users would feel (nothing lost, each key in order, no two nodes inside one partition's handlers at
//!   once, no record delivered twice) and reporting the wait from commit to delivery.
//!
//! Each run can add latency each way between the nodes and the database (a TCP proxy), as between real
//! pods and their database. `RUST_LOG` shows the nodes' logs. `OUTBOX_SCALE_PROCESSES=K` adds, per
//! latency, a spot check with K separate worker processes (balance after start, join, leave, crash).
//!
//! ```sh
//! OUTBOX_SCALE_NODES=1,8,32,64 OUTBOX_SCALE_LATENCY_MS=0,2,10,50 ./scripts/test.sh -p outbox-tests --test scale -- --ignored --nocapture
//! ```
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use common::recorded::Recorded;
use common::{Exclusive, Sink, wait_for};
use metrics_util::debugging::{DebuggingRecorder, Snapshotter};
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
    // Empty: no in-process runs (for the process spot check alone).
    let sizes = list.split(',').filter(|n| !n.trim().is_empty());
    sizes.map(|n| n.trim().parse().expect("OUTBOX_SCALE_NODES: a list of node counts")).collect()
}

/// Milliseconds added each way between the nodes and the database (a TCP proxy), one run per value.
fn latencies() -> Vec<u64> {
    let list = std::env::var("OUTBOX_SCALE_LATENCY_MS").unwrap_or_else(|_| "0".into());
    list.split(',').map(|ms| ms.trim().parse().expect("OUTBOX_SCALE_LATENCY_MS: a list of milliseconds")).collect()
}

/// How long the idle and the loaded windows last.
fn idle_secs() -> u64 {
    std::env::var("OUTBOX_SCALE_IDLE_SECS").map_or(20, |s| s.parse().expect("OUTBOX_SCALE_IDLE_SECS: seconds"))
}

/// Records per second of the loaded window.
fn load_rate() -> u64 {
    std::env::var("OUTBOX_SCALE_RATE").map_or(1000, |s| s.parse().expect("OUTBOX_SCALE_RATE: records per second"))
}

/// What the nodes' handlers saw: every delivery, and which node was inside which partition's handler.
#[derive(Clone, Default)]
struct Seen {
    sink: Arc<Sink>,
    exclusive: Arc<Exclusive>,
}

impl Seen {
    /// Waits until every record of `committed` was delivered.
    async fn delivered(&self, what: &str, committed: &HashMap<uuid::Uuid, Instant>) {
        wait_for(&format!("{what} delivered"), LONG, || async {
            let delivered: BTreeSet<uuid::Uuid> = self.sink.all().iter().map(|d| d.id).collect();
            committed.keys().all(|id| delivered.contains(id))
        })
        .await;
    }
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

/// What a statement seen by `pg_stat_statements` was for, by its text.
#[derive(PartialEq)]
enum Kind {
    Fetch,
    /// Heartbeats and ownership rounds; `leader`: statements only the leader runs (targets, reaping).
    Cluster {
        leader: bool,
    },
    /// The harness's producer: its inserts and its wake-ups.
    Producer,
    /// Anything else: the processors' completions, and transaction control (the producer's too).
    Other,
}

fn kind(query: &str) -> Kind {
    let q = query.trim_start();
    if q.starts_with("WITH served AS") {
        Kind::Fetch
    } else if q.contains("SET target_owner") || q.starts_with(r#"DELETE FROM "outbox".instances WHERE expires_at"#) {
        Kind::Cluster { leader: true }
    } else if q.contains(r#""outbox".instances"#)
        || [
            "SELECT partition, owner, epoch, target_owner",
            "WITH taken AS",
            r#"UPDATE "outbox".partitions p SET owner"#,
        ]
        .iter()
        .any(|c| q.starts_with(c))
    {
        Kind::Cluster { leader: false }
    } else if q.starts_with("WITH locked AS") || q.contains("pg_notify") {
        Kind::Producer
    } else {
        Kind::Other
    }
}

/// The nodes' statements per second over a window, per instance (and the leader's own in total), and
/// the milliseconds per second the database spent executing them, per instance.
struct Load {
    all: f64,
    fetches: f64,
    cluster: f64,
    leader: f64,
    busy_ms: f64,
    /// Records per second the harness's producer committed.
    produced: f64,
}

/// The nodes' statements over the next `secs`: everything but the harness's own reads and its
/// producer's statements (each of its records costs a `BEGIN` and a `COMMIT` besides).
async fn load(admin: &PgPool, n: usize, secs: u64) -> Load {
    sqlx::query("SELECT pg_stat_statements_reset()").execute(admin).await.unwrap();
    tokio::time::sleep(Duration::from_secs(secs)).await;
    let rows: Vec<(String, i64, f64)> = sqlx::query_as(
        "SELECT query, calls, total_exec_time FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid
         WHERE d.datname = current_database() AND query NOT LIKE '%pg_stat_statements%'",
    )
    .fetch_all(admin)
    .await
    .unwrap();
    let (mut all, mut fetches, mut cluster, mut leader, mut produced, mut busy_ms) = (0, 0, 0, 0, 0, 0.0);
    for (query, calls, ms) in rows {
        match kind(&query) {
            Kind::Producer => {
                if query.trim_start().starts_with("WITH locked AS") {
                    produced += calls;
                }
                continue;
            }
            Kind::Fetch => fetches += calls,
            Kind::Cluster { leader: only } => {
                cluster += calls;
                if only {
                    leader += calls;
                }
            }
            Kind::Other => {}
        }
        all += calls;
        busy_ms += ms;
    }
    let per = |calls: i64| calls as f64 / secs as f64 / n as f64;
    Load {
        all: per(all - 2 * produced),
        fetches: per(fetches),
        cluster: per(cluster),
        leader: leader as f64 / secs as f64,
        busy_ms: busy_ms / secs as f64 / n as f64,
        produced: produced as f64 / secs as f64,
    }
}

/// "p50 / p99 / max" in milliseconds, or "–" when nothing was recorded.
fn quantiles(values: &[f64]) -> String {
    let at = |q: f64| values[((values.len() - 1) as f64 * q).round() as usize] * 1000.0;
    if values.is_empty() {
        return "–".into();
    }
    format!("{:.1} / {:.1} / {:.1} ms", at(0.5), at(0.99), at(1.0))
}

/// Records committed at `rate` per second, one per transaction over 10,000 keys, each woken after its
/// commit, until `stop`; when each was committed.
async fn produce(admin: PgPool, rate: u64, stop: tokio_util::sync::CancellationToken) -> HashMap<uuid::Uuid, Instant> {
    let outbox = Outbox::new(outbox_core::Config::default()).unwrap();
    let db = Db::from(admin);
    let mut committed = HashMap::new();
    let mut ticker = tokio::time::interval(Duration::from_micros(1_000_000 / rate));
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
/// nodes' handlers at once. Returns (records, duplicate deliveries, each record's commit → delivery, each
/// graceful shutdown's duration), in seconds, sorted.
async fn rolling_restart(
    url: &str,
    admin: &PgPool,
    nodes: &mut Vec<Node>,
    numbers: &mut usize,
    seen: &Seen,
) -> (usize, usize, Vec<f64>, Vec<f64>) {
    let stop = tokio_util::sync::CancellationToken::new();
    let producer = tokio::spawn(produce(admin.clone(), 200, stop.clone()));
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut shutdowns = Vec::new();
    for _ in 0..nodes.len() {
        *numbers += 1;
        nodes.push(start_node(url, *numbers, seen).await);
        let began = Instant::now();
        nodes.remove(0).shutdown().await.unwrap();
        shutdowns.push(began.elapsed().as_secs_f64());
    }
    shutdowns.sort_by(f64::total_cmp);
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop.cancel();
    let committed = producer.await.unwrap();
    seen.delivered("every record committed during the restart", &committed).await;
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
    let mut waits: Vec<f64> =
        committed.iter().map(|(id, at)| first[id].saturating_duration_since(*at).as_secs_f64()).collect();
    waits.sort_by(f64::total_cmp);
    let duplicates = deliveries.iter().filter(|d| committed.contains_key(&d.id)).count() - committed.len();
    (committed.len(), duplicates, waits, shutdowns)
}

#[tokio::test(flavor = "multi_thread")]
#[ignore = "the scale harness: minutes per size; run by hand (see the module docs)"]
async fn scale() {
    common::logs();
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    recorder.install().unwrap();
    let sizes = sizes();
    let most = sizes.iter().max().copied().unwrap_or(1) + 1;
    // Per node: its pool, a heartbeat, a LISTEN and a fetch connection; per worker process the same with
    // the default pool of `Db::connect`; and room for the harness.
    let per_process = outbox_core::ConnectOptions::default().max_connections as usize + 3;
    let spot = processes().map_or(0, |k| (k + 1) * per_process);
    let max_connections = (most * (POOL as usize + 3) + spot + 20).to_string();
    let cluster = PgCluster::start(&[
        ("max_connections", &max_connections),
        ("shared_preload_libraries", "pg_stat_statements"),
        ("pg_stat_statements.track", "all"),
    ]);
    for latency_ms in latencies() {
        for &n in &sizes {
            measure(&cluster, &snapshotter, latency_ms, n).await;
        }
        if let Some(k) = processes() {
            spot_check_processes(&cluster, latency_ms, k).await;
        }
    }
}

/// Seconds from `since` until `expected` instances are live (and not draining) and balanced.
async fn processes_balanced(admin: &PgPool, expected: usize, since: Instant) -> f64 {
    loop {
        let ids: Vec<(uuid::Uuid,)> =
            sqlx::query_as("SELECT id FROM outbox.instances WHERE expires_at > now() AND NOT draining")
                .fetch_all(admin)
                .await
                .unwrap();
        let ids: BTreeSet<InstanceId> = ids.into_iter().map(|(id,)| InstanceId(id)).collect();
        if ids.len() == expected && balanced(&owners(admin).await, &ids) {
            return since.elapsed().as_secs_f64();
        }
        assert!(since.elapsed() < LONG, "{expected} processes did not balance within {LONG:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Worker processes for the spot check (`OUTBOX_SCALE_PROCESSES`), if asked for.
fn processes() -> Option<usize> {
    std::env::var("OUTBOX_SCALE_PROCESSES").ok().map(|k| k.parse().expect("OUTBOX_SCALE_PROCESSES: a count"))
}

/// The spot check with separate processes: `k` worker processes (`outbox-test-worker`, default
/// intervals), each with its own pools and `LISTEN` connection; how long the cluster takes to balance
/// after they start, after one more joins, after one leaves (SIGTERM) and after a quarter are killed
/// (SIGKILL). Balance is read from the database: the live instances and who owns each partition. Their
/// logs: `outbox-scale-process-*.log` in the temporary directory.
async fn spot_check_processes(cluster: &PgCluster, latency_ms: u64, k: usize) {
    let database = format!("scale_{latency_ms}ms_{k}_processes");
    cluster.create_database(&database).await;
    let admin = PgPool::connect(&cluster.url(&database)).await.unwrap();
    let proxy = DelayProxy::start(cluster.port, Duration::from_millis(latency_ms)).await;
    let url = format!("postgres://postgres@127.0.0.1:{}/{database}", proxy.port);
    Outbox::new(outbox_core::Config::default()).unwrap().migrate(&Db::from(&admin)).await.unwrap();
    let start = |number: usize| {
        let name = format!("process-{number}");
        // Kept after the run, to read when a process misbehaves.
        let log = std::fs::File::create(std::env::temp_dir().join(format!("outbox-scale-{name}.log"))).unwrap();
        let child = std::process::Command::new(env!("CARGO_BIN_EXE_outbox-test-worker"))
            .envs([("DATABASE_URL", url.as_str()), ("WORKER_NAME", name.as_str())])
            .envs([("HEARTBEAT", "2s"), ("STALE", "10s"), ("REBALANCE", "2s"), ("POLL", "100ms")])
            .stdout(std::process::Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        outbox_tests::process::Process(child)
    };
    let began = Instant::now();
    let mut workers: Vec<_> = (1..=k).map(start).collect();
    let started = processes_balanced(&admin, k, began).await;
    let joined = Instant::now();
    workers.push(start(k + 1));
    let join = processes_balanced(&admin, k + 1, joined).await;
    let left = Instant::now();
    let leaving = workers.remove(0);
    std::process::Command::new("kill").args(["-TERM", &leaving.0.id().to_string()]).status().unwrap();
    let leave = processes_balanced(&admin, k, left).await;
    let killed = k.div_ceil(4);
    let crashed = Instant::now();
    workers.drain(..killed);
    let crash = processes_balanced(&admin, k - killed, crashed).await;
    println!(
        "\n## {k} worker processes, {latency_ms} ms each way\n\
         - balanced after: start {started:.1} s (processes starting included), one joining {join:.1} s, one leaving {leave:.1} s, a quarter killed {crash:.1} s ({killed} killed)"
    );
    drop(workers);
    drop(leaving);
    admin.close().await;
}

/// One run: `n` nodes, `latency_ms` each way between them and the database; prints what it measured.
async fn measure(cluster: &PgCluster, snapshotter: &Snapshotter, latency_ms: u64, n: usize) {
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
    let _ = snapshotter.snapshot();
    let idle = load(&admin, n, idle_secs()).await;
    let idle_metrics = Recorded::take(snapshotter);
    let heartbeats = idle_metrics.histogram("outbox_heartbeat_seconds", &[]);
    let leader_rounds = idle_metrics.histogram("outbox_ownership_round_seconds", &[("leader", "true")]);
    let other_rounds = idle_metrics.histogram("outbox_ownership_round_seconds", &[("leader", "false")]);
    let connections: (i64,) =
        sqlx::query_as("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()")
            .fetch_one(&admin)
            .await
            .unwrap();

    let stop = tokio_util::sync::CancellationToken::new();
    let producer = tokio::spawn(produce(admin.clone(), load_rate(), stop.clone()));
    tokio::time::sleep(Duration::from_secs(3)).await;
    let _ = snapshotter.snapshot();
    let loaded = load(&admin, n, idle_secs()).await;
    let loaded_heartbeats = Recorded::take(snapshotter).histogram("outbox_heartbeat_seconds", &[]);
    stop.cancel();
    let committed = producer.await.unwrap();
    seen.delivered("the loaded window's records", &committed).await;

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
        "–".into()
    };
    // Back to n nodes, balanced, before the rolling restart.
    while nodes.len() < n {
        numbers += 1;
        nodes.push(start_node(&url, numbers, &seen).await);
    }
    until_balanced(&admin, &nodes, Instant::now()).await;
    // Partitions taken from the killed nodes are delivered only after their quiet period: wait for it,
    // so that it does not count as the restart's.
    wait_for("every partition handed to a processor", LONG, || async {
        nodes.iter().map(|node| node.assignment().borrow().epochs.len()).sum::<usize>() == PARTITIONS
    })
    .await;
    let _ = snapshotter.snapshot();
    let (records, duplicates, waits, shutdowns) = rolling_restart(&url, &admin, &mut nodes, &mut numbers, &seen).await;
    let restart_heartbeats = Recorded::take(snapshotter).histogram("outbox_heartbeat_seconds", &[]);
    println!(
        "\n## {n} nodes, {latency_ms} ms each way\n\
         - balanced after: start {start:.1} s, one joining {join:.1} s, one leaving {leave:.1} s, a quarter killed {crash}\n\
         - idle, statements/s per instance: {:.2} (fetches {:.2}, cluster {:.2}), executing {:.3} ms/s; the leader's own (targets, reaping): {:.2}/s\n\
         - {:.0} records/s (one per transaction), statements/s per instance: {:.2} (fetches {:.2}, cluster {:.2}), executing {:.2} ms/s; {:.0} statements/s in all\n\
         - heartbeat round trip p50 / p99 / max: idle {}, loaded {}, rolling restart {}\n\
         - ownership round p50 / p99 / max: the leader's {}, the others' {}\n\
         - connections: {}\n\
         - rolling restart at 200 records/s: {records} records, {duplicates} duplicates, commit → delivery p50 / p99 / max {}; each shutdown {}",
        idle.all,
        idle.fetches,
        idle.cluster,
        idle.busy_ms,
        idle.leader,
        loaded.produced,
        loaded.all,
        loaded.fetches,
        loaded.cluster,
        loaded.busy_ms,
        loaded.all * n as f64,
        quantiles(&heartbeats),
        quantiles(&loaded_heartbeats),
        quantiles(&restart_heartbeats),
        quantiles(&leader_rounds),
        quantiles(&other_rounds),
        connections.0 - 1,
        quantiles(&waits),
        quantiles(&shutdowns),
    );
    assert_eq!(duplicates, 0, "a graceful rolling restart delivers nothing twice");
    for node in nodes {
        node.shutdown().await.unwrap();
    }
    admin.close().await;
}
