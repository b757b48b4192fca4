//! What an operator wants to see: instances with their last heartbeat, and partition → owner, epoch,
//! target, quiet period.

use outbox_core::{Db, Outbox};

use crate::driver::Store;
use crate::error::Result;
pub use crate::stored::{InstanceInfo, PartitionRow};

/// A snapshot of the cluster as the database sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct ClusterStatus {
    /// Registered instances, oldest first.
    pub instances: Vec<InstanceInfo>,
    /// All 256 partitions.
    pub partitions: Vec<PartitionRow>,
}

/// Reads the cluster's state (any process may call it; it needs no running node).
pub async fn status(db: impl Into<Db>, outbox: &Outbox) -> Result<ClusterStatus> {
    let store = Store::new(db.into(), outbox, outbox.config().query_timeout);
    Ok(ClusterStatus { instances: store.instances().await?, partitions: store.view().await?.partitions })
}
