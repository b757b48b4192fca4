//! The one error type of `outbox-cluster`: a database error travels inside [`Error::Core`], so "not
//! migrated" and "transient" are decided once, by `outbox-core`.

/// Errors of `outbox-cluster`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// From the outbox core (configuration, processor), and every database error
    /// ([`outbox_core::Error::Database`]).
    #[error(transparent)]
    Core(#[from] outbox_core::Error),
    /// The database is of a backend this crate was built without (enable its feature).
    #[error("outbox-cluster was built without the {backend} driver: enable its feature {backend:?}")]
    BackendNotBuilt {
        /// The backend of the database given.
        backend: &'static str,
    },
    /// Invalid cluster configuration; the message names the field.
    #[error("invalid cluster configuration: {0}")]
    Config(String),
    /// A background task of the node panicked.
    #[error("node task failed: {0}")]
    Task(String),
}

impl Error {
    /// Whether retrying the same operation later may succeed (see [`outbox_core::Error::is_transient`]).
    pub fn is_transient(&self) -> bool {
        matches!(self, Error::Core(e) if e.is_transient())
    }

    /// A missing schema or table as [`outbox_core::Error::NotMigrated`], which says what to do.
    pub(crate) fn not_migrated(self, outbox: &outbox_core::Outbox) -> Error {
        match self {
            Error::Core(e) => Error::Core(e.not_migrated_in(&outbox.config().schema)),
            other => other,
        }
    }
}

impl From<sqlx::Error> for Error {
    fn from(e: sqlx::Error) -> Self {
        Error::Core(e.into())
    }
}

/// Result alias of `outbox-cluster`.
pub type Result<T, E = Error> = std::result::Result<T, E>;
