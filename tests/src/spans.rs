//! Spans as OpenTelemetry exports them, kept in memory (the SDK's in-memory exporter) and written to a
//! file one per line, so a test can read what a worker process traced.

use std::io::Write;
use std::path::Path;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider};
use tracing_subscriber::Layer;
use tracing_subscriber::registry::LookupSpan;

/// One ended span.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ended {
    /// Its name.
    pub name: String,
    /// Its trace, in hex.
    pub trace_id: String,
    /// Its own id, in hex.
    pub span_id: String,
    /// Its parent's id, in hex: zeros for a root.
    pub parent_span_id: String,
    /// Its kind (`Consumer`, `Internal`, …).
    pub kind: String,
    /// Its `messaging.message.id` attribute (the record id of a delivery), if any.
    pub message_id: Option<String>,
}

/// Traces into memory.
pub struct Recorder {
    provider: SdkTracerProvider,
    exporter: InMemorySpanExporter,
}

impl Default for Recorder {
    fn default() -> Self {
        Self::new()
    }
}

impl Recorder {
    /// A recorder with nothing recorded yet.
    pub fn new() -> Self {
        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder().with_simple_exporter(exporter.clone()).build();
        Self { provider, exporter }
    }

    /// The `tracing` layer that turns spans into OpenTelemetry spans recorded here.
    pub fn layer<S>(&self) -> impl Layer<S> + use<S>
    where
        S: tracing::Subscriber + for<'a> LookupSpan<'a>,
    {
        tracing_opentelemetry::layer().with_tracer(self.provider.tracer("outbox-tests"))
    }

    /// Every span ended so far.
    pub fn ended(&self) -> Vec<Ended> {
        let _ = self.provider.force_flush();
        let spans = self.exporter.get_finished_spans().unwrap_or_default();
        spans
            .into_iter()
            .map(|span| Ended {
                name: span.name.to_string(),
                trace_id: span.span_context.trace_id().to_string(),
                span_id: span.span_context.span_id().to_string(),
                parent_span_id: span.parent_span_id.to_string(),
                kind: format!("{:?}", span.span_kind),
                message_id: span
                    .attributes
                    .iter()
                    .find(|kv| kv.key.as_str() == "messaging.message.id")
                    .map(|kv| kv.value.to_string()),
            })
            .collect()
    }

    /// Writes every span ended so far to `path`, one per line.
    pub fn write(&self, path: &Path) -> std::io::Result<()> {
        let mut file = std::fs::File::create(path)?;
        for s in self.ended() {
            let id = s.message_id.as_deref().unwrap_or("-");
            writeln!(file, "{}\t{}\t{}\t{}\t{}\t{id}", s.name, s.trace_id, s.span_id, s.parent_span_id, s.kind)?;
        }
        file.sync_all()
    }
}

/// The spans [`Recorder::write`] wrote to `path`.
pub fn read(path: &Path) -> std::io::Result<Vec<Ended>> {
    let text = std::fs::read_to_string(path)?;
    Ok(text
        .lines()
        .filter_map(|line| {
            let f: Vec<&str> = line.split('\t').collect();
            let [name, trace_id, span_id, parent_span_id, kind, id] = f[..] else { return None };
            Some(Ended {
                name: name.into(),
                trace_id: trace_id.into(),
                span_id: span_id.into(),
                parent_span_id: parent_span_id.into(),
                kind: kind.into(),
                message_id: (id != "-").then(|| id.into()),
            })
        })
        .collect())
}
