//! Trace context end to end. Each delivery runs its handler in a span of its own (a consumer span, in
//! OpenTelemetry's messaging terms), named for the record, so logs and traces tell deliveries apart.
//! With the `opentelemetry` feature, `schedule` also writes the W3C trace context of the span it runs
//! in (`traceparent`, `tracestate`) into the record's headers, and the delivery span takes that context
//! as its parent: one trace runs from the request that scheduled a record, through the database and
//! whichever instance delivers it, into the handler (and on to NATS, which gets the headers too).

use std::borrow::Cow;

use tracing::Span;

use crate::assignment::InstanceId;
use crate::record::{Headers, Record};

/// The W3C header that carries the trace and the parent span.
pub const TRACEPARENT: &str = "traceparent";

/// `headers` with the current span's trace context added, unless they carry one already or there is
/// none (no `opentelemetry` feature, or no sampled span).
pub(crate) fn with_context(headers: &Headers) -> Cow<'_, Headers> {
    #[cfg(feature = "opentelemetry")]
    if !headers.contains_key(TRACEPARENT) {
        use opentelemetry::propagation::TextMapPropagator;
        use opentelemetry::trace::TraceContextExt;
        use tracing_opentelemetry::OpenTelemetrySpanExt;
        let context = Span::current().context();
        if context.span().span_context().is_valid() {
            let mut headers = headers.clone();
            propagator().inject_context(&context, &mut Writing(&mut headers));
            return Cow::Owned(headers);
        }
    }
    Cow::Borrowed(headers)
}

/// The span a delivery of `record` by `instance` runs in: a root, so that a trace is one record's and
/// not the processor's whole life; with the `opentelemetry` feature, a child of the context its headers
/// carry.
pub(crate) fn delivery_span(record: &Record, instance: InstanceId) -> Span {
    let span = tracing::info_span!(
        parent: None,
        "outbox.deliver",
        otel.name = %format_args!("{} process", record.event_type),
        otel.kind = "consumer",
        messaging.system = "outbox",
        messaging.operation.type = "process",
        messaging.destination.name = %record.event_type,
        messaging.message.id = %record.id,
        key = %record.key,
        partition = record.partition,
        seq = record.seq,
        %instance,
    );
    #[cfg(feature = "opentelemetry")]
    if record.headers.contains_key(TRACEPARENT) {
        use opentelemetry::propagation::TextMapPropagator;
        use tracing_opentelemetry::OpenTelemetrySpanExt;
        let _ = span.set_parent(propagator().extract(&Reading(&record.headers)));
    }
    span
}

#[cfg(feature = "opentelemetry")]
fn propagator() -> opentelemetry_sdk::propagation::TraceContextPropagator {
    opentelemetry_sdk::propagation::TraceContextPropagator::new()
}

/// Record headers as OpenTelemetry writes a carrier…
#[cfg(feature = "opentelemetry")]
struct Writing<'a>(&'a mut Headers);

#[cfg(feature = "opentelemetry")]
impl opentelemetry::propagation::Injector for Writing<'_> {
    fn set(&mut self, key: &str, value: String) {
        self.0.insert(key.to_string(), value);
    }
}

/// …and reads one.
#[cfg(feature = "opentelemetry")]
struct Reading<'a>(&'a Headers);

#[cfg(feature = "opentelemetry")]
impl opentelemetry::propagation::Extractor for Reading<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).map(String::as_str)
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(String::as_str).collect()
    }
}
