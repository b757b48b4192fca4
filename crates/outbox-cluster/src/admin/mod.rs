//! The operator's page and its JSON API (feature `admin`): a router a service mounts on its own port
//! or under its own path.
//!
//! - `GET /`: one page (HTML, CSS and JS embedded in the binary): the 256 partitions as a 16 × 16 grid
//!   coloured by owner and shaded by backlog, the instances with their heartbeat age and delivered/s,
//!   delivered/s and backlog over the last minutes, and the FAILED records with requeue and skip.
//! - `GET /api/status`, `GET /api/partitions`, `GET /api/failed`: what the page shows ([`StatusView`],
//!   [`PartitionView`], [`FailedPage`]).
//! - `POST /api/failed/{id}/requeue`, `POST /api/failed/{id}/skip`, `POST /api/requeue` (a key's FAILED
//!   records, or all), `POST /api/purge`: each needs `Authorization: Bearer <token>` naming one of the configured
//!   tokens ([`AdminConfig::tokens`]), and is logged with that token's name. Without tokens the page is
//!   read-only. Payloads, when shown at all ([`AdminConfig::show_payloads`]), go only to a `GET
//!   /api/failed?payloads=true` with a token. Reading needs no token: keys and error texts (which may
//!   quote a payload's fields) go to whoever reaches the router, so mount it where only operators do. The token travels in a header, never a cookie, so a form on another site cannot use it.
//!
//! ```no_run
//! # async fn demo(pool: sqlx::PgPool, outbox: outbox_core::Outbox) -> Result<(), Box<dyn std::error::Error>> {
//! use outbox_cluster::admin::{Admin, AdminConfig};
//! let admin = Admin::new(outbox, pool, AdminConfig::default())?;
//! let listener = tokio::net::TcpListener::bind(outbox_cluster::admin::DEFAULT_ADDR).await?;
//! axum::serve(listener, admin.router()).await?;
//! # Ok(()) }
//! ```

mod api;
mod auth;
mod error;
mod snapshot;

use std::collections::BTreeMap;
use std::fmt;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::sync::Arc;

use axum::Router;
use axum::http::header;
use axum::middleware;
use axum::response::{Html, IntoResponse};
use axum::routing::{get, post};
use outbox_core::{Db, Outbox};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

pub use api::{Backlog, FailedPage, FailedView, InstanceView, PartitionView, Sample, StatusView};

/// Where the demo serves the page when no address is given: loopback only.
pub const DEFAULT_ADDR: SocketAddr = SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 9188));

/// Tokens shorter than this are refused: a guessable token is no lock.
pub const MIN_TOKEN_LEN: usize = 16;

/// What the page may do and show.
#[derive(Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdminConfig {
    /// Bearer tokens allowed to requeue, skip and purge, by name (the name is what the log shows). None:
    /// the page is read-only.
    pub tokens: BTreeMap<String, String>,
    /// Whether FAILED records' payloads are shown (they may hold personal data): only to a request that
    /// carries one of the tokens and asks for them (`payloads=true`; the page asks when the operator
    /// ticks "payloads", not at every refresh), and each such read is logged with the token's name.
    pub show_payloads: bool,
    /// Host names the page may be reached by, besides IP addresses and `localhost`: a request naming
    /// any other host is refused, so a web page whose name an attacker points at 127.0.0.1 (DNS
    /// rebinding) cannot read the API from the operator's browser. Bare names (`ops.example.com`): no
    /// scheme, port or path.
    pub hosts: Vec<String>,
}

impl fmt::Debug for AdminConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AdminConfig")
            .field("tokens", &self.tokens.keys().collect::<Vec<_>>())
            .field("show_payloads", &self.show_payloads)
            .field("hosts", &self.hosts)
            .finish()
    }
}

impl AdminConfig {
    /// Every token named, visible ASCII (all a header carries), at least [`MIN_TOKEN_LEN`] characters,
    /// and no two alike; payloads shown only with a token to show them to.
    pub fn validate(&self) -> Result<()> {
        for (name, token) in &self.tokens {
            if name.trim().is_empty() {
                return Err(Error::Config("admin.tokens: a token has an empty name".into()));
            }
            if token.contains(char::is_whitespace) {
                return Err(Error::Config(format!("admin.tokens.{name}: holds white space")));
            }
            if !token.bytes().all(|b| b.is_ascii_graphic()) {
                return Err(Error::Config(format!(
                    "admin.tokens.{name}: holds a character other than visible ASCII, which no request header carries"
                )));
            }
            if token.chars().count() < MIN_TOKEN_LEN {
                return Err(Error::Config(format!("admin.tokens.{name}: shorter than {MIN_TOKEN_LEN} characters")));
            }
        }
        let distinct: std::collections::BTreeSet<&String> = self.tokens.values().collect();
        if distinct.len() != self.tokens.len() {
            return Err(Error::Config("admin.tokens: two names share one token".into()));
        }
        // A name as a request's `Host` carries it, without its port: anything else never matches.
        for host in &self.hosts {
            let name = host.trim_end_matches('.');
            if name.is_empty() || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b"-._".contains(&b)) {
                return Err(Error::Config(format!(
                    "admin.hosts: {host:?} is not a bare host name (letters, digits, '-', '_' and '.'; no scheme, port or path)"
                )));
            }
        }
        if self.show_payloads && self.tokens.is_empty() {
            return Err(Error::Config(
                "admin.show_payloads: payloads are shown only to a request with a token; configure admin.tokens".into(),
            ));
        }
        Ok(())
    }

    /// Whether no token is configured: nothing can be changed through the page.
    pub fn read_only(&self) -> bool {
        self.tokens.is_empty()
    }
}

/// The page and its API over one outbox and database.
#[derive(Clone)]
pub struct Admin {
    inner: Arc<Inner>,
}

struct Inner {
    outbox: Outbox,
    db: Db,
    config: AdminConfig,
    snapshots: snapshot::Snapshots,
}

impl Admin {
    /// Validates `config`.
    pub fn new(outbox: Outbox, db: impl Into<Db>, config: AdminConfig) -> Result<Admin> {
        config.validate()?;
        Ok(Admin {
            inner: Arc::new(Inner { outbox, db: db.into(), config, snapshots: snapshot::Snapshots::default() }),
        })
    }

    /// The routes, to serve as they are or to `nest` under a path of the service's own (the page
    /// addresses the API relative to itself).
    pub fn router(self) -> Router {
        Router::new()
            .route("/", get(page))
            .route("/api/status", get(api::status))
            .route("/api/partitions", get(api::partitions))
            .route("/api/failed", get(api::failed))
            .route("/api/failed/{id}/{action}", post(api::resolve))
            .route("/api/requeue", post(api::requeue_many))
            .route("/api/purge", post(api::purge))
            .layer(middleware::map_response(not_stored))
            .layer(middleware::from_fn_with_state(self.clone(), auth::known_host))
            .with_state(self)
    }
}

/// An answer of the API (FAILED records may carry payloads with personal data) is kept in no cache,
/// the browser's disk included; the page says how it is cached itself.
async fn not_stored(mut response: axum::response::Response) -> axum::response::Response {
    response.headers_mut().entry(header::CACHE_CONTROL).or_insert(header::HeaderValue::from_static("no-store"));
    response
}

/// The page, which no other site may frame (a framed page could trick a click onto requeue or skip).
async fn page() -> impl IntoResponse {
    let headers = [
        (header::CONTENT_SECURITY_POLICY, "frame-ancestors 'none'"),
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        (header::CACHE_CONTROL, "no-cache"),
    ];
    (headers, Html(include_str!("page.html")))
}
