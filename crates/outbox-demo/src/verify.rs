//! The verifier: reads the stream and the database back, and reports per order what is missing,
//! duplicated, out of order, or should never have been published (an event of a rolled-back
//! transaction). Exits non-zero when anything is wrong.

use std::collections::{BTreeMap, BTreeSet};
use std::process::ExitCode;

use uuid::Uuid;

use crate::orders::OrderEvent;
use crate::sink::Sink;
use crate::{Context, Failure};

/// What the verifier found.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Report {
    /// Events committed in the database.
    pub committed: usize,
    /// Messages read from the stream.
    pub messages: usize,
    /// Committed events missing from the stream, per order.
    pub missing: BTreeMap<String, Vec<u32>>,
    /// Events present more than once, per order.
    pub duplicated: BTreeMap<String, Vec<u32>>,
    /// Orders whose events first appear out of sequence, with that order.
    pub out_of_order: BTreeMap<String, Vec<u32>>,
    /// Events in the stream that no committed transaction wrote (rolled back), per order.
    pub ghosts: BTreeMap<String, Vec<u32>>,
    /// Orders whose status in the read model differs from the orders table, with the two statuses;
    /// `None` if no read model was kept (`consume` never ran).
    pub read_model: Option<Vec<(String, String, Option<String>)>>,
}

impl Report {
    /// Whether nothing is wrong.
    pub fn ok(&self) -> bool {
        self.missing.is_empty()
            && self.duplicated.is_empty()
            && self.out_of_order.is_empty()
            && self.ghosts.is_empty()
            && self.read_model.as_ref().is_none_or(Vec::is_empty)
    }

    /// Prints the summary and the first problems.
    pub fn print(&self) {
        println!("committed events   {}", self.committed);
        println!("stream messages    {}", self.messages);
        for (label, problems) in [
            ("missing", &self.missing),
            ("duplicated", &self.duplicated),
            ("out of order", &self.out_of_order),
            ("rolled back but published", &self.ghosts),
        ] {
            let events: usize = problems.values().map(Vec::len).sum();
            println!("{label:<26} {events} events in {} orders", problems.len());
            for (order, seqs) in problems.iter().take(5) {
                println!("    {order}: seq {seqs:?}");
            }
        }
        match &self.read_model {
            None => println!("read model                 not kept (run `consume`)"),
            Some(differ) => {
                println!("read model                 {} orders differ", differ.len());
                for (order, status, kept) in differ.iter().take(5) {
                    println!(
                        "    {order}: {status} in the orders table, {} in the read model",
                        kept.as_deref().unwrap_or("none")
                    );
                }
            }
        }
        println!("{}", if self.ok() { "OK: nothing lost, duplicated, reordered or leaked" } else { "FAILED" });
    }
}

pub async fn command(ctx: &Context) -> Result<ExitCode, Failure> {
    let report = verify(ctx).await?;
    report.print();
    Ok(if report.ok() { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

/// Compares the stream (or the local sink) with `demo_order_events`.
pub async fn verify(ctx: &Context) -> Result<Report, Failure> {
    const COMMITTED: &str = "SELECT event_id, order_id, seq FROM demo_order_events";
    let rows: Vec<(Uuid, String, i32)> = ctx.db.fetch_all(COMMITTED, &[]).await?;
    let committed: BTreeMap<Uuid, (String, u32)> =
        rows.into_iter().map(|(id, order, seq)| (id, (order, seq as u32))).collect();
    let events = Sink::open(ctx, false).await?.read_all().await?;
    let read_model = crate::consume::mismatches(&ctx.db).await?;
    Ok(Report { read_model, ..compare(&committed, &events) })
}

/// The pure comparison, so it can be tested without servers.
pub fn compare(committed: &BTreeMap<Uuid, (String, u32)>, stream: &[OrderEvent]) -> Report {
    let mut report = Report { committed: committed.len(), messages: stream.len(), ..Report::default() };
    let mut seen: BTreeSet<Uuid> = BTreeSet::new();
    let mut firsts: BTreeMap<&str, Vec<u32>> = BTreeMap::new();
    for event in stream {
        if !committed.contains_key(&event.event_id) {
            report.ghosts.entry(event.key.clone()).or_default().push(event.seq);
        } else if !seen.insert(event.event_id) {
            report.duplicated.entry(event.key.clone()).or_default().push(event.seq);
        } else {
            firsts.entry(&event.key).or_default().push(event.seq);
        }
    }
    for (id, (order, seq)) in committed {
        if !seen.contains(id) {
            report.missing.entry(order.clone()).or_default().push(*seq);
        }
    }
    for (order, seqs) in firsts {
        if seqs.windows(2).any(|w| w[0] >= w[1]) {
            report.out_of_order.insert(order.to_string(), seqs);
        }
    }
    report
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(id: Uuid, key: &str, seq: u32) -> OrderEvent {
        OrderEvent { event_id: id, key: key.into(), seq, step: "s".into() }
    }

    #[test]
    fn finds_every_kind_of_problem() {
        let ids: Vec<Uuid> = (0..5).map(|_| Uuid::now_v7()).collect();
        let committed: BTreeMap<Uuid, (String, u32)> = [
            (ids[0], ("a".to_string(), 1)),
            (ids[1], ("a".to_string(), 2)),
            (ids[2], ("b".to_string(), 1)),
            (ids[3], ("b".to_string(), 2)),
        ]
        .into();
        let clean = [event(ids[0], "a", 1), event(ids[2], "b", 1), event(ids[1], "a", 2), event(ids[3], "b", 2)];
        assert!(compare(&committed, &clean).ok());
        let ghost = Uuid::now_v7();
        let messy = [
            event(ids[1], "a", 2),
            event(ids[0], "a", 1),
            event(ids[2], "b", 1),
            event(ids[2], "b", 1),
            event(ghost, "b", 2),
        ];
        let report = compare(&committed, &messy);
        assert_eq!(report.out_of_order["a"], [2, 1]);
        assert_eq!(report.duplicated["b"], [1]);
        assert_eq!(report.ghosts["b"], [2]);
        assert_eq!(report.missing["b"], [2]);
        assert!(!report.ok());
    }
}
