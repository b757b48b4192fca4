//! The handler seam: what delivers a record (a JetStream publisher, an HTTP call, a test sink), the
//! fallback that runs when retries are exhausted, and the router that picks both by event type.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;

use crate::record::Record;
use crate::retry::RetryPolicy;

/// A boxed error from a handler.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Whether a failed delivery may be retried.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureKind {
    /// Try again after the retry policy's delay (or the handler's retry-after).
    Retryable,
    /// Retrying cannot help (malformed record, missing route): go to the fallback at once.
    Permanent,
}

/// A failed delivery: retryable or permanent, with the cause and an optional retry-after.
#[derive(Debug)]
pub struct HandlerError {
    kind: FailureKind,
    retry_after: Option<Duration>,
    source: BoxError,
}

impl HandlerError {
    /// A failure worth retrying.
    pub fn retryable(source: impl Into<BoxError>) -> Self {
        Self { kind: FailureKind::Retryable, retry_after: None, source: source.into() }
    }

    /// A failure that no retry can fix.
    pub fn permanent(source: impl Into<BoxError>) -> Self {
        Self { kind: FailureKind::Permanent, retry_after: None, source: source.into() }
    }

    /// Asks for the next attempt after `delay` instead of the policy's delay (capped by its `max_delay`).
    pub fn with_retry_after(mut self, delay: Duration) -> Self {
        self.retry_after = Some(delay);
        self
    }

    /// Retryable or permanent.
    pub fn kind(&self) -> FailureKind {
        self.kind
    }

    /// The handler's retry-after, if it gave one.
    pub fn retry_after(&self) -> Option<Duration> {
        self.retry_after
    }
}

impl fmt::Display for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.kind {
            FailureKind::Retryable => "retryable",
            FailureKind::Permanent => "permanent",
        };
        write!(f, "{kind}: {}", self.source)
    }
}

impl std::error::Error for HandlerError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.source)
    }
}

/// Delivers one record. Called for one record of a key at a time; many keys are in flight at once.
///
/// Delivery is at least once: after a crash between delivery and completion the same record (same
/// [`Record::id`]) is delivered again, so the target should deduplicate by id.
pub trait Handler: Send + Sync + 'static {
    /// Delivers `record`; `Ok` completes it.
    fn handle(&self, record: &Record) -> impl Future<Output = Result<(), HandlerError>> + Send;
}

/// Runs when a record's retries are exhausted or its failure is permanent. `Ok` completes the record
/// (outcome `fallback`); an error leaves it FAILED.
pub trait Fallback: Send + Sync + 'static {
    /// Handles `record`, whose last delivery failed with `failure`.
    fn handle(&self, record: &Record, failure: &HandlerError) -> impl Future<Output = Result<(), HandlerError>> + Send;
}

/// Object-safe form of [`Handler`], for routing.
pub(crate) trait DynHandler: Send + Sync {
    fn handle<'a>(&'a self, record: &'a Record) -> BoxFuture<'a, Result<(), HandlerError>>;
}

impl<H: Handler> DynHandler for H {
    fn handle<'a>(&'a self, record: &'a Record) -> BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(Handler::handle(self, record))
    }
}

/// Object-safe form of [`Fallback`].
pub(crate) trait DynFallback: Send + Sync {
    fn handle<'a>(&'a self, record: &'a Record, failure: &'a HandlerError) -> BoxFuture<'a, Result<(), HandlerError>>;
}

impl<F: Fallback> DynFallback for F {
    fn handle<'a>(&'a self, record: &'a Record, failure: &'a HandlerError) -> BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(Fallback::handle(self, record, failure))
    }
}

/// A [`Handler`] from an async closure taking an owned [`Record`] (a cheap clone: the payload is shared).
pub fn handler_fn<F, Fut>(f: F) -> HandlerFn<F>
where
    F: Fn(Record) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), HandlerError>> + Send,
{
    HandlerFn(f)
}

/// See [`handler_fn`].
#[derive(Clone)]
pub struct HandlerFn<F>(F);

impl<F, Fut> Handler for HandlerFn<F>
where
    F: Fn(Record) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), HandlerError>> + Send,
{
    fn handle(&self, record: &Record) -> impl Future<Output = Result<(), HandlerError>> + Send {
        (self.0)(record.clone())
    }
}

/// A [`Fallback`] from an async closure taking the record and the failure's text.
pub fn fallback_fn<F, Fut>(f: F) -> FallbackFn<F>
where
    F: Fn(Record, String) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), HandlerError>> + Send,
{
    FallbackFn(f)
}

/// See [`fallback_fn`].
#[derive(Clone)]
pub struct FallbackFn<F>(F);

impl<F, Fut> Fallback for FallbackFn<F>
where
    F: Fn(Record, String) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), HandlerError>> + Send,
{
    fn handle(&self, record: &Record, failure: &HandlerError) -> impl Future<Output = Result<(), HandlerError>> + Send {
        (self.0)(record.clone(), failure.to_string())
    }
}

/// One route: a handler, an optional fallback, an optional retry policy (else the configured default).
#[derive(Clone)]
pub struct Route {
    pub(crate) handler: Arc<dyn DynHandler>,
    pub(crate) fallback: Option<Arc<dyn DynFallback>>,
    pub(crate) retry: Option<RetryPolicy>,
}

impl Route {
    /// A route to `handler`, without fallback, with the default retry policy.
    pub fn new(handler: impl Handler) -> Self {
        Self { handler: Arc::new(handler), fallback: None, retry: None }
    }

    /// Runs `fallback` when retries are exhausted or a failure is permanent.
    pub fn fallback(mut self, fallback: impl Fallback) -> Self {
        self.fallback = Some(Arc::new(fallback));
        self
    }

    /// Uses `policy` instead of the configured default; a policy that does not
    /// [validate](RetryPolicy::validate) (say a jitter above 1) is refused here, with the field named.
    pub fn retry(mut self, policy: RetryPolicy) -> crate::error::Result<Self> {
        policy.validate()?;
        self.retry = Some(policy);
        Ok(self)
    }
}

/// Routes by event type, with an optional catch-all.
///
/// A record whose event type has no route and no catch-all fails permanently ("no handler"), so it
/// becomes visible as FAILED instead of being dropped.
#[derive(Clone, Default)]
pub struct Handlers {
    routes: HashMap<String, Route>,
    default: Option<Route>,
}

impl Handlers {
    /// No routes yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Routes `event_type` to `handler` (no fallback, default retry policy).
    pub fn on(self, event_type: impl Into<String>, handler: impl Handler) -> Self {
        self.route(event_type, Route::new(handler))
    }

    /// Routes `event_type` to `route`.
    pub fn route(mut self, event_type: impl Into<String>, route: Route) -> Self {
        self.routes.insert(event_type.into(), route);
        self
    }

    /// Routes every event type without a route of its own to `route`.
    pub fn default_route(mut self, route: Route) -> Self {
        self.default = Some(route);
        self
    }

    pub(crate) fn get(&self, event_type: &str) -> Option<&Route> {
        self.routes.get(event_type).or(self.default.as_ref())
    }
}

impl fmt::Debug for Handlers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut types: Vec<_> = self.routes.keys().collect();
        types.sort();
        f.debug_struct("Handlers").field("routes", &types).field("default", &self.default.is_some()).finish()
    }
}
