//! The shape of a service that uses the outbox: an HTTP endpoint writes an order and the event that
//! describes it in one transaction, every instance embeds a clustered node that delivers the events,
//! `/metrics` serves Prometheus text, and SIGTERM (or Ctrl-C) stops taking requests, lets in-flight
//! deliveries finish and hands the node's partitions over.
//!
//! ```sh
//! DATABASE_URL=postgres://root:outbox@127.0.0.1/outbox_demo cargo run -p outbox-demo --example order_service
//! curl -s -XPOST localhost:3000/orders -d '{"id": "o-1", "amount": 42}' -H 'content-type: application/json'
//! curl -s localhost:3000/metrics | grep outbox_records_completed_total
//! ```
//!
//! Any backend works (`postgres://`, `mysql://`, `sqlite://orders.db`, the default). `LISTEN_ADDR`
//! (default `127.0.0.1:3000`) and `INSTANCE_NAME` name this instance; start several on other ports to see
//! them share the partitions. The handler here logs each event; put a publisher there (the
//! `outbox-nats` JetStream handler, say) in a real service.

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Json, Router};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use outbox_cluster::{ClusterConfig, Node};
use outbox_core::{Config, Db, HandlerError, Handlers, NewRecord, Outbox, Record, handler_fn};
use serde::{Deserialize, Serialize};
use tokio::signal::unix::{SignalKind, signal};

#[derive(Clone)]
struct App {
    db: Db,
    outbox: Outbox,
    metrics: PrometheusHandle,
}

#[derive(Deserialize)]
struct PlaceOrder {
    id: String,
    amount: i64,
}

#[derive(Serialize)]
struct Placed {
    order: String,
    event: uuid::Uuid,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::from_default_env()).init();
    let metrics = PrometheusBuilder::new().install_recorder()?;
    let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| "sqlite://orders.db".into());
    let addr = std::env::var("LISTEN_ADDR").unwrap_or_else(|_| "127.0.0.1:3000".into());
    let db = Db::connect(&url).await?;
    let outbox = Outbox::new(Config::default())?;
    outbox.migrate(&db).await?;
    // The service's own table, in SQL every backend accepts.
    db.execute("CREATE TABLE IF NOT EXISTS example_orders (id VARCHAR(64) PRIMARY KEY, amount BIGINT NOT NULL)", &[])
        .await?;

    let handlers = Handlers::new().on(
        "order.placed",
        handler_fn(|record: Record| async move {
            // Deliveries are at least once: a consumer deduplicates by `record.id` (or key and seq).
            tracing::info!(order = %record.key, event = %record.id, seq = record.seq, "order.placed delivered");
            Ok::<(), HandlerError>(())
        }),
    );
    let name = std::env::var("INSTANCE_NAME").unwrap_or_else(|_| format!("orders@{addr}"));
    let cluster = ClusterConfig { name, ..ClusterConfig::default() };
    let node = Node::start(outbox.clone(), &db, handlers, cluster).await?;

    let app = Router::new()
        .route("/orders", post(place_order))
        .route("/metrics", get(|State(app): State<App>| async move { app.metrics.render() }))
        .with_state(App { db, outbox, metrics });
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    tracing::info!(%addr, instance = %node.id(), "order service listening");
    axum::serve(listener, app).with_graceful_shutdown(stopped()).await?;
    // Requests are done; let the node finish its deliveries and hand its partitions over.
    node.shutdown().await?;
    Ok(())
}

/// Writes the order and its event in one transaction, then wakes the event's owner.
async fn place_order(
    State(app): State<App>,
    Json(order): Json<PlaceOrder>,
) -> Result<Json<Placed>, (StatusCode, String)> {
    use outbox_core::Error;
    let failed = |e: Error| match e {
        // Bad input (an empty or oversized key, say) is the caller's; anything else is ours.
        Error::EmptyKey | Error::KeyTooLong { .. } | Error::BadKey { .. } | Error::PayloadTooLarge { .. } => {
            (StatusCode::BAD_REQUEST, e.to_string())
        }
        e if e.is_transient() => (StatusCode::SERVICE_UNAVAILABLE, "try again".to_string()),
        e => {
            tracing::error!(error = %e, order = %order.id, "placing an order failed");
            (StatusCode::INTERNAL_SERVER_ERROR, "the order was not placed".to_string())
        }
    };
    let event =
        NewRecord::json(&order.id, "order.placed", &serde_json::json!({"id": order.id, "amount": order.amount}))
            .map_err(failed)?;
    let mut tx = app.db.begin().await.map_err(failed)?;
    tx.execute("INSERT INTO example_orders (id, amount) VALUES ($1, $2)", &[(&order.id).into(), order.amount.into()])
        .await
        .map_err(failed)?;
    let scheduled = app.outbox.schedule(&mut tx, event).await.map_err(failed)?;
    tx.commit().await.map_err(failed)?;
    // After the commit: a lost wake-up costs latency only, so its error is not the caller's.
    if let Err(e) = app.outbox.wake(&app.db, &[scheduled]).await {
        tracing::warn!(error = %e, order = %order.id, "wake-up not sent; the owner's poll finds the event");
    }
    Ok(Json(Placed { order: order.id, event: scheduled.id }))
}

/// Resolves on SIGTERM or Ctrl-C.
async fn stopped() {
    let mut term = match signal(SignalKind::terminate()) {
        Ok(term) => term,
        Err(e) => {
            tracing::error!(error = %e, "cannot listen for SIGTERM; Ctrl-C still stops the service");
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    tracing::info!("stopping: no new requests; in-flight deliveries finish, then partitions are handed over");
}
