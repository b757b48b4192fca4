//! The bench's figures: one row per scenario and round, reported as the median round, as a table and
//! one JSON line per scenario.

use serde_json::json;

/// One scenario's result in one round.
pub struct Row {
    pub scenario: &'static str,
    pub value: f64,
    pub unit: &'static str,
    pub extra: serde_json::Value,
}

/// Prints, per scenario, the round with the median value (its extra figures too) and the median of
/// its ratios to the relay of the same round; then one JSON line per scenario, for comparing runs.
/// `by_scenario[i]` holds scenario i's row from every round.
pub fn print(by_scenario: &[Vec<Row>], relays: &[f64], quick: bool) {
    let rounds = relays.len();
    println!("{:<36} {:>14} {:<16} {:>10}   ({rounds} rounds: medians)", "scenario", "value", "unit", "vs relay");
    let mut lines = Vec::new();
    for list in by_scenario {
        let values: Vec<f64> = list.iter().map(|row| row.value).collect();
        let ratio = median(values.iter().zip(relays).map(|(value, relay)| value / relay).collect());
        let middle = median(values.clone());
        let Some(row) = list.iter().find(|row| row.value.total_cmp(&middle).is_eq()) else { continue };
        let shown = if row.unit == "records/s" { format!("{ratio:.2}x") } else { "-".into() };
        println!("{:<36} {:>14.1} {:<16} {:>10}", row.scenario, row.value, row.unit, shown);
        let mut line =
            json!({"scenario": row.scenario, "value": row.value, "unit": row.unit, "quick": quick, "rounds": values});
        if row.unit == "records/s" {
            line["relay_ratio"] = json!(ratio);
        }
        if let (Some(line), Some(extra)) = (line.as_object_mut(), row.extra.as_object()) {
            line.extend(extra.clone());
        }
        lines.push(line);
    }
    for line in lines {
        println!("{line}");
    }
}

/// The middle value (the upper middle one of an even count).
pub fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(f64::NAN)
}

/// The `p` quantile of sorted `values` (0 when empty).
pub fn percentile(values: &[f64], p: f64) -> f64 {
    values.get(((values.len() as f64 * p) as usize).min(values.len().saturating_sub(1))).copied().unwrap_or(0.0)
}

/// Peak resident set (VmHWM) of a process, from /proc.
pub fn peak_rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}
