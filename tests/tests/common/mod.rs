//! Shared test harness: one suite, three backends ([`every_backend!`] runs a test on a fresh PostgreSQL
//! database, a fresh SQLite file and a fresh MySQL database), an outbox on the test's own database, a recording sink, fast cluster
//! tunables, and waiting on conditions (never sleeping for an outcome).
#![allow(dead_code, unused_macros, clippy::unwrap_used, clippy::expect_used)]

pub mod conformance;
mod driver;
pub mod recorded;
#[allow(unused_imports)]
pub use driver::TableLock;
#[allow(unused_imports)]
pub use outbox_tests::nats;

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use outbox_cluster::{ClusterConfig, Node};
use outbox_core::{Config, Db, DbRow, Epoch, Handlers, InstanceId, NewRecord, Outbox, Partition, Record, Tx, Value};
use sqlx::AssertSqlSafe;
use tokio::time::Instant;

/// Runs each named `async fn name(db: TestDb)` on each backend listed: `name::postgres` on a fresh
/// PostgreSQL database (`#[sqlx::test]`), `name::sqlite` on a fresh SQLite file and `name::mysql` on a
/// fresh MySQL database. A test of what only some backends have (a network between, row and table
/// locks, session settings) lists those: a variant that returned at once passed having tested nothing.
macro_rules! on_backends {
    ($backends:tt $($name:ident),* $(,)?) => { $( on_backends!(@one $backends $name); )* };
    (@one [$($backend:ident),+] $name:ident) => {
        mod $name { $( on_backends!(@test $backend $name); )+ }
    };
    (@test postgres $name:ident) => {
        #[sqlx::test(migrations = false)]
        async fn postgres(pool: sqlx::PgPool) {
            super::$name(crate::common::TestDb::postgres(pool)).await
        }
    };
    (@test sqlite $name:ident) => {
        #[tokio::test]
        async fn sqlite() {
            super::$name(crate::common::TestDb::sqlite().await).await
        }
    };
    (@test mysql $name:ident) => {
        #[tokio::test]
        async fn mysql() {
            super::$name(crate::common::TestDb::mysql().await).await
        }
    };
}

/// [`on_backends!`] on all three.
macro_rules! every_backend {
    ($($name:ident),* $(,)?) => { on_backends!([postgres, sqlite, mysql] $($name),*); };
}

/// Runs a statement written for both backends (see [`TestDb::sql`]) with its binds; rows affected.
macro_rules! exec {
    ($db:expr, $sql:expr $(, $arg:expr)* $(,)?) => {
        $db.exec(&$sql, &[$(outbox_core::Value::from($arg)),*]).await
    };
}

/// Fetches every row of a statement written for both backends as tuples of `$t`.
macro_rules! rows {
    ($db:expr, $t:ty, $sql:expr $(, $arg:expr)* $(,)?) => {
        $db.rows::<$t>(&$sql, &[$(outbox_core::Value::from($arg)),*]).await
    };
}

/// The test's database: a fresh PostgreSQL or MySQL database or a fresh SQLite file (deleted with the last
/// clone).
#[derive(Clone)]
pub struct TestDb {
    pub db: Db,
    /// The SQLite file's URL (`None` on PostgreSQL, where [`TestDb::url`] asks the database).
    sqlite_url: Option<String>,
    _dir: Option<Arc<tempfile::TempDir>>,
}

impl TestDb {
    /// Runs a statement written for both backends (see [`TestDb::sql`]); returns the rows affected.
    pub async fn exec(&self, sql: &str, args: &[Value<'_>]) -> u64 {
        self.db.execute(AssertSqlSafe(self.sql(sql)), args).await.unwrap()
    }

    /// Every row of a query written for both backends.
    pub async fn rows<T: DbRow>(&self, sql: &str, args: &[Value<'_>]) -> Vec<T> {
        self.db.fetch_all(AssertSqlSafe(self.sql(sql)), args).await.unwrap()
    }

    /// The one value of a query written for both backends.
    pub async fn scalar<T>(&self, sql: &str, args: &[Value<'_>]) -> T
    where
        (T,): DbRow,
    {
        let (value,) = self.db.fetch_one::<(T,)>(AssertSqlSafe(self.sql(sql)), args).await.unwrap();
        value
    }

    /// The same database through a new pool of `connections` connections.
    pub async fn with_pool_size(&self, connections: u32) -> TestDb {
        let options = outbox_core::ConnectOptions { max_connections: connections, ..Default::default() };
        TestDb { db: self.db.new_pool(&options).await.unwrap(), ..self.clone() }
    }

    /// A transaction of either backend, for `schedule` (on SQLite `BEGIN IMMEDIATE`).
    pub async fn begin(&self) -> Tx {
        self.db.begin().await.unwrap()
    }

    /// A transaction that has run `sql`, a locking read written for every backend (see [`TestDb::sql`]),
    /// and holds its locks until it is ended.
    pub async fn holding(&self, sql: &str, args: &[Value<'_>]) -> Tx {
        let mut tx = self.begin().await;
        tx.execute(AssertSqlSafe(self.sql(sql)), args).await.unwrap();
        tx
    }
}

impl From<&TestDb> for Db {
    fn from(db: &TestDb) -> Db {
        db.db.clone()
    }
}

impl From<TestDb> for Db {
    fn from(db: TestDb) -> Db {
        db.db
    }
}

/// An outbox on the test's database, migrated, with test-friendly tunables changed by `tune`.
pub async fn outbox(db: &TestDb, tune: impl FnOnce(&mut Config)) -> Outbox {
    let mut config = Config { poll_interval: Duration::from_millis(20), ..Config::default() };
    tune(&mut config);
    let outbox = Outbox::new(config).unwrap();
    outbox.migrate(db).await.unwrap();
    outbox
}

/// A processor that polls once an hour.
pub fn hourly(c: &mut Config) {
    c.poll_interval = Duration::from_secs(3600);
    c.listen_poll_interval = Duration::from_secs(3600);
    c.active_poll_interval = Duration::from_secs(3600);
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

pub async fn start(outbox: &Outbox, db: &TestDb, handlers: Handlers) -> Node {
    Node::start(outbox.clone(), db, handlers, fast_cluster()).await.unwrap()
}

/// A node whose lease (30 s) no stall of a busy machine lets lapse, for tests that claim what is not
/// read before the next poll: a lease renewed after it lapsed makes the processor read every partition
/// (a fetch that ran across the lapse was thrown away), which a 600 ms one did under a loaded CI run.
pub async fn start_unlapsing(outbox: &Outbox, db: &TestDb, handlers: Handlers) -> Node {
    Node::start(outbox.clone(), db, handlers, unlapsing_cluster()).await.unwrap()
}

/// [`fast_cluster`] on a lease of 30 s (renewed every second), which no stall of a busy machine lets
/// lapse: see [`start_unlapsing`].
pub fn unlapsing_cluster() -> ClusterConfig {
    ClusterConfig {
        heartbeat_interval: Duration::from_secs(1),
        stale_timeout: Duration::from_secs(30),
        ..fast_cluster()
    }
}

/// `n` distinct keys with `prefix` that fall into `partition`.
pub fn keys_in(partition: Partition, prefix: &str, n: usize) -> Vec<String> {
    (0..).map(|i| format!("{prefix}-{i}")).filter(|k| outbox_core::partition_of(k) == partition).take(n).collect()
}

/// One delivery as a handler saw it.
#[derive(Debug, Clone)]
pub struct Delivery {
    pub id: uuid::Uuid,
    pub epoch: Epoch,
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

    /// The key's deliveries as positions in its own sequence (see [`ranks`]).
    pub fn ranks_of(&self, key: &str) -> Vec<i64> {
        ranks(&self.seqs_of(key))
    }
}

/// At least once, in order: for each of `keys` keys, a record's first delivery comes after every earlier
/// record's (a cancelled call's record is delivered again later).
pub fn assert_first_deliveries_in_order(sink: &Sink, keys: usize, rounds: i64) {
    for k in 0..keys {
        let ranks = sink.ranks_of(&format!("key-{k}"));
        let mut firsts: Vec<i64> = Vec::new();
        for &rank in &ranks {
            if !firsts.contains(&rank) {
                firsts.push(rank);
            }
        }
        assert_eq!(firsts, (1..=rounds).collect::<Vec<i64>>(), "key-{k}: {ranks:?}");
    }
}

/// Which instance is inside a handler for which partition; any overlap is a violation.
#[derive(Default)]
pub struct Exclusive {
    inside: Mutex<BTreeMap<Partition, (String, usize)>>,
    pub violations: Mutex<Vec<String>>,
}

pub struct Inside {
    exclusive: Arc<Exclusive>,
    partition: Partition,
}

impl Exclusive {
    pub fn enter(self: &Arc<Self>, instance: &str, partition: Partition) -> Inside {
        let mut inside = self.inside.lock().unwrap();
        let entry = inside.entry(partition).or_insert_with(|| (instance.to_string(), 0));
        if entry.0 != instance {
            self.violations.lock().unwrap().push(format!("partition {partition}: {} and {instance}", entry.0));
        }
        entry.1 += 1;
        Inside { exclusive: self.clone(), partition }
    }

    /// How many handler calls `instance` is inside now.
    pub fn calls_of(&self, instance: &str) -> usize {
        self.inside.lock().unwrap().values().filter(|(name, _)| name == instance).map(|&(_, calls)| calls).sum()
    }

    /// In how many partitions `instance` is inside a handler call now.
    pub fn partitions_of(&self, instance: &str) -> usize {
        self.inside.lock().unwrap().values().filter(|(name, _)| name == instance).count()
    }
}

impl Drop for Inside {
    fn drop(&mut self) {
        let mut inside = self.exclusive.inside.lock().unwrap();
        if let Some(entry) = inside.get_mut(&self.partition) {
            entry.1 -= 1;
            if entry.1 == 0 {
                inside.remove(&self.partition);
            }
        }
    }
}

/// Each sequence number's rank among the distinct ones in `seqs`, from 1. A key's sequence numbers are
/// strictly increasing but not consecutive, so `[41, 41, 97, 130]` (a redelivered first record, then
/// two more) reads `[1, 1, 2, 3]`.
pub fn ranks(seqs: &[i64]) -> Vec<i64> {
    let distinct: std::collections::BTreeSet<i64> = seqs.iter().copied().collect();
    seqs.iter().map(|s| distinct.range(..s).count() as i64 + 1).collect()
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

/// A count written for both backends (see [`TestDb::sql`]).
pub async fn count(db: &TestDb, sql: &str) -> i64 {
    db.scalar(sql, &[]).await
}

pub async fn pending(db: &TestDb) -> i64 {
    count(db, "SELECT count(*) FROM {s}records").await
}

/// Schedules `records` in one committed transaction.
pub async fn commit(outbox: &Outbox, db: &TestDb, records: Vec<NewRecord>) -> Vec<outbox_core::Scheduled> {
    let mut tx = db.begin().await;
    let scheduled = outbox.schedule_batch(&mut tx, &records).await.unwrap();
    tx.commit().await.unwrap();
    scheduled
}

/// Registers an instance with a lease a day long, as the cluster's registry would; returns its id.
pub async fn register_instance(db: &TestDb) -> InstanceId {
    let me = InstanceId::new();
    exec!(db, "INSERT INTO {s}instances (id, name, expires_at) VALUES ($1, 'test', {ago:-86400})", me);
    me
}

/// How many partitions each instance owns.
pub async fn owners(db: &TestDb) -> BTreeMap<InstanceId, i64> {
    let rows = rows!(
        db,
        (InstanceId, i64),
        "SELECT owner, count(*) FROM {s}partitions WHERE owner IS NOT NULL GROUP BY owner"
    );
    rows.into_iter().collect()
}

/// An instance that owns every partition, heartbeating every `heartbeat_ms`, whose lease ended a minute
/// ago: the next instance takes its partitions over, after their quiet period.
pub async fn owner_of_all_dead_since_a_minute(db: &TestDb, heartbeat_ms: i64) -> InstanceId {
    let dead = register_instance(db).await;
    exec!(db, "UPDATE {s}instances SET expires_at = {ago:60}, heartbeat_ms = $1 WHERE id = $2", heartbeat_ms, dead);
    exec!(db, "UPDATE {s}partitions SET owner = $1", dead);
    dead
}

pub async fn failed_count(db: &TestDb) -> i64 {
    count(db, "SELECT count(*) FROM {s}records WHERE failed_at IS NOT NULL").await
}

/// Waits until exactly `n` records are FAILED.
pub async fn wait_failed(db: &TestDb, n: i64) {
    wait_for(&format!("{n} FAILED records"), Duration::from_secs(60), || async { failed_count(db).await == n }).await;
}

/// Runs a node whose handler accepts everything until the outbox is drained, then stops it.
pub async fn deliver_all(outbox: &Outbox, db: &TestDb) {
    let ok = outbox_core::handler_fn(|_| async { Ok::<(), outbox_core::HandlerError>(()) });
    let node = start(outbox, db, Handlers::new().default_route(outbox_core::Route::new(ok))).await;
    drained(db, Duration::from_secs(60)).await;
    node.shutdown().await.unwrap();
}

/// Waits until the outbox holds no pending (non-FAILED) record.
pub async fn drained(db: &TestDb, timeout: Duration) {
    wait_for("all records completed", timeout, || async {
        count(db, "SELECT count(*) FROM {s}records WHERE failed_at IS NULL").await == 0
    })
    .await;
}

/// Handlers that record every delivery in `sink` and accept it.
pub fn recording(sink: &Arc<Sink>) -> Handlers {
    let sink = sink.clone();
    Handlers::new().default_route(outbox_core::Route::new(outbox_core::handler_fn(move |r| {
        let sink = sink.clone();
        async move {
            sink.record(&r);
            Ok(())
        }
    })))
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

/// The logs of this thread that `filter` (as `RUST_LOG`) lets through, kept in memory while it lives.
pub struct Captured {
    written: Arc<Mutex<Vec<u8>>>,
    _default: tracing::subscriber::DefaultGuard,
}

impl Captured {
    pub fn start(filter: &str) -> Captured {
        let written = Arc::new(Mutex::new(Vec::new()));
        let into = written.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
            .with_ansi(false)
            .with_writer(move || Written(into.clone()))
            .finish();
        Captured { written, _default: tracing::subscriber::set_default(subscriber) }
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.written.lock().unwrap()).into_owned()
    }
}

/// A log writer into memory.
struct Written(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Written {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Makes PostgreSQL refuse, with SQLSTATE `code`, each `event` (`DELETE`, `UPDATE`, `DELETE OR UPDATE`)
/// of a record for which `condition` (SQL over `OLD`) holds, until [`open_the_gate`]; [`refusals`]
/// counts them.
pub async fn refuse_until_the_gate_opens(db: &TestDb, event: &str, condition: &str, code: &str) {
    db.exec("CREATE TABLE {s}gate (open boolean)", &[]).await;
    db.exec("CREATE SEQUENCE {s}refusals", &[]).await;
    let refuse = format!(
        "CREATE FUNCTION {{s}}refuse() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF {condition} AND NOT EXISTS (SELECT FROM outbox.gate) THEN
                PERFORM nextval('outbox.refusals');
                RAISE EXCEPTION 'refused' USING ERRCODE = '{code}';
            END IF;
            RETURN CASE TG_OP WHEN 'DELETE' THEN OLD ELSE NEW END;
        END $$"
    );
    db.exec(&refuse, &[]).await;
    let trigger =
        format!("CREATE TRIGGER refuse BEFORE {event} ON {{s}}records FOR EACH ROW EXECUTE FUNCTION {{s}}refuse()");
    db.exec(&trigger, &[]).await;
}

/// How many writes [`refuse_until_the_gate_opens`] refused.
pub async fn refusals(db: &TestDb) -> i64 {
    db.scalar("SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM {s}refusals", &[]).await
}

/// Ends [`refuse_until_the_gate_opens`]'s refusals.
pub async fn open_the_gate(db: &TestDb) {
    db.exec("INSERT INTO {s}gate VALUES (true)", &[]).await;
}
