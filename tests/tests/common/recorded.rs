//! What the library's metrics recorded, read through `metrics_util`'s debugging recorder.

use metrics_util::debugging::{DebugValue, Snapshotter};

/// What was recorded since the last snapshot (taking one sets counters back to 0 and clears
/// histograms).
pub struct Recorded(Vec<(metrics::Key, DebugValue)>);

impl Recorded {
    pub fn take(snapshotter: &Snapshotter) -> Self {
        Self(snapshotter.snapshot().into_vec().into_iter().map(|(key, .., value)| (key.key().clone(), value)).collect())
    }

    /// The values of the metrics named `name` with every label of `labels`.
    fn of<'a>(&'a self, name: &'a str, labels: &'a [(&str, &str)]) -> impl Iterator<Item = &'a DebugValue> {
        let matches = move |key: &metrics::Key| {
            key.name() == name && labels.iter().all(|(k, v)| key.labels().any(|l| l.key() == *k && l.value() == *v))
        };
        self.0.iter().filter(move |(key, _)| matches(key)).map(|(_, value)| value)
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
