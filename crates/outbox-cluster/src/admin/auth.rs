//! Who may change anything or read payloads: the bearer token of the request, matched against the
//! configured tokens in constant time; and by which host names the page may be reached at all.

use std::net::IpAddr;

use axum::extract::{FromRequestParts, OptionalFromRequestParts, Request, State};
use axum::http::header::{AUTHORIZATION, HOST};
use axum::http::request::Parts;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;
use tracing::warn;

use super::Admin;
use super::error::ApiError;

/// The name of the token a request carried: every change needs one, and so does reading payloads.
pub(super) struct Operator(pub(super) String);

impl FromRequestParts<Admin> for Operator {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, admin: &Admin) -> Result<Self, Self::Rejection> {
        if admin.inner.config.tokens.is_empty() {
            return Err(ApiError::ReadOnly);
        }
        match operator(parts, admin)? {
            Some(operator) => Ok(operator),
            None => {
                warn!(method = %parts.method, path = %parts.uri.path(), "admin: change refused, no token");
                Err(ApiError::Unauthenticated)
            }
        }
    }
}

/// A request without a token is no operator's, nor is any request to a read-only page (a token it
/// carries is ignored); one with a token that is not configured is refused.
impl OptionalFromRequestParts<Admin> for Operator {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, admin: &Admin) -> Result<Option<Self>, Self::Rejection> {
        if admin.inner.config.tokens.is_empty() {
            return Ok(None);
        }
        operator(parts, admin)
    }
}

/// The configured token the request's bearer token matches, if it carries one.
fn operator(parts: &Parts, admin: &Admin) -> Result<Option<Operator>, ApiError> {
    let given = parts
        .headers
        .get(AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, token)| token.trim())
        .filter(|token| !token.is_empty());
    let Some(given) = given else { return Ok(None) };
    // Every token is compared, so the time taken says nothing about which one nearly matched; and as
    // digests of one length, since comparing slices of different lengths returns at once.
    let given = Sha256::digest(given.as_bytes());
    let mut found = None;
    for (name, token) in &admin.inner.config.tokens {
        if bool::from(Sha256::digest(token.as_bytes()).as_slice().ct_eq(given.as_slice())) {
            found = Some(name.clone());
        }
    }
    match found {
        Some(name) => Ok(Some(Operator(name))),
        None => {
            warn!(method = %parts.method, path = %parts.uri.path(), "admin: request refused, unknown token");
            Err(ApiError::Forbidden)
        }
    }
}

/// Refuses a request whose `Host` is a name other than `localhost` or one of [`AdminConfig::hosts`]
/// (IP addresses pass: a rebound name never arrives as one). No `Host` at all (not a browser) passes.
///
/// [`AdminConfig::hosts`]: super::AdminConfig::hosts
pub(super) async fn known_host(State(admin): State<Admin>, request: Request, next: Next) -> Response {
    let host = request.headers().get(HOST).map(|h| h.to_str().unwrap_or_default().to_ascii_lowercase());
    if let Some(host) = host {
        let name = match host.strip_prefix('[') {
            Some(v6) => v6.split(']').next().unwrap_or_default(),
            None => host.rsplit_once(':').map_or(host.as_str(), |(name, port)| {
                if port.bytes().all(|b| b.is_ascii_digit()) { name } else { host.as_str() }
            }),
        };
        // A fully qualified name may end in a dot, in the request or in the configuration.
        let bare = name.trim_end_matches('.');
        let known = name.parse::<IpAddr>().is_ok()
            || bare == "localhost"
            || admin.inner.config.hosts.iter().any(|h| h.trim_end_matches('.').eq_ignore_ascii_case(bare));
        if !known {
            warn!(host = %name, path = %request.uri().path(), "admin: request for an unknown host refused");
            return ApiError::UnknownHost(name.to_string()).into_response();
        }
    }
    next.run(request).await
}
