//! Cluster tunables, with named defaults and `validate()`.

use std::time::Duration;

use outbox_core::config::MAX_DURATION;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Heartbeat every 2 s (the client-go lease default): cheap, and leaves several beats per stale timeout.
pub const DEFAULT_HEARTBEAT_INTERVAL: Duration = Duration::from_secs(2);
/// An instance silent for 10 s is dead and its partitions move on: five heartbeat intervals, so a GC pause
/// or a slow query is not a death.
pub const DEFAULT_STALE_TIMEOUT: Duration = Duration::from_secs(10);
/// Look for partitions to acquire every 2 s: bounds failover after a crash at stale timeout + 2 s (stale
/// timeout + 4 s on MySQL and SQLite across processes, where the leader's round and the new owner's
/// each wait their tick).
pub const DEFAULT_REBALANCE_INTERVAL: Duration = Duration::from_secs(2);

/// Tunables of a clustered node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ClusterConfig {
    /// Human-readable instance name shown in status (e.g. the pod name).
    pub name: String,
    /// How often the instance renews its lease.
    #[serde(with = "humantime_serde")]
    pub heartbeat_interval: Duration,
    /// How long after its last heartbeat (by database time) a dead instance's partitions are delivered
    /// by others. Its lease, during which it counts as live and may deliver, ends two heartbeat
    /// intervals earlier ([`ClusterConfig::lease`]); whoever takes its partitions then waits those two
    /// intervals (the time the old owner needs to notice a lease that ended early) before delivering
    /// them. Must be at least four heartbeat intervals. On MySQL keep the lease at 2 s or more: the
    /// server's limit on a transaction whose client vanished is whole seconds, and the cluster's hold
    /// other instances' rows for up to half a lease (`Node::start` warns of a shorter one).
    #[serde(with = "humantime_serde")]
    pub stale_timeout: Duration,
    /// How often ownership is reconsidered.
    #[serde(with = "humantime_serde")]
    pub rebalance_interval: Duration,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        Self {
            name: default_name(),
            heartbeat_interval: DEFAULT_HEARTBEAT_INTERVAL,
            stale_timeout: DEFAULT_STALE_TIMEOUT,
            rebalance_interval: DEFAULT_REBALANCE_INTERVAL,
        }
    }
}

fn default_name() -> String {
    std::env::var("HOSTNAME")
        .ok()
        .filter(|name| !name.is_empty())
        .unwrap_or_else(|| format!("pid-{}", std::process::id()))
}

/// Longest instance name: every backend's column holds it (MySQL's is `VARCHAR(256)`).
const MAX_NAME_CHARS: usize = 256;

impl ClusterConfig {
    /// Checks values and their relations; the error names the field.
    pub fn validate(&self) -> Result<()> {
        let bad = |msg: String| Err(Error::Config(msg));
        for (name, value) in [
            ("heartbeat_interval", self.heartbeat_interval),
            ("stale_timeout", self.stale_timeout),
            ("rebalance_interval", self.rebalance_interval),
        ] {
            if value < Duration::from_millis(10) || value > MAX_DURATION {
                return bad(format!("{name} must be within 10ms..=100 years, got {value:?}"));
            }
        }
        if self.name.is_empty() || self.name.chars().count() > MAX_NAME_CHARS || self.name.contains(char::is_control) {
            return bad(format!(
                "name must be 1..={MAX_NAME_CHARS} characters without control characters, got {:?}",
                self.name
            ));
        }
        if self.heartbeat_interval.checked_mul(4).is_none_or(|four| self.stale_timeout < four) {
            return bad(format!(
                "stale_timeout ({:?}) must be at least four times heartbeat_interval ({:?}): the lease lasts stale_timeout \
                 minus two heartbeat intervals, and must outlast one late heartbeat",
                self.stale_timeout, self.heartbeat_interval
            ));
        }
        Ok(())
    }

    /// How long a renewal keeps the instance live (and delivering): `stale_timeout` minus two heartbeat
    /// intervals. Once a lease has expired it is never renewed: the instance fences itself and registers
    /// again under a new id, and others may take its partitions.
    pub fn lease(&self) -> Duration {
        self.stale_timeout.saturating_sub(self.heartbeat_interval * 2)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_relations_are_checked() {
        ClusterConfig::default().validate().unwrap();
        let config = ClusterConfig { stale_timeout: Duration::from_millis(7900), ..Default::default() };
        let err = config.validate().unwrap_err().to_string();
        assert!(err.contains("stale_timeout") && err.contains("heartbeat_interval"), "{err}");
        let config = ClusterConfig { stale_timeout: Duration::from_secs(8), ..Default::default() };
        config.validate().unwrap();
        assert_eq!(config.lease(), Duration::from_secs(4));
        let config = ClusterConfig { heartbeat_interval: Duration::MAX, ..Default::default() };
        assert!(config.validate().unwrap_err().to_string().contains("heartbeat_interval"), "no overflow panic");
        for config in [
            ClusterConfig { stale_timeout: Duration::MAX, ..Default::default() },
            ClusterConfig { rebalance_interval: MAX_DURATION + Duration::from_secs(1), ..Default::default() },
        ] {
            let err = config.validate().unwrap_err().to_string();
            assert!(err.contains("100 years"), "{err}");
        }
        for name in [String::new(), "x".repeat(257), "pod\0-1".into()] {
            let config = ClusterConfig { name: name.clone(), ..Default::default() };
            assert!(config.validate().unwrap_err().to_string().contains("name"), "{name:?} accepted");
        }
    }
}
