//! outbox demo: an order service whose events flow through the outbox.
//!
//! Places orders (order row + `created` event in one transaction, then `paid` and `shipped` for the same
//! order key in later transactions; a few transactions are rolled back on purpose), runs an outbox node
//! whose handler logs each event, and verifies at the end that every committed event arrived exactly in
//! per-order sequence and that no rolled-back event did.

use std::collections::{BTreeMap, BTreeSet};
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use outbox_cluster::{ClusterConfig, Node};
use outbox_core::{Config, HandlerError, Handlers, NewRecord, Outbox, Route, handler_fn};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use tracing::info;

const ORDERS: usize = 200;
const STEPS: [&str; 3] = ["order.created", "order.paid", "order.shipped"];

#[derive(Debug, Serialize, Deserialize)]
struct OrderEvent {
    key: String,
    seq: usize,
    step: String,
}

type Seen = Arc<Mutex<BTreeMap<String, Vec<usize>>>>;

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info,sqlx=warn".into()),
        )
        .init();
    match run().await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run() -> Result<bool, Box<dyn std::error::Error>> {
    let url =
        std::env::var("DATABASE_URL").unwrap_or_else(|_| "postgres://root:outbox@127.0.0.1:5432/outbox_demo".into());
    let pool = PgPoolOptions::new().max_connections(8).connect(&url).await.map_err(|e| {
        format!("cannot connect to PostgreSQL ({e}); start it, or run ./scripts/demo.sh which starts it for you")
    })?;
    let outbox = Outbox::new(Config { poll_interval: Duration::from_millis(50), ..Config::default() })?;
    outbox.migrate(&pool).await?;
    sqlx::query("DROP TABLE IF EXISTS demo_orders").execute(&pool).await?;
    sqlx::query("CREATE TABLE demo_orders (id text PRIMARY KEY, status text NOT NULL)").execute(&pool).await?;
    sqlx::query("TRUNCATE outbox.records, outbox.completed, outbox.keys").execute(&pool).await?;

    let seen: Seen = Arc::default();
    let s = seen.clone();
    let handler = handler_fn(move |record| {
        let s = s.clone();
        async move {
            let event: OrderEvent = serde_json::from_slice(&record.payload)
                .map_err(|e| HandlerError::permanent(format!("undecodable payload: {e}")))?;
            info!(key = %record.key, seq = record.seq, event = %record.event_type, partition = record.partition, "delivered");
            if let Ok(mut seen) = s.lock() {
                seen.entry(event.key).or_default().push(event.seq);
            }
            Ok(())
        }
    });
    let node = Node::start(
        outbox.clone(),
        pool.clone(),
        Handlers::new().default_route(Route::new(handler)),
        ClusterConfig { name: "demo-worker".into(), ..ClusterConfig::default() },
    )
    .await?;

    let started = Instant::now();
    let rolled_back = place_orders(&outbox, &pool).await?;
    let committed = ORDERS * STEPS.len();
    info!(orders = ORDERS, committed, rolled_back = rolled_back.len(), "orders placed; waiting for delivery");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let pending: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox.records").fetch_one(&pool).await?;
        if pending == 0 || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let elapsed = started.elapsed();
    node.shutdown().await?;
    Ok(verify(&seen, &rolled_back, committed, elapsed))
}

/// Places the orders; returns the keys whose extra transaction was rolled back on purpose.
async fn place_orders(outbox: &Outbox, pool: &PgPool) -> Result<BTreeSet<String>, Box<dyn std::error::Error>> {
    let mut rolled_back = BTreeSet::new();
    for (seq, step) in STEPS.iter().enumerate() {
        for order in 0..ORDERS {
            let key = format!("order-{order}");
            let event = OrderEvent { key: key.clone(), seq: seq + 1, step: step.to_string() };
            let mut tx = pool.begin().await?;
            sqlx::query(
                "INSERT INTO demo_orders (id, status) VALUES ($1, $2) ON CONFLICT (id) DO UPDATE SET status = $2",
            )
            .bind(&key)
            .bind(step)
            .execute(&mut *tx)
            .await?;
            outbox.schedule(&mut tx, NewRecord::json(&key, *step, &event)?).await?;
            tx.commit().await?;
            if order % 10 == 0 && seq == 1 {
                // A payment that fails after the event was written: the whole transaction rolls back,
                // so this event must never be delivered.
                let mut tx = pool.begin().await?;
                let ghost = OrderEvent { key: key.clone(), seq: 999, step: "order.refunded".into() };
                outbox.schedule(&mut tx, NewRecord::json(&key, "order.refunded", &ghost)?).await?;
                tx.rollback().await?;
                rolled_back.insert(key);
            }
        }
    }
    Ok(rolled_back)
}

fn verify(seen: &Seen, rolled_back: &BTreeSet<String>, committed: usize, elapsed: Duration) -> bool {
    let Ok(seen) = seen.lock() else { return false };
    let delivered: usize = seen.values().map(Vec::len).sum();
    let expected: Vec<usize> = (1..=STEPS.len()).collect();
    let out_of_order = seen.values().filter(|seqs| **seqs != expected).count();
    let ghosts = seen.iter().filter(|(k, seqs)| rolled_back.contains(*k) && seqs.contains(&999)).count();
    let missing = ORDERS - seen.values().filter(|seqs| seqs.len() >= STEPS.len()).count();
    println!();
    println!("== verification ==");
    println!("committed events      {committed}");
    println!("delivered events      {delivered} in {elapsed:.2?}");
    println!("orders missing events {missing}");
    println!("orders out of order   {out_of_order}");
    println!("rolled-back delivered {ghosts} (of {} rolled-back transactions)", rolled_back.len());
    let ok = delivered == committed && out_of_order == 0 && ghosts == 0 && missing == 0;
    println!("{}", if ok { "OK: nothing lost, duplicated or reordered" } else { "FAILED" });
    ok
}
