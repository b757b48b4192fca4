//! # outbox-cluster
//!
//! Runs the outbox processor inside every instance of a service: the instance registers and heartbeats
//! into the instances table ([`registry`]), acquires and releases partitions with an epoch that grows on
//! every change of owner ([`ownership`]), and hands its partitions to the processor ([`node`]).
//!
//! Every `rebalance_interval` the leader (the live instance with the smallest id) computes balanced,
//! sticky targets ([`rebalance`]); owners release partitions targeted elsewhere once nothing of theirs is
//! in flight, and the targeted instance then acquires them (release-before-acquire). A crashed
//! instance's partitions are taken once its lease has expired by database time.
//!
//! Runs on PostgreSQL and on SQLite ([`outbox_core::Db`]); the SQL of each is in `sql.rs` and
//! `sqlite.rs`.
//!
//! ```no_run
//! # async fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! use outbox_cluster::{ClusterConfig, Node};
//! use outbox_core::{Config, Handlers, Outbox};
//! let outbox = Outbox::new(Config::default())?;
//! let node = Node::start(outbox, pool, Handlers::new(), ClusterConfig::default()).await?;
//! // ... serve ...
//! node.shutdown().await?;
//! # Ok(()) }
//! ```
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used))]

pub mod config;
pub mod node;
pub mod ownership;
pub mod rebalance;
pub mod registry;
mod sql;
mod sqlite;
pub mod status;

pub use config::ClusterConfig;
pub use node::Node;
pub use status::{ClusterStatus, status};

/// Errors of `outbox-cluster`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// From the outbox core (configuration, processor).
    #[error(transparent)]
    Core(#[from] outbox_core::Error),
    /// A database error.
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
    /// Invalid cluster configuration; the message names the field.
    #[error("invalid cluster configuration: {0}")]
    Config(String),
    /// A background task of the node panicked.
    #[error("node task failed: {0}")]
    Task(String),
}

/// Result alias of `outbox-cluster`.
pub type Result<T, E = Error> = std::result::Result<T, E>;
