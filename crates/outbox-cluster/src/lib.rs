//! # outbox-cluster
//!
//! Runs the outbox processor inside every instance of a service: the instance registers and heartbeats
//! into the instances table (`registry.rs`), acquires and releases partitions with an epoch that grows on
//! every change of owner (`ownership.rs`), and hands its partitions to the processor ([`node`]).
//!
//! Every `rebalance_interval` the leader (the live instance with the smallest id) computes balanced,
//! sticky targets ([`rebalance`]); owners release partitions targeted elsewhere once nothing of theirs is
//! in flight, and the targeted instance then acquires them (release-before-acquire). A crashed
//! instance's partitions are taken once its lease has expired by database time.
//!
//! Runs on every database of [`outbox_core::Db`] this crate is built with (features `postgres`,
//! `sqlite` and `mysql`); each one's statements and their execution are in `driver/<name>.rs`, behind
//! the one interface of `driver/mod.rs`.
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

#[cfg(feature = "admin")]
pub mod admin;
pub mod config;
mod driver;
pub mod error;
pub mod node;
mod ownership;
pub mod rebalance;
mod registry;
pub mod status;
mod stored;

pub use config::ClusterConfig;
pub use error::{Error, Result};
pub use node::Node;
pub use status::{ClusterStatus, InstanceInfo, PartitionRow, status};
