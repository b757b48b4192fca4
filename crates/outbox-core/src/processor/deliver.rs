//! Delivering a key's run: each record to its handler in turn (with a timeout), then the retry
//! decision and the fallback. Whatever happens, including a panic anywhere in a handler, a fallback or
//! the decision, a delivered record ends with an [`Outcome`]; only a cancelled call (its partition was
//! fenced, or the lease ran out) ends without one, and its record is delivered again.

use std::any::Any;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, error, info, warn};

use crate::assignment::{Assignment, InstanceId};
use crate::config::Config;
use crate::handler::{FailureKind, HandlerError, Handlers, Route};
use crate::partition::Partition;
use crate::record::Record;
use crate::stored::{Fetched, Outcome, Verdict};

/// Longest error text stored with a record (`last_error`), in bytes. A longer text is cut at a
/// character boundary and ends with "…"; NUL and other control characters (but newline and tab) are
/// replaced with U+FFFD, so any handler error can be stored on every backend.
pub const MAX_ERROR_BYTES: usize = 4096;

/// What a run needs besides its records.
pub(super) struct Context {
    pub(super) handlers: Arc<Handlers>,
    pub(super) config: Config,
    pub(super) assignment: watch::Receiver<Assignment>,
    pub(super) shutdown: CancellationToken,
}

/// The call a run is in, for the processor's watch over calls that do not return
/// (`State::check_overdue`): a handler that blocks its thread (a synchronous call inside an async
/// handler) can be neither timed out nor cancelled, and its key would wait without a word.
#[derive(Debug, Default)]
pub(super) struct InCall(Mutex<Option<Call>>);

#[derive(Debug, Clone, Copy)]
pub(super) struct Call {
    pub(super) record: uuid::Uuid,
    pub(super) partition: Partition,
    pub(super) instance: InstanceId,
    pub(super) started: tokio::time::Instant,
    reported: bool,
}

impl InCall {
    /// The call of `fetched`, until the value returned is dropped (the call ended, or was dropped).
    fn begin(&self, fetched: &Fetched) -> Ending<'_> {
        let (record, partition, instance) = (fetched.record.id, fetched.record.partition, fetched.instance);
        self.set(Some(Call { record, partition, instance, started: tokio::time::Instant::now(), reported: false }));
        Ending(self)
    }

    fn set(&self, call: Option<Call>) {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) = call;
    }

    /// The call under way if it has run longer than `limit`, and whether this is the first time it was
    /// found so.
    pub(super) fn overdue(&self, limit: Duration) -> Option<(Call, bool)> {
        let mut call = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let call = call.as_mut().filter(|c| c.started.elapsed() > limit)?;
        let first = !std::mem::replace(&mut call.reported, true);
        Some((*call, first))
    }
}

/// Ends the call it was returned for when dropped.
struct Ending<'a>(&'a InCall);

impl Drop for Ending<'_> {
    fn drop(&mut self) {
        self.0.set(None);
    }
}

/// Delivers a key's run one record at a time, each finished before the next starts. Before each
/// record it checks that the partition is still granted to this instance at the run's epoch and the
/// lease has not run out. Stops after a record that is not completed (a retry or FAILED: the rest must
/// wait), on shutdown (after the first record), when the grant is gone, and at once when `fenced` is
/// cancelled, dropping the handler call in progress. Returns the key and the outcomes of the records
/// it delivered and of those not reached whose calls were counted (`careful.rs`): their counts are
/// taken back, unless the partition has moved on (then the write is fenced out).
pub(super) async fn deliver_run(
    ctx: Arc<Context>,
    run: Vec<Fetched>,
    fenced: CancellationToken,
    in_call: Arc<InCall>,
) -> (String, Vec<Outcome>) {
    let key = run.first().map(|f| f.record.key.clone()).unwrap_or_default();
    let mut outcomes = Vec::with_capacity(run.len());
    let mut run = run.into_iter().peekable();
    let granted = |f: &Fetched| ctx.assignment.borrow().grants(f.instance, f.record.partition, f.record.epoch);
    // Once shutting down, no record is started after the first.
    while let Some(fetched) = run.next_if(|f| (outcomes.is_empty() || !ctx.shutdown.is_cancelled()) && granted(f)) {
        let record = &fetched.record;
        let _call = in_call.begin(&fetched);
        let (verdict, attempts) = tokio::select! {
            biased;
            () = fenced.cancelled() => {
                info!(record = %record.id, key = %record.key, partition = record.partition, instance = %fetched.instance,
                    epoch = %record.epoch, "handler call cancelled: the partition was fenced or the lease ran out; the record will be delivered again");
                break;
            }
            delivered = deliver(&ctx.handlers, &ctx.config, &fetched) => delivered,
        };
        let completed = verdict.completes();
        outcomes.push(Outcome::of(fetched, verdict, attempts));
        if !completed {
            break;
        }
    }
    outcomes.extend(not_called(run));
    (key, outcomes)
}

/// The outcomes of the records of `run` whose calls were counted but will not be made: their counts
/// taken back (`careful.rs`). A suspect stays one, its call that did not finish still its last: taken
/// back as uncalled, its next owner called it side by side with others, and counted them all again if
/// it ended that process too.
pub(super) fn not_called(run: impl IntoIterator<Item = Fetched>) -> impl Iterator<Item = Outcome> {
    run.into_iter().filter(|f| f.careful).map(|f| {
        let (attempts, verdict) = (f.record.attempts, Verdict::NotCalled { unfinished: f.unfinished });
        Outcome::of(f, verdict, attempts)
    })
}

/// Delivers one record: handler (with timeout), then retry decision, then fallback; returns the verdict
/// and the attempt count. Always returns: a panic that escapes the guarded calls (in the decision, say
/// in an error's `Display`) is a retryable failure under the route's policy, FAILED once it runs out.
async fn deliver(handlers: &Handlers, config: &Config, fetched: &Fetched) -> (Verdict, i32) {
    let record = &fetched.record;
    let span = crate::trace::delivery_span(record, fetched.instance);
    let guarded = AssertUnwindSafe(decide(handlers, config, record)).catch_unwind().instrument(span).await;
    guarded.unwrap_or_else(|panic| {
        let attempts = record.attempts.saturating_add(1);
        let failure = HandlerError::retryable(format!("delivery panicked: {}", panic_message(&*panic)));
        let policy = policy(handlers.get(&record.event_type), config);
        if policy.may_retry(u32::try_from(attempts).unwrap_or(u32::MAX)) {
            return (retry(record, attempts, policy, &failure), attempts);
        }
        error!(record = %record.id, key = %record.key, partition = record.partition, attempts, error = %failure,
            "delivery failed and its retries ran out; FAILED (the fallback is not called after a panic)");
        (Verdict::Failed { error: storable_error(&failure.to_string()) }, attempts)
    })
}

/// FAILED, if calls counted before they were made used up a suspect's retries (`careful.rs`): the
/// last one did not finish (a failure that used them up would have ended in the fallback or FAILED),
/// so the record is given up without another call, or it could end every instance that takes it on.
pub(super) fn out_of_unfinished_calls(handlers: &Handlers, config: &Config, record: &Record) -> Option<Verdict> {
    let attempts = u32::try_from(record.attempts).unwrap_or(0);
    if attempts == 0 || policy(handlers.get(&record.event_type), config).may_retry(attempts) {
        return None;
    }
    let error = format!(
        "retries ran out after {attempts} attempts, the last of which did not finish (the process ended \
         during the handler call, or the call was cancelled); FAILED without another call"
    );
    Some(failed(record, record.attempts, &error))
}

/// The route's retry policy, or the configured default.
fn policy<'a>(route: Option<&'a Route>, config: &'a Config) -> &'a crate::RetryPolicy {
    route.and_then(|r| r.retry.as_ref()).unwrap_or(&config.retry)
}

/// The verdict and the attempt count after this delivery.
async fn decide(handlers: &Handlers, config: &Config, record: &Record) -> (Verdict, i32) {
    let route = handlers.get(&record.event_type);
    let timeout = config.handler_timeout;
    let result = match route {
        None => Err(HandlerError::permanent(format!("no handler for event type {:?}", record.event_type))),
        Some(route) => call("handler", timeout, || route.handler.handle(record)).await,
    };
    let failure = match result {
        Ok(()) => return (Verdict::Delivered, record.attempts),
        Err(failure) => failure,
    };
    let attempts = record.attempts.saturating_add(1);
    let policy = policy(route, config);
    if failure.kind() == FailureKind::Retryable && policy.may_retry(u32::try_from(attempts).unwrap_or(u32::MAX)) {
        return (retry(record, attempts, policy, &failure), attempts);
    }
    (fall_back(route, timeout, record, attempts, &failure).await, attempts)
}

fn retry(record: &Record, attempts: i32, policy: &crate::RetryPolicy, failure: &HandlerError) -> Verdict {
    let retries = u32::try_from(attempts).unwrap_or(u32::MAX);
    let delay = failure.retry_after().map_or_else(|| policy.delay(record.id, retries), |d| d.min(policy.max_delay));
    warn!(record = %record.id, key = %record.key, partition = record.partition, attempts,
        retry_in = ?delay, error = %failure, "delivery failed; will retry");
    Verdict::Retry { delay, error: storable_error(&failure.to_string()) }
}

/// Retries are exhausted or the failure is permanent: the route's fallback, else FAILED.
async fn fall_back(
    route: Option<&Route>,
    timeout: Duration,
    record: &Record,
    attempts: i32,
    failure: &HandlerError,
) -> Verdict {
    let Some(fallback) = route.and_then(|r| r.fallback.as_ref()) else {
        return failed(record, attempts, &failure.to_string());
    };
    match call("fallback", timeout, || fallback.handle(record, failure)).await {
        Ok(()) => {
            info!(record = %record.id, key = %record.key, partition = record.partition, attempts,
                error = %failure, "delivery failed; the fallback handled the record");
            Verdict::Fallback
        }
        Err(fallback_failure) => failed(record, attempts, &format!("{failure}; fallback: {fallback_failure}")),
    }
}

fn failed(record: &Record, attempts: i32, error: &str) -> Verdict {
    error!(record = %record.id, key = %record.key, partition = record.partition, attempts, error,
        "record to be written FAILED; its key is blocked until an operator requeues or skips it");
    Verdict::Failed { error: storable_error(error) }
}

/// Runs one handler or fallback call with a timeout. A timeout, or a panic anywhere in the call
/// (including while `start` builds the future, before its first await), is a retryable failure that
/// carries the panic's message.
async fn call<'a>(
    what: &str,
    timeout: Duration,
    start: impl FnOnce() -> BoxFuture<'a, Result<(), HandlerError>>,
) -> Result<(), HandlerError> {
    let guarded = AssertUnwindSafe(async move { start().await }).catch_unwind();
    match tokio::time::timeout(timeout, guarded).await {
        Ok(Ok(result)) => result,
        Ok(Err(panic)) => Err(HandlerError::retryable(format!("{what} panicked: {}", panic_message(&*panic)))),
        Err(_) => Err(HandlerError::retryable(format!("{what} timed out after {timeout:?}"))),
    }
}

/// The message of a panic (`panic!("…")` payloads are `&str` or `String`).
fn panic_message(payload: &(dyn Any + Send)) -> &str {
    payload
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("a panic without a message")
}

/// `text` as it can be stored on every backend: control characters (NUL, which PostgreSQL's text
/// refuses, among them) but newline and tab replaced with U+FFFD, at most [`MAX_ERROR_BYTES`].
pub(crate) fn storable_error(text: &str) -> String {
    let mut stored: String =
        text.chars().map(|c| if c.is_control() && c != '\n' && c != '\t' { '\u{FFFD}' } else { c }).collect();
    if stored.len() > MAX_ERROR_BYTES {
        let mut end = MAX_ERROR_BYTES - '…'.len_utf8();
        while !stored.is_char_boundary(end) {
            end -= 1;
        }
        stored.truncate(end);
        stored.push('…');
    }
    stored
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::handler::{fallback_fn, handler_fn};

    #[test]
    fn stored_errors_hold_no_control_characters_and_are_capped() {
        assert_eq!(storable_error("a\0b\r\nc\td\u{1b}"), "a\u{FFFD}b\u{FFFD}\nc\td\u{FFFD}");
        let short = "é".repeat(MAX_ERROR_BYTES / 2);
        assert_eq!(storable_error(&short), short, "exactly at the limit: kept whole");
        let long = "é".repeat(MAX_ERROR_BYTES);
        let stored = storable_error(&long);
        assert!(stored.len() <= MAX_ERROR_BYTES && stored.ends_with('…'), "{}", stored.len());
        assert!(stored.starts_with("éé"));
    }

    /// A record of event type "t" delivered `attempts` times before.
    fn record(attempts: i32) -> Record {
        Record {
            id: uuid::Uuid::now_v7(),
            partition: 3,
            key: "k".into(),
            seq: 1,
            event_type: "t".into(),
            payload: Default::default(),
            headers: Default::default(),
            attempts,
            created_at: chrono::Utc::now(),
            deliver_at: None,
            epoch: crate::Epoch(1),
        }
    }

    /// A handler's retry-after is the delay, in place of the policy's, up to the policy's cap.
    #[tokio::test]
    async fn a_handlers_retry_after_sets_the_delay_up_to_the_cap() {
        let hour = Duration::from_secs(3600);
        let policy = crate::RetryPolicy::fixed(hour, 3).with_max_delay(2 * hour);
        let failing = |after: Option<Duration>| {
            let handler = handler_fn(move |_| async move {
                let failure = HandlerError::retryable("busy");
                Err(match after {
                    Some(delay) => failure.with_retry_after(delay),
                    None => failure,
                })
            });
            Handlers::new().route("t", Route::new(handler).retry(policy.clone()).unwrap())
        };
        let config = Config::default();
        for (after, delay) in
            [(None, hour), (Some(Duration::from_millis(250)), Duration::from_millis(250)), (Some(100 * hour), 2 * hour)]
        {
            let (verdict, attempts) = decide(&failing(after), &config, &record(1)).await;
            let Verdict::Retry { delay: got, error } = verdict else { panic!("{after:?}: {verdict:?}") };
            assert_eq!((got, attempts, error.as_str()), (delay, 2, "retryable: busy"), "retry-after {after:?}");
        }
    }

    /// A fallback that fails, panics or outlasts `handler_timeout` leaves the record FAILED, with both
    /// failures in its error; one that succeeds completes it.
    #[tokio::test(start_paused = true)]
    async fn a_fallback_that_fails_panics_or_hangs_leaves_the_record_failed() {
        let config = Config { handler_timeout: Duration::from_secs(5), ..Config::default() };
        type Answer = fn() -> BoxFuture<'static, Result<(), HandlerError>>;
        let cases: [(Answer, Option<&str>); 4] = [
            (|| Box::pin(async { Ok(()) }), None),
            (|| Box::pin(async { Err(HandlerError::permanent("dead letters full")) }), Some("dead letters full")),
            (|| Box::pin(async { panic!("fallback bug") }), Some("fallback panicked: fallback bug")),
            (|| Box::pin(std::future::pending()), Some("fallback timed out after 5s")),
        ];
        for (answer, failed_with) in cases {
            let rejected = handler_fn(|_| async { Err(HandlerError::permanent("malformed")) });
            let handlers = Handlers::new().route("t", Route::new(rejected).fallback(fallback_fn(move |_, _| answer())));
            let (verdict, attempts) = decide(&handlers, &config, &record(0)).await;
            assert_eq!(attempts, 1);
            match (verdict, failed_with) {
                (Verdict::Fallback, None) => {}
                (Verdict::Failed { error }, Some(text)) => {
                    assert!(error.starts_with("permanent: malformed; fallback: ") && error.contains(text), "{error}");
                }
                (verdict, expected) => panic!("{verdict:?}, expected FAILED with {expected:?}"),
            }
        }
    }

    /// Counts taken back leave each record as fetched: attempts and, for a suspect, its unfinished call.
    #[test]
    fn a_suspect_taken_back_stays_a_suspect() {
        let fetched = |unfinished| Fetched {
            record: record(2),
            instance: crate::InstanceId::new(),
            requeues: 0,
            careful: true,
            unfinished,
        };
        let outcomes: Vec<Outcome> = not_called([fetched(true), fetched(false)]).collect();
        let [suspect, other] = &outcomes[..] else { panic!("{outcomes:?}") };
        // Taken back, not retried: `outbox_records_retried_total` counts neither (it counted the suspect).
        assert!(matches!(suspect.verdict, Verdict::NotCalled { unfinished: true }), "{suspect:?}");
        assert!(matches!(other.verdict, Verdict::NotCalled { unfinished: false }), "{other:?}");
        let written = |o: &Outcome| o.verdict.still_queued().map(|q| (q.error.map(str::to_owned), q.delay, q.failed));
        let unfinished = Some(super::super::careful::UNFINISHED_CALL.to_owned());
        assert_eq!(written(suspect), Some((unfinished, Duration::ZERO, false)), "its unfinished call still its last");
        assert_eq!(written(other), Some((None, Duration::ZERO, false)));
        assert_eq!((suspect.attempts, other.attempts), (2, 2));
    }

    #[test]
    fn panic_messages_are_recovered() {
        let text = std::panic::catch_unwind(|| panic!("boom {}", 7)).unwrap_err();
        assert_eq!(panic_message(&*text), "boom 7");
        let literal = std::panic::catch_unwind(|| panic!("plain")).unwrap_err();
        assert_eq!(panic_message(&*literal), "plain");
    }
}
