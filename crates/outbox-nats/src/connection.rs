//! Connecting: one or many servers, credentials and TLS as async-nats supports them. Reconnects are
//! automatic and unbounded after the first connection; the first one fails fast with a typed error.

use std::time::Duration;

use async_nats::{Client, ConnectOptions, Event};
use tracing::{info, warn};

use crate::config::{Auth, NatsConfig};
use crate::{Error, Result};

/// Connects with `config` (validated first).
pub async fn connect(config: &NatsConfig) -> Result<Client> {
    config.validate()?;
    // A server that stops answering without closing the connection (a frozen host, a network that
    // drops everything) is taken for dead after about three pings go unanswered: a ping every publish
    // timeout leaves it within seconds for another server, where the client's minute-long default kept
    // every publish waiting out its ack for minutes, past the retries of a record.
    let mut options = ConnectOptions::new()
        .name(&config.connection_name)
        .request_timeout(Some(config.publish_timeout))
        .ping_interval(config.publish_timeout.max(Duration::from_secs(1)))
        .max_reconnects(None::<usize>)
        .event_callback(log_event(config.connection_name.clone()));
    options = match &config.auth {
        Auth::None => options,
        Auth::Token { token } => options.token(token.clone()),
        Auth::UserPassword { user, password } => options.user_and_password(user.clone(), password.clone()),
        Auth::Nkey { seed } => options.nkey(seed.clone()),
        Auth::CredentialsFile { path } => {
            options.credentials_file(path).await.map_err(|source| Error::Credentials { path: path.clone(), source })?
        }
    };
    let tls = &config.tls;
    // A certificate authority or a client certificate is given for TLS: without it the client would
    // connect in clear, credentials and all, to a server that allows it.
    if tls.required || tls.ca_file.is_some() || tls.cert_file.is_some() {
        options = options.require_tls(true);
    }
    if let Some(ca) = &tls.ca_file {
        options = options.add_root_certificates(ca.clone());
    }
    if let (Some(cert), Some(key)) = (&tls.cert_file, &tls.key_file) {
        options = options.add_client_certificate(cert.clone(), key.clone());
    }
    let servers = config.redacted_servers();
    let client =
        options.connect(&config.servers).await.map_err(|source| Error::Connect { servers: servers.clone(), source })?;
    info!(%servers, "connected to NATS");
    Ok(client)
}

/// Logs what happens to a connection. A publish the server's permissions deny is answered only by an
/// asynchronous `-ERR` on the connection, and the publish waits out its ack: without this warning the
/// reason showed only as an info line of the client's own.
fn log_event(connection: String) -> impl Fn(Event) -> std::future::Ready<()> + Send + Sync + 'static {
    move |event| {
        match &event {
            Event::Connected => info!(%connection, "NATS connection up"),
            Event::Closed | Event::Draining => info!(%connection, %event, "NATS connection"),
            Event::Disconnected | Event::LameDuckMode | Event::SlowConsumer(_) | Event::ClientError(_) => {
                warn!(%connection, %event, "NATS connection")
            }
            Event::ServerError(error) => {
                warn!(%connection, %error, "the NATS server reported an error on the connection")
            }
        }
        std::future::ready(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The file is read before any server is dialled; its error says which file.
    #[tokio::test]
    async fn a_missing_credentials_file_is_named() {
        let path = std::env::temp_dir().join("outbox-nats-no-such.creds");
        let config = NatsConfig { auth: Auth::CredentialsFile { path: path.clone() }, ..NatsConfig::default() };
        let err = connect(&config).await.unwrap_err();
        assert!(matches!(&err, Error::Credentials { path: p, .. } if *p == path), "{err:?}");
        assert!(err.to_string().contains("outbox-nats-no-such.creds"), "{err}");
    }
}
