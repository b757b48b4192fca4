//! The cluster's storage drivers: one module per database with its statements and their execution,
//! behind [`Store`], whose methods state each operation's contract once. This is the only module of the
//! crate that names a database; to add one, add `driver/<name>.rs` and its arm in `dispatch!`.

#[cfg(feature = "mysql")]
mod mysql;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "sqlite")]
mod sqlite;
// The conformance suite compares the backends, so it needs all of them.
#[cfg(all(test, feature = "postgres", feature = "sqlite", feature = "mysql"))]
pub(crate) mod tests;

use std::sync::Arc;
use std::time::Duration;

use metrics::SharedString;
use outbox_core::driver::answered_within;
#[cfg(any(feature = "postgres", feature = "mysql"))]
use outbox_core::driver::finishing;
use outbox_core::{Db, Epochs, InstanceId, Outbox, Partition};

use crate::error::{Error, Result};
use crate::rebalance::Targets;
use crate::stored::{InstanceInfo, Lease, Taken, View};

/// Runs `$body` with `$conn` bound to a connection of the backend's pool (on SQLite the pool, whose
/// writers take their turn at the file) and `$s` to its statements, within the outbox's
/// `query_timeout`: a connection that stops answering is given up and closed, where it would stall
/// the ownership rounds, and with them every handover, without an error. A backend this crate was
/// built without (enabled in `outbox-core` by another crate) is an error.
macro_rules! dispatch {
    ($store:expr, $work:literal, |$conn:ident, $s:ident| $body:expr) => {
        answered_within($store.limit, $work, async {
            match &$store.db {
                #[cfg(feature = "postgres")]
                Db::Postgres(pool) => {
                    let $s = &$store.statements.postgres;
                    finishing(pool, async |conn| $s.limited(conn, async |$conn| $body).await).await
                }
                #[cfg(feature = "sqlite")]
                Db::Sqlite($conn) => {
                    let $s = &$store.statements.sqlite;
                    $body
                }
                #[cfg(feature = "mysql")]
                Db::MySql(pool) => {
                    let $s = &$store.statements.mysql;
                    finishing(pool, async |conn| $s.limited(conn, async |$conn| $body).await).await
                }
                other => Err(Error::BackendNotBuilt { backend: other.backend() }),
            }
        })
        .await
    };
}

/// The database of a cluster with the statements built for its outbox schema. Cheap to clone.
#[derive(Debug, Clone)]
pub(crate) struct Store {
    db: Db,
    statements: Arc<Statements>,
    /// The outbox's `query_timeout`.
    limit: Duration,
    /// The `schema` label of the cluster's metrics.
    schema: SharedString,
}

#[derive(Debug)]
struct Statements {
    #[cfg(feature = "postgres")]
    postgres: postgres::PgStatements,
    #[cfg(feature = "sqlite")]
    sqlite: sqlite::SqliteStatements,
    #[cfg(feature = "mysql")]
    mysql: mysql::MySqlStatements,
}

impl Store {
    /// A store whose transactions hold rows, or wait for them, for at most `hold` once their client is
    /// gone (MySQL's `wait_timeout` and lock waits; PostgreSQL's lock and idle-in-transaction time
    /// limits). A node's is under half its lease, since its transactions lock other instances'
    /// rows: an acquirer whose host vanished must not hold back their renewals past their leases.
    #[cfg_attr(
        not(any(feature = "mysql", feature = "postgres")),
        expect(unused_variables, reason = "only the servers' transactions take it")
    )]
    pub(crate) fn new(db: Db, outbox: &Outbox, hold: Duration) -> Self {
        let schema = outbox.config().schema.as_str();
        let statements = Statements {
            #[cfg(feature = "postgres")]
            postgres: postgres::PgStatements::new(schema, hold, outbox.config().query_timeout),
            #[cfg(feature = "sqlite")]
            sqlite: sqlite::SqliteStatements::new(schema),
            #[cfg(feature = "mysql")]
            mysql: mysql::MySqlStatements::new(schema, hold, outbox.config().query_timeout),
        };
        Self {
            db,
            statements: Arc::new(statements),
            limit: outbox.config().query_timeout,
            schema: outbox.schema_label(),
        }
    }

    pub(crate) fn db(&self) -> &Db {
        &self.db
    }

    /// The `schema` label of the cluster's metrics ([`Outbox::schema_label`]).
    pub(crate) fn schema_label(&self) -> SharedString {
        self.schema.clone()
    }

    /// The shortest lease this database keeps safe from an instance whose host vanishes mid-round:
    /// MySQL gives up such a client's transaction after whole seconds (`wait_timeout`), holding the
    /// rows it locked, other instances' included, for as long.
    pub(crate) fn shortest_lease(&self) -> Duration {
        match &self.db {
            #[cfg(feature = "mysql")]
            Db::MySql(_) => Duration::from_secs(2),
            _ => Duration::ZERO,
        }
    }

    /// Registers instance `id` with a lease of `lease.live` from database time; returns the lease's
    /// remaining time as the database answered it. An `id` already registered is registered afresh
    /// (lease, name, counts, takeover stamp), so a registration whose answer was lost is retried under
    /// the same id and leaves no second row, live but never heartbeating, for the rebalancer to target.
    /// Only an id that never owned a partition may be registered again. Refused on a connection workers
    /// cannot run on ([`Db::check_worker_session`]), before anything is written.
    pub(crate) async fn register(&self, id: InstanceId, name: &str, lease: Lease) -> Result<Duration> {
        dispatch!(self, "registering the instance", |conn, s| s.register(conn, id, name, lease).await)
    }

    /// Removes instance `id`.
    pub(crate) async fn deregister(&self, id: InstanceId) -> Result<()> {
        dispatch!(self, "deregistering the instance", |conn, s| s.deregister(conn, id).await)
    }

    /// Deletes the instances whose lease expired more than `grace` ago, and more than twice the
    /// heartbeat interval they declared; returns how many. A partition taken from an instance whose row
    /// is gone gets the taker's own quiet period, so a row deleted sooner would cut short the quiet
    /// period of its partitions taken over later (a leader with a shorter stale timeout, an acquisition
    /// held up).
    pub(crate) async fn reap(&self, grace: Duration) -> Result<u64> {
        dispatch!(self, "reaping expired instances", |conn, s| s.reap(conn, grace).await)
    }

    /// Takes the partitions targeted at `me` that are free or whose owner's lease has expired by
    /// database time, each in one compare-and-set that bumps its epoch (so whatever the previous owner
    /// still writes is fenced out). A partition another writer holds locked is left for the next round.
    /// One taken from an owner whose lease expired starts a quiet period of twice that owner's declared
    /// heartbeat interval or `me`'s `heartbeat`, whichever is longer (`me`'s if the owner's row is
    /// gone): the time that owner needs to notice and stop. Its end is stored with the partition, so
    /// every later acquisition, of the partition free or from a dead owner, gets at least what is left
    /// of it: released, handed on or lapsed with the instance that took it, the partition is delivered
    /// by nobody until the period ends. Each partition taken comes with what is left of its period.
    pub(crate) async fn acquire(&self, me: InstanceId, heartbeat: Duration) -> Result<Vec<Taken>> {
        dispatch!(self, "acquiring partitions", |conn, s| s.acquire(conn, me, heartbeat).await)
    }

    /// The partitions the database shows `me` owning, with their epochs.
    pub(crate) async fn owned(&self, me: InstanceId) -> Result<Epochs> {
        dispatch!(self, "reading owned partitions", |conn, s| s.owned(conn, me).await)
    }

    /// Frees the partitions `me` still owns at the given epochs, bumping each epoch; returns those freed.
    pub(crate) async fn release(&self, me: InstanceId, partitions: &Epochs) -> Result<Vec<Partition>> {
        dispatch!(self, "releasing partitions", |conn, s| s.release(conn, me, partitions).await)
    }

    /// Every partition's owner, epoch, target and quiet period, and the instances taking part in the assignment
    /// (lease live by database time, not draining), in one statement: what a round reads.
    pub(crate) async fn view(&self) -> Result<View> {
        dispatch!(self, "reading the partitions", |conn, s| s.view(conn).await)
    }

    /// Writes the targets that differ from the stored ones, in one transaction; returns their partitions.
    pub(crate) async fn set_targets(&self, targets: &Targets) -> Result<Vec<Partition>> {
        dispatch!(self, "writing targets", |conn, s| s.set_targets(conn, targets).await)
    }

    /// Marks `me` as leaving, so the assignment no longer counts it.
    pub(crate) async fn drain(&self, me: InstanceId) -> Result<()> {
        dispatch!(self, "marking the instance draining", |conn, s| s.drain(conn, me).await)
    }

    /// Every registered instance, oldest first, with its lease state and partition count.
    pub(crate) async fn instances(&self) -> Result<Vec<InstanceInfo>> {
        dispatch!(self, "reading the instances", |conn, s| s.instances(conn).await)
    }
}

/// The heartbeat's own connection, opened on first use: a renewal never waits for a pooled connection
/// behind deliveries or the application's use of the pool.
#[derive(Default)]
pub(crate) struct HeartbeatConnection {
    #[cfg(feature = "postgres")]
    postgres: Option<sqlx::PgConnection>,
    #[cfg(feature = "sqlite")]
    sqlite: Option<sqlx::SqliteConnection>,
    #[cfg(feature = "mysql")]
    mysql: Option<sqlx::MySqlConnection>,
}

impl HeartbeatConnection {
    /// Renews the lease of `id` for `live` if it has not expired by database time; returns its
    /// remaining time, or `None` when it had expired (the instance was declared dead and must register
    /// again). On SQLite it takes this process's turn at the file, then the write lock, which writers
    /// in other processes may hold.
    pub(crate) async fn renew(
        &mut self,
        store: &Store,
        id: InstanceId,
        live: Duration,
        delivered: u64,
    ) -> Result<Option<Duration>> {
        // Reported for the operator's rates; a count past i64 would take 290 years at 1e9/s.
        let delivered = i64::try_from(delivered).unwrap_or(i64::MAX);
        match &store.db {
            #[cfg(feature = "postgres")]
            Db::Postgres(pool) => {
                store.statements.postgres.heartbeat(pool, &mut self.postgres, id, live, delivered).await
            }
            #[cfg(feature = "sqlite")]
            Db::Sqlite(pool) => store.statements.sqlite.heartbeat(pool, &mut self.sqlite, id, live, delivered).await,
            #[cfg(feature = "mysql")]
            Db::MySql(pool) => store.statements.mysql.heartbeat(pool, &mut self.mysql, id, live, delivered).await,
            other => Err(Error::BackendNotBuilt { backend: other.backend() }),
        }
    }
}
