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
mod tests;

use std::sync::Arc;
use std::time::Duration;

use outbox_core::{Db, Epochs, InstanceId, Outbox, Partition};

use crate::error::{Error, Result};
use crate::rebalance::Targets;
use crate::stored::{InstanceInfo, Lease, Taken, View};

/// Runs `$body` with `$pool` bound to the backend's pool and `$s` to its statements; a backend this
/// crate was built without (enabled in `outbox-core` by another crate) is an error.
macro_rules! dispatch {
    ($store:expr, |$pool:ident, $s:ident| $body:expr) => {
        match &$store.db {
            #[cfg(feature = "postgres")]
            Db::Postgres($pool) => {
                let $s = &$store.statements.postgres;
                $body
            }
            #[cfg(feature = "sqlite")]
            Db::Sqlite($pool) => {
                let $s = &$store.statements.sqlite;
                $body
            }
            #[cfg(feature = "mysql")]
            Db::MySql($pool) => {
                let $s = &$store.statements.mysql;
                $body
            }
            other => Err(Error::BackendNotBuilt { backend: other.backend() }),
        }
    };
}

/// The database of a cluster with the statements built for its outbox schema. Cheap to clone.
#[derive(Debug, Clone)]
pub(crate) struct Store {
    db: Db,
    statements: Arc<Statements>,
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
    pub(crate) fn new(db: Db, outbox: &Outbox) -> Self {
        let schema = outbox.config().schema.as_str();
        let statements = Statements {
            #[cfg(feature = "postgres")]
            postgres: postgres::PgStatements::new(schema),
            #[cfg(feature = "sqlite")]
            sqlite: sqlite::SqliteStatements::new(schema),
            #[cfg(feature = "mysql")]
            mysql: mysql::MySqlStatements::new(schema),
        };
        Self { db, statements: Arc::new(statements) }
    }

    pub(crate) fn db(&self) -> &Db {
        &self.db
    }

    /// Registers instance `id` with a lease of `lease.live` from database time; returns the lease's
    /// remaining time as the database answered it.
    pub(crate) async fn register(&self, id: InstanceId, name: &str, lease: Lease) -> Result<Duration> {
        dispatch!(self, |pool, s| s.register(pool, id, name, lease).await)
    }

    /// Removes instance `id`.
    pub(crate) async fn deregister(&self, id: InstanceId) -> Result<()> {
        dispatch!(self, |pool, s| s.deregister(pool, id).await)
    }

    /// Deletes the instances whose lease expired more than `grace` ago; returns how many.
    pub(crate) async fn reap(&self, grace: Duration) -> Result<u64> {
        dispatch!(self, |pool, s| s.reap(pool, grace).await)
    }

    /// Takes the partitions targeted at `me` that are free or whose owner's lease has expired by
    /// database time, each in one compare-and-set that bumps its epoch (so whatever the previous owner
    /// still writes is fenced out). A partition another writer holds locked is left for the next round.
    pub(crate) async fn acquire(&self, me: InstanceId) -> Result<Vec<Taken>> {
        dispatch!(self, |pool, s| s.acquire(pool, me).await)
    }

    /// The partitions the database shows `me` owning, with their epochs.
    pub(crate) async fn owned(&self, me: InstanceId) -> Result<Epochs> {
        dispatch!(self, |pool, s| s.owned(pool, me).await)
    }

    /// Frees the partitions `me` still owns at the given epochs, bumping each epoch; returns those freed.
    pub(crate) async fn release(&self, me: InstanceId, partitions: &Epochs) -> Result<Vec<Partition>> {
        dispatch!(self, |pool, s| s.release(pool, me, partitions).await)
    }

    /// Every partition's owner, epoch and target, and the instances taking part in the assignment
    /// (lease live by database time, not draining), in one statement: what a round reads.
    pub(crate) async fn view(&self) -> Result<View> {
        dispatch!(self, |pool, s| s.view(pool).await)
    }

    /// Writes the targets that differ from the stored ones, in one transaction; returns their partitions.
    pub(crate) async fn set_targets(&self, targets: &Targets) -> Result<Vec<Partition>> {
        dispatch!(self, |pool, s| s.set_targets(pool, targets).await)
    }

    /// Marks `me` as leaving, so the assignment no longer counts it.
    pub(crate) async fn drain(&self, me: InstanceId) -> Result<()> {
        dispatch!(self, |pool, s| s.drain(pool, me).await)
    }

    /// Every registered instance, oldest first, with its lease state and partition count.
    pub(crate) async fn instances(&self) -> Result<Vec<InstanceInfo>> {
        dispatch!(self, |pool, s| s.instances(pool).await)
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
    /// Renews the lease of `id` for `lease.live` if it has not expired by database time; returns its
    /// remaining time, or `None` when it had expired (the instance was declared dead and must register
    /// again). On SQLite it takes this process's turn at the file, then the write lock, which writers
    /// in other processes may hold.
    pub(crate) async fn renew(
        &mut self,
        store: &Store,
        id: InstanceId,
        lease: Lease,
        delivered: u64,
    ) -> Result<Option<Duration>> {
        // Reported for the operator's rates; a count past i64 would take 290 years at 1e9/s.
        let delivered = i64::try_from(delivered).unwrap_or(i64::MAX);
        match &store.db {
            #[cfg(feature = "postgres")]
            Db::Postgres(pool) => {
                store.statements.postgres.heartbeat(pool, &mut self.postgres, id, lease, delivered).await
            }
            #[cfg(feature = "sqlite")]
            Db::Sqlite(pool) => store.statements.sqlite.heartbeat(pool, &mut self.sqlite, id, lease, delivered).await,
            #[cfg(feature = "mysql")]
            Db::MySql(pool) => store.statements.mysql.heartbeat(pool, &mut self.mysql, id, lease, delivered).await,
            other => Err(Error::BackendNotBuilt { backend: other.backend() }),
        }
    }
}
