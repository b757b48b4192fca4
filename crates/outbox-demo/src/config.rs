//! Configuration: a TOML file with `[outbox]`, `[cluster]` and `[nats]` sections (all optional, all
//! defaulted), overridden by flags and the environment (`DATABASE_URL`, `NATS_URL`, `OUTBOX_*`).

use std::path::Path;

use outbox_cluster::ClusterConfig;
use outbox_cluster::admin::AdminConfig;
use outbox_core::Config;
use outbox_nats::NatsConfig;
use serde::{Deserialize, Serialize};

/// An admin token from the environment (named after the variable in the log), beside the file's.
pub const ADMIN_TOKEN_ENV: &str = "OUTBOX_ADMIN_TOKEN";

/// The whole configuration file.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DemoConfig {
    /// Outbox and processor tunables.
    pub outbox: Config,
    /// Cluster tunables.
    pub cluster: ClusterConfig,
    /// NATS connection, subject and stream.
    pub nats: NatsConfig,
    /// The operator's page (`worker --admin-addr`): tokens allowed to change things, payloads shown.
    pub admin: AdminConfig,
    /// Whether events go to NATS: a `[nats]` section or a NATS URL was given (otherwise: the local sink).
    #[serde(skip)]
    pub use_nats: bool,
}

impl DemoConfig {
    /// Reads `path` if given (defaults otherwise), applies `nats_url`, and validates everything.
    pub fn load(path: Option<&Path>, nats_url: Option<&str>) -> Result<Self, String> {
        let mut config = match path {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
                let mut config: DemoConfig =
                    toml::from_str(&text).map_err(|e| format!("bad configuration in {}: {e}", path.display()))?;
                let table: toml::Table =
                    text.parse().map_err(|e| format!("bad configuration in {}: {e}", path.display()))?;
                config.use_nats = table.contains_key("nats");
                config
            }
            None => DemoConfig::default(),
        };
        if let Some(url) = nats_url {
            config.nats.servers = url.split(',').map(str::trim).map(String::from).collect();
            config.use_nats = true;
        }
        config.outbox.validate().map_err(|e| e.to_string())?;
        config.cluster.validate().map_err(|e| e.to_string())?;
        if let Ok(token) = std::env::var(ADMIN_TOKEN_ENV) {
            config.admin.tokens.insert(ADMIN_TOKEN_ENV.into(), token);
        }
        config.nats.validate().map_err(|e| e.to_string())?;
        config.admin.validate().map_err(|e| e.to_string())?;
        // A record whose publish was stored but whose ack was lost is published again by a later
        // attempt (perhaps the last of its retries, the ones between failing before they were sent
        // during an outage), or by the next owner after a takeover; only within the window does the
        // stream drop it.
        let window = config.nats.stream.duplicate_window;
        for (name, after) in [
            (
                "the retries' span (outbox.retry's delays and a nats.publish_timeout per attempt)",
                config.outbox.retry.longest_span(config.nats.publish_timeout),
            ),
            ("cluster.stale_timeout", config.cluster.stale_timeout),
        ] {
            if config.use_nats && after >= window {
                return Err(format!(
                    "nats.stream.duplicate_window ({}) must be longer than {name} ({}): a record published again \
                     after the window lands in the stream twice",
                    humantime::format_duration(window),
                    humantime::format_duration(after)
                ));
            }
        }
        Ok(config)
    }
}
