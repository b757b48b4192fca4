//! Trace context end to end (feature `opentelemetry`): a record scheduled inside a traced span carries
//! its W3C context, and the worker process that delivers it runs the handler in a consumer span of the
//! same trace, a child of the producer's span.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[macro_use]
mod common;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;
use opentelemetry::trace::TraceContextExt;
use outbox_core::NewRecord;
use outbox_tests::process::Process;
use outbox_tests::spans::{self, Recorder};
use tracing::Instrument;
use tracing::instrument::WithSubscriber;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;

every_backend!(a_delivery_in_another_process_continues_the_producers_trace);

async fn a_delivery_in_another_process_continues_the_producers_trace(db: TestDb) {
    let outbox = outbox(&db, |_| {}).await;
    let recorder = Recorder::new();
    let subscriber = tracing_subscriber::registry().with(recorder.layer());
    // The producer: a request span, inside which the record is scheduled; and one record outside any.
    let (traced, producer) = async {
        let request = tracing::info_span!("place order");
        async {
            let scheduled = commit(&outbox, &db, vec![NewRecord::new("traced", "order.placed", "{}")]).await;
            let context = tracing::Span::current().context();
            let producer = context.span().span_context().clone();
            (scheduled[0], producer)
        }
        .instrument(request)
        .await
    }
    .with_subscriber(subscriber)
    .await;
    let untraced = commit(&outbox, &db, vec![NewRecord::new("untraced", "order.placed", "{}")]).await[0];

    // The worker, in a process of its own, delivers both and writes down its spans when it stops.
    let dir = tempfile::tempdir().unwrap();
    let span_log = dir.path().join("spans");
    let mut worker = Process(
        Command::new(env!("CARGO_BIN_EXE_outbox-test-worker"))
            .env("DATABASE_URL", db.url().await)
            .env("WORKER_NAME", "traced")
            .env("SPAN_LOG", &span_log)
            .env("RUST_LOG", "info,sqlx=warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    drained(&db, Duration::from_secs(30)).await;
    let status = Command::new("kill").args(["-TERM", &worker.0.id().to_string()]).status().unwrap();
    assert!(status.success());
    assert!(worker.0.wait().unwrap().success(), "the worker stops gracefully");

    let ended = spans::read(&span_log).unwrap();
    let delivery = |id: uuid::Uuid| {
        let id = id.to_string();
        ended
            .iter()
            .find(|s| s.message_id.as_deref() == Some(&id))
            .unwrap_or_else(|| panic!("no span for {id}: {ended:?}"))
    };
    let traced = delivery(traced.id);
    assert_eq!(traced.trace_id, producer.trace_id().to_string(), "the delivery continues the producer's trace");
    // Its parent is the span `schedule` ran in, inside the request's span, both ended in this process.
    let produced = recorder.ended();
    let parent = produced.iter().find(|s| s.span_id == traced.parent_span_id).expect("the parent is the producer's");
    assert_eq!(parent.parent_span_id, producer.span_id().to_string(), "{parent:?} is inside the request span");
    assert_eq!((traced.name.as_str(), traced.kind.as_str()), ("order.placed process", "Consumer"));
    let untraced = delivery(untraced.id);
    assert_ne!(untraced.trace_id, producer.trace_id().to_string());
    assert_eq!(untraced.parent_span_id, "0000000000000000", "a record scheduled outside a trace starts one");
}
