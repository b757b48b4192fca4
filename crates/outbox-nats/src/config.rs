//! Connection, subject and stream settings: serde data with named defaults, `validate()`, and `Debug`
//! that never shows a secret.

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use outbox_core::config::MAX_DURATION;
use serde::{Deserialize, Serialize};

use crate::subject::SubjectTemplate;
use crate::{Error, Result};

/// The local server a newcomer starts.
pub const DEFAULT_SERVER: &str = "nats://127.0.0.1:4222";
/// One subject per event type under `outbox.`; `{key}` and `{partition}` are also available.
pub const DEFAULT_SUBJECT: &str = "outbox.{event_type}";
/// The stream the defaults provision.
pub const DEFAULT_STREAM: &str = "OUTBOX";
/// Longer than any takeover plus retry delay, so redeliveries after a crash are still deduplicated;
/// NATS cautions against very large windows (memory per tracked id).
pub const DEFAULT_DUPLICATE_WINDOW: Duration = Duration::from_secs(20 * 60);
/// An ack not back within 5 s (the async-nats default) is a retryable timeout.
pub const DEFAULT_PUBLISH_TIMEOUT: Duration = Duration::from_secs(5);

/// How to authenticate.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Auth {
    /// No credentials.
    #[default]
    None,
    /// A token.
    Token {
        /// The token.
        token: String,
    },
    /// User and password.
    UserPassword {
        /// User name.
        user: String,
        /// Password.
        password: String,
    },
    /// An NKey seed.
    Nkey {
        /// The seed (starts with `SU`).
        seed: String,
    },
    /// A `.creds` file (JWT + NKey).
    CredentialsFile {
        /// Path of the file.
        path: PathBuf,
    },
}

impl fmt::Debug for Auth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Auth::None => f.write_str("None"),
            Auth::Token { .. } => f.write_str("Token(<redacted>)"),
            Auth::UserPassword { user, .. } => write!(f, "UserPassword({user}, <redacted>)"),
            Auth::Nkey { .. } => f.write_str("Nkey(<redacted>)"),
            Auth::CredentialsFile { path } => write!(f, "CredentialsFile({})", path.display()),
        }
    }
}

/// TLS settings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct Tls {
    /// Refuse to connect without TLS (implied by `ca_file` or `cert_file`).
    pub required: bool,
    /// Extra root certificates (PEM).
    pub ca_file: Option<PathBuf>,
    /// Client certificate (PEM), with `key_file`.
    pub cert_file: Option<PathBuf>,
    /// Client key (PEM), with `cert_file`.
    pub key_file: Option<PathBuf>,
}

/// Storage of the provisioned stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Storage {
    /// On disk (survives server restarts).
    File,
    /// In memory.
    Memory,
}

/// The stream [`ensure_stream`](crate::ensure_stream) creates or checks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StreamSettings {
    /// Stream name.
    pub name: String,
    /// Subjects it captures; must cover every subject the template renders (`validate` refuses subjects
    /// that can capture none of them, as far as the template's tokens before its first placeholder tell).
    pub subjects: Vec<String>,
    /// File or memory.
    pub storage: Storage,
    /// Replicas (1, 3 or 5 in a cluster).
    pub replicas: usize,
    /// How long JetStream remembers message ids for deduplication; set explicitly, never the server default.
    #[serde(with = "humantime_serde")]
    pub duplicate_window: Duration,
}

impl Default for StreamSettings {
    fn default() -> Self {
        Self {
            name: DEFAULT_STREAM.into(),
            subjects: vec!["outbox.>".into()],
            storage: Storage::File,
            replicas: 1,
            duplicate_window: DEFAULT_DUPLICATE_WINDOW,
        }
    }
}

/// Everything the JetStream handler needs.
#[derive(Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NatsConfig {
    /// One or many server URLs (a cluster); URLs may carry credentials, which `Debug` hides.
    pub servers: Vec<String>,
    /// Credentials.
    pub auth: Auth,
    /// TLS.
    pub tls: Tls,
    /// Client name shown by the server.
    pub connection_name: String,
    /// Subject template: `{event_type}`, `{key}`, `{partition}`.
    pub subject: String,
    /// The stream to publish into: the one [`ensure_stream`](crate::ensure_stream) provisions. A
    /// publish goes wherever its subject leads, and any stream's ack counts as delivered: a subject
    /// another stream captures (an operator's own, on purpose or by overlap) is delivered there, so keep
    /// the template's subjects within this stream's unless that is meant. A record's own
    /// `Nats-Expected-Stream` header pins it to one stream.
    pub stream: StreamSettings,
    /// How long to wait for a publish ack, and, before a publish, for a connection that is down.
    #[serde(with = "humantime_serde")]
    pub publish_timeout: Duration,
}

impl Default for NatsConfig {
    fn default() -> Self {
        Self {
            servers: vec![DEFAULT_SERVER.into()],
            auth: Auth::None,
            tls: Tls::default(),
            connection_name: "outbox".into(),
            subject: DEFAULT_SUBJECT.into(),
            stream: StreamSettings::default(),
            publish_timeout: DEFAULT_PUBLISH_TIMEOUT,
        }
    }
}

impl fmt::Debug for NatsConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsConfig")
            .field("servers", &self.redacted_servers())
            .field("auth", &self.auth)
            .field("tls", &self.tls)
            .field("connection_name", &self.connection_name)
            .field("subject", &self.subject)
            .field("stream", &self.stream)
            .field("publish_timeout", &self.publish_timeout)
            .finish()
    }
}

impl NatsConfig {
    /// Checks the values; the error names the field.
    pub fn validate(&self) -> Result<()> {
        let bad = |msg: String| Err(Error::Config(msg));
        if self.servers.is_empty() {
            return bad("servers must list at least one URL".into());
        }
        let template = SubjectTemplate::parse(&self.subject)?;
        let stream = &self.stream;
        if stream.name.is_empty() || stream.name.contains(['.', '*', '>', ' ', '/', '\\']) {
            return bad(format!("stream.name {:?} must be non-empty without . * > / \\ or spaces", stream.name));
        }
        if stream.subjects.is_empty() {
            return bad("stream.subjects must list at least one subject".into());
        }
        // Else every publish would find no stream and every record end FAILED.
        if !stream.subjects.iter().any(|pattern| template.may_be_captured_by(pattern)) {
            return bad(format!(
                "none of stream.subjects {:?} captures a subject that subject {:?} renders",
                stream.subjects, self.subject
            ));
        }
        if !(1..=5).contains(&stream.replicas) {
            return bad(format!("stream.replicas must be within 1..=5, got {}", stream.replicas));
        }
        if stream.duplicate_window.is_zero() || stream.duplicate_window > MAX_DURATION {
            return bad(format!(
                "stream.duplicate_window must be within (0, 100 years] (deduplication is what makes redelivery safe), got {:?}",
                stream.duplicate_window
            ));
        }
        if self.publish_timeout.is_zero() || self.publish_timeout > MAX_DURATION {
            return bad(format!("publish_timeout must be within (0, 100 years], got {:?}", self.publish_timeout));
        }
        if self.tls.cert_file.is_some() != self.tls.key_file.is_some() {
            return bad("tls.cert_file and tls.key_file go together".into());
        }
        Ok(())
    }

    /// The server URLs with any user info replaced by `<redacted>`, with a scheme or without (the client
    /// takes `alice:pw@host:4222` too). Everything up to the last `@` goes: a password may hold a `/`
    /// that was not percent-encoded, and a server URL has no path to keep.
    pub fn redacted_servers(&self) -> String {
        self.servers
            .iter()
            .map(|url| {
                let start = url.find("://").map_or(0, |scheme| scheme + 3);
                match url[start..].rfind('@') {
                    Some(at) => format!("{}<redacted>{}", &url[..start], &url[start + at..]),
                    None => url.clone(),
                }
            })
            .collect::<Vec<_>>()
            .join(",")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_never_shows_secrets() {
        let config = NatsConfig {
            servers: vec!["nats://alice:hunter2@n1:4222".into(), "nats://n2:4222".into()],
            auth: Auth::UserPassword { user: "alice".into(), password: "hunter2".into() },
            ..NatsConfig::default()
        };
        let shown = format!("{config:?}");
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("nats://<redacted>@n1:4222,nats://n2:4222"), "{shown}");
        let bare = NatsConfig { servers: vec!["alice:hunter2@n1:4222".into()], ..NatsConfig::default() };
        assert_eq!(bare.redacted_servers(), "<redacted>@n1:4222");
        // A password with `/` in it (base64 passwords often have one), not percent-encoded.
        let slash = NatsConfig { servers: vec!["nats://svc:ab/cd+ef==@n1:4222".into()], ..NatsConfig::default() };
        assert_eq!(slash.redacted_servers(), "nats://<redacted>@n1:4222");
        for auth in [Auth::Token { token: "s3cret".into() }, Auth::Nkey { seed: "SUAB".into() }] {
            let shown = format!("{:?}", NatsConfig { auth, ..NatsConfig::default() });
            assert!(!shown.contains("s3cret") && !shown.contains("SUAB"), "{shown}");
        }
    }

    #[test]
    fn validate_names_the_bad_field() {
        NatsConfig::default().validate().unwrap();
        let cases: [(NatsConfig, &str); 8] = [
            // Past `Instant`'s range the client's ping timer panicked in its connection task, and a window
            // past 292 years wrapped when sent to the server.
            (NatsConfig { publish_timeout: Duration::MAX, ..Default::default() }, "publish_timeout"),
            (
                NatsConfig {
                    stream: StreamSettings {
                        duplicate_window: Duration::from_secs(600 * 365 * 86_400),
                        ..Default::default()
                    },
                    ..Default::default()
                },
                "duplicate_window",
            ),
            (NatsConfig { servers: vec![], ..Default::default() }, "servers"),
            // The stream's default subjects (`outbox.>`) capture none of these.
            (NatsConfig { subject: "events.{event_type}".into(), ..Default::default() }, "stream.subjects"),
            (NatsConfig { subject: "outbox".into(), ..Default::default() }, "stream.subjects"),
            (NatsConfig { subject: "outbox.{nope}".into(), ..Default::default() }, "{nope}"),
            (
                NatsConfig {
                    stream: StreamSettings { duplicate_window: Duration::ZERO, ..Default::default() },
                    ..Default::default()
                },
                "duplicate_window",
            ),
            (
                NatsConfig {
                    stream: StreamSettings { name: "a.b".into(), ..Default::default() },
                    ..Default::default()
                },
                "stream.name",
            ),
        ];
        for (config, field) in cases {
            let err = config.validate().unwrap_err().to_string();
            assert!(err.contains(field), "{err} should name {field}");
        }
        let own_stream = NatsConfig {
            subject: "events.{partition}.{key}".into(),
            stream: StreamSettings { subjects: vec!["other.>".into(), "events.*.*".into()], ..Default::default() },
            ..Default::default()
        };
        own_stream.validate().unwrap();
    }
}
