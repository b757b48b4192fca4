//! What an operator wants to see: instances with their last heartbeat, and partition → owner, epoch,
//! target.

use outbox_core::Outbox;
use sqlx::PgPool;

use crate::Result;
use crate::ownership::{self, PartitionRow};
use crate::registry::{self, InstanceInfo};
use crate::sql::Sql;

/// A snapshot of the cluster as the database sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct ClusterStatus {
    /// Registered instances, oldest first.
    pub instances: Vec<InstanceInfo>,
    /// All 256 partitions.
    pub partitions: Vec<PartitionRow>,
}

/// Reads the cluster's state (any process may call it; it needs no running node).
pub async fn status(pool: &PgPool, outbox: &Outbox) -> Result<ClusterStatus> {
    let sql = Sql::new(&outbox.config().schema);
    Ok(ClusterStatus {
        instances: registry::instances(pool, &sql).await?,
        partitions: ownership::partitions(pool, &sql).await?,
    })
}
