//! Cluster tunables, with named defaults and `validate()`.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// Heartbeat every 2 s (the client-go lease default): cheap, and leaves several beats per stale timeout.
pub const DEFAULT_HEARTBEAT_INTERVAL: Duration = Duration::from_secs(2);
/// An instance silent for 10 s is dead: five missed heartbeats, so a GC pause or a slow query is not a death.
pub const DEFAULT_STALE_TIMEOUT: Duration = Duration::from_secs(10);
/// Look for partitions to acquire every 2 s: bounds takeover time after a crash at stale timeout + 2 s.
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
    /// Lease length: an instance whose last heartbeat is older (by database time) is dead, and an
    /// instance that could not renew within it stops processing on its own.
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
    std::env::var("HOSTNAME").unwrap_or_else(|_| format!("pid-{}", std::process::id()))
}

impl ClusterConfig {
    /// Checks values and their relations; the error names the field.
    pub fn validate(&self) -> Result<()> {
        let bad = |msg: String| Err(Error::Config(msg));
        for (name, value) in [
            ("heartbeat_interval", self.heartbeat_interval),
            ("stale_timeout", self.stale_timeout),
            ("rebalance_interval", self.rebalance_interval),
        ] {
            if value < Duration::from_millis(10) {
                return bad(format!("{name} must be at least 10ms, got {value:?}"));
            }
        }
        if self.stale_timeout <= self.heartbeat_interval * 2 {
            return bad(format!(
                "stale_timeout ({:?}) must be more than twice heartbeat_interval ({:?}), or one late heartbeat looks like a death",
                self.stale_timeout, self.heartbeat_interval
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_relations_are_checked() {
        ClusterConfig::default().validate().unwrap();
        let config = ClusterConfig { stale_timeout: Duration::from_secs(3), ..Default::default() };
        let err = config.validate().unwrap_err().to_string();
        assert!(err.contains("stale_timeout") && err.contains("heartbeat_interval"), "{err}");
    }
}
