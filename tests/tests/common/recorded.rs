//! What the library's metrics recorded, read through `metrics_util`'s debugging recorder, or kept as
//! they stand ([`Kept`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, SharedString, Unit};
use metrics_util::debugging::{DebugValue, Snapshotter};
use metrics_util::registry::{AtomicStorage, Registry};

/// What was recorded since the last snapshot (taking one sets counters back to 0 and clears
/// histograms).
pub struct Recorded(Vec<(metrics::Key, DebugValue)>);

impl Recorded {
    pub fn take(snapshotter: &Snapshotter) -> Self {
        Self(snapshotter.snapshot().into_vec().into_iter().map(|(key, .., value)| (key.key().clone(), value)).collect())
    }

    /// The values of the metrics named `name` with every label of `labels`.
    fn of<'a>(&'a self, name: &'a str, labels: &'a [(&str, &str)]) -> impl Iterator<Item = &'a DebugValue> {
        self.0.iter().filter(move |(key, _)| named(key, name, labels)).map(|(_, value)| value)
    }

    /// A counter's value (0 if never incremented).
    pub fn counter(&self, name: &str, labels: &[(&str, &str)]) -> u64 {
        self.of(name, labels)
            .map(|value| match value {
                DebugValue::Counter(n) => *n,
                other => panic!("{name} is not a counter: {other:?}"),
            })
            .sum()
    }

    /// A histogram's values, sorted.
    pub fn histogram(&self, name: &str, labels: &[(&str, &str)]) -> Vec<f64> {
        let mut values: Vec<f64> = self
            .of(name, labels)
            .flat_map(|value| match value {
                DebugValue::Histogram(values) => values.iter().map(|x| x.into_inner()).collect::<Vec<_>>(),
                other => panic!("{name} is not a histogram: {other:?}"),
            })
            .collect();
        values.sort_by(f64::total_cmp);
        values
    }
}

/// A recorder that keeps each counter's total and each gauge's last value, read without resetting them
/// (the debugging recorder's snapshot sets a gauge back to 0, so a gauge read twice could not be told
/// from one set to 0), and how often a gauge was set (each `gauge!` registers it): a loop that sets
/// one on every pass shows how fast it turns.
pub struct Kept(Registry<Key, AtomicStorage>, AtomicU64);

impl Kept {
    pub fn new() -> Self {
        Self(Registry::atomic(), AtomicU64::new(0))
    }

    /// How many times any gauge was set.
    pub fn gauge_settings(&self) -> u64 {
        self.1.load(Ordering::SeqCst)
    }

    /// A gauge's value (`None` if never set).
    pub fn gauge(&self, name: &str) -> Option<f64> {
        let gauges = self.0.get_gauge_handles();
        gauges.iter().find(|(key, _)| key.name() == name).map(|(_, g)| f64::from_bits(g.load(Ordering::SeqCst)))
    }

    /// The value of the gauge `name` with every label of `labels` (`None` if never set).
    pub fn gauge_of(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let gauges = self.0.get_gauge_handles();
        gauges.iter().find(|(key, _)| named(key, name, labels)).map(|(_, g)| f64::from_bits(g.load(Ordering::SeqCst)))
    }

    /// A counter's total over all its labels (0 if never incremented).
    pub fn counter(&self, name: &str) -> u64 {
        self.counter_of(name, &[])
    }

    /// The total of the counters named `name` with every label of `labels` (0 if never incremented).
    pub fn counter_of(&self, name: &str, labels: &[(&str, &str)]) -> u64 {
        let counters = self.0.get_counter_handles();
        counters.iter().filter(|(key, _)| named(key, name, labels)).map(|(_, c)| c.load(Ordering::SeqCst)).sum()
    }
}

/// Whether `key` is named `name` and carries every label of `labels`.
fn named(key: &Key, name: &str, labels: &[(&str, &str)]) -> bool {
    key.name() == name && labels.iter().all(|(k, v)| key.labels().any(|l| l.key() == *k && l.value() == *v))
}

impl metrics::Recorder for Kept {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}

    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        self.0.get_or_create_counter(key, |c| Counter::from_arc(Arc::clone(c)))
    }

    fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
        self.1.fetch_add(1, Ordering::SeqCst);
        self.0.get_or_create_gauge(key, |g| Gauge::from_arc(Arc::clone(g)))
    }

    fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
        self.0.get_or_create_histogram(key, |h| Histogram::from_arc(Arc::clone(h)))
    }
}
