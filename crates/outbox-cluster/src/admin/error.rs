//! The API's errors: a status and a JSON `{"error": …}` the page shows.

use axum::Json;
use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use std::time::Duration;

use tracing::warn;

/// An API error: its status and a JSON `{"error": …}` the page shows.
#[derive(Debug)]
pub(super) enum ApiError {
    ReadOnly,
    Unauthenticated,
    Forbidden,
    BadRequest(String),
    NotFound(String),
    /// The database failed: the detail goes to the log, not to a client that may hold no token.
    Unavailable(String),
    /// The database did not answer in time.
    TimedOut,
    /// The last read of the cluster and its backlog was given up at its time limit; the next is not
    /// tried until this much later.
    Resting(std::time::Duration),
    /// The request named a host the page is not known by.
    UnknownHost(String),
    /// A query, path or body axum could not read: its status (400, 415, 422) and reason, in the
    /// API's JSON like every other error.
    Unreadable(StatusCode, String),
}

impl From<QueryRejection> for ApiError {
    fn from(r: QueryRejection) -> Self {
        ApiError::Unreadable(r.status(), r.body_text())
    }
}

impl From<PathRejection> for ApiError {
    fn from(r: PathRejection) -> Self {
        ApiError::Unreadable(r.status(), r.body_text())
    }
}

impl From<JsonRejection> for ApiError {
    fn from(r: JsonRejection) -> Self {
        ApiError::Unreadable(r.status(), r.body_text())
    }
}

impl From<outbox_core::Error> for ApiError {
    fn from(e: outbox_core::Error) -> Self {
        match e {
            e @ outbox_core::Error::RecordNotFound { .. } => ApiError::NotFound(e.to_string()),
            e @ (outbox_core::Error::EmptyKey
            | outbox_core::Error::KeyTooLong { .. }
            | outbox_core::Error::BadKey { .. }
            | outbox_core::Error::BadLimit { .. }
            | outbox_core::Error::Config(_)) => ApiError::BadRequest(e.to_string()),
            e => ApiError::Unavailable(e.to_string()),
        }
    }
}

impl ApiError {
    /// The error of a change that failed, its log line saying who asked for what (`change`): the
    /// change may have been made in part, as a purge that failed pruning keys after purging records.
    pub(super) fn of_change(self, change: impl FnOnce() -> String) -> Self {
        match self {
            ApiError::Unavailable(m) => ApiError::Unavailable(format!("{}: {m}", change())),
            other => other,
        }
    }
}

impl From<crate::Error> for ApiError {
    fn from(e: crate::Error) -> Self {
        match e {
            crate::Error::Core(core) => core.into(),
            other => ApiError::Unavailable(other.to_string()),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, message) = match self {
            ApiError::ReadOnly => (
                StatusCode::FORBIDDEN,
                "read-only: no admin token is configured, so nothing can be changed here".into(),
            ),
            ApiError::Unauthenticated => {
                (StatusCode::UNAUTHORIZED, "an admin token is required (Authorization: Bearer …)".into())
            }
            ApiError::Forbidden => {
                (StatusCode::FORBIDDEN, "the admin token is not one of the configured tokens".into())
            }
            ApiError::BadRequest(m) => (StatusCode::BAD_REQUEST, m),
            ApiError::NotFound(m) => (StatusCode::NOT_FOUND, m),
            ApiError::Unavailable(m) => {
                warn!(error = %m, "admin request failed");
                (StatusCode::SERVICE_UNAVAILABLE, "the outbox database failed; this service's log says how".into())
            }
            ApiError::UnknownHost(name) => (
                StatusCode::FORBIDDEN,
                format!("this page is not served as {name:?}: add it to the admin configuration's hosts"),
            ),
            ApiError::Unreadable(status, m) => (status, m),
            ApiError::TimedOut => {
                warn!("admin request timed out waiting for the database");
                (StatusCode::SERVICE_UNAVAILABLE, "the outbox database did not answer in time".into())
            }
            ApiError::Resting(left) => (
                StatusCode::SERVICE_UNAVAILABLE,
                format!(
                    "the last read of the backlog did not finish in time (the database may still be counting); the next is tried in {}",
                    humantime::format_duration(Duration::from_secs(left.as_secs().max(1)))
                ),
            ),
        };
        let mut response = (status, Json(serde_json::json!({ "error": message }))).into_response();
        if status == StatusCode::UNAUTHORIZED {
            response.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}
