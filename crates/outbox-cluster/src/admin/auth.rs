//! Who may change anything: the bearer token of a mutating request, matched against the configured
//! tokens in constant time.

use axum::extract::FromRequestParts;
use axum::http::header::AUTHORIZATION;
use axum::http::request::Parts;
use subtle::ConstantTimeEq;

use super::Admin;
use super::error::ApiError;

/// The name of the token a mutating request carried.
pub(super) struct Operator(pub(super) String);

impl FromRequestParts<Admin> for Operator {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, admin: &Admin) -> Result<Self, Self::Rejection> {
        let tokens = &admin.inner.config.tokens;
        if tokens.is_empty() {
            return Err(ApiError::ReadOnly);
        }
        let given = parts
            .headers
            .get(AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim)
            .ok_or(ApiError::Unauthenticated)?;
        // Every token is compared, so the time taken says nothing about which one nearly matched.
        let mut found = None;
        for (name, token) in tokens {
            if bool::from(token.as_bytes().ct_eq(given.as_bytes())) {
                found = Some(name.clone());
            }
        }
        found.map(Operator).ok_or(ApiError::Forbidden)
    }
}
