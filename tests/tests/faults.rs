//! Multi-process fault test: real worker processes (`outbox-test-worker`) against the real PostgreSQL,
//! the real MariaDB and one SQLite file they all share, scaled 1 → 4 → 2 → 3 while a producer writes
//! (and sometimes rolls back), with kill -9, SIGSTOP pauses in every timing window (shorter than the
//! lease, between "another instance took over" and "the instance row was reaped", longer than the
//! reap), and (on the database servers) killed database connections. A checker then reads the
//! database and the workers' handler-call log and asserts the invariants, including exclusivity: no two
//! handler calls for one key overlap in time, except a call that was already running when its process
//! was stopped.
//!
//! CI runs one round of faults (about 20 s). The soak is the same test with more rounds:
//! `OUTBOX_FAULT_ROUNDS=20 ./scripts/test.sh -p outbox-tests --test faults -- --nocapture`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[macro_use]
mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::*;
use outbox_core::{NewRecord, Outbox};
use outbox_tests::calls::Call;
use outbox_tests::process::Process;
use outbox_tests::wall_micros;
use rand::RngExt;
use sqlx::PgPool;
use tokio::time::Instant;
use uuid::Uuid;

every_backend!(cluster_survives_scaling_crashes_pauses_and_killed_connections);
every_backend!(a_record_whose_handler_ends_the_process_fails_after_its_retries);

/// Taken by each scenario for its whole run: two at once put eight worker processes and two producers on
/// a machine of two cores, and four SQLite workers so starved drained in 26-33 s after the last crash
/// (BENCHMARKS.md, "SQLite clusters under CPU overload"), past `DRAIN_BOUND`, where one scenario alone
/// drains in a few seconds.
static ONE_SCENARIO_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// SIGSTOP durations, one per timing window of the workers' tunables (heartbeat 200 ms, stale timeout
/// 1 s, so a 600 ms lease): shorter than the lease; past the takeover by another instance (the lease,
/// then a round or two, then a 400 ms quiet period: about 1-1.4 s after the last heartbeat) but before
/// the instance row is reaped (two stale timeouts after the lease: 2.6 s); past the reap.
const PAUSES: [Duration; 3] = [Duration::from_millis(300), Duration::from_millis(1500), Duration::from_millis(3000)];

/// Stated bound: after the last crash, the backlog drains within this (failover needs the 1 s lease
/// plus a 200 ms round; the rest is margin for a loaded machine).
const DRAIN_BOUND: Duration = Duration::from_secs(20);
const KEYS: usize = 120;
/// Records per key committed just before each pause.
const BURST: usize = 20;

struct Worker {
    name: String,
    child: Process,
}

impl Worker {
    /// Starts a worker on `url` logging its handler calls to `<name>.calls` in `calls`; its own log goes
    /// to `outbox-fault-<backend>-<name>.log` in the temporary directory.
    fn start(db: &TestDb, url: &str, name: &str, calls: &std::path::Path) -> Worker {
        Self::start_with(db, url, name, calls, &[])
    }

    /// The same, with more environment variables (see `outbox-test-worker`).
    fn start_with(db: &TestDb, url: &str, name: &str, calls: &std::path::Path, env: &[(&str, &str)]) -> Worker {
        let backend = db.db.backend();
        let path = std::env::temp_dir().join(format!("outbox-fault-{backend}-{name}.log"));
        let log = std::fs::File::create(path).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_outbox-test-worker"))
            .envs(env.iter().copied())
            .env("DATABASE_URL", url)
            .env("WORKER_NAME", name)
            .env("TOKIO_WORKER_THREADS", WORKER_THREADS.to_string())
            .env("PGAPPNAME", format!("outbox-{name}"))
            .env("CALL_LOG", calls.join(format!("{name}.calls")))
            .env("RUST_LOG", "info,sqlx=warn")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        Worker { name: name.into(), child: Process(child) }
    }

    fn signal(&self, signal: &str) {
        let status = Command::new("kill").args([signal, &self.child.0.id().to_string()]).status().unwrap();
        assert!(status.success(), "kill {signal} {}", self.name);
    }

    /// SIGTERM and wait for the graceful exit.
    async fn stop(self) {
        self.signal("-TERM");
        self.stop_wait().await;
    }

    /// Waits for a signalled graceful exit, which must succeed.
    async fn stop_wait(mut self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = self.child.0.try_wait().unwrap() {
                assert!(status.success(), "{} exited with {status}", self.name);
                return;
            }
            assert!(Instant::now() < deadline, "{} did not stop gracefully", self.name);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// SIGSTOP for `duration`, then SIGCONT. The pause is stamped once every thread of the process shows
    /// as stopped in `/proc` (`kill` returns before a thread running on another core has stopped), so a
    /// call that started earlier may have been running when it stopped.
    async fn pause(&self, duration: Duration) -> Pause {
        self.signal("-STOP");
        let tasks = format!("/proc/{}/task", self.child.0.id());
        let stopped = || {
            std::fs::read_dir(&tasks).unwrap().all(|task| {
                let stat = std::fs::read_to_string(task.unwrap().path().join("stat")).unwrap_or_default();
                // The state follows the command name, which is in parentheses.
                stat.rsplit_once(") ").is_some_and(|(_, rest)| rest.starts_with('T'))
            })
        };
        while !stopped() {
            tokio::time::sleep(Duration::from_micros(100)).await;
        }
        let stopped_us = wall_micros();
        tokio::time::sleep(duration).await;
        self.signal("-CONT");
        Pause { worker: self.name.clone(), stopped_us, duration }
    }

    fn kill9(mut self) {
        self.child.0.kill().unwrap();
        self.child.0.wait().unwrap();
    }
}

/// A worker process was stopped between these wall-clock times (µs).
#[derive(Debug)]
struct Pause {
    worker: String,
    stopped_us: i64,
    duration: Duration,
}

/// The threads of a worker's runtime (`TOKIO_WORKER_THREADS`), each of which may be stopped between a
/// call's grant and its start.
const WORKER_THREADS: usize = 2;

/// Pairs of handler calls for one key that overlap in time. A call that was running when its process
/// was stopped is exempt (nothing can stop it), and so is one whose grant was checked before the stop
/// and which started after it: a thread stopped between the processor's check and the handler's first
/// instruction starts the call on resuming, its lease gone meanwhile. Nothing tells those from calls
/// the processor started after the resume, so the first `WORKER_THREADS` calls a worker starts after
/// each resume are taken as such (the check refuses any later call under a lapsed lease, and a pause
/// past the lease catches more keys than that in flight). Every other call must have the key to itself.
fn overlapping_calls(calls: &[Call], pauses: &[Pause]) -> Vec<String> {
    let running_when_stopped = |c: &Call| {
        pauses.iter().any(|p| p.worker == c.instance && c.started_us <= p.stopped_us && c.ended_us >= p.stopped_us)
    };
    let mut granted_before_stop = BTreeSet::new();
    for pause in pauses {
        let mut after: Vec<&Call> =
            calls.iter().filter(|c| c.instance == pause.worker && c.started_us > pause.stopped_us).collect();
        after.sort_by_key(|c| c.started_us);
        granted_before_stop.extend(after.iter().take(WORKER_THREADS).map(|c| (c.record_id, c.started_us)));
    }
    let exempt = |c: &Call| running_when_stopped(c) || granted_before_stop.contains(&(c.record_id, c.started_us));
    let mut by_key: BTreeMap<&str, Vec<&Call>> = BTreeMap::new();
    for call in calls {
        by_key.entry(&call.key).or_default().push(call);
    }
    let mut violations = Vec::new();
    for (key, mut calls) in by_key {
        calls.sort_by_key(|c| c.started_us);
        for (i, a) in calls.iter().enumerate() {
            for b in calls[i + 1..].iter().take_while(|b| b.started_us < a.ended_us) {
                if !exempt(a) && !exempt(b) {
                    violations.push(format!(
                        "{key}: {} seq {} epoch {} [{}, {}] and {} seq {} epoch {} [{}, {}]",
                        a.instance,
                        a.seq,
                        a.epoch,
                        a.started_us,
                        a.ended_us,
                        b.instance,
                        b.seq,
                        b.epoch,
                        b.started_us,
                        b.ended_us
                    ));
                }
            }
        }
    }
    violations
}

#[derive(Default)]
struct Produced {
    committed: Vec<(Uuid, String, i64)>,
    rolled_back: Vec<Uuid>,
}

/// Writes small transactions of random keys until `stop`; about one in ten is rolled back on purpose.
async fn produce(outbox: Outbox, db: TestDb, stop: Arc<AtomicBool>) -> Produced {
    let mut produced = Produced::default();
    let mut n = 0u64;
    while !stop.load(Ordering::SeqCst) {
        let records: Vec<NewRecord> = (0..5)
            .map(|_| NewRecord::new(format!("key-{}", rand::rng().random_range(0..KEYS)), "t", format!("{n}")))
            .collect();
        n += 1;
        let mut tx = db.begin().await;
        let scheduled = match outbox.schedule_batch(&mut tx, &records).await {
            Ok(scheduled) => scheduled,
            // InnoDB may choose the transaction as a deadlock victim and roll it back: nothing of it
            // was committed, and an application runs it again (here: the next batch).
            Err(e) if e.is_transient() => {
                drop(tx);
                continue;
            }
            Err(e) => panic!("schedule failed: {e}"),
        };
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

/// Commits `BURST` records for every key in one transaction; returns them as (id, key, seq).
async fn burst(outbox: &Outbox, db: &TestDb) -> Vec<(Uuid, String, i64)> {
    let records: Vec<NewRecord> =
        (0..BURST).flat_map(|_| (0..KEYS).map(|k| NewRecord::new(format!("key-{k}"), "t", "burst"))).collect();
    loop {
        let mut tx = db.begin().await;
        match outbox.schedule_batch(&mut tx, &records).await {
            Ok(scheduled) => {
                tx.commit().await.unwrap();
                return scheduled.iter().zip(&records).map(|(s, r)| (s.id, r.key.clone(), s.seq)).collect();
            }
            // A deadlock victim (InnoDB) was rolled back whole: run it again.
            Err(e) if e.is_transient() => drop(tx),
            Err(e) => panic!("schedule failed: {e}"),
        }
    }
}

async fn owners(db: &TestDb) -> usize {
    count(db, "SELECT count(DISTINCT owner) FROM {s}partitions WHERE owner IS NOT NULL").await as usize
}

async fn cluster_survives_scaling_crashes_pauses_and_killed_connections(db: TestDb) {
    let _alone = ONE_SCENARIO_AT_A_TIME.lock().await;
    let outbox = outbox(&db, |_| {}).await;
    let calls = tempfile::tempdir().unwrap();
    let url = db.url().await;
    let stop = Arc::new(AtomicBool::new(false));
    let producer = tokio::spawn(produce(outbox.clone(), db.clone(), stop.clone()));
    let step = Duration::from_millis(1500);
    let wait_owners = |n: usize| {
        let db = db.clone();
        async move { wait_for(&format!("{n} owners"), Duration::from_secs(30), || async { owners(&db).await == n }).await }
    };

    let mut workers: BTreeMap<String, Worker> = BTreeMap::new();
    let mut started = 0;
    let mut spawn = |workers: &mut BTreeMap<String, Worker>| {
        started += 1;
        let name = format!("w{started}");
        workers.insert(name.clone(), Worker::start(&db, &url, &name, calls.path()));
    };
    let pick = |workers: &BTreeMap<String, Worker>| {
        let names: Vec<String> = workers.keys().cloned().collect();
        names[rand::rng().random_range(0..names.len())].clone()
    };

    // Scale 1 → 4 → 2 → 3.
    spawn(&mut workers);
    wait_owners(1).await;
    for _ in 0..3 {
        spawn(&mut workers);
    }
    wait_owners(4).await;
    tokio::time::sleep(step).await;
    for _ in 0..2 {
        let name = pick(&workers);
        workers.remove(&name).unwrap().stop().await;
    }
    wait_owners(2).await;
    spawn(&mut workers);
    wait_owners(3).await;
    tokio::time::sleep(step).await;

    let rounds: usize = std::env::var("OUTBOX_FAULT_ROUNDS").map_or(1, |r| r.parse().unwrap());
    let (mut pauses, mut bursts) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        // kill -9 a worker, and replace it.
        let name = pick(&workers);
        workers.remove(&name).unwrap().kill9();
        spawn(&mut workers);
        tokio::time::sleep(step).await;

        // Zombies: a worker paused in each timing window; for the longer pauses the others take its
        // partitions while it sleeps; then it wakes up in the middle of its deliveries.
        // A burst first, so every key has a run of records in flight when the worker stops.
        for duration in PAUSES {
            bursts.extend(burst(&outbox, &db).await);
            tokio::time::sleep(Duration::from_millis(100)).await;
            pauses.push(workers[&pick(&workers)].pause(duration).await);
            tokio::time::sleep(step).await;
        }

        // Kill a worker's database connections (its pool and heartbeat reconnect); SQLite runs inside
        // each process, so it has no server connections to kill.
        let victim = pick(&workers);
        let pid = workers[&victim].child.0.id();
        if let Some(terminated) = db.terminate_connections(&format!("outbox-{victim}"), pid).await {
            assert!(terminated > 0, "{victim} had connections to terminate");
        }
        tokio::time::sleep(step).await;

        // Scale out and in between 2 and 4 instances.
        if round % 2 == 0 && workers.len() < 4 {
            spawn(&mut workers);
        } else if workers.len() > 2 {
            let name = pick(&workers);
            workers.remove(&name).unwrap().stop().await;
        }
        // One more crash; after the last round, the drain below starts right away and so includes
        // this crash's failover.
        let name = pick(&workers);
        workers.remove(&name).unwrap().kill9();
        spawn(&mut workers);
        if round + 1 < rounds {
            tokio::time::sleep(step).await;
        }
        eprintln!("fault round {} of {rounds} done", round + 1);
    }

    // Keep producing briefly past the last crash, so records wait on its partitions' failover.
    let last_crash = Instant::now();
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::SeqCst);
    let mut produced = producer.await.unwrap();
    produced.committed.extend(bursts);
    if tokio::time::timeout(DRAIN_BOUND, drained(&db, DRAIN_BOUND * 2)).await.is_err() {
        let stuck = rows!(
            db,
            (i16, i64, Option<Uuid>, i64, Option<bool>),
            "SELECT r.partition, count(*), p.owner, p.epoch, (SELECT i.expires_at > {now} FROM {s}instances i WHERE i.id = p.owner)
             FROM {s}records r JOIN {s}partitions p ON p.partition = r.partition
             WHERE r.failed_at IS NULL GROUP BY r.partition, p.owner, p.epoch ORDER BY r.partition"
        );
        let instances = rows!(db, (Uuid, String, bool), "SELECT id, name, expires_at > {now} FROM {s}instances");
        // Whether a key waits for a retry's time (due false) or for nothing.
        let heads = rows!(
            db,
            (i16, String, i64, i32, Option<bool>, Option<String>),
            "SELECT r.partition, r.key, r.seq, r.attempts, (r.next_attempt_at IS NULL OR r.next_attempt_at <= {now}), r.last_error
             FROM {s}records r WHERE r.failed_at IS NULL
             AND r.seq = (SELECT min(h.seq) FROM {s}records h WHERE h.key = r.key AND h.failed_at IS NULL)
             ORDER BY r.partition, r.key"
        );
        panic!(
            "not drained within {DRAIN_BOUND:?} of the last crash (worker logs: outbox-fault-*.log in the temporary directory).\n\
             pending by (partition, count, owner, epoch, owner live): {stuck:?}\ninstances: {instances:?}\n\
             heads pending (partition, key, seq, attempts, due, last error): {heads:?}"
        );
    }
    eprintln!("drained {:?} after the last crash", last_crash.elapsed());
    for (_, worker) in std::mem::take(&mut workers) {
        worker.stop().await;
    }

    // The checker.
    assert!(produced.committed.len() > 500, "produced {}", produced.committed.len());
    // Every call begun, unfinished ones (cancelled) too: order, exclusivity and overlaps are what a
    // handler saw begin; a record counts as delivered only by a call that returned.
    let mut deliveries = outbox_tests::calls::read_dir(calls.path()).unwrap();
    deliveries.sort_by_key(|c| c.started_us);
    let delivered: BTreeSet<Uuid> = deliveries.iter().filter(|d| d.finished).map(|d| d.record_id).collect();
    let missing: Vec<_> = produced.committed.iter().filter(|(id, _, _)| !delivered.contains(id)).collect();
    assert!(
        missing.is_empty(),
        "{} committed records never delivered: {:?}",
        missing.len(),
        &missing[..missing.len().min(5)]
    );
    let ghosts: Vec<_> = produced.rolled_back.iter().filter(|id| delivered.contains(id)).collect();
    assert!(ghosts.is_empty(), "rolled-back records delivered: {ghosts:?}");

    let mut expected: BTreeMap<&str, Vec<i64>> = BTreeMap::new();
    for (_, key, seq) in &produced.committed {
        expected.entry(key).or_default().push(*seq);
    }
    let mut firsts: BTreeMap<&str, Vec<i64>> = BTreeMap::new();
    let mut seen = BTreeSet::new();
    for call in &deliveries {
        if seen.insert(call.record_id) {
            firsts.entry(&call.key).or_default().push(call.seq);
        }
    }
    for (key, seqs) in &mut expected {
        seqs.sort();
        assert_eq!(&firsts[key], seqs, "{key}: first deliveries out of sequence");
    }

    let mut by_epoch: BTreeMap<(outbox_core::Partition, outbox_core::Epoch), BTreeSet<&str>> = BTreeMap::new();
    for call in &deliveries {
        by_epoch.entry((call.partition, call.epoch)).or_default().insert(&call.instance);
    }
    let shared: Vec<_> = by_epoch.iter().filter(|(_, instances)| instances.len() > 1).collect();
    assert!(shared.is_empty(), "(partition, epoch) delivered by two instances: {shared:?}");

    let overlaps = overlapping_calls(&deliveries, &pauses);
    assert!(
        overlaps.is_empty(),
        "{} pairs of handler calls for one key overlapped (pauses {pauses:?}); first: {:#?}",
        overlaps.len(),
        &overlaps[..overlaps.len().min(10)]
    );

    assert_eq!(failed_count(&db).await, 0);
    assert_eq!(pending(&db).await, 0);
    let paused: Vec<String> = pauses.iter().map(|p| format!("{} {:?}", p.worker, p.duration)).collect();
    eprintln!("paused: {}", paused.join(", "));
    eprintln!(
        "committed {}, rolled back {}, calls {} ({} unfinished, {} duplicates after crashes), epochs seen {}",
        produced.committed.len(),
        produced.rolled_back.len(),
        deliveries.len(),
        deliveries.iter().filter(|d| !d.finished).count(),
        deliveries.iter().filter(|d| d.finished).count() - delivered.len(),
        by_epoch.len()
    );
}

/// A handler that ends its process (`std::process::abort`, as a panic under `panic = "abort"`, a stack
/// overflow or running out of memory would) on one record, with one worker process started again each
/// time it ends, as an orchestrator would. The first call is not counted (nothing is written before
/// it); each instance that takes the partition over from the one that ended counts its call before
/// making it, so after `1 + MAX_RETRIES` counted calls the record is FAILED without another, and its
/// key's later record waits behind it while every other key is delivered, none of them counted more
/// than once. Before calls were counted, the record ended every process that took it on, for ever.
async fn a_record_whose_handler_ends_the_process_fails_after_its_retries(db: TestDb) {
    let _alone = ONE_SCENARIO_AT_A_TIME.lock().await;
    const MAX_RETRIES: usize = 2;
    let outbox = outbox(&db, |_| {}).await;
    let url = db.url().await;
    let mut records = vec![
        NewRecord::new("poison", "ok", "before"),
        NewRecord::new("poison", "abort", "ends the process"),
        NewRecord::new("poison", "ok", "after"),
    ];
    for k in 0..20 {
        records.extend((0..5).map(|i| NewRecord::new(format!("k-{k}"), "ok", format!("{i}"))));
    }
    let scheduled = commit(&outbox, &db, records).await;
    let (before, poison, after) = (scheduled[0].id, scheduled[1].id, scheduled[2].id);
    let calls = tempfile::tempdir().unwrap();
    let retries = MAX_RETRIES.to_string();
    let env = [("ABORT_EVENT", "abort"), ("MAX_RETRIES", retries.as_str())];
    let start = |n: usize| Worker::start_with(&db, &url, &format!("abort-{n}"), calls.path(), &env);
    let mut ended = 0;
    let mut worker = start(ended);
    let deadline = Instant::now() + Duration::from_secs(120);
    while failed_count(&db).await == 0 {
        assert!(Instant::now() < deadline, "the record never FAILED; {ended} processes ended on it");
        if let Some(status) = worker.child.0.try_wait().unwrap() {
            assert!(!status.success(), "the worker exited on its own with {status}");
            ended += 1;
            assert!(ended <= MAX_RETRIES + 2, "{ended} processes ended on one record");
            worker = start(ended);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    wait_for("every other key delivered", Duration::from_secs(60), || async {
        count(&db, "SELECT count(*) FROM {s}records WHERE failed_at IS NULL").await == 1
    })
    .await;
    worker.stop().await;
    assert_eq!(ended, MAX_RETRIES + 2, "the first call uncounted, then one ended per counted call");

    let rows = rows!(
        db,
        (Uuid, i32, Option<String>, bool),
        "SELECT id, attempts, last_error, failed_at IS NOT NULL FROM {s}records ORDER BY seq"
    );
    let [(failed, attempts, error, is_failed), (waiting, _, _, waiting_failed)] = &rows[..] else {
        panic!("left in the outbox: {rows:?}")
    };
    assert_eq!((*failed, *is_failed), (poison, true));
    assert_eq!(*attempts, MAX_RETRIES as i32 + 1, "every counted call");
    assert!(error.as_deref().is_some_and(|e| e.contains("did not finish")), "{error:?}");
    assert_eq!((*waiting, *waiting_failed), (after, false), "the key's later record waits behind it");
    let delivered: BTreeSet<Uuid> = outbox_tests::calls::read_dir(calls.path())
        .unwrap()
        .iter()
        .filter(|c| c.finished)
        .map(|c| c.record_id)
        .collect();
    assert!(delivered.contains(&before), "the record before it was delivered");
    assert_eq!(delivered.len(), 1 + 20 * 5, "every record but the two of the key's from the poison on");
    // Calls in flight beside the record when a process ended are counted once: a record counted before
    // is called alone, and its turn lasts until its outcome is written.
    let counted = rows!(db, (String, i32), "SELECT key, attempts FROM {s}completed");
    assert_eq!(counted.len(), 1 + 20 * 5);
    let most = counted.iter().max_by_key(|(_, attempts)| *attempts);
    assert!(most.is_some_and(|(_, attempts)| *attempts <= 1), "{most:?}");
}

/// Measures what counting calls before they are made costs: one in-process node with a no-op handler
/// drains a backlog (20,000 records over 2,000 keys) of partitions that are free, or that it takes
/// over from a dead owner, so every record already there is in a counted run. Timed from the first
/// completed record (after the quiet period of a takeover) until the backlog is drained; alternated.
///
/// `./scripts/test.sh -p outbox-tests --test faults -- --ignored --nocapture measure_a_drain`
#[sqlx::test(migrations = false)]
#[ignore = "measurement, run on demand"]
async fn measure_a_drain_after_a_takeover(pool: PgPool) {
    let db = TestDb::postgres(pool.clone());
    let outbox = outbox(&db, |_| {}).await;
    let ok = outbox_core::handler_fn(|_| async { Ok::<(), outbox_core::HandlerError>(()) });
    let handlers = || outbox_core::Handlers::new().default_route(outbox_core::Route::new(ok.clone()));
    const RECORDS: i64 = 20_000;
    for taken_over in [false, true, false, true, false, true] {
        for batch in 0..20 {
            let records = (0..1000).map(|i| NewRecord::new(format!("k-{}", (batch * 1000 + i) % 2000), "t", "x"));
            commit(&outbox, &db, records.collect()).await;
        }
        if taken_over {
            let dead = register_instance(&db).await;
            exec!(db, "UPDATE {s}instances SET expires_at = {ago:60} WHERE id = $1", dead);
            exec!(db, "UPDATE {s}partitions SET owner = $1", dead);
        }
        let node = start(&outbox, &db, handlers()).await;
        wait_for("the first record completed", Duration::from_secs(60), || async { pending(&db).await < RECORDS })
            .await;
        let began = Instant::now();
        drained(&db, Duration::from_secs(300)).await;
        let took = began.elapsed();
        node.shutdown().await.unwrap();
        eprintln!(
            "{}: {:.0} records/s",
            if taken_over { "taken over" } else { "free      " },
            RECORDS as f64 / took.as_secs_f64()
        );
        exec!(db, "DELETE FROM {s}completed");
        exec!(db, "DELETE FROM {s}instances");
        exec!(db, "UPDATE {s}partitions SET owner = NULL, target_owner = NULL");
    }
}

/// Measures what suspects cost their next owner: a node takes over (from a dead owner) 40 keys whose
/// 20 records each are all suspects, as a process that ended in the middle of runs of 20 leaves them,
/// beside 400 keys of 10 records in counted runs; the handler takes 5 ms. Timed from the first
/// completed record until the suspects are delivered, and until the backlog is.
///
/// `./scripts/test.sh -p outbox-tests --test faults -- --ignored --nocapture measure_suspects`
#[sqlx::test(migrations = false)]
#[ignore = "measurement, run on demand"]
async fn measure_suspects_after_a_takeover(pool: PgPool) {
    let db = TestDb::postgres(pool.clone());
    let outbox = outbox(&db, |_| {}).await;
    let slow = outbox_core::handler_fn(|_| async {
        tokio::time::sleep(Duration::from_millis(5)).await;
        Ok::<(), outbox_core::HandlerError>(())
    });
    let handlers = || outbox_core::Handlers::new().default_route(outbox_core::Route::new(slow.clone()));
    for _ in 0..3 {
        let suspects = (0..20).flat_map(|_| (0..40).map(|k| NewRecord::new(format!("s-{k}"), "t", "x")));
        let counted = (0..10).flat_map(|_| (0..400).map(|k| NewRecord::new(format!("k-{k}"), "t", "x")));
        commit(&outbox, &db, suspects.chain(counted).collect()).await;
        exec!(
            db,
            "UPDATE {s}records SET attempts = 1, last_error = $1 WHERE key LIKE 's-%'",
            outbox_core::UNFINISHED_CALL
        );
        let dead = register_instance(&db).await;
        exec!(db, "UPDATE {s}instances SET expires_at = {ago:60} WHERE id = $1", dead);
        exec!(db, "UPDATE {s}partitions SET owner = $1", dead);
        let all = pending(&db).await;
        let node = start(&outbox, &db, handlers()).await;
        wait_for("the first record completed", Duration::from_secs(60), || async { pending(&db).await < all }).await;
        let began = Instant::now();
        let left = "SELECT count(*) FROM {s}records WHERE key LIKE 's-%'";
        wait_for("the suspects delivered", Duration::from_secs(600), || async { count(&db, left).await == 0 }).await;
        let suspects = began.elapsed();
        drained(&db, Duration::from_secs(600)).await;
        eprintln!("800 suspects over 40 keys: delivered in {suspects:?}; the whole backlog in {:?}", began.elapsed());
        node.shutdown().await.unwrap();
        exec!(db, "DELETE FROM {s}completed");
        exec!(db, "DELETE FROM {s}instances");
        exec!(db, "UPDATE {s}partitions SET owner = NULL, target_owner = NULL");
    }
}

/// Measures, with real worker processes, how long partitions take to move after a graceful stop
/// (handover) and after a kill -9 (failover), until the other instance owns them and until a record
/// committed into one of them right after the stop is delivered, and how many transactions per second
/// an idle instance costs the database, for the default tunables and a fast profile. Prints figures
/// (for the README); timings are not asserted.
///
/// `./scripts/test.sh -p outbox-tests --test faults -- --ignored --nocapture measure`
#[sqlx::test(migrations = false)]
#[ignore = "measurement, run on demand"]
async fn measure_handover_failover_and_idle_load(pool: PgPool) {
    let db = TestDb::postgres(pool.clone());
    let outbox = outbox(&db, |_| {}).await;
    let url = db.url().await;
    let profiles = [("default", "2s", "10s", "2s", "100ms"), ("fast", "200ms", "1s", "200ms", "50ms")];
    for (profile, heartbeat, stale, rebalance, poll) in profiles {
        let start = |name: &str| {
            let log = std::fs::File::create(std::env::temp_dir().join(format!("outbox-measure-{name}.log"))).unwrap();
            let child = Command::new(env!("CARGO_BIN_EXE_outbox-test-worker"))
                .envs([("DATABASE_URL", url.as_str()), ("WORKER_NAME", name), ("HEARTBEAT", heartbeat)])
                .envs([("STALE", stale), ("REBALANCE", rebalance), ("POLL", poll)])
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .unwrap();
            Worker { name: name.into(), child: Process(child) }
        };
        let owned_by = |name: &'static str| {
            let pool = pool.clone();
            async move {
                let n: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM outbox.partitions p JOIN outbox.instances i ON i.id = p.owner WHERE i.name = $1",
                )
                .bind(name)
                .fetch_one(&pool)
                .await
                .unwrap();
                n
            }
        };
        // A key of a partition `name` owns: a record for it, committed once `name` has gone, is
        // delivered only once another instance has taken that partition over.
        let key_owned_by = |name: &'static str| {
            let pool = pool.clone();
            async move {
                let partition: i16 = sqlx::query_scalar(
                    "SELECT p.partition FROM outbox.partitions p JOIN outbox.instances i ON i.id = p.owner
                     WHERE i.name = $1 LIMIT 1",
                )
                .bind(name)
                .fetch_one(&pool)
                .await
                .unwrap();
                (0..)
                    .map(|i| format!("measure-{i}"))
                    .find(|k| i16::from(outbox_core::partition_of(k)) == partition)
                    .unwrap()
            }
        };
        let minute = Duration::from_secs(60);
        let a = start("a");
        wait_for("a owns all", minute, || async { owned_by("a").await == 256 }).await;

        // Idle load: one instance, nothing to deliver, for 20 s.
        let xacts = || async {
            let n: i64 = sqlx::query_scalar(
                "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = current_database()",
            )
            .fetch_one(&pool)
            .await
            .unwrap();
            n
        };
        tokio::time::sleep(Duration::from_secs(2)).await;
        let before = xacts().await;
        tokio::time::sleep(Duration::from_secs(20)).await;
        let idle_tps = (xacts().await - before - 1) as f64 / 20.0;

        let b = start("b");
        wait_for("balanced", minute, || async { owned_by("a").await == 128 && owned_by("b").await == 128 }).await;
        let key = key_owned_by("b").await;
        let stopped = Instant::now();
        b.signal("-TERM");
        commit(&outbox, &db, vec![NewRecord::new(&key, "t", "")]).await;
        wait_for("a took b's partitions", minute, || async { owned_by("a").await == 256 }).await;
        let handover = stopped.elapsed();
        drained(&db, minute).await;
        let handover_delivered = stopped.elapsed();
        b.stop_wait().await;

        let c = start("c");
        wait_for("balanced", minute, || async { owned_by("a").await == 128 && owned_by("c").await == 128 }).await;
        let key = key_owned_by("c").await;
        let crashed = Instant::now();
        c.kill9();
        commit(&outbox, &db, vec![NewRecord::new(&key, "t", "")]).await;
        wait_for("a took the crashed instance's partitions", minute, || async { owned_by("a").await == 256 }).await;
        let failover = crashed.elapsed();
        drained(&db, minute).await;
        let failover_delivered = crashed.elapsed();
        a.stop().await;
        sqlx::query("DELETE FROM outbox.instances").execute(&pool).await.unwrap();
        sqlx::query("UPDATE outbox.partitions SET owner = NULL, target_owner = NULL").execute(&pool).await.unwrap();
        eprintln!(
            "profile {profile} (heartbeat {heartbeat}, stale {stale}, rebalance {rebalance}, poll {poll}): \
             graceful handover {handover:.2?} (delivering {handover_delivered:.2?}), failover after kill -9 \
             {failover:.2?} (delivering {failover_delivered:.2?}), idle instance {idle_tps:.1} transactions/s"
        );
    }
}
