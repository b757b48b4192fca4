//! The order service: its tables, its event payload, and the load generator.
//!
//! Each event is written in the same transaction as the order's new status and a row in
//! `demo_order_events` (the business history that `verify` compares the stream with). A fraction of
//! transactions is rolled back on purpose after scheduling their event; the service then retries the
//! same step in a new transaction, so every order's committed events are seq 1, 2, 3, … and a
//! rolled-back event (its own `event_id`) must never reach the stream.

use std::time::Duration;

use clap::Args;
use outbox_core::{Db, NewRecord, Outbox};
use rand::RngExt;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::{Context, Failure};

/// The demo's business tables: one SQL text for every backend, with `{id}`, `{uuid}` and `{time}` for
/// the three column types whose names differ ([`column_types`]).
const TABLES: &str = "
CREATE TABLE IF NOT EXISTS demo_orders (
    id         {id}   PRIMARY KEY,
    status     {id}   NOT NULL,
    updated_at {time} NOT NULL DEFAULT CURRENT_TIMESTAMP
);
CREATE TABLE IF NOT EXISTS demo_order_events (
    event_id     {uuid} PRIMARY KEY,
    order_id     {id}   NOT NULL,
    seq          integer NOT NULL,
    step         {id}   NOT NULL,
    committed_at {time} NOT NULL DEFAULT CURRENT_TIMESTAMP,
    UNIQUE (order_id, seq)
)";

/// The names of a short text key, a UUID and a point in time on `db`'s backend (MySQL indexes no
/// unbounded text and has no UUID or zoned time type).
fn column_types(db: &Db) -> [(&'static str, &'static str); 3] {
    match db.backend() {
        "mysql" => [("{id}", "VARCHAR(64)"), ("{uuid}", "BINARY(16)"), ("{time}", "TIMESTAMP(6)")],
        _ => [("{id}", "text"), ("{uuid}", "uuid"), ("{time}", "timestamptz")],
    }
}

/// Databases from the first demo version (PostgreSQL only) lack this column.
const HAS_UPDATED_AT: &str = "SELECT updated_at FROM demo_orders LIMIT 0";
const ADD_UPDATED_AT: &str =
    "ALTER TABLE demo_orders ADD COLUMN updated_at timestamptz NOT NULL DEFAULT CURRENT_TIMESTAMP";

/// Creates the demo's tables if they do not exist.
pub async fn create_tables(db: &Db) -> Result<(), Failure> {
    let tables = column_types(db).iter().fold(TABLES.to_string(), |sql, (name, ty)| sql.replace(name, ty));
    db.execute_script(sqlx::AssertSqlSafe(tables)).await?;
    if db.execute(HAS_UPDATED_AT, &[]).await.is_err() {
        db.execute(ADD_UPDATED_AT, &[]).await?;
    }
    Ok(())
}

/// An order's status: updated, or inserted when the update found no row (no upsert syntax is common
/// to the three backends; an order has one producer, so the two cannot race).
const UPDATE_ORDER: &str = "UPDATE demo_orders SET status = $2, updated_at = CURRENT_TIMESTAMP WHERE id = $1";
const INSERT_ORDER: &str = "INSERT INTO demo_orders (id, status) VALUES ($1, $2)";

const INSERT_EVENT: &str = "INSERT INTO demo_order_events (event_id, order_id, seq, step) VALUES ($1, $2, $3, $4)";

const STEPS: [&str; 5] = ["created", "paid", "shipped", "delivered", "closed"];

/// An event's JSON payload: enough to check order from the stream alone.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OrderEvent {
    /// Unique per attempt (a rolled-back attempt's id never appears in the database).
    pub event_id: Uuid,
    /// The order id, also the outbox key.
    pub key: String,
    /// Per-order sequence, 1, 2, 3, …
    pub seq: u32,
    /// What happened.
    pub step: String,
}

fn step(seq: u32) -> String {
    STEPS.get(seq as usize - 1).map_or_else(|| format!("note-{seq}"), |s| s.to_string())
}

/// `produce` options.
#[derive(Args, Debug, Clone)]
pub struct ProduceArgs {
    /// Orders to place.
    #[arg(long, default_value_t = 100)]
    pub orders: u32,
    /// Events per order (created, paid, shipped, …), each in its own transaction.
    #[arg(long, default_value_t = 3)]
    pub events_per_order: u32,
    /// Transactions per second in total (0: as fast as possible).
    #[arg(long, default_value_t = 0.0)]
    pub rate: f64,
    /// Fraction of transactions rolled back on purpose (then retried).
    #[arg(long, default_value_t = 0.1)]
    pub rollback_fraction: f64,
    /// Concurrent producer connections.
    #[arg(long, default_value_t = 4)]
    pub concurrency: u32,
}

/// What a produce run did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Produced {
    /// Events committed.
    pub committed: u64,
    /// Transactions rolled back on purpose.
    pub rolled_back: u64,
}

pub async fn produce_command(ctx: &Context, args: ProduceArgs) -> Result<(), Failure> {
    let started = std::time::Instant::now();
    let produced = produce(&ctx.outbox, &ctx.db, &args).await?;
    println!(
        "produced {} events for {} orders ({} transactions rolled back on purpose) in {:.1?}",
        produced.committed,
        args.orders,
        produced.rolled_back,
        started.elapsed()
    );
    Ok(())
}

/// Places `args.orders` orders with `args.events_per_order` events each.
pub async fn produce(outbox: &Outbox, db: &Db, args: &ProduceArgs) -> Result<Produced, Failure> {
    if !(0.0..1.0).contains(&args.rollback_fraction) {
        return Err(Failure(format!("--rollback-fraction must be within [0, 1), got {}", args.rollback_fraction)));
    }
    // NaN fails both comparisons; below a hundredth the pause between transactions outlasts any run,
    // above a million it rounds to nothing, which tokio's interval refuses.
    if !(args.rate == 0.0 || (0.01..=1_000_000.0).contains(&args.rate)) {
        return Err(Failure(format!(
            "--rate must be 0 (as fast as possible) or within 0.01..=1000000, got {}",
            args.rate
        )));
    }
    let run = format!("{:04x}", rand::rng().random::<u16>());
    let workers = args.concurrency.max(1);
    let pause = (args.rate > 0.0).then(|| Duration::from_secs_f64(f64::from(workers) / args.rate));
    let tasks = (0..workers).map(|w| {
        let (outbox, db, args, run) = (outbox.clone(), db.clone(), args.clone(), run.clone());
        tokio::spawn(async move {
            let mut produced = Produced::default();
            let orders: Vec<String> =
                (0..args.orders).filter(|o| o % workers == w).map(|o| format!("o{run}-{o}")).collect();
            let mut ticker = pause.map(tokio::time::interval);
            for seq in 1..=args.events_per_order {
                for order in &orders {
                    loop {
                        if let Some(ticker) = ticker.as_mut() {
                            ticker.tick().await;
                        }
                        let rollback = rand::rng().random::<f64>() < args.rollback_fraction;
                        place(&outbox, &db, order, seq, rollback).await?;
                        if rollback {
                            produced.rolled_back += 1;
                        } else {
                            produced.committed += 1;
                            break;
                        }
                    }
                }
            }
            Ok::<Produced, Failure>(produced)
        })
    });
    let mut total = Produced::default();
    for task in futures::future::join_all(tasks).await {
        let produced = task.map_err(|e| Failure(format!("producer task failed: {e}")))??;
        total.committed += produced.committed;
        total.rolled_back += produced.rolled_back;
    }
    Ok(total)
}

/// One business transaction: the order's status, its history row and its event; rolled back on request.
/// A transaction that fails transiently (on MySQL, InnoDB may pick it as a deadlock victim) is run
/// again from the start, as any application must.
async fn place(outbox: &Outbox, db: &Db, order: &str, seq: u32, rollback: bool) -> Result<(), Failure> {
    let event = OrderEvent { event_id: Uuid::now_v7(), key: order.to_string(), seq, step: step(seq) };
    let mut attempt = 1;
    loop {
        match place_once(outbox, db, &event, rollback).await {
            Err(e) if e.is_transient() && attempt < 5 => {
                tracing::warn!(order, seq, attempt, error = %e, "order transaction failed; running it again");
                attempt += 1;
            }
            done => return Ok(done?),
        }
    }
}

async fn place_once(outbox: &Outbox, db: &Db, event: &OrderEvent, rollback: bool) -> outbox_core::Result<()> {
    let (order, seq) = (event.key.as_str(), event.seq);
    let record = NewRecord::json(order, format!("order.{}", event.step), event)?;
    let mut tx = db.begin().await?;
    let status = [order.into(), event.step.as_str().into()];
    // The first event creates the order; a later one updates it, or creates it if the first was rolled
    // back. (An update of a missing row takes a gap lock on MySQL, and two of those inserting into
    // the same gap deadlock, so it is not the first thing tried.)
    if seq == 1 || tx.execute(UPDATE_ORDER, &status).await? == 0 {
        tx.execute(INSERT_ORDER, &status).await?;
    }
    let step = event.step.as_str();
    tx.execute(INSERT_EVENT, &[event.event_id.into(), order.into(), i64::from(seq).into(), step.into()]).await?;
    let scheduled = outbox.schedule(&mut tx, record).await?;
    if rollback {
        return tx.rollback().await;
    }
    tx.commit().await?;
    // Committed: a wake-up that fails only leaves the event to the owner's next poll (and must not run
    // the transaction again).
    if let Err(e) = outbox.wake(db, &[scheduled]).await {
        tracing::warn!(order, seq, partition = scheduled.partition, error = %e, "wake-up not sent");
    }
    Ok(())
}
