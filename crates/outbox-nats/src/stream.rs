//! Stream provisioning: create the stream, or check that the existing one matches the configuration
//! (subjects, storage, replicas, duplicate window; neither `no_ack` nor sealed) and say precisely what
//! differs. Uses only settings
//! nats-server 2.9 knows, so it works there and on newer servers.

use async_nats::Client;
use async_nats::jetstream::{self, stream};
use tracing::info;

use crate::config::{Storage, StreamSettings};
use crate::{Error, Result};

/// Creates the stream if missing, else checks it; returns its info.
pub async fn ensure_stream(client: &Client, settings: &StreamSettings) -> Result<stream::Info> {
    let js = jetstream::new(client.clone());
    let name = settings.name.clone();
    let failed = |message: String, refused: bool| Error::Stream { stream: name.clone(), message, refused };
    let wanted = stream::Config {
        name: settings.name.clone(),
        subjects: settings.subjects.clone(),
        storage: match settings.storage {
            Storage::File => stream::StorageType::File,
            Storage::Memory => stream::StorageType::Memory,
        },
        num_replicas: settings.replicas,
        duplicate_window: settings.duplicate_window,
        ..Default::default()
    };
    match js.get_stream(&settings.name).await {
        Ok(existing) => checked(existing, &wanted).await,
        Err(e) if is_not_found(&e) => match js.create_stream(wanted.clone()).await {
            Ok(mut created) => {
                info!(stream = %settings.name, subjects = ?settings.subjects, "created JetStream stream");
                Ok(created.info().await.map_err(|e| failed(e.to_string(), false))?.clone())
            }
            // Workers started together race to create it, and the losers' create is refused (nats-server
            // 2.9 answers a subject overlap with the stream just made): the stream there is checked.
            Err(e) => match js.get_stream(&settings.name).await {
                Ok(existing) => checked(existing, &wanted).await,
                Err(_) => {
                    use jetstream::context::CreateStreamErrorKind as Kind;
                    let refused = match e.kind() {
                        Kind::JetStream(js) => refuses_for_good(js.error_code()),
                        Kind::EmptyStreamName | Kind::InvalidStreamName | Kind::DomainAndExternalSet => true,
                        _ => false,
                    };
                    Err(failed(format!("cannot create: {e}"), refused))
                }
            },
        },
        Err(e) => {
            use jetstream::context::GetStreamErrorKind as Kind;
            let refused = match e.kind() {
                Kind::JetStream(js) => refuses_for_good(js.error_code()),
                Kind::EmptyName | Kind::InvalidStreamName => true,
                Kind::Request => false,
            };
            Err(failed(e.to_string(), refused))
        }
    }
}

/// The existing stream's info, or what in it differs from the configuration.
async fn checked(mut existing: stream::Stream, wanted: &stream::Config) -> Result<stream::Info> {
    let failed = |message: String| Error::Stream { stream: wanted.name.clone(), message, refused: false };
    let info = existing.info().await.map_err(|e| failed(e.to_string()))?.clone();
    let differences = differences(wanted, &info.config);
    if !differences.is_empty() {
        return Err(Error::StreamMismatch { stream: wanted.name.clone(), differences });
    }
    Ok(info)
}

/// Whether the server's answer holds whatever the retries: the settings clash with another stream or
/// the server's own (not clustered, no JetStream), or are invalid.
fn refuses_for_good(code: jetstream::ErrorCode) -> bool {
    use jetstream::ErrorCode as C;
    [
        C::STREAM_SUBJECT_OVERLAP,
        C::STREAM_REPLICAS_NOT_SUPPORTED,
        C::STREAM_INVALID_CONFIG,
        C::STREAM_NAME_EXIST,
        C::JETSTREAM_NOT_ENABLED,
        C::JETSTREAM_NOT_ENABLED_FOR_ACCOUNT,
    ]
    .contains(&code)
}

pub(crate) fn is_not_found(e: &jetstream::context::GetStreamError) -> bool {
    matches!(e.kind(), jetstream::context::GetStreamErrorKind::JetStream(js)
        if js.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND)
}

fn differences(wanted: &stream::Config, actual: &stream::Config) -> Vec<String> {
    let mut out = Vec::new();
    let (mut w, mut a) = (wanted.subjects.clone(), actual.subjects.clone());
    w.sort();
    a.sort();
    if w != a {
        out.push(format!("subjects: configured {w:?}, stream has {a:?}"));
    }
    if wanted.storage != actual.storage {
        out.push(format!("storage: configured {:?}, stream has {:?}", wanted.storage, actual.storage));
    }
    if wanted.num_replicas != actual.num_replicas {
        out.push(format!("replicas: configured {}, stream has {}", wanted.num_replicas, actual.num_replicas));
    }
    // Set by an operator on an existing stream: with either, no publish is ever acknowledged, so every
    // record would be retried until FAILED although the messages may be stored.
    if actual.no_ack {
        out.push("no_ack: the stream acknowledges no publish".into());
    }
    if actual.sealed {
        out.push("sealed: the stream takes no more messages".into());
    }
    if wanted.duplicate_window != actual.duplicate_window {
        out.push(format!(
            "duplicate_window: configured {:?}, stream has {:?}",
            wanted.duplicate_window, actual.duplicate_window
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stream that never acknowledges a publish, or takes none, is named as differing.
    #[test]
    fn a_stream_that_acknowledges_nothing_differs() {
        let wanted = stream::Config { name: "OUTBOX".into(), ..Default::default() };
        assert!(differences(&wanted, &wanted).is_empty());
        let silent = stream::Config { no_ack: true, sealed: true, ..wanted.clone() };
        let found = differences(&wanted, &silent);
        assert!(
            found.iter().any(|d| d.starts_with("no_ack")) && found.iter().any(|d| d.starts_with("sealed")),
            "{found:?}"
        );
    }
}
